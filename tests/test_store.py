"""The job store: what the controller relies on to survive a restart."""
from __future__ import annotations

import pytest

from orchestrator.store import JobState, NodeState, Store, StoreError


@pytest.fixture
def db(tmp_path):
    return tmp_path / "tfsn.db"


def test_jobs_nodes_and_events_persist_across_reopen(db):
    store = Store(db)
    job = store.create_job("tiny", {"name": "tiny", "run": "true"}, "/x/train.yaml", "secret")
    store.transition(job.id, JobState.PROVISIONING, "2 nodes")
    store.add_node("tiny-1-n0", job.id, 0, "local")
    store.update_node("tiny-1-n0", state=NodeState.STARTING, handle={"provider": "local", "node_id": "tiny-1-n0",
                                                                     "data": {"pid": 42}})
    store.record_result(job.id, "tiny-1-n0", 1, -9, 9, False, "killed")
    store.record_result(job.id, "tiny-1-n0", 1, 0, None, False, "retried report is ignored")
    store.record_steps(job.id, 1, 0, [{"step": 0, "at": 1.0, "step_time": 0.5, "metrics": {"loss": 3.0}},
                                      {"step": 1, "at": 2.0, "step_time": 0.3, "metrics": {"loss": 2.5}}])
    store.close()

    again = Store(db)  # what a restarted controller sees
    job = again.job(job.id)
    assert job.state == JobState.PROVISIONING and job.token == "secret" and job.spec["name"] == "tiny"
    assert job.step == 1 and job.loss == 2.5 and job.step_time == pytest.approx(0.4)
    node = again.nodes(job.id)[0]
    assert node.state == NodeState.STARTING and node.handle["data"]["pid"] == 42 and node.rank == 0
    [result] = again.results(job.id, 1)
    assert (result.returncode, result.signal, result.summary) == (-9, 9, "killed")
    assert [e.message for e in again.events(job.id)] == ["PENDING", "PROVISIONING: 2 nodes"]
    assert [r["step"] for r in again.steps(job.id)] == [0, 1]
    assert again.find_job("tiny").id == job.id == again.find_job(str(job.id)).id


def test_forbidden_transitions_are_refused(db):
    store = Store(db)
    job = store.create_job("a", {}, "p", "t")
    with pytest.raises(StoreError, match="PENDING -> SUCCEEDED"):
        store.transition(job.id, JobState.SUCCEEDED)
    store.transition(job.id, JobState.STOPPED, "by user")
    assert store.job(job.id).finished_at is not None
    with pytest.raises(StoreError, match="STOPPED -> RUNNING"):
        store.transition(job.id, JobState.RUNNING)
    assert store.jobs(active_only=True) == []


def test_unknown_job_is_a_clear_error(db):
    store = Store(db)
    with pytest.raises(StoreError, match="no job with id or name 'nope'"):
        store.find_job("nope")


def test_two_connections_see_each_others_writes(db):
    controller, cli = Store(db), Store(db)
    job = cli.create_job("a", {}, "p", "t")
    cli.request_stop(job.id)
    assert controller.job(job.id).stop_requested == 1


def test_promote_node_only_from_the_expected_state(db):
    store = Store(db)
    job = store.create_job("a", {}, "p", "t")
    store.add_node("n", job.id, 0, "local")
    store.update_node("n", state=NodeState.STARTING)
    store.update_node("n", state=NodeState.FAILED)       # the loop failed it...
    assert not store.promote_node("n", NodeState.STARTING, NodeState.READY)  # ...a late heartbeat can't revive it
    assert store.node("n").state == NodeState.FAILED
