"""`model.entry`: the job's own step, imported in a child, searched per hardware type, priced by the plan.

Every bad entry is refused by `tfsn validate`, `tfsn plan` and `tfsn launch` alike with one line that names
the field and the file, a non-zero exit and no traceback; a good one prices the offers from its searched step.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

GOOD = """\
import torch

def build():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x, y = torch.randn(8, 32), torch.randint(4, (8,))
    return model, (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])

if __name__ == "__main__":
    raise SystemExit("training is not run at import")
"""


def _job(tmp_path: Path, script: str, entry: str = "train.py:build", extra: str = "") -> Path:
    (tmp_path / "train.py").write_text(script)
    spec = tmp_path / "train.yaml"
    spec.write_text(f"name: entry-job\nrun: python train.py\nnum_nodes: 2\nsteps: 100\nresources:\n  infra: [local]\n"
                    f"model:\n  entry: {entry}\n{extra}")
    return spec


@pytest.fixture
def cli(tfsn, tmp_path):
    tfsn.env.update(TFSN_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    return tfsn


def _refused(cli, spec: Path, command: str = "validate") -> str:
    out = cli(command, str(spec), check=False, timeout=180)
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "model.entry" in line and "To fix:" in line, line
    return line


def test_a_script_that_fails_to_import_names_the_field_file_and_line(cli, tmp_path):
    spec = _job(tmp_path, "import os\n\ndef build(:\n    pass\n")
    line = _refused(cli, spec)
    assert line.startswith(f"tfsn: error: {spec}:8: model.entry train.py:build: importing train.py failed: "
                           "train.py:3: SyntaxError"), line


def test_an_error_raised_at_import_is_refused_by_plan_and_launch_too(cli, tmp_path):
    spec = _job(tmp_path, "x = 1\nraise RuntimeError('no data here')\n")
    for command in ("plan", "launch"):
        line = _refused(cli, spec, command)
        assert "train.py:2: RuntimeError: no data here" in line, line
    assert not (cli.home / "tfsn.db").exists() or "entry-job" not in cli("ls").stdout   # nothing was launched


def test_a_missing_function_is_named(cli, tmp_path):
    line = _refused(cli, _job(tmp_path, "def other():\n    pass\n"))
    assert "train.py has no function 'build'" in line and "define that function" in line, line


def test_a_misspelled_function_gets_a_suggestion(cli, tmp_path):
    line = _refused(cli, _job(tmp_path, GOOD, entry="train.py:Build"))
    assert "train.py has no function 'Build'; did you mean 'build'? To fix:" in line, line


def test_a_step_that_cannot_be_searched_says_why(cli, tmp_path):
    """A model that returns no loss (loss_fn None) was refused with 'its step could not be searched ... see `tfsn
    plan` for why the search failed', and `tfsn plan` refused it with the same line: the why was never shown."""
    script = "import torch\n\ndef build():\n    return torch.nn.Linear(2, 2), torch.randn(4, 2), None\n"
    for command in ("validate", "plan"):
        line = _refused(cli, _job(tmp_path, script), command)
        assert "searched for these offers' hardware: ValueError: the loss is not a scalar tensor" in line, line
        assert "To fix: make model.entry's step run (its error is above)" in line, line


def test_a_missing_file_is_named(cli, tmp_path):
    line = _refused(cli, _job(tmp_path, GOOD, entry="model.py:build"))
    assert "no file model.py in the workdir" in line, line


def test_a_wrong_return_shape_says_what_was_expected(cli, tmp_path):
    line = _refused(cli, _job(tmp_path, "def build():\n    return 42\n"))
    assert "build() returned an int; expected (model, batch, loss_fn)" in line, line


def test_a_function_that_raises_names_its_line(cli, tmp_path):
    line = _refused(cli, _job(tmp_path, "def build():\n    return {}['batch']\n"))
    assert "build() failed: train.py:2: KeyError: 'batch'" in line, line


def test_a_script_that_trains_at_import_is_stopped_at_the_timeout(cli, tmp_path):
    spec = _job(tmp_path, "import time\ntime.sleep(120)\n", extra="  entry_timeout: 2s\n")
    t0 = time.monotonic()
    line = _refused(cli, spec)
    assert time.monotonic() - t0 < 60
    assert "did not import, build, capture and time its step within 2 s" in line and "entry_timeout" in line, line


def test_a_compile_cache_that_cannot_be_written_is_named_not_blamed_on_the_entry(cli, tmp_path):
    """With TFSN_CACHE a file, every search failed and the entry was blamed: "its step could not be searched ...:
    BackendCompilerFailed ... To fix: make model.entry's step run (its error is above)", with nothing above."""
    cli.env["TFSN_CACHE"] = str(tmp_path / "cache-file")
    (tmp_path / "cache-file").write_text("")
    line = _refused(cli, _job(tmp_path, GOOD))
    assert f"TFSN_CACHE {tmp_path / 'cache-file'} cannot be used (a file is there)" in line, line
    assert "set TFSN_CACHE to a folder you can write to" in line and "BackendCompilerFailed" not in line, line


def test_plan_prices_the_searched_step_and_caches_it(cli, tmp_path):
    spec = _job(tmp_path, GOOD)
    first = json.loads(cli("plan", str(spec), "--json", timeout=300).stdout)
    [host] = first["hardware"]
    assert host["hardware"] == "host" and host["source"] == "searched graph" and host["graphs"] >= 2
    assert first["chosen"]["step_source"] == "searched graph"
    assert first["entry"]["params"] == 32 * 64 + 64 + 64 * 4 + 4 and first["entry"]["example_batch"] == 8
    # the offer's step: the forward+backward (timed here, its kernels searched) plus the update and the all-reduce
    # between the 2 nodes
    assert first["chosen"]["step_seconds"] > host["searched_device_step_s"] > 0 and host["kernels_predicted_s"] > 0
    assert first["chosen"]["step_seconds"] > host["searched_device_step_s"] + host["update_s"] > 0
    t0 = time.monotonic()
    second = json.loads(cli("plan", str(spec), "--json").stdout)
    assert time.monotonic() - t0 < 10
    assert second["hardware"][0]["cached"] and second["chosen"]["step_seconds"] == first["chosen"]["step_seconds"]
    text = cli("plan", str(spec)).stdout
    assert "this machine's CPU:" in text and "searched graph" in text and "cached" in text and "timed here" in text


def test_the_declared_shape_alone_is_priced_by_the_roofline(cli, tmp_path):
    spec = tmp_path / "train.yaml"
    spec.write_text("run: python train.py\nresources:\n  infra: [local]\nmodel:\n  params: 1M\n  layers: 2\n"
                    "  hidden: 64\n  seq_len: 32\n  batch_size: 8\n")
    out = json.loads(cli("plan", str(spec), "--json").stdout)
    assert out["chosen"]["step_source"] == "roofline fallback" and out["entry"] is None
    assert out["hardware"][0]["why_fallback"] == "no model.entry in the spec"


def test_the_child_sees_the_jobs_envs(cli, tmp_path):
    script = GOOD.replace("torch.randn(8, 32), torch.randint(4, (8,))",
                          "torch.randn(int(os.environ['BATCH']), 32), torch.randint(4, (int(os.environ['BATCH']),))")
    spec = _job(tmp_path, "import os\n" + script)
    spec.write_text(spec.read_text() + "envs:\n  BATCH: 3\n")
    assert json.loads(cli("plan", str(spec), "--json").stdout)["entry"]["example_batch"] == 3


class _Counting(torch.nn.Module):
    """An MLP whose forward counts its calls in a Python attribute, as a step counter would: dynamo compiles it
    again at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.nn.functional.cross_entropy(self.net(x), y) * (1.0 + 0.0 * self.calls)


def _price_here(model: torch.nn.Module, monkeypatch, tmp_path) -> dict:
    from optimizer.entry import price_here

    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TFSN_TOP_K", "1")
    g = torch.Generator().manual_seed(0)
    return price_here(model, (torch.randn(8, 32, generator=g), torch.randint(4, (8,), generator=g)), None, 1)


def test_this_machines_step_is_timed_and_the_model_left_as_it_was(monkeypatch, tmp_path):
    """Priced here, the compiled step is also timed as a worker's loop runs it (AdamW included); the timing's
    updates are undone, so whatever prices the model next sees the model the user built."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    priced = _price_here(_Loss(model), monkeypatch, tmp_path)
    assert priced["timed_s"] > 0 and priced["timed_update_s"] > 0 and priced["predicted_s"] > 0
    after = model.state_dict()
    for name, value in before.items():     # the capture's one step moves BatchNorm's statistics, never a weight
        if "running" not in name and "num_batches" not in name:
            assert torch.equal(after[name], value), name


def test_a_step_that_compiles_again_at_every_call_is_priced_by_its_kernels_not_timed(monkeypatch, tmp_path):
    """A forward that changes Python state is compiled again at every call: timing it would time compiles (and
    count each compile's graphs again). Its kernels' predicted sum prices it, over the graphs of one step."""
    torch.manual_seed(0)
    counting = _price_here(_Counting(), monkeypatch, tmp_path)
    assert "timed_s" not in counting and counting["predicted_s"] > 0 and counting["graphs"] == 2


class _Loss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.model(x), y)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_command_ended_by_sigterm_or_a_closed_terminal_leaves_no_child_behind(cli, tmp_path, sig):
    """Killed by SIGTERM or SIGHUP while the child imported model.entry, `tfsn validate` (and plan, launch) left
    that child searching on, for up to entry_timeout, and its temporary folder behind."""
    pid_file = tmp_path / "child.pid"
    spec = _job(tmp_path, f"import os, time\n\ndef build():\n    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                          "    time.sleep(120)\n")
    cli.env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tfsn.py"), "validate", str(spec)], env=cli.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    try:
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert proc.returncode == 128 + sig and "Traceback" not in err, (proc.returncode, err)
