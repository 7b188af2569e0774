"""Atomic, verified training checkpoints on top of torch.distributed.checkpoint (DCP).

A checkpoint is ``directory/step_000000123/``: the DCP files (one or more ``.distcp`` per rank
plus ``.metadata``) and ``tfsn-manifest.json`` with the sha256 of every file. DCP writes into a
``.tmp-*`` sibling and rank 0 renames it into place only after the manifest is durable, so a
crash at any point leaves either the old set of checkpoints or the new one, never a half one.
``restore`` verifies checksums and falls back to the previous checkpoint when the newest is
corrupt. With a process group, every rank must call ``save``/``restore`` with the same object
names (they run collectives); the directory must be on storage shared by all ranks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["CheckpointError", "CheckpointInfo", "list_checkpoints", "load_tensors", "restore", "save"]

MANIFEST = "tfsn-manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_RNG_KEY = "_tfsn_rng_rank{}"
# DCP warns on every call without a process group; single-process use is intended here.
_NO_DIST_WARNING = r"torch\.distributed is (disabled|unavailable)"
# Checkpoints whose checksums this process computed or verified: (path, saved_at). Lets
# pruning skip re-hashing gigabytes on every save.
_known_good: set[tuple[str, float]] = set()


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint on disk. ``step`` is the number of completed training steps."""

    step: int
    path: Path
    saved_at: float
    bytes: int
    seconds: float


class CheckpointError(Exception):
    """A checkpoint could not be saved, verified or loaded; the message says what to do."""


def save(directory: str | Path, step: int, objects: Mapping[str, object], *, keep: int = 3) -> CheckpointInfo:
    """Save ``objects`` (plus every rank's RNG state) as the checkpoint for ``step``.

    Collective when a process group is initialized: all ranks must call it. Keeps the newest
    ``keep`` valid checkpoints (always including this one) and deletes older ones.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    start = time.time()
    directory = Path(directory)
    distributed, rank, world_size = _dist_info()
    nonce = _broadcast(secrets.token_hex(6) if rank == 0 else None, distributed)
    final = directory / f"step_{step:09d}"
    tmp = directory / f".tmp-{final.name}-{nonce}"

    state = _state_dicts(objects)
    state[_RNG_KEY.format(rank)] = _rng_state()
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        with _quiet_no_dist():
            dcp.save(state, checkpoint_id=tmp, no_dist=not distributed)
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing checkpoint {tmp} failed: {_one_line(e)}; earlier checkpoints are untouched") from e

    outcome: CheckpointInfo | str | None = None
    if rank == 0:
        try:
            outcome = _commit(tmp, final, step, world_size, start, nonce)
        except (OSError, CheckpointError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = f"committing checkpoint {final} failed: {_one_line(e)}; earlier checkpoints are untouched"
        else:
            try:
                _prune(directory, outcome, keep, start)
            except OSError as e:
                warnings.warn(f"pruning old checkpoints in {directory} failed: {e}", stacklevel=2)
    # The broadcast doubles as the final barrier: no rank continues before the rename.
    outcome = _broadcast(outcome, distributed)
    if isinstance(outcome, str):
        raise CheckpointError(outcome)
    return outcome


def restore(directory: str | Path, objects: Mapping[str, object]) -> CheckpointInfo | None:
    """Load the newest valid checkpoint into ``objects`` in place; None when there is none.

    Collective when a process group is initialized. Corrupt or partial checkpoints are skipped
    with a warning; nothing is deleted.
    """
    directory = Path(directory)
    distributed, rank, world_size = _dist_info()
    found: tuple[CheckpointInfo, int] | str | None = None
    if rank == 0:
        try:
            found = _newest_valid(directory)
        except OSError as e:
            found = f"cannot read checkpoint directory {directory}: {e}; check it is mounted and readable"
    found = _broadcast(found, distributed)
    if isinstance(found, str):
        raise CheckpointError(found)
    if found is None:
        return None
    info, saved_world_size = found

    state = _state_dicts(objects)
    rng_key = _RNG_KEY.format(rank)
    restore_rng = saved_world_size == world_size
    if restore_rng:
        state[rng_key] = None
    else:
        warnings.warn(
            f"checkpoint {info.path} was saved with world size {saved_world_size}, now {world_size}: "
            "RNG states are not restored",
            stacklevel=2,
        )
    try:
        with _quiet_no_dist():
            dcp.load(state, checkpoint_id=info.path, no_dist=not distributed)
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        raise CheckpointError(
            f"loading checkpoint {info.path} failed: {_one_line(e)}; pass the same objects it was saved with"
        ) from e
    _apply(objects, state)
    if restore_rng:
        _set_rng_state(state[rng_key])
    return info


def list_checkpoints(directory: str | Path) -> list[CheckpointInfo]:
    """Valid checkpoints in ``directory``, newest first. Reads and hashes every file; no collectives."""
    infos = []
    for path in _step_dirs(Path(directory)):
        try:
            infos.append(_verify(path)[0])
        except CheckpointError:
            continue
    return infos


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a verified checkpoint as ``{flattened key: tensor}``, in this process only.

    For inspection and bit-for-bit comparisons; keys look like ``model.fc.weight`` or
    ``optimizer.state.fc.weight.exp_avg``.
    """
    path = Path(path)
    _verify(path)
    metadata = dcp.FileSystemReader(path).read_metadata()
    tensors = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    with _quiet_no_dist():
        dcp.load(tensors, checkpoint_id=path, no_dist=True)
    return tensors


# --- state dicts ----------------------------------------------------------------------------


def _state_dicts(objects: Mapping[str, object]) -> dict[str, Any]:
    """State dicts keyed by object name; modules and optimizers keyed by parameter FQN (no DDP prefix)."""
    model = _the_model(objects)
    state: dict[str, Any] = {}
    for name, obj in objects.items():
        if name.startswith("_tfsn"):
            raise CheckpointError(f"object name {name!r} is reserved; rename it")
        if isinstance(obj, torch.nn.Module):
            state[name] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            state[name] = get_optimizer_state_dict(model, obj)
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            state[name] = obj.state_dict()
        else:
            raise CheckpointError(
                f"cannot checkpoint {name!r} ({type(obj).__name__}): pass a module, an optimizer, "
                "or an object with state_dict() and load_state_dict()"
            )
    return state


def _apply(objects: Mapping[str, object], state: dict[str, Any]) -> None:
    model = _the_model(objects)
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, state[name])
        elif isinstance(obj, torch.optim.Optimizer):
            set_optimizer_state_dict(model, obj, state[name])
        else:
            obj.load_state_dict(state[name])  # type: ignore[attr-defined]


def _the_model(objects: Mapping[str, object]) -> torch.nn.Module | None:
    """The module optimizers belong to: optimizer state is keyed by this module's parameter names."""
    modules = [o for o in objects.values() if isinstance(o, torch.nn.Module)]
    if any(isinstance(o, torch.optim.Optimizer) for o in objects.values()) and len(modules) != 1:
        raise CheckpointError(
            f"optimizers need exactly one module among the checkpointed objects, got {len(modules)}; "
            "pass the model that owns the optimizer's parameters (wrap several in one nn.Module)"
        )
    return modules[0] if modules else None


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


def _commit(tmp: Path, final: Path, step: int, world_size: int, start: float, nonce: str) -> CheckpointInfo:
    """Checksum the DCP files, write the manifest durably, then rename ``tmp`` to ``final``."""
    names = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    if ".metadata" not in names:
        raise CheckpointError(f"{tmp} has no DCP .metadata after saving")
    files = dict(zip(names, _sha256_all([tmp / n for n in names])))
    saved_at = time.time()
    manifest = {"format": FORMAT, "step": step, "saved_at": saved_at, "world_size": world_size, "files": files}
    partial = tmp / (MANIFEST + ".partial")
    with open(partial, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, tmp / MANIFEST)
    _fsync_dir(tmp)
    if final.exists():
        aside = final.parent / f".tmp-{final.name}-{nonce}-old"
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)
    _known_good.add((str(final), saved_at))
    size = sum((final / n).stat().st_size for n in names)
    return CheckpointInfo(step, final, saved_at, size, time.time() - start)


def _prune(directory: Path, current: CheckpointInfo, keep: int, start: float) -> None:
    """Keep ``current`` and the newest ``keep - 1`` other valid checkpoints; delete older ones and stale temps."""
    kept = 1
    for path in _step_dirs(directory):
        if path == current.path:
            continue
        try:
            _verify(path, rehash=False)
            valid = True
        except CheckpointError:
            valid = False
        if valid and kept < keep:
            kept += 1
        elif valid or _step_of(path) < current.step:
            shutil.rmtree(path, ignore_errors=True)
    for tmp in directory.glob(".tmp-*"):
        if tmp.stat().st_mtime < start:
            shutil.rmtree(tmp, ignore_errors=True)


def _newest_valid(directory: Path) -> tuple[CheckpointInfo, int] | None:
    for path in _step_dirs(directory):
        try:
            return _verify(path)
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint: {e}", stacklevel=3)
    return None


def _verify(path: Path, *, rehash: bool = True) -> tuple[CheckpointInfo, int]:
    """Check manifest, presence and sha256 of every file; return the info and the saved world size.

    ``rehash=False`` trusts checksums this process already computed for the same checkpoint.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        step, saved_at, world_size = int(manifest["step"]), float(manifest["saved_at"]), int(manifest["world_size"])
        files: dict[str, str] = dict(manifest["files"])
        if manifest["format"] != FORMAT:
            raise ValueError(f"unknown format {manifest['format']}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: manifest missing or unreadable ({e}); it was not completely written") from e
    if ".metadata" not in files or step != _step_of(path):
        raise CheckpointError(f"{path}: manifest does not describe this DCP checkpoint; do not use it")
    paths = [path / name for name in files]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path}: files missing: {', '.join(missing)}; the checkpoint is incomplete")
    if rehash or (str(path), saved_at) not in _known_good:
        for name, digest in zip(files, _sha256_all(paths)):
            if digest != files[name]:
                raise CheckpointError(f"{path}: checksum mismatch in {name}; the checkpoint is corrupt")
        _known_good.add((str(path), saved_at))
    size = sum(p.stat().st_size for p in paths)
    return CheckpointInfo(step, path, saved_at, size, 0.0), world_size


def _step_dirs(directory: Path) -> list[Path]:
    """``step_*`` directories, highest step first; ``.tmp-*`` leftovers are never listed."""
    if not directory.is_dir():
        return []
    dirs = [p for p in directory.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(dirs, key=_step_of, reverse=True)


def _step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else -1


def _sha256_all(paths: list[Path]) -> list[str]:
    """Hash files in parallel threads (hashlib releases the GIL): checkpoints can be many GB."""

    def digest(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        return h.hexdigest()

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(paths) or 1)) as pool:
        return list(pool.map(digest, paths))


def _one_line(e: BaseException) -> str:
    """DCP exceptions carry per-rank tracebacks; CheckpointError messages stay one line."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        rank, (cause, _) = next(iter(e.failures.items()))
        return f"rank {rank}: {_one_line(cause)}"
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


@contextlib.contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """Silence DCP's 'assuming single process' warning, which is expected without a process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        yield
