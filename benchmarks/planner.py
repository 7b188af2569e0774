"""The planner against its targets: plan time, optimality, and the cost of its plans vs the naive plan.

    python benchmarks/planner.py [--json] [--repeats 7] [--cases 200]

  plan time   tfsn's vectorized planner (orchestrator.planning.planner.plan_job) beside a brute-force planner that
              checks and prices offer by offer in Python, on catalogs of 10k and 100k offers (the shipped
              snapshot's rows repeated over synthetic zones, prices jittered +-20%, seeded); median of
              repeats. Target: 100k offers in < 200 ms.
  optimality  over random catalogs and jobs (seeded), the plan's chosen cost against the brute-force
              minimum. Target: optimal on every case.
  reference   a fixed set of jobs on the shipped catalog: predicted cost of the run under tfsn's plan and
              under the naive plan (the cheapest capable offer per hour), per job and in total.
Why: "price every offer by what the whole run costs" must be cheap enough to run on every launch, must
find the true minimum, and must beat picking the cheapest hourly price.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import print_table  # noqa: E402
from optimizer.hardware import find_hardware  # noqa: E402
from optimizer.predict import memory_gib_needed, predict_step_seconds  # noqa: E402
from orchestrator.planning.planner import (STARTUP_SECONDS, PlanError, expected_spot_hours, plan_job,  # noqa: E402
                                  workload_of)
from orchestrator.spec import JobSpec  # noqa: E402
from providers.catalog import load_offers  # noqa: E402

import numpy as np  # noqa: E402

ALL_GPUS = {"H100": 8, "H200": 8, "A100": 8, "A100-80GB": 8, "L40S": 1, "A10G": 8, "T4": 4, "V100": 8, "L4": 1}
REFERENCE_JOBS = {
    "gpt3-xl, any GPU": dict(resources={"accelerators": ALL_GPUS}, steps=1000,
                             model=dict(params="1.3B", layers=24, hidden=2048, seq_len=2048, batch_size=256)),
    "350M, 5k steps, small GPUs first": dict(
        resources={"accelerators": {"T4": 4, "A10G": 8, "L4": 1, "A100": 8, "H100": 8}}, steps=5000,
        model=dict(params="350M", layers=24, hidden=1024, seq_len=2048, batch_size=512)),
    "125M, 20k steps, one GPU": dict(
        resources={"accelerators": {"T4": 1, "V100": 1, "A10G": 1, "L4": 1, "L40S": 1, "A100-80GB": 1, "H100": 1}},
        steps=20000, model=dict(params="125M", layers=12, hidden=768, seq_len=1024, batch_size=256)),
    "1.3B, 2 nodes, spot": dict(
        resources={"accelerators": {"H100": 8, "A100": 8, "A100-80GB": 8, "V100": 8}, "use_spot": True},
        num_nodes=2, steps=3000),
    "2.7B, 8-GPU nodes": dict(
        resources={"accelerators": {"A100-80GB": 8, "H100": 8, "V100-32GB": 8, "H200": 8}}, steps=2000,
        model=dict(params="2.7B", layers=32, hidden=2560, seq_len=2048, batch_size=512)),
    "7B, needs > 80 GB per GPU": dict(
        resources={"accelerators": {"H100": 8, "H200": 8, "A100-80GB": 8}}, steps=1000,
        model=dict(params="7B", layers=32, hidden=4096, seq_len=4096, batch_size=256)),
}


def job(name: str = "bench", **fields) -> JobSpec:
    return JobSpec.model_validate({"name": name, "run": "python train.py", **fields})


def brute_force(spec: JobSpec, offers) -> tuple[float, int] | None:
    """(minimum predicted cost, offer index) by checking and pricing one offer at a time; None if none fits."""
    res, nodes, steps = spec.resources, spec.num_nodes, spec.steps or 1000
    workload, _ = workload_of(spec)
    need = memory_gib_needed(workload) if spec.model is not None else 0.0   # the reference workload only prices
    wanted = {(c.name.casefold(), c.count) for c in res.accelerator_choices()}
    best = None
    for i, o in enumerate(offers):
        if (((o.accelerator or "").casefold(), o.accelerator_count) not in wanted
                or o.accelerator_memory_gib < need or (hw := find_hardware(o.accelerator)) is None):
            continue
        price = o.spot_price if res.use_spot else o.price
        if price is None or (res.max_hourly_cost is not None and price > res.max_hourly_cost):
            continue
        work = steps * predict_step_seconds(workload, hw, o.accelerator_count, nodes) / 3600
        if res.use_spot:
            auto = min(max(math.sqrt(2 * 60 * 3600 / (0.05 * nodes)), 30), 1800) / 3600
            work = float(expected_spot_hours(np.array([work]), nodes, np.array([auto]))[0])
        cost = price * nodes * (STARTUP_SECONDS / 3600 + work)
        if best is None or cost < best[0]:
            best = (cost, i)
    return best


def synthetic_catalog(size: int, seed: int = 0):
    """`size` offers: the shipped rows over synthetic zones, prices jittered +-20%."""
    rng = random.Random(seed)
    base = load_offers()
    out = []
    while len(out) < size:
        o = base[len(out) % len(base)]
        k = len(out) // len(base)
        jitter = rng.uniform(0.8, 1.2)
        out.append(replace(o, zone=f"{o.zone or o.region}-s{k}", price=round(o.price * jitter, 5),
                           spot_price=None if o.spot_price is None else round(o.spot_price * jitter, 5)))
    return out


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plan_time(repeats: int) -> list[dict]:
    spec = job(resources={"accelerators": ALL_GPUS})
    rows = []
    for size in (10_000, 100_000):
        offers = synthetic_catalog(size)
        plan = plan_job(spec, offers)
        best = brute_force(spec, offers)
        assert best is not None and math.isclose(plan.chosen.cost, best[0], rel_tol=1e-9)
        tfsn_s = timed(lambda: plan_job(spec, offers), repeats)
        brute_s = timed(lambda: brute_force(spec, offers), max(1, repeats // 3))
        rows.append({"offers": size, "capable": len(plan), "tfsn_ms": tfsn_s * 1e3, "brute_force_ms": brute_s * 1e3,
                     "speedup": brute_s / tfsn_s})
    return rows


def optimality(cases: int) -> dict:
    rng = random.Random(1)
    names = ["H100", "A100", "A100-80GB", "L4", "T4", "L40S", "K80"]
    memory = {"H100": 80, "A100": 40, "A100-80GB": 80, "L4": 22.35, "T4": 16, "L40S": 44.7, "K80": 12}
    base = load_offers()[0]
    optimal = planned = 0
    for _ in range(cases):
        offers = []
        for i in range(rng.randint(1, 60)):
            acc, count = rng.choice(names), rng.choice([1, 8])
            price = rng.uniform(0.05, 150)
            offers.append(replace(base, provider=rng.choice("abc"), region=rng.choice(["r1", "r2"]), zone=f"z{i % 3}",
                                  instance_type=f"i{i}", accelerator=acc, accelerator_count=count,
                                  accelerator_memory_gib=memory[acc], price=price,
                                  spot_price=rng.choice([None, price * rng.uniform(0.2, 0.9)])))
        spec = job(resources={"accelerators": {n: rng.choice([1, 8]) for n in rng.sample(names, rng.randint(2, 5))},
                              "use_spot": rng.random() < 0.3,
                              "max_hourly_cost": rng.choice([None, None, 30.0, 90.0])},
                   num_nodes=rng.randint(1, 3), steps=rng.randint(100, 20000),
                   model=rng.choice([None, dict(params=rng.choice([1e8, 3e8, 1.3e9, 7e9]), layers=24, hidden=2048,
                                                seq_len=rng.choice([512, 2048]), batch_size=rng.choice([16, 256]))]))
        best = brute_force(spec, offers)
        try:
            chosen = plan_job(spec, offers).chosen.cost
        except PlanError:
            optimal += best is None
            continue
        planned += 1
        optimal += best is not None and math.isclose(chosen, best[0], rel_tol=1e-9)
    return {"cases": cases, "planned": planned, "optimal": optimal}


def reference_set() -> list[dict]:
    offers = load_offers()
    rows = []
    for name, fields in REFERENCE_JOBS.items():
        plan = plan_job(job(**fields), offers)
        c, n = plan.chosen, plan.naive
        rows.append({"job": name, "chosen": f"{c.offer.provider} {c.offer.instance_type}", "chosen_cost": c.cost,
                     "chosen_hours": c.hours, "naive": f"{n.offer.provider} {n.offer.instance_type}",
                     "naive_cost": n.cost, "naive_hours": n.hours})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", type=int, default=200)
    args = parser.parse_args()

    timing = plan_time(args.repeats)
    print("plan time (median):")
    print_table(["offers", "capable", "tfsn ms", "brute force ms", "speedup"],
                [[r["offers"], r["capable"], f"{r['tfsn_ms']:.1f}", f"{r['brute_force_ms']:.0f}",
                  f"{r['speedup']:.0f}x"] for r in timing])
    opt = optimality(args.cases)
    print(f"\noptimality: {opt['optimal']}/{opt['cases']} cases optimal ({opt['planned']} with a capable offer)")
    ref = reference_set()
    print("\nreference jobs, predicted cost of the run (USD):")
    print_table(["job", "tfsn plan", "$", "hours", "naive plan", "$", "hours", "naive/tfsn"],
                [[r["job"], r["chosen"], f"{r['chosen_cost']:,.2f}", f"{r['chosen_hours']:,.1f}", r["naive"],
                  f"{r['naive_cost']:,.2f}", f"{r['naive_hours']:,.1f}", f"{r['naive_cost'] / r['chosen_cost']:.2f}"]
                 for r in ref])
    total_tfsn, total_naive = sum(r["chosen_cost"] for r in ref), sum(r["naive_cost"] for r in ref)
    print(f"total: tfsn ${total_tfsn:,.2f} vs naive ${total_naive:,.2f} "
          f"({total_naive / total_tfsn:.2f}x; tfsn saves {1 - total_tfsn / total_naive:.0%})")
    ms_100k = next(r["tfsn_ms"] for r in timing if r["offers"] == 100_000)
    print(f"targets: 100k offers < 200 ms: {'met' if ms_100k < 200 else 'MISSED'} ({ms_100k:.0f} ms); "
          f"optimal on every case: {'met' if opt['optimal'] == opt['cases'] else 'MISSED'}")
    if args.json:
        print(json.dumps({"plan_time": timing, "optimality": opt, "reference": ref,
                          "reference_total": {"tfsn": total_tfsn, "naive": total_naive,
                                              "naive_over_tfsn": total_naive / total_tfsn}}))


if __name__ == "__main__":
    main()
