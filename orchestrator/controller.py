"""The controller: drives every job through its state machine, from the store.

PENDING -> PROVISIONING -> RUNNING -> (RECOVERING -> RUNNING)* -> SUCCEEDED | FAILED | STOPPED

`reconcile(job)` is a pure function of what the store holds and what providers see, so the
controller can be killed at any point and started again: it re-reads its jobs and carries on.
Agents poll the controller (heartbeat) and get back what their node should be doing now.
"""
from __future__ import annotations

import math
import os
import re
import secrets
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from health.findings import Action, FindingKind
from health.metrics import Metrics
from health.telemetry import Sample
from orchestrator.home import job_dir
from orchestrator.placement import plan_for
from orchestrator.planner import Blocklist, FailedAttempt, NoCapacityError, PlanError, PlannedOffer
from orchestrator.spec import JobSpec
from orchestrator.store import Job, JobState, Node, NodeState, Store
from orchestrator.watch import JobWatch, health_config
from providers.base import CapacityError, NodeHandle, NodeRequest, NodeStatus, Offer, Provider, ProviderError
from providers.registry import load_provider

STOP_GRACE_S = 15.0           # how long a failed attempt waits for every node to report before deciding
DEFAULT_START_TIMEOUT_S = 900.0  # a new node gets this long to send its first heartbeat, unless its provider says
# A node to be replaced waits this long for the checkpoint asked of the job first (or 30 steps).
REPLACE_CHECKPOINT_WAIT_S = 60.0
# A worker killed by one of these is blamed on its node (OOM killer, hardware, kill -9), not the code.
NODE_FAULT_SIGNALS = {9, 7, 11, 6}  # SIGKILL, SIGBUS, SIGSEGV, SIGABRT
_RANK_PREFIX = re.compile(r"^(\[rank\d+\]:\s*)+")
DEFAULT_STATUS_POLL_S = 10.0  # how often a provider is asked about a node unless it says otherwise
# What a remote node's agent is given from this machine's environment (how to install tfsn there).
REMOTE_SETTINGS = ("TFSN_INSTALL_SPEC",)
TRANSIENT_TRIES = 5           # a provisioning request that fails transiently this often in a row is blocked
RELEASE_RETRY_S = 30.0        # how often a node whose termination failed is terminated again
PLAN_KEEP = 50                # ranked candidates kept in the store for failover


def requested_cpus(spec: JobSpec) -> int | None:
    """The vCPUs each node asks for (None: the provider's default)."""
    return int(spec.resources.cpus.count) if spec.resources.cpus else None


def free_port() -> int:
    """A TCP port free on loopback now, for the workers' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Controller:
    """Reconciles active jobs; serves as the API's `Handlers`."""

    def __init__(self, store: Store, home: Path, providers: dict[str, Provider], url: str = "") -> None:
        self.store = store
        self.home = home
        self.providers = providers
        self.url = url                      # set once the API server listens
        self.started_at = time.time()       # no node is blamed for silence while no controller listened
        self.wake = threading.Event()       # set by the API when something happened
        self.metrics = Metrics()            # tfsn_* series, served by the daemon
        self._watches: dict[int, JobWatch] = {}
        self._seen: dict[str, tuple[float, NodeStatus]] = {}   # node id -> (when, provider status)
        self._release_tried: dict[str, float] = {}              # node id -> when a terminate last failed
        self._backoff: dict[int, tuple[int, float]] = {}        # job id -> (transient failures in a row, retry at)
        self._log_lock = threading.Lock()

    # ---- API handlers -------------------------------------------------------------------------
    def heartbeat(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        node = self._node_of(job_id, node_id)
        self.store.update_node(node_id, heartbeat_at=time.time(), agent_state=str(body.get("state", "")),
                               addr=str(body.get("addr") or node.addr), host=str(body.get("host") or node.host))
        # Only a STARTING node becomes READY: the loop may have failed it meanwhile.
        if body.get("state") == "ready" and self.store.promote_node(node_id, NodeState.STARTING, NodeState.READY):
            self._event(job_id, "node", f"node {node_id} ready" + (f" (rank {node.rank})" if node.rank is not None
                                                                      else " (spare)"))
            self.wake.set()
        return self.command(self.store.job(job_id), self.store.node(node_id))

    def result(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        self._node_of(job_id, node_id)
        signal = body.get("signal")
        self.store.record_result(job_id, node_id, int(body["attempt"]), int(body["returncode"]),
                                 None if signal is None else int(signal), bool(body.get("stopped")),
                                 str(body.get("summary", ""))[-4000:])
        self.wake.set()
        return {}

    def logs(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]:
        lines = [str(line) for line in body.get("lines", [])]
        self._append_log(job_id, lines)
        return {}

    def telemetry(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]:
        """Step records and heartbeats of one rank; the answer asks for a checkpoint when one is wanted."""
        attempt, rank, records = int(body["attempt"]), int(body["rank"]), list(body["records"])
        self.store.record_steps(job_id, attempt, rank, records)
        watch = self._watches.get(job_id)
        if watch is not None:
            heartbeat = body.get("heartbeat")
            watch.observe(attempt, rank, records, None if heartbeat is None else float(heartbeat))
        job = self.store.job(job_id)
        return {"checkpoint": job.checkpoint_request} if job.checkpoint_request > job.checkpoint_at else {}

    def samples(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """GPU samples (NVML, DCGM) from a node's agent."""
        self._node_of(job_id, node_id)
        watch = self._watches.get(job_id)
        if watch is not None:
            for raw in body.get("samples", []):
                watch.observe_device(Sample(**{**raw, "node": node_id}))
        return {}

    def checkpoint(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]:
        step, path = int(body["step"]), str(body["path"])
        if body.get("restored"):
            self.store.update_job(job_id, restored_step=step)
            self._event(job_id, "checkpoint", f"restored step {step} from {path}")
        else:
            self.store.update_job(job_id, checkpoint_step=step, checkpoint_path=path, checkpoint_at=time.time())
            self._event(job_id, "checkpoint", f"saved step {step} in {body.get('seconds', 0):.2f}s to {path}")
        return {}

    def command(self, job: Job, node: Node) -> dict[str, Any]:
        """What `node`'s agent must do now: setup, idle, run an attempt, or exit."""
        if job.state.terminal or not node.state.active:
            return {"action": "exit"}
        spec = JobSpec.model_validate(job.spec)
        if node.state == NodeState.STARTING:
            return {"action": "setup", "setup": spec.setup or "", "workdir": spec.workdir}
        if node.rank is None or job.state != JobState.RUNNING or job.attempt_state != "running":
            return {"action": "idle"}
        return {"action": "run", "attempt": job.attempt, "run": spec.run, "workdir": spec.workdir,
                "nnodes": spec.num_nodes, "node_rank": node.rank, "nproc_per_node": spec.nprocs(),
                "master_addr": self._master_addr(job), "master_port": job.master_port,
                "env": self._worker_env(job, spec)}

    def _master_addr(self, job: Job) -> str:
        """Where the workers meet: rank 0's node, as its agent reported it (loopback on one machine)."""
        first = next((n for n in self.store.nodes(job.id, active_only=True) if n.rank == 0), None)
        if first is None or getattr(self._provider(first.provider), "shares_host", False) or not first.addr:
            return "127.0.0.1"
        return first.addr

    def _worker_env(self, job: Job, spec: JobSpec) -> dict[str, str]:
        ckpt = spec.checkpoint
        env = {**spec.envs, "TFSN_ATTEMPT": str(job.attempt), "TFSN_NUM_NODES": str(spec.num_nodes),
               "TFSN_CHECKPOINT_DIR": ckpt.dir or str(job_dir(job.id, self.home) / "checkpoints"),
               "TFSN_JOB_NAME": job.name}
        # The spec overrides the script's own settings only where the user wrote them down.
        if "interval" in ckpt.model_fields_set:
            env["TFSN_CHECKPOINT_INTERVAL"] = str(ckpt.interval)
        if "keep" in ckpt.model_fields_set:
            env["TFSN_CHECKPOINT_KEEP"] = str(ckpt.keep)
        if spec.steps is not None:
            env["TFSN_STEPS"] = str(spec.steps)
        ranked = [n for n in self.store.nodes(job.id, active_only=True) if n.rank is not None]
        shared = ranked and all(getattr(self._provider(n.provider), "shares_host", False) for n in ranked)
        if shared and "OMP_NUM_THREADS" not in spec.envs:
            # Nodes that share this machine split its cores instead of each taking all of them.
            cpus = requested_cpus(spec) or max(1, (os.cpu_count() or 1) // spec.num_nodes)
            env["OMP_NUM_THREADS"] = str(max(1, cpus // spec.nprocs()))
        return env

    def _node_of(self, job_id: int, node_id: str) -> Node:
        node = self.store.node(node_id)
        if node.job_id != job_id:
            raise ValueError(f"node {node_id} is not part of job {job_id}")
        return node

    # ---- logs and events ----------------------------------------------------------------------
    def _append_log(self, job_id: int, lines: list[str]) -> None:
        if not lines:
            return
        with self._log_lock, open(job_dir(job_id, self.home) / "job.log", "a") as log:
            log.write("".join(line.rstrip("\n") + "\n" for line in lines))

    def _event(self, job_id: int, kind: str, message: str) -> None:
        self.store.add_event(job_id, kind, message)
        self._append_log(job_id, [f"[tfsn] {message}"])

    def _transition(self, job: Job, new: JobState, message: str = "", **changes: Any) -> None:
        self.store.transition(job.id, new, message, **changes)
        if new.terminal and self._watches.pop(job.id, None) is not None:
            self.metrics.forget(str(job.id))
        self._append_log(job.id, [f"[tfsn] job {job.id} {new.value}" + (f": {message}" if message else "")])

    # ---- the loop -----------------------------------------------------------------------------
    def run_forever(self, stop: threading.Event, idle_exit_s: float) -> None:
        """Reconcile every active job until `stop` is set or nothing was active for `idle_exit_s`."""
        self.reconcile_intents()
        idle_since = time.monotonic()
        while not stop.is_set():
            self.wake.clear()
            active = self.store.jobs(active_only=True)
            for job in active:
                try:
                    self.reconcile(job.id)
                except Exception:  # one broken job must not stop the others
                    print(f"job {job.id}: reconcile failed\n{traceback.format_exc()}", flush=True)
            self.sweep_releases()
            if active or self.store.unreleased_nodes():
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > idle_exit_s:
                return
            self.wake.wait(0.5)

    def reconcile_intents(self) -> None:
        """Nodes recorded but maybe never created (a crash between the two): make sure none leaks."""
        for job in self.store.jobs(active_only=True):
            for node in self.store.nodes(job.id, active_only=True):
                if node.state == NodeState.REQUESTED:
                    try:
                        self._terminate(node)
                    except Exception:  # a provider bug must not keep the controller from starting
                        print(f"node {node.id}: terminate failed\n{traceback.format_exc()}", flush=True)
                    self.store.update_node(node.id, state=NodeState.TERMINATED,
                                           failure="controller restarted before the node was confirmed")

    def reconcile(self, job_id: int) -> None:
        """One step of the job's state machine."""
        job = self.store.job(job_id)
        if job.stop_requested:
            self._teardown(job)
            self._transition(job, JobState.STOPPED, "stopped by the user")
            return
        spec = JobSpec.model_validate(job.spec)
        if job.state == JobState.PENDING:
            try:
                plan = plan_for(spec, self.providers)
            except (PlanError, ProviderError) as err:
                self._transition(job, JobState.FAILED, str(err), error=str(err))
                return
            candidates = [c.to_record() for c in plan.ranked(PLAN_KEEP)]
            self._transition(job, JobState.PROVISIONING, f"{spec.num_nodes} node(s) on {_describe(plan.chosen)}"
                             + ("" if plan.chosen == plan.naive else
                                f" (the cheapest per hour, {_describe(plan.naive)}, would cost "
                                f"${plan.naive.cost:,.2f})"), plan=candidates)
            job = self.store.job(job_id)
        self._check_nodes(job, spec)
        if job.state in (JobState.PROVISIONING, JobState.RECOVERING):
            self._provision(self.store.job(job_id), spec)
        elif job.state == JobState.RUNNING:
            self._watch_attempt(self.store.job(job_id), spec)

    # ---- nodes --------------------------------------------------------------------------------
    def _provider(self, name: str) -> Provider:
        if name not in self.providers:
            self.providers[name] = load_provider(name)
        return self.providers[name]

    def _check_nodes(self, job: Job, spec: JobSpec) -> None:
        """Fail every node whose agent is gone or silent."""
        now = time.time()
        timeout = spec.health.heartbeat_timeout
        for node in self.store.nodes(job.id, active_only=True):
            if node.handle is None:
                continue
            status = self._status(node, now)
            # A VM boots and installs tfsn before its agent speaks; a local process speaks at once.
            start_timeout = getattr(self._provider(node.provider), "start_timeout_s", DEFAULT_START_TIMEOUT_S)
            first_timeout = max(timeout, start_timeout)
            if status == NodeStatus.TERMINATED:
                self._fail_node(job, node, "the node's agent exited")
            elif node.heartbeat_at is None and now - max(node.provisioned_at or node.created_at,
                                                         self.started_at) > first_timeout:
                if status == NodeStatus.PENDING and node.offer is not None:
                    # never scheduled (a Kubernetes pod with no room, a VM stuck in a queue): no room for this
                    # offer (Kubernetes offers have no zone: a wider block would take the whole cluster)
                    self._block(job, node.offer, node.spot, f"node {node.id} still pending after "
                                f"{first_timeout:.0f}s", "offer")
                self._fail_node(job, node, f"no heartbeat within {first_timeout:.0f}s of start")
            elif node.heartbeat_at is not None and now - max(node.heartbeat_at, self.started_at) > timeout:
                self._fail_node(job, node, f"no heartbeat for {now - node.heartbeat_at:.0f}s")

    def _status(self, node: Node, now: float) -> NodeStatus:
        """The provider's view of a node, asked at most every `status_poll_s` (cloud APIs are rate limited)."""
        provider = self._provider(node.provider)
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

    def _fail_node(self, job: Job, node: Node, reason: str) -> None:
        self.store.update_node(node.id, state=NodeState.FAILED, failure=reason)
        self._event(job.id, "node", f"node {node.id} failed: {reason}")
        self._terminate(node)

    def _terminate(self, node: Node) -> None:
        """Ask the provider to delete the node; until it confirms, `released` stays 0 and the loop asks again."""
        self._seen.pop(node.id, None)
        handle = NodeHandle(**node.handle) if node.handle else _intended_handle(node)
        try:
            self._provider(node.provider).terminate(handle)
        except ProviderError as err:  # the job goes on without that node either way; the sweep retries
            if node.id not in self._release_tried:
                self._event(node.job_id, "node", f"node {node.id} could not be terminated yet: {err}")
            self._release_tried[node.id] = time.monotonic()
            return
        self._release_tried.pop(node.id, None)
        self.store.update_node(node.id, released=True)

    def sweep_releases(self) -> None:
        """Terminate again the nodes whose termination the provider has not confirmed (every RELEASE_RETRY_S)."""
        for node in self.store.unreleased_nodes():
            if time.monotonic() - self._release_tried.get(node.id, -math.inf) > RELEASE_RETRY_S:
                try:
                    self._terminate(node)
                except Exception:   # a provider bug must not stop the loop
                    print(f"node {node.id}: terminate failed\n{traceback.format_exc()}", flush=True)

    def _candidate(self, job: Job, spec: JobSpec) -> PlannedOffer | None:
        """The best planned offer that no provisioning failure has ruled out. The store keeps the plan's
        best PLAN_KEEP; when blocks used them all up (or the job predates plans), plan again."""
        blocked = _blocklist(job)
        for record in job.plan:
            candidate = PlannedOffer.from_record(record)
            if not blocked.blocks(candidate.offer):
                return candidate
        try:
            plan = plan_for(spec, self.providers)
        except (PlanError, ProviderError):
            return None
        fresh = [c for c in plan.ranked() if not blocked.blocks(c.offer)][:PLAN_KEEP]
        if not fresh:
            return None
        self.store.update_job(job.id, plan=[c.to_record() for c in fresh])
        return fresh[0]

    def _create_node(self, job: Job, spec: JobSpec, rank: int | None) -> None:
        """Record the node, then ask the provider for it (the order keeps crashes from leaking nodes).

        A provisioning error blocks what its scope says (the offer, zone, region or provider) and the
        next node goes to the next candidate of the plan; nodes already placed elsewhere follow it,
        since one job's nodes must share a zone.
        """
        if time.monotonic() < self._backoff.get(job.id, (0, 0.0))[1]:
            return   # the last request hit a transient error (throttling, network): wait before the next
        candidate = self._candidate(job, spec)
        if candidate is None:
            reason = str(NoCapacityError(_blocklist(job).history))
            self._teardown(job)
            self._transition(job, JobState.FAILED, reason, error=reason)
            return
        offer = candidate.offer
        provider = self._provider(offer.provider)
        local = getattr(provider, "shares_host", False)
        unreachable = None if local else _unreachable(self.url)
        if unreachable:
            self._teardown(job)
            self._transition(job, JobState.FAILED, unreachable, error=unreachable)
            return
        ranked_sites = {_site(n.offer) for n in self.store.nodes(job.id, active_only=True)
                        if n.rank is not None and n.offer is not None}
        if rank is None and ranked_sites and ranked_sites != {_site(asdict(offer))}:
            return   # a spare serves only where the ranks are: none while its site there is blocked
        self._gather(job, offer)
        # Unique beyond this store: the local provider finds a node's processes by its id.
        node_id = f"{job.name}-{job.id}-n{len(self.store.nodes(job.id))}-{secrets.token_hex(2)}"
        self.store.add_node(node_id, job.id, rank, provider.name, offer=asdict(offer), spot=candidate.spot)
        log = job_dir(job.id, self.home) / f"{node_id}.log"
        request = NodeRequest(
            job_id=str(job.id), node_id=node_id, workdir=spec.workdir, log_path=str(log),
            command=agent_command(local), cpus=requested_cpus(spec),
            env=agent_env(self.url, job, node_id, local), offer=offer, spot=candidate.spot,
            avoid_hosts=self._excluded_hosts(job, spec), placement=spec.placement(provider.name))
        try:
            handle = provider.provision(request)
        except Exception as err:  # a provider bug or an OS error must not leave the node REQUESTED
            if not isinstance(err, ProviderError):
                err = ProviderError(f"{type(err).__name__}: {err}", provider=provider.name)
            self.store.update_node(node_id, state=NodeState.FAILED, failure=str(err))
            # The cloud may have taken the request before the error (a timeout after EC2 accepted the
            # ClientToken, an operation that failed half-way): make sure nothing is left running.
            self._terminate(self.store.node(node_id))
            failures = self._backoff.get(job.id, (0, 0.0))[0] + 1
            if err.retryable and not isinstance(err, CapacityError) and failures < TRANSIENT_TRIES:
                # throttled or unreachable: the same request may well succeed; try it again, later
                self._backoff[job.id] = (failures, time.monotonic() + min(60.0, 2.0 ** failures))
                self._event(job.id, "node", f"node {node_id} could not be created on {_describe(candidate)}: {err} "
                            f"(transient, attempt {failures} of {TRANSIENT_TRIES}; trying again)")
                return
            self._backoff.pop(job.id, None)
            self._block(job, asdict(offer), candidate.spot, str(err), err.scope)
            following = self._candidate(self.store.job(job.id), spec)
            self._event(job.id, "node", f"node {node_id} could not be created on {_describe(candidate)}: {err} "
                        f"(blocked this {err.scope}; " + (f"next: {_describe(following)})" if following
                                                          else "no candidate left)"))
            return
        self._backoff.pop(job.id, None)
        self.store.update_node(node_id, state=NodeState.STARTING, handle=handle.__dict__, provisioned_at=time.time())
        role = f"rank {rank}" if rank is not None else "spare"
        self._event(job.id, "node", f"node {node_id} provisioned on {_describe(candidate)} ({role})")

    def _excluded_hosts(self, job: Job, spec: JobSpec) -> tuple[str, ...]:
        """The machines under the nodes the health policy replaced: a new node must not land there."""
        policy = self._watch(job, spec).policy
        return tuple(sorted({n.host for n in self.store.nodes(job.id) if n.host and policy.is_excluded(n.id)}))

    def _block(self, job: Job, offer: dict[str, Any], spot: bool, error: str, scope: str) -> None:
        """Rule out `scope` around `offer` for the rest of the job (kept in the store, read by _candidate)."""
        blocked = self.store.job(job.id).blocked
        self.store.update_job(job.id, blocked=blocked + [{"offer": offer, "spot": spot, "error": error,
                                                          "scope": scope}])

    def _gather(self, job: Job, offer: Offer) -> None:
        """Release the job's nodes that are not where its next node goes (they are recreated there)."""
        here = _site(asdict(offer))
        for node in self.store.nodes(job.id, active_only=True):
            if node.offer is not None and _site(node.offer) != here:
                self._terminate(node)
                self.store.update_node(node.id, state=NodeState.TERMINATED,
                                       failure=f"moved with the job to {offer.provider}/{offer.zone or offer.region}")
                self._event(job.id, "node", f"node {node.id} released: the job moves to "
                            f"{offer.provider}/{offer.zone or offer.region}")

    def _provision(self, job: Job, spec: JobSpec) -> None:
        """Give every rank a node (a spare first), keep the spares topped up, then start an attempt."""
        # Nodes created that never came up (no heartbeat). Refused requests are failover's business (the
        # plan's candidates bound them); nodes lost after they ran are charged to max_restarts.
        failed = [n for n in self.store.nodes(job.id)
                  if n.state == NodeState.FAILED and n.handle is not None and n.heartbeat_at is None]
        budget = spec.num_nodes + spec.recovery.spares + spec.recovery.max_restarts + 2
        if len(failed) > budget:
            reason = f"{len(failed)} nodes failed to start; last: {failed[-1].failure}"
            self._teardown(job)
            self._transition(job, JobState.FAILED, reason, error=reason)
            return
        setup_failure = next((r for r in self.store.results(job.id, 0) if r.returncode != 0), None)
        if setup_failure is not None:
            reason = f"setup failed on node {setup_failure.node_id}: {setup_failure.summary}"
            self._teardown(job)
            self._transition(job, JobState.FAILED, reason, error=reason)
            return
        nodes = self.store.nodes(job.id, active_only=True)
        ranked = {n.rank: n for n in nodes if n.rank is not None}
        spares = [n for n in nodes if n.rank is None]
        for rank in range(spec.num_nodes):
            if rank in ranked:
                continue
            spare = next((s for s in sorted(spares, key=lambda s: s.state != NodeState.READY)), None)
            if spare is not None:
                spares.remove(spare)
                self.store.update_node(spare.id, rank=rank)
                self._event(job.id, "node", f"spare node {spare.id} takes rank {rank}")
            else:
                self._create_node(job, spec, rank)
            if self.store.job(job.id).state.terminal:
                return
        for _ in range(spec.recovery.spares - len(spares)):
            self._create_node(job, spec, None)
            if self.store.job(job.id).state.terminal:
                return
        nodes = self.store.nodes(job.id, active_only=True)
        ready = [n for n in nodes if n.rank is not None and n.state == NodeState.READY]
        first = next((n for n in ready if n.rank == 0), None)
        if (spec.num_nodes > 1 and first is not None and not first.addr
                and not getattr(self._provider(first.provider), "shares_host", False)):
            # the other nodes' workers would wait for a rendezvous on loopback until they time out
            self._fail_node(job, first, "its agent reported no address the other nodes can reach")
            return
        if len(ready) == spec.num_nodes:
            attempt = job.attempt + 1
            self._watch(job, spec).start_attempt(attempt, self._rank_nodes(ready, spec))
            self._transition(job, JobState.RUNNING, f"attempt {attempt} on " + ", ".join(
                n.id for n in sorted(ready, key=lambda n: n.rank)), attempt=attempt, attempt_state="running",
                attempt_changed_at=time.time(), attempt_started_at=time.time(), master_port=free_port())
            self.wake.set()

    # ---- health -------------------------------------------------------------------------------
    def _watch(self, job: Job, spec: JobSpec) -> JobWatch:
        watch = self._watches.get(job.id)
        if watch is None:
            watch = self._watches[job.id] = JobWatch(job.id, health_config(spec.health.model_dump()), self.metrics)
            watch.policy.restore(job.health)   # cooldowns and exclusions outlive a controller restart
        return watch

    @staticmethod
    def _rank_nodes(nodes: list[Node], spec: JobSpec) -> list[str]:
        """The node of every global rank: torchrun numbers ranks node by node."""
        by_rank = {n.rank: n.id for n in nodes}
        return [by_rank[r // spec.nprocs()] for r in range(spec.num_nodes * spec.nprocs())]

    def _act_on_health(self, job: Job, spec: JobSpec) -> None:
        """Findings become events; decisions become checkpoints, node replacements or a failed attempt."""
        watch = self._watch(job, spec)
        ranked = [n for n in self.store.nodes(job.id, active_only=True) if n.rank is not None]
        if len(ranked) == spec.num_nodes:  # e.g. after a controller restart
            watch.start_attempt(job.attempt, self._rank_nodes(ranked, spec))
        now = time.time()
        findings, decisions = watch.check(now)
        for finding in findings:
            self._event(job.id, "finding", f"{finding.kind.value} ({finding.severity.value}) on "
                        f"{finding.node or 'the job'}: {finding.evidence}")
        nodes = {n.id: n for n in ranked}
        for decision in decisions:
            if decision.action == Action.CHECKPOINT:
                self.store.update_job(job.id, checkpoint_request=now)
                self._event(job.id, "health", f"checkpoint requested: {decision.reason}")
            elif decision.action == Action.FAIL:
                self.store.update_job(job.id, attempt_state="stopping", attempt_changed_at=now,
                                      pending_reason=decision.reason)
                self._event(job.id, "health", f"failing attempt {job.attempt}: {decision.reason}")
            elif decision.action == Action.REPLACE_NODE and decision.node in nodes:
                self.store.update_job(job.id, health=watch.policy.state())   # it excluded the node
                if decision.finding.kind == FindingKind.HANG:  # a stuck rank cannot take part in a save
                    self._fail_node(job, nodes[decision.node], decision.reason)
                else:
                    self.store.update_job(job.id, checkpoint_request=now, pending_replace=decision.node,
                                          pending_reason=decision.reason)
                    self._event(job.id, "health", f"checkpointing, then replacing {decision.node}: {decision.reason}")
        job = self.store.job(job.id)
        if job.pending_replace:
            waited = now - job.checkpoint_request
            saved = job.checkpoint_at >= job.checkpoint_request
            if saved or waited > max(REPLACE_CHECKPOINT_WAIT_S, 30 * (job.step_time or 0)):
                node = nodes.get(job.pending_replace)
                self.store.update_job(job.id, pending_replace="")
                if node is not None:
                    self._fail_node(job, node, job.pending_reason + ("" if saved else " (no checkpoint in time)"))
        if job.step_time:
            done = job.step + 1 - (job.restored_step or 0)
            self.metrics.goodput(watch.label, min(1.0, done * job.step_time / max(1e-9, now - job.attempt_started_at)))

    # ---- attempts -----------------------------------------------------------------------------
    def _watch_attempt(self, job: Job, spec: JobSpec) -> None:
        running = job.attempt_state == "running"
        if running:
            self._act_on_health(job, spec)  # may fail a node or the attempt: read the state after it
            job = self.store.job(job.id)
        nodes = {n.id: n for n in self.store.nodes(job.id)}
        ranked = [n for n in nodes.values() if n.rank is not None and n.state.active]
        results = self.store.results(job.id, job.attempt)
        by_node = {r.node_id: r for r in results}
        if running:
            failures = [r for r in results if r.returncode != 0]
            if len(ranked) < spec.num_nodes or failures or job.attempt_state == "stopping":
                what = failures[0].summary if failures else job.pending_reason or "a node failed"
                self.store.update_job(job.id, attempt_state="stopping", attempt_changed_at=time.time())
                self._event(job.id, "attempt", f"attempt {job.attempt} failed: {what}; stopping all ranks")
                self.wake.set()
            elif len(ranked) == spec.num_nodes and all(by_node.get(n.id) for n in ranked):
                self._teardown(job)
                self._transition(job, JobState.SUCCEEDED, f"all {spec.num_nodes} node(s) finished")
            return
        # stopping: wait until every live ranked node reported (or the grace ran out), then decide
        waiting = [n for n in ranked if n.id not in by_node]
        if waiting and time.time() - job.attempt_changed_at < STOP_GRACE_S:
            return
        self._recover(job, spec, nodes, results)

    def _recover(self, job: Job, spec: JobSpec, nodes: dict[str, Node], results: list[Any]) -> None:
        """Blame nodes, replace them, and restart every rank from the checkpoint (or give up)."""
        first_failures = [r for r in results if r.returncode != 0 and not r.stopped]
        blamed = [r for r in first_failures if r.signal in NODE_FAULT_SIGNALS]
        for r in blamed:
            node = nodes[r.node_id]
            if node.state.active:
                self._fail_node(job, node, f"a worker was killed by signal {r.signal}")
        dead = [n for n in nodes.values() if n.state == NodeState.FAILED and n.updated_at >= job.attempt_started_at]
        infra = bool(blamed) or bool(dead) or not first_failures
        summary = first_failures[0].summary if first_failures else "; ".join(
            f"{n.id}: {n.failure}" for n in dead) or job.pending_reason or "a node was lost"
        # The same error on another rank is still the same error.
        signature = f"{'node' if infra else _RANK_PREFIX.sub('', summary)}|{job.checkpoint_step}"
        if not infra and signature == job.last_failure:
            reason = f"failed the same way twice with no progress in between: {summary}"
            self._teardown(job)
            self._transition(job, JobState.FAILED, reason, error=reason)
            return
        if job.restarts >= spec.recovery.max_restarts:
            reason = f"gave up after {job.restarts} restart(s) (recovery.max_restarts); last failure: {summary}"
            self._teardown(job)
            self._transition(job, JobState.FAILED, reason, error=reason)
            return
        self._transition(job, JobState.RECOVERING, f"restart {job.restarts + 1} of {spec.recovery.max_restarts}"
                         f" from the checkpoint at step {job.checkpoint_step or 0}: {summary}",
                         restarts=job.restarts + 1, attempt_state="idle", attempt_changed_at=time.time(),
                         last_failure=signature, pending_replace="", pending_reason="")
        self.metrics.restart(str(job.id))
        self.wake.set()

    def _teardown(self, job: Job) -> None:
        for node in self.store.nodes(job.id, active_only=True):
            self._terminate(node)
            self.store.update_node(node.id, state=NodeState.TERMINATED)


def _describe(candidate: PlannedOffer) -> str:
    offer = candidate.offer
    where = offer.zone or offer.region
    what = offer.instance_type + (f" ({offer.accelerator_count}x {offer.accelerator})" if offer.accelerator else "")
    parts = [offer.provider + ("" if where == offer.provider else f"/{where}")]
    parts += [what] if what != offer.provider else []
    return " ".join(parts + (["spot"] if candidate.spot else []))


def _site(offer: dict[str, Any]) -> tuple:
    """Where and on what a node runs, as far as keeping a job's nodes alike and together is concerned."""
    return offer["provider"], offer["region"], offer["zone"], offer["instance_type"]


def _intended_handle(node: Node) -> NodeHandle:
    """How to find a node that was recorded but never confirmed: its id, and where it was asked for."""
    where = {k: node.offer[k] for k in ("region", "zone") if node.offer and node.offer.get(k)}
    return NodeHandle(node.provider, node.id, data=where)


def _unreachable(url: str) -> str | None:
    """Why nodes elsewhere could not reach the controller at `url`, or None."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in ("", "0.0.0.0", "::") or host == "localhost" or host.startswith("127.") or host == "::1":
        return (f"cloud nodes could not reach this controller at {url or 'an unset address'}. To fix: restart it "
                "with TFSN_API_HOST=0.0.0.0 and TFSN_API_ADVERTISE=<an address the nodes reach> (and TFSN_API_PORT "
                "for a fixed port): `tfsn controller stop`, then launch again")
    return None


def _blocklist(job: Job) -> Blocklist:
    """What the job's failed provisioning attempts rule out (rebuilt from the store)."""
    blocked = Blocklist()
    for entry in job.blocked:
        offer = Offer(**entry["offer"])
        blocked.block(offer, entry["scope"])
        blocked.history.append(FailedAttempt(offer, entry["spot"], entry["error"], entry["scope"]))
    return blocked


def agent_command(local: bool = True) -> list[str]:
    """How a node starts its agent: with this very Python here, with the node's own Python elsewhere."""
    return [sys.executable if local else "python3", "-m", "orchestrator.agent"]


def agent_env(url: str, job: Job, node_id: str, local: bool = True) -> dict[str, str]:
    """The agent's environment: the controller's address and the job's secret. A local node inherits
    this process's environment; a remote one gets only tfsn's settings (never this machine's credentials,
    paths or devices: they would end up in the VM's metadata)."""
    job_specific = {"TFSN_CONTROLLER_URL", "TFSN_TOKEN", "TFSN_JOB_ID", "TFSN_NODE_ID", "TFSN_HOME"}
    keep = {k: v for k, v in os.environ.items()
            if k not in job_specific and (local or k in REMOTE_SETTINGS)}
    return {**keep, "TFSN_CONTROLLER_URL": url, "TFSN_TOKEN": job.token, "TFSN_JOB_ID": str(job.id),
            "TFSN_NODE_ID": node_id}
