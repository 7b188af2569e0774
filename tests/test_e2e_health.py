"""End to end: the health monitor finds a slow or stuck worker, and the job recovers around it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from tests.conftest import write_job
from tests.test_e2e import worker_pid

pytestmark = pytest.mark.e2e


@contextlib.contextmanager
def duty_cycled(pid: int, stopped_s: float, running_s: float):
    """Slow a process down by stopping it (SIGSTOP) for `stopped_s` of every `stopped_s + running_s`."""
    stop = threading.Event()

    def cycle() -> None:
        while not stop.is_set():
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stopped_s)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                return
            time.sleep(running_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def straggler_metrics(tfsn) -> str:
    """The controller's per-rank compute times and straggler scores now (for a failure message)."""
    try:
        url = json.loads((tfsn.home / "controller.json").read_text())["metrics_url"]
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except (OSError, ValueError, KeyError) as err:
        return f"(no metrics: {err})"
    return " ".join(line for line in text.splitlines()
                    if line.startswith(("tfsn_straggler_score{", "tfsn_compute_time_seconds{")))


def test_slowed_worker_is_found_checkpointed_and_replaced(tfsn, tmp_path):
    # Two ranks: each rank's compute time against the other's, held against its own past, shows the slow one.
    # A restart here takes seconds, not a cloud node's minutes: said, so that the policy finds the
    # replacement worth it once the slowdown has cost that much (health/policy.py rule 4b). 600 steps: the slowdown
    # starts at step 150; the replacement came at steps 248 to 272 in five runs (one beside another test file), but
    # never before step 450 in one run beside a whole CI run (2026-12-07), and after the last steps the rest of the
    # run would lose less than a replacement costs (rule 4b).
    spec = write_job(tmp_path / "job.yaml", entry=False, steps=600, interval=1000, fast=False,
                     health={"thresholds": {"replace_restart_s": 2.0, "replace_save_s": 0.5}})
    tfsn("launch", str(spec), "--detach")
    # A long baseline first: a slowdown that starts while a rank's usual pace is still being learned
    # is partly taken for that pace (the detector cannot tell a slow chip from a new fault yet).
    st = tfsn.wait(1, lambda s: s["state"] == "RUNNING" and s["step"] >= 150, what="a baseline of steps")
    slow_node = next(n["id"] for n in st["nodes"] if n["rank"] == 1)
    seen: list[str] = []

    def replaced(status: dict) -> bool:
        if status["state"] == "RUNNING":
            seen.append(f"step {status.get('step')}: {straggler_metrics(tfsn)}")
        return status["restarts"] >= 1

    # stopped 20 ms of every 40 (half the time): its compute takes about twice as long (periods of tens of
    # milliseconds, so that scheduling jitter does not change the fraction much). A 40% slowdown (12 ms of
    # 40) went unseen in a CI run on a machine loaded to 4 on 2 cores, where both ranks' compute times
    # varied by that much from step to step
    with duty_cycled(worker_pid(tfsn, 1, rank=1), 0.020, 0.020):
        try:
            st = tfsn.wait(1, replaced, timeout=180, what="the slow node to be replaced")
        except AssertionError as err:
            raise AssertionError("\n".join([str(err), "what the monitor saw:", *seen[-20:]])) from None
    events = [e["message"] for e in st["events"]]
    assert any(m.startswith("straggler") and slow_node in m for m in events), events
    assert any(m.startswith(f"checkpointing, then replacing {slow_node}") for m in events), events
    done = tfsn.wait_done(1, timeout=300)
    assert done["state"] == "SUCCEEDED", done
    failed = [n for n in done["nodes"] if n["state"] == "FAILED"]
    assert [n["id"] for n in failed] == [slow_node], "only the slow node is replaced"
    assert done["restored_step"] > 70, "the restart resumed from the checkpoint taken for the replacement"
    # The healthy rank is never acted on. It may be warned about: it waits for the slowed rank inside DDP's
    # all-reduce, which overlaps its backward, so at the slowdown's onset its own compute time can rise past its
    # baseline for a few steps ("rank 0 computes 1.12x", once in a CI run loaded to 5 on 2 cores).
    healthy = [n["id"] for n in done["nodes"] if n["id"] != slow_node and n["rank"] == 0]
    acted_on = [m for m in events for n in healthy if n in m and m.startswith(
        ("checkpointing, then replacing", "checkpoint requested", f"node {n} failed"))]
    assert not acted_on, (healthy, events)


def test_stopped_worker_is_found_hung_and_replaced(tfsn, tmp_path):
    # timeouts short for a test, but not so short that a healthy rank's heartbeat, delayed on a loaded 2-core
    # machine while its checkpoint writer hashes, reads as silent (4 s did once in a whole-suite run: every
    # node was replaced)
    spec = write_job(tmp_path / "job.yaml", entry=False, steps=100000, interval=20,
                     health={"heartbeat_timeout": "8s", "thresholds": {"hang_min_s": 12}})
    tfsn("launch", str(spec), "--detach")
    st = tfsn.wait(1, lambda s: s["state"] == "RUNNING" and s["step"] >= 30, what="training to start")
    stuck_node = next(n["id"] for n in st["nodes"] if n["rank"] == 0)
    os.kill(worker_pid(tfsn, 1, rank=0), signal.SIGSTOP)  # for good
    st = tfsn.wait(1, lambda s: s["restarts"] >= 1 and s["state"] == "RUNNING" and (s["restored_step"] or 0) > 0,
                   timeout=120, what="the hung node to be replaced and training resumed")
    events = [e["message"] for e in st["events"]]
    assert any(m.startswith("hang") and stuck_node in m for m in events), events
    failed = [n for n in st["nodes"] if n["state"] == "FAILED"]
    assert [n["id"] for n in failed] == [stuck_node]
    tfsn("stop", "1")
