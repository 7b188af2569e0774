"""The cluster simulator: deterministic, drives the real Monitor and Policy, accounts for every second."""
from __future__ import annotations

import json

import pytest

from health.sim import LLAMA3_FAILURES_PER_GPU_HOUR, Mode, Scenario, cli_main, simulate

QUIET = Scenario(failures_per_gpu_hour=0.0, stragglers_per_gpu_hour=0.0)


def test_the_llama3_failure_rate():
    assert LLAMA3_FAILURES_PER_GPU_HOUR == pytest.approx(1.97e-5, rel=0.01)


def test_deterministic_for_a_seed():
    a = simulate(256, 200, throttle_rank=5, slowdown=0.2, onset=80, seed=3).to_json()
    b = simulate(256, 200, throttle_rank=5, slowdown=0.2, onset=80, seed=3).to_json()
    c = simulate(256, 200, throttle_rank=5, slowdown=0.2, onset=80, seed=4).to_json()
    assert a == b and a != c


def test_a_throttled_rank_is_found_by_its_step_times_and_replaced():
    result = simulate(512, 200, throttle_rank=77, slowdown=0.2, onset=100, seed=1,
                      scenario=Scenario(failures_per_gpu_hour=0.0, stragglers_per_gpu_hour=0.0, device_samples=False))
    assert result.detected and 0 <= result.detection_delay_steps <= 10
    assert result.blamed == [77] and result.false_positives == 0
    assert result.replacements == 1 and result.decisions == {"checkpoint": 1, "replace_node": 1}
    assert result.lost_steps == 0                   # checkpointed before the replacement


def test_a_healthy_run_has_no_findings():
    result = simulate(512, 400, seed=2, scenario=QUIET)
    assert (result.detected, result.blamed, result.false_positives, result.replacements) == (False, [], 0, 0)


def test_the_wall_time_is_accounted_for():
    sc = Scenario(failures_per_gpu_hour=1e-2, stragglers_per_gpu_hour=1e-2, fast_forward=True)
    for mode in Mode:
        r = simulate(64, 3000, seed=5, mode=mode, scenario=sc)
        assert r.crashes > 0 and r.stragglers > 0
        assert r.wall_s == pytest.approx(r.steps * sc.step_s + sum(r.lost_s.values()))
        assert r.ettr == pytest.approx(r.steps * sc.step_s / r.wall_s)


def test_tfsn_beats_the_baselines_when_gpus_fail_and_slow_down():
    sc = Scenario(failures_per_gpu_hour=1e-2, stragglers_per_gpu_hour=1e-2, fast_forward=True)
    ettr = {mode: simulate(64, 4000, seed=6, mode=mode, scenario=sc).ettr for mode in Mode}
    assert ettr[Mode.TFSN] > ettr[Mode.RESTART_ON_CRASH] > ettr[Mode.NONE]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="throttle-rank 9"):
        simulate(8, 10, throttle_rank=9)
    with pytest.raises(ValueError, match="slowdown"):
        simulate(8, 10, throttle_rank=1, slowdown=0.0)


def test_the_command_ends_with_one_json_line(capsys):
    assert cli_main(["--ranks", "128", "--steps", "150", "--throttle-rank", "3", "--slowdown", "0.5",
                     "--onset", "90", "--seed", "1", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "rank 3 50% slower from step 90: found after" in lines[1]
    result = json.loads(lines[-1])
    assert {"detected", "detection_delay_steps", "blamed", "false_positives", "ettr"} <= set(result)
    assert result["detected"] is True
    assert cli_main(["--ranks", "4", "--steps", "10", "--throttle-rank", "7"]) == 2
