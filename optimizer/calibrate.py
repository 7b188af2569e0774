"""Measure this machine for the CPU cost model, and write what was measured as its hardware spec.

The figures come from small C kernels compiled by the generator's own compiler step (same gcc flags,
same libgomp as torch), so they are what generated code can reach here, not a vendor's peak:
read bandwidth of each cache level and of DRAM, with one thread and with all threads; the FMA rate;
the cost of one kernel call from Python; the fork/join of an OpenMP parallel region.
The machine may be shared and noisy, so every figure is the best of several repetitions (the highest
bandwidth or FLOP rate, the lowest overhead): noise only ever slows a run down.
"""
from __future__ import annotations

import ctypes
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import yaml

from optimizer.cache import atomic_write
from optimizer.calibrate_step import StepFigures, measure
from optimizer.codegen.compiler import build_library, hardware_id
from optimizer.hardware import GENERIC_CPU, cpuinfo, host_cpu_model, host_spec_path, load_all
from optimizer.threads import torch_threads

SOURCE = r"""#include <stdint.h>
#include <time.h>
#include <omp.h>
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
/* unaligned vectors: the buffers' alignment is the allocator's, and an aligned-load fault is no figure */
typedef float vec __attribute__((vector_size(4 * LANES), aligned(4)));
#define SUMS 8      /* independent sums: enough loads in flight to hide the add latency */
#define CHAINS 12   /* independent FMA chains: latency (4-5 clk) x FMA pipes (2), with room */

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int tfsn_lanes(void) { return LANES; }
int tfsn_read_step(void) { return SUMS * LANES; }             /* floats per iteration of a read */
int tfsn_fma_flops(void) { return CHAINS * LANES * 2; }       /* FLOP per iteration of tfsn_fma */

/* Every thread reads its own slice of n floats (n a multiple of SUMS * LANES) `reps` times, into
   accumulators kept across passes (the inner loop is loads and adds only); the seconds it took. */
double tfsn_read(const float* x, int64_t n, int64_t reps, int threads, float* sink) {
  double t0 = now();
  #pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const float* mine = x + (int64_t)t * n;
    vec acc[SUMS];
    for (int k = 0; k < SUMS; k++) acc[k] = (vec){0};
    for (int64_t r = 0; r < reps; r++) {
      __asm__ volatile("" : "+r"(mine));   /* an opaque pointer: every pass must load again */
      for (int64_t i = 0; i < n; i += SUMS * LANES)
        for (int k = 0; k < SUMS; k++) acc[k] += *(const vec*)(mine + i + k * LANES);
    }
    for (int k = 1; k < SUMS; k++) acc[0] += acc[k];
    float s = 0;
    for (int l = 0; l < LANES; l++) s += acc[0][l];
    sink[t] = s;
  }
  return now() - t0;
}

/* Every thread runs `iters` x CHAINS x lanes independent fused multiply-adds of vectors of `type`
   (`lanes` floats); the seconds it took. Defined at full width and at half: a core whose wide vectors
   run as two halves (Zen 4's 512-bit ops on 256-bit pipes) reaches the same rate with both; one with
   full-width pipes, twice. */
#define FMA_KERNEL(name, type, lanes)                                             \
double name(int64_t iters, int threads, float m, float c, float* sink) {          \
  double t0 = now();                                                              \
  _Pragma("omp parallel num_threads(threads)")                                    \
  {                                                                               \
    type a[CHAINS];                                                               \
    for (int k = 0; k < CHAINS; k++) a[k] = (type){0} + (float)k;                 \
    for (int64_t i = 0; i < iters; i++)                                           \
      for (int k = 0; k < CHAINS; k++) a[k] = a[k] * m + c;                       \
    for (int k = 1; k < CHAINS; k++) a[0] += a[k];                                \
    float s = 0;                                                                  \
    for (int l = 0; l < (lanes); l++) s += a[0][l];                               \
    sink[omp_get_thread_num()] = s;                                               \
  }                                                                               \
  return now() - t0;                                                              \
}
typedef float half_vec __attribute__((vector_size(2 * LANES), aligned(4)));
FMA_KERNEL(tfsn_fma, vec, LANES)
FMA_KERNEL(tfsn_fma_half, half_vec, LANES / 2)

/* n empty parallel regions, each timed: the fork/join alone, no ctypes call in between. */
void tfsn_fork_join(int64_t n, int threads, double* seconds) {
  for (int64_t i = 0; i < n; i++) {
    double t0 = now();
    #pragma omp parallel num_threads(threads)
    { __asm__ volatile(""); }
    seconds[i] = now() - t0;
  }
}

/* What a generated kernel's call costs with no work: four pointer arguments, nothing done. */
void tfsn_empty(void* a, void* b, void* c, void* d) { __asm__ volatile("" :: "r"(a), "r"(b), "r"(c), "r"(d)); }
"""

# When sysfs says nothing of a level: a typical x86 server core (32 KiB L1d, 1 MiB L2, 32 MiB shared L3).
DEFAULT_CACHES = {"l1": (32 << 10, 1), "l2": (1 << 20, 1), "l3": (32 << 20, 0)}   # bytes, cpus sharing (0: all)
FULL_WIDTH_GAIN = 1.3         # the widest vector counts as full rate when it beats its half by this much
FLOP_PER_CLOCK_GUESS = 32      # 2 x 256-bit FMA pipes x 8 lanes x 2 FLOP: Haswell and later, Zen 2 and later


@dataclass(frozen=True)
class LevelFigures:
    """One memory level as measured."""

    name: str               # "l1", "l2", "l3", "dram"
    size_mib: float         # capacity summed over the instances the threads use (DRAM: the machine's)
    core_gbs: float         # one thread reading a buffer half the size of one instance (DRAM: much larger)
    all_gbs: float          # all threads at once, each its own slice


@dataclass(frozen=True)
class Calibration:
    """Everything `calibrate` measured; `write_host_spec` turns it into a hardware spec."""

    cpu_model: str
    vendor: str
    threads: int
    simd_width: int                # fp32 lanes at full rate: the widest vector's, or half on a double-pumped unit
    clock_ghz: float
    clock_source: str              # where clock_ghz comes from
    levels: tuple[LevelFigures, ...]
    peak_gflops_core: float        # fp32 FMA rate, one thread
    peak_gflops_all: float         # fp32 FMA rate, all threads
    library_gemm_efficiency: float  # torch.mm's (the BLAS sgemm's) GFLOP/s over the FMA rate, one thread
    call_overhead_us: float        # ctypes call of a 4-pointer kernel + torch.empty_strided of its output
    fork_join_us: float            # one empty OpenMP parallel region on all threads
    per_core_l2_kib: float         # one core's share of L2 (the spec's shared_memory_per_unit_kib)
    step: StepFigures              # the local all-reduce and the optimizer's update (calibrate_step.py)
    quick: bool
    seconds: float                 # how long calibrating took
    measured_at: str               # UTC, ISO 8601
    notes: tuple[str, ...]         # fallbacks taken (a figure assumed, not read) and doubts (a busy machine)

    def figures(self) -> dict:
        """The measured figures as plain data (the CLI's --json)."""
        return asdict(self)


def _cpu_list_size(text: str) -> int:
    """How many CPUs a sysfs list such as "0-3,8" names."""
    count = 0
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1 if lo else 0
    return count


def cache_levels(notes: list[str], cpus: int) -> dict[str, tuple[int, int]]:
    """{"l1": (bytes of one instance, cpus sharing it), "l2": ..., "l3": ...} from sysfs, defaults where absent."""
    found: dict[str, tuple[int, int]] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text() if (index / "shared_cpu_list").exists() else "0"
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or f"l{level}" not in DEFAULT_CACHES:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        found[f"l{level}"] = (int(size.rstrip("KMG")) * scale, max(1, _cpu_list_size(shared)))
    for name, (size, sharing) in DEFAULT_CACHES.items():
        if name not in found:
            notes.append(f"{name}: not in /sys/devices/system/cpu/cpu0/cache, assumed {size >> 10} KiB")
            found[name] = (size, sharing or cpus)
    return found


def _dram_mib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**20


Probe = tuple[Callable[[int], float], float]     # (run `units` of work -> seconds, work per unit)


def _units(run: Callable[[int], float], target_s: float) -> int:
    """The work that makes one run last `target_s`. Growing at most 10x a step, and only stopping at the
    full target, keeps a fixed delay (a thread waiting for a busy core before it starts) from passing
    for work."""
    units = 1
    for _ in range(60):
        seconds = run(units)
        if seconds >= target_s:
            break
        units = math.ceil(units * min(10.0, max(2.0, 1.2 * target_s / max(seconds, 1e-9))))
    return units


def best_rates(probes: dict[str, Probe], target_s: float, repeats: int) -> dict[str, float]:
    """The highest rate (work per second) of each probe over `repeats` rounds. A round runs every probe
    once, so the repetitions of one probe are spread over the whole calibration: a neighbour's burst
    slows some of them, rarely all."""
    units = {key: _units(run, target_s) for key, (run, _) in probes.items()}
    fastest = dict.fromkeys(probes, math.inf)
    for _ in range(repeats):
        for key, (run, _) in probes.items():
            fastest[key] = min(fastest[key], run(units[key]))
    return {key: work * units[key] / fastest[key] for key, (_, work) in probes.items()}


# GEMMs of a training step (tokens x width x width, and the weight gradient's long depth) on which
# the library's sgemm is measured, one thread: the cost model weighs it against generated GEMMs
LIBRARY_SHAPES = ((1024, 256, 768), (1024, 768, 256), (256, 1024, 768))


def _library_gemm(torch, m: int, k: int, n: int) -> Probe:
    """torch.mm (the BLAS sgemm that library GEMMs call) on one thread: (run, GFLOP per run)."""
    a, b, out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)

    def run(reps: int) -> float:
        with torch_threads(1):
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b, out=out)
            return time.perf_counter() - t0
    return run, 2.0 * m * k * n / 1e9


def calibrate(threads: int | None = None, quick: bool = False) -> Calibration:
    """Measure this machine with `threads` threads (default: torch's, what generated kernels run with).

    `quick` shortens every measurement (20 ms instead of 100, 5 repetitions instead of 7, a smaller DRAM
    buffer, fewer rounds of the step's figures), a little noisier; the step's figures, timed in processes
    of their own, take most of the time either way (56 s for --quick on 2 loaded cores, 2026-12-07).
    """
    import torch

    started = time.perf_counter()
    cpus = os.cpu_count() or 1
    threads = threads if threads is not None else torch.get_num_threads()
    if not 1 <= threads <= cpus:
        raise ValueError(f"threads {threads}: this machine has {cpus} CPUs. To fix: use 1 to {cpus}")
    target_s, repeats = (0.02, 5) if quick else (0.1, 7)
    notes: list[str] = []
    lib = ctypes.CDLL(str(build_library(SOURCE)))   # torch is imported first: its libgomp serves ours
    lib.tfsn_read.restype = lib.tfsn_fma.restype = lib.tfsn_fma_half.restype = ctypes.c_double
    lib.tfsn_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.tfsn_fma.argtypes = lib.tfsn_fma_half.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                                          ctypes.c_float, ctypes.c_void_p]
    lib.tfsn_fork_join.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.tfsn_fork_join.restype = None
    lanes, step, fma_flops = lib.tfsn_lanes(), lib.tfsn_read_step(), lib.tfsn_fma_flops()
    sink = (ctypes.c_float * cpus)()

    caches = cache_levels(notes, cpus)
    l3_total = caches["l3"][0] * math.ceil(cpus / caches["l3"][1])
    dram_bytes = max((64 if quick else 256) << 20, 4 * l3_total)      # >= 4x all of L3: no cache hits
    buffer = torch.ones(dram_bytes // 4 + threads * step, dtype=torch.float32)    # touched: pages mapped
    address = buffer.data_ptr()

    def read(floats_per_thread: int, nthreads: int) -> Probe:
        n = max(step, floats_per_thread // step * step)                # whole loop iterations
        return (lambda reps: lib.tfsn_read(address, n, reps, nthreads, sink)), nthreads * n * 4 / 1e9

    # m < 1 and c > 0: every chain converges to c / (1 - m), no overflow, no denormals.
    def fma(nthreads: int) -> Probe:
        return (lambda iters: lib.tfsn_fma(iters, nthreads, 0.999, 0.001, sink)), nthreads * fma_flops / 1e9

    probes = {"peak 1": fma(1), f"peak {threads}": fma(threads),
              "half 1": ((lambda iters: lib.tfsn_fma_half(iters, 1, 0.999, 0.001, sink)), fma_flops / 2e9),
              **{f"sgemm {m}x{k}x{n}": _library_gemm(torch, m, k, n) for m, k, n in LIBRARY_SHAPES}}
    sizes = {}
    for name, (size, sharing) in caches.items():
        # Half an instance per thread: fits with room for the code's own lines. Threads are assumed to be
        # packed, so `sharing` of them split one shared instance.
        sizes[name] = size * math.ceil(threads / sharing) / 2**20
        probes[f"{name} 1"] = read(size // 8, 1)
        probes[f"{name} {threads}"] = read(size // 2 // min(sharing, threads) // 4, threads)
    sizes["dram"] = _dram_mib()
    probes["dram 1"], probes[f"dram {threads}"] = read(dram_bytes // 4, 1), read(dram_bytes // 4 // threads, threads)
    rates = best_rates(probes, target_s, repeats)         # GB/s and GFLOP/s
    levels = tuple(LevelFigures(name, size_mib, rates[f"{name} 1"], rates[f"{name} {threads}"])
                   for name, size_mib in sizes.items())

    # The clock: /proc/cpuinfo "cpu MHz" (the kernel's figure, on a VM the nominal one); where absent,
    # the one-thread FMA rate over a typical 32 FP32 FLOP per clock.
    mhz = cpuinfo("cpu MHz")
    if mhz:
        clock_ghz, clock_source = float(mhz) / 1000, "/proc/cpuinfo cpu MHz"
    else:
        clock_ghz, clock_source = rates["peak 1"] / FLOP_PER_CLOCK_GUESS, "FMA rate / 32 FLOP per clock"
        notes.append("clock: no 'cpu MHz' in /proc/cpuinfo, estimated from the FMA rate")
    if rates[f"peak {threads}"] < 0.75 * threads * rates["peak 1"]:
        notes.append(f"{threads} threads reached only {rates[f'peak {threads}'] / rates['peak 1']:.1f}x the FMA rate "
                     "of one: other work was running (or threads share cores), the all-thread figures are low. "
                     "To fix: calibrate again when the machine is idle, with --threads at most the cores")
    return Calibration(
        cpu_model=host_cpu_model(), vendor=cpuinfo("vendor_id") or "unknown", threads=threads,
        # lanes at full rate (what the cost model divides work by): half the widest vector when
        # that vector is no faster than its half (double-pumped 512-bit)
        simd_width=lanes if rates["peak 1"] >= FULL_WIDTH_GAIN * rates["half 1"] else lanes // 2,
        clock_ghz=clock_ghz, clock_source=clock_source, levels=levels,
        peak_gflops_core=rates["peak 1"], peak_gflops_all=rates[f"peak {threads}"],
        library_gemm_efficiency=statistics.median(rates[f"sgemm {m}x{k}x{n}"] for m, k, n in LIBRARY_SHAPES)
        / rates["peak 1"],
        call_overhead_us=_call_overhead_us(lib, torch, 20 if quick else 50, repeats),
        fork_join_us=_fork_join_us(lib, threads, 10 if quick else 30, 0.2 if quick else 1.0),
        per_core_l2_kib=caches["l2"][0] / 1024 / caches["l2"][1], step=measure(quick), quick=quick,
        seconds=time.perf_counter() - started, measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        notes=tuple(notes))


def _call_overhead_us(lib: ctypes.CDLL, torch, batches: int, repeats: int) -> float:
    """Median per call over batches of 100, best of `repeats`: what runtime.py pays per generated kernel."""
    fn = lib.tfsn_empty
    fn.argtypes, fn.restype = [ctypes.c_void_p] * 4, None
    inputs = [torch.empty(16, 16) for _ in range(3)]
    calls = 100

    def batch() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            out = torch.empty_strided((16, 16), (16, 1), dtype=torch.float32)
            fn(*[t.data_ptr() for t in (out, *inputs)])
        return (time.perf_counter() - t0) / calls

    batch()                                    # warm: the first call resolves the symbol
    return 1e6 * min(statistics.median(batch() for _ in range(batches)) for _ in range(repeats))


def _fork_join_us(lib: ctypes.CDLL, threads: int, batches: int, budget_s: float) -> float:
    """Median of back-to-back empty parallel regions per batch, best batch (the pool is warm, as it is
    between a step's kernels). Batches stop at `budget_s` after three: on a busy machine one region can
    wait milliseconds for a core, and thousands of them would be minutes."""
    regions = 100
    seconds = (ctypes.c_double * regions)()
    lib.tfsn_fork_join(regions, threads, seconds)           # starts the pool's threads: not counted
    medians: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(medians) < batches and (len(medians) < 3 or time.perf_counter() < deadline):
        lib.tfsn_fork_join(regions, threads, seconds)
        medians.append(statistics.median(seconds))
    return 1e6 * min(medians)


def _rounded(value: float, places: int) -> float:
    """`value` to `places` decimals, or to 3 significant digits where those decimals would leave less: a figure
    that a busy machine measured tiny is written tiny, never 0, which the spec's loader refuses as corrupt."""
    if value == 0 or abs(value) >= 10 ** (2 - places):
        return round(value, places)
    return round(value, 2 - math.floor(math.log10(abs(value))))


def host_spec(cal: Calibration) -> dict:
    """`cal` as the data of a hardware spec file (configs/hardware format)."""
    generic = load_all()[GENERIC_CPU]
    return {
        "name": "host", "aliases": ["host"], "kind": "cpu", "vendor": cal.vendor,
        "cpu_model": cal.cpu_model, "threads": cal.threads,
        "peak_tflops": {"fp32": _rounded(cal.peak_gflops_all / 1000, 4)},     # bf16 runs at this rate (no bf16 FMA)
        "core_peak_tflops": _rounded(cal.peak_gflops_core / 1000, 4),
        "clock_ghz": _rounded(cal.clock_ghz, 3),
        "compute_units": cal.threads,
        "simd_width": cal.simd_width,
        "registers_per_unit_kib": 2.0 if "avx512f" in hardware_id() else 0.5,    # 32 zmm x 64 B, or 16 ymm x 32 B
        "shared_memory_per_unit_kib": cal.per_core_l2_kib,                 # no scratchpad: the private L2
        "launch_overhead_us": _rounded(cal.fork_join_us, 3),
        "call_overhead_us": _rounded(cal.call_overhead_us, 3),
        "library_gemm_efficiency": _rounded(cal.library_gemm_efficiency, 3),
        "interconnect_gbs": generic.interconnect_gbs,                      # no accelerator link: as cpu-generic
        **{name: _rounded(value, 4) for name, value in asdict(cal.step).items()},
        "memory": [{"name": lv.name, "size_mib": _rounded(lv.size_mib, 4), "bandwidth_gbs": _rounded(lv.all_gbs, 1),
                    "core_bandwidth_gbs": _rounded(lv.core_gbs, 1)} for lv in cal.levels],
    }


def write_host_spec(cal: Calibration) -> Path:
    """Write `cal` where `cpu_spec()` finds it, atomically (a reader never sees half a file)."""
    header = (f"# This machine's CPU ({cal.cpu_model}), measured by `tfsn calibrate`{' --quick' * cal.quick} "
              f"at {cal.measured_at} with {cal.threads} thread(s), in {cal.seconds:.1f} s.\n"
              "# Bandwidths: best of several reads of a buffer half the size of each cache level (DRAM: at least\n"
              "# 4x L3); bandwidth_gbs with all threads, core_bandwidth_gbs with one. peak: a generated FMA kernel,\n"
              "# all threads (core_peak_tflops: one thread). library_gemm_efficiency: torch.mm over the one-thread\n"
              "# peak, one thread, median of three\n"
              "# shapes. Overheads: medians, best of several. allreduce_*: gloo between two processes of this\n"
              "# machine, one thread each; update_*: torch.optim.AdamW.step, one thread, fitted over three sets.\n"
              f"# clock_ghz from {cal.clock_source}.\n"
              + "".join(f"# note: {note}\n" for note in cal.notes))
    path = host_spec_path()
    atomic_write(path, (header + yaml.safe_dump(host_spec(cal), sort_keys=False)).encode())
    return path
