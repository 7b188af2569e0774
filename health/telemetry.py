"""Telemetry sources: SDK step records, NVML device readings, a dcgm-exporter scrape.

Every source yields the same `Sample`, so a detector reads a clock ratio or an Xid the same way
whether it came from NVML on the node or from a DCGM exporter in the cluster. A field a source
does not know stays None; detectors skip what is None.

GPU indices are NVML's (as nvidia-smi and dcgm-exporter's `gpu` label number them, PCI order),
not CUDA ordinals, which follow CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import http.client
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client.parser import text_string_to_metric_families

GPU_EXTRA = "pip install 'tfsn[gpu]'"
# Xid events read per NVML sample: an Xid storm (thousands a second from a failing GPU) must not keep
# the agent's loop, which also heartbeats, draining events; the rest wait in NVML's queue for the next call.
MAX_XIDS_PER_SAMPLE = 1024


class TelemetryError(Exception):
    """A telemetry source could not be read (endpoint down, bad answer, NVML missing)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading from one rank (SDK) or one GPU (NVML, DCGM) at one time."""

    time: float                     # unix seconds
    node: str                       # node id
    rank: int | None = None         # training rank (SDK samples)
    gpu: int | None = None          # GPU index on the node (device samples)
    step: int | None = None         # step that just ended (SDK)
    step_time: float | None = None  # wall seconds of that step (SDK)
    compute_time: float | None = None  # step_time minus time waited in collectives (SDK, DDP)
    sm_clock_mhz: float | None = None
    max_sm_clock_mhz: float | None = None
    clock_event_reasons: int | None = None  # NVML bitmask (ClockReason)
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_sbe_volatile: int | None = None     # single-bit (corrected) errors, volatile count
    ecc_dbe_volatile: int | None = None     # double-bit (uncorrected)
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    xid: int | None = None                  # an Xid event code seen on this GPU (gpu None: NVML lost its index)
    xid_watched: bool | None = None         # False: NVML refused to report this GPU's Xids (registration failed)

    @property
    def clock_ratio(self) -> float | None:
        """SM clock over its maximum: a GPU held well below 1.0 under load is being slowed."""
        if self.sm_clock_mhz is None or not self.max_sm_clock_mhz:
            return None
        return self.sm_clock_mhz / self.max_sm_clock_mhz


class ClockReason(enum.IntFlag):
    """NVML's clocks event (formerly "throttle") reason bits, also DCGM's CLOCKS_EVENT_REASONS.

    Values from nvml.h `nvmlClocksEventReason*`. HW_SLOWDOWN is also raised together with
    HW_THERMAL and HW_POWER_BRAKE, so look at those to tell the cause.
    """

    GPU_IDLE = 0x1
    APPLICATIONS_CLOCKS_SETTING = 0x2
    SW_POWER_CAP = 0x4
    HW_SLOWDOWN = 0x8
    SYNC_BOOST = 0x10
    SW_THERMAL = 0x20
    HW_THERMAL = 0x40
    HW_POWER_BRAKE = 0x80
    DISPLAY_CLOCK = 0x100
    # The bits that mean the GPU is slowed against its will (idle, app clocks, sync boost and
    # display clocks are ordinary operation).
    THROTTLING = HW_SLOWDOWN | HW_THERMAL | HW_POWER_BRAKE | SW_THERMAL | SW_POWER_CAP


def sdk_sample(node: str, record: dict[str, Any]) -> Sample:
    """A Sample from one SDK step record.

    The SDK posts `{"rank", "attempt", "records": [{"step", "at", "step_time", "metrics"}]}`;
    the rank lives on the batch, so merge it in: `sdk_sample(node, {**r, "rank": body["rank"]})`.
    """
    try:
        compute = record.get("compute_time")
        rank = record.get("rank")
        return Sample(time=float(record["at"]), node=node, rank=None if rank is None else int(rank),
                      step=int(record["step"]), step_time=float(record["step_time"]),
                      compute_time=None if compute is None else float(compute))
    except (KeyError, TypeError, ValueError) as err:
        raise TelemetryError(f"bad SDK step record from node {node}: {err!r}") from None


# ---- NVML ---------------------------------------------------------------------------------------

def _pynvml() -> Any:
    """nvidia-ml-py, imported only when NVML is wanted so the package imports without it."""
    try:
        import pynvml
    except ImportError:
        raise TelemetryError(f"NVML telemetry needs nvidia-ml-py: {GPU_EXTRA}") from None
    return pynvml


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _nvml_sample(node: str, gpu: int, readings: dict[str, Any], at: float) -> Sample:
    """Map raw NVML readings of one GPU (as nvidia-ml-py returns them) to a Sample.

    `readings` keys, each None when NVML said NOT_SUPPORTED or failed:
    clock_sm, max_clock_sm (MHz), clocks_event_reasons (bitmask), temperature (C),
    power_usage (milliwatts), ecc_corrected_volatile, ecc_uncorrected_volatile (counts),
    remapped_rows ((correctable, uncorrectable, pending, failure) from nvmlDeviceGetRemappedRows).
    """
    power_mw = readings.get("power_usage")
    remap = readings.get("remapped_rows")
    return Sample(
        time=at, node=node, gpu=gpu,
        sm_clock_mhz=_float(readings.get("clock_sm")),
        max_sm_clock_mhz=_float(readings.get("max_clock_sm")),
        clock_event_reasons=_int(readings.get("clocks_event_reasons")),
        temperature_c=_float(readings.get("temperature")),
        power_w=None if power_mw is None else power_mw / 1000.0,
        ecc_sbe_volatile=_int(readings.get("ecc_corrected_volatile")),
        ecc_dbe_volatile=_int(readings.get("ecc_uncorrected_volatile")),
        remapped_rows_pending=None if remap is None else bool(remap[2]),
        remapped_rows_failure=None if remap is None else bool(remap[3]),
    )


class NvmlSource:
    """Every GPU of this node through NVML, plus the Xid events NVML raised since the last call.

    Needs nvidia-ml-py (`tfsn[gpu]`) and an NVIDIA driver; check `available()` first. `nvml` is the
    nvidia-ml-py module (passed in by tests that stand in for a driver). A GPU whose Xid events NVML
    will not report is listed in `unwatched` with NVML's reason, and its samples say `xid_watched=False`,
    so that the controller can say that an Xid there would go unseen.
    """

    def __init__(self, node: str, nvml: Any = None) -> None:
        self.node = node
        self._nvml = nvml = nvml or _pynvml()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            raise TelemetryError(f"NVML is not usable on node {node}: {err}") from None
        try:
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            # Xids arrive as events, not as a readable value: register once, drain on every sample().
            self._events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as err:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()
            raise TelemetryError(f"NVML is not usable on node {node}: {err}") from None
        self.unwatched: dict[int, str] = {}
        for index, handle in enumerate(self._handles):
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
            except nvml.NVMLError as err:  # NOT_SUPPORTED on some boards; the device readings still work
                self.unwatched[index] = str(err)
        # Renamed from "throttle" to "event" reasons in nvidia-ml-py 12.535; same bits.
        self._reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        self._closed = False

    @staticmethod
    def available() -> bool:
        """True when nvidia-ml-py imports, NVML initialises and sees at least one GPU."""
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception:  # ImportError, NVMLError (no driver, no library), OSError
            return False
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        except Exception:
            return False
        finally:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()

    def sample(self) -> list[Sample]:
        """One Sample per GPU, then one per Xid event drained (zero wait) since the last call."""
        nvml, now = self._nvml, time.time()
        samples = []
        for index, handle in enumerate(self._handles):
            readings = {
                "clock_sm": self._read(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
                "max_clock_sm": self._read(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM),
                "clocks_event_reasons": self._read(self._reasons, handle),
                "temperature": self._read(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
                "power_usage": self._read(nvml.nvmlDeviceGetPowerUsage, handle),
                "ecc_corrected_volatile": self._read(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                                     nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC),
                "ecc_uncorrected_volatile": self._read(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                                       nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                       nvml.NVML_VOLATILE_ECC),
                "remapped_rows": self._read(nvml.nvmlDeviceGetRemappedRows, handle),
            }
            sample = _nvml_sample(self.node, index, readings, now)
            samples.append(dataclasses.replace(sample, xid_watched=False) if index in self.unwatched else sample)
        for _ in range(MAX_XIDS_PER_SAMPLE):   # a storm is drained over several calls, never in an endless loop
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:  # TIMEOUT: nothing pending; anything else: read again next call
                break
            if event.eventType & nvml.nvmlEventTypeXidCriticalError:
                # None if NVML cannot name the GPU (it fell off the bus): kept, as the node's Xid
                gpu = self._read(nvml.nvmlDeviceGetIndex, event.device)
                samples.append(Sample(time=now, node=self.node, gpu=gpu, xid=int(event.eventData)))
        return samples

    def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML query, None when the GPU does not support it or cannot answer (lost GPU)."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def close(self) -> None:
        """Free the event set and release NVML (nvmlInit is reference-counted)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlEventSetFree(self._events)
        finally:
            self._nvml.nvmlShutdown()


# ---- DCGM exporter ------------------------------------------------------------------------------

# dcgm-exporter metric name -> Sample field. Of these, its default counters CSV exports SM clock,
# temperature, power, Xid and row-remap failure; add the others to the exporter's counters file
# (-f) to get them. DCGM 3.3 renamed CLOCK_THROTTLE_REASONS to CLOCKS_EVENT_REASONS.
_DCGM_FIELDS = {
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
    "DCGM_FI_DEV_MAX_SM_CLOCK": "max_sm_clock_mhz",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "clock_event_reasons",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "clock_event_reasons",
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "ecc_sbe_volatile",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_dbe_volatile",
    "DCGM_FI_DEV_ROW_REMAP_PENDING": "remapped_rows_pending",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "remapped_rows_failure",
    "DCGM_FI_DEV_XID_ERRORS": "xid",
}
_INT_FIELDS = {"clock_event_reasons", "ecc_sbe_volatile", "ecc_dbe_volatile", "xid"}
_BOOL_FIELDS = {"remapped_rows_pending", "remapped_rows_failure"}


def _dcgm_blank(value: float) -> bool:
    """DCGM's "no value" sentinels (dcgm_structs.h: DCGM_INT32_BLANK 0x7ffffff0.., DCGM_INT64_BLANK
    0x7ffffffffffffff0.., DCGM_FP64_BLANK 140737488355328.0), which the exporter prints as numbers."""
    return value != value or value >= 140737488355328.0 or 0x7ffffff0 <= value <= 0x7fffffff


class DcgmSource:
    """Scrapes a dcgm-exporter /metrics endpoint: one Sample per GPU per call.

    DCGM_FI_DEV_XID_ERRORS holds the *last* Xid a GPU raised, not an event, so a Sample carries
    `xid` only when that value changes (first sight included): one report per Xid, as from NVML.
    """

    def __init__(self, url: str, node: str, timeout: float = 2.0) -> None:
        self.url, self.node, self.timeout = url, node, timeout
        self._last_xid: dict[int, int] = {}

    def sample(self) -> list[Sample]:
        """Scrape once; TelemetryError (one line, with the URL) when the endpoint fails or is not DCGM."""
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as response:
                text = response.read().decode("utf-8")
            per_gpu: dict[int, dict[str, Any]] = {}
            for family in text_string_to_metric_families(text):
                field = _DCGM_FIELDS.get(family.name)
                if field is None:
                    continue
                for point in family.samples:
                    if "gpu" in point.labels and not _dcgm_blank(point.value):
                        per_gpu.setdefault(int(point.labels["gpu"]), {})[field] = point.value
        except (OSError, http.client.HTTPException) as err:  # URLError, HTTPError, timeouts, resets
            raise TelemetryError(f"cannot scrape DCGM exporter at {self.url}: {err}") from None
        except ValueError as err:  # not UTF-8 or not Prometheus text
            raise TelemetryError(f"DCGM exporter at {self.url} sent an unreadable answer: {str(err)[:200]}") from None
        if not per_gpu:
            raise TelemetryError(f"no per-GPU DCGM_FI_DEV_* metrics at {self.url}: is it a dcgm-exporter?")
        now = time.time()
        return [self._sample(gpu, values, now) for gpu, values in sorted(per_gpu.items())]

    def _sample(self, gpu: int, values: dict[str, Any], at: float) -> Sample:
        fields = {name: (int(v) if name in _INT_FIELDS else bool(v) if name in _BOOL_FIELDS else float(v))
                  for name, v in values.items()}
        xid = fields.pop("xid", 0)
        if xid == self._last_xid.get(gpu, 0):
            xid = 0
        else:
            self._last_xid[gpu] = xid
        return Sample(time=at, node=self.node, gpu=gpu, xid=xid or None, **fields)
