"""Hang detection: ranks that finish no step for longer than the job's steps, or their phase, can explain.

The timeout grows with the job (`hang_step_factor` x its 99th-percentile step interval, at least
`hang_min_s`), so a job of minute-long steps is not called hung after a few seconds. A rank that
announced a phase (a checkpoint save, an evaluation, data loading: orchestrator/sdk/phases.py) and
still heartbeats has that phase's timeout instead, learned from history as NVRx does:
`phase_timeout_factor` x the longest duration of that phase seen in this job, within
[`phase_timeout_min_s`, `phase_timeout_max_s`], and the ceiling until the phase was seen once. While
a rank is within its phase's timeout the others, blocked in a collective or a barrier behind it
(rank 0 evaluating alone), are not hung either. Who is to blame
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


TRAIN = "train"                 # the phase of a rank that announced none
# Distinct phase names learned per job. The SDK allows 16 per process and the API 16 per post, but nothing
# bounded them across posts: a client inventing names would grow the controller without end. Names past
# this have no history: their timeout is the ceiling.
MAX_PHASES = 64


def step_timeout(config: HealthConfig, intervals: np.ndarray) -> float:
    """No step for this long is a hang: `hang_step_factor` x the p99 of recent step intervals, at least
    `hang_min_s`."""
    return max(config.hang_min_s, config.hang_step_factor * float(np.percentile(intervals, 99))
               if intervals.size else 0.0)


class PhaseHistory:
    """The longest duration of each phase seen in a job (kept across its attempts), and the timeouts
    that follow from them."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self.longest: dict[str, float] = {}

    def observe(self, phase: str, seconds: float) -> None:
        if phase != TRAIN and math.isfinite(seconds) and seconds >= 0 and (
                phase in self.longest or len(self.longest) < MAX_PHASES):
            self.longest[phase] = max(seconds, self.longest.get(phase, 0.0))

    def timeout(self, phase: str) -> float:
        """`phase_timeout_factor` x the longest seen, clamped; the ceiling for a phase never seen."""
        cfg = self.config
        if phase not in self.longest:
            return cfg.phase_timeout_max_s
        return min(max(cfg.phase_timeout_factor * self.longest[phase], cfg.phase_timeout_min_s),
                   cfg.phase_timeout_max_s)

    def explain(self, phase: str) -> str:
        seen = self.longest.get(phase)
        return (f"{self.timeout(phase):.0f}s: never seen, the ceiling" if seen is None else
                f"{self.timeout(phase):.0f}s: {self.config.phase_timeout_factor:g} x the longest {phase} "
                f"seen, {seen:.0f}s, within [{self.config.phase_timeout_min_s:.0f}, "
                f"{self.config.phase_timeout_max_s:.0f}]s")


class Pardons:
    """One pardon per silence, per rank, as the controller gives its nodes (orchestrator/control/stalls.py): a
    rank last heard before the controller stopped listening (a suspend, a SIGSTOP) counts its silence from when
    it listened again, but only once until it is heard anew, so a rank really stuck is still found one timeout
    after the controller runs again, however often it stalls."""

    def __init__(self, n: int) -> None:
        self._heard = np.full(n, np.nan)    # each rank's last word when it was pardoned ...
        self._until = np.full(n, np.nan)    # ... and when its silence counts from since

    def grant(self, heard: np.ndarray, until: float) -> None:
        """Nothing was heard until `until`: ranks last `heard` before it, not pardoned since, start again there."""
        fresh = (heard < until) & (self._heard != heard)
        self._heard[fresh], self._until[fresh] = heard[fresh], until

    def window(self, heard: np.ndarray) -> np.ndarray:
        """When each rank's silence counts from, last heard at `heard`."""
        return np.where(self._heard == heard, self._until, heard)


class HangWatch:
    """When each rank last finished a step and last sent anything, the phase it is in, and the job's
    recent step intervals."""

    def __init__(self, config: HealthConfig, rank_nodes: Sequence[str], history: PhaseHistory | None = None,
                 started_at: float = math.nan) -> None:
        """`started_at`: when the attempt began (NaN: unknown), from which a first step is awaited."""
        self.config = config
        self._started_at = started_at
        self.rank_nodes = tuple(rank_nodes)
        self.history = history or PhaseHistory(config)
        n = len(self.rank_nodes)
        self._phase = [TRAIN] * n                           # the phase each rank said it is in ...
        self._phase_since = np.full(n, np.nan)              # ... since when
        self._phase_spent = 0.0                             # most seconds of phases a rank finished since
                                                            # the last step interval
        # The job's recent pace: wall seconds per step, over as many steps as the straggler test keeps.
        self._interval = np.full(config.straggler_window + config.straggler_baseline, np.nan)   # ring
        self._pos = 0                                       # next entry to write
        self._progress_at = np.full(n, np.nan)              # when each rank last finished a step
        self._beat_at = np.full(n, np.nan)                  # when each rank last sent anything
        self._beats = np.zeros(n, bool)                     # ranks that send heartbeats between steps
        self._first_at = math.nan                           # the job's first finished step
        # The controller's stalls, pardoned once per silence: of steps, of heartbeats, of the first step's wait.
        self._pardons = {"progress": Pardons(n), "beat": Pardons(n), "start": Pardons(1)}

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

    def phase(self, rank: int, phase: str, since: float | None, finished: dict[str, float]) -> None:
        """What `rank` said with its heartbeat: the phase it is in (since when), and the longest duration
        of each phase it finished since its last word."""
        for name, seconds in finished.items():
            self.history.observe(name, seconds)
        self._phase_spent = max(self._phase_spent, sum(finished.values()))
        self._phase[rank] = phase
        self._phase_since[rank] = np.nan if phase == TRAIN or since is None else since

    def add_interval(self, seconds: float, steps: int = 1) -> None:
        """Wall `seconds` for the last `steps` steps (after the warm-up: compiling is not the pace). A gap
        spent mostly in an announced phase (a save) is not the pace of steps either: that phase has its own
        timeout, and a 150 s save must not make the step timeout ten times that."""
        spent, self._phase_spent = self._phase_spent, 0.0
        if spent >= seconds / 2:
            return
        self._interval[self._pos] = seconds / steps
        self._pos = (self._pos + 1) % self._interval.size

    def pardon(self, until: float) -> None:
        """The controller heard nothing until `until` (it stalled): that silence is no rank's, once (`Pardons`)."""
        self._pardons["progress"].grant(self._progress_since(), until)
        self._pardons["beat"].grant(self._beat_at, until)
        self._pardons["start"].grant(np.array([self._started_at]), until)

    def _progress_since(self) -> np.ndarray:
        """When each rank last finished a step (the job's first step for a rank that finished none)."""
        return np.where(np.isnan(self._progress_at), self._first_at, self._progress_at)

    def findings(self, now: float, step: int | None) -> list[Finding]:
        """Ranks with no step progress for longer than the job's steps, or their phase, can explain."""
        cfg = self.config
        if math.isnan(self._first_at):  # the first step may compile, load data, wait for peers for minutes ...
            return self._no_first_step(now, step)
        timeout = step_timeout(cfg, self._interval[~np.isnan(self._interval)])
        since = self._pardons["progress"].window(self._progress_since())
        beat_at = self._pardons["beat"].window(self._beat_at)
        stuck, phased = self._stuck(now, since, beat_at, timeout)
        if not stuck.any():
            return []
        silent = self._beats & (now - beat_at > cfg.heartbeat_timeout_s)
        idle = now - since.max() if stuck.all() else 0.0
        if not stuck.all():            # the others went on: this rank's process or telemetry is gone
            return self._by_node(np.flatnonzero(stuck), now, step, Severity.WARNING,
                                 lambda r: f"rank(s) {r} finished no step for {now - since[stuck].max():.0f}s "
                                           f"(timeout {timeout:.0f}s) while the others reached step {step}"
                                           + self._phase_note(phased & stuck, now))
        if silent.any():               # all wait in a collective; the silent ones are the ones they wait on
            return self._by_node(np.flatnonzero(silent), now, step, Severity.CRITICAL,
                                 lambda r: f"no rank finished a step for {idle:.0f}s (timeout {timeout:.0f}s); "
                                           f"rank(s) {r} silent for {now - np.nanmax(beat_at[silent]):.0f}s "
                                           f"(heartbeat timeout {cfg.heartbeat_timeout_s:.0f}s) while the others "
                                           "keep beating: the job waits on them")
        why = ("every rank still heartbeats: a deadlock, or a wait outside the job" if self._beats.all()
               else "no heartbeats to tell which rank the others wait on")
        return [Finding(FindingKind.HANG, Severity.CRITICAL, "", None, tuple(range(len(self.rank_nodes))),
                        f"no rank finished a step for {idle:.0f}s (timeout {timeout:.0f}s) after step "
                        f"{step}; {why}" + self._phase_note(phased, now), now, step)]

    def _no_first_step(self, now: float, step: int | None) -> list[Finding]:
        """... but not past the ceiling of a phase never seen (`phase_timeout_max_s`): a first step that never
        ends (a data loader, or a first collective, that hangs) was never called a hang, and the job waited for
        ever. No rank is to blame: none has a pace to fall behind. Only ranks that were heard (the SDK's
        heartbeats) are awaited: a script without the SDK reports no step ever, and ran for 30 minutes only."""
        waited = now - self._pardons["start"].window(np.array([self._started_at]))[0]
        limit = self.config.phase_timeout_max_s
        if not waited > limit or np.isnan(self._beat_at).all():   # NaN too: the attempt's start is unknown
            return []
        return [Finding(FindingKind.HANG, Severity.CRITICAL, "", None, tuple(range(len(self.rank_nodes))),
                        f"no rank finished a first step in {waited:.0f}s since the attempt began (timeout "
                        f"{limit:.0f}s, phase_timeout_max_s: the longest a step never seen may take; for a first "
                        "step this slow (a download, a long compile) raise health.thresholds.phase_timeout_max_s)",
                        now, step)]

    def _stuck(self, now: float, since: np.ndarray, beat_at: np.ndarray,
               timeout: float) -> tuple[np.ndarray, np.ndarray]:
        """(stuck, in a phase): a rank in a phase that still heartbeats is stuck past its phase's timeout;
        a training rank past the step timeout, unless a live rank's phase still explains the wait."""
        live = now - beat_at <= self.config.heartbeat_timeout_s
        phased = live & ~np.isnan(self._phase_since)
        limits = np.array([self.history.timeout(p) for p in self._phase]) if phased.any() else 0.0
        ends = np.where(phased, np.fmax(self._phase_since, since) + limits, since + timeout)
        excused = ends[phased].max() if phased.any() else -math.inf
        return (now > ends) & (phased | (now > excused)), phased

    def _phase_note(self, ranks: np.ndarray, now: float) -> str:
        """What the stuck ranks in a phase were doing, for the evidence."""
        if not ranks.any():
            return ""
        rank = int(np.flatnonzero(ranks)[0])
        phase = self._phase[rank]
        return (f"; rank {rank} has been in {phase} for {now - self._phase_since[rank]:.0f}s (phase timeout "
                f"{self.history.explain(phase)})")

    def _by_node(self, ranks: np.ndarray, now: float, step: int | None, severity: Severity,
                 evidence: Callable[[str], str]) -> list[Finding]:
        """One hang finding per node of `ranks`; `evidence` writes its line from the node's ranks."""
        return [Finding(FindingKind.HANG, severity, node, None, tuple(mine), evidence(ranks_text(mine)), now, step)
                for node, mine in ranks_by_node(self.rank_nodes, ranks).items()]
