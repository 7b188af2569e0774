"""How long each rank waits for the others in DDP's gradient all-reduce.

In synchronous data parallel training every rank's wall step time is the same: the slow rank
sets the pace and the others wait for it inside the all-reduce. What tells them apart is the
wait. The fast ranks have finished their backward pass and wait long for the last bucket;
the slow rank arrives last and hardly waits. `compute time = step time - exposed wait` is
therefore the per-rank signal the straggler detector needs.

The hook does what DDP's default does (divide by the world size, then all-reduce the bucket),
so installing it changes no result. (No `from __future__ import annotations` here: DDP checks
the hook's annotations against the real types.)
"""
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class CommTimer:
    """Per-step exposed wait: from the last bucket becoming ready to the last all-reduce finishing."""

    def __init__(self) -> None:
        self._last_ready = 0.0
        self._last_done = 0.0

    def hook(self, _state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self._last_ready = time.perf_counter()
        tensor = bucket.buffer().div_(dist.get_world_size())
        future = dist.all_reduce(tensor, async_op=True).get_future()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self._last_done = time.perf_counter()
            return fut.value()[0]

        return future.then(done)

    def take_wait(self) -> "float | None":
        """The exposed wait of the step that just ended (None if no all-reduce ran), then reset."""
        wait = self._last_done - self._last_ready if self._last_done >= self._last_ready > 0 else None
        self._last_ready = self._last_done = 0.0
        return wait


def install(model: DistributedDataParallel) -> CommTimer:
    """Time `model`'s gradient all-reduce; call before its first backward pass."""
    timer = CommTimer()
    model.register_comm_hook(None, timer.hook)
    return timer
