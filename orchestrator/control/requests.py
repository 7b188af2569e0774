"""The bodies the API accepts, one model per route, each bounded: a request outside them is a 400
before any handler runs, whatever its JSON holds."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.sdk.client import (METRIC_NAME_CHARS, METRICS_MAX, SKIPPED_CHARS, SKIPPED_MAX,
                                     TELEMETRY_RECORDS_MAX)

Text = Annotated[str, Field(max_length=255)]
Count = Annotated[int, Field(ge=0, le=10**12)]
Seconds = Annotated[float, Field(ge=0, le=10**10, allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Heartbeat(_Body):
    state: Annotated[str, Field(max_length=32)] = ""
    attempt: Count | None = None
    addr: Annotated[str, Field(max_length=255, pattern=r"^[A-Za-z0-9.:%\[\]-]*$")] = ""  # an IP or a host name
    host: Text = ""


class Result(_Body):
    attempt: Count
    returncode: Annotated[int, Field(ge=-(2**31), le=2**31)]
    signal: Annotated[int, Field(ge=0, le=128)] | None = None
    stopped: bool = False
    summary: Annotated[str, Field(max_length=16_000)] = ""


class Logs(_Body):
    lines: Annotated[list[Annotated[str, Field(max_length=64_000)]], Field(max_length=20_000)]


class StepRecord(BaseModel):
    model_config = ConfigDict(extra="allow")   # newer SDKs may add fields; the store keeps what it knows
    step: Count
    at: Seconds
    step_time: Seconds
    compute_time: Seconds | None = None
    metrics: Annotated[dict[Annotated[str, Field(max_length=METRIC_NAME_CHARS)], Any],
                       Field(max_length=METRICS_MAX)] = {}


PhaseName = Annotated[str, Field(max_length=32, pattern=r"^[a-z][a-z0-9_-]*$")]


class Telemetry(_Body):
    attempt: Count
    rank: Annotated[int, Field(ge=0, le=1_000_000)]
    records: Annotated[list[StepRecord], Field(max_length=TELEMETRY_RECORDS_MAX)]
    heartbeat: Seconds | None = None
    step: Count | None = None        # the step the rank is in (with no record yet while it runs)
    phase: PhaseName | None = None   # what it does now: train, or an announced phase (checkpoint, eval, data)
    phase_since: Seconds | None = None
    phases: Annotated[dict[PhaseName, Seconds], Field(max_length=16)] = {}   # longest of each finished phase


Reading = Annotated[float, Field(ge=-1e9, le=1e9, allow_inf_nan=False)]


class GpuSample(_Body):
    """One NVML/DCGM reading (health.telemetry.Sample's fields, bounded: a GPU index is a metric label)."""
    time: Seconds
    node: Text | None = None           # replaced by the node the token speaks for
    rank: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    gpu: Annotated[int, Field(ge=0, le=63)] | None = None
    step: Count | None = None
    step_time: Seconds | None = None
    compute_time: Seconds | None = None
    sm_clock_mhz: Reading | None = None
    max_sm_clock_mhz: Reading | None = None
    clock_event_reasons: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    temperature_c: Reading | None = None
    power_w: Reading | None = None
    ecc_sbe_volatile: Count | None = None
    ecc_dbe_volatile: Count | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    xid: Annotated[int, Field(ge=0, le=2**31)] | None = None
    xid_watched: bool | None = None


class Samples(_Body):
    samples: Annotated[list[GpuSample], Field(max_length=1024)]


class Checkpoint(_Body):
    step: Count
    path: Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00-\x1f\x7f]*$")]   # one line
    seconds: Seconds = 0.0
    restored: bool = False
    skipped: Annotated[list[Annotated[str, Field(max_length=SKIPPED_CHARS, pattern=r"^[^\x00-\x1f\x7f]*$")]],
                       Field(max_length=SKIPPED_MAX)] = []   # a restore's reasons for passing newer ones over


class BootFailure(_Body):
    """What a VM's boot script sends before it powers off (providers/bootstrap.py: the end of its log)."""
    stage: Annotated[str, Field(max_length=32)] = ""
    returncode: Annotated[int, Field(ge=-(2**31), le=2**31)] = 0
    tail: Annotated[str, Field(max_length=20_000)]


class AttemptCommand(_Body):
    attempt: Annotated[int, Field(ge=1, le=10**12)]
