"""Scoped credentials: what each caller of the API may do, derived from the job's secret.

The job's secret (`Job.token`) never leaves the controller (and, for a TfsnJob, its Secret). Each node's
agent gets a token good for that node's routes only (heartbeat, result, samples, logs, its attempt's
command), so one node cannot speak for another (say, rewrite rank 0's rendezvous address); the workers'
SDK gets a token good for telemetry and checkpoints only. Both are HMACs of the job's secret, so nothing
more is stored, and all of them die with the job: a terminal job accepts no writes (see api.py).
"""
from __future__ import annotations

import hashlib
import hmac

AGENT = "agent"
SDK = "sdk"


def agent_token(job_secret: str, node_id: str) -> str:
    """The token of node `node_id`'s agent."""
    return _derive(job_secret, f"{AGENT}:{node_id}")


def sdk_token(job_secret: str) -> str:
    """The token of the job's workers (the SDK inside the training script)."""
    return _derive(job_secret, SDK)


def allows(job_secret: str, presented: str, scope: str, node_id: str | None = None) -> bool:
    """Whether `presented` is the token of `scope` (for `node_id` when the scope is a node's agent)."""
    expected = agent_token(job_secret, node_id or "") if scope == AGENT else sdk_token(job_secret)
    return hmac.compare_digest(presented.encode(), expected.encode())


def _derive(job_secret: str, purpose: str) -> str:
    return hmac.new(job_secret.encode(), purpose.encode(), hashlib.sha256).hexdigest()
