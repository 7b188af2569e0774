"""The job store: what the controller relies on to survive a restart."""
from __future__ import annotations

import pytest

from orchestrator.control.store import JobState, NodeState, Store, StoreError


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


def old_store(db, rest: str) -> None:
    """A store as an older tfsn made it: the first release's jobs columns, then `rest` (the later
    columns that older tfsn had, the closing parenthesis, other tables and rows)."""
    import sqlite3

    old = sqlite3.connect(db)
    old.executescript("""
        CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, state TEXT NOT NULL,
            spec TEXT NOT NULL, spec_path TEXT NOT NULL, token TEXT NOT NULL, created_at REAL NOT NULL,
            updated_at REAL NOT NULL, attempt INTEGER NOT NULL DEFAULT 0, attempt_state TEXT NOT NULL DEFAULT 'idle',
            attempt_changed_at REAL NOT NULL DEFAULT 0, attempt_started_at REAL NOT NULL DEFAULT 0,
            master_port INTEGER NOT NULL DEFAULT 0, restarts INTEGER NOT NULL DEFAULT 0,
            stop_requested INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '',
            last_failure TEXT NOT NULL DEFAULT '', step INTEGER NOT NULL DEFAULT 0, loss REAL, step_time REAL,
            restored_step INTEGER, checkpoint_step INTEGER, checkpoint_path TEXT NOT NULL DEFAULT '',
            finished_at REAL""" + rest)
    old.commit()
    old.close()


def test_a_store_from_before_the_planner_opens_with_its_jobs_and_nodes(db):
    old_store(db, """, checkpoint_at REAL NOT NULL DEFAULT 0, checkpoint_request REAL NOT NULL DEFAULT 0,
            pending_replace TEXT NOT NULL DEFAULT '', pending_reason TEXT NOT NULL DEFAULT '');
        CREATE TABLE nodes (id TEXT PRIMARY KEY, job_id INTEGER NOT NULL, rank INTEGER, provider TEXT NOT NULL,
            state TEXT NOT NULL, handle TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL,
            heartbeat_at REAL, agent_state TEXT NOT NULL DEFAULT '', failure TEXT NOT NULL DEFAULT '');
        INSERT INTO jobs (name, state, spec, spec_path, token, created_at, updated_at)
            VALUES ('old', 'RUNNING', '{"name": "old"}', '/x.yaml', 't', 1, 1);
        INSERT INTO nodes (id, job_id, rank, provider, state, created_at, updated_at)
            VALUES ('old-1-n0', 1, 0, 'local', 'READY', 1, 1);
    """)
    store = Store(db)
    job = store.job(1)
    assert job.state == JobState.RUNNING and job.plan == [] and job.blocked == []
    node = store.nodes(1)[0]
    assert node.state == NodeState.READY and node.offer is None and node.spot is False
    store.update_job(1, blocked=[{"scope": "zone", "zone": "us-east-1a"}])
    store.add_node("old-1-n1", 1, 1, "aws", offer={"zone": "us-east-1b"}, spot=True)
    assert store.job(1).blocked == [{"scope": "zone", "zone": "us-east-1a"}]
    assert store.node("old-1-n1").offer == {"zone": "us-east-1b"} and store.node("old-1-n1").spot is True


def test_a_store_from_before_checkpoint_requests_opens_and_launches(db):
    """A store made before the checkpoint and replacement columns (one was on this very machine's
    ~/.tfsn): every column of the schema it lacks is added, none listed by hand."""
    old_store(db, """, plan TEXT NOT NULL DEFAULT '[]', blocked TEXT NOT NULL DEFAULT '[]',
            health TEXT NOT NULL DEFAULT '{}');
        INSERT INTO jobs (name, state, spec, spec_path, token, created_at, updated_at)
            VALUES ('old', 'SUCCEEDED', '{"name": "old"}', '/x.yaml', 't', 1, 1);
    """)
    store = Store(db)
    job = store.job(1)
    assert job.state == JobState.SUCCEEDED and job.checkpoint_at == 0 and job.checkpoint_request == 0
    new = store.create_job("new", {"name": "new"}, "/y.yaml", "t2")
    store.update_job(new.id, checkpoint_at=5.0)
    assert store.job(new.id).checkpoint_at == 5.0 and [j.name for j in store.jobs()] == ["old", "new"]


def test_reserved_job_ids_are_never_given_to_a_new_job_and_a_reservation_never_lowers_them(db):
    """An operator restoring jobs from TfsnJobs reserves their ids first: a job admitted meanwhile
    must not take an id a job still to be restored holds."""
    store = Store(db)
    store.reserve_job_ids(7)                   # an empty store: the first job would have been id 1
    assert store.create_job("a", {}, "/a", "t").id == 8
    store.reserve_job_ids(3)                   # below what was given out: no effect
    assert store.create_job("b", {}, "/b", "t").id == 9
    store.close()
    assert Store(db).create_job("c", {}, "/c", "t").id == 10   # kept across a reopen
