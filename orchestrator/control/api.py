"""The controller's HTTP API: what agents and the SDK call, on 127.0.0.1 unless TFSN_API_HOST opens it.

Routing, size limits and the per-job secret token live here; what a request means is the
controller's business (`Handlers`). A request without the job's token is refused with 401.
"""
from __future__ import annotations

import hmac
import json
import os
import re
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Protocol

from orchestrator.sdk.client import TOKEN_HEADER
from orchestrator.control import tls
from orchestrator.control.store import Store, StoreError

MAX_BODY_BYTES = 8 * 1024 * 1024


class Handlers(Protocol):
    """The controller's side of each endpoint; each returns the JSON answer."""

    def heartbeat(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def result(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def samples(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def logs(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]: ...
    def telemetry(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]: ...
    def checkpoint(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]: ...


_ROUTES: list[tuple[re.Pattern[str], Callable[[Handlers, int, dict[str, str], dict[str, Any]], dict[str, Any]]]] = [
    (re.compile(r"/v1/jobs/(?P<job>\d+)/nodes/(?P<node>[\w.-]+)/heartbeat"),
     lambda h, job, m, body: h.heartbeat(job, m["node"], body)),
    (re.compile(r"/v1/jobs/(?P<job>\d+)/nodes/(?P<node>[\w.-]+)/result"),
     lambda h, job, m, body: h.result(job, m["node"], body)),
    (re.compile(r"/v1/jobs/(?P<job>\d+)/nodes/(?P<node>[\w.-]+)/samples"),
     lambda h, job, m, body: h.samples(job, m["node"], body)),
    (re.compile(r"/v1/jobs/(?P<job>\d+)/logs"), lambda h, job, m, body: h.logs(job, body)),
    (re.compile(r"/v1/jobs/(?P<job>\d+)/telemetry"), lambda h, job, m, body: h.telemetry(job, body)),
    (re.compile(r"/v1/jobs/(?P<job>\d+)/checkpoint"), lambda h, job, m, body: h.checkpoint(job, body)),
]


class ApiServer(ThreadingHTTPServer):
    """The API on `host`: plain HTTP on loopback; elsewhere TLS with a certificate of the CA in `home`
    (required there), which the nodes are given (`trust`) and pin."""

    daemon_threads = True
    allow_reuse_address = True  # a restarted controller takes its old port back at once
    handshake_timeout_s = 10.0  # a client that opens a connection and says nothing holds its thread this long

    def __init__(self, port: int, store: Store, handlers: Handlers, host: str = "127.0.0.1",
                 advertise: str = "", home: Path | None = None) -> None:
        self.authority: tls.Authority | None = None
        if tls.serves_tls(host):
            if home is None:
                raise ValueError(f"an API on {host} serves TLS and needs the folder of its CA: pass `home`")
            self.authority = tls.ensure_authority(home, tls.server_names(host, advertise))
        super().__init__((host, port), _RequestHandler)
        if self.authority is not None:
            # The handshake is done in the request's thread (finish_request): never in the accept loop.
            self.socket = self.authority.server_context.wrap_socket(self.socket, server_side=True,
                                                                     do_handshake_on_connect=False)
        self.store = store
        self.handlers = handlers
        self.advertise = advertise   # the address nodes reach this server at, when not the bound one

    @property
    def url(self) -> str:
        scheme = "https" if self.authority is not None else "http"
        return f"{scheme}://{self.advertise or self.server_address[0]}:{self.server_address[1]}"

    @property
    def trust(self) -> dict[str, str]:
        """The environment a node needs to trust this server (the CA and its fingerprint); none on loopback."""
        return self.authority.node_env() if self.authority is not None else {}

    def finish_request(self, request: socket.socket, client_address: Any) -> None:
        """TLS handshake first: a client that does not speak TLS, or does not trust this CA, gets nothing."""
        if isinstance(request, ssl.SSLSocket):
            request.settimeout(self.handshake_timeout_s)
            try:
                request.do_handshake()
            except OSError:   # plain HTTP, a port scanner, a timeout: the connection is closed
                return
            request.settimeout(None)
        super().finish_request(request, client_address)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="tfsn-api", daemon=True)
        thread.start()
        return thread


class _RequestHandler(BaseHTTPRequestHandler):
    server: ApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: agents poll every second
        pass

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._reply(200, {"ok": True, "pid": os.getpid()})
        else:
            self._reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        for pattern, call in _ROUTES:
            match = pattern.fullmatch(self.path)
            if match:
                break
        else:
            self._reply(404, {"error": "not found"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self._reply(413, {"error": f"Content-Length must be 0 to {MAX_BODY_BYTES} bytes"})
            self.close_connection = True
            return
        raw = self.rfile.read(length)
        job_id = int(match["job"])
        try:
            token = self.server.store.job(job_id).token
        except StoreError:
            self._reply(404, {"error": f"no job {job_id}"})
            return
        given = self.headers.get(TOKEN_HEADER, "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            self._reply(401, {"error": "missing or wrong job token"})
            return
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as err:
            self._reply(400, {"error": f"bad JSON: {err}"})
            return
        try:
            self._reply(200, call(self.server.handlers, job_id, match.groupdict(), body))
        except (KeyError, TypeError, ValueError, StoreError) as err:
            self._reply(400, {"error": f"bad request: {err!r}"})
