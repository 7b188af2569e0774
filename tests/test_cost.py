"""What a job cost so far and what its plan predicted, from a store whose node times and prices are known."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from orchestrator.control.cost import job_cost
from orchestrator.control.store import JobState, NodeState, Store
from orchestrator.planning.planner import PlannedOffer
from providers.base import Offer

T0 = 1_800_000_000.0   # when the first node was confirmed
AWS = Offer(provider="aws", region="us-east-1", zone="use1-az6", instance_type="p4d.24xlarge", accelerator="A100",
            accelerator_count=8, accelerator_memory_gib=40, vcpus=96, memory_gib=1152, price=4.0, spot_price=1.5)
GCP = Offer(provider="gcp", region="us-central1", zone="us-central1-a", instance_type="a2-highgpu-8g",
            accelerator="A100", accelerator_count=8, accelerator_memory_gib=40, vcpus=96, memory_gib=680, price=3.0)


MODEL = {"params": 1.3e9, "layers": 24, "hidden": 2048, "seq_len": 2048, "batch_size": 256, "dtype": "bf16"}


def plan() -> list[dict]:
    """The planner's ranked candidates as the controller stores them: GCP first, then AWS spot and on-demand."""
    return [PlannedOffer(GCP, False, 2, 3.0, 1.0, 3.0, 18.0).to_record(),
            PlannedOffer(AWS, True, 2, 1.5, 1.2, 3.5, 10.5).to_record(),
            PlannedOffer(AWS, False, 2, 4.0, 1.0, 3.0, 24.0).to_record()]


def node(store: Store, job_id: int, node_id: str, offer: Offer, spot: bool, created: float,
         provisioned: float | None = None, released: float | None = None) -> None:
    store.add_node(node_id, job_id, 0, offer.provider, offer=asdict(offer), spot=spot)
    store.update_node(node_id, created_at=created, provisioned_at=provisioned)
    if released is not None:
        store.update_node(node_id, state=NodeState.TERMINATED, released=True, released_at=released)


@pytest.fixture
def finished_job(tfsn) -> int:
    """A job that ran on AWS after GCP refused it: a node on demand for half an hour, one on spot for two hours."""
    store = Store(tfsn.home / "tfsn.db")
    job = store.create_job("train", {"name": "train", "num_nodes": 2, "steps": 100, "model": MODEL}, "train.yaml",
                           "token")
    store.transition(job.id, JobState.PROVISIONING, plan=plan())
    node(store, job.id, "train-1-n0", GCP, False, created=T0 - 60)                       # refused: never billed
    node(store, job.id, "train-1-n1", AWS, False, created=T0 - 30, provisioned=T0, released=T0 + 1800)
    node(store, job.id, "train-1-n2", AWS, True, created=T0 + 500, provisioned=T0 + 600, released=T0 + 600 + 7200)
    store.transition(job.id, JobState.RUNNING)
    store.transition(job.id, JobState.SUCCEEDED)
    return job.id


def test_status_json_has_node_hours_dollars_spent_and_the_predicted_total(tfsn, finished_job):
    cost = tfsn.status(finished_job)["cost"]
    # 0.5 h at $4.00 on demand + 2 h at $1.50 spot; predicted: the spot candidate the newest node runs on
    assert cost == {"node_hours": 2.5, "spent_usd": 5.0, "predicted_node_hours": 7.0, "predicted_usd": 10.5}
    [listed] = json.loads(tfsn("status", "--json").stdout)
    assert listed["cost"] == cost


def test_the_predicted_node_hours_count_the_spares(tfsn):
    """Spares (recovery.spares) stand by on the chosen offer for the whole run: the plan's cost pays for them."""
    store = Store(tfsn.home / "tfsn.db")
    job = store.create_job("train", {"name": "train", "num_nodes": 2, "steps": 100, "model": MODEL,
                                     "recovery": {"spares": 1}}, "train.yaml", "token")
    store.transition(job.id, JobState.PROVISIONING, plan=[PlannedOffer(GCP, False, 2, 3.0, 1.0, 3.0, 27.0,
                                                                       spares=1).to_record()])
    assert tfsn.status(job.id)["cost"]["predicted_node_hours"] == 9.0     # 3 h x (2 nodes + 1 spare)


def test_a_job_without_model_has_no_prediction_and_says_why(tfsn):
    """Without `model:` the planner ranks offers with its 1.3B-parameter reference workload; its hours were shown
    as the job's prediction ('$0.00 spent of $0.00 predicted (22.94 node-h)' for an 8-step job of a Linear)."""
    store = Store(tfsn.home / "tfsn.db")
    job = store.create_job("train", {"name": "train", "num_nodes": 2, "steps": 8, "model": None}, "train.yaml", "t")
    store.transition(job.id, JobState.PROVISIONING, plan=plan())
    assert tfsn.status(job.id)["cost"]["predicted_usd"] is None
    assert ("cost: 0.00 node-h, $0.00 spent (no prediction: the spec has no model:)"
            in tfsn("status", str(job.id)).stdout)


def test_status_tables_show_the_cost_columns(tfsn, finished_job):
    table = tfsn("status").stdout.splitlines()
    assert table[0].split()[-3:] == ["NODE-H", "SPENT", "PREDICTED"]
    assert table[1].split()[-3:] == ["2.50", "$5.00", "$10.50"]
    assert "cost: 2.50 node-h, $5.00 spent of $10.50 predicted (7.00 node-h)" in tfsn("status", str(finished_job)).stdout


def test_a_node_not_yet_released_is_billed_until_now_and_an_old_store_node_until_its_last_update(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    job = store.create_job("train", {"name": "train", "num_nodes": 1}, "train.yaml", "token")
    node(store, job.id, "running", AWS, False, created=T0, provisioned=T0)
    node(store, job.id, "old", AWS, True, created=T0, provisioned=T0)
    store.update_node("old", released=True)
    with store._tx() as db:   # a node released by a tfsn that had no released_at: its last update ended it
        db.execute("UPDATE nodes SET released_at = NULL, updated_at = ? WHERE id = 'old'", (T0 + 3600,))
    cost = job_cost(store.job(job.id), store.nodes(job.id), now=T0 + 2 * 3600)
    assert (cost.node_hours, cost.spent_usd) == (3.0, 2 * 4.0 + 1 * 1.5)
    assert cost.predicted_usd is None and cost.predicted_node_hours is None   # no plan: nothing predicted


def test_the_first_confirmed_release_ends_the_bill(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    job = store.create_job("train", {"name": "train", "num_nodes": 1}, "train.yaml", "token")
    node(store, job.id, "n0", AWS, False, created=T0, provisioned=T0)
    store.update_node("n0", released=True)
    first = store.node("n0").released_at
    store.update_node("n0", released=True)   # the controller's sweep confirms it again later
    assert first is not None and store.node("n0").released_at == first
