"""Bad input at the command line: one clear line, a non-zero exit, no traceback, nothing lost."""
from __future__ import annotations

import json

import pytest

from orchestrator.control.store import JobState, Store
from tests.conftest import EXAMPLE, write_job


def assert_one_line_error(proc, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines and all(line.startswith("tfsn: error: ") for line in lines), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def test_validate_names_file_line_and_field(tfsn, tmp_path):
    bad = tmp_path / "train.yaml"
    bad.write_text("name: x\nrun: python train.py\nresources:\n  acelerators: H100:8\n")
    proc = tfsn("validate", str(bad), check=False)
    assert_one_line_error(proc, f"{bad}:4:", "resources.acelerators", "did you mean 'accelerators'")


def test_launch_of_a_bad_file_saves_nothing_and_keeps_existing_jobs(tfsn, tmp_path):
    store = Store(tfsn.home / "tfsn.db")
    earlier = store.create_job("earlier", {"name": "earlier", "num_nodes": 1}, "x.yaml", "t")
    store.transition(earlier.id, JobState.STOPPED, "by user")
    before = json.loads(tfsn("status", "--json").stdout)
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    proc = tfsn("launch", str(bad), check=False)
    assert_one_line_error(proc, f"{bad}:", "invalid YAML")
    after = json.loads(tfsn("status", "--json").stdout)
    assert [j["id"] for j in after] == [earlier.id]
    assert after[0]["state"] == before[0]["state"] == "STOPPED"


def test_launch_asking_for_a_gpu_on_this_machine_says_how_to_fix(tfsn, tmp_path):
    spec = write_job(tmp_path / "gpu.yaml", steps=1, resources={"accelerators": "H100:8"})
    proc = tfsn("launch", str(spec), check=False)
    assert_one_line_error(proc, "H100:8", "To fix")
    assert json.loads(tfsn("status", "--json").stdout) == []


def test_missing_file_and_bad_env_pair(tfsn, tmp_path):
    assert_one_line_error(tfsn("launch", str(tmp_path / "nope.yaml"), check=False), "nope.yaml")
    assert_one_line_error(tfsn("launch", str(EXAMPLE / "train.yaml"), "--env", "NOEQUALS", check=False),
                          "KEY=VALUE")


def test_unknown_job_in_status_logs_stop(tfsn):
    for command in ("status", "logs", "stop"):
        assert_one_line_error(tfsn(command, "ghost", check=False), "ghost", "tfsn ls")


def test_bad_health_policy_names_line_and_suggests(tfsn, tmp_path):
    bad = tmp_path / "train.yaml"
    bad.write_text("run: python train.py\nhealth:\n  thresholds:\n    straggler_min_slowdwn: 0.1\n"
                   "  actions:\n    straggler: explode\n")
    proc = tfsn("validate", str(bad), check=False)
    assert_one_line_error(proc, f"{bad}:3: health.thresholds", "did you mean 'straggler_min_slowdown'",
                          f"{bad}:5: health.actions", "explode")


def test_health_simulate_reports_detection_as_json(tfsn):
    out = tfsn("health", "simulate", "--ranks", "64", "--steps", "150", "--throttle-rank", "5",
               "--slowdown", "0.3", "--onset", "90", "--seed", "1", "--json")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["detected"] and result["blamed"] == [5] and result["false_positives"] == 0
    assert 0 < result["detection_delay_steps"] <= 20 and 0 < result["ettr"] <= 1


def test_bad_name_and_job_refs_are_one_line_errors(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", steps=1)
    assert_one_line_error(tfsn("launch", str(spec), "--name", "bad name!", check=False), "--name")
    for ref in ("99999999999999999999999", "²"):
        assert_one_line_error(tfsn("status", ref, check=False), "no job")


def test_missing_workdir_is_refused_before_anything_runs(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", steps=1, workdir=str(tmp_path / "nowhere"))
    assert_one_line_error(tfsn("launch", str(spec), check=False), "nowhere", "To fix")
    assert json.loads(tfsn("status", "--json").stdout) == []


# ---- issue 17: bounded specs, and `tfsn validate` refuses what `tfsn launch` refuses -----------------

NOT_LAUNCHABLE = [
    ("num_nodes: 99999999999999999999999999999999\n", "num_nodes: input should be less than or equal to 4096"),
    ('envs:\n  SEED: "1\\0"\n', "envs.SEED: a control character (U+0000)"),
    ("resources:\n  accelerators: FOO:8\n  infra: [aws]\n", "resources.accelerators: unknown accelerator 'FOO'"),
    ("resources:\n  accelerators: H10:8\n", "did you mean 'H100'?"),
    ("workdir: nowhere\n", "workdir: "),
]


@pytest.mark.parametrize("extra, needle", NOT_LAUNCHABLE)
def test_validate_refuses_what_launch_refuses_with_the_same_line(tfsn, tmp_path, extra, needle):
    (tmp_path / "code").mkdir()
    spec = tmp_path / "train.yaml"
    spec.write_text("run: python train.py\nworkdir: code\n" + extra)
    checked = tfsn("validate", str(spec), check=False)
    launched = tfsn("launch", "--detach", str(spec), check=False)
    assert_one_line_error(checked, f"{spec}:", needle, "To fix")
    assert launched.returncode == 2 and launched.stderr == checked.stderr
    assert json.loads(tfsn("status", "--json").stdout) == []
