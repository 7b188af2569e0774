"""The planner: capability, cost of the run, spot expected cost, optimality and failover."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from optimizer.hardware import find_hardware
from optimizer.predict import REFERENCE_WORKLOAD, Workload, memory_gib_needed, predict_step_seconds
from orchestrator.planning.planner import (HOST_STARTUP_SECONDS, STARTUP_SECONDS, Blocklist, NoCapacityError, PlanError, PlannedOffer,
                                           check_accelerators, plan_job, workload_of)
from orchestrator.spec import JobSpec, SpecError, load_spec
from providers.base import AuthError, CapacityError, Offer, ProviderError, QuotaError

ACC_MEMORY = {"H100": 80.0, "A100": 40.0, "A100-80GB": 80.0, "L4": 22.35, "T4": 16.0, "L40S": 48.0, "K80": 12.0,
              "Gaudi2": 96.0}   # Gaudi2: an accelerator no hardware spec describes


def spec(resources=None, **fields) -> JobSpec:
    return JobSpec.model_validate({"name": "t", "run": "python train.py", "resources": resources or {}, **fields})


def offer(provider="cloudA", region="r1", zone="z1", instance="big", accelerator="H100", count=8, price=10.0,
          spot=None, vcpus=96.0, memory=1024.0, interconnect=None) -> Offer:
    gib = ACC_MEMORY.get(accelerator, 0.0) if accelerator else 0.0
    return Offer(provider, region, zone, instance, accelerator, count if accelerator else 0, gib, vcpus, memory,
                 price, spot, interconnect)


def run_hours(accelerator, count, nodes=1, steps=1000, workload=REFERENCE_WORKLOAD):
    step = predict_step_seconds(workload, find_hardware(accelerator), count, nodes)
    return STARTUP_SECONDS / 3600 + steps * step / 3600


def test_cost_is_price_times_nodes_times_predicted_hours():
    plan = plan_job(spec({"accelerators": "H100:8"}, num_nodes=2, steps=500), [offer(price=98.32)])
    c = plan.chosen
    assert c.hours == pytest.approx(run_hours("H100", 8, nodes=2, steps=500))
    assert c.cost == pytest.approx(98.32 * 2 * c.hours)
    assert (plan.steps, plan.nodes, plan.reference_workload) == (500, 2, True)


def test_this_machines_nodes_start_in_seconds_not_a_cloud_vms_minutes():
    # the README example ended 42 s after its launch and its plan said 0.17 h: 10 minutes of a cloud VM's boot,
    # image pull and setup were counted for local nodes, processes of this machine
    job = spec(num_nodes=2, steps=500)
    here = offer(provider="local", accelerator=None, price=0.0)
    cloud = offer(provider="cloudB", accelerator=None, price=0.0)
    local_hours = plan_job(job, [here], host_providers=("local",)).chosen.hours
    cloud_hours = plan_job(job, [cloud], host_providers=("local",)).chosen.hours
    assert cloud_hours - local_hours == pytest.approx((STARTUP_SECONDS - HOST_STARTUP_SECONDS) / 3600)


def test_a_node_trains_on_as_many_accelerators_as_it_runs_workers():
    # torchrun starts nproc_per_node workers, one GPU each: with 1 of them, 7 of the node's 8 H100s idle (and
    # are paid for), so the 8-GPU node is no faster than the 1-GPU one and costs 8 times as much per hour
    one, eight = offer(instance="p5.4xl", count=1, price=12.29), offer(instance="p5.48xl", count=8, price=98.32)
    plan = plan_job(spec({"accelerators": {"H100": 8}}, nproc_per_node=1, steps=500), [eight])
    assert plan.chosen.hours == pytest.approx(run_hours("H100", 1, steps=500))
    alone = plan_job(spec({"accelerators": "H100:1"}, nproc_per_node=1, steps=500), [one]).chosen
    assert plan.chosen.hours == pytest.approx(alone.hours) and plan.chosen.cost == pytest.approx(8 * alone.cost)
    assert plan_job(spec({"accelerators": "H100:8"}, nproc_per_node=8, steps=500), [eight]).chosen.hours == \
        pytest.approx(run_hours("H100", 8, steps=500))


def test_workers_beyond_a_nodes_accelerators_are_refused_as_they_could_not_start():
    # 16 workers on 8 H100s: torchrun's worker 8 calls set_device(8) (an invalid ordinal) and NCCL refuses two
    # ranks on one GPU, so the nodes fail at start, paid for; it was planned, two workers taking turns on a GPU
    job = spec({"accelerators": {"H100": 8, "A100": 8}}, nproc_per_node=16)
    with pytest.raises(PlanError, match=r"^no capable offer: nproc_per_node 16 \(more workers than the node's "
                                        r"accelerators.*To fix: set nproc_per_node: auto \(one worker per "
                                        r"accelerator\) or at most 8$") as err:
        plan_job(job, [offer(), offer(accelerator="A100")])
    assert err.value.field == ("nproc_per_node",)
    sixteen = offer(instance="huge", count=16, price=30.0)     # a node of as many accelerators as workers runs them
    job = spec({"accelerators": {"A100": 8, "H100": 16}}, nproc_per_node=16)
    assert [c.offer for c in plan_job(job, [offer(accelerator="A100", price=1.0), sixteen])] == [sixteen]
    cpu = offer(instance="c8", accelerator=None, vcpus=8, memory=64, price=0.4)   # a CPU node runs any number
    assert plan_job(spec(nproc_per_node=16), [cpu]).chosen.offer is cpu


def test_the_cost_of_the_run_pays_for_the_spares_kept_beside_its_nodes():
    # recovery.spares: standby nodes of the chosen offer, created with the job and billed for the whole run
    job = spec({"accelerators": "H100:8"}, num_nodes=2, steps=500, recovery={"spares": 1})
    c = plan_job(job, [offer(price=98.32)]).chosen
    assert c.hours == pytest.approx(run_hours("H100", 8, nodes=2, steps=500))
    assert c.cost == pytest.approx(98.32 * 3 * c.hours)
    assert (c.nodes, c.spares) == (2, 1)
    assert PlannedOffer.from_record(c.to_record()).spares == 1       # the controller keeps the candidates


def test_the_slow_cheap_offer_loses_to_the_fast_expensive_one():
    slow = offer(instance="t4", accelerator="T4", count=4, price=3.912)
    fast = offer(instance="p5", accelerator="H100", count=8, price=98.32)
    big = Workload(params=3e8, layers=24, hidden=1024, seq_len=2048, batch_size=512)
    plan = plan_job(spec({"accelerators": {"T4": 4, "H100": 8}},
                         model=dict(params=3e8, layers=24, hidden=1024, seq_len=2048, batch_size=512)), [slow, fast])
    assert plan.naive.offer is slow and plan.chosen.offer is fast
    assert plan.chosen.cost < plan.naive.cost
    assert plan.chosen.hours == pytest.approx(run_hours("H100", 8, workload=big))
    assert not plan.reference_workload


def test_an_ordered_list_keeps_the_users_preference_before_cost():
    cheap_run = offer(instance="p5", accelerator="H100", count=8, price=98.32)
    dear_run = offer(instance="t4", accelerator="T4", count=4, price=3.912)
    model = dict(params=3e8, layers=24, hidden=1024, seq_len=2048, batch_size=512)
    ordered = plan_job(spec({"accelerators": ["T4:4", "H100:8"]}, model=model), [cheap_run, dear_run])
    assert [c.offer.instance_type for c in ordered] == ["t4", "p5"]
    any_of = plan_job(spec({"accelerators": {"T4": 4, "H100": 8}}, model=model), [cheap_run, dear_run])
    assert [c.offer.instance_type for c in any_of] == ["p5", "t4"]


@pytest.mark.parametrize("resources, offers, expected, message", [
    ({"accelerators": "h100:8", "infra": ["aws"]},
     [offer(provider="aws"), offer(provider="gcp", price=1)], {"aws"}, "resources.infra ['aws']"),
    ({"accelerators": "H100:8", "regions": ["r2"]},
     [offer(region="r1", price=1), offer(region="r2")], {"r2"}, "resources.regions ['r2']"),
    ({"accelerators": "H100:8"},
     [offer(count=4, price=1), offer(accelerator="A100", price=1), offer(instance="ok")], {"ok"},
     "resources.accelerators H100:8"),
    ({"accelerators": "H100:8", "cpus": "100+"},
     [offer(vcpus=96, price=1), offer(instance="ok", vcpus=192)], {"ok"}, "resources.cpus 100+"),
    ({"accelerators": "H100:8", "cpus": 96},
     [offer(vcpus=192, price=1), offer(instance="ok", vcpus=96)], {"ok"}, "resources.cpus 96"),
    ({"accelerators": "H100:8", "memory": "2000+"},
     [offer(memory=1024, price=1), offer(instance="ok", memory=2048)], {"ok"}, "resources.memory 2000+"),
    ({"accelerators": "H100:8", "use_spot": True},
     [offer(spot=None, price=1), offer(instance="ok", spot=30.0)], {"ok"}, "resources.use_spot true"),
    ({"accelerators": "H100:8", "max_hourly_cost": 50},
     [offer(price=60), offer(instance="ok", price=40)], {"ok"}, "resources.max_hourly_cost 50"),
    ({"accelerators": "K80:8"}, [offer(accelerator="K80", price=1)], set(), "hardware specs (none for K80)"),
])
def test_each_constraint_filters_offers_and_names_itself_when_it_removes_the_last(resources, offers, expected, message):
    field = "provider" if "infra" in resources else "region" if "regions" in resources else "instance_type"
    if expected:
        plan = plan_job(spec(resources), offers)
        assert {getattr(c.offer, field) for c in plan} == expected
    survivors = [o for o in offers if getattr(o, field) not in expected]
    with pytest.raises(PlanError) as err:
        plan_job(spec(resources), survivors)
    assert message in str(err.value) and "To fix:" in str(err.value)
    assert f"removed the last {len(survivors)} offer(s)" in str(err.value)


@pytest.mark.parametrize("written, expected", [
    ("H100-80GB:8", {"h100"}), ("nvidia-h100:8", {"h100"}), ("nvidia-h100-80gb:8", {"h100"}),
    ("nvidia-tesla-t4:8", {"t4"}), ("A100-40GB:8", {"a100"}), ("A100-SXM4-80GB:8", {"a100-80gb"}),
    ("V100-16GB:8", {"v100"}), ("V100:8", {"v100"}), ("h100:8", {"h100"}),
])
def test_an_accelerator_is_found_by_any_name_of_its_chip(written, expected):
    """`accelerators: H100-80GB:8` (an alias of the H100's hardware spec) or GCP's `nvidia-h100` was refused with "no
    capable offer ... removed the last 214 offer(s)": offers matched only the catalog's own spelling, "H100". A name
    the catalog does not use finds the offers of its chip, of the memory it states (a 16 GB V100 is not a 32 GB one)."""
    offers = [offer(instance=name.lower(), accelerator=name) for name in ("H100", "A100", "A100-80GB", "T4")]
    offers += [Offer("cloudA", "r1", "z1", name.lower(), name, 8, gib, 96.0, 1024.0, 10.0, None, None)
               for name, gib in (("V100", 16.0), ("V100-32GB", 32.0))]
    plan = plan_job(spec({"accelerators": written}), offers)
    assert {c.offer.instance_type for c in plan} == expected


def test_an_accelerator_or_count_no_offer_has_is_told_what_the_offers_have():
    # as SkyPilot's "Try one of these offered accelerators": the choices that the job's infra and regions sell
    offers = [offer(provider="aws", count=n, instance=f"h{n}") for n in (1, 2, 8)] + [
        offer(provider="aws", accelerator="A100", count=8), offer(provider="gcp", accelerator="MI300X")]
    for wanted in ("H100:3", "MI300X:8"):
        with pytest.raises(PlanError) as err:
            plan_job(spec({"accelerators": wanted, "infra": ["aws"]}), offers)
        assert str(err.value).endswith("To fix: ask for one of those offered here: A100:8, H100:1, H100:2, H100:8")
    # not an accelerator without a hardware spec: asked for, it is refused in turn ("hardware specs (none for ...)")
    with pytest.raises(PlanError, match=r"offered here: A100:8, H100:1, H100:2, H100:8$"):
        plan_job(spec({"accelerators": "H100:3", "infra": ["aws"]}),
                 offers + [offer(provider="aws", accelerator="Gaudi2", count=8)])


def test_an_at_least_amount_no_offer_has_is_to_be_lowered_not_written_as_n_plus():
    """`cpus: 200+` with no such offer said "To fix: write cpus as 'N+' (at least N), or lower it": it was N+."""
    for resources, what in (({"cpus": "200+"}, "resources.cpus 200+ removed"),
                            ({"memory": "2TB+"}, "resources.memory 2048+ GiB removed")):
        with pytest.raises(PlanError) as err:
            plan_job(spec({"accelerators": "H100:8", **resources}), [offer(vcpus=96, memory=1024)])
        assert what in str(err.value) and str(err.value).endswith("To fix: lower it"), str(err.value)


@pytest.mark.parametrize("written, meant", [("8xH100", "H100:8"), ("H100x8", "H100:8"), ("A100-80GBx4", "A100-80GB:4"),
                                            ("h10", "H100")])
def test_an_unknown_accelerator_with_a_count_in_its_name_is_told_the_name_count_form(written, meant):
    """`accelerators: 8xH100` was "unknown accelerator '8xH100'; did you mean 'H100'?": one H100 where eight were
    meant."""
    with pytest.raises(PlanError) as err:
        check_accelerators(spec({"accelerators": written}))
    assert f"unknown accelerator {written!r}; did you mean {meant!r}? To fix:" in str(err.value)


@pytest.mark.parametrize("written, message", [
    ("cpu", "'cpu' is not an accelerator. To fix: remove resources.accelerators for a job on CPUs only"),
    ("none", "'none' is not an accelerator. To fix: remove"),
    ("80GB:8", "unknown accelerator '80GB'; a GPU's memory is not its name here. To fix: name the chips, any of them "
               "as a mapping, e.g. {A100-80GB: 8, H100: 8}"),
    ("gpu:8", "unknown accelerator 'gpu'. To fix: use one with a hardware spec"),
])
def test_a_cpu_a_memory_size_or_gpu_as_the_accelerator_says_what_to_write(written, message):
    """`accelerators: gpu:8` got "did you mean 'CPU'?", `cpu` "this machine's GPUs are not planned", and dstack's
    `80GB:8` (any GPU of 80 GB) "did you mean 'H100-80GB'?"."""
    with pytest.raises(PlanError) as err:
        check_accelerators(spec({"accelerators": written}))
    assert f"resources.accelerators: {message}" in str(err.value)
    assert "CPU'?" not in str(err.value)


def test_regions_compare_case_aside_and_a_misspelt_one_is_named_with_the_region_meant():
    """`regions: [US-East-1]` removed every us-east-1 offer, and `regions: [us-east1]` (GCP's spelling on AWS) said only
    "add regions, or remove regions to allow all"."""
    offers = [offer(region="us-east-1", instance="east"), offer(region="us-west-2", instance="west")]
    assert {c.offer.instance_type for c in plan_job(spec({"accelerators": "H100:8", "regions": ["US-East-1"]}),
                                                    offers)} == {"east"}
    with pytest.raises(PlanError) as err:
        plan_job(spec({"accelerators": "H100:8", "regions": ["us-east1"]}), offers)
    assert "To fix: write 'us-east-1' for 'us-east1' (no offer is in the latter), add regions" in str(err.value)
    with pytest.raises(PlanError) as err:
        plan_job(spec({"accelerators": "H100:8", "regions": ["euwest"]}), offers)
    assert "To fix: add regions" in str(err.value)           # no wild guess (us-west-2)


GPT3_XL = dict(params="1.3B", layers=24, hidden=2048, seq_len=2048, batch_size=256)


def test_the_described_model_must_fit_in_accelerator_memory():
    small = offer(instance="l4", accelerator="L4", count=1, price=0.1)      # 22.35 GiB
    large = offer(instance="a100", accelerator="A100-80GB", count=1)
    job = spec({"accelerators": {"L4": 1, "A100-80GB": 1}}, model=GPT3_XL)
    assert [c.offer.instance_type for c in plan_job(job, [small, large])] == ["a100"]
    with pytest.raises(PlanError) as err:
        plan_job(job, [small])
    assert "memory for the model (23.6 GiB per device needed: a whole replica per device, not sharded) removed the " \
        "last 1 offer(s)" in str(err.value)
    assert err.value.field == ("model",)       # `tfsn plan` names the model: section's line, not the file's first
    # a replica per device (no sharding): which accelerators of the catalog hold one, beyond those asked for
    with pytest.raises(PlanError) as err:
        plan_job(spec({"accelerators": "L4:1"}, model=GPT3_XL), [small, large, offer(accelerator="T4"),
                                                                 offer(accelerator="Gaudi2")])   # no spec: not named
    assert str(err.value).endswith("To fix: ask for accelerators of at least 23.6 GiB (the catalog's: A100-80GB "
                                   "80 GiB), or a smaller model / seq_len")
    # without a model section the reference workload only prices offers: it says nothing of the model's size
    assert {c.offer.instance_type for c in plan_job(spec({"accelerators": {"L4": 1, "A100-80GB": 1}}),
                                                    [small, large])} == {"l4", "a100"}


def test_the_max_hourly_cost_message_says_how_far_to_raise_it():
    with pytest.raises(PlanError, match=r"raise max_hourly_cost to at least 60\.00"):
        plan_job(spec({"accelerators": "H100:8", "max_hourly_cost": 50}), [offer(price=60), offer(price=75)])


def test_a_cpu_only_job_plans_on_cpu_offers():
    plan = plan_job(spec({"cpus": "8+"}, model=dict(params=1e7, layers=4, hidden=256, seq_len=256, batch_size=8)),
                    [offer(), offer(instance="c8", accelerator=None, vcpus=8, memory=32, price=0.4)])
    assert [c.offer.instance_type for c in plan] == ["c8"]


def test_every_worker_of_a_cpu_node_holds_a_replica_in_its_memory():
    # 4 workers of a 1.3B model on one 32 GiB CPU node: 4 x 23.6 GiB, not one replica's 23.6 GiB
    cpu = offer(instance="c8", accelerator=None, vcpus=8, memory=32, price=0.4)
    assert plan_job(spec(model=GPT3_XL, nproc_per_node=1), [cpu]).chosen.offer is cpu
    with pytest.raises(PlanError, match=r"memory for the model \(94.2 GiB per device needed: a whole replica per "
                                        r"worker, 4 per device.*or fewer workers per node \(nproc_per_node\)$"):
        plan_job(spec(model=GPT3_XL, nproc_per_node=4), [cpu])


def test_the_local_nodes_share_this_machines_memory():
    # 2 local nodes of 2 workers are 4 processes of one 64 GiB machine: 4 x 23.6 GiB, not one node's 2 x 23.6 GiB
    here = offer(provider="local", instance="local", accelerator=None, vcpus=8, memory=64, price=0.0)
    assert plan_job(spec(model=GPT3_XL, num_nodes=2), [here], host_providers=("local",)).chosen.offer is here
    with pytest.raises(PlanError, match=r"\(94.2 GiB per device needed: a whole replica per worker, 4 per device.*"
                                        r"or fewer local nodes \(num_nodes: they share this machine's memory\)$"):
        plan_job(spec(model=GPT3_XL, num_nodes=2, nproc_per_node=2), [here], host_providers=("local",))
    cloud = offer(instance="c8", accelerator=None, vcpus=8, memory=64, price=0.4)     # a node of its own each
    assert plan_job(spec(model=GPT3_XL, num_nodes=2, nproc_per_node=2), [cloud]).chosen.offer is cloud


def expected_spot_hours_by_hand(run_hours_no_startup, nodes, interval_hours):
    rate = 0.05 * nodes                                   # SPOT_PREEMPTIONS_PER_NODE_HOUR x nodes
    lost = min(interval_hours, run_hours_no_startup) / 2   # a run shorter than its interval never checkpoints
    loss = rate * (600 / 3600 + lost)                      # restart + half an interval per preemption
    return run_hours_no_startup / (1 - loss)


def test_spot_cost_includes_the_expected_preemptions_and_restarts():
    o = offer(price=98.32, spot=30.0)
    on_demand = plan_job(spec({"accelerators": "H100:8"}, num_nodes=2), [o]).chosen
    spot = plan_job(spec({"accelerators": "H100:8", "use_spot": True}, num_nodes=2,
                         checkpoint={"interval": "10m"}), [o]).chosen
    work = on_demand.hours - STARTUP_SECONDS / 3600
    assert spot.hours == pytest.approx(STARTUP_SECONDS / 3600 + expected_spot_hours_by_hand(work, 2, 10 / 60))
    assert spot.hours > on_demand.hours and spot.cost == pytest.approx(30.0 * 2 * spot.hours)
    by_steps = plan_job(spec({"accelerators": "H100:8", "use_spot": True}, num_nodes=2,
                             checkpoint={"interval": 100}), [o]).chosen
    interval = 100 * by_steps.step_seconds / 3600
    assert by_steps.hours == pytest.approx(STARTUP_SECONDS / 3600 + expected_spot_hours_by_hand(work, 2, interval))


def test_a_spot_run_shorter_than_its_checkpoint_interval_loses_at_most_the_run_per_preemption():
    # 100 steps of ~1.3 s on one node: the run ends before the first of its checkpoints every 100000 steps (or
    # every day), so a preemption loses the work done so far, not half an interval of 18 h (the run would never
    # finish) or 12 h
    o = offer(price=98.32, spot=30.0)
    work = plan_job(spec({"accelerators": "H100:8"}, steps=100), [o]).chosen.hours - STARTUP_SECONDS / 3600
    for interval in (100000, "24h"):
        spot = plan_job(spec({"accelerators": "H100:8", "use_spot": True}, steps=100,
                             checkpoint={"interval": interval}), [o]).chosen
        assert spot.hours == pytest.approx(STARTUP_SECONDS / 3600 + expected_spot_hours_by_hand(work, 1, work))


def test_spot_on_too_many_nodes_never_finishes_and_is_not_planned():
    with pytest.raises(PlanError, match="expected spot preemptions on 40 node") as err:
        plan_job(spec({"accelerators": "H100:8", "use_spot": True}, num_nodes=40, steps=100_000,
                      checkpoint={"interval": "1h"}),
                 [offer(spot=30.0)])
    assert err.value.field == ("resources", "use_spot")


def test_blocklist_scopes():
    a1 = offer(provider="A", region="r1", zone="z1", instance="i1")
    a1b = offer(provider="A", region="r1", zone="z1", instance="i2")
    a2 = offer(provider="A", region="r1", zone="z2", instance="i1")
    a3 = offer(provider="A", region="r2", zone="z3", instance="i1")
    b1 = offer(provider="B", region="r1", zone="z1", instance="i1")
    az = offer(provider="C", region="east", zone=None, instance="i1")
    az_other = offer(provider="C", region="west", zone=None, instance="i1")
    every = [a1, a1b, a2, a3, b1, az, az_other]

    def blocked_by(o, scope):
        bl = Blocklist()
        bl.block(o, scope)
        return [x for x in every if bl.blocks(x)]

    assert blocked_by(a1, "offer") == [a1]
    assert blocked_by(a1, "zone") == [a1, a1b]
    assert blocked_by(a1, "region") == [a1, a1b, a2]
    assert blocked_by(a1, "provider") == [a1, a1b, a2, a3]
    assert blocked_by(az, "zone") == [az]                      # no zone: the region is the zone
    with pytest.raises(ValueError):
        Blocklist().block(a1, "planet")


def test_failover_walks_down_the_ranking_blocking_what_each_error_implies():
    offers = [offer(provider="A", zone="z1", instance="i1", price=1.0),
              offer(provider="A", zone="z1", instance="i2", price=2.0),
              offer(provider="A", region="r2", zone="z9", instance="i1", price=3.0),
              offer(provider="B", zone="z1", instance="i1", price=4.0),
              offer(provider="B", region="r3", instance="i1", price=5.0),
              offer(provider="C", zone="z1", instance="i1", price=6.0)]
    plan = plan_job(spec({"accelerators": "H100:8"}), offers)
    errors = iter([CapacityError("no capacity", scope="zone"), QuotaError("quota"), AuthError("no credentials")])
    tried = []

    def attempt(candidate):
        tried.append((candidate.offer.provider, candidate.offer.region, candidate.offer.instance_type))
        error = next(errors, None)
        if error is not None:
            raise error
        return "node"

    result, blocked = provision_with_failover(plan, attempt)
    # zone z1 of A blocked (A/z1/i2 skipped), then region r2 of A (quota), then provider B (auth: B/r3 skipped)
    assert tried == [("A", "r1", "i1"), ("A", "r2", "i1"), ("B", "r1", "i1"), ("C", "r1", "i1")]
    assert result == "node"
    assert [h.scope for h in blocked.history] == ["zone", "region", "provider"]


def test_failover_succeeds_on_the_first_candidate_not_blocked():
    offers = [offer(zone="z1", instance="i1", price=1.0), offer(zone="z2", instance="i1", price=2.0)]
    plan = plan_job(spec({"accelerators": "H100:8"}), offers)
    calls = []

    def attempt(candidate):
        calls.append(candidate.offer.zone)
        if candidate.offer.zone == "z1":
            raise CapacityError("InsufficientInstanceCapacity", scope="zone")
        return candidate

    result, blocked = provision_with_failover(plan, attempt)
    assert calls == ["z1", "z2"] and result.offer.zone == "z2"
    assert "InsufficientInstanceCapacity" in blocked.history[0].error


def test_failover_ends_with_the_history_when_everything_fails():
    plan = plan_job(spec({"accelerators": "H100:8"}), [offer(zone="z1"), offer(zone="z2")])

    def attempt(candidate):
        raise CapacityError(f"no capacity in {candidate.offer.zone}", scope="zone")

    with pytest.raises(NoCapacityError) as err:
        provision_with_failover(plan, attempt)
    assert len(err.value.history) == 2 and "no capacity in z2" in str(err.value)


def provision_with_failover(plan, attempt):
    """The controller's walk down a plan (one node at a time there), as one loop."""
    blocked = Blocklist()
    while (candidate := plan.next(blocked)) is not None:
        try:
            return attempt(candidate), blocked
        except ProviderError as err:
            blocked.record(candidate, err)
    raise NoCapacityError(blocked.history)


# --- brute force: the plan's choice is the cheapest capable offer, over random catalogs -------------------

NAMES = ["H100", "A100", "A100-80GB", "L4", "T4", "L40S", "K80", None]
offers_strategy = st.lists(st.builds(
    offer, provider=st.sampled_from(["p1", "p2", "p3"]), region=st.sampled_from(["r1", "r2"]),
    zone=st.sampled_from([None, "z1", "z2"]), instance=st.sampled_from(["i1", "i2", "i3", "i4"]),
    accelerator=st.sampled_from(NAMES), count=st.sampled_from([1, 8]),
    price=st.floats(0.05, 150, allow_nan=False), spot=st.none() | st.floats(0.01, 100, allow_nan=False),
    vcpus=st.sampled_from([4.0, 8.0, 96.0]), memory=st.sampled_from([16.0, 64.0, 1024.0]),
    interconnect=st.sampled_from([None, "EFA 400 Gbps"])), min_size=1, max_size=60)
spec_strategy = st.fixed_dictionaries({
    "accelerators": st.one_of(
        st.dictionaries(st.sampled_from(NAMES[:-1]), st.sampled_from([1, 8]), min_size=2, max_size=6),
        st.lists(st.sampled_from(["H100:8", "A100:8", "L4:1", "T4:8", "L40S:1", "A100-80GB:8", "H100:1"]),
                 min_size=2, max_size=5, unique=True),
        st.dictionaries(st.sampled_from(NAMES[:-1]), st.sampled_from([1, 8]), min_size=3, max_size=6),
        st.none()),
    "use_spot": st.booleans(), "infra": st.sampled_from([None, None, ["aws"]]),
    "regions": st.sampled_from([None, None, ["r1"], ["r1", "r2"]]),
    "max_hourly_cost": st.sampled_from([None, None, 20.0, 80.0])})
model_strategy = st.none() | st.builds(dict, params=st.sampled_from([1e8, 3e8, 1.3e9, 7e9]), layers=st.just(24),
                                       hidden=st.just(2048), seq_len=st.sampled_from([512, 2048]),
                                       batch_size=st.sampled_from([16, 256]))


def oracle(job: JobSpec, offers: list[Offer], providers_allowed):
    """Capability and cost written out offer by offer, independently of the planner's arrays."""
    res, nodes, steps = job.resources, job.num_nodes, job.steps or 1000
    m = job.model
    workload = REFERENCE_WORKLOAD if m is None else Workload(m.params, m.layers, m.hidden, m.seq_len, m.batch_size)
    need = memory_gib_needed(workload) if m is not None else 0.0     # the reference workload only prices
    choices = res.accelerator_choices()
    best = None
    for o in offers:
        if providers_allowed is not None and o.provider not in providers_allowed:
            continue
        if res.regions and o.region not in res.regions:
            continue
        prefs = [i for i, c in enumerate(choices) if o.accelerator and c.name.casefold() == o.accelerator.casefold()
                 and c.count == o.accelerator_count]
        if (choices and not prefs) or (not choices and o.accelerator):
            continue
        hw = find_hardware(o.accelerator)
        if hw is None or (o.accelerator_memory_gib if o.accelerator else o.memory_gib) < need:
            continue
        price = o.spot_price if res.use_spot else o.price
        if price is None or (res.max_hourly_cost is not None and price > res.max_hourly_cost):
            continue
        net = 50.0 if o.interconnect else 12.5
        work = steps * predict_step_seconds(workload, hw, o.accelerator_count, nodes, net) / 3600
        if res.use_spot:
            interval = min(max(math.sqrt(2 * 60 * 3600 / (0.05 * nodes)), 30), 1800) / 3600
            work = expected_spot_hours_by_hand(work, nodes, interval)
        cost = price * nodes * (STARTUP_SECONDS / 3600 + work)
        pref = 0 if res.accelerators_any_of else prefs[0] if prefs else 0
        if best is None or (pref, cost) < best:
            best = (pref, cost)
    return best


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(offers=offers_strategy, resources=spec_strategy, model=model_strategy,
       nodes=st.integers(1, 3), steps=st.integers(1, 20000))
def test_the_chosen_offer_is_the_cheapest_capable_one(offers, resources, model, nodes, steps):
    resources = {k: v for k, v in resources.items() if v is not None}
    if resources.get("infra"):
        resources["infra"] = ["aws"]
        offers = [o if o.provider != "p1" else o.__class__(**{**o.__dict__, "provider": "aws"}) for o in offers]
    job = spec(resources, num_nodes=nodes, steps=steps, **({"model": model} if model else {}))
    best = oracle(job, offers, resources.get("infra"))
    event("no capable offer" if best is None else "planned")
    if best is None:
        with pytest.raises(PlanError):
            plan_job(job, offers)
        return
    plan = plan_job(job, offers)
    assert plan.chosen.cost == pytest.approx(best[1], rel=1e-9)
    costs = [c.cost for c in plan]
    if job.resources.accelerators_any_of or not job.resources.accelerator_choices():
        assert costs == sorted(costs)
    hourly = [c.price_per_hour for c in plan]
    assert plan.naive.price_per_hour == min(hourly)


def test_a_faster_node_network_from_the_catalog_shortens_multi_node_steps():
    efa = offer(instance="efa", interconnect="EFA 3200 Gbps")
    plain = offer(instance="plain")
    plan = plan_job(spec({"accelerators": "H100:8"}, num_nodes=4), [plain, efa])
    assert [c.offer.instance_type for c in plan] == ["efa", "plain"]
    h100 = find_hardware("H100")
    assert plan.chosen.step_seconds == pytest.approx(predict_step_seconds(REFERENCE_WORKLOAD, h100, 8, 4, 400.0))


@pytest.mark.parametrize("interconnect, gbs", [("EFA 3200 Gigabit", 400.0), ("EFA 4x 100 Gigabit", 50.0),
                                               ("EFA 400 Gigabit", 50.0), ("Up to 10 Gigabit", 1.25)])
def test_the_node_network_is_read_in_ec2s_own_words(interconnect, gbs):
    # `tfsn catalog refresh aws` writes EC2's NetworkPerformance ("3200 Gigabit" for a p5, "4x 100 Gigabit" for a
    # p4d): read as the 100 Gbps default, an 8-node p5 job's all-reduce was priced 32 times too slow
    plan = plan_job(spec({"accelerators": "H100:8"}, num_nodes=8), [offer(interconnect=interconnect)])
    assert plan.chosen.step_seconds == pytest.approx(
        predict_step_seconds(REFERENCE_WORKLOAD, find_hardware("H100"), 8, 8, gbs))


@pytest.mark.parametrize("params, expected", [("350M", 3.5e8), ("1.3B", 1.3e9), (7000000000, 7e9), ("2.5e9", 2.5e9)])
def test_the_model_section_becomes_the_workload(params, expected):
    job = spec(model=dict(params=params, layers=2, hidden=64, seq_len=128, batch_size=4, dtype="fp16"))
    workload, reference = workload_of(job)
    assert workload == Workload(expected, 2, 64, 128, 4, "fp16") and not reference
    assert workload_of(spec()) == (REFERENCE_WORKLOAD, True)


def test_a_bad_model_section_is_a_spec_error_naming_line_and_field(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("run: python train.py\nmodel:\n  params: 1.3B\n  layers: 0\n")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert (f"{path}:4: model.layers: input should be greater than or equal to 1, got 0. "
            "To fix: write it like 'layers: 24'") in err.value.messages
    # a shape with fields missing (and no entry) names them all, and the entry that would do instead
    path.write_text("run: python train.py\nmodel:\n  params: 1.3B\n  layers: 2\n")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.messages == [f"{path}:2: model: hidden, seq_len, batch_size missing: the model is described by "
                                  "an entry or by its shape. To fix: add 'entry: train.py:build' (a function returning "
                                  "model, batch, loss_fn), or all of params, layers, hidden, seq_len, batch_size"]


def test_a_local_step_pays_the_calibrated_all_reduce_per_ddp_bucket_and_the_fixed_share(tmp_path, monkeypatch):
    """On this machine's local nodes the step is the searched graphs + the update + the fixed share every step
    pays + what a data-parallel one pays beyond it + the gloo all-reduce that `tfsn calibrate` measured: a latency
    per DDP bucket and a rate; one node has neither the data-parallel share nor an all-reduce; without a
    calibration the offer's link prices the all-reduce as before."""
    from pathlib import Path

    import yaml

    from optimizer.hardware import GENERIC_CPU, host_cpu_model, load_all
    from orchestrator.planning.entry import EntryStep, HardwareStep
    from orchestrator.planning.planner import HOST

    monkeypatch.setenv("TFSN_CACHE", str(tmp_path))
    grads = 3 << 20                        # 3 MiB of gradients: DDP's 1 MiB first bucket and one more
    entry = EntryStep(params=grads // 4, grad_bytes=grads, example_batch=4, dtype="fp32",
                      hardware={HOST: HardwareStep(0.010, update_s=0.002, overhead_s=0.001,
                                                  overhead_solo_s=0.0003)})
    local = offer(provider="local", region="local", zone=None, instance="local", accelerator=None, vcpus=2,
                  memory=8, price=0.0)

    def step(nodes: int) -> float:
        job = spec({"infra": ["local"]}, num_nodes=nodes, model={"entry": "train.py:build"})
        return plan_job(job, [local], entry=entry, host_providers=("local",)).chosen.step_seconds

    uncalibrated = step(2)
    assert uncalibrated > 0.013            # the offer's default network prices the all-reduce
    generic = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "hardware" / f"{GENERIC_CPU}.yaml").read_text())
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "host.yaml").write_text(yaml.safe_dump(
        {**generic, "name": "host", "cpu_model": host_cpu_model(), "allreduce_latency_us": 500.0,
         "allreduce_gbs": 0.5, "step_overhead_us": 1000.0}))
    assert load_all()[GENERIC_CPU].allreduce_gbs == 0
    assert step(2) == pytest.approx(0.010 + 0.002 + 0.0003 + 0.001 + 2 * 500e-6 + grads / 0.5e9)
    assert step(1) == pytest.approx(0.010 + 0.002 + 0.0003)


def test_a_local_data_parallel_step_waits_for_the_other_rank_as_the_square_root_of_its_own_time(tmp_path,
                                                                                                  monkeypatch):
    """As one of several local ranks, a step pays a fixed share and a wait that `tfsn calibrate` measured for a
    1 ms step and that grows as the square root of the step's own time (forward, backward, update and the fixed
    share every step pays, at the job's per-rank batch); alone it pays neither. A larger per-rank batch scales
    the graphs' share only."""
    from orchestrator.planning.entry import EntryStep, HardwareStep
    from orchestrator.planning.planner import HOST

    monkeypatch.setenv("TFSN_CACHE", str(tmp_path))        # not calibrated: the all-reduce priced by the link
    local = offer(provider="local", region="local", zone=None, instance="local", accelerator=None, vcpus=2,
                  memory=8, price=0.0)

    def step(nodes: int, seconds: float, batch_size: int | None = None) -> float:
        entry = EntryStep(params=4, grad_bytes=16, example_batch=4, dtype="fp32",
                          hardware={HOST: HardwareStep(seconds, update_s=0.001, overhead_s=0.002,
                                                      overhead_solo_s=0.0005, parallel_wait_s=0.0005)})
        model = {"entry": "train.py:build", **({"batch_size": batch_size} if batch_size else {})}
        job = spec({"infra": ["local"]}, num_nodes=nodes, model=model)
        return plan_job(job, [local], entry=entry, host_providers=("local",)).chosen.step_seconds

    base = step(2, 0.0025) - (0.004 + 0.002 + 0.0005 * 2.0)         # a 4 ms step waits 2 x a 1 ms one's
    assert 0 <= base < 1e-4                                         # what is left: 16 bytes' all-reduce
    assert step(2, 0.0145) == pytest.approx(0.016 + 0.002 + 0.0005 * 4.0 + base)
    assert step(2, 0.0025, batch_size=32) == pytest.approx(0.0115 + 0.002 + 0.0005 * 11.5 ** 0.5 + base)
    assert step(1, 0.0025) == pytest.approx(0.004)


def test_plan_says_when_this_cpu_is_uncalibrated_or_calibrated_by_an_older_tfsn(tmp_path, monkeypatch):
    """A spec written before `tfsn calibrate` measured a training loop prices that loop's figures at 0: the plan
    says to calibrate again, as it says to calibrate at all; a current calibration says nothing."""
    from pathlib import Path

    import yaml

    from optimizer.hardware import GENERIC_CPU, host_cpu_model
    from orchestrator.planning.offers import host_calibration_note

    monkeypatch.setenv("TFSN_CACHE", str(tmp_path))
    assert "not calibrated" in host_calibration_note() and "tfsn calibrate" in host_calibration_note()
    generic = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "hardware" / f"{GENERIC_CPU}.yaml").read_text())
    host = {**generic, "name": "host", "cpu_model": host_cpu_model(), "allreduce_latency_us": 200.0,
            "allreduce_gbs": 1.5, "step_overhead_us": 340.0}
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "host.yaml").write_text(yaml.safe_dump(host))
    assert "older tfsn" in host_calibration_note() and "calibrate` again" in host_calibration_note()
    # one that timed a training loop but not yet a data-parallel step against the same step alone
    (tmp_path / "hardware" / "host.yaml").write_text(yaml.safe_dump({**host, "step_overhead_solo_us": 330.0}))
    assert "older tfsn" in host_calibration_note()
    (tmp_path / "hardware" / "host.yaml").write_text(yaml.safe_dump(
        {**host, "step_overhead_solo_us": 330.0, "parallel_overhead_us": 1200.0, "parallel_wait_us": 1100.0,
         "buffer_broadcast_us": 500.0}))
    assert host_calibration_note() is None
