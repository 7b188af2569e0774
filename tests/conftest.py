"""Shared fixtures: an isolated TFSN_HOME per test and a way to run the real `tfsn` command."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-gpt"
# The example trained eagerly: the jobs of these tests check the orchestration, and each worker start (restarts
# too) would otherwise spend seconds compiling its step (tests/test_entry_worker.py runs the compiled chain).
EAGER = {"OPTIMIZE": "0"}
# A smaller model than the example's default, so an e2e job takes seconds, not minutes.
FAST_MODEL = {"N_LAYER": "1", "N_EMBD": "32", "N_HEAD": "2", "BLOCK_SIZE": "32", "BATCH_SIZE": "8",
              "CORPUS_CHARS": "20000", "LOG_INTERVAL": "5", **EAGER}


# The files that take a minute or more of a CI run (their tests' durations in the run of 2026-12-07, 4 processes on 2
# cores; the fifteenth's to eighteenth's in their branches' runs), handed out first: those that mostly wait on jobs
# (end to end), then the longest first. `--dist loadfile` hands a process a whole file, and xdist orders the files by
# their number of tests, so a long file of few tests came last (the two tests of test_e2e_health.py, 165 s, third from
# last; test_e2e.py, 236 s, 20th from last) and ran while the other processes had nothing left.
LONG_FILES = ["test_e2e_health.py", "test_e2e.py", "test_optimizer_user_models_sixteenth.py",
              "test_optimizer_user_models_eighteenth.py",
              "test_optimizer_user_models_nineteenth.py",
              "test_optimizer_user_models_twentieth.py",
              "test_optimizer_user_models_eleventh.py", "test_optimizer_user_models_seventeenth.py",
              "test_optimizer_triton.py", "test_optimizer_user_models.py", "test_triton_gpu_compile.py",
              "test_optimizer_user_models_seventh.py", "test_optimizer_user_models_fourth.py",
              "test_optimizer_user_models_fifteenth.py", "test_optimizer_correctness.py",
              "test_optimizer_higher_order.py", "test_optimizer_user_models_more.py",
              "test_optimizer_user_models_eighth.py", "test_cli.py", "test_optimizer_user_models_fifth.py",
              "test_optimizer_user_models_third.py", "test_optimizer_user_models_fourteenth.py",
              "test_optimizer_user_models_twelfth.py", "test_optimizer_user_models_ninth.py", "test_optimizer_ops.py",
              "test_optimizer_user_models_tenth.py", "test_optimizer_numeric_idioms.py",
              "test_optimizer_user_models_thirteenth.py", "test_optimizer_training_loops.py", "test_provider_aws.py"]


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):     # pytest-xdist's order by number of tests: keep ours
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """LONG_FILES' tests first, in that order; each file's tests and the other files in their own order."""
    rank = {f"tests/{name}": i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FILES)))


@pytest.fixture(autouse=True, scope="session")
def triton_interpreter_without_dead_overflow_checks():
    """Triton's interpreter (TRITON_INTERPRET=1) computes an overflow check for each integer +, - and * of 32
    bits or less (sanitize_overflow, on by default), in int64, then drops it: device_assert checks nothing
    unless the kernel runs with debug=True, which the interpreter never does, and a GPU compile deletes the
    same dead code. Half of the interpreter's time went there; off, each kernel computes the same values."""
    if importlib.util.find_spec("triton") is not None:     # (0.3 s) a test may import Triton only when it runs
        from triton.runtime import interpreter
        builder = interpreter.interpreter_builder
        assert not builder.options.debug, "the interpreter now checks device_assert: keep its overflow checks"
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    yield


@pytest.fixture(autouse=True, scope="session")
def triton_interpreter_patches_the_language_once_per_launch():
    """Triton's interpreter patches triton.language (every builtin of tl, tl.tensor and tl.math wrapped again)
    at each kernel launch, and again at each call of a @triton.jit helper from inside the kernel (the prelude's
    tfsn_* functions: a thousand calls in one user-model test), though the launch has patched it already and
    restores it after; those re-patches were a sixth of the interpreter's time. A helper's call now keeps the
    language as its kernel's launch patched it: the same interpreted functions run."""
    if importlib.util.find_spec("triton") is not None:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
        patch_lang = interpreter._patch_lang
        assert "_patch_lang(self.fn)" in inspect.getsource(interpreter.InterpretedFunction.__call__), \
            "the interpreter no longer patches the language at a helper's call: drop this fixture"

        def patch_unless_patched(fn):
            langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
            if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):     # patched by the launch
                return interpreter._LangPatchScope()
            return patch_lang(fn)
        interpreter._patch_lang = patch_unless_patched
    yield


class Tfsn:
    """Runs `python tfsn.py ...` as a user would, against one TFSN_HOME."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.env = {**os.environ, "TFSN_HOME": str(home), "TFSN_CONTROLLER_IDLE_S": "20"}

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, str(ROOT / "tfsn.py"), *args], env=self.env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"tfsn {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def status(self, job: int | str) -> dict:
        return json.loads(self("status", str(job), "--json").stdout)

    def wait(self, job: int | str, until, timeout: float = 240, what: str = "") -> dict:
        """Poll `tfsn status --json` until `until(status)` holds."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self("status", str(job), "--json", check=False)  # the job may not be submitted yet
            st = json.loads(proc.stdout) if proc.returncode == 0 else {"state": "not submitted", "id": job}
            if proc.returncode == 0 and until(st):
                return st
            if time.monotonic() > deadline:
                log = (self.home / "jobs" / str(st["id"]) / "job.log")
                raise AssertionError(f"timed out waiting for {what or until}: {st['state']}\n"
                                     f"{log.read_text()[-4000:] if log.exists() else ''}")
            time.sleep(1.0)  # each poll is a Python start (~0.3 s of CPU): more often would slow the job it watches

    def wait_done(self, job: int | str, timeout: float = 240) -> dict:
        return self.wait(job, lambda s: s["state"] in ("SUCCEEDED", "FAILED", "STOPPED"), timeout, "the job to end")


@pytest.fixture
def tfsn(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    runner = Tfsn(home)
    yield runner
    info = home / "controller.json"
    if info.exists():  # leave nothing running behind
        pid = json.loads(info.read_text())["pid"]
        for job in json.loads(runner("status", "--json", check=False).stdout or "[]"):
            if job["state"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
                runner("stop", str(job["id"]), check=False)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def write_job(path: Path, steps: int, interval: int = 10, envs: dict | None = None, fast: bool = True,
              entry: bool = True, **fields) -> Path:
    """A copy of the example's train.yaml (with a smaller model when `fast`), pointing at its code. Without
    `entry` the model is priced by the shape it declares: the launch starts no child that imports, captures and
    searches the step (20 to 40 s of CPU on a 2-core machine, once per distinct `envs`), for the tests that check
    what happens after the launch (tests/test_entry*.py and test_plan_cli.py check the entry's pricing)."""
    spec = yaml.safe_load((EXAMPLE / "train.yaml").read_text())
    if not entry:
        del spec["model"]["entry"]
    spec.update(workdir=str(EXAMPLE), steps=steps, checkpoint={"interval": interval, "keep": 3,
                                                               "dir": str(path.parent / f"{path.stem}-ckpt")})
    spec["envs"] = {**spec.get("envs", {}), **EAGER, **(FAST_MODEL if fast else {}), **(envs or {})}
    spec.update(fields)
    path.write_text(yaml.safe_dump(spec))
    return path
