"""Detectors: turn telemetry samples into findings that name a node (straggler, throttle, Xid, hang, ECC).

A `Monitor` keeps the last few steps of every rank in numpy arrays so that one step of 4096 ranks
costs well under a millisecond, and `check()` reports every condition that holds now. Conditions
(a slow rank, a throttled GPU, a hang, a pending row remap) are reported at every check while they
last, so the policy can tell a persistent fault from a blip; events (an Xid) are reported once.

The straggler test, and why it looks like this. In synchronous data parallel every rank waits for
the slowest, so a rank's *compute* time (its step time minus collective waits) is the signal.
Each step, d = log(compute) - median over ranks of log(compute): the median cancels whatever slows
every rank (data, eval steps), the log makes "10% slower" the same shift at any step time. From d
we take the rank's usual standing (a chip 1-2% slower than most is not a fault; learned slowly, and
capped at `straggler_min_slowdown`) and divide by the noise sigma: the larger of the cluster's
spread (1.4826 x MAD across ranks) and the rank's own spread, one standard error high, so a noisier
rank is not mistaken for a slow one. The result is clipped to +-`straggler_clip` so that an outlier
step (a GC pause, 2-3x) adds a bounded amount, and summed in a one-sided CUSUM S = max(0, S + z - k)
(Page 1954), the test that detects a persistent mean shift fastest for a given false-alarm rate.
Its limit h is not tuned by hand: Siegmund's approximation of the average run length of a Gaussian
CUSUM, ARL0 = (e^{2kb} - 2kb - 1) / 2k^2 with b = h + 1.166, is solved for h so that a healthy rank
raises a false alarm once per `straggler_false_alarm_steps` steps (1e9: ~0.001 expected false
alarms in 1e6 rank-steps). A rank whose CUSUM crossed h is blamed only if the median of its last
`straggler_window` steps also shows it at least `straggler_min_slowdown` slower than the cluster.
The test starts after warm-up + window + baseline steps (56 by default), once every rank has a
baseline. With 3-5% noise it finds a 10% slowdown in ~10 steps and a 20% one in ~5
(benchmarks/health.py measures it, and the false alarms).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from health.config import HealthConfig
from health.findings import Finding, FindingKind, Severity
from health.telemetry import ClockReason, Sample

MAD_TO_SIGMA = 1.4826          # sigma of a normal distribution = 1.4826 x its median absolute deviation
HW_THROTTLING = ClockReason.HW_SLOWDOWN | ClockReason.HW_THERMAL | ClockReason.HW_POWER_BRAKE
SHOWN_RANKS = 8                # ranks spelled out in one line of evidence


# ---- Xid ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class XidClass:
    """What an Xid code means for the job: whose fault, how bad, and what the GPU needs."""

    code: int
    fault: str               # "application", "hardware", "driver" or "unknown"
    severity: Severity
    reset: bool              # the GPU needs a reset (or the node a reboot) before it is trusted again
    drain: bool              # take the node out of service: the fault will come back
    description: str


# From NVIDIA's Xid catalog (https://docs.nvidia.com/deploy/xid-errors/, "Analyzing Xid Errors with
# the Xid Catalog", resolution buckets RESTART_APP / RESET_GPU / RESTART_BM / CONTACT_SUPPORT) and
# NVIDIA's GPU health checks. Application faults restart the app on the same GPU; the others leave
# the GPU untrustworthy until reset, or the node needs service.
_A, _H, _D = "application", "hardware", "driver"
_XIDS: dict[int, tuple[str, Severity, bool, bool, str]] = {
    13: (_A, Severity.INFO, False, False, "graphics engine exception (usually an out-of-bounds access in a kernel)"),
    31: (_A, Severity.INFO, False, False, "GPU memory page fault (an illegal address in the application)"),
    43: (_A, Severity.INFO, False, False, "GPU stopped processing the application's channel (app fault, GPU fine)"),
    45: (_A, Severity.INFO, False, False, "preemptive cleanup after an earlier error (follow-on, not a cause)"),
    48: (_H, Severity.CRITICAL, True, True, "double-bit (uncorrectable) ECC error"),
    61: (_D, Severity.CRITICAL, True, False, "internal micro-controller breakpoint/warning"),
    62: (_D, Severity.CRITICAL, True, False, "internal micro-controller halt"),
    63: (_H, Severity.WARNING, True, False, "ECC page retirement / row remap recorded; reset to activate"),
    64: (_H, Severity.CRITICAL, True, True, "ECC page retirement / row remap failed"),
    74: (_H, Severity.CRITICAL, True, True, "NVLink error"),
    79: (_H, Severity.CRITICAL, True, True, "GPU has fallen off the bus"),
    92: (_H, Severity.WARNING, False, False, "high single-bit ECC error rate"),
    94: (_H, Severity.WARNING, True, False, "contained ECC error (the app must restart; reset to remap)"),
    95: (_H, Severity.CRITICAL, True, True, "uncontained ECC error"),
    119: (_D, Severity.CRITICAL, True, False, "GSP RPC timeout"),
    120: (_D, Severity.CRITICAL, True, False, "GSP error"),
    140: (_H, Severity.CRITICAL, True, True, "unrecovered ECC error"),
    154: (_D, Severity.WARNING, True, False, "GPU recovery action changed: a reset or reboot is required"),
}


def classify_xid(code: int) -> XidClass:
    """The table entry for `code`; an unknown code is a warning with no node action."""
    if code in _XIDS:
        return XidClass(code, *_XIDS[code])
    return XidClass(code, "unknown", Severity.WARNING, False, False, "not in tfsn's Xid table")


# ---- the straggler statistics --------------------------------------------------------------------

def cusum_limit(k: float, false_alarm_steps: float) -> float:
    """CUSUM limit h giving one false alarm per `false_alarm_steps` N(0,1) steps (Siegmund 1985)."""
    def arl0(h: float) -> float:
        b = min(2 * k * (h + 1.166), 700.0)       # past e^700 it is infinite for our purpose
        return (math.expm1(b) - b) / (2 * k * k)
    lo, hi = 0.0, 1000.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if arl0(mid) < false_alarm_steps else (lo, mid)
    return hi


def _median(a: np.ndarray, axis: int | None = None) -> np.ndarray:
    """np.median, or np.nanmedian where a value is missing (3x slower, so only then)."""
    with np.errstate(all="ignore"):
        return np.nanmedian(a, axis=axis) if np.isnan(a).any() else np.median(a, axis=axis)


def _ranks_text(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:SHOWN_RANKS])
    return shown + (f" and {len(ranks) - SHOWN_RANKS} more" if len(ranks) > SHOWN_RANKS else "")


@dataclass
class _Device:
    """What one GPU's last samples said."""

    throttled: int = 0              # consecutive throttled samples
    clock: float = 0.0
    max_clock: float = 0.0
    reasons: int = 0
    dbe: int = 0
    pending: bool = False
    failure: bool = False
    sbe: deque[tuple[float, int]] = field(default_factory=deque)   # (time, count) over the last hour


@dataclass
class _Pending:
    """One step's rank samples, gathered until every rank sent its own."""

    values: np.ndarray
    count: int = 0
    time: float = 0.0


class Monitor:
    """Every detector over one attempt of one job; start a new one when the job restarts."""

    def __init__(self, config: HealthConfig, rank_nodes: Sequence[str]) -> None:
        self.config = config
        self.rank_nodes = tuple(rank_nodes)
        n = len(self.rank_nodes)
        # Small jobs have no cluster whose spread tells the noise: each rank's deviation from the
        # other ranks is held against its own past. With several ranks that deviation, not the raw
        # time, is what moves (ranks sharing a machine speed up when one of them is held back).
        self._relative = n >= config.straggler_min_ranks
        self._peers = n >= 2
        self._rows = config.straggler_window + config.straggler_baseline
        self._logt = np.full((self._rows, n), np.nan)       # ring: log compute time, one row per step
        self._center = np.zeros(self._rows)                 # ring: that step's median (0: own baseline instead)
        self._spread = np.full(self._rows, np.nan)          # ring: that step's noise sigma across ranks
        self._interval = np.full(self._rows, np.nan)        # ring: wall seconds per step
        self._started = 0                                   # steps with data, warm-up included
        self._filled = 0                                    # steps in the rings
        self._pos = 0                                       # next row to write
        self._step: int | None = None
        self._step_at = math.nan
        self._cusum = np.zeros(n)
        self._limit = cusum_limit(config.straggler_cusum_k, config.straggler_false_alarm_steps)
        self._own_center = np.full(n, np.nan)               # median deviation over the baseline rows
        self._own_sigma = np.full(n, np.nan)                # noise sigma over the baseline rows
        self._allowance = np.zeros(n)                       # how much slower than the median it usually is
        self._refreshes = 0
        self._progress_at = np.full(n, np.nan)              # when each rank last finished a step
        self._beat_at = np.full(n, np.nan)                  # when each rank last sent anything
        self._beats = np.zeros(n, bool)                     # ranks that send heartbeats between steps
        self._first_at = math.nan                           # the job's first finished step
        self._pending: dict[int, _Pending] = {}
        self._devices: dict[tuple[str, int], _Device] = {}
        self._watch: set[tuple[str, int]] = set()           # devices with something to report
        self._events: list[Finding] = []                    # one-off findings waiting for check()

    # ---- input ----------------------------------------------------------------------------------
    def observe_step(self, step: int, compute_times: np.ndarray, now: float) -> None:
        """One finished step of every rank (NaN: the rank sent nothing); the fast path."""
        cfg = self.config
        times = np.asarray(compute_times, dtype=float)
        if times.shape != self._cusum.shape:
            raise ValueError(f"expected {self._cusum.size} compute times, got shape {times.shape}")
        if self._step is not None and step <= self._step:
            raise ValueError(f"step {step} after step {self._step}: steps must increase "
                             "(a restarted attempt needs a new Monitor)")
        with np.errstate(all="ignore"):
            x = np.log(np.where(times > 0, times, np.nan))
        seen = ~np.isnan(x)
        self._progress_at[seen] = np.fmax(self._progress_at[seen], now)
        self._beat_at[seen] = np.fmax(self._beat_at[seen], now)
        if math.isnan(self._first_at):
            self._first_at = now
        row, last, last_at = self._pos, self._step, self._step_at
        self._step, self._step_at = step, now
        self._started += bool(seen.any())
        if self._started <= cfg.straggler_warmup_steps or not seen.any():
            return                     # compiling, warming caches: nothing to learn from yet
        self._interval[row] = (now - last_at) / (step - last)
        center = float(_median(x[seen])) if self._peers else 0.0
        d = x - center
        self._logt[row], self._center[row] = x, center
        self._spread[row] = MAD_TO_SIGMA * float(_median(np.abs(d[seen]))) if self._relative else np.nan
        self._pos = (row + 1) % self._rows
        self._filled += 1
        if self._filled % cfg.straggler_window == 0:
            self._refresh_baseline()
        if np.isnan(self._own_center).all():
            return                     # no baseline yet
        # A rank's own sigma comes from few samples, and an underestimate means false alarms: take it
        # one standard error high (a MAD-based sigma from n samples is ~1.16/sqrt(n) off).
        samples = min(cfg.straggler_baseline + (self._refreshes - 1) * cfg.straggler_window, cfg.straggler_learn_steps)
        own = self._own_sigma * (1 + 1.16 / math.sqrt(samples))
        if self._relative:
            d = d - self._allowance
            noise = np.fmax(np.fmax(own, float(np.nanmedian(self._spread))), cfg.straggler_noise_floor)
        else:
            d = d - self._own_center
            noise = np.fmax(own, cfg.straggler_noise_floor)
        z = np.clip(d / noise, -cfg.straggler_clip, cfg.straggler_clip)
        grown = np.clip(self._cusum + z - cfg.straggler_cusum_k, 0.0, 2 * self._limit)
        self._cusum = np.where(np.isnan(z), self._cusum, grown)

    def observe(self, sample: Sample) -> None:
        """Any one sample: a rank's step or heartbeat, or a GPU's readings and Xid events."""
        if sample.gpu is not None:
            self._observe_device(sample)
        if sample.rank is None:
            return
        rank = sample.rank
        if not 0 <= rank < len(self.rank_nodes):
            raise ValueError(f"rank {rank} is not in this job's {len(self.rank_nodes)} ranks")
        self._beat_at[rank] = np.fmax(self._beat_at[rank], sample.time)
        if sample.step is None:
            self._beats[rank] = True
            return
        self._progress_at[rank] = np.fmax(self._progress_at[rank], sample.time)
        if math.isnan(self._first_at):
            self._first_at = sample.time
        value = sample.compute_time if sample.compute_time is not None else sample.step_time
        if self._step is not None and sample.step <= self._step:
            return                     # that step was closed without it
        pending = self._pending.get(sample.step)
        if pending is None:
            pending = self._pending[sample.step] = _Pending(np.full(len(self.rank_nodes), np.nan))
        if value is not None and np.isnan(pending.values[rank]):
            pending.values[rank] = value
            pending.count += 1
        pending.time = max(pending.time, sample.time)
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

    def _observe_device(self, sample: Sample) -> None:
        cfg, key = self.config, (sample.node, sample.gpu)
        dev = self._devices.setdefault(key, _Device())
        if sample.xid is not None:
            self._events.append(self._xid_finding(sample))
        ratio = sample.clock_ratio
        if ratio is not None:
            reasons = sample.clock_event_reasons or 0
            slowed = ratio < cfg.throttle_clock_ratio and bool(reasons & ClockReason.THROTTLING)
            dev.throttled = dev.throttled + 1 if slowed else 0
            dev.clock, dev.max_clock, dev.reasons = sample.sm_clock_mhz or 0.0, sample.max_sm_clock_mhz or 0.0, reasons
        if sample.ecc_dbe_volatile is not None:
            dev.dbe = sample.ecc_dbe_volatile
        if sample.remapped_rows_pending is not None:
            dev.pending = sample.remapped_rows_pending
        if sample.remapped_rows_failure is not None:
            dev.failure = sample.remapped_rows_failure
        if sample.ecc_sbe_volatile is not None:
            if dev.sbe and sample.ecc_sbe_volatile < dev.sbe[-1][1]:
                dev.sbe.clear()        # the volatile counter restarts with the GPU
            dev.sbe.append((sample.time, sample.ecc_sbe_volatile))
            while sample.time - dev.sbe[0][0] > 3600:
                dev.sbe.popleft()
        if (dev.throttled >= cfg.throttle_samples or dev.dbe or dev.pending or dev.failure
                or self._sbe_last_hour(dev) >= cfg.ecc_sbe_per_hour):
            self._watch.add(key)

    # ---- output ---------------------------------------------------------------------------------
    def check(self, now: float) -> list[Finding]:
        """Every finding that holds now, plus the events (Xids) seen since the last check."""
        findings, self._events = self._events, []
        stragglers = self._stragglers(now)
        throttled = self._device_findings(now, findings)
        for node in sorted(set(stragglers) | set(throttled)):
            slow, hot = stragglers.get(node), throttled.get(node)
            if slow and hot:           # the slow rank's own GPU is throttled: one finding, both halves
                findings.append(Finding(FindingKind.THROTTLE, Severity.CRITICAL, node, hot.gpu, slow.ranks,
                                        f"{slow.evidence}; {hot.evidence}", now, self._step))
            else:
                findings.append(slow or hot)
        findings.extend(self._hangs(now))
        return findings

    def scores(self) -> np.ndarray:
        """Each rank's windowed score: cluster median / its compute time over the last window (1.0 healthy)."""
        recent = self._recent_rows(self.config.straggler_window)
        if not recent.size:
            return np.full(len(self.rank_nodes), np.nan)
        d = self._logt[recent] - self._center[recent, None]
        if not self._relative:
            d = d - self._own_center
        return np.exp(-_median(d, axis=0))

    # ---- detectors ------------------------------------------------------------------------------
    def _recent_rows(self, count: int, skip: int = 0) -> np.ndarray:
        """Ring indices of up to `count` steps, newest first, after skipping the newest `skip`."""
        count = max(0, min(count, self._filled - skip))
        return (self._pos - 1 - skip - np.arange(count)) % self._rows

    def _refresh_baseline(self) -> None:
        """Each rank's own center and noise over the baseline steps (before the recent window)."""
        cfg = self.config
        rows = self._recent_rows(cfg.straggler_baseline, skip=cfg.straggler_window)
        if rows.size < cfg.straggler_baseline:         # too few to say what is usual for a rank
            return
        d = self._logt[rows] - self._center[rows, None]
        center = _median(d, axis=0)
        # The rank's noise and how much slower than the median it usually is (a slower chip) are
        # learned slowly: a 32-step estimate is 20% off often enough to cause false alarms, and a new
        # slowdown must be caught long before it is taken for normal. The allowance is capped: a
        # rank always slower than that is a fault, however long it has been.
        self._refreshes += 1
        weight = max(1 / self._refreshes, cfg.straggler_window / cfg.straggler_learn_steps)
        # The center is learned as slowly as the rest: taken whole at each refresh, a slowdown
        # would become the rank's "own baseline" one window after it began, before it is caught.
        known = ~np.isnan(self._own_center)
        learned = self._own_center + weight * (center - self._own_center)
        self._own_center = np.where(known, np.where(np.isnan(center), self._own_center, learned), center)
        sigma = MAD_TO_SIGMA * _median(np.abs(d - center), axis=0)
        sigma = np.where(np.isnan(sigma), self._own_sigma, sigma)          # no data: keep what we knew
        known = ~np.isnan(self._own_sigma)
        self._own_sigma = np.where(known, self._own_sigma + weight * (sigma - self._own_sigma), sigma)
        usual = np.clip(np.nan_to_num(self._own_center), 0.0, -math.log(1 - cfg.straggler_min_slowdown))
        self._allowance += weight * (usual - self._allowance)

    def _stragglers(self, now: float) -> dict[str, Finding]:
        cfg = self.config
        ranks = np.flatnonzero(self._cusum > self._limit)
        if not ranks.size:
            return {}
        recent = self._recent_rows(cfg.straggler_window)
        d = self._logt[np.ix_(recent, ranks)] - self._center[recent, None]
        slow = _median(d, axis=0) - (0.0 if self._relative else self._own_center[ranks])
        score = np.exp(-slow)
        own = np.exp(self._own_center[ranks] - _median(d, axis=0))
        keep = score < 1 - cfg.straggler_min_slowdown
        if not self._relative and keep.sum() > len(self.rank_nodes) / 2:
            return {}                  # most ranks slowed together: the job, not a node
        out: dict[str, Finding] = {}
        reference = ("the cluster median" if self._relative else "the other ranks, against its own baseline"
                     if self._peers else "its own baseline")
        for node in dict.fromkeys(self.rank_nodes[r] for r in ranks[keep]):
            sel = [i for i in np.flatnonzero(keep) if self.rank_nodes[ranks[i]] == node]
            worst = min(sel, key=lambda i: score[i])
            evidence = (f"rank {ranks[worst]} computes {1 / score[worst]:.2f}x {reference} over the last "
                        f"{recent.size} steps (score {score[worst]:.2f} < {1 - cfg.straggler_min_slowdown:.2f}, "
                        f"vs its own baseline {own[worst]:.2f}; CUSUM {self._cusum[ranks[worst]]:.1f} > "
                        f"{self._limit:.1f})")
            if len(sel) > 1:
                evidence += f"; slow ranks on this node: {_ranks_text([int(ranks[i]) for i in sel])}"
            out[node] = Finding(FindingKind.STRAGGLER, Severity.WARNING, node, None,
                                tuple(int(ranks[i]) for i in sel), evidence, now, self._step)
        return out

    def _device_findings(self, now: float, findings: list[Finding]) -> dict[str, Finding]:
        """ECC findings go straight to `findings`; throttle findings come back by node, to pair with stragglers."""
        cfg = self.config
        throttled: dict[str, Finding] = {}
        for key in sorted(self._watch):
            node, gpu = key
            dev = self._devices[key]
            ecc: list[str] = []
            severity = Severity.WARNING
            if dev.dbe:
                ecc.append(f"{dev.dbe} uncorrected (double-bit) ECC errors since the last GPU reset")
                severity = Severity.CRITICAL
            if dev.failure:
                ecc.append("row remapping failed: bad memory rows can no longer be retired")
                severity = Severity.CRITICAL
            if dev.pending:
                ecc.append("a row remap is pending: the GPU needs a reset to retire the bad row")
            sbe = self._sbe_last_hour(dev)
            if sbe >= cfg.ecc_sbe_per_hour:
                ecc.append(f"{sbe} corrected ECC errors in the last hour (limit {cfg.ecc_sbe_per_hour})")
            if ecc:
                findings.append(Finding(FindingKind.ECC, severity, node, gpu, (),
                                        f"GPU {gpu}: " + "; ".join(ecc), now, self._step))
            if dev.throttled >= cfg.throttle_samples and node not in throttled:
                reasons = ClockReason(dev.reasons & ClockReason.THROTTLING)
                # A power or software cap alone is ordinary under full load; hardware slowdown is not.
                level = Severity.WARNING if reasons & HW_THROTTLING else Severity.INFO
                throttled[node] = Finding(
                    FindingKind.THROTTLE, level, node, gpu, (),
                    f"GPU {gpu} SM clock {dev.clock:.0f}/{dev.max_clock:.0f} MHz "
                    f"({dev.clock / dev.max_clock:.0%} < {cfg.throttle_clock_ratio:.0%}) with {reasons.name} "
                    f"for {dev.throttled} samples", now, self._step)
            if not ecc and dev.throttled < cfg.throttle_samples:
                self._watch.discard(key)
        return throttled

    def _xid_finding(self, sample: Sample) -> Finding:
        xid = classify_xid(int(sample.xid))
        todo = "drain the node" if xid.drain else "reset the GPU" if xid.reset else "no node action"
        return Finding(FindingKind.XID, xid.severity, sample.node, sample.gpu, (),
                       f"Xid {xid.code} on GPU {sample.gpu}: {xid.description} ({xid.fault} fault; {todo})",
                       sample.time, self._step)

    @staticmethod
    def _sbe_last_hour(dev: _Device) -> int:
        return dev.sbe[-1][1] - dev.sbe[0][1] if dev.sbe else 0

    def _hangs(self, now: float) -> list[Finding]:
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
            return self._by_node(np.flatnonzero(stuck), now, Severity.WARNING,
                                 lambda r: f"rank(s) {r} finished no step for {now - since[stuck].max():.0f}s "
                                           f"(timeout {timeout:.0f}s) while the others reached step {self._step}")
        if silent.any():               # all wait in a collective; the silent ones are the ones they wait on
            return self._by_node(np.flatnonzero(silent), now, Severity.CRITICAL,
                                 lambda r: f"no rank finished a step for {idle:.0f}s (timeout {timeout:.0f}s); "
                                           f"rank(s) {r} silent for {now - np.nanmax(self._beat_at[silent]):.0f}s "
                                           f"(heartbeat timeout {cfg.heartbeat_timeout_s:.0f}s) while the others "
                                           "keep beating: the job waits on them")
        why = ("every rank still heartbeats: a deadlock, or a wait outside the job" if self._beats.all()
               else "no heartbeats to tell which rank the others wait on")
        return [Finding(FindingKind.HANG, Severity.CRITICAL, "", None, tuple(range(len(self.rank_nodes))),
                        f"no rank finished a step for {idle:.0f}s (timeout {timeout:.0f}s) after step "
                        f"{self._step}; {why}", now, self._step)]

    def _by_node(self, ranks: np.ndarray, now: float, severity: Severity,
                 evidence: Callable[[str], str]) -> list[Finding]:
        out = []
        for node in dict.fromkeys(self.rank_nodes[r] for r in ranks):
            mine = [int(r) for r in ranks if self.rank_nodes[r] == node]
            out.append(Finding(FindingKind.HANG, severity, node, None, tuple(mine),
                               evidence(_ranks_text(mine)), now, self._step))
        return out
