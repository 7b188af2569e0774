"""A small threaded HTTP(S) server that routes requests to an emulator's handlers.

Shared by the cloud emulators: routing by method and path pattern, JSON bodies, a log of the
requests served, one-shot injected errors, and TLS with a throwaway CA (azure-core refuses to send
bearer tokens over plain http, so the Azure emulator is served over https and the SDK is told to
trust this CA through its own `connection_verify` setting).
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import re
import ssl
import tempfile
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    """One request as a handler sees it."""

    method: str
    path: str
    query: dict[str, str]
    body: Any                 # parsed JSON, or None
    match: re.Match           # the route's match: named groups are path parameters


@dataclass
class Response:
    status: int
    body: Any = None          # serialized as JSON unless None
    headers: dict[str, str] | None = None


@dataclass
class _Fault:
    method: str
    pattern: re.Pattern
    response: Response
    times: int


Handler = Callable[[Request], Response]


class HttpEmulator:
    """Base of an emulator: subclasses register routes in `__init__` with `self.route(...)`."""

    def __init__(self, *, tls: bool = False) -> None:
        self._routes: list[tuple[str, re.Pattern, Handler]] = []
        self._faults: list[_Fault] = []
        self._lock = threading.RLock()
        self.requests: list[tuple[str, str]] = []   # (method, path) of every request served
        self._tls_dir = tempfile.TemporaryDirectory(prefix="tfsn-emulator-") if tls else None
        self.ca_path: str | None = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        if self._tls_dir is not None:
            self.ca_path, cert, key = _make_certificates(Path(self._tls_dir.name))
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{'https' if self._tls_dir else 'http'}://{host}:{port}"

    def route(self, method: str, pattern: str, handler: Handler) -> None:
        self._routes.append((method, re.compile(pattern), handler))

    def fail_next(self, method: str, pattern: str, status: int, body: Any = None, *, times: int = 1,
                  headers: dict[str, str] | None = None) -> None:
        """Answer the next `times` requests whose path matches `pattern` with this error instead."""
        with self._lock:
            self._faults.append(_Fault(method, re.compile(pattern), Response(status, body, headers), times))

    def count(self, method: str, pattern: str) -> int:
        """How many requests served so far match (for asserting what the driver called)."""
        regex = re.compile(pattern)
        return sum(1 for m, p in self.requests if m == method and regex.search(p))

    def start(self) -> "HttpEmulator":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._tls_dir is not None:
            self._tls_dir.cleanup()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _dispatch(self, method: str, target: str, raw: bytes) -> Response:
        parts = urlsplit(target)
        with self._lock:
            self.requests.append((method, parts.path))
            for fault in self._faults:
                if fault.method == method and fault.pattern.search(parts.path):
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    return fault.response
            for route_method, pattern, handler in self._routes:
                match = pattern.fullmatch(parts.path)
                if route_method == method and match:
                    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                    body = json.loads(raw) if raw else None
                    return handler(Request(method, parts.path, query, body, match))
        return Response(404, {"error": {"code": 404, "message": f"no route for {method} {parts.path}"}})

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        def answer(method: str, target: str, headers: dict[str, str], raw: bytes) -> Answer:
            response = self._dispatch(method, target, raw)
            payload = b"" if response.body is None else json.dumps(response.body).encode()
            return response.status, [("Content-Type", "application/json; charset=utf-8"),
                                     ("Content-Length", str(len(payload))), *(response.headers or {}).items()], payload

        return handler_class(answer)


# What a server answers: (status, headers in the order sent, payload).
Answer = tuple[int, list[tuple[str, str]], bytes]


def handler_class(answer: Callable[[str, str, dict[str, str], bytes], Answer]) -> type[BaseHTTPRequestHandler]:
    """A request handler that answers each request with `answer(method, target, headers (lower-case names), body)`;
    the payload is not sent to a HEAD."""

    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            status, headers, payload = answer(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                                              raw)
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _serve

        def log_message(self, *args) -> None:  # keep test output clean
            pass

    return _Handler


def _make_certificates(folder: Path) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it: (ca, cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tfsn test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return tuple(str(p) for p in paths)
