"""The collectives of a checkpoint save: rounds in which every rank's outcome is heard, on a gloo group of its own.

A save has steps that can fail on one rank only: reading its objects' state, making its folder, opening its
writer, writing, reading its files back. Each step is a `round`: every rank runs its part and sends the
outcome, its failure included, to rank 0, which decides and sends each rank its share. No rank leaves a round
before all have reported, so a failure on one rank fails the save on every rank in that round, in one line,
instead of leaving the others in a collective until the group's timeout. That timeout, for a rank that stops
answering (hung, or gone), is the job's own: the one its script gave `init_process_group` (torch's default
otherwise). A round that times out or loses a peer fails the save as any failure does, and the group, whose
messages may now be out of step, is made anew at the next save.

The group is gloo's, made from the default group's store but not registered with torch.distributed, as torch
makes the helper group of its own ProcessGroupWrapper: `dist.destroy_process_group()` shuts down every group
that torch.distributed knows, which ended a background save under it when a script destroyed the group before
`run.finish()`. This one lives until the save that holds it is done. (DCP's `save` asks torch.distributed for
ranks, so a save drives DCP's planner and writer itself, over this group: see `checkpoint.SaveSession.write`.)
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

Part = TypeVar("Part")
Share = TypeVar("Share")

_made = itertools.count()   # groups made by this process: each meets the others under a store prefix of its own


class RoundFailed(Exception):
    """A rank's part of a round, or rank 0's decision, raised; every rank raises this, with the same message."""


class _Failure:
    """What a rank sends for a part that raised."""

    def __init__(self, message: str) -> None:
        self.message = message


class SaveGroup:
    """The ranks of one save (or one process alone, with no communication)."""

    def __init__(self, backend: Any, rank: int, size: int, world: Any) -> None:
        self._backend, self.rank, self.size = backend, rank, size
        self._world = world   # the default process group this group was made in (None: none)
        self._broken = False  # a round's communication failed: the next save makes a new group

    @classmethod
    def renewed(cls, group: SaveGroup | None) -> SaveGroup:
        """`group` while the default process group it was made in is the current one, else a new group: collective
        over the default group (every rank calls it, in the same order); a group of one without a process group.
        RoundFailed when the other ranks do not come within the timeout."""
        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if group is not None and group._world is world and not group._broken:
            return group
        if world is None or dist.get_world_size() == 1:
            return cls(None, 0, 1, world)
        rank, size = dist.get_rank(), dist.get_world_size()
        default_store = dist.distributed_c10d._get_default_store()   # its timeout: init_process_group's
        store = dist.PrefixStore(f"tfsn-save-group/{next(_made)}/", default_store)
        try:
            return cls(dist.ProcessGroupGloo(store, rank, size, default_store.timeout), rank, size, world)
        except RuntimeError as e:   # a rank did not come within the timeout: hung, gone, or still in a failed save
            raise RoundFailed(f"rank {rank} could not meet the other ranks ({one_line(e)}); a rank is hung or "
                              "gone") from e

    def round(self, part: Callable[[], Part], decide: Callable[[list[Part]], list[Share]]) -> Share:
        """Every rank runs `part`; rank 0 gets all results in rank order, and `decide` returns each rank's share.

        Raises RoundFailed on every rank when a `part` raised (the lowest such rank's message) or `decide` did.
        Only an Exception is caught: anything else (a KeyboardInterrupt) ends this rank's save at once.
        """
        mine: Any
        cause: Exception | None = None   # what raised here, chained to the RoundFailed
        try:
            mine = part()
        except Exception as e:
            cause, mine = e, _Failure(f"rank {self.rank}: {one_line(e)}" if self.size > 1 else one_line(e))
        shares: list[Any] = []
        parts = self._communicate(self._gather, mine)
        if self.rank == 0:
            failed = next((p for p in parts if isinstance(p, _Failure)), None)
            try:
                shares = [failed] * self.size if failed is not None else decide(parts)
            except Exception as e:
                cause, shares = e, [_Failure(one_line(e))] * self.size
        share = self._communicate(self._scatter, shares)
        if isinstance(share, _Failure):
            raise RoundFailed(share.message) from cause
        return share

    def _communicate(self, collective: Callable[[Any], Any], value: Any) -> Any:
        """`collective(value)`; RoundFailed when a rank did not answer within the timeout or is gone."""
        try:
            return collective(value)
        except RuntimeError as e:   # gloo's errors (DistBackendError is one)
            self._broken = True
            raise RoundFailed(f"rank {self.rank} lost touch with the other ranks ({one_line(e)}); a rank is hung "
                              "or gone") from e

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's `value` on rank 0, in rank order ([] on the others)."""
        if self._backend is None:
            return [value]
        data = _to_tensor(value)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._backend.allgather([lengths], [torch.tensor([data.numel()], dtype=torch.int64)]).wait()
        longest = max(int(n) for n in lengths)
        received = [[torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]] if self.rank == 0 else []
        self._backend.gather(received, [_padded(data, longest)], _at_rank_0(dist.GatherOptions())).wait()
        return [_from_tensor(t, int(n)) for t, n in zip(received[0], lengths)] if received else []

    def _scatter(self, shares: list[Any]) -> Any:
        """Rank 0's `shares[r]` on each rank r (`shares` is read on rank 0 only)."""
        if self._backend is None:
            return shares[0]
        pickled: dict[int, torch.Tensor] = {}   # the same object for many ranks (a failure, a location) once
        datas = [pickled.setdefault(id(s), _to_tensor(s)) for s in shares]
        lengths = torch.tensor([d.numel() for d in datas] if datas else [0] * self.size, dtype=torch.int64)
        self._backend.broadcast([lengths], _at_rank_0(dist.BroadcastOptions())).wait()
        longest = int(lengths.max())
        received = torch.empty(longest, dtype=torch.uint8)
        sent = [[_padded(d, longest) for d in datas]] if datas else []
        self._backend.scatter([received], sent, _at_rank_0(dist.ScatterOptions())).wait()
        return _from_tensor(received, int(lengths[self.rank]))


def one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _at_rank_0(options: Any) -> Any:
    options.rootRank = 0
    return options


def _to_tensor(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)


def _padded(data: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([data, torch.zeros(length - data.numel(), dtype=torch.uint8)]) if data.numel() < length else data


def _from_tensor(data: torch.Tensor, length: int) -> Any:
    return pickle.loads(data[:length].numpy().tobytes())
