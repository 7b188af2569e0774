"""IR, fusion, C generation and the compile cache, one graph at a time.

Graphs are traced here with make_fx and the backend's own decompositions, so each test sees
exactly the core-ATen graph AOTAutograd would hand the compiler, and checks both what fused
(the plan is data) and that the generated code computes what eager does.
"""
from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from optimizer import backend, cache, expr, fusion, ir, layout, loopnest
from optimizer.backend import compile_graph, decompositions, make_backend
from optimizer.codegen import c
from optimizer.codegen.compiler import build_library, host_flags, load_library
from optimizer.schedule import DEFAULT, Schedule
from tests.optimizer_models import SUMMED_STORES, forward_and_backward

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))


def trace(fn, *inputs):
    gm = make_fx(fn, decomposition_table=decompositions())(*inputs)
    graph = ir.from_fx(gm)
    return gm, graph, fusion.plan(graph)


def kernels(graph, plan):
    return [g for g in plan.groups if g.kind != "extern"]


def ops(graph, plan, group) -> set[str]:
    """The ATen ops one loop nest computes, inlined ones included."""
    return {graph.nodes[n].op.split(".")[1] for n in fusion.fused_nodes(graph, plan.buffers, group)}


def run(gm, inputs, **options):
    """The graph compiled and run; a graph whose generated code failed to build (and so ran as
    ATen, right but silently unoptimized) fails the test instead."""
    before = backend.STATS["aten_graphs"]
    out = compile_graph(gm, inputs, **options)(list(inputs))
    assert backend.STATS["aten_graphs"] == before + (options.get("fuse") is False), "the graph ran as ATen"
    return out[0] if len(out) == 1 else out


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def test_residual_add_and_layernorm_are_one_row_kernel():
    x, r, w, b = torch.randn(5, 7, 19), torch.randn(5, 7, 19), torch.randn(19), torch.randn(19)
    gm, graph, plan = trace(lambda x, r, w, b: layer_norm(x + r, w, b), x, r, w, b)
    ks = kernels(graph, plan)
    assert len(ks) == 1, fusion.describe(graph, plan)
    assert ks[0].reduced == (2,) and {"sum", "rsqrt", "add", "mul"} <= ops(graph, plan, ks[0])
    torch.testing.assert_close(run(gm, [x, r, w, b]), layer_norm(x + r, w, b), rtol=1e-4, atol=1e-5)


def test_group_norm_is_generated_not_left_to_aten():
    """GroupNorm (UNets, diffusion models, after a conv) is decomposed like LayerNorm: its statistics are a row
    kernel over each group's channels and pixels, and the normalization, per-channel weight and bias and the
    activation after it are generated too; before, native_group_norm ran as one ATen call between kernels."""
    x, w, b = torch.randn(3, 6, 5, 7), torch.randn(6), torch.randn(6)
    fn = lambda x, w, b: F.silu(F.group_norm(x, 2, w, b))  # noqa: E731
    gm, graph, plan = trace(fn, x, w, b)
    externs = {graph.nodes[g.nodes[0]].op for g in plan.groups if g.kind == "extern"}
    assert not any("group_norm" in op for op in externs), externs
    assert any(g.reduced for g in kernels(graph, plan)), fusion.describe(graph, plan)
    torch.testing.assert_close(run(gm, [x, w, b]), fn(x, w, b), rtol=1e-4, atol=1e-5)


def test_softmax_and_cross_entropy_rows_fuse():
    x = torch.randn(6, 37)
    gm, graph, plan = trace(lambda x: F.softmax(x, dim=-1), x)
    assert len(kernels(graph, plan)) == 1, fusion.describe(graph, plan)
    torch.testing.assert_close(run(gm, [x]), F.softmax(x, dim=-1))
    y = torch.randint(0, 37, (6,))
    gm, graph, plan = trace(lambda x, y: F.cross_entropy(x, y), x, y)
    rows = [g for g in kernels(graph, plan) if g.reduced == (1,)]
    assert len(rows) == 1 and {"amax", "exp", "sum", "log"} <= ops(graph, plan, rows[0]), fusion.describe(graph, plan)
    torch.testing.assert_close(run(gm, [x, y]), F.cross_entropy(x, y))


def test_bias_and_gelu_are_the_gemm_epilogue():
    x, w, b = torch.randn(70, 33), torch.randn(45, 33), torch.randn(45)
    gm, graph, plan = trace(lambda x, w, b: F.gelu(F.linear(x, w, b)), x, w, b)
    gemms = [g for g in plan.groups if g.kind == "gemm"]
    assert len(gemms) == 1 and {"mm", "add", "erf"} <= ops(graph, plan, gemms[0]), fusion.describe(graph, plan)
    assert gemms[0].nodes[0] not in plan.buffers, "the GEMM's own output should stay in a per-block scratch"
    assert len(plan.groups) == 1        # the fused GEMM, reading the weight's transpose from the weight itself
    torch.testing.assert_close(run(gm, [x, w, b]), F.gelu(F.linear(x, w, b)), rtol=1e-4, atol=1e-5)


def test_whole_tensor_reductions_feed_the_same_kernel():
    x = torch.randn(101)

    def centered(x):                     # the mean is a per-"row" value of a row with no kept axes
        m = x.sum() / x.numel()
        return x - m, ((x - m) * (x - m)).sum()
    gm, graph, plan = trace(centered, x)
    for a, e in zip(run(gm, [x]), centered(x)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_column_reduction_for_bias_gradients():
    g = torch.randn(23, 41)
    gm, graph, plan = trace(lambda g: (g.sum(0), (g * g).sum(0)), g, )
    ks = kernels(graph, plan)
    assert len(ks) == 1 and ks[0].reduced == (0,), fusion.describe(graph, plan)
    s, s2 = run(gm, [g])
    torch.testing.assert_close(s, g.sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, (g * g).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", [DEFAULT, Schedule(parallel_min_elements=1, column_block=5, vector_width=1)],
                         ids=str)
@pytest.mark.parametrize("name", sorted(SUMMED_STORES))
def test_values_summed_where_they_are_stored_match_eager_forward_and_backward(name, schedule):
    """Pointwise values stored and summed over rows by the kernel that computes them (a bias gradient), read
    again by later passes, kept dims, channels-last: outputs and gradients as eager's."""
    fn, make = SUMMED_STORES[name]
    torch.manual_seed(0)
    args, step = make(), forward_and_backward(fn)
    gm, graph, plan = trace(step, *args)
    for a, e in zip(run(gm, list(args), schedule=schedule), step(*args)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


SCHEDULES = [DEFAULT, Schedule(vector_width=8, unroll=4), Schedule(parallel_axis=-1),
             Schedule(parallel_min_elements=1, chunk=3, gemm_block_rows=7, column_block=5),
             Schedule(vector_width=1, gemm_block_rows=1000),
             Schedule(gemm="generated"), Schedule(gemm="generated", gemm_mr=3, gemm_nr=5, gemm_kc=4, gemm_block_rows=5)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_every_schedule_computes_the_same_step(schedule):
    torch.manual_seed(0)
    x, w, b, lw, lb = torch.randn(37, 21), torch.randn(29, 21), torch.randn(29), torch.randn(29), torch.randn(29)

    def step(x, w, b, lw, lb):
        h = F.gelu(F.linear(x, w, b))
        return layer_norm(h + h.sum(0), lw, lb), F.softmax(h, dim=-1).sum(0)
    gm, graph, plan = trace(step, x, w, b, lw, lb)
    out = run(gm, [x, w, b, lw, lb], schedule=schedule)
    for a, e in zip(out, step(x, w, b, lw, lb)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_batched_gemm_epilogue_for_attention_scores():
    q, k = torch.randn(3, 11, 7), torch.randn(3, 13, 7)
    mask = torch.ones(11, 13, dtype=torch.bool).tril()

    def scores(q, k):                   # scale and causal mask: the bmm's epilogue
        return (q @ k.transpose(1, 2) * 0.37).masked_fill(~mask, float("-inf"))

    def attention(q, k):                # softmax then reads the bmm's output row by row
        return torch.softmax(scores(q, k), dim=-1)
    gm, graph, plan = trace(scores, q, k)
    assert [g.kind for g in plan.groups].count("gemm") == 1, fusion.describe(graph, plan)
    for fn in (scores, attention):
        gm, graph, plan = trace(fn, q, k)
        for schedule in (DEFAULT, Schedule(gemm="generated", gemm_block_rows=4)):
            torch.testing.assert_close(run(gm, [q, k], schedule=schedule), fn(q, k), rtol=1e-4, atol=1e-5)


GEMM_TILES = [Schedule(gemm="generated", vector_width=v, gemm_mr=mr, gemm_nr=nr, gemm_kc=kc, gemm_block_rows=br,
                        parallel_min_elements=1)
              for v, mr, nr, kc, br in [(16, 6, 32, 256, 64), (8, 4, 24, 7, 13), (4, 3, 5, 64, 9), (16, 8, 48, 3, 1000),
                                        (8, 1, 8, 1000, 5)]]


@pytest.mark.parametrize("schedule", GEMM_TILES, ids=lambda s: f"{s.vector_width}:{s.gemm_mr}x{s.gemm_nr}x{s.gemm_kc}")
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "batched", "batched_nt"])
def test_generated_gemm_matches_torch_on_every_layout_and_edge(schedule, layout):
    """Our micro-kernel against torch.mm: rows and columns not multiples of the tile (padding
    and cut stores), depth split in several cache tiles (accumulated in C), transposed operands
    (a weight read as B^T, an activation read as A^T in a weight gradient), batches; alone and
    with an epilogue."""
    torch.manual_seed(0)
    m, k, n = 37, 29, 53
    if layout == "nn":
        a, b = torch.randn(m, k), torch.randn(k, n)
    elif layout == "nt":
        a, b = torch.randn(m, k), torch.randn(n, k).t()
    elif layout == "tn":
        a, b = torch.randn(k, m).t(), torch.randn(k, n)
    elif layout == "batched":
        a, b = torch.randn(3, m, k), torch.randn(3, k, n)
    else:
        a, b = torch.randn(3, m, k), torch.randn(3, n, k).transpose(1, 2)
    bias = torch.randn(n)
    for fn in (lambda a, b, bias: a @ b, lambda a, b, bias: torch.relu(a @ b + bias)):
        gm, graph, plan = trace(fn, a, b, bias)
        assert [g.kind for g in plan.groups].count("gemm") == 1, fusion.describe(graph, plan)
        torch.testing.assert_close(run(gm, [a, b, bias], schedule=schedule), fn(a, b, bias), rtol=1e-4, atol=1e-4)


def test_maximum_and_minimum_keep_nan_and_the_first_operand_on_ties():
    a = torch.tensor([-0.0, 0.0, float("nan"), 1.0, 2.0, -1.0])
    b = torch.tensor([0.0, -0.0, 1.0, float("nan"), 1.0, 3.0])
    for fn in (torch.maximum, torch.minimum):
        gm, graph, plan = trace(lambda a, b: fn(a, b) * 1.0, a, b)
        got, want = run(gm, [a, b]), fn(a, b)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_fp32_math_calls_the_float_functions_and_matches_torch():
    """tanh/erf/log of a float tensor call tanhf/erff/logf (libmvec's SIMD versions where glibc has
    them), not the double ones: GELU's tanh was a scalar double call per element."""
    x = torch.linspace(-9, 9, 1001)

    def fn(x):
        return torch.tanh(x) + torch.erf(x) * 0.5 + torch.log(x.abs() + 1e-3)
    gm, graph, plan = trace(fn, x)
    source, _ = c.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups))
    assert {"tanhf(", "erff(", "logf("} <= {f for f in ("tanhf(", "erff(", "logf(") if f in source}, source
    assert not re.search(r"[^a-z_](tanh|erf|log)\(", source), source
    torch.testing.assert_close(run(gm, [x]), fn(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel, shape", [((2, 2), (2, 3, 8, 10)), ((3, 3), (1, 2, 9, 6)), ((2, 1), (2, 2, 4, 5))])
def test_tiling_max_pool_is_generated_and_exactly_atens(kernel, shape):
    """Values and indices equal ATen's bit for bit: ties (a ReLU's zeros) keep the first maximum of
    the window, a NaN wins (the last one of its window); the gradient through the indices too."""
    torch.manual_seed(0)
    x = torch.relu(torch.randn(shape))
    x[0, 0, 0, 0] = x[0, 1, 1, 0] = x[-1, -1, -1, -1] = float("nan")
    x[-1, 0, :kernel[0], :kernel[1]] = 0.0
    x[-1, 0, 0, 1 % kernel[1]] = -0.0        # a signed-zero tie: ATen keeps the first, +0.0

    def pool(x):
        return torch.ops.aten.max_pool2d_with_indices(x, list(kernel))
    gm, graph, plan = trace(pool, x)
    assert not any("max_pool2d_with_indices" in graph.nodes[n].op for g in plan.groups
                                             if g.kind == "extern" for n in g.nodes), fusion.describe(graph, plan)
    values, indices = run(gm, [x])
    want_values, want_indices = pool(x)
    torch.testing.assert_close(values, want_values, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(values), torch.signbit(want_values))
    assert torch.equal(indices, want_indices)

    leaf = x.clone().requires_grad_()
    eager = torch.nn.functional.max_pool2d(leaf, kernel)
    grad = torch.randn(eager.shape)
    want = torch.autograd.grad(eager, leaf, grad)[0]
    leaf2 = x.clone().requires_grad_()
    compiled = torch.compile(lambda t: torch.nn.functional.max_pool2d(t, kernel), backend=make_backend(top_k=1))
    got = torch.autograd.grad(compiled(leaf2), leaf2, grad)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_overlapping_or_padded_max_pool_stays_aten():
    x = torch.randn(2, 3, 9, 9)
    for fn in (lambda x: F.max_pool2d(x, 3, stride=2), lambda x: F.max_pool2d(x, 2, padding=1)):
        gm, graph, plan = trace(fn, x)
        assert any("max_pool2d" in graph.nodes[n].op for g in plan.groups if g.kind == "extern" for n in g.nodes)
        torch.testing.assert_close(run(gm, [x]), fn(x))


def test_a_bad_schedule_is_one_clear_error():
    with pytest.raises(ValueError, match="Schedule.gemm is 'mkl'; use 'library' or 'generated'"):
        Schedule(gemm="mkl")
    with pytest.raises(ValueError, match="Schedule.gemm_mr is 0; it must be at least 1"):
        Schedule(gemm_mr=0)
    with pytest.raises(ValueError, match="vector_width is 1 with gemm='generated'"):
        Schedule(gemm="generated", vector_width=1)


def test_schedule_knobs_reach_the_source():
    x, w, b = torch.randn(8, 40), torch.randn(40), torch.randn(40)
    gm, graph, plan = trace(layer_norm, x, w, b)
    source = lambda s: c.write_source(graph, plan.groups, plan.buffers, [s] * len(plan.groups))[0]  # noqa: E731
    assert "simdlen(16)" in source(DEFAULT) and "simdlen(8)" in source(Schedule(vector_width=8))
    assert "GCC unroll 4" in source(Schedule(unroll=4))
    assert "omp parallel for" in source(Schedule(parallel_min_elements=1))
    assert "omp parallel for" not in source(Schedule(parallel_min_elements=1, parallel_axis=-1))


@pytest.mark.parametrize("src,dst", [((4, 6), (24,)), ((2, 3, 4), (6, 4)), ((6, 4), (2, 3, 4)), ((6, 1, 4), (6, 4)),
                                     ((2, 6), (3, 4)), ((1, 5), (5, 1)), ((3, 4, 5), (60,))])
def test_reshape_index_map_matches_torch(src, dst):
    base = torch.arange(int(torch.tensor(src).prod())).reshape(src)
    viewed = base.reshape(dst)
    names = [f"i{d}" for d in range(len(dst))]
    exprs = loopnest.reshape_index(src, dst, [expr.var(n) for n in names])
    for idx in itertools.product(*(range(n) for n in dst)):
        env = dict(zip(names, idx))
        src_idx = tuple(expr.evaluate(e, env) for e in exprs)
        assert base[src_idx] == viewed[idx], f"{src}->{dst} at {idx}: {exprs}"


def test_cache_compiles_once_and_leaves_no_temp_files(tmp_path):
    source = c.PRELUDE + "int answer(void) { return 42; }\n"
    builds = cache.STATS["builds"]
    first = build_library(source)
    second = build_library(source)
    assert first == second and cache.STATS["builds"] == builds + 1
    assert load_library(first).answer() == 42
    assert first.with_suffix(".c").read_text() == source
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]
    assert Path(os.environ["TFSN_CACHE"]) in first.parents


def test_cache_key_covers_the_source():
    a = build_library(c.PRELUDE + "int f(void) { return 1; }\n")
    b = build_library(c.PRELUDE + "int f(void) { return 2; }\n")
    assert a != b and load_library(a).f() == 1 and load_library(b).f() == 2


RUN_MODEL = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from optimizer import cache
    from optimizer.backend import optimize
    from tests.optimizer_models import suite
    case = next(c for c in suite() if c.name == "gpt2_block")
    torch.manual_seed(0)
    model = optimize(case.build())
    loss = case.loss(model, case.batch(torch.Generator().manual_seed(1)))
    loss.backward()
    print(json.dumps({{"builds": cache.STATS["builds"], "hits": cache.STATS["hits"], "loss": loss.item()}}))
""")


def run_model_processes(n: int, cache_dir: Path) -> list[dict]:
    import json
    env = {**os.environ, "TFSN_CACHE": str(cache_dir)}
    code = RUN_MODEL.format(root=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(n)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_a_second_process_compiles_nothing_and_concurrent_ones_agree(tmp_path):
    first, other = run_model_processes(2, tmp_path / "cache")           # two at once on an empty cache
    assert first["builds"] > 0 and first["loss"] == other["loss"]
    assert not [p for p in (tmp_path / "cache").rglob(".*")], "a temp file was left behind"
    (again,) = run_model_processes(1, tmp_path / "cache")
    assert again["builds"] == 0 and again["hits"] > 0 and again["loss"] == first["loss"]


def test_kernels_of_the_same_code_are_compiled_once_and_both_compute_eagers_values():
    """Two groups of the same loop nest (a repeated layer's) under other names: gcc compiles the function once,
    the second name an alias of it, and each call writes its own output."""
    def fn(a, b):
        return torch.tanh(a) * 2 + 1, torch.tanh(b) * 2 + 1
    a, b = torch.randn(37, 5), torch.randn(37, 5)
    gm, graph, plan = trace(fn, a, b)
    source, written = c.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups), plan.inplace)
    first, second = [k.name for k in written if k is not None]
    assert source.count(f"void {first}(") == 1 and f"void {second}(" not in source
    assert f'{second} __attribute__((alias("{first}")))' in source
    got = run(gm, [a, b])
    for g, want in zip(got, fn(a, b)):
        torch.testing.assert_close(g, want)


def test_generated_code_shares_torchs_openmp_runtime():
    build = build_library(c.PRELUDE + "#include <omp.h>\nint threads(void) { return omp_get_max_threads(); }\n")
    lib = load_library(build)
    assert "-fopenmp" in host_flags()
    maps = Path("/proc/self/maps").read_text()
    gomps = {line.split()[-1] for line in maps.splitlines() if re.search(r"libgomp[^/]*\.so", line)}
    assert len(gomps) == 1, f"two OpenMP runtimes loaded: {gomps}"
    assert lib.threads() == torch.get_num_threads()


def test_bad_options_are_one_clear_error():
    with pytest.raises(ValueError, match="unknown option 'fusion'; known options: schedule, fuse"):
        make_backend(fusion=False)
    with pytest.raises(ValueError, match="schedule must be an optimizer.schedule.Schedule"):
        make_backend(schedule={"vector_width": 8})


def test_generated_exp_is_accurate_and_handles_special_values():
    x = torch.cat([torch.linspace(-100, 89, 100003),
                   torch.tensor([float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 88.72, 88.73])])
    gm, graph, plan = trace(lambda x: torch.exp(x) + 0.0, x)
    y, ref = run(gm, [x]), torch.exp(x)
    normal = torch.isfinite(ref) & (ref > 2.6e-38)
    rel = ((y - ref).abs() / ref)[normal]
    assert rel.max().item() < 4 * 2**-23, "exp is off by more than 4 ulp"
    assert (y[~normal & torch.isfinite(ref)] <= 2.6e-38).all(), "tiny results flush to (near) zero"
    assert y[-7].item() == 0.0 and y[-6].item() == float("inf") and torch.isnan(y[-5])
    assert y[-2].item() == pytest.approx(ref[-2].item(), rel=1e-6) and y[-1].item() == float("inf")


@pytest.mark.parametrize("shape, strides, want", [
    ((12, 116, 768), (89088, 768, 1), "i0*768"),          # [B, T, C] read as [B*T, C]: contiguous, no division
    ((12, 116, 768), (768, 9216, 1), "/116"),             # T and B swapped in memory: the division stays
])
def test_a_merged_view_of_contiguous_dims_indexes_without_division(shape, strides, want):
    """A kernel over [B*T, C] reading a [B, T, C] tensor; its sum over rows reads the tensor over its own axes
    (ir._reduced_through_view), in either layout with no division."""
    x = torch.empty_strided(shape, strides).normal_()

    def fn(x):
        return x.reshape(-1, shape[-1]) * 2, x.reshape(-1, shape[-1]).sum(0)
    gm, graph, plan = trace(fn, x)
    source, kernels = c.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups))
    (summed,) = [k.source for g, k in zip(plan.groups, kernels) if g.reduced]
    assert want in source and "/" not in summed, source
    for a, e in zip(run(gm, [x]), fn(x)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-3)


def test_fold_splits_undoes_only_divisions_the_strides_allow():
    r = expr.var("r")
    idx = loopnest.reshape_index((2, 3, 4, 5), (120,), (r,))
    assert expr.fold_splits(list(zip(idx, (60, 20, 5, 1)))) == [(r, 1)]
    # dims 2 and 3 swapped in memory: only the outer pair folds
    assert sorted(((c.c_index(e), s) for e, s in expr.fold_splits(list(zip(idx, (60, 20, 1, 4)))))) == \
        [("(r)%5", 4), ("(r/5)%4", 1), ("r/20", 20)]
    for value in range(120):
        for strides in ((60, 20, 5, 1), (60, 20, 1, 4), (1, 2, 6, 24)):
            exact = sum(expr.evaluate(e, {"r": value}) * s for e, s in zip(idx, strides))
            folded = sum(expr.evaluate(e, {"r": value}) * s for e, s in expr.fold_splits(list(zip(idx, strides))))
            assert folded == exact


def trace_mutation(fn, *inputs):
    """fn's graph as AOTAutograd hands it over when it keeps input mutations: functional ops,
    then one copy_ into each mutated input at the end."""
    gm = make_fx(torch.func.functionalize(fn, remove="mutations"), decomposition_table=decompositions())(*inputs)
    graph = ir.from_fx(gm)
    return gm, graph, fusion.plan(graph)


def copies(graph, plan) -> int:
    return sum(g.kind == "extern" and graph.nodes[g.nodes[0]].op == fusion.COPY_INTO for g in plan.groups)


def momentum_update(p, g, m):
    m.mul_(0.9).add_(g, alpha=0.1)
    p.sub_(m * 0.01 + p * 1e-3)


def test_an_update_writes_over_its_inputs_with_no_copy():
    p, g, m = torch.randn(7, 13), torch.randn(7, 13), torch.randn(7, 13)
    gm, graph, plan = trace_mutation(momentum_update, p, g, m)
    assert sorted(plan.inplace.values()) == graph.inputs[:1] + graph.inputs[2:] and copies(graph, plan) == 0, \
        fusion.describe(graph, plan)
    want_p, want_m = p.clone(), m.clone()
    momentum_update(want_p, g, want_m)
    # p arrives transposed-contiguous, not as traced: the kernel writes a conformed copy, copied back
    p_t = p.t().contiguous().t()
    run(gm, [p_t, g, m])
    torch.testing.assert_close(p_t, want_p)
    torch.testing.assert_close(m, want_m)


@pytest.mark.parametrize("fn", [
    lambda x: (x.add(1), x.mul_(2))[0].sum(),     # the old x summed by a kernel after the one writing x
    lambda x: (x.copy_(x.t() * 2), None)[1],      # x read at another element than the one written
], ids=["read-later", "read-elsewhere"])
def test_an_input_read_after_or_beside_its_write_keeps_its_copy(fn):
    x = torch.randn(9, 9)
    gm, graph, plan = trace_mutation(fn, x.clone())
    assert plan.inplace == {} and copies(graph, plan) == 1, fusion.describe(graph, plan)
    want_x = x.clone()
    want = fn(want_x)
    got = run(gm, [x])
    torch.testing.assert_close(x, want_x)
    if want is not None:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_loops_follow_the_layout_and_merge_short_axes(layout):
    x = torch.randn(4, 12, 26, 26)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        x = torch.randn(4, 12, 26, 30)[..., 2:28]

    def fn(x):
        return F.relu(x) * 2, (x * x).sum(dim=(0, 2, 3))
    gm, graph, plan = trace(fn, x)
    source, _ = c.write_source(graph, plan.groups, plan.buffers, [DEFAULT] * len(plan.groups))
    if layout == "contiguous":        # rows of 26 are contiguous: one loop of 26 x 26 per (batch, channel)
        assert "m2 < 676;" in source and "m1 < 8112;" in source, source
    elif layout == "channels_last":   # channels innermost, as they lie in memory; the 12 channels' sums
        # run their SIMD lanes along rows of 26 pixels x 12 channels (a lane per pixel and channel)
        assert "m3 < 312;" in source and "jb" not in source, source
    else:                             # rows 30 apart: no merged loop, whose index would need a division
        assert "m2" not in source and "i3 < 26;" in source, source
    for got, want in zip(run(gm, [x]), fn(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


CHANNELS_LAST_SCHEDULES = [DEFAULT, Schedule(parallel_min_elements=1), Schedule(parallel_axis=-1),
                           Schedule(vector_width=1), Schedule(vector_width=16, chunk=3, parallel_min_elements=1)]


@pytest.mark.parametrize("channels", [3, 10, 18, 64])
@pytest.mark.parametrize("schedule", CHANNELS_LAST_SCHEDULES, ids=str)
def test_channels_last_batchnorm_gelu_forward_and_backward(channels, schedule):
    """BatchNorm + GELU over a channels-last activation, forward and backward, as training runs it:
    a per-channel reduction whose channels are innermost in memory. With fewer than 64 channels its
    SIMD lanes run along rows of whole pixels (a lane per pixel and channel, the channels' sums folded
    from them), and the per-channel weight, mean and scale are read from tables along those lanes."""
    torch.manual_seed(channels)
    x = torch.randn(5, channels, 9, 7).contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(channels) + 0.5, torch.randn(channels)
    g = torch.randn(5, channels, 9, 7).contiguous(memory_format=torch.channels_last)

    def bn_gelu(x, w, b, g):          # BatchNorm in training as its decomposition computes it
        mean = x.mean((0, 2, 3), keepdim=True)
        rstd = torch.rsqrt(x.var((0, 2, 3), unbiased=False, keepdim=True) + 1e-5)
        y = F.gelu((x - mean) * rstd * w[:, None, None] + b[:, None, None])
        return (y, *torch.autograd.grad(y, (x, w, b), g))
    want = bn_gelu(x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), g)
    gm, graph, plan = trace(bn_gelu, x, w, b, g)
    nests = [loopnest.lower(graph, k, plan.buffers, tables=True) for k in kernels(graph, plan)]
    lanes = [n.lane_run for n in nests if n.lane_run is not None]
    if channels < loopnest.LANE_COLUMNS:
        assert lanes and all(n.lanes(run[0]) <= loopnest.TABLE_MAX for n, run in zip(nests, lanes)), \
            fusion.describe(graph, plan)
        source, _ = c.write_source(graph, plan.groups, plan.buffers, [schedule] * len(plan.groups))
        assert "tb0[" in source and "% " not in source.split("tb0[")[-1].split("\n}")[0], source
    else:
        assert not lanes
    got = run(gm, [x.detach(), w.detach(), b.detach(), g], schedule=schedule)
    for a, e, name in zip(got, want, ["y", "grad x", "grad w", "grad b"]):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("schedule", CHANNELS_LAST_SCHEDULES, ids=str)
def test_per_image_channel_statistics_of_channels_last_tensors(schedule):
    """A column reduction that also keeps an outer axis (statistics per image and channel, as an
    instance or group norm takes them from an NHWC tensor), with a mean and the centred values after
    it; and a max over the same axes, which keeps the column blocks (no lanes)."""
    x = torch.randn(4, 11, 13, 6)           # N, H, W, C: channels innermost

    def stats(x):
        mean = x.mean((1, 2), keepdim=True)
        return x - mean, (x * x).sum((1, 2))

    def peaks(x):
        return x.amax((1, 2)), x - x.amax((1, 2), keepdim=True)
    for fn, lanes in ((stats, True), (peaks, False)):
        gm, graph, plan = trace(fn, x)
        nests = [loopnest.lower(graph, k, plan.buffers, tables=True) for k in kernels(graph, plan)]
        assert any(n.lane_run is not None and n.kept[:-1] for n in nests) == lanes, fusion.describe(graph, plan)
        for a, e in zip(run(gm, [x], schedule=schedule), fn(x)):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_batchnorm_running_statistics_under_channels_last_lanes():
    """A compiled BatchNorm2d + GELU training on channels-last inputs of 10 channels: its running
    mean and variance, updated in place by the per-channel statements, are updated once per step
    (not once per lane), and its output and gradients match eager over three steps."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.BatchNorm2d(10), torch.nn.GELU())
    mine = torch.nn.Sequential(torch.nn.BatchNorm2d(10), torch.nn.GELU())
    mine.load_state_dict(eager.state_dict())
    compiled = torch.compile(mine, backend=make_backend(top_k=1))
    for step in range(3):
        x = torch.randn(6, 10, 8, 8).contiguous(memory_format=torch.channels_last)
        want, got = eager(x), compiled(x)
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for (name, a), e in zip(mine.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, e.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
        for (name, a), e in zip(mine.named_buffers(), eager.buffers()):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step} {name}: {m}")


def conv_chain(x, w1, w2):
    return F.conv2d(F.relu(F.conv2d(x, w1, padding=1)), w2, padding=1)


def test_convolutions_take_channels_last_activations_and_outputs_keep_their_layout():
    x, w1, w2 = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3), torch.randn(5, 4, 3, 3)
    gm = make_fx(conv_chain, tracing_mode="fake", decomposition_table=decompositions())(x, w1, w2)
    assert layout.channels_last_convolutions(gm)
    convs = [n for n in gm.graph.nodes if n.target == torch.ops.aten.convolution.default]
    assert all(n.args[0].meta["val"].is_contiguous(memory_format=torch.channels_last) for n in convs)
    clones = [n for n in gm.graph.nodes if n.target == torch.ops.aten.clone.default]
    # x is copied to NHWC; the ReLU between the convolutions is NHWC already; the result back to NCHW
    assert [n.kwargs["memory_format"] for n in clones] == [torch.channels_last, torch.contiguous_format]
    graph = ir.from_fx(gm)
    assert graph.nodes[graph.outputs[0].index].type.strides == (5 * 81, 81, 9, 1)
    torch.testing.assert_close(run(gm, [x, w1, w2]), conv_chain(x, w1, w2), rtol=1e-4, atol=1e-4)


def test_a_view_that_needs_the_old_layout_keeps_it():
    def flatten(x, w):
        return F.conv2d(x, w).view(2, -1)
    x, w = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3)
    gm = make_fx(flatten, tracing_mode="fake", decomposition_table=decompositions())(x, w)
    code = gm.code
    assert not layout.channels_last_convolutions(gm)
    assert gm.code == code
    torch.testing.assert_close(run(gm, [x, w]), flatten(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", [DEFAULT, Schedule(gemm="generated")], ids=["library", "generated"])
def test_gemm_operands_that_are_views_read_the_right_memory(schedule):
    x, w = torch.randn(21, 40), torch.randn(23, 37)

    def fn(x, w):       # a slice starts past its base's first element; the transposes do not
        return torch.relu(x[:, 3:] @ w.t()) + x[:, :23]
    gm, graph, plan = trace(fn, x, w)
    assert [g.kind for g in plan.groups].count("gemm") == 1, fusion.describe(graph, plan)
    torch.testing.assert_close(run(gm, [x, w], schedule=schedule), fn(x, w), rtol=1e-4, atol=1e-4)


def diagonal_then_update(x, y, w):
    y.add_(x.diagonal())           # an alias of x from an op the IR does not see as a view
    x.mul_(2)
    w.copy_(torch.cumsum(x, 0))


def test_an_input_aliased_by_an_aten_view_keeps_its_copy():
    x, y, w = torch.randn(5, 5), torch.randn(5), torch.randn(5, 5)
    gm, graph, plan = trace_mutation(diagonal_then_update, x.clone(), y.clone(), w.clone())
    assert graph.inputs[0] not in plan.inplace.values(), fusion.describe(graph, plan)
    want = [x.clone(), y.clone(), w.clone()]
    diagonal_then_update(*want)
    run(gm, [x, y, w])
    for got, expected in zip((x, y, w), want):
        torch.testing.assert_close(got, expected)


def test_a_mutated_input_given_in_other_strides_is_still_mutated():
    def fn(x):
        return (x.add(1), x.mul_(2))[0].sum()
    x = torch.randn(9, 9)
    gm, graph, plan = trace_mutation(fn, x.clone())
    given = x.t().contiguous().t()       # the traced strides' transpose: the kernels read a copy
    want = x.clone()
    total = fn(want)
    torch.testing.assert_close(run(gm, [given]), total)
    torch.testing.assert_close(given, want)


def test_a_slice_of_a_transposed_gemm_operand_is_made():
    x, w = torch.randn(4, 8), torch.randn(9, 8)

    def fn(x, w):
        return torch.relu(x @ w.t()[:, :5])
    gm, graph, plan = trace(fn, x, w)
    torch.testing.assert_close(run(gm, [x, w]), fn(x, w))


def test_strided_ops_keep_the_convolutions_layout():
    def fn(x, w):
        return F.relu(F.conv2d(x, w)).as_strided((2, 4, 6), (144, 36, 6)).sum(-1)
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    gm = make_fx(fn, tracing_mode="fake", decomposition_table=decompositions())(x, w)
    assert not layout.channels_last_convolutions(gm)


class _StridedResidual(torch.nn.Module):
    """relu(bn(conv3x3 stride 2 (x)) + bn(conv1x1 stride 2 (x))), pooled: a ResNet downsampling
    block's two paths, with the input's gradient the sum of the two convolutions' grad inputs."""

    def __init__(self, channels: int = 24) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, channels, 3, stride=2, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(channels)
        self.shortcut = torch.nn.Conv2d(3, channels, 1, stride=2, bias=False)
        self.bn_shortcut = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + self.bn_shortcut(self.shortcut(x))).mean((2, 3))


def test_input_gradient_of_a_strided_residual_block():
    """The input's gradient through both paths of a downsampling block matches eager. Its BatchNorm
    backward (24 channels innermost, in blocks of 16, with the ReLU mask selecting the mean's gradient)
    was miscompiled by gcc 12 at -O3 for AVX-512: values up to 1e35 at a few elements of the last
    image, at batches 5 to 8 (compiler.host_flags now turns ivopts off). Under this schedule it
    failed in every run."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _StridedResidual()
    mine = _StridedResidual()
    mine.load_state_dict(eager.state_dict())
    compiled = torch.compile(mine, backend=make_backend(schedule=Schedule(column_block=16, parallel_min_elements=1)))
    x = torch.randn(5, 3, 16, 16)
    grads = []
    for model in (eager, compiled):
        leaf = x.clone().requires_grad_()
        model(leaf).square().sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)
