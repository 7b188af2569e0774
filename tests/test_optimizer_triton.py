"""The Triton renderer of the loop nest, run on this CPU by Triton's interpreter (TRITON_INTERPRET=1):
the same fusion plans as the C target, forward and backward, against eager PyTorch.

On a GPU machine, TFSN_TEST_DEVICE=cuda runs the same tests compiled for the GPU, against eager on the
GPU (benchmarks/gpu_check.sh does). Needs the `triton` package (the `gpu` extra); without it these
tests are skipped."""
from __future__ import annotations

import os

DEVICE = os.environ.get("TFSN_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

pytest.importorskip("triton")

import copy  # noqa: E402
import re  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402

from optimizer import backend, fusion, ir  # noqa: E402
from optimizer.backend import decompositions, make_backend  # noqa: E402
from optimizer.codegen import triton as tt  # noqa: E402
from optimizer.codegen.triton_combo import write_program  # noqa: E402
from optimizer.runtime import CompiledGraph  # noqa: E402
from optimizer.schedule import DEFAULT, Schedule  # noqa: E402
from optimizer.target import Timing  # noqa: E402
from hypothesis import given, settings  # noqa: E402

from tests import test_optimizer_ops as ops_fuzz  # noqa: E402
from tests.optimizer_models import SUMMED_STORES, concatenations, suite  # noqa: E402
from tests.test_optimizer_ops import EXAMPLES, FUZZ, operands  # noqa: E402
from tests.test_optimizer_correctness import (  # noqa: E402
    lazy_negation_gradients_match_eager, lazy_negation_inputs_match_eager, masked_attention_matches_eager)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))


def forward_and_backward(fn):
    """fn's outputs and the gradients of their sum with respect to every float input."""
    def step(*args):
        args = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        floats = [a for a in args if a.requires_grad]
        grads = torch.autograd.grad(sum(o.float().sum() for o in outs), floats)
        return (*outs, *grads)
    return step


@dataclasses.dataclass
class Programmed:
    """A graph's plan as write_program was given it, and the program it wrote."""
    graph: ir.Graph
    groups: list
    buffers: set
    schedules: list
    inplace: dict
    program: object

    def kernels(self) -> list:
        """The plan's kernels, each alone (write_source's)."""
        return tt.write_source(self.graph, self.groups, self.buffers, self.schedules, self.inplace)[1]


def run_program(fn, args, schedule: Schedule = DEFAULT, gemm: bool = True, order=None):
    """fn's outputs as its graph's Triton program computes them, eager's, the plan and what was programmed;
    `order(graph, groups)` gives the plan's steps another order of the graph's."""
    args = [a.to(DEVICE) for a in args]
    gm = make_fx(fn, decomposition_table=decompositions())(*args)
    graph = ir.from_fx(gm, ir.graph_device(args), half=True)
    plan = fusion.plan(graph, gemm=gemm)
    if order is not None:
        plan = dataclasses.replace(plan, groups=order(graph, plan.groups))
    schedules = [schedule] * len(plan.groups)
    program = write_program(graph, plan.groups, plan.buffers, schedules, plan.inplace)
    assert any(program.kernels), "nothing was generated"
    lib = tt.TritonLibrary(program.source)
    got = CompiledGraph(graph, program.groups, program.kernels, lib, plan.inplace)(list(args))
    return got, gm(*args), plan, Programmed(graph, plan.groups, plan.buffers, schedules, plan.inplace, program)


def run_triton(fn, args, schedule: Schedule = DEFAULT, gemm: bool = True):
    got, want, plan, _ = run_program(fn, args, schedule, gemm)
    return got, want, plan


def mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def block(x, lw, lb, w):
    h = F.layer_norm(x, (x.shape[-1],), lw, lb)
    att = (h @ h.transpose(-2, -1)) * 0.25
    mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril().logical_not()
    return x + torch.softmax(att.masked_fill(mask, float("-inf")), dim=-1) @ (h @ w)


def cross_entropy(logits, target):
    return F.cross_entropy(logits, target)


CASES = {
    "mlp": (mlp, lambda: (torch.randn(19, 37), torch.randn(45, 37), torch.randn(45), torch.randn(10, 45),
                          torch.randn(10))),
    "attention_block": (block, lambda: (torch.randn(2, 13, 24), torch.randn(24), torch.randn(24),
                                        torch.randn(24, 24))),
    "cross_entropy": (cross_entropy, lambda: (torch.randn(21, 17), torch.randint(0, 17, (21,)))),
    "concatenations": (concatenations, lambda: (torch.randn(3, 5, 8), torch.randn(24, 8), torch.randn(1, 1, 8))),
}


GENERATED = Schedule(gemm="generated")      # GEMMs as tl.dot tiles (DEFAULT leaves the product to the library)


@pytest.mark.parametrize("schedule", [DEFAULT, GENERATED], ids=["library", "generated"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_triton_matches_eager_forward_and_backward(name, schedule):
    fn, make = CASES[name]
    torch.manual_seed(0)
    got, want, plan = run_triton(forward_and_backward(fn), make(), schedule)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", [DEFAULT, GENERATED], ids=["library", "generated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_16_bit_floats_as_close_to_the_truth_as_eager(name, dtype, schedule):
    """bf16/fp16 graphs (GEMMs on tl.dot with an fp32 accumulator or by the library into fp32, the rest
    computed in fp32 and rounded where eager rounds: each op's result) are as close to an fp64 reference
    as eager's own 16-bit run, forward and backward."""
    fn, make = CASES[name]
    torch.manual_seed(0)
    plan = as_close_to_the_truth_as_eager(fn, make(), dtype, schedule)
    assert any(g.kind == "gemm" for g in plan.groups) or name == "cross_entropy"


def as_close_to_the_truth_as_eager(fn, args, dtype, schedule):
    """fn's forward and backward in `dtype` through Triton, each result as close to fn's fp64 run as eager's
    own `dtype` run (3x its error, or dtype's eps at the result's scale); the plan."""
    exact = [a.double() if a.is_floating_point() else a for a in args]
    low = [a.to(dtype) if a.is_floating_point() else a for a in exact]
    got, want, plan = run_triton(forward_and_backward(fn), low, schedule)
    truth = forward_and_backward(fn)(*exact)
    for g, w, t in zip(got, want, truth):
        assert g.dtype == w.dtype == dtype
        scale = t.abs().max().item()
        err, eager_err = ((x.double() - t.to(x.device)).abs().max().item() for x in (g, w))
        assert err <= max(3 * eager_err, torch.finfo(dtype).eps * scale), (err, eager_err, scale)
    return plan


@pytest.mark.parametrize("schedule", [DEFAULT, GENERATED], ids=["library", "generated"])
def test_16_bit_relus_zeros_are_zeros(schedule):
    """A bf16 ReLU after a GEMM, forward and backward: its zeros are stored as zeros, so its backward
    (where(out <= 0, 0, grad)) passes no gradient through them, as eager. Failed under the interpreter:
    rounding's nudge turned 0.0 into a subnormal, which the interpreter stores as 1.2e-38, and every
    clipped element passed its whole gradient (errors of 3 where eager's were 0.01)."""
    torch.manual_seed(0)
    as_close_to_the_truth_as_eager(lambda x, w, b: F.linear(x, w, b).relu(),
                                   (torch.randn(6, 4), torch.randn(5, 4), torch.randn(5)), torch.bfloat16, schedule)


@pytest.mark.parametrize("schedule", [Schedule(chunk=16, gemm="generated", gemm_block_rows=16, gemm_nr=16, gemm_kc=16,
                                               gemm_mr=2, gemm_stages=1),
                                      Schedule(chunk=256, gemm="generated", gemm_block_rows=64, gemm_nr=32, gemm_kc=32,
                                               gemm_mr=8, gemm_stages=4)])
def test_block_sizes_warps_and_stages_are_schedule_knobs(schedule):
    fn, make = CASES["mlp"]
    torch.manual_seed(0)
    got, want, plan = run_triton(forward_and_backward(fn), make(), schedule)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    graph = ir.from_fx(make_fx(forward_and_backward(fn), decomposition_table=decompositions())(*make()))
    source, kernels = tt.write_source(graph, plan.groups, plan.buffers, [schedule] * len(plan.groups))
    assert 'input_precision="ieee"' in source and "tl.dot(" in source
    launches = [(g, dict(k.meta)) for g, k in zip(plan.groups, kernels) if k is not None]
    assert all(m["num_warps"] == schedule.gemm_mr for _, m in launches)
    assert {m.get("num_stages") for g, m in launches if g.kind == "gemm"} == {schedule.gemm_stages}


def test_fp32_gemm_epilogue_runs_in_the_dot_kernel():
    """Generated: the epilogue on the tl.dot tile; library: on the tile of torch's product, in the one
    program that runs after it, which the launch passes the product (the kernel's last pointer)."""
    fn, make = CASES["mlp"]
    args = make()
    gm = make_fx(fn, decomposition_table=decompositions())(*args)
    graph = ir.from_fx(gm)
    plan = fusion.plan(graph)
    gemms = [g for g in plan.groups if g.kind == "gemm"]
    assert gemms and any(len(g.nodes) > 1 for g in gemms), "no GEMM took its epilogue"
    for schedule in (GENERATED, DEFAULT):
        source, kernels = tt.write_source(graph, plan.groups, plan.buffers, [schedule] * len(plan.groups))
        k = next(k for g, k in zip(plan.groups, kernels) if g.kind == "gemm" and len(g.nodes) > 1)
        assert "tl.erf(" in k.source                      # GELU on the tile
        assert ("tl.dot(" in k.source) == (schedule == GENERATED) == (k.product is None)
    assert k.product.epilogue and "tl.load(prod + " in k.source


def test_a_lone_library_product_is_written_where_the_graph_wants_it():
    """x @ w with nothing after it: torch's matmul writes the graph's output (a transposed one too, in fp32
    or 16 bits: the library sums in fp32 and rounds once, as a tile would), and no program runs; with an
    epilogue, a 16-bit product goes through fp32 and is rounded once, by the program after it."""
    for fn in (lambda x, w: x @ w, lambda x, w: (x @ w).t(), lambda x, w: (x @ w) * 2):
        for dtype in (torch.float32, torch.bfloat16):
            args = (torch.randn(37, 24, dtype=dtype), torch.randn(24, 40, dtype=dtype))
            got, want, plan = run_triton(fn, args)
            torch.testing.assert_close(got[0], want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
            graph = ir.from_fx(make_fx(fn, decomposition_table=decompositions())(*args), half=True)   # run_triton's
            _, kernels = tt.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups))
            (k,) = [k for k in kernels if k is not None]
            epilogue = "mul" in {graph.nodes[n].op.split(".")[1] for n in k.outputs}
            assert k.product.epilogue == epilogue and (k.product.into is None) == epilogue    # a scratch for x @ w
            # its source (what `tfsn optimize --emit` writes and plan.json names) says when it is not launched
            assert ("not launched" in k.source) == (not k.product.epilogue), k.source


def test_a_linear_bias_is_added_by_the_library_addmm():
    """A Linear's epilogue is only its bias: the library's addmm adds it while it writes the output (16-bit
    operands summed and biased in fp32, rounded once) and no program runs; before, the product went to a fp32
    scratch that one more program read back to add the bias (two launches, the product written and read).
    A 16-bit mm's product plus a bias (b + x @ w.T) is no addmm: eager rounds the product before the add (the
    library's addmm was up to 0.125 off eager's bf16 there), so its epilogue's program adds it."""
    g = torch.Generator().manual_seed(0)
    cases = ((lambda x, w, b: F.linear(x, w, b), True), (lambda x, w, b: b + x @ w.t(), "float32"),
             (lambda x, w, b: F.linear(x, w, b).t(), True), (lambda x, w, b: F.linear(x, w, b) * 2, False),
             (lambda x, w, b: torch.add(x @ w.t(), b, alpha=2), False))
    for fn, addmm in cases:
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            addmm_here = addmm in (True, str(dtype).removeprefix("torch."))
            args = tuple(torch.randn(*s, generator=g).to(dtype) for s in ((37, 24), (40, 24), (40,)))
            got, want, plan = run_triton(fn, args)
            # one rounding of the exact value where the library adds the bias, else eager's roundings (the product's)
            expected = fn(*(a.double() for a in args)) if addmm_here or dtype == torch.float32 else fn(*args)
            torch.testing.assert_close(got[0], expected.to(got[0].device, dtype), rtol=tol, atol=tol)
            graph = ir.from_fx(make_fx(fn, decomposition_table=decompositions())(*args), half=True)
            _, kernels = tt.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups))
            (k,) = [k for g_, k in zip(plan.groups, kernels) if g_.kind == "gemm"]
            assert (k.product.bias is not None) == addmm_here and k.product.epilogue != addmm_here, (dtype, k.source)
            assert ("not launched" in k.source) == addmm_here

    def autocast_linear(x, w, b):      # fp32 parameters, their bf16 casts made in the graph (the bias's in the epilogue)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return F.linear(x, w, b)
    args = tuple(torch.randn(*s, generator=g) for s in ((37, 24), (40, 24), (40,)))
    got, want, plan = run_triton(autocast_linear, args)
    expected = F.linear(*(a.bfloat16().double() for a in args)).to(got[0].device, torch.bfloat16)
    torch.testing.assert_close(got[0], expected, rtol=1e-2, atol=1e-2)
    graph = ir.from_fx(make_fx(autocast_linear, decomposition_table=decompositions())(*args), half=True)
    _, kernels = tt.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups))
    (k,) = [k for g_, k in zip(plan.groups, kernels) if g_.kind == "gemm"]
    assert k.product.bias is not None and not k.product.epilogue, k.source


def test_epilogues_that_only_look_like_a_bias_keep_their_program():
    """The library's addmm adds one contiguous [N] row of the operands' dtype and writes the only output: a bias
    broadcast along the other axis, a full or 0-d addend, a strided or offset slice, one of another dtype (the
    add promotes) and a product also returned are left to the epilogue's program, and match eager."""
    g = torch.Generator().manual_seed(1)
    m, k, n = 12, 8, 10
    cases = {"[1, N]": (lambda x, w, b: x @ w.t() + b, (1, n)), "[M, 1]": (lambda x, w, b: x @ w.t() + b, (m, 1)),
             "[M, N]": (lambda x, w, b: x @ w.t() + b, (m, n)), "0-d": (lambda x, w, b: x @ w.t() + b, ()),
             "b[::2]": (lambda x, w, b: F.linear(x, w, b[::2]), (2 * n,)),
             "b[3:3 + N]": (lambda x, w, b: F.linear(x, w, b[3:3 + n]), (n + 5,)),
             "fp64 bias": (lambda x, w, b: x @ w.t() + b.double(), (n,)),
             "product returned too": (lambda x, w, b: (lambda h: (h, h + b))(x @ w.t()), (n,))}
    for what, (fn, bias_shape) in cases.items():
        for dtype in (torch.float32, torch.bfloat16):
            args = tuple(torch.randn(s, generator=g).to(dtype) for s in ((m, k), (n, k), bias_shape))
            got, want, plan = run_triton(fn, args)
            want = want if isinstance(want, tuple) else (want,)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.shape == b.shape, what
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=lambda e: f"{what} {dtype}: {e}")
            graph = ir.from_fx(make_fx(fn, decomposition_table=decompositions())(*args), half=True)
            _, kernels = tt.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups))
            products = [k.product for g_, k in zip(plan.groups, kernels) if g_.kind == "gemm"]
            assert products and all(p.bias is None for p in products), (what, dtype)


def test_fp32_products_take_tf32_only_where_torch_allowed_it():
    """The graph records torch's float32 matmul precision at capture: 'high' (TF32) renders tl.dot in TF32,
    as eager's cuBLAS would run; the default ('highest') in IEEE fp32."""
    fn, make = CASES["mlp"]
    args = make()
    for precision, dot in (("highest", 'input_precision="ieee"'), ("high", 'input_precision="tf32"')):
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            graph = ir.from_fx(make_fx(fn, decomposition_table=decompositions())(*args))
        finally:
            torch.set_float32_matmul_precision(before)
        plan = fusion.plan(graph)
        source, kernels = tt.write_source(graph, plan.groups, plan.buffers, [GENERATED] * len(plan.groups))
        assert dot in source and source.count("tl.dot(") == source.count(dot), precision
        # the search checks such products (cuBLAS's or a tile's) at TF32's tolerance, every other kernel at fp32's
        for schedule in (GENERATED, DEFAULT):
            _, kernels = tt.write_source(graph, plan.groups, plan.buffers, [schedule] * len(plan.groups))
            gemms = [k.tf32 for g, k in zip(plan.groups, kernels) if k is not None and g.kind == "gemm"]
            others = [k.tf32 for g, k in zip(plan.groups, kernels) if k is not None and g.kind != "gemm"]
            assert gemms and set(gemms) == {precision == "high"} and not any(others), (precision, schedule)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_cost_model_picks_compute_what_eager_does(name):
    """On a GPU the plan and launch shapes are the H200 model's picks (tiles, depths, warps, elements per
    program the CPU heuristic never uses): the kernels they give still match eager, and a second
    compile of the graph reads them from the cache."""
    from optimizer.hardware import find_hardware
    fn, make = CASES[name]
    torch.manual_seed(0)
    args = [a.to(DEVICE) for a in make()]
    gm = make_fx(forward_and_backward(fn), decomposition_table=decompositions())(*args)
    graph = ir.from_fx(gm, ir.graph_device(args))
    spec = find_hardware("H200")
    plan, schedules = backend.gpu_searched_plan(graph, spec, None)
    assert any(s != DEFAULT for s, g in zip(schedules, plan.groups) if g.kind != "extern")
    source, kernels = tt.write_source(graph, plan.groups, plan.buffers, schedules, plan.inplace)
    got = CompiledGraph(graph, plan.groups, kernels, tt.TritonLibrary(source), plan.inplace)(list(args))
    for g, w in zip(got, gm(*args)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    searches = backend.STATS["searches"]
    again = backend.gpu_searched_plan(ir.from_fx(gm, ir.graph_device(args)), spec, None)
    assert backend.STATS["searches"] == searches and again[1] == schedules


def searched_on_triton(monkeypatch, name: str, top_k: int = 3):
    """A case's forward+backward graph searched on the Triton target with its top k launch shapes built,
    checked and timed on DEVICE (each kernel timed, whatever the model predicts), and the graph."""
    from optimizer import search
    from optimizer.codegen.triton_target import TritonTarget
    from optimizer.hardware import find_hardware
    monkeypatch.setattr(search, "MIN_TIMED_S", 0.0)
    fn, make = CASES[name]
    torch.manual_seed(0)
    args = [a.to(DEVICE) for a in make()]
    gm = make_fx(forward_and_backward(fn), decomposition_table=decompositions())(*args)
    graph = ir.from_fx(gm, ir.graph_device(args))
    result = search.search_graph(graph, TritonTarget(find_hardware("H200"), DEVICE), top_k=top_k)
    source, kernels = tt.write_source(graph, result.plan.groups, result.plan.buffers, result.schedules,
                                      result.plan.inplace)
    got = CompiledGraph(graph, result.plan.groups, kernels, tt.TritonLibrary(source), result.plan.inplace)(list(args))
    for g, w in zip(got, gm(*args)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    return result


def test_the_search_times_launch_shapes_on_the_triton_target(monkeypatch):
    """Where the GPU is, each kernel's launch shape is the fastest measured there of the model's top k
    (under the interpreter: the same path on this CPU), and the kernels chosen compute what eager does."""
    result = searched_on_triton(monkeypatch, "attention_block")
    timed = [k for k in result.kernels if k.measured_s is not None]
    assert timed and all(len(k.timed) >= 2 for k in timed), [k.timed for k in result.kernels]
    assert {result.plan.groups[k.group].kind for k in timed} == {"gemm", "kernel"}     # GEMM tiles and the rest


def test_a_wrong_triton_candidate_is_discarded_before_it_is_timed(monkeypatch, caplog):
    """The first launch shape other than the default that the search builds is made to store x + 1 (a
    planted generator bug) and is timed the fastest by far: without the check it would win."""
    import logging
    import re

    from optimizer.codegen.triton_target import TritonTarget
    planted, timed = [], []
    write = tt.TritonWriter.write

    def planted_write(self):
        kernel = write(self)
        if self.s != DEFAULT and self.name.startswith("v") and not planted:     # TritonTarget.build's
            planted.append((self.s, self.group))
        if planted and (self.s, self.group) == planted[0]:
            return dataclasses.replace(kernel, source=re.sub(r"\((t\d+)\)\.to\(", r"(\1 + 1.0).to(", kernel.source)
                                       + "# planted\n")
        return kernel

    def clock(target, graph, kernels, rounds, budget_s):
        sources = [built[0][i].source for built, i in kernels]
        timed.extend(sources)
        return [Timing((1e-7,) * 3 if "planted" in src else (1e-5,) * 3) for src in sources]
    monkeypatch.setattr(tt.TritonWriter, "write", planted_write)
    monkeypatch.setattr(TritonTarget, "time", clock)
    with caplog.at_level(logging.WARNING, logger="tfsn.optimizer"):
        searched_on_triton(monkeypatch, "mlp")
    assert planted, "the search built no candidate but the default"
    assert any("discarded a candidate" in r.getMessage() for r in caplog.records)
    assert timed and not any("planted" in src for src in timed), "the wrong candidate was timed"


def test_a_launch_shape_that_fails_to_launch_is_discarded_not_fatal(monkeypatch):
    """On a GPU, Triton refuses a launch shape it has not the resources for (OutOfResources: shared memory
    over the block's, estimated by the model only); the search builds four per kernel, so one refused
    shape must be discarded as a wrong one is, and the graph still compiled and run (compile_graph never
    fails on an op). Planted: the first shape other than the default raises when launched. Failed with
    the InterpreterError raised out of compile_graph from measure.agree_on."""
    from optimizer import search
    from optimizer.hardware import find_hardware
    monkeypatch.setattr(search, "MIN_TIMED_S", 0.0)
    monkeypatch.setattr(backend, "gpu_spec", lambda device: find_hardware("H200"))
    planted = []
    write = tt.TritonWriter.write

    def planted_write(self):
        kernel = write(self)
        if self.s != DEFAULT and self.name.startswith("v") and not planted:     # TritonTarget.build's
            planted.append((self.s, self.group))
        if self.name.startswith("v") and planted and (self.s, self.group) == planted[0]:
            refused = "    raise RuntimeError('planted: out of resources')\n"
            return dataclasses.replace(kernel, source=kernel.source + refused)
        return kernel
    monkeypatch.setattr(tt.TritonWriter, "write", planted_write)
    fn, make = CASES["mlp"]
    torch.manual_seed(0)
    args = [a.to(DEVICE) for a in make()]
    gm = make_fx(forward_and_backward(fn), decomposition_table=decompositions())(*args)
    got = backend.compile_graph(gm, list(args), codegen="triton", top_k=3)(list(args))
    assert planted, "the search built no candidate but the default"
    want = gm(*args)
    assert len(got) == len(want) == 6       # the output and five gradients
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chip", ["H100", "T4"])
def test_every_launch_shape_the_search_runs_fits_the_chip(monkeypatch, chip):
    """The search on a GPU launches each kernel's reference schedule beside its candidates (to check them):
    every GEMM launched must fit a block's shared memory by the model's own count ((BM + BN) x BK x stages
    operands), or Triton refuses it on the GPU and the reference's failure fails the compile. DEFAULT's
    GEMM (BM 64, BN 32, BK 256, 3 stages) over a depth of 512 was 288 KiB of fp32, over an H100 block's
    227 (a GEMM's BK is now at most 64); at BK 64 it is 72 KiB, over a T4's 64, where the reference is the
    model's pick."""
    from optimizer import search
    from optimizer.codegen.triton_target import TritonTarget
    from optimizer.hardware import find_hardware
    monkeypatch.setattr(search, "MIN_TIMED_S", 0.0)
    spec = find_hardware(chip)
    launched = []
    launcher = tt.TritonLibrary.launcher

    def recording(self, kernel):
        launched.append(dict(kernel.meta))
        return launcher(self, kernel)
    monkeypatch.setattr(tt.TritonLibrary, "launcher", recording)
    torch.manual_seed(0)
    args = [torch.randn(128, 512, device=DEVICE), torch.randn(512, 128, device=DEVICE)]
    graph = ir.from_fx(make_fx(lambda a, b: (a @ b).relu())(*args), ir.graph_device(args))
    search.search_graph(graph, TritonTarget(spec, DEVICE), top_k=2)
    gemms = [m for m in launched if "BK" in m]
    assert gemms, "no GEMM was launched"
    shared = [(m["BM"] + m["BN"]) * m["BK"] * 4 * m["num_stages"] / 1024 for m in gemms]
    assert max(shared) <= spec.shared_memory_per_block_kib, list(zip(gemms, shared))


def test_tfsn_top_k_sets_the_launch_shapes_timed_on_a_gpu(monkeypatch):
    """$TFSN_TOP_K is the search's top k wherever `top_k=` is not given (OPTIONS, README): 1, the model's
    pick untimed, holds for a GPU graph too. Failed: the GPU search ran with GPU_TOP_K (4) whatever it said."""
    from optimizer import search
    from optimizer.hardware import find_hardware
    monkeypatch.setattr(backend, "gpu_spec", lambda device: find_hardware("H200"))
    monkeypatch.setenv("TFSN_TOP_K", "1")
    ran = []
    searched = search.search_graph

    def recording(graph, target, **kwargs):
        ran.append((kwargs["top_k"], kwargs["timing"]))
        return searched(graph, target, **kwargs)
    monkeypatch.setattr(search, "search_graph", recording)
    fn, make = CASES["mlp"]
    args = [a.to(DEVICE) for a in make()]
    gm = make_fx(forward_and_backward(fn), decomposition_table=decompositions())(*args)
    backend.compile_graph(gm, list(args), codegen="triton")
    assert ran == [(1, False)]


def test_a_bf16_gemm_tile_agrees_with_the_library_product_it_is_checked_against():
    """A correct tl.dot tile of a bf16 GEMM passes the search's check against its reference, cuBLAS's (here
    torch's) product: the two sum in other orders, so where the fp32 sum lies near a rounding boundary they
    round to neighbouring bf16 values, one ulp (2**-8 relative) apart. Failed: the check's rtol of 1e-4 took
    one such element of 65536 (this shape and seed) for a generator bug, and the tile was discarded with a
    warning asking for a bug report; at a GPU's sizes every tile would be."""
    from optimizer.codegen.triton_target import TritonTarget
    from optimizer.hardware import find_hardware
    args = [torch.randn(256, 2048, dtype=torch.bfloat16), torch.randn(2048, 256, dtype=torch.bfloat16)]
    graph = ir.from_fx(make_fx(lambda x, w: x @ w, decomposition_table=decompositions())(*args),
                       ir.graph_device(args), half=True)
    plan = fusion.plan(graph)
    (group,) = [g for g in plan.groups if g.kind == "gemm"]
    target = TritonTarget(find_hardware("H100"), DEVICE)
    tile = Schedule(gemm="generated", gemm_block_rows=64, gemm_nr=64, gemm_kc=32, gemm_mr=4)
    (built,) = target.build(graph, [(group, [DEFAULT, tile])], plan.buffers, plan.inplace)
    assert built[0][0].product is not None and built[0][1].product is None      # the library's, and a tile
    assert target.check(graph, built, 0, [1]) == [True]


def test_a_triton_kernel_writing_over_its_inputs_is_checked_on_what_it_writes_there(monkeypatch):
    """As tests/test_search_validation.py's C version, on the Triton target: an optimizer update writes over
    the parameter and the moment, each candidate is run on its own copies of them (a second run on the
    reference's leftovers would differ), and one that writes them wrong is caught."""
    import re

    from optimizer.codegen.triton_target import TritonTarget
    from optimizer.hardware import find_hardware

    def momentum_update(p, g, m):
        m.mul_(0.9).add_(g, alpha=0.1)
        p.sub_(m * 0.01 + p * 1e-3)
    inputs = [torch.randn(16, 256, device=DEVICE) for _ in range(3)]
    gm = make_fx(torch.func.functionalize(momentum_update, remove="mutations"),
                 decomposition_table=decompositions())(*inputs)
    graph = ir.from_fx(gm, ir.graph_device(inputs))
    plan = fusion.plan(graph)
    (group,) = [g for g in plan.groups if g.kind != "extern"]
    target = TritonTarget(find_hardware("H100"), DEVICE)
    schedules = [DEFAULT, Schedule(chunk=256, gemm_mr=2)]
    (built,) = target.build(graph, [(group, schedules)], plan.buffers, plan.inplace)
    assert set(built[0][1].outputs) == set(plan.inplace.values()) <= set(graph.inputs)
    assert target.check(graph, built, 0, [0, 1]) == [True, True]
    write = tt.TritonWriter.write

    def planted_write(self):       # the candidate stores x + 1 where it stored x
        kernel = write(self)
        if self.s == DEFAULT:
            return kernel
        return dataclasses.replace(kernel, source=re.sub(r"\((t\d+)\)\.to\(", r"(\1 + 1.0).to(", kernel.source))
    monkeypatch.setattr(tt.TritonWriter, "write", planted_write)
    (planted,) = target.build(graph, [(group, schedules)], plan.buffers, plan.inplace)
    assert target.check(graph, planted, 0, [1]) == [False]


def test_on_plan_hears_of_each_graph_searched_for_a_gpu(monkeypatch):
    """make_backend(on_plan=...) is called with each searched graph's expected seconds (OPTIONS: what `tfsn
    plan` prices this machine's step from; entry.price_here raises without a call), for a GPU graph too now
    that one gets Triton kernels by default: searched now, then read from the cache. Failed: never called."""
    from optimizer.hardware import find_hardware
    monkeypatch.setattr(backend, "gpu_spec", lambda device: find_hardware("H200"))
    heard = []
    fn, make = CASES["mlp"]
    args = [a.to(DEVICE) for a in make()]
    gm = make_fx(forward_and_backward(fn), decomposition_table=decompositions())(*args)
    for _ in range(2):
        backend.compile_graph(gm, list(args), codegen="triton", top_k=1,
                              on_plan=lambda seconds, fresh, entry: heard.append((seconds > 0, fresh, entry)))
    assert [h[:2] for h in heard] == [(True, True), (True, False)] and heard[0][2] == heard[1][2]


def close(actual, expected, what):
    """As tests/test_optimizer_correctness.py: rtol 1e-4, atol 1e-5 of the expected tensor's largest magnitude."""
    scale = expected.detach().abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=1e-4, atol=1e-5 * max(scale, 1e-3),
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("gemm", ["library", "generated"])
@pytest.mark.parametrize("case", suite(lm_layers=1), ids=lambda c: c.name)
def test_suite_training_step_through_triton_matches_eager(case, gemm, monkeypatch):
    """Every suite model's forward, backward and AdamW step as Triton kernels, its GEMMs by the library
    (torch's matmul, then the epilogue's program) or as generated tiles. The step is given eager's
    gradients: the attention key bias's gradient is exactly zero in eager and rounding noise here,
    which Adam would turn into a full step (see test_optimizer_correctness). Convolutions in fp32: on a GPU
    cuDNN's default (allow_tf32) rounds their operands to TF32's 10 bits (2**-11 relative), in eager's NCHW
    convolution and in the channels-last one tfsn runs through torch alike but by other algorithms, so the two
    differ by more than the fp32 tolerance this test checks the kernels at (tfsn follows the flag as eager does)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = case.build().to(DEVICE)
    tfsn = copy.deepcopy(eager)
    batch = tuple(t.to(DEVICE) for t in case.batch(torch.Generator().manual_seed(1)))
    triton_backend = make_backend(codegen="triton", schedule=Schedule(gemm=gemm))
    kernels, aten = backend.STATS["kernels"], backend.STATS["aten_graphs"]
    loss = case.loss(eager, batch)
    loss.backward()
    got = case.loss(torch.compile(tfsn, backend=triton_backend), batch)
    got.backward()
    close(got, loss, "loss")
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q.grad, p.grad, f"grad of {name}")
        q.grad = p.grad.clone()
    for (name, b), c in zip(eager.named_buffers(), tfsn.buffers()):      # BatchNorm's running stats
        close(c, b, f"buffer {name}")
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    opt_tfsn = torch.optim.AdamW(tfsn.parameters(), lr=1e-2, weight_decay=0.1)
    step = torch.compile(opt_tfsn.step, backend=triton_backend)
    for _ in range(2):
        opt_eager.step()
        step()
    assert backend.STATS["kernels"] > kernels and backend.STATS["aten_graphs"] == aten, "a graph ran as ATen"
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q, p, f"{name} after two AdamW steps")
    torch._dynamo.reset()


def adamw_steps(params: list, steps: int, foreach: bool, **options) -> tuple[list, list, int]:
    """`steps` AdamW steps on copies of `params`, eager's and compiled by tfsn (`options` to make_backend), on
    the same gradients: (eager's parameters and moments, tfsn's in the same order, the kernels tfsn made). A
    graph of the step run as ATen fails."""
    torch._dynamo.reset()
    mine, ref = ([p.clone().requires_grad_() for p in params] for _ in range(2))
    opt_mine, opt_ref = (torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=foreach) for ps in (mine, ref))
    step = torch.compile(opt_mine.step, backend=make_backend(codegen="triton", **options))
    kernels, aten = backend.STATS["kernels"], backend.STATS["aten_graphs"]
    for i in range(steps):
        for p, q in zip(mine, ref):
            p.grad = q.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(p.device)
        opt_ref.step()
        step()
    assert backend.STATS["aten_graphs"] == aten, "the step ran as ATen"
    torch._dynamo.reset()

    def tensors(opt, ps):
        return [t.detach() for p in ps for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    return tensors(opt_ref, ref), tensors(opt_mine, mine), backend.STATS["kernels"] - kernels


def test_foreach_adamw_step_through_triton_matches_eager():
    """AdamW with foreach=True (its default for CUDA parameters) as Triton kernels: the foreach ops taken per
    tensor, each parameter's update written in place, all parameters' updates launched as one kernel (a
    parameter of several programs among them), after one more that counts the steps they read."""
    torch.manual_seed(0)
    params = [torch.randn(5, 7, device=DEVICE), torch.randn(9, device=DEVICE), torch.randn(3000, device=DEVICE),
              torch.randn(2, 3, 4, device=DEVICE)]
    want, got, kernels = adamw_steps(params, 2, foreach=True)
    assert kernels == 2, kernels
    for g, w in zip(got, want):
        close(g, w, "parameter and moments after two AdamW steps")


def test_only_independent_kernels_launch_as_one():
    """Consecutive kernels run as one launch when none writes what another reads or writes: the in-place update
    of p must wait for the kernel that reads p transposed (side by side on a GPU, their programs would race; the
    interpreter runs them in order, so the launch count is the check), the update of w need not."""
    def f(p, g, w):
        y = p.t().contiguous() * 3
        p.sub_(g)
        w.mul_(2)
        return y
    torch._dynamo.reset()
    args = [torch.randn(6, 5, device=DEVICE), torch.randn(6, 5, device=DEVICE), torch.randn(7, device=DEVICE)]
    mine = [a.clone() for a in args]
    kernels = backend.STATS["kernels"]
    got = torch.compile(f, backend=make_backend(codegen="triton"))(*mine)
    torch._dynamo.reset()
    assert backend.STATS["kernels"] - kernels == 2
    want = f(*args)
    assert torch.equal(got, want) and all(torch.equal(m, a) for m, a in zip(mine, args))


def test_a_graph_whose_kernel_triton_does_not_compile_runs_as_aten(monkeypatch, caplog):
    """Triton's compiler can refuse what its interpreter ran (a literal out of an int8's range did, on an H200):
    the kernels are compiled before the first step, and a graph with one that failed runs as ATen, said with
    Triton's error, instead of failing the training step at that kernel's launch."""
    def refused(self, graph, kernels):
        return [(next(k.name for k in kernels if k is not None), RuntimeError("PTX assembly failed: stand-in"))]
    monkeypatch.setattr(tt.TritonLibrary, "precompile", refused)
    torch._dynamo.reset()
    x = torch.randn(6, 5, device=DEVICE)
    aten = backend.STATS["aten_graphs"]
    with caplog.at_level("WARNING", logger="tfsn.optimizer"):
        got = torch.compile(lambda x: (x.sin() * 2).sum(1), backend=make_backend(codegen="triton"))(x)
    torch._dynamo.reset()
    assert backend.STATS["aten_graphs"] == aten + 1
    assert torch.equal(got, (x.sin() * 2).sum(1))
    assert "Triton did not compile 1 of its kernels" in caplog.text and "PTX assembly failed" in caplog.text


def test_a_combined_kernel_triton_does_not_compile_runs_as_its_parts(monkeypatch, caplog):
    """A combined kernel is new code, its parts' bodies side by side: where Triton refuses it (registers, an
    argument list too long) the graph ran as ATen. Its parts are the plan's own kernels: they run one by one."""
    def refuses_combined(self, graph, kernels):
        return [(k.name, RuntimeError("out of resources: stand-in")) for k in kernels
                if k is not None and k.name.startswith("c")]
    monkeypatch.setattr(tt.TritonLibrary, "precompile", refuses_combined)

    def f(p, g, w):
        p.sub_(g)
        w.mul_(2)
        return p.sum()
    torch._dynamo.reset()
    args = [torch.randn(6, 5, device=DEVICE), torch.randn(6, 5, device=DEVICE), torch.randn(7, device=DEVICE)]
    mine = [a.clone() for a in args]
    aten, kernels = backend.STATS["aten_graphs"], backend.STATS["kernels"]
    with caplog.at_level("WARNING", logger="tfsn.optimizer"):
        got = torch.compile(f, backend=make_backend(codegen="triton"))(*mine)
    torch._dynamo.reset()
    # two parts: p - g (written over p) and its sum in one kernel, w * 2 in another
    assert backend.STATS["aten_graphs"] == aten and backend.STATS["kernels"] - kernels == 2
    assert "did not compile the combined kernel" in caplog.text and "out of resources" in caplog.text
    assert torch.allclose(got, f(*args)) and all(torch.equal(m, a) for m, a in zip(mine, args))


def test_precompile_reports_only_kernels_that_fail_when_compiled_alone(monkeypatch):
    """CPython 3.11's ast.parse, which Triton runs on each kernel's source, is not thread-safe: on the compile
    pool a parse can raise a spurious SystemError (python/cpython#106905), which would send the whole graph to
    ATen. Such a kernel, compiled again alone, compiles; a kernel Triton refuses every time is still reported.
    On a GPU only (precompile does nothing on a CPU): the device, its driver and Triton's compile stood in."""
    import contextlib
    import triton.runtime
    graph = plan_graph(lambda x: (x.sin() * 2).sum(1), [torch.randn(6, 5)])
    plan = fusion.plan(graph)
    source, kernels = tt.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups), plan.inplace)
    names = [k.name for k in kernels if k is not None]
    assert len(names) >= 2
    lib = tt.TritonLibrary(source)
    monkeypatch.setattr(triton.runtime, "driver", type("Driver", (), {"active": None})())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    calls = []

    class Warmup:
        def __init__(self, name: str, error: BaseException | None, times: int) -> None:
            self.name, self.error, self.times = name, error, times

        def warmup(self, *dtypes, grid, **meta):
            calls.append(self.name)
            if self.error is not None and calls.count(self.name) <= self.times:
                raise self.error
    flaky, refused = names[0], names[1]
    monkeypatch.setattr(lib.module, flaky, Warmup(flaky, SystemError("AST constructor recursion depth mismatch "
                                                                      "(before=24, after=16)"), 1))
    monkeypatch.setattr(lib.module, refused, Warmup(refused, RuntimeError("PTX assembly failed: stand-in"), 99))
    for name in names[2:]:
        monkeypatch.setattr(lib.module, name, Warmup(name, None, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)     # unset already where the tests run on a GPU
    failed = lib.precompile(dataclasses.replace(graph, device="cuda:0"), kernels)
    assert [(name, str(e)) for name, e in failed] == [(refused, "PTX assembly failed: stand-in")]
    assert calls.count(flaky) == 2


def test_kernels_launch_and_precompile_with_the_gpus_launch_options(monkeypatch):
    """TritonLibrary launches and precompiles every kernel (a split reduction's second one too) with
    tt.launch_options(): on an NVIDIA GPU, libdevice keeping subnormals as eager does (tests/test_triton_gpu_compile
    reads that off the PTX). Failed: launched with the schedule's block sizes and warps only. The GPU, its driver
    and Triton's launch stood in (no GPU here)."""
    import contextlib
    import triton.runtime
    options = {"enable_reflect_ftz": False}
    monkeypatch.setattr(tt, "launch_options", lambda: options)
    x = torch.randn(3, 3000)
    graph = ir.from_fx(make_fx(lambda x: (x.sin().sum(1),), decomposition_table=decompositions())(x), "cpu")
    plan = fusion.plan(graph)
    source, kernels = tt.write_source(graph, plan.groups, plan.buffers, [SPLIT] * len(plan.groups), plan.inplace)
    (kernel,) = [k for k in kernels if k is not None]
    assert kernel.split is not None
    lib = tt.TritonLibrary(source)
    launched = []

    class Recorded:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *tensors, **meta: launched.append((self.name, meta))

        def warmup(self, *dtypes, grid, **meta):
            launched.append((self.name, meta))
    for name, _, _ in kernel.launches():
        monkeypatch.setattr(lib.module, name, Recorded(name))
    lib.launcher(kernel)([torch.empty(3, 3000), torch.empty(3)])
    monkeypatch.setattr(triton.runtime, "driver", type("Driver", (), {"active": None})())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert lib.precompile(dataclasses.replace(graph, device="cuda:0"), kernels) == []
    names = [name for name, _, _ in kernel.launches()]
    assert [name for name, _ in launched] == names * 2, launched
    assert all(meta.items() >= options.items() for _, meta in launched), launched


def test_a_combined_kernels_parts_share_no_value():
    """In the suite's forward and backward graphs, no part of a combined kernel reads a value another part
    computes (read off the graph's own edges, through views), and the combined kernels are there to check."""
    combined = 0
    for name, (fn, make) in sorted(CASES.items()):
        graph = plan_graph(fn, make())
        plan = fusion.plan(graph)
        program = write_program(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups), plan.inplace)
        for group, kernel in zip(program.groups, program.kernels):
            if kernel is None or not kernel.name.startswith("c"):
                continue
            combined += 1
            parts = [set(g.nodes) for g in plan.groups if set(g.nodes) <= set(group.nodes)]
            assert sum(len(p) for p in parts) == len(group.nodes), (name, kernel.name)
            for part in parts:
                reads = set()
                for n in part:
                    todo = list(graph.nodes[n].inputs)
                    while todo:
                        i = todo.pop()
                        reads.add(i)
                        if graph.nodes[i].kind == ir.Kind.VIEW:
                            todo += graph.nodes[i].inputs
                assert not reads & (set(group.nodes) - part), f"{name}: {kernel.name}'s parts depend on each other"
    assert combined >= 3, combined


def _memory_of(graph: ir.Graph, inplace: dict[int, int], n: int) -> int:
    """The node whose allocation node n's tensor lies in, found independently of triton_combo: through
    in-place writes, the IR's views and every ATen call whose schema says it returns an alias (diagonal,
    as_strided, split...), and getitems of those."""
    while True:
        node = graph.nodes[n]
        schema = getattr(node.target, "_schema", None)
        aliases = schema is not None and not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)
        if n in inplace:
            n = inplace[n]
        elif node.inputs and (node.kind == ir.Kind.VIEW or aliases or node.op == "getitem"):
            n = node.inputs[0]
        else:
            return n


def _updates_beside_views(p, q, g):
    """In-place updates of two inputs after a read of one through a view the IR sees (a transpose)."""
    out = p.t().contiguous() * 3,
    q.mul_(0.5)
    p.sub_(g)
    return out


def _updates_beside_aliases(p, q, g):
    """The same after a read through an alias only ATen makes (a diagonal)."""
    out = torch.diagonal(p) * 3,
    q.mul_(0.5)
    p.sub_(g)
    return out


def _compiled_as_eager(step, args, monkeypatch) -> list[Programmed]:
    """Runs `step` compiled by the Triton backend on copies of `args`, asserts its results and the inputs it
    updated are eager's, and returns what each of its graphs was planned and programmed as."""
    import optimizer.codegen.triton_combo as combo
    recorded: list[Programmed] = []

    def recording(graph, groups, buffers, schedules, inplace=None, spec=None):
        program = write_program(graph, groups, buffers, schedules, inplace, spec)
        recorded.append(Programmed(graph, list(groups), buffers, list(schedules), dict(inplace or {}), program))
        return program
    monkeypatch.setattr(combo, "write_program", recording)
    torch._dynamo.reset()
    mine = [a.clone() for a in args]
    got = torch.compile(step, backend=make_backend(codegen="triton"))(*mine)
    torch._dynamo.reset()
    want = step(*args)
    assert all(torch.allclose(x, y) for x, y in zip((*got, *mine), (*want, *args)))
    return recorded


@pytest.mark.parametrize("step", [_updates_beside_views, _updates_beside_aliases], ids=["view", "alias"])
def test_no_part_of_a_combined_kernel_writes_memory_another_part_touches(step, monkeypatch):
    """Every combined kernel of a step that reads an input through a view or an ATen alias beside in-place
    updates: no part writes memory (found by an alias walk of its own, not triton_combo's) that another part
    reads or writes (on a GPU their programs race; the interpreter runs them in order and cannot show it), and
    the results and updated inputs are eager's."""
    import optimizer.codegen.triton_combo as combo
    args = [torch.randn(6, 5, device=DEVICE), torch.randn(7, device=DEVICE), torch.randn(6, 5, device=DEVICE)]
    combined = 0
    for r in _compiled_as_eager(step, args, monkeypatch):
        kernels = r.kernels()
        for run in combo.combined_runs(r.graph, r.groups, kernels, r.inplace):
            combined += 1
            touched = [{_memory_of(r.graph, r.inplace, n) for n in kernels[i].params} for i in run]
            written = [{_memory_of(r.graph, r.inplace, n) for n in kernels[i].outputs} for i in run]
            for a in range(len(run)):
                for b in range(len(run)):
                    assert a == b or not written[a] & touched[b], (r.graph.nodes[min(written[a] & touched[b])].name)
    assert combined, "no kernels were combined: nothing was checked"


@pytest.mark.parametrize("step", [_updates_beside_views, _updates_beside_aliases], ids=["view", "alias"])
def test_a_combined_kernels_parts_run_in_reverse_order_as_eager(step, monkeypatch):
    """The interpreter runs a combined kernel's programs in id order, so a part reading what an earlier part writes
    would read it fresh and match eager; a GPU runs them at once. With the parts' order reversed (the last part's
    programs first) such a race reads stale memory: the in-place updates beside views and aliases still match."""
    import optimizer.codegen.triton_combo as combo
    real = combo._combined
    monkeypatch.setattr(combo, "_combined", lambda name, parts: real(name, list(reversed(parts))))
    args = [torch.randn(6, 5, device=DEVICE), torch.randn(7, device=DEVICE), torch.randn(6, 5, device=DEVICE)]
    recorded = _compiled_as_eager(step, args, monkeypatch)
    assert any(k is not None and k.name.startswith("c") for r in recorded for k in r.program.kernels), \
        "no kernels were combined: nothing was checked"


def _reordered_pairs(r: Programmed) -> list[tuple[int, int]]:
    """The pairs of plan steps (a, b), a first in the plan, that the program runs b before a (a combined kernel
    runs its parts at the first's place), each checked independent by walks of the test's own: b computes from
    no value of a's (the graph's edges, transitively), and neither writes memory the other reads or writes (an
    extern touches its inputs and its result; one that may write its arguments, by its schema or for want of
    one, touches nothing safely)."""
    graph, kernels = r.graph, r.kernels()
    position = {}
    for s, step in enumerate(r.program.groups):
        for i, group in enumerate(r.groups):
            if i not in position and set(group.nodes) <= set(step.nodes):
                position[i] = s

    def memory(i: int) -> tuple[set, set]:
        """(touched, written) of plan step i."""
        if kernels[i] is not None:
            return ({_memory_of(graph, r.inplace, n) for n in kernels[i].params},
                    {_memory_of(graph, r.inplace, n) for n in kernels[i].outputs})
        node = graph.nodes[r.groups[i].nodes[0]]
        schema = getattr(node.target, "_schema", None)
        inputs = {_memory_of(graph, r.inplace, n) for n in node.inputs}
        unsafe = node.kind == ir.Kind.EXTERN and node.op not in ("getitem", "constant") and (
            schema is None or schema.is_mutable)
        return inputs | {node.index}, ({node.index} | inputs) if unsafe else {node.index}

    pairs = []
    for b in range(len(r.groups)):
        for a in range(b):
            if position[a] <= position[b]:
                continue
            pairs.append((a, b))
            needs, todo = set(), [n for n in r.groups[b].nodes]
            while todo:
                for i in graph.nodes[todo.pop()].inputs:
                    if i not in needs:
                        needs.add(i)
                        todo.append(i)
            assert not needs & set(r.groups[a].nodes), f"step {b} moved before step {a}, whose value it reads"
            (touched_a, written_a), (touched_b, written_b) = memory(a), memory(b)
            assert not written_a & touched_b and not written_b & touched_a, f"steps {a} and {b} share memory"
    return pairs


def _apart(x, w, y):
    """Two reductions with a GEMM between that neither reads."""
    return x.sum(0), x @ w, y.sin().sum(1)


@pytest.mark.parametrize("warps", [1, 4, 8])
def test_a_part_runs_in_one_wave_of_the_gpu(warps):
    """A kernel combines while its programs fit on the spec's GPU at once (its SMs times the programs of its warps
    one SM holds): the GPT-2 block's q, k and v copies at the benchmark's size, 1044 programs each, do on an H100
    at any warps; one program more than the wave and it runs alone. Without a spec, COMBINED_PROGRAMS."""
    import optimizer.codegen.triton_combo as combo
    from optimizer.hardware import find_hardware
    spec = find_hardware("h100")
    gm = make_fx(_apart, decomposition_table=decompositions())(torch.randn(6, 5), torch.randn(5, 4),
                                                                  torch.randn(7, 3))
    graph = ir.from_fx(gm, "cpu", half=True)
    plan = fusion.plan(graph)
    _, kernels = tt.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups), plan.inplace)
    assert combo.combined_runs(graph, plan.groups, kernels, plan.inplace, spec) == [[0, 2]]
    wave = spec.compute_units * min(spec.blocks_per_unit, spec.threads_per_unit // (warps * spec.simd_width))

    def runs(programs: int, on=spec) -> list:
        kernel = dataclasses.replace(kernels[2], grid=(programs,), meta=(("num_warps", warps),))
        return combo.combined_runs(graph, plan.groups, [*kernels[:2], kernel], plan.inplace, on)
    assert wave >= 1044 and runs(1044) == runs(wave) == [[0, 2]] and runs(wave + 1) == []
    assert runs(combo.COMBINED_PROGRAMS, None) == [[0, 2]] and runs(combo.COMBINED_PROGRAMS + 1, None) == []


def _after_an_extern(x, w, y):
    """A reduction; a GEMM and an extern of its product; reductions of the extern's result, directly and through
    a kernel between; and a reduction of neither."""
    a = x.sum(0)
    c = torch.cumsum(x @ w, 0)
    d = c.exp() + 1
    return a, c, (c * 2).sum(1), d, d.sum(1), y.sin().sum(1)


def _combined_apart(r: Programmed) -> list[list[int]]:
    """The plan steps each combined kernel of the program runs, where some step runs between them in the plan."""
    runs = [[i for i, g in enumerate(r.groups) if set(g.nodes) <= set(step.nodes)]
            for step, kernel in zip(r.program.groups, r.program.kernels) if kernel is not None and
            kernel.name.startswith("c")]
    return [run for run in runs if run[-1] - run[0] >= len(run)]


def test_independent_kernels_apart_combine_as_eager_forward_and_backward():
    """Two small kernels with a GEMM between them run as one kernel (the later moved to the first's place, as it
    reads nothing the GEMM computes): forward and backward are eager's, and the steps the program reorders are
    independent."""
    torch.manual_seed(0)
    got, want, _, r = run_program(forward_and_backward(_apart), [torch.randn(6, 5), torch.randn(5, 4),
                                                                 torch.randn(7, 3)])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert _combined_apart(r) and _reordered_pairs(r)


def _inputs_first(graph: ir.Graph, groups: list) -> list:
    """The plan's kernels that compute from the graph's inputs alone (through no step's value, a view's either)
    first, the other steps after in order."""
    stepped = {g.nodes[0] for g in groups if g.kind == "extern"}

    def of_inputs(group) -> bool:
        todo, seen = list(group.nodes), set(group.nodes)
        while todo:
            node = graph.nodes[todo.pop()]
            if node.kind not in (ir.Kind.INPUT, ir.Kind.POINTWISE, ir.Kind.REDUCE, ir.Kind.VIEW) \
                    or node.index in stepped:
                return False
            todo += [i for i in node.inputs if i not in seen]
            seen.update(node.inputs)
        return group.kind == "kernel"
    return sorted(groups, key=lambda g: not of_inputs(g))


def test_a_kernel_that_reads_what_a_step_between_computes_does_not_move_before_it():
    """Kernels computing from an extern's result (directly, and through a kernel between) stay after the extern,
    though a run of small kernels before it could take them (reductions of the inputs alone, put first): the
    steps the program reorders are independent, and forward and backward are eager's."""
    torch.manual_seed(0)
    got, want, _, r = run_program(forward_and_backward(_after_an_extern), [torch.randn(6, 5), torch.randn(5, 4),
                                                                           torch.randn(7, 3)], order=_inputs_first)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    _reordered_pairs(r)
    cumsum = next(i for i, g in enumerate(r.groups) if r.graph.nodes[g.nodes[0]].op == "aten.cumsum.default")
    assert cumsum > 0 and r.groups[0].kind == "kernel", "no kernel before the extern to move to"


def _of_a_slice(x, y, w):
    """A reduction, and a GEMM and a reduction of a slice (a view made by a step of its own)."""
    a = x.sum(0)
    v = y[1:]
    return a, v @ w, v.sin().sum(1)


def test_a_kernel_that_reads_a_view_made_between_does_not_move_before_it():
    """A kernel reading a view made by a step between (a slice: a view writes no memory, so only the graph's
    edges show the kernel needs it) stays after that step; forward and backward are eager's."""
    torch.manual_seed(0)
    got, want, _, r = run_program(forward_and_backward(_of_a_slice), [torch.randn(6, 5), torch.randn(7, 3),
                                                                      torch.randn(3, 4)], order=_inputs_first)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    _reordered_pairs(r)
    ops = [r.graph.nodes[g.nodes[0]].op for g in r.groups]
    assert r.groups[0].kind == "kernel" and "aten.slice.Tensor" in ops[1:], "no view made after a kernel"


def _update_after_a_read(p, w, x):
    """An input updated in place after a GEMM reads it, with an independent reduction before the GEMM (whose
    product is no output itself: fusion writes no input in place that an output reads)."""
    out = x.sum(0), (p @ w) * 2
    p.mul_(0.5)
    return out


def _update_after_a_view_read(p, w, x):
    """The same, the GEMM reading the input through a view (a transpose)."""
    out = x.sum(0), (p.t() @ w) * 2
    p.mul_(0.5)
    return out


@pytest.mark.parametrize("step", [_update_after_a_read, _update_after_a_view_read], ids=["direct", "view"])
def test_an_update_in_place_does_not_move_before_a_read_of_its_input(step, monkeypatch):
    """An in-place update of an input is not combined with a kernel before a GEMM that reads the input (through a
    view too): the results and the updated input are eager's, and the steps the program reorders are
    independent."""
    args = [torch.randn(5, 5, device=DEVICE), torch.randn(5, 4, device=DEVICE), torch.randn(7, 3, device=DEVICE)]
    (r,) = _compiled_as_eager(step, args, monkeypatch)
    assert r.inplace, "the update was not written in place"
    update = next(i for i, g in enumerate(r.groups) if set(r.inplace) & set(g.nodes))
    assert r.groups[0].kind == "kernel" and any(g.kind == "gemm" for g in r.groups[1:update]), \
        "no kernel before the GEMM to move the update to"
    _reordered_pairs(r)


def _beside_a_write_in_place(p, x, y):
    """Reductions of two inputs with an ATen op between that writes a third in place (make_fx keeps it: an
    extern of a mutable schema)."""
    a = x.sum(0)
    p.mul_(0.5)
    return a, y.sin().sum(1)


def test_no_kernel_moves_past_an_extern_that_writes_in_place():
    """An extern that writes in place is passed by no kernel (what it writes is the schema's word per argument,
    not followed here): the reductions either side of it, independent as they are, run as two kernels, as
    eager."""
    args = [torch.randn(5, 5), torch.randn(6, 5), torch.randn(7, 3)]
    got, want, _, r = run_program(_beside_a_write_in_place, args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert [(g.kind, r.graph.nodes[g.nodes[0]].op) for g in r.groups][1] == ("extern", "aten.mul_.Tensor")
    assert [g.kind for g in r.program.groups] == ["kernel", "extern", "kernel"]


# ---- op lowerings whose obvious Triton forms are wrong: values torch gets right ----

SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, -3.0, 1.5, -1.5, 7.25, -7.25, 1e-3, -1e-3,
           float("inf"), float("-inf"), float("nan")]


def run_op(fn, *args):
    got, want, _ = run_triton(fn, args)
    return got[0], want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pow_of_negative_bases_matches_torch(dtype):
    """torch.pow(-2.0, 3) is -8 and (-2.0) ** 4 is 16: a negative base with a whole exponent has a value
    (exp2(log2(x) * y) makes it NaN); a fractional one is NaN; x ** 0 and 1 ** y are 1, even for NaN and inf."""
    x = torch.tensor(SPECIAL, dtype=dtype)
    whole = torch.tensor([0.0, 1.0, -1.0, 2.0, 3.0, -3.0, 4.0, 5.0, -6.0, 0.5, 2.5, -2.5, 40.0, 41.0, -41.0,
                          float("inf"), float("-inf"), float("nan"), 1e-3], dtype=dtype)
    cases = {
        "x ** 4": lambda x, y: x ** 4, "x ** 5": lambda x, y: x ** 5, "x ** -3": lambda x, y: x ** -3,
        "x ** 7": lambda x, y: x ** 7, "x ** 41": lambda x, y: x ** 41, "x ** -40": lambda x, y: x ** -40,
        "x ** 2.5": lambda x, y: x ** 2.5, "x ** 0": lambda x, y: x ** 0, "x ** y": lambda x, y: x ** y,
        "-2 ** y": lambda x, y: torch.pow(-2.0, y), "1 ** y": lambda x, y: torch.pow(1.0, y),
        "0.5 ** y": lambda x, y: torch.pow(0.5, y), "-0 ** y": lambda x, y: torch.pow(-0.0, y),
        # inf's log is no literal (the kernel named `inf` and failed to build), and inf ** 0 is 1
        "inf ** y": lambda x, y: torch.pow(float("inf"), y), "-inf ** y": lambda x, y: torch.pow(-float("inf"), y),
        "nan ** y": lambda x, y: torch.pow(float("nan"), y), "3e38 ** y": lambda x, y: torch.pow(3e38, y),
    }
    for what, fn in cases.items():
        for a, b in ((x, whole), (x.flip(0), whole)):      # every base against every exponent, twice
            got, want = run_op(fn, a, b)
            # a few ulp where ATen's pow is libm's (tests/test_optimizer_ops.py's bound for libm functions)
            torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0,
                                       equal_nan=True, msg=lambda m: f"{what}: {m}")
            assert torch.equal(torch.signbit(got[got == 0]), torch.signbit(want[got == 0])), f"{what}: sign of 0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_negative_zero_scalars_keep_their_sign(dtype):
    """A -0.0 in the model is -0.0 in the kernel: Triton before 3.7 (the GPU machine's 3.6) makes every zero
    literal +0.0, so (-0.0) ** -1 came out +inf and x * -0.0 lost its sign there; the kernels make it at run
    time, and no zero literal with a sign is left in their source."""
    x = torch.tensor(SPECIAL, dtype=dtype)
    cases = {"-0 ** y": lambda x: torch.pow(-0.0, x), "x * -0": lambda x: x * -0.0,
             "where": lambda x: torch.where(x > 0, x, -0.0), "x + -0": lambda x: torch.add(x, -0.0),
             # SGD's param.add_(grad, alpha=-lr) at a warmup's lr of 0
             "alpha -0": lambda x: torch.add(x, x.abs(), alpha=-0.0)}
    for what, fn in cases.items():
        gm = make_fx(fn, decomposition_table=decompositions())(x)
        graph = ir.from_fx(gm, ir.graph_device([x]), half=True)
        plan = fusion.plan(graph)
        source, _ = tt.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups), plan.inplace)
        body = source[len(tt.PRELUDE):]
        assert not re.search(r"-\s*0\.0(?!\d)", body), (what, body)
        got, want = run_op(fn, x)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
        assert torch.equal(torch.signbit(got[got == 0]), torch.signbit(want[got == 0])), f"{what}: sign of 0"


def test_non_finite_alphas_are_rendered_as_floats():
    """add/sub's alpha is a scalar like any other: an infinite or NaN one is float("inf"), not Python's
    repr `inf` (a NameError in the kernel)."""
    x, y = torch.tensor([1.0, -2.0, 0.0, 3.0]), torch.tensor([1.0, 2.0, -1.0, 0.0])
    for alpha in (float("inf"), float("-inf"), float("nan")):
        got, want = run_op(lambda x, y: torch.sub(x, y, alpha=alpha), x, y)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"alpha {alpha}: {m}")


def test_fp64_scalars_standing_alone_keep_fp64_precision():
    """Triton makes a float literal an fp32 constant: fp64 fills, where's and masked_fill's scalar operand and
    threshold's value came out rounded to fp32 (1/7 off by 4e-8 relative); each is exactly torch's now. A
    scalar out of fp32's range is the fp64 value too."""
    x = torch.randn(13, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cases = {"full_like": lambda x: torch.full_like(x, 1 / 7), "where": lambda x: torch.where(x > 0, 1 / 7, x),
             "masked_fill": lambda x: x.masked_fill(x > 0, -1 / 3), "threshold": lambda x: F.threshold(x, 0.1, 1 / 7),
             "huge fill": lambda x: x.masked_fill(x < 0, 1e300)}
    for what, fn in cases.items():
        got, want = run_op(fn, x)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fills_standing_alone_are_values_of_the_graphs_dtype(dtype):
    """A fill (full_like, ones_like) that meets no block before a function is a value of the graph's dtype: an
    int fill was an int32 literal and tl.log(1) did not compile (torch.distributions' Weibull.log_prob takes
    the log of ones_like), an fp64 one an fp32 literal (exp of full_like(x, 2.5) 6e-8 off), and tfsn_pow,
    tfsn_atan2 and tfsn_hypot given one beside a block failed on `&` of its comparisons in the interpreter
    (Kumaraswamy.log_prob raises full_like(x, 0.3) to a power)."""
    x = torch.tensor(SPECIAL, dtype=dtype)
    cases = {"log(ones_like)": lambda x: torch.log(torch.ones_like(x)) + x,
             "exp(full_like 2.5)": lambda x: torch.exp(torch.full_like(x, 2.5)) + x,
             "full / full": lambda x: torch.full_like(x, 1) / torch.full_like(x, 3) + x,
             "full ** x": lambda x: torch.pow(torch.full_like(x, 0.3), x),
             "x ** full": lambda x: torch.pow(x, torch.full_like(x, 0.3)),
             "atan2(full, x)": lambda x: torch.atan2(torch.full_like(x, -0.0), x),
             "hypot(x, full)": lambda x: torch.hypot(x, torch.full_like(x, 2.0))}
    for what, fn in cases.items():
        got, want = run_op(fn, x)
        # a few ulp where ATen's function is libm's (test_pow_of_negative_bases_matches_torch's bound)
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0,
                                   equal_nan=True, msg=lambda m: f"{what}: {m}")


def test_integer_pow_matches_torch():
    """Integers to whole powers are exact and wrap as torch's do (no float rounding): 3 ** 39 needs 62 bits."""
    base = torch.tensor([3, -3, 2, -2, 0, 1, -1, 7, -5, 3], dtype=torch.int64)
    exponent = torch.tensor([39, 39, 62, 63, 5, 100, 7, 30, 3, 0], dtype=torch.int64)
    got, want = run_op(lambda a, b: torch.pow(a, b), base, exponent)
    assert torch.equal(got, want)
    got, want = run_op(lambda a, b: a ** 3, base.to(torch.int32), exponent)
    assert torch.equal(got, want)


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error in units of the last place of the expected value."""
    spacing = torch.finfo(want.dtype).eps * want.abs().clamp_min(torch.finfo(want.dtype).tiny)
    return ((got - want).abs() / spacing).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", [torch.expm1, torch.log1p, torch.tanh])
def test_functions_accurate_near_zero(op, dtype):
    """expm1(1e-7) is 1.00000005e-7, log1p(1e-7) 9.9999995e-8 and tanh(1e-5) 9.9999999997e-6: exp(x) - 1,
    log(1 + x) and 2 sigmoid(2x) - 1 lose most digits to cancellation there (rounding 1 + x to 1 first)."""
    small = torch.logspace(-30, -0.5, 300, dtype=torch.float64)
    x = torch.cat([small, -small, torch.linspace(-4, 4, 161, dtype=torch.float64),
                   torch.tensor([0.0, -0.0, 1e-40, -1e-40, 20.0, -20.0, 90.0, 750.0, -750.0, -1.0, -1.5,
                                 float("inf"), float("-inf"), float("nan")], dtype=torch.float64)]).to(dtype)
    got, want = run_op(op, x)
    finite = want.isfinite() & (want.abs() > torch.finfo(dtype).tiny)
    assert ulps(got[finite], want[finite]) <= 8, f"{op.__name__}: {ulps(got[finite], want[finite]):.0f} ulp off"
    torch.testing.assert_close(got[~finite], want[~finite], rtol=0, atol=torch.finfo(dtype).tiny, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_signed_zeros_come_out_as_torchs(dtype):
    """-(+0.0) is -0.0, and tanh, round, trunc, relu, abs and pow keep torch's sign of a zero result (it
    shows in 1 / x, atan2, copysign). Triton before 3.7 compiles unary minus as 0 - x, which gives +0.0."""
    x = torch.tensor([0.0, -0.0, 0.4, -0.4, 0.5, -0.5, 1.5, -2.5, 3.0, -3.0, float("inf"), float("nan")],
                     dtype=dtype)
    cases = {"neg": torch.neg, "-x": lambda x: -x, "tanh": torch.tanh, "round": torch.round,
             "trunc": torch.trunc, "ceil": torch.ceil, "floor": torch.floor, "relu": torch.relu,
             "abs": torch.abs, "x ** 41": lambda x: x ** 41, "x * 0": lambda x: x * 0.0,
             "neg(x) * 0": lambda x: torch.neg(x) * 0.0, "sin": torch.sin, "sqrt": torch.sqrt}
    for what, fn in cases.items():
        got, want = run_op(fn, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
        zero = want == 0
        assert torch.equal(torch.signbit(got[zero]), torch.signbit(want[zero])), \
            f"{what}: sign of zero {got[zero].tolist()} (torch: {want[zero].tolist()})"


@pytest.mark.parametrize("rows_per_program", [1, 4, 16])
@pytest.mark.parametrize("name", ["attention_block", "cross_entropy"])
def test_reductions_run_several_rows_per_program(name, rows_per_program):
    """A GPU reduction schedule's chunk is rows per program (space.GPU_ROWS, as costmodel.predict_gpu prices it):
    the kernel holds a [rows, block] tile, rows past the end masked (21 and 26 rows are no multiple of 4 or 16)."""
    fn, make = CASES[name]
    torch.manual_seed(0)
    got, want, plan = run_triton(forward_and_backward(fn), make(), Schedule(chunk=rows_per_program))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert any(g.kind != "gemm" and g.reduced for g in plan.groups)
    source, _ = tt.write_source(plan_graph(fn, make()), plan.groups, plan.buffers,
                                [Schedule(chunk=rows_per_program)] * len(plan.groups))
    assert "tl.arange(0, XROWS)[:, None]" in source


def plan_graph(fn, args):
    return ir.from_fx(make_fx(forward_and_backward(fn), decomposition_table=decompositions())(*args))


def test_sums_of_bools_and_integers_accumulate_in_int64():
    def counts(x, ints):
        return (x > 0).sum(), (ints * 3).sum(1), (x != 0).sum(0, keepdim=True)
    ints = torch.randint(-2 ** 30, 2 ** 30, (5, 9), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    got, want, plan = run_triton(counts, [torch.randn(70, 3), ints])     # sums of 30-bit values: no fp32 sums
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.int64 and torch.equal(g.cpu(), w.cpu())
    assert not [g for g in plan.groups if g.kind == "extern"], "a sum stayed an ATen call"


SPLIT = Schedule(chunk=2, reduction_split=4)     # 3000 reduced elements: 3 slices of one block of 1024 each


def split_kernels(fn, args, schedule: Schedule = SPLIT) -> list[tt.TritonKernel]:
    """fn's Triton kernels under `schedule` that run as split reductions (for meta tensors too)."""
    graph = ir.from_fx(make_fx(fn, decomposition_table=decompositions())(*args), ir.graph_device(args), half=True)
    plan = fusion.plan(graph)
    _, kernels = tt.write_source(graph, plan.groups, plan.buffers, [schedule] * len(plan.groups), plan.inplace)
    return [k for k in kernels if k is not None and k.split is not None]


def with_nans(x: torch.Tensor) -> torch.Tensor:
    """x with a NaN in its second row past its first slice (a max or min must come out NaN there)."""
    x = x.clone()
    x.view(-1, x.shape[-1])[1, -5] = float("nan")
    return x


SPLIT_CASES = {     # reductions over 3000 elements: each split into 3 slices
    "sum_mean_max_min_of_rows": lambda x: (x.sum(-1), x.mean(-1, keepdim=True), x.amax(-1), x.amin(-1)),
    "whole_tensor": lambda x: (x.sum(), x.mean(), x.amax(), x.amin()),
    "column_sum_and_max": lambda x: (x.t().sum(0), x.t().amax(0, keepdim=True), x.t().mean(0)),
    "count": lambda x: ((x > 0).sum(-1), (x > 0).sum()),
    "rstd_after_the_mean": lambda x: (torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6),),
    "column_sum_beside_a_product": lambda x: ((x.t() * 3).sum(0), x.t() * 3),      # the product on each slice
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_split_reductions_match_eager(name, dtype):
    """Sums, means, maxima, minima and counts as split reductions (Schedule.reduction_split: slices of 3000
    elements reduced to partials, then combined): eager's values, a NaN in the last slice of a row made that
    row's max and min NaN, counts exact, the per-row values after a mean (an rstd) run on the combined mean."""
    fn = SPLIT_CASES[name]
    torch.manual_seed(0)
    x = with_nans(torch.randn(3, 3000)).to(dtype)
    clean = torch.randn(3, 3000).to(dtype)
    assert split_kernels(fn, [x]), "no reduction was split"
    for args in ([x], [clean]):
        got, want, _ = run_triton(fn, args, SPLIT)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            if not w.is_floating_point():
                assert torch.equal(g.cpu(), w.cpu())
                continue
            assert torch.equal(g.isnan().cpu(), w.isnan().cpu())
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2       # bf16: one rounding of a fp32 result
            torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance * 3000 ** 0.5, equal_nan=True)


def layer_norm_linear(x, lw, lb, w, b):
    return torch.tanh(F.linear(F.layer_norm(x, (x.shape[-1],), lw, lb), w, b))


def test_a_bias_gradient_split_matches_eager_forward_and_backward():
    """A LayerNorm then a Linear over 3000 rows: the backward's bias and LayerNorm weight gradients are column
    sums down 3000 rows, run split; every output and gradient as eager's."""
    torch.manual_seed(0)
    args = [torch.randn(3000, 8), torch.randn(8), torch.randn(8), torch.randn(5, 8), torch.randn(5)]
    step = forward_and_backward(layer_norm_linear)
    assert len(split_kernels(step, args)) >= 2, "the bias and weight gradients were not split"
    got, want, _ = run_triton(step, args, SPLIT)
    for i, (g, w) in enumerate(zip(got, want)):
        close(g, w, f"result {i}")


@pytest.mark.parametrize("name", sorted(SUMMED_STORES))
def test_values_summed_where_they_are_stored_match_eager_forward_and_backward(name):
    """Pointwise values stored and summed over rows by the kernel that computes them (a bias gradient), read
    again by later passes, kept dims, channels-last: outputs and gradients as eager's."""
    fn, make = SUMMED_STORES[name]
    torch.manual_seed(0)
    got, want, _ = run_triton(forward_and_backward(fn), make())
    for i, (g, w) in enumerate(zip(got, want)):
        close(g, w, f"result {i}")


def test_a_bias_gradient_stored_by_its_split_sum_matches_eager_forward_and_backward():
    """A Linear + GELU over 3000 rows: the backward's bias gradient sums the pointwise gradient the GEMMs read in
    the kernel that stores it, split into slices, each slice storing the elements it reads; all as eager's."""
    fn, _ = SUMMED_STORES["linear_gelu"]
    torch.manual_seed(0)
    args = [torch.randn(3, 1000, 4), torch.randn(6, 4), torch.randn(6), torch.randn(3, 6)]
    step = forward_and_backward(fn)
    graph = ir.from_fx(make_fx(step, decomposition_table=decompositions())(*args), half=True)
    plan = fusion.plan(graph)
    _, kernels = tt.write_source(graph, plan.groups, plan.buffers, [SPLIT] * len(plan.groups), plan.inplace)
    (bias,) = [n for n in graph.nodes if n.kind == ir.Kind.REDUCE and n.type.numel == 6]
    (kernel,) = [k for g, k in zip(plan.groups, kernels) if bias.index in g.nodes]
    assert kernel.split is not None and bias.args[0].index in kernel.outputs, fusion.describe(graph, plan)
    got, want, _ = run_triton(step, args, SPLIT)
    for i, (g, w) in enumerate(zip(got, want)):
        close(g, w, f"result {i}")


@pytest.mark.parametrize("fn", [lambda x: (torch.softmax(x, -1),), lambda x: (x - x.mean(-1, keepdim=True),)],
                         ids=["softmax", "centered"])
def test_reductions_that_cannot_split_run_whole(fn):
    """A row read in two passes (softmax: max, then the sum of exps) or over the whole domain after its mean
    keeps one program per row block, whatever the schedule's split, and computes eager's values."""
    x = torch.randn(3, 3000)
    assert not split_kernels(fn, [x])
    got, want, _ = run_triton(fn, [x], SPLIT)
    close(got[0], want[0], "result")


def test_a_graph_on_a_second_gpu_launches_its_kernels_with_that_gpu_current():
    """Triton launches on the current device (and its current stream), whatever device the tensors are on: a
    graph on cuda:1 called while cuda:0 is current would launch in cuda:0's context on cuda:1's memory. Read
    from the entry's source (no second GPU here): every step between the unpacking of the inputs and the
    return runs under the guard; a CPU graph has none."""
    fn, make = CASES["mlp"]
    graph = plan_graph(fn, make())
    plan = fusion.plan(graph)
    source, kernels = tt.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups), plan.inplace)
    lib = tt.TritonLibrary(source)
    on_cpu = CompiledGraph(graph, plan.groups, kernels, lib, plan.inplace)
    assert "on_device" not in on_cpu.source
    second = CompiledGraph(dataclasses.replace(graph, device="cuda:1"), plan.groups, kernels, lib, plan.inplace)
    lines = second.source.splitlines()
    assert lines[3] == "    with on_device(1):" and second.run.__globals__["on_device"] is torch.cuda._DeviceGuard
    assert all(line.startswith("        ") for line in lines[4:]) and any(line.strip().startswith("k") for line in lines[4:])


def test_a_tensor_of_2_to_the_31_elements_is_indexed_in_int64():
    """Triton's program ids and aranges are int32: the logits of a 128k-vocabulary LM head over 32k tokens (2**32
    elements) wrapped their offsets, which a GPU runs as an illegal address. Written from meta tensors (no such
    buffers here): the kernels over the big tensor index in int64, one over small tensors of the same graph not."""
    def f(logits, bias):
        return torch.softmax(logits, -1), bias * 2
    args = [torch.empty(2 ** 15, 2 ** 17, device="meta"), torch.empty(64, device="meta")]
    graph = ir.from_fx(make_fx(f, decomposition_table=decompositions())(*args), "meta")
    plan = fusion.plan(graph)
    _, kernels = tt.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups), plan.inplace)
    wide = {k.name: "tl.int64" in k.source for k in kernels if k is not None}
    big = [k.name for k in kernels if k is not None and any(graph.nodes[p].type.numel >= 2 ** 31 for p in k.params)]
    assert big and all(wide[name] for name in big) and not all(wide.values()), wide


def test_a_split_whose_last_slice_runs_past_2_to_the_31_is_indexed_in_int64(monkeypatch):
    """A split reduction's slices are whole blocks: the last one's indices run past the count, up to slices x
    span. x.sum() of 2**31 - 1 elements in 3 slices runs to 2**31 + 1023, which int32 wraps into negative indices
    that pass `r < count` (reads before the tensor, on a GPU), though the tensor alone stays under 2**31. Written
    from a meta tensor; then run, with the limit lowered to a small tensor's padded extent, against eager."""
    def total(x):
        return (x.sum(),)
    split = Schedule(reduction_split=3)
    [kernel] = split_kernels(total, [torch.empty(2 ** 31 - 1, device="meta")], split)
    assert "tl.int64" in kernel.source
    x = torch.randn(3000, dtype=torch.float64)
    [small] = split_kernels(total, [x], split)
    assert "tl.int64" not in small.source       # 3 slices of 1024: 3072
    monkeypatch.setattr(tt, "INT32_INDEX_LIMIT", 3001)
    [wide] = split_kernels(total, [x], split)
    assert "tl.int64" in wide.source
    got, want, _ = run_triton(total, [x], split)
    torch.testing.assert_close(got[0], want[0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_indexed_in_int64_match_eager(monkeypatch, name):
    """The int64 indexing of the test above, run: every kernel of every case made wide by a limit of 1."""
    monkeypatch.setattr(tt, "INT32_INDEX_LIMIT", 1)
    fn, make = CASES[name]
    torch.manual_seed(0)
    got, want, _ = run_triton(forward_and_backward(fn), make())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


class GraphOfLaunches:
    """A stand-in for graphs.CudaRecorder: a capture runs nothing but counts what the graph holds, and a
    replay takes `replay_s`, as a GPU running the captured kernels back to back would."""

    def __init__(self, replay_s: float, fail: bool = False) -> None:
        self.replay_s, self.fail, self.held = replay_s, fail, []

    def capture(self, run, inputs):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.held.append(run)

        def replay(_inputs):
            time.sleep(self.replay_s)
        return [], replay


@pytest.mark.parametrize("fail", [False, True], ids=["captured", "capture_fails"])
def test_on_a_gpu_launch_shapes_are_timed_in_cuda_graphs(monkeypatch, caplog, fail):
    """Each candidate is timed as the replay of a graph of GRAPHED_LAUNCHES of its launches, its time the
    replay's share per launch (a step's graphs run kernels back to back: Triton's launch from Python is
    not what the step pays); where a capture fails, every candidate is timed as launched instead."""
    import logging

    from optimizer import graphs
    from optimizer.codegen import triton_target
    from optimizer.hardware import find_hardware
    stand_in = GraphOfLaunches(replay_s=0.02, fail=fail)
    monkeypatch.setattr(graphs, "recorder_for", lambda device: stand_in)
    fn, make = CASES["cross_entropy"]
    args = make()
    graph = ir.from_fx(make_fx(fn, decomposition_table=decompositions())(*args))
    plan = fusion.plan(graph)
    group = next(g for g in plan.groups if g.kind != "extern")
    target = triton_target.TritonTarget(find_hardware("H100"), DEVICE)
    shapes = [Schedule(chunk=1, gemm_mr=1), Schedule(chunk=4, gemm_mr=2)]
    [built] = target.build(graph, [(group, shapes)], plan.buffers, plan.inplace)
    with caplog.at_level(logging.INFO, logger="tfsn.optimizer"):
        timings = target.time(graph, [(built, 0), (built, 1)], rounds=2, budget_s=1.0)
    assert len(timings) == 2
    if fail:
        assert "not in a CUDA graph" in caplog.text and not stand_in.held
        return
    assert len(stand_in.held) == 2 and all(len(run([])) == triton_target.GRAPHED_LAUNCHES for run in stand_in.held)
    per_launch = 0.02 / triton_target.GRAPHED_LAUNCHES
    assert all(per_launch <= t.best < 5 * per_launch for t in timings), [t.best for t in timings]


def test_a_gpu_tie_is_timed_again_on_the_next_compiles(monkeypatch):
    """Launch shapes whose timings overlap are an unsettled choice on a GPU as on a CPU: each later compile
    of the graph times just the tied shapes again, until search.RETIMES re-timings, then keeps its pick."""
    import json

    from optimizer import search
    from optimizer.cache import cache_dir
    from optimizer.codegen.triton_target import TritonTarget
    from optimizer.hardware import find_hardware
    calls = []

    def clock(self, graph, kernels, rounds, budget_s):       # everyone's best within everyone's spread
        calls.append(len(kernels))
        return [Timing((1e-5, 1.2e-5, 1.3e-5)) for _ in kernels]
    monkeypatch.setattr(TritonTarget, "time", clock)
    monkeypatch.setattr(search, "MIN_TIMED_S", 0.0)
    fn, make = CASES["cross_entropy"]
    args = [a.to(DEVICE) for a in make()]
    gm = make_fx(forward_and_backward(fn), decomposition_table=decompositions())(*args)
    h100 = find_hardware("H100")
    backend.gpu_searched_plan(ir.from_fx(gm, ir.graph_device(args)), h100, None)
    searched = len(calls)
    (path,) = (cache_dir() / "search").glob("*.json")
    ties = json.loads(path.read_text())["unsettled"]
    assert searched >= 1 and ties and all(t["retimed"] == 0 for t in ties)
    for retimed in range(1, search.RETIMES + 1):
        backend.gpu_searched_plan(ir.from_fx(gm, ir.graph_device(args)), h100, None)
        assert calls[searched:] == [len(t["schedules"]) for t in ties], "the tied shapes were not timed again"
        del calls[searched:]
        entry = json.loads(path.read_text())
        assert entry["unsettled"] == ([] if retimed == search.RETIMES else [{**t, "retimed": retimed} for t in ties])
    backend.gpu_searched_plan(ir.from_fx(gm, ir.graph_device(args)), h100, None)
    assert len(calls) == searched, "timed again past the bound"


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16])
def test_whole_scalars_out_of_a_narrow_integers_range_wrap_as_torchs(dtype):
    """int8 + 200 is int8 + (-56) in torch, and uint8 * -1 is uint8 * 255: a Python int meets a narrow
    integer tensor as that dtype, wrapped, in arithmetic and in comparisons (int8 > 200 is int8 > -56).
    Triton refuses the bare literal (`Scalar 200 is out of range for type int8`), at compile time on a GPU."""
    info = torch.iinfo(dtype)
    x = torch.tensor([info.min, -1 if info.min else 1, 0, 3, 100, info.max], dtype=dtype)
    cases = {"+ 200": lambda x: x + 200, "- 300": lambda x: x - 300, "* -1": lambda x: x * -1,
             "+ 2 ** 16 + 5": lambda x: x + (2 ** 16 + 5), "> 200": lambda x: x > 200,
             "< -129": lambda x: x < -129}
    for what, fn in cases.items():
        got, want = run_op(fn, x)
        assert got.dtype == want.dtype and torch.equal(got, want), f"{dtype} x {what}: {got.tolist()} != {want.tolist()}"


def test_sums_of_bools_are_logical_ors_as_torchs():
    """mask_a + mask_b of two bool tensors is their logical or in torch (True + True is True), and so is
    prims.fma's a * b + c; Triton's 1-bit integers wrap (True + True is False), so the sum is computed wider
    and tested against zero."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers prims.fma)
    a = torch.tensor([True, True, False, False])
    b = torch.tensor([True, False, True, False])
    cases = {"a + b": lambda a, b: a + b, "a + True": lambda a, b: a + True,
             "add alpha": lambda a, b: torch.add(a, b, alpha=True), "a + b + b": lambda a, b: a + b + b,
             "fma": lambda a, b: torch.ops.prims.fma(a, b, a)}
    for what, fn in cases.items():
        got, want = run_op(fn, a, b)
        assert got.dtype == want.dtype == torch.bool and torch.equal(got, want), f"{what}: {got.tolist()}"


def test_zeros_convert_to_bf16_as_zeros():
    """0 (from fp32, int64, bool) to bf16 is 0 and -0.0 is -0.0. Under the interpreter the conversion was
    rounded by nudging the fp32 bits before the interpreter's own conversion: zero's nudged bits were an fp32
    subnormal, which that conversion turned into 1.1e-38."""
    floats = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e-3, 1.0e30])
    for x in (floats, torch.tensor([0, 1, -3, 0]), torch.tensor([False, True, False])):
        got, want = run_op(lambda x: x.to(torch.bfloat16), x)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), \
            f"{x.dtype} -> bf16: {got.tolist()} (torch: {want.tolist()})"


def test_values_of_one_element_broadcast_into_blocks():
    """A tensor of one element read by a kernel over blocks: the backward of a max over all elements (which
    tests isnan(max) & isnan(x) per element) and GeM pooling's learned exponent of shape (1,) (tfsn_pow by
    it). Under the interpreter a scalar comparison's result broadcast into a block came out fp32, and `&`
    with a bool block failed the kernel."""
    x, p = torch.randn(5, 8), torch.tensor([3.0])

    def gem(x, p):
        return x.clamp(min=1e-6).pow(p).mean(-1).pow(1.0 / p) + x.abs().max() * 2
    got, want, _ = run_triton(forward_and_backward(gem), [x, p])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_elements_read_at_a_constant_index_of_a_matrix_match_eager():
    """x * x[2, 3] and its kin: the element is loaded once before the kernel's blocks (its index is constant),
    at the offset 2 * 8 + 3 which is an expression, not a number. That load was written masked by the block's
    mask, which is defined after it: every such kernel failed with 'xzero' unbound (seen in torch.cumprod of
    a clone with y[2, 3] = 0 written into it, forward and backward)."""
    def fn(x):
        return torch.tanh(x) * x[2, 3], (x * x[4, 5].exp()).sum(1)

    got, want, _ = run_triton(forward_and_backward(fn), [torch.randn(6, 8)])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


CONSTANT_INDEX_READS = {
    "negative": (lambda x: torch.tanh(x) * x[-1, -2], [(6, 8)]),
    "of_a_slice": (lambda x: x * x[:, 2:][1, 3], [(6, 8)]),
    "of_a_transpose": (lambda x: x * x.t()[3, 2], [(6, 8)]),
    "of_an_expanded_row": (lambda x, w: x * w[:1].expand(6, 5)[4, 3], [(6, 5), (8, 5)]),
    "into_an_empty_batch": (lambda x, w: x * w[2, 3], [(0, 5), (8, 5)]),
    "beside_a_row_reduction": (lambda x: torch.softmax(x * x[1, 1].exp(), -1) * x[0, 0], [(6, 8)]),
    "beside_a_product": (lambda x, w: (x @ w) * w[2, 1] + x[0, 0], [(6, 8), (8, 5)]),
}


@pytest.mark.parametrize("name", list(CONSTANT_INDEX_READS))
def test_reads_at_a_constant_index_of_any_view_match_eager(name):
    """Kin of x * x[2, 3], each element read once before the kernel's blocks, unmasked: at negative indices, in a
    view with an offset, a transpose, a row of stride 0, beside a batch of no rows, in reduction and GEMM kernels
    (the first, third, sixth and seventh failed before the prologue was written unmasked); forward and backward
    against eager."""
    fn, shapes = CONSTANT_INDEX_READS[name]
    g = torch.Generator().manual_seed(0)
    got, want, _ = run_triton(forward_and_backward(fn), [torch.randn(*s, generator=g) for s in shapes])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_bf16_subnormals_convert_as_torchs():
    """fp32 -> bf16 -> fp32 of subnormals (bf16 has fp32's exponent range, so 1e-40 is a bf16 subnormal, not 0)
    and of values rounded to nearest even, ties included, and infinities; a bf16 input's subnormals load
    exactly. The interpreter's own conversions gave 0 for 1e-40 (the GPU's give torch's)."""
    x = torch.tensor([1e-40, -1e-40, 9.2e-41, 1.1e-38, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8),
                      3.4e38, float("inf"), 0.0, -0.0, 1.0])
    got, want = run_op(lambda x: x.to(torch.bfloat16).to(torch.float32) * 1.0, x)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), f"{got.tolist()} != {want.tolist()}"
    half = x.to(torch.bfloat16)
    got, want = run_op(lambda h: h.float() * 2.0, half)
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"


@settings(FUZZ, max_examples=max(2, EXAMPLES // 4))          # ~7 s an example under the interpreter
@given(o=operands())
def test_pointwise_table_matches_eager_through_triton(o):
    """tests/test_optimizer_ops.py's differential fuzz of every pointwise entry (dtypes, layouts, special
    values), rendered by Triton: its renderer has its own table (it found bool sums wrapping, narrow integer
    scalars refused, and the interpreter's bf16 conversions); on DEVICE, against eager there."""
    on_device = (ops_fuzz.same_layout(t, DEVICE) for t in (o.x, o.x2, o.y, o.c))
    ops_fuzz.run_table(ops_fuzz.Operands(*on_device, o.s), None, codegen="triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_powers_by_scalars_as_eagers(dtype):
    """Eager's pow of a half by a scalar rounds the exponent to the half (bf16 x ** 1.7 is x ** 1.703125), and
    for fp16 by 0.5 or -0.5 is pow itself: (-inf) ** 0.5 is inf and (-0.0) ** -0.5 is inf, where sqrt gives
    NaN and -inf (C's kernels do the same: codegen/c_ops.expression)."""
    big = 1e10 if dtype == torch.bfloat16 else 300.0     # bf16 1e10 ** 1.7 is 7% off 1e10 ** 1.703125
    x = torch.tensor([float("-inf"), -0.0, 0.0, 2.0, 7.25, 0.3, big, float("inf"), -2.0], dtype=dtype)
    for e in (0.5, -0.5, 1.7, -1.3, 2.0):
        got, want = run_op(lambda x: x ** e, x)
        # fp32 libm values rounded to the half: one half ulp apart at most
        torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=0, equal_nan=True,
                                   msg=lambda m: f"x ** {e}: {m}")
        zero = want == 0
        assert torch.equal(got[zero].signbit(), want[zero].signbit()), f"x ** {e}: sign of zero"


@pytest.mark.parametrize("mask", ["tril", "arange", "buffer"])
def test_causal_mask_is_computed_in_the_kernels_that_read_it(monkeypatch, mask):
    """As the C target's test (test_optimizer_correctness): the mask built in forward is computed inside
    the Triton softmax kernels of both graphs, and the step matches eager."""
    masked_attention_matches_eager(monkeypatch, mask, DEVICE, codegen="triton")


def test_inputs_with_a_lazy_negation_bit_are_read_as_their_values():
    """tests/test_optimizer_correctness.py's regression through the Triton kernels: an input `z.conj().imag`
    (a lazy negation bit over z's memory) read by its data pointer lost its sign."""
    lazy_negation_inputs_match_eager("triton")


def test_output_gradients_with_a_lazy_negation_bit_are_read_as_their_values():
    """tests/test_optimizer_correctness.py's regression through the Triton kernels: a gradient given to
    backward() with a lazy negation bit was read without its sign."""
    lazy_negation_gradients_match_eager("triton")
