"""Provisioning with failover: the controller walks the plan down when a provider refuses a node.

The providers here are scripted stand-ins for the Provider protocol (no cloud SDK involved): the
drivers' own error mapping is tested against their emulators; this is the controller's side.
"""
from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from collections.abc import Callable

import pytest

from orchestrator.control.controller import Controller
from orchestrator.control.provisioning import TRANSIENT_TRIES
from orchestrator.planning import entry
from orchestrator.spec import JobSpec
from orchestrator.control.store import JobState, NodeState, Store
from providers.base import (AuthError, CapacityError, NodeHandle, NodeRequest, NodeStatus, Offer, ProviderError,
                            QuotaError)
from providers.catalog import CatalogError


URL = "http://10.0.0.5:7000"   # the controller's API as cloud nodes would reach it


def h100(provider: str, region: str, zone: str, price: float) -> Offer:
    return Offer(provider=provider, region=region, zone=zone, instance_type="gpu8", accelerator="H100",
                 accelerator_count=8, accelerator_memory_gib=80.0, vcpus=192.0, memory_gib=2048.0, price=price)


class ScriptedProvider:
    """Offers what it is given; refuses provisioning in the zones it is told to, with the given error."""

    shares_host = False
    status_poll_s = 0.0
    start_timeout_s = 0.0          # the job's heartbeat_timeout decides

    def __init__(self, name: str, offers: list[Offer], refuse: dict[str, ProviderError] | None = None,
                 room: dict[str, int] | None = None) -> None:
        self.name = name
        self._offers = offers
        self.refuse = refuse or {}    # zone -> the error every request there gets
        self.room = room or {}        # zone -> nodes it grants before it answers with a capacity error
        self.created: dict[str, Offer] = {}
        self.terminated: list[str] = []
        self.asked: list[str] = []
        self.pending_zones: set[str] = set()   # nodes created there are never scheduled
        self.requests: list[NodeRequest] = []

    def offers(self) -> list[Offer]:
        return list(self._offers)

    def provision(self, request: NodeRequest) -> NodeHandle:
        self.requests.append(request)
        self.asked.append(request.offer.zone)
        zone = request.offer.zone
        if zone in self.refuse:
            raise self.refuse[zone]
        if zone in self.room:
            if self.room[zone] == 0:
                raise CapacityError(f"InsufficientInstanceCapacity in {zone}", provider=self.name)
            self.room[zone] -= 1
        self.created[request.node_id] = request.offer
        return NodeHandle(self.name, request.node_id, {"zone": request.offer.zone})

    def status(self, handle: NodeHandle) -> NodeStatus:
        if handle.node_id in self.terminated:
            return NodeStatus.TERMINATED
        return NodeStatus.PENDING if handle.data["zone"] in self.pending_zones else NodeStatus.RUNNING

    def terminate(self, handle: NodeHandle) -> None:
        self.terminated.append(handle.node_id)


def submit(store: Store, tmp_path, num_nodes: int, **fields) -> int:
    spec = JobSpec.model_validate({"name": "big", "run": "true", "workdir": str(tmp_path), "num_nodes": num_nodes,
                                   "steps": 1000, "resources": {"accelerators": "H100:8", "infra": ["aws", "gcp"]},
                                   **fields})
    return store.create_job("big", spec.model_dump(mode="json"), "train.yaml", "t").id


def reconcile(controller: Controller, job_id: int, times: int = 4) -> None:
    for _ in range(times):
        if controller.store.job(job_id).state.terminal:
            return
        controller.reconcile(job_id)


def backoff_passed(controller: Controller, job_id: int) -> None:
    """The waits after the job's last transient errors (a create's, a plan's) are over (their counts stay)."""
    backoff = controller.provisioner.backoff
    for key in [key for key in backoff if key[0] == job_id]:
        backoff[key] = (backoff[key][0], 0.0)


def test_capacity_error_moves_the_job_to_the_next_zone_with_all_its_nodes(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    # us-east-1a is the cheapest; it gives one node, then runs out
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0),
                                   h100("aws", "us-east-1", "us-east-1b", 95.0)], room={"us-east-1a": 1})
    gcp = ScriptedProvider("gcp", [h100("gcp", "us-central1", "us-central1-a", 99.0)])
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": gcp}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=2)
    reconcile(controller, job_id)

    active = store.nodes(job_id, active_only=True)
    assert {n.offer["zone"] for n in active} == {"us-east-1b"} and len(active) == 2
    first = store.nodes(job_id)[0]
    assert first.state == NodeState.TERMINATED and first.id in aws.terminated, "moved with the job, not leaked"
    assert store.job(job_id).blocked[0]["scope"] == "zone"
    events = [e.message for e in store.events(job_id)]
    assert any("could not be created on aws/us-east-1a" in m and "next: aws/us-east-1b" in m for m in events), events
    assert gcp.asked == [], "a zone out of capacity does not rule out the rest of its region"


def test_quota_blocks_the_region_and_no_candidate_left_fails_the_job_with_the_history(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0),
                                   h100("aws", "us-east-1", "us-east-1b", 91.0)],
                           refuse={"us-east-1a": QuotaError("VcpuLimitExceeded", provider="aws")})
    gcp = ScriptedProvider("gcp", [h100("gcp", "us-central1", "us-central1-a", 99.0)],
                           refuse={"us-central1-a": CapacityError("ZONE_RESOURCE_POOL_EXHAUSTED", provider="gcp")})
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": gcp}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=1)
    reconcile(controller, job_id, times=6)

    job = store.job(job_id)
    assert job.state == JobState.FAILED
    assert aws.asked == ["us-east-1a"], "a quota error rules out the whole region, us-east-1b included"
    assert gcp.asked == ["us-central1-a"]
    assert "VcpuLimitExceeded" in job.error and "ZONE_RESOURCE_POOL_EXHAUSTED" in job.error
    assert "To fix" in job.error


def test_the_plan_and_blocks_survive_a_controller_restart(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    offers = [h100("aws", "us-east-1", "us-east-1a", 90.0), h100("aws", "us-east-1", "us-east-1b", 95.0)]
    aws = ScriptedProvider("aws", offers, refuse={"us-east-1a": CapacityError("no capacity", provider="aws")})
    job_id = submit(store, tmp_path, num_nodes=1)
    Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL).reconcile(job_id)
    assert store.job(job_id).state == JobState.PROVISIONING

    again = ScriptedProvider("aws", offers)   # a new controller; us-east-1a would have capacity again
    controller = Controller(store, tmp_path, {"aws": again, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    reconcile(controller, job_id)
    assert again.asked == ["us-east-1b"], "the block recorded before the restart still holds"
    assert store.job(job_id).plan[0]["zone"] == "us-east-1a", "the plan is the one made at submission"


def test_a_node_that_is_never_scheduled_counts_as_no_capacity_there(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0),
                                   h100("aws", "us-east-1", "us-east-1b", 95.0)])
    aws.pending_zones.add("us-east-1a")        # e.g. a Kubernetes pool with no free GPUs: the pod stays Pending
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=1, health={"heartbeat_timeout": "1s"})
    controller.reconcile(job_id)
    time.sleep(1.2)
    reconcile(controller, job_id)

    first, second = store.nodes(job_id)
    assert first.state == NodeState.FAILED and "no heartbeat within" in first.failure
    assert store.job(job_id).blocked[0]["scope"] == "offer" and "still pending" in store.job(job_id).blocked[0]["error"]
    assert second.state == NodeState.STARTING and second.offer["zone"] == "us-east-1b"


def test_a_node_replaced_by_the_health_policy_keeps_its_machine_out_of_the_job(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    job_id = submit(store, tmp_path, num_nodes=1)
    Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL).reconcile(job_id)
    (node,) = store.nodes(job_id)
    assert aws.requests[0].avoid_hosts == ()
    # its agent said which machine it is on; the policy replaced it (a straggler), then the controller restarted
    store.update_node(node.id, host="gpu-host-7", state=NodeState.FAILED, failure="straggler")
    store.update_job(job_id, health={"excluded": [node.id]})

    Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL).reconcile(job_id)
    assert len(aws.requests) == 2 and aws.requests[1].avoid_hosts == ("gpu-host-7",)


def test_cloud_nodes_are_not_requested_while_the_controller_listens_on_loopback_only(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    job_id = submit(store, tmp_path, num_nodes=1)
    reconcile(Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])},
                         url="http://127.0.0.1:7000"), job_id)
    job = store.job(job_id)
    assert job.state == JobState.FAILED and aws.asked == []
    assert "TFSN_API_HOST" in job.error and "127.0.0.1" in job.error


def test_a_remote_node_gets_its_own_python_and_none_of_this_machines_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-ship")
    monkeypatch.setenv("TFSN_INSTALL_SPEC", "tfsn==0.1.0")
    store = Store(tmp_path / "tfsn.db")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL).reconcile(
        submit(store, tmp_path, num_nodes=1))
    (request,) = aws.requests
    assert request.command[0] == "python3" and "AWS_SECRET_ACCESS_KEY" not in request.env
    assert "PATH" not in request.env and request.env["TFSN_INSTALL_SPEC"] == "tfsn==0.1.0"
    assert request.env["TFSN_CONTROLLER_URL"] == URL and request.env["TFSN_TOKEN"]


def test_a_spare_that_cannot_be_placed_with_the_ranks_does_not_move_them(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0),
                                   h100("aws", "us-east-1", "us-east-1b", 95.0)], room={"us-east-1a": 2})
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=2, recovery={"spares": 1})
    reconcile(controller, job_id)
    ranked = [n for n in store.nodes(job_id, active_only=True) if n.rank is not None]
    assert len(ranked) == 2 and {n.offer["zone"] for n in ranked} == {"us-east-1a"}
    assert not [n for n in store.nodes(job_id, active_only=True) if n.rank is None], "no spare elsewhere"
    assert not {n.id for n in ranked} & set(aws.terminated), "the ranks stay where they are"


def test_a_node_whose_termination_failed_is_terminated_again_until_the_provider_confirms(tmp_path, monkeypatch):
    import orchestrator.control.nodes as nodes_module

    class FlakyDelete(ScriptedProvider):
        def terminate(self, handle: NodeHandle) -> None:
            if len(self.terminated) < 2:
                self.terminated.append("refused")
                raise ProviderError("RequestLimitExceeded", provider=self.name)
            super().terminate(handle)

    monkeypatch.setattr(nodes_module, "RELEASE_RETRY_S", 0.0)
    store = Store(tmp_path / "tfsn.db")
    aws = FlakyDelete("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=1)
    controller.reconcile(job_id)
    store.request_stop(job_id)
    controller.reconcile(job_id)                       # teardown: the delete is refused
    (node,) = store.nodes(job_id)
    assert node.state == NodeState.TERMINATED and not node.released
    assert [n.id for n in store.unreleased_nodes()] == [node.id]
    with controller.calls.waiting():                         # each delete waited for, as `reconcile` does
        controller.nodes.sweep_releases()                    # refused again
        controller.nodes.sweep_releases()                    # done
    assert aws.terminated == ["refused", "refused", node.id] and store.node(node.id).released
    assert store.unreleased_nodes() == []


def test_a_throttled_request_is_retried_after_a_backoff_not_blocked(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    throttled = ProviderError("RequestLimitExceeded: Request limit exceeded.", provider="aws")
    throttled.retryable = True
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0),
                                   h100("aws", "us-east-1", "us-east-1b", 95.0)],
                           refuse={"us-east-1a": throttled})
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=1)
    controller.reconcile(job_id)
    controller.reconcile(job_id)                       # within the backoff: no new request
    assert aws.asked == ["us-east-1a"] and store.job(job_id).blocked == []
    del aws.refuse["us-east-1a"]                       # the throttling is over
    backoff_passed(controller, job_id)
    controller.reconcile(job_id)
    assert aws.asked == ["us-east-1a", "us-east-1a"]
    assert [n.offer["zone"] for n in store.nodes(job_id, active_only=True)] == ["us-east-1a"]


def test_a_multi_node_cloud_job_does_not_start_without_rank_0s_address(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=2)
    controller.reconcile(job_id)
    first, second = store.nodes(job_id)
    controller.handlers.heartbeat(job_id, first.id, {"state": "ready"})                        # no address reported
    controller.handlers.heartbeat(job_id, second.id, {"state": "ready", "addr": "10.0.1.7"})
    controller.reconcile(job_id)
    assert store.job(job_id).attempt == 0, "no attempt whose workers would meet on loopback"
    assert store.node(first.id).state == NodeState.FAILED and "address" in store.node(first.id).failure


def test_a_job_that_ends_drops_its_health_watch_even_when_its_last_log_line_cannot_be_written(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    refused = CapacityError("InsufficientInstanceCapacity", provider="aws")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0), h100("aws", "us-east-1", "us-east-1b",
                                                                                     95.0)],
                           refuse={"us-east-1a": refused, "us-east-1b": refused})
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=1)
    controller.reconcile(job_id)                      # the node is refused in 1a; the job's watch exists by now
    assert controller.health.existing(job_id) is not None
    log = tmp_path / "jobs" / str(job_id) / "job.log"
    log.unlink()
    log.mkdir()                                       # the job log cannot be written any more
    try:
        reconcile(controller, job_id)                 # refused in 1b, no candidate left: FAILED, its log line fails
    except OSError:
        pass
    assert store.job(job_id).state == JobState.FAILED
    assert controller.health.existing(job_id) is None, "a job that ended kept its watch and metric series"


def test_a_stop_interrupts_provisioning_between_two_nodes_and_releases_every_node(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=200)
    create = aws.provision

    def create_then_stop(request: NodeRequest) -> NodeHandle:   # `tfsn stop` while the third node is created
        handle = create(request)
        if len(aws.created) == 3:
            store.request_stop(job_id)
        return handle

    aws.provision = create_then_stop
    controller.reconcile(job_id)
    assert len(aws.created) == 3, "provisioning goes on no further than the node under way when stop came"
    controller.reconcile(job_id)
    assert store.job(job_id).state == JobState.STOPPED
    assert sorted(aws.terminated) == sorted(aws.created)
    assert all(n.state == NodeState.TERMINATED and n.released for n in store.nodes(job_id))


def test_one_pass_of_the_loop_creates_a_bounded_number_of_a_jobs_nodes(tmp_path):
    """A 200-node job takes its nodes over several passes, so that another job's stop is seen between them."""
    from orchestrator.control.provisioning import CREATES_PER_PASS
    store = Store(tmp_path / "tfsn.db")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    big, small = submit(store, tmp_path, num_nodes=200), submit(store, tmp_path, num_nodes=1)
    controller.reconcile(big)
    assert len(aws.created) == CREATES_PER_PASS
    store.request_stop(small)
    controller.reconcile(small)
    assert store.job(small).state == JobState.STOPPED
    reconcile(controller, big, times=200 // CREATES_PER_PASS + 1)
    assert len(store.nodes(big)) == 200


def test_nproc_auto_is_one_worker_per_accelerator_of_the_offer_chosen_not_of_the_first_choice(tmp_path):
    """accelerators [H100:8, L4:4] with no H100 to be had: the planner picks L4:4, so 4 workers a node, not 8."""
    store = Store(tmp_path / "tfsn.db")
    l4 = Offer(provider="aws", region="us-east-1", zone="us-east-1a", instance_type="g6.12xlarge", accelerator="L4",
               accelerator_count=4, accelerator_memory_gib=24.0, vcpus=48.0, memory_gib=192.0, price=4.6)
    aws = ScriptedProvider("aws", [l4])
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=2, resources={"accelerators": ["H100:8", "L4:4"], "infra": ["aws"]})
    controller.reconcile(job_id)
    for addr, node in enumerate(store.nodes(job_id)):
        controller.handlers.heartbeat(job_id, node.id, {"state": "ready", "addr": f"10.0.1.{addr + 1}"})
    controller.reconcile(job_id)
    job = store.job(job_id)
    assert job.state == JobState.RUNNING and {n.offer["accelerator"] for n in store.nodes(job_id)} == {"L4"}
    for node in store.nodes(job_id):
        assert controller.handlers.attempt(job_id, node.id, {"attempt": job.attempt})["nproc_per_node"] == 4
    # the health watch maps the 2 x 4 global ranks onto the nodes, torchrun's way
    first, second = sorted(store.nodes(job_id), key=lambda n: n.rank)
    assert controller.health.existing(job_id)._monitor.rank_nodes == (first.id,) * 4 + (second.id,) * 4


class WorkdirDeleting(ScriptedProvider):
    """Refuses a node, and the job's workdir is deleted meanwhile (by the user, a cleanup of /tmp)."""

    def provision(self, request: NodeRequest) -> NodeHandle:
        shutil.rmtree(request.workdir)
        raise QuotaError("VcpuLimitExceeded", provider=self.name)


def test_a_workdir_deleted_under_a_job_fails_it_with_the_fix_when_it_is_planned_again(tmp_path, monkeypatch):
    """Before: model.entry's search ran its child in the missing workdir, FileNotFoundError was taken for a bug
    and planning began again at every pass: the job stayed PROVISIONING (RECOVERING after a fault) for ever."""
    store = Store(tmp_path / "tfsn.db")
    aws = WorkdirDeleting("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    code = tmp_path / "code"
    code.mkdir()
    search = entry.price_entry        # the first plan falls back on the declared shape (a search takes seconds)
    monkeypatch.setattr(entry, "price_entry", lambda *args, **kw: None if code.exists() else search(*args, **kw))
    job_id = submit(store, code, num_nodes=1, model={"entry": "train.py:build", "params": "1B", "layers": 16,
                                                     "hidden": 2048, "seq_len": 1024, "batch_size": 8})
    reconcile(controller, job_id)
    job = store.job(job_id)
    assert job.state == JobState.FAILED and f"workdir: {code} is not a directory" in job.error, job.error


class FlakyCatalog(ScriptedProvider):
    """Its offers() fails with the errors it is given, one a call, before it answers (a catalog call's 503)."""

    def __init__(self, *args, offer_errors: list[ProviderError] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offer_errors = offer_errors or []
        self.offer_calls = 0

    def offers(self) -> list[Offer]:
        self.offer_calls += 1
        if self.offer_errors:
            raise self.offer_errors.pop(0)
        return super().offers()


def _unavailable() -> ProviderError:
    error = ProviderError("DescribeInstanceTypes: 503 Service Unavailable", provider="aws")
    error.retryable = True
    return error


def _recovering_with_its_plan_used_up(tmp_path, aws: FlakyCatalog) -> tuple[Controller, int]:
    """A job ran on us-east-1a (its plan's only candidate), lost its node, and the zone has no room left: the
    replacement's create is refused, the zone blocked, and the job is planned again while RECOVERING."""
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=1)
    controller.reconcile(job_id)
    (node,) = store.nodes(job_id)
    controller.handlers.heartbeat(job_id, node.id, {"state": "ready", "addr": "10.0.1.1"})
    controller.reconcile(job_id)
    assert store.job(job_id).state == JobState.RUNNING
    controller.nodes.fail(store.job(job_id), store.node(node.id), "the agent went silent")
    controller.reconcile(job_id)                          # the attempt stops
    controller.reconcile(job_id)                          # RECOVERING
    assert store.job(job_id).state == JobState.RECOVERING
    return controller, job_id


def test_a_transient_error_while_a_recovering_job_is_planned_again_is_retried_after_a_backoff(tmp_path):
    """Before: a catalog call's 503 while the job was planned again failed the recovering job at once."""
    aws = FlakyCatalog("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)], room={"us-east-1a": 1})
    controller, job_id = _recovering_with_its_plan_used_up(tmp_path, aws)
    store = controller.store
    aws.offer_errors.append(_unavailable())
    controller.reconcile(job_id)                          # refused in 1a, 1a blocked, planned again: the 503
    assert store.job(job_id).state == JobState.RECOVERING, store.job(job_id).error
    said = [e.message for e in store.events(job_id) if "503" in e.message]
    assert said == ["planning again failed: aws's offers could not be read (DescribeInstanceTypes: 503 Service "
                    "Unavailable) (transient, attempt 1 of "
                    "5; trying again)"], said
    calls = aws.offer_calls
    controller.reconcile(job_id)                          # within the backoff: the catalog is not asked again
    assert aws.offer_calls == calls and store.job(job_id).state == JobState.RECOVERING
    aws._offers.append(h100("aws", "us-east-1", "us-east-1b", 95.0))   # the catalog answers again, with 1b
    backoff_passed(controller, job_id)
    reconcile(controller, job_id)
    assert [n.offer["zone"] for n in store.nodes(job_id, active_only=True)] == ["us-east-1b"]
    assert store.job(job_id).state == JobState.RECOVERING and (job_id, "plan") not in controller.provisioner.backoff


@pytest.mark.parametrize("errors, said", [
    ([AuthError("UnauthorizedOperation: the credentials expired", provider="aws")],
     "aws's offers could not be read (UnauthorizedOperation: the credentials expired)"),
    ([_unavailable() for _ in range(TRANSIENT_TRIES)],
     "aws's offers could not be read (DescribeInstanceTypes: 503 Service Unavailable)"),
])
def test_a_permanent_error_or_one_transient_too_often_while_planned_again_fails_the_job_with_it(tmp_path, errors,
                                                                                                 said):
    aws = FlakyCatalog("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)], room={"us-east-1a": 1})
    controller, job_id = _recovering_with_its_plan_used_up(tmp_path, aws)
    aws.offer_errors.extend(errors)
    for _ in errors:
        controller.reconcile(job_id)
        backoff_passed(controller, job_id)
    job = controller.store.job(job_id)
    assert job.state == JobState.FAILED and job.error == said, job.error
    assert aws.offer_calls == 1 + len(errors), "a permanent error is not retried; a transient one as often as allowed"


def test_a_transient_error_while_a_pending_job_is_planned_is_retried_after_a_backoff(tmp_path):
    """Before: a catalog call's 503 at the job's first plan failed it at once."""
    aws = FlakyCatalog("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)], offer_errors=[_unavailable()])
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=1)
    controller.reconcile(job_id)
    assert store.job(job_id).state == JobState.PENDING, store.job(job_id).error
    assert any("planning failed: aws's offers could not be read (DescribeInstanceTypes: 503" in e.message
               for e in store.events(job_id))
    controller.reconcile(job_id)                          # within the backoff
    assert aws.offer_calls == 1
    backoff_passed(controller, job_id)
    controller.reconcile(job_id)
    assert store.job(job_id).state == JobState.PROVISIONING and aws.asked == ["us-east-1a"]


class ThrottledAfterTheFirst(FlakyCatalog):
    """Grants its first create; throttles every one after that."""

    def provision(self, request: NodeRequest) -> NodeHandle:
        if self.created:
            self.requests.append(request)
            error = ProviderError("RequestLimitExceeded: Request limit exceeded.", provider=self.name)
            error.retryable = True
            raise error
        return super().provision(request)


def test_a_plan_s_transient_errors_are_counted_apart_from_the_creates_before_it(tmp_path):
    """Before: a create throttled 4 times in a row, then its offer blocked (a node never scheduled there) and the
    job planned again: the plan's first 503 was counted as the 5th transient error, and failed the job."""
    aws = ThrottledAfterTheFirst("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    aws.pending_zones.add("us-east-1a")                   # rank 0's node is never scheduled
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=2, health={"heartbeat_timeout": "1s"})
    for _ in range(TRANSIENT_TRIES - 1):                  # rank 1's create is throttled 4 times in a row
        controller.reconcile(job_id)
        backoff_passed(controller, job_id)
    assert len(aws.requests) == TRANSIENT_TRIES and store.job(job_id).blocked == []
    aws.offer_errors.append(_unavailable())
    time.sleep(1.2)
    controller.reconcile(job_id)                          # rank 0 never started: 1a blocked, planned again: 503
    job = store.job(job_id)
    assert job.state == JobState.PROVISIONING, job.error
    said = [e.message for e in store.events(job_id) if "503" in e.message]
    assert said == ["planning again failed: aws's offers could not be read (DescribeInstanceTypes: 503 Service "
                    "Unavailable) (transient, attempt 1 of "
                    "5; trying again)"], said


def test_a_job_stopped_while_it_waits_out_a_plan_s_backoff_stops_at_once_and_its_backoff_is_dropped(tmp_path):
    """Before: the stopped job's backoff stayed in the controller's memory for as long as it ran."""
    aws = FlakyCatalog("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)], offer_errors=[_unavailable()])
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=1)
    controller.reconcile(job_id)                          # the 503: a backoff of 2 s
    assert (job_id, "plan") in controller.provisioner.backoff
    store.request_stop(job_id)
    controller.reconcile(job_id)                          # within the backoff
    assert store.job(job_id).state == JobState.STOPPED and aws.offer_calls == 1
    assert controller.provisioner.backoff == {}


class GatedCreates(FlakyCatalog):
    """Refuses every create for no capacity; all but the first only once `gate` is set (creates in flight at once)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def provision(self, request: NodeRequest) -> NodeHandle:
        self.requests.append(request)
        if len(self.requests) > 1:
            self.gate.wait(10)
        raise CapacityError(f"InsufficientInstanceCapacity in {request.offer.zone}", provider=self.name)


def _until(what: str, controller: Controller, done: Callable[[], bool]) -> None:
    """The loop's passes fold in the calls that ended, until `done`."""
    for _ in range(500):
        controller.calls.collect()
        if done():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} did not happen")


def test_a_create_refused_while_the_job_waits_out_a_plan_s_backoff_does_not_end_the_wait(tmp_path):
    """Before: the refusal of a create in flight reset the plan's backoff: the job was planned again at once, and
    with its only zone blocked, failed for no capacity instead of waiting for the catalog to answer."""
    aws = GatedCreates("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=2)
    controller._reconcile(job_id)                         # as the loop does: planned off the loop
    _until("the plan", controller, lambda: store.job(job_id).state == JobState.PROVISIONING)
    aws.offer_errors.append(_unavailable())
    controller._reconcile(job_id)                         # both ranks' creates in flight
    _until("rank 0's refusal, then the re-plan's 503", controller,
           lambda: any("planning again failed" in e.message for e in store.events(job_id)))
    aws.gate.set()                                        # rank 1's create is refused now, within the plan's backoff
    _until("rank 1's refusal", controller, lambda: all(n.state == NodeState.FAILED for n in store.nodes(job_id))
           and len(store.nodes(job_id)) == 2)
    controller.calls.settle(5)
    job = store.job(job_id)
    assert job.state == JobState.PROVISIONING and aws.offer_calls == 2, (job.error, aws.offer_calls)
    refused = [e.message for e in store.events(job_id) if "could not be created" in e.message]
    assert refused[-1].endswith("(blocked this zone; planning again)"), refused


def test_a_job_that_fails_when_planned_again_after_a_transient_error_leaves_no_backoff(tmp_path):
    """Before: the catalog answered the retry with only blocked offers; the job failed for no capacity off the loop
    (never reconciled again), and its plan's backoff stayed in the controller's memory."""
    aws = FlakyCatalog("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)], room={"us-east-1a": 1})
    controller, job_id = _recovering_with_its_plan_used_up(tmp_path, aws)
    aws.offer_errors.append(_unavailable())
    controller.reconcile(job_id)                          # refused in 1a, 1a blocked, planned again: the 503
    backoff_passed(controller, job_id)
    controller._reconcile(job_id)                         # as the loop does: planned again off the loop
    _until("the job's end", controller, lambda: controller.store.job(job_id).state.terminal)
    job = controller.store.job(job_id)
    assert job.state == JobState.FAILED and "no capable offer" in job.error, job.error
    assert controller.provisioner.backoff == {}


@pytest.mark.parametrize("error", [_unavailable(), AuthError("AuthFailure: AWS was not able to validate the provided "
                                                             "access credentials", provider="aws")])
def test_a_pending_job_is_planned_on_the_other_clouds_when_one_cloud_s_offers_cannot_be_read(tmp_path, error):
    """Before: aws's 503 (or refused credentials) failed the whole plan: retried 5 times, then the job failed, though
    gcp, which the job allows too, had capable offers."""
    aws = FlakyCatalog("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)], offer_errors=[error])
    gcp = ScriptedProvider("gcp", [h100("gcp", "us-central1", "us-central1-a", 95.0)])
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": gcp}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=1)
    controller.reconcile(job_id)
    job = store.job(job_id)
    assert job.state == JobState.PROVISIONING and gcp.asked == ["us-central1-a"], job.error
    said = [e.message for e in store.events(job_id) if "aws" in e.message and "gcp" not in e.message]
    assert said == [f"aws's offers could not be read ({error}): planned without them"], said
    assert controller.provisioner.backoff == {}


def test_a_recovering_job_is_planned_again_on_the_other_clouds_when_one_cloud_s_offers_cannot_be_read(tmp_path):
    """Before: aws's 503 while the recovering job was planned again kept it waiting out backoffs (then failed it),
    though gcp had capable offers."""
    aws = FlakyCatalog("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)], room={"us-east-1a": 1})
    controller, job_id = _recovering_with_its_plan_used_up(tmp_path, aws)
    gcp = controller.ctx.providers["gcp"]
    gcp._offers.append(h100("gcp", "us-central1", "us-central1-a", 95.0))
    aws.offer_errors.append(_unavailable())
    reconcile(controller, job_id)                         # refused in 1a, 1a blocked, planned again without aws
    store = controller.store
    assert [n.offer["zone"] for n in store.nodes(job_id, active_only=True)] == ["us-central1-a"], store.job(job_id).error
    said = [e.message for e in store.events(job_id) if "503" in e.message]
    assert said == ["aws's offers could not be read (DescribeInstanceTypes: 503 Service Unavailable): planned "
                    "without them"], said
    assert (job_id, "plan") not in controller.provisioner.backoff


def test_a_cloud_whose_offers_cannot_be_read_is_waited_for_when_the_others_offers_are_all_blocked(tmp_path):
    """The others' plan has only blocked offers: aws, left out for its 503, may have room; the job waits out a backoff
    as when aws was the only cloud, rather than failing for no capacity."""
    aws = FlakyCatalog("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)], room={"us-east-1a": 1})
    controller, job_id = _recovering_with_its_plan_used_up(tmp_path, aws)
    offer = h100("gcp", "us-central1", "us-central1-a", 95.0)
    controller.ctx.providers["gcp"]._offers.append(offer)
    controller.store.update_job(job_id, blocked=[{"offer": dataclasses.asdict(offer), "scope": "provider",
                                                  "spot": False, "error": "AuthFailure"}])
    aws.offer_errors.append(_unavailable())
    controller.reconcile(job_id)
    job = controller.store.job(job_id)
    assert job.state == JobState.RECOVERING and (job_id, "plan") in controller.provisioner.backoff, job.error
    assert any(e.message.startswith("planning again failed: aws's offers could not be read (DescribeInstanceTypes: "
                                    "503") for e in
               controller.store.events(job_id))


def test_every_cloud_whose_offers_cannot_be_read_is_named_when_the_others_cannot_place_the_job(tmp_path):
    """Before: aws's refused credentials and gcp's 503 made the job wait out gcp's backoffs, then fail with
    "DescribeInstanceTypes: 503 Service Unavailable" alone: neither cloud named, aws's credentials never said."""
    refused = AuthError("AuthFailure: AWS was not able to validate the provided access credentials", provider="aws")
    aws = FlakyCatalog("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)], offer_errors=[refused] * TRANSIENT_TRIES)
    gcp = FlakyCatalog("gcp", [], offer_errors=[_unavailable() for _ in range(TRANSIENT_TRIES)])
    both = f"gcp's offers could not be read ({_unavailable()}); aws's offers could not be read ({refused})"
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": gcp}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=1)
    controller.reconcile(job_id)
    (said,) = [e.message for e in store.events(job_id) if "planning failed" in e.message]
    assert said == f"planning failed: {both} (transient, attempt 1 of {TRANSIENT_TRIES}; trying again)", said
    for _ in range(TRANSIENT_TRIES):
        backoff_passed(controller, job_id)
        controller.reconcile(job_id)
    job = store.job(job_id)
    assert job.state == JobState.FAILED and job.error == both, job.error


class MalformedCatalog(ScriptedProvider):
    """Its offers are rows of a catalog file that does not parse (a hand-edited refreshed copy, SkyPilot's)."""

    def offers(self) -> list[Offer]:
        raise CatalogError("aws.csv:3: price: 'x' is not a number. To fix: correct that row, or delete the file")


def test_a_catalog_that_does_not_parse_fails_the_job_with_its_line_rather_than_planning_it_again_each_pass(tmp_path):
    """Before: the CatalogError went to the calls' collector as a bug, and the job stayed PENDING, planned again (and
    a traceback logged) at every pass of the loop, its events saying nothing."""
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {"aws": MalformedCatalog("aws", []), "gcp": ScriptedProvider("gcp", [])},
                            url=URL)
    job_id = submit(store, tmp_path, num_nodes=1)
    controller.reconcile(job_id)
    job = store.job(job_id)
    assert job.state == JobState.FAILED and job.error.startswith("aws.csv:3: price: "), job.error
