"""The controller's health watch over one job: telemetry in, decisions out.

The controller feeds every SDK record and heartbeat it receives into the job's `Monitor` (one per
attempt: ranks move to other nodes on a restart) and, on each pass of its loop, turns the
monitor's findings into the policy's decisions (one `Policy` per job, kept across attempts, so its
hysteresis and cooldowns survive restarts). Metrics for Prometheus are updated on the way.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from health.config import HealthConfig
from health.findings import Decision, Finding
from health.metrics import Metrics
from health.monitor import Monitor
from health.policy import Policy
from health.telemetry import Sample, sdk_sample


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
        self._monitor: Monitor | None = None
        self._rank_nodes: tuple[str, ...] = ()
        self._active: dict[tuple[str, str], str] = {}   # (kind, node) -> severity, as of the last check
        self._lock = threading.Lock()

    def start_attempt(self, attempt: int, rank_nodes: Sequence[str]) -> None:
        """A new attempt: a fresh monitor over the ranks' new placement."""
        with self._lock:
            if attempt == self.attempt and self._monitor is not None:
                return
            self.attempt = attempt
            self._rank_nodes = tuple(rank_nodes)
            self._monitor = Monitor(self.config, self._rank_nodes)
            self._active = {}

    def observe(self, attempt: int, rank: int, records: list[dict[str, Any]], heartbeat: float | None) -> None:
        """One telemetry post of one rank."""
        with self._lock:
            if self._monitor is None or attempt != self.attempt or not 0 <= rank < len(self._rank_nodes):
                return  # a late post of an earlier attempt
            node = self._rank_nodes[rank]
            for record in records:
                sample = sdk_sample(node, {**record, "rank": rank})
                self._monitor.observe(sample)
                self.metrics.observe(self.label, sample)
            if heartbeat is not None:
                self._monitor.observe(Sample(time=heartbeat, node=node, rank=rank))

    def observe_device(self, sample: Sample) -> None:
        """An NVML or DCGM sample from a node's agent."""
        with self._lock:
            if self._monitor is not None:
                self._monitor.observe(sample)
            self.metrics.observe(self.label, sample)

    def check(self, now: float) -> tuple[list[Finding], list[Decision]]:
        """The findings that are new since the last check (a condition is reported by the monitor
        at every check while it lasts: the policy needs that, the log and the counters do not),
        and the policy's decisions over all current findings."""
        with self._lock:
            if self._monitor is None:
                return [], []
            findings = self._monitor.check(now)
            scores = self._monitor.scores()
        self.metrics.straggler_scores(self.label, {r: float(s) for r, s in enumerate(scores) if s == s})
        active = {(f.kind.value, f.node): f.severity.value for f in findings}
        new = [f for f in findings if self._active.get((f.kind.value, f.node)) != f.severity.value]
        self._active = active
        for finding in new:
            self.metrics.finding(self.label, finding.kind.value, finding.severity.value)
        return new, self.policy.decide(findings, now)
