"""Atomic, verified training checkpoints on top of torch.distributed.checkpoint (DCP).

A checkpoint is ``DIR/step_000000123/``: the DCP files (one or more ``.distcp`` per rank plus
``.metadata``, in a ``data-*`` folder of their own when the step was saved again) and
``tfsn-manifest.json`` with the sha256 of every file. ``DIR`` is a folder or an
s3://, gs:// or az:// URL (see ``ckptstore``); either way a checkpoint becomes visible only once it is
complete, so a crash at any point leaves the old set of checkpoints or the new one, never a half one.
Checksums are computed by all ranks together, each hashing its share of the files; ``restore``
verifies them the same way and falls back to the previous checkpoint when the newest is corrupt.
With a process group, every rank must call ``save``/``restore`` with the same object names (they run
collectives); a folder must be on storage shared by all ranks. ``SaveSession`` is the protocol in
steps, so that ``asyncsave`` can run the writing and the commit off the training thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import random
import re
import secrets
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from orchestrator.sdk.ckptstore import (DATA_PREFIX, MANIFEST, Location, Store, StorageUnavailable, open_store,
                                        step_of)
from orchestrator.sdk.savegroup import RoundFailed, SaveGroup, one_line
from orchestrator.sdk.statedicts import StateDictReader
from orchestrator.spec import checkpoint_url_scheme

__all__ = ["CheckpointError", "CheckpointInfo", "MANIFEST", "SaveSession", "list_checkpoints", "load_tensors",
           "restore", "save"]

FORMAT = 1
_RNG_KEY = "_tfsn_rng_rank{}"
# DCP warns on every call without a process group; single-process use is intended here.
NO_DIST_WARNING = r"torch\.distributed is (disabled|unavailable)"
# Checkpoints whose checksums this process computed or verified: (location, saved_at). Lets
# pruning skip re-hashing gigabytes on every save.
_known_good: set[tuple[str, float]] = set()
_DATA_DIR = re.compile(rf"|{DATA_PREFIX}[0-9a-f]+")
_sync_group: SaveGroup | None = None   # the collectives of `save` (an AsyncSaver has a group of its own)


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint. ``step`` is the number of completed training steps; ``path`` is a Path in a
    folder, the URL (str) on an object store."""

    step: int
    path: Location
    saved_at: float
    bytes: int
    seconds: float


class CheckpointError(Exception):
    """A checkpoint could not be saved, verified or loaded; the message says what to do."""


def save(directory: str | Path, step: int, objects: Mapping[str, object], *, keep: int = 3) -> CheckpointInfo:
    """Save ``objects`` (plus every rank's RNG state) as the checkpoint for ``step``, now; the RNGs are left as
    saved, whatever the storage library drew from them while it wrote.

    Collective when a process group is initialized: all ranks must call it. Keeps the newest
    ``keep`` valid checkpoints (always including this one) and deletes older ones. A step that is already
    saved is saved again (the newest state wins, as a second ``torch.save`` to one file would), but its
    committed copy stays until the new one is committed: a failure or a crash meanwhile leaves it as it was.
    A failure on any rank fails the save on every rank at once (see `savegroup`).
    """
    global _sync_group
    _sync_group = save_group(_sync_group, step)
    try:
        state, failure = SaveSession.state(objects), None
    except Exception as e:   # the other ranks hear of it in the save's first round, then this rank raises it
        state, failure = {}, e
    rng = state.get(_RNG_KEY.format(_dist_info()[1]))
    try:
        session = SaveSession.start(directory, step, keep, _sync_group, failure)
        session.write(state)
        return session.finish()
    finally:   # what the storage library drew (gcsfs's, botocore's retry jitter) is not the training's: a resume
        if rng is not None:   # from this checkpoint replays these states
            _set_rng_state(rng)


def save_group(group: SaveGroup | None, step: int) -> SaveGroup:
    """The group of the save of `step` (`SaveGroup.renewed`: collective); CheckpointError if the ranks do not meet."""
    try:
        return SaveGroup.renewed(group)
    except RoundFailed as e:
        raise CheckpointError(f"checkpoint {step} was not saved: {e}") from e


def check_keep(keep: int) -> None:
    """Before a save starts (an asynchronous one raises nothing else on the training thread)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")


class SaveSession:
    """One save in three collective steps, each a round of `group` (see savegroup): `start` (where to write,
    chosen by rank 0 once every rank is ready), `write` (DCP's plan, then its write) of `state()`, `finish`
    (checksums by all ranks, the commit by rank 0, pruning). A failure in a step fails it on every rank."""

    def __init__(self, store: Store, final: Location, written: Location, data: str, step: int, keep: int,
                 group: SaveGroup, started: float) -> None:
        self.store, self.final, self.written, self.data, self.group = store, final, written, data, group
        self.step, self.keep = step, keep
        self.started = started
        self._share: list[str] = []      # the files this rank hashes (`write` lists them)
        self._names: list[str] = []      # all the files written (rank 0)

    @classmethod
    def start(cls, directory: str | Path, step: int, keep: int, group: SaveGroup,
              failure: Exception | None = None) -> SaveSession:
        """Collective: every rank opens the store (or reports `failure`, its state that could not be read), then
        rank 0 picks where DCP writes. The rank with the `failure` raises it; the others a CheckpointError."""
        check_keep(keep)
        started = time.time()
        name = f"step_{step:09d}"
        stores: list[Store] = []

        def ready() -> None:
            if failure is not None:
                raise CheckpointError(f"reading the state to save failed: {_one_line(failure)}")
            stores.append(_open(directory))

        def begin(_: list[None]) -> list[tuple[Location, str]]:
            store = stores[0]
            try:
                return [store.begin(store.child(store.root, name), secrets.token_hex(6))] * group.size
            except Exception as e:
                raise CheckpointError(f"cannot write to {directory} ({_one_line(e)}); check it exists and is "
                                      "writable") from e

        try:
            written, data = group.round(ready, begin)
        except RoundFailed as e:
            if failure is not None:
                raise failure from None
            raise CheckpointError(f"checkpoint {step} was not saved: {e}") from e
        return cls(stores[0], stores[0].child(stores[0].root, name), written, data, step, keep, group, started)

    @staticmethod
    def state(objects: Mapping[str, object], reader: StateDictReader | None = None) -> dict[str, Any]:
        """What DCP writes: the objects' state dicts (through `reader` when given) and this rank's RNG states
        (read now)."""
        state = _state_dicts(objects, reader)
        state[_RNG_KEY.format(_dist_info()[1])] = _rng_state()
        return state

    def write(self, state: dict[str, Any]) -> None:
        """Collective: DCP's steps in two rounds (plans, then the data with DCP's metadata and a listing by rank 0);
        on failure the partial files are removed. The steps are those StorageWriter documents, driven here because
        DCP's `save` runs them over a group torch.distributed knows (see savegroup)."""
        planner, coordinator = DefaultSavePlanner(), self.group.rank == 0
        writers: list[StorageWriter] = []
        metadata: list[Metadata] = []

        def plan() -> SavePlan:
            self.store.prepare(self.written)
            writers.append(self.store.writer(self.written))
            planner.set_up_planner(state_dict=state, storage_meta=writers[0].storage_meta(),
                                   is_coordinator=coordinator)
            writers[0].set_up_storage_writer(coordinator)
            return writers[0].prepare_local_plan(planner.create_local_plan())

        def plan_globally(plans: list[SavePlan]) -> list[SavePlan]:
            plans, global_metadata = planner.create_global_plan(plans)
            metadata.append(global_metadata)
            return writers[0].prepare_global_plan(plans)

        def write_data() -> list[WriteResult]:
            writes = writers[0].write_data(planner.finish_plan(local_plan), planner)
            writes.wait()
            return writes.value()

        def finish_and_list(results: list[list[WriteResult]]) -> list[list[str]]:
            writers[0].finish(metadata=metadata[0], results=results)
            self._names = self.store.files(self.written)
            return [self._names[r::self.group.size] for r in range(self.group.size)]   # each rank hashes a share

        try:
            local_plan = self.group.round(plan, plan_globally)
            self._share = self.group.round(write_data, finish_and_list)
        except RoundFailed as e:
            self._discard()
            raise CheckpointError(f"writing checkpoint {self.written} failed: {e}; "
                                  "earlier checkpoints are untouched") from e

    def finish(self) -> CheckpointInfo:
        """Collective: hash the files (each rank its share), commit on rank 0, prune; the same outcome everywhere."""
        def digests() -> dict[str, str]:
            paths = [self.store.child(self.written, n) for n in self._share]
            return dict(zip(self._share, _sha256_all(self.store, paths)))

        def commit(shares: list[dict[str, str]]) -> list[CheckpointInfo]:
            files = {name: digest for share in shares for name, digest in share.items()}
            info = _commit(self.store, self.written, self.final, self.data, self.step, self.group.size,
                           self.started, {n: files[n] for n in self._names})
            try:
                if self.data:
                    self.store.remove_replaced(self.final, self.data)
                _prune(self.store, info, self.keep, self.started)
            except Exception as e:
                warnings.warn(f"pruning old checkpoints in {self.store.root} failed: {e}", stacklevel=2)
            return [info] * self.group.size

        try:
            return self.group.round(digests, commit)
        except RoundFailed as e:
            self._discard()
            raise CheckpointError(f"committing checkpoint {self.final} failed: {e}; "
                                  "earlier checkpoints are untouched") from e

    def _discard(self) -> None:
        """Rank 0, after a failed step: remove what this save wrote, unless the step's manifest names it after all
        (a failure after the commit); what cannot be removed goes with a later save."""
        if self.group.rank != 0:
            return
        with contextlib.suppress(Exception):
            if self.data and _read_manifest(self.store, self.final)["data"] == self.data:
                return
        with contextlib.suppress(Exception):
            self.store.remove(self.written)


def restore(directory: str | Path, objects: Mapping[str, object],
            skipped: list[str] | None = None) -> CheckpointInfo | None:
    """Load the newest valid checkpoint into ``objects`` in place; None when there is none.

    Collective when a process group is initialized. Corrupt or partial checkpoints are skipped
    with a warning (on rank 0), or with their reason appended to ``skipped`` where one is given;
    nothing is deleted.
    """
    distributed, rank, world_size = _dist_info()
    found: list[tuple[Location, dict[str, Any]]] | str = []

    def skip(reason: str) -> None:
        if skipped is None:
            warnings.warn(f"skipping checkpoint: {reason}", stacklevel=3)
        else:
            skipped.append(reason)
    if rank == 0:
        try:
            found = _committed(_open(directory), skip)
        except CheckpointError as e:
            found = str(e)
        except Exception as e:
            fix = ("check that this node has credentials for the bucket (train.yaml's resources.remote_identity, or "
                   "envs) and that it exists" if checkpoint_url_scheme(str(directory)) else
                   "check it is mounted and readable")
            found = f"cannot read checkpoint directory {directory}: {_one_line(e)}; {fix}"
    found = _broadcast(found, distributed)
    if isinstance(found, str):
        raise CheckpointError(found)
    store = _open(directory)
    for location, manifest in found:
        problem = _check_share(store, location, manifest["files"], rank, world_size)
        problem = next((p for p in _all_gather(problem, distributed) if p is not None), None)
        if problem is None:
            _known_good.add((str(location), manifest["saved_at"]))
            info = CheckpointInfo(manifest["step"], location, manifest["saved_at"], manifest.get("bytes", 0), 0.0)
            _load(store, info, manifest, objects)
            return info
        if rank == 0:
            skip(problem)
    return None


def _load(store: Store, info: CheckpointInfo, manifest: dict[str, Any], objects: Mapping[str, object]) -> None:
    distributed, rank, world_size = _dist_info()
    saved_world_size, files = manifest["world_size"], _dcp_files(store, info.path, manifest)
    state = _state_dicts(objects)
    rng_key = _RNG_KEY.format(rank)
    restore_rng = saved_world_size == world_size
    if restore_rng:
        state[rng_key] = None
    else:
        warnings.warn(
            f"checkpoint {info.path} was saved with world size {saved_world_size}, now {world_size}: "
            "RNG states are not restored",
            stacklevel=3,
        )
    try:
        _only_saved_optimizer_state(objects, state, store.reader(files).read_metadata().state_dict_metadata)
        with quiet_no_dist():
            dcp.load(state, storage_reader=store.reader(files), no_dist=not distributed)
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        raise CheckpointError(
            f"loading checkpoint {info.path} failed: {_one_line(e)}; pass the same objects it was saved with"
        ) from e
    _apply(objects, state)
    if restore_rng:
        _set_rng_state(state[rng_key])


def _only_saved_optimizer_state(objects: Mapping[str, object], state: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """Leave out of `state` each parameter's optimizer state the checkpoint does not hold, so that the
    optimizer is restored without it, as it was saved: Adam creates a parameter's state at its first
    gradient (a layer not trained yet has none), while DCP's state dict, read for loading, has it for all."""
    for name, obj in objects.items():
        if not isinstance(obj, torch.optim.Optimizer) or not isinstance(state[name].get("state"), dict):
            continue
        prefix = f"{name}.state."
        held = {rest.rsplit(".", depth)[0] for key in saved if key.startswith(prefix)
                for rest in [key[len(prefix):]] for depth in range(rest.count(".") + 1)}
        for fqn in [fqn for fqn in state[name]["state"] if fqn not in held]:
            del state[name]["state"][fqn]


def list_checkpoints(directory: str | Path) -> list[CheckpointInfo]:
    """Valid checkpoints in ``directory``, newest first. Reads and hashes every file; no collectives."""
    store = _open(directory)
    infos = []
    for location in store.step_dirs():
        try:
            infos.append(_verify(store, location)[0])
        except CheckpointError:
            continue
    return infos


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a verified checkpoint as ``{flattened key: tensor}``, in this process only.

    For inspection and bit-for-bit comparisons; keys look like ``model.fc.weight`` or
    ``optimizer.state.fc.weight.exp_avg``. ``path`` is a checkpoint's directory or URL.
    """
    location: Location = path if isinstance(path, str) and checkpoint_url_scheme(path) else Path(path)
    parent = str(location).rstrip("/").rsplit("/", 1)[0] if isinstance(location, str) else location.parent
    store = _open(parent)
    files = _dcp_files(store, location, _verify(store, location)[1])
    metadata = store.reader(files).read_metadata()
    tensors = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    with quiet_no_dist():
        dcp.load(tensors, storage_reader=store.reader(files), no_dist=True)
    return tensors


# --- state dicts ----------------------------------------------------------------------------


def _state_dicts(objects: Mapping[str, object], reader: StateDictReader | None = None) -> dict[str, Any]:
    """State dicts keyed by object name; modules and optimizers keyed by parameter FQN (no DDP prefix), as
    DCP's get_model_state_dict and get_optimizer_state_dict key them (or `reader`, which gives the same)."""
    owners = _owners(objects)
    state: dict[str, Any] = {}
    for name, obj in objects.items():
        if name.startswith("_tfsn"):
            raise CheckpointError(f"object name {name!r} is reserved; rename it")
        if isinstance(obj, torch.nn.Module):
            state[name] = reader.model(obj) if reader is not None else get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            model = owners[name]
            try:
                state[name] = reader.optimizer(model, obj) if reader else get_optimizer_state_dict(model, obj)
            except KeyError:   # DCP's mapping from parameters to names: checked only when it fails, off the fast path
                _check_owned(name, obj, model)
                raise
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            state[name] = obj.state_dict()
        else:
            raise CheckpointError(
                f"cannot checkpoint {name!r} ({type(obj).__name__}): pass a module, an optimizer, "
                "or an object with state_dict() and load_state_dict()"
            )
    return state


def _check_owned(name: str, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Optimizer state is keyed by the model's parameter names: each of its parameters must be the model's."""
    owned = {id(p) for p in model.parameters()}
    if any(id(p) not in owned for group in optimizer.param_groups for p in group["params"]):
        raise CheckpointError(f"optimizer {name!r} holds parameters that are not the model's (a layer replaced "
                              "after the optimizer was made?); make the optimizer after changing the model")


def _apply(objects: Mapping[str, object], state: dict[str, Any]) -> None:
    owners = _owners(objects)
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, state[name])
        elif isinstance(obj, torch.optim.Optimizer):
            # not strict: a parameter whose state the checkpoint does not hold is restored without one
            set_optimizer_state_dict(owners[name], obj, state[name], options=StateDictOptions(strict=False))
        else:
            obj.load_state_dict(state[name])  # type: ignore[attr-defined]


def _owners(objects: Mapping[str, object]) -> dict[str, torch.nn.Module]:
    """Each optimizer's module (by the optimizer's name): its state is keyed by that module's parameter names.
    With one module, that one (a parameter it does not hold is found only when DCP's mapping fails, off the fast
    path); with several (a GAN's generator and critic, a model and its EMA), the one holding all the optimizer's
    parameters."""
    modules = {name: o for name, o in objects.items() if isinstance(o, torch.nn.Module)}
    optimizers = {name: o for name, o in objects.items() if isinstance(o, torch.optim.Optimizer)}
    if optimizers and not modules:
        raise CheckpointError("optimizers need the model whose parameters they hold among the checkpointed objects; "
                              "pass it too: checkpoint(model=model, optimizer=optimizer)")
    if len(modules) == 1:
        return dict.fromkeys(optimizers, next(iter(modules.values())))
    held = {name: {id(p) for p in module.parameters()} for name, module in modules.items()}
    owners = {}
    for name, optimizer in optimizers.items():
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        holders = [module for module, ids in held.items() if wanted <= ids]
        if not holders:
            raise CheckpointError(
                f"no one of the checkpointed modules ({', '.join(modules)}) holds all of optimizer {name!r}'s "
                "parameters; pass one module holding them all (wrap several in one nn.Module), and make the "
                "optimizer after replacing a layer")
        if len(holders) > 1:
            raise CheckpointError(f"optimizer {name!r}'s parameters are held by each of {', '.join(holders)}; "
                                  "checkpoint only one of those modules")
        owners[name] = modules[holders[0]]
    return owners


def _rng_state() -> tuple[Any, ...]:
    """A tuple, so DCP stores it as one opaque blob under this rank's key."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return (torch.get_rng_state(), cuda, random.getstate(), _numpy_random_state())


def _set_rng_state(state: tuple[Any, ...]) -> None:
    cpu, cuda, python, numpy_state = state
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
    random.setstate(python)
    if numpy_state is not None:
        import numpy

        numpy.random.set_state(numpy_state)


def _numpy_random_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()


# --- files ----------------------------------------------------------------------------------


def _commit(store: Store, written: Location, final: Location, data: str, step: int, world_size: int, started: float,
            files: dict[str, str]) -> CheckpointInfo:
    """Write the manifest (the commit: see ckptstore) of the DCP files in ``written`` with their checksums; their
    names are relative to ``final`` (``written`` is ``final``'s folder ``data`` when the step is saved again)."""
    if ".metadata" not in files:
        raise CheckpointError(f"{written} has no DCP .metadata after saving")
    size = sum(store.sizes(written, list(files)).values())
    saved_at = time.time()
    manifest: dict[str, Any] = {"format": FORMAT, "step": step, "saved_at": saved_at, "world_size": world_size,
                                "bytes": size, "files": {_inside(data, n): d for n, d in files.items()}}
    if data:
        manifest["data"] = data
    store.commit(written, final, json.dumps(manifest, indent=1).encode(), data)
    _known_good.add((str(final), saved_at))
    return CheckpointInfo(step, final, saved_at, size, time.time() - started)


def _prune(store: Store, current: CheckpointInfo, keep: int, started: float) -> None:
    """Keep ``current`` and the newest ``keep - 1`` other valid checkpoints; delete older ones and stale temps."""
    kept = 1
    for location in store.step_dirs():
        if str(location) == str(current.path):
            continue
        try:
            _verify(store, location, rehash=False)
            valid = True
        except CheckpointError:
            valid = False
        if valid and kept < keep:
            kept += 1
        elif valid or step_of(location) < current.step:
            store.remove(location)
    store.remove_stale(started)


def _committed(store: Store, skip: Callable[[str], None]) -> list[tuple[Location, dict[str, Any]]]:
    """Checkpoints whose manifest is there and readable, newest first (their files still unchecked); `skip` is
    told why each other one is left out."""
    found = []
    for location in store.step_dirs():
        try:
            found.append((location, _read_manifest(store, location)))
        except CheckpointError as e:
            skip(str(e))
    return found


def _read_manifest(store: Store, location: Location) -> dict[str, Any]:
    try:
        manifest = json.loads(store.read_bytes(store.child(location, MANIFEST)))
        fields = {"step": int(manifest["step"]), "saved_at": float(manifest["saved_at"]),
                  "world_size": int(manifest["world_size"]), "files": dict(manifest["files"]),
                  "bytes": int(manifest.get("bytes", 0)), "data": str(manifest.get("data", ""))}
        if manifest["format"] != FORMAT:
            raise ValueError(f"unknown format {manifest['format']}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{location}: manifest missing or unreadable ({e}); it was not completely written") from e
    if (not _DATA_DIR.fullmatch(fields["data"]) or _inside(fields["data"], ".metadata") not in fields["files"]
            or fields["step"] != step_of(location)):
        raise CheckpointError(f"{location}: manifest does not describe this DCP checkpoint; do not use it")
    return fields


def _verify(store: Store, location: Location, *, rehash: bool = True) -> tuple[CheckpointInfo, dict[str, Any]]:
    """Check manifest, presence and sha256 of every file in this process; the info and the manifest.

    ``rehash=False`` trusts checksums this process already computed for the same checkpoint.
    """
    manifest = _read_manifest(store, location)
    known = (str(location), manifest["saved_at"]) in _known_good
    problem = _check_share(store, location, manifest["files"], 0, 1, rehash=rehash or not known)
    if problem is not None:
        raise CheckpointError(problem)
    _known_good.add((str(location), manifest["saved_at"]))
    size = manifest["bytes"] or sum(store.sizes(location, list(manifest["files"])).values())
    return CheckpointInfo(manifest["step"], location, manifest["saved_at"], size, 0.0), manifest


def _dcp_files(store: Store, location: Location, manifest: dict[str, Any]) -> Location:
    """Where a checkpoint's DCP files are: the step's own folder, or its `data` folder when it was saved again."""
    return store.child(location, manifest["data"]) if manifest["data"] else location


def _inside(data: str, name: str) -> str:
    return f"{data}/{name}" if data else name


def _check_share(store: Store, location: Location, files: dict[str, str], rank: int, world_size: int,
                 *, rehash: bool = True) -> str | None:
    """What is wrong with this rank's share of a checkpoint's files (every ``world_size``-th), or None."""
    names = sorted(files)[rank::world_size]
    try:
        present = store.sizes(location, names)
        missing = [n for n in names if n not in present]
        if missing:
            return f"{location}: files missing: {', '.join(missing)}; the checkpoint is incomplete"
        digests = _sha256_all(store, [store.child(location, n) for n in names]) if rehash else []
    except OSError as e:
        return f"{location}: cannot read it ({_one_line(e)}); check the storage is reachable"
    for name, digest in zip(names, digests):
        if digest != files[name]:
            return f"{location}: checksum mismatch in {name}; the checkpoint is corrupt"
    return None


def _sha256_all(store: Store, paths: list[Location]) -> list[str]:
    """Hash files in parallel threads (hashlib releases the GIL): checkpoints can be many GB."""

    def digest(p: Location) -> str:
        h = hashlib.sha256()
        with store.open(p) as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        return h.hexdigest()

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(paths) or 1)) as pool:
        return list(pool.map(digest, paths))


def _open(directory: str | Path) -> Store:
    try:
        return open_store(directory)
    except StorageUnavailable as e:
        raise CheckpointError(str(e)) from None


def _one_line(e: BaseException) -> str:
    """DCP exceptions carry per-rank tracebacks; CheckpointError messages stay one line."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        rank, (cause, _) = next(iter(e.failures.items()))
        return f"rank {rank}: {_one_line(cause)}"
    return one_line(e)


# --- process group --------------------------------------------------------------------------


def _dist_info() -> tuple[bool, int, int]:
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(), dist.get_world_size()
    return False, 0, 1


def _broadcast(value: Any, distributed: bool) -> Any:
    """Rank 0's ``value`` on every rank (identity without a process group)."""
    if not distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(value: Any, distributed: bool) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` without a process group)."""
    if not distributed:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


@contextlib.contextmanager
def quiet_no_dist() -> Iterator[None]:
    """Silence DCP's 'assuming single process' warning, which is expected without a process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
        yield
