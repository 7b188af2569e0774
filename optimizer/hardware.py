"""Hardware specs: the chip parameters the cost model reads, loaded from configs/hardware/*.yaml.

Each file describes one chip with vendor figures (cited in comments beside each number): peak compute
per dtype, the memory hierarchy, compute units, SIMD width, registers and shared memory per unit, launch
overhead, and the per-direction bandwidth of the link between accelerators of one node. Catalogs name
accelerators their own way ("H100", "A100-80GB"), so every spec lists the `aliases` it answers to.
A bad file raises `HardwareSpecError` naming the file and field; nothing else escapes the loader.

This machine's CPU has a second source: `tfsn calibrate` measures it and writes a spec of the same format
under the cache folder (`host_spec_path`); `cpu_spec()` prefers that measured spec to the shipped generic one.
"""
from __future__ import annotations

import functools
import math
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from optimizer.cache import cache_dir, content_key

# The configs package shipped beside this one, by path: imported by name, a `configs` folder of the user's (first
# on sys.path as the training script's folder is) would be read in its place.
SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
KINDS = ("gpu", "cpu")
_SCALARS = ("clock_ghz", "compute_units", "simd_width", "registers_per_unit_kib",
            "shared_memory_per_unit_kib", "launch_overhead_us", "interconnect_gbs")
_FIELDS = ("name", "aliases", "kind", "vendor", "peak_tflops", "memory") + _SCALARS
# written by `tfsn calibrate`; defaults below
_OPTIONAL = ("call_overhead_us", "library_gemm_efficiency", "cpu_model", "threads", "core_peak_tflops")
# the parts of a step outside its graphs on local nodes (optimizer/calibrate_step.py): 0 = not measured
STEP_FIGURES = ("allreduce_latency_us", "allreduce_gbs", "step_overhead_us", "step_overhead_solo_us",
                "parallel_overhead_us", "parallel_wait_us", "buffer_broadcast_us",
                "update_fixed_us", "update_tensor_us", "update_element_ns")
_OPTIONAL += STEP_FIGURES
# What a GPU's occupancy depends on, besides registers_per_unit_kib and shared_memory_per_unit_kib: a GPU
# spec must give them (a kernel the chip cannot launch is rejected by the cost model, not guessed at)
_GPU_LIMITS = ("shared_memory_per_block_kib", "threads_per_unit", "blocks_per_unit", "registers_per_thread")
_LEVEL_FIELDS = {"name", "size_mib", "bandwidth_gbs"}
_LEVEL_OPTIONAL = {"core_bandwidth_gbs"}
GENERIC_CPU = "cpu-generic"


class HardwareSpecError(ValueError):
    """A hardware spec file is missing, unreadable or wrong; the message names the file and field."""


@dataclass(frozen=True)
class MemoryLevel:
    """One level of the memory hierarchy, whole chip: capacity and peak bandwidth."""

    name: str                 # "shared", "l2", "hbm", "dram", ...
    size_mib: float           # capacity summed over the chip, MiB
    bandwidth_gbs: float      # peak bandwidth summed over the chip, GB/s (1e9 bytes/s)
    core_bandwidth_gbs: float | None = None   # one core's (one thread's) bandwidth, GB/s; None: not known


@dataclass(frozen=True)
class HardwareSpec:
    """One chip. Rates are dense (no sparsity), per chip; `interconnect_gbs` is per direction."""

    name: str
    aliases: tuple[str, ...]
    kind: str                          # "gpu" or "cpu"
    vendor: str
    peak_tflops: dict[str, float]      # dtype -> dense peak TFLOP/s; a missing dtype runs at the fp32 rate
    clock_ghz: float
    compute_units: int                 # SMs, CUs or cores
    simd_width: int                    # warp / wavefront size, or vector lanes
    registers_per_unit_kib: float
    shared_memory_per_unit_kib: float
    launch_overhead_us: float          # kernel launch (GPU) or parallel-region fork/join (CPU)
    interconnect_gbs: float            # accelerator-to-accelerator link inside a node, each way, GB/s
    memory: tuple[MemoryLevel, ...]    # fastest first; the last level is main memory (HBM / DRAM)
    call_overhead_us: float = 2.0      # one call of a generated kernel from Python: ctypes + output allocation
    library_gemm_efficiency: float = 0.85  # fraction of the fp32 FMA peak the BLAS sgemm reaches (CPU)
    cpu_model: str = ""                # the CPU a calibrated spec was measured on ("" for vendor specs)
    threads: int = 0                   # threads used by that calibration (0 for vendor specs)
    core_peak_tflops: float = 0.0      # fp32 FMA rate of one thread alone, as calibrated (0: peak / compute_units)
    # measured by `tfsn calibrate` (calibrate_step.py), 0 elsewhere: a gloo all-reduce between two local processes
    allreduce_latency_us: float = 0.0  # ... of a tiny gradient
    allreduce_gbs: float = 0.0         # ... GB of gradient per second beyond that, as a data-parallel loop pays it
    step_overhead_us: float = 0.0      # a data-parallel step's fixed share (guards, wrappers, autograd, hooks, sync)
    step_overhead_solo_us: float = 0.0  # ... of a job's only process: no DDP, no collective
    parallel_overhead_us: float = 0.0  # what a data-parallel step pays beyond the same step alone, at no compute
    parallel_wait_us: float = 0.0      # ... more where that step alone takes 1 ms (it grows as its square root)
    buffer_broadcast_us: float = 0.0   # what DDP's broadcast of the model's buffers (each forward) adds to a step
    update_fixed_us: float = 0.0       # torch.optim.AdamW.step, one thread: per call,
    update_tensor_us: float = 0.0      # per parameter tensor,
    update_element_ns: float = 0.0     # and per parameter element
    # GPU launch limits (CUDA Programming Guide, "Technical Specifications per Compute Capability"); 0 on CPUs
    shared_memory_per_block_kib: float = 0.0   # the most shared memory one block (program) may allocate
    threads_per_unit: int = 0          # resident threads per SM / CU
    blocks_per_unit: int = 0           # resident blocks per SM / CU
    registers_per_thread: int = 0      # the most 32-bit registers one thread may use (255 on NVIDIA)

    @property
    def main_memory(self) -> MemoryLevel:
        return self.memory[-1]

    @property
    def last_level_cache(self) -> MemoryLevel:
        """A GPU's L2 (what its SMs share, where their re-reads land), else the main memory."""
        return next((level for level in self.memory if level.name.lower() == "l2"), self.main_memory)

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; a dtype the chip lacks (bf16 on a T4) runs at the fp32 rate."""
        return 1e12 * self.peak_tflops.get(dtype, self.peak_tflops["fp32"])

    def core_peak_flops(self, dtype: str = "fp32") -> float:
        """Peak FLOP/s of one core running alone. Calibrated where `tfsn calibrate` measured it: the all-thread
        peak over the cores is low when other work shared the cores during calibration (or threads share a
        core), while a worker's thread runs at one core's rate whenever it runs."""
        per_core = self.core_peak_tflops * 1e12 if self.core_peak_tflops else self.peak_flops("fp32") / self.compute_units
        return per_core * self.peak_flops(dtype) / self.peak_flops("fp32")

    def threads_peak_flops(self, dtype: str, threads: int | None) -> float:
        """Peak FLOP/s `threads` threads reach (all of the chip's when None), at most the all-thread peak."""
        if threads is None or threads >= self.compute_units:
            return self.peak_flops(dtype)
        return min(self.peak_flops(dtype), max(threads, 1) * self.core_peak_flops(dtype))


def _number(value: Any, where: str, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= minimum:
        raise HardwareSpecError(f"{where}: {value!r} must be a number > {minimum:g}. "
                                "To fix: write the vendor figure, e.g. 989.4")
    return float(value)


def _level(level: Any, where: str) -> MemoryLevel:
    if not isinstance(level, dict) or not _LEVEL_FIELDS <= set(level) <= _LEVEL_FIELDS | _LEVEL_OPTIONAL:
        raise HardwareSpecError(f"{where}: must be {{name: ..., size_mib: ..., bandwidth_gbs: ...}}, "
                                "optionally with core_bandwidth_gbs")
    core = level.get("core_bandwidth_gbs")
    return MemoryLevel(str(level["name"]), _number(level["size_mib"], f"{where}.size_mib"),
                       _number(level["bandwidth_gbs"], f"{where}.bandwidth_gbs"),
                       None if core is None else _number(core, f"{where}.core_bandwidth_gbs"))


def _calibration_fields(data: dict, source: str) -> dict[str, Any]:
    """The optional fields a calibrated spec carries, validated; absent ones keep their defaults."""
    found: dict[str, Any] = {}
    if "call_overhead_us" in data:
        found["call_overhead_us"] = _number(data["call_overhead_us"], f"{source}: call_overhead_us")
    if "library_gemm_efficiency" in data:
        value = _number(data["library_gemm_efficiency"], f"{source}: library_gemm_efficiency")
        if value > 1.5:
            raise HardwareSpecError(f"{source}: library_gemm_efficiency: {value} is a fraction of the FMA peak "
                                    "(above 1 only when the BLAS beats the calibrated FMA loop). "
                                    "To fix: write a number in (0, 1.5], e.g. 0.85")
        found["library_gemm_efficiency"] = value
    for name in STEP_FIGURES:
        if name in data:
            found[name] = _number(data[name], f"{source}: {name}")
    if "core_peak_tflops" in data:
        found["core_peak_tflops"] = _number(data["core_peak_tflops"], f"{source}: core_peak_tflops")
    if "cpu_model" in data:
        if not isinstance(data["cpu_model"], str):
            raise HardwareSpecError(f"{source}: cpu_model: must be a string, the CPU's model name")
        found["cpu_model"] = data["cpu_model"]
    if "threads" in data:
        threads = data["threads"]
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise HardwareSpecError(f"{source}: threads: {threads!r} must be a whole number >= 1")
        found["threads"] = threads
    return found


def _gpu_limits(data: dict, source: str) -> dict[str, Any]:
    """The launch limits a GPU spec must give, validated (a CPU spec gives none)."""
    if data["kind"] != "gpu":
        extra = [f for f in _GPU_LIMITS if f in data]
        if extra:
            raise HardwareSpecError(f"{source}: {extra[0]}: only GPU specs have launch limits. To fix: remove it")
        return {}
    missing = [f for f in _GPU_LIMITS if f not in data]
    if missing:
        raise HardwareSpecError(f"{source}: {missing[0]}: required field of a GPU spec is missing. To fix: write "
                                "the figure of the chip's compute capability (CUDA Programming Guide, Technical "
                                "Specifications per Compute Capability), e.g. 227 for shared_memory_per_block_kib "
                                "on an H100")
    limits: dict[str, Any] = {"shared_memory_per_block_kib": _number(data["shared_memory_per_block_kib"],
                                                                     f"{source}: shared_memory_per_block_kib")}
    for field in _GPU_LIMITS[1:]:
        value = data[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HardwareSpecError(f"{source}: {field}: {value!r} must be a whole number >= 1")
        limits[field] = value
    if limits["shared_memory_per_block_kib"] > data["shared_memory_per_unit_kib"]:
        raise HardwareSpecError(f"{source}: shared_memory_per_block_kib: {limits['shared_memory_per_block_kib']:g} "
                                f"is more than shared_memory_per_unit_kib ({data['shared_memory_per_unit_kib']}). "
                                "To fix: a block's shared memory is at most its SM's")
    return limits


def parse_spec(data: Any, source: str) -> HardwareSpec:
    """Validate one spec's YAML data; `source` is the file name used in messages."""
    if not isinstance(data, dict):
        raise HardwareSpecError(f"{source}: the top level must be a mapping of fields")
    unknown = sorted(set(data) - set(_FIELDS) - set(_OPTIONAL) - set(_GPU_LIMITS))
    missing = [f for f in _FIELDS if f not in data]
    if unknown:
        raise HardwareSpecError(f"{source}: unknown field {unknown[0]!r}. "
                                f"To fix: use only {', '.join(_FIELDS + _OPTIONAL + _GPU_LIMITS)}")
    if missing:
        raise HardwareSpecError(f"{source}: {missing[0]}: required field is missing")
    name, kind, vendor = data["name"], data["kind"], data["vendor"]
    if not isinstance(name, str) or not name:
        raise HardwareSpecError(f"{source}: name: must be a non-empty string")
    if kind not in KINDS:
        raise HardwareSpecError(f"{source}: kind: {kind!r} is not one of {', '.join(KINDS)}")
    aliases = data["aliases"]
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise HardwareSpecError(f"{source}: aliases: must be a list of names, e.g. [H100, H100-SXM]")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or "fp32" not in peaks:
        raise HardwareSpecError(f"{source}: peak_tflops: must be a mapping with at least fp32")
    for dtype in peaks:
        if dtype not in DTYPES:
            raise HardwareSpecError(f"{source}: peak_tflops.{dtype}: unknown dtype. To fix: use {', '.join(DTYPES)}")
    peak = {d: _number(v, f"{source}: peak_tflops.{d}") for d, v in peaks.items()}
    scalars = {f: _number(data[f], f"{source}: {f}") for f in _SCALARS}
    levels = data["memory"]
    if not isinstance(levels, list) or not levels:
        raise HardwareSpecError(f"{source}: memory: must be a list of levels, fastest first")
    memory = [_level(level, f"{source}: memory[{i}]") for i, level in enumerate(levels)]
    return HardwareSpec(
        name=name, aliases=tuple(dict.fromkeys([name, *aliases])), kind=kind, vendor=str(vendor),
        peak_tflops=peak, clock_ghz=scalars["clock_ghz"], compute_units=int(scalars["compute_units"]),
        simd_width=int(scalars["simd_width"]), registers_per_unit_kib=scalars["registers_per_unit_kib"],
        shared_memory_per_unit_kib=scalars["shared_memory_per_unit_kib"],
        launch_overhead_us=scalars["launch_overhead_us"], interconnect_gbs=scalars["interconnect_gbs"],
        memory=tuple(memory), **_calibration_fields(data, source), **_gpu_limits(data, source))


def load_spec_file(path: str | Path) -> HardwareSpec:
    """Load and validate one spec file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise HardwareSpecError(f"{path}: cannot read: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise HardwareSpecError(f"{path}: invalid YAML: {str(err).splitlines()[0]}") from None
    return parse_spec(data, str(path.name))


def _shipped_dir() -> Path:
    return SHIPPED_CONFIGS / "hardware"


@functools.lru_cache(maxsize=8)
def load_all(directory: str | None = None) -> dict[str, HardwareSpec]:
    """Every spec in `directory` (default: the shipped configs/hardware), by name. Aliases must be unique."""
    folder = Path(directory) if directory else _shipped_dir()
    specs: dict[str, HardwareSpec] = {}
    owner: dict[str, str] = {}
    for path in sorted(folder.glob("*.yaml")):
        spec = load_spec_file(path)
        if spec.name in specs:
            raise HardwareSpecError(f"{path.name}: name {spec.name!r} is already defined by another file")
        for alias in spec.aliases:
            key = alias.casefold()
            if key in owner and owner[key] != spec.name:
                raise HardwareSpecError(f"{path.name}: alias {alias!r} is already used by {owner[key]}")
            owner[key] = spec.name
        specs[spec.name] = spec
    if not specs:
        raise HardwareSpecError(f"{folder}: no *.yaml hardware specs found")
    return specs


# The vendor's words before a chip's name, as GCP ("nvidia-tesla-t4", "nvidia-h100-80gb") and Kubernetes labels
# write it: "nvidia-h100" is the H100.
_VENDOR_PREFIX_RE = re.compile(r"^(?:nvidia|amd)[-_ ](?:tesla[-_ ])?")


@functools.lru_cache(maxsize=256)
def find_hardware(accelerator: str | None, directory: str | None = None) -> HardwareSpec | None:
    """The spec a catalog's accelerator name refers to (case-insensitive), or None if none does.

    `None` (a CPU-only offer) maps to the generic CPU spec.
    """
    wanted = (accelerator or "cpu").casefold()
    for name in (wanted, _VENDOR_PREFIX_RE.sub("", wanted)):
        for spec in load_all(directory).values():
            if any(alias.casefold() == name for alias in spec.aliases):
                return spec
    return None


def cpuinfo(key: str) -> str:
    """The first value of `key` in /proc/cpuinfo ("model name", "cpu MHz", ...), or "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return ""


def host_cpu_model() -> str:
    """This machine's CPU, what a calibrated spec is valid for: the model name, with family and model
    numbers where x86 gives them (a VM may name a whole generation just "AMD EPYC")."""
    name = cpuinfo("model name") or platform.processor() or platform.machine() or "unknown"
    family, model = cpuinfo("cpu family"), cpuinfo("model")
    return f"{name} (family {family}, model {model})" if family and model else name


def host_spec_path() -> Path:
    """Where `tfsn calibrate` writes this machine's measured spec."""
    return cache_dir() / "hardware" / "host.yaml"


def _load_host(path: Path) -> HardwareSpec | None:
    if not path.exists():
        return None
    try:
        spec = load_spec_file(path)
    except (HardwareSpecError, UnicodeDecodeError) as err:
        reason = str(err).removeprefix(f"{path.name}: ").split(". To fix")[0]
        raise HardwareSpecError(f"{path}: corrupt calibrated spec: {reason}. "
                                "To fix: run `tfsn calibrate` again") from None
    return spec if spec.cpu_model == host_cpu_model() else None


def load_host_spec() -> HardwareSpec | None:
    """The calibrated spec of this machine, or None when there is none or it was measured on another CPU."""
    return _load_host(host_spec_path())


@functools.lru_cache(maxsize=8)
def _cpu_spec(path: str, stamp: tuple[int, int, int] | None) -> HardwareSpec:
    host = _load_host(Path(path)) if stamp else None
    return host or load_all()[GENERIC_CPU]


def planned_hardware(spec: HardwareSpec) -> str:
    """How a job's plan names the hardware it searched for: the spec's name and a digest of its figures (a
    calibrated spec of another CPU, or the same name measured again, is other hardware). Here, not beside the
    backend, so that the controller names it without importing torch (seconds, during which it answered no
    heartbeat)."""
    return f"{spec.name}@{content_key(repr(spec))[:12]}"


def cpu_spec() -> HardwareSpec:
    """This machine's CPU: the calibrated spec if there is one for this CPU, else the shipped generic one.

    Cached per process, keyed on the file's identity and mtime, so a new calibration is seen at once.
    """
    path = host_spec_path()
    try:
        st = path.stat()
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    return _cpu_spec(str(path), stamp)
