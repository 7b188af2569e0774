"""GPU detectors, per (node, GPU): a throttled clock, Xid events, ECC errors and row remapping.

A GPU finding names the node and the GPU, not ranks: NVML's GPU index is not the rank's. Xids are
events, reported once; a throttled clock and ECC trouble are conditions, reported while they hold,
one finding per GPU (a node's power-capped GPU 0 must not hide its overheating GPU 5). An Xid whose
GPU NVML could not name (it fell off the bus) is the node's; a GPU whose Xids NVML refuses to report
is said once, since a fault there would go unseen.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from health.config import HealthConfig
from health.findings import Finding, FindingKind, Severity
from health.telemetry import ClockReason, Sample

HW_THROTTLING = ClockReason.HW_SLOWDOWN | ClockReason.HW_THERMAL | ClockReason.HW_POWER_BRAKE
SBE_WINDOW_S = 3600            # corrected ECC errors are counted over the last hour


@dataclass(frozen=True, slots=True)
class XidClass:
    """What an Xid code means for the job: whose fault, how bad, and what the GPU needs."""

    code: int
    fault: str               # "application", "hardware", "driver" or "unknown"
    severity: Severity
    reset: bool              # the GPU needs a reset (or the node a reboot) before it is trusted again
    drain: bool              # take the node out of service: the fault will come back
    description: str


# From NVIDIA's Xid catalog (https://docs.nvidia.com/deploy/xid-errors/, "Analyzing Xid Errors with
# the Xid Catalog", resolution buckets RESTART_APP / RESET_GPU / RESTART_BM / CONTACT_SUPPORT) and
# NVIDIA's GPU health checks. Application faults restart the app on the same GPU; the others leave
# the GPU untrustworthy until reset, or the node needs service.
_A, _H, _D = "application", "hardware", "driver"
_XIDS: dict[int, tuple[str, Severity, bool, bool, str]] = {
    13: (_A, Severity.INFO, False, False, "graphics engine exception (usually an out-of-bounds access in a kernel)"),
    31: (_A, Severity.INFO, False, False, "GPU memory page fault (an illegal address in the application)"),
    43: (_A, Severity.INFO, False, False, "GPU stopped processing the application's channel (app fault, GPU fine)"),
    45: (_A, Severity.INFO, False, False, "preemptive cleanup after an earlier error (follow-on, not a cause)"),
    48: (_H, Severity.CRITICAL, True, True, "double-bit (uncorrectable) ECC error"),
    61: (_D, Severity.CRITICAL, True, False, "internal micro-controller breakpoint/warning"),
    62: (_D, Severity.CRITICAL, True, False, "internal micro-controller halt"),
    63: (_H, Severity.WARNING, True, False, "ECC page retirement / row remap recorded; reset to activate"),
    64: (_H, Severity.CRITICAL, True, True, "ECC page retirement / row remap failed"),
    74: (_H, Severity.CRITICAL, True, True, "NVLink error"),
    79: (_H, Severity.CRITICAL, True, True, "GPU has fallen off the bus"),
    92: (_H, Severity.WARNING, False, False, "high single-bit ECC error rate"),
    94: (_H, Severity.WARNING, True, False, "contained ECC error (the app must restart; reset to remap)"),
    95: (_H, Severity.CRITICAL, True, True, "uncontained ECC error"),
    119: (_D, Severity.CRITICAL, True, False, "GSP RPC timeout"),
    120: (_D, Severity.CRITICAL, True, False, "GSP error"),
    140: (_H, Severity.CRITICAL, True, True, "unrecovered ECC error"),
    154: (_D, Severity.WARNING, True, False, "GPU recovery action changed: a reset or reboot is required"),
}


def classify_xid(code: int) -> XidClass:
    """The table entry for `code`; an unknown code is a warning with no node action."""
    if code in _XIDS:
        return XidClass(code, *_XIDS[code])
    return XidClass(code, "unknown", Severity.WARNING, False, False, "not in tfsn's Xid table")


@dataclass
class _GpuState:
    """What one GPU's last samples said."""

    throttled: int = 0              # consecutive throttled samples
    clock: float = 0.0
    max_clock: float = 0.0
    reasons: int = 0
    dbe: int = 0
    pending: bool = False
    failure: bool = False
    sbe: deque[tuple[float, int]] = field(default_factory=deque)   # (time, count) over the last hour

    def sbe_last_hour(self) -> int:
        return self.sbe[-1][1] - self.sbe[0][1] if self.sbe else 0


class DeviceWatch:
    """Every GPU's samples: Xids as they come, and the GPUs with a condition to report at each check."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self._gpus: dict[tuple[str, int], _GpuState] = {}
        self._watch: set[tuple[str, int]] = set()           # GPUs with something to report
        self._events: list[Finding] = []                    # one-off findings waiting for check()
        self._unwatched: set[tuple[str, int]] = set()       # GPUs said to have no Xid events

    def observe(self, sample: Sample, step: int | None) -> None:
        """One GPU's readings and Xid event; `step` is the job's last closed step."""
        if sample.xid is not None:
            self._events.append(_xid_finding(sample, step))
        if sample.gpu is None:
            return                     # an Xid of a GPU NVML could not name: nothing else to read
        cfg, key = self.config, (sample.node, sample.gpu)
        gpu = self._gpus.setdefault(key, _GpuState())
        if sample.xid_watched is False and key not in self._unwatched:
            self._unwatched.add(key)
            self._events.append(Finding(FindingKind.XID, Severity.INFO, sample.node, sample.gpu, (),
                                        f"GPU {sample.gpu}: NVML refused to report its Xid events; an Xid there "
                                        "goes unseen (the node's log says why)", sample.time, step))
        ratio = sample.clock_ratio
        if ratio is not None:
            reasons = sample.clock_event_reasons or 0
            slowed = ratio < cfg.throttle_clock_ratio and bool(reasons & ClockReason.THROTTLING)
            gpu.throttled = gpu.throttled + 1 if slowed else 0
            gpu.clock, gpu.max_clock, gpu.reasons = sample.sm_clock_mhz or 0.0, sample.max_sm_clock_mhz or 0.0, reasons
        if sample.ecc_dbe_volatile is not None:
            gpu.dbe = sample.ecc_dbe_volatile
        if sample.remapped_rows_pending is not None:
            gpu.pending = sample.remapped_rows_pending
        if sample.remapped_rows_failure is not None:
            gpu.failure = sample.remapped_rows_failure
        if sample.ecc_sbe_volatile is not None:
            if gpu.sbe and sample.ecc_sbe_volatile < gpu.sbe[-1][1]:
                gpu.sbe.clear()        # the volatile counter restarts with the GPU
            gpu.sbe.append((sample.time, sample.ecc_sbe_volatile))
            while sample.time - gpu.sbe[0][0] > SBE_WINDOW_S:
                gpu.sbe.popleft()
        if (gpu.throttled >= cfg.throttle_samples or gpu.dbe or gpu.pending or gpu.failure
                or gpu.sbe_last_hour() >= cfg.ecc_sbe_per_hour):
            self._watch.add(key)

    def check(self, now: float, step: int | None) -> tuple[list[Finding], dict[str, list[Finding]]]:
        """The Xids since the last check and the ECC findings; apart, the throttle findings by node
        (one per throttled GPU, the most severe first), for the Monitor to pair with the node's stragglers."""
        findings, self._events = self._events, []
        throttled: dict[str, list[Finding]] = {}
        for key in sorted(self._watch):
            node, index = key
            gpu = self._gpus[key]
            ecc = self._ecc_finding(node, index, gpu, now, step)
            if ecc is not None:
                findings.append(ecc)
            hot = gpu.throttled >= self.config.throttle_samples
            if hot:
                throttled.setdefault(node, []).append(self._throttle_finding(node, index, gpu, now, step))
            if ecc is None and not hot:
                self._watch.discard(key)
        for hot in throttled.values():
            hot.sort(key=lambda f: f.severity != Severity.WARNING)      # stable: by GPU within a severity
        return findings, throttled

    def _ecc_finding(self, node: str, index: int, gpu: _GpuState, now: float, step: int | None) -> Finding | None:
        cfg = self.config
        ecc: list[str] = []
        severity = Severity.WARNING
        if gpu.dbe:
            ecc.append(f"{gpu.dbe} uncorrected (double-bit) ECC errors since the last GPU reset")
            severity = Severity.CRITICAL
        if gpu.failure:
            ecc.append("row remapping failed: bad memory rows can no longer be retired")
            severity = Severity.CRITICAL
        if gpu.pending:
            ecc.append("a row remap is pending: the GPU needs a reset to retire the bad row")
        sbe = gpu.sbe_last_hour()
        if sbe >= cfg.ecc_sbe_per_hour:
            ecc.append(f"{sbe} corrected ECC errors in the last hour (limit {cfg.ecc_sbe_per_hour})")
        if not ecc:
            return None
        return Finding(FindingKind.ECC, severity, node, index, (), f"GPU {index}: " + "; ".join(ecc), now, step)

    def _throttle_finding(self, node: str, index: int, gpu: _GpuState, now: float, step: int | None) -> Finding:
        cfg = self.config
        reasons = ClockReason(gpu.reasons & ClockReason.THROTTLING)
        # A power or software cap alone is ordinary under full load; hardware slowdown is not.
        level = Severity.WARNING if reasons & HW_THROTTLING else Severity.INFO
        return Finding(FindingKind.THROTTLE, level, node, index, (),
                       f"GPU {index} SM clock {gpu.clock:.0f}/{gpu.max_clock:.0f} MHz "
                       f"({gpu.clock / gpu.max_clock:.0%} < {cfg.throttle_clock_ratio:.0%}) with {reasons.name} "
                       f"for {gpu.throttled} samples", now, step)


def _xid_finding(sample: Sample, step: int | None) -> Finding:
    xid = classify_xid(int(sample.xid))
    todo = "drain the node" if xid.drain else "reset the GPU" if xid.reset else "no node action"
    where = f"GPU {sample.gpu}" if sample.gpu is not None else "a GPU NVML could not name (lost from the bus?)"
    return Finding(FindingKind.XID, xid.severity, sample.node, sample.gpu, (),
                   f"Xid {xid.code} on {where}: {xid.description} ({xid.fault} fault; {todo})",
                   sample.time, step)
