"""Checkpoints off the critical path: the training thread copies the state to memory, a background
thread writes, checksums, commits and prunes it.

The training thread does only what must see the state of the moment: it reads the state dicts and copies
their tensors into buffers kept from one save to the next (`ReusedBuffers`, pinned when there is a GPU;
one `_foreach_copy_` for all of them, not a Python call per tensor). Everything else runs on one
writer thread kept for the whole run: agreeing with the other ranks where the save goes (a collective),
torch.distributed.checkpoint's write, the checksums, the commit and pruning. Why not DCP's `async_save`:
it builds an executor and starts a thread per call (2.7 ms per save of the example, 2 ranks on this
busy 2-core machine), and it leaves agreeing on the save's name, a collective, on the training thread
(3.3 ms), which also waited there for the slowest rank. The writer's collectives run in a gloo group of
their own (see `savegroup`), so they never interleave with the training's, and a script that destroys its
process group while the last save is written does not end that save.

At most one save is in flight: a save that finds the previous one still writing waits for it (every
rank waits, so the ranks never disagree about which saves exist; skipping would need one more vote).
The wait counts as the new save's stall, and `auto` intervals keep saves further apart than a write
takes. A save that fails in the background raises its CheckpointError from the next `save` or from
`wait`, on every rank, whichever rank it failed on (a rank whose state could not be staged too: the ranks
must go on alike, or the next save would wait for one that does not come). A crash before the commit
leaves the previous checkpoint the newest.
"""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from orchestrator.sdk.checkpoint import CheckpointInfo, SaveSession, check_keep, save_group
from orchestrator.sdk.savegroup import SaveGroup
from orchestrator.sdk.statedicts import StateDictReader


class PendingSave:
    """A save being written in the background; `result()` is its CheckpointInfo once committed."""

    def __init__(self, step: int, future: concurrent.futures.Future[CheckpointInfo]) -> None:
        self.step = step
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        return self._future.result(timeout)


class ReusedBuffers:
    """Stages a state dict by copying its tensors into buffers kept from the previous save (pinned when
    there is a GPU), all in one `_foreach_copy_`; other values are deep-copied, and so are they all when a
    tensor is not a plain one (DTensor, ShardedTensor: DCP's DefaultStager, which knows them)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._fallback: DefaultStager | None = None

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        sources: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        try:
            staged = self._place(state_dict, (), sources, targets)
        except _NotPlain:
            return self._default_stager().stage(state_dict)   # type: ignore[return-value]
        on_gpu = any(source.is_cuda for source in sources)
        if sources:   # an empty list is an error to _foreach_copy_
            with torch.no_grad():
                torch._foreach_copy_(targets, sources, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()   # the non-blocking copies must land before the step changes the weights
        return staged

    def close(self) -> None:
        self._buffers.clear()
        if self._fallback is not None:
            self._fallback.close()

    def _place(self, value: Any, path: tuple[Any, ...], sources: list[torch.Tensor],
               targets: list[torch.Tensor]) -> Any:
        """`value` with each tensor replaced by its buffer; the pairs to copy are appended to sources/targets."""
        if isinstance(value, torch.Tensor):
            if type(value) not in _PLAIN_TENSORS:
                raise _NotPlain
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                self._buffers[path] = buffer
            sources.append(value.detach())
            targets.append(buffer)
            return buffer
        if type(value) in _IMMUTABLE:   # nothing to copy
            return value
        if isinstance(value, dict):   # an OrderedDict too (model state dicts): DCP takes a plain dict
            return {key: self._place(item, (*path, key), sources, targets) for key, item in value.items()}
        if type(value) in (list, tuple):
            if all(type(item) in _IMMUTABLE for item in value):   # Python's RNG state: 625 ints
                return value if type(value) is tuple else list(value)
            return type(value)(self._place(item, (*path, i), sources, targets) for i, item in enumerate(value))
        return copy.deepcopy(value)

    def _default_stager(self) -> DefaultStager:
        if self._fallback is None:
            cuda = torch.cuda.is_available()
            self._fallback = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                          use_async_staging=False, use_non_blocking_copy=cuda))
        return self._fallback


class _NotPlain(Exception):
    """A tensor subclass in the state: staged by DCP's DefaultStager instead."""


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_IMMUTABLE = (int, float, bool, str, bytes, type(None))


class AsyncSaver:
    """Saves of one training process, each written in the background by one writer thread, one at a time."""

    def __init__(self) -> None:
        self._group: SaveGroup | None = None
        self._reader = StateDictReader()
        self._stager = ReusedBuffers()
        self._pending: PendingSave | None = None
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfsn-checkpoint")

    def save(self, directory: str | Path, step: int, objects: Mapping[str, object], *, keep: int,
             done: Callable[[CheckpointInfo | None], None] = lambda info: None) -> PendingSave:
        """Stage `objects` now and write them behind; collective like `checkpoint.save` (every rank saves,
        in the same order).

        `done` runs in the background with the committed checkpoint, or None when the save failed.
        """
        self.wait()   # one in flight: the staging buffers are the previous save's until it is written
        check_keep(keep)
        self._group = save_group(self._group, step)   # made on the first save: every rank saves
        try:
            staged, failure = self._stager.stage(SaveSession.state(objects, self._reader)), None
        except Exception as e:   # reported as any failure of the save is, on every rank: its writer tells the others
            staged, failure = {}, e
        self._pending = PendingSave(step, self._writer.submit(self._write, directory, step, keep, self._group, staged,
                                                              failure, done))
        return self._pending

    def wait(self) -> CheckpointInfo | None:
        """Wait for the save in flight; its CheckpointInfo (None if there is none). Raises its CheckpointError."""
        pending = self._pending
        if pending is None:
            return None
        try:
            return pending.result()
        finally:
            if pending.done():   # not on an interrupted wait: its buffers are still being written
                self._pending = None

    def close(self) -> None:
        """Wait for the save in flight, then free the thread and the staging memory."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            self._stager.close()

    @staticmethod
    def _write(directory: str | Path, step: int, keep: int, group: SaveGroup, staged: STATE_DICT_TYPE,
               failure: Exception | None, done: Callable[[CheckpointInfo | None], None]) -> CheckpointInfo:
        """The writer thread: the whole save protocol of `checkpoint.save`, on the staged copy (or, with
        `failure`, the staging's error, which fails the save on every rank in its first round)."""
        info = None
        try:
            session = SaveSession.start(directory, step, keep, group, failure)
            session.write(staged)
            info = session.finish()
            return info
        finally:
            done(info)
