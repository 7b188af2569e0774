"""Finding and deleting what tfsn left in a cloud: every resource that carries its tags.

Each cloud driver answers two calls: `tagged_resources()` lists every resource of the account (or
project, resource group, namespace) that carries tfsn's job tag, and `delete_resource(resource)`
deletes one, waiting until the cloud says it is gone; one already gone is no error. A driver whose
cloud has no credentials or settings on this machine raises `NotConfigured` before any request.
This module runs those calls for many clouds at once: each cloud in its own thread, a bounded number
of deletions at a time within it, kinds in dependency order (an instance before its NIC, NICs before
their network), and every cloud under one deadline, so a hung cloud never holds the others.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Protocol, TypeVar

from providers.base import MissingExtraError, ProviderError
from providers.naming import JOB_TAG, NODE_TAG, OWNER_TAG

# The order of deletion: what holds another resource goes first (an instance holds its disk and NIC,
# a NIC holds its subnet). Kinds of one stage are deleted in parallel.
STAGES: tuple[tuple[str, ...], ...] = (("instance", "pod"), ("volume", "disk", "nic"), ("vnet",))
DELETE_WORKERS = 8          # deletions of one cloud in flight at once (cloud APIs throttle bursts)

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass(frozen=True)
class TaggedResource:
    """One resource tfsn created in a cloud, as its tags and the cloud name it."""

    provider: str                 # the driver that lists and deletes it ("aws", "gcp", ...)
    kind: str                     # one of the kinds in STAGES
    name: str                     # the cloud's own id or name of it, as its console shows it
    where: str                    # region, zone, resource group or namespace
    job: str | None               # its tfsn-job tag; None for what tfsn shares between jobs (a region's vnet)
    node: str | None = None       # its tfsn-node tag, where it has one
    owner: str | None = None      # its tfsn-owner tag: the store whose job it is (None: made before that tag)
    ref: Mapping[str, Any] = field(default_factory=dict, compare=False)  # what the driver needs to delete it


class NotConfigured(ProviderError):
    """This cloud has no credentials or settings on this machine: tfsn cannot have used it from here."""

    scope = "provider"


class Sweepable(Protocol):
    """A driver whose leftovers `tfsn down` can find and delete."""

    name: str

    def tagged_resources(self) -> list[TaggedResource]:
        """Every resource carrying tfsn's tags (NotConfigured where the cloud is not set up here)."""
        ...

    def delete_resource(self, resource: TaggedResource) -> None:
        """Delete it and wait until the cloud confirms; one already gone is success."""
        ...


def tagged(provider: str, kind: str, name: str, where: str, tags: Mapping[str, str] | None,
           **ref: Any) -> TaggedResource:
    """A resource named by its cloud, with the job and node of its tags (the one reading of tags for all drivers)."""
    tags = tags or {}
    return TaggedResource(provider, kind, name, where, tags.get(JOB_TAG), tags.get(NODE_TAG), tags.get(OWNER_TAG), ref)


def stage(kind: str) -> int:
    return next(i for i, kinds in enumerate(STAGES) if kind in kinds)


def bounded(calls: Mapping[K, Callable[[], T]], deadline: float, workers: int) -> dict[K, T | BaseException]:
    """Run the calls, `workers` at a time, each result or exception by its key; a call not finished by
    `deadline` (time.monotonic) is a TimeoutError. The threads are daemons: a hung SDK call cannot keep
    the process from exiting once its deadline passed."""
    todo: queue.Queue = queue.Queue()
    for item in calls.items():
        todo.put(item)
    results: dict[K, T | BaseException] = {}
    finished = threading.Condition()

    def work() -> None:
        while time.monotonic() < deadline:
            try:
                key, call = todo.get_nowait()
            except queue.Empty:
                return
            try:
                value: T | BaseException = call()
            except Exception as err:   # noqa: BLE001 - every failure is the caller's to report, per resource
                value = err
            with finished:
                results[key] = value
                finished.notify_all()

    for _ in range(min(workers, len(calls))):
        threading.Thread(target=work, daemon=True).start()
    with finished:
        while len(results) < len(calls) and time.monotonic() < deadline:
            finished.wait(deadline - time.monotonic())
        late = TimeoutError("not done when the deadline came (it may still finish: sweep again to confirm)")
        return {key: results.get(key, late) for key in calls}


def list_resources(drivers: list[Sweepable], deadline: float) -> dict[str, list[TaggedResource] | BaseException]:
    """Every driver's tagged resources, listed in parallel: a list, NotConfigured, or the error that stopped it.
    A driver whose SDK is not installed is not configured here either."""
    found = bounded({d.name: d.tagged_resources for d in drivers}, deadline, workers=max(1, len(drivers)))
    return {name: NotConfigured(str(value), provider=name) if isinstance(value, MissingExtraError) else value
            for name, value in found.items()}


def delete_resources(drivers: Mapping[str, Sweepable], resources: list[TaggedResource],
                     deadline: float) -> dict[TaggedResource, BaseException | None]:
    """Delete the resources, each cloud in parallel, stage after stage within a cloud; None where deleted.
    A resource of a stage whose predecessor failed is still tried: the cloud says whether it is held."""
    def one_cloud(name: str) -> dict[TaggedResource, BaseException | None]:
        outcome: dict[TaggedResource, BaseException | None] = {}
        mine = [r for r in resources if r.provider == name]
        for number in range(len(STAGES)):
            calls = {r: _deleter(drivers[name], r) for r in mine if stage(r.kind) == number}
            outcome.update(bounded(calls, deadline, DELETE_WORKERS))
        return outcome

    clouds = sorted({r.provider for r in resources})
    per_cloud = bounded({name: (lambda name=name: one_cloud(name)) for name in clouds}, deadline, len(clouds) or 1)
    outcome: dict[TaggedResource, BaseException | None] = {}
    for name, result in per_cloud.items():
        if isinstance(result, BaseException):   # only a deadline ends a cloud's loop itself
            outcome.update({r: result for r in resources if r.provider == name})
        else:
            outcome.update(result)
    return outcome


def _deleter(driver: Sweepable, resource: TaggedResource) -> Callable[[], None]:
    return lambda: driver.delete_resource(resource)
