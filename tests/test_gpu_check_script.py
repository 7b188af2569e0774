"""benchmarks/gpu_check.sh's JSON line for a Triton test part that ends without its report: what a lent GPU's
run says when its tests are cut or crash (run here with --cpu on a stand-in test file, in a scratch copy)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def triton_part(tmp_path: Path, tests: str) -> dict:
    """The JSON line's "triton" entry of `PARTS=triton gpu_check.sh --cpu` with `tests` as the Triton test file."""
    for name in ("gpu_check.sh", "failures_now.py"):
        (tmp_path / "benchmarks").mkdir(exist_ok=True)
        shutil.copy(ROOT / "benchmarks" / name, tmp_path / "benchmarks" / name)
    (tmp_path / "optimizer" / "codegen").mkdir(parents=True)
    (tmp_path / "optimizer" / "codegen" / "triton.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_optimizer_triton.py").write_text(tests)
    env = {**os.environ, "PARTS": "triton", "PYTHON": sys.executable, "TESTS_LIMIT_S": "60"}
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])["triton"]


def test_a_crashed_test_run_is_reported_as_a_crash_with_its_failures_named(tmp_path):
    """A test process that dies (a segfault, as a kernel's illegal access can) is not said to be cut by its time
    limit, and the failures before it are named, parametrized ids with spaces included."""
    triton = triton_part(tmp_path, "import os, signal, pytest\n"
                                   "@pytest.mark.parametrize('s', ['a b'])\n"
                                   "def test_spaced(s):\n    assert s == 'c'\n"
                                   "def test_crash():\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    assert "time limit" not in triton["error"] and "139" in triton["error"], triton
    assert triton["failed"] == ["tests/test_optimizer_triton.py::test_spaced[a b]"], triton


def test_parts_that_name_no_part_are_refused_before_anything_runs():
    """A typo in PARTS would spend a lent GPU's minutes running nothing it asked for: refused in one line, exit 2."""
    for parts in ("bogus", "tests,TRITON", ",", " "):
        done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu"], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PARTS": parts, "PYTHON": sys.executable}, timeout=60)
        assert done.returncode == 2 and "PARTS names" in done.stderr and not done.stdout, (parts, done)
