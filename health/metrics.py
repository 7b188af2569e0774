"""The tfsn_* Prometheus metrics, defined once, on a registry of their own.

Each `Metrics` owns a `CollectorRegistry` (not prometheus_client's global one), so tests and
several controllers in one process never clash over metric names.

Cardinality: per-rank metrics (step time, compute time, straggler score) hold one series per
rank, so a 4096-rank job is ~4k series per metric, ~12k for the three; per-GPU metrics one per
GPU (the same ~4k at 8 GPUs a node); the rest one per job. Call `forget(job)` when a job ends so
a long-lived controller does not keep series of jobs that are gone.
"""
from __future__ import annotations

import threading
import time
from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from health.telemetry import Sample

_JOB = ("job",)
_RANK = ("job", "rank")
_GPU = ("job", "node", "gpu")
_FINDING = ("job", "kind", "severity")


class Metrics:
    """Updates the tfsn_* series from samples, findings and job events; serves them over HTTP."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.step_time = Gauge("tfsn_step_time_seconds", "Wall seconds of the rank's last step.",
                               _RANK, registry=r)
        self.compute_time = Gauge("tfsn_compute_time_seconds",
                                  "Seconds of the rank's last step not spent waiting in collectives.",
                                  _RANK, registry=r)
        self.straggler_score = Gauge("tfsn_straggler_score",
                                     "The straggler detector's score of the rank (lower = slower).",
                                     _RANK, registry=r)
        self.clock_ratio = Gauge("tfsn_gpu_clock_ratio", "SM clock over the GPU's maximum SM clock.",
                                 _GPU, registry=r)
        self.temperature = Gauge("tfsn_gpu_temperature_celsius", "GPU temperature.", _GPU, registry=r)
        self.findings = Counter("tfsn_findings", "Health findings raised, by detector kind and severity.",
                                _FINDING, registry=r)
        self.restarts = Counter("tfsn_restarts", "Restarts of the job from a checkpoint.", _JOB, registry=r)
        self.goodput_ratio = Gauge("tfsn_goodput_ratio", "Productive training time over wall time.",
                                   _JOB, registry=r)
        self.job_step = Gauge("tfsn_job_step", "Last step rank 0 finished.", _JOB, registry=r)
        self._labelled: list[tuple[MetricWrapperBase, tuple[str, ...]]] = [
            (self.step_time, _RANK), (self.compute_time, _RANK), (self.straggler_score, _RANK),
            (self.clock_ratio, _GPU), (self.temperature, _GPU), (self.findings, _FINDING),
            (self.restarts, _JOB), (self.goodput_ratio, _JOB), (self.job_step, _JOB)]
        self._heartbeats = _HeartbeatAges()
        r.register(self._heartbeats)

    def observe(self, job: str, sample: Sample) -> None:
        """Update the series a sample informs: an SDK step record or a GPU reading."""
        if sample.rank is not None:
            rank = str(sample.rank)
            if sample.step_time is not None:
                self.step_time.labels(job, rank).set(sample.step_time)
            if sample.compute_time is not None:
                self.compute_time.labels(job, rank).set(sample.compute_time)
            if sample.rank == 0 and sample.step is not None:  # rank 0 speaks for the job, as in the store
                self.job_step.labels(job).set(sample.step)
            self._heartbeats.beat(job, sample.node, sample.time)  # a step record is a worker's heartbeat
        if sample.gpu is not None:
            gpu = str(sample.gpu)
            ratio = sample.clock_ratio
            if ratio is not None:
                self.clock_ratio.labels(job, sample.node, gpu).set(ratio)
            if sample.temperature_c is not None:
                self.temperature.labels(job, sample.node, gpu).set(sample.temperature_c)

    def finding(self, job: str, kind: str, severity: str) -> None:
        """Count one finding of a detector."""
        self.findings.labels(job, kind, severity).inc()

    def restart(self, job: str) -> None:
        """Count one restart of the job."""
        self.restarts.labels(job).inc()

    def goodput(self, job: str, ratio: float) -> None:
        """Set the job's productive time / wall time."""
        self.goodput_ratio.labels(job).set(ratio)

    def straggler_scores(self, job: str, scores: Mapping[int, float]) -> None:
        """Set the straggler score of each rank given."""
        for rank, score in scores.items():
            self.straggler_score.labels(job, str(rank)).set(score)

    def forget(self, job: str) -> None:
        """Drop every series of a finished job, so series count follows running jobs only."""
        for metric, names in self._labelled:
            series = {tuple(s.labels[n] for n in names)
                      for family in metric.collect() for s in family.samples if s.labels.get("job") == job}
            for values in series:
                metric.remove(*values)
        self._heartbeats.forget(job)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics of this registry from a daemon thread; returns the bound port (0 = any free)."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_address[1])


class _HeartbeatAges(Collector):
    """tfsn_node_heartbeat_age_seconds, computed at scrape time so a silent node's age keeps growing.

    The age is from the newest step record's own timestamp (the worker's clock), so it measures
    when the node last made progress, not when its records reached the controller.
    """

    NAME = "tfsn_node_heartbeat_age_seconds"
    HELP = "Seconds since the node's newest step record."

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def beat(self, job: str, node: str, at: float) -> None:
        with self._lock:
            self._last[job, node] = max(at, self._last.get((job, node), at))

    def forget(self, job: str) -> None:
        with self._lock:
            for key in [k for k in self._last if k[0] == job]:
                del self._last[key]

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=["job", "node"])]

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["job", "node"])
        now = time.time()
        with self._lock:
            last = list(self._last.items())
        for (job, node), at in last:
            family.add_metric([job, node], max(0.0, now - at))  # clamp: clocks of nodes differ slightly
        return [family]
