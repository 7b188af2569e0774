"""Checkpoints off the critical path: the training thread copies the state to memory, a background
thread writes, checksums, commits and prunes it (torch.distributed.checkpoint's `async_save`).

At most one save is in flight: a save that finds the previous one still writing waits for it (every
rank waits, so the ranks never disagree about which saves exist; skipping would need one more vote).
The wait counts as the new save's stall, and `auto` intervals keep saves further apart than a write
takes. The staging buffers (pinned memory when there is a GPU) are kept and reused from one save
to the next. The background's collectives run in a process group of their own, so they never
interleave with the training's. A save that fails in the background raises its CheckpointError from
the next `save` or from `wait`; a crash before the commit leaves the previous checkpoint the newest.
"""

from __future__ import annotations

import concurrent.futures
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

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


class AsyncSaver:
    """Saves of one training process, each written in the background, one at a time."""

    def __init__(self) -> None:
        self._group: Any = None
        self._stager: DefaultStager | None = None
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

    def _staging(self) -> DefaultStager:
        if self._stager is None:
            cuda = torch.cuda.is_available()
            # Synchronous: the copy is the stall the step pays, and it must end before the step goes on.
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager

