"""The generated Triton kernels under the launch shapes a GPU runs them with, run on this CPU by Triton's
interpreter (TRITON_INTERPRET=1), forward and backward, against eager PyTorch.

tests/test_optimizer_triton.py runs mostly the heuristic schedule; on a GPU every kernel takes the shape the
cost model or the search picks (space.gpu_kernel_space): 256..8192 elements per program, 1..16 rows per
program with rows of more than GPU_REDUCTION_BLOCK elements looped over in blocks, GEMM tiles of 32..256
rows and columns and 16..64 deep, or the library's product. A wrong mask or block loop shows only under
some of them: here every distinct shape of each kernel's space runs on sizes no block divides (5 rows of
1031, 3 x 7 x 13, tiles larger than the matrix), and the H100 and H200 models' own picks, in fp64 where
the kernel is generated in fp64 (a clear signal: the error of a correct kernel is ~1e-16)."""
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

from optimizer import backend, fusion, ir, search, space  # noqa: E402
from optimizer.backend import decompositions  # noqa: E402
from optimizer.codegen import triton as tt  # noqa: E402
from optimizer.features import kernel_features  # noqa: E402
from optimizer.hardware import find_hardware  # noqa: E402
from optimizer.runtime import CompiledGraph  # noqa: E402
from optimizer.schedule import Schedule  # noqa: E402
from tests.optimizer_models import SUMMED_STORES, forward_and_backward  # noqa: E402
from tests.test_optimizer_triton import adamw_steps  # noqa: E402

LAUNCH_OPTIONS = ("num_warps", "num_stages")     # how the GPU runs a program, not what it computes


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))


def traced(fn, args) -> tuple[torch.fx.GraphModule, ir.Graph]:
    gm = make_fx(forward_and_backward(fn), decomposition_table=decompositions())(*args)
    return gm, ir.from_fx(gm, ir.graph_device(args), half=True)


def run(graph: ir.Graph, plan: fusion.Plan, schedules, args) -> list[torch.Tensor]:
    source, kernels = tt.write_source(graph, plan.groups, plan.buffers, schedules, plan.inplace)
    assert any(kernels), "nothing was generated"
    return CompiledGraph(graph, plan.groups, kernels, tt.TritonLibrary(source), plan.inplace)(list(args))


def distinct_launch_shapes(graph: ir.Graph, plan: fusion.Plan, k: int) -> list[Schedule]:
    """Group k's rows of space.gpu_kernel_space as Schedules, one per distinct kernel the interpreter runs:
    rows that differ only in warps or stages give the same source, grid and block sizes."""
    group = plan.groups[k]
    table = space.gpu_kernel_space(0, kernel_features(graph, group, plan.buffers))
    seen, shapes = set(), []
    for row in range(len(table)):
        schedule = table.schedule(row)
        kernel = tt.TritonWriter(graph, group, plan.buffers, schedule, "k", plan.inplace).write()
        key = (kernel.source, kernel.grid, tuple(m for m in kernel.meta if m[0] not in LAUNCH_OPTIONS))
        if key not in seen:
            seen.add(key)
            shapes.append(schedule)
    return shapes


def assert_matches(got, want, rtol: float, what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = w.abs().max().item() if w.numel() and w.is_floating_point() else 1.0
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}, result {i}: {m}")


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


R = torch.randn
# a reduction's block loop (1031 > 1024: a full and a one-element block) and its last program's masked rows (5
# rows by 2, 4 or 8), column sums down 1031 rows (5 columns by rows per program), 37 x 129 elements in blocks
# of 256..8192, a batched product's tiles (BM 32..128 over 65 rows, BN 32 or 64 over 33 columns, BK 16..64
# over 40: 18 tiles, and the library's product; fp32, whose products are IEEE's summed in another order than
# eager's)
SWEPT = {
    "softmax_5x1031": (lambda x: torch.softmax(x, -1), lambda: (R(5, 1031),), torch.float64),
    "column_sum_and_max_1031x5": (lambda x: x.sum(0) + x.amax(0), lambda: (R(1031, 5),), torch.float64),
    "layer_norm_3x7x13": (lambda x, w, b: F.layer_norm(x, (13,), w, b), lambda: (R(3, 7, 13), R(13), R(13)),
                          torch.float64),
    "sigmoid_times_broadcast_37x129": (lambda x, y: torch.sigmoid(x) * y + 1, lambda: (R(37, 129), R(129)),
                                       torch.float64),
    "bmm_relu_2x65x40x33": (lambda a, b: torch.bmm(a, b).relu(), lambda: (R(2, 65, 40), R(2, 40, 33)),
                            torch.float32),
    # GELU's gradient stored and summed down 3 x 401 rows (the bias gradient) by one kernel, 1..8 columns a program
    "linear_gelu_bias_gradient_3x401x5": (SUMMED_STORES["linear_gelu"][0],
                                          lambda: (R(3, 401, 7), R(5, 7), R(5), R(3, 5)), torch.float64),
}
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.mark.parametrize("name", sorted(SWEPT))
def test_every_gpu_launch_shape_matches_eager(name):
    """Each kernel under each distinct launch shape of its GPU space (the i-th of every kernel's shapes in
    the i-th run, so that each kernel meets all of its own), forward and backward."""
    fn, make, dtype = SWEPT[name]
    torch.manual_seed(0)
    args = [a.to(DEVICE, dtype) for a in make()]
    gm, graph = traced(fn, args)
    want = gm(*args)
    plan = fusion.plan(graph)
    shapes = {k: distinct_launch_shapes(graph, plan, k) for k, g in enumerate(plan.groups) if g.kind != "extern"}
    assert max(len(s) for s in shapes.values()) >= 4, shapes      # more than the heuristic's one shape
    for i in range(max(len(s) for s in shapes.values())):
        schedules = [shapes[k][i % len(shapes[k])] if k in shapes else Schedule() for k in range(len(plan.groups))]
        shown = [(s.gemm, s.chunk, s.gemm_block_rows, s.gemm_nr, s.gemm_kc) for s in schedules]
        assert_matches(run(graph, plan, schedules, args), want, TOLERANCE[dtype], f"launch shapes {shown}")


PICKED = {     # (function, inputs, dtype of the run)
    "log_softmax_3x2049": (lambda x: torch.log_softmax(x, -1), lambda: (R(3, 2049),), torch.float64),
    "rmsnorm_5x1025": (rmsnorm, lambda: (R(5, 1025), R(1025)), torch.float64),
    "cross_entropy_37x1031": (lambda x, t: F.cross_entropy(x, t, ignore_index=3, label_smoothing=0.1),
                              lambda: (R(37, 1031), torch.randint(0, 1031, (37,))), torch.float64),
    "bias_gradient_3x7x13": (lambda x, w, b: F.linear(x, w, b), lambda: (R(3, 7, 13), R(5, 13), R(5)),
                             torch.float32),
    "linear_gelu_bf16": (lambda x, w, b: F.gelu(F.linear(x, w, b)), lambda: (R(7, 13), R(37, 13), R(37)),
                         torch.bfloat16),
}


@pytest.mark.parametrize("chip", ["h100", "h200"])
@pytest.mark.parametrize("name", sorted(PICKED))
def test_the_gpu_models_picks_match_eager(name, chip):
    """The plan and launch shapes the chip's cost model picks (search without timing, as a GPU's first
    compile with top_k 1) compute what eager does: to fp64's precision in fp64, within 1e-5 in fp32, and
    bf16 as close to the fp64 truth as eager's bf16 run (twice its error, or bf16's eps at the scale)."""
    fn, make, dtype = PICKED[name]
    torch.manual_seed(0)
    exact = [a.to(DEVICE, torch.float64) if a.is_floating_point() else a.to(DEVICE) for a in make()]
    args = [a.to(dtype) if a.is_floating_point() else a for a in exact]
    gm, graph = traced(fn, args)
    picked = search.search_graph(graph, find_hardware(chip), timing=False)
    got = run(graph, picked.plan, picked.schedules, args)
    if dtype != torch.bfloat16:
        assert_matches(got, gm(*args), TOLERANCE[dtype], f"{chip}'s picks")
        return
    truth = traced(fn, exact)[0](*exact)
    for g, w, t in zip(got, gm(*args), truth):
        scale = t.abs().max().item()
        err, eager_err = ((x.double() - t).abs().max().item() for x in (g, w))
        assert err <= max(2 * eager_err, torch.finfo(dtype).eps * scale), (err, eager_err, scale)


@pytest.mark.parametrize("foreach", [True, False])
def test_adamw_steps_under_the_h100_models_launch_shapes_match_eager(monkeypatch, foreach):
    """torch.optim.AdamW's step compiled as a GPU's would be (the H100 model's plan and launch shapes, top_k 1)
    on parameters no block divides, three steps: parameters and moments as eager's."""
    monkeypatch.setattr(backend, "gpu_spec", lambda device: find_hardware("h100"))
    torch.manual_seed(0)
    params = [R(s, device=DEVICE) for s in ((1031,), (37, 129), (3, 7, 13))]
    want, got, _ = adamw_steps(params, 3, foreach, top_k=1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
