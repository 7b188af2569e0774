"""Bad input at the command line: one clear line, a non-zero exit, no traceback, nothing lost."""
from __future__ import annotations

import json

from orchestrator.store import JobState, Store
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
