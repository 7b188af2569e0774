"""The search against timing everything: on a space small enough to time every candidate, how good
is the plan tfsn's search picks (cost model + top-k timing), and how much sooner does it have it?

    python benchmarks/search_vs_exhaustive.py [--top-k 8] [--rounds 3] [--json]

The graph: a residual block of pointwise and row-reduction work, y = gelu(layer_norm(x) * s + t) + x
and its softmax-weighted mean, at a size where kernels take tens to hundreds of microseconds.
Exhaustive: every fusion plan (all combinations of the graph's fusion decisions) and, in each, every
schedule of every kernel compiled and timed here; the best plan is the one whose kernels' best
measured times sum lowest. tfsn: `search.search_graph` with timing of the top k per kernel. Both
plans' kernels are then timed again side by side, in the same rounds, for the final comparison.
  quality   tfsn plan time / exhaustive best plan time (1.00 = found the best)
  speed-up  exhaustive seconds (compile + time all) / tfsn seconds (search + top-k timing)
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import print_table  # noqa: E402
from costmodel_accuracy import lower  # noqa: E402
from optimizer import features, fusion, measure, search, space  # noqa: E402
from optimizer.hardware import cpu_spec  # noqa: E402


def block(x, s, t):
    y = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (x.shape[-1],)) * s + t) + x
    return y, (torch.softmax(y, dim=-1) * y).sum(-1)


def plan_kernels(graph, plan, schedules, prefix):
    """The plan's kernels at their schedules, compiled: [(kernel, library)]."""
    groups = [(g, [s]) for g, s in zip(plan.groups, schedules) if g.kind != "extern"]
    return [(ks[0], lib) for ks, lib in measure.build_groups(graph, groups, plan.buffers, prefix=prefix)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = cpu_spec()
    graph, _ = lower(block, (torch.randn(args.rows, args.cols), torch.randn(args.cols), torch.randn(args.cols)))
    threads = torch.get_num_threads()

    t0 = time.perf_counter()
    result = search.search_graph(graph, spec, top_k=args.top_k, threads=threads)
    tfsn_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    points = fusion.decision_points(graph)
    best_plan, best_time, candidates, measured_kernels = None, float("inf"), 0, {}
    for flips in itertools.product((False, True), repeat=len(points)):
        plan = fusion.plan(graph, choice=fusion.choice_of(points, flips))
        groups = [(i, g) for i, g in enumerate(plan.groups) if g.kind != "extern"]
        todo = []
        for i, g in groups:
            key = (g, tuple(fusion.fused_nodes(graph, plan.buffers, g)), frozenset(plan.buffers.intersection(g.nodes)))
            if key not in measured_kernels:
                table = space.kernel_space(0, features.kernel_features(graph, g, plan.buffers))
                todo.append((key, g, [table.schedule(r) for r in range(len(table))]))
        if todo:
            built = measure.build_groups(graph, [(g, s) for _, g, s in todo], plan.buffers, prefix="all")
            for (key, _, schedules), (kernels, lib) in zip(todo, built):
                times = measure.time_variants(graph, kernels, lib, rounds=args.rounds)
                candidates += len(times)
                best = min(range(len(times)), key=times.__getitem__)
                measured_kernels[key] = (times[best], schedules[best])
        chosen, total = [], 0.0
        for g in plan.groups:
            if g.kind == "extern":
                chosen.append(None)
                continue
            key = (g, tuple(fusion.fused_nodes(graph, plan.buffers, g)), frozenset(plan.buffers.intersection(g.nodes)))
            total += measured_kernels[key][0]
            chosen.append(measured_kernels[key][1])
        if total < best_time:
            best_plan, best_time, best_schedules = plan, total, chosen
    exhaustive_s = time.perf_counter() - t0

    # both plans' kernels timed in the same rounds, so that noise falls on both alike
    mine = plan_kernels(graph, result.plan, result.schedules, "tfsn")
    best = plan_kernels(graph, best_plan, best_schedules, "best")
    final = measure.time_kernels(graph, mine + best, rounds=args.rounds + 4)
    tfsn_time, exhaustive_time = sum(final[:len(mine)]), sum(final[len(mine):])
    quality = tfsn_time / exhaustive_time
    rows = [["tfsn search (model + top-k timing)", f"{tfsn_s:.1f}", result.scored,
             sum(len(k.timed) for k in result.kernels), f"{tfsn_time * 1e6:.1f}"],
            ["exhaustive (time every candidate)", f"{exhaustive_s:.1f}", candidates, candidates,
             f"{exhaustive_time * 1e6:.1f}"]]
    print(f"graph: {len(graph.nodes)} nodes, {len(points)} fusion decisions, {2 ** len(points)} plans; "
          f"spec {spec.name}, {threads} threads")
    print_table(["method", "seconds to a plan", "scored", "timed", "plan time us"], rows)
    print(f"quality (tfsn / exhaustive best, lower is better): {quality:.3f}; "
          f"tfsn reached its plan {exhaustive_s / tfsn_s:.1f}x sooner")
    if args.json:
        print(json.dumps({"tfsn_s": round(tfsn_s, 2), "exhaustive_s": round(exhaustive_s, 2),
                          "speedup": round(exhaustive_s / tfsn_s, 1), "quality": round(quality, 3),
                          "tfsn_plan_us": round(tfsn_time * 1e6, 1), "best_plan_us": round(exhaustive_time * 1e6, 1),
                          "exhaustive_candidates": candidates, "tfsn_scored": result.scored,
                          "tfsn_timed": sum(len(k.timed) for k in result.kernels), "fusion_decisions": len(points)}))


if __name__ == "__main__":
    main()
