"""The node agent and its workers, without a controller (its posts go nowhere and are kept for later)."""
from __future__ import annotations

from orchestrator.agent.node import Agent
from orchestrator.sdk.client import ControllerClient
from tests.awsfaults import free_port
from tests.vmsandbox import wait_for


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
