"""Checkpoints off the critical path: the training thread copies the state to memory, a background
thread writes, checksums, commits and prunes it (torch.distributed.checkpoint's `async_save`).

At most one save is in flight: a save that finds the previous one still writing waits for it (every
rank waits, so the ranks never disagree about which saves exist; skipping would need one more vote).
The wait counts as the new save's stall, and `auto` intervals keep saves further apart than a write
takes. The staging buffers (pinned memory when there is a GPU) are kept and reused from one save
to the next (`ReusedBuffers`: one copy per tensor; DCP's DefaultStager deep-copies the whole state,
which made a save call take 15-80 ms instead of 3-20 ms for a 0.4M-parameter model with AdamW on this
busy 2-core machine). The background's collectives run in a process group of their own, so they never
interleave with the training's. A save that fails in the background raises its CheckpointError from
the next `save` or from `wait`; a crash before the commit leaves the previous checkpoint the newest.
"""

from __future__ import annotations

import concurrent.futures
import copy
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from orchestrator.sdk.checkpoint import NO_DIST_WARNING, CheckpointInfo, SaveSession


class PendingSave:
    """A save being written in the background; `result()` is its CheckpointInfo once committed."""

    def __init__(self, step: int, future: concurrent.futures.Future[CheckpointInfo]) -> None:
        self.step = step
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        return self._future.result(timeout)


class ReusedBuffers(AsyncStager):
    """Stages a state dict by copying each tensor into a buffer kept from the previous save (pinned when
    there is a GPU); other values are deep-copied, and so are they all when a tensor is not a plain one
    (DTensor, ShardedTensor: DCP's DefaultStager, which knows them)."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._fallback: DefaultStager | None = None

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        if not _plain(state_dict):
            if self._fallback is None:
                cuda = torch.cuda.is_available()
                self._fallback = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                              use_async_staging=False, use_non_blocking_copy=cuda))
            return self._fallback.stage(state_dict)   # type: ignore[return-value]
        staged = self._copy(state_dict, ())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()   # the non-blocking copies must land before the step changes the weights
        return staged

    def synchronize_staging(self) -> None:
        """Nothing: `stage` returns once the copies are done."""

    def close(self) -> None:
        self._buffers.clear()
        if self._fallback is not None:
            self._fallback.close()

    def _copy(self, value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                self._buffers[path] = buffer
            return buffer.copy_(value.detach(), non_blocking=value.is_cuda)
        if isinstance(value, (int, float, str, bytes)) or value is None:   # immutable: nothing to copy
            return value
        if isinstance(value, dict):   # an OrderedDict too (model state dicts): DCP takes a plain dict
            return {key: self._copy(item, (*path, key)) for key, item in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self._copy(item, (*path, i)) for i, item in enumerate(value))
        return copy.deepcopy(value)


def _plain(value: Any) -> bool:
    """No tensor subclass anywhere in `value` (dicts, lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return type(value) in (torch.Tensor, torch.nn.Parameter)
    if isinstance(value, dict):
        return all(_plain(item) for item in value.values())
    if type(value) in (list, tuple):
        return all(_plain(item) for item in value)
    return True


class AsyncSaver:
    """Saves of one training process, each written in the background, one at a time."""

    def __init__(self) -> None:
        self._group: Any = None
        self._stager: ReusedBuffers | None = None
        self._pending: PendingSave | None = None
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfsn-checkpoint")

    def save(self, directory: str | Path, step: int, objects: Mapping[str, object], *, keep: int,
             done: Callable[[CheckpointInfo | None], None] = lambda info: None) -> PendingSave:
        """Stage `objects` now and write them behind; collective like `checkpoint.save`.

        `done` runs in the background with the committed checkpoint, or None when the save failed.
        """
        self.wait()   # one in flight: the staging buffers are the previous save's until it is written
        state = SaveSession.state(objects)
        session = SaveSession.start(directory, step, keep, self._checkpoint_group())
        try:
            if not session.distributed:   # DCP warns from its own thread, out of reach of a catch_warnings
                warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
            upload = dcp.async_save(state, storage_writer=session.writer(), process_group=session.group,
                                    async_stager=self._staging(), no_dist=not session.distributed)
        except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
            session.failed(e)
        self._pending = PendingSave(step, self._writer.submit(self._complete, session, upload, done))
        return self._pending

    def wait(self) -> CheckpointInfo | None:
        """Wait for the save in flight; its CheckpointInfo (None if there is none). Raises its CheckpointError."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        """Wait for the save in flight, then free the thread and the staging memory."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    @staticmethod
    def _complete(session: SaveSession, upload: concurrent.futures.Future[Any],
                  done: Callable[[CheckpointInfo | None], None]) -> CheckpointInfo:
        info = None
        try:
            try:
                upload.result()
            except (Exception, dcp.CheckpointException) as e:
                session.failed(e)
            info = session.finish()
            return info
        finally:
            done(info)

    def _checkpoint_group(self) -> Any:
        """A gloo group for the background's collectives, made on the first save (collective: all ranks save)."""
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _staging(self) -> ReusedBuffers:
        # Synchronous: the copy is the stall the step pays, and it must end before the step goes on.
        if self._stager is None:
            self._stager = ReusedBuffers()
        return self._stager

