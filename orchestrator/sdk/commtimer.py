"""Each rank's own compute time per step, told apart from its wait for the other ranks in DDP's all-reduce.

In synchronous data parallel training every rank's wall step time is the same: the slow rank sets
the pace and the others wait for it inside the all-reduce. Two ways to see a rank's own part:

- CPU jobs (gloo): the all-reduce runs on the CPU, so the time from the last gradient bucket
  becoming ready to the last all-reduce finishing is the exposed wait; `compute = step - wait`.
- CUDA jobs (NCCL): the comm hook runs when a collective is *enqueued*, long before the device
  does it, so a CPU clock reads a wait of ~0 on every rank and every rank's "compute" is the shared
  step time. The device timeline tells instead: a CUDA event recorded at the step's start and one
  recorded when each bucket's gradients are ready (in the hook, on the compute stream: it completes
  when the kernels that made the bucket's gradients have run). `compute = last ready - start`, on the
  device clock: the slow rank's backward ends last, the waiting ranks' ends early. The events are
  read off the training thread (the telemetry thread waits on them), so a step never synchronizes.

The hook does what DDP's default does (divide by the size of DDP's process group, then all-reduce the bucket in it),
so installing it changes no result. (No `from __future__ import annotations` here: DDP checks
the hook's annotations against the real types.)
"""
import time
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class EventClock(Protocol):
    """Marks on a device's timeline (CUDA events), and the seconds between two of them."""

    def record(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class CudaEvents:
    """CUDA events on the current stream of the current device."""

    def record(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()   # blocks the caller (the telemetry thread) until the device got there
        return start.elapsed_time(end) / 1000.0


class PendingCompute:
    """A device-timed compute time, read when its events have completed (by whoever sends it)."""

    def __init__(self, clock: EventClock, start: Any, ready: Any) -> None:
        self.clock, self.start, self.ready = clock, start, ready

    def resolve(self) -> "Optional[float]":
        try:
            return max(0.0, self.clock.seconds(self.start, self.ready))
        except RuntimeError:   # a CUDA error (the device is gone): no figure for this step
            return None


class CommTimer:
    """Per step: the exposed all-reduce wait on the CPU, or with `events` the device-timed compute."""

    def __init__(self, events: "Optional[EventClock]" = None) -> None:
        self.events = events
        self._last_ready = 0.0
        self._last_done = 0.0
        self._start: Any = None
        self._ready: Any = None

    def step_started(self) -> None:
        """Called at the start of each step: the device path marks it on the device's timeline."""
        if self.events is not None:
            self._start, self._ready = self.events.record(), None

    def hook(self, group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's default, in DDP's own process group (its data-parallel group, not always the default one)."""
        if self.events is not None:
            self._ready = self.events.record()   # the last bucket's mark is when all gradients were ready
        self._last_ready = time.perf_counter()
        tensor = bucket.buffer().div_(dist.get_world_size(group))
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self._last_done = time.perf_counter()
            return fut.value()[0]

        return future.then(done)

    def take_wait(self) -> "Optional[float]":
        """The exposed CPU wait of the step that just ended (None if no all-reduce ran), then reset."""
        wait = self._last_done - self._last_ready if self._last_done >= self._last_ready > 0 else None
        self._last_ready = self._last_done = 0.0
        return wait

    def take_compute(self, step_seconds: float, other_wait: float = 0.0) -> "Optional[float | PendingCompute]":
        """This step's compute time: a number (CPU path: the step less its waits), or a PendingCompute
        read later off the training thread (device path); None when no all-reduce ran."""
        wait = self.take_wait()
        if self.events is not None:
            start, ready, self._start, self._ready = self._start, self._ready, None, None
            return PendingCompute(self.events, start, ready) if start is not None and ready is not None else None
        if wait is None:
            return max(0.0, step_seconds - other_wait) if other_wait else None
        return max(0.0, step_seconds - wait - other_wait)


def install(model: DistributedDataParallel, events: "Optional[EventClock]" = None) -> CommTimer:
    """Time `model`'s gradient all-reduce; call before its first backward pass. A model on a CUDA device
    is timed on the device (CUDA events) unless `events` says otherwise."""
    if events is None and any(p.is_cuda for p in model.parameters()):
        events = CudaEvents()
    timer = CommTimer(events)
    model.register_comm_hook(model.process_group, timer.hook)
    return timer
