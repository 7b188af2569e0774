"""The operator process: the controller, its API server and the kubernetes provider, for every TfsnJob.

There is one job state machine, the controller's. The operator process runs a `Controller` (and its
API server: agents in worker pods report to it exactly as to a local controller, so health is the
same detectors and policy on the same telemetry) with the kubernetes provider, and each TfsnJob is
one controller job. `Operator` only translates between the two:

- admit: validate the spec with `JobSpec` (a bad one gets a status condition, and no pods), make the
  job's token Secret and headless Service, bind its pods to the TfsnJob (owner, Secret, checkpoint
  volume), and add the controller job;
- sync (the timer): taint what a refused taint left (orchestrator.k8s.taints), have the writer check
  `.status` (orchestrator.k8s.status), keep the conditions;
- spec_changed: not applied to a job under way; a condition says so and how to apply it; a refused spec is
  checked again;
- release (delete): stop the job; the controller deletes the pods, owner references the Secret and Service.
Adoption of the jobs under way when an operator starts is orchestrator.k8s.adoption.

The API listens beyond loopback (pods reach it), so it serves TLS with the operator's CA (see
orchestrator.control.tls), which its pods pin. The CA is kept in a Secret of the operator's namespace, not
only in its home (an emptyDir): a successor serves with the same CA, and the running pods carry on.
"""
from __future__ import annotations

import datetime
import math
import os
import secrets
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrator.control import tls
from orchestrator.control.api import ApiServer
from orchestrator.control.controller import Controller
from orchestrator.control.store import Job, JobState, Store, StoreError
from orchestrator.home import tfsn_home
from orchestrator.k8s.adoption import Adoption, job_key, refused, token_secret
from orchestrator.k8s.crd import CA_SECRET, GROUP, KIND, VERSION, Condition, TfsnJobStatus
from orchestrator.k8s.status import StatusWriter, status_record
from orchestrator.k8s.taints import Taints
from orchestrator.spec import ENVS_ONLY, JobSpec, _dotted, _user_path, checkpoint_url_scheme
from providers.base import NotFoundError, ProviderError, import_sdk
from providers.kubernetes import EXTRA, TOKEN_KEY, KubernetesProvider, PodBinding
from providers.naming import dns_label

CHECKPOINT_MOUNT = "/tfsn/checkpoints"     # checkpoint.dir of a TfsnJob that names none
CLAIM_ANNOTATION = "tfsn.dev/checkpoint-claim"   # a TfsnJob's own PersistentVolumeClaim of checkpoints
AGENT_COMMAND = ("python3", "-m", "orchestrator.agent")
FINAL_WRITE_WAIT_S = 10.0       # the delete handler's last status write waits no longer for another one


@dataclass(frozen=True)
class OperatorSettings:
    """The operator process's knobs (TFSN_OPERATOR_*), read once at start."""

    home: Path                         # the controller's working store (a cache: .status is the store) and logs
    host: str = "0.0.0.0"              # where the API listens: worker pods must reach it
    port: int = 0                      # 0: any free port
    advertise: str = ""                # the host pods reach the API at (the operator's Service; default: pod IP)
    checkpoint_claim: str = ""         # default PVC of checkpoints, in each job's namespace; "": emptyDir
    pod_poll_s: float = 5.0            # how often the controller reads a pod's phase
    namespace: str = ""                # the namespace whose TfsnJobs are adopted at start (kopf's); "": all

    @classmethod
    def from_env(cls) -> OperatorSettings:
        env = os.environ
        return cls(home=tfsn_home(), host=env.get("TFSN_OPERATOR_HOST", "0.0.0.0"),
                   port=int(env.get("TFSN_OPERATOR_PORT", 0)),
                   advertise=env.get("TFSN_OPERATOR_ADVERTISE") or socket.gethostbyname(socket.gethostname()),
                   checkpoint_claim=env.get("TFSN_OPERATOR_CHECKPOINT_CLAIM", ""),
                   pod_poll_s=float(env.get("TFSN_OPERATOR_POD_POLL_S", 5)),
                   namespace=env.get("TFSN_OPERATOR_NAMESPACE", ""))


def tfsnjob_of(job: Job) -> tuple[str, str] | None:
    """(namespace, name) of the TfsnJob a controller job runs, from its `spec_path`."""
    url = urllib.parse.urlsplit(job.spec_path)
    if url.scheme != "tfsnjob":
        return None
    return url.netloc, url.path.lstrip("/")


def spec_error(err: ValidationError, data: dict[str, Any]) -> str:
    """One line naming every bad field of a TfsnJob's spec, as `tfsn launch` would."""
    parts = []
    for e in err.errors():
        path = _user_path(data, tuple(e["loc"]), missing=e["type"] == "missing")
        what = str(e.get("ctx", {}).get("error", e["msg"])) if e["type"] == "value_error" else e["msg"]
        if e["type"] == "extra_forbidden":
            what = "unknown field. To fix: remove it (the spec is train.yaml's schema)"
        parts.append(f"spec.{_dotted(path)}: {what}" if path else f"spec: {what}")
    return " ".join("; ".join(dict.fromkeys(parts)).split())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(previous: list[dict[str, Any]], type_: str, ok: bool, reason: str, message: str = "") -> Condition:
    """A condition whose transition time moves only when its status does."""
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == type_), {})
    when = old.get("lastTransitionTime") if old.get("status") == status and old.get("lastTransitionTime") else _now()
    return Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=when)


class Operator:
    """The controller, its API server and the kubernetes provider, for every TfsnJob the operator watches."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        settings.home.mkdir(parents=True, exist_ok=True)
        self.provider = KubernetesProvider()
        if tls.serves_tls(settings.host):
            self._keep_ca()
        self.store = Store(settings.home / "operator.db")
        self.provider.status_poll_s = settings.pod_poll_s
        self.controller = Controller(self.store, settings.home, {"kubernetes": self.provider})
        self.server = ApiServer(settings.port, self.store, self.controller.handlers, settings.host, settings.advertise,
                                settings.home)
        self.controller.listen(self.server)
        self.writer = StatusWriter(self._record_of, self.custom_objects)
        self.store.on_change = self.writer.changed
        self.taints = Taints(self.store, self.provider, self.writer.changed)
        self.provider.on_deleted = self.taints.pod_deleted
        self.adoption = Adoption(self)
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._serving = False
        self._custom_api: Any = None
        self._job_ids: dict[str, int] = {}   # job_key -> controller job id

    def _keep_ca(self) -> None:
        """Put the CA kept in the operator's Secret in its home; on the first start, keep the home's there."""
        namespace, home = self.provider.namespace, self.settings.home
        try:
            kept = self._kept_ca(namespace)
        except NotFoundError:   # ours is kept, or the one another operator kept meanwhile is taken
            self.provider.apply("Secret", namespace, {
                "apiVersion": "v1", "kind": "Secret", "type": "Opaque", "stringData": tls.ca_files(home),
                "metadata": {"name": CA_SECRET, "namespace": namespace,
                             "labels": {"app.kubernetes.io/managed-by": "tfsn"}}})
            kept = self._kept_ca(namespace)
        tls.restore_ca(home, kept)

    def _kept_ca(self, namespace: str) -> dict[str, str]:
        kept = {name: self.provider.read_secret(namespace, CA_SECRET, name) or "" for name in (tls.CA_KEY, tls.CA_CERT)}
        if not all(kept.values()):
            raise ProviderError(f"Secret {CA_SECRET} in namespace {namespace} lacks {tls.CA_KEY} or {tls.CA_CERT}. "
                                f"To fix: kubectl delete secret {CA_SECRET} -n {namespace} (a new CA is made; the "
                                "pods running now then stop and their jobs restart from their checkpoints)",
                                provider="kubernetes")
        return kept

    def start(self, reconcile: bool = True) -> None:
        """Serve agents, write statuses and run the controller's loop in threads (kopf keeps the event loop);
        without `reconcile` the caller drives `controller.reconcile` itself (tests). Once only: a second call
        (kopf running a failed startup handler again) changes nothing."""
        if self._serving:
            return
        self.server.start()
        self._serving = True
        self.writer.start()
        if reconcile:
            self._loop = threading.Thread(target=self.controller.run_forever, args=(self._stop, math.inf),
                                          name="tfsn-controller", daemon=True)
            self._loop.start()

    def close(self) -> None:
        """Stop reconciling, write what is due, stop serving; the pods run on until the next operator adopts them."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.controller.wake.set()
        if self._loop is not None:
            self._loop.join(30)
        self.writer.stop()
        if self._serving:
            self.server.shutdown()      # waits for serve_forever to return: only once it ran
        self.server.server_close()
        self.store.on_change = None
        self.store.close()

    def custom_objects(self) -> Any:
        """CustomObjectsApi on the provider's client (same cluster, credentials, timeouts and retries)."""
        if self._custom_api is None:
            kubernetes = import_sdk("kubernetes", provider="kubernetes", extra=EXTRA)
            self._custom_api = kubernetes.client.CustomObjectsApi(self.provider.api_client())
        return self._custom_api

    # ---- create ---------------------------------------------------------------------------------
    def admit(self, body: dict[str, Any]) -> dict[str, Any]:
        """A new TfsnJob: its controller job (the writer puts it in `.status`), or, for a bad spec, a
        status that says what to fix. Returns the conditions (kopf writes them).

        Idempotent: kopf runs a create handler again when it could not record that it ran."""
        job = self.job_of(body)
        if job is None and (body.get("status") or {}).get("jobId") is not None:
            return self.adoption.adopt(body)   # admitted before this operator started: its pods may be running
        if job is None:
            spec, problem = self.checked_spec(body, dict(body.get("spec") or {}))
            if spec is None:
                return self.invalid(body, problem)
            job = self.create_job(body, spec)
        durable = self.prepare(body, job).checkpoint_claim is not None
        self.controller.wake.set()
        return {"conditions": [c.model_dump(by_alias=True) for c in (
            _condition([], "Valid", True, "SpecValid"),
            _condition([], "CheckpointsDurable", durable, "PersistentVolumeClaim" if durable else "EmptyDir",
                       "" if durable else "checkpoints are kept in each pod's emptyDir and lost with the pod. To "
                       f"fix: annotate the {KIND} with {CLAIM_ANNOTATION}: <a PersistentVolumeClaim>"))]}

    def checked_spec(self, body: dict[str, Any], data: dict[str, Any], written: bool = True
                     ) -> tuple[JobSpec | None, str]:
        """`data` as the spec of a job on this cluster, or None and one line saying what to fix. `written`: as the
        TfsnJob says it ($NAME in its paths filled from its envs), not as a job recorded it (filled already)."""
        data.setdefault("name", body["metadata"]["name"])
        try:
            spec = JobSpec.model_validate(data, context=ENVS_ONLY if written else None)
        except ValidationError as err:
            return None, spec_error(err, data)
        except Exception as err:    # a validator's bug: a condition, as `tfsn launch` says it, not kopf retrying forever
            return None, (f"spec: cannot validate the spec: {type(err).__name__}: {err}. To fix: report it as a tfsn "
                          "bug, with this spec")
        problem = _cluster_problem(spec)
        if problem:
            return None, problem
        spec.resources.infra = ["kubernetes"]
        spec.checkpoint.dir = spec.checkpoint.dir or CHECKPOINT_MOUNT
        return spec, ""

    def create_job(self, body: dict[str, Any], spec: JobSpec) -> Job:
        key = job_key(body["metadata"])
        job = self.store.create_job(spec.name, spec.model_dump(mode="json"), key, secrets.token_urlsafe(32))
        self._job_ids[key] = job.id
        return job

    def invalid(self, body: dict[str, Any], message: str) -> dict[str, Any]:
        previous = (body.get("status") or {}).get("conditions", [])
        return TfsnJobStatus(phase="Failed", message=message, conditions=[
            _condition(previous, "Valid", False, "InvalidSpec", message)]).model_dump(by_alias=True)

    def job_of(self, body: dict[str, Any]) -> Job | None:
        """The TfsnJob's controller job (looked up in the store once, then remembered)."""
        key = job_key(body["metadata"])
        if key not in self._job_ids:
            job = next((j for j in self.store.jobs() if j.spec_path == key), None)
            if job is None:
                return None
            self._job_ids[key] = job.id
        return self.store.job(self._job_ids[key])

    def remember_job(self, meta: dict[str, Any], job_id: int) -> None:
        self._job_ids[job_key(meta)] = job_id

    def prepare(self, body: dict[str, Any], job: Job) -> PodBinding:
        """The job's Secret and headless Service, and what its pods get (see PodBinding)."""
        meta = body["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": uid}
        owned = {"namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "tfsn"},
                 "ownerReferences": [{**owner, "controller": True, "blockOwnerDeletion": True}]}
        secret, service = token_secret(name), dns_label(f"{name}-workers")
        self.provider.apply("Secret", namespace, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                                  "metadata": {"name": secret, **owned},
                                                  "stringData": {TOKEN_KEY: job.token}})
        self.provider.replace_secret_data(namespace, secret, {TOKEN_KEY: job.token})  # a new job, a new token
        selector = {"tfsn.dev/owner-uid": uid}
        self.provider.apply("Service", namespace, {"apiVersion": "v1", "kind": "Service", "metadata": {
            "name": service, **owned}, "spec": {"clusterIP": "None", "selector": selector,
                                                 "publishNotReadyAddresses": True,
                                                 "ports": [{"name": "rendezvous", "port": 29500}]}})
        spec = JobSpec.model_validate(job.spec)
        claim = (meta.get("annotations") or {}).get(CLAIM_ANNOTATION) or self.settings.checkpoint_claim or None
        binding = self.provider.bindings[str(job.id)] = PodBinding(
            namespace=namespace, owner=owner, token_secret=secret, service=service,
            checkpoint_path=_mount_path(spec.checkpoint.dir), checkpoint_claim=claim,
            checkpoint_sub_path=dns_label(name) if claim else "", command=AGENT_COMMAND, labels=selector)
        return binding

    def _record_of(self, job_id: int) -> tuple[str, str, dict[str, Any]] | None:
        """(namespace, name, the `.status` keys the writer owns) of a job; None for a job no TfsnJob of this
        operator runs (any longer)."""
        try:
            job = self.store.job(job_id)
        except StoreError:
            return None
        where = tfsnjob_of(job)
        if where is None or str(job.id) not in self.provider.bindings:   # released: its TfsnJob is going
            return None
        return (*where, status_record(job, self.store.nodes(job.id), self.provider.hosts, self.taints.tainted))

    # ---- timer ----------------------------------------------------------------------------------
    def sync(self, body: dict[str, Any]) -> dict[str, Any]:
        """Taint the hosts of failed nodes whose taint was refused, have the writer bring `.status` up to
        date (in its thread), and return the conditions' changes (kopf writes them)."""
        job = self.job_of(body)
        if job is None:
            return {}
        self.taints.retry(job)
        self.writer.changed(job.id)
        previous = (body.get("status") or {}).get("conditions", [])
        phase = job.state.value.title()
        conditions = [c.model_dump(by_alias=True) for c in (
            _condition(previous, "Valid", True, "SpecValid"),
            _condition(previous, "Running", job.state == JobState.RUNNING, phase, job.error))]
        conditions += [c for c in previous if c.get("type") not in ("Valid", "Running")]
        return {} if conditions == previous else {"conditions": conditions}

    def tainted_since(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        """(host, failure) of every host tainted for the TfsnJob since the last call: a Kubernetes event each.
        Queued as each taint is made: the status says tainted long before the timer could compare."""
        job = self.job_of(body)
        return [] if job is None else self.taints.news(job.id)

    def spec_changed(self, body: dict[str, Any]) -> dict[str, Any]:
        """A changed spec is not applied to a job under way (its plan, pods and checkpoints are of the old one); a
        refused one is checked again, the edit being the fix its Valid=False condition asked for."""
        if self.job_of(body) is None:
            if not refused(body.get("status") or {}):
                return {}
            admitted = self.admit(body)
            return admitted if "phase" in admitted else {"phase": "", "message": "", **admitted}   # no longer Failed
        previous = (body.get("status") or {}).get("conditions", [])
        message = ("the spec changed after the job started; the job runs on with the spec it started with. To fix: "
                   f"kubectl delete the {KIND} and apply it again (it restarts from its checkpoints)")
        kept = [c for c in previous if c.get("type") != "SpecApplied"]
        return {"conditions": [*kept, _condition(previous, "SpecApplied", False, "SpecChanged", message)
                               .model_dump(by_alias=True)]}

    # ---- delete ---------------------------------------------------------------------------------
    def release(self, body: dict[str, Any]) -> bool:
        """Ask the controller to stop the job; True once it has (its pods are deleted, its status written
        unless the API server keeps refusing: the TfsnJob is going anyway)."""
        job = self.job_of(body)
        if job is None:
            return True
        if not job.state.terminal:
            try:
                self.store.request_stop(job.id)
            except StoreError:
                return True
            self.controller.wake.set()
            return False
        self.writer.write(job.id, wait_s=FINAL_WRITE_WAIT_S)
        self.provider.bindings.pop(str(job.id), None)
        self.taints.news(job.id)   # no event for a TfsnJob that is going
        return True


def _mount_path(checkpoint_dir: str | None) -> str:
    """Where the pods mount the checkpoint volume: checkpoint.dir, unless that is an object store's URL."""
    return CHECKPOINT_MOUNT if not checkpoint_dir or checkpoint_url_scheme(checkpoint_dir) else checkpoint_dir


def _cluster_problem(spec: JobSpec) -> str:
    """What a valid train.yaml may hold that a TfsnJob cannot."""
    if spec.resources.infra and spec.resources.infra != ["kubernetes"]:
        return (f"spec.resources.infra: a {KIND} runs on this cluster, not on {', '.join(spec.resources.infra)}. "
                "To fix: remove resources.infra or set it to [kubernetes]")
    if spec.resources.use_spot:
        return "spec.resources.use_spot: a Kubernetes cluster has no spot market. To fix: remove it"
    if spec.checkpoint.dir is not None and not spec.checkpoint.dir.startswith("/") \
            and not checkpoint_url_scheme(spec.checkpoint.dir):
        return (f"spec.checkpoint.dir: {spec.checkpoint.dir!r} is relative; the checkpoint volume is mounted "
                f"there in each pod. To fix: give an absolute path such as {CHECKPOINT_MOUNT}, or remove it")
    return ""
