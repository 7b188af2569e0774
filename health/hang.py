"""Hang detection: ranks that finish no step for longer than the job's steps can explain.

The timeout grows with the job (`hang_step_factor` x its 99th-percentile step interval, at least
`hang_min_s`), so a job of minute-long steps is not called hung after a few seconds. Who is to blame
follows from who else stopped: if the other ranks went on, the stuck rank's process or telemetry is
gone; if every rank stopped, they all wait in a collective, and the ranks that also stopped
heartbeating are the ones the others wait on; with none of those (a deadlock, or no heartbeats to
tell), no node is to blame and the finding is the whole job's.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from health.config import HealthConfig
from health.findings import Finding, FindingKind, Severity, ranks_by_node, ranks_text


class HangWatch:
    """When each rank last finished a step and last sent anything, and the job's recent step intervals."""

    def __init__(self, config: HealthConfig, rank_nodes: Sequence[str]) -> None:
        self.config = config
        self.rank_nodes = tuple(rank_nodes)
        n = len(self.rank_nodes)
        # The job's recent pace: wall seconds per step, over as many steps as the straggler test keeps.
        self._interval = np.full(config.straggler_window + config.straggler_baseline, np.nan)   # ring
        self._pos = 0                                       # next entry to write
        self._progress_at = np.full(n, np.nan)              # when each rank last finished a step
        self._beat_at = np.full(n, np.nan)                  # when each rank last sent anything
        self._beats = np.zeros(n, bool)                     # ranks that send heartbeats between steps
        self._first_at = math.nan                           # the job's first finished step

    def steps_finished(self, seen: np.ndarray, now: float) -> None:
        """The `seen` ranks (a boolean mask) finished a step at `now`."""
        self._progress_at[seen] = np.fmax(self._progress_at[seen], now)
        self._beat_at[seen] = np.fmax(self._beat_at[seen], now)
        if math.isnan(self._first_at):
            self._first_at = now

    def heard(self, rank: int, time: float, finished_step: bool) -> None:
        """A sample from `rank`: a finished step, or else a heartbeat."""
        self._beat_at[rank] = np.fmax(self._beat_at[rank], time)
        if not finished_step:
            self._beats[rank] = True
            return
        self._progress_at[rank] = np.fmax(self._progress_at[rank], time)
        if math.isnan(self._first_at):
            self._first_at = time

    def add_interval(self, seconds: float) -> None:
        """Wall seconds per step between the last two steps (after the warm-up: compiling is not the pace)."""
        self._interval[self._pos] = seconds
        self._pos = (self._pos + 1) % self._interval.size

    def findings(self, now: float, step: int | None) -> list[Finding]:
        """Ranks with no step progress for longer than the job's steps can explain."""
        cfg = self.config
        if math.isnan(self._first_at):
            return []                  # nothing finished yet: the first step may compile for minutes
        intervals = self._interval[~np.isnan(self._interval)]
        timeout = max(cfg.hang_min_s, cfg.hang_step_factor * float(np.percentile(intervals, 99))
                      if intervals.size else 0.0)
        since = np.where(np.isnan(self._progress_at), self._first_at, self._progress_at)
        stuck = now - since > timeout
        if not stuck.any():
            return []
        silent = self._beats & (now - self._beat_at > cfg.heartbeat_timeout_s)
        idle = now - since.max() if stuck.all() else 0.0
        if not stuck.all():            # the others went on: this rank's process or telemetry is gone
            return self._by_node(np.flatnonzero(stuck), now, step, Severity.WARNING,
                                 lambda r: f"rank(s) {r} finished no step for {now - since[stuck].max():.0f}s "
                                           f"(timeout {timeout:.0f}s) while the others reached step {step}")
        if silent.any():               # all wait in a collective; the silent ones are the ones they wait on
            return self._by_node(np.flatnonzero(silent), now, step, Severity.CRITICAL,
                                 lambda r: f"no rank finished a step for {idle:.0f}s (timeout {timeout:.0f}s); "
                                           f"rank(s) {r} silent for {now - np.nanmax(self._beat_at[silent]):.0f}s "
                                           f"(heartbeat timeout {cfg.heartbeat_timeout_s:.0f}s) while the others "
                                           "keep beating: the job waits on them")
        why = ("every rank still heartbeats: a deadlock, or a wait outside the job" if self._beats.all()
               else "no heartbeats to tell which rank the others wait on")
        return [Finding(FindingKind.HANG, Severity.CRITICAL, "", None, tuple(range(len(self.rank_nodes))),
                        f"no rank finished a step for {idle:.0f}s (timeout {timeout:.0f}s) after step "
                        f"{step}; {why}", now, step)]

    def _by_node(self, ranks: np.ndarray, now: float, step: int | None, severity: Severity,
                 evidence: Callable[[str], str]) -> list[Finding]:
        """One hang finding per node of `ranks`; `evidence` writes its line from the node's ranks."""
        return [Finding(FindingKind.HANG, severity, node, None, tuple(mine), evidence(ranks_text(mine)), now, step)
                for node, mine in ranks_by_node(self.rank_nodes, ranks).items()]
