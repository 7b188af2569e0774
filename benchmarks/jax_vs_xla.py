"""tfsn.jax.optimize against jax.jit (XLA CPU) on JAX training steps.

    nice python benchmarks/jax_vs_xla.py [--json] [--rounds 5] [--steps 10] [--size small|bench]

For each model (the MLP, the transformer block and the convnet of tests/test_optimizer_jax.py, in
plain jax.numpy; the convnet's convolutions stay XLA ops), one training step = value_and_grad of the loss and a hand-written Adam update, jitted
two ways side by side in this process: `xla` is jax.jit(step); `tfsn` is tfsn.jax.optimize(step)
(its kernels XLA FFI custom calls, the rest XLA's; its matmuls tfsn's GEMMs or XLA's dots,
and its kernels' threads, whichever its own race of the ways measured fastest). Compile time is the first call's time minus a
steady step, tfsn's with an empty TFSN_CACHE. Steady figures are medians over rounds of `steps`
steps; rounds interleave the peers so that noise on a shared machine hits both alike. Target
(issue 20): geomean >= 1.0x jax.jit. Needs the `jax` extra.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
_tmp = tempfile.mkdtemp(prefix="tfsn-jax-bench-")
os.environ["TFSN_CACHE"] = _tmp

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import tfsn  # noqa: E402
from tests.test_optimizer_jax import (adam_state, adam_step, block_loss, block_params, conv_params,  # noqa: E402
                                      convnet_loss, mlp_loss, mlp_params, normal)

# mlp: batch, layer sizes; block: batch, tokens, width, hidden; convnet: batch, height, width, channels, classes
SIZES = {"small": {"mlp": (32, (64, 128, 10)), "block": (2, 16, 48, 96), "convnet": (8, 16, 16, (3, 8, 16), 10)},
         "bench": {"mlp": (256, (512, 1024, 10)), "block": (8, 64, 192, 768), "convnet": (32, 32, 32, (3, 32, 64), 10)}}


def models(size: str) -> dict:
    (batch, dims), (b, t, d, hidden) = SIZES[size]["mlp"], SIZES[size]["block"]
    n, height, width, channels, classes = SIZES[size]["convnet"]
    keys = jax.random.split(jax.random.PRNGKey(0), 9)
    mlp = mlp_params(keys[0], dims)
    labels = jax.random.randint(keys[1], (batch,), 0, dims[-1], jnp.int32)
    blk = block_params(keys[2], d, hidden)
    conv = conv_params(keys[6], channels, classes)
    conv_batch = (normal(keys[7], (n, height, width, channels[0])),
                  jax.random.randint(keys[8], (n,), 0, classes, jnp.int32))
    return {"mlp": (mlp_loss, mlp, (normal(keys[3], (batch, dims[0])), labels)),
            "block": (block_loss, blk, (normal(keys[4], (b, t, d)), normal(keys[5], (b, t, d)))),
            "convnet": (convnet_loss, conv, conv_batch)}


def timed(step, params, batch, n: int) -> float:
    state = adam_state(params)
    t0 = time.perf_counter()
    for _ in range(n):
        params, state, loss = step(params, state, *batch)
    jax.block_until_ready(loss)
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    args = ap.parse_args()
    rows = {}
    for name, (loss, params, batch) in models(args.size).items():
        step = adam_step(loss)
        peers = {"xla": jax.jit(step), "tfsn": tfsn.jax.optimize(step)}
        first = {p: timed(fn, params, batch, 1) for p, fn in peers.items()}
        times: dict[str, list[float]] = {p: [] for p in peers}
        for _ in range(args.rounds):
            for p, fn in peers.items():
                times[p].append(timed(fn, params, batch, args.steps))
        med = {p: statistics.median(v) for p, v in times.items()}
        (stats,) = peers["tfsn"].stats.values()
        rows[name] = {"xla_ms": med["xla"] * 1e3, "tfsn_ms": med["tfsn"] * 1e3, "speedup": med["xla"] / med["tfsn"],
                      "compile_s": {p: max(first[p] - med[p], 0.0) for p in peers},
                      "kernels": stats.get("kernels", 0), "externs": stats.get("externs", 0),
                      "matmuls": stats.get("matmuls"), "threads": stats.get("threads"),
                      "fallback": stats.get("fallback")}
        r = rows[name]
        print(f"{name:6s} xla {r['xla_ms']:8.3f} ms  tfsn {r['tfsn_ms']:8.3f} ms  {r['speedup']:.2f}x jax.jit  "
              f"compile xla {r['compile_s']['xla']:.2f} s tfsn {r['compile_s']['tfsn']:.2f} s  "
              f"{r['kernels']} kernels, {r['externs']} XLA ops, matmuls by {r['matmuls']}, {r['threads']} thread(s)" + (f"  FELL BACK: {r['fallback']}" if r["fallback"] else ""))
    geomean = math.exp(statistics.mean(math.log(r["speedup"]) for r in rows.values()))
    print(f"geomean {geomean:.2f}x jax.jit (target >= 1.0x)")
    if args.json:
        print(json.dumps({"size": args.size, "rounds": args.rounds, "steps": args.steps, "models": rows,
                          "geomean_speedup": geomean}))
    shutil.rmtree(_tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
