"""End to end on the local provider: real controller, agents, torchrun workers, DCP checkpoints."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from orchestrator.sdk.checkpoint import list_checkpoints, load_tensors
from providers.processes import pids_with_env
from tests.conftest import EXAMPLE, ROOT, write_job

pytestmark = pytest.mark.e2e


def assert_processes_go(nodes: list[dict], within_s: float = 20.0) -> None:
    """No process of these nodes (agent, torchrun, workers) is left within `within_s` of the job's end: the
    provider's teardown runs off the controller's loop, so the last ones may still be exiting when the
    terminal state is written."""
    deadline = time.monotonic() + within_s
    while True:
        left = [p for n in nodes for p in pids_with_env(TFSN_NODE_ID=n["id"])]
        if not left:
            return
        assert time.monotonic() < deadline, f"processes of the job's nodes still running: {left}"
        time.sleep(0.2)


def final_tensors(spec: Path, steps: int) -> dict[str, torch.Tensor]:
    ckpts = list_checkpoints(spec.parent / f"{spec.stem}-ckpt")
    assert ckpts and ckpts[0].step == steps, f"no final checkpoint at step {steps}: {ckpts}"
    return load_tensors(ckpts[0].path)


def worker_pid(tfsn, job: int, rank: int) -> int:
    node = next(n for n in tfsn.status(job)["nodes"] if n["rank"] == rank and n["state"] == "READY")
    pids = pids_with_env(TFSN_NODE_ID=node["id"], RANK=str(rank), TFSN_JOB_ID=str(job))
    workers = [p for p in pids if "train.py" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(workers) == 1, f"expected one worker of rank {rank}, found {workers}"
    return workers[0]


PLANTED_SECRET = "sk-planted-7f3a9c2e41d0"


def test_example_runs_to_succeeded(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", steps=12, interval=5, envs={"SOME_API_KEY": PLANTED_SECRET})
    out = tfsn("launch", str(spec), timeout=300)
    assert "SUCCEEDED" in out.stdout
    st = tfsn.status(1)
    assert st["state"] == "SUCCEEDED" and st["restarts"] == 0
    assert st["step"] == 12 and st["checkpoint"]["step"] == 12
    assert st["loss"] is not None
    assert {n["state"] for n in st["nodes"]} == {"TERMINATED"} and len(st["nodes"]) == 2
    # two nodes of this machine (free), each billed from its start to its confirmed release
    assert st["cost"]["spent_usd"] == 0.0 and st["cost"]["predicted_usd"] == 0.0
    assert 0 < st["cost"]["node_hours"] <= 2 * st["duration_s"] / 3600
    assert f"cost: {st['cost']['node_hours']:,.2f} node-h, $0.00 spent of $0.00 predicted" in out.stdout
    logs = [p for p in tfsn.home.rglob("*") if p.is_file() and not p.name.startswith("tfsn.db")]
    assert logs and not [p for p in logs if PLANTED_SECRET.encode() in p.read_bytes()], "a secret reached a log"
    log = tfsn("logs", "1").stdout
    assert "[rank0]: step 10: loss" in log and "SUCCEEDED" in log
    assert tfsn("logs", "1", "--follow").stdout.strip() == log.strip()  # returns once the job has ended
    # the nodes' processes are gone
    assert_processes_go(st["nodes"])


def test_killed_worker_resumes_bit_for_bit(tfsn, tmp_path):
    steps = 80  # the example's own model: slow enough to kill a worker mid-run
    reference = write_job(tmp_path / "reference.yaml", entry=False, steps=steps, interval=10, fast=False)
    victim = write_job(tmp_path / "victim.yaml", entry=False, steps=steps, interval=10, fast=False)
    tfsn("launch", str(reference), "--detach", "--name", "reference")
    tfsn("launch", str(victim), "--detach", "--name", "victim")
    st = tfsn.wait("victim", lambda s: (s["checkpoint"] or {}).get("step", 0) >= 20 and s["step"] > 22,
                   what="a checkpoint and progress past it")
    os.kill(worker_pid(tfsn, st["id"], rank=1), signal.SIGKILL)
    done = tfsn.wait_done("victim", timeout=300)
    assert done["state"] == "SUCCEEDED", done
    assert done["restarts"] == 1
    assert done["restored_step"] >= 20
    failed = [n for n in done["nodes"] if n["state"] == "FAILED"]
    assert len(failed) == 1 and failed[0]["rank"] == 1, done["nodes"]
    assert len(done["nodes"]) == 3  # the failed node was replaced, the healthy one kept
    assert tfsn.wait_done("reference", timeout=300)["state"] == "SUCCEEDED"
    ref, got = final_tensors(reference, steps), final_tensors(victim, steps)
    assert ref.keys() == got.keys() and any(k.startswith("optimizer") for k in ref)
    for key in ref:
        assert torch.equal(ref[key], got[key]), f"{key} differs after the restart"


def test_controller_kill_and_restart_keeps_the_job(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", entry=False, steps=100, interval=25, fast=False,
                     health={"heartbeat_timeout": "3s"})
    tfsn("launch", str(spec), "--detach")
    tfsn.wait(1, lambda s: s["state"] == "RUNNING" and s["step"] >= 5, what="training to start")
    info = json.loads((tfsn.home / "controller.json").read_text())
    os.kill(info["pid"], signal.SIGKILL)
    # The workers keep training while no controller runs, for longer than the heartbeat timeout:
    # the new controller must not blame the nodes for the silence it caused.
    time.sleep(5)
    tfsn("controller", "start")
    restarted = json.loads((tfsn.home / "controller.json").read_text())
    assert restarted["pid"] != info["pid"] and restarted["url"] == info["url"]
    done = tfsn.wait_done(1, timeout=300)
    assert done["state"] == "SUCCEEDED" and done["restarts"] == 0, done
    assert done["step"] == 100, "telemetry sent while the controller was down was lost"


def test_application_error_fails_without_looping(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", entry=False, steps=10,
                     run="python -c \"raise ValueError('bad learning rate')\"")
    out = tfsn("launch", str(spec), timeout=300, check=False)
    assert out.returncode == 1
    st = tfsn.status(1)
    assert st["state"] == "FAILED"
    assert "ValueError: bad learning rate" in st["error"]
    assert st["restarts"] <= 1, "the same error must not be retried in a loop"
    assert "ValueError: bad learning rate" in out.stderr


def test_restarts_are_bounded(tfsn, tmp_path):
    # Every attempt's worker dies by a signal (a node fault each time): max_restarts ends it.
    spec = write_job(tmp_path / "job.yaml", entry=False, steps=10, run="kill -9 $$", recovery={"max_restarts": 1})
    out = tfsn("launch", str(spec), timeout=300, check=False)
    assert out.returncode == 1
    st = tfsn.status(1)
    assert st["state"] == "FAILED" and st["restarts"] == 1
    assert "max_restarts" in st["error"]


def agent_pids(node_id: str) -> list[int]:
    """The node's agent process (`python -m orchestrator.agent`), not the torchrun it runs
    (`python .../orchestrator/agent/torchrun.py`)."""
    return [p for p in pids_with_env(TFSN_NODE_ID=node_id)
            if "orchestrator.agent" in Path(f"/proc/{p}/cmdline").read_text().split("\0")]


def test_killed_agent_is_replaced_by_a_spare_and_stop_tears_down(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", entry=False, steps=100000, interval=20, recovery={"spares": 1})
    tfsn("launch", str(spec), "--detach")
    st = tfsn.wait(1, lambda s: s["state"] == "RUNNING" and s["step"] >= 3, what="training to start")
    spare = next(n for n in st["nodes"] if n["rank"] is None)
    node = next(n for n in st["nodes"] if n["rank"] == 0)
    agent = agent_pids(node["id"])
    assert len(agent) == 1
    os.kill(agent[0], signal.SIGKILL)
    st = tfsn.wait(1, lambda s: s["restarts"] == 1 and s["state"] == "RUNNING" and s["step"] >= 3,
                   what="the replacement node to train")
    assert any(n["id"] == node["id"] and n["state"] == "FAILED" for n in st["nodes"])
    assert any(n["id"] == spare["id"] and n["rank"] == 0 for n in st["nodes"]), "the spare took rank 0"
    assert any(e["message"] == f"spare node {spare['id']} takes rank 0" for e in st["events"])
    tfsn.wait(1, lambda s: sum(n["rank"] is None and n["state"] == "READY" for n in s["nodes"]) == 1,
              what="a new spare")
    tfsn("stop", "1")
    st = tfsn.status(1)
    assert st["state"] == "STOPPED"
    assert_processes_go(st["nodes"])


def test_silent_agent_is_failed_after_heartbeat_timeout(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", entry=False, steps=100000, interval=20, health={"heartbeat_timeout": "3s"})
    tfsn("launch", str(spec), "--detach")
    st = tfsn.wait(1, lambda s: s["state"] == "RUNNING" and s["step"] >= 3, what="training to start")
    node = next(n for n in st["nodes"] if n["rank"] == 1)
    agent = agent_pids(node["id"])
    os.kill(agent[0], signal.SIGSTOP)  # alive but silent
    st = tfsn.wait(1, lambda s: s["restarts"] == 1 and s["state"] == "RUNNING", what="the silent node's replacement")
    failed = next(n for n in st["nodes"] if n["id"] == node["id"])
    assert failed["state"] == "FAILED" and "no heartbeat" in failed["failure"]
    assert not pids_with_env(TFSN_NODE_ID=node["id"]), "the silent node's processes were not killed"
    tfsn("stop", "1")


def test_a_suspended_controller_fails_no_node_when_it_resumes(tfsn, tmp_path):
    """The laptop running the controller and a local job suspends (here: SIGSTOP of the controller and the
    agents for twice the heartbeat timeout). Before: the controller's loop, running again before any agent could
    speak, failed every node for its silence, and the job restarted all of them from the last checkpoint."""
    spec = write_job(tmp_path / "job.yaml", entry=False, steps=100000, interval=20, health={"heartbeat_timeout": "5s"})
    tfsn("launch", str(spec), "--detach")
    st = tfsn.wait(1, lambda s: s["state"] == "RUNNING" and s["step"] >= 3, what="training to start")
    controller = json.loads((tfsn.home / "controller.json").read_text())["pid"]
    agents = [pid for node in st["nodes"] for pid in agent_pids(node["id"])]
    assert len(agents) == len(st["nodes"]) == 2
    for pid in (controller, *agents):
        os.kill(pid, signal.SIGSTOP)
    time.sleep(10)
    os.kill(controller, signal.SIGCONT)
    log = tfsn.home / "jobs" / "1" / "job.log"
    stalled = re.compile(r"\[tfsn\] controller stalled for (\d+)s: heartbeat clocks restarted")
    judged = re.compile(stalled.pattern + r"|\[tfsn\] node \S+ failed")
    deadline = time.monotonic() + 30   # the agents speak again once the loop has judged their silence
    while not judged.search(log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in agents:
        with contextlib.suppress(ProcessLookupError):   # a node failed meanwhile is killed: said below
            os.kill(pid, signal.SIGCONT)
    resumed = tfsn.status(1)["step"]
    st = tfsn.wait(1, lambda s: s["step"] >= resumed + 5 or s["restarts"] > 0, what="training to go on")
    assert st["restarts"] == 0 and [n["state"] for n in st["nodes"]] == ["READY"] * 2, st["nodes"]
    stalls = [int(seconds) for seconds in stalled.findall(log.read_text())]
    assert len(stalls) == 1 and 10 <= stalls[0] <= 11, log.read_text()[-4000:]   # since its last pass
    tfsn("stop", "1")


def test_ctrl_c_on_launch_stops_the_job(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", entry=False, steps=100000, interval=20)
    # A terminal's Ctrl-C: SIGINT at its default disposition in the child even when this test runs in a
    # background job (`cmd &` in a script), whose children inherit SIGINT ignored.
    launch = subprocess.Popen([sys.executable, str(ROOT / "tfsn.py"), "launch", str(spec)], env=tfsn.env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    tfsn.wait(1, lambda s: s["state"] == "RUNNING" and s["step"] >= 3, what="training to start")
    launch.send_signal(signal.SIGINT)
    try:
        out, _ = launch.communicate(timeout=150)
    except subprocess.TimeoutExpired:       # say where the stop got stuck, for the next person
        launch.kill()
        out, _ = launch.communicate()
        controller_log = (tfsn.home / "controller.log")
        raise AssertionError(f"launch did not exit after Ctrl-C.\nits output (end):\n{out[-3000:]}\n"
                             f"status: {tfsn('status', '1', check=False).stdout[-3000:]}\ncontroller log (end):\n"
                             f"{controller_log.read_text()[-4000:] if controller_log.exists() else '(none)'}") from None
    assert launch.returncode == 1 and "STOPPED" in out
    st = tfsn.status(1)
    assert st["state"] == "STOPPED"
    assert_processes_go(st["nodes"])


def test_example_spec_is_valid(tfsn):
    out = tfsn("validate", str(EXAMPLE / "train.yaml"))
    assert "valid job 'tiny-gpt'" in out.stdout
