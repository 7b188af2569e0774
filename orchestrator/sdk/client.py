"""The HTTP client that agents and the SDK use to reach the controller.

Every call has a timeout; retrying is the caller's choice (an agent keeps heartbeating, the SDK
keeps its telemetry buffered), so a controller that is down or restarting never blocks training.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

TOKEN_HEADER = "Authorization"


class ControllerUnavailable(Exception):
    """The controller did not answer (down, restarting, or a network error); try again later."""


class ControllerRejected(Exception):
    """The controller answered with an error (bad token, unknown job); retrying will not help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"controller refused the request ({status}): {message}")
        self.status = status


class ControllerClient:
    """POSTs JSON to one job's endpoints with the job's secret token."""

    def __init__(self, url: str, token: str, job_id: int, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.job_id = job_id
        self.timeout = timeout

    @classmethod
    def from_env(cls) -> "ControllerClient | None":
        """The client for the job this process runs in, or None when not launched by tfsn."""
        url, token, job = (os.environ.get(k) for k in ("TFSN_CONTROLLER_URL", "TFSN_TOKEN", "TFSN_JOB_ID"))
        if not (url and token and job):
            return None
        return cls(url, token, int(job))

    def post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """POST `body` to /v1/jobs/<job><path>; returns the JSON answer."""
        request = urllib.request.Request(
            f"{self.url}/v1/jobs/{self.job_id}{path}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", TOKEN_HEADER: f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as err:
            if err.code >= 500:
                raise ControllerUnavailable(f"controller error {err.code}") from None
            raise ControllerRejected(err.code, err.read().decode(errors="replace")[:200]) from None
        except (OSError, ValueError) as err:  # URLError, timeouts, resets, a half-sent answer
            raise ControllerUnavailable(str(err)) from None
