"""The straggler test: a rank that computes persistently slower than the others.

Why the test looks like this. In synchronous data parallel every rank waits for
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
What a blamed rank does is not learned as its usual standing, noise or baseline: else a 10% slowdown
would be half excused within a few hundred steps, long before a replacement pays (health/policy.py).
When noise grows on every rank at once, the cluster's spread grows with it long before each rank's
slowly learned sigma does: each rank's sigma is scaled by how much the recent spread exceeds the
spread it was learned against. Ranks slowed together on `straggler_shared_nodes` nodes or more (a
rack, a leaf switch, a quarter of the job) are one info finding of the job's, naming no node: their
CUSUMs rise together, so when the first crosses h the others are past h/2, and those are counted. A
rank far slower than that group (past its median by `straggler_min_slowdown` and 5 of its sigmas) is
still blamed on its node: a rack slowed 10% must not hide a GPU 50% slower elsewhere.
The test starts after warm-up + window + baseline steps (56 by default), once every rank has a
baseline. With 3-5% noise it finds a 10% slowdown in ~10 steps and a 20% one in ~5
(benchmarks/health.py measures it, and the false alarms).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from health.config import HealthConfig
from health.findings import Finding, FindingKind, Severity, ranks_by_node, ranks_text

MAD_TO_SIGMA = 1.4826          # sigma of a normal distribution = 1.4826 x its median absolute deviation


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


def _apart(slow: np.ndarray, margin: float) -> np.ndarray:
    """Which of ranks slowed together (`slow`: log slowdowns) are far slower than the rest: past their median
    by `margin` and by 5 sigmas of their spread. A GPU 50% slower is its node's fault, even while a rack
    is 10% slower."""
    center = float(np.median(slow))
    sigma = MAD_TO_SIGMA * float(np.median(np.abs(slow - center)))
    return slow > center + max(margin, 5 * sigma)


class StragglerTest:
    """The CUSUM test over every rank's log compute time; the last window + baseline steps in numpy rings."""

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
        self._filled = 0                                    # steps in the rings
        self._pos = 0                                       # next row to write
        self._cusum = np.zeros(n)
        self._limit = cusum_limit(config.straggler_cusum_k, config.straggler_false_alarm_steps)
        self._own_center = np.full(n, np.nan)               # median deviation over the baseline rows
        self._own_sigma = np.full(n, np.nan)                # noise sigma over the baseline rows
        self._allowance = np.zeros(n)                       # how much slower than the median it usually is
        self._base_spread = 0.0                             # the cluster's spread over the baseline rows
        self._refreshes = 0

    def add(self, x: np.ndarray, seen: np.ndarray) -> None:
        """One step after the warm-up: every rank's log compute time `x` (NaN where not `seen`)."""
        row = self._pos
        center = float(_median(x[seen])) if self._peers else 0.0
        d = x - center
        self._logt[row], self._center[row] = x, center
        self._spread[row] = MAD_TO_SIGMA * float(_median(np.abs(d[seen]))) if self._relative else np.nan
        self._pos = (row + 1) % self._rows
        self._filled += 1
        if self._filled % self.config.straggler_window == 0:
            self._refresh_baseline()
        if np.isnan(self._own_center).all():
            return                     # no baseline yet
        self._accumulate(d)

    def scores(self) -> np.ndarray:
        """Each rank's windowed score: cluster median / its compute time over the last window (1.0 healthy)."""
        recent = self._recent_rows(self.config.straggler_window)
        if not recent.size:
            return np.full(len(self.rank_nodes), np.nan)
        d = self._logt[recent] - self._center[recent, None]
        if not self._relative:
            d = d - self._own_center
        return np.exp(-_median(d, axis=0))

    def findings(self, now: float, step: int | None) -> dict[str, Finding]:
        """A finding per node with a rank whose CUSUM crossed the limit and whose last window is slow; or,
        when ranks on `straggler_shared_nodes` nodes or more are slowed together, one finding of the job's."""
        cfg = self.config
        if not (self._cusum > self._limit).any():
            return {}
        # Suspects: past half the limit. A shared cause (a rack, a switch, a quarter of the job) raises the
        # CUSUMs of all its ranks together, so when the first crosses the limit the others are near it.
        ranks = np.flatnonzero(self._cusum > self._limit / 2)
        recent = self._recent_rows(cfg.straggler_window)
        d = self._logt[np.ix_(recent, ranks)] - self._center[recent, None]
        slow = _median(d, axis=0) - (0.0 if self._relative else self._own_center[ranks])
        score = np.exp(-slow)
        own = np.exp(self._own_center[ranks] - _median(d, axis=0))
        keep = score < 1 - cfg.straggler_min_slowdown
        if not self._relative and keep.sum() > len(self.rank_nodes) / 2:
            return {}                  # most ranks slowed together: the job, not a node
        at = {int(rank): i for i, rank in enumerate(ranks)}
        slowed = ranks_by_node(self.rank_nodes, ranks[keep])
        out: dict[str, Finding] = {}
        if len(slowed) >= cfg.straggler_shared_nodes:
            apart = _apart(slow[keep], -math.log(1 - cfg.straggler_min_slowdown))
            group = ranks[keep][~apart]
            out[""] = self._shared(ranks_by_node(self.rank_nodes, group), group, score[keep][~apart], now, step)
            slowed = ranks_by_node(self.rank_nodes, ranks[keep][apart])   # far slower than the group: their own
        reference = ("the cluster median" if self._relative else "the other ranks, against its own baseline"
                     if self._peers else "its own baseline")
        for node, mine in slowed.items():
            mine = [r for r in mine if self._cusum[r] > self._limit]
            if not mine:
                continue
            worst = min(mine, key=lambda r: score[at[r]])
            i = at[worst]
            evidence = (f"rank {worst} computes {1 / score[i]:.2f}x {reference} over the last "
                        f"{recent.size} steps (score {score[i]:.2f} < {1 - cfg.straggler_min_slowdown:.2f}, "
                        f"vs its own baseline {own[i]:.2f}; CUSUM {self._cusum[worst]:.1f} > "
                        f"{self._limit:.1f})")
            if len(mine) > 1:
                evidence += f"; slow ranks on this node: {ranks_text(mine)}"
            out[node] = Finding(FindingKind.STRAGGLER, Severity.WARNING, node, None, tuple(mine), evidence, now, step,
                                slowdown=float(1 / score[i] - 1))
        return out

    def _shared(self, slowed: dict[str, list[int]], ranks: np.ndarray, score: np.ndarray, now: float,
                step: int | None) -> Finding:
        """One info finding of the job for a slowdown many nodes share: no node is to blame for it."""
        nodes = list(slowed)
        shown = ", ".join(nodes[:4]) + (f" and {len(nodes) - 4} more" if len(nodes) > 4 else "")
        factor = float(np.median(1 / score))
        return Finding(FindingKind.STRAGGLER, Severity.INFO, "", None, tuple(int(r) for r in ranks),
                       f"{ranks.size} ranks on {len(nodes)} nodes ({shown}) compute {factor:.2f}x the cluster median "
                       f"together: a shared cause (a rack, a switch, the network, storage or the data), not one "
                       f"node's fault (>= {self.config.straggler_shared_nodes} nodes); no node replaced",
                       now, step, slowdown=factor - 1)

    def _accumulate(self, d: np.ndarray) -> None:
        """Add this step's deviations `d`, in units of noise and clipped, to each rank's CUSUM."""
        cfg = self.config
        # A rank's own sigma comes from few samples, and an underestimate means false alarms: take it
        # one standard error high (a MAD-based sigma from n samples is ~1.16/sqrt(n) off).
        samples = min(cfg.straggler_baseline + (self._refreshes - 1) * cfg.straggler_window, cfg.straggler_learn_steps)
        own = self._own_sigma * (1 + 1.16 / math.sqrt(samples))
        if self._relative:
            d = d - self._allowance
            # Noise that grows on every rank (a noisier fabric, a new data mix) grows the cluster's spread
            # at once, long before each rank's slowly learned sigma follows: scale those by how much.
            recent = float(np.nanmedian(self._spread[self._recent_rows(cfg.straggler_window)]))
            # (a 5% dead band: the spread's own jitter must not slow the detection of a real slowdown)
            growth = max(1.0, recent / self._base_spread - 0.05) if self._base_spread > 0 else 1.0
            noise = np.fmax(np.fmax(own * growth, float(np.nanmedian(self._spread))), cfg.straggler_noise_floor)
        else:
            d = d - self._own_center
            noise = np.fmax(own, cfg.straggler_noise_floor)
        z = np.clip(d / noise, -cfg.straggler_clip, cfg.straggler_clip)
        grown = np.clip(self._cusum + z - cfg.straggler_cusum_k, 0.0, 2 * self._limit)
        self._cusum = np.where(np.isnan(z), self._cusum, grown)

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
        blamed = self._blamed()
        # The center is learned as slowly as the rest: taken whole at each refresh, a slowdown
        # would become the rank's "own baseline" one window after it began, before it is caught.
        known = ~np.isnan(self._own_center)
        learned = self._own_center + weight * (center - self._own_center)
        keep = np.isnan(center) | blamed                # no data, or blamed now: nothing learned from it
        self._own_center = np.where(known, np.where(keep, self._own_center, learned), center)
        sigma = MAD_TO_SIGMA * _median(np.abs(d - center), axis=0)
        sigma = np.where(blamed, np.nan, sigma)
        sigma = np.where(np.isnan(sigma), self._own_sigma, sigma)          # no data: keep what we knew
        known = ~np.isnan(self._own_sigma)
        self._own_sigma = np.where(known, self._own_sigma + weight * (sigma - self._own_sigma), sigma)
        spread = float(np.nanmedian(self._spread[rows])) if self._relative else math.nan
        if math.isfinite(spread):      # the cluster's spread when the ranks' sigmas were learned, learned alike
            self._base_spread = spread if self._base_spread <= 0 else (
                self._base_spread + weight * (spread - self._base_spread))
        usual = np.clip(np.nan_to_num(self._own_center), 0.0, -math.log(1 - cfg.straggler_min_slowdown))
        self._allowance = np.where(blamed, self._allowance, self._allowance + weight * (usual - self._allowance))

    def _blamed(self) -> np.ndarray:
        """The ranks `findings` would blame now: CUSUM past the limit and the last window slow enough."""
        blamed = self._cusum > self._limit
        if not blamed.any():
            return blamed
        recent = self._recent_rows(self.config.straggler_window)
        slow = _median(self._logt[recent] - self._center[recent, None], axis=0)
        if not self._relative:
            slow = slow - self._own_center
        return blamed & (np.exp(-slow) < 1 - self.config.straggler_min_slowdown)
