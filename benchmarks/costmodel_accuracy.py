"""The cost model against this CPU: does it rank schedules the way the machine does?

    python benchmarks/costmodel_accuracy.py [--samples 200] [--rounds 5] [--kernels gemm_a,layernorm] [--json]

For each kernel (GEMM in three shapes with a bias epilogue, LayerNorm, softmax, bias+GELU, and causal
attention as a whole graph: the scores' GEMM with its scale epilogue, the masked softmax, and the
second GEMM as a library call), `--samples` schedules are drawn (seeded) from the schedules the search
scores (optimizer/space.py less the twins costmodel.distinct leaves out; attention: one schedule per
kernel of its graph, summed), all of
them compiled and timed here (optimizer/measure.py: round-robin rounds, the best round of each,
since other processes only ever add time), and compared with
the model's predictions on this host's spec (the calibrated one when `tfsn calibrate` has run,
optimizer.hardware.cpu_spec):
  spearman      rank correlation of predicted vs measured times (target >= 0.8 for every kernel)
  top1 regret   measured time of the model's best-predicted schedule / best measured
  top8 regret   best measured among the model's 8 best-predicted / best measured (target <= 1.10)
Why: the search compiles only the model's top few candidates; that works only if the model ranks well.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import print_table  # noqa: E402
from optimizer import costmodel, features, fusion, ir, measure, space  # noqa: E402
from optimizer.backend import decompositions  # noqa: E402
from optimizer.hardware import cpu_spec, load_spec_file  # noqa: E402


def _gemm(m: int, k: int, n: int, transposed: bool = False):
    w = torch.randn(n, k) if transposed else torch.randn(k, n)
    return (lambda x, w, b: x @ (w.t() if transposed else w) + b), (torch.randn(m, k), w, torch.randn(n))


def _attention(x_q, x_k, x_v, mask):
    scores = (x_q @ x_k.transpose(-1, -2)) * 0.125
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ x_v


KERNELS = {
    "gemm_a": _gemm(256, 768, 768),
    "gemm_b": _gemm(64, 3072, 768),
    "gemm_c": _gemm(512, 256, 1024, transposed=True),
    "layernorm": (lambda x, w, b: torch.nn.functional.layer_norm(x, (768,), w, b),
                  (torch.randn(2048, 768), torch.randn(768), torch.randn(768))),
    "softmax": (lambda x: torch.softmax(x, dim=-1), (torch.randn(1536, 256),)),
    "bias_gelu": (lambda x, b: torch.nn.functional.gelu(x + b), (torch.randn(2048, 3072), torch.randn(3072))),
    "attention": (_attention, (torch.randn(12, 128, 64), torch.randn(12, 128, 64), torch.randn(12, 128, 64),
                               torch.ones(128, 128, dtype=torch.bool).triu(1))),
}


def lower(fn, inputs, store_gemm_epilogues: bool = False) -> tuple[ir.Graph, fusion.Plan]:
    """The function as the backend sees it: core ATen, our decompositions, the default fusion plan
    (`store_gemm_epilogues`: pointwise values read straight off a matmul are written by its epilogue
    instead of being recomputed by their readers, so that the GEMM is one of our kernels)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    graph = ir.from_fx(make_fx(fn, decomposition_table=decompositions())(*inputs))
    def base(i: int) -> ir.Node:
        node = graph.nodes[i]
        return base(node.args[0].index) if node.kind == ir.Kind.VIEW else node
    store = frozenset(n.index for n in graph.nodes if store_gemm_epilogues and n.kind == ir.Kind.POINTWISE
                      and any(base(i).kind == ir.Kind.MATMUL for i in n.inputs))
    return graph, fusion.plan(graph, choice=fusion.Choice(store=store))


def scored_space(table: costmodel.FeatureTable, kernel: int, spec) -> costmodel.Candidates:
    """The schedules of one kernel the search scores: its space less the twins the model prices alike
    (costmodel.distinct), so that ranks are measured on what the model has to tell apart."""
    cands = space.kernel_space(kernel, table.kernels[kernel])
    return cands.take(costmodel.distinct(table, cands, spec))


def sample_rows(table: costmodel.Candidates, count: int, rng: np.random.Generator) -> costmodel.Candidates:
    rows = rng.choice(len(table), size=min(count, len(table)), replace=False)
    return table.take(np.sort(rows))


def run_kernel(name: str, samples: int, rounds: int, rng: np.random.Generator, spec) -> dict:
    fn, inputs = KERNELS[name]
    graph, plan = lower(fn, inputs, store_gemm_epilogues=name == "attention")
    groups = [g for g in plan.groups if g.kind != "extern"]
    feats = [features.kernel_features(graph, g, plan.buffers) for g in groups]
    table = costmodel.FeatureTable(feats)
    t0 = time.perf_counter()
    if len(groups) == 1 or name != "attention":
        group = max(range(len(groups)), key=lambda i: feats[i].elements * (1 + (feats[i].kind == costmodel.GEMM)))
        cands = sample_rows(scored_space(table, group, spec), samples, rng)
        predicted = costmodel.predict(table, cands, spec, threads=torch.get_num_threads())
        schedules = [cands.schedule(r) for r in range(len(cands))]
        kernels, lib = measure.build_variants(graph, groups[group], plan.buffers, schedules)
        compile_s = time.perf_counter() - t0
        measured = measure.time_variants(graph, kernels, lib, rounds=rounds, budget_s=60)
        space_size = len(scored_space(table, group, spec))
    else:        # a whole graph: one schedule per kernel, predicted and measured as the sum
        samples = min(samples, *(len(scored_space(table, i, spec)) for i in range(len(feats))))
        picks = [sample_rows(scored_space(table, i, spec), samples, rng) for i in range(len(feats))]
        predicted = sum(costmodel.predict(table, p, spec, threads=torch.get_num_threads()) for p in picks)
        measured = np.zeros(samples)
        compile_s = 0.0
        for i, p in enumerate(picks):
            t1 = time.perf_counter()
            kernels, lib = measure.build_variants(graph, groups[i], plan.buffers,
                                                  [p.schedule(r) for r in range(len(p))], prefix=f"g{i}_")
            compile_s += time.perf_counter() - t1
            measured = measured + np.array(measure.time_variants(graph, kernels, lib, rounds=rounds, budget_s=30))
        space_size = math.prod(len(scored_space(table, i, spec)) for i in range(len(feats)))   # joint schedules sampled
    predicted, measured = np.asarray(predicted), np.asarray(measured)
    order = np.argsort(predicted, kind="stable")
    best = measured.min()
    return {"kernel": name, "samples": len(measured), "space": space_size,
            "spearman": round(costmodel.spearman(predicted, measured), 3),
            "top1_regret": round(float(measured[order[0]] / best), 3),
            "top8_regret": round(float(measured[order[:8]].min() / best), 3),
            "best_measured_us": round(float(best) * 1e6, 1),
            "predicted_best_us": round(float(predicted[order[0]]) * 1e6, 1),
            "median_ratio": round(float(np.median(measured / predicted)), 2),
            "compile_s": round(compile_s, 1), "_detail": (cands if name != "attention" else None, predicted, measured)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spec", help="a hardware spec file (default: this host's calibrated spec, else cpu-generic)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = [k for k in args.kernels.split(",") if k]
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        sys.exit(f"costmodel_accuracy: unknown kernel {unknown[0]!r}; known: {', '.join(KERNELS)}")
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    spec = load_spec_file(args.spec) if args.spec else cpu_spec()
    print(f"spec: {spec.name} ({spec.compute_units} threads, torch threads {torch.get_num_threads()})")
    results = [run_kernel(n, args.samples, args.rounds, rng, spec) for n in names]
    print_table(["kernel", "samples", "space", "spearman", "top1 regret", "top8 regret", "best us",
                 "measured/predicted", "compile s"],
                [[r["kernel"], r["samples"], r["space"], r["spearman"], r["top1_regret"], r["top8_regret"],
                  r["best_measured_us"], r["median_ratio"], r["compile_s"]] for r in results])
    met = all(r["spearman"] >= 0.8 and r["top8_regret"] <= 1.10 for r in results)
    print(f"targets (spearman >= 0.8 and top-8 regret <= 1.10 for every kernel): {'met' if met else 'NOT met'}")
    if args.json:
        print(json.dumps({"spec": spec.name, "kernels": [{k: v for k, v in r.items() if k != "_detail"} for r in results], "min_spearman": min(r["spearman"] for r in results),
                          "max_top8_regret": max(r["top8_regret"] for r in results),
                          "median_spearman": statistics.median(r["spearman"] for r in results)}))


if __name__ == "__main__":
    main()
