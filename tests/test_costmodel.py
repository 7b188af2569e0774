"""The cost model: what it reads off a kernel, and that its predictions move with each knob the way
the machine's time does (the figures themselves are measured by benchmarks/costmodel_accuracy.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from optimizer import costmodel, externs, features, fusion, ir, space
from optimizer.backend import decompositions
from optimizer.costmodel import Candidates, FeatureTable, KernelFeatures, predict, predict_gpu, spearman
from optimizer.hardware import find_hardware, load_all
from optimizer.schedule import Schedule

CPU = load_all()["cpu-generic"]


def lowered(fn, *inputs):
    graph = ir.from_fx(make_fx(fn, decomposition_table=decompositions())(*inputs))
    plan = fusion.plan(graph)
    groups = [g for g in plan.groups if g.kind != "extern"]
    return graph, plan, groups, [features.kernel_features(graph, g, plan.buffers) for g in groups]


def times(kernel: KernelFeatures, schedules, spec=CPU, threads=None) -> np.ndarray:
    return predict(FeatureTable([kernel]), Candidates.of(0, schedules), spec, threads)


def test_spearman_of_known_orders():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)       # ties share their rank
    assert spearman([1, 2, 3], [7, 7, 7]) == 0.0


def test_features_of_softmax_layernorm_and_a_linear_layer():
    x = torch.randn(64, 200)
    _, _, groups, feats = lowered(lambda x: torch.softmax(x, dim=-1), x)
    (soft,) = feats
    assert soft.kind == costmodel.REDUCTION and soft.rows == 64 and soft.inner == 200
    assert soft.passes == 3 and soft.carried == 2          # max, sum of exp, normalize; two carry a reduction
    assert soft.math >= 1 and soft.read_bytes == 64 * 200 * 4
    w, b = torch.randn(96, 200), torch.randn(96)
    _, _, groups, feats = lowered(lambda x, w, b: F.gelu(F.linear(x, w, b)), x, w, b)
    gemm = [f for f in feats if f.kind == costmodel.GEMM]
    assert len(gemm) == 1
    assert (gemm[0].m, gemm[0].n, gemm[0].k) == (64, 96, 200)
    assert gemm[0].b_strided == 1                          # F.linear reads the weight transposed
    assert gemm[0].math >= 1                               # GELU's erf runs in the epilogue


def test_a_transposed_read_is_seen_as_strided():
    x, y = torch.randn(300, 200), torch.randn(200, 300)
    # the loops follow the output's layout (x's, transposed): y is the operand read across its rows
    _, _, _, (mixed,) = lowered(lambda x, y: x.t() * y, x, y)
    assert mixed.strided_bytes == y.numel() * 4 and mixed.read_bytes == 2 * y.numel() * 4
    _, _, _, (plain,) = lowered(lambda x: x + 1.0, x)
    assert plain.strided_bytes == 0
    _, _, _, (transposed,) = lowered(lambda x: x.t() + 1.0, x)   # read and written in x's order
    assert transposed.strided_bytes == 0


def test_predictions_move_with_each_knob_as_the_machine_does():
    big = KernelFeatures(kind=costmodel.POINTWISE, elements=4e6, rows=2000, inner=2000, ops=4, math=2,
                         read_bytes=16e6, write_bytes=16e6)
    scalar, vector, serial = times(big, [Schedule(vector_width=1), Schedule(vector_width=16),
                                         Schedule(vector_width=16, parallel_axis=-1)])
    assert scalar > 2 * vector                             # vectorized math beats scalar calls
    assert serial > 1.5 * vector                           # 16 cores split a large kernel
    tiny = KernelFeatures(kind=costmodel.POINTWISE, elements=64, rows=4, inner=16, ops=1,
                          read_bytes=256, write_bytes=256)
    forked, alone = times(tiny, [Schedule(parallel_min_elements=0), Schedule(parallel_axis=-1)])
    assert forked > alone                                  # the fork costs more than the work
    two = times(big, [Schedule(vector_width=16)], threads=2)[0]
    assert two > 4 * vector                                # 2 threads, not 16


def test_gemm_register_tiles_and_library():
    gemm = KernelFeatures(kind=costmodel.GEMM, elements=512 * 512, rows=512, inner=512, ops=1, m=512, n=512,
                          k=512, write_bytes=512 * 512 * 4)
    fits, spills, thin = times(gemm, [Schedule(gemm="generated", gemm_mr=4, gemm_nr=32),
                                      Schedule(gemm="generated", gemm_mr=8, gemm_nr=64),   # 32 accumulators + B: spill
                                      Schedule(gemm="generated", gemm_mr=1, gemm_nr=16)])  # latency-bound
    assert fits < spills and fits < thin
    library = times(gemm, [Schedule(gemm="library", gemm_block_rows=512)])[0]
    assert library < thin
    # the library's measured efficiency (tfsn calibrate) is what the generated kernel competes with
    slow_blas = dataclasses.replace(CPU, library_gemm_efficiency=0.4)
    slow_library, same_fits = times(gemm, [Schedule(gemm="library", gemm_block_rows=512),
                                           Schedule(gemm="generated", gemm_mr=4, gemm_nr=32)], spec=slow_blas)
    assert slow_library > library * 1.5 and same_fits == pytest.approx(fits)
    assert slow_library > same_fits


def test_every_kernel_space_scores_and_round_trips_to_schedules():
    kinds = [KernelFeatures(kind=costmodel.POINTWISE, elements=1e4, rows=100, inner=100, ops=1),
             KernelFeatures(kind=costmodel.REDUCTION, elements=1e4, rows=100, inner=100, ops=1, passes=2, carried=1),
             KernelFeatures(kind=costmodel.REDUCTION, elements=1e4, rows=1, inner=100, ops=1, columns=100),
             KernelFeatures(kind=costmodel.GEMM, elements=1e4, rows=100, inner=100, ops=0, m=100, n=100, k=100)]
    table = FeatureTable(kinds)
    for make in (space.kernel_space, space.gpu_kernel_space):
        cands = Candidates.concat([make(i, f) for i, f in enumerate(kinds)])
        spec = CPU if make is space.kernel_space else find_hardware("H100")
        predicted = predict(table, cands, spec) if spec.kind == "cpu" else predict_gpu(table, cands, spec)
        assert len(predicted) == len(cands) and np.all(predicted > 0)
        if spec.kind == "cpu":
            assert np.all(np.isfinite(predicted))
        else:       # GPU programs over the chip's limits are rejected (tests/test_gpu_costmodel.py); never all
            assert all(np.isfinite(predicted[cands.kernel == i]).any() for i in range(len(kinds)))
    cpu = space.kernel_space(0, kinds[0])
    assert len({cpu.schedule(r) for r in range(len(cpu))}) == len(cpu)      # no two rows are one schedule


def test_gpu_predictions_rank_chips_and_sizes():
    small = KernelFeatures(kind=costmodel.GEMM, elements=1e6, rows=1000, inner=1000, ops=0, m=1024, n=1024, k=1024)
    large = KernelFeatures(kind=costmodel.GEMM, elements=1.6e7, rows=4096, inner=4096, ops=0, m=4096, n=4096, k=4096)
    table = FeatureTable([small, large])
    cands = Candidates.concat([space.gpu_kernel_space(0, small), space.gpu_kernel_space(1, large)])
    best = {}
    for chip in ("H100", "A10G"):
        t = predict_gpu(table, cands, find_hardware(chip))
        best[chip] = (t[cands.kernel == 0].min(), t[cands.kernel == 1].min())
    assert best["H100"][1] < best["A10G"][1]
    assert best["H100"][0] < best["H100"][1]
    # an fp32 GEMM (the model did not allow TF32) near the library's share of the fp32 peak on an H100 (above
    # the generated tiles' FMA path), never above it
    flops = 2 * 4096 ** 3
    assert 0.75 < flops / best["H100"][1] / find_hardware("H100").peak_flops("fp32") <= costmodel.GPU_LIBRARY_GEMM_COMPUTE


def test_gpu_bias_gradient_is_near_its_bandwidth_bound():
    """A column reduction (one row of 768 columns over 4096 rows) runs as many programs, not one."""
    h100 = find_hardware("H100")
    bias_grad = KernelFeatures(kind=costmodel.REDUCTION, elements=4096 * 768, rows=1, inner=4096, ops=1,
                               read_bytes=4096 * 768 * 4, write_bytes=768 * 4, columns=768)
    t = predict_gpu(FeatureTable([bias_grad]), space.gpu_kernel_space(0, bias_grad), h100).min()
    bound = bias_grad.read_bytes / (h100.main_memory.bandwidth_gbs * 1e9)
    assert bound < t < 10 * bound + h100.launch_overhead_us * 1e-6


def test_a_half_gemm_pays_for_widening_its_operands_only_in_the_library():
    """C's library path copies bf16/fp16 operands into fp32 for sgemm; the generated GEMM widens them on load."""
    fp32 = KernelFeatures(kind=costmodel.GEMM, elements=64 * 256, rows=64, inner=256, ops=0, m=64, n=256, k=512,
                          write_bytes=64 * 256 * 4)
    bf16 = dataclasses.replace(fp32, precision=float(costmodel.PRECISIONS.index("bf16")))
    schedules = [Schedule(gemm="library", gemm_block_rows=64), Schedule(gemm="generated", gemm_mr=4, gemm_nr=32)]
    (library32, generated32), (library16, generated16) = times(fp32, schedules), times(bf16, schedules)
    assert library16 > library32 and generated16 == pytest.approx(generated32)


def test_one_block_gemm_costs_the_same_serial_or_parallel():
    """The generated code forks a GEMM only for 4 blocks or more: with one, both knobs are one kernel."""
    gemm = KernelFeatures(kind=costmodel.GEMM, elements=128 * 3072, rows=128, inner=3072, ops=3, math=1,
                          m=128, n=3072, k=768, write_bytes=128 * 3072 * 4)
    serial, parallel = times(gemm, [Schedule(gemm_block_rows=256, parallel_axis=-1),
                                    Schedule(gemm_block_rows=256, parallel_min_elements=0)])
    assert serial == pytest.approx(parallel)


def _varied_kernels() -> list[KernelFeatures]:
    """Kernels of every kind and edge: row and column reductions, a 1-D loop, a one-row loop, GEMMs
    with and without an epilogue, small and odd shapes."""
    x, w, b = torch.randn(37, 200), torch.randn(96, 200), torch.randn(96)
    cases = [(lambda x: torch.softmax(x, dim=-1), (x,)),
             (lambda x: x.sum(dim=0), (x,)),
             (lambda x: F.layer_norm(x, (200,)), (x,)),
             (lambda v: torch.tanh(v) * 2 + 1, (torch.randn(5003),)),
             (lambda v: v.exp().sum(), (torch.randn(1, 7),)),
             (lambda x, w, b: F.gelu(F.linear(x, w, b)), (x, w, b)),
             (lambda x, w: x @ w.t(), (x, w)),
             (lambda x, w: x @ w.t(), (torch.randn(3, 200), torch.randn(5, 200)))]
    return [f for fn, args in cases for f in lowered(fn, *args)[3]]


@pytest.mark.parametrize("lanes,cores", [(8, 4), (16, 2), (4, 64)])
@pytest.mark.parametrize("threads", [1, 2, None])
def test_distinct_leaves_out_only_twins_the_model_prices_alike(lanes, cores, threads):
    """Every candidate left out has a kept twin of exactly its predicted time, so the search loses
    nothing by not scoring it, and the best of the whole space is still found."""
    spec = dataclasses.replace(CPU, simd_width=lanes, compute_units=cores)
    kernels = _varied_kernels()
    assert {k.kind for k in kernels} == {costmodel.POINTWISE, costmodel.REDUCTION, costmodel.GEMM}
    table = FeatureTable(kernels)
    for i, kernel in enumerate(kernels):
        cands = space.kernel_space(i, kernel)
        every = predict(table, cands, spec, threads)
        kept = costmodel.distinct(table, cands, spec)
        assert 0 < len(kept) < len(cands)
        assert set(every.tolist()) == set(every[kept].tolist()), f"kernel {i} ({kernel.kind}) lost a price"
        assert every[kept].min() == every.min()


def test_distinct_keeps_both_kinds_of_vector_loop():
    """The model prices unroll only on scalar loops, but an unrolled vector loop is other code (GCC
    ivdep + unroll, not omp simd): one unrolled row of each vector width stays for the clock to try."""
    kernel = lowered(lambda v: torch.tanh(v) * 2 + 1, torch.randn(64, 512))[3][0]
    table = FeatureTable([kernel])
    cands = space.kernel_space(0, kernel)
    kept = cands.take(costmodel.distinct(table, cands, CPU))
    serial = kept.parallel == 0
    for width in (4, 8, 16):
        assert sorted(kept.unroll[serial & (kept.vector_width == width)].tolist()) == [1, 2]
    assert sorted(kept.unroll[serial & (kept.vector_width == 1)].tolist()) == [1, 2, 4, 8, 16]


# ---- one worker's thread runs at one core's measured rate

def _calibrated(core_peak_tflops: float):
    """cpu-generic as a 2-core calibration under load would write it: the all-thread peak only 1.2x one
    thread's (`core_peak_tflops`), so that peak / cores understates a core alone."""
    return dataclasses.replace(CPU, compute_units=2, peak_tflops={"fp32": 1.2 * core_peak_tflops},
                               core_peak_tflops=core_peak_tflops)


def test_a_one_thread_gemm_is_priced_at_the_calibrated_core_peak():
    graph, plan, groups, kernels = lowered(lambda a, b: a @ b, torch.randn(512, 512), torch.randn(512, 512))
    library = Schedule(gemm="library", gemm_block_rows=512, parallel_axis=-1)
    spec = _calibrated(0.1)
    measured = times(kernels[0], [library], spec, threads=1)[0]
    uncalibrated = times(kernels[0], [library], dataclasses.replace(spec, core_peak_tflops=0.0), threads=1)[0]
    flops = 2.0 * 512 ** 3
    assert measured == pytest.approx(flops / (spec.library_gemm_efficiency * 0.1e12), rel=0.1)
    assert uncalibrated / measured == pytest.approx(2 / 1.2, rel=0.05)     # peak / cores: 0.06 TFLOP/s, not 0.1


def test_a_cpu_extern_is_priced_for_the_threads_it_runs_with():
    x, w = torch.randn(24, 12, 26, 26), torch.randn(20, 12, 3, 3)
    graph = ir.from_fx(make_fx(lambda x, w: F.conv2d(x, w, padding=1), decomposition_table=decompositions())(x, w))
    (node,) = [n for n in graph.nodes if n.op == "aten.convolution.default"]
    spec = _calibrated(0.1)
    one, every = (externs.extern_cost(graph, node, spec, threads).seconds for threads in (1, None))
    flops = 2.0 * 24 * 20 * 26 * 26 * 12 * 9
    assert one == pytest.approx(flops / (0.1e12 * externs.CPU["conv"].compute) + spec.call_overhead_us * 1e-6)
    assert one / every == pytest.approx(1.2, rel=0.02)                       # the chip's 0.12 TFLOP/s with both
    assert externs.extern_cost(graph, node, spec, 2).seconds == every
