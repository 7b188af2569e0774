"""The controller's health watch over one job: telemetry in, decisions out.

The controller feeds every SDK record and heartbeat it receives into the job's `Monitor` (one per
attempt: ranks move to other nodes on a restart) and, on each pass of its loop, turns the
monitor's findings into the policy's decisions (one `Policy` per job, kept across attempts, so its
hysteresis and cooldowns survive restarts). Metrics for Prometheus are updated on the way.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from health.config import HealthConfig
from health.findings import Action, Decision, Finding, FindingKind
from health.metrics import Metrics
from health.hang import PhaseHistory
from health.monitor import Monitor
from health.policy import Costs, Policy
from health.telemetry import Sample, sdk_sample
from orchestrator.control.context import ControlContext
from orchestrator.control.nodes import Nodes, workers_per_node
from orchestrator.control.store import Job, Node
from orchestrator.spec import JobSpec

# A node to be replaced waits this long for the checkpoint asked of the job first (or 30 steps).
REPLACE_CHECKPOINT_WAIT_S = 60.0


def health_config(health: Mapping[str, Any]) -> HealthConfig:
    """The job's health settings: configs/health.yaml overlaid with train.yaml's `health:` section."""
    thresholds = {**health.get("thresholds", {}), "heartbeat_timeout_s": float(health["heartbeat_timeout"])}
    return HealthConfig.load({"thresholds": thresholds, "actions": dict(health.get("actions", {}))})


class JobWatch:
    """Health state of one job, shared by the API threads (observe) and the controller loop (check)."""

    def __init__(self, job_id: int, config: HealthConfig, metrics: Metrics) -> None:
        self.label = str(job_id)
        self.config = config
        self.policy = Policy(config)
        self.metrics = metrics
        self.attempt = 0
        self.phases = PhaseHistory(config)     # how long saves and evals took: kept across attempts
        # What a replacement costs this job, measured: from the last step of an attempt to the first step
        # of the next (detection, new node, start, checkpoint load, first step: all of it), and the last save.
        self.restart_s: float | None = None
        self.save_s: float | None = None
        self._last_step_at = 0.0               # of the current attempt
        self._restart_from: float | None = None
        self._monitor: Monitor | None = None
        self._rank_nodes: tuple[str, ...] = ()
        self._active: dict[tuple[str, str, int | None], str] = {}   # (kind, node, gpu) -> severity, last check
        self.checked_at = -math.inf            # the controller's stalls since are news to this job's monitor
        self._lock = threading.Lock()

    def start_attempt(self, attempt: int, rank_nodes: Sequence[str]) -> None:
        """A new attempt: a fresh monitor over the ranks' new placement."""
        with self._lock:
            if attempt == self.attempt and self._monitor is not None:
                return
            if self._last_step_at:
                self._restart_from, self._last_step_at = self._last_step_at, 0.0
            self.attempt = attempt
            self._rank_nodes = tuple(rank_nodes)
            self._monitor = Monitor(self.config, self._rank_nodes, self.phases, time.time())
            self._active = {}

    def observe(self, attempt: int, rank: int, records: list[dict[str, Any]], heartbeat: float | None) -> None:
        """One telemetry post of one rank."""
        with self._lock:
            if self._monitor is None or attempt != self.attempt or not 0 <= rank < len(self._rank_nodes):
                return  # a late post of an earlier attempt
            node = self._rank_nodes[rank]
            for record in records:
                sample = sdk_sample(node, {**record, "rank": rank})
                self._step_seen(sample.time)
                self._monitor.observe(sample)
                self.metrics.observe(self.label, sample)
            if heartbeat is not None:
                self._monitor.observe(Sample(time=heartbeat, node=node, rank=rank))

    def post(self, attempt: int, rank: int, body: Mapping[str, Any], received: float) -> None:
        """One SDK post (requests.Telemetry): the rank's phase, step records and heartbeat. The node's clock
        need not agree with the controller's, whose `now` every timeout is measured against: the rank's times
        are moved by how far its heartbeat (its clock as it sent) is from `received` (ours as it came)."""
        heartbeat = body.get("heartbeat")
        shift = 0.0 if heartbeat is None else received - float(heartbeat)
        if body.get("phase") is not None:   # first: a step that held a save closes knowing of the save
            since = body.get("phase_since")
            self.observe_phase(attempt, rank, str(body["phase"]), None if since is None else float(since) + shift,
                               {str(k): float(v) for k, v in body.get("phases", {}).items()})
        records = [{**record, "at": float(record["at"]) + shift} for record in body["records"]]
        self.observe(attempt, rank, records, None if heartbeat is None else received)

    def _step_seen(self, at: float) -> None:
        if self._restart_from is not None and at > self._restart_from:
            self.restart_s, self._restart_from = at - self._restart_from, None
        self._last_step_at = max(self._last_step_at, at)

    def saved(self, seconds: float) -> None:
        """A checkpoint was saved; `seconds`: how long the training waited for it."""
        self.save_s = seconds

    def observe_phase(self, attempt: int, rank: int, phase: str, since: float | None,
                      finished: Mapping[str, float]) -> None:
        """The phase a rank said it is in (checkpoint, eval, data; train) and the phases it finished."""
        with self._lock:
            if self._monitor is not None and attempt == self.attempt and 0 <= rank < len(self._rank_nodes):
                self._monitor.observe_phase(rank, phase, since, dict(finished))

    def observe_device(self, sample: Sample) -> None:
        """An NVML or DCGM sample from a node's agent."""
        with self._lock:
            if self._monitor is not None:
                self._monitor.observe(sample)
            self.metrics.observe(self.label, sample)

    def pardon(self, until: float) -> None:
        """The controller heard nothing until `until` (it stalled): that silence is no rank's (once per silence)."""
        with self._lock:
            if self._monitor is not None:
                self._monitor.pardon(until)

    def check(self, now: float, step_s: float | None = None,
              remaining_steps: int | None = None) -> tuple[list[Finding], list[Decision]]:
        """The findings that are new since the last check (a condition is reported by the monitor
        at every check while it lasts: the policy needs that, the log and the counters do not),
        and the policy's decisions over all current findings, with what the job's steps cost now."""
        with self._lock:
            if self._monitor is None:
                return [], []
            findings = self._monitor.check(now)
            scores = self._monitor.scores()
        self.metrics.straggler_scores(self.label, {r: float(s) for r, s in enumerate(scores) if s == s})
        active = {(f.kind.value, f.node, f.gpu): f.severity.value for f in findings}
        new = [f for f in findings if self._active.get((f.kind.value, f.node, f.gpu)) != f.severity.value]
        self._active = active
        for finding in new:
            self.metrics.finding(self.label, finding.kind.value, finding.severity.value)
        costs = Costs(step_s=step_s, remaining_steps=remaining_steps, restart_s=self.restart_s, save_s=self.save_s)
        return new, self.policy.decide(findings, now, costs)


class HealthWatch:
    """Every running job's JobWatch, and what the loop does with their decisions: events for findings,
    checkpoints asked, nodes replaced (after a checkpoint, or at once for a hang), attempts failed."""

    def __init__(self, ctx: ControlContext, nodes: Nodes) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self._watches: dict[int, JobWatch] = {}

    def watch(self, job: Job, spec: JobSpec) -> JobWatch:
        watch = self._watches.get(job.id)
        if watch is None:
            watch = self._watches[job.id] = JobWatch(job.id, health_config(spec.health.model_dump()),
                                                     self.ctx.metrics)
            watch.policy.restore(job.health)   # cooldowns and exclusions outlive a controller restart
        return watch

    def existing(self, job_id: int) -> JobWatch | None:
        """The job's watch if its loop made one (telemetry of a job not watched yet is only stored)."""
        return self._watches.get(job_id)

    def forget(self, job_id: int) -> None:
        """The job ended: drop its watch and its metric series."""
        if self._watches.pop(job_id, None) is not None:
            self.ctx.metrics.forget(str(job_id))

    def act(self, job: Job, spec: JobSpec) -> None:
        """Findings become events; decisions become checkpoints, node replacements or a failed attempt."""
        watch = self.watch(job, spec)
        ranked = [n for n in self.ctx.store.nodes(job.id, active_only=True) if n.rank is not None]
        if len(ranked) == spec.num_nodes:  # e.g. after a controller restart
            watch.start_attempt(job.attempt, rank_nodes(ranked, workers_per_node(spec, ranked)))
        now = self.nodes.stalls.ran()
        for stall in self.nodes.stalls.since(watch.checked_at, spec.health.heartbeat_timeout):
            watch.pardon(stall.end)
        watch.checked_at = now
        findings, decisions = watch.check(now, job.step_time, max(0, spec.steps - job.step) if spec.steps else None)
        for finding in findings:
            self.ctx.event(job.id, "finding", f"{finding.kind.value} ({finding.severity.value}) on "
                           f"{finding.node or 'the job'}: {finding.evidence}")
        nodes = {n.id: n for n in ranked}
        for decision in decisions:
            self._apply(job, watch, decision, nodes, now)
        self._replace_when_saved(self.ctx.store.job(job.id), nodes, now)
        job = self.ctx.store.job(job.id)
        if job.step_time:
            done = job.step + 1 - (job.restored_step or 0)
            self.ctx.metrics.goodput(watch.label, min(1.0, done * job.step_time
                                                      / max(1e-9, now - job.attempt_started_at)))

    def _apply(self, job: Job, watch: JobWatch, decision: Decision, nodes: dict[str, Node], now: float) -> None:
        store = self.ctx.store
        if decision.action == Action.CHECKPOINT:
            store.update_job(job.id, checkpoint_request=now)
            self.ctx.event(job.id, "health", f"checkpoint requested: {decision.reason}")
        elif decision.action == Action.FAIL:
            # the attempt's failure is what was found (the restart says it), the decision's reason why it fails
            found = f"{decision.finding.kind.value}: {decision.finding.evidence}"
            store.update_job(job.id, attempt_state="stopping", attempt_changed_at=now, pending_reason=found)
            self.ctx.event(job.id, "health", f"failing attempt {job.attempt}: {decision.reason}")
        elif decision.action == Action.REPLACE_NODE and decision.node in nodes:
            store.update_job(job.id, health=watch.policy.state())   # it excluded the node
            if decision.finding.kind == FindingKind.HANG:  # a stuck rank cannot take part in a save
                self.nodes.fail(job, nodes[decision.node], decision.reason)
            else:
                store.update_job(job.id, checkpoint_request=now, pending_replace=decision.node,
                                 pending_reason=decision.reason)
                self.ctx.event(job.id, "health", f"checkpointing, then replacing {decision.node}: {decision.reason}")

    def _replace_when_saved(self, job: Job, nodes: dict[str, Node], now: float) -> None:
        """Fail the node awaiting replacement once the checkpoint asked for it is saved (or waited too long)."""
        if not job.pending_replace:
            return
        saved = job.checkpoint_at >= job.checkpoint_request
        if saved or now - job.checkpoint_request > max(REPLACE_CHECKPOINT_WAIT_S, 30 * (job.step_time or 0)):
            node = nodes.get(job.pending_replace)
            self.ctx.store.update_job(job.id, pending_replace="")
            if node is not None:
                self.nodes.fail(job, node, job.pending_reason + ("" if saved else " (no checkpoint in time)"))


def rank_nodes(nodes: list[Node], nprocs: int) -> list[str]:
    """The node of every global rank: torchrun numbers ranks node by node."""
    by_rank = {n.rank: n.id for n in nodes}
    return [by_rank[r // nprocs] for r in range(len(nodes) * nprocs)]
