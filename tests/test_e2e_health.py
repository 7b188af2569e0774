"""End to end: the health monitor finds a slow or stuck worker, and the job recovers around it."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.conftest import write_job
from tests.test_e2e import worker_pid

pytestmark = pytest.mark.e2e


def duty_cycle(pid: int, stopped_s: float, running_s: float, stop: threading.Event) -> None:
    """Slow a process down by stopping it for `stopped_s` of every `stopped_s + running_s`."""
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(running_s)


def test_slowed_worker_is_found_checkpointed_and_replaced(tfsn, tmp_path):
    # Two ranks on a 2-core machine: the slow rank frees a core for the other, so its own time hardly
    # moves; its time against the other rank's, held against its own past, is what shows it.
    spec = write_job(tmp_path / "job.yaml", steps=450, interval=1000, fast=False)
    tfsn("launch", str(spec), "--detach")
    st = tfsn.wait(1, lambda s: s["state"] == "RUNNING" and s["step"] >= 70, what="a baseline of steps")
    slow_node = next(n["id"] for n in st["nodes"] if n["rank"] == 1)
    stop = threading.Event()
    # stopped 12 ms of every 40: 30% of the time, so its steps take ~40% longer (periods of tens of
    # milliseconds, so that scheduling jitter on a loaded machine does not change the fraction much)
    cycler = threading.Thread(target=duty_cycle, args=(worker_pid(tfsn, 1, rank=1), 0.012, 0.028, stop), daemon=True)
    cycler.start()
    try:
        st = tfsn.wait(1, lambda s: s["restarts"] >= 1, timeout=180, what="the slow node to be replaced")
    finally:
        stop.set()
        cycler.join()
    events = [e["message"] for e in st["events"]]
    assert any(m.startswith("straggler") and slow_node in m for m in events), events
    assert any(m.startswith(f"checkpointing, then replacing {slow_node}") for m in events), events
    done = tfsn.wait_done(1, timeout=300)
    assert done["state"] == "SUCCEEDED", done
    failed = [n for n in done["nodes"] if n["state"] == "FAILED"]
    assert [n["id"] for n in failed] == [slow_node], "only the slow node is replaced"
    assert done["restored_step"] > 70, "the restart resumed from the checkpoint taken for the replacement"
    assert not any(m.startswith("straggler") and n["id"] in m for m in events
                   for n in done["nodes"] if n["id"] != slow_node and n["rank"] == 0)


def test_stopped_worker_is_found_hung_and_replaced(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", steps=100000, interval=20,
                     health={"heartbeat_timeout": "4s", "thresholds": {"hang_min_s": 6}})
    tfsn("launch", str(spec), "--detach")
    st = tfsn.wait(1, lambda s: s["state"] == "RUNNING" and s["step"] >= 30, what="training to start")
    stuck_node = next(n["id"] for n in st["nodes"] if n["rank"] == 0)
    os.kill(worker_pid(tfsn, 1, rank=0), signal.SIGSTOP)  # for good
    st = tfsn.wait(1, lambda s: s["restarts"] >= 1 and s["state"] == "RUNNING" and s["restored_step"] is not None,
                   timeout=120, what="the hung node to be replaced and training resumed")
    events = [e["message"] for e in st["events"]]
    assert any(m.startswith("hang") and stuck_node in m for m in events), events
    failed = [n for n in st["nodes"] if n["state"] == "FAILED"]
    assert [n["id"] for n in failed] == [stuck_node]
    tfsn("stop", "1")
