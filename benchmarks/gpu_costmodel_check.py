"""The cost model against the chip it runs on, for what needs no code generator: library GEMMs at
several shapes in fp32, TF32 and bf16, a softmax, a LayerNorm, attention (SDPA) forward and backward,
a convolution; each run by eager PyTorch on the device and timed, and priced by the model as tfsn
prices that graph (optimizer.search with library GEMMs: externs by optimizer/externs.py, the softmax
and LayerNorm as one generated kernel each at its best schedule).

    python benchmarks/gpu_costmodel_check.py [--device cuda|cpu] [--spec h200] [--quick] [--json]

On a GPU the spec is the chip's (by its name, or --spec); on this CPU it is the host's spec (the
calibrated one when `tfsn calibrate` has run), so that the script is tested here. It prints, per case,
predicted and measured microseconds and their ratio, then:
  spearman        rank correlation of predicted vs measured over the cases of one class (gemm,
                  attention, ...) and over all of them (the issue's target: >= 0.8 on the GPU)
  median ratio    measured / predicted per class: how far each class's documented efficiency is off
  top1 regret     where one computation has two eager forms (attention: fused SDPA or matmul-softmax-
                  matmul; a GEMM with B transposed or not), measured time of the form the model
                  predicts faster / the faster measured one
Generated kernels: for a few fused groups as tfsn plans them (a softmax, a LayerNorm, a bias + GELU,
a bias gradient (a column sum), a GEMM with its bias + GELU epilogue, in fp32; and, held out of the fit of the
model's constants, a LayerNorm, a bias + GELU and a bias gradient at a GPT-2 block's sizes in bf16), up to 8
launch shapes of the GPU schedule space
(optimizer/space.py: the model's pick and others evenly spread over its ranking; for the GEMM, also its
product left to cuBLAS with the epilogue's program after it) are rendered as Triton, run, and timed: per
kernel, Spearman of predicted vs measured over its launch shapes, and the top-1 regret (measured time of
the model's pick / the fastest measured). On a CPU this part runs only under TRITON_INTERPRET=1, at small
shapes and priced for an H100 (to test the script; the times mean nothing).
Launch cost (GPU only): microseconds per launch of a tiny generated kernel, launched one by one from Python
and replayed from a CUDA graph, beside the spec's launch_overhead_us.
Timing: CUDA events around repeated calls after a warm-up (median of batches); on the CPU, the median
of perf_counter batches. The machine may be shared: medians and ratios, never one absolute time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _common import print_table  # noqa: E402
from optimizer import ir, search  # noqa: E402
from optimizer.backend import decompositions, gpu_spec  # noqa: E402
from optimizer.costmodel import spearman  # noqa: E402
from optimizer.hardware import HardwareSpec, cpu_spec, find_hardware  # noqa: E402

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    name: str
    kind: str                                   # the class it tests: gemm, attention, conv, softmax, layernorm
    precision: str                              # fp32 | tf32 | bf16
    fn: Callable
    shapes: tuple                               # input shapes; float inputs of `precision`'s dtype
    grad: bool = False                          # time forward + backward (inputs require grad)
    alternative: str = ""                       # a name shared by two forms of one computation (top-1 regret)


def _mm(a, b):
    return a @ b


def _mm_t(a, b):
    return a @ b.t()


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _attention_math(q, k, v):
    t = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


def _softmax(x):
    return torch.softmax(x, dim=-1)


def _layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def _conv(x, w):
    return F.conv2d(x, w, padding=1)


def cases(device: str, quick: bool) -> list[Case]:
    """The cases of a device: GPU shapes large enough to be library-bound, CPU shapes that run in ms."""
    gpu = device != "cpu"
    gemms = ([(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 1024, 4096), (2048, 8192, 1024)]
             if gpu else [(256, 256, 256), (512, 768, 768), (1024, 1024, 1024), (2048, 256, 1024)])
    precisions = ("fp32", "tf32", "bf16") if gpu else ("fp32",)
    if quick:
        gemms = gemms[:3]
    found = [Case(f"mm {m}x{k}x{n} {p}", "gemm", p, _mm, ((m, k), (k, n))) for p in precisions for m, k, n in gemms]
    m, k, n = gemms[1]
    for p in precisions[-1:]:
        found += [Case(f"mm {m}x{k}x{n} {p} (B)", "gemm", p, _mm, ((m, k), (k, n)), alternative=f"mm {p}"),
                  Case(f"mm {m}x{k}x{n} {p} (B^T)", "gemm", p, _mm_t, ((m, k), (n, k)), alternative=f"mm {p}")]
    p = "bf16" if gpu else "fp32"
    rows = [(8192, 8192), (65536, 1024)] if gpu else [(2048, 1024), (512, 4096)]
    found += [Case(f"softmax {r}x{c} {p}", "softmax", p, _softmax, ((r, c),)) for r, c in rows]
    found += [Case(f"layernorm {r}x{c} {p}", "layernorm", p, _layernorm, ((r, c), (c,), (c,))) for r, c in rows]
    heads = [(8, 16, 2048, 64), (4, 32, 4096, 128)] if gpu else [(4, 8, 256, 64), (2, 8, 512, 64)]
    for b, h, t, d in heads[:1] if quick else heads:
        qkv = ((b, h, t, d),) * 3
        found += [Case(f"sdpa {b}x{h}x{t}x{d} {p}", "attention", p, _sdpa, qkv, alternative=f"attention {t}"),
                  Case(f"sdpa {b}x{h}x{t}x{d} {p} fwd+bwd", "attention", p, _sdpa, qkv, grad=True),
                  Case(f"matmul-softmax-matmul {b}x{h}x{t}x{d} {p}", "attention", p, _attention_math, qkv,
                       alternative=f"attention {t}")]
    convs = [((32, 64, 56, 56), (128, 64, 3, 3)), ((64, 256, 14, 14), (256, 256, 3, 3))] if gpu \
        else [((8, 32, 28, 28), (64, 32, 3, 3)), ((8, 64, 14, 14), (64, 64, 3, 3))]
    found += [Case(f"conv {x[0]}x{x[1]}x{x[2]}x{x[3]} -> {w[0]} {p}", "conv", p, _conv, (x, w)) for x, w in convs]
    return found


@contextlib.contextmanager
def float32_precision(precision: str):
    """TF32 on for a `tf32` case, off otherwise (torch's default): for the capture and for the run."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _inputs(case: Case, device: str, fake: bool) -> list[torch.Tensor]:
    dtype = DTYPES[case.precision]
    make = torch.empty if fake else torch.randn
    return [make(s, dtype=dtype, device=device, requires_grad=case.grad and not fake) for s in case.shapes]


def _step(case: Case) -> Callable:
    if not case.grad:
        return case.fn

    def forward_backward(*xs):
        return torch.autograd.grad(case.fn(*xs).sum(), xs)
    return forward_backward


def predict(case: Case, spec: HardwareSpec) -> float:
    """The model's seconds for the case's graph as tfsn prices it, with library GEMMs (on a CPU, on the
    threads torch runs eager with)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    with float32_precision(case.precision):
        shapes = [torch.empty(s, dtype=DTYPES[case.precision], requires_grad=case.grad) for s in case.shapes]
        gm = make_fx(_step(case), decomposition_table=decompositions(), tracing_mode="fake")(*shapes)
        graph = ir.from_fx(gm, half=True)
    threads = torch.get_num_threads() if spec.kind == "cpu" else None
    return search.search_graph(graph, spec, gemm=False, timing=False, threads=threads).predicted_s


def measure(case: Case, device: str, budget_s: float = 0.5, xs: list | None = None) -> float:
    """Median seconds of one call on `device` (CUDA events on a GPU), on `xs` or random inputs."""
    with float32_precision(case.precision):
        xs = xs if xs is not None else _inputs(case, device, fake=False)
        step = _step(case)
        for _ in range(3):
            step(*xs)
        if device == "cpu":
            t0, reps = time.perf_counter(), 0
            while reps < 3 or time.perf_counter() - t0 < budget_s / 10:
                step(*xs)
                reps += 1
            batches = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(reps):
                    step(*xs)
                batches.append((time.perf_counter() - t0) / reps)
            return statistics.median(batches)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(*xs)
        end.record()
        torch.cuda.synchronize(device)
        reps = max(1, min(200, int(budget_s / 10 / max(start.elapsed_time(end) * 1e-3, 1e-6))))
        batches = []
        for _ in range(7):
            start.record()
            for _ in range(reps):
                step(*xs)
            end.record()
            torch.cuda.synchronize(device)
            batches.append(start.elapsed_time(end) * 1e-3 / reps)
        return statistics.median(batches)


def chip_spec(device: str, name: str | None) -> HardwareSpec:
    """The spec of `--spec`, or of the device: the GPU's name (NVIDIA H100 80GB HBM3 -> H100), this CPU's."""
    if name:
        spec = find_hardware(name)
        if spec is None:
            sys.exit(f"gpu_costmodel_check: --spec {name!r} is not a chip of configs/hardware")
        return spec
    if device == "cpu":
        return cpu_spec()
    spec = gpu_spec(device)
    if spec is not None:
        return spec
    sys.exit(f"gpu_costmodel_check: no spec in configs/hardware for {torch.cuda.get_device_name(device)!r}; "
             "name one with --spec")


def _gelu_bias(x, b):
    return F.gelu(x + b)


def _linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


def _column_sum(x):
    return x.sum(0)


def generated_kernels(device: str, spec: HardwareSpec, quick: bool, deadline: float = float("inf")) -> dict:
    """Predicted vs measured for launch shapes of tfsn's own Triton kernels (see the module's docstring); a kernel
    not begun by `deadline` (time.monotonic()) is said to be skipped, so that the JSON line still comes."""
    import os

    from torch.fx.experimental.proxy_tensor import make_fx

    from optimizer import costmodel, features, fusion
    from optimizer.codegen import triton as tt
    from optimizer.runtime import CompiledGraph
    from optimizer.schedule import DEFAULT
    from optimizer.space import gpu_kernel_space
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"error": "not run on a CPU: set TRITON_INTERPRET=1 to test the script"}
    big = device != "cpu"
    r, c = (32768, 4096) if big else (64, 128)
    m, k, n = (2048, 2048, 2048) if big else (32, 48, 64)
    t, d = (8192, 768) if big else (48, 64)     # a GPT-2 block's tokens x width (12 x 1024 x 768 at --size bench)
    fp32, bf16 = torch.float32, torch.bfloat16
    graphs = [("softmax", _softmax, ((r, c),), fp32), ("layernorm", _layernorm, ((r, c), (c,), (c,)), fp32),
              ("bias+gelu", _gelu_bias, ((r, c), (c,)), fp32), ("column sum", _column_sum, ((r, c),), fp32),
              # held out: the model's constants were fitted to the five others on an H100 (2026-12-06); these
              # are GPT-2's own sizes in bf16, for a check the fit has not seen (before the GEMM, whose 7 shapes
              # compile the longest, should --budget-s run out)
              ("held out: layernorm bf16", _layernorm, ((t, d), (d,), (d,)), bf16),
              ("held out: bias+gelu bf16", _gelu_bias, ((t, 4 * d), (4 * d,)), bf16),
              ("held out: column sum bf16", _column_sum, ((t, 4 * d),), bf16),
              ("gemm+bias+gelu", _linear_gelu, ((m, k), (n, k), (n,)), fp32)]
    per_kernel, shapes_each = {}, 6 if quick else 8
    for name, fn, shapes, dtype in graphs:
        if time.monotonic() > deadline:
            per_kernel[name] = {"error": "skipped: --budget-s was spent"}
            continue
        xs = [torch.randn(sh, device=device, dtype=dtype) for sh in shapes]
        gm = make_fx(fn, decomposition_table=decompositions())(*xs)
        graph = ir.from_fx(gm, ir.graph_device(xs), half=True)
        plan = fusion.plan(graph, gemm=True)
        g = max((i for i, grp in enumerate(plan.groups) if grp.kind != "extern"),
                key=lambda i: (plan.groups[i].kind == "gemm", len(plan.groups[i].nodes)))
        kernel = features.kernel_features(graph, plan.groups[g], plan.buffers)
        cands = gpu_kernel_space(0, kernel)
        predicted = costmodel.predict_gpu(costmodel.FeatureTable([kernel]), cands, spec)
        order = [int(i) for i in np.argsort(predicted, kind="stable") if np.isfinite(predicted[i])]
        picks = list(dict.fromkeys(order[round(j * (len(order) - 1) / max(shapes_each - 1, 1))]
                                   for j in range(shapes_each)))
        picks += [i for i in order if cands.generated[i] == 0 and i not in picks][:1] if kernel.kind == costmodel.GEMM \
            else []     # a GEMM's product by the library (cuBLAS), beside the tiles: what the search times too
        built = []
        for row in picks:
            schedules = [DEFAULT] * len(plan.groups)
            schedules[g] = cands.schedule(row)
            source, kernels = tt.write_source(graph, plan.groups, plan.buffers, schedules, plan.inplace)
            built.append((row, schedules[g], kernels, tt.TritonLibrary(source)))
        # the shapes compiled side by side (each compile's LLVM and ptxas run outside the GIL), not one by one at
        # their first launch: 30-40 compiles in a row took most of this part's time limit. The first alone: it
        # makes Triton's driver, whose setup is not locked
        built[0][3].precompile(graph, built[0][2])
        with ThreadPoolExecutor(max_workers=len(built)) as pool:
            list(pool.map(lambda b: b[3].precompile(graph, b[2]), built[1:]))
        rows, failed = [], []
        for row, schedule, kernels, lib in built:
            shape = {f: getattr(schedule, f) for f in ("chunk", "gemm", "gemm_block_rows", "gemm_nr", "gemm_kc",
                                                       "gemm_mr", "gemm_stages")}
            compiled = CompiledGraph(graph, plan.groups, kernels, lib, plan.inplace)
            case = Case(name, "generated", "bf16" if dtype == bf16 else "fp32",
                        lambda *a, compiled=compiled: compiled(list(a)), shapes)
            try:
                measured = measure(case, device, xs=xs)
            except Exception as e:  # noqa: BLE001 - Triton refuses a shape the model fits (OutOfResources): said, not fatal
                failed.append({"schedule": shape, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            rows.append({"schedule": shape, "row": row, "predicted_s": float(predicted[row]), "measured_s": measured})
        if not rows:
            per_kernel[name] = {"error": "no launch shape ran", "failed": failed}
            continue
        best = min(r["measured_s"] for r in rows)
        pick = rows[0] if rows[0]["row"] == picks[0] else None      # the model's own pick, if it ran
        per_kernel[name] = {"spearman": round(spearman([r["predicted_s"] for r in rows],
                                                       [r["measured_s"] for r in rows]), 3),
                            "top1_regret": round(pick["measured_s"] / best, 3) if pick else None,
                            "pick_measured_over_predicted": round(pick["measured_s"] / pick["predicted_s"], 3)
                            if pick else None,
                            "shapes": rows, **({"failed": failed} if failed else {})}
    return per_kernel


LAUNCHES = 200      # launches per timed batch in launch_costs


def launch_costs(device: str, spec: HardwareSpec) -> dict:
    """Microseconds per launch of a tiny generated kernel (x + 1 over 1024 floats), the median of 5 batches
    of LAUNCHES: launched one by one from Python, and replayed from a CUDA graph of them (what a step's
    graphs pay, optimizer/graphs.py). What the GPU specs' launch_overhead_us (an order of magnitude from
    NVIDIA's blog) stands for, measured."""
    if device == "cpu":
        return {"error": "not on a CPU"}
    from torch.fx.experimental.proxy_tensor import make_fx

    from optimizer import fusion, graphs
    from optimizer import measure as timing
    from optimizer.codegen import triton as tt
    from optimizer.schedule import DEFAULT
    x = torch.randn(1024, device=device)
    graph = ir.from_fx(make_fx(lambda t: t + 1)(x), ir.graph_device([x]))
    plan = fusion.plan(graph)
    source, kernels = tt.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups), plan.inplace)
    kernel = next(k for k in kernels if k is not None)
    launch = tt.TritonLibrary(source).launcher(kernel)
    tensors = [timing.buffer(graph, p, device=device) for p in kernel.params]
    launch(tensors)

    def per_launch_us(run: Callable[[], object]) -> float:
        samples = []
        for _ in range(5):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize(device)
            samples.append((time.perf_counter() - t0) / LAUNCHES * 1e6)
        return round(statistics.median(samples), 2)
    launches = per_launch_us(lambda: [launch(tensors) for _ in range(LAUNCHES)])
    _, replay = graphs.CudaRecorder(torch.device(device)).capture(
        lambda _inputs: [launch(tensors) for _ in range(LAUNCHES)], [])
    return {"launched_us": launches, "graph_replayed_us": per_launch_us(lambda: replay([])),
            "spec_launch_overhead_us": spec.launch_overhead_us}


def summarize(rows: list[dict]) -> dict:
    """Spearman and median measured/predicted per class and overall; top-1 regret per alternative pair."""
    by_kind: dict[str, list[dict]] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)
    per_class = {k: {"cases": len(v), "median_ratio": round(statistics.median(r["ratio"] for r in v), 3),
                     "spearman": round(spearman([r["predicted_s"] for r in v], [r["measured_s"] for r in v]), 3)
                     if len(v) > 2 else None} for k, v in by_kind.items()}
    regrets = {}
    for alt in sorted({r["alternative"] for r in rows if r["alternative"]}):
        pair = [r for r in rows if r["alternative"] == alt]
        picked = min(pair, key=lambda r: r["predicted_s"])
        regrets[alt] = round(picked["measured_s"] / min(r["measured_s"] for r in pair), 3)
    return {"spearman": round(spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]), 3),
            "classes": per_class, "top1_regret": regrets,
            "max_top1_regret": max(regrets.values()) if regrets else None}


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (default where there is one) or cpu")
    parser.add_argument("--spec", help="the chip's spec (configs/hardware name); default: the device's")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no generated kernel after this many seconds (the rest are reported skipped)")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        parser.error(f"--device {args.device}: no CUDA device here; use --device cpu")
    spec = chip_spec(args.device, args.spec)
    rows = []
    for case in cases(args.device, args.quick):
        predicted, measured = predict(case, spec), measure(case, args.device)
        rows.append({"case": case.name, "kind": case.kind, "precision": case.precision,
                     "alternative": case.alternative, "predicted_s": predicted, "measured_s": measured,
                     "ratio": measured / predicted if predicted > 0 else float("inf")})
    where = torch.cuda.get_device_name(args.device) if args.device != "cpu" else f"cpu, {torch.get_num_threads()} threads"
    print(f"cost model vs eager PyTorch on {where}, spec {spec.name}")
    print_table(["case", "predicted us", "measured us", "measured/predicted"],
                [[r["case"], f"{r['predicted_s'] * 1e6:.1f}", f"{r['measured_s'] * 1e6:.1f}", f"{r['ratio']:.2f}"]
                 for r in rows])
    summary = summarize(rows)
    print_table(["class", "cases", "spearman", "median measured/predicted"],
                [[k, v["cases"], v["spearman"] if v["spearman"] is not None else "-", v["median_ratio"]]
                 for k, v in summary["classes"].items()])
    print(f"spearman over all cases: {summary['spearman']}; top-1 regret: "
          + ", ".join(f"{k} {v}" for k, v in summary["top1_regret"].items()))
    try:    # priced for a GPU: on a CPU (TRITON_INTERPRET=1, a test of the script) an H100's spec stands in
        generated = generated_kernels(args.device, spec if spec.kind == "gpu" else find_hardware("h100"), args.quick,
                                      started + args.budget_s)
    except ImportError as e:
        generated = {"error": f"triton is not installed ({e})"}
    if "error" in generated:
        print(f"generated kernels: {generated['error']}")
    else:
        print("generated Triton kernels, launch shapes of the GPU space, predicted vs measured:")
        print_table(["kernel", "shapes", "spearman", "top-1 regret", "pick measured/predicted"],
                    [[k, len(v["shapes"]), v["spearman"], v["top1_regret"], v["pick_measured_over_predicted"]]
                     if "shapes" in v else [k, 0, "-", "-", v["error"]] for k, v in generated.items()])
        for k, v in generated.items():
            for f in v.get("failed", []):
                print(f"  {k}: launch shape {f['schedule']} failed: {f['error']}")
    try:
        launches = launch_costs(args.device, spec)
    except Exception as e:     # noqa: BLE001 - a figure missing, not the script's other figures
        launches = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(f"a tiny generated kernel's launch: {launches}")
    if args.json:
        print(json.dumps({"device": where, "spec": spec.name, "torch": torch.__version__, **summary,
                          "generated_kernels": generated, "launch_us": launches,
                          "cases": [{k: v for k, v in r.items()} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
