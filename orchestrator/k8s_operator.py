"""The Kubernetes operator: TfsnJobs run by the controller, one kopf handler per event.

There is one job state machine, the controller's. The operator process runs a `Controller` (and its
API server: agents in worker pods report to it exactly as to a local controller, so health is the
same detectors and policy on the same telemetry) with the kubernetes provider, and each TfsnJob is
one controller job. The handlers only translate between the two.

The TfsnJob's `.status` is the job's durable store; the operator's SQLite store is a working cache
that may be lost with the operator's pod at any moment. Every write to a job or its nodes (a state
transition, a node recorded, failed or ready, a checkpoint) is copied into `.status` at once by a
`StatusWriter` thread (a failed write is retried by the next change or the timer), and an operator
that starts with an empty store re-creates each job and its nodes from `.status` under their old ids
(the token is in the job's Secret), so the worker pods' agents carry on reporting to it:

- startup: re-create every TfsnJob's controller job from its `.status` before any handler runs (a new
  TfsnJob admitted meanwhile could take a job id a running one holds);
- create: validate the spec with `JobSpec` (a bad one gets a status condition, and no pods), make the
  job's token Secret and headless Service, bind its pods to the TfsnJob (owner, Secret, checkpoint
  volume), and add the controller job;
- resume: the same re-creation for a TfsnJob the startup listing missed; pods of the TfsnJob that the
  status does not know are deleted;
- timer: taint what a refused taint left, write `.status` again if a write failed, keep the conditions;
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
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import kopf
from pydantic import ValidationError

from orchestrator.api import ApiServer
from orchestrator.controller import Controller
from orchestrator.crd import (GROUP, KIND, PLURAL, VERSION, Condition, JobRecord, NodeStatus, TfsnJobStatus)
from orchestrator.home import tfsn_home
from orchestrator.spec import JobSpec, _dotted, _user_path
from orchestrator.store import Job, JobState, Node, NodeState, Store, StoreError
from providers.base import NodeHandle, ProviderError, import_sdk
from providers.kubernetes import EXTRA, TIMEOUT_S, TOKEN_KEY, UNHEALTHY_TAINT, KubernetesProvider, PodBinding
from providers.naming import dns_label

SYNC_S = float(os.environ.get("TFSN_OPERATOR_SYNC_S", 3))  # how often the timer checks .status
CHECKPOINT_MOUNT = "/tfsn/checkpoints"     # checkpoint.dir of a TfsnJob that names none
CLAIM_ANNOTATION = "tfsn.dev/checkpoint-claim"   # a TfsnJob's own PersistentVolumeClaim of checkpoints
AGENT_COMMAND = ("python3", "-m", "orchestrator.agent")
# .status keys the StatusWriter owns; the handlers own `conditions` (kopf writes them, and its own notes)
RECORD_KEYS = tuple(f.alias or n for n, f in TfsnJobStatus.model_fields.items() if n != "conditions")
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
    namespace: str = ""                # the only namespace watched; "": all

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


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that sets the `.status` keys of `new` that differ from `old`, each whole.
    Not a merge patch: that would drop the nulls the record holds (an offer's zone, a checkpoint's step);
    not the whole status: the rest of it is kopf's."""
    return [{"op": "add", "path": f"/status/{key}", "value": value} for key, value in new.items()
            if key not in old or old[key] != value]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(previous: list[dict[str, Any]], type_: str, ok: bool, reason: str, message: str = "") -> Condition:
    """A condition whose transition time moves only when its status does."""
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == type_), {})
    when = old.get("lastTransitionTime") if old.get("status") == status and old.get("lastTransitionTime") else _now()
    return Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=when)


class StatusWriter:
    """Copies controller jobs into their TfsnJobs' `.status` as soon as the store changes.

    It runs in a thread of its own, so that a store write (an agent's heartbeat, the controller's loop)
    never waits on the API server; each write sends only the keys that differ from what it wrote last (a
    JSON patch, through the kubernetes client's timeout and bounded retries with backoff). A write that
    fails is forgotten, not lost: the next change or the timer compares with the server and writes again.
    """

    def __init__(self, record_of: Callable[[int], tuple[str, str, dict[str, Any]] | None],
                 api: Callable[[], Any]) -> None:
        self._record_of = record_of     # job id -> (namespace, name, .status keys it owns), None: not ours
        self._api = api                 # the CustomObjectsApi
        self._due: set[int] = set()
        self._wake = threading.Condition()
        self._write_lock = threading.Lock()
        self._written: dict[int, dict[str, Any]] = {}  # job id -> what .status holds of ours, as last written
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def changed(self, job_id: int) -> None:
        """The store changed the job (Store.on_change): write it soon."""
        with self._wake:
            self._due.add(job_id)
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tfsn-status", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Write what is due, then stop."""
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(60)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._due or self._stop.is_set(), timeout=1.0)
                due, self._due = self._due, set()
            for job_id in sorted(due):
                self.write(job_id)
            if self._stop.is_set() and not self._due:
                return

    def write(self, job_id: int) -> bool:
        """Bring the TfsnJob's `.status` up to date with the store now; False if the API server refused."""
        with self._write_lock:
            target = self._record_of(job_id)
            if target is None:
                self._written.pop(job_id, None)
                return True
            namespace, name, record = target
            api = self._api()
            where = (GROUP, VERSION, namespace, PLURAL, name)
            try:
                old = self._written.get(job_id)
                if old is None:     # after a start or a failed write: what the server holds now
                    old = api.get_namespaced_custom_object_status(*where, _request_timeout=TIMEOUT_S).get("status")
                    if old is None:   # a JSON patch needs the status there: made, leaving any kopf wrote since
                        api.patch_namespaced_custom_object_status(*where, {"status": {}}, _request_timeout=TIMEOUT_S,
                                                                  _content_type="application/merge-patch+json")
                        old = {}
                patch = status_patch(old, record)
                if patch:
                    api.patch_namespaced_custom_object_status(*where, patch, _request_timeout=TIMEOUT_S,
                                                              _content_type="application/json-patch+json")
            except Exception as err:  # ApiException, urllib3's errors after its retries: the timer tries again
                self._written.pop(job_id, None)
                if getattr(err, "status", None) == 404:   # the TfsnJob is gone: nothing to keep
                    return True
                log.warning("cannot write the status of %s %s/%s (tried again): %s", KIND, namespace, name,
                            " ".join(str(err).split())[:300])
                return False
            self._written[job_id] = record
            return True


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
        self.writer = StatusWriter(self._record_of, self._custom_objects)
        self.store.on_change = self.writer.changed
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._serving = False
        self._custom_api: Any = None
        self._job_ids: dict[str, int] = {}   # job_key -> controller job id
        self._tainted: set[str] = set()       # ids of failed nodes whose host is tainted (also in .status)

    def start(self, reconcile: bool = True) -> None:
        """Serve agents, write statuses and run the controller's loop in threads (kopf keeps the event loop);
        without `reconcile` the caller drives `controller.reconcile` itself (tests)."""
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
        meta, data = body["metadata"], dict(body.get("spec") or {})
        job = self._job_of(body)
        if job is None and (body.get("status") or {}).get("jobId") is not None:
            return self.adopt(body)   # admitted before this operator started: its pods may be running
        if job is None:
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
            job = self.store.create_job(spec.name, spec.model_dump(mode="json"), job_key(meta),
                                        secrets.token_urlsafe(32))
            self._job_ids[job_key(meta)] = job.id
        durable = self._prepare(body, job).checkpoint_claim is not None
        self.controller.wake.set()
        return {"conditions": [c.model_dump(by_alias=True) for c in (
            _condition([], "Valid", True, "SpecValid"),
            _condition([], "CheckpointsDurable", durable, "PersistentVolumeClaim" if durable else "EmptyDir",
                       "" if durable else "checkpoints are kept in each pod's emptyDir and lost with the pod. To "
                       f"fix: annotate the {KIND} with {CLAIM_ANNOTATION}: <a PersistentVolumeClaim>"))]}

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

    # ---- .status: the store ---------------------------------------------------------------------
    def _record_of(self, job_id: int) -> tuple[str, str, dict[str, Any]] | None:
        """The `.status` keys the writer owns, from the store: everything the controller needs to carry
        the job on. None for a job no TfsnJob of this operator runs (any longer)."""
        try:
            job = self.store.job(job_id)
        except StoreError:
            return None
        where = tfsnjob_of(job)
        if where is None or str(job.id) not in self.provider.bindings:   # released: its TfsnJob is going
            return None
        nodes = []
        for node in self.store.nodes(job.id):
            data = (node.handle or {}).get("data", {})
            nodes.append(NodeStatus(
                id=node.id, rank=node.rank, state=node.state.value, pod=data.get("pod", ""),
                host=self.provider.hosts.get(node.id) or node.host, failure=node.failure,
                tainted=node.id in self._tainted, addr=node.addr, offer=node.offer,
                heard=node.heartbeat_at is not None, created_at=node.created_at,
                provisioned_at=node.provisioned_at, released=node.released))
        status = TfsnJobStatus(
            phase=job.state.value.title(), job_id=job.id, attempt=job.attempt, step=job.step, restarts=job.restarts,
            checkpoint={"step": job.checkpoint_step, "path": job.checkpoint_path}, nodes=nodes, message=job.error,
            record=JobRecord(
                spec=job.spec, attempt_state=job.attempt_state, attempt_changed_at=job.attempt_changed_at,
                attempt_started_at=job.attempt_started_at, master_port=job.master_port,
                stop_requested=bool(job.stop_requested), last_failure=job.last_failure,
                restored_step=job.restored_step, step_time=job.step_time, checkpoint_at=job.checkpoint_at,
                checkpoint_request=job.checkpoint_request, pending_replace=job.pending_replace,
                pending_reason=job.pending_reason, plan=job.plan, blocked=job.blocked, health=job.health,
                created_at=job.created_at, finished_at=job.finished_at))
        return (*where, status.model_dump(by_alias=True, exclude={"conditions"}))

    def _restored(self, body: dict[str, Any], token: str) -> tuple[Job, list[Node]] | None:
        """The controller job and nodes a TfsnJob's `.status` records; None if it records no job."""
        meta, raw = body["metadata"], body.get("status") or {}
        try:
            status = TfsnJobStatus.model_validate({k: v for k, v in raw.items() if k in RECORD_KEYS})
            state = JobState(status.phase.upper())
            node_states = [NodeState(n.state) for n in status.nodes]
        except (ValidationError, ValueError):   # not a record this operator wrote
            return None
        record = status.record
        if record is None or status.job_id is None or not record.spec:
            return None     # written by an operator that kept no record
        now = time.time()
        job = Job(id=status.job_id, name=str(record.spec.get("name") or meta["name"]), state=state,
                  spec=record.spec, spec_path=job_key(meta), token=token, created_at=record.created_at or now,
                  updated_at=now, attempt=status.attempt, attempt_state=record.attempt_state,
                  attempt_changed_at=record.attempt_changed_at, attempt_started_at=record.attempt_started_at,
                  master_port=record.master_port, restarts=status.restarts, stop_requested=int(record.stop_requested),
                  error=status.message, last_failure=record.last_failure, step=status.step,
                  step_time=record.step_time, restored_step=record.restored_step,
                  checkpoint_step=status.checkpoint.step, checkpoint_path=status.checkpoint.path,
                  finished_at=record.finished_at, checkpoint_at=record.checkpoint_at,
                  checkpoint_request=record.checkpoint_request, pending_replace=record.pending_replace,
                  pending_reason=record.pending_reason, plan=record.plan, blocked=record.blocked, health=record.health)
        nodes = []
        for n, state_ in zip(status.nodes, node_states):
            pod, failure, released = n.pod, n.failure, n.released
            if state_ == NodeState.REQUESTED:   # its pod may or may not exist: made sure it does not (the sweep)
                pod, failure, released = dns_label(n.id), "the operator restarted before its pod was confirmed", False
                state_ = NodeState.TERMINATED
            handle = NodeHandle("kubernetes", n.id, {"namespace": meta["namespace"], "pod": pod,
                                                     "context": self.provider.context}).__dict__ if pod else None
            nodes.append(Node(id=n.id, job_id=job.id, rank=n.rank, provider="kubernetes", state=state_,
                              handle=handle, created_at=n.created_at, updated_at=n.created_at,
                              heartbeat_at=now if n.heard else None, failure=failure, offer=n.offer, addr=n.addr,
                              host=n.host, provisioned_at=n.provisioned_at, released=released))
        return job, nodes

    # ---- start / resume -------------------------------------------------------------------------
    def adopt_all(self) -> None:
        """At start, before any handler: every TfsnJob's controller job re-created from its `.status`."""
        api = self._custom_objects()
        try:
            if self.settings.namespace:
                listed = api.list_namespaced_custom_object(GROUP, VERSION, self.settings.namespace, PLURAL,
                                                           _request_timeout=TIMEOUT_S)
            else:
                listed = api.list_cluster_custom_object(GROUP, VERSION, PLURAL, _request_timeout=TIMEOUT_S)
        except Exception as err:   # the resume handlers adopt them one by one instead
            log.warning("cannot list %ss to adopt them (each is adopted as kopf resumes it): %s", KIND, err)
            return
        for body in listed.get("items", []):
            status = body.get("status") or {}
            if status.get("jobId") is not None and status.get("phase") not in _TERMINAL:
                self.adopt(body)

    def adopt(self, body: dict[str, Any]) -> dict[str, Any]:
        """A TfsnJob seen at start: carry on with its controller job, re-created from `.status` if the store
        lacks it. Returns the conditions to write, if any."""
        status = body.get("status") or {}
        job = self._job_of(body)
        if job is not None:
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
        job = self._resume(body)
        if job is None:
            return self._restart(body)
        return {}

    def _resume(self, body: dict[str, Any]) -> Job | None:
        """Re-create the controller job and its nodes from `.status`, with the token from the job's Secret,
        and keep its pods: their agents go on reporting to this operator. None where that cannot be."""
        meta, status = body["metadata"], body.get("status") or {}
        token = self._token(meta["namespace"], _token_secret(meta["name"]))
        restored = self._restored(body, token) if token else None
        if restored is None:
            return None
        job, nodes = restored
        try:
            self.store.job(job.id)
            return None   # the id is another job's (a TfsnJob admitted before this one was resumed)
        except StoreError:
            pass
        self._prepare(body, job)   # its pods' binding, before the controller's loop can see the job
        message = (f"{job.state.value}: adopted {KIND} {meta['namespace']}/{meta['name']} from its status (attempt "
                   f"{job.attempt}, {job.restarts} restart(s), checkpoint at step {job.checkpoint_step or 0})")
        if not self.store.restore(job, nodes, message):
            self.provider.bindings.pop(str(job.id), None)
            return None
        self._job_ids[job_key(meta)] = job.id
        self._tainted.update(n["id"] for n in status.get("nodes", []) if n.get("tainted"))
        self.provider.hosts.update({n.id: n.host for n in nodes if n.host})
        self._delete_strangers(body, {n.handle["data"]["pod"] for n in nodes if n.handle})
        self.controller.wake.set()
        return self.store.job(job.id)

    def _restart(self, body: dict[str, Any]) -> dict[str, Any]:
        """No record to carry the job on from (a status written by an older operator, the Secret gone, the
        id taken): a new controller job restarts every rank from the checkpoint the status names."""
        meta, status = body["metadata"], body.get("status") or {}
        self._delete_strangers(body, set())
        conditions = self.admit({**body, "status": {}})
        job = self._job_of(body)
        if job is None:
            return conditions
        checkpoint = status.get("checkpoint") or {}
        self.store.update_job(job.id, attempt=int(status.get("attempt", 0)), restarts=int(status.get("restarts", 0)),
                              checkpoint_step=checkpoint.get("step"), checkpoint_path=checkpoint.get("path", ""),
                              step=int(status.get("step", 0)))
        self.store.add_event(job.id, "operator", f"adopted {KIND} {meta['namespace']}/{meta['name']} (was job "
                             f"{status['jobId']}) without its record; restarting from the checkpoint at step "
                             f"{checkpoint.get('step') or 0}")
        return conditions

    def _token(self, namespace: str, secret: str) -> str | None:
        """The job token kept in the job's Secret (the agents of its pods present it), None if unreadable."""
        try:
            return self.provider.read_secret(namespace, secret, TOKEN_KEY)
        except ProviderError as err:
            log.warning("%s", err)
            return None

    def _delete_strangers(self, body: dict[str, Any], known: set[str]) -> None:
        """Delete the TfsnJob's pods that no node of its record owns (made after the last status write)."""
        meta = body["metadata"]
        for pod in self.provider.pods_of(meta["namespace"], meta["uid"]):
            if pod not in known:
                self.provider.delete_pod(meta["namespace"], pod)

    # ---- timer ----------------------------------------------------------------------------------
    def sync(self, body: dict[str, Any]) -> dict[str, Any]:
        """Taint the hosts of failed nodes whose taint was refused, write `.status` again where a write
        failed, and return the conditions' changes (kopf writes them)."""
        job = self._job_of(body)
        if job is None:
            return {}
        for node in self.store.nodes(job.id):
            host = self.provider.hosts.get(node.id) or node.host
            if node.state == NodeState.FAILED and host and node.id not in self._tainted:
                self._taint(job, node, host)
        self.writer.write(job.id)
        previous = (body.get("status") or {}).get("conditions", [])
        phase = job.state.value.title()
        conditions = [c.model_dump(by_alias=True) for c in (
            _condition(previous, "Valid", True, "SpecValid"),
            _condition(previous, "Running", job.state == JobState.RUNNING, phase, job.error))]
        conditions += [c for c in previous if c.get("type") not in ("Valid", "Running")]
        return {} if conditions == previous else {"conditions": conditions}

    def newly_tainted(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        """(host, failure) of the nodes tainted since `body`'s status was written: a Kubernetes event each."""
        job = self._job_of(body)
        if job is None:
            return []
        was = {n.get("id") for n in (body.get("status") or {}).get("nodes", []) if n.get("tainted")}
        return [(self.provider.hosts.get(n.id) or n.host, n.failure) for n in self.store.nodes(job.id)
                if n.id in self._tainted and n.id not in was]

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
        """Ask the controller to stop the job; True once it has (its pods are deleted, its status written)."""
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
        self.writer.write(job.id)
        self.provider.bindings.pop(str(job.id), None)
        return True


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


@kopf.on.startup()
def start(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.WARNING   # Kubernetes events for problems, not for every handler run
    memo.tfsn = Operator(OperatorSettings.from_env())
    memo.tfsn.start()
    memo.tfsn.adopt_all()


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
    patch.status.update(memo.tfsn.sync(dict(body)))
    for host, failure in memo.tfsn.newly_tainted(dict(body)):
        kopf.warn(body, reason="NodeTainted", message=f"{UNHEALTHY_TAINT} on {host}: {failure}")


@kopf.on.update(*RESOURCE, field="spec")
def update(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(memo.tfsn.spec_changed(dict(body)))


@kopf.on.delete(*RESOURCE)
def delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if not memo.tfsn.release(dict(body)):
        raise kopf.TemporaryError("stopping the job's pods", delay=2)
