"""What the tfsn SDK costs a training loop, with telemetry on and checkpointing never due.

    python benchmarks/sdk_overhead.py [--json] [--rounds 7] [--steps 50]

Measures the median time per training step of a small GPT (the size of examples/tiny-gpt's default
model) in two loops run side by side in this process:
  plain  the training step alone;
  sdk    the same step written as a user writes it with tfsn: `tfsn.init()`, `run.steps()`,
         `run.log(loss=...)` and `run.checkpoint(model=..., optimizer=...)` every step, with the
         telemetry posted over HTTP to a real controller API (ApiServer, Store and Controller on
         127.0.0.1). The checkpoint interval is longer than the run and each round's total is one
         step past its end, so `run.checkpoint` decides every step but never saves.
Why: the SDK promises that a step never waits for the network; the target is < 1% overhead.
The loops alternate in rounds (plain, sdk, plain, sdk, ...) on one torch thread, so drift on a
noisy machine hits both alike; figures are medians over rounds, with each sdk round against the plain
rounds either side of it (median and ~95% interval) as the confidence hint. Each sdk round starts and
finishes its own `Run` (untimed), so the SDK's telemetry thread never runs during a plain round.
The API server's own work (HTTP, JSON, SQLite) runs in this process too: the figure is an upper
bound. At the end the store must hold every step record sent, with its loss, and no checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

# This folder holds health.py, which would shadow the `health` package: the repo root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn as nn
import torch.nn.functional as F

import tfsn
from _common import print_table
from orchestrator.control.api import ApiServer
from orchestrator.control.controller import Controller
from orchestrator.spec import JobSpec
from orchestrator.control.store import Store

# examples/tiny-gpt/train.py's defaults (its corpus has 43 distinct characters)
VOCAB, N_LAYER, N_HEAD, N_EMBD, BLOCK_SIZE, BATCH_SIZE = 43, 2, 4, 128, 64, 16
NEVER = 10**9          # a checkpoint interval, in steps, longer than any run here
TARGET_PCT = 1.0


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, as in the example."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(N_EMBD), nn.Linear(N_EMBD, 3 * N_EMBD), nn.Linear(N_EMBD, N_EMBD)
        self.ln2 = nn.LayerNorm(N_EMBD)
        self.mlp = nn.Sequential(nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(), nn.Linear(4 * N_EMBD, N_EMBD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, N_EMBD), nn.Embedding(BLOCK_SIZE, N_EMBD)
        self.blocks = nn.Sequential(*[Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        logits = self.head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile); a single value is all three."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def train_step(model: GPT, opt: torch.optim.Optimizer, data: torch.Tensor, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(len(data) - BLOCK_SIZE - 1, (BATCH_SIZE,), generator=g).tolist()
    x = torch.stack([data[s:s + BLOCK_SIZE] for s in starts])
    y = torch.stack([data[s + 1:s + BLOCK_SIZE + 1] for s in starts])
    loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def plain_round(model: GPT, opt: torch.optim.Optimizer, data: torch.Tensor, start: int, n: int) -> float:
    """Seconds per step of `n` plain steps."""
    began = time.perf_counter()
    for step in range(start, start + n):
        train_step(model, opt, data, step)
    return (time.perf_counter() - began) / n


def sdk_round(model: GPT, opt: torch.optim.Optimizer, data: torch.Tensor, start: int, n: int,
              checkpoint_dir: Path) -> float:
    """Seconds per step of `n` steps under the SDK. The total is one step past the round, so the save
    after the last step is never due; leaving at the top of that extra step records step start+n-1.
    Each round has its own `Run`, started and finished untimed, so no SDK thread runs in a plain round."""
    run = tfsn.init(checkpoint_dir=checkpoint_dir, checkpoint_interval=NEVER)
    assert run.managed, "the SDK did not pick up the controller from the environment"
    began = time.perf_counter()
    for step in run.steps(start, start + n + 1):
        if step == start + n:
            break
        loss = train_step(model, opt, data, step)
        run.log(loss=loss)
        run.checkpoint(model=model, optimizer=opt)
    seconds = time.perf_counter() - began
    run.finish()  # sends what is left
    return seconds / n


def sdk_cost_per_step(checkpoint_dir: Path, n: int = 20_000, repeats: int = 5) -> float:
    """Seconds the SDK adds to one step, from a loop whose steps do nothing but the SDK calls: a
    figure the machine's noise cannot hide the way it hides 1% of a 50 ms step. Median of repeats."""
    loss = torch.tensor(1.0)
    costs = []
    for _ in range(repeats):
        run = tfsn.init(checkpoint_dir=checkpoint_dir, checkpoint_interval=NEVER)
        began = time.perf_counter()
        for step in run.steps(0, n + 1):
            if step == n:
                break
            run.log(loss=loss)
            run.checkpoint(model=None)
        with_sdk = time.perf_counter() - began
        run.finish()
        began = time.perf_counter()
        for step in range(n):
            pass
        costs.append((with_sdk - (time.perf_counter() - began)) / n)
    return statistics.median(costs)


@contextmanager
def controller_api(home: Path) -> Iterator[tuple[Store, int]]:
    """A real controller API on 127.0.0.1 with one job, and this process's TFSN_* variables pointing at it."""
    store = Store(home / "tfsn.db")
    spec = JobSpec.model_validate({"name": "bench", "run": "true"}).model_dump(mode="json")
    job = store.create_job("bench", spec, str(home / "train.yaml"), secrets.token_urlsafe(32))
    server = ApiServer(0, store, Controller(store, home, providers={}).handlers)
    server.start()
    for key in [k for k in os.environ if k.startswith("TFSN_")]:  # e.g. a TFSN_CHECKPOINT_INTERVAL would win
        del os.environ[key]
    os.environ.update(TFSN_CONTROLLER_URL=server.url, TFSN_TOKEN=job.token, TFSN_JOB_ID=str(job.id))
    try:
        yield store, job.id
    finally:
        server.shutdown()
        server.server_close()
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of each loop (default 7)")
    parser.add_argument("--steps", type=int, default=50, help="steps per round (default 50)")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    args = parser.parse_args()
    if min(args.rounds, args.steps) < 1:
        parser.error("--rounds and --steps must be >= 1")

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    data = torch.randint(VOCAB, (200_000,))
    n = args.steps
    plain: list[float] = []
    sdk: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tfsn-bench-") as tmp, controller_api(Path(tmp)) as (store, job_id):
        ckpt_dir = Path(tmp) / "checkpoints"
        step = 0
        for i in range(args.rounds + 2):  # a warm-up pair, then plain, sdk, plain, ..., sdk, plain
            seconds = plain_round(model, opt, data, step, n)
            step += n
            if i > 0:
                plain.append(seconds)
            if i > args.rounds:
                break
            seconds = sdk_round(model, opt, data, step, n, ckpt_dir)
            step += n
            if i > 0:
                sdk.append(seconds)
        expected = (args.rounds + 1) * n  # the warm-up round sends too
        records = store.steps(job_id)
        cost = sdk_cost_per_step(ckpt_dir)
        received = len(records)
        with_loss = sum("loss" in r["metrics"] for r in records)
        saved = ckpt_dir.exists()

    p25, plain_med, p75 = quartiles(plain)
    s25, sdk_med, s75 = quartiles(sdk)
    overhead = (sdk_med / plain_med - 1) * 100
    # each sdk round against the mean of the plain rounds either side of it: a linear drift cancels
    pairs = [(b / ((plain[i] + plain[i + 1]) / 2) - 1) * 100 for i, b in enumerate(sdk)]
    pair_lo, pair_med, pair_hi = quartiles(pairs)
    half = 1.57 * (pair_hi - pair_lo) / math.sqrt(len(pairs))  # ~95% interval of a median (box-plot notch)
    ci = (pair_med - half, pair_med + half)
    met = overhead < TARGET_PCT
    conclusive = ci[1] < TARGET_PCT or ci[0] > TARGET_PCT
    print(f"{args.rounds} sdk rounds between {args.rounds + 1} plain ones, {n} steps each; 1 torch thread; tiny-gpt model")
    print_table(["loop", "median ms/step", "IQR ms/step"],
                [["plain", f"{plain_med * 1e3:.2f}", f"{p25 * 1e3:.2f}-{p75 * 1e3:.2f}"],
                 ["tfsn SDK", f"{sdk_med * 1e3:.2f}", f"{s25 * 1e3:.2f}-{s75 * 1e3:.2f}"]])
    print(f"overhead: {overhead:+.2f}% (median sdk / median plain - 1)")
    print(f"per sdk round vs the plain rounds either side: median {pair_med:+.2f}%, "
          f"~95% interval {ci[0]:+.2f}% .. {ci[1]:+.2f}%, IQR {pair_lo:+.2f}% .. {pair_hi:+.2f}%")
    print(f"target < {TARGET_PCT:g}%: {'met' if met else 'NOT met'}" + ("" if conclusive else
          " (inconclusive: the interval straddles the target; use more rounds or a quieter machine)"))
    print(f"SDK cost per step, measured on empty steps: {cost * 1e6:.1f} us = "
          f"{cost / plain_med * 100:.3f}% of a {plain_med * 1e3:.1f} ms step (target < {TARGET_PCT:g}%: "
          f"{'met' if cost / plain_med * 100 < TARGET_PCT else 'NOT met'})")
    print(f"telemetry: {received} step records in the controller's store ({with_loss} with a loss) "
          f"of {expected} expected; checkpoints saved: {'yes (wrong)' if saved else 'none'}")
    if args.json:
        print(json.dumps({"benchmark": "sdk_overhead", "rounds": args.rounds, "steps_per_round": n,
                          "plain_ms": plain_med * 1e3, "sdk_ms": sdk_med * 1e3, "overhead_pct": overhead,
                          "sdk_cost_us_per_step": cost * 1e6, "sdk_cost_pct": cost / plain_med * 100,
                          "paired_overhead_pct": pair_med, "paired_ci95_pct": list(ci), "paired_iqr_pct": [pair_lo, pair_hi],
                          "target_pct": TARGET_PCT, "target_met": met, "conclusive": conclusive, "records_expected": expected,
                          "records_received": received, "checkpoint_saved": saved}))
    return 0 if received == expected == with_loss and not saved else 1


if __name__ == "__main__":
    sys.exit(main())
