"""A TfsnJob's `.status` as the durable store of its controller job: the translation both ways, and the
thread that writes it.

The operator's SQLite store is a cache that may be lost with its pod; `.status` is what outlives it. So
`.status` holds everything the controller needs to carry a job on (its record, its nodes), kept small
enough for an object in etcd: nodes that no longer matter are dropped, long texts clipped (see
`status_record`). It is read back by an operator of any version: fields it does not know are ignored
(`crd.known_fields`), so that rolling the operator back never restarts a job.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from pydantic import ValidationError

from orchestrator.k8s.crd import GROUP, KIND, PLURAL, VERSION, JobRecord, NodeStatus, TfsnJobStatus, known_fields
from orchestrator.spec import JobSpec
from orchestrator.control.store import Job, JobState, Node, NodeState
from providers.base import NodeHandle
from providers.kubernetes import TIMEOUT_S
from providers.naming import dns_label

# .status keys the StatusWriter owns; the handlers own `conditions` (kopf writes them, and its own notes)
RECORD_KEYS = tuple(f.alias or n for n, f in TfsnJobStatus.model_fields.items() if n != "conditions")
TEXT_LIMIT = 300          # characters of a failure or error kept in .status (the events have them whole)
SIGNATURE_LIMIT = 1000    # the previous failure's signature: compared whole to spot "failed the same way twice"
SETTLED_NODES = 16        # released nodes kept beyond those the controller still reads
BLOCKED_LIMIT = 50        # newest failed provisioning requests kept
RETRY_S = 2.0             # a write refused (or broken) is tried again after this
log = logging.getLogger("tfsn.operator")


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that sets the `.status` keys of `new` that differ from `old`, each whole.
    Not a merge patch: that would drop the nulls the record holds (an offer's zone, a checkpoint's step);
    not the whole status: the rest of it is kopf's."""
    return [{"op": "add", "path": f"/status/{key}", "value": value} for key, value in new.items()
            if key not in old or old[key] != value]


def _clipped(text: str, limit: int = TEXT_LIMIT) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def kept_nodes(job: Job, nodes: list[Node], tainted: set[str]) -> list[Node]:
    """The nodes `.status` keeps: those the controller still reads after a restart (active ones, deletions
    not yet confirmed, nodes that never started: the start-failure budget, nodes whose machine is excluded
    or tainted, the node waiting to be replaced), and the newest SETTLED_NODES of the rest."""
    excluded = set((job.health or {}).get("excluded", []))

    def needed(n: Node) -> bool:
        return (n.state.active or not n.released or n.id in tainted or n.id in excluded or n.host in excluded
                or n.id == job.pending_replace
                or (n.state == NodeState.FAILED and n.handle is not None and n.heartbeat_at is None))
    settled = [n.id for n in nodes if not needed(n)]
    kept = set(settled[-SETTLED_NODES:])
    return [n for n in nodes if needed(n) or n.id in kept]


def status_record(job: Job, nodes: list[Node], hosts: dict[str, str], tainted: set[str]) -> dict[str, Any]:
    """The `.status` keys the writer owns, from the store: everything the controller needs to carry the
    job on (see `kept_nodes` for which nodes)."""
    shown = []
    for node in kept_nodes(job, nodes, tainted):
        data = (node.handle or {}).get("data", {})
        shown.append(NodeStatus(
            id=node.id, rank=node.rank, state=node.state.value, pod=data.get("pod", ""),
            host=hosts.get(node.id) or node.host, failure=_clipped(node.failure), tainted=node.id in tainted,
            addr=node.addr, offer=node.offer, heard=node.heartbeat_at is not None, created_at=node.created_at,
            updated_at=node.updated_at, provisioned_at=node.provisioned_at, released=node.released))
    blocked = [{**b, "error": _clipped(str(b.get("error", "")))} for b in job.blocked[-BLOCKED_LIMIT:]]
    status = TfsnJobStatus(
        phase=job.state.value.title(), job_id=job.id, attempt=job.attempt, step=job.step, restarts=job.restarts,
        checkpoint={"step": job.checkpoint_step, "path": job.checkpoint_path}, nodes=shown,
        message=_clipped(job.error), record=JobRecord(
            spec=job.spec, attempt_state=job.attempt_state, attempt_changed_at=job.attempt_changed_at,
            attempt_started_at=job.attempt_started_at, master_port=job.master_port,
            stop_requested=bool(job.stop_requested), last_failure=_clipped(job.last_failure, SIGNATURE_LIMIT),
            restored_step=job.restored_step, step_time=job.step_time, checkpoint_at=job.checkpoint_at,
            checkpoint_request=job.checkpoint_request, pending_replace=job.pending_replace,
            pending_reason=_clipped(job.pending_reason), plan=job.plan, blocked=blocked, health=job.health,
            created_at=job.created_at, finished_at=job.finished_at))
    return status.model_dump(by_alias=True, exclude={"conditions"})


def restored_job(raw: dict[str, Any], name: str, namespace: str, spec_path: str, token: str,
                 context: str | None) -> tuple[Job, list[Node]] | None:
    """The controller job and nodes a TfsnJob's `.status` records (fields this operator does not know are
    ignored); None where it records no job this operator can run (no record, a spec it cannot read)."""
    try:
        status = TfsnJobStatus.model_validate(known_fields(TfsnJobStatus, {k: v for k, v in raw.items()
                                                                            if k in RECORD_KEYS}))
        state = JobState(status.phase.upper())
        node_states = [NodeState(n.state) for n in status.nodes]
    except (ValidationError, ValueError):   # not a record any operator wrote
        return None
    record = status.record
    if record is None or status.job_id is None or not record.spec:
        return None     # written by an operator that kept no record
    try:
        JobSpec.model_validate(record.spec)
    except ValidationError:   # a spec of another version of tfsn: restarted from the TfsnJob's own spec
        return None
    now = time.time()
    job = Job(id=status.job_id, name=str(record.spec.get("name") or name), state=state, spec=record.spec,
              spec_path=spec_path, token=token, created_at=record.created_at or now, updated_at=now,
              attempt=status.attempt, attempt_state=record.attempt_state,
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
        handle = NodeHandle("kubernetes", n.id, {"namespace": namespace, "pod": pod,
                                                 "context": context}).__dict__ if pod else None
        # updated_at as recorded: the controller tells a node failed in this attempt from older ones by it
        nodes.append(Node(id=n.id, job_id=job.id, rank=n.rank, provider="kubernetes", state=state_,
                          handle=handle, created_at=n.created_at, updated_at=n.updated_at or n.created_at,
                          heartbeat_at=now if n.heard else None, failure=failure, offer=n.offer, addr=n.addr,
                          host=n.host, provisioned_at=n.provisioned_at, released=released))
    return job, nodes


class StatusWriter:
    """Copies controller jobs into their TfsnJobs' `.status` as soon as the store changes.

    It runs in a thread of its own, so that a store write (an agent's heartbeat, the controller's loop)
    never waits on the API server; each write sends only the keys that differ from what it wrote last (a
    JSON patch, through the kubernetes client's timeout and bounded retries with backoff). A write that
    fails, for any reason, is tried again RETRY_S later; the thread never dies of one.
    """

    def __init__(self, record_of: Callable[[int], tuple[str, str, dict[str, Any]] | None],
                 api: Callable[[], Any]) -> None:
        self._record_of = record_of     # job id -> (namespace, name, .status keys it owns), None: not ours
        self._api = api                 # the CustomObjectsApi
        self._due: set[int] = set()
        self._retry: dict[int, float] = {}   # job id -> when to try a failed write again (monotonic)
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
        """Write what is due (failed writes included, once more), then stop."""
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(60)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._due or self._stop.is_set(), timeout=RETRY_S / 4)
                stopping, now = self._stop.is_set(), time.monotonic()
                again = {j for j, at in self._retry.items() if stopping or at <= now}
                for job_id in again:
                    del self._retry[job_id]
                due, self._due = self._due | again, set()
            for job_id in sorted(due):
                if not self.write(job_id) and not stopping:
                    with self._wake:
                        self._retry[job_id] = time.monotonic() + RETRY_S
            if stopping:
                return

    def write(self, job_id: int, wait_s: float | None = None) -> bool:
        """Bring the TfsnJob's `.status` up to date with the store now; False if that failed (the API server
        refused, the store or the cluster could not be read) or another write held it over `wait_s`."""
        if not self._write_lock.acquire(timeout=-1 if wait_s is None else wait_s):
            return False
        where: tuple[str, ...] = ()
        try:
            target = self._record_of(job_id)
            if target is None:
                self._written.pop(job_id, None)
                return True
            namespace, name, record = target
            where = (GROUP, VERSION, namespace, PLURAL, name)
            api = self._api()
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
            self._written[job_id] = record
            return True
        except Exception as err:  # ApiException, urllib3's errors after its retries, the store: tried again
            self._written.pop(job_id, None)
            if getattr(err, "status", None) == 404:   # the TfsnJob is gone: nothing to keep
                return True
            what = f"{KIND} {where[2]}/{where[4]}" if where else f"job {job_id}"
            log.warning("cannot write the status of %s (tried again): %s", what, " ".join(str(err).split())[:300])
            return False
        finally:
            self._write_lock.release()
