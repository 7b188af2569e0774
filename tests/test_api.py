"""The controller API under attack: scoped tokens, auth before the body, limits, bounded bodies, no way to
a traceback or a dropped connection, nothing written to an ended job, no secrets in heartbeats."""
from __future__ import annotations

import json
import os
import socket
import ssl
import struct
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.control import api as api_module
from orchestrator.control.api import MAX_CONNECTIONS, ApiServer
from orchestrator.control.controller import Controller
from orchestrator.control.credentials import agent_token, sdk_token
from orchestrator.control.store import JobState, NodeState, Store
from orchestrator.sdk.client import ControllerClient, ControllerRejected, ControllerUnavailable
from orchestrator.spec import JobSpec

SECRET_ENV = "sk-live-0123456789abcdef"


@pytest.fixture
def server(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    spec = JobSpec.model_validate({"name": "t", "run": "python train.py", "envs": {"API_KEY": SECRET_ENV},
                                   "checkpoint": {"dir": "/ckpt"}, "num_nodes": 2}).model_dump(mode="json")
    job = store.create_job("t", spec, "p", "the-secret")
    for rank in (0, 1):
        store.add_node(f"n{rank}", job.id, rank, "local", offer=None, spot=False)
        store.update_node(f"n{rank}", state=NodeState.READY, handle={"provider": "local", "node_id": f"n{rank}",
                                                                     "data": {}}, addr=f"10.0.0.{rank + 1}")
    api = ApiServer(0, store, Controller(store, tmp_path, providers={}).handlers)
    api.start()
    yield api, store, job
    api.shutdown()
    api.server_close()


def agent(api, job, node="n0") -> ControllerClient:
    return ControllerClient(api.url, agent_token(job.token, node), job.id)


def sdk(api, job) -> ControllerClient:
    return ControllerClient(api.url, sdk_token(job.token), job.id)


def raw(api, request: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes, return the whole answer (the server closes the connection or answers one request)."""
    with socket.create_connection(api.server_address, timeout=timeout) as conn:
        conn.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


TELEMETRY = {"rank": 0, "attempt": 1, "records": [{"step": 0, "at": 1.0, "step_time": 0.1, "metrics": {"loss": 1.0}}]}


def test_listens_on_loopback_only(server):
    api, _, _ = server
    assert api.server_address[0] == "127.0.0.1"


def test_request_without_or_with_wrong_token_is_refused(server):
    api, store, job = server
    for token in ("", "wrong", "the-secret", agent_token(job.token, "n0")):   # the job's own secret opens nothing
        with pytest.raises(ControllerRejected, match="401"):
            ControllerClient(api.url, token, job.id).post("/telemetry", TELEMETRY)
    assert store.steps(job.id) == []
    sdk(api, job).post("/telemetry", TELEMETRY)
    assert [r["step"] for r in store.steps(job.id)] == [0]


def test_tokens_are_scoped_to_their_routes_and_nodes(server):
    api, store, job = server
    with pytest.raises(ControllerRejected, match="401"):   # a worker cannot speak for a node
        sdk(api, job).post("/nodes/n0/heartbeat", {"state": "ready", "addr": "6.6.6.6"})
    with pytest.raises(ControllerRejected, match="401"):   # nor write the job log
        sdk(api, job).post("/nodes/n0/logs", {"lines": ["[tfsn] job 1 succeeded"]})
    with pytest.raises(ControllerRejected, match="401"):   # node 1 cannot move rank 0's rendezvous address
        agent(api, job, "n1").post("/nodes/n0/heartbeat", {"state": "ready", "addr": "6.6.6.6"})
    with pytest.raises(ControllerRejected, match="401"):   # an agent cannot record checkpoints
        agent(api, job).post("/checkpoint", {"step": 1, "path": "/ckpt/step-1"})
    assert store.node("n0").addr == "10.0.0.1"
    agent(api, job, "n1").post("/nodes/n1/heartbeat", {"state": "ready", "addr": "10.0.0.9"})
    assert store.node("n1").addr == "10.0.0.9"


def test_another_jobs_tokens_do_not_open_this_job(server):
    api, store, job = server
    other = store.create_job("o", job.spec, "p", "other-secret")
    with pytest.raises(ControllerRejected, match="401"):
        ControllerClient(api.url, sdk_token(other.token), job.id).post("/telemetry", TELEMETRY)


def test_an_unknown_job_and_a_wrong_token_get_the_same_answer(server):
    api, _, job = server
    answers = [raw(api, f"POST /v1/jobs/{j}/telemetry HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                        f"Content-Length: 2\r\n\r\n{{}}".encode()) for j in (job.id, 999, 123456789012345678)]
    assert {status(a) for a in answers} == {401}
    assert len({a.split(b"\r\n\r\n", 1)[1] for a in answers}) == 1


def test_a_huge_job_id_is_a_404_not_a_dropped_connection(server):
    api, _, _ = server
    answer = raw(api, b"POST /v1/jobs/99999999999999999999/telemetry HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert status(answer) == 404


def test_the_body_is_not_read_before_the_token_is_checked(server):
    api, _, job = server
    with socket.create_connection(api.server_address, timeout=5) as conn:   # announces 8 MiB, sends none
        conn.sendall(f"POST /v1/jobs/{job.id}/telemetry HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                     f"Content-Length: {8 << 20}\r\n\r\n".encode())
        assert b" 401 " in conn.recv(200)


def test_bodies_over_the_routes_cap_are_refused_before_reading(server):
    api, _, job = server
    token = agent_token(job.token, "n0")
    for length in (-1, 16 * 1024 + 1):
        answer = raw(api, f"POST /v1/jobs/{job.id}/nodes/n0/heartbeat HTTP/1.1\r\nHost: x\r\n"
                          f"Authorization: Bearer {token}\r\nContent-Length: {length}\r\n\r\n".encode())
        assert status(answer) == 413
    answer = raw(api, f"POST /v1/jobs/{job.id}/nodes/n0/heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{token}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode())
    assert status(answer) == 411


def test_a_client_that_never_sends_its_body_is_dropped_and_others_are_served(server, monkeypatch):
    api, store, job = server
    monkeypatch.setattr(api_module._RequestHandler, "timeout", 3.0)
    token = sdk_token(job.token)
    silent = [socket.create_connection(api.server_address) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        for conn in silent:
            conn.sendall(f"POST /v1/jobs/{job.id}/telemetry HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                         "Content-Length: 100\r\n\r\n".encode())
        start = time.monotonic()   # every thread is taken: a new client is told so at once, not held
        with pytest.raises(ControllerUnavailable, match="503|reset|closed|refused|Remote end|Broken pipe"):
            sdk(api, job).post("/telemetry", TELEMETRY, timeout=5)
        assert time.monotonic() - start < 2
        deadline = time.monotonic() + 10   # the silent ones time out and free their threads
        while True:
            try:
                sdk(api, job).post("/telemetry", TELEMETRY, timeout=5)
                break
            except ControllerUnavailable:
                assert time.monotonic() < deadline, "the server never recovered from silent clients"
                time.sleep(0.2)
    finally:
        for conn in silent:
            conn.close()


def test_heartbeats_never_carry_the_command_or_its_secrets(server):
    api, store, job = server
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING, "", attempt=1, attempt_state="running", master_port=29500)
    answer = agent(api, job).post("/nodes/n0/heartbeat", {"state": "ready"})
    assert answer == {"action": "run", "attempt": 1}
    command = agent(api, job).post("/nodes/n0/attempt", {"attempt": 1})
    assert command["run"] == "python train.py" and command["env"]["API_KEY"] == SECRET_ENV
    assert command["env"]["TFSN_TOKEN"] == sdk_token(job.token)   # the workers get the narrower token
    assert agent(api, job).post("/nodes/n0/attempt", {"attempt": 2}) == {"action": "run", "attempt": 1}


def test_an_ended_job_takes_no_more_writes(server):
    api, store, job = server
    store.transition(job.id, JobState.STOPPED, "stopped by the user")
    for client, path, body in ((sdk(api, job), "/telemetry", TELEMETRY),
                               (sdk(api, job), "/checkpoint", {"step": 9, "path": "/ckpt/step-9"}),
                               (agent(api, job), "/nodes/n0/result", {"attempt": 1, "returncode": 0})):
        with pytest.raises(ControllerRejected, match="409"):
            client.post(path, body)
    assert store.job(job.id).checkpoint_step is None and store.steps(job.id) == []
    assert agent(api, job).post("/nodes/n0/heartbeat", {"state": "ready", "addr": "6.6.6.6"}) == {"action": "exit"}
    assert store.node("n0").addr == "10.0.0.1"
    agent(api, job).post("/nodes/n0/logs", {"lines": ["last words"]})   # an agent's last lines still arrive


def test_a_node_cannot_forge_the_controllers_lines(server, tmp_path):
    api, _, job = server
    agent(api, job).post("/nodes/n0/logs", {"lines": ["[tfsn] job 1 succeeded", "[tfsn] node n0: starting"]})
    log = (tmp_path / "jobs" / str(job.id) / "job.log").read_text().splitlines()
    assert log == ["[node n0] [tfsn] job 1 succeeded", "[tfsn] node n0: starting"]


def test_a_checkpoint_outside_the_jobs_directory_is_refused(server):
    api, store, job = server
    for path in ("/etc/passwd", "/ckpt/../etc", "/ckptx/step-1", "relative/step-1"):
        with pytest.raises(ControllerRejected, match="400"):
            sdk(api, job).post("/checkpoint", {"step": 1, "path": path})
    sdk(api, job).post("/checkpoint", {"step": 1, "path": "/ckpt/step-1"})
    assert store.job(job.id).checkpoint_path == "/ckpt/step-1"


def test_unreachable_controller_is_unavailable_not_rejected():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ControllerUnavailable):
        ControllerClient(f"http://127.0.0.1:{port}", "t", 1, timeout=1).post("/telemetry", {})


_PATHS = ["/v1/jobs/{job}/telemetry", "/v1/jobs/{job}/checkpoint", "/v1/jobs/{job}/nodes/{node}/heartbeat",
          "/v1/jobs/{job}/nodes/{node}/attempt", "/v1/jobs/{job}/nodes/{node}/result",
          "/v1/jobs/{job}/nodes/{node}/samples", "/v1/jobs/{job}/nodes/{node}/logs"]
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                   max_size=4), max_leaves=12)
_fields = st.sampled_from(["state", "addr", "attempt", "returncode", "signal", "lines", "records", "rank", "step",
                           "path", "samples", "heartbeat", "at", "step_time", "summary", "stopped"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(_PATHS), job_part=st.sampled_from(["{id}", "0", "99999999999999999999", "-1", "x"]),
       node=st.sampled_from(["n0", "n1", "ghost", "a" * 300, "../n0"]),
       body=st.one_of(_json, st.dictionaries(_fields, _json, max_size=6)),
       token=st.sampled_from(["agent", "sdk", "none", "secret"]), garbage=st.binary(max_size=40))
def test_any_request_gets_a_json_4xx_or_200_never_a_crash(server, path, job_part, node, body, token, garbage):
    api, store, job = server
    target = path.format(job=job_part.format(id=job.id), node=node)
    credential = {"agent": agent_token(job.token, node), "sdk": sdk_token(job.token), "none": "",
                  "secret": job.token}[token]
    payload = garbage if garbage.startswith(b"\xff") else json.dumps(body).encode()
    answer = raw(api, f"POST {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {credential}\r\n"
                      f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    assert answer, f"{target}: the connection was dropped"
    code = status(answer)
    assert code in (200, 400, 401, 404, 409, 413), (target, body, answer[:300])
    json.loads(answer.split(b"\r\n\r\n", 1)[1])   # JSON, not a traceback
    assert sdk(api, job).post("/telemetry", TELEMETRY) == {}   # still serving


def test_a_preexisting_home_and_its_files_are_made_private(tmp_path, monkeypatch):
    from orchestrator.home import job_dir, private_open, tfsn_home
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    monkeypatch.setenv("TFSN_HOME", str(home))
    (home / "tfsn.db").touch(mode=0o644)
    assert tfsn_home() == home and home.stat().st_mode & 0o777 == 0o700
    store = Store(home / "tfsn.db")
    store.create_job("t", {}, "p", "s")
    with private_open(job_dir(1, home) / "job.log") as log:
        log.write("x\n")
    for path in [home / "tfsn.db", *home.glob("tfsn.db-*"), job_dir(1, home) / "job.log"]:
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert job_dir(1, home).stat().st_mode & 0o777 == 0o700


def test_a_client_that_trickles_its_request_is_cut_at_the_deadline_and_one_address_cannot_take_every_slot(
        server, monkeypatch):
    api, _, job = server
    monkeypatch.setattr(api_module, "REQUEST_DEADLINE_S", 2.0)
    trickler = socket.create_connection(api.server_address)
    hogs = [socket.create_connection(api.server_address) for _ in range(api_module.MAX_PER_CLIENT - 1)]
    try:
        start = time.monotonic()
        while time.monotonic() - start < 6:   # a byte every half second: no read ever times out
            try:
                trickler.sendall(b"P")
            except OSError:
                break
            time.sleep(0.5)
        assert time.monotonic() - start < 5, "a trickling client kept its connection past the deadline"
        busy = raw(api, f"POST /v1/jobs/{job.id}/telemetry HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status(busy) in (401, 503)   # the hogs' slots were freed at their deadline, or still held
        with socket.create_connection(api.server_address, source_address=("127.0.0.2", 0), timeout=5) as other:
            other.sendall(f"POST /v1/jobs/{job.id}/telemetry HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
            assert b" 401 " in other.recv(200)   # another address is served meanwhile
    finally:
        for conn in [trickler, *hogs]:
            conn.close()


def test_one_request_per_connection(server):
    api, _, job = server
    with socket.create_connection(api.server_address, timeout=5) as conn:   # two requests, pipelined
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
        answers = b""
        while chunk := conn.recv(4096):
            answers += chunk
    assert answers.count(b"HTTP/1.1 200") == 1 and b"Connection: close" in answers


def test_a_node_cannot_start_a_line_of_the_log_with_a_line_break_or_a_control_sequence(server, tmp_path):
    api, store, job = server
    agent(api, job).post("/nodes/n0/logs", {"lines": ["hi\n[tfsn] job 1 SUCCEEDED", "\r[tfsn] x", "\x1b[2K[tfsn] y",
                                                      "a\u2028[tfsn] z", "\x1b[32mgreen\x1b[0m"]})
    log = (tmp_path / "jobs" / str(job.id) / "job.log").read_text().split("\n")[:-1]
    assert log == ["[node n0] hi\\n[tfsn] job 1 SUCCEEDED", "[node n0] \\r[tfsn] x", "[node n0] \\x1b[2K[tfsn] y",
                   "[node n0] a\\u2028[tfsn] z", "\x1b[32mgreen\x1b[0m"]
    with pytest.raises(ControllerRejected, match="400"):
        sdk(api, job).post("/checkpoint", {"step": 5, "path": "/ckpt/step-5\n[tfsn] job 1 SUCCEEDED"})


def test_spares_and_failed_nodes_cannot_end_an_attempt(server):
    api, store, job = server
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING, "", attempt=1, attempt_state="running", master_port=29500)
    store.add_node("spare", job.id, None, "local", offer=None, spot=False)
    store.update_node("spare", state=NodeState.READY)
    for attempt in (1, 2):
        with pytest.raises(ControllerRejected, match="400"):
            agent(api, job, "spare").post("/nodes/spare/result", {"attempt": attempt, "returncode": 1})
    agent(api, job, "spare").post("/nodes/spare/result", {"attempt": 0, "returncode": 0})   # its setup ended
    with pytest.raises(ControllerRejected, match="400"):   # nor a ranked node an attempt not yet started
        agent(api, job, "n1").post("/nodes/n1/result", {"attempt": 2, "returncode": 1})
    store.update_node("n1", state=NodeState.FAILED)
    assert agent(api, job, "n1").post("/nodes/n1/heartbeat", {"addr": "6.6.6.6"}) == {"action": "exit"}
    assert store.node("n1").addr == "10.0.0.2" and store.results(job.id, 1) == []


def test_gpu_samples_are_typed_and_bounded(server):
    api, _, job = server
    for sample in ({"time": 1, "gpu": "x"}, {"time": 1, "gpu": 10**6}, {"time": 1, "xid": float("inf")},
                   {"time": 1, "bogus": 1}):
        body = json.dumps({"samples": [sample]})
        answer = raw(api, f"POST /v1/jobs/{job.id}/nodes/n0/samples HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                          f"{agent_token(job.token, 'n0')}\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        assert status(answer) == 400, sample


def test_deep_json_and_unknown_methods_get_json_4xx(server):
    api, _, job = server
    body = "[" * 20000 + "]" * 20000
    answer = raw(api, f"POST /v1/jobs/{job.id}/nodes/n0/logs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{agent_token(job.token, 'n0')}\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    assert status(answer) == 400
    for method in ("HEAD", "TRACE", "BREW"):
        answer = raw(api, f"{method} /healthz HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status(answer) == 405, method
    json.loads(raw(api, b"BREW /healthz HTTP/1.1\r\nHost: x\r\n\r\n").split(b"\r\n\r\n", 1)[1])


def test_an_api_advertised_beyond_loopback_serves_tls_even_when_bound_to_it(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    api = ApiServer(0, store, Controller(store, tmp_path, providers={}).handlers, advertise="203.0.113.5",
                    home=tmp_path)
    try:
        assert api.url.startswith("https://203.0.113.5:") and api.trust
    finally:
        api.server_close()


def test_a_local_controller_is_reached_without_the_users_proxy(server):
    """In a fresh process (urllib keeps the first opener it builds, with the proxies of that moment)."""
    api, _, job = server
    code = ("import sys; from orchestrator.sdk.client import ControllerClient as C; "
            f"print(C({api.url!r}, {sdk_token(job.token)!r}, {job.id}).post('/telemetry', {TELEMETRY!r}))")
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    env.update(HTTP_PROXY="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9")   # nothing listens there
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "{}", out.stderr[-500:]


def test_a_node_that_floods_the_log_cannot_fill_the_disk(server, tmp_path, monkeypatch):
    from orchestrator.control import handlers
    api, store, job = server
    monkeypatch.setattr(handlers, "MAX_JOB_LOG_BYTES", 1000)
    for _ in range(5):
        agent(api, job).post("/nodes/n0/logs", {"lines": ["x" * 400]})
    log = tmp_path / "jobs" / str(job.id) / "job.log"
    assert log.stat().st_size < 2000 and "nodes' lines are dropped" in log.read_text()
    assert sum("nodes' lines are dropped" in e.message for e in store.events(job.id)) == 1   # said once


def test_colour_codes_or_concealed_text_cannot_hide_a_forged_line(server, tmp_path):
    api, _, job = server
    lines = ["\x1b[m[tfsn] job 1 succeeded", "\x1b[8mx\x1b[0m[tfsn] job 1 done", "\x1b[32mgreen\x1b[0m"]
    agent(api, job).post("/nodes/n0/logs", {"lines": lines})
    log = (tmp_path / "jobs" / str(job.id) / "job.log").read_text().split("\n")[:-1]
    assert [line.startswith("[node n0] ") for line in log] == [True, True, False]


def test_a_late_result_of_an_earlier_attempt_is_taken_and_ignored(server):
    """After a restart, a node whose stop took long still reports attempt 1: its agent must not be refused
    (it would exit and cost the new attempt)."""
    api, store, job = server
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING, "", attempt=2, attempt_state="running", master_port=29500)
    assert agent(api, job, "n1").post("/nodes/n1/result", {"attempt": 1, "returncode": -15, "stopped": True}) == {}
    assert store.results(job.id, 1) == []
    store.update_node("n1", state=NodeState.FAILED)   # failed meanwhile: its own result still says why
    agent(api, job, "n1").post("/nodes/n1/result", {"attempt": 2, "returncode": 1, "summary": "killed"})
    assert [r.summary for r in store.results(job.id, 2)] == ["killed"]


def test_a_busy_tls_controller_closes_extra_connections_without_waiting_for_their_handshake(tmp_path, monkeypatch):
    store = Store(tmp_path / "tfsn.db")
    api = ApiServer(0, store, Controller(store, tmp_path, providers={}).handlers, advertise="203.0.113.5",
                    home=tmp_path)
    api.start()
    silent = [socket.create_connection(api.server_address) for _ in range(api_module.MAX_PER_CLIENT + 8)]
    try:
        time.sleep(0.5)
        start = time.monotonic()
        with socket.create_connection(api.server_address, source_address=("127.0.0.2", 0), timeout=10) as other:
            context = ssl.create_default_context(cadata=api.authority.ca_pem)
            context.check_hostname = False
            with context.wrap_socket(other) as conn:
                conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert b" 200 " in conn.recv(200)
        assert time.monotonic() - start < 2, "silent clients of one address stalled the accept loop"
    finally:
        for conn in silent:
            conn.close()
        api.shutdown()
        api.server_close()


def test_the_agents_log_batches_fit_the_routes_cap(server, tmp_path):
    """600 lines of 16,000 characters (9.6 MB) reach the log in several posts: one post was a 413, retried
    for ever, and the node's log stuck."""
    from orchestrator.agent.node import LogShipper
    api, _, job = server
    shipper = LogShipper(agent(api, job), "n0")
    for i in range(600):
        shipper.add(f"{i:04d}" + "x" * 15_996)
    deadline = time.monotonic() + 60
    log = tmp_path / "jobs" / str(job.id) / "job.log"
    while not (log.exists() and log.read_text().count("\n") == 600):
        assert time.monotonic() < deadline, "the node's lines never all reached the log"
        time.sleep(0.2)


def test_a_client_that_vanishes_mid_request_is_not_logged_as_a_bug(server, capsys):
    """A VM torn down, an agent killed: its connection is reset while the server reads or answers it."""
    api, store, job = server
    token = agent_token(job.token, "n0")
    body = json.dumps({"state": "ready"})
    for _ in range(20):
        conn = socket.create_connection(api.server_address, timeout=5)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close = a reset
        conn.sendall(f"POST /v1/jobs/{job.id}/nodes/n0/heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     f"{token}\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        conn.close()
    time.sleep(1.0)
    agent(api, job).post("/nodes/n0/heartbeat", {"state": "ready"})   # served on as before
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err, printed.out + printed.err


def test_a_restart_that_restores_nothing_is_said_not_taken_for_a_resume(server, tmp_path, monkeypatch):
    """A job restarted 'from the checkpoint at step 10' whose checkpoints were all corrupt trained from step 0 with
    nothing in the job's log but the workers' warnings: the controller now says what was restored, and warns when
    it is not the last checkpoint the job saved."""
    import torch

    from orchestrator.sdk.run import Run
    api, store, _ = server
    root = tmp_path / "ckpt"
    spec = JobSpec.model_validate({"name": "r", "run": "x", "checkpoint": {"dir": str(root)}})
    job = store.create_job("r", spec.model_dump(mode="json"), "p", "r-secret")
    sdk(api, job).post("/checkpoint", {"step": 10, "path": f"{root}/step_000000010"})   # the last save heard of
    for name, value in {"TFSN_CONTROLLER_URL": api.url, "TFSN_TOKEN": sdk_token(job.token),
                        "TFSN_JOB_ID": str(job.id)}.items():
        monkeypatch.setenv(name, value)
    run = Run(checkpoint_dir=str(root), checkpoint_interval=5, keep=2, total_steps=5)   # nothing readable there
    assert run.restore(model=torch.nn.Linear(2, 2)) == 0
    run.finish()
    said = [e.message for e in store.events(job.id) if e.kind == "checkpoint"][-1]
    assert said == (f"no checkpoint to restore in {root}: training starts at step 0; WARNING: the last checkpoint "
                    f"saved was step 10 ({root}/step_000000010), and it could not be restored (the workers' "
                    "warnings say why)")
    assert store.job(job.id).restored_step == 0
    with pytest.raises(ControllerRejected, match="400"):      # only its own folder, and only as 'nothing restored'
        sdk(api, job).post("/checkpoint", {"step": 0, "path": "/etc", "restored": True})
    with pytest.raises(ControllerRejected, match="400"):
        sdk(api, job).post("/checkpoint", {"step": 3, "path": str(root)})


def test_a_restore_that_skips_a_corrupt_checkpoint_says_which_and_why_in_the_jobs_events(server, tmp_path,
                                                                                        monkeypatch, capfd):
    """A corrupt newest checkpoint was skipped with a Python warning in the workers' output ('.../run.py:308:
    UserWarning: skipping checkpoint: ...' and the source line under it) and the job's event said only 'restored
    step 6': the event now names the checkpoint passed over and why, and the worker says it in one line."""
    import torch

    from orchestrator.sdk.run import Run
    api, store, _ = server
    root = tmp_path / "ckpt"
    spec = JobSpec.model_validate({"name": "r", "run": "x", "checkpoint": {"dir": str(root)}})
    job = store.create_job("r", spec.model_dump(mode="json"), "p", "r-secret")
    for name, value in {"TFSN_CONTROLLER_URL": api.url, "TFSN_TOKEN": sdk_token(job.token),
                        "TFSN_JOB_ID": str(job.id)}.items():
        monkeypatch.setenv(name, value)
    model = torch.nn.Linear(2, 2)
    run = Run(checkpoint_dir=str(root), checkpoint_interval=2, keep=3, total_steps=4)
    for _ in run.steps(run.restore(model=model)):
        run.checkpoint(model=model)
    run.finish()
    shard = next((root / "step_000000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0" if shard.read_bytes()[-1:] != b"\0" else b"\1")
    run = Run(checkpoint_dir=str(root), checkpoint_interval=2, keep=3, total_steps=4)
    assert run.restore(model=model) == 2
    run.finish()
    said = [e.message for e in store.events(job.id) if e.kind == "checkpoint"][-1]
    assert said.startswith(f"restored step 2 from {root}/step_000000002; WARNING: the last checkpoint saved was "
                           "step 4"), said
    assert said.endswith(f"could not be restored; skipped 1 newer: {root}/step_000000004: checksum mismatch in "
                         f"{shard.name}; the checkpoint is corrupt"), said
    err = capfd.readouterr().err
    assert "UserWarning" not in err and f"tfsn: skipping checkpoint: {root}/step_000000004: checksum mismatch" in err
