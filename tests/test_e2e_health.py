"""End to end: the health monitor finds a slow or stuck worker, and the job recovers around it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import write_job
from tests.test_e2e import worker_pid

pytestmark = pytest.mark.e2e


@contextlib.contextmanager
def noisy_neighbours(pid: int, core: int, hogs: int):
    """Slow a process down the way a co-tenant does: pin all its threads to one core and run `hogs`
    busy loops pinned there too, so it gets about 1/(hogs+1) of that core. (Stopping and resuming it
    instead is undone by the scheduler's catch-up credit on a loaded machine.)"""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {core})
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(hogs)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for the slowed rank and one for the other")
def test_slowed_worker_is_found_checkpointed_and_replaced(tfsn, tmp_path):
    # Two ranks: each rank's compute time against the other's, held against its own past, shows the slow one.
    spec = write_job(tmp_path / "job.yaml", steps=600, interval=1000, fast=False)
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

    # two busy neighbours on its core: its steps take about 3x as long as the other rank's
    with noisy_neighbours(worker_pid(tfsn, 1, rank=1), core=0, hogs=2):
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
