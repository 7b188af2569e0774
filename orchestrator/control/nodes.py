"""A job's nodes as the providers see them: liveness checks, failing and releasing nodes.

A node is released by asking its provider to terminate it; until the provider confirms, the store keeps
`released` false and `sweep_releases` asks again, so a refused or failed delete never leaks a machine.
Status and terminate calls run off the loop (calls.py): a check uses the status the last call returned,
and a node whose create is still in flight is terminated once that call has returned.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Any

from orchestrator.control.boot import BOOT_FAILURES_PER_OFFER, failed_boots_on
from orchestrator.control.calls import Call, deadline_s
from orchestrator.control.context import ControlContext
from orchestrator.control.stalls import Gap, Pardons, Stalls
from orchestrator.control.store import Job, JobState, Node, NodeState
from orchestrator.planning.planner import blocked_record
from orchestrator.spec import JobSpec
from providers.base import NodeHandle, NodeStatus, Offer, ProviderError

DEFAULT_START_TIMEOUT_S = 900.0  # a new node gets this long to send its first heartbeat, unless its provider says
DEFAULT_STATUS_POLL_S = 10.0     # how often a provider is asked about a node unless it says otherwise
RELEASE_RETRY_S = 30.0           # a node whose termination failed is terminated again after this, doubled
RELEASE_RETRY_MAX_S = 600.0      # at each failure in a row up to this (it is never given up: that would leak it)


class Nodes:
    """Liveness and release of nodes; what the provisioning, recovery and health parts call to fail one."""

    def __init__(self, ctx: ControlContext, pass_s: float) -> None:
        """`pass_s`: the loop's longest sleep between two passes (what a stall of the controller is measured by)."""
        self.ctx = ctx
        self.started_at = time.time()   # no node is blamed for silence while no controller listened ...
        self.stalls = Stalls(pass_s)    # ... nor, once per silence, while this one did not run (stalls.py)
        self._pardons = Pardons()
        self._checked: dict[int, float] = {}   # job id -> its last check (its stalls since are new)
        self._seen: dict[str, tuple[float, NodeStatus]] = {}   # node id -> (when, provider status)
        self._release_retry: dict[str, tuple[int, float]] = {}  # node id -> (terminates failed in a row, retry at)

    def check(self, job: Job, spec: JobSpec) -> None:
        """Fail every node whose agent is gone or silent; silence while the controller stalled is pardoned once."""
        now = self.stalls.ran()
        timeout = spec.health.heartbeat_timeout
        stalls = self.stalls.since(self._checked.get(job.id, -math.inf), timeout)
        self._checked[job.id] = now
        pardoned: set[Gap] = set()   # the new stalls without which a node would be failed now
        for node in self.ctx.store.nodes(job.id, active_only=True):
            if node.handle is None:
                continue
            if node.boot_failure:   # its boot script said why it failed (and powered the machine off)
                self._boot_failed(job, node)
                continue
            status = self._status(node, now)
            if status == NodeStatus.TERMINATED:
                self.fail(job, node, "the node's agent exited")
                continue
            # A VM boots and installs tfsn before its agent speaks; a local process speaks at once.
            start_timeout = getattr(self.ctx.provider(node.provider), "start_timeout_s", DEFAULT_START_TIMEOUT_S)
            limit = timeout if node.heartbeat_at is not None else max(timeout, start_timeout)
            heard = max(node.heartbeat_at or node.provisioned_at or node.created_at, self.started_at)
            since = self._pardons.window(node.id, heard, stalls)
            if now - since <= limit:
                if now - heard > limit:
                    pardoned.update(g for g in stalls if g.end == since)
                continue
            stalled = f" ({now - since:.0f}s since the controller ran again after a stall)" if since > heard else ""
            if node.heartbeat_at is not None:
                self.fail(job, node, f"no heartbeat for {now - node.heartbeat_at:.0f}s{stalled}")
                continue
            if status == NodeStatus.PENDING and node.offer is not None:
                # never scheduled (a Kubernetes pod with no room, a VM stuck in a queue): no room for this
                # offer (Kubernetes offers have no zone: a wider block would take the whole cluster)
                self.block(job, node.offer, node.spot, f"node {node.id} still pending after {limit:.0f}s", "offer")
            self.fail(job, node, f"no heartbeat within {limit:.0f}s of start{stalled}")
        for stall in sorted(pardoned):
            self.ctx.event(job.id, "node", f"controller stalled for {stall.seconds:.0f}s: heartbeat clocks restarted")

    def forget(self, job_id: int) -> None:
        """The job ended: drop when it was last checked."""
        self._checked.pop(job_id, None)

    def _boot_failed(self, job: Job, node: Node) -> None:
        """Fail a node whose boot failed; BOOT_FAILURES_PER_OFFER of them on one offer block it for the job."""
        self.fail(job, node, node.failure or "its boot failed")
        if node.offer is None or node.heartbeat_at is not None:
            return
        failed = failed_boots_on(self.ctx, job, node.offer)
        if failed >= BOOT_FAILURES_PER_OFFER:
            self.block(job, node.offer, node.spot, f"{failed} nodes failed to boot; last: {node.failure}", "offer")
            self.ctx.event(job.id, "node", f"{failed} nodes failed to boot on {node.offer['instance_type']} in "
                                           f"{node.offer.get('zone') or node.offer['region']}: not asked for again")

    def _status(self, node: Node, now: float) -> NodeStatus:
        """The provider's view of a node as its last status call returned it (UNKNOWN before any); a new call is
        started at most every `status_poll_s` (cloud APIs are rate limited)."""
        provider = self.ctx.provider(node.provider)
        seen = self._seen.get(node.id)
        if seen is None or now - seen[0] >= getattr(provider, "status_poll_s", DEFAULT_STATUS_POLL_S):
            handle = NodeHandle(**node.handle)
            self.ctx.calls.start(("status", node.id), provider.name, f"{provider.name}: status of node {node.id}",
                                 lambda: provider.status(handle), deadline_s(provider, "status"),
                                 lambda call: self._saw(node.id, call), wakes=False)
        seen = self._seen.get(node.id)   # where the caller waits for its calls, this call's answer
        return seen[1] if seen is not None else NodeStatus.UNKNOWN

    def _saw(self, node_id: str, call: Call) -> None:
        status = call.value
        if call.error is not None:   # transient: the heartbeat timeout still catches a dead node
            print(f"node {node_id}: status failed: {call.error}", flush=True)
            status = NodeStatus.UNKNOWN
        if self.ctx.store.node(node_id).state.active:
            self._seen[node_id] = (time.time(), status)

    def block(self, job: Job, offer: dict[str, Any], spot: bool, error: str, scope: str) -> None:
        """Rule out `scope` around `offer` for the rest of the job (kept in the store, read by provisioning)."""
        blocked = self.ctx.store.job(job.id).blocked
        self.ctx.store.update_job(job.id, blocked=blocked + [blocked_record(Offer(**offer), spot, error, scope)])

    def fail(self, job: Job, node: Node, reason: str) -> None:
        """Mark the node failed and release it; recovery restarts the job without it."""
        self.ctx.store.update_node(node.id, state=NodeState.FAILED, failure=reason)
        self.ctx.event(job.id, "node", f"node {node.id} failed: {reason}")
        self.terminate(node)

    def terminate(self, node: Node) -> None:
        """Ask the provider to delete the node, off the loop; until it confirms, `released` stays 0 and the sweep
        asks again (also where a call for the node, its create, is still in flight: it goes first)."""
        self._seen.pop(node.id, None)
        self._pardons.forget(node.id)
        self.ctx.calls.cancel(("change", node.id))   # a create still queued need not run: delete what may exist
        handle = NodeHandle(**node.handle) if node.handle else _intended_handle(node)
        try:
            provider = self.ctx.provider(node.provider)
        except ProviderError as err:
            self._terminated(node, err)
            return
        self.ctx.calls.start(("change", node.id), provider.name, f"{provider.name}: terminate of node {node.id}",
                             lambda: provider.terminate(handle), deadline_s(provider, "terminate"),
                             lambda call: self._terminated(node, call.error))

    def _terminated(self, node: Node, error: BaseException | None) -> None:
        if error is None:
            self._release_retry.pop(node.id, None)
            self.ctx.store.update_node(node.id, released=True)
            return
        if not isinstance(error, ProviderError):   # a provider bug: say so, and try again like any failure
            print(f"node {node.id}: terminate failed: {type(error).__name__}: {error}", flush=True)
        failures = self._release_retry.get(node.id, (0, 0.0))[0] + 1
        if failures == 1:   # the job goes on without that node either way; the sweep retries
            self.ctx.event(node.job_id, "node", f"node {node.id} could not be terminated yet: {error}")
        wait = min(RELEASE_RETRY_MAX_S, RELEASE_RETRY_S * 2 ** (failures - 1))
        self._release_retry[node.id] = (failures, time.monotonic() + wait)

    def release(self, node: Node, failure: str = "") -> None:
        """Terminate a node the job no longer wants (not a fault of the node's)."""
        self.terminate(node)
        self.ctx.store.update_node(node.id, state=NodeState.TERMINATED, **({"failure": failure} if failure else {}))

    def teardown(self, job: Job) -> None:
        """Release every node of the job: their terminate calls run side by side."""
        for node in self.ctx.store.nodes(job.id, active_only=True):
            self.release(node)

    def give_up(self, job: Job, reason: str) -> None:
        """Release every node of the job and fail it with `reason` as its error."""
        self.teardown(job)
        self.ctx.transition(job, JobState.FAILED, reason, error=reason)

    def sweep_releases(self) -> None:
        """Terminate again the nodes whose termination the provider has not confirmed (with backoff, see
        RELEASE_RETRY_S, and never while a call for the node is in flight)."""
        for node in self.ctx.store.unreleased_nodes():
            if (not self.ctx.calls.busy(("change", node.id))
                    and time.monotonic() >= self._release_retry.get(node.id, (0, -math.inf))[1]):
                self.terminate(node)

    def reconcile_intents(self) -> None:
        """Nodes recorded but maybe never created (a crash between the two): make sure none leaks."""
        for job in self.ctx.store.jobs(active_only=True):
            for node in self.ctx.store.nodes(job.id, active_only=True):
                if node.state == NodeState.REQUESTED:
                    self.ctx.store.update_node(node.id, state=NodeState.TERMINATED,
                                               failure="controller restarted before the node was confirmed")
                    self.terminate(node)


def workers_per_node(spec: JobSpec, nodes: list[Node]) -> int:
    """The job's workers per node on these nodes: `nproc_per_node: auto` is one per accelerator of the offer the
    planner chose for them (all of a job's nodes share one), not of the spec's first choice."""
    offer = next((n.offer for n in nodes if n.offer), None)
    return spec.nprocs(offer["accelerator_count"] if offer is not None else None)


def site(offer: dict[str, Any] | Offer) -> tuple:
    """Where and on what a node runs, as far as keeping a job's nodes alike and together is concerned."""
    record = asdict(offer) if isinstance(offer, Offer) else offer
    return record["provider"], record["region"], record["zone"], record["instance_type"]


def _intended_handle(node: Node) -> NodeHandle:
    """How to find a node that was recorded but never confirmed: its id, and where it was asked for."""
    where = {k: node.offer[k] for k in ("region", "zone") if node.offer and node.offer.get(k)}
    return NodeHandle(node.provider, node.id, data=where)
