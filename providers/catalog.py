"""The instance catalog: every offer tfsn may plan on, as rows of SkyPilot's vms.csv.

Sources, per provider, first found wins:
  1. a refreshed copy, `tfsn catalog refresh PROVIDER` -> $TFSN_CACHE/catalog/PROVIDER.csv
     (default ~/.cache/tfsn/catalog/PROVIDER.csv), fetched from the cloud's own APIs;
  2. SkyPilot's local catalog cache, ~/.sky/catalogs/<version>/PROVIDER/vms.csv (newest version);
  3. the snapshot shipped in configs/catalog/PROVIDER.csv (as-of date and source in SOURCE.md).

Columns are SkyPilot's (`InstanceType, vCPUs, MemoryGiB, AcceleratorName, AcceleratorCount, GPUInfo,
Region, AvailabilityZone, Price, SpotPrice, Arch`), read by name so that column order and SkyPilot's
older spellings (`GpuInfo`) do not matter; tfsn adds two optional columns, `Provider` and
`Interconnect`, that SkyPilot's readers ignore. SkyPilot's GCP catalog prices a GPU separately from its
host VM (rows with an accelerator and no instance type); such rows are joined to their host here.
"""
from __future__ import annotations

import csv
import io
import math
import os
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from providers.base import Offer

# The configs package shipped beside this one, by path: imported by name, a `configs` folder of the user's (first
# on sys.path as the training script's folder is) would be read in its place.
SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"

CATALOG_PROVIDERS = ("aws", "gcp", "azure")
COLUMNS = ("InstanceType", "vCPUs", "MemoryGiB", "AcceleratorName", "AcceleratorCount", "GPUInfo",
           "Region", "AvailabilityZone", "Price", "SpotPrice", "Arch")
EXTRA_COLUMNS = ("Provider", "Interconnect")
_ALIASES = {"GpuInfo": "GPUInfo"}

# Memory of one accelerator, GiB, for rows whose GPUInfo does not say (vendor datasheets: NVIDIA A100,
# A10, H100, H200, L4, L40S, T4, V100, K80, P100, P4, M60, B200 datasheets; AMD MI300X data sheet).
ACCELERATOR_MEMORY_GIB = {
    "A100": 40, "A100-80GB": 80, "A10": 24, "A10G": 24, "H100": 80, "H100-MEGA": 80, "H200": 141,
    "L4": 24, "L40S": 48, "T4": 16, "T4G": 16, "V100": 16, "V100-32GB": 32, "K80": 12, "P100": 16,
    "P4": 8, "M60": 8, "B200": 180, "MI300X": 192,
}

# SkyPilot's GCP catalog lists a GPU's price apart from its host VM; tfsn joins a GPU row to the host
# that carries that many of those GPUs (GCP machine families: A2, A3, A4, G2 bundle their GPUs; the
# attachable T4/V100/P100/P4 go on an N1 host with 8 vCPUs per GPU, tfsn's choice).
_HOST_FOR_ACCELERATOR = {
    "A100": "a2-highgpu-{n}g", "A100-80GB": "a2-ultragpu-{n}g", "H100": "a3-highgpu-{n}g",
    "H100-MEGA": "a3-megagpu-{n}g", "H200": "a3-ultragpu-{n}g", "B200": "a4-highgpu-{n}g",
}
_L4_HOSTS = {1: "g2-standard-4", 2: "g2-standard-24", 4: "g2-standard-48", 8: "g2-standard-96"}
_ATTACHABLE = ("T4", "V100", "P100", "P4")


class CatalogError(ValueError):
    """A catalog file is unreadable or malformed; the message names the file, line and column."""


def cache_dir() -> Path:
    """Where `tfsn catalog refresh` writes: $TFSN_CACHE/catalog, default ~/.cache/tfsn/catalog."""
    root = os.environ.get("TFSN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tfsn")
    return Path(root) / "catalog"


def snapshot_dir() -> Path:
    return SHIPPED_CONFIGS / "catalog"


def skypilot_catalog(provider: str) -> Path | None:
    """SkyPilot's cached vms.csv for `provider`, newest catalog version first, or None."""
    root = Path(os.path.expanduser("~")) / ".sky" / "catalogs"
    found = sorted(root.glob(f"*/{provider}/vms.csv"),
                   key=lambda p: int(re.sub(r"\D", "", p.parent.parent.name) or 0), reverse=True)
    return found[0] if found else None


def catalog_sources(provider: str | None = None) -> dict[str, Path]:
    """The file each provider's offers come from (see the module docstring for the order)."""
    out = {}
    for name in ([provider] if provider else CATALOG_PROVIDERS):
        for path in (cache_dir() / f"{name}.csv", skypilot_catalog(name), snapshot_dir() / f"{name}.csv"):
            if path is not None and path.is_file():
                out[name] = path
                break
    return out


def load_offers(provider: str | None = None, *, path: str | os.PathLike | None = None) -> list[Offer]:
    """Every offer of `provider` (or of all catalog providers), from `path` or the default sources.

    `path` is one CSV file or a folder of them; a file's provider is its `Provider` column, else its
    name (`aws.csv`), else its folder (`.../aws/vms.csv`). Raises CatalogError on a malformed file.
    """
    if path is not None:
        target = Path(path)
        if not target.exists():
            raise CatalogError(f"{target}: no such file or folder. To fix: give a vms.csv file or a folder of them")
        paths = sorted(target.rglob("*.csv")) if target.is_dir() else [target]
        offers = [o for p in paths for o in read_offers(p)]
        return [o for o in offers if provider is None or o.provider == provider]
    return [o for name, p in catalog_sources(provider).items() for o in read_offers(p, provider=name)]


class CatalogOffers:
    """The offers of a cloud whose machines are too many to list live: its rows of the catalog (a mixin)."""

    name: str

    def offers(self) -> list[Offer]:
        return load_offers(self.name)


def _provider_of(path: Path) -> str:
    stem = path.stem.lower()
    return path.parent.name.lower() if stem == "vms" else stem


def _float(text: str, where: str, *, optional: bool) -> float | None:
    text = (text or "").strip()
    if not text:
        if optional:
            return None
        raise CatalogError(f"{where}: empty. To fix: write a number")
    try:
        value = float(text)
    except ValueError:
        raise CatalogError(f"{where}: {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise CatalogError(f"{where}: {text!r} must be a finite number >= 0")
    return value


def _gpu_memory_gib(info: str, accelerator: str | None) -> float:
    """Memory of one accelerator: GPUInfo's SizeInMiB when it has one, else the vendor table."""
    if not accelerator:
        return 0.0
    match = re.search(r"'SizeInMiB':\s*([0-9.]+)", info or "")
    if match:
        return float(match.group(1)) / 1024
    return float(ACCELERATOR_MEMORY_GIB.get(accelerator.upper(), 0.0))


def read_offers(path: str | os.PathLike, *, provider: str | None = None) -> list[Offer]:
    """Parse one vms.csv. Rows without an on-demand price are skipped (they cannot be bought)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as err:
        raise CatalogError(f"{path}: cannot read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise CatalogError(f"{path}: not UTF-8 text. To fix: give a vms.csv file") from None
    reader = csv.DictReader(io.StringIO(text))
    header = [_ALIASES.get(c, c) for c in (reader.fieldnames or [])]
    reader.fieldnames = header
    absent = [c for c in ("InstanceType", "Region", "Price") if c not in header]
    if absent:
        raise CatalogError(f"{path}:1: missing column {absent[0]!r}. To fix: use SkyPilot's vms.csv "
                           f"columns: {', '.join(COLUMNS)}")
    default_provider = provider or _provider_of(path)
    offers: dict[tuple, Offer] = {}
    gpu_rows: list[tuple[str, dict, int]] = []
    for line, row in enumerate(reader, start=2):
        where = f"{path}:{line}"
        if None in row:
            raise CatalogError(f"{where}: more fields than the header has columns")
        accelerator = (row.get("AcceleratorName") or "").strip() or None
        instance = (row.get("InstanceType") or "").strip()
        row_provider = (row.get("Provider") or "").strip().lower() or default_provider
        if not instance:
            if accelerator:
                gpu_rows.append((row_provider, row, line))
            continue
        price = _float(row["Price"], f"{where}: Price", optional=True)
        if price is None:
            continue
        count = _float(row.get("AcceleratorCount", ""), f"{where}: AcceleratorCount", optional=True)
        offer = Offer(
            provider=row_provider, region=row["Region"].strip(),
            zone=(row.get("AvailabilityZone") or "").strip() or None,
            instance_type=instance, accelerator=accelerator,
            accelerator_count=int(count or 0) if accelerator else 0,
            accelerator_memory_gib=_gpu_memory_gib(row.get("GPUInfo", ""), accelerator),
            vcpus=_float(row.get("vCPUs", ""), f"{where}: vCPUs", optional=True) or 0.0,
            memory_gib=_float(row.get("MemoryGiB", ""), f"{where}: MemoryGiB", optional=True) or 0.0,
            price=price, spot_price=_float(row.get("SpotPrice", ""), f"{where}: SpotPrice", optional=True),
            interconnect=(row.get("Interconnect") or "").strip() or None,
            arch=(row.get("Arch") or "").strip() or "x86_64")
        key = (offer.provider, offer.region, offer.zone, offer.instance_type)
        kept = offers.get(key)
        if kept is None:
            offers[key] = offer
        elif kept.spot_price is None and offer.spot_price is not None:   # duplicate rows: keep the spot price
            offers[key] = replace(kept, spot_price=offer.spot_price)
    offers.update(_join_split_gpu_rows(gpu_rows, offers, path))
    return list(offers.values())


def _host_for(accelerator: str, count: int) -> str | None:
    name = accelerator.upper()
    if name in _HOST_FOR_ACCELERATOR:
        return _HOST_FOR_ACCELERATOR[name].format(n=count)
    if name == "L4":
        return _L4_HOSTS.get(count)
    if name in _ATTACHABLE:
        return f"n1-standard-{min(96, 8 * count)}"
    return None


def _join_split_gpu_rows(gpu_rows: list[tuple[str, dict, int]], hosts: dict[tuple, Offer],
                         path: Path) -> dict[tuple, Offer]:
    """GPU-only rows (GCP) priced on top of their host VM row of the same zone."""
    joined = {}
    for provider, row, line in gpu_rows:
        where = f"{path}:{line}"
        accelerator = row["AcceleratorName"].strip()
        count = int(_float(row.get("AcceleratorCount", ""), f"{where}: AcceleratorCount", optional=False))
        host_type = _host_for(accelerator, count)
        zone = (row.get("AvailabilityZone") or "").strip() or None
        host = hosts.get((provider, row["Region"].strip(), zone, host_type)) if host_type else None
        price = _float(row["Price"], f"{where}: Price", optional=True)
        if host is None or host.accelerator or price is None:
            continue
        spot = _float(row.get("SpotPrice", ""), f"{where}: SpotPrice", optional=True)
        joined[(provider, host.region, host.zone, f"{host_type}+{accelerator}")] = replace(
            host, accelerator=accelerator, accelerator_count=count,
            accelerator_memory_gib=_gpu_memory_gib(row.get("GPUInfo", ""), accelerator),
            price=round(host.price + price, 5),
            spot_price=None if spot is None or host.spot_price is None else round(host.spot_price + spot, 5))
    return joined


def _gpu_info(offer: Offer) -> str:
    if not offer.accelerator:
        return ""
    mib = round(offer.accelerator_memory_gib * 1024)
    return (f"{{'Gpus': [{{'Name': '{offer.accelerator}', 'Count': {offer.accelerator_count}, "
            f"'MemoryInfo': {{'SizeInMiB': {mib}}}}}], 'TotalGpuMemoryInMiB': {mib * offer.accelerator_count}}}")


def write_offers(path: str | os.PathLike, offers: Iterable[Offer]) -> Path:
    """Write `offers` as vms.csv (plus Provider and Interconnect) atomically: temp file + os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as out:
            writer = csv.writer(out)
            writer.writerow(COLUMNS + EXTRA_COLUMNS)
            for o in sorted(offers, key=lambda o: (o.provider, o.instance_type, o.region, o.zone or "")):
                writer.writerow([o.instance_type, o.vcpus, o.memory_gib, o.accelerator or "",
                                 o.accelerator_count or "", _gpu_info(o), o.region, o.zone or "", o.price,
                                 "" if o.spot_price is None else o.spot_price, o.arch, o.provider,
                                 o.interconnect or ""])
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path

