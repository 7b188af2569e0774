"""The controller's HTTP API: what agents and the SDK call, on 127.0.0.1 unless TFSN_API_HOST opens it.

Routing, credentials, limits and body validation live here; what a request means is the controller's
business (`Handlers`). Every request is authenticated from its headers before its body is read: the
token must be the route's scope (a node's agent, or the job's SDK; see credentials.py), and an unknown
job is refused exactly as a wrong token is (401), so the API tells outsiders nothing. Then its body is
read, within a size cap per route and a socket timeout, and checked against the route's model
(requests.py). A job that ended accepts no writes (409), but for its agents' last log lines and the
heartbeat that tells them to exit. Whatever arrives, the answer is JSON with a 4xx (or a 500 for a bug
of ours, logged), never a dropped connection. The one GET route beside /healthz serves a booting VM the
files of its job (tfsn's wheel, the code archive) by sha256, to that job's nodes only (boot.py).

A connection carries one request and lives REQUEST_DEADLINE_S at most (an authorized download
DOWNLOAD_DEADLINE_S), handshake and all (a reaper
closes it then, however slowly it trickles): beyond MAX_CONNECTIONS at once, or MAX_PER_CLIENT from
one address, a client gets a 503 at once, so one host cannot hold every thread the agents need.
Parsing runs PARSERS bodies at a time, so that bodies of empty objects cannot multiply memory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Protocol

from pydantic import BaseModel, ValidationError

from orchestrator.control import requests, tls
from orchestrator.control.credentials import AGENT, SDK, allows
from orchestrator.control.store import Job, Store, StoreError
from orchestrator.sdk.client import TELEMETRY_BYTES_MAX, TOKEN_HEADER
from providers.bootstrap import ARTIFACTS_ROUTE, BOOT_FAILURE_ROUTE

READ_TIMEOUT_S = 15.0         # a client that stops sending (headers or body) is dropped after this long
REQUEST_DEADLINE_S = 20.0     # and a whole connection, however it trickles, after this long
MAX_CONNECTIONS = 64          # connections served at once; more get a 503 at once (agents retry)
MAX_PER_CLIENT = 16           # of them from one address
PARSERS = threading.BoundedSemaphore(4)   # bodies parsed at once (JSON can take ~40x its size in memory)
DOWNLOAD_DEADLINE_S = 900.0   # a download's connection lives this long (a code archive is up to 100 MiB)
LOG_GRACE_S = 60.0            # an ended job still takes its agents' last log lines this long
UNAUTHORIZED = "missing or wrong token for this job and route"


class Handlers(Protocol):
    """The controller's side of each endpoint; each returns the JSON answer."""

    def heartbeat(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def attempt(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def result(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def samples(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def logs(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def telemetry(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]: ...
    def checkpoint(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]: ...
    def boot_failure(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def artifact(self, job_id: int, node_id: str, digest: str) -> Path: ...


@dataclass(frozen=True)
class Route:
    pattern: re.Pattern[str]
    scope: str                       # whose token opens it: a node's agent, or the job's SDK
    body: type[BaseModel]
    max_bytes: int
    call: Callable[[Handlers, int, dict[str, str], dict[str, Any]], dict[str, Any]]
    when_over: str = ""              # on an ended job: "" refused, "answer" served, "grace" for LOG_GRACE_S


_JOB = r"/v1/jobs/(?P<job>\d{1,18})"
_NODE = _JOB + r"/nodes/(?P<node>[\w.-]{1,253})"
ROUTES = [
    Route(re.compile(_NODE + "/heartbeat"), AGENT, requests.Heartbeat, 16 * 1024,
          lambda h, job, m, body: h.heartbeat(job, m["node"], body), when_over="answer"),
    Route(re.compile(_NODE + "/attempt"), AGENT, requests.AttemptCommand, 1024,
          lambda h, job, m, body: h.attempt(job, m["node"], body)),
    Route(re.compile(_NODE + "/result"), AGENT, requests.Result, 64 * 1024,
          lambda h, job, m, body: h.result(job, m["node"], body)),
    Route(re.compile(_NODE + "/samples"), AGENT, requests.Samples, 1024 * 1024,
          lambda h, job, m, body: h.samples(job, m["node"], body)),
    Route(re.compile(_NODE + "/logs"), AGENT, requests.Logs, 8 * 1024 * 1024,
          lambda h, job, m, body: h.logs(job, m["node"], body), when_over="grace"),
    Route(re.compile(_NODE + "/" + BOOT_FAILURE_ROUTE), AGENT, requests.BootFailure, 64 * 1024,
          lambda h, job, m, body: h.boot_failure(job, m["node"], body), when_over="grace"),
    Route(re.compile(_JOB + "/telemetry"), SDK, requests.Telemetry, TELEMETRY_BYTES_MAX,
          lambda h, job, m, body: h.telemetry(job, body)),
    Route(re.compile(_JOB + "/checkpoint"), SDK, requests.Checkpoint, 16 * 1024,
          lambda h, job, m, body: h.checkpoint(job, body)),
]

# A VM's boot script fetches tfsn's wheel and the job's code here (GET, by sha256, with its agent token).
DOWNLOAD = re.compile(_NODE + "/" + ARTIFACTS_ROUTE + r"/(?P<digest>[0-9a-f]{64})")


class ApiServer(ThreadingHTTPServer):
    """The API on `host`: plain HTTP on loopback; elsewhere TLS with a certificate of the CA in `home`
    (required there), which the nodes are given (`trust`) and pin."""

    daemon_threads = True
    allow_reuse_address = True  # a restarted controller takes its old port back at once
    request_queue_size = 256    # the listen backlog: thousands of agents may reconnect at once
    handshake_timeout_s = 10.0  # a client that opens a connection and says nothing holds its thread this long

    def __init__(self, port: int, store: Store, handlers: Handlers, host: str = "127.0.0.1",
                 advertise: str = "", home: Path | None = None) -> None:
        self.authority: tls.Authority | None = None
        if tls.serves_tls(host) or (advertise and tls.serves_tls(advertise)):   # bound or reached beyond loopback
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
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._open: dict[socket.socket, tuple[float, str]] = {}   # connection -> (deadline, client address)
        self._open_lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._reap, name="tfsn-api-reaper", daemon=True).start()

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

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        """A thread per connection, within MAX_CONNECTIONS and MAX_PER_CLIENT; beyond them a 503."""
        client = str(client_address[0])
        with self._open_lock:
            mine = sum(1 for _, who in self._open.values() if who == client)
            admitted = mine < MAX_PER_CLIENT and self._slots.acquire(blocking=False)
            if admitted:
                self._open[request] = (time.monotonic() + REQUEST_DEADLINE_S, client)
        if not admitted:
            _refuse_busy(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def extend_deadline(self, request: socket.socket, seconds: float) -> None:
        """Give an authorized download more time than a request has (the reaper closes it after that)."""
        with self._open_lock:
            if request in self._open:
                self._open[request] = (time.monotonic() + seconds, self._open[request][1])

    def _release(self, request: socket.socket) -> None:
        with self._open_lock:
            if self._open.pop(request, None) is not None:
                self._slots.release()

    def _reap(self) -> None:
        """Close every connection past its deadline (its thread then ends and frees its slot)."""
        while not self._closed.wait(1.0):
            now = time.monotonic()
            with self._open_lock:
                late = [conn for conn, (deadline, _) in self._open.items() if deadline < now]
            for conn in late:
                try:
                    socket.socket.shutdown(conn, socket.SHUT_RDWR)   # the plain socket's, under any TLS
                except OSError:
                    pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-request (a VM torn down, an agent killed) is no error of ours: nothing to log."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()


def _refuse_busy(request: socket.socket) -> None:
    """A 503 on a plain connection; a TLS one is just closed (writing would wait for its handshake, in the
    accept loop, for as long as a silent client likes)."""
    if isinstance(request, ssl.SSLSocket):
        return
    body = json.dumps({"error": "the controller is busy; try again"}).encode()
    try:
        request.settimeout(1.0)
        request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close"
                        b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    except OSError:
        pass


class _RequestHandler(BaseHTTPRequestHandler):
    server: ApiServer
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S     # socket timeout for every read: request line, headers and body

    def log_message(self, format: str, *args: Any) -> None:  # quiet: agents poll every second
        pass

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        """The JSON answer; the connection ends with it (one request per connection, see the docstring)."""
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a bad request line, headers too long, an unknown method) as JSON;
        a method we do not serve is a 405, not its 501."""
        code = 405 if code == 501 else code
        self._reply(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._reply(200, {"ok": True, "pid": os.getpid()})
            return
        match = DOWNLOAD.fullmatch(self.path)
        if match is None:
            self._reply(404, {"error": "not found"})
            return
        job = self._authorized(int(match["job"]), AGENT, match["node"])
        if job is None:
            self._reply(401, {"error": UNAUTHORIZED})
        elif job.state.terminal:
            self._reply(409, {"error": f"job {job.id} is {job.state.value}: its nodes need no files"})
        else:
            try:
                path = self.server.handlers.artifact(job.id, match["node"], match["digest"])
            except (KeyError, ValueError, StoreError):
                self._reply(404, {"error": "no such file for this node"})
                return
            self._send_file(path)

    def _send_file(self, path: Path) -> None:
        """A file as the answer, streamed, within DOWNLOAD_DEADLINE_S."""
        try:
            data = open(path, "rb")
        except OSError:
            self._reply(404, {"error": "no such file for this node"})
            return
        with data:
            self.server.extend_deadline(self.request, DOWNLOAD_DEADLINE_S)
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(os.fstat(data.fileno()).st_size))
            self.send_header("Connection", "close")
            self.close_connection = True
            self.end_headers()
            try:
                shutil.copyfileobj(data, self.wfile, 1 << 16)
            except OSError:   # the node went away or stalled past READ_TIMEOUT_S: it retries
                pass

    def _not_allowed(self) -> None:
        self._reply(405, {"error": "method not allowed"})

    do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def do_POST(self) -> None:
        match, route = next(((m, r) for r in ROUTES if (m := r.pattern.fullmatch(self.path))), (None, None))
        if route is None:
            self._reply(404, {"error": "not found"})
            return
        job_id = int(match["job"])
        job = self._authorized(job_id, route.scope, match["node"] if route.scope == AGENT else None)
        if job is None:
            self._reply(401, {"error": UNAUTHORIZED})
            return
        if job.state.terminal and not (route.when_over == "answer" or (
                route.when_over == "grace" and time.time() - (job.finished_at or 0) < LOG_GRACE_S)):
            self._reply(409, {"error": f"job {job_id} is {job.state.value}: it takes no more reports"})
            return
        body = self._body(route)
        if body is None:
            return
        if not job.state.terminal and self.server.store.job(job_id).state.terminal and not route.when_over:
            self._reply(409, {"error": f"job {job_id} ended while its report arrived"})   # see the check above
            return
        try:
            answer = route.call(self.server.handlers, job_id, match.groupdict(), body)
        except (KeyError, TypeError, ValueError, StoreError) as err:
            self._reply(400, {"error": f"bad request: {err}"[:500]})
            return
        except Exception:   # a bug of ours: logged, answered, and the server goes on
            print(f"API {self.path}: {traceback.format_exc()}", flush=True)
            self._reply(500, {"error": "internal error (see the controller's log)"})
            return
        self._reply(200, answer)

    def _authorized(self, job_id: int, scope: str, node_id: str | None) -> Job | None:
        """The job, if the request's token is of `scope` (the route's) for it; None for a wrong token or an
        unknown job alike (the same work either way, so that timing tells no more than the status)."""
        given = self.headers.get(TOKEN_HEADER, "").removeprefix("Bearer ").strip()
        try:
            job = self.server.store.job(job_id)
            secret = job.token
        except StoreError:
            job, secret = None, "no such job"
        ok = allows(secret, given, scope, node_id)
        return job if ok and job is not None else None

    def _body(self, route: Route) -> dict[str, Any] | None:
        """The request's body, read within the route's cap and checked against its model; None once an
        error was answered."""
        if self.headers.get("Transfer-Encoding"):
            self._reply(411, {"error": "send a Content-Length (chunked bodies are not accepted)"})
            return None
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= route.max_bytes:
            self._reply(413, {"error": f"Content-Length must be 0 to {route.max_bytes} bytes here"})
            return None
        try:
            raw = self.rfile.read(length)
        except OSError:   # the client went silent (READ_TIMEOUT_S) or away: nobody to answer
            self.close_connection = True
            return None
        if len(raw) < length:
            self.close_connection = True
            return None
        try:
            with PARSERS:
                return route.body.model_validate(json.loads(raw or b"{}")).model_dump(exclude_unset=False)
        except (ValueError, RecursionError) as err:   # json's errors, pydantic's ValidationError, deep nesting
            what = _validation_text(err) if isinstance(err, ValidationError) else f"bad JSON: {err}"
            self._reply(400, {"error": what[:500]})
            return None


def _validation_text(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in err.errors()[:5])
