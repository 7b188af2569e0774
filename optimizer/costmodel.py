"""The analytical cost model: the time of a generated kernel under a schedule, on a chip spec.

Why analytical: the search scores millions of (kernel, schedule) candidates; only a handful are
ever compiled. A candidate is one row of a table (`Candidates`); what a kernel does is extracted
once (`KernelFeatures`) and broadcast to its rows, and every formula below is numpy over all rows
at once, so that scoring costs well under a microsecond per candidate.

Model of one CPU kernel (the C the generator writes; see optimizer/codegen/c.py):

- threads: the outer loop split across `compute_units` threads in static chunks; the busiest
  thread's share of the outer iterations sets the time (chunk quantization), plus a fork/join
  (`launch_overhead_us`) when parallel, plus the Python-side call (`call_overhead_us`).
- compute: per row, the innermost loop runs ceil(inner / lanes) vector iterations plus a scalar
  remainder; each iteration issues its weighted arithmetic on two vector pipes, and a loop with a
  reduction carried across iterations is bound by the add latency instead.
- memory: bytes read and written, at the bandwidth of the smallest memory level that holds the
  kernel's footprint (a level private to a core holds only the running threads' share), for the
  running threads (`core_bandwidth_gbs` each, at most the level's total); an access strided along
  the innermost loop moves a cache line per element unless those lines stay cached. A row read in
  several passes (LayerNorm: mean, variance, normalize) is read again from where one row fits.
- GEMM: the library (MKL) at the spec's fraction of peak (measured by `tfsn calibrate`) on its
  block of rows, plus the packing of B it redoes per call (one call when there is no epilogue);
  or the generated micro-kernel: per step of depth, max of FMAs on two pipes, loads on two ports
  and the FMA latency of one accumulator chain, with a spill penalty once the accumulators and B
  vectors exceed the register file; tiles past an edge run full-width on padding; B is packed
  once per call into panels, each re-read per row tile from the level one panel fits in, the
  block of A per panel. The epilogue is a pointwise kernel on the block.
- the kernel time is max(compute, memory) plus overheads (roofline per level).

Every constant below is a named assumption; the spec's numbers come from configs/hardware or from
`tfsn calibrate` (optimizer/calibrate.py) of this very machine. Accuracy is measured by
benchmarks/costmodel_accuracy.py, never assumed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from optimizer.hardware import HardwareSpec
from optimizer.schedule import Schedule

POINTWISE, REDUCTION, GEMM = 0, 1, 2
# What a GEMM multiplies in (KernelFeatures.precision indexes these): fp32 on the SIMT cores, TF32 only where
# the captured model allowed it, bf16 / fp16 on tensor cores; every one accumulates in fp32
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
PRECISION_BYTES = (4, 4, 2, 2)

LINE_BYTES = 64                 # cache line, bytes (x86-64, Arm Neoverse)
VECTOR_PIPES = 2                # vector arithmetic issued per cycle (two FMA ports: Intel since Haswell, Zen 4)
LOAD_PORTS = 2                  # vector loads per cycle (Intel Optimization Manual: 2 x 512-bit on SPR)
ADD_LATENCY = 4                 # cycles of a dependent FP add/FMA (Intel Optimization Manual, Golden Cove)
VECTOR_REGISTERS = 32           # zmm0-31 (AVX-512) / ymm0-31 with AVX-512VL
LOOP_OVERHEAD = 1.0             # cycles of index arithmetic and branch per iteration of a pass (vector loops:
                                # the compiler unrolls them anyway; scalar ones pay it per unrolled body)
VECTOR_MATH_OPS = 20.0          # vector instructions of an inlined exp / libmvec erf, tanh, log (polynomials)
SCALAR_MATH_CYCLES = 25.0       # cycles of a scalar libm call (expf, erff, tanhf) or our inline exp unvectorized
ROW_OP_CYCLES = 8.0             # cycles of a per-row scalar value (mean, rstd: a divide or a sqrt)
CHUNK_S = 0.1e-6                # seconds of OpenMP bookkeeping and lost prefetch per static chunk
SCALAR_STRIDED = 0.5            # cycles per element loaded with a non-unit stride, scalar
GATHER_PER_LANE = 0.6           # cycles per lane of a vector gather (Intel: ~1 load per lane, 2 ports)
SPILL_FACTOR = 1.6              # slowdown of a micro-kernel whose accumulators spill to the stack
PACK_CYCLES = 3.0               # cycles per element copied into a packed B panel: a transposing copy whose stores
                                # stride by N (fitted to one gemm_c measurement of costmodel_accuracy)
LIBRARY_TILE_ROWS = 8           # rows per library micro-tile (edge waste below a multiple of it)
LIBRARY_CALL_US = 1.0           # one BLAS call's own overhead, microseconds (argument checks, dispatch)
FLAT_ROW = 16                   # elements a 1-D loop's "row" stands for (features.py)
PRIVATE_LEVELS = ("registers", "l1", "l2", "shared")    # per-core levels: a thread holds only its share


@dataclass(frozen=True)
class KernelFeatures:
    """What one fused group does, independent of its schedule (extracted once, see features.py)."""

    kind: int                  # POINTWISE | REDUCTION | GEMM
    elements: float            # iterations of the loop nest over the group's domain
    rows: float                # iterations of the outer loop (rows; for column reductions: rows of kept axes)
    inner: float               # length of the innermost loop (the SIMD one)
    ops: float                 # arithmetic per element, over all passes (add, mul, compare, select)
    math: float = 0.0          # exp / log / tanh / erf / div / sqrt per element, over all passes
    row_ops: float = 0.0       # arithmetic per row (per-row values of a reduction)
    read_bytes: float = 0.0    # bytes of distinct buffers read
    write_bytes: float = 0.0   # bytes written
    strided_bytes: float = 0.0  # of read_bytes, read with a non-unit stride along the innermost loop
    passes: float = 1.0        # passes over each row (reduction stages + final pass)
    row_bytes: float = 0.0     # bytes one pass over one row reads
    carried: float = 0.0       # passes whose innermost loop carries a reduction (latency-bound)
    columns: float = 0.0       # column reductions (last axis kept): the columns blocked by column_block
    load_bytes: float = 4.0    # bytes of one load's element (the narrowest input read whole): how much of a
                               # sector a column reduction's loads use
    m: float = 0.0             # GEMM: rows of C, columns of C, depth, batch
    n: float = 0.0
    k: float = 0.0
    batch: float = 1.0
    b_strided: float = 0.0     # GEMM: B's columns are not contiguous (a transposed operand)
    flat: float = 0.0          # a 1-D loop: its "rows" are FLAT_ROW elements, its chunks count elements
    precision: float = 0.0     # GEMM: index in PRECISIONS of the rate its product runs at (GPUs)
    bias: float = 0.0          # GEMM: its whole epilogue is a bias the library's addmm adds (loopnest.bias_epilogue)
    partials: float = 0.0      # reduction: bytes of one row's partial results of one slice where it may split
                               # (LoopNest.splittable; a GPU's split reduction), 0 where it may not


@dataclass
class Candidates:
    """A table of (kernel, schedule) rows: one numpy column per knob, `kernel` indexes the features."""

    kernel: np.ndarray
    vector_width: np.ndarray
    unroll: np.ndarray
    parallel: np.ndarray       # 1: outer loop across threads (forced, whatever its size), 0: serial
    chunk: np.ndarray
    column_block: np.ndarray
    generated: np.ndarray      # GEMM: 1 generated micro-kernel, 0 library
    block_rows: np.ndarray
    mr: np.ndarray
    nr: np.ndarray
    kc: np.ndarray
    stages: np.ndarray         # GPU GEMM: tiles in flight (Schedule.gemm_stages)
    split: np.ndarray          # GPU reduction: slices of the reduced axes (Schedule.reduction_split)

    def __len__(self) -> int:
        return len(self.kernel)

    @classmethod
    def concat(cls, tables: Sequence[Candidates]) -> Candidates:
        return cls(**{f.name: np.concatenate([getattr(t, f.name) for t in tables]) for f in fields(cls)})

    def take(self, rows: np.ndarray) -> Candidates:
        return Candidates(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def schedule(self, row: int) -> Schedule:
        """The generator's Schedule of one row."""
        parallel = bool(self.parallel[row])
        return Schedule(vector_width=int(self.vector_width[row]), unroll=int(self.unroll[row]),
                        parallel_axis=0 if parallel else -1, parallel_min_elements=0 if parallel else 65536,
                        chunk=int(self.chunk[row]), column_block=int(self.column_block[row]),
                        gemm="generated" if self.generated[row] else "library",
                        gemm_block_rows=int(self.block_rows[row]), gemm_mr=int(self.mr[row]),
                        gemm_nr=int(self.nr[row]), gemm_kc=int(self.kc[row]), gemm_stages=int(self.stages[row]),
                        reduction_split=int(self.split[row]))

    @classmethod
    def of(cls, kernel: int, schedules: Sequence[Schedule]) -> Candidates:
        """Rows for given schedules of one kernel (to score what the generator would get)."""
        def col(f):
            return np.array([f(s) for s in schedules], dtype=np.float64)
        return cls(kernel=np.full(len(schedules), kernel, dtype=np.int64),
                   vector_width=col(lambda s: s.vector_width), unroll=col(lambda s: s.unroll),
                   parallel=col(lambda s: float(s.parallel_axis >= 0)), chunk=col(lambda s: s.chunk),
                   column_block=col(lambda s: s.column_block), generated=col(lambda s: float(s.gemm == "generated")),
                   block_rows=col(lambda s: s.gemm_block_rows), mr=col(lambda s: s.gemm_mr),
                   nr=col(lambda s: s.gemm_nr), kc=col(lambda s: s.gemm_kc), stages=col(lambda s: s.gemm_stages),
                   split=col(lambda s: s.reduction_split))


class FeatureTable:
    """Kernel features as numpy columns, so that candidate rows index them."""

    def __init__(self, kernels: Sequence[KernelFeatures]) -> None:
        self.kernels = list(kernels)
        for f in fields(KernelFeatures):
            setattr(self, f.name, np.array([getattr(k, f.name) for k in kernels], dtype=np.float64))


@dataclass(frozen=True)
class _Chip:
    """The spec reduced to the numbers the formulas use, in seconds, bytes and cycles."""

    cores: float                       # threads the kernels run with (at most the chip's cores)
    units: float                       # the chip's cores: private levels are split over these
    clock: float                       # Hz, effective (see of)
    lanes: float                       # fp32 lanes of the widest vector
    peak_core: float                   # fp32 FLOP/s of one core
    library: float                     # fraction of peak_core the BLAS sgemm reaches
    call_s: float
    fork_s: float
    sizes: np.ndarray                  # bytes per level, chip total
    private: np.ndarray                # bool per level
    bandwidth: np.ndarray              # bytes/s per level, chip total
    core_bandwidth: np.ndarray         # bytes/s per level, one core

    @classmethod
    def of(cls, spec: HardwareSpec, threads: int | None = None) -> _Chip:
        levels = spec.memory
        cores = float(spec.compute_units)
        core_bw = [(lv.core_bandwidth_gbs or lv.bandwidth_gbs / cores) * 1e9 for lv in levels]
        # the issue rate that makes the spec's peak: 2 FLOP x lanes x pipes per cycle (a boost clock
        # when the peak was measured by `tfsn calibrate`)
        clock = spec.core_peak_flops("fp32") / (2.0 * spec.simd_width * VECTOR_PIPES)
        return cls(cores=float(min(threads or cores, cores)), units=cores, clock=clock, lanes=float(spec.simd_width),
                   peak_core=spec.core_peak_flops("fp32"), library=spec.library_gemm_efficiency,
                   call_s=spec.call_overhead_us * 1e-6,
                   fork_s=spec.launch_overhead_us * 1e-6,
                   sizes=np.array([lv.size_mib * 2**20 for lv in levels]),
                   private=np.array([lv.name.lower() in PRIVATE_LEVELS for lv in levels]),
                   bandwidth=np.array([lv.bandwidth_gbs * 1e9 for lv in levels]),
                   core_bandwidth=np.array(core_bw))

    def level_bandwidth(self, footprint: np.ndarray, threads: np.ndarray) -> np.ndarray:
        """Bandwidth (bytes/s) of the smallest level holding `footprint` bytes, for `threads` threads."""
        share = np.where(self.private[None, :], self.sizes[None, :] * (threads[:, None] / self.units),
                         self.sizes[None, :])
        fits = footprint[:, None] <= share
        fits[:, -1] = True
        level = np.argmax(fits, axis=1)
        return np.minimum(self.bandwidth[level], threads * self.core_bandwidth[level])


def _busiest(rows: np.ndarray, threads: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    """Outer iterations of the busiest thread under OpenMP static scheduling."""
    even = np.ceil(rows / threads)
    c = np.maximum(chunk, 1)
    chunked = c * np.ceil(np.ceil(rows / c) / threads)
    return np.minimum(np.where(chunk > 0, chunked, even), rows)


def predict(features: FeatureTable, cand: Candidates, spec: HardwareSpec, threads: int | None = None) -> np.ndarray:
    """Predicted seconds of every candidate row on `spec` (a CPU spec), running `threads` threads
    (default: all of the spec's cores)."""
    chip = _Chip.of(spec, threads)
    k = cand.kernel
    kind = features.kind[k]
    elements, inner = features.elements[k], np.maximum(features.inner[k], 1)
    lanes = cand.vector_width
    column = (kind == REDUCTION) & (features.columns[k] > 0)
    jb = np.minimum(cand.column_block, np.maximum(features.columns[k], 1))
    rows = np.where(column, features.rows[k] * np.ceil(features.columns[k] / jb), features.rows[k])
    # -- threads
    parallel = (cand.parallel > 0) & (rows >= 2)
    threads = np.where(parallel, np.minimum(chip.cores, rows), 1.0)
    chunk = np.where(features.flat[k] > 0, np.ceil(cand.chunk / FLAT_ROW), cand.chunk)
    busiest = _busiest(rows, threads, chunk)
    overhead = chip.call_s + np.where(parallel, chip.fork_s, 0.0)
    # -- compute: cycles per row of the innermost loop
    slots = np.ceil(lanes / chip.lanes)               # issue slots per vector op (2 for 512-bit on a 256-bit datapath)
    simd_len = np.where(column, jb, inner)
    vector_iters = np.floor(simd_len / lanes) + np.mod(simd_len, lanes)
    scalar = lanes <= 1
    math_cycles = np.where(scalar, SCALAR_MATH_CYCLES, VECTOR_MATH_OPS * slots / VECTOR_PIPES)
    per_iter = features.ops[k] * slots / VECTOR_PIPES + features.math[k] * math_cycles \
        + features.passes[k] * LOOP_OVERHEAD / np.where(scalar, cand.unroll, 1.0)
    strided_loads = features.strided_bytes[k] / np.maximum(features.read_bytes[k], 1)
    per_iter += strided_loads * np.where(scalar, SCALAR_STRIDED, GATHER_PER_LANE * lanes)
    per_iter = np.maximum(per_iter, features.carried[k] * ADD_LATENCY * np.where(scalar, 1.0, slots))
    iters_per_row = elements / np.maximum(features.rows[k], 1) / simd_len   # runs of the SIMD loop per row
    cycles_row = iters_per_row * vector_iters * per_iter + features.row_ops[k] * ROW_OP_CYCLES
    row_share = busiest / np.maximum(rows, 1)
    chunks = np.where(parallel & (cand.chunk > 0), np.ceil(busiest / np.maximum(chunk, 1)), 0.0)
    compute = cycles_row * features.rows[k] * row_share / chip.clock + chunks * CHUNK_S
    # -- memory
    moved = features.read_bytes[k] + features.write_bytes[k]
    line_waste = np.where(inner * LINE_BYTES > chip.sizes[0] / chip.units, LINE_BYTES / 4.0, 1.0)
    moved = moved + features.strided_bytes[k] * (line_waste - 1)
    memory = moved / chip.level_bandwidth(moved, threads) * row_share * threads
    reread = features.row_bytes[k] * (features.passes[k] - 1) * rows
    memory += reread / chip.level_bandwidth(features.row_bytes[k] * threads, threads) * row_share * threads
    time = np.maximum(compute, memory) + overhead
    rows_gemm = np.flatnonzero(kind == GEMM)
    if len(rows_gemm):
        time[rows_gemm] = _gemm(features, cand.take(rows_gemm), chip, k[rows_gemm], lanes[rows_gemm],
                                np.maximum(compute, memory)[rows_gemm] * threads[rows_gemm])
    return time


def distinct(features: FeatureTable, cand: Candidates, spec: HardwareSpec) -> np.ndarray:
    """The rows of `cand` worth scoring: one per class of candidates that `predict` prices alike by
    construction (the first of each class, in table order), so that the search neither scores nor
    times twins. A knob counts at the value the formulas above read: a chunk past the rows is all
    rows on one thread, a column block or a GEMM block past the edge is the edge, a parallel loop of
    one row is serial, a serial loop has no chunk, a GEMM's tile depth stops at its depth, and
    unroll counts only on a scalar loop. One exception keeps rows the model prices alike: a vector
    loop unrolled (GCC ivdep + unroll) is other code than one left to `omp simd`, so one unrolled
    vector row stays beside the plain one and the clock settles between them. A GPU spec's
    candidates are all kept."""
    if spec.kind == "gpu" or not len(cand):
        return np.arange(len(cand))
    k = cand.kernel
    gemm = features.kind[k] == GEMM
    generated = gemm & (cand.generated > 0)
    column = (features.kind[k] == REDUCTION) & (features.columns[k] > 0)
    jb = np.where(column, np.minimum(cand.column_block, np.maximum(features.columns[k], 1)), 0.0)
    rows = np.where(column, features.rows[k] * np.ceil(features.columns[k] / np.maximum(jb, 1)), features.rows[k])
    parallel = np.where(gemm, cand.parallel > 0, (cand.parallel > 0) & (rows >= 2))
    units = np.where(features.flat[k] > 0, np.ceil(cand.chunk / FLAT_ROW), cand.chunk)
    chunk = np.where(parallel & ~gemm & (cand.chunk > 0), np.minimum(units, rows), 0.0)
    unroll = np.where(cand.vector_width > 1, np.minimum(cand.unroll, 2.0), cand.unroll)
    m = np.maximum(features.m[k], 1)
    lone = (features.ops[k] + features.math[k] == 0) & (cand.generated == 0)
    block_rows = np.where(gemm, np.where(lone, m, np.minimum(cand.block_rows, m)), 0.0)
    kc = np.where(generated, np.minimum(cand.kc, np.maximum(features.k[k], 1)), 0.0)
    key = np.stack([k.astype(np.float64), cand.vector_width, unroll, parallel.astype(np.float64), chunk, jb,
                    cand.generated, block_rows, np.where(generated, cand.mr, 0.0),
                    np.where(generated, cand.nr, 0.0), kc], axis=1)
    rows = np.ascontiguousarray(key).view(np.dtype((np.void, key.itemsize * key.shape[1]))).ravel()
    _, first = np.unique(rows, return_index=True)     # one bytes key per row: far quicker than axis=0
    return np.sort(first)


def _gemm(f: FeatureTable, cand: Candidates, chip: _Chip, k: np.ndarray, lanes: np.ndarray,
          epilogue_serial: np.ndarray) -> np.ndarray:
    """GEMM rows: the product (library or generated) plus its epilogue (priced as a pointwise loop on
    one thread, `epilogue_serial`) on each block, the blocks split over threads as the code does:
    only when there are 4 or more of them."""
    m, n, depth, batch = np.maximum(f.m[k], 1), np.maximum(f.n[k], 1), np.maximum(f.k[k], 1), f.batch[k]
    lone = (f.ops[k] + f.math[k] == 0) & (cand.generated == 0)     # no epilogue: one library call
    br = np.where(lone, m, np.minimum(cand.block_rows, m))
    blocks = batch * np.ceil(m / br)
    flops = 2.0 * batch * m * n * depth
    outer_par = (cand.parallel > 0) & (blocks >= 4)
    threads = np.where(outer_par, np.minimum(chip.cores, blocks), 1.0)
    share = _busiest(blocks, threads, np.zeros_like(blocks)) / blocks
    # library: per block a call that packs B again, at the spec's library efficiency; serial blocks
    # let the library thread each call itself
    lib_threads = np.where(outer_par, 1.0, np.minimum(chip.cores, np.maximum(1.0, br * n * depth / 2**18)))
    edge = np.ceil(br / LIBRARY_TILE_ROWS) * LIBRARY_TILE_ROWS / br
    lib_compute = flops * edge * share / (chip.library * chip.peak_core * lib_threads)
    pack = depth * n * 4.0 * 2
    pack_s = pack / chip.level_bandwidth(np.full_like(m, 1.0) * depth * n * 4.0, lib_threads)
    lib_calls = LIBRARY_CALL_US * 1e-6 + np.where(outer_par, 0.0, np.where(lib_threads > 1, chip.fork_s, 0.0))
    library = blocks * share * (pack_s + lib_calls) + lib_compute
    # generated micro-kernel: per depth step of one mr x W tile (W: nr in whole vectors); tiles
    # past the block's edge run the same full-vector code on padding, only their store is cut
    mr, kc = cand.mr, np.minimum(cand.kc, depth)
    b_vectors = np.ceil(cand.nr / lanes)
    width = b_vectors * lanes
    panels = np.ceil(n / width)
    acc = mr * b_vectors
    slots = np.ceil(lanes / chip.lanes)
    # + the loop's own step (counter, pointers, branch): hidden behind many accumulators, a quarter
    # of a 4-accumulator tile's step, which runs at its latency bound with no slack
    step = np.maximum.reduce([acc * slots / VECTOR_PIPES, (b_vectors * slots + mr) / LOAD_PORTS,
                              np.full_like(acc, ADD_LATENCY)]) + LOOP_OVERHEAD
    step = np.where(acc + b_vectors + 1 > VECTOR_REGISTERS, step * SPILL_FACTOR, step)
    tiles = np.ceil(br / mr) * panels
    edge_elements = (np.mod(br, mr) > 0) * panels * mr * width + (np.mod(n, width) > 0) * np.ceil(br / mr) * mr * width
    cycles_block = depth * tiles * step + np.ceil(depth / kc) * (tiles * acc * slots * 2 + edge_elements)
    gen_compute = blocks * share * cycles_block / chip.clock
    # B is packed once per call into zero-padded panels, by all threads (a strided B: a transposing copy)
    pack_cycles = batch * depth * panels * width * np.where(f.b_strided[k] > 0, PACK_CYCLES, 1.0) / threads
    # per block: each B panel (kc x W) is streamed once per row tile, the block of A (rows x kc) once per panel
    b_traffic = np.ceil(br / mr) * depth * panels * width * 4.0
    a_traffic = panels * br * depth * 4.0
    one = np.ones_like(threads)            # the busiest thread's own traffic, at one core's bandwidth
    gen_memory = blocks * share * (b_traffic / chip.level_bandwidth(kc * width * 4.0, one)
                                   + a_traffic / chip.level_bandwidth(br * kc * 4.0, one))
    generated = np.maximum(gen_compute, gen_memory) + pack_cycles / chip.clock
    # a bf16/fp16 product for the library: both operands first widened into fp32 copies (read 2 bytes, write 4)
    half = np.isin(f.precision[k], (PRECISIONS.index("bf16"), PRECISIONS.index("fp16")))
    widened = batch * (m * depth + depth * n) * 6.0
    widen_s = np.where(half, widened / chip.level_bandwidth(widened, one), 0.0)
    product = np.where(cand.generated > 0, generated, library + widen_s)
    # the epilogue: the pointwise part of the features, on blocks the product just left in cache
    epilogue = epilogue_serial * share
    return product + epilogue + chip.call_s + np.where(outer_par, chip.fork_s, 0.0)


def predict_on(features: FeatureTable, cand: Candidates, spec: HardwareSpec, threads: int | None = None) -> np.ndarray:
    """`predict` on a CPU spec, `predict_gpu` on a GPU one."""
    return predict_gpu(features, cand, spec) if spec.kind == "gpu" else predict(features, cand, spec, threads)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties), for the accuracy benchmark and tests."""
    ra, rb = _ranks(np.asarray(a, dtype=float)), _ranks(np.asarray(b, dtype=float))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denom) if denom else 0.0


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for value in np.unique(x):               # ties share their average rank
        tie = x == value
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


# ---- GPUs: predictions for hardware that is not present (the planner's and `tfsn optimize`'s view) ----
# A GPU candidate reads the same table with GPU meanings: `chunk` = elements (pointwise) or rows
# (reduction) per program, `mr` = warps per program, and for GEMMs `block_rows` x `nr` x `kc` = the
# BM x BN x BK tile of a program. A program must fit the chip: its shared memory within the spec's
# per-block limit, its registers within the per-thread limit and, times its threads, within the register
# file; a candidate that does not is rejected (an infinite time), as the compiler would refuse it or spill.
# How many programs share an SM (occupancy) is the least that the spec's limits allow; programs run in
# waves of that many per SM, and the last wave's idle SMs count (wave quantization).
GPU_FULL_TILE = 128 * 128       # a BM x BN tile this large reaches the tensor cores' peak; smaller ones less
GPU_SECTOR_BYTES = 32           # the unit NVIDIA's L1 and L2 move (CUDA C++ Best Practices Guide, "Coalesced Access
                                # to Global Memory"): a load that uses fewer of a sector's bytes still moves it
GPU_MATH_OPS = 8.0              # SFU-assisted exp/erf/tanh, in FMA-equivalents per element
GPU_REGISTER_BASE = 32          # registers of a kernel beyond its tile's values: indices, pointers, masks, loop
                                # counters (assumption: ptxas -v reports ~30 for a small Triton pointwise kernel)
GPU_REGISTER_GRANULE = 8        # registers are allocated per warp in units of 256, 8 per thread (CUDA Occupancy
                                # Calculator, "register allocation unit size")
GPU_MMA_K = 16                  # depth of one MMA step: the A and B fragments a thread holds per step
GPU_MAX_DEPTH = 64             # a GEMM's BK at most (Triton's; a CPU schedule's 256 would not fit a block)
GPU_REDUCTION_BLOCK = 1024      # elements of a row a reduction program holds per pass at most (longer rows loop)
GPU_MEMORY_LATENCY = 1.0e-6     # seconds from a load's issue to its data, HBM under load. By Little's law a chip
                                # moves at most the bytes its programs have in flight per latency: one round of
                                # loads per wave of programs (and per block of a row). ~600 cycles unloaded on
                                # Hopper; 1.0 us fits the 2026-12-06 H100 run (benchmarks/gpu_runs: bias + GELU at
                                # 256 elements a program, 4% slower than at 1024, as 331 waves of 1 us say)
GPU_L2_REUSE = 0.5              # the share of L2 a reduction's rows, read again by its later passes, keep hitting
                                # in (assumption: NVIDIA's L2 is two partitions and an SM's reuse stays in its own;
                                # H100 run: softmax and LayerNorm over 32768 x 4096 fp32 took 1.6-1.9x as long with
                                # 34-67 MB of rows resident at once, by this model's occupancy, as with 6.5 MB)
GPU_OVERLAP_WARPS = 0.5         # the share of an SM's warps resident that hides compute behind memory entirely
                                # (assumption: the usual rule of half occupancy for a memory-bound kernel; H100 run:
                                # bias + GELU at 64 elements a thread, 12 warps an SM, was 18% slower than at 48)
# A GEMM left to the vendor's library (cuBLAS through torch): its fraction of the precision's peak and of the
# memory bandwidth (measured on an H200: see optimizer/externs.py, which prices a matmul extern with them)
GPU_LIBRARY_GEMM_COMPUTE = 0.80
GPU_LIBRARY_GEMM_MEMORY = 0.85
# A generated tile's fp32 product in IEEE precision runs on the FMA units, a path Triton does not tune (its
# maintainers, triton-lang/triton#762): the share of the fp32 peak it reaches at most. Users measured 85-95% of
# cuBLAS's on an A100 (#2491); on the 2026-12-06 H100 run (benchmarks/gpu_runs, a 2048^3 product + bias + GELU)
# the best of 5 tiles took 1.08 ms, cuBLAS 0.354 ms with its epilogue: a third of the library's rate
GPU_FMA_DOT = 0.35


def gpu_occupancy(spec: HardwareSpec, threads: np.ndarray, registers: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """Programs resident per SM for programs of `threads` threads, `registers` per thread and `shared`
    bytes of shared memory: the least that the spec's limits allow; 0 where one program alone does not
    fit (too much shared memory for one block, more registers than a thread may have, or a register
    file too small for its threads), which the callers turn into a rejection."""
    regs = np.ceil(registers / GPU_REGISTER_GRANULE) * GPU_REGISTER_GRANULE
    register_file = spec.registers_per_unit_kib * 1024 / 4
    by_shared = np.where(shared > 0, np.floor(spec.shared_memory_per_unit_kib * 1024 / np.maximum(shared, 1.0)),
                         float(spec.blocks_per_unit))
    resident = np.minimum.reduce([np.full_like(threads, float(spec.blocks_per_unit)),
                                  np.floor(spec.threads_per_unit / threads),
                                  np.floor(register_file / (regs * threads)), by_shared])
    fits = (np.ceil(registers) <= spec.registers_per_thread) & (shared <= spec.shared_memory_per_block_kib * 1024)
    return np.where(fits, resident, 0.0)


def _values(features: FeatureTable, k: np.ndarray) -> np.ndarray:
    """Tiles live at once in a loop kernel's registers: its full-size inputs and its result."""
    return 1.0 + np.maximum(1.0, np.round(features.read_bytes[k] / np.maximum(features.elements[k] * 4.0, 1.0)))


def predict_gpu(features: FeatureTable, cand: Candidates, spec: HardwareSpec) -> np.ndarray:
    """Predicted seconds of every candidate row on a GPU spec; `inf` for a program the chip cannot run."""
    k = cand.kernel
    kind = features.kind[k]
    reduction = kind == REDUCTION
    threads = float(spec.simd_width) * np.maximum(cand.mr, 1)       # warps (NVIDIA: 32) or wavefronts (AMD: 64)
    # pointwise and reductions: programs of `chunk` elements / rows. A column reduction (a bias gradient: the
    # last axis kept) is written as a row reduction whose rows are its columns, `chunk` adjacent columns a
    # program, each pass a block of the reduced rows (codegen/triton.py's reduction)
    per_program = np.maximum(cand.chunk, 1)
    column = reduction & (features.columns[k] > 0)
    rows = np.where(column, features.rows[k] * features.columns[k], features.rows[k])
    reduced = np.where(column, features.elements[k] / np.maximum(rows, 1), features.inner[k])
    lane_ops = features.elements[k] * (features.ops[k] + GPU_MATH_OPS * features.math[k])
    # a split reduction (Schedule.reduction_split, where the nest may split): a first launch whose rows are the
    # slices of every row, each writing its partial results (and the members over the whole domain), then a
    # second that combines each row's partials and runs the per-row values after them, writing about a row's
    # partials' bytes a row
    split = np.where(reduction & (features.partials[k] > 0), np.maximum(cand.split, 1), 1.0)
    partial_bytes = rows * split * features.partials[k]
    first = _gpu_loop(spec, reduction, column, rows * split, np.ceil(reduced / split), features.elements[k],
                      lane_ops + np.where(split > 1, 0.0, features.rows[k] * features.row_ops[k]),
                      features.read_bytes[k], features.write_bytes[k] + np.where(split > 1, partial_bytes, 0.0),
                      per_program, threads, _values(features, k), features.load_bytes[k],
                      features.row_bytes[k] / split, np.where(split > 1, np.minimum(features.passes[k], 2.0),
                                                              features.passes[k]))
    second = _gpu_loop(spec, reduction, np.zeros_like(column), rows, split, rows * split,
                       rows * split + features.rows[k] * features.row_ops[k], partial_bytes,
                       rows * features.partials[k], per_program, threads, np.full_like(threads, 2.0),
                       features.load_bytes[k], np.zeros_like(threads), np.ones_like(threads))
    loop = first + np.where(split > 1, second, 0.0)
    return np.where(kind == GEMM, _gpu_gemm(features, cand, spec, threads), loop)


def _gpu_loop(spec: HardwareSpec, reduction: np.ndarray, column: np.ndarray, rows: np.ndarray, reduced: np.ndarray,
              elements: np.ndarray, lane_ops: np.ndarray, read: np.ndarray, write: np.ndarray,
              per_program: np.ndarray, threads: np.ndarray, values: np.ndarray, load_bytes: np.ndarray,
              row_bytes: np.ndarray, passes: np.ndarray) -> np.ndarray:
    """Seconds of one launch of a loop kernel: programs of `per_program` elements (pointwise) or rows of
    `reduced` elements each (reductions), in waves over the SMs; `inf` where a program does not fit."""
    units = float(spec.compute_units)
    l2 = spec.last_level_cache
    l2_bytes, l2_bandwidth = l2.size_mib * 2**20, l2.bandwidth_gbs * 1e9
    in_l2 = read + write <= l2_bytes
    programs = np.where(reduction, np.ceil(rows / per_program), np.ceil(elements / per_program))
    row_block = np.minimum(2.0 ** np.ceil(np.log2(np.maximum(reduced, 1))), GPU_REDUCTION_BLOCK)
    held = np.where(reduction, per_program * row_block, per_program)     # a program's values per pass
    registers = GPU_REGISTER_BASE + np.ceil(held / threads) * values
    resident = gpu_occupancy(spec, threads, registers, np.zeros_like(threads))
    slots = units * np.maximum(resident, 1)
    waves = np.ceil(programs / slots)
    # SMs in use: a launch of fewer programs than SMs leaves the rest idle; more waves than one leave the last
    # one partly empty. That slows what the SMs compute, not what memory moves while enough is in flight (the
    # latency below): a column sum's 4096 programs of one column in two waves, the second 48% full, took the
    # time of the bytes (2026-12-06 H100 run, benchmarks/gpu_runs)
    fill = np.minimum(1.0, programs / units) * np.where(waves > 1, programs / (waves * slots), 1.0)
    compute = lane_ops / (spec.peak_flops("fp32") / 2) / np.maximum(fill, 1e-3)
    # a column program reads `chunk` adjacent elements of each reduced row: a load of fewer bytes than a sector
    # still moves the whole sector, from where the data lives (H100, a column sum of 512 MiB in fp32: 1.1 ms at a
    # column a program, 0.59 ms at two, 0.34-0.40 ms at four, 0.24 ms at sixteen, the sectors' bytes from HBM:
    # the other columns' programs do not find the rest in L2)
    used = np.where(column, np.minimum(1.0, per_program * load_bytes / GPU_SECTOR_BYTES), 1.0)
    moved = read / used + write
    # a reduction's later passes read each row again: from L2 while the rows of the programs resident at once
    # fit in the part of it they keep (GPU_L2_REUSE), else in part from memory again, through L2 either way
    again = np.where(reduction, rows * row_bytes * (passes - 1), 0.0)
    footprint = np.minimum(programs, slots) * per_program * row_bytes
    missed = np.clip(1.0 - GPU_L2_REUSE * l2_bytes / np.maximum(footprint, 1.0), 0.0, 1.0)
    memory = np.where(in_l2, (moved + again) / l2_bandwidth,
                      np.maximum((moved + again * missed) / (spec.main_memory.bandwidth_gbs * 1e9),
                                 (moved + again) / l2_bandwidth))
    # a program's loads are issued together and it waits one latency for them, once per block of its rows on the
    # first pass: programs of few bytes on few slots cannot keep enough in flight to reach the bandwidth
    blocks = np.where(reduction, np.ceil(reduced / row_block), 1.0)
    memory = np.maximum(memory, waves * blocks * GPU_MEMORY_LATENCY)
    # compute and memory overlap while an SM holds enough warps to run some while others wait on memory; with
    # fewer (programs of many registers a thread), part of one adds to the other
    warps = resident * threads / spec.simd_width
    hidden = np.minimum(1.0, warps / (GPU_OVERLAP_WARPS * spec.threads_per_unit / spec.simd_width))
    loop = np.maximum(compute, memory) + (1.0 - hidden) * np.minimum(compute, memory) + spec.launch_overhead_us * 1e-6
    return np.where(resident > 0, loop, np.inf)


def _gpu_gemm(features: FeatureTable, cand: Candidates, spec: HardwareSpec, threads: np.ndarray) -> np.ndarray:
    """GEMM rows: generated, BM x BN tiles in waves of the programs an SM holds, at the rate of the GEMM's
    precision; library, the vendor's product and then the epilogue's program."""
    k = cand.kernel
    units = float(spec.compute_units)
    l2 = spec.last_level_cache
    precision = features.precision[k].astype(np.int64)
    itemsize = np.array(PRECISION_BYTES, dtype=np.float64)[precision]
    peak = np.array([spec.peak_flops(p) for p in PRECISIONS])[precision]
    bm, bn, bk = cand.block_rows, cand.nr, np.minimum(cand.kc, GPU_MAX_DEPTH)
    m, n, depth, batch = features.m[k], features.n[k], features.k[k], features.batch[k]
    tiles = batch * np.ceil(m / bm) * np.ceil(n / bn)
    shared = (bm + bn) * bk * itemsize * cand.stages
    # fp32 accumulators of the tile spread over the threads, plus the A and B fragments of one MMA step
    registers = GPU_REGISTER_BASE + (bm * bn + (bm + bn) * GPU_MMA_K * itemsize / 4.0) / threads
    per_unit = gpu_occupancy(spec, threads, registers, shared)
    slots = units * np.maximum(per_unit, 1)
    padded = batch * np.ceil(m / bm) * bm * np.ceil(n / bn) * bn * depth * 2.0
    tile_eff = np.minimum(1.0, (bm * bn / GPU_FULL_TILE) ** 0.5) * np.where(precision == 0, GPU_FMA_DOT, 1.0)
    # a wave's time is that of the most programs one SM runs in it: `per_unit` in a full wave, fewer in the last
    # one where fewer tiles are left than slots (a tile alone on its SM runs at the SM's rate, however many could
    # fit). H100 run: 512 fp32 tiles of 256 x 32, three an SM, in a full wave and a third of one, took the time of
    # 512 tiles of 32 x 256 one an SM in four full waves (1.08 and 1.12 ms)
    full = np.floor(tiles / slots)
    busiest = full * np.maximum(per_unit, 1) + np.ceil((tiles - full * slots) / units)
    quantized = busiest * units / np.maximum(tiles, 1)
    compute = padded * quantized / (peak * tile_eff)
    unique = batch * (m * depth + depth * n + m * n) * itemsize
    reread = batch * (m * depth * (np.ceil(n / bn) - 1) + depth * n * (np.ceil(m / bm) - 1)) * itemsize
    memory = unique / (spec.main_memory.bandwidth_gbs * 1e9) + reread / (l2.bandwidth_gbs * 1e9)
    epilogue = features.elements[k] * (features.ops[k] + GPU_MATH_OPS * features.math[k]) / (spec.peak_flops("fp32") / 2)
    # with s stages, s - 1 tiles load while one is multiplied: two in flight hide a load (Triton's default of
    # 3); with one stage each tile is loaded, then multiplied
    overlap = np.minimum(1.0, (cand.stages - 1) / 2.0)
    launch = spec.launch_overhead_us * 1e-6
    gemm = np.maximum(compute, memory) + (1.0 - overlap) * np.minimum(compute, memory) + epilogue + launch
    # the library's product (generated == 0): the whole product at the library's rate (it picks its own tiles),
    # written where the graph wants it when nothing follows it but a bias it adds itself (addmm), else into fp32,
    # which a tiled program reads back with the group's other inputs to run the epilogue
    alone = (features.ops[k] + features.math[k] == 0) | (features.bias[k] > 0)
    operands = batch * (m * depth + depth * n) * itemsize
    product = batch * m * n * np.where(alone, itemsize, 4.0)
    library = np.maximum(batch * m * n * depth * 2.0 / (peak * GPU_LIBRARY_GEMM_COMPUTE),
                         (operands + product) / (spec.main_memory.bandwidth_gbs * 1e9 * GPU_LIBRARY_GEMM_MEMORY)) + launch
    rest = np.maximum(features.read_bytes[k] - operands, 0.0) + product + features.write_bytes[k]
    rest_bw = np.where(rest <= l2.size_mib * 2**20, l2.bandwidth_gbs, spec.main_memory.bandwidth_gbs) * 1e9
    library = library + np.where(alone, 0.0, np.maximum(epilogue, rest / rest_bw) + launch)
    return np.where(cand.generated > 0, np.where(per_unit > 0, gemm, np.inf), library)
