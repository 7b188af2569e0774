"""Detectors on synthetic telemetry: the right node is blamed, noise never is."""
from __future__ import annotations

import numpy as np
import pytest

from health.config import HealthConfig
from health.device import classify_xid
from health.findings import Action, FindingKind, Severity
from health.monitor import Monitor
from health.straggler import cusum_limit
from health.telemetry import ClockReason, Sample

CONFIG = HealthConfig.load()
GPUS = 8


def nodes(ranks: int) -> list[str]:
    return [f"n{r // GPUS}" for r in range(ranks)]


def compute_times(rng: np.random.Generator, ranks: int, steps: int) -> np.ndarray:
    """(steps, ranks): lognormal noise of 3-5% per rank, 1% chip spread, shared jitter, 0.1% 2-3x outliers."""
    sigma = rng.uniform(0.03, 0.05, ranks)
    x = sigma * rng.standard_normal((steps, ranks)) + 0.02 * rng.standard_normal((steps, 1))
    x += 0.01 * rng.standard_normal(ranks)
    outliers = rng.random((steps, ranks)) < 1e-3
    x[outliers] += np.log(rng.uniform(2, 3, outliers.sum()))
    return 0.5 * np.exp(x)


def run(monitor: Monitor, times: np.ndarray, step_s: float = 1.0, first: int = 0) -> dict[int, list]:
    """Feed every step and check after each; the findings by step."""
    out = {}
    for i, row in enumerate(times):
        step = first + i
        monitor.observe_step(step, row, step * step_s)
        findings = monitor.check(step * step_s)
        if findings:
            out[step] = findings
    return out


def test_cusum_limit_solves_siegmunds_approximation():
    assert cusum_limit(1.0, 1e9) == pytest.approx(9.54, abs=0.01)
    assert cusum_limit(1.0, 1e6) < cusum_limit(1.0, 1e9) < cusum_limit(0.5, 1e9)


@pytest.mark.parametrize("slowdown, within", [(0.2, 10), (0.5, 10)])
def test_a_slowed_rank_is_found_and_its_node_blamed(slowdown, within):
    rng = np.random.default_rng(7)
    times = compute_times(rng, 512, 160)
    times[100:, 37] *= 1 + slowdown
    monitor = Monitor(CONFIG, nodes(512))
    found = run(monitor, times)
    first = min(found)
    assert 100 <= first <= 100 + within, found
    (finding,) = found[first]
    assert (finding.kind, finding.severity, finding.node, finding.gpu, finding.ranks) == \
        (FindingKind.STRAGGLER, Severity.WARNING, "n4", None, (37,))
    assert "rank 37" in finding.evidence and "\n" not in finding.evidence
    scores = monitor.scores()
    assert scores[37] < 1 / (1 + slowdown / 2) and np.all(np.abs(np.delete(scores, 37) - 1) < 0.2)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_noisy_healthy_cluster_is_never_flagged(seed):
    rng = np.random.default_rng(seed)
    assert run(Monitor(CONFIG, nodes(512)), compute_times(rng, 512, 500)) == {}


def test_outlier_steps_do_not_trigger():
    rng = np.random.default_rng(5)
    times = compute_times(rng, 256, 200)
    times[100:103, 3] *= 3.0          # three GC pauses in a row
    times[150::10, 4] *= 2.5          # one rank with an outlier every 10 steps
    assert run(Monitor(CONFIG, nodes(256)), times) == {}


def test_a_rank_always_a_little_slower_is_not_a_straggler():
    rng = np.random.default_rng(6)
    times = compute_times(rng, 256, 400)
    times[:, 9] *= 1.03               # a slower chip: below straggler_min_slowdown
    assert run(Monitor(CONFIG, nodes(256)), times) == {}


def test_a_rank_that_stays_10_percent_slower_stays_blamed():
    # A replacement pays only after the slowdown has cost a restart (~1,300 s at 10%): the finding must hold
    # that long. Before, the rank's "usual standing" was learned from the slowdown itself (up to 5%), which
    # left 5% of a 10% slowdown, one noise sigma at 5% noise, the CUSUM's drift allowance: blamed in 5% of
    # the checks of 20,000 steps.
    rng = np.random.default_rng(12)
    times = 0.5 * np.exp(0.05 * rng.standard_normal((1600, 256)))
    times[300:, 9] *= 1.10
    found = run(Monitor(CONFIG, nodes(256)), times)
    held = [step for step, fs in found.items() if any(f.node == "n1" and 9 in f.ranks for f in fs)]
    assert {f.node for fs in found.values() for f in fs} == {"n1"}
    assert held and held[0] < 330
    assert len([s for s in held if s >= 400]) > 0.9 * 1200, len(held)


def test_a_rack_slowed_together_does_not_hide_a_gpu_far_slower_elsewhere():
    rng = np.random.default_rng(3)
    times = 0.5 * np.exp(0.04 * rng.standard_normal((500, 512)))
    times[150:, 64:128] *= 1.10       # a rack: nodes n8-n15 10% slower together (a shared cause) ...
    times[200:, 300] *= 1.5           # ... and a GPU of n37 50% slower: before, only the rack's finding was made
    found = run(Monitor(CONFIG, nodes(512)), times)
    kinds = {(f.node, f.severity) for fs in found.values() for f in fs}
    assert kinds == {("", Severity.INFO), ("n37", Severity.WARNING)}
    assert min(step for step, fs in found.items() if any(f.node == "n37" for f in fs)) < 215


def test_a_small_job_compares_each_rank_with_its_own_past():
    rng = np.random.default_rng(8)
    times = compute_times(rng, 2, 200)
    slowed = times.copy()
    slowed[120:, 1] *= 1.3
    found = run(Monitor(CONFIG, ["a", "b"]), slowed)
    assert found and {f.ranks for fs in found.values() for f in fs} == {(1,)}
    both = times.copy()
    both[120:] *= 1.3                 # the whole job slowed: no node to blame
    assert run(Monitor(CONFIG, ["a", "b"]), both) == {}


def test_a_broken_clock_is_missing_data_not_a_straggler():
    # A rank whose clock breaks reports inf, NaN, 0 or a negative time: none of them is a time. Before, inf was
    # taken as one (log(inf) = inf): ten such steps blamed n0 ("rank 5 computes infx the cluster median").
    rng = np.random.default_rng(21)
    times = compute_times(rng, 64, 300)
    times[150:160, 5] = np.inf
    times[170:175, 6] = [np.nan, 0.0, -1.0, np.inf, -np.inf]
    times[200:, 9] *= 1.15            # and the test still finds a real slowdown afterwards
    found = run(Monitor(CONFIG, nodes(64)), times)
    assert {(f.node, f.ranks) for fs in found.values() for f in fs} == {("n1", (9,))}
    assert min(found) < 215


def test_samples_gathered_per_step_feed_the_same_detector():
    rng = np.random.default_rng(9)
    times = compute_times(rng, 16, 120)
    times[80:, 5] *= 1.5
    monitor, first = Monitor(CONFIG, nodes(16)), None
    for step, row in enumerate(times):
        for rank in range(16):        # step_time stands in when compute_time is missing
            kind = {"compute_time": row[rank]} if rank % 2 else {"step_time": row[rank]}
            monitor.observe(Sample(time=step + rank / 100, node=f"n{rank // GPUS}", rank=rank, step=step, **kind))
        if first is None and monitor.check(step + 1):
            first = step
    assert first is not None and 80 <= first <= 90
    assert monitor.check(121)[0].ranks == (5,)


def test_a_step_missing_a_rank_waits_for_gather_steps_and_seconds():
    monitor = Monitor(CONFIG, nodes(4))
    def post(step: float, at: float, ranks=range(3)) -> None:   # rank 3 is late
        for rank in ranks:
            monitor.observe(Sample(time=at, node="n0", rank=rank, step=step, compute_time=1.0))
    for step in range(CONFIG.gather_steps + 1):                   # fast steps: a batch behind is seconds, not steps
        post(step, step * 0.1)
    assert monitor._step is None
    post(CONFIG.gather_steps + 1, CONFIG.gather_s + 1)
    assert monitor._step == 1         # steps 0 and 1 closed without rank 3; the later ones still wait
    post(0, 0.0, ranks=[3])           # too late for step 0: ignored
    post(2, 0.2, ranks=[3])           # in time for step 2, which is now complete
    assert monitor._step == 2


def test_throttle_needs_a_throttling_reason_and_persistence():
    def feed(monitor, gpu, reasons, count, clock=1300.0):
        for i in range(count):
            monitor.observe(Sample(time=i, node="n0", gpu=gpu, sm_clock_mhz=clock, max_sm_clock_mhz=1980.0,
                                   clock_event_reasons=int(reasons)))
    monitor = Monitor(CONFIG, nodes(8))
    feed(monitor, 0, ClockReason.GPU_IDLE, 5)                     # idle is not throttling
    feed(monitor, 1, ClockReason.HW_SLOWDOWN, CONFIG.throttle_samples - 1)
    feed(monitor, 2, ClockReason.HW_THERMAL, 5, clock=1900.0)     # 96% of max: fine
    assert monitor.check(10) == []
    feed(monitor, 1, ClockReason.HW_SLOWDOWN | ClockReason.HW_THERMAL, 1)
    (finding,) = monitor.check(11)
    assert (finding.kind, finding.severity, finding.node, finding.gpu) == \
        (FindingKind.THROTTLE, Severity.WARNING, "n0", 1)
    assert "1300/1980 MHz" in finding.evidence and "HW_SLOWDOWN" in finding.evidence
    other = Monitor(CONFIG, nodes(8))
    feed(other, 3, ClockReason.SW_POWER_CAP, 5)                   # a power cap alone: report, no fault
    assert [f.severity for f in other.check(5)] == [Severity.INFO]
    feed(other, 3, ClockReason.HW_SLOWDOWN, 1, clock=1980.0)      # back to full clocks: gone
    assert other.check(6) == []


def slow_rank_19(feed_gpus) -> list:
    """64 ranks, rank 19 (node n2) 40% slower from step 100, `feed_gpus(monitor, step)` adding GPU samples at
    every step: the findings of the last check."""
    rng = np.random.default_rng(11)
    times = compute_times(rng, 64, 140)
    times[100:, 19] *= 1.4
    monitor, findings = Monitor(CONFIG, nodes(64)), []
    for step, row in enumerate(times):
        monitor.observe_step(step, row, float(step))
        feed_gpus(monitor, step)
        findings = monitor.check(float(step))
    return findings


def test_a_straggler_on_a_throttled_gpu_is_one_critical_finding():
    def hot(monitor: Monitor, step: int) -> None:
        if step >= 100:
            monitor.observe(Sample(time=step, node="n2", gpu=3, sm_clock_mhz=1414.0, max_sm_clock_mhz=1980.0,
                                   clock_event_reasons=int(ClockReason.HW_SLOWDOWN | ClockReason.HW_POWER_BRAKE)))
    (finding,) = slow_rank_19(hot)
    assert (finding.kind, finding.severity, finding.node, finding.gpu, finding.ranks) == \
        (FindingKind.THROTTLE, Severity.CRITICAL, "n2", 3, (19,))
    assert "rank 19" in finding.evidence and "GPU 3 SM clock" in finding.evidence


@pytest.mark.parametrize("code, fault, severity, drain", [
    (13, "application", Severity.INFO, False), (31, "application", Severity.INFO, False),
    (43, "application", Severity.INFO, False), (48, "hardware", Severity.CRITICAL, True),
    (63, "hardware", Severity.WARNING, False), (74, "hardware", Severity.CRITICAL, True),
    (79, "hardware", Severity.CRITICAL, True), (95, "hardware", Severity.CRITICAL, True),
    (119, "driver", Severity.CRITICAL, False), (12345, "unknown", Severity.WARNING, False),
])
def test_xid_classification(code, fault, severity, drain):
    xid = classify_xid(code)
    assert (xid.fault, xid.severity, xid.drain) == (fault, severity, drain)
    assert xid.reset or not xid.drain and xid.description


def test_an_xid_is_reported_once_on_its_gpu():
    monitor = Monitor(CONFIG, nodes(16))
    monitor.observe(Sample(time=5.0, node="n1", gpu=6, xid=79))
    (finding,) = monitor.check(6.0)
    assert (finding.kind, finding.severity, finding.node, finding.gpu) == (FindingKind.XID, Severity.CRITICAL, "n1", 6)
    assert "Xid 79" in finding.evidence and "fallen off the bus" in finding.evidence
    assert monitor.check(7.0) == []


def hung_job(beating: list[int], ranks: int = 16) -> tuple[Monitor, float]:
    """20 steps of 2 s, then every rank blocks; the `beating` ranks keep sending heartbeats."""
    monitor = Monitor(CONFIG, nodes(ranks))
    for step in range(CONFIG.straggler_warmup_steps + 20):
        monitor.observe_step(step, np.full(ranks, 1.9), 2.0 * step)
        for rank in range(ranks):
            monitor.observe(Sample(time=2.0 * step + 1, node=f"n{rank // GPUS}", rank=rank))
    stop = 2.0 * step
    for t in np.arange(stop + 5, stop + 300, 5.0):
        for rank in beating:
            monitor.observe(Sample(time=t, node=f"n{rank // GPUS}", rank=rank))
    return monitor, stop


def test_a_hang_blames_the_rank_that_stopped_heartbeating():
    monitor, stop = hung_job([r for r in range(16) if r != 11])
    assert monitor.check(stop + CONFIG.hang_min_s - 5) == []
    (finding,) = monitor.check(stop + 290)
    assert (finding.kind, finding.severity, finding.node, finding.ranks) == \
        (FindingKind.HANG, Severity.CRITICAL, "n1", (11,))
    assert "rank(s) 11 silent" in finding.evidence


def test_a_hang_with_every_rank_beating_is_a_deadlock_of_the_job():
    monitor, stop = hung_job(list(range(16)))
    (finding,) = monitor.check(stop + 290)
    assert (finding.kind, finding.node, finding.ranks) == (FindingKind.HANG, "", tuple(range(16)))
    assert "deadlock" in finding.evidence


def test_the_hang_timeout_grows_with_the_step_time():
    monitor = Monitor(CONFIG, nodes(8))
    for step in range(CONFIG.straggler_warmup_steps + 10):
        monitor.observe_step(step, np.full(8, 55.0), 60.0 * step)
    last = 60.0 * step
    assert monitor.check(last + 300) == []                      # 5 steps' time: still fine
    assert monitor.check(last + CONFIG.hang_step_factor * 60 + 1)[0].kind == FindingKind.HANG


def test_ecc_findings():
    monitor = Monitor(CONFIG, nodes(32))
    monitor.observe(Sample(time=0, node="n0", gpu=0, ecc_dbe_volatile=2))
    monitor.observe(Sample(time=0, node="n1", gpu=1, remapped_rows_failure=True))
    monitor.observe(Sample(time=0, node="n2", gpu=2, remapped_rows_pending=True))
    monitor.observe(Sample(time=0, node="n3", gpu=3, ecc_sbe_volatile=10))
    monitor.observe(Sample(time=1800, node="n3", gpu=3, ecc_sbe_volatile=10 + CONFIG.ecc_sbe_per_hour))
    monitor.observe(Sample(time=0, node="n3", gpu=4, ecc_sbe_volatile=0))
    monitor.observe(Sample(time=1800, node="n3", gpu=4, ecc_sbe_volatile=CONFIG.ecc_sbe_per_hour - 1))
    found = {(f.node, f.gpu): f for f in monitor.check(1800)}
    assert set(found) == {("n0", 0), ("n1", 1), ("n2", 2), ("n3", 3)}
    assert [found[k].severity for k in sorted(found)] == [Severity.CRITICAL, Severity.CRITICAL, Severity.WARNING,
                                                         Severity.WARNING]
    assert all(f.kind == FindingKind.ECC for f in found.values())
    assert "needs a reset" in found["n2", 2].evidence
    monitor.observe(Sample(time=1900, node="n2", gpu=2, remapped_rows_pending=False))   # reset done
    assert ("n2", 2) not in {(f.node, f.gpu) for f in monitor.check(1900)}


def test_bad_input_is_refused():
    monitor = Monitor(CONFIG, nodes(8))
    with pytest.raises(ValueError, match="expected 8"):
        monitor.observe_step(0, np.ones(7), 0.0)
    monitor.observe_step(3, np.ones(8), 0.0)
    with pytest.raises(ValueError, match="steps must increase"):
        monitor.observe_step(3, np.ones(8), 1.0)
    with pytest.raises(ValueError, match="rank 9"):
        monitor.observe(Sample(time=0, node="n0", rank=9))


# ---- issue 18 (4)/(5): throttles, Xids ---------------------------------------------------------------

def power_capped(monitor: Monitor, node: str, gpu: int, t: float, clock: float = 1680.0,
                 reasons: ClockReason = ClockReason.SW_POWER_CAP) -> None:
    monitor.observe(Sample(time=t, node=node, gpu=gpu, sm_clock_mhz=clock, max_sm_clock_mhz=1980.0,
                           clock_event_reasons=int(reasons)))


def test_a_power_capped_gpu_does_not_make_a_straggler_critical():
    """A straggler warning plus an ordinary power cap on its node was one critical finding, replaced at once
    with no hysteresis."""
    from health.policy import Policy
    findings = slow_rank_19(lambda monitor, step: power_capped(monitor, "n2", 3, float(step)))   # 85%: ordinary
    by_kind = {f.kind: f for f in findings}
    assert by_kind[FindingKind.STRAGGLER].severity == Severity.WARNING and by_kind[FindingKind.STRAGGLER].ranks == (19,)
    assert by_kind[FindingKind.THROTTLE].severity == Severity.INFO
    assert all(f.severity != Severity.CRITICAL for f in findings)
    (decision,) = [d for d in Policy(CONFIG).decide(findings, 140.0) if d.finding.kind == FindingKind.STRAGGLER]
    assert decision.action != Action.REPLACE_NODE


def test_every_throttled_gpu_of_a_node_is_reported():
    """Only one throttled GPU per node was kept: a power-capped GPU 0 hid GPU 5 at 55% with HW_THERMAL."""
    monitor = Monitor(CONFIG, nodes(16))
    for t in range(CONFIG.throttle_samples):
        power_capped(monitor, "n0", 0, float(t))
        power_capped(monitor, "n0", 5, float(t), clock=0.55 * 1980, reasons=ClockReason.HW_THERMAL)
    found = {f.gpu: f for f in monitor.check(10.0)}
    assert set(found) == {0, 5}
    assert found[5].severity == Severity.WARNING and "HW_THERMAL" in found[5].evidence
    assert found[0].severity == Severity.INFO


def test_a_slow_rank_with_a_hot_gpu_on_its_node_is_critical_and_other_throttled_gpus_stay():
    def capped_and_hot(monitor: Monitor, step: int) -> None:
        power_capped(monitor, "n2", 0, float(step))
        if step >= 100:
            power_capped(monitor, "n2", 3, float(step), clock=1414.0, reasons=ClockReason.HW_SLOWDOWN)
    findings = slow_rank_19(capped_and_hot)
    assert sorted((f.kind, f.severity, f.gpu, f.ranks) for f in findings) == [
        (FindingKind.THROTTLE, Severity.CRITICAL, 3, (19,)), (FindingKind.THROTTLE, Severity.INFO, 0, ())]


def test_an_xid_whose_gpu_cannot_be_named_is_the_nodes():
    """An Xid whose device index NVML could not read (a GPU off the bus) was dropped."""
    monitor = Monitor(CONFIG, nodes(16))
    monitor.observe(Sample(time=5.0, node="n1", gpu=None, xid=79))
    (finding,) = monitor.check(6.0)
    assert (finding.kind, finding.severity, finding.node, finding.gpu) == (FindingKind.XID, Severity.CRITICAL, "n1",
                                                                           None)
    assert "Xid 79 on a GPU NVML could not name" in finding.evidence
    from health.policy import Policy
    assert [(d.action, d.node) for d in Policy(CONFIG).decide([finding], 6.0)] == [(Action.REPLACE_NODE, "n1")]


# ---- phases: a long save or eval is not a hang (issue 18, deliverable 3) --------------------------------

def running_job(ranks: int = 16, steps: int = CONFIG.straggler_warmup_steps + 20, first: int = 0,
                start: float = 0.0, monitor: Monitor | None = None) -> tuple[Monitor, float]:
    """Steps of 2 s with heartbeats between them; returns the monitor and the time of the last step."""
    monitor = monitor or Monitor(CONFIG, nodes(ranks))
    for i in range(steps):
        t = start + 2.0 * i
        monitor.observe_step(first + i, np.full(ranks, 1.9), t)
        for rank in range(ranks):
            monitor.observe(Sample(time=t + 1, node=f"n{rank // GPUS}", rank=rank))
    return monitor, start + 2.0 * (steps - 1)


def beat(monitor: Monitor, ranks, t: float, phase: str = "train", since: float | None = None,
         finished: dict | None = None) -> None:
    for rank in ranks:
        monitor.observe(Sample(time=t, node=f"n{rank // GPUS}", rank=rank))
        monitor.observe_phase(rank, phase, since, finished or {})


def test_a_150s_save_while_ranks_heartbeat_is_not_a_hang_and_a_stop_in_training_still_is():
    monitor, last = running_job()
    save = last + 1
    for t in np.arange(save, save + 151, 5.0):                   # every rank saves for 150 s, beating
        beat(monitor, range(16), t, "checkpoint", save)
        assert monitor.check(t) == [], t
    end = save + 150
    beat(monitor, range(16), end, finished={"checkpoint": 150.0})
    monitor, last = running_job(steps=10, first=CONFIG.straggler_warmup_steps + 20, start=end + 2, monitor=monitor)
    for t in np.arange(last + 5, last + CONFIG.hang_min_s, 5.0):  # then every rank stops in a step, beating
        beat(monitor, range(16), t)
        assert monitor.check(t) == [], t
    beat(monitor, range(16), last + CONFIG.hang_min_s + 5)
    (finding,) = monitor.check(last + CONFIG.hang_min_s + 5)
    assert (finding.kind, finding.severity, finding.node) == (FindingKind.HANG, Severity.CRITICAL, "")
    assert "checkpoint" not in finding.evidence


def test_a_save_past_its_learned_timeout_is_a_hang_that_names_the_phase():
    monitor, last = running_job()
    beat(monitor, range(16), last + 1, finished={"checkpoint": 40.0})   # an earlier save took 40 s
    save = last + 2
    timeout = CONFIG.phase_timeout_factor * 40.0
    for t in np.arange(save, save + timeout, 10.0):
        beat(monitor, range(16), t, "checkpoint", save)
        assert monitor.check(t) == []
    beat(monitor, range(16), save + timeout + 5, "checkpoint", save)
    (finding,) = monitor.check(save + timeout + 5)
    assert (finding.kind, finding.node) == (FindingKind.HANG, "")
    assert f"in checkpoint for {timeout + 5:.0f}s (phase timeout {timeout:.0f}s: {CONFIG.phase_timeout_factor:g} x " \
           "the longest checkpoint seen, 40s" in finding.evidence


def test_ranks_waiting_for_rank_0_to_evaluate_are_not_hung_and_a_silent_rank_in_a_phase_is():
    monitor, last = running_job()
    start = last + 1
    for t in np.arange(start, start + 300, 10.0):                # rank 0 evaluates alone for 5 minutes ...
        beat(monitor, [0], t, "eval", start)
        beat(monitor, range(1, 16), t)                           # ... the others wait at a barrier
        assert monitor.check(t) == [], t
    # Rank 0 stops beating in its eval: its announcement no longer explains anything.
    t = start + 300 + CONFIG.heartbeat_timeout_s + CONFIG.hang_min_s
    beat(monitor, range(1, 16), t)
    (finding,) = monitor.check(t)
    assert (finding.kind, finding.node, finding.ranks) == (FindingKind.HANG, "n0", (0,))


def test_phase_timeouts_are_learned_and_clamped():
    from health.hang import PhaseHistory
    history = PhaseHistory(CONFIG)
    assert history.timeout("eval") == CONFIG.phase_timeout_max_s          # never seen: the ceiling
    history.observe("eval", 1.0)
    assert history.timeout("eval") == CONFIG.phase_timeout_min_s          # a 1 s eval: the floor
    history.observe("eval", 100.0)
    history.observe("eval", 50.0)
    assert history.timeout("eval") == CONFIG.phase_timeout_factor * 100.0  # the longest seen counts
    history.observe("eval", 10_000.0)
    assert history.timeout("eval") == CONFIG.phase_timeout_max_s


def test_phase_names_learned_per_job_are_bounded():
    # Each post may carry 16 names (the API's bound), but nothing bounded them across posts: 10,000 names
    # were 10,000 entries kept for the job's life.
    from health.hang import MAX_PHASES, PhaseHistory
    history = PhaseHistory(CONFIG)
    history.observe("checkpoint", 40.0)
    for i in range(10_000):
        history.observe(f"p{i}", 1.0)
    assert len(history.longest) == MAX_PHASES
    history.observe("checkpoint", 60.0)                                    # a known phase still learns
    assert history.timeout("checkpoint") == CONFIG.phase_timeout_factor * 60.0
    assert history.timeout("p9999") == CONFIG.phase_timeout_max_s          # an unlearned one: the ceiling


def test_a_first_step_that_never_ends_is_a_hang_of_the_job_past_the_ceiling():
    """A rank stuck before its first step (a data loader, a first all-reduce) was never a hang ('nothing finished
    yet: the first step may compile for minutes'): the job waited for ever. Past phase_timeout_max_s since the
    attempt began it is the whole job's hang."""
    monitor = Monitor(CONFIG, nodes(8), started_at=100.0)
    for t in np.arange(105.0, 100 + CONFIG.phase_timeout_max_s + 60, 5.0):   # every rank heartbeats, none steps
        for rank in range(8):
            monitor.observe(Sample(time=t, node=f"n{rank // GPUS}", rank=rank))
    assert monitor.check(100 + CONFIG.phase_timeout_max_s - 1) == []           # compiling for 30 min is allowed
    (finding,) = monitor.check(100 + CONFIG.phase_timeout_max_s + 30)
    assert (finding.kind, finding.severity, finding.node, finding.ranks) == \
        (FindingKind.HANG, Severity.CRITICAL, "", tuple(range(8)))
    assert f"no rank finished a first step in {CONFIG.phase_timeout_max_s + 30:.0f}s" in finding.evidence
    assert Monitor(CONFIG, nodes(8)).check(1e9) == []                          # an attempt whose start is unknown
    assert "raise health.thresholds.phase_timeout_max_s" in finding.evidence   # a slow first step: the knob


def test_an_attempt_whose_ranks_send_nothing_is_not_a_first_step_hang():
    """A script without the SDK reports no step nor heartbeat, ever: the first-step rule failed every such job
    as hung 30 minutes into each attempt (max_restarts times, then FAILED). Nothing heard is nothing to judge."""
    monitor = Monitor(CONFIG, nodes(8), started_at=100.0)
    assert monitor.check(100 + 10 * CONFIG.phase_timeout_max_s) == []
    monitor.observe(Sample(time=150.0, node="n0", rank=0))                      # one rank's heartbeat: the SDK's
    (finding,) = monitor.check(100 + CONFIG.phase_timeout_max_s + 30)
    assert (finding.kind, finding.ranks) == (FindingKind.HANG, tuple(range(8)))
