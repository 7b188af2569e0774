"""The planner: rank every capable offer by the predicted cost of the whole run, not by its hourly price.

    plan = plan_job(spec, offers)                  # pure: no I/O
    blocked = Blocklist()
    candidate = plan.next(blocked)                 # the best offer nothing has ruled out
    ... provisioning fails with a ProviderError:
    blocked.record(candidate, err)                 # blocks the offer, zone, region or provider
    ... and the next candidate is plan.next(blocked); none left: NoCapacityError(blocked.history)

(the controller walks this loop one node at a time, keeping the candidates and the blocks in its store)

An offer is capable when it meets the accelerator request (type and count; any of a mapping, or one of
an ordered list), has accelerator memory for the spec's `model:` (optimizer.predict.memory_gib_needed; a
spec without one is priced with the reference workload, which says nothing of its size), meets
`cpus` / `memory`, is in `infra` and `regions`, is sold on the requested market (`use_spot`) and costs at
most `max_hourly_cost` per node-hour. Its predicted cost is

    price per node-hour x (num_nodes + recovery.spares) x predicted hours   (spares are billed standing by),
    predicted hours = STARTUP_SECONDS (HOST_STARTUP_SECONDS on this machine) + steps x predicted step
                      seconds  (and, on spot, the expected restarts: see expected_spot_hours)

where the step time comes from the optimizer's predictor for that accelerator, count and node count.
A mapping of accelerators (any of them) is ranked by cost alone; an ordered list keeps the user's
preference first and ranks by cost within each choice. The planner knows no provider by name.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from optimizer.hardware import HardwareSpec, find_hardware, load_all
from optimizer.predict import (DEFAULT_INTER_NODE_GBS, REFERENCE_WORKLOAD, Workload, allreduce_seconds_many,
                               memory_gib_needed, step_seconds_many, training_state_gib)
from orchestrator.spec import JobSpec, close_match
from providers.base import SCOPES, Offer, ProviderError

if TYPE_CHECKING:   # the entry's runner raises PlanError: it imports this module
    from orchestrator.planning.entry import EntryStep

# Steps assumed when the spec has no `steps` (so that a plan still compares whole runs).
DEFAULT_STEPS = 1000
# Provisioning, boot, image pull, `setup` and first compile, per (re)start, seconds (assumption: SkyPilot
# reports a few minutes to launch a GPU VM; we add setup and warm-up).
STARTUP_SECONDS = 600.0
# The same on this machine's offers (the local provider's nodes: agent processes that import torch and compile the
# step, no VM to boot). Measured: the README example (`tfsn launch examples/tiny-gpt/train.yaml`) ended 42 s after
# it started, of which its 300 steps of about 44 ms took 13 s (2-core VM beside a test run, 2026-12-07).
HOST_STARTUP_SECONDS = 30.0
# Spot preemptions per node-hour (assumption; AWS Spot Instance Advisor's lowest bucket, "<5%" of
# instances interrupted per month, is far lower, but GPU spot capacity is reclaimed much more often).
SPOT_PREEMPTIONS_PER_NODE_HOUR = 0.05
# Time to write one checkpoint, seconds, for the `auto` interval (assumption).
CHECKPOINT_SAVE_SECONDS = 60.0
# A spot run whose expected restarts would take this share of its time or more is not planned.
MAX_SPOT_LOSS = 0.9
# Where an offer's step time came from: the job's own step searched for the offer's chip (model.entry), or
# the first-order roofline of the declared shape (optimizer.predict) when there is no entry or its search failed.
SEARCHED, ROOFLINE = "searched graph", "roofline fallback"
# The hardware key of an offer of this machine (its CPU, calibrated where `tfsn calibrate` ran)
HOST = "host"

Predictor = Callable[[Workload, Sequence[HardwareSpec], np.ndarray, int, np.ndarray], np.ndarray]


class PlanError(ValueError):
    """No capable offer; the message says which constraint removed the last ones and how to relax it.
    `field` is the spec's field to blame where there is one, e.g. ("resources", "accelerators")."""

    def __init__(self, message: str, field: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.field = field


class NoCapacityError(Exception):
    """Every capable offer failed to provision; `history` says what was tried and why it failed."""

    def __init__(self, history: list[FailedAttempt]) -> None:
        self.history = history
        lines = "; ".join(f"{h.offer.provider}/{h.offer.region}/{h.offer.instance_type}: {h.error}"
                          for h in history[-5:])
        super().__init__(f"no capable offer could be provisioned after {len(history)} attempt(s): {lines}. "
                         "To fix: allow more providers, regions or accelerators, or try again later")


@dataclass(frozen=True)
class PlannedOffer:
    """One candidate: an offer on one market, with its predicted step time, run time and run cost."""

    offer: Offer
    spot: bool
    nodes: int
    price_per_hour: float      # USD per node-hour on this market
    step_seconds: float        # predicted seconds per optimizer step
    hours: float               # predicted wall-clock hours of the run, startup and restarts included
    cost: float                # predicted USD for the run: price_per_hour x (nodes + spares) x hours
    step_source: str = ROOFLINE   # SEARCHED or ROOFLINE
    search_entries: tuple[str, ...] = ()  # the search cache entries model.entry's step left for this offer's workers
    spares: int = 0            # standby nodes of this offer (recovery.spares), billed beside the training nodes

    def to_record(self) -> dict:
        """JSON-safe, with the whole offer (for the controller's store); `from_record` reads it back."""
        return {"offer": asdict(self.offer), **self.to_dict(), "search_entries": list(self.search_entries)}

    @classmethod
    def from_record(cls, record: dict) -> PlannedOffer:
        return cls(Offer(**record["offer"]), record["spot"], record["nodes"], record["price_per_hour"],
                   record["step_seconds"], record["predicted_hours"], record["predicted_cost"],
                   record.get("step_source", ROOFLINE),      # records of older versions have none
                   tuple(record.get("search_entries", ())), record.get("spares", 0))

    def to_dict(self) -> dict:
        o = self.offer
        return {"provider": o.provider, "region": o.region, "zone": o.zone, "instance_type": o.instance_type,
                "accelerator": o.accelerator, "accelerator_count": o.accelerator_count, "spot": self.spot,
                "nodes": self.nodes, "spares": self.spares, "price_per_hour": round(self.price_per_hour, 6),
                "step_seconds": round(self.step_seconds, 6), "step_source": self.step_source,
                "predicted_hours": round(self.hours, 6), "predicted_cost": round(self.cost, 4)}


@dataclass(frozen=True)
class FailedAttempt:
    """A provisioning attempt that failed, and what the failure blocked."""

    offer: Offer
    spot: bool
    error: str
    scope: str


@dataclass
class Blocklist:
    """What failover has ruled out: offers, zones, regions or whole providers, from errors' scopes."""

    keys: set[tuple] = field(default_factory=set)
    history: list[FailedAttempt] = field(default_factory=list)

    def block(self, offer: Offer, scope: str) -> None:
        """Rule out `offer` and everything else in `scope` ("offer", "zone", "region" or "provider")."""
        if scope not in SCOPES:
            raise ValueError(f"scope {scope!r} is not one of {SCOPES}")
        if scope == "zone" and offer.zone is None:       # a region-level offer: its zone is the region
            scope = "region"
        self.keys.add(_key(offer, scope))

    def record(self, candidate: PlannedOffer, error: ProviderError) -> None:
        """Block what a provider error implies (its `scope`) and remember the attempt."""
        self.block(candidate.offer, error.scope)
        self.history.append(FailedAttempt(candidate.offer, candidate.spot, str(error), error.scope))

    def blocks(self, offer: Offer) -> bool:
        return any(_key(offer, scope) in self.keys for scope in SCOPES)

    @classmethod
    def from_records(cls, records: Sequence[dict]) -> Blocklist:
        """The blocklist of a job's failed attempts as the store keeps them (see `blocked_record`)."""
        blocked = cls()
        for entry in records:
            offer = Offer(**entry["offer"])
            blocked.block(offer, entry["scope"])
            blocked.history.append(FailedAttempt(offer, entry["spot"], entry["error"], entry["scope"]))
        return blocked


def blocked_record(offer: Offer, spot: bool, error: str, scope: str) -> dict:
    """A failed provisioning attempt as the job's store keeps it (JSON)."""
    return {"offer": asdict(offer), "spot": spot, "error": error, "scope": scope}


def _key(offer: Offer, scope: str) -> tuple:
    if scope == "provider":
        return (scope, offer.provider)
    if scope == "region":
        return (scope, offer.provider, offer.region)
    if scope == "zone":
        return (scope, offer.provider, offer.region, offer.zone)
    return (scope, offer.provider, offer.region, offer.zone, offer.instance_type)


@dataclass(frozen=True, eq=False)
class Plan:
    """Capable offers ranked by predicted run cost (cheapest first), and the naive choice beside them.

    Candidates are built on demand from columns, so a plan over 100k offers stays cheap.
    """

    offers: Sequence[Offer]
    order: np.ndarray          # indices into `offers`, best first
    spot: bool
    nodes: int
    spares: int                # standby nodes billed beside the training nodes (recovery.spares)
    price: np.ndarray          # per offer index, USD per node-hour on the market
    step_seconds: np.ndarray
    hours: np.ndarray
    cost: np.ndarray
    naive_index: int           # the cheapest capable offer per hour
    workload: Workload | None  # the declared shape (None: the spec has only model.entry)
    reference_workload: bool   # True when the spec named no model
    steps: int
    step_source: np.ndarray | None = None    # per offer index: SEARCHED or ROOFLINE
    entry: EntryStep | None = None            # the searched step of model.entry, per hardware key
    hardware_keys: Sequence[str] = ()         # per offer index: its key in `entry.hardware`
    unread: Mapping[str, ProviderError] = field(default_factory=dict)   # provider -> why its offers were not read

    def __len__(self) -> int:
        return len(self.order)

    def candidate(self, index: int) -> PlannedOffer:
        """The candidate for offer `index` (an index into `offers`)."""
        source = ROOFLINE if self.step_source is None else str(self.step_source[index])
        found = self.entry.hardware.get(self.hardware_keys[index]) \
            if self.entry is not None and self.hardware_keys else None
        return PlannedOffer(self.offers[index], self.spot, self.nodes, float(self.price[index]),
                            float(self.step_seconds[index]), float(self.hours[index]), float(self.cost[index]),
                            source, found.entries if found is not None else (), self.spares)

    def hardware(self) -> list[dict]:
        """One row per hardware type among the capable offers: its key, the offers' accelerator, where
        their step time came from, and the searched step of one replica (seconds at the example batch) or
        why the search did not price it."""
        rows: dict[str, dict] = {}
        for i in self.order:
            key = self.hardware_keys[int(i)] if self.hardware_keys else self.offers[int(i)].accelerator or "cpu"
            if key in rows:
                continue
            found = self.entry.hardware.get(key) if self.entry is not None else None
            rows[key] = {"hardware": key, "accelerator": self.offers[int(i)].accelerator,
                         "source": str(self.step_source[int(i)]) if self.step_source is not None else ROOFLINE,
                         "step_seconds": float(self.step_seconds[int(i)]),
                         "searched_device_step_s": found.seconds if found is not None else None,
                         "update_s": found.update_s if found is not None and found.seconds is not None else None,
                         "kernels_predicted_s": found.predicted_s if found is not None else None,
                         "graphs": found.graphs if found is not None else 0,
                         "cached": found.cached if found is not None else False,
                         "why_fallback": (None if found is not None and found.seconds is not None else
                                          found.error if found is not None else
                                          "no model.entry in the spec" if self.entry is None else "not searched")}
        return list(rows.values())

    def __iter__(self) -> Iterator[PlannedOffer]:
        return (self.candidate(int(i)) for i in self.order)

    def ranked(self, limit: int | None = None) -> list[PlannedOffer]:
        return [self.candidate(int(i)) for i in self.order[:limit]]

    @property
    def chosen(self) -> PlannedOffer:
        return self.candidate(int(self.order[0]))

    @property
    def naive(self) -> PlannedOffer:
        return self.candidate(self.naive_index)

    def next(self, blocked: Blocklist) -> PlannedOffer | None:
        """The best candidate that `blocked` does not rule out, or None when none is left."""
        for i in self.order:
            if not blocked.blocks(self.offers[int(i)]):
                return self.candidate(int(i))
        return None


def workload_of(spec: JobSpec) -> tuple[Workload | None, bool]:
    """The spec's declared model shape as a Workload (None: only an entry), or the reference workload
    (second value True)."""
    m = spec.model
    if m is None:
        return REFERENCE_WORKLOAD, True
    if not m.has_shape:
        return None, False
    return Workload(params=m.params, layers=m.layers, hidden=m.hidden, seq_len=m.seq_len,
                    batch_size=m.batch_size, dtype=m.dtype), False


def expected_spot_hours(run_hours: np.ndarray, nodes: int, interval_hours: np.ndarray) -> np.ndarray:
    """Expected wall-clock hours of a spot run of `run_hours` hours without preemptions.

    Preemptions arrive at SPOT_PREEMPTIONS_PER_NODE_HOUR x nodes per hour; each costs a restart
    (STARTUP_SECONDS) plus half a checkpoint interval of lost work on average (half the run when it ends
    before its first checkpoint: no preemption loses more than the whole run), and restarts can be
    preempted too, so the expected time is run_hours / (1 - rate x loss). Runs whose expected loss
    reaches MAX_SPOT_LOSS get infinite hours (they would never finish).
    """
    rate = SPOT_PREEMPTIONS_PER_NODE_HOUR * nodes
    loss = rate * (STARTUP_SECONDS / 3600 + np.minimum(interval_hours, run_hours) / 2)
    with np.errstate(divide="ignore"):
        return np.where(loss < MAX_SPOT_LOSS, run_hours / np.maximum(1.0 - loss, 1e-9), np.inf)


def _checkpoint_interval_hours(spec: JobSpec, step_seconds: np.ndarray, nodes: int) -> np.ndarray:
    ckpt = spec.checkpoint
    if ckpt.interval_steps is not None:
        return ckpt.interval_steps * step_seconds / 3600
    if ckpt.interval_seconds is not None:
        return np.full_like(step_seconds, ckpt.interval_seconds / 3600)
    mtbf_s = 3600 / (SPOT_PREEMPTIONS_PER_NODE_HOUR * nodes)          # Young's formula, as `auto` does
    return np.full_like(step_seconds, min(max(math.sqrt(2 * CHECKPOINT_SAVE_SECONDS * mtbf_s), 30), 1800) / 3600)


# A node's network as catalogs write it: "EFA 3200 Gbps", or EC2's NetworkPerformance that `tfsn catalog refresh aws`
# keeps ("EFA 3200 Gigabit" for a p5, "EFA 4x 100 Gigabit" for a p4d's four cards, "Up to 10 Gigabit")
_NETWORK_RE = re.compile(r"(?:(\d+)\s*x\s*)?(\d+(?:\.\d+)?)\s*(?:gbps|gigabit)", re.IGNORECASE)


def _inter_node_gbs(interconnect: str | None) -> float:
    """Node network bandwidth in GB/s from a catalog's interconnect text, else the default."""
    match = _NETWORK_RE.search(interconnect or "")
    return int(match[1] or 1) * float(match[2]) / 8 if match else DEFAULT_INTER_NODE_GBS


class _Filter:
    """Applies constraints in order and remembers which one removed the last offers."""

    def __init__(self, n: int) -> None:
        self.mask = np.ones(n, dtype=bool)
        self.emptied_by: tuple[str, str] | None = None
        self.before: np.ndarray | None = None
        self.field: tuple[str, ...] = ()

    def apply(self, keep: np.ndarray, what: str, fix: str | Callable[[], str], field: tuple[str, ...] = ()) -> None:
        """Keep the offers of `keep`; the spec's field to blame is the one `what` begins with ("resources.cpus"),
        or `field` for a constraint that no single field states (the model's size: its section). A `fix` that
        reads the offers (what they have instead) is a function, called only once the offers are gone."""
        if self.emptied_by is not None:
            return
        new = self.mask & keep
        if self.mask.any() and not new.any():
            self.emptied_by, self.before = (what, fix if isinstance(fix, str) else fix()), self.mask.copy()
            named = re.match(r"(resources|model)\.(\w+)", what)
            self.field = field or (named.groups() if named else ())
        self.mask = new


def _codes(values: Sequence) -> tuple[np.ndarray, list]:
    """Small integer codes for a column of hashable values, and the distinct values in code order."""
    distinct = list(dict.fromkeys(values))
    index = {v: i for i, v in enumerate(distinct)}
    return np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values)), distinct


@dataclass(frozen=True)
class _Columns:
    """The offers as numpy columns, built with one comprehension per column: the fastest way out of 100k
    dataclasses. Text columns are small integer codes into their distinct values."""

    provider: np.ndarray
    provider_names: list
    region: np.ndarray
    region_names: list
    accelerator: np.ndarray
    accelerator_names: list            # as the catalog spells them (None: CPU only)
    count: np.ndarray                  # accelerators per node
    accelerator_memory: np.ndarray     # GiB per accelerator
    vcpus: np.ndarray
    memory: np.ndarray                 # GiB per node
    market: np.ndarray                 # USD per node-hour on the job's market; nan where there is none

    @classmethod
    def of(cls, offers: Sequence[Offer], spot: bool) -> _Columns:
        provider, provider_names = _codes([o.provider for o in offers])
        region, region_names = _codes([o.region for o in offers])
        accelerator, accelerator_names = _codes([o.accelerator for o in offers])
        return cls(provider, provider_names, region, region_names, accelerator, accelerator_names,
                   count=np.array([o.accelerator_count for o in offers], dtype=np.int64),
                   accelerator_memory=np.array([o.accelerator_memory_gib for o in offers], dtype=float),
                   vcpus=np.array([o.vcpus for o in offers], dtype=float),
                   memory=np.array([o.memory_gib for o in offers], dtype=float),
                   market=np.array([o.spot_price for o in offers] if spot else [o.price for o in offers],
                                   dtype=float))                       # None (no spot market) -> nan


def _filter_place(f: _Filter, res: Any, c: _Columns) -> None:
    if res.infra:
        allowed = [i for i, p in enumerate(c.provider_names) if p in res.infra]
        f.apply(np.isin(c.provider, allowed), f"resources.infra {res.infra}",
                f"add providers to infra (the catalog has {', '.join(sorted(c.provider_names))})")
    if res.regions:     # case aside: "US-East-1" is us-east-1
        wanted = {region.casefold() for region in res.regions}
        allowed = [i for i, r in enumerate(c.region_names) if r.casefold() in wanted]
        known = {r.casefold() for r in c.region_names}
        unknown = [region for region in res.regions if region.casefold() not in known]
        close = close_match(unknown[0], c.region_names, cutoff=0.8) if unknown else None    # a typo, not a guess
        typo = f"write {close!r} for {unknown[0]!r} (no offer is in the latter), " if close else ""
        f.apply(np.isin(c.region, allowed), f"resources.regions {res.regions}",
                f"{typo}add regions, or remove regions to allow all")


_STATED_MEMORY_RE = re.compile(r"(\d+)\s*gb", re.IGNORECASE)


def _offers_of(name: str, c: _Columns) -> np.ndarray:
    """Which offers have the accelerator `name` (case aside): those the catalog calls so; for a name the catalog
    does not use, those whose accelerator has the hardware spec `name` is an alias of ("H100-80GB" and GCP's
    "nvidia-h100-80gb" are the catalogs' "H100"), of the memory the name states, if it states one."""
    names = [(a or "").casefold() for a in c.accelerator_names]
    if name.casefold() in names:
        return c.accelerator == names.index(name.casefold())
    wanted = find_hardware(name)
    codes = [code for code, catalog_name in enumerate(c.accelerator_names)
             if wanted is not None and catalog_name and find_hardware(catalog_name) is wanted]
    mask = np.isin(c.accelerator, codes)
    stated = _STATED_MEMORY_RE.search(name)
    if stated:
        mask &= np.abs(c.accelerator_memory - float(stated[1])) <= 0.1 * float(stated[1])
    return mask


def _offered_here(mask: np.ndarray, c: _Columns) -> str:
    """The fix for an accelerator or count that the offers of `mask` (the job's infra and regions, of accelerators
    with a hardware spec: no other could be planned) do not sell: the choices they do."""
    here = mask & (c.count > 0)
    pairs = np.unique(np.stack([c.accelerator[here], c.count[here]], axis=1), axis=0)
    offered = sorted(((c.accelerator_names[a], int(n)) for a, n in pairs), key=lambda p: (p[0].casefold(), p[1]))
    if not offered:
        return "ask for another accelerator or count (see `tfsn catalog ls`)"
    return "ask for one of those offered here: " + ", ".join(f"{a}:{n}" for a, n in offered)


def _filter_accelerators(f: _Filter, res: Any, c: _Columns) -> tuple[np.ndarray, list[HardwareSpec | None]]:
    """Keep the offers with an accelerator the job asked for (and a hardware spec to predict it with).
    Returns each offer's preference (its choice's place in `accelerators`, 0 for any_of) and the spec of
    every distinct accelerator."""
    choices = res.accelerator_choices()
    preference = np.zeros(len(c.count), dtype=np.int64)
    hardware = [find_hardware(name or None) for name in c.accelerator_names]
    has_spec = np.array([h is not None for h in hardware])[c.accelerator]
    if choices:
        rank = np.full(len(c.count), -1, dtype=np.int64)
        for i, choice in enumerate(choices):
            rank[_offers_of(choice.name, c) & (c.count == choice.count) & (rank < 0)] = i
        wanted = ", ".join(f"{choice.name}:{choice.count}" for choice in choices)
        f.apply(rank >= 0, f"resources.accelerators {wanted}", lambda: _offered_here(f.mask & has_spec, c))
        preference = np.where(res.accelerators_any_of, 0, np.maximum(rank, 0))
    else:
        f.apply(c.count == 0, "resources.accelerators (none: a CPU-only job)",
                "name accelerators, e.g. 'accelerators: H100:8', or add CPU offers to the catalog")
    missing = sorted({c.accelerator_names[a] for a in np.unique(c.accelerator[f.mask]) if hardware[a] is None})
    f.apply(has_spec, f"hardware specs (none for {', '.join(missing) or '-'})",
            "add a configs/hardware/*.yaml spec (or an alias) for the accelerator")
    return preference, hardware


# A count written into the name, "8xH100" or "H100x8": the closest name alone ("H100") would be one accelerator.
_COUNT_IN_NAME_RES = (re.compile(r"(?P<count>\d{1,2})\s*[x×]\s*(?P<name>.+)", re.IGNORECASE),
                      re.compile(r"(?P<name>.+?)\s*[x×]\s*(?P<count>\d{1,2})", re.IGNORECASE))
_MEMORY_SIZE_RE = re.compile(r"\d+\s*GB", re.IGNORECASE)        # dstack's `gpu: 80GB:8`: any GPU of that memory


def _count_in_name(name: str) -> str | None:
    """"H100:8" for a name that is a known accelerator and a count ("8xH100", "H100x8"); else None."""
    for pattern in _COUNT_IN_NAME_RES:
        match = pattern.fullmatch(name)
        if match and find_hardware(match["name"]) is not None:
            return f"{match['name']}:{int(match['count'])}"
    return None


def check_accelerators(spec: JobSpec) -> None:
    """PlanError for an accelerator no hardware spec knows: no offer of it could ever be priced (see
    _filter_accelerators), so no catalog or provider needs asking to refuse it."""
    chips = [h for h in load_all().values() if h.kind != "cpu"]
    for choice in spec.resources.accelerator_choices():
        hardware = find_hardware(choice.name)
        if hardware is not None and hardware.kind != "cpu":
            continue
        if hardware is not None or choice.name.casefold() == "none":      # `accelerators: cpu` for no GPU
            raise PlanError(f"resources.accelerators: {choice.name!r} is not an accelerator. To fix: remove "
                            "resources.accelerators for a job on CPUs only", field=("resources", "accelerators"))
        if _MEMORY_SIZE_RE.fullmatch(choice.name):
            hint = (f"; a GPU's memory is not its name here. To fix: name the chips, any of them as a mapping, e.g. "
                    f"{{A100-80GB: {choice.count}, H100: {choice.count}}}")
        else:
            close = _count_in_name(choice.name) or close_match(choice.name, [a for h in chips for a in h.aliases])
            hint = (f"; did you mean {close!r}?" if close else ".") + " To fix: use one with a hardware spec in " \
                f"configs/hardware/: {', '.join(h.name for h in chips)}"
        raise PlanError(f"resources.accelerators: unknown accelerator {choice.name!r}{hint}",
                        field=("resources", "accelerators"))


def memory_needed(workload: Workload | None, entry: EntryStep | None) -> float | None:
    """GiB one replica needs: the declared shape's (state and activations), else the entry's training state
    (its activations unknown); None when neither is known."""
    if workload is not None:
        return memory_gib_needed(workload)
    return training_state_gib(entry.params, entry.dtype) if entry is not None else None


def _workers_per_device(spec: JobSpec, counts: np.ndarray, host: np.ndarray) -> np.ndarray:
    """Replicas each device holds: one per accelerator (no node runs more workers than it has: see
    _filter_resources); on a CPU node (count 0) every worker's, in the node's memory; on this machine's offers
    (`host`) every node's workers too: its local nodes are processes of the one machine."""
    return np.where(counts > 0, 1, spec.nprocs(0)) * np.where(host, spec.num_nodes, 1)


def _filter_resources(f: _Filter, spec: JobSpec, c: _Columns, need: float | None, here: np.ndarray) -> None:
    """Keep the offers that hold the model (`need` GiB a replica) and meet resources' cpus, memory and price;
    `here` marks this machine's offers."""
    res = spec.resources
    if spec.nproc_per_node != "auto":   # torchrun's worker N trains on accelerator N: one beyond them cannot start
        workers = spec.nproc_per_node
        f.apply((c.count == 0) | (c.count >= workers),
                f"nproc_per_node {workers} (more workers than the node's accelerators: each needs one of its own)",
                lambda: "set nproc_per_node: auto (one worker per accelerator) or at most "
                        f"{int(c.count[f.mask].max())}", field=("nproc_per_node",))
    if need is not None:   # the reference workload prices offers; it says nothing of the user's model size
        workers = _workers_per_device(spec, c.count, here)
        fits = np.where(c.count > 0, c.accelerator_memory, c.memory) >= need * workers
        most = int(workers[f.mask].max()) if f.mask.any() else 1
        fewer = (", or fewer workers per node (nproc_per_node)" if spec.nprocs(0) > 1 else "") + (
            ", or fewer local nodes (num_nodes: they share this machine's memory)"
            if spec.num_nodes > 1 and (f.mask & here).any() else "")
        f.apply(fits, f"memory for the model ({need * most:.1f} GiB per device needed: a whole replica per "
                + (f"worker, {most} per device, " if most > 1 else "device, ") + "not sharded)",
                lambda: _holding(c, need * most) + (fewer if most > 1 else ""), field=("model",))
    if res.cpus is not None:
        f.apply(c.vcpus >= res.cpus.count if res.cpus.at_least else c.vcpus == res.cpus.count,
                f"resources.cpus {res.cpus}",
                "lower it" if res.cpus.at_least else "write cpus as 'N+' (at least N), or lower it")
    if res.memory is not None:
        f.apply(c.memory >= res.memory.count if res.memory.at_least else c.memory == res.memory.count,
                f"resources.memory {res.memory} GiB",
                "lower it" if res.memory.at_least else "write memory as 'N+' (at least N GiB), or lower it")
    f.apply(~np.isnan(c.market), "resources.use_spot true (no spot price)", "set use_spot: false")
    if res.max_hourly_cost is not None:
        cheapest = float(np.nanmin(np.where(f.mask, c.market, np.nan))) if f.mask.any() else math.nan
        f.apply(c.market <= res.max_hourly_cost, f"resources.max_hourly_cost {res.max_hourly_cost:g}",
                f"raise max_hourly_cost to at least {cheapest:.2f}")


def _holding(c: _Columns, need: float) -> str:
    """The fix for a model no asked accelerator holds: the catalog's accelerators that do, wherever they are (of
    those with a hardware spec: no other could be planned)."""
    holds = c.accelerator_memory >= need
    big = {c.accelerator_names[a]: float(c.accelerator_memory[holds & (c.accelerator == a)].max())
           for a in np.unique(c.accelerator[holds]) if find_hardware(c.accelerator_names[a] or None) is not None}
    which = ", ".join(f"{name} {gib:.0f} GiB" for name, gib in sorted(big.items(), key=lambda kv: (kv[1], kv[0])))
    return (f"ask for accelerators of at least {need:.1f} GiB (the catalog's: {which or 'none'}), or a smaller "
            "model / seq_len")


def hardware_key(offer: Offer, spec: HardwareSpec | None, host_providers: Sequence[str]) -> str:
    """The hardware type an offer's step is searched for: HOST for this machine's offers, else its chip."""
    return HOST if offer.provider in host_providers else spec.name if spec is not None else "?"


def _searched_step(job: JobSpec, entry: EntryStep, found: Any, hw: HardwareSpec, count: int, nodes: int,
                   link_gbs: float, here: bool = False) -> float:
    """One optimizer step from the searched step of one replica: scaled from the example's per-rank batch to
    the job's (model.batch_size over the data-parallel width; the example's own without it), plus the update
    (found.update_s) and the fixed share every step pays around its graphs (found.overhead_solo_s); as one of
    several ranks, plus what a data-parallel step pays beyond that (found.overhead_s) and its wait for the other
    ranks (found.parallel_wait_s, a 1 ms step's: it grows as the square root of the step's own time); and the
    gradient all-reduce: over the offer's links, or for this machine's local nodes (`here`) as `tfsn calibrate`
    measured it between local processes, where it did."""
    from optimizer.hardware import cpu_spec
    from optimizer.predict import local_allreduce_seconds

    per_node = job.nprocs(count)
    global_batch = job.model.batch_size if job.model.batch_size is not None else None
    scale = global_batch / (per_node * nodes) / entry.example_batch if global_batch else 1.0
    allreduce = local_allreduce_seconds(entry.grad_bytes, per_node * nodes, cpu_spec()) if here else None
    if allreduce is None:
        allreduce = float(allreduce_seconds_many(entry.grad_bytes, [hw], [per_node], nodes, [link_gbs])[0])
    own = found.seconds * scale + found.update_s + found.overhead_solo_s
    if per_node * nodes > 1:
        return own + found.overhead_s + found.parallel_wait_s * math.sqrt(own * 1e3) + allreduce
    return own + allreduce


def _step_seconds(offers: Sequence[Offer], c: _Columns, capable: np.ndarray, workload: Workload | None,
                  hardware: list[HardwareSpec | None], job: JobSpec, predictor: Predictor,
                  entry: EntryStep | None, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Predicted seconds per step of every capable offer (nan elsewhere), and where each came from: one
    prediction for each distinct (accelerator, count, network, hardware key) among them, broadcast. The
    entry's searched step where its search priced the offer's hardware, else the roofline of the declared
    shape (nan without one)."""
    link_code, link_names = _codes([o.interconnect for o in offers])
    link_gbs = np.array([_inter_node_gbs(text) for text in link_names])
    key_code, key_names = _codes(keys)
    key = ((c.accelerator[capable] * (int(c.count.max()) + 1) + c.count[capable]) * len(link_names)
           + link_code[capable]) * len(key_names) + key_code[capable]
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    picked = capable[first]
    specs = [hardware[int(a)] for a in c.accelerator[picked]]
    # torchrun's workers train on one accelerator each: `nproc_per_node: 1` on an 8-GPU node leaves 7 idle
    replicas = np.array([min(job.nprocs(int(n)), int(n)) for n in c.count[picked]], dtype=np.int64)
    step_unique = np.full(len(picked), np.nan) if workload is None else np.asarray(
        predictor(workload, specs, replicas, job.num_nodes, link_gbs[link_code[picked]]), dtype=float)
    source_unique = np.full(len(picked), ROOFLINE, dtype=object)
    for u, i in enumerate(picked):
        found = entry.hardware.get(keys[int(i)]) if entry is not None else None
        if found is not None and found.seconds is not None:
            step_unique[u] = _searched_step(job, entry, found, specs[u], int(c.count[i]), job.num_nodes,
                                            float(link_gbs[link_code[i]]), keys[int(i)] == HOST)
            source_unique[u] = SEARCHED
    step, source = np.full(len(offers), np.nan), np.full(len(offers), ROOFLINE, dtype=object)
    step[capable] = step_unique[inverse.ravel()]
    source[capable] = source_unique[inverse.ravel()]
    return step, source


def _capable(spec: JobSpec, offers: Sequence[Offer], workload: Workload | None, entry: EntryStep | None,
             host_providers: Sequence[str]) -> tuple[_Columns, _Filter, np.ndarray, list, list[str], np.ndarray]:
    """The offers' columns, the filter of every constraint but the step's, each offer's preference, the
    hardware spec of every distinct accelerator, each offer's hardware key, and which offers are this machine's."""
    if not offers:
        raise PlanError("the catalog has no offers. To fix: run `tfsn catalog refresh` or pass --catalog PATH")
    c = _Columns.of(offers, spec.resources.use_spot)
    f = _Filter(len(offers))
    _filter_place(f, spec.resources, c)
    preference, hardware = _filter_accelerators(f, spec.resources, c)
    keys = [hardware_key(o, hardware[int(a)], host_providers) for o, a in zip(offers, c.accelerator)]
    here = np.array([o.provider in host_providers for o in offers])
    _filter_resources(f, spec, c, memory_needed(workload, entry), here)
    return c, f, preference, hardware, keys, here


def hardware_to_search(spec: JobSpec, offers: Sequence[Offer], host_providers: Sequence[str] = ()) -> list[str]:
    """The hardware keys of the offers that meet every constraint but the step's (no memory check: the
    model's size is what the search learns), best known first: what model.entry's step is searched for."""
    c, f, _, _, keys, _ = _capable(spec, offers, None, None, host_providers)
    return list(dict.fromkeys(keys[int(i)] for i in np.flatnonzero(f.mask)))


def plan_job(spec: JobSpec, offers: Sequence[Offer], *, predictor: Predictor = step_seconds_many,
             steps: int | None = None, entry: EntryStep | None = None, host_providers: Sequence[str] = ()) -> Plan:
    """Rank the capable `offers` for `spec` by predicted run cost. Pure; raises PlanError if none is capable.
    `entry` is model.entry's searched step per hardware key (`host_providers` offer this machine's CPU)."""
    workload, is_reference = workload_of(spec)
    steps = steps or spec.steps or DEFAULT_STEPS
    sized = None if is_reference else workload     # the reference workload says nothing of the model's size
    c, f, preference, hardware, keys, here = _capable(spec, offers, sized, entry, host_providers)
    capable = np.flatnonzero(f.mask)
    if capable.size and f.emptied_by is None:
        step, source = _step_seconds(offers, c, capable, workload, hardware, spec, predictor, entry, keys)
        # why the search failed (e.g. "the loss is not a scalar tensor"): `tfsn plan` cannot show it once no offer is left
        found = [entry.hardware.get(keys[int(i)]) for i in capable if np.isnan(step[int(i)])] if entry else []
        why = sorted({h.error for h in found if h is not None and h.error})
        f.apply(~np.isnan(step), "model.entry (its step could not be searched for these offers' hardware"
                + (f": {'; '.join(why)}" if why else "") + "; and the model declares no shape to fall back on)",
                ("make model.entry's step run (its error is above)" if why else
                 "see `tfsn plan` for why the search failed") + ", or add the shape (params, layers, hidden, "
                "seq_len, batch_size) under model:")
        capable = np.flatnonzero(f.mask)
    if f.emptied_by is not None or not capable.size:
        what, fix = f.emptied_by or ("the constraints", "relax the resources")
        left = int(f.before.sum()) if f.before is not None else 0
        raise PlanError(f"no capable offer: {what} removed the last {left} offer(s) of {len(offers)}. To fix: {fix}",
                        field=f.field)
    return _ranked(spec, offers, c, capable, preference, step, steps, here, dict(
        workload=workload, reference_workload=is_reference, step_source=source, entry=entry, hardware_keys=keys))


def _ranked(spec: JobSpec, offers: Sequence[Offer], c: _Columns, capable: np.ndarray, preference: np.ndarray,
            step: np.ndarray, steps: int, here: np.ndarray, extra: dict) -> Plan:
    """The plan: run hours (spot restarts included) and cost of every capable offer, ranked; `here` marks this
    machine's offers, whose nodes start in seconds."""
    res, nodes = spec.resources, spec.num_nodes
    run_hours = steps * step / 3600
    if res.use_spot:
        run_hours = expected_spot_hours(run_hours, nodes, _checkpoint_interval_hours(spec, step, nodes))
    hours = np.where(here, HOST_STARTUP_SECONDS, STARTUP_SECONDS) / 3600 + run_hours
    market = c.market
    cost = market * (nodes + spec.recovery.spares) * hours
    finite = capable[np.isfinite(cost[capable])]
    if not finite.size:
        raise PlanError(f"no capable offer: expected spot preemptions on {nodes} node(s) would never let the run "
                        "finish. To fix: set use_spot: false, or checkpoint more often",
                        field=("resources", "use_spot"))
    order = finite[np.lexsort((finite, market[finite], cost[finite], preference[finite]))]
    cheapest = finite[market[finite] == market[finite].min()]
    naive = int(cheapest[np.argmin(cost[cheapest])])
    return Plan(offers=offers, order=order, spot=res.use_spot, nodes=nodes, spares=spec.recovery.spares,
                price=market, step_seconds=step,
                hours=hours, cost=cost, naive_index=naive, steps=steps, **extra)
