"""The provider interface: what the orchestrator asks of any source of nodes.

A provider turns a `NodeRequest` (plain data: what to run on the node) into a running node and
answers for it by its `NodeHandle`. Errors are typed so that the caller can tell what to retry,
what to block and what the user must fix.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

log = logging.getLogger(__name__)


class NodeStatus(str, enum.Enum):
    """What the provider can see of a node, independent of what runs on it."""

    PENDING = "pending"        # requested, not yet running
    RUNNING = "running"        # up; its agent may or may not be healthy
    TERMINATED = "terminated"  # gone (exited, deleted, preempted)
    UNKNOWN = "unknown"        # the provider could not tell (transient API error)


@dataclass(frozen=True)
class Offer:
    """One kind of node a provider can give, at a price: a row of the catalog (SkyPilot's vms.csv).

    Prices are per node-hour in USD; `spot_price` is None where the offer has no spot market.
    `zone` is None when the catalog knows only the region (the provider picks the zone).
    """

    provider: str                     # provider name: "aws", "gcp", "azure", "kubernetes", "local", ...
    region: str
    zone: str | None
    instance_type: str
    accelerator: str | None           # canonical accelerator name ("H100", "A100-80GB"), None for CPU-only
    accelerator_count: int            # accelerators per node (0 for CPU-only)
    accelerator_memory_gib: float     # memory of one accelerator
    vcpus: float
    memory_gib: float
    price: float                      # on-demand $/node-hour
    spot_price: float | None = None   # spot $/node-hour, None if not offered
    interconnect: str | None = None   # e.g. "EFA 3200 Gbps", "NVLink"; None if unknown
    arch: str = "x86_64"

    def hourly(self, spot: bool) -> float | None:
        """The node-hour price on the chosen market, or None if that market does not exist."""
        return self.spot_price if spot else self.price


@dataclass(frozen=True)
class BootFiles:
    """What a VM's boot script (bootstrap.py) fetches from the controller before its agent starts, each
    checked against its sha256: tfsn's wheel (none where TFSN_INSTALL_SPEC names what to install instead)
    and the job's code archive; `root` is the node's own folder (boot log, downloads, the workdir). `extra`
    is the tfsn extra the job needs on the node besides tfsn (the driver of its checkpoint store: "aws" for
    s3://), installed with the wheel from the wheel's own pinned ranges; `extra_module` is what that extra
    must make importable ("s3fs"), checked before the agent starts."""

    wheel: str = ""                   # the wheel's file name; "" when the node installs TFSN_INSTALL_SPEC
    wheel_sha256: str = ""
    code_sha256: str = ""             # the job's workdir archive; "" for none (the image holds the code)
    root: str = "/var/lib/tfsn"       # on the node; a relative request workdir is under it
    extra: str = ""                   # tfsn[extra] the job needs ("aws", "gcs", "azblob"); "" for none
    extra_module: str = ""            # the module that extra provides ("s3fs", "gcsfs", "adlfs")


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
    offer: Offer | None = None        # the planned offer (cloud providers); None: the provider's default
    spot: bool = False                # request the spot / preemptible market of the offer
    avoid_hosts: tuple[str, ...] = ()  # machines the health policy took out of the job (a provider that can
                                       # choose the machine, such as Kubernetes, keeps off them)
    placement: Mapping[str, Any] = field(default_factory=dict)  # the job spec's section named after the
                                       # provider, as plain data (kubernetes: image, node_selector, tolerations)
    boot: BootFiles | None = None     # what a VM's boot script fetches first (drivers that `runs_boot_script`)
    identity: str = ""                # the cloud identity the VM runs as (providers/identity.py); "" for none
    owner: str = ""                   # the id of the store that asks for it (job ids are only unique within one):
                                      # tagged, so that a sweep from another store leaves the node alone


@dataclass(frozen=True)
class NodeHandle:
    """How a provider finds a node again, also after the controller restarts (JSON-safe)."""

    provider: str                     # provider name, e.g. "local"
    node_id: str                      # the id from the NodeRequest
    data: dict[str, Any] = field(default_factory=dict)  # provider-specific identifiers


class ProviderError(Exception):
    """Base of all provider errors.

    `retryable` says whether the same request may succeed later; `scope` says how much a failover
    should block after it: "offer" (this instance type in this zone), "zone", "region" or
    "provider". Each subclass has the usual scope of its cause; a driver passes another when it
    knows better (an AWS capacity error is about one zone, a quota about one region).
    """

    retryable = False
    scope = "offer"

    def __init__(self, message: str, *, provider: str = "", scope: str | None = None) -> None:
        super().__init__(message)
        self.provider = provider
        if scope is not None:
            if scope not in SCOPES:
                raise ValueError(f"scope {scope!r} is not one of {SCOPES}")
            self.scope = scope


SCOPES = ("offer", "zone", "region", "provider")


class CapacityError(ProviderError):
    """The provider has no capacity for this request now; try elsewhere or later."""

    retryable = True
    scope = "zone"


class QuotaError(ProviderError):
    """The account's quota forbids the request. To fix: raise the quota or pick another provider."""

    scope = "region"


class AuthError(ProviderError):
    """Credentials are missing or refused. To fix: configure the provider's SDK credentials."""

    scope = "provider"


class NotFoundError(ProviderError):
    """The node, image or region does not exist."""


class InvalidRequestError(ProviderError):
    """The request can never succeed on this provider as written (e.g. asks for a GPU it lacks)."""


@dataclass(frozen=True)
class Fault:
    """What one kind of cloud error means for tfsn: the error to raise, the failover scope it implies, what the
    user can do. Each driver declares its cloud's faults; `fault_error` writes every message the same way."""

    error: type[ProviderError] = ProviderError
    fix: str = ""                   # what to do, after "To fix:"; "" where nothing but time helps
    scope: str | None = None        # None: the error type's usual scope
    retryable: bool | None = None   # None: the error type's own


def fault_error(fault: Fault, detail: str, *, provider: str) -> ProviderError:
    """The error `fault` names, as "<what failed>: <the cloud's code and message>. To fix: <fix>"."""
    error = fault.error(f"{detail}. To fix: {fault.fix}" if fault.fix else detail, provider=provider,
                        scope=fault.scope)
    if fault.retryable is not None:
        error.retryable = fault.retryable
    return error


def provider_error(err: Exception, what: str, classify: Callable[..., tuple[Fault, str]], *, provider: str,
                   **context: Any) -> ProviderError:
    """`err`, raised while doing `what`, as a typed error: an SDK's exception as its driver's
    `classify(err, **context)` names it (the fault, and the cloud's detail); an error tfsn raised itself (no
    credentials, a missing extra) keeps its type, scope and retryability."""
    if isinstance(err, ProviderError):
        found = type(err)(f"{what}: {err}", provider=err.provider or provider, scope=err.scope)
        found.retryable = err.retryable
        return found
    fault, detail = classify(err, **context)
    return fault_error(fault, f"{what}: {detail}", provider=provider)


@runtime_checkable
class Provider(Protocol):
    """One source of nodes. Every call is idempotent for the same `node_id`."""

    name: str

    def offers(self) -> list[Offer]:
        """Every kind of node this provider can give (from its catalog or its cluster), with prices."""
        ...

    def provision(self, request: NodeRequest) -> NodeHandle:
        """Create and start the node; return at once without waiting for its agent."""
        ...

    def status(self, handle: NodeHandle) -> NodeStatus:
        """What the provider sees of the node now."""
        ...

    def terminate(self, handle: NodeHandle) -> None:
        """Stop and delete the node and everything on it; a missing node is not an error."""
        ...


def status_on_error(err: Exception, missing: type[Exception], *, provider: str, name: str) -> NodeStatus:
    """What a failed read of node `name` says of it: TERMINATED where the cloud says it does not exist (`missing`:
    deleted, or a spot node preempted), else UNKNOWN, logged: an API or network failure says nothing of the node."""
    if isinstance(err, missing):
        return NodeStatus.TERMINATED
    log.warning("%s: status of %s: %s", provider, name, err)
    return NodeStatus.UNKNOWN


def planned_offer(request: NodeRequest, provider: str) -> Offer:
    """The request's offer, which must be one of `provider`'s: a VM driver cannot guess an instance type."""
    if request.offer is None or request.offer.provider != provider:
        raise InvalidRequestError(
            f"node {request.node_id}: the {provider} provider needs a planned {provider} offer, got "
            f"{request.offer and request.offer.provider!r}. To fix: plan the job with infra: [{provider}]",
            provider=provider)
    return request.offer


class Clients:
    """A driver's SDK clients, made on first use, once per key. The controller calls a provider from several
    threads at once (calls.py): building a boto3 session or resolving credentials from two at a time is unsafe."""

    def __init__(self) -> None:
        self._made: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key not in self._made:
                self._made[key] = make()
            return self._made[key]


class MissingExtraError(ProviderError):
    """The provider's SDK is not installed. To fix: install the extra the message names."""

    scope = "provider"


# How long an SDK's import is tried again while another thread imports a module it shares (`requests`).
IMPORT_RACE_S = 5.0


def import_sdk(module: str, *, provider: str, extra: str) -> Any:
    """Import a cloud SDK lazily, so that tfsn without the extra still imports and runs locally. Clouds are
    called in parallel threads: an import that meets a module another thread is still importing ("partially
    initialized module") is tried again once that one is done, rather than taken for a missing SDK."""
    import importlib

    deadline = time.monotonic() + IMPORT_RACE_S
    while True:
        try:
            return importlib.import_module(module)
        except ImportError as err:
            if "partially initialized module" in str(err) and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise MissingExtraError(
                f"the {provider} provider needs the Python module {module} ({err}). "
                f"To fix: pip install 'tfsn[{extra}]'", provider=provider) from None


def wait_for(done: Callable[[], bool], *, timeout_s: float, poll_s: float,
             pause: Callable[[float], object] = time.sleep, longest_pause_s: float = 15.0) -> None:
    """Pause, then ask `done`, until it says True: how a driver waits for a cloud's long-running operation
    without hammering its API (each pause 1.5 times the last, up to `longest_pause_s`). `pause` waits; an SDK
    poller's own wait ends early when its operation does. TimeoutError after `timeout_s`: the driver says what
    did not finish."""
    deadline = time.monotonic() + timeout_s
    wait = poll_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"not done within {timeout_s:.0f}s")
        pause(min(wait, left))
        if done():
            return
        wait = min(wait * 1.5, longest_pause_s)
