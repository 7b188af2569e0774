"""Adoption: an operator that starts (a new pod, an upgrade, a crash) carries on the TfsnJobs under way.

The TfsnJob's `.status` is the job's durable store; the operator's SQLite store a working cache that may
be lost with its pod. At start, every TfsnJob is listed, the job ids their statuses hold are reserved (a
job admitted meanwhile never takes one), their controller jobs and nodes are re-created from `.status`
under their old ids (the token is in the job's Secret), so the worker pods' agents carry on reporting;
only then are the jobs that cannot be carried on restarted from their checkpoint. A TfsnJob that cannot
be adopted now (its Secret unreadable, the API server refusing) is left to kopf's resume handler.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from orchestrator.control.store import Job, JobState, StoreError
from orchestrator.k8s.crd import GROUP, KIND, PLURAL, VERSION
from orchestrator.k8s.status import restored_job
from providers.base import NotFoundError, ProviderError
from providers.kubernetes import TIMEOUT_S, TOKEN_KEY
from providers.naming import dns_label

if TYPE_CHECKING:
    from orchestrator.k8s.runtime import Operator

LIST_TRIES = 3                  # listing the TfsnJobs at start, before the startup handler fails (kopf retries it)
LIST_BACKOFF_S = 1.0            # 1 s, then 2 s between those tries
TERMINAL_PHASES = {s.value.title() for s in JobState if s.terminal}
log = logging.getLogger("tfsn.operator")


class Adoption:
    """Re-creates controller jobs from the TfsnJobs' statuses, or restarts them from their checkpoints."""

    def __init__(self, operator: Operator) -> None:
        self.op = operator

    def adopt_all(self) -> None:
        """At start, before any handler: every TfsnJob's controller job re-created from its `.status`.

        The ids every status holds are reserved first and every job that can be carried on is restored
        before any is restarted: a restart is a new job, which must not take an id a later TfsnJob holds.
        A TfsnJob that cannot be adopted now is left to the resume handler; ProviderError if the TfsnJobs
        cannot be listed (the startup handler fails, and kopf runs it again)."""
        bodies = self._listed()
        held = [(b.get("status") or {}).get("jobId") for b in bodies]   # terminal ones too
        self.op.store.reserve_job_ids(max((i for i in held if isinstance(i, int)), default=0))
        restarts = []
        for body in bodies:
            status = body.get("status") or {}
            if status.get("jobId") is None or status.get("phase") in TERMINAL_PHASES:
                continue
            with _adopting(body):
                if self.op.job_of(body) is not None:
                    self.adopt(body)
                elif self._resume(body) is None:
                    restarts.append(body)
        for body in restarts:
            with _adopting(body):
                self._restart(body)

    def _listed(self) -> list[dict[str, Any]]:
        """The TfsnJobs of the namespace the operator watches (all, cluster-wide), tried LIST_TRIES times."""
        api, namespace = self.op.custom_objects(), self.op.settings.namespace
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
        job = self.op.job_of(body)
        if job is not None:      # the store outlived the operator's container
            self._remember(status)
            self.op.prepare(body, job)
            return {}
        if status.get("jobId") is None:          # never admitted (the operator stopped first), or invalid
            if refused(status) or status.get("phase") in TERMINAL_PHASES:
                return {}
            self._delete_strangers(body, set())  # pods of an admission whose record never reached .status
            return self.op.admit(body)
        if status.get("phase") in TERMINAL_PHASES:
            return {}
        if self._resume(body) is None:
            return self._restart(body)
        return {}

    def _remember(self, status: dict[str, Any]) -> None:
        """What only `.status` keeps of a job's nodes: the hosts tainted for them, and where each one ran."""
        for node in status.get("nodes") or []:
            if node.get("id") and node.get("tainted"):
                self.op.taints.tainted.add(node["id"])
            if node.get("id") and node.get("host"):
                self.op.provider.hosts.setdefault(node["id"], node["host"])

    def _resume(self, body: dict[str, Any]) -> Job | None:
        """Re-create the controller job and its nodes from `.status`, with the token from the job's Secret,
        and keep its pods: their agents go on reporting to this operator. None where that cannot be."""
        meta, status = body["metadata"], body.get("status") or {}
        token = self._token(meta["namespace"], token_secret(meta["name"]))
        restored = restored_job(status, meta["name"], meta["namespace"], job_key(meta), token,
                                self.op.provider.context) if token else None
        if restored is None:
            return None
        job, nodes = restored
        try:
            self.op.store.job(job.id)
            return None   # the id is another job's (one whose status holds the same id)
        except StoreError:
            pass
        self.op.prepare(body, job)   # its pods' binding, before the controller's loop can see the job
        try:   # all before the job is in the store: the controller's loop, running, may make a pod at once
            self._remember(status)
            self._delete_strangers(body, {n.handle["data"]["pod"] for n in nodes if n.handle})
        except BaseException:
            self.op.provider.bindings.pop(str(job.id), None)
            raise
        message = (f"{job.state.value}: adopted {KIND} {meta['namespace']}/{meta['name']} from its status (attempt "
                   f"{job.attempt}, {job.restarts} restart(s), checkpoint at step {job.checkpoint_step or 0})")
        if not self.op.store.restore(job, nodes, message):
            self.op.provider.bindings.pop(str(job.id), None)
            return None
        self.op.remember_job(meta, job.id)
        self.op.controller.wake.set()
        return self.op.store.job(job.id)

    def _restart(self, body: dict[str, Any]) -> dict[str, Any]:
        """No record to carry the job on from (a status written by an older operator, the Secret gone, the
        id taken): a new controller job restarts every rank from the checkpoint the status names, with the
        spec the job ran with (the TfsnJob's own spec where the status has none this operator can read)."""
        meta, status = body["metadata"], body.get("status") or {}
        recorded = (status.get("record") or {}).get("spec") if isinstance(status.get("record"), dict) else None
        spec, problem = self.op.checked_spec(body, dict(recorded), written=False) \
            if isinstance(recorded, dict) and recorded else (None, "")
        if spec is None:
            spec, problem = self.op.checked_spec(body, dict(body.get("spec") or {}))
        if spec is None:    # said before any pod is deleted
            return self.op.invalid(body, problem)
        self._delete_strangers(body, set())
        job = self.op.create_job(body, spec)
        checkpoint = status.get("checkpoint") or {}   # recorded before anything may fail: a retry finds it whole
        self.op.store.update_job(job.id, attempt=int(status.get("attempt", 0)),
                                 restarts=int(status.get("restarts", 0)), checkpoint_step=checkpoint.get("step"),
                                 checkpoint_path=checkpoint.get("path", ""), step=int(status.get("step", 0)))
        self.op.store.add_event(job.id, "operator", f"adopted {KIND} {meta['namespace']}/{meta['name']} (was job "
                                f"{status['jobId']}) without its record; restarting from the checkpoint at step "
                                f"{checkpoint.get('step') or 0}")
        return self.op.admit({**body, "status": {}})

    def _token(self, namespace: str, secret: str) -> str | None:
        """The job token kept in the job's Secret (the agents of its pods present it); None only when the
        Secret or its key is absent. Any other failure (a 503, a timeout, a 403) is raised: a job is never
        restarted, its pods deleted, because its Secret could not be read just now."""
        try:
            return self.op.provider.read_secret(namespace, secret, TOKEN_KEY)
        except NotFoundError:
            return None

    def _delete_strangers(self, body: dict[str, Any], known: set[str]) -> None:
        """Delete the TfsnJob's pods that no node of its record owns (made after the last status write)."""
        meta = body["metadata"]
        for pod in self.op.provider.pods_of(meta["namespace"], meta["uid"]):
            if pod not in known:
                self.op.provider.delete_pod(meta["namespace"], pod)


def refused(status: dict[str, Any]) -> bool:
    """Was the TfsnJob's spec refused (a Valid=False condition, no job made)?"""
    return status.get("jobId") is None and any(c.get("type") == "Valid" and c.get("status") == "False"
                                               for c in status.get("conditions", []))


def job_key(meta: dict[str, Any]) -> str:
    """The controller job's `spec_path` of a TfsnJob: how the two find each other."""
    return f"tfsnjob://{meta['namespace']}/{meta['name']}?uid={meta['uid']}"


def token_secret(name: str) -> str:
    """The Secret holding the job token of TfsnJob `name`."""
    return dns_label(f"{name}-tfsn-token")


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
