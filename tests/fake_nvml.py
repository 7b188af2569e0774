"""A stand-in for nvidia-ml-py's `pynvml` module on a machine without an NVIDIA driver.

It answers the calls NvmlSource makes with what the real module returns for H100s (same names,
same NVMLError class with `value` and `str()`), and can be told to fail any call the way a
driver does: `FakeNvml(gpus=8, failing={"nvmlEventSetCreate": NVML_ERROR_UNKNOWN})`. What the
tests check on it is tfsn's handling of NVML's answers; the real module is exercised on a GPU
(tests/test_health_telemetry.py::test_nvml_source_reads_the_real_gpus, benchmarks/health_gpu_check.sh).
"""
from __future__ import annotations

import types
from collections import deque
from typing import Any

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
_MESSAGES = {NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_TIMEOUT: "Timeout",
             NVML_ERROR_GPU_IS_LOST: "GPU is lost", NVML_ERROR_UNKNOWN: "Unknown Error"}


class NVMLError(Exception):
    """As pynvml's: the error code in `value`, its message as str()."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


class FakeNvml(types.ModuleType):
    """`gpus` H100s; `failing` maps a function name to the error code it raises (for every call), and
    `failing_gpus` maps one to the GPU indices it fails for. `xid(gpu, code)` queues an Xid event."""

    NVMLError = NVMLError
    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, gpus: int = 8, failing: dict[str, int] | None = None,
                 failing_gpus: dict[str, set[int]] | None = None) -> None:
        super().__init__("pynvml")
        self.gpus, self.failing, self.failing_gpus = gpus, dict(failing or {}), dict(failing_gpus or {})
        self.pending: deque[Any] = deque()
        self.registered: set[int] = set()
        self.inits = 0

    def _call(self, name: str, gpu: int | None = None) -> None:
        if name in self.failing and (gpu is None or gpu in self.failing_gpus.get(name, {gpu})):
            raise NVMLError(self.failing[name])

    def xid(self, gpu: int | None, code: int) -> None:
        """An Xid event on `gpu` (None: a GPU whose index NVML can no longer read)."""
        self.pending.append(types.SimpleNamespace(eventType=self.nvmlEventTypeXidCriticalError, eventData=code,
                                                  device=("lost" if gpu is None else gpu)))

    # ---- the module's functions ------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._call("nvmlInit")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._call("nvmlDeviceGetHandleByIndex", index)
        return index

    def nvmlEventSetCreate(self) -> str:
        self._call("nvmlEventSetCreate")
        return "event-set"

    def nvmlEventSetFree(self, _events: str) -> None:
        pass

    def nvmlDeviceRegisterEvents(self, handle: int, _types: int, _events: str) -> None:
        self._call("nvmlDeviceRegisterEvents", handle)
        self.registered.add(handle)

    def nvmlEventSetWait_v2(self, _events: str, _timeout_ms: int) -> Any:
        if not self.pending:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        return self.pending.popleft()

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        if handle == "lost":
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return int(handle)

    def nvmlDeviceGetClockInfo(self, handle: int, _clock: int) -> int:
        return 1980

    def nvmlDeviceGetMaxClockInfo(self, handle: int, _clock: int) -> int:
        return 1980

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return 0

    def nvmlDeviceGetTemperature(self, handle: int, _sensor: int) -> int:
        return 45

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 650_000

    def nvmlDeviceGetTotalEccErrors(self, handle: int, _kind: int, _counter: int) -> int:
        return 0

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return (0, 0, 0, 0)
