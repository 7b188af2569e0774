"""The SDK inside a training script: standalone runs, resume, corrupt checkpoints, telemetry."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from orchestrator.sdk import run as sdk
from orchestrator.sdk.checkpoint import MANIFEST, list_checkpoints, load_tensors
from tests.conftest import EXAMPLE, FAST_MODEL


def run_example(ckpt_dir: Path, steps: int, interval: int = 10, wait: bool = True, **extra: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFSN_")}
    env.update(FAST_MODEL, STEPS=str(steps), OMP_NUM_THREADS="1", **extra)
    # the script's own init() arguments would put checkpoints in ./checkpoints; point them elsewhere
    env.update(TFSN_CHECKPOINT_DIR=str(ckpt_dir), TFSN_CHECKPOINT_INTERVAL=str(interval))
    proc = subprocess.Popen([sys.executable, "train.py"], cwd=EXAMPLE, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if wait:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        return out
    return proc


def test_standalone_run_trains_and_checkpoints(tmp_path):
    out = run_example(tmp_path / "ckpt", steps=30, interval=10)
    assert "starting at step 0 of 30" in out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[-1] < losses[0] - 0.5, f"loss did not fall: {losses}"
    assert [c.step for c in list_checkpoints(tmp_path / "ckpt")] == [30, 20, 10]


def test_standalone_resume_after_kill_matches_uninterrupted_run(tmp_path):
    run_example(tmp_path / "ref", steps=40, interval=10)
    proc = run_example(tmp_path / "cut", steps=40, interval=10, wait=False)
    deadline = time.monotonic() + 120
    while not [c for c in list_checkpoints(tmp_path / "cut") if c.step >= 20] and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = run_example(tmp_path / "cut", steps=40, interval=10)
    start = int(re.search(r"starting at step (\d+)", resumed).group(1))
    assert start >= 20
    ref = load_tensors(list_checkpoints(tmp_path / "ref")[0].path)
    got = load_tensors(list_checkpoints(tmp_path / "cut")[0].path)
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path):
    run_example(tmp_path / "ckpt", steps=20, interval=10)
    newest = list_checkpoints(tmp_path / "ckpt")[0]
    assert newest.step == 20
    victim = next(p for p in newest.path.iterdir() if p.name.endswith(".distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = run_example(tmp_path / "ckpt", steps=25, interval=10)
    assert "starting at step 10 of 25" in out
    assert (newest.path / MANIFEST).exists(), "restore must never delete a checkpoint"


def _make_run(tmp_path, interval, total=None) -> sdk.Run:
    return sdk.Run(checkpoint_dir=tmp_path, checkpoint_interval=interval, keep=2, total_steps=total)


def test_checkpoint_is_due_every_interval_and_after_the_last_step(tmp_path):
    run = _make_run(tmp_path, 4)
    model = torch.nn.Linear(2, 2)
    saved = [step + 1 for step in run.steps(0, 10) if run.checkpoint(model=model)]
    assert saved == [4, 8, 10]


def test_a_save_before_the_loop_holds_the_steps_done_so_far(tmp_path):
    """A save of the initial weights (`run.checkpoint(force=True, ...)` before the loop) was step 1, so a run resumed
    from it started at step 1, skipping step 0; after a restore, a save before the loop is the restored step."""
    model = torch.nn.Linear(2, 2)
    run = _make_run(tmp_path, 2)
    assert run.checkpoint(force=True, model=model).step == 0
    assert run.checkpoint(model=model) is None              # due only after a step
    resumed = _make_run(tmp_path, 2)
    start = resumed.restore(model=model)
    assert start == 0
    assert [step for step in resumed.steps(start, 3) if resumed.checkpoint(model=model)] == [1, 2]
    again = _make_run(tmp_path, 2)
    assert again.restore(model=model) == 3 and again.checkpoint(force=True, model=model).step == 3


def test_a_resumed_run_saves_again_only_after_a_step(tmp_path):
    """An unforced save before the loop is never due, after a restore too: the restored step 4, at an interval of 2
    (or the last step), was written again, every checkpoint's files, at each resume."""
    model = torch.nn.Linear(2, 2)
    first = _make_run(tmp_path, 2, total=4)
    assert [step for step in first.steps(0) if first.checkpoint(model=model)] == [1, 3]
    resumed = _make_run(tmp_path, 2, total=4)
    assert resumed.restore(model=model) == 4
    assert resumed.checkpoint(model=model) is None


def test_time_based_interval_is_decided_at_sync_points(tmp_path, monkeypatch):
    run = _make_run(tmp_path, "1h", total=100)
    model = torch.nn.Linear(2, 2)
    clock = [0.0]
    monkeypatch.setattr(sdk.time, "monotonic", lambda: clock[0])
    run._last_save = 0.0
    saved = []
    for step in run.steps(0, 100):
        clock[0] += 200.0  # each step "takes" 200 s: the hour passes during step 18
        if run.checkpoint(model=model):
            saved.append(step + 1)
    assert saved[0] == 20, "time-based saves happen at the first sync point after the interval"
    assert saved[-1] == 100


def test_telemetry_never_blocks_a_step_when_the_controller_hangs(tmp_path, monkeypatch):
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # accepts connections, never answers
    monkeypatch.setenv("TFSN_CONTROLLER_URL", f"http://127.0.0.1:{hung.getsockname()[1]}")
    monkeypatch.setenv("TFSN_TOKEN", "t")
    monkeypatch.setenv("TFSN_JOB_ID", "1")
    run = _make_run(tmp_path, 1000)
    assert run.managed
    run._telemetry.EXIT_FLUSH_S = 0
    started = time.monotonic()
    for step in run.steps(0, 200):
        run.log(loss=torch.tensor(1.0))
    assert time.monotonic() - started < 2.0, "steps waited on the network"
    threading.Thread(target=run.finish, daemon=True).start()
    hung.close()


@pytest.fixture
def controller(monkeypatch):
    """A controller's /telemetry route on a real HTTP server: the bodies it took, as the API's model reads them,
    refusing as the API does a body over the route's byte cap (413) or one its model refuses (400)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from pydantic import ValidationError

    from orchestrator.control.api import ROUTES
    from orchestrator.control.requests import Telemetry
    bodies: list[dict] = []
    max_bytes = next(route.max_bytes for route in ROUTES if route.body is Telemetry)

    class Controller(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            status = 413 if len(raw) > max_bytes else 200
            if status == 200 and self.path.endswith("/telemetry"):
                try:
                    bodies.append(Telemetry.model_validate(json.loads(raw)).model_dump())
                except ValidationError:
                    status = 400
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Controller)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    monkeypatch.setenv("TFSN_CONTROLLER_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("TFSN_TOKEN", "t")
    monkeypatch.setenv("TFSN_JOB_ID", "1")
    yield bodies
    server.shutdown()
    server.server_close()


def test_numpy_scalars_are_logged_as_numbers(tmp_path, controller):
    """A metric computed with NumPy (a mean over an eval set's float32 array, a count) is np.float32 or np.int64, not a
    Python float or int: run.log refused it ("expected a number or a one-element tensor, got float32")."""
    import numpy as np
    run = _make_run(tmp_path, 1000)
    run._telemetry.EXIT_FLUSH_S = 5
    for step in run.steps(0, 1):
        run.log(loss=torch.tensor(0.5), acc=np.mean(np.array([1, 0], dtype=np.float32)), tokens=np.int64(7))
    with pytest.raises(TypeError, match=r"run.log\(note=...\): expected a number or a one-element tensor, got str"):
        run.log(note="x")
    run.finish()
    (record,) = [r for body in controller for r in body["records"]]
    assert record["metrics"] == {"loss": 0.5, "acc": 0.5, "tokens": 7.0}


@pytest.mark.parametrize("value, kind", [
    ("np.timedelta64(3, 's')", "timedelta64"), ("10 ** 400", "int"), ("torch.tensor(1 + 2j)", "Tensor")])
def test_a_metric_that_is_no_float_is_refused_by_run_log_not_by_the_heartbeat(tmp_path, controller, value, kind):
    """NumPy's timedelta64 is a numbers.Real, 10**400 an int, a complex tensor has one element: run.log took them and
    the telemetry thread's float() raised at every flush from then on, before the post, so the rank sent no
    heartbeat again (taken for a hung node) and no metric."""
    import numpy as np
    run = _make_run(tmp_path, 1000)
    run._telemetry.EXIT_FLUSH_S = 5
    for step in run.steps(0, 1):
        with pytest.raises(TypeError, match=rf"run.log\(bad=...\): expected a number or a one-element tensor, "
                                            rf"got {kind}"):
            run.log(bad=eval(value, {"np": np, "torch": torch}))
        run.log(loss=1.0)
    run.finish()
    assert [r["metrics"] for body in controller for r in body["records"]] == [{"loss": 1.0}]


def test_metrics_the_api_would_refuse_are_refused_by_run_log_not_by_the_heartbeat(tmp_path, controller):
    """A metric name over 255 characters, or a 257th metric in a step: the API refused the whole telemetry body (400),
    heartbeat included, at every flush that held that step's record; with a step per flush, every one."""
    run = _make_run(tmp_path, 1000)
    run._telemetry.EXIT_FLUSH_S = 5
    for step in run.steps(0, 1):
        with pytest.raises(ValueError, match=r"run.log\(xxx+=...\): a metric name is at most 255 characters"):
            run.log(**{"x" * 256: 1.0})
        run.log(**{f"m{i}": 1.0 for i in range(253)}, loss=1.0)
        run.log(loss=0.5)                                  # a metric logged again is no new one
        with pytest.raises(ValueError, match=r"run.log\(extra=...\): a step has at most 254 metrics"):
            run.log(extra=1.0)
    run.finish()
    (record,) = [r for body in controller for r in body["records"]]
    assert len(record["metrics"]) == 254 and record["metrics"]["loss"] == 0.5


def test_a_metric_name_the_api_cannot_read_is_refused_by_run_log(tmp_path, controller):
    """A name holding a lone surrogate (a file name decoded with surrogateescape) is sent by json.dumps, escaped, but
    the API refuses it as no Unicode text: the whole telemetry body, heartbeat included, at every flush that held it."""
    run = _make_run(tmp_path, 1000)
    run._telemetry.EXIT_FLUSH_S = 5
    for step in run.steps(0, 1):
        with pytest.raises(ValueError, match=r"run.log\('loss/\\udcff'=...\): a metric name is Unicode text"):
            run.log(**{b"loss/\xff".decode(errors="surrogateescape"): 1.0})
        run.log(**{"loss/é😀": 1.0})
    run.finish()
    (record,) = [r for body in controller for r in body["records"]]
    assert record["metrics"] == {"loss/é😀": 1.0}


def test_metrics_logged_after_the_last_step_are_said_to_be_unsent(tmp_path, controller, capsys):
    """A final evaluation logged after the loop has no step to go with: it was dropped, saying nothing."""
    run = _make_run(tmp_path, 1000)
    for step in run.steps(0, 1):
        run.log(loss=1.0)
    run.log(test_acc=0.9)
    run.log(test_acc=0.8, test_loss=0.1)
    run.finish()
    assert [r["metrics"] for body in controller for r in body["records"]] == [{"loss": 1.0}]
    assert capsys.readouterr().err == ("tfsn: run.log(test_acc, test_loss) after the last step is not sent: metrics "
                                       "are sent with a step; log them in run.steps()'s loop\n")


def test_a_loop_left_mid_step_says_nothing_of_metrics_after_the_last_step(tmp_path, controller, capsys):
    """A step that raised (or a `break`) leaves its run.log unrecorded, inside the loop: finish said they were logged
    "after the last step" and to log them in the loop, under the script's own traceback."""
    run = _make_run(tmp_path, 1000)
    with pytest.raises(RuntimeError):
        for step in run.steps(0, 3):
            run.log(loss=1.0)
            if step == 1:
                raise RuntimeError("CUDA out of memory")
    run.finish()
    assert [r["metrics"] for body in controller for r in body["records"]] == [{"loss": 1.0}]
    assert "after the last step" not in capsys.readouterr().err


def test_a_device_timed_compute_time_is_read_off_the_training_thread(controller):
    """On CUDA a step's compute time is a pair of events: the record holds them, the telemetry thread reads them.
    (A reporter that had not begun a step sent step -1, which the API refuses: its heartbeats were lost.)"""
    from orchestrator.sdk import commtimer
    from orchestrator.sdk.client import ControllerClient
    from tests.test_commtimer import FakeDeviceClock
    reporter = sdk.TelemetryReporter(ControllerClient.from_env(), rank=0, attempt=1, flush_s=3600)
    reporter.add({"step": 0, "at": time.time(), "step_time": 0.5, "metrics": {},
                  "compute_time": commtimer.PendingCompute(FakeDeviceClock(), 1.0, 1.25)})
    assert reporter.flush()
    (record,) = controller[-1]["records"]
    assert record["compute_time"] == 0.25
    reporter.EXIT_FLUSH_S = 0
    reporter.close()


def test_a_backlog_over_the_routes_cap_is_sent_in_batches_it_takes(controller, capsys):
    """After a controller outage, a full buffer of step records (10,000, several MiB) went in one post: over the
    route's 4 MiB cap, the 413 cleared every record (the steps the health detectors and goodput need). It is sent
    oldest first in posts the route takes, each with a heartbeat; a batch the controller refuses as malformed (400)
    is the only one dropped, saying so."""
    from orchestrator.sdk.client import ControllerClient

    reporter = sdk.TelemetryReporter(ControllerClient.from_env(), rank=0, attempt=1, flush_s=3600)
    names = [f"layer_{i:02d}_gradient_norm_after_clipping_and_scaling" for i in range(8)]
    for step in range(10_000):
        reporter.add({"step": step, "at": time.time(), "step_time": 0.01, "metrics": dict.fromkeys(names, 0.5)})
    started = time.monotonic()
    assert reporter.flush()
    assert time.monotonic() - started < 60
    assert len(controller) > 1 and all(body["heartbeat"] for body in controller)
    assert [r["step"] for body in controller for r in body["records"]] == list(range(10_000))
    controller.clear()
    reporter.add({"step": 10_000, "at": time.time(), "step_time": -1.0, "metrics": {}})   # the model refuses it
    assert reporter.flush() and controller == []
    assert capsys.readouterr().err == "tfsn: the controller refused 1 step record(s), steps 10000 to 10000 " \
        "(dropped; the heartbeats go on): controller refused the request (400): {}\n"
    reporter.add({"step": 10_001, "at": time.time(), "step_time": 0.01, "metrics": {}})
    assert reporter.flush() and [r["step"] for r in controller[-1]["records"]] == [10_001]
    reporter.EXIT_FLUSH_S = 0
    reporter.close()


def _slow_backlog(records: int) -> sdk.TelemetryReporter:
    """A reporter holding `records` step records of ~52 kB (about 80 in a post) for a controller taking 2 s a post."""
    from orchestrator.sdk.client import ControllerClient

    client = ControllerClient.from_env()
    post = client.post

    def slow(path: str, body: dict, timeout: float | None = None) -> dict:
        time.sleep(2.0)
        return post(path, body, timeout)

    client.post = slow
    reporter = sdk.TelemetryReporter(client, rank=0, attempt=1, flush_s=3600)
    names = [f"{i:03d}_" + "m" * 200 for i in range(250)]
    for step in range(records):
        reporter.add({"step": step, "at": time.time(), "step_time": 0.01, "metrics": dict.fromkeys(names, 0.5)})
    return reporter


def test_the_phases_in_a_refused_batch_go_with_the_next_post(controller, capsys):
    """The phases finished since the last flush (how long a save or an evaluation took: what tells a long one from a
    hang) ride in the first post; a batch the controller refused (400) for one of its records dropped them too."""
    from orchestrator.sdk import phases
    from orchestrator.sdk.client import ControllerClient

    clock = phases.PhaseClock()
    reporter = sdk.TelemetryReporter(ControllerClient.from_env(), rank=0, attempt=1, flush_s=3600, clock=clock)
    with clock.phase("eval"):
        time.sleep(0.02)
    reporter.add({"step": 0, "at": time.time(), "step_time": -1.0, "metrics": {}})   # the model refuses it
    assert reporter.flush() and controller == []
    assert "refused 1 step record(s)" in capsys.readouterr().err
    assert reporter.flush() and controller[-1]["phases"]["eval"] >= 0.02
    reporter.EXIT_FLUSH_S = 0
    reporter.close()


def test_close_waits_for_the_threads_flush_rather_than_sending_its_batches_again(controller):
    """close() waits 5 s for the telemetry thread, then flushes itself. A backlog of several batches to a slow
    controller outlasts that wait: both flushes read the same records and the batch in flight was posted twice (the
    controller stores every record it is sent: the step twice in the job's history). One flush at a time."""
    reporter = _slow_backlog(300)
    reporter._wake.set()   # the thread's flush starts: four posts, 8 s
    time.sleep(0.5)
    reporter.EXIT_FLUSH_S = 10
    reporter.close()
    assert [r["step"] for body in controller for r in body["records"]] == list(range(300))


def test_close_keeps_to_its_exit_flush_time_with_a_backlog_to_a_slow_controller(controller):
    """close() gives the last records EXIT_FLUSH_S after the thread's 5 s, and a script's exit waits on it: its own
    flush went on posting batch after batch (here 2 s each) past that, the exit with it."""
    reporter = _slow_backlog(600)
    reporter.EXIT_FLUSH_S = 1
    started = time.monotonic()
    reporter.close()
    assert time.monotonic() - started < 5 + 1 + 2 + 1


def test_a_field_that_cannot_be_read_is_dropped_not_the_heartbeat(controller, capsys):
    """A metric or a device timing that raises when the telemetry thread reads it (a CUDA error; here a meta tensor,
    and a clock that fails) raised out of every flush from then on, before the post: the record stayed at the head of
    the queue, and the rank sent no heartbeat or metric again (a healthy rank taken for hung, its node replaced).
    Records a controller did not answer for are still kept for the next flush."""
    from orchestrator.sdk import commtimer
    from orchestrator.sdk.client import ControllerClient
    from tests.test_commtimer import FakeDeviceClock

    class FailingClock(FakeDeviceClock):
        def seconds(self, start: float, end: float) -> float:
            raise ValueError("no such event")

    client = ControllerClient.from_env()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))          # a port nothing listens on: the controller is down
    reporter = sdk.TelemetryReporter(ControllerClient(f"http://127.0.0.1:{closed.getsockname()[1]}", "t", 1),
                                     rank=0, attempt=1, flush_s=3600)
    reporter.add({"step": 0, "at": time.time(), "step_time": 0.5, "metrics": {
        "loss": torch.tensor(1.0, device="meta"), "lr": 0.1}, "compute_time": commtimer.PendingCompute(
        FailingClock(), 1.0, 1.25)})
    reporter.add({"step": 1, "at": time.time(), "step_time": 0.5, "metrics": {"loss": torch.tensor(0.5)}})
    assert not reporter.flush()
    closed.close()
    reporter.client = client
    assert reporter.flush()
    assert [(r["step"], r["metrics"], r["compute_time"]) for r in controller[-1]["records"]] == [
        (0, {"lr": 0.1}, None), (1, {"loss": 0.5}, None)]
    assert capsys.readouterr().err == (
        "tfsn: step 0's metric 'loss' is not sent: reading it failed (RuntimeError: Tensor.item() cannot be called "
        "on meta tensors)\n"
        "tfsn: step 0's compute_time is not sent: reading it failed (ValueError: no such event)\n")
    assert reporter.flush() and controller[-1]["records"] == []      # and the heartbeats go on
    reporter.EXIT_FLUSH_S = 0
    reporter.close()


def test_a_ddp_model_with_a_comm_hook_of_its_own_is_restored_and_trains_untimed(tmp_path, controller, capsys):
    """`run.restore(model=ddp)` installed the all-reduce timer's comm hook over the user's (PowerSGD, fp16
    compression, DDP's mixed_precision): DDP takes one, and restore failed with RuntimeError
    'register_comm_hook or register_builtin_comm_hook can only be called once'."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Linear(2, 2))
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        run = _make_run(tmp_path / "ckpt", 100)
        for step in run.steps(run.restore(model=model), 2):
            model(torch.randn(3, 2)).sum().backward()
        run.finish()
    finally:
        dist.destroy_process_group()
    assert capsys.readouterr().err.count("tfsn: the all-reduce is not timed: the DDP model has a comm hook") == 1
    assert [r["step"] for body in controller for r in body["records"]] == [0, 1]


def test_phases_reach_the_controller_with_the_heartbeat(tmp_path, controller):
    """`with run.phase("eval"):` and tfsn's own save are announced, with how long each took, so that
    the controller does not take a long evaluation or save for a hang."""
    from orchestrator.sdk import phases
    bodies = controller
    run = _make_run(tmp_path, 3)
    model = torch.nn.Linear(2, 2)
    for step in run.steps(0, 3):
        with run.phase("eval"):
            time.sleep(0.05)
            assert run._telemetry.flush()                 # a heartbeat sent while evaluating
        run.checkpoint(model=model)
    with phases.phase("data"):                            # what code without the Run at hand calls
        time.sleep(0.02)
    run.finish()
    during = [b for b in bodies if b["phase"] == "eval"]
    assert len(during) == 3 and all(0 < time.time() - b["phase_since"] < 60 for b in during)
    longest: dict[str, float] = {}
    for body in bodies:
        for name, seconds in body["phases"].items():
            longest[name] = max(seconds, longest.get(name, 0.0))
    assert set(longest) == {"eval", "checkpoint", "data"} and longest["eval"] >= 0.05 and longest["data"] >= 0.02
    assert bodies[-1]["phase"] == "train" and bodies[-1]["phase_since"] is None


def test_listeners_hear_each_phase_the_heartbeat_reports(tmp_path, controller):
    """One way in to a phase: `run.on_phase` listeners hear what the controller hears, the background write
    included."""
    from orchestrator.sdk import phases
    bodies = controller
    run = sdk.Run(checkpoint_dir=tmp_path, checkpoint_interval=1, keep=2, total_steps=None, async_save=True)
    heard: list[tuple[str, bool, bool]] = []
    run.on_phase(lambda name, started: heard.append((name, started, threading.current_thread() is threading.main_thread())))
    model = torch.nn.Linear(2, 2)
    for step in run.steps(0, 2):
        with run.phase("eval"):
            pass
        run.checkpoint(model=model)
    with phases.phase("data"):
        pass
    run.finish()
    reported = {name for body in bodies for name in body["phases"]}
    assert reported == {name for name, _, _ in heard} == {"eval", "checkpoint", "checkpoint-write", "data"}
    for name in reported:
        assert [s for n, s, _ in heard if n == name].count(True) == [s for n, s, _ in heard if n == name].count(False)
    assert sum(1 for n, s, _ in heard if n == "checkpoint-write" and s) == 2
    assert all(not main for n, s, main in heard if n == "checkpoint-write" and not s)   # ended by the writer thread


def test_a_rank_waiting_for_a_background_write_is_in_the_write_phase(tmp_path, controller, monkeypatch):
    """Waiting for a save being written (at the end, before the next save, before a restore), the rank reports
    the write's phase since the write began: hang detection gives it the timeout learned from earlier writes,
    not the one of "checkpoint", whose history holds only the milliseconds of the steps' stalls."""
    from orchestrator.sdk import checkpoint
    bodies = controller
    release = threading.Event()
    real_commit = checkpoint._commit

    def slow_commit(*args: object) -> object:
        release.wait(30)
        return real_commit(*args)

    monkeypatch.setattr(checkpoint, "_commit", slow_commit)
    run = sdk.Run(checkpoint_dir=tmp_path, checkpoint_interval=1, keep=2, total_steps=None, async_save=True)
    began = time.time()
    for step in run.steps(0, 1):
        run.checkpoint(model=torch.nn.Linear(2, 2))
    finishing = threading.Thread(target=run.finish)
    try:
        deadline = time.time() + 20
        while not any(b["phase"] == "train" for b in bodies) and time.time() < deadline:
            time.sleep(0.05)                              # training goes on while the save is written ...
        finishing.start()
        while not any(b["phase"] == "checkpoint-write" for b in bodies) and time.time() < deadline:
            time.sleep(0.05)                              # ... until the end waits for it
        waiting = [b for b in bodies if b["phase"] == "checkpoint-write"]
        assert waiting and began <= waiting[0]["phase_since"] <= time.time()
    finally:
        release.set()
        finishing.join(30)
    assert any(b["phases"].get("checkpoint-write", 0) > 0 for b in bodies)   # its duration, for the timeout


def test_a_bad_phase_name_is_a_one_line_error(tmp_path):
    run = _make_run(tmp_path, 3)
    for bad in ("Eval", "train", "", "x" * 40, 3):
        with pytest.raises(ValueError) as err:
            with run.phase(bad):
                pass
        assert "run.phase(" in str(err.value) and "\n" not in str(err.value)


def test_init_refuses_a_checkpoint_setting_that_would_fail_or_go_astray(tmp_path, monkeypatch):
    """keep=0 failed only at the first save, minutes into the run, and an unsupported URL ("ftp://...") was taken
    as a path: a folder "ftp:" beside the script, whose checkpoints a restart on another node never finds."""
    import tfsn
    monkeypatch.chdir(tmp_path)
    for bad, what in ((dict(keep=0), "keep must be at least 1"), (dict(checkpoint_dir="ftp://host/ckpt"), "ftp://")):
        with pytest.raises(ValueError) as err:
            tfsn.init(**bad)
        assert what in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


_EXITS_WHILE_WRITING = """
import sys, time, torch, tfsn
from orchestrator.sdk import checkpoint
commit = checkpoint._commit
def slow_commit(*args):   # the last save is still being written when the script ends
    time.sleep(1)
    if sys.argv[2] == "fail":
        raise OSError(28, "No space left on device")
    return commit(*args)
checkpoint._commit = slow_commit
run = tfsn.init(checkpoint_dir=sys.argv[1], checkpoint_interval=100, steps=2)
model = torch.nn.Linear(4, 4)
for step in run.steps(0):
    run.checkpoint(model=model)
print("loop done", flush=True)
"""


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_a_script_that_ends_without_finish_still_saves_its_last_checkpoint(tmp_path, outcome):
    """The exit waits for the last background save (failed before: the write's checksums could not start a
    thread once Python was shutting down, the save was lost and the exit status was still 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFSN_")}
    proc = subprocess.run([sys.executable, "-c", _EXITS_WHILE_WRITING, str(tmp_path), outcome], env=env,
                          capture_output=True, text=True, timeout=120)
    if outcome == "ok":
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert [c.step for c in list_checkpoints(tmp_path)] == [2]
    else:   # a failed last save is a failed run: a one-line error, no traceback, a non-zero exit
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert re.fullmatch(r"tfsn: committing checkpoint \S+step_000000002 failed: .*No space left.*\n", proc.stderr)
        assert list_checkpoints(tmp_path) == []
