"""The provider interface: what the orchestrator asks of any source of nodes.

A provider turns a `NodeRequest` (plain data: what to run on the node) into a running node and
answers for it by its `NodeHandle`. Errors are typed so that the caller can tell what to retry,
what to block and what the user must fix.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class NodeStatus(str, enum.Enum):
    """What the provider can see of a node, independent of what runs on it."""

    PENDING = "pending"        # requested, not yet running
    RUNNING = "running"        # up; its agent may or may not be healthy
    TERMINATED = "terminated"  # gone (exited, deleted, preempted)
    UNKNOWN = "unknown"        # the provider could not tell (transient API error)


@dataclass(frozen=True)
class NodeRequest:
    """One node to create."""

    job_id: str                       # the job the node belongs to (for tags and cleanup)
    node_id: str                      # unique, recorded in the store before the request
    command: list[str]                # the bootstrap command: starts the node agent
    env: dict[str, str]               # environment of the bootstrap command
    workdir: str                      # working directory of the command on the node
    log_path: str | None = None       # where the provider keeps the command's output, if local
    cpus: int | None = None           # requested vCPUs (None: the provider's default)
    memory_gib: float | None = None   # requested memory (None: the provider's default)


@dataclass(frozen=True)
class NodeHandle:
    """How a provider finds a node again, also after the controller restarts (JSON-safe)."""

    provider: str                     # provider name, e.g. "local"
    node_id: str                      # the id from the NodeRequest
    data: dict[str, Any] = field(default_factory=dict)  # provider-specific identifiers


class ProviderError(Exception):
    """Base of all provider errors; `retryable` says whether the same request may succeed later."""

    retryable = False

    def __init__(self, message: str, *, provider: str = "") -> None:
        super().__init__(message)
        self.provider = provider


class CapacityError(ProviderError):
    """The provider has no capacity for this request now; try elsewhere or later."""

    retryable = True


class QuotaError(ProviderError):
    """The account's quota forbids the request. To fix: raise the quota or pick another provider."""


class AuthError(ProviderError):
    """Credentials are missing or refused. To fix: configure the provider's SDK credentials."""


class NotFoundError(ProviderError):
    """The node, image or region does not exist."""


class InvalidRequestError(ProviderError):
    """The request can never succeed on this provider as written (e.g. asks for a GPU it lacks)."""


@runtime_checkable
class Provider(Protocol):
    """One source of nodes. Every call is idempotent for the same `node_id`."""

    name: str

    def provision(self, request: NodeRequest) -> NodeHandle:
        """Create and start the node; return at once without waiting for its agent."""
        ...

    def status(self, handle: NodeHandle) -> NodeStatus:
        """What the provider sees of the node now."""
        ...

    def terminate(self, handle: NodeHandle) -> None:
        """Stop and delete the node and everything on it; a missing node is not an error."""
        ...
