"""A job's nodes as the providers see them: liveness checks, failing and releasing nodes.

A node is released by asking its provider to terminate it; until the provider confirms, the store keeps
`released` false and `sweep_releases` asks again, so a refused or failed delete never leaks a machine.
"""
from __future__ import annotations

import math
import time
import traceback
from dataclasses import asdict
from typing import Any

from orchestrator.control.boot import BOOT_FAILURES_PER_OFFER, failed_boots_on
from orchestrator.control.context import ControlContext
from orchestrator.control.store import Job, JobState, Node, NodeState
from orchestrator.planning.planner import blocked_record
from orchestrator.spec import JobSpec
from providers.base import NodeHandle, NodeStatus, Offer, ProviderError

DEFAULT_START_TIMEOUT_S = 900.0  # a new node gets this long to send its first heartbeat, unless its provider says
DEFAULT_STATUS_POLL_S = 10.0     # how often a provider is asked about a node unless it says otherwise
RELEASE_RETRY_S = 30.0           # how often a node whose termination failed is terminated again


class Nodes:
    """Liveness and release of nodes; what the provisioning, recovery and health parts call to fail one."""

    def __init__(self, ctx: ControlContext) -> None:
        self.ctx = ctx
        self.started_at = time.time()   # no node is blamed for silence while no controller listened
        self._seen: dict[str, tuple[float, NodeStatus]] = {}   # node id -> (when, provider status)
        self._release_tried: dict[str, float] = {}              # node id -> when a terminate last failed

    def check(self, job: Job, spec: JobSpec) -> None:
        """Fail every node whose agent is gone or silent."""
        now = time.time()
        timeout = spec.health.heartbeat_timeout
        for node in self.ctx.store.nodes(job.id, active_only=True):
            if node.handle is None:
                continue
            if node.boot_failure:   # its boot script said why it failed (and powered the machine off)
                self._boot_failed(job, node)
                continue
            status = self._status(node, now)
            # A VM boots and installs tfsn before its agent speaks; a local process speaks at once.
            start_timeout = getattr(self.ctx.provider(node.provider), "start_timeout_s", DEFAULT_START_TIMEOUT_S)
            first_timeout = max(timeout, start_timeout)
            if status == NodeStatus.TERMINATED:
                self.fail(job, node, "the node's agent exited")
            elif node.heartbeat_at is None and now - max(node.provisioned_at or node.created_at,
                                                         self.started_at) > first_timeout:
                if status == NodeStatus.PENDING and node.offer is not None:
                    # never scheduled (a Kubernetes pod with no room, a VM stuck in a queue): no room for this
                    # offer (Kubernetes offers have no zone: a wider block would take the whole cluster)
                    self.block(job, node.offer, node.spot, f"node {node.id} still pending after "
                               f"{first_timeout:.0f}s", "offer")
                self.fail(job, node, f"no heartbeat within {first_timeout:.0f}s of start")
            elif node.heartbeat_at is not None and now - max(node.heartbeat_at, self.started_at) > timeout:
                self.fail(job, node, f"no heartbeat for {now - node.heartbeat_at:.0f}s")

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
        """The provider's view of a node, asked at most every `status_poll_s` (cloud APIs are rate limited)."""
        provider = self.ctx.provider(node.provider)
        seen = self._seen.get(node.id)
        if seen is not None and now - seen[0] < getattr(provider, "status_poll_s", DEFAULT_STATUS_POLL_S):
            return seen[1]
        try:
            status = provider.status(NodeHandle(**node.handle))
        except ProviderError as err:   # transient: the heartbeat timeout still catches a dead node
            print(f"node {node.id}: status failed: {err}", flush=True)
            status = NodeStatus.UNKNOWN
        self._seen[node.id] = (now, status)
        return status

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
        """Ask the provider to delete the node; until it confirms, `released` stays 0 and the loop asks again."""
        self._seen.pop(node.id, None)
        handle = NodeHandle(**node.handle) if node.handle else _intended_handle(node)
        try:
            self.ctx.provider(node.provider).terminate(handle)
        except ProviderError as err:  # the job goes on without that node either way; the sweep retries
            if node.id not in self._release_tried:
                self.ctx.event(node.job_id, "node", f"node {node.id} could not be terminated yet: {err}")
            self._release_tried[node.id] = time.monotonic()
            return
        self._release_tried.pop(node.id, None)
        self.ctx.store.update_node(node.id, released=True)

    def release(self, node: Node, failure: str = "") -> None:
        """Terminate a node the job no longer wants (not a fault of the node's)."""
        self.terminate(node)
        self.ctx.store.update_node(node.id, state=NodeState.TERMINATED, **({"failure": failure} if failure else {}))

    def teardown(self, job: Job) -> None:
        for node in self.ctx.store.nodes(job.id, active_only=True):
            self.release(node)

    def give_up(self, job: Job, reason: str) -> None:
        """Release every node of the job and fail it with `reason` as its error."""
        self.teardown(job)
        self.ctx.transition(job, JobState.FAILED, reason, error=reason)

    def sweep_releases(self) -> None:
        """Terminate again the nodes whose termination the provider has not confirmed (every RELEASE_RETRY_S)."""
        for node in self.ctx.store.unreleased_nodes():
            if time.monotonic() - self._release_tried.get(node.id, -math.inf) > RELEASE_RETRY_S:
                try:
                    self.terminate(node)
                except Exception:   # a provider bug must not stop the loop
                    print(f"node {node.id}: terminate failed\n{traceback.format_exc()}", flush=True)

    def reconcile_intents(self) -> None:
        """Nodes recorded but maybe never created (a crash between the two): make sure none leaks."""
        for job in self.ctx.store.jobs(active_only=True):
            for node in self.ctx.store.nodes(job.id, active_only=True):
                if node.state == NodeState.REQUESTED:
                    try:
                        self.terminate(node)
                    except Exception:  # a provider bug must not keep the controller from starting
                        print(f"node {node.id}: terminate failed\n{traceback.format_exc()}", flush=True)
                    self.ctx.store.update_node(node.id, state=NodeState.TERMINATED,
                                               failure="controller restarted before the node was confirmed")


def site(offer: dict[str, Any] | Offer) -> tuple:
    """Where and on what a node runs, as far as keeping a job's nodes alike and together is concerned."""
    record = asdict(offer) if isinstance(offer, Offer) else offer
    return record["provider"], record["region"], record["zone"], record["instance_type"]


def _intended_handle(node: Node) -> NodeHandle:
    """How to find a node that was recorded but never confirmed: its id, and where it was asked for."""
    where = {k: node.offer[k] for k in ("region", "zone") if node.offer and node.offer.get(k)}
    return NodeHandle(node.provider, node.id, data=where)
