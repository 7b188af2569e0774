"""tfsn's generated kernels against eager PyTorch and torch.compile (Inductor) on the training step,
over a broad suite of models, at 1 and 2 threads.

    nice python benchmarks/optimizer_vs_peers.py [--json] [--quick] [--models a,b] [--threads 1,2]
                                                 [--rounds 5] [--steps 10] [--first-batch | --second-batch]
                                                 [--size bench] [--device cuda] [--codegen c|triton]

The suite (`SUITE` below, issue 19): the optimizer's own four models (tests/optimizer_models.py at
`--size`: MLP, GPT-2 block, CNN, embedding + LM head + cross-entropy) and models written as users
write them (tests/user_models.py: a nanoGPT with tied embeddings and SDPA, a Llama-style decoder,
nn.MultiheadAttention, nn.TransformerEncoderLayer, a small ViT, convnets of three sizes with
BatchNorm and pooling, an MLP-mixer, a bf16-autocast MLP, a GRU cell unrolled over a sequence, and
a tiny MLP whose step is mostly call overhead), each at two batch sizes.

One training step = zero_grad, forward, loss, backward, AdamW step. Three peers run it side by side
in one process:
  eager     plain PyTorch;
  inductor  torch.compile(model) and torch.compile(opt.step), default backend and mode;
  tfsn      the same two calls with backend=tfsn (optimizer.backend.make_backend()).
Each peer starts from the same weights, on `--device` (default cpu). tfsn's kernels are C on a CPU
and Triton on a GPU (`--codegen` overrides: triton on a CPU runs under TRITON_INTERPRET=1 only).

Threads: each thread count runs in a process of its own, with OMP_NUM_THREADS and
torch.set_num_threads set to it before anything is compiled. That one setting governs every peer:
ATen's intra-op pool, Inductor's kernels (it compiles `omp parallel num_threads(N)` with N =
torch.get_num_threads()), and tfsn's kernels (`omp parallel for` in the C they generate, run by
torch's own libgomp, whose thread count torch.set_num_threads sets; tfsn's search also prices and
caches plans per thread count).

Compile time is the first step's time minus a steady step, with empty caches (each process points
TORCHINDUCTOR_CACHE_DIR and TFSN_CACHE at a fresh temp folder). Steady figures are medians over
rounds of `steps` steps; rounds interleave the peers so that drift on a shared machine hits them
alike. Targets (issue 19): tfsn >= 1.25x eager and >= 1.10x Inductor, geometric mean over the
suite, at 1 and at 2 threads; no model below 0.95x eager; tfsn's compile time no longer than
Inductor's.
"""
from __future__ import annotations

import argparse
import atexit
import copy
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# This folder holds health.py, which would shadow the `health` package: the repo root goes first.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
_tmp = tempfile.mkdtemp(prefix="tfsn-bench-")
atexit.register(shutil.rmtree, _tmp, ignore_errors=True)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_tmp, "inductor")   # cold compiles for both
os.environ["TFSN_CACHE"] = os.path.join(_tmp, "tfsn")

import torch

from _common import print_table
from optimizer import graphs
from optimizer.backend import STATS, make_backend
from tests import optimizer_models, user_models

PEERS = ("eager", "inductor", "tfsn")
# on a GPU also: Inductor with its CUDA graphs (mode="reduce-overhead"), and tfsn launching its kernels one
# by one (cuda_graphs=False), what each gains from replaying its graphs
GPU_PEERS = ("inductor_cudagraphs", "tfsn_launches")
TARGETS = {"vs_eager": 1.25, "vs_inductor": 1.10, "worst_vs_eager": 0.95}     # issue 19

# name: (module, its case's name, batch sizes); user_models' cases run at their test dimensions
SUITE = {
    "mlp": ("optimizer_models", "mlp", (19, 76)),
    "gpt2_block": ("optimizer_models", "gpt2_block", (3, 12)),
    "cnn": ("optimizer_models", "cnn", (6, 24)),                            # 52x52 images at --size bench
    "lm_head_ce": ("optimizer_models", "lm_head_ce", (3, 12)),
    "gpt": ("user_models", "gpt", (3, 24)),                                 # tied embeddings, causal SDPA
    "llama": ("user_models", "llama", (3, 24)),                             # RMSNorm, RoPE, SwiGLU, SDPA
    "mha": ("user_models", "mha_key_padding", (4, 32)),                     # nn.MultiheadAttention
    "encoder": ("user_models", "encoder_postnorm_relu", (5, 40)),           # nn.TransformerEncoderLayer
    "vit": ("user_models", "vit", (4, 32)),
    "convnet": ("user_models", "convnet", (6, 48)),                         # 15x15 images
    "resnet": ("user_models", "resnet", (4, 32)),                           # 16x16 images, basic blocks
    "mixer": ("user_models", "mixer", (6, 48)),
    "resmlp_bf16": ("user_models", "resmlp_bf16", (13, 104)),               # bf16 autocast
    "gru": ("user_models", "gru", (5, 40)),                                 # nn.GRUCell, 6 steps in Python
    "tiny_mlp": ("user_models", "tiny_mlp", (8, 64)),                       # call overhead dominates
}
QUICK = ("tiny_mlp", "mlp", "convnet", "gpt")


@dataclass(frozen=True)
class BenchCase:
    name: str
    batch_size: int
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], tuple]                       # -> (model inputs, target)
    loss: Callable[[torch.nn.Module, tuple, torch.Tensor], torch.Tensor]
    loss_rtol: float = 1e-4                                         # first loss, tfsn against eager


def bench_cases(names: list[str], size: str, first_batch: bool, second_batch: bool = False) -> list[BenchCase]:
    """The suite's models by name, one case per batch size (or only the first, or only the others)."""
    found = []
    for name in names:
        module, case_name, sizes = SUITE[name]
        for n in sizes[:1] if first_batch else sizes[1:] if second_batch else sizes:
            if module == "optimizer_models":
                c = next(c for c in optimizer_models.suite(size) if c.name == case_name)
                found.append(BenchCase(name, n, c.build, lambda g, c=c, n=n: _split(c.batch(g, n)),
                                       lambda m, x, y, c=c: c.loss(m, (*x, y))))
            else:
                c = user_models.case(case_name)
                found.append(BenchCase(name, n, c.build, lambda g, c=c, n=n: c.batch(g, n),
                                       lambda m, x, y, c=c: c.step(m, x, y)[1], 2.0 ** -5 if c.bf16 else 1e-4))
    return found


def _split(batch: tuple) -> tuple:
    *inputs, target = batch
    return tuple(inputs), target


def make_step(model: torch.nn.Module, case: BenchCase, inputs: tuple, target: torch.Tensor, backend,
              mode: str | None = None):
    """One training step of `model` (compiled with `backend` in `mode`, or eager when None)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd = model if backend is None else torch.compile(model, backend=backend, mode=mode)
    opt_step = opt.step if backend is None else torch.compile(opt.step, backend=backend, mode=mode)

    def step() -> float:
        if mode == "reduce-overhead":   # Inductor's CUDA graph trees: a new step, so last step's outputs may go
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = case.loss(fwd, inputs, target)
        loss.backward()
        opt_step()
        return loss.item()
    return step


def timed(step, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def bench_case(case: BenchCase, rounds: int, steps: int, device: str = "cpu", codegen: str = "c") -> dict:
    torch.manual_seed(0)
    base = case.build().to(device)
    inputs, target = case.batch(torch.Generator().manual_seed(1))
    inputs, target = tuple(t.to(device) for t in inputs), target.to(device)
    backends = {"eager": (None, None), "inductor": ("inductor", None), "tfsn": (make_backend(codegen=codegen), None),
                "inductor_cudagraphs": ("inductor", "reduce-overhead"),
                "tfsn_launches": (make_backend(codegen=codegen, cuda_graphs=False), None)}
    peers = PEERS + (GPU_PEERS if device != "cpu" else ())
    fns, compile_s, first_loss = {}, {}, {}
    before, replays = dict(STATS), graphs.COUNTS["replays"]
    for peer in peers:
        torch._dynamo.reset()
        fns[peer] = make_step(copy.deepcopy(base), case, inputs, target, *backends[peer])
        t0 = time.perf_counter()
        first_loss[peer] = fns[peer]()
        compile_s[peer] = time.perf_counter() - t0
    for peer in peers:      # the reset before a later peer emptied Dynamo's cache: recompiled here, untimed
        fns[peer]()
        fns[peer]()
    times = {p: [] for p in peers}
    for _ in range(rounds):
        for peer in peers:
            times[peer].append(timed(fns[peer], steps))
    med = {p: statistics.median(times[p]) for p in peers}
    for peer in peers:
        compile_s[peer] = max(compile_s[peer] - med[peer], 0.0)
    gpu = {"vs_inductor_cudagraphs": med["inductor_cudagraphs"] / med["tfsn"],
           "cuda_graphs_gain": med["tfsn_launches"] / med["tfsn"],
           "cuda_graph_replays": graphs.COUNTS["replays"] - replays} if device != "cpu" else {}
    return {"model": case.name, "batch": case.batch_size, "ms": {p: med[p] * 1e3 for p in peers},
            "vs_eager": med["eager"] / med["tfsn"], "vs_inductor": med["inductor"] / med["tfsn"], **gpu,
            "compile_s": {"inductor": compile_s["inductor"], "tfsn": compile_s["tfsn"]},
            "loss_matches": abs(first_loss["tfsn"] - first_loss["eager"]) <= case.loss_rtol * max(1.0, abs(first_loss["eager"])),
            "first_loss": {"eager": first_loss["eager"], "tfsn": first_loss["tfsn"]},
            # what tfsn compiled: graphs lowered to generated kernels, and graphs left whole to ATen
            "tfsn_graphs": {k: STATS[k] - before[k] for k in ("graphs", "kernels", "aten_graphs")}}


def geomean(values) -> float:
    values = list(values)
    return math.exp(statistics.mean(math.log(v) for v in values)) if values else float("nan")


def summary(results: list[dict]) -> dict:
    """Geomeans, the worst model, compile totals and the targets met, over the cases that ran."""
    ran = [r for r in results if "error" not in r]
    geo = {k: geomean(r[k] for r in ran) for k in ("vs_eager", "vs_inductor")}
    compile_total = {k: sum(r["compile_s"][k] for r in ran) for k in ("inductor", "tfsn")}
    worst = min(ran, key=lambda r: r["vs_eager"]) if ran else None
    targets = {f"vs_eager>={TARGETS['vs_eager']}": geo["vs_eager"] >= TARGETS["vs_eager"],
               f"vs_inductor>={TARGETS['vs_inductor']}": geo["vs_inductor"] >= TARGETS["vs_inductor"],
               f"every model>={TARGETS['worst_vs_eager']}x eager": bool(worst) and worst["vs_eager"] >= TARGETS["worst_vs_eager"],
               "compile<=inductor": compile_total["tfsn"] <= compile_total["inductor"],
               "every case ran, first loss as eager's": len(ran) == len(results) and all(r["loss_matches"] for r in ran)}
    return {"geomean": geo, "compile_total_s": compile_total, "targets": targets,
            "worst": None if worst is None else {"model": worst["model"], "batch": worst["batch"],
                                                 "vs_eager": worst["vs_eager"]}}


def run_one(args: argparse.Namespace) -> int:
    """The suite at one thread count, in this process: a row per case as it finishes, then the table."""
    if args.threads:
        torch.set_num_threads(args.threads[0])
    codegen = args.codegen or ("c" if args.device == "cpu" else "triton")
    where = f"{torch.get_num_threads()} threads" if args.device == "cpu" else torch.cuda.get_device_name(args.device)
    results = []
    for case in bench_cases(args.models, args.size, args.first_batch, args.second_batch):
        try:
            r = bench_case(case, args.rounds, args.steps, args.device, codegen)
        except Exception as e:          # noqa: BLE001  one failing model costs its row, reported, not the run
            r = {"model": case.name, "batch": case.batch_size, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
        results.append(r)
        print(f"[{where}] {case.name} batch {case.batch_size}: " + (r["error"] if "error" in r else
              f"tfsn {r['vs_eager']:.2f}x eager, {r['vs_inductor']:.2f}x inductor, compile s inductor "
              f"{r['compile_s']['inductor']:.1f} tfsn {r['compile_s']['tfsn']:.1f}"
              + ("" if r["loss_matches"] else f"; FIRST LOSS DIFFERS: {r['first_loss']}")), file=sys.stderr, flush=True)
    rows = [[r["model"], r["batch"], "failed: " + r["error"][:60], "", "", "", "", "", "", ""] if "error" in r else
            [r["model"], r["batch"], *(f"{r['ms'][p]:.2f}" for p in PEERS), f"{r['vs_eager']:.2f}x",
             f"{r['vs_inductor']:.2f}x", f"{r['compile_s']['inductor']:.1f}", f"{r['compile_s']['tfsn']:.1f}",
             f"{r['tfsn_graphs']['kernels']} / {r['tfsn_graphs']['aten_graphs']}"
             + ("" if r["loss_matches"] else "  LOSS DIFFERS")] for r in results]
    s = summary(results)
    rows.append(["geomean / total", "", "", "", "", f"{s['geomean']['vs_eager']:.2f}x",
                 f"{s['geomean']['vs_inductor']:.2f}x", f"{s['compile_total_s']['inductor']:.1f}",
                 f"{s['compile_total_s']['tfsn']:.1f}", ""])
    print(f"training step (forward, backward, AdamW), median ms over {args.rounds} rounds x {args.steps} steps, "
          f"{where}, tfsn codegen {codegen}")
    print_table(["model", "batch", "eager ms", "inductor ms", "tfsn ms", "tfsn vs eager", "tfsn vs inductor",
                 "inductor compile s", "tfsn compile s", "tfsn kernels / graphs left to ATen"], rows)
    if args.device != "cpu":
        print("on the GPU, with CUDA graphs: Inductor's (mode='reduce-overhead') and tfsn's (default; "
              "'launches': cuda_graphs=False)")
        print_table(["model", "batch", "inductor cudagraphs ms", "tfsn launches ms", "tfsn vs inductor cudagraphs",
                     "tfsn graphs gain", "tfsn graph replays"],
                    [[r["model"], r["batch"], f"{r['ms']['inductor_cudagraphs']:.2f}", f"{r['ms']['tfsn_launches']:.2f}",
                      f"{r['vs_inductor_cudagraphs']:.2f}x", f"{r['cuda_graphs_gain']:.2f}x", r["cuda_graph_replays"]]
                     for r in results if "error" not in r])
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in s["targets"].items()))
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "device": args.device, "codegen": codegen,
                          "results": results, **s}))
    return 0


def run_threads(args: argparse.Namespace) -> int:
    """Each thread count in a process of its own, then the ratios side by side."""
    runs = []
    for n in args.threads:
        cmd = [sys.executable, __file__, "--threads", str(n), "--json", "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--size", args.size, "--device", args.device,
               "--models", ",".join(args.models), *(["--first-batch"] if args.first_batch else []),
               *(["--second-batch"] if args.second_batch else []),
               *(["--codegen", args.codegen] if args.codegen else [])]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": str(n)})
        lines = proc.stdout.rstrip("\n").split("\n")
        if proc.returncode != 0 or not lines[-1].startswith("{"):
            print(proc.stdout, end="")
            print(f"the {n}-thread run failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        print("\n".join(lines[:-1]), flush=True)
        runs.append(json.loads(lines[-1]))
    by_case = {}
    for run in runs:
        for r in run["results"]:
            by_case.setdefault((r["model"], r["batch"]), {})[run["threads"]] = r
    header = ["model", "batch"]
    for run in runs:
        header += [f"vs eager {run['threads']}t", f"vs inductor {run['threads']}t"]
    rows = [[model, batch, *(c for run in runs for c in _ratios(per.get(run["threads"])))]
            for (model, batch), per in by_case.items()]
    rows.append(["geomean", "", *(f"{run['geomean'][k]:.2f}x" for run in runs for k in ("vs_eager", "vs_inductor"))])
    rows.append(["compile s (inductor / tfsn)", "", *(c for run in runs for c in
                 (f"{run['compile_total_s']['inductor']:.0f}", f"{run['compile_total_s']['tfsn']:.0f}"))])
    print(f"\ntfsn's training step against eager and Inductor (ratio > 1: tfsn faster), threads {args.threads}")
    print_table(header, rows)
    targets = {f"{k} at {run['threads']} threads": v for run in runs for k, v in run["targets"].items()}
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in targets.items()))
    if args.json:
        print(json.dumps({"runs": runs, "targets": targets}))
    return 0


def _ratios(r: dict | None) -> tuple[str, str]:
    if r is None or "error" in r:
        return ("failed", "") if r else ("", "")
    flag = "" if r["loss_matches"] else "!"
    return f"{r['vs_eager']:.2f}x{flag}", f"{r['vs_inductor']:.2f}x{flag}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        print(f"--device {args.device}: no such device here (torch.cuda.is_available() is "
              f"{torch.cuda.is_available()})", file=sys.stderr)
        return 2
    return run_one(args) if len(args.threads) <= 1 else run_threads(args)


def _thread_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give thread counts >= 1, comma separated (e.g. 1,2)")
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", "--only", action="append", default=[], metavar="NAME[,NAME]",
                        help="run only these models (repeatable, comma separated; default: the whole suite)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a subset in a few minutes: {', '.join(QUICK)}, first batch size, 3 rounds x 5 steps")
    batches = parser.add_mutually_exclusive_group()
    batches.add_argument("--first-batch", action="store_true", help="each model at its first batch size only")
    batches.add_argument("--second-batch", action="store_true", help="each model at its other batch sizes only")
    parser.add_argument("--threads", type=_thread_counts, default=None,
                        help="thread counts, comma separated (default 1,2 on a CPU; torch's on a GPU)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per peer (default 5)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 10)")
    parser.add_argument("--size", choices=("small", "bench"), default="bench",
                        help="size of tests/optimizer_models.py's four (default bench)")
    parser.add_argument("--device", default="cpu", help="where the peers run: cpu (default) or cuda")
    parser.add_argument("--codegen", choices=("c", "triton"),
                        help="tfsn's kernels: c (the default on a CPU) or triton (the default on a GPU)")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    args = parser.parse_args(argv)
    args.models = [m for arg in args.models for m in arg.split(",") if m]
    unknown = sorted(set(args.models) - set(SUITE))
    if unknown:
        parser.error(f"--models: no model {', '.join(unknown)} in the suite (it has {', '.join(SUITE)})")
    if args.quick:
        args.models, args.first_batch, args.second_batch = args.models or list(QUICK), True, False
        args.rounds, args.steps = args.rounds or 3, args.steps or 5
    args.models = args.models or list(SUITE)
    args.rounds, args.steps = args.rounds or 5, args.steps or 10
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.threads is None:
        args.threads = [1, 2] if args.device == "cpu" else []
    return args


if __name__ == "__main__":
    sys.exit(main())
