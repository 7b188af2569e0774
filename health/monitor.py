"""The Monitor: every detector over one attempt of one job, fed with telemetry, asked for findings.

A `Monitor` keeps the last few steps of every rank in numpy arrays so that one step of 4096 ranks
costs well under a millisecond, and `check()` reports every condition that holds now. Conditions
(a slow rank, a throttled GPU, a hang, a pending row remap) are reported at every check while they
last, so the policy can tell a persistent fault from a blip; events (an Xid) are reported once.

The detectors live by signal: the straggler test (straggler.py), the GPUs' clocks, Xids and ECC
(device.py), progress and heartbeats (hang.py). The Monitor gathers each step's samples from the
ranks, keeps what the detectors share (the ranks' nodes, the last step, the warm-up) and makes one
finding of a slow rank on a throttled GPU.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from health.config import HealthConfig
from health.device import DeviceWatch
from health.findings import Finding, FindingKind, Severity
from health.hang import HangWatch, PhaseHistory
from health.straggler import StragglerTest
from health.telemetry import Sample


@dataclass
class _Pending:
    """One step's rank samples, gathered until every rank sent its own."""

    values: np.ndarray
    count: int = 0
    time: float = 0.0


class Monitor:
    """Every detector over one attempt of one job; start a new one when the job restarts."""

    def __init__(self, config: HealthConfig, rank_nodes: Sequence[str], phases: PhaseHistory | None = None,
                 started_at: float = math.nan) -> None:
        """`phases`: the job's phase durations so far (kept across attempts by the caller); `started_at`: when
        the attempt began."""
        self.config = config
        self.rank_nodes = tuple(rank_nodes)
        self._straggler = StragglerTest(config, self.rank_nodes)
        self._devices = DeviceWatch(config)
        self._hang = HangWatch(config, self.rank_nodes, phases, started_at)
        self._step: int | None = None
        self._step_at = math.nan
        self._started = 0                                   # steps with data, warm-up included
        self._pending: dict[int, _Pending] = {}

    # ---- input ----------------------------------------------------------------------------------
    def observe_step(self, step: int, compute_times: np.ndarray, now: float) -> None:
        """One finished step of every rank (NaN: the rank sent nothing); the fast path."""
        times = np.asarray(compute_times, dtype=float)
        if times.shape != (len(self.rank_nodes),):
            raise ValueError(f"expected {len(self.rank_nodes)} compute times, got shape {times.shape}")
        if self._step is not None and step <= self._step:
            raise ValueError(f"step {step} after step {self._step}: steps must increase "
                             "(a restarted attempt needs a new Monitor)")
        with np.errstate(all="ignore"):     # a broken clock's 0, negative or infinite time is no time: missing
            x = np.log(np.where((times > 0) & (times < math.inf), times, np.nan))
        seen = ~np.isnan(x)
        self._hang.steps_finished(seen, now)
        last, last_at = self._step, self._step_at
        self._step, self._step_at = step, now
        self._started += bool(seen.any())
        if self._started <= self.config.straggler_warmup_steps or not seen.any():
            return                     # compiling, warming caches: nothing to learn from yet
        self._hang.add_interval(now - last_at, step - last)
        self._straggler.add(x, seen)

    def observe(self, sample: Sample) -> None:
        """Any one sample: a rank's step or heartbeat, or a GPU's readings and Xid events."""
        if sample.gpu is not None or sample.xid is not None:
            self._devices.observe(sample, self._step)
        if sample.rank is None:
            return
        rank = sample.rank
        if not 0 <= rank < len(self.rank_nodes):
            raise ValueError(f"rank {rank} is not in this job's {len(self.rank_nodes)} ranks")
        self._hang.heard(rank, sample.time, finished_step=sample.step is not None)
        if sample.step is None:
            return
        if self._step is not None and sample.step <= self._step:
            return                     # that step was closed without it
        value = sample.compute_time if sample.compute_time is not None else sample.step_time
        self._gather(rank, sample.step, value, sample.time)

    def observe_phase(self, rank: int, phase: str, since: float | None, finished: dict[str, float]) -> None:
        """A rank's phase (orchestrator/sdk/phases.py): the one it is in, since when, and the longest
        duration of each phase it finished since its last word."""
        if not 0 <= rank < len(self.rank_nodes):
            raise ValueError(f"rank {rank} is not in this job's {len(self.rank_nodes)} ranks")
        self._hang.phase(rank, phase, since, finished)

    def _gather(self, rank: int, step: int, value: float | None, time: float) -> None:
        """Hold a rank's step sample until its step is complete, or late enough to close without the rest."""
        pending = self._pending.get(step)
        if pending is None:
            pending = self._pending[step] = _Pending(np.full(len(self.rank_nodes), np.nan))
        if value is not None and np.isnan(pending.values[rank]):
            pending.values[rank] = value
            pending.count += 1
        pending.time = max(pending.time, time)
        # Ranks post in batches (the SDK every second), so a step waits for its late ranks until it
        # is both `gather_steps` steps and `gather_s` seconds behind the newest one.
        newest = max(self._pending)
        while self._pending:
            oldest = min(self._pending)
            first = self._pending[oldest]
            late = (newest - oldest >= self.config.gather_steps
                    and self._pending[newest].time - first.time >= self.config.gather_s)
            if first.count < len(self.rank_nodes) and not late:
                break
            del self._pending[oldest]
            self.observe_step(oldest, first.values, first.time)

    def pardon(self, until: float) -> None:
        """The controller heard nothing until `until` (its own process stalled): no rank is hung for that silence
        (once per silence: health/hang.py's `Pardons`)."""
        self._hang.pardon(until)

    # ---- output ---------------------------------------------------------------------------------
    def check(self, now: float) -> list[Finding]:
        """Every finding that holds now, plus the events (Xids) seen since the last check."""
        stragglers = self._straggler.findings(now, self._step)
        findings, throttled = self._devices.check(now, self._step)
        for node in sorted(set(stragglers) | set(throttled)):
            slow, hot = stragglers.get(node), throttled.get(node, [])
            if slow and hot and hot[0].severity == Severity.WARNING:
                # A slow rank on a node whose GPU is held down by hardware (thermal, power brake): one
                # finding, both halves, critical. An ordinary power cap explains nothing: the straggler
                # stays a warning and goes through the policy's hysteresis.
                findings.append(Finding(FindingKind.THROTTLE, Severity.CRITICAL, node, hot[0].gpu, slow.ranks,
                                        f"{slow.evidence}; {hot[0].evidence}", now, self._step))
                hot = hot[1:]
            elif slow:
                findings.append(slow)
            findings.extend(hot)
        findings.extend(self._hang.findings(now, self._step))
        return findings

    def scores(self) -> np.ndarray:
        """Each rank's windowed score: cluster median / its compute time over the last window (1.0 healthy)."""
        return self._straggler.scores()
