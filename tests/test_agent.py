"""The node agent and its workers, without a controller (its posts go nowhere and are kept for later)."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.agent.node import Agent, failure_summary
from orchestrator.sdk.client import ControllerClient
from providers.processes import pids_with_env
from tests.awsfaults import free_port
from tests.vmsandbox import wait_for

ROOT = str(Path(__file__).resolve().parent.parent)   # this tfsn, for the agent's torchrun wrapper


def test_a_workers_lines_reach_the_log_while_it_runs(tmp_path, monkeypatch):
    """torchrun copies its workers' lines to its stdout, a pipe to the agent: block-buffered, they came only once
    the attempt ended, so `tfsn logs --follow` showed nothing of a running job."""
    for name in ("TFSN_DCGM_URL", "TFSN_AGENT_METRICS_PORT", "TFSN_WORKDIR", "PYTHONUNBUFFERED"):   # as on a VM
        monkeypatch.delenv(name, raising=False)
    agent = Agent(ControllerClient("http://127.0.0.1:9", "token", 1, timeout=0.2), "live-0")
    agent._start({"nnodes": 1, "node_rank": 0, "nproc_per_node": 1, "master_addr": "127.0.0.1",
                  "master_port": free_port(), "run": "echo first line; sleep 120", "attempt": 1,
                  "workdir": str(tmp_path), "env": {"TFSN_NODE_ID": "live-0", "TFSN_ATTEMPT": "1"}})
    try:
        wait_for(lambda: "[rank0]: first line" in agent.logs.tail or agent.proc.poll() is not None, 60,
                 "the worker's first line")
        assert agent.proc.poll() is None, list(agent.logs.tail)   # seen while the worker runs
    finally:
        agent.stop_workers()


def test_the_plan_that_came_with_the_code_is_in_the_workers_cache_before_they_start(tmp_path, monkeypatch):
    """A cloud node's code archive holds the job's plan (codesync.PLAN_FOLDER); the node's cache starts empty, and
    the workers find the plan's search entries there as they start, so that they search nothing."""
    from optimizer.cache import PLAN_FOLDER
    for name in ("TFSN_DCGM_URL", "TFSN_AGENT_METRICS_PORT", "PYTHONUNBUFFERED"):
        monkeypatch.delenv(name, raising=False)
    workdir, cache, entry = tmp_path / "workdir", tmp_path / "node-cache", f"{'e' * 64}.json"
    (workdir / PLAN_FOLDER).mkdir(parents=True)
    (workdir / PLAN_FOLDER / entry).write_text("{}")
    monkeypatch.setenv("TFSN_WORKDIR", str(workdir))   # as a VM's boot script sets it, where it unpacked the code
    agent = Agent(ControllerClient("http://127.0.0.1:9", "token", 1, timeout=0.2), "vm-0")
    agent._start({"nnodes": 1, "node_rank": 0, "nproc_per_node": 1, "master_addr": "127.0.0.1",
                  "master_port": free_port(), "run": 'ls "$TFSN_CACHE/search"; sleep 120', "attempt": 1,
                  "workdir": "/the/controller's/workdir", "env": {"TFSN_NODE_ID": "vm-0", "TFSN_CACHE": str(cache)}})
    try:
        wait_for(lambda: f"[rank0]: {entry}" in "".join(agent.logs.tail) or agent.proc.poll() is not None, 60,
                 "the worker's listing of its cache")
        assert f"[rank0]: {entry}" in "".join(agent.logs.tail), list(agent.logs.tail)
        assert f"1 search entries of the job's plan installed in {cache}" in "".join(agent.logs.tail)
    finally:
        agent.stop_workers()


# torchrun's report after a worker that printed no Python error exited with code 2 (a `run: python trian.py` typo),
# as a local node's log held it.
TORCHRUN_ROOT_CAUSE = """\
E1205 22:11:21.868000 9102 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
bash FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 9112)
============================================================""".splitlines()


@pytest.mark.parametrize("said, code", [
    ("python: can't open file '/home/me/proj/trian.py': [Errno 2] No such file or directory", 2),
    ("bash: line 1: pythn: command not found", 127),
    ("config.toml has no [model] section; giving up", 3),
])
def test_a_worker_that_fails_without_a_python_error_is_summed_up_by_its_last_line(said, code):
    """A worker that exits without a traceback was summed up as "workers exited with code 1" (torchrun's code,
    not the worker's): `tfsn launch` ended on that line, and the cause was only in the job's log."""
    lines = [f"[rank1]: {said}", f"[rank0]: {said}"] + [l.replace("exitcode  : 2", f"exitcode  : {code}")
                                                         for l in TORCHRUN_ROOT_CAUSE]
    assert failure_summary(lines, 1) == (f"workers exited with code {code}; their last line: [rank0]: {said}", None)
    assert failure_summary(lines[2:], 1) == (f"workers exited with code {code}", None)   # nothing printed


def test_a_python_error_is_summed_up_with_where_the_users_code_raised_it():
    """The summary that ends `tfsn launch` was "[rank0]: [rank0]: RuntimeError: boom" or "SyntaxError: '(' was
    never closed", with no file or line: it now says where, in the job's workdir when a frame is there."""
    raised = ["[rank0]: [rank0]: Traceback (most recent call last):",
              '[rank0]: [rank0]:   File "/home/me/my proj/train.py", line 23, in <module>',
              "[rank0]: [rank0]:     main()",
              '[rank0]: [rank0]:   File "/home/me/my proj/train.py", line 20, in main',
              "[rank0]: [rank0]:     loss = step(model, batch)",
              '[rank0]: [rank0]:   File "/venv/lib/python3.11/site-packages/torch/nn/functional.py", line 9, in mse',
              "[rank0]: [rank0]: RuntimeError: shape mismatch: [8, 512] vs [8, 768]"]
    assert failure_summary(raised + TORCHRUN_ROOT_CAUSE, 1, "/home/me/my proj") == (
        "[rank0]: RuntimeError: shape mismatch: [8, 512] vs [8, 768] (at train.py:20)", None)
    assert failure_summary(raised, 1)[0].endswith("(at /venv/lib/python3.11/site-packages/torch/nn/functional.py:9)")
    syntax = ['[rank0]:   File "/home/me/my proj/train.py", line 2', "[rank0]:     x = (1,", "[rank0]:         ^",
              "[rank0]: SyntaxError: '(' was never closed"]
    assert failure_summary(syntax + TORCHRUN_ROOT_CAUSE, 1, "/home/me/my proj/") == (
        "[rank0]: SyntaxError: '(' was never closed (at train.py:2)", None)
    assert failure_summary(["[rank0]: ValueError: bad learning rate"], 1) == ("[rank0]: ValueError: bad learning rate",
                                                                              None)   # no traceback shown: no place


def test_the_error_is_the_first_failed_ranks_not_its_peers_after_it():
    """Rank 1 of a 2-worker node raised; rank 0 then failed in its next collective, and the job ended on rank 0's
    'Connection closed by peer' (printed last) instead of rank 1's error, which torchrun names as the root cause."""
    lines = ["[rank1]: [rank1]: RuntimeError: boom at step 12",
             "[rank0]: [rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:6553. This is typically caused by a remote worker crashing."]
    root = [line.replace("rank      : 0 (local_rank: 0)", "rank      : 1 (local_rank: 1)")
            for line in TORCHRUN_ROOT_CAUSE]
    assert failure_summary(lines + root, 1) == ("[rank1]: RuntimeError: boom at step 12", None)
    assert failure_summary(lines + TORCHRUN_ROOT_CAUSE, 1)[0].startswith("[rank0]: RuntimeError: [../gloo")


def test_a_failed_attempt_leaves_the_workers_traceback_once_prefixed_and_none_of_torchruns(tmp_path, monkeypatch):
    """A worker that raised after joining its process group showed its traceback as '[rank0]: [rank0]: ...' (torch's
    excepthook prefix under torchrun's), followed by torchrun's own traceback through runpy and launcher/api.py
    (ChildFailedError): the job log's only traceback is now the user's, prefixed once, and the summary is the same."""
    for name in ("TFSN_DCGM_URL", "TFSN_AGENT_METRICS_PORT", "TFSN_WORKDIR"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "train.py").write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                       "raise RuntimeError('boom at step 3')\n")
    agent = Agent(ControllerClient("http://127.0.0.1:9", "token", 1, timeout=0.2), "fail-0")
    agent._start({"nnodes": 1, "node_rank": 0, "nproc_per_node": 1, "master_addr": "127.0.0.1",
                  "master_port": free_port(), "run": "python train.py", "attempt": 1,
                  "workdir": str(tmp_path), "env": {"TFSN_NODE_ID": "fail-0", "TFSN_ATTEMPT": "1", "PYTHONPATH": ROOT}})
    try:
        wait_for(lambda: agent.proc.poll() is not None, 60, "the worker's failure")
        agent._collect()
    finally:
        agent.stop_workers()
    lines = list(agent.logs.tail)
    assert "[rank0]: RuntimeError: boom at step 3" in lines, lines
    assert not [line for line in lines if "[rank0]: [rank0]:" in line], lines
    assert [line for line in lines if "Traceback" in line] == ["[rank0]: Traceback (most recent call last):"], lines
    assert any("Root Cause" in line for line in lines), lines        # torchrun's summary block stays
    assert agent.reports[0]["summary"] == "[rank0]: RuntimeError: boom at step 3 (at train.py:3)"


def report_of_one_worker(tmp_path, monkeypatch, run: str) -> dict:
    """The report a real agent makes of one torchrun worker running `run` to its end."""
    for name in ("TFSN_DCGM_URL", "TFSN_AGENT_METRICS_PORT", "TFSN_WORKDIR"):
        monkeypatch.delenv(name, raising=False)
    agent = Agent(ControllerClient("http://127.0.0.1:9", "token", 1, timeout=0.2), "one-0")
    agent._start({"nnodes": 1, "node_rank": 0, "nproc_per_node": 1, "master_addr": "127.0.0.1",
                  "master_port": free_port(), "run": run, "attempt": 1, "workdir": str(tmp_path),
                  "env": {"TFSN_NODE_ID": "one-0", "TFSN_ATTEMPT": "1"}})
    try:
        wait_for(lambda: agent.proc.poll() is not None, 60, "the worker's end")
        agent._collect()
    finally:
        agent.stop_workers()
    return agent.reports[0]


def test_a_worker_killed_under_a_shell_of_the_users_is_reported_killed_by_its_signal(tmp_path, monkeypatch):
    """A `run` that bash does not exec (`python train.py && ...`, a script of commands) ends with bash's code 128+N
    when the OOM killer or a kill -9 takes the Python process: it was reported as "workers exited with code 137",
    an application error, where the same kill of `run: python train.py` fails the node and replaces it."""
    report = report_of_one_worker(tmp_path, monkeypatch,
                                  "python -c 'import os; os.kill(os.getpid(), 9)' && echo trained")
    assert report["signal"] == 9, report
    assert report["summary"].startswith("a worker was killed by SIGKILL"), report


def test_a_script_that_exits_128_plus_n_itself_is_an_application_error_not_a_signal(tmp_path, monkeypatch):
    """bash's 128+N is a signal only where bash reported the kill ("line 1: 4242 Killed  python train.py"): a
    script's own sys.exit(137) was read as SIGKILL, its node failed and replaced at every restart, and the same
    error twice never ended the job."""
    report = report_of_one_worker(tmp_path, monkeypatch, "python -c 'import sys; sys.exit(137)' && echo trained")
    assert report["signal"] is None, report
    assert report["summary"] == "workers exited with code 137", report


def test_torchruns_exit_barrier_error_is_one_line(capsys):
    """A node whose workers finished waits for its peers at torchrun's exit barrier; a peer that never came was
    logged with `logger.exception`, a traceback through store_util in the job log."""
    import logging

    from orchestrator.agent.torchrun import EXIT_BARRIER_LOGGER, OneLine
    logger = logging.getLogger(EXIT_BARRIER_LOGGER)
    handler = logging.StreamHandler()
    logger.addHandler(handler)
    logger.addFilter(one_line := OneLine())
    try:
        try:
            raise RuntimeError("Socket Timeout\n  waiting for 1 of 2")
        except RuntimeError:
            logger.exception("Error waiting on exit barrier. Elapsed: %s seconds", 300.2)
    finally:
        logger.removeFilter(one_line)
        logger.removeHandler(handler)
    lines = capsys.readouterr().err.splitlines()   # ours, and torch's own handler's (glog-style) when it has one
    assert lines and all(line.endswith("Error waiting on exit barrier. Elapsed: 300.2 seconds: "
                                       "RuntimeError: Socket Timeout waiting for 1 of 2") for line in lines), lines


@pytest.mark.parametrize("users", [None, "INFO"])
def test_torchruns_own_cpp_warnings_are_off_and_the_workers_level_is_theirs(tmp_path, users):
    """A 2-node job that succeeded ended its log with torchrun's C++ warning of a store closed by the node that
    hosts it ('[W... TCPStore.cpp:138] recvValueWithTimeout failed ... Exception raised from recvBytes', then 35
    lines 'frame #N: c10::Error::Error ...'): the exit barrier's last read races that node's exit. torchrun runs
    with TORCH_CPP_LOG_LEVEL=ERROR; its workers keep the level they were given, or none."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    if users:
        env["TORCH_CPP_LOG_LEVEL"] = users
    out = subprocess.run([sys.executable, "-m", "orchestrator.agent.torchrun", "--nnodes", "1", "--nproc-per-node",
                          "1", "--master-port", str(free_port()), "--no-python", "bash", "-c",
                          "echo level=${TORCH_CPP_LOG_LEVEL-unset}"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and f"level={users or 'unset'}" in out.stdout, out.stdout + out.stderr


def test_a_package_of_the_users_named_orchestrator_does_not_replace_the_torchrun_wrapper(tmp_path):
    """The agent ran `python -m orchestrator.agent.torchrun` in the user's workdir, where -m looks first: a project
    with its own `orchestrator` package (a name users pick) ran that instead, and no attempt could start."""
    import subprocess
    from orchestrator.agent import node
    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "orchestrator" / "__init__.py").write_text("raise ImportError('the user\'s own orchestrator')\n")
    cmd = {"nnodes": 1, "node_rank": 0, "nproc_per_node": 1, "master_addr": "127.0.0.1", "master_port": free_port(),
           "run": "echo worker ran"}
    out = subprocess.run(node.torchrun_command(cmd), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "worker ran" in out.stdout, out.stdout + out.stderr


def test_a_flooding_worker_stops_at_the_nodes_log_cap_and_its_lines_still_go_to_the_job(monkeypatch, capsys):
    """The agent copied every line to its stdout (a local node's log file in TFSN_HOME, a VM's boot log) with no
    bound, while the job's log stops at 4 GiB: a worker printing without end filled the disk through that copy."""
    from orchestrator.agent import node
    monkeypatch.setattr(node, "MAX_PRINTED_BYTES", 1000)
    shipper = node.LogShipper(ControllerClient("http://127.0.0.1:9", "token", 1, timeout=0.2), "flood-0")
    for i in range(100):
        shipper.add(f"[rank0]: line {i:03d} " + "x" * 80)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 11 and printed[-1].startswith("[tfsn] node flood-0: this node's own log passed "), printed
    assert sum(len(line) + 1 for line in printed[:-1]) < 1000
    assert len(shipper._pending) == 100                     # every line is still sent to the job's log



def test_lines_a_flood_dropped_before_they_were_sent_leave_a_mark_in_the_jobs_log(monkeypatch):
    """A worker printed 400,000 lines in a burst: the agent's buffer (20,000 lines) dropped the oldest unsent ones, and
    the job's log went from line 1999 to 21514 to 67470 ... with nothing said, while the node's own log says the
    job's log has every line. Each gap is now marked where it is, with its size; lines dropped while their post is in
    flight were sent, and leave none."""
    import threading

    from orchestrator.agent import node
    posted: list[str] = []
    in_flight = threading.Event()
    resume = threading.Event()

    class Recorder(ControllerClient):
        def post(self, path, body, timeout=None):
            in_flight.set()
            resume.wait(5)
            posted.extend(body["lines"])
            return {}
    monkeypatch.setattr(node.LogShipper, "_loop", lambda self: None)
    shipper = node.LogShipper(Recorder("http://127.0.0.1:9", "token", 1), "burst-0", max_buffer=10)
    for i in range(25):
        shipper.add(f"line {i}")
    resume.set()
    shipper.flush()
    lost = "[tfsn] node burst-0: {} lines of output dropped here (printed faster than they could be sent)"
    assert posted == [lost.format(15)] + [f"line {i}" for i in range(15, 25)]
    posted.clear()
    resume.clear()
    flushing = threading.Thread(target=shipper.flush)
    for i in range(25, 30):
        shipper.add(f"line {i}")
    flushing.start()
    in_flight.wait(5)
    for i in range(30, 42):        # 12 more: 5 fill the buffer, then the 5 in flight and 2 unsent go
        shipper.add(f"line {i}")
    resume.set()
    flushing.join()
    shipper.flush()
    assert posted == [f"line {i}" for i in range(25, 30)] + [lost.format(2)] + [f"line {i}" for i in range(32, 42)]


def test_the_nodes_log_cap_counts_bytes_not_characters(monkeypatch, capsys):
    """The cap counted characters: a worker's tqdm bars ('█', 3 bytes in UTF-8) wrote 3 x the cap to the disk."""
    from orchestrator.agent import node
    monkeypatch.setattr(node, "MAX_PRINTED_BYTES", 1000)
    shipper = node.LogShipper(ControllerClient("http://127.0.0.1:9", "token", 1, timeout=0.2), "bars-0")
    for _ in range(100):
        shipper.add("[rank0]: " + "█" * 80)
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("[tfsn] node bars-0: this node's own log passed "), printed
    assert sum(len(line.encode()) + 1 for line in printed[:-1]) < 1000


def test_the_agents_last_flush_beside_the_background_one_sends_each_line_once(monkeypatch):
    """The agent flushes its lines at exit while its background thread flushes every 0.5 s: both took the same
    pending lines and posted them ('node X: attempt 2 ended with code 0' twice in the job's log), then both removed
    as many, the second removing lines that had not been sent."""
    import threading

    from orchestrator.agent import node
    posted: list[str] = []
    entered = threading.Barrier(2, timeout=2)

    class Slow(ControllerClient):
        def post(self, path, body, timeout=None):
            try:
                entered.wait()        # a second flush gets here while the first one's post is in flight
            except threading.BrokenBarrierError:
                pass
            posted.extend(body["lines"])
            return {}
    monkeypatch.setattr(node.LogShipper, "_loop", lambda self: None)     # the two flushes are the test's own
    shipper = node.LogShipper(Slow("http://127.0.0.1:9", "token", 1), "twice-0")
    for line in ("[rank0]: done", "[tfsn] node twice-0: attempt 2 ended with code 0"):
        shipper.add(line)
    flushes = [threading.Thread(target=shipper.flush) for _ in range(2)]
    for thread in flushes:
        thread.start()
    shipper.add("[tfsn] node twice-0: a line added meanwhile")
    for thread in flushes:
        thread.join()
    shipper.flush()
    assert posted == ["[rank0]: done", "[tfsn] node twice-0: attempt 2 ended with code 0",
                      "[tfsn] node twice-0: a line added meanwhile"]


@pytest.mark.parametrize("script, summary", [
    ("echo installing deps; false", "setup exited with code 1; its last lines: installing deps"),
    ("exit 3", "setup exited with code 3"),
])
def test_a_failed_setup_is_summed_up_with_its_exit_code_and_last_lines(tmp_path, monkeypatch, script, summary):
    """'job 1 FAILED: setup failed on node b2-1-n0-81b1: [setup] installing deps' read as if installing failed
    with no error: a command that fails silently after an echo left only the echo, and never the exit code."""
    for name in ("TFSN_DCGM_URL", "TFSN_AGENT_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)
    agent = Agent(ControllerClient("http://127.0.0.1:9", "token", 1, timeout=0.2), "setup-0")
    agent._setup(script, str(tmp_path))
    wait_for(lambda: agent.state != "setup", 30, "the setup's end")
    assert agent.state == "setup-failed" and agent.reports[0]["summary"] == summary


def test_the_agent_heartbeats_while_its_workers_take_their_grace_to_stop(tmp_path, monkeypatch):
    """Told to stop (another rank failed), the agent waited for its workers inside its loop: up to its whole stop
    grace (10 s) without a heartbeat when they outlive SIGTERM (a script that saves on SIGTERM, a worker blocked in a
    collective whose Python handler cannot run). A healthy node was failed for that silence under a heartbeat_timeout
    that `tfsn validate` calls safe, and replaced; its agent now heartbeats every second while the workers stop."""
    from orchestrator.agent import node
    for name in ("TFSN_DCGM_URL", "TFSN_AGENT_METRICS_PORT", "TFSN_WORKDIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(node, "STOP_GRACE_S", 4.0)
    run = {"action": "run", "attempt": 1}
    command = {"nnodes": 1, "node_rank": 0, "nproc_per_node": 1, "master_addr": "127.0.0.1",
               "master_port": free_port(), "run": "trap '' TERM; echo armed; sleep 120", "workdir": str(tmp_path),
               "env": {"TFSN_NODE_ID": "slow-stop-0", "TFSN_ATTEMPT": "1"}}
    told: list[dict] = [run]          # what each heartbeat answers, the last one for good
    beats: list[float] = []
    results: list[dict] = []

    class Controller(ControllerClient):
        def post(self, path, body, timeout=None):
            if path.endswith("/heartbeat"):
                beats.append(time.monotonic())
                return told[-1]
            if path.endswith("/attempt"):
                return {**run, **command}
            if path.endswith("/result"):
                results.append(body)
            return {}
    agent = Agent(Controller("http://127.0.0.1:9", "token", 1), "slow-stop-0")
    loop = threading.Thread(target=agent.run, daemon=True)
    loop.start()
    try:
        wait_for(lambda: "[rank0]: armed" in agent.logs.tail, 60, "the worker to start")
        stop_told = time.monotonic()
        told.append({"action": "idle"})
        wait_for(lambda: results, 30, "the stopped attempt's report")
        stopped = time.monotonic()
        told.append({"action": "exit"})
        loop.join(10)
    finally:
        agent.stop_workers()
    assert not loop.is_alive()
    assert results[0]["attempt"] == 1 and results[0]["stopped"], results
    assert stopped - stop_told >= node.STOP_GRACE_S        # the workers did outlive SIGTERM
    during = [stop_told] + [t for t in beats if stop_told <= t <= stopped] + [stopped]
    assert max(b - a for a, b in zip(during, during[1:])) < 2.5, "the agent went silent while its workers stopped"
    assert not pids_with_env(TFSN_NODE_ID="slow-stop-0"), "a worker outlived the stop"


def test_the_lines_an_agent_still_holds_when_its_node_is_terminated_reach_the_jobs_log(tmp_path):
    """A job's end tears its nodes down (the local provider SIGTERMs each node's processes, again every 0.1 s, and
    SIGKILLs them after its grace): the agent exited at the first SIGTERM with the lines it had not posted yet, so
    that every successful job's log lacked its nodes' last lines ('attempt 1 ended with code 0', and what the
    workers printed in their last half second: a script's final results). It now sends what it holds first."""
    import http.server
    import json
    import os

    from providers.base import NodeRequest
    from providers.local import LocalProvider
    node_id, lines, received, hold = "held-0", 3000, [], threading.Event()
    hold.set()

    class FakeController(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path.endswith("/logs") and hold.is_set():
                self.send_response(503)             # a controller busy for now: the agent keeps the lines
                self.end_headers()
                return
            if self.path.endswith("/logs"):
                received.extend(body["lines"])
            answer = {"action": "setup", "setup": f"seq {lines}", "workdir": str(tmp_path)} \
                if self.path.endswith("/heartbeat") and body.get("state") == "starting" else {"action": "idle"}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeController)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, "PYTHONPATH": ROOT, "TFSN_CONTROLLER_URL": f"http://127.0.0.1:{server.server_port}",
           "TFSN_TOKEN": "token", "TFSN_JOB_ID": "1", "TFSN_NODE_ID": node_id}
    for name in ("TFSN_DCGM_URL", "TFSN_AGENT_METRICS_PORT", "TFSN_WORKDIR"):
        env.pop(name, None)
    provider = LocalProvider()
    handle = provider.provision(NodeRequest(job_id="1", node_id=node_id, command=[sys.executable, "-m",
                                "orchestrator.agent"], env=env, workdir=ROOT, log_path=str(tmp_path / "node.log")))
    try:
        wait_for(lambda: f"[setup] {lines}" in (tmp_path / "node.log").read_text(), 60, "the setup's lines")
        hold.clear()                                 # the controller takes lines again as the node is torn down
        provider.terminate(handle)
    finally:
        server.shutdown()
    assert [line for line in received if line.startswith("[setup]")] == [f"[setup] {i}" for i in range(1, lines + 1)]
