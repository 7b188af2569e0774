"""The Kubernetes operator: TfsnJobs run by the controller, one kopf handler per event.

There is one job state machine, the controller's. The operator process runs a `Controller` (and its
API server: agents in worker pods report to it exactly as to a local controller, so health is the
same detectors and policy on the same telemetry) with the kubernetes provider, and each TfsnJob is
one controller job. The handlers only translate between the two.

The TfsnJob's `.status` is the job's durable store; the operator's SQLite store is a working cache
that may be lost with the operator's pod at any moment. Every write to a job or its nodes (a state
transition, a node recorded, failed or ready, a checkpoint) is copied into `.status` at once by a
`StatusWriter` thread (orchestrator.k8s.status; a failed write is tried again), and an operator that
starts with an empty store re-creates each job and its nodes from `.status` under their old ids (the
token is in the job's Secret), so the worker pods' agents carry on reporting to it:

- startup: list every TfsnJob, reserve the job ids their statuses hold (a job admitted meanwhile never
  takes one), re-create their controller jobs, and only then restart those that cannot be carried on.
  A TfsnJob that cannot be adopted now (its Secret unreadable, the API server refusing) is left to the
  resume handler; a listing that fails fails the startup handler, which kopf runs again;
- create: validate the spec with `JobSpec` (a bad one gets a status condition, and no pods), make the
  job's token Secret and headless Service, bind its pods to the TfsnJob (owner, Secret, checkpoint
  volume), and add the controller job;
- resume: the same re-creation for a TfsnJob the startup listing missed; pods of the TfsnJob that the
  status does not know are deleted before the controller sees the job;
- timer: taint what a refused taint left, have the writer check `.status`, keep the conditions, and
  post a NodeTainted event for every host tainted since;
- update of the spec: not applied to a job under way; a condition says so and how to apply it;
- delete: stop the job; the controller deletes the pods, owner references the Secret and Service.

The Kubernetes node of every node the controller fails (a failed pod, a silent agent, a health finding)
is tainted as its pod is deleted, before the replacement is asked for, so that the scheduler never puts
the replacement there (the timer tries again should that be refused).

Adoption lists the TfsnJobs of the namespaces the operator watches, and kopf does not tell its startup
handler which those are, only whether it watches the whole cluster. So: TFSN_OPERATOR_NAMESPACE, when
set, is the namespace listed (`tfsn operator run --namespace X` sets it and has kopf watch X alone);
otherwise the whole cluster is listed, but only when kopf runs cluster-wide. An operator started with
`kopf run --namespace X` and no TFSN_OPERATOR_NAMESPACE refuses to start (it would adopt the jobs of
namespaces another operator runs) and says to set it.

Run it with `tfsn operator run` (or `kopf run -m orchestrator.k8s.operator --all-namespaces`); settings
come from TFSN_OPERATOR_* variables (see `OperatorSettings`).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import secrets
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import kopf
from pydantic import ValidationError

from orchestrator.control.api import ApiServer
from orchestrator.control.controller import Controller
from orchestrator.k8s.crd import GROUP, KIND, PLURAL, VERSION, Condition, TfsnJobStatus
from orchestrator.home import tfsn_home
from orchestrator.k8s.status import StatusWriter, restored_job, status_record
from orchestrator.spec import JobSpec, _dotted, _user_path
from orchestrator.control.store import Job, JobState, Node, NodeState, Store, StoreError
from providers.base import NotFoundError, ProviderError, import_sdk
from providers.kubernetes import EXTRA, TIMEOUT_S, TOKEN_KEY, UNHEALTHY_TAINT, KubernetesProvider, PodBinding
from providers.naming import dns_label

SYNC_S = float(os.environ.get("TFSN_OPERATOR_SYNC_S", 3))  # how often the timer checks .status
CHECKPOINT_MOUNT = "/tfsn/checkpoints"     # checkpoint.dir of a TfsnJob that names none
CLAIM_ANNOTATION = "tfsn.dev/checkpoint-claim"   # a TfsnJob's own PersistentVolumeClaim of checkpoints
AGENT_COMMAND = ("python3", "-m", "orchestrator.agent")
LIST_TRIES = 3                  # listing the TfsnJobs at start, before the startup handler fails (kopf retries it)
LIST_BACKOFF_S = 1.0            # 1 s, then 2 s between those tries
RETRY_DELAY_S = 10.0            # when kopf runs a handler again after the API server refused it something
FINAL_WRITE_WAIT_S = 10.0       # the delete handler's last status write waits no longer for another one
log = logging.getLogger("tfsn.operator")


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


def job_key(meta: dict[str, Any]) -> str:
    """The controller job's `spec_path` of a TfsnJob: how the two find each other."""
    return f"tfsnjob://{meta['namespace']}/{meta['name']}?uid={meta['uid']}"


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
        self.store = Store(settings.home / "operator.db")
        self.provider = KubernetesProvider()
        self.provider.status_poll_s = settings.pod_poll_s
        self.provider.on_deleted = self._pod_deleted
        self.controller = Controller(self.store, settings.home, {"kubernetes": self.provider})
        self.server = ApiServer(settings.port, self.store, self.controller.handlers, settings.host, settings.advertise)
        self.controller.url = self.server.url
        self.writer = StatusWriter(self._record_of, self._custom_objects)
        self.store.on_change = self.writer.changed
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._serving = False
        self._custom_api: Any = None
        self._job_ids: dict[str, int] = {}   # job_key -> controller job id
        self._tainted: set[str] = set()       # ids of failed nodes whose host is tainted (also in .status)
        self._taint_news: dict[int, list[tuple[str, str]]] = {}   # job id -> (host, failure) not yet an event
        self._news_lock = threading.Lock()

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

    def _custom_objects(self) -> Any:
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
        job = self._job_of(body)
        if job is None and (body.get("status") or {}).get("jobId") is not None:
            return self.adopt(body)   # admitted before this operator started: its pods may be running
        if job is None:
            spec, problem = self._checked_spec(body, dict(body.get("spec") or {}))
            if spec is None:
                return self._invalid(body, problem)
            job = self._create_job(body, spec)
        durable = self._prepare(body, job).checkpoint_claim is not None
        self.controller.wake.set()
        return {"conditions": [c.model_dump(by_alias=True) for c in (
            _condition([], "Valid", True, "SpecValid"),
            _condition([], "CheckpointsDurable", durable, "PersistentVolumeClaim" if durable else "EmptyDir",
                       "" if durable else "checkpoints are kept in each pod's emptyDir and lost with the pod. To "
                       f"fix: annotate the {KIND} with {CLAIM_ANNOTATION}: <a PersistentVolumeClaim>"))]}

    def _checked_spec(self, body: dict[str, Any], data: dict[str, Any]) -> tuple[JobSpec | None, str]:
        """`data` as the spec of a job on this cluster, or None and one line saying what to fix."""
        data.setdefault("name", body["metadata"]["name"])
        try:
            spec = JobSpec.model_validate(data)
        except ValidationError as err:
            return None, spec_error(err, data)
        problem = _cluster_problem(spec)
        if problem:
            return None, problem
        spec.resources.infra = ["kubernetes"]
        spec.checkpoint.dir = spec.checkpoint.dir or CHECKPOINT_MOUNT
        return spec, ""

    def _create_job(self, body: dict[str, Any], spec: JobSpec) -> Job:
        key = job_key(body["metadata"])
        job = self.store.create_job(spec.name, spec.model_dump(mode="json"), key, secrets.token_urlsafe(32))
        self._job_ids[key] = job.id
        return job

    def _invalid(self, body: dict[str, Any], message: str) -> dict[str, Any]:
        previous = (body.get("status") or {}).get("conditions", [])
        return TfsnJobStatus(phase="Failed", message=message, conditions=[
            _condition(previous, "Valid", False, "InvalidSpec", message)]).model_dump(by_alias=True)

    def _job_of(self, body: dict[str, Any]) -> Job | None:
        """The TfsnJob's controller job (looked up in the store once, then remembered)."""
        key = job_key(body["metadata"])
        if key not in self._job_ids:
            job = next((j for j in self.store.jobs() if j.spec_path == key), None)
            if job is None:
                return None
            self._job_ids[key] = job.id
        return self.store.job(self._job_ids[key])

    def _prepare(self, body: dict[str, Any], job: Job) -> PodBinding:
        """The job's Secret and headless Service, and what its pods get (see PodBinding)."""
        meta = body["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": uid}
        owned = {"namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "tfsn"},
                 "ownerReferences": [{**owner, "controller": True, "blockOwnerDeletion": True}]}
        secret, service = _token_secret(name), dns_label(f"{name}-workers")
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
            checkpoint_path=spec.checkpoint.dir or CHECKPOINT_MOUNT, checkpoint_claim=claim,
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
        return (*where, status_record(job, self.store.nodes(job.id), self.provider.hosts, self._tainted))

    # ---- start / resume -------------------------------------------------------------------------
    def adopt_all(self) -> None:
        """At start, before any handler: every TfsnJob's controller job re-created from its `.status`.

        The ids every status holds are reserved first and every job that can be carried on is restored
        before any is restarted: a restart is a new job, which must not take an id a later TfsnJob holds.
        A TfsnJob that cannot be adopted now is left to the resume handler; ProviderError if the TfsnJobs
        cannot be listed (the startup handler fails, and kopf runs it again)."""
        bodies = self._listed()
        held = [(b.get("status") or {}).get("jobId") for b in bodies]   # terminal ones too
        self.store.reserve_job_ids(max((i for i in held if isinstance(i, int)), default=0))
        restarts = []
        for body in bodies:
            status = body.get("status") or {}
            if status.get("jobId") is None or status.get("phase") in _TERMINAL:
                continue
            with _adopting(body):
                if self._job_of(body) is not None:
                    self.adopt(body)
                elif self._resume(body) is None:
                    restarts.append(body)
        for body in restarts:
            with _adopting(body):
                self._restart(body)

    def _listed(self) -> list[dict[str, Any]]:
        """The TfsnJobs of the namespace the operator watches (all, cluster-wide), tried LIST_TRIES times."""
        api, namespace = self._custom_objects(), self.settings.namespace
        for attempt in range(LIST_TRIES):
            try:
                if namespace:
                    listed = api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                               _request_timeout=TIMEOUT_S)
                else:
                    listed = api.list_cluster_custom_object(GROUP, VERSION, PLURAL, _request_timeout=TIMEOUT_S)
                return list(listed.get("items", []))
            except Exception as err:   # ApiException, urllib3's errors after its own retries
                failure = err
                if attempt + 1 < LIST_TRIES:
                    time.sleep(LIST_BACKOFF_S * 2 ** attempt)
        where, why = f"namespace {namespace}" if namespace else "the cluster", " ".join(str(failure).split())[:300]
        raise ProviderError(f"cannot list the {KIND}s of {where} to adopt them: {why}. To fix: let the operator's "
                            f"service account list {PLURAL}.{GROUP}", provider="kubernetes")

    def adopt(self, body: dict[str, Any]) -> dict[str, Any]:
        """A TfsnJob seen at start: carry on with its controller job, re-created from `.status` if the store
        lacks it. Returns the conditions to write, if any. ProviderError where the cluster refused something
        it needs (the caller tries again later)."""
        status = body.get("status") or {}
        job = self._job_of(body)
        if job is not None:      # the store outlived the operator's container
            self._remember(status)
            self._prepare(body, job)
            return {}
        if status.get("jobId") is None:          # never admitted (the operator stopped first), or invalid
            conditions = status.get("conditions", [])
            invalid = any(c.get("type") == "Valid" and c.get("status") == "False" for c in conditions)
            if invalid or status.get("phase") in _TERMINAL:
                return {}
            self._delete_strangers(body, set())  # pods of an admission whose record never reached .status
            return self.admit(body)
        if status.get("phase") in _TERMINAL:
            return {}
        if self._resume(body) is None:
            return self._restart(body)
        return {}

    def _remember(self, status: dict[str, Any]) -> None:
        """What only `.status` keeps of a job's nodes: the hosts tainted for them, and where each one ran."""
        for node in status.get("nodes") or []:
            if node.get("id") and node.get("tainted"):
                self._tainted.add(node["id"])
            if node.get("id") and node.get("host"):
                self.provider.hosts.setdefault(node["id"], node["host"])

    def _resume(self, body: dict[str, Any]) -> Job | None:
        """Re-create the controller job and its nodes from `.status`, with the token from the job's Secret,
        and keep its pods: their agents go on reporting to this operator. None where that cannot be."""
        meta, status = body["metadata"], body.get("status") or {}
        token = self._token(meta["namespace"], _token_secret(meta["name"]))
        restored = restored_job(status, meta["name"], meta["namespace"], job_key(meta), token,
                                self.provider.context) if token else None
        if restored is None:
            return None
        job, nodes = restored
        try:
            self.store.job(job.id)
            return None   # the id is another job's (one whose status holds the same id)
        except StoreError:
            pass
        self._prepare(body, job)   # its pods' binding, before the controller's loop can see the job
        try:   # all before the job is in the store: the controller's loop, running, may make a pod at once
            self._remember(status)
            self._delete_strangers(body, {n.handle["data"]["pod"] for n in nodes if n.handle})
        except BaseException:
            self.provider.bindings.pop(str(job.id), None)
            raise
        message = (f"{job.state.value}: adopted {KIND} {meta['namespace']}/{meta['name']} from its status (attempt "
                   f"{job.attempt}, {job.restarts} restart(s), checkpoint at step {job.checkpoint_step or 0})")
        if not self.store.restore(job, nodes, message):
            self.provider.bindings.pop(str(job.id), None)
            return None
        self._job_ids[job_key(meta)] = job.id
        self.controller.wake.set()
        return self.store.job(job.id)

    def _restart(self, body: dict[str, Any]) -> dict[str, Any]:
        """No record to carry the job on from (a status written by an older operator, the Secret gone, the
        id taken): a new controller job restarts every rank from the checkpoint the status names, with the
        spec the job ran with (the TfsnJob's own spec where the status has none this operator can read)."""
        meta, status = body["metadata"], body.get("status") or {}
        recorded = (status.get("record") or {}).get("spec") if isinstance(status.get("record"), dict) else None
        spec, problem = self._checked_spec(body, dict(recorded)) if isinstance(recorded, dict) and recorded \
            else (None, "")
        if spec is None:
            spec, problem = self._checked_spec(body, dict(body.get("spec") or {}))
        if spec is None:    # said before any pod is deleted
            return self._invalid(body, problem)
        self._delete_strangers(body, set())
        job = self._create_job(body, spec)
        checkpoint = status.get("checkpoint") or {}   # recorded before anything may fail: a retry finds it whole
        self.store.update_job(job.id, attempt=int(status.get("attempt", 0)), restarts=int(status.get("restarts", 0)),
                              checkpoint_step=checkpoint.get("step"), checkpoint_path=checkpoint.get("path", ""),
                              step=int(status.get("step", 0)))
        self.store.add_event(job.id, "operator", f"adopted {KIND} {meta['namespace']}/{meta['name']} (was job "
                             f"{status['jobId']}) without its record; restarting from the checkpoint at step "
                             f"{checkpoint.get('step') or 0}")
        return self.admit({**body, "status": {}})

    def _token(self, namespace: str, secret: str) -> str | None:
        """The job token kept in the job's Secret (the agents of its pods present it); None only when the
        Secret or its key is absent. Any other failure (a 503, a timeout, a 403) is raised: a job is never
        restarted, its pods deleted, because its Secret could not be read just now."""
        try:
            return self.provider.read_secret(namespace, secret, TOKEN_KEY)
        except NotFoundError:
            return None

    def _delete_strangers(self, body: dict[str, Any], known: set[str]) -> None:
        """Delete the TfsnJob's pods that no node of its record owns (made after the last status write)."""
        meta = body["metadata"]
        for pod in self.provider.pods_of(meta["namespace"], meta["uid"]):
            if pod not in known:
                self.provider.delete_pod(meta["namespace"], pod)

    # ---- timer ----------------------------------------------------------------------------------
    def sync(self, body: dict[str, Any]) -> dict[str, Any]:
        """Taint the hosts of failed nodes whose taint was refused, have the writer bring `.status` up to
        date (in its thread), and return the conditions' changes (kopf writes them)."""
        job = self._job_of(body)
        if job is None:
            return {}
        for node in self.store.nodes(job.id):
            host = self.provider.hosts.get(node.id) or node.host
            if node.state == NodeState.FAILED and host and node.id not in self._tainted:
                self._taint(job, node, host)
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
        job = self._job_of(body)
        if job is None:
            return []
        with self._news_lock:
            return self._taint_news.pop(job.id, [])

    def _pod_deleted(self, node_id: str, host: str) -> None:
        """The controller deleted a pod. Deleted for a failure (the node is FAILED by then, its replacement not
        yet asked for), its host is tainted now, so the scheduler never puts the replacement there."""
        try:
            node = self.store.node(node_id)
        except StoreError:
            return
        if node.state == NodeState.FAILED and node_id not in self._tainted:
            self._taint(self.store.job(node.job_id), node, host)

    def _taint(self, job: Job, node: Node, host: str) -> bool:
        """Keep pods off the Kubernetes node a failed tfsn node ran on; False (tried again later) if refused."""
        try:
            self.provider.taint(host, f"tfsn node {node.id} of job {job.name}: {node.failure}")
        except ProviderError as err:
            self.store.add_event(job.id, "node", f"could not taint Kubernetes node {host}: {err}")
            return False
        self._tainted.add(node.id)
        with self._news_lock:
            self._taint_news.setdefault(job.id, []).append((host, node.failure))
        self.store.add_event(job.id, "node", f"tainted Kubernetes node {host} ({UNHEALTHY_TAINT}): {node.failure}")
        self.writer.changed(job.id)
        return True

    def spec_changed(self, body: dict[str, Any]) -> dict[str, Any]:
        """A changed spec is not applied to a job under way (its plan, pods and checkpoints are of the old one)."""
        if self._job_of(body) is None:
            return {}
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
        job = self._job_of(body)
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
        with self._news_lock:
            self._taint_news.pop(job.id, None)
        return True


@contextlib.contextmanager
def _adopting(body: dict[str, Any]) -> Iterator[None]:
    """One TfsnJob's adoption at start: a failure is logged and left to kopf's resume handler for that
    TfsnJob (which runs it again, with retries), never the end of the startup handler."""
    try:
        yield
    except Exception as err:
        meta = body["metadata"]
        log.warning("cannot adopt %s %s/%s now (its resume handler tries again): %s", KIND, meta["namespace"],
                    meta["name"], " ".join(str(err).split())[:300])


_TERMINAL = {s.value.title() for s in JobState if s.terminal}


def _token_secret(name: str) -> str:
    """The Secret holding the job token of TfsnJob `name`."""
    return dns_label(f"{name}-tfsn-token")


def _cluster_problem(spec: JobSpec) -> str:
    """What a valid train.yaml may hold that a TfsnJob cannot."""
    if spec.resources.infra and spec.resources.infra != ["kubernetes"]:
        return (f"spec.resources.infra: a {KIND} runs on this cluster, not on {', '.join(spec.resources.infra)}. "
                "To fix: remove resources.infra or set it to [kubernetes]")
    if spec.resources.use_spot:
        return "spec.resources.use_spot: a Kubernetes cluster has no spot market. To fix: remove it"
    if spec.checkpoint.dir is not None and not spec.checkpoint.dir.startswith("/"):
        return (f"spec.checkpoint.dir: {spec.checkpoint.dir!r} is relative; the checkpoint volume is mounted "
                f"there in each pod. To fix: give an absolute path such as {CHECKPOINT_MOUNT}, or remove it")
    return ""


# ---- kopf handlers ------------------------------------------------------------------------------
RESOURCE = (GROUP, VERSION, PLURAL)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account in the cluster, else the kubeconfig, read now (KUBECONFIG set by then)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _retried(handler: Callable[[dict[str, Any]], dict[str, Any]], body: kopf.Body) -> dict[str, Any]:
    """A handler's work, a refusal of the API server (a 503, a timeout, RBAC) made a retry after a delay."""
    try:
        return handler(dict(body))
    except ProviderError as err:
        raise kopf.TemporaryError(f"{err} (tried again in {RETRY_DELAY_S:.0f}s)", delay=RETRY_DELAY_S) from None


def adoption_namespace(clusterwide: bool, namespace: str) -> str:
    """The namespace whose TfsnJobs are adopted at start ("": all); see the module docstring."""
    if namespace or clusterwide:
        return namespace
    raise kopf.PermanentError(
        f"kopf watches some namespaces only, and TFSN_OPERATOR_NAMESPACE does not say which: the operator would "
        f"adopt the {KIND}s of every namespace. To fix: set TFSN_OPERATOR_NAMESPACE to the watched namespace, or "
        "run `tfsn operator run --namespace NAME`")


@kopf.on.startup()
def start(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.WARNING   # Kubernetes events for problems, not for every handler run
    operator = getattr(memo, "tfsn", None)
    if operator is None:     # not again when kopf retries this handler: one operator, one port for its API
        ours = OperatorSettings.from_env()
        adoption_namespace(settings.peering.clusterwide, ours.namespace)
        operator = memo.tfsn = Operator(ours)
    operator.start()
    try:
        operator.adopt_all()
    except ProviderError as err:   # kopf runs no other handler before this one succeeds: none admits a job
        raise kopf.TemporaryError(f"{err} (tried again in {RETRY_DELAY_S:.0f}s)", delay=RETRY_DELAY_S) from None


@kopf.on.cleanup()
def stop(memo: kopf.Memo, **_: Any) -> None:
    operator = getattr(memo, "tfsn", None)
    if operator is not None:
        operator.close()


@kopf.on.create(*RESOURCE)
def create(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(_retried(memo.tfsn.admit, body))


@kopf.on.resume(*RESOURCE)
def resume(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(_retried(memo.tfsn.adopt, body))


@kopf.timer(*RESOURCE, interval=SYNC_S)
def sync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(memo.tfsn.sync(dict(body)))
    for host, failure in memo.tfsn.tainted_since(dict(body)):
        kopf.warn(body, reason="NodeTainted", message=f"{UNHEALTHY_TAINT} on {host}: {failure}")


@kopf.on.update(*RESOURCE, field="spec")
def update(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(memo.tfsn.spec_changed(dict(body)))


@kopf.on.delete(*RESOURCE)
def delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if not memo.tfsn.release(dict(body)):
        raise kopf.TemporaryError("stopping the job's pods", delay=2)
