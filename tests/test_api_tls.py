"""The controller's API beyond loopback: TLS with the controller's own CA, which clients pin.

Real sockets and real TLS throughout: the server binds 0.0.0.0 (so it serves TLS) and the tests reach it
on 127.0.0.1, which its certificate covers.
"""
from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from orchestrator.control import tls
from orchestrator.control.api import ApiServer
from orchestrator.control.controller import Controller
from orchestrator.control.credentials import agent_token
from orchestrator.control.provisioning import agent_env
from orchestrator.control.store import Job, JobState, NodeState, Store
from orchestrator.sdk.client import (CA_FINGERPRINT_ENV, CA_PEM_ENV, ControllerClient, ControllerRejected,
                                     ControllerUnavailable, ControllerUntrusted, fingerprint)
from orchestrator.spec import JobSpec
from providers.base import NodeRequest
from providers.bootstrap import startup_script
from providers.local import LocalProvider

SECRET = "sk-planted-9f8e7d6c5b4a"          # an API key in the job's envs
RUN = "python train.py --wandb-project never-on-the-wire"


def serve(home: Path, store: Store, advertise: str = "") -> ApiServer:
    controller = Controller(store, home, {"local": LocalProvider()})
    server = ApiServer(0, store, controller.handlers, host="0.0.0.0", advertise=advertise, home=home)
    controller.listen(server)
    server.start()
    return server


def running_job(store: Store) -> Job:
    """A job with a secret in its envs, RUNNING on node n0: n0's heartbeat is answered with the run command."""
    spec = JobSpec.model_validate({"name": "t", "run": RUN, "envs": {"WANDB_API_KEY": SECRET}})
    job = store.create_job("t", spec.model_dump(mode="json"), "p", "the-secret")
    store.add_node("n0", job.id, 0, "local")
    store.update_node("n0", state=NodeState.READY)
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING, attempt=1, attempt_state="running", master_port=29500)
    return store.job(job.id)


@pytest.fixture
def api(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    job = running_job(store)
    server = serve(tmp_path, store)
    yield server, store, job
    server.shutdown()
    server.server_close()


def local_url(server: ApiServer, port: int | None = None) -> str:
    return f"https://127.0.0.1:{port or server.server_address[1]}"


def pinned(server: ApiServer, job_id: int, url: str = "", **trust: str) -> ControllerClient:
    trust = trust or {"ca_pem": server.authority.ca_pem, "ca_fingerprint": server.authority.fingerprint}
    return ControllerClient(url or local_url(server), agent_token("the-secret", "n0"), job_id, timeout=5, **trust)


def test_beyond_loopback_the_api_serves_https_to_a_client_pinned_to_its_ca(api, tmp_path, monkeypatch):
    server, store, job = api
    assert server.url == f"https://0.0.0.0:{server.server_address[1]}"
    assert pinned(server, job.id).post("/nodes/n0/logs", {"lines": ["over tls"]}) == {}
    assert "over tls" in (tmp_path / "jobs" / str(job.id) / "job.log").read_text()
    # an agent (and the SDK in its workers) gets the same trust through its environment
    env = agent_env(local_url(server), job, "n0", local=False, trust=server.trust)
    assert env[CA_FINGERPRINT_ENV] == fingerprint(env[CA_PEM_ENV]) == server.authority.fingerprint
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ControllerClient.from_env().post("/nodes/n0/logs", {"lines": ["from the environment"]}) == {}


def test_a_client_that_trusts_another_ca_is_refused_before_it_sends_anything(api, tmp_path):
    server, _, job = api
    other = tls.ensure_authority(tmp_path / "other", ["127.0.0.1"])
    log = tmp_path / "jobs" / str(job.id) / "job.log"
    cases = {
        "pinned to another CA's fingerprint": dict(ca_pem=server.authority.ca_pem, ca_fingerprint=other.fingerprint),
        "trusting another CA": dict(ca_pem=other.ca_pem, ca_fingerprint=other.fingerprint),
        "with no CA at all": dict(ca_pem="", ca_fingerprint=server.authority.fingerprint),
    }
    for case, trust in cases.items():
        with pytest.raises(ControllerUntrusted, match="To fix") as refused:
            pinned(server, job.id, **trust).post("/nodes/n0/logs", {"lines": [f"sent {case}"]})
        assert isinstance(refused.value, ControllerRejected), case   # agents stop: retrying cannot help
    assert not log.exists() or "sent" not in log.read_text()


def test_plain_http_gets_no_answer(api):
    server, _, job = api
    port = server.server_address[1]
    with pytest.raises(ControllerUnavailable):
        ControllerClient(f"http://127.0.0.1:{port}", agent_token("the-secret", "n0"), job.id, timeout=5).post(
            "/nodes/n0/logs", {"lines": []})
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(f"POST /v1/jobs/{job.id}/logs HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode())
        try:
            answer = conn.recv(4096)   # a TLS alert at most
        except ConnectionResetError:
            answer = b""
        assert b"HTTP/" not in answer
    assert pinned(server, job.id).post("/nodes/n0/logs", {"lines": ["still serving"]}) == {}


def test_a_client_that_never_says_a_word_holds_up_no_one(api):
    server, _, job = api
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5):   # no handshake
        started = time.monotonic()
        assert pinned(server, job.id).post("/nodes/n0/logs", {"lines": ["meanwhile"]}) == {}
        assert time.monotonic() - started < 3


def test_the_ca_survives_a_restart_and_a_new_address_gets_a_new_certificate_of_the_same_ca(tmp_path):
    from cryptography import x509

    store = Store(tmp_path / "tfsn.db")
    job = running_job(store)
    first = serve(tmp_path, store, advertise="node-a.example")
    fingerprint, trust = first.authority.fingerprint, first.trust
    first.shutdown()
    first.server_close()
    second = serve(tmp_path, store, advertise="10.1.2.3")
    try:
        assert second.authority.fingerprint == fingerprint and second.trust == trust
        assert second.url == f"https://10.1.2.3:{second.server_address[1]}"
        cert = x509.load_pem_x509_certificate((tls.folder(tmp_path) / tls.SERVER).read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {str(n) for n in names.get_values_for_type(x509.IPAddress)} == {"10.1.2.3", "0.0.0.0", "127.0.0.1"}
        assert names.get_values_for_type(x509.DNSName) == ["localhost"]   # not node-a.example any more
        # a client that pinned the CA before the restart trusts the new certificate
        client = ControllerClient(local_url(second), agent_token("the-secret", "n0"), job.id, timeout=5,
                                  ca_pem=trust[CA_PEM_ENV], ca_fingerprint=trust[CA_FINGERPRINT_ENV])
        assert client.post("/nodes/n0/logs", {"lines": ["after the restart"]}) == {}
    finally:
        second.shutdown()
        second.server_close()


def test_keys_and_certificates_are_readable_by_their_owner_only(api, tmp_path):
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tls.folder(tmp_path).iterdir() if p.suffix}
    assert files == {tls.CA_KEY: 0o600, tls.CA_CERT: 0o600, tls.SERVER: 0o600}
    assert stat.S_IMODE(tls.folder(tmp_path).stat().st_mode) == 0o700


def test_on_loopback_the_api_stays_plain_http_and_makes_no_ca(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    server = ApiServer(0, store, Controller(store, tmp_path, {}).handlers, home=tmp_path)
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.trust == {}
        assert not tls.folder(tmp_path).exists()
    finally:
        server.server_close()


def test_a_cloud_nodes_boot_script_hands_its_agent_the_ca_and_the_pin_and_nothing_stale(api, monkeypatch):
    server, _, job = api
    monkeypatch.setenv(CA_FINGERPRINT_ENV, "another-controllers-pin")   # e.g. a controller started inside a job
    request = NodeRequest(job_id=str(job.id), node_id="n1", command=["python3", "-m", "orchestrator.agent"],
                          env=agent_env(server.url, job, "n1", local=False, trust=server.trust), workdir="/tmp")
    script = startup_script(request)
    exports = script[script.index("\nexport TFSN_CA_"):script.index("\nexport TFSN_WORKDIR")]   # the PEM spans lines
    shell = subprocess.run(["bash", "-c", f'{exports}\nprintf "%s|%s" "${CA_PEM_ENV}" "${CA_FINGERPRINT_ENV}"'],
                           capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]})
    assert shell.stdout == f"{server.authority.ca_pem}|{server.authority.fingerprint}"
    # a loopback controller's local nodes get no pin at all (plain HTTP), not one left in the environment
    assert CA_FINGERPRINT_ENV not in agent_env("http://127.0.0.1:1", job, "n2", local=True, trust={})


class Tap:
    """A TCP proxy that keeps every byte it forwards, both ways."""

    def __init__(self, port: int) -> None:
        self.target, self.seen = port, bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_the_heartbeat_answer_with_the_run_command_and_its_secrets_is_unreadable_on_the_wire(api):
    server, _, job = api
    tap = Tap(server.server_address[1])
    try:
        client = pinned(server, job.id, url=local_url(server, tap.port))
        assert client.post("/nodes/n0/heartbeat", {"state": "ready"}) == {"action": "run", "attempt": 1}
        command = client.post("/nodes/n0/attempt", {"attempt": 1})
        assert (command["action"], command["run"], command["env"]["WANDB_API_KEY"]) == ("run", RUN, SECRET)
        assert len(tap.seen) > 1000                            # the handshake and the answer went through it
        for plain in (SECRET, "never-on-the-wire", "the-secret", "heartbeat"):
            assert plain.encode() not in tap.seen, plain
    finally:
        tap.listener.close()


def test_a_client_on_plain_http_through_the_same_tap_would_have_leaked_it(tmp_path):
    """The tap sees plain text when there is plain text to see (the test above is not vacuous)."""
    store = Store(tmp_path / "tfsn.db")
    job = running_job(store)
    server = ApiServer(0, store, Controller(store, tmp_path, {"local": LocalProvider()}).handlers)
    server.start()
    tap = Tap(server.server_address[1])
    try:
        command = ControllerClient(f"http://127.0.0.1:{tap.port}", agent_token("the-secret", "n0"), job.id).post(
            "/nodes/n0/attempt", {"attempt": 1})
        assert command["env"]["WANDB_API_KEY"] == SECRET and SECRET.encode() in tap.seen
    finally:
        tap.listener.close()
        server.shutdown()
        server.server_close()


def test_a_half_ca_on_disk_is_refused_not_replaced(tmp_path):
    tls.ensure_authority(tmp_path, ["127.0.0.1"])
    (tls.folder(tmp_path) / tls.CA_KEY).unlink()
    with pytest.raises(tls.AuthorityError, match="To fix"):
        tls.ensure_authority(tmp_path, ["127.0.0.1"])


WORKER = """
import hashlib, os, ssl
from orchestrator.sdk.client import ControllerClient
pem, pin, url = (os.environ[k] for k in ("TFSN_CA_PEM", "TFSN_CA_FINGERPRINT", "TFSN_CONTROLLER_URL"))
assert hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest() == pin
ControllerClient.from_env().post("/telemetry", {"rank": 0, "attempt": int(os.environ["TFSN_ATTEMPT"]), "records": []})
print(f"worker reached {url} pinned to {pin}")
"""


@pytest.mark.e2e
def test_a_local_job_under_a_controller_open_to_the_network_runs_over_pinned_tls(tfsn, tmp_path):
    from tests.conftest import write_job

    (tmp_path / "worker.py").write_text(WORKER)
    spec = write_job(tmp_path / "job.yaml", steps=1, num_nodes=1, run=f"python {tmp_path / 'worker.py'}")
    tfsn.env.update(TFSN_API_HOST="0.0.0.0", TFSN_API_ADVERTISE="127.0.0.1")
    assert "SUCCEEDED" in tfsn("launch", str(spec), timeout=300).stdout   # the agent heartbeats over TLS
    url = json.loads((tfsn.home / "controller.json").read_text())["url"]
    assert url.startswith("https://127.0.0.1:")
    assert f"on {url}" in tfsn("controller", "status").stdout               # the CLI checks it with the CA
    pin = fingerprint((tls.folder(tfsn.home) / tls.CA_CERT).read_text())
    assert f"worker reached {url} pinned to {pin}" in tfsn("logs", "1").stdout
