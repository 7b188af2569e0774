"""Compile time of the kernel optimizer where fusion groups grow large: each group's lowering extended
member by member from the kept lowering of its prefix (optimizer.loopnest.KEPT, the default) against
every group lowered whole (KEPT = 0, as before lowerings were kept).

    nice python benchmarks/compile_time.py [--lattices 3x3,5x4,7x5] [--repeat 3] [--no-gpt] [--json]

Models: the RNN-T of tests/user_models_tenth.py, whose loss is a Python loop of logaddexp over a T x U
lattice, so its graphs' fusion groups grow with the lattice (an 11 x 8 one took 229 s to compile), at
each lattice size; and the nanoGPT of tests/user_models.py, whose groups are of the usual size. One
compile: a fresh TFSN_CACHE and dynamo state, the first forward and backward timed (search, codegen and
the C compiler included). The two modes alternate within each round, so the machine's load falls on
both alike; the table gives medians over --repeat rounds, after one untimed compile (imports).
  whole s     first-step seconds, every group lowered whole
  extended s  the same with lowerings extended
  ratio       whole s / extended s
  search      the same ratio for the seconds spent in search.search_graph alone
  same plans  whether both modes chose the same fusion plans (groups and stored values) for every graph
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import print_table  # noqa: E402
from optimizer import loopnest, search  # noqa: E402
from optimizer.backend import make_backend  # noqa: E402
from tests.user_models import TinyGPT, _gpt_batch  # noqa: E402
from tests.user_models_tenth import RNNT  # noqa: E402

MODES = {"whole": 0, "extended": loopnest.KEPT}


def rnnt_step(lattice: str):
    """An RNN-T over a T x U lattice (batch 2) and its inputs."""
    steps, labels = map(int, lattice.split("x"))
    g = torch.Generator().manual_seed(0)
    return RNNT(), (torch.randn(2, steps, 4, generator=g), torch.randint(1, 5, (2, labels), generator=g))


def gpt_step():
    """The tests' nanoGPT and a batch of it (it computes its loss itself)."""
    (idx,), targets = _gpt_batch(torch.Generator().manual_seed(0))
    return TinyGPT(), (idx, targets)


def first_step(model: torch.nn.Module, inputs: tuple) -> tuple[float, float, list]:
    """Compile the model and run its first forward and backward: (seconds, seconds in the searches, the
    plans the searches chose as (groups, stored values))."""
    os.environ["TFSN_CACHE"] = tempfile.mkdtemp(prefix="tfsn-compile-time-")
    torch._dynamo.reset()
    searched, plans = [0.0], []
    original = search.search_graph

    def timed_search(*args, **kwargs):
        t0 = time.perf_counter()
        result = original(*args, **kwargs)
        searched[0] += time.perf_counter() - t0
        plans.append((result.plan.groups, sorted(result.plan.buffers)))
        return result

    search.search_graph = timed_search
    try:
        compiled = torch.compile(model, backend=make_backend())
        t0 = time.perf_counter()
        _, loss = compiled(*inputs)
        loss.backward()
        return time.perf_counter() - t0, searched[0], plans
    finally:
        search.search_graph = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lattices", default="3x3,5x4,7x5", help="RNN-T lattice sizes, T x U")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-gpt", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    models = {f"rnnt {lattice}": (lambda lattice=lattice: rnnt_step(lattice)) for lattice in args.lattices.split(",") if lattice}
    if not args.no_gpt:
        models["gpt"] = gpt_step
    first_step(*rnnt_step("2x2"))                    # imports and first-use costs, untimed
    rows, results = [], {}
    for name, build in models.items():
        seconds = {mode: [] for mode in MODES}
        searched = {mode: [] for mode in MODES}
        plans = {}
        for _ in range(args.repeat):
            for mode, kept in MODES.items():
                loopnest.KEPT = kept
                total, in_search, plans[mode] = first_step(*build())
                seconds[mode].append(total)
                searched[mode].append(in_search)
        loopnest.KEPT = MODES["extended"]
        whole, extended = (statistics.median(seconds[m]) for m in MODES)
        search_whole, search_extended = (statistics.median(searched[m]) for m in MODES)
        same = plans["whole"] == plans["extended"]
        results[name] = {"whole_s": whole, "extended_s": extended, "ratio": whole / extended,
                         "search_whole_s": search_whole, "search_extended_s": search_extended,
                         "search_ratio": search_whole / search_extended, "same_plans": same,
                         "runs": seconds, "search_runs": searched}
        rows.append([name, f"{whole:.1f}", f"{extended:.1f}", f"{whole / extended:.2f}",
                     f"{search_whole / search_extended:.2f}", "yes" if same else "NO"])
        print(f"{name}: whole {seconds['whole']} extended {seconds['extended']}", file=sys.stderr, flush=True)
    print_table(["model", "whole s", "extended s", "ratio", "search", "same plans"], rows)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "repeat": args.repeat, "models": results}))


if __name__ == "__main__":
    main()
