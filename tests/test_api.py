"""The controller API: loopback only, and nothing without the job's secret token."""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from orchestrator.control.api import ApiServer
from orchestrator.sdk.client import ControllerClient, ControllerRejected, ControllerUnavailable
from orchestrator.control.controller import Controller
from orchestrator.spec import JobSpec
from orchestrator.control.store import Store


@pytest.fixture
def server(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    spec = JobSpec.model_validate({"name": "t", "run": "true"}).model_dump(mode="json")
    job = store.create_job("t", spec, "p", "the-secret")
    api = ApiServer(0, store, Controller(store, tmp_path, providers={}).handlers)
    api.start()
    yield api, store, job
    api.shutdown()


def test_listens_on_loopback_only(server):
    api, _, _ = server
    assert api.server_address[0] == "127.0.0.1"


def test_request_without_or_with_wrong_token_is_refused(server):
    api, store, job = server
    body = json.dumps({"rank": 0, "attempt": 1, "records": [{"step": 0, "at": 1.0, "step_time": 0.1,
                                                             "metrics": {"loss": 1.0}}]}).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "the-secret"[:-1]}):
        request = urllib.request.Request(f"{api.url}/v1/jobs/{job.id}/telemetry", data=body, headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=5)
        assert err.value.code == 401
    assert store.steps(job.id) == []  # nothing was recorded
    with pytest.raises(ControllerRejected, match="401"):
        ControllerClient(api.url, "wrong", job.id).post("/telemetry", json.loads(body))
    ControllerClient(api.url, "the-secret", job.id).post("/telemetry", json.loads(body))
    assert [r["step"] for r in store.steps(job.id)] == [0]


def test_another_jobs_token_does_not_open_this_job(server):
    api, store, job = server
    other = store.create_job("o", job.spec, "p", "other-secret")
    with pytest.raises(ControllerRejected, match="401"):
        ControllerClient(api.url, other.token, job.id).post("/logs", {"lines": ["x"]})


def test_malformed_requests_get_4xx_not_a_crash(server):
    api, _, job = server
    client = ControllerClient(api.url, "the-secret", job.id)
    with pytest.raises(ControllerRejected, match="400"):
        client.post("/telemetry", {"rank": "zero"})
    with pytest.raises(ControllerRejected, match="400"):
        client.post("/nodes/ghost-node/heartbeat", {})
    with pytest.raises(ControllerRejected, match="404"):
        ControllerClient(api.url, "the-secret", 999).post("/logs", {"lines": []})
    assert client.post("/logs", {"lines": ["still serving"]}) == {}


def test_unreachable_controller_is_unavailable_not_rejected():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ControllerUnavailable):
        ControllerClient(f"http://127.0.0.1:{port}", "t", 1, timeout=1).post("/logs", {"lines": []})


def test_negative_content_length_is_refused_before_reading(server):
    api, _, job = server
    host, port = api.server_address
    with socket.create_connection((host, port), timeout=5) as conn:
        conn.sendall(f"POST /v1/jobs/{job.id}/logs HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n".encode())
        assert b" 413 " in conn.recv(200).split(b"\r\n")[0] + b" "
