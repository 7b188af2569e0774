"""A cluster simulator that drives the real Monitor and Policy: detection delay, false alarms, ETTR.

    tfsn health simulate --ranks 4096 --steps 300 --throttle-rank 17 --slowdown 0.2 --onset 100 --json

Why: a health monitor is only as good as its numbers on a cluster nobody has at hand. The
simulator makes per-rank compute times with realistic noise (lognormal per rank and step, a shared
per-step jitter, static chip-to-chip differences, rare 2-3x outlier steps), slows one GPU (or random
ones) by a *fractional slowdown* (0.10 = that rank computes 1.10x longer, its NVML clock ratio
1/1.10 with HW_SLOWDOWN|HW_THERMAL set), crashes GPUs at Llama 3's rate, and replays what tfsn's
Monitor and Policy decide, step by step, in simulated time.

Failure rate. Llama 3 405B pre-training saw 419 unexpected interruptions in 54 days on 16,384
H100s, ~78% attributed to hardware (Llama Team, "The Llama 3 Herd of Models", 2024, section 3.3.4):
419 / (54 x 24 x 16,384) = 1.97e-5 interruptions per GPU-hour, one every ~50,700 GPU-hours, i.e.
one every ~3.1 hours for the whole 16,384-GPU job. Slowdowns are not counted there; we assume one
slow GPU per four interruptions (`stragglers_per_gpu_hour`).

ETTR (effective training time ratio) = steps x healthy step time / wall time: every second not
spent on a step that is kept counts against it - checkpoint saves, work lost since the last
checkpoint, detection and restart time, and steps run slower because a slow rank holds everyone back
(in synchronous data parallel the slowest rank sets the pace). Three ways to run:
  tfsn              the Monitor and Policy: an Xid is seen within one poll and its node replaced; a
                    slow rank is found, checkpointed and its node replaced.
  restart-on-crash  no health monitor: a crash restarts from the checkpoint once a process exits; a
                    hardware fault that hangs the collectives instead is only ended by the NCCL timeout
                    (PyTorch's default, 10 minutes); slow ranks are never fixed.
  none              no health monitor and no automatic restart: a person notices the stopped job
                    (`manual_detect_s`, 30 minutes) and restarts it; slow ranks are never fixed.
All three replace a crashed node on restart and checkpoint at the same interval.
"""
from __future__ import annotations

import argparse
import enum
import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from health.config import HealthConfig
from health.findings import Action, Decision, Finding, Severity
from health.monitor import Monitor
from health.policy import Policy
from health.telemetry import ClockReason, Sample

LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16_384)   # 1.97e-5
HARDWARE_XIDS = (79, 48, 74, 95, 64, 119, 140)              # what a crashed GPU reports (device.classify_xid)
MAX_CLOCK_MHZ = 1980.0                                      # H100 SXM boost clock


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
    hardware_share: float = 0.78               # of failures (Llama 3); the rest are software: the process exits
    hang_share: float = 0.5                    # hardware failures that hang the collectives rather than exit
    stragglers_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR / 4   # assumed, see the module docstring
    straggler_slowdown: tuple[float, float] = (0.1, 0.5)    # a random slow GPU (thermal, power brake): 10-50% slower
    device_samples: bool = True                # slow GPUs report their clocks; False: only step times tell
    checkpoint_save_s: float = 2.0             # blocking part of an asynchronous checkpoint (copy to host memory)
    checkpoint_every_steps: int | None = None  # None: Young's interval sqrt(2 x save x MTBF), as `interval: auto`
    restart_s: float = 120.0                   # a standby node takes over: restart, rendezvous, load the checkpoint
    exit_detect_s: float = 5.0                 # the agent's poll: a process exit, or the Monitor's next check
    collective_timeout_s: float = 600.0        # PyTorch's default NCCL timeout ends a hung collective
    manual_detect_s: float = 1800.0            # with no monitor, how long until a person notices
    fast_forward: bool = False                 # feed the Monitor only around slowdowns (for long runs) ...
    watch_steps: int = 300                     # ... from before each onset until this many steps after it


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
    false_positives: int              # nodes found at fault while healthy
    ettr: float
    wall_s: float
    crashes: int = 0
    stragglers: int = 0               # slow GPUs that appeared (scripted + random)
    replacements: int = 0             # nodes replaced on the policy's decision (crash replacements not counted)
    lost_steps: int = 0               # steps redone after restarts
    checkpoints: int = 0
    decisions: dict[str, int] = field(default_factory=dict)   # the Policy's decisions by action
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
                self._crash()
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
        rng = self.rng
        x = self.sigma * rng.standard_normal(n) + sc.common_noise * rng.standard_normal()
        times = np.exp(x) * self.chip
        outliers = np.flatnonzero(rng.random(n) < sc.outlier_rate)
        times[outliers] *= rng.uniform(*sc.outlier_factor, outliers.size)
        for rank, slowdown in self.slow.items():
            times[rank] *= 1 + slowdown
        self.monitor.observe_step(self.step, times, self.t)
        if sc.device_samples:
            reasons = int(ClockReason.HW_SLOWDOWN | ClockReason.HW_THERMAL)
            for rank, slowdown in self.slow.items():
                self.monitor.observe(Sample(time=self.t, node=self.node(rank), gpu=rank % sc.gpus_per_node,
                                            sm_clock_mhz=MAX_CLOCK_MHZ / (1 + slowdown),
                                            max_sm_clock_mhz=MAX_CLOCK_MHZ, clock_event_reasons=reasons))
        findings = self.monitor.check(self.t)
        self._score(findings, throttled, onset_step)
        self._act(self.policy.decide(findings, self.t))

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
                self._replace(decision.node)
                self.result.replacements += 1
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

    def _crash(self) -> None:
        sc, rng = self.sc, self.crashes
        self._lose("rework", self.next_crash - self.t)     # the step in flight
        self.result.crashes += 1
        victim, hardware = int(rng.integers(self.n)), rng.random() < sc.hardware_share
        hangs, xid = rng.random() < sc.hang_share, int(rng.choice(HARDWARE_XIDS))
        if self.mode == Mode.NONE:
            detect = sc.manual_detect_s
        elif self.mode == Mode.RESTART_ON_CRASH:
            detect = sc.collective_timeout_s if hardware and hangs else sc.exit_detect_s
        else:
            detect = sc.exit_detect_s
            if hardware:                 # the GPU's Xid reaches the Monitor; the Policy replaces the node at once
                monitor = self.monitor or Monitor(self.config, [self.node(r) for r in range(self.n)])
                monitor.observe(Sample(time=self.t, node=self.node(victim), gpu=victim % sc.gpus_per_node, xid=xid))
                self._count(self.policy.decide(monitor.check(self.t + detect), self.t + detect))
        if hardware:
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


def simulate(ranks: int = 512, steps: int = 300, throttle_rank: int | None = None, slowdown: float = 0.2,
             onset: int = 100, seed: int = 0, *, mode: Mode | str = Mode.TFSN, scenario: Scenario | None = None,
             config: HealthConfig | None = None) -> SimResult:
    """Run `steps` steps of a `ranks`-GPU job; deterministic for a seed.

    `throttle_rank` computes (1 + `slowdown`) times longer from step `onset` until its node is replaced.
    """
    if ranks < 1 or steps < 1:
        raise ValueError("ranks and steps must be at least 1")
    if throttle_rank is not None and not 0 <= throttle_rank < ranks:
        raise ValueError(f"--throttle-rank {throttle_rank} is not one of the {ranks} ranks")
    if not slowdown > 0:
        raise ValueError(f"--slowdown is a fraction greater than 0 (0.1 = 10% slower), got {slowdown}")
    run = _Run(ranks, seed, Mode(mode), scenario or Scenario(), config or HealthConfig.load())
    return run.run(steps, None if throttle_rank is None else (throttle_rank, slowdown, onset))


def simulate_command(ranks: int, steps: int, throttle_rank: int | None, slowdown: float, onset: int, seed: int,
                     as_json: bool) -> int:
    """`tfsn health simulate`: a short summary; with `as_json`, a last line of one JSON object."""
    try:
        result = simulate(ranks, steps, throttle_rank, slowdown, onset, seed)
    except ValueError as err:
        print(f"error: {err}")
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
