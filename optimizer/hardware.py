"""Hardware specs: the chip parameters the cost model reads, loaded from configs/hardware/*.yaml.

Each file describes one chip with vendor figures (cited in comments beside each number): peak compute
per dtype, the memory hierarchy, compute units, SIMD width, registers and shared memory per unit, launch
overhead, and the per-direction bandwidth of the link between accelerators of one node. Catalogs name
accelerators their own way ("H100", "A100-80GB"), so every spec lists the `aliases` it answers to.
A bad file raises `HardwareSpecError` naming the file and field; nothing else escapes the loader.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
KINDS = ("gpu", "cpu")
_SCALARS = ("clock_ghz", "compute_units", "simd_width", "registers_per_unit_kib",
            "shared_memory_per_unit_kib", "launch_overhead_us", "interconnect_gbs")
_FIELDS = ("name", "aliases", "kind", "vendor", "peak_tflops", "memory") + _SCALARS


class HardwareSpecError(ValueError):
    """A hardware spec file is missing, unreadable or wrong; the message names the file and field."""


@dataclass(frozen=True)
class MemoryLevel:
    """One level of the memory hierarchy, whole chip: capacity and peak bandwidth."""

    name: str                 # "shared", "l2", "hbm", "dram", ...
    size_mib: float           # capacity summed over the chip, MiB
    bandwidth_gbs: float      # peak bandwidth summed over the chip, GB/s (1e9 bytes/s)


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

    @property
    def main_memory(self) -> MemoryLevel:
        return self.memory[-1]

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; a dtype the chip lacks (bf16 on a T4) runs at the fp32 rate."""
        return 1e12 * self.peak_tflops.get(dtype, self.peak_tflops["fp32"])


def _number(value: Any, where: str, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= minimum:
        raise HardwareSpecError(f"{where}: {value!r} must be a number > {minimum:g}. "
                                "To fix: write the vendor figure, e.g. 989.4")
    return float(value)


def parse_spec(data: Any, source: str) -> HardwareSpec:
    """Validate one spec's YAML data; `source` is the file name used in messages."""
    if not isinstance(data, dict):
        raise HardwareSpecError(f"{source}: the top level must be a mapping of fields")
    unknown = sorted(set(data) - set(_FIELDS))
    missing = [f for f in _FIELDS if f not in data]
    if unknown:
        raise HardwareSpecError(f"{source}: unknown field {unknown[0]!r}. To fix: use only {', '.join(_FIELDS)}")
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
    memory = []
    for i, level in enumerate(levels):
        where = f"{source}: memory[{i}]"
        if not isinstance(level, dict) or set(level) != {"name", "size_mib", "bandwidth_gbs"}:
            raise HardwareSpecError(f"{where}: must be {{name: ..., size_mib: ..., bandwidth_gbs: ...}}")
        memory.append(MemoryLevel(str(level["name"]), _number(level["size_mib"], f"{where}.size_mib"),
                                  _number(level["bandwidth_gbs"], f"{where}.bandwidth_gbs")))
    return HardwareSpec(
        name=name, aliases=tuple(dict.fromkeys([name, *aliases])), kind=kind, vendor=str(vendor),
        peak_tflops=peak, clock_ghz=scalars["clock_ghz"], compute_units=int(scalars["compute_units"]),
        simd_width=int(scalars["simd_width"]), registers_per_unit_kib=scalars["registers_per_unit_kib"],
        shared_memory_per_unit_kib=scalars["shared_memory_per_unit_kib"],
        launch_overhead_us=scalars["launch_overhead_us"], interconnect_gbs=scalars["interconnect_gbs"],
        memory=tuple(memory))


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
    return Path(str(files("configs").joinpath("hardware")))


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


@functools.lru_cache(maxsize=256)
def find_hardware(accelerator: str | None, directory: str | None = None) -> HardwareSpec | None:
    """The spec a catalog's accelerator name refers to (case-insensitive), or None if none does.

    `None` (a CPU-only offer) maps to the generic CPU spec.
    """
    wanted = (accelerator or "cpu").casefold()
    for spec in load_all(directory).values():
        if any(alias.casefold() == wanted for alias in spec.aliases):
            return spec
    return None
