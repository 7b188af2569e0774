"""A cluster simulator that drives the real Monitor and Policy: detection delay, false alarms, ETTR.

    tfsn health simulate --ranks 4096 --steps 300 --throttle-rank 17 --slowdown 0.2 --onset 100 --json

Why: a health monitor is only as good as its numbers on a cluster nobody has at hand. The
simulator makes per-rank compute times with realistic noise (lognormal per rank and step, a shared
per-step jitter, static chip-to-chip differences, rare 2-3x outlier steps), slows one GPU (or random
ones) by a *fractional slowdown* (0.10 = that rank computes 1.10x longer, its NVML clock ratio
1/1.10 with HW_SLOWDOWN|HW_THERMAL set), can add a healthy disturbance no node should be replaced
for (health/disturbances.py: a transient, a slow rack or switch or quarter, noise growth, heavy tails,
GC pauses, eval steps), interrupts the job at Llama 3's rate with Llama 3's causes (health/failures.py:
the ~40% with no Xid included), and replays what tfsn's Monitor and Policy decide, step by step, in
simulated time. Slowdowns are not counted in Llama 3's table; we assume one slow GPU per four
interruptions (`stragglers_per_gpu_hour`).

ETTR (effective training time ratio) = steps x healthy step time / wall time: every second not
spent on a step that is kept counts against it - checkpoint stalls, work lost since the last
checkpoint (or, after silent data corruption, since the corruption), detection and restart time, the
restarts and saves false alarms cause, and steps run slower because a slow rank holds everyone back
(in synchronous data parallel the slowest rank sets the pace). How soon each cause is known:
                     Xid          exit        hang (no Xid)        node lost           SDC
  tfsn               GPU sample   agent poll  hang timeout (*)     node heartbeat      found after
                     (5 s)        (5 s)       from health/hang.py  timeout (30 s)      sdc_found_after_s
  restart-on-crash   exit, or the NCCL timeout (PyTorch's default, 10 min) when the collectives hang
  none               a person notices (`manual_detect_s`, 30 minutes); slow ranks are never fixed
(*) no node is named: a NIC's node is found when the restart fails on it again (one more restart).
All modes replace a node at fault when it is known and checkpoint at the same interval.

Restart and save costs (`RESTART_S`, `ASYNC_SAVE_STALL_SHARE` of a step) are named constants below,
each with the measurement it comes from; the checkpoint interval follows from the save cost (Young).
A week at 16,384 GPUs runs with `fast_forward`: the Monitor then watches only around slowdowns, so the false alarms a
healthy stretch would raise are measured apart, by benchmarks/health.py's healthy and hidden-healthy
runs at 4096 ranks (each would cost a save, or a save and a restart, here).
"""
from __future__ import annotations

import argparse
import enum
import json
import math
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from health.config import HealthConfig
from health.disturbances import Disturbance
from health.failures import LLAMA3_CAUSES, LLAMA3_FAILURES_PER_GPU_HOUR, Cause, Effect
from health.findings import Action, Decision, Finding, Severity
from health.hang import step_timeout
from health.monitor import Monitor
from health.policy import Costs, Policy
from health.telemetry import ClockReason, Sample

MAX_CLOCK_MHZ = 1980.0                                      # H100 SXM boost clock
# Seconds a restart takes once the fault is known: the failed node replaced, workers started,
# rendezvous, the checkpoint loaded, the first step run. MEASURED on the local provider by
# `python benchmarks/recovery.py --repeats 3` (2 nodes x 1 worker, no spares: median of 3 kills of the
# "step done" row, kill -9 to the first step of attempt 2 done, detection included: an upper bound of
# the restart alone). A large job takes longer to restore (the example's checkpoint is 5 MB; NCCL's
# setup grows with the ranks) and a cloud job adds what its spares do not hide: this understates those.
RESTART_S = 9.1                 # runs of 8.4, 11.9 and 9.1 s (2026-12-04); one earlier run: 29.8 s
# The training's stall per checkpoint save, as a share of a step. MEASURED by the same run of
# `python benchmarks/recovery.py --repeats 3`: its async "stall / step" row (median stall over 24
# saves / median step without a save, rank 0 of the example, asynchronous saves). The stall is reading
# the state dicts and copying them to host memory; it grows with the state held per GPU, as a step's
# work does, so the simulator charges the same share of its own step (`Scenario.step_s`). That scaling is
# an assumption: the example copies host to host, a GPU job copies device to pinned host memory.
ASYNC_SAVE_STALL_SHARE = 0.032  # 2.3 ms per save over a 72.5 ms step (2026-12-04)


class Mode(str, enum.Enum):
    TFSN = "tfsn"
    RESTART_ON_CRASH = "restart-on-crash"
    NONE = "none"


@dataclass(frozen=True)
class Scenario:
    """The simulated cluster and its faults; defaults as documented in the module docstring."""

    noise: tuple[float, float] = (0.03, 0.05)  # per rank, the lognormal sigma of its step-to-step noise
    chip_spread: float = 0.01                  # static speed differences between GPUs (lognormal sigma)
    common_noise: float = 0.02                 # per-step jitter every rank shares (data, eval): the median cancels it
    outlier_rate: float = 1e-3                 # outlier steps (GC pauses, page faults) per rank-step ...
    outlier_factor: tuple[float, float] = (2.0, 3.0)   # ... each this many times longer
    step_s: float = 5.0                        # a healthy step's wall time
    gpus_per_node: int = 8
    failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    causes: tuple[Cause, ...] = LLAMA3_CAUSES  # what an interruption is, weighted by its count
    hang_share: float = 0.5                    # without a monitor: Xid faults that hang the collectives rather than exit
    stragglers_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR / 4   # assumed, see the module docstring
    straggler_slowdown: tuple[float, float] = (0.1, 0.5)    # a random slow GPU (thermal, power brake): 10-50% slower
    device_samples: bool = True                # slow GPUs report their clocks; False: only step times tell
    checkpoint_save_s: float | None = None     # the training's stall per save; None: ASYNC_SAVE_STALL_SHARE x step_s
    checkpoint_every_steps: int | None = None  # None: Young's interval sqrt(2 x save x MTBF), as `interval: auto`
    restart_s: float = RESTART_S               # once the fault is known: see RESTART_S
    restarted_before: bool = False             # the job restarted before this stretch: the Policy knows restart_s
    exit_detect_s: float = 5.0                 # the agent's poll and GPU sample period: a process exit, an Xid
    node_timeout_s: float = 30.0               # train.yaml's heartbeat_timeout: a silent node is failed
    sdc_found_after_s: float = 3600.0          # ASSUMED: silent data corruption is noticed (a loss spike) this late
    collective_timeout_s: float = 600.0        # PyTorch's default NCCL timeout ends a hung collective
    manual_detect_s: float = 1800.0            # with no monitor, how long until a person notices
    disturbance: str = ""                      # a healthy disturbance (health/disturbances.py) ...
    disturbance_onset: int = 100               # ... from this step
    fast_forward: bool = False                 # feed the Monitor only around slowdowns (for long runs) ...
    watch_steps: int = 300                     # ... from before each onset until this many steps after it

    def __post_init__(self) -> None:
        if self.checkpoint_save_s is None:
            object.__setattr__(self, "checkpoint_save_s", ASYNC_SAVE_STALL_SHARE * self.step_s)


@dataclass
class SimResult:
    """What one simulated run did and how much of its time trained."""

    mode: str
    ranks: int
    steps: int
    seed: int
    detected: bool                    # the throttled rank was blamed
    detection_delay_steps: int | None  # steps from its onset to the first finding on it
    blamed: list[int]                 # ranks named by any finding
    false_positives: int              # nodes found at fault (warned about or worse) while healthy
    ettr: float
    wall_s: float
    crashes: int = 0
    stragglers: int = 0               # slow GPUs that appeared (scripted + random)
    replacements: int = 0             # nodes replaced on the policy's decision (crash replacements not counted)
    false_replacements: int = 0       # of those, nodes with no slow GPU (a healthy node replaced)
    lost_steps: int = 0               # steps redone after restarts
    checkpoints: int = 0
    decisions: dict[str, int] = field(default_factory=dict)   # the Policy's decisions by action
    causes: dict[str, int] = field(default_factory=dict)      # interruptions by cause (health/failures.py)
    # Where the wall time that did not train went: wall = steps x step_s + the sum of these.
    lost_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("checkpoints", "rework", "detection", "restarts", "slow_steps"), 0.0))

    def to_json(self) -> dict:
        return asdict(self)


def checkpoint_interval_steps(ranks: int, scenario: Scenario) -> int:
    """Young's interval sqrt(2 x save x MTBF), clamped to 30 s..30 min like checkpoint `interval: auto`."""
    if scenario.checkpoint_every_steps:
        return scenario.checkpoint_every_steps
    rate_s = scenario.failures_per_gpu_hour * ranks / 3600
    seconds = math.sqrt(2 * scenario.checkpoint_save_s / rate_s) if rate_s > 0 else 1800.0
    return max(1, round(min(max(seconds, 30.0), 1800.0) / scenario.step_s))


def detection_s(cause: Cause, mode: Mode, sc: Scenario, config: HealthConfig, hangs: bool) -> float:
    """Seconds from an interruption to its being known, by what it looks like and who watches
    (`hangs`: without a monitor, whether an Xid fault hangs the collectives rather than exits)."""
    if cause.effect == Effect.SILENT:
        return sc.sdc_found_after_s
    if mode == Mode.NONE:
        return sc.manual_detect_s
    if mode == Mode.RESTART_ON_CRASH:
        exits = cause.effect == Effect.EXIT or (cause.effect == Effect.XID and not hangs)
        return sc.exit_detect_s if exits else sc.collective_timeout_s
    if cause.effect == Effect.HANG:
        return step_timeout(config, np.array([sc.step_s]))
    return sc.node_timeout_s if cause.effect == Effect.NODE_LOST else sc.exit_detect_s


class _Run:
    """One simulated job: its ranks, its faults, its clock, and (for tfsn) its Monitor and Policy."""

    def __init__(self, ranks: int, seed: int, mode: Mode, scenario: Scenario, config: HealthConfig) -> None:
        self.n, self.mode, self.sc, self.config = ranks, mode, scenario, config
        # One stream per source, so the three modes meet the same crashes and slowdowns in the same order.
        self.rng, self.crashes, self.slowdowns = (np.random.default_rng([seed, i]) for i in range(3))
        self.generation = [0] * -(-ranks // scenario.gpus_per_node)   # a replaced node comes back renamed
        self.sigma = self.rng.uniform(*scenario.noise, ranks)
        self.chip = np.exp(scenario.chip_spread * self.rng.standard_normal(ranks))
        self.slow: dict[int, float] = {}               # rank -> fractional slowdown
        self.onset: dict[int, float] = {}              # rank -> when it slowed down
        self.t, self.step, self.saved = 0.0, 0, 0
        # What the Policy knows of a restart's and a save's cost: as the controller's HealthWatch, only what
        # this job has seen (None until its first restart or save: the Policy then takes its configured defaults).
        self.seen: dict[str, float | None] = {"restarts": scenario.restart_s if scenario.restarted_before else None,
                                              "checkpoints": None}
        self.interval = checkpoint_interval_steps(ranks, scenario)
        self.policy = Policy(config) if mode == Mode.TFSN else None
        self.monitor: Monitor | None = None
        self.next_crash = self._after(scenario.failures_per_gpu_hour, self.crashes)
        self.next_straggler = self._after(scenario.stragglers_per_gpu_hour, self.slowdowns)
        # Fast-forward starts the Monitor this long before a slowdown, so it has its history.
        self.lead_s = (config.straggler_warmup_steps + config.straggler_window + config.straggler_baseline
                       + 8) * scenario.step_s
        self.blamed: set[int] = set()
        self.false: set[str] = set()
        self.total = 0
        self.disturbance = (Disturbance(scenario.disturbance, scenario.disturbance_onset, ranks, scenario.gpus_per_node)
                            if scenario.disturbance else None)
        self.result = SimResult(mode.value, ranks, 0, seed, False, None, [], 0, 0.0, 0.0)

    def node(self, rank: int) -> str:
        slot = rank // self.sc.gpus_per_node
        return f"node{slot}" + (f"-{self.generation[slot]}" if self.generation[slot] else "")

    def _after(self, per_gpu_hour: float, rng: np.random.Generator) -> float:
        """When the next event of a Poisson process at `per_gpu_hour` x ranks comes."""
        rate = per_gpu_hour * self.n / 3600
        return self.t + rng.exponential(1 / rate) if rate > 0 else math.inf

    # ---- the run --------------------------------------------------------------------------------
    def run(self, steps: int, throttle: tuple[int, float, int] | None) -> SimResult:
        onset_step: int | None = None
        self.total = steps
        while self.step < steps:
            if throttle and onset_step is None and self.step >= throttle[2]:
                onset_step = self.step
                self._slow_down(throttle[0], throttle[1])
            while self.next_straggler <= self.t:
                rng = self.slowdowns
                self._slow_down(int(rng.integers(self.n)), float(rng.uniform(*self.sc.straggler_slowdown)))
                self.next_straggler = self._after(self.sc.stragglers_per_gpu_hour, rng)
            dt = self.sc.step_s * (1 + max(self.slow.values(), default=0.0))
            if self.next_crash < self.t + dt:
                self._interrupt()
                continue
            self.t += dt
            self.result.lost_s["slow_steps"] += dt - self.sc.step_s
            self.step += 1
            if self.mode == Mode.TFSN and (not self.sc.fast_forward or self._watching(throttle, onset_step)):
                self._monitor(throttle[0] if throttle else None, onset_step)
            elif self.monitor is not None:
                self.monitor = None
            if self.step - self.saved >= self.interval:
                self._checkpoint()
        r = self.result
        r.steps, r.wall_s = steps, self.t
        r.ettr = steps * self.sc.step_s / self.t if self.t else 1.0
        r.blamed, r.false_positives = sorted(self.blamed), len(self.false)
        return r

    def _slow_down(self, rank: int, slowdown: float) -> None:
        self.slow[rank], self.onset[rank] = slowdown, self.t
        self.result.stragglers += 1

    def _watching(self, throttle: tuple[int, float, int] | None, onset_step: int | None) -> bool:
        """Fast-forward: is a slowdown about to start, or recent enough for the Monitor still to find it?"""
        watch_s = self.sc.watch_steps * self.sc.step_s
        return (self.next_straggler - self.t < self.lead_s or (throttle is not None and onset_step is None)
                or any(self.t - self.onset[r] < watch_s for r in self.slow))

    def _monitor(self, throttled: int | None, onset_step: int | None) -> None:
        sc, n = self.sc, self.n
        if self.monitor is None:
            self.monitor = Monitor(self.config, [self.node(r) for r in range(n)])
        times = self._compute_times()
        self.monitor.observe_step(self.step, times, self.t)
        if sc.device_samples:
            reasons = int(ClockReason.HW_SLOWDOWN | ClockReason.HW_THERMAL)
            for rank, slowdown in self.slow.items():
                self.monitor.observe(Sample(time=self.t, node=self.node(rank), gpu=rank % sc.gpus_per_node,
                                            sm_clock_mhz=MAX_CLOCK_MHZ / (1 + slowdown),
                                            max_sm_clock_mhz=MAX_CLOCK_MHZ, clock_event_reasons=reasons))
        findings = self.monitor.check(self.t)
        self._score(findings, throttled, onset_step)
        costs = Costs(step_s=sc.step_s, remaining_steps=self.total - self.step, restart_s=self.seen["restarts"],
                      save_s=self.seen["checkpoints"])
        self._act(self.policy.decide(findings, self.t, costs))

    def _compute_times(self) -> np.ndarray:
        """This step's compute time of every rank: noise, chips, outliers, slow GPUs, the disturbance."""
        sc, n, rng, dist = self.sc, self.n, self.rng, self.disturbance
        scale, z = dist.noise(self.step, rng) if dist else (1.0, None)
        z = rng.standard_normal(n) if z is None else z
        times = np.exp(scale * self.sigma * z + sc.common_noise * rng.standard_normal()) * self.chip
        outliers = np.flatnonzero(rng.random(n) < sc.outlier_rate)
        times[outliers] *= rng.uniform(*sc.outlier_factor, outliers.size)
        for rank, slowdown in self.slow.items():
            times[rank] *= 1 + slowdown
        if dist:
            dist.apply(self.step, times, rng)
        return times

    def _score(self, findings: list[Finding], throttled: int | None, onset_step: int | None) -> None:
        """Which findings were right: on a node with a slow GPU, or false."""
        faulty = {self.node(r) for r in self.slow}
        gpus = self.sc.gpus_per_node
        for f in findings:
            # A GPU finding (throttle, Xid, ECC) names a node and GPU, not ranks: here GPU g of node
            # slot s runs rank s * gpus + g.
            if f.ranks or not f.node:
                self.blamed.update(f.ranks)
            else:
                slot = int(f.node.removeprefix("node").split("-")[0])
                self.blamed.update(slot * gpus + g for g in (range(gpus) if f.gpu is None else [f.gpu]))
            if f.node and f.node not in faulty and f.severity != Severity.INFO:
                self.false.add(f.node)
            hit = throttled is not None and throttled in self.slow and f.node == self.node(throttled)
            if hit and not self.result.detected and f.severity != Severity.INFO:
                self.result.detected = True
                self.result.detection_delay_steps = self.step - onset_step

    def _act(self, decisions: list[Decision]) -> None:
        restart = False
        for decision in self._count(decisions):
            if decision.action == Action.CHECKPOINT:
                self._checkpoint()
            elif decision.action == Action.REPLACE_NODE:
                healthy = decision.node not in {self.node(r) for r in self.slow}
                self._replace(decision.node)
                self.result.replacements += 1
                self.result.false_replacements += healthy
                restart = True
            elif decision.action == Action.FAIL:
                self._roll_back()
                restart = True
        if restart:
            if self.step > self.saved:   # the job still runs: save before the restart, lose nothing
                self._checkpoint()
            self._lose("restarts", self.sc.restart_s)
            self.monitor = None          # a new attempt gets a new Monitor

    def _count(self, decisions: list[Decision]) -> list[Decision]:
        for decision in decisions:
            self.result.decisions[decision.action.value] = self.result.decisions.get(decision.action.value, 0) + 1
        return decisions

    def _interrupt(self) -> None:
        """An interruption of one of Llama 3's causes: rework, detection, restart(s), the node replaced if at fault."""
        sc, rng = self.sc, self.crashes
        # The step in flight; none if the failure fell due while the job saved or restarted (then it is
        # taken as the save or restart ends: the clock never goes back).
        self._lose("rework", max(0.0, self.next_crash - self.t))
        self.result.crashes += 1
        weights = np.array([c.count for c in sc.causes], dtype=float)
        cause = sc.causes[int(rng.choice(len(sc.causes), p=weights / weights.sum()))]
        victim, hangs = int(rng.integers(self.n)), rng.random() < sc.hang_share
        self.result.causes[cause.name] = self.result.causes.get(cause.name, 0) + 1
        detect = detection_s(cause, self.mode, sc, self.config, hangs)
        if self.mode == Mode.TFSN and cause.effect == Effect.XID:
            # the GPU's Xid reaches the Monitor; the Policy replaces the node at once
            monitor = self.monitor or Monitor(self.config, [self.node(r) for r in range(self.n)])
            monitor.observe(Sample(time=self.t, node=self.node(victim), gpu=victim % sc.gpus_per_node, xid=cause.xid))
            self._count(self.policy.decide(monitor.check(self.t + detect), self.t + detect))
        if cause.effect == Effect.SILENT:          # everything since the corruption was wrong
            self._lose("rework", detect)
            detect = 0.0
        elif cause.node_fault and cause.effect in (Effect.HANG, Effect.EXIT):
            # nothing named the node: the restart fails on it again, and that failure names it
            self._lose("detection", sc.exit_detect_s)
            self._lose("restarts", sc.restart_s)
        if cause.node_fault:
            self._replace(self.node(victim))
        self._roll_back()
        self._lose("detection", detect)
        self._lose("restarts", sc.restart_s)
        self.monitor = None
        self.next_crash = self._after(sc.failures_per_gpu_hour, rng)

    def _roll_back(self) -> None:
        """Back to the last checkpoint: the steps since are done again."""
        self.result.lost_steps += self.step - self.saved
        self.result.lost_s["rework"] += (self.step - self.saved) * self.sc.step_s
        self.step = self.saved

    def _lose(self, why: str, seconds: float) -> None:
        self.t += seconds
        self.result.lost_s[why] += seconds
        if why in self.seen:
            self.seen[why] = seconds

    def _replace(self, node: str) -> None:
        """The node's slot gets a fresh machine: new chips, no slow GPU."""
        slot = next(s for s in range(len(self.generation)) if self.node(s * self.sc.gpus_per_node) == node)
        self.generation[slot] += 1
        ranks = range(slot * self.sc.gpus_per_node, min((slot + 1) * self.sc.gpus_per_node, self.n))
        for rank in ranks:
            self.slow.pop(rank, None)
            self.onset.pop(rank, None)
            self.sigma[rank] = self.rng.uniform(*self.sc.noise)
            self.chip[rank] = math.exp(self.sc.chip_spread * self.rng.standard_normal())
        if self.policy is not None:
            self.policy.forget(node)

    def _checkpoint(self) -> None:
        self._lose("checkpoints", self.sc.checkpoint_save_s)
        self.saved = self.step
        self.result.checkpoints += 1


# Bounds of a simulation: 64k ranks is twice the largest clusters built (the process holds ~160 MB; 3M ranks held
# 1.6 GB, and 100M ranks grew without end), and 100k steps of 512 ranks take 5 minutes here.
MAX_RANKS = 65536
MAX_STEPS = 100_000


def simulate(ranks: int = 512, steps: int = 300, throttle_rank: int | None = None, slowdown: float = 0.2,
             onset: int = 100, seed: int = 0, *, mode: Mode | str = Mode.TFSN, scenario: Scenario | None = None,
             config: HealthConfig | None = None) -> SimResult:
    """Run `steps` steps of a `ranks`-GPU job; deterministic for a seed.

    `throttle_rank` computes (1 + `slowdown`) times longer from step `onset` until its node is replaced.
    """
    if not (1 <= ranks <= MAX_RANKS and 1 <= steps <= MAX_STEPS):
        raise ValueError(f"--ranks {ranks} --steps {steps}: ranks must be from 1 to {MAX_RANKS} and steps from 1 to "
                         f"{MAX_STEPS}. To fix: simulate a job within those (memory grows with the ranks, time with both)")
    if throttle_rank is not None and not 0 <= throttle_rank < ranks:
        raise ValueError(f"--throttle-rank {throttle_rank} is not one of the {ranks} ranks. To fix: name one from 0 "
                         f"to {ranks - 1}")
    if not slowdown > 0:
        raise ValueError(f"--slowdown is a fraction greater than 0 (0.1 = 10% slower), got {slowdown}. To fix: e.g. "
                         "--slowdown 0.1")
    run = _Run(ranks, seed, Mode(mode), scenario or Scenario(), config or HealthConfig.load())
    return run.run(steps, None if throttle_rank is None else (throttle_rank, slowdown, onset))


def simulate_command(ranks: int, steps: int, throttle_rank: int | None, slowdown: float, onset: int, seed: int,
                     as_json: bool) -> int:
    """`tfsn health simulate`: a short summary; with `as_json`, a last line of one JSON object."""
    try:
        result = simulate(ranks, steps, throttle_rank, slowdown, onset, seed)
    except ValueError as err:          # bad arguments: one line on stderr, as every tfsn command says them
        print(f"tfsn: error: {err}", file=sys.stderr)
        return 2
    print(f"{ranks} ranks x {steps} steps (seed {seed}): ETTR {result.ettr:.1%}, {result.crashes} crash(es), "
          f"{result.replacements} node(s) replaced, {result.false_positives} false positive(s)")
    if throttle_rank is not None:
        found = (f"found after {result.detection_delay_steps} steps" if result.detected else "not found")
        print(f"rank {throttle_rank} {slowdown:.0%} slower from step {onset}: {found}")
    if as_json:
        print(json.dumps(result.to_json()))
    return 0


def cli_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tfsn health simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--throttle-rank", type=int, default=None)
    parser.add_argument("--slowdown", type=float, default=0.2, help="fraction: 0.1 = that rank is 10%% slower")
    parser.add_argument("--onset", type=int, default=100, help="step at which the slowdown starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    args = parser.parse_args(argv)
    return simulate_command(args.ranks, args.steps, args.throttle_rank, args.slowdown, args.onset, args.seed,
                            args.json)


if __name__ == "__main__":
    raise SystemExit(cli_main())
