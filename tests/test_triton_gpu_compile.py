"""The generated Triton kernels compile for NVIDIA GPUs, checked on this CPU: Triton compiles ahead for a
named target (its frontend, its MLIR passes, LLVM and ptxas, all in the wheel), as it does at a kernel's
first launch on the GPU. The interpreter (tests/test_optimizer_triton.py) runs the kernels' values but not
that compiler: a literal out of an int8's range passed it and was refused on the H200, at compile time.

Kernels come from the suite's graphs, forward and backward, in fp32 and bf16, under the heuristic schedule
(library GEMMs), generated GEMM tiles and the H100 model's launch shapes, and from the pointwise op table of
tests/test_optimizer_ops.py in each of its dtypes. Compiled for an H100 (sm_90) and, for the GEMM tiles, an
A100 (sm_80), whose matrix instructions differ."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

from optimizer import fusion, ir, search  # noqa: E402
from optimizer.backend import decompositions  # noqa: E402
from optimizer.codegen import triton as tt  # noqa: E402
from optimizer.codegen.triton_combo import write_program  # noqa: E402
from optimizer.hardware import find_hardware  # noqa: E402
from optimizer.schedule import DEFAULT, Schedule  # noqa: E402
from tests import test_optimizer_ops as ops_table  # noqa: E402
from tests.optimizer_models import suite  # noqa: E402

H100, A100 = GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)
GENERATED = Schedule(gemm="generated")
COMPILED: set = set()          # kernels compiled already (the same source, signature and launch), per target
WORKER = Path(__file__).with_name("triton_compile_worker.py")
POINTERS = {"float32": "*fp32", "float64": "*fp64", "bfloat16": "*bf16", "float16": "*fp16", "int64": "*i64",
            "int32": "*i32", "int16": "*i16", "int8": "*i8", "uint8": "*u8", "bool": "*i1"}


@pytest.fixture(autouse=True)
def private_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "tfsn"))


def compile_graph(graph: ir.Graph, plan: fusion.Plan, schedules, target: GPUTarget, path: Path,
                  gemms_only: bool = False, ptx: dict[str, str] | None = None) -> int:
    """Every kernel the graph launches (or its GEMMs'), compiled for `target` as its launch would (pointer
    dtypes and 16-byte alignment, block sizes, warps, stages), each distinct one once, one at a time (CPython
    3.11's ast.parse is not thread-safe: side by side, 1 run in 3 failed with "AST constructor recursion depth
    mismatch"), in a process without the interpreter (tests/triton_compile_worker.py); Triton's error, with the
    kernel's name and source, if one does not compile. How many were; each one's PTX into `ptx` if given."""
    program = write_program(graph, plan.groups, plan.buffers, schedules, plan.inplace)
    path.write_text(program.source)
    kernels = program.kernels
    todo = {}
    for group, k in zip(program.groups, kernels):
        if k is None or (k.product is not None and not k.product.epilogue) or gemms_only and group.kind != "gemm":
            continue
        names = [f"p{i}" for i in range(len(k.params))] + (["prod"] if k.product is not None else []) + \
            [f"s{j}" for j in range(len(k.split.dtypes) if k.split is not None else 0)]
        pointers = {name: POINTERS[str(d).removeprefix("torch.")] for name, d in zip(names, k.pointer_dtypes(graph))}
        source = unnamed(k)
        for launched, (name, _, launch) in enumerate(k.launches()):         # a split reduction's second kernel too
            meta = dict(launch)
            options = {option: meta.pop(option) for option in ("num_warps", "num_stages") if option in meta} | \
                tt.nvidia_launch_options()          # what TritonLibrary launches with on an NVIDIA GPU
            signature = pointers | {constant: "constexpr" for constant in meta}
            key = (source, launched, tuple(signature.items()), tuple(meta.items()), tuple(options.items()),
                   target.arch)
            if key not in COMPILED or ptx is not None:
                todo[key] = {"name": name, "signature": signature, "constexprs": meta, "options": options}
    if todo:
        job = path.with_suffix(".json")
        job.write_text(json.dumps({"module": str(path), "target": [target.backend, target.arch, target.warp_size],
                                   "kernels": list(todo.values()), "ptx": ptx is not None}))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        run = subprocess.run([sys.executable, str(WORKER), str(job)], capture_output=True, text=True, env=env,
                             timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        sources = {name: k.source for k in kernels if k is not None for name, _, _ in k.launches()}
        result = json.loads(run.stdout.strip().splitlines()[-1])
        failed = result["failed"]
        if ptx is not None:
            ptx.update(result["ptx"])
        assert not failed, "\n".join(f"{f['name']} does not compile for sm_{target.arch}: {f['error']}\n"
                                      f"{sources[f['name']]}" for f in failed)
    COMPILED.update(todo)
    return len(todo)


def unnamed(kernel: tt.TritonKernel) -> str:
    """The kernel's source with its functions' names numbered in launch order: the same body under another
    name (a second GPT block's kernels, a kernel the H100 model's schedule left as the heuristic's) compiles
    to the same code, so it is compiled once (a quarter of the suite's kernels in fp32)."""
    source = kernel.source
    for launched, (name, _, _) in enumerate(kernel.launches()):
        source = re.sub(rf"\b{name}\b", f"kernel{launched}", source)
    return source


def suite_graphs(dtype: torch.dtype):
    """The suite's models at test size: the loss and every parameter's gradient, as one graph each."""
    g = torch.Generator().manual_seed(0)
    for case in suite("small"):
        torch.manual_seed(0)
        model = case.build().to(dtype)
        batch = [x.to(dtype) if x.is_floating_point() else x for x in case.batch(g)]
        names = [name for name, _ in model.named_parameters()]

        def step(*params, case=case, model=model, names=names):
            as_model = (lambda x: torch.func.functional_call(model, dict(zip(names, params[:len(names)])), (x,)))
            loss = case.loss(as_model, tuple(params[len(names):]))
            return (loss, *torch.autograd.grad(loss.float(), params[:len(names)]))
        args = [p.detach().requires_grad_() for p in model.parameters()] + batch
        yield case.name, ir.from_fx(make_fx(step, decomposition_table=decompositions())(*args), half=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_suites_kernels_compile_for_an_h100(dtype, tmp_path):
    """Each suite model's forward and backward, under the heuristic schedule (GEMMs by the library, their
    epilogues generated), generated GEMM tiles, and the launch shapes the H100 cost model picks."""
    spec = find_hardware("h100")
    compiled = 0
    for name, graph in suite_graphs(dtype):
        plan = fusion.plan(graph)
        picked = search.search_graph(graph, spec, timing=False)
        variants = [("default", plan, [DEFAULT] * len(plan.groups)), ("h100", picked.plan, picked.schedules)]
        if dtype == torch.float32:         # bf16 tiles: the A100 test's, and the model's picks here
            variants.append(("generated", plan, [GENERATED] * len(plan.groups)))
        for tag, p, schedules in variants:
            compiled += compile_graph(graph, p, schedules, H100, tmp_path / f"{name}_{tag}.py")
    assert compiled > 20


def test_generated_gemm_tiles_compile_for_an_a100(tmp_path):
    """sm_80 multiplies with mma, sm_90 with wgmma: the tiles go through another lowering there."""
    compiled = 0
    for dtype in (torch.float32, torch.bfloat16):
        for name, graph in suite_graphs(dtype):
            plan = fusion.plan(graph)
            if name != "lm_head_ce":       # its 39 GEMMs' tiles are those of the others (16 s more)
                compiled += compile_graph(graph, plan, [GENERATED] * len(plan.groups), A100,
                                          tmp_path / f"{name}_{dtype}.py", gemms_only=True)
    assert compiled >= 4


@pytest.mark.parametrize("dtype", ops_table.DTYPES)
def test_the_pointwise_table_compiles_for_an_h100(dtype, tmp_path):
    """Every entry of the op table that eager takes for this dtype, on a 2-D operand, a broadcast row, a
    bool condition and a Python scalar of the dtype's kind (narrow integers' scalars are where Triton's
    compiler refused what its interpreter ran)."""
    shape = (5, 7)
    make = ops_table.values
    s = {"bool": True}.get(dtype, 300 if dtype.startswith(("int", "uint")) else -0.75)     # 300: past a uint8
    o = ops_table.Operands(make(shape, dtype, 0, 0.1, 0), make(shape, dtype, 1, 0.1, 0), make((1, 7), dtype, 2, 0.1, 0),
                           make((5, 1), "bool", 3, 0.1, 0), s)
    calls = ops_table.eager_calls(ops_table.RECIPES, o)

    def fn(x, x2, y, c):
        ops = ops_table.Operands(x, x2, y, c, o.s)
        return [r.call(ops) for r, _ in calls]
    graph = ir.from_fx(make_fx(fn)(o.x, o.x2, o.y, o.c), half=True)
    plan = fusion.plan(graph)
    assert compile_graph(graph, plan, [DEFAULT] * len(plan.groups), H100, tmp_path / f"table_{dtype}.py") >= 1


def test_split_reductions_compile_for_an_h100(tmp_path, monkeypatch):
    """Both kernels of the split reductions tests/test_optimizer_triton.py runs (sums, means, maxima, minima and
    counts of rows, of a whole tensor and of columns; a LayerNorm and Linear's forward and backward), in fp32,
    bf16 and fp64, and the H100 model's pick for x.sum() over 64M elements (1024 slices of 64k)."""
    from tests.test_optimizer_triton import SPLIT, SPLIT_CASES, forward_and_backward, layer_norm_linear
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)     # set by that module: kernels rendered for a GPU
    graphs = [(f"{name}_{dtype}", fn, [torch.randn(3, 3000).to(dtype)]) for name, fn in SPLIT_CASES.items()
              for dtype in (torch.float32, torch.bfloat16, torch.float64)]
    graphs.append(("layer_norm_linear", forward_and_backward(layer_norm_linear),
                   [torch.randn(3000, 8), torch.randn(8), torch.randn(8), torch.randn(5, 8), torch.randn(5)]))
    compiled = 0
    for name, fn, args in graphs:
        graph = ir.from_fx(make_fx(fn, decomposition_table=decompositions())(*args), half=True)
        plan = fusion.plan(graph)
        compiled += compile_graph(graph, plan, [SPLIT] * len(plan.groups), H100, tmp_path / f"{name}.py")
    graph = ir.from_fx(make_fx(lambda x: x.sum(), decomposition_table=decompositions(),
                               tracing_mode="fake")(torch.empty(64 * 2 ** 20)))
    picked = search.search_graph(graph, find_hardware("h100"), timing=False)
    assert any(s.reduction_split > 1 for s in picked.schedules)
    compiled += compile_graph(graph, picked.plan, picked.schedules, H100, tmp_path / "sum_64m.py")
    assert compiled > 2 * len(graphs)


def compiled_ptx(fn: Callable, args: tuple, path: Path) -> str:
    """The PTX of every kernel of `fn`'s graph (decomposed as the backend decomposes, heuristic schedule)
    compiled for an H100, as one text: the instructions the GPU would run, which the interpreter does not."""
    graph = ir.from_fx(make_fx(fn, decomposition_table=decompositions())(*args), half=True)
    plan = fusion.plan(graph)
    ptx: dict[str, str] = {}
    assert compile_graph(graph, plan, [DEFAULT] * len(plan.groups), H100, path, ptx=ptx) >= 1
    return "\n".join(ptx.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
def test_square_roots_compile_to_the_gpus_correctly_rounded_instructions(dtype, tmp_path):
    """sqrt, rsqrt and powers of 0.5 and -0.5 are eager's: correctly rounded square roots, subnormals kept. Triton's
    tl.sqrt of fp32 is the GPU's approximation that flushes subnormals to zero (sqrt.approx.ftz.f32: the sqrt of
    1e-40 is 0 where eager's is 1e-20), and tl.rsqrt is an approximation in fp64 too (rsqrt.approx.f64); the
    interpreter computes both exactly, so only the instructions compiled for the GPU show it."""
    def roots(x):
        return x.sqrt(), x.rsqrt(), x ** 0.5, x ** -0.5
    x = torch.rand(6, 7).to(dtype)
    code = compiled_ptx(roots, (x,), tmp_path / "roots.py")
    roots_compiled = set(re.findall(r"\br?sqrt\.[a-z0-9.]+", code))
    assert roots_compiled and not any("approx" in r for r in roots_compiled), roots_compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fmod_and_remainder_compile_to_an_exact_long_division(dtype, tmp_path):
    """fmod and remainder are exact only if each step of their long division is: the quotient's division
    correctly rounded (Triton's fp32 / is div.full, 2 ulp, and its % is LLVM's frem: a - trunc(a / b) * b,
    which NVPTX computes with that division and is wrong once the quotient passes 2^24), the remainder by a
    fused multiply-add, and the subnormal divisors' exponent read without flushing them to zero."""
    def modulos(a, b):
        return torch.fmod(a, b), torch.remainder(a, b), a % 0.3
    a, b = torch.randn(5, 9, dtype=dtype), torch.rand(5, 9, dtype=dtype) + 0.5
    code = compiled_ptx(modulos, (a, b), tmp_path / "modulos.py")
    divisions = set(re.findall(r"\bdiv\.[a-z0-9.]+", code))
    assert divisions == {f"div.rn.f{dtype.itemsize * 8}"}, divisions
    assert re.search(r"\bfma\.rn\.f(32|64)\b", code) and not re.search(r"\b(mul|fma|setp)[a-z0-9.]*\.ftz", code)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_divisions_compile_to_correctly_rounded_divisions(dtype, tmp_path):
    """Every division the graph asks for (by a tensor or a Python number, reciprocal, rsqrt's 1 / sqrt, negative
    whole powers) is the GPU's correctly rounded div.rn, as eager's: Triton's fp32 / is div.full (2 ulp), and by
    a constant div.approx, whose error a round after it turns into a whole step (a fake quantizer's level:
    round(x / scale)). The interpreter divides exactly either way, so only the PTX shows it."""
    def divisions(x, s):
        return torch.round(x / s), x / 0.3, x.reciprocal(), x.rsqrt(), x ** -1, x ** -2, x ** -3, x ** -0.5
    x, s = torch.rand(5, 9).to(dtype) + 0.5, torch.rand(5, 9).to(dtype) + 0.1
    code = compiled_ptx(divisions, (x, s), tmp_path / "divisions.py")
    found = set(re.findall(r"\bdiv\.[a-z0-9.]+", code))
    assert found == {"div.rn.f32"}, found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rounded_divisions_compile_to_correctly_rounded_divisions(dtype, tmp_path):
    """torch.div with rounding_mode "trunc" and "floor" (`//`) are eager's only if the quotient they truncate or
    round is correctly rounded (Triton's fp32 / is div.full, 2 ulp: 6.0 / 3.0 may come out below 2.0, whose
    trunc is 1), floor's fmod exact as fmod's own, and nothing flushes subnormals."""
    def divisions(a, b):
        return torch.div(a, b, rounding_mode="trunc"), a // b, a // 0.3
    a, b = torch.randn(5, 9, dtype=dtype), torch.rand(5, 9, dtype=dtype) + 0.5
    code = compiled_ptx(divisions, (a, b), tmp_path / "divisions.py")
    divisions_compiled = set(re.findall(r"\bdiv\.[a-z0-9.]+", code))
    assert divisions_compiled == {f"div.rn.f{dtype.itemsize * 8}"}, divisions_compiled
    assert not re.search(r"\b(mul|fma|setp|add|sub)[a-z0-9.]*\.ftz", code)


def test_divisions_of_one_element_dividends_compile(tmp_path):
    """fmod, remainder and floor division of a 0-d tensor or a Python number by a tensor: the prelude's tfsn_fmod
    started its long division from |a|, a one-element block, which the first step made b's shape: a loop-carried
    value that changes shape, which Triton's compiler refuses ("k0 does not compile"; the interpreter ran it)."""
    def divisions(a, b):
        return torch.fmod(a, b), torch.remainder(a, b), a // b, 5.0 // b
    assert compiled_ptx(divisions, (torch.tensor(5.0), torch.rand(5, 9) + 0.5), tmp_path / "divisions.py")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_atan2_and_hypot_compile_to_correctly_rounded_divisions_and_roots(dtype, tmp_path):
    """atan2's and hypot's ratio of the smaller magnitude to the larger, and hypot's root, are the GPU's
    correctly rounded instructions, as eager's are: Triton's fp32 / is div.full (2 ulp) and its tl.sqrt
    sqrt.approx, which the interpreter, computing them exactly, does not show."""
    def angles(y, x):
        return torch.atan2(y, x), torch.hypot(y, x)
    y, x = torch.randn(5, 9).to(dtype), torch.randn(5, 9).to(dtype)
    code = compiled_ptx(angles, (y, x), tmp_path / "angles.py")
    found = set(re.findall(r"\b(?:div|sqrt)\.[a-z0-9.]+", code))
    assert found == {"div.rn.f32", "sqrt.rn.f32"}, found


def test_math_functions_keep_subnormals_as_eagers(tmp_path):
    """log, log2, log1p, pow (exp2 of log2), sin, cos and exp of fp32 keep subnormal inputs and results, as torch's
    CUDA kernels: Triton compiles libdevice, where most come from, to flush subnormals to zero unless asked not to
    (nvvm-reflect-ftz), so on a GPU log(1e-40) was -inf where eager's is -92.1, 1e-40 ** -0.5 inf where it is 1e20.
    The interpreter computes them with numpy, so only the instructions compiled for the GPU show it: none is .ftz.
    (libdevice's erf has an ex2.approx.ftz of its own, whatever the option, in a term of its tail where erf is 1.)"""
    from triton.backends.nvidia.compiler import CUDAOptions
    if "enable_reflect_ftz" not in CUDAOptions.__dataclass_fields__:
        pytest.skip("this Triton has no enable_reflect_ftz (triton-lang/triton#8762): libdevice flushes subnormals")

    def functions(x, y):
        return x.log(), x.log2(), x.log1p(), x ** y, x.sin(), x.cos(), x.exp()
    args = (torch.rand(6, 7), torch.randn(6, 7))
    code = compiled_ptx(functions, args, tmp_path / "functions.py")
    flushing = sorted(set(re.findall(r"\b[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz\.[a-z0-9.]+", code)))
    assert not flushing, flushing
