"""The HTTP client that agents and the SDK use to reach the controller.

Every call has a timeout; retrying is the caller's choice (an agent keeps heartbeating, the SDK
keeps its telemetry buffered), so a controller that is down or restarting never blocks training.

A controller reached over https is trusted only if its certificate is signed by the CA the job was
given (TFSN_CA_PEM), and that CA is the one pinned (TFSN_CA_FINGERPRINT, SHA-256 of its DER): the
heartbeat's answer carries the job's command and environment, its secrets included. There is no
unverified fallback.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

TOKEN_HEADER = "Authorization"
HEARTBEAT_S = 1.0                           # how often a node's agent reports to the controller
SKIPPED_MAX, SKIPPED_CHARS = 16, 1000        # a restore's reasons for skipped checkpoints, as reported: at most
METRICS_MAX, METRIC_NAME_CHARS = 256, 255   # a step record's metrics, as the API takes them: at most
TELEMETRY_RECORDS_MAX = 20_000              # step records in one telemetry post, as the API takes them
TELEMETRY_BYTES_MAX = 4 * 1024 * 1024       # one telemetry post's body: larger is a 413
CA_PEM_ENV = "TFSN_CA_PEM"                  # the controller's CA certificate (public)
CA_FINGERPRINT_ENV = "TFSN_CA_FINGERPRINT"  # SHA-256 of that certificate's DER, hex
_FIX_TRUST = (f"To fix: give this process the {CA_PEM_ENV} and {CA_FINGERPRINT_ENV} that tfsn gives the job's "
              "nodes (the CA is $TFSN_HOME/tls/ca.pem on the controller's machine)")


class ControllerUnavailable(Exception):
    """The controller did not answer (down, restarting, or a network error); try again later."""


class ControllerRejected(Exception):
    """The controller answered with an error (bad token, unknown job); retrying will not help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"controller refused the request ({status}): {message}")
        self.status = status


class ControllerUntrusted(ControllerRejected):
    """The controller is not the one this job trusts (its CA is not the pinned one, or there is no CA to
    check an https controller with); retrying will not help."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)   # no HTTP status: this side refused
        self.status = 0


def fingerprint(ca_pem: str) -> str:
    """SHA-256 of a PEM certificate's DER, lower-case hex (ValueError if it is no PEM certificate)."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(ca_pem.strip())).hexdigest()


def pinned_context(ca_pem: str, pin: str = "") -> ssl.SSLContext:
    """A TLS context that trusts the CA `ca_pem` and nothing else, host names checked; ControllerUntrusted
    when there is no CA or `pin` (a CA fingerprint) is another CA's."""
    if not ca_pem:
        raise ControllerUntrusted(f"the controller serves https but this process has no CA to verify it with. "
                                  f"{_FIX_TRUST}")
    try:
        actual = fingerprint(ca_pem)
    except ValueError:
        raise ControllerUntrusted(f"{CA_PEM_ENV} is not a PEM certificate. {_FIX_TRUST}") from None
    wanted = pin.replace(":", "").strip().lower()
    if wanted and not hmac.compare_digest(wanted, actual):
        raise ControllerUntrusted(f"the CA given (SHA-256 {actual}) is not the pinned one ({wanted}). {_FIX_TRUST}")
    return ssl.create_default_context(cadata=ca_pem)   # with cadata, the system's CAs are not loaded


class ControllerClient:
    """POSTs JSON to one job's endpoints with the job's secret token (over TLS pinned to the job's CA for an
    https URL)."""

    def __init__(self, url: str, token: str, job_id: int, timeout: float = 5.0, ca_pem: str = "",
                 ca_fingerprint: str = "") -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.job_id = job_id
        self.timeout = timeout
        self.ca_pem = ca_pem
        self.ca_fingerprint = ca_fingerprint

    @classmethod
    def from_env(cls) -> "ControllerClient | None":
        """The client for the job this process runs in, or None when not launched by tfsn."""
        url, token, job = (os.environ.get(k) for k in ("TFSN_CONTROLLER_URL", "TFSN_TOKEN", "TFSN_JOB_ID"))
        if not (url and token and job):
            return None
        return cls(url, token, int(job), ca_pem=os.environ.get(CA_PEM_ENV, ""),
                   ca_fingerprint=os.environ.get(CA_FINGERPRINT_ENV, ""))

    @functools.cached_property
    def _tls(self) -> ssl.SSLContext | None:
        """The pinned context for an https controller (built on first use: a bad pin fails a call, never the
        training script that made the client); None for plain HTTP (loopback)."""
        return pinned_context(self.ca_pem, self.ca_fingerprint) if self.url.startswith("https:") else None

    def post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """POST `body` to /v1/jobs/<job><path>; returns the JSON answer."""
        request = urllib.request.Request(
            f"{self.url}/v1/jobs/{self.job_id}{path}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", TOKEN_HEADER: f"Bearer {self.token}"})
        context = self._tls
        handlers: list[urllib.request.BaseHandler] = [urllib.request.HTTPSHandler(context=context)] if context else []
        if _loopback(urllib.parse.urlsplit(self.url).hostname or ""):
            handlers.append(urllib.request.ProxyHandler({}))   # HTTP_PROXY must never see a local job's tokens
        try:
            with urllib.request.build_opener(*handlers).open(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as err:
            if err.code >= 500:
                raise ControllerUnavailable(f"controller error {err.code}") from None
            raise ControllerRejected(err.code, err.read().decode(errors="replace")[:200]) from None
        except (OSError, ValueError) as err:  # URLError, timeouts, resets, a half-sent answer
            reason = getattr(err, "reason", None)
            if isinstance(reason, ssl.SSLCertVerificationError):
                raise ControllerUntrusted(f"the controller at {self.url} is not the one this job trusts "
                                          f"({reason.verify_message}). {_FIX_TRUST}") from None
            raise ControllerUnavailable(str(err)) from None


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
