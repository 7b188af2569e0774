"""Telemetry sources: SDK records, NVML mapping, and a real HTTP scrape of dcgm-exporter text."""
from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from health.telemetry import (ClockReason, DcgmSource, NvmlSource, Sample, TelemetryError, _dcgm_blank,
                              _nvml_sample, sdk_sample)

HAS_GPU = Path("/dev/nvidiactl").exists()

# What dcgm-exporter 4.x serves for two H100s with ECC, row-remap, max-clock and clock-event
# fields added to its counters file. GPU 0 is held by HW_SLOWDOWN at 60% of its max SM clock;
# GPU 1 runs at full clock and raised Xid 79 (fallen off the bus).
LABELS = ('gpu="{i}",UUID="GPU-{uuid}",pci_bus_id="00000000:{bus}:00.0",device="nvidia{i}",'
          'modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",DCGM_FI_DRIVER_VERSION="550.90.07"')
GPUS = [dict(i=0, uuid="6f3c1a2e-8a1b-4f2d-9c3e-1d2b3c4d5e6f", bus="18"),
        dict(i=1, uuid="0b9e7d6c-5a4b-3c2d-1e0f-a9b8c7d6e5f4", bus="2A")]


def dcgm_text(reasons_name: str = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", xid: int = 79) -> str:
    rows = {  # name, type, help, (gpu0, gpu1)
        "DCGM_FI_DEV_SM_CLOCK": ("gauge", "SM clock frequency (in MHz).", (1188, 1980)),
        "DCGM_FI_DEV_MAX_SM_CLOCK": ("gauge", "Maximum supported SM clock (in MHz).", (1980, 1980)),
        "DCGM_FI_DEV_MEM_CLOCK": ("gauge", "Memory clock frequency (in MHz).", (2619, 2619)),
        "DCGM_FI_DEV_MEMORY_TEMP": ("gauge", "Memory temperature (in C).",
                                    (9223372036854775794, 9223372036854775794)),  # DCGM blank: no value
        "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C).", (84, 41)),
        "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W).", (402.117, 689.5)),
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("counter", "Total energy consumption since boot (in mJ).",
                                                 (8843310021, 9120440113)),
        reasons_name: ("gauge", "Current clock event reasons.", (int(ClockReason.HW_SLOWDOWN), 0)),
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("counter", "Total number of single-bit volatile ECC errors.", (3, 0)),
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("counter", "Total number of double-bit volatile ECC errors.", (0, 0)),
        "DCGM_FI_DEV_ROW_REMAP_PENDING": ("gauge", "Whether remapping of rows is pending.", (0, 0)),
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("gauge", "Whether remapping of rows has failed.", (0, 0)),
    }
    lines = []
    for name, (kind, doc, values) in rows.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{{{LABELS.format(**g)}}} {v}" for g, v in zip(GPUS, values)]
    lines += ["# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.",
              "# TYPE DCGM_FI_DEV_XID_ERRORS gauge",
              f'DCGM_FI_DEV_XID_ERRORS{{{LABELS.format(**GPUS[0])},err_code="0",err_msg="No Error"}} 0',
              f'DCGM_FI_DEV_XID_ERRORS{{{LABELS.format(**GPUS[1])},err_code="{xid}",'
              f'err_msg="GPU has fallen off the bus"}} {xid}']
    return "\n".join(lines) + "\n"


class Exporter:
    """A real HTTP server on 127.0.0.1 serving whatever `body` (and `status`) currently hold."""

    def __init__(self) -> None:
        self.body, self.status = dcgm_text().encode(), 200
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(exporter.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(exporter.body)))
                self.end_headers()
                self.wfile.write(exporter.body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()


@pytest.fixture
def exporter():
    server = Exporter()
    yield server
    server.server.shutdown()
    server.server.server_close()


# ---- Sample, ClockReason, SDK records -------------------------------------------------------------

def test_sdk_sample_from_a_record_as_the_sdk_posts_it():
    body = {"rank": 3, "attempt": 1, "records": [{"step": 41, "at": 1700000000.25, "step_time": 0.512,
                                                   "metrics": {"loss": 2.5}}]}
    sample = sdk_sample("node-a", {**body["records"][0], "rank": body["rank"]})
    assert sample == Sample(time=1700000000.25, node="node-a", rank=3, step=41, step_time=0.512)
    with_compute = sdk_sample("node-a", {"rank": 0, "step": 1, "at": 5.0, "step_time": 0.5, "compute_time": 0.4})
    assert with_compute.compute_time == 0.4 and with_compute.gpu is None


def test_a_bad_sdk_record_is_a_telemetry_error():
    with pytest.raises(TelemetryError, match="node-a"):
        sdk_sample("node-a", {"rank": 0, "step": 1, "step_time": 0.5})  # no "at"


def test_clock_ratio_needs_both_clocks():
    assert Sample(time=0, node="n", gpu=0, sm_clock_mhz=1188, max_sm_clock_mhz=1980).clock_ratio == pytest.approx(0.6)
    assert Sample(time=0, node="n", gpu=0, sm_clock_mhz=1188).clock_ratio is None
    assert Sample(time=0, node="n", gpu=0, max_sm_clock_mhz=1980).clock_ratio is None
    assert Sample(time=0, node="n", gpu=0, sm_clock_mhz=0, max_sm_clock_mhz=0).clock_ratio is None


def test_clock_reason_bits_match_nvml_and_throttling_is_the_forced_slowdowns():
    # nvml.h nvmlClocksEventReason* values
    assert [int(r) for r in ClockReason] == [0x1, 0x2, 0x4, 0x8, 0x10, 0x20, 0x40, 0x80, 0x100]
    assert ClockReason.THROTTLING == (ClockReason.HW_SLOWDOWN | ClockReason.HW_THERMAL | ClockReason.HW_POWER_BRAKE
                                      | ClockReason.SW_THERMAL | ClockReason.SW_POWER_CAP) == 0xEC
    for benign in (ClockReason.GPU_IDLE, ClockReason.APPLICATIONS_CLOCKS_SETTING, ClockReason.SYNC_BOOST,
                   ClockReason.DISPLAY_CLOCK):
        assert not benign & ClockReason.THROTTLING
    assert ClockReason(0x48) & ClockReason.THROTTLING  # HW_SLOWDOWN | HW_THERMAL, as a hot GPU reports


# ---- NVML -----------------------------------------------------------------------------------------
# The NVML calls themselves (NvmlSource.sample) are exercised only on a machine with an NVIDIA GPU
# (test_nvml_source_reads_the_real_gpus below); here we test the mapping of the values they return.

def test_nvml_readings_of_a_healthy_gpu():
    readings = {"clock_sm": 1980, "max_clock_sm": 1980, "clocks_event_reasons": 0, "temperature": 45,
                "power_usage": 689512, "ecc_corrected_volatile": 0, "ecc_uncorrected_volatile": 0,
                "remapped_rows": (0, 0, 0, 0)}
    sample = _nvml_sample("node-a", 2, readings, at=100.0)
    assert sample == Sample(time=100.0, node="node-a", gpu=2, sm_clock_mhz=1980.0, max_sm_clock_mhz=1980.0,
                            clock_event_reasons=0, temperature_c=45.0, power_w=689.512, ecc_sbe_volatile=0,
                            ecc_dbe_volatile=0, remapped_rows_pending=False, remapped_rows_failure=False)
    assert sample.clock_ratio == 1.0


def test_nvml_readings_of_a_hot_gpu_with_a_pending_row_remap():
    readings = {"clock_sm": 1155, "max_clock_sm": 1980, "clocks_event_reasons": 0x48, "temperature": 88,
                "power_usage": 512004, "ecc_corrected_volatile": 17, "ecc_uncorrected_volatile": 1,
                "remapped_rows": (0, 1, 1, 0)}
    sample = _nvml_sample("node-a", 0, readings, at=100.0)
    assert ClockReason(sample.clock_event_reasons) == ClockReason.HW_SLOWDOWN | ClockReason.HW_THERMAL
    assert sample.clock_ratio == pytest.approx(1155 / 1980)
    assert (sample.ecc_sbe_volatile, sample.ecc_dbe_volatile) == (17, 1)
    assert sample.remapped_rows_pending is True and sample.remapped_rows_failure is False


def test_nvml_readings_a_gpu_does_not_support_stay_unknown():
    # A board without ECC or row remapping answers NOT_SUPPORTED: NvmlSource passes None.
    readings = {"clock_sm": 1410, "max_clock_sm": 2100, "clocks_event_reasons": 0x1, "temperature": 38,
                "power_usage": 30250, "ecc_corrected_volatile": None, "ecc_uncorrected_volatile": None,
                "remapped_rows": None}
    sample = _nvml_sample("node-a", 0, readings, at=100.0)
    assert sample.ecc_sbe_volatile is None and sample.remapped_rows_pending is None
    assert sample.power_w == pytest.approx(30.25)


def test_nvml_available_is_a_plain_bool_and_never_raises():
    available = NvmlSource.available()
    assert isinstance(available, bool)
    if not HAS_GPU:
        assert available is False


@pytest.mark.skipif(HAS_GPU, reason="checks the error of a machine without NVML")
def test_nvml_source_without_nvml_says_what_to_do():
    with pytest.raises(TelemetryError) as err:
        NvmlSource("node-a")
    if importlib.util.find_spec("pynvml") is None:
        assert "tfsn[gpu]" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(not NvmlSource.available(), reason="needs an NVIDIA GPU and nvidia-ml-py")
def test_nvml_source_reads_the_real_gpus():
    source = NvmlSource("node-a")
    try:
        samples = [s for s in source.sample() if s.xid is None]
        assert [s.gpu for s in samples] == list(range(len(samples))) and samples
        for s in samples:
            assert s.max_sm_clock_mhz and 0 < s.clock_ratio <= 1.05
            assert 0 < s.temperature_c < 120 and 0 < s.power_w < 2000
            assert s.clock_event_reasons is not None
        assert all(s.xid is None for s in source.sample())  # nothing raised an Xid meanwhile
    finally:
        source.close()
        source.close()


# ---- DCGM exporter --------------------------------------------------------------------------------

@pytest.mark.parametrize("reasons_name", ["DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"])
def test_dcgm_source_reads_both_gpus(exporter, reasons_name):
    exporter.body = dcgm_text(reasons_name).encode()
    before = time.time()
    slow, lost = DcgmSource(exporter.url, "node-a").sample()
    assert (slow.node, slow.gpu, lost.gpu) == ("node-a", 0, 1) and slow.time >= before
    assert slow.clock_ratio == pytest.approx(0.6)
    assert ClockReason(slow.clock_event_reasons) & ClockReason.THROTTLING == ClockReason.HW_SLOWDOWN
    assert (slow.temperature_c, slow.power_w, slow.ecc_sbe_volatile, slow.ecc_dbe_volatile) == (84, 402.117, 3, 0)
    assert slow.remapped_rows_pending is False and slow.remapped_rows_failure is False and slow.xid is None
    assert lost.xid == 79 and lost.clock_ratio == 1.0 and lost.clock_event_reasons == 0
    assert slow.rank is None and slow.step_time is None


def test_dcgm_xid_is_reported_once_per_change(exporter):
    source = DcgmSource(exporter.url, "node-a")
    assert [s.xid for s in source.sample()] == [None, 79]
    assert [s.xid for s in source.sample()] == [None, None]  # the same "last Xid" again: no new event
    exporter.body = dcgm_text(xid=48).encode()
    assert [s.xid for s in source.sample()] == [None, 48]


def test_dcgm_without_optional_fields_leaves_them_unknown(exporter):
    exporter.body = b"".join(line.encode() + b"\n" for line in dcgm_text().splitlines()
                             if "MAX_SM_CLOCK" not in line and "ECC" not in line)
    sample = DcgmSource(exporter.url, "node-a").sample()[0]
    assert sample.sm_clock_mhz == 1188 and sample.clock_ratio is None and sample.ecc_sbe_volatile is None


def test_dcgm_blank_values_are_not_readings():
    assert _dcgm_blank(9223372036854775794) and _dcgm_blank(2147483632) and _dcgm_blank(140737488355328.0)
    assert _dcgm_blank(float("nan"))
    assert not _dcgm_blank(0) and not _dcgm_blank(1980) and not _dcgm_blank(79)


def test_dcgm_unreachable_is_a_one_line_error_naming_the_url():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/metrics"
    began = time.monotonic()
    with pytest.raises(TelemetryError) as err:
        DcgmSource(url, "node-a", timeout=0.5).sample()
    assert url in str(err.value) and "\n" not in str(err.value)
    assert time.monotonic() - began < 2


def test_dcgm_endpoint_that_never_answers_times_out():
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/metrics"
        began = time.monotonic()
        with pytest.raises(TelemetryError, match="127.0.0.1"):
            DcgmSource(url, "node-a", timeout=0.3).sample()
        assert time.monotonic() - began < 2


@pytest.mark.parametrize("body", [b"<html><body>Welcome to nginx!</body></html>", b"\xff\xfe\x00garbage{{",
                                  b"DCGM_FI_DEV_SM_CLOCK{gpu=\"0\"} fast\n", b"up 1\nprocess_cpu_seconds_total 3\n", b""])
def test_dcgm_garbage_is_a_telemetry_error(exporter, body):
    exporter.body = body
    with pytest.raises(TelemetryError, match="127.0.0.1"):
        DcgmSource(exporter.url, "node-a").sample()


def test_dcgm_http_error_is_a_telemetry_error(exporter):
    exporter.status, exporter.body = 503, b"DCGM not ready"
    with pytest.raises(TelemetryError, match="503"):
        DcgmSource(exporter.url, "node-a").sample()


# ---- NVML's failures, on a stand-in for the driver (tests/fake_nvml.py) ---------------------------------

def test_an_xid_whose_gpu_index_cannot_be_read_is_kept_as_the_nodes():
    from health.config import HealthConfig
    from health.monitor import Monitor
    from tests.fake_nvml import FakeNvml
    nvml = FakeNvml(gpus=2)
    source = NvmlSource("node-a", nvml=nvml)
    nvml.xid(None, 79)
    (lost,) = [s for s in source.sample() if s.xid is not None]
    assert (lost.node, lost.gpu, lost.xid) == ("node-a", None, 79)
    monitor = Monitor(HealthConfig.load(), ["node-a"] * 2)
    monitor.observe(lost)
    (finding,) = monitor.check(lost.time)
    assert (finding.kind.value, finding.severity.value, finding.node) == ("xid", "critical", "node-a")
    source.close()
    assert nvml.inits == 0


def test_a_refused_xid_registration_is_said_in_the_samples_and_becomes_one_finding():
    """A failed Xid event registration was silent: an Xid on that GPU would never be seen, and nobody knew."""
    from health.config import HealthConfig
    from health.metrics import Metrics
    from orchestrator.control.health_watch import JobWatch
    from tests.fake_nvml import NVML_ERROR_NOT_SUPPORTED, FakeNvml
    nvml = FakeNvml(gpus=4, failing={"nvmlDeviceRegisterEvents": NVML_ERROR_NOT_SUPPORTED},
                    failing_gpus={"nvmlDeviceRegisterEvents": {3}})
    source = NvmlSource("node-a", nvml=nvml)
    assert source.unwatched == {3: "Not Supported"} and nvml.registered == {0, 1, 2}
    samples = source.sample()
    assert [s.xid_watched for s in samples] == [None, None, None, False]
    watch = JobWatch(1, HealthConfig.load(), Metrics())
    watch.start_attempt(1, ["node-a"] * 4)
    for sample in samples + source.sample():
        watch.observe_device(sample)
    new, decisions = watch.check(time.time())
    (finding,) = new
    assert (finding.kind.value, finding.severity.value, finding.gpu) == ("xid", "info", 3)
    assert "Xid events" in finding.evidence and "goes unseen" in finding.evidence
    assert [d.action.value for d in decisions] == ["warn"]
    assert watch.check(time.time()) == ([], [])           # said once
    source.close()


def test_nvml_failing_at_agent_start_leaves_the_agent_running_without_device_samples(monkeypatch):
    """NVML that initialised for available() but failed in NvmlSource() crashed the agent at start."""
    from orchestrator.agent.node import Agent
    from orchestrator.sdk.client import ControllerClient
    from tests.fake_nvml import NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_UNKNOWN, FakeNvml
    monkeypatch.delenv("TFSN_DCGM_URL", raising=False)
    monkeypatch.delenv("TFSN_AGENT_METRICS_PORT", raising=False)
    client = ControllerClient("http://127.0.0.1:9", "token", 1, timeout=0.2)   # nobody listens: posts wait
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(failing={"nvmlEventSetCreate": NVML_ERROR_UNKNOWN}))
    agent = Agent(client, "n0")
    assert agent.gpus is None
    (line,) = [x for x in agent.logs.tail if "GPU telemetry" in x]
    assert "running without GPU telemetry from NVML" in line and "Unknown Error" in line
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(gpus=2, failing={
        "nvmlDeviceRegisterEvents": NVML_ERROR_NOT_SUPPORTED}))
    agent = Agent(client, "n1")
    assert isinstance(agent.gpus, NvmlSource)
    said = [x for x in agent.logs.tail if "are not watched" in x]
    assert len(said) == 2 and "Xid events of GPU 1 are not watched (NVML: Not Supported)" in said[1]


def test_the_watch_measures_the_jobs_restart_and_save_for_the_policy():
    """A replacement's cost is the job's own: from the last step of an attempt to the first of the next."""
    from health.config import HealthConfig
    from health.metrics import Metrics
    from orchestrator.control.health_watch import JobWatch
    watch = JobWatch(1, HealthConfig.load(), Metrics())
    assert (watch.restart_s, watch.save_s) == (None, None)              # the policy takes its defaults
    watch.start_attempt(1, ["a", "b"])
    for rank in (0, 1):
        watch.observe(1, rank, [{"step": s, "at": 90.0 + s, "step_time": 1.0, "metrics": {}} for s in range(10)], None)
    watch.saved(1.5)
    watch.start_attempt(2, ["a", "c"])
    watch.observe(2, 1, [{"step": 5, "at": 144.0, "step_time": 1.0, "metrics": {}}], None)
    watch.observe(2, 0, [{"step": 5, "at": 146.0, "step_time": 1.0, "metrics": {}}], None)
    assert (watch.restart_s, watch.save_s) == (45.0, 1.5)


def test_a_node_clock_a_minute_off_neither_hangs_a_long_save_nor_hides_a_dead_rank():
    """Step, heartbeat and phase times are the node's clock; timeouts are the controller's. A node 60 s behind
    looked silent all along (its ranks blamed for a save's pause); one 60 s ahead, never silent."""
    from health.config import HealthConfig
    from health.metrics import Metrics
    from orchestrator.control.health_watch import JobWatch

    def job(skew: float) -> tuple[JobWatch, float]:
        watch = JobWatch(1, HealthConfig.load(), Metrics())
        watch.start_attempt(1, [f"n{r // 8}" for r in range(16)])
        now = 1000.0
        for step in range(80):                                 # 2 s steps, each rank posting once per step
            now += 2.0
            for rank in range(16):
                watch.post(1, rank, {"records": [{"step": step, "at": now + skew, "step_time": 1.9}],
                                     "heartbeat": now + skew, "phase": "train"}, now)
        return watch, now

    watch, now = job(skew=-60.0)
    save = now + 1
    for t in range(int(save), int(save) + 300, 5):             # a first save of 5 min, every rank beating
        for rank in range(16):
            watch.post(1, rank, {"records": [], "heartbeat": t - 60.0, "phase": "checkpoint",
                                 "phase_since": save - 60.0}, t)
        new, decisions = watch.check(t)
        assert new == [] and decisions == [], (t, [f.evidence for f in new])
    watch, now = job(skew=+60.0)
    for t in range(int(now) + 5, int(now) + 200, 5):           # rank 3 dies; the others wait in a collective
        for rank in set(range(16)) - {3}:
            watch.post(1, rank, {"records": [], "heartbeat": t + 60.0, "phase": "train"}, t)
    new, decisions = watch.check(now + 200)
    assert [(f.kind.value, f.node, f.ranks) for f in new] == [("hang", "n0", (3,))]


def test_an_xid_storm_is_drained_over_several_samples():
    """sample() drained NVML's event queue until it was empty: a storm faster than the drain would keep the
    agent's loop (its heartbeats too) there; 100,000 queued Xids came back as one list of 100,004 samples."""
    from health.telemetry import MAX_XIDS_PER_SAMPLE
    from tests.fake_nvml import FakeNvml
    nvml = FakeNvml(gpus=4)
    source = NvmlSource("node-a", nvml=nvml)
    for _ in range(100_000):
        nvml.xid(2, 79)
    samples = source.sample()
    assert len(samples) == 4 + MAX_XIDS_PER_SAMPLE and len(nvml.pending) == 100_000 - MAX_XIDS_PER_SAMPLE
    assert {(s.gpu, s.xid) for s in samples[4:]} == {(2, 79)}
    while nvml.pending:                    # the rest come with the next samples
        source.sample()
    source.close()
