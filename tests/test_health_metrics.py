"""The tfsn_* Prometheus metrics, scraped over real HTTP, and the Grafana dashboard built on them."""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from health.metrics import Metrics
from health.telemetry import Sample

DASHBOARD = Path(__file__).resolve().parent.parent / "configs" / "grafana" / "tfsn-dashboard.json"


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of a /metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def series(name: str, **labels: str) -> tuple[str, frozenset]:
    return name, frozenset(labels.items())


def fill(metrics: Metrics, job: str) -> None:
    """What a controller does over a few steps of a 2-node job."""
    now = time.time()
    for rank, step_time in enumerate([0.50, 0.52, 0.81, 0.49]):
        metrics.observe(job, Sample(time=now, node=f"node-{rank // 2}", rank=rank, step=120, step_time=step_time,
                                    compute_time=step_time - 0.1))
    metrics.observe(job, Sample(time=now, node="node-1", gpu=0, sm_clock_mhz=1188, max_sm_clock_mhz=1980,
                                temperature_c=84.0, clock_event_reasons=0x8))
    metrics.observe(job, Sample(time=now, node="node-1", gpu=1, xid=79))  # an event, no gauge of its own
    metrics.straggler_scores(job, {0: 1.0, 1: 0.97, 2: 0.62, 3: 1.01})
    metrics.finding(job, "throttle", "warning")
    metrics.finding(job, "throttle", "warning")
    metrics.finding(job, "xid", "critical")
    metrics.restart(job)
    metrics.goodput(job, 0.93)


def test_the_served_endpoint_exposes_every_series():
    metrics = Metrics()
    fill(metrics, "7")
    port = metrics.serve(0)
    assert port > 0
    got = scrape(port)
    assert got[series("tfsn_step_time_seconds", job="7", rank="2")] == 0.81
    assert got[series("tfsn_compute_time_seconds", job="7", rank="2")] == pytest.approx(0.71)
    assert got[series("tfsn_straggler_score", job="7", rank="2")] == 0.62
    assert got[series("tfsn_gpu_clock_ratio", job="7", node="node-1", gpu="0")] == pytest.approx(0.6)
    assert got[series("tfsn_gpu_temperature_celsius", job="7", node="node-1", gpu="0")] == 84.0
    assert got[series("tfsn_findings_total", job="7", kind="throttle", severity="warning")] == 2
    assert got[series("tfsn_findings_total", job="7", kind="xid", severity="critical")] == 1
    assert got[series("tfsn_restarts_total", job="7")] == 1
    assert got[series("tfsn_goodput_ratio", job="7")] == 0.93
    assert got[series("tfsn_job_step", job="7")] == 120
    for node in ("node-0", "node-1"):
        assert 0 <= got[series("tfsn_node_heartbeat_age_seconds", job="7", node=node)] < 5
    # the Xid sample has no clock: it must not have made a series for GPU 1
    assert series("tfsn_gpu_clock_ratio", job="7", node="node-1", gpu="1") not in got


def test_heartbeat_age_is_computed_when_scraped():
    metrics = Metrics()
    metrics.observe("7", Sample(time=time.time() - 100, node="node-0", rank=0, step=1, step_time=0.5))
    metrics.observe("7", Sample(time=time.time() - 300, node="node-0", rank=1, step=1, step_time=0.5))  # late batch
    port = metrics.serve(0)
    first = scrape(port)[series("tfsn_node_heartbeat_age_seconds", job="7", node="node-0")]
    assert 100 <= first < 105  # the newest record counts, not the last one to arrive
    time.sleep(0.2)
    assert scrape(port)[series("tfsn_node_heartbeat_age_seconds", job="7", node="node-0")] > first


def test_job_step_follows_rank_zero():
    metrics = Metrics()
    metrics.observe("7", Sample(time=1.0, node="n", rank=0, step=10, step_time=0.5))
    metrics.observe("7", Sample(time=1.0, node="n", rank=1, step=11, step_time=0.5))
    got = scrape(metrics.serve(0))
    assert got[series("tfsn_job_step", job="7")] == 10


def test_forget_drops_only_that_jobs_series():
    metrics = Metrics()
    fill(metrics, "7")
    fill(metrics, "8")
    metrics.forget("7")
    got = scrape(metrics.serve(0))
    assert not [key for key in got if ("job", "7") in key[1]]
    assert got[series("tfsn_step_time_seconds", job="8", rank="2")] == 0.81
    assert got[series("tfsn_node_heartbeat_age_seconds", job="8", node="node-1")] >= 0
    assert got[series("tfsn_findings_total", job="8", kind="throttle", severity="warning")] == 2


def test_two_instances_keep_their_own_registries():
    one, two = Metrics(), Metrics(CollectorRegistry())  # neither touches prometheus_client's global REGISTRY
    one.restart("7")
    two.goodput("7", 0.5)
    got_one, got_two = scrape(one.serve(0)), scrape(two.serve(0))
    assert got_one[series("tfsn_restarts_total", job="7")] == 1
    assert series("tfsn_restarts_total", job="7") not in got_two
    assert got_two[series("tfsn_goodput_ratio", job="7")] == 0.5
    assert series("tfsn_goodput_ratio", job="7") not in got_one


# ---- the Grafana dashboard ------------------------------------------------------------------------

def exposed_names(metrics: Metrics) -> set[str]:
    """The names a PromQL query can use for what `metrics` registers."""
    names = set()
    for family in metrics.registry.collect():
        names |= {family.name + "_total", family.name + "_created"} if family.type == "counter" else {family.name}
    return names


def test_dashboard_queries_use_only_metrics_that_exist():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for expr in exprs for name in re.findall(r"\btfsn_\w+", expr)}
    known = exposed_names(Metrics())
    assert all(re.search(r"\btfsn_\w+", e) for e in exprs), "every query reads a tfsn metric"
    assert used <= known, f"dashboard queries unknown metrics: {sorted(used - known)}"
    registered = {n.removesuffix("_created") for n in known if not n.endswith("_created")}
    assert registered <= used, f"metrics with no panel: {sorted(registered - used)}"


def test_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41 and dashboard["uid"] and dashboard["title"]
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert panel["targets"] and {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        assert all(t["refId"] for t in panel["targets"])
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for wanted in ("step time", "compute time", "straggler", "clock ratio", "findings", "restarts", "goodput",
                   "heartbeat"):
        assert wanted in titles
