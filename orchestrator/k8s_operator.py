"""The Kubernetes operator: TfsnJobs run by the controller, one kopf handler per event.

There is one job state machine, the controller's. The operator process runs a `Controller` (and its
API server: agents in worker pods report to it exactly as to a local controller, so health is the
same detectors and policy on the same telemetry) with the kubernetes provider, and each TfsnJob is
one controller job. The handlers only translate between the two:

- create: validate the spec with `JobSpec` (a bad one gets a status condition, and no pods), make the
  job's token Secret and headless Service, bind its pods to the TfsnJob (owner, Secret, checkpoint
  volume), and add the controller job;
- resume (the operator started): adopt the TfsnJob: the controller job if the store still has it,
  else a new one that carries on from `.status` (attempt, restarts, checkpoint): the status is the
  store that outlives the operator's pod;
- timer: mirror the controller's job into `.status`;
- update of the spec: not applied to a job under way; a condition says so and how to apply it;
- delete: stop the job; the controller deletes the pods, owner references the Secret and Service.

The Kubernetes node of every node the controller fails (a failed pod, a silent agent, a health finding)
is tainted as its pod is deleted, before the replacement is asked for, so that the scheduler never puts
the replacement there (the timer tries again should that be refused).

Run it with `tfsn operator run` (or `kopf run -m orchestrator.k8s_operator`); settings come from
TFSN_OPERATOR_* variables (see `OperatorSettings`).
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import secrets
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
from pydantic import ValidationError

from orchestrator.api import ApiServer
from orchestrator.controller import Controller
from orchestrator.crd import GROUP, KIND, PLURAL, VERSION, Condition, NodeStatus, TfsnJobStatus
from orchestrator.home import tfsn_home
from orchestrator.spec import JobSpec, _dotted, _user_path
from orchestrator.store import Job, JobState, Node, NodeState, Store, StoreError
from providers.base import ProviderError
from providers.kubernetes import TOKEN_KEY, UNHEALTHY_TAINT, KubernetesProvider, PodBinding
from providers.naming import dns_label

SYNC_S = float(os.environ.get("TFSN_OPERATOR_SYNC_S", 3))  # how often .status is brought up to date
CHECKPOINT_MOUNT = "/tfsn/checkpoints"     # checkpoint.dir of a TfsnJob that names none
CLAIM_ANNOTATION = "tfsn.dev/checkpoint-claim"   # a TfsnJob's own PersistentVolumeClaim of checkpoints
AGENT_COMMAND = ("python3", "-m", "orchestrator.agent")


@dataclass(frozen=True)
class OperatorSettings:
    """The operator process's knobs (TFSN_OPERATOR_*), read once at start."""

    home: Path                         # the controller's store and logs
    host: str = "0.0.0.0"              # where the API listens: worker pods must reach it
    port: int = 0                      # 0: any free port
    advertise: str = ""                # the host pods reach the API at (the operator's Service; default: pod IP)
    checkpoint_claim: str = ""         # default PVC of checkpoints, in each job's namespace; "": emptyDir
    pod_poll_s: float = 5.0            # how often the controller reads a pod's phase

    @classmethod
    def from_env(cls) -> OperatorSettings:
        env = os.environ
        return cls(home=tfsn_home(), host=env.get("TFSN_OPERATOR_HOST", "0.0.0.0"),
                   port=int(env.get("TFSN_OPERATOR_PORT", 0)),
                   advertise=env.get("TFSN_OPERATOR_ADVERTISE") or socket.gethostbyname(socket.gethostname()),
                   checkpoint_claim=env.get("TFSN_OPERATOR_CHECKPOINT_CLAIM", ""),
                   pod_poll_s=float(env.get("TFSN_OPERATOR_POD_POLL_S", 5)))


def job_key(meta: dict[str, Any]) -> str:
    """The controller job's `spec_path` of a TfsnJob: how the two find each other."""
    return f"tfsnjob://{meta['namespace']}/{meta['name']}?uid={meta['uid']}"


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
    """The controller, its API server and the kubernetes provider, for every TfsnJob of the cluster."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        settings.home.mkdir(parents=True, exist_ok=True)
        self.store = Store(settings.home / "operator.db")
        self.provider = KubernetesProvider()
        self.provider.status_poll_s = settings.pod_poll_s
        self.provider.on_deleted = self._pod_deleted
        self.controller = Controller(self.store, settings.home, {"kubernetes": self.provider})
        self.server = ApiServer(settings.port, self.store, self.controller, settings.host, settings.advertise)
        self.controller.url = self.server.url
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._serving = False
        self._job_ids: dict[str, int] = {}   # job_key -> controller job id
        self._tainted: set[str] = set()       # ids of failed nodes whose host is tainted (also in .status)

    def start(self, reconcile: bool = True) -> None:
        """Serve agents and run the controller's loop in threads (kopf keeps the event loop); without
        `reconcile` the caller drives `controller.reconcile` itself (tests)."""
        self.server.start()
        self._serving = True
        if reconcile:
            self._loop = threading.Thread(target=self.controller.run_forever, args=(self._stop, math.inf),
                                          name="tfsn-controller", daemon=True)
            self._loop.start()

    def close(self) -> None:
        """Stop serving and reconciling; the pods keep running until the next operator adopts the jobs."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.controller.wake.set()
        if self._loop is not None:
            self._loop.join(30)
        if self._serving:
            self.server.shutdown()      # waits for serve_forever to return: only once it ran
        self.server.server_close()
        self.store.close()

    # ---- create / adopt -----------------------------------------------------------------------
    def admit(self, body: dict[str, Any]) -> dict[str, Any]:
        """A new TfsnJob: its controller job, or, for a bad spec, a status that says what to fix.

        Idempotent: kopf runs a create handler again when it could not record that it ran."""
        meta, data = body["metadata"], dict(body.get("spec") or {})
        job = self._job_of(body)
        if job is not None:
            self._prepare(body, job)
            return {"phase": job.state.value.title(), "jobId": job.id}
        data.setdefault("name", meta["name"])
        try:
            spec = JobSpec.model_validate(data)
        except ValidationError as err:
            return self._invalid(body, spec_error(err, data))
        problem = _cluster_problem(spec)
        if problem:
            return self._invalid(body, problem)
        spec.resources.infra = ["kubernetes"]
        spec.checkpoint.dir = spec.checkpoint.dir or CHECKPOINT_MOUNT
        job = self.store.create_job(spec.name, spec.model_dump(mode="json"), job_key(meta), secrets.token_urlsafe(32))
        durable = self._prepare(body, job).checkpoint_claim is not None
        self.controller.wake.set()
        return TfsnJobStatus(phase=job.state.value.title(), job_id=job.id, conditions=[
            _condition([], "Valid", True, "SpecValid"),
            _condition([], "CheckpointsDurable", durable, "PersistentVolumeClaim" if durable else "EmptyDir",
                       "" if durable else "checkpoints are kept in each pod's emptyDir and lost with the pod. To fix: "
                       f"annotate the {KIND} with {CLAIM_ANNOTATION}: <a PersistentVolumeClaim>")],
        ).model_dump(by_alias=True)

    def adopt(self, body: dict[str, Any]) -> dict[str, Any]:
        """A TfsnJob seen at start: carry on with its controller job, rebuilt from `.status` if lost."""
        meta, status = body["metadata"], body.get("status") or {}
        job = self._job_of(body)
        if job is not None:
            self._prepare(body, job)
            return {}
        if status.get("jobId") is None:          # never admitted (the operator stopped first), or invalid
            conditions = status.get("conditions", [])
            invalid = any(c.get("type") == "Valid" and c.get("status") == "False" for c in conditions)
            return {} if invalid or status.get("phase") in _TERMINAL else self.admit(body)
        if status.get("phase") in _TERMINAL:
            return {}
        # The store went with the old operator pod: its pods cannot be told apart from strangers', so
        # they go, and a new controller job restarts every rank from the checkpoint the status names.
        for pod in self.provider.pods_of(meta["namespace"], meta["uid"]):
            self.provider.delete_pod(meta["namespace"], pod)
        admitted = self.admit(body)
        job = self._job_of(body)
        if job is None:
            return admitted
        checkpoint = status.get("checkpoint") or {}
        self.store.update_job(job.id, attempt=int(status.get("attempt", 0)), restarts=int(status.get("restarts", 0)),
                              checkpoint_step=checkpoint.get("step"), checkpoint_path=checkpoint.get("path", ""),
                              step=int(status.get("step", 0)))
        self.store.add_event(job.id, "operator", f"adopted {KIND} {meta['namespace']}/{meta['name']} (was job "
                             f"{status['jobId']}); restarting from the checkpoint at step "
                             f"{checkpoint.get('step') or 0}")
        return {**admitted, "restarts": int(status.get("restarts", 0)), "attempt": int(status.get("attempt", 0))}

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
        secret, service = dns_label(f"{name}-tfsn-token"), dns_label(f"{name}-workers")
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

    # ---- status -------------------------------------------------------------------------------
    def sync(self, body: dict[str, Any]) -> dict[str, Any]:
        """`.status` from the controller's job; taints the hosts of nodes it failed. Only what changed."""
        status = body.get("status") or {}
        job = self._job_of(body)
        if job is None:
            return {}
        before = {n.get("id"): n for n in status.get("nodes", [])}
        nodes = []
        for node in self.store.nodes(job.id):
            old = before.get(node.id, {})
            host = self.provider.hosts.get(node.id) or old.get("host", "")
            tainted = bool(old.get("tainted")) or node.id in self._tainted
            if node.state == NodeState.FAILED and host and not tainted:   # the first try was refused
                tainted = self._taint(job, node, host)
            nodes.append(NodeStatus(id=node.id, rank=node.rank, state=node.state.value,
                                    pod=(node.handle or {}).get("data", {}).get("pod", ""), host=host,
                                    failure=node.failure, tainted=tainted))
        previous = status.get("conditions", [])
        phase = job.state.value.title()
        new = TfsnJobStatus(
            phase=phase, job_id=job.id, attempt=job.attempt, step=job.step, restarts=job.restarts,
            checkpoint={"step": job.checkpoint_step, "path": job.checkpoint_path}, nodes=nodes, message=job.error,
            conditions=[_condition(previous, "Valid", True, "SpecValid"),
                        _condition(previous, "Running", job.state == JobState.RUNNING, phase, job.error),
                        *(c for c in previous if c.get("type") not in ("Valid", "Running"))],
        ).model_dump(by_alias=True)
        return {k: v for k, v in new.items() if status.get(k) != v}

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
        self.store.add_event(job.id, "node", f"tainted Kubernetes node {host} ({UNHEALTHY_TAINT}): {node.failure}")
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

    # ---- delete -------------------------------------------------------------------------------
    def release(self, body: dict[str, Any]) -> bool:
        """Ask the controller to stop the job; True once it has (its pods are deleted)."""
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
        self.provider.bindings.pop(str(job.id), None)
        return True


_TERMINAL = {s.value.title() for s in JobState if s.terminal}


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


@kopf.on.startup()
def start(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.WARNING   # Kubernetes events for problems, not for every handler run
    memo.tfsn = Operator(OperatorSettings.from_env())
    memo.tfsn.start()


@kopf.on.cleanup()
def stop(memo: kopf.Memo, **_: Any) -> None:
    operator = getattr(memo, "tfsn", None)
    if operator is not None:
        operator.close()


@kopf.on.create(*RESOURCE)
def create(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(memo.tfsn.admit(dict(body)))


@kopf.on.resume(*RESOURCE)
def resume(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(memo.tfsn.adopt(dict(body)))


@kopf.timer(*RESOURCE, interval=SYNC_S)
def sync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    changes = memo.tfsn.sync(dict(body))
    was = {n.get("id") for n in (body.get("status") or {}).get("nodes", []) if n.get("tainted")}
    for node in changes.get("nodes", []):
        if node["tainted"] and node["id"] not in was:
            kopf.warn(body, reason="NodeTainted", message=f"{UNHEALTHY_TAINT} on {node['host']}: {node['failure']}")
    patch.status.update(changes)


@kopf.on.update(*RESOURCE, field="spec")
def update(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(memo.tfsn.spec_changed(dict(body)))


@kopf.on.delete(*RESOURCE)
def delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if not memo.tfsn.release(dict(body)):
        raise kopf.TemporaryError("stopping the job's pods", delay=2)

