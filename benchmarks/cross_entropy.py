"""Cross-entropy's forward and backward over a language model's logits: tfsn with its own nll_loss backward
(a where over the class positions, fused into the softmax's backward) against tfsn with torch's
decomposition (zeros, then an ATen scatter of -1 at the targets), eager, and Inductor.

    nice python benchmarks/cross_entropy.py [--rows 1024] [--vocab 8192] [--repeat 15] [--threads 1] [--json]

One step: F.cross_entropy of fixed fp32 logits (requires_grad) and targets, then backward. Each peer is
compiled and run once untimed, then the peers alternate within each round, so the machine's load falls on
all alike; the table gives median milliseconds and each peer's time over tfsn's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import print_table  # noqa: E402
from optimizer.backend import decompositions, make_backend  # noqa: E402

aten = torch.ops.aten
OWN_BACKWARDS = (aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)


def loss(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(x, target)


@contextlib.contextmanager
def torchs_nll_backward():
    """tfsn's table without its own nll_loss backwards while in the block (a compile: torch.compile is lazy,
    so the first call must be inside)."""
    table = decompositions()
    saved = {op: table.pop(op) for op in OWN_BACKWARDS}
    try:
        yield
    finally:
        table.update(saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.vocab, generator=g, requires_grad=True)
    target = torch.randint(0, args.vocab, (args.rows,), generator=g)

    def step(fn: Callable) -> float:
        start = time.perf_counter()
        fn(x, target).backward()
        elapsed = time.perf_counter() - start
        x.grad = None
        return elapsed

    peers = {"tfsn": torch.compile(lambda x, t: loss(x, t), backend=make_backend())}
    step(peers["tfsn"])             # compiled now, with the table as it is
    peers["tfsn, torch's backward"] = torch.compile(lambda x, t: loss(x, t), backend=make_backend())
    with torchs_nll_backward():
        step(peers["tfsn, torch's backward"])
    peers["eager"] = loss
    peers["inductor"] = torch.compile(lambda x, t: loss(x, t))
    step(peers["inductor"])
    times: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(args.repeat):
        for name, fn in peers.items():
            times[name].append(step(fn))
    medians = {name: statistics.median(t) for name, t in times.items()}
    print_table(["peer", "ms", "/ tfsn"], [[name, f"{m * 1e3:.1f}", f"{m / medians['tfsn']:.2f}"]
                                           for name, m in medians.items()])
    if args.json:
        print(json.dumps({"rows": args.rows, "vocab": args.vocab, "threads": args.threads,
                          "median_ms": {n: round(m * 1e3, 2) for n, m in medians.items()},
                          "over_tfsn": {n: round(m / medians["tfsn"], 3) for n, m in medians.items()}}))


if __name__ == "__main__":
    main()
