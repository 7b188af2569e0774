"""Each rank's compute time in DDP, on two real gloo processes: the CPU path (the step less the exposed
all-reduce wait) and the device path (marks on a device timeline, here a stand-in for CUDA events)."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from orchestrator.sdk import commtimer

STEPS, SLEEP_S, DEVICE_S = 12, 0.06, 0.01


class FakeDeviceClock:
    """Stands in for CUDA events on a machine without a GPU: a device clock that the test moves on as if
    kernels ran; record() marks it, seconds() is the distance between two marks."""

    def __init__(self) -> None:
        self.now = 0.0
        self.marks: list[float] = []

    def record(self) -> float:
        self.marks.append(self.now)
        return self.now

    def seconds(self, start: float, end: float) -> float:
        return end - start


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))


def steps(ddp: DistributedDataParallel, timer: commtimer.CommTimer, before_backward=lambda: None) -> list:
    x = torch.randn(8, 256)
    out = []
    for _ in range(STEPS):
        timer.step_started()
        began = time.perf_counter()
        loss = ddp(x).square().mean()
        before_backward()
        loss.backward()
        out.append(timer.take_compute(time.perf_counter() - began))
    return out


def worker(rank: int, store: str, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        # CPU path: rank 1 is slow by SLEEP_S before its backward; rank 0 waits for it in the all-reduce.
        cpu = DistributedDataParallel(model())
        slow = (lambda: time.sleep(SLEEP_S)) if rank == 1 else (lambda: None)
        cpu_compute = steps(cpu, commtimer.install(cpu), slow)
        # Device path: each parameter's gradient "runs" DEVICE_S on rank 0's device and 3x that on rank 1's,
        # the forward pass too; the CPU sleeps the same on both ranks (the device clock must not see it).
        clock = FakeDeviceClock()
        dev = DistributedDataParallel(model(), bucket_cap_mb=0.25)       # several buckets
        per_kernel = DEVICE_S * (3 if rank == 1 else 1)

        def run_kernel(*_args: object) -> None:
            clock.now += per_kernel

        dev.register_forward_pre_hook(run_kernel)
        for p in dev.parameters():
            p.register_hook(lambda grad: run_kernel())
        pending = steps(dev, commtimer.install(dev, events=clock), lambda: time.sleep(0.01))
        device = [p.resolve() if isinstance(p, commtimer.PendingCompute) else None for p in pending]
        Path(result).write_text(json.dumps({"cpu": cpu_compute, "device": device}))
    finally:
        dist.destroy_process_group()


def test_each_ranks_compute_time_on_the_cpu_path_and_on_a_device_timeline(tmp_path):
    results = [tmp_path / f"rank{r}.json" for r in range(2)]
    # spawn, not fork: a fork of this multi-threaded pytest process (servers of earlier tests) can inherit a
    # held lock and hang in the child for ever
    ranks = mp.start_processes(_entry, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=False,
                               start_method="spawn")
    deadline = time.monotonic() + 180
    try:
        while not ranks.join(timeout=5):
            assert time.monotonic() < deadline, "the two gloo ranks did not finish within 180 s"
    finally:
        for process in ranks.processes:
            process.kill()
    fast, slow = (json.loads(path.read_text()) for path in results)
    # CPU: the slow rank's compute is SLEEP_S longer; the waiting rank's wait is taken out of its step.
    gap = statistics.median(s - f for s, f in zip(slow["cpu"][2:], fast["cpu"][2:]))
    assert 0.6 * SLEEP_S < gap < 1.6 * SLEEP_S, (fast["cpu"], slow["cpu"])
    # Device: step start to the last bucket's gradients on the device clock: forward + 4 parameters' gradients.
    assert fast["device"] == [pytest.approx(5 * DEVICE_S, abs=1e-9)] * STEPS
    assert slow["device"] == [pytest.approx(15 * DEVICE_S, abs=1e-9)] * STEPS


def grouped_worker(rank: int, store: str, folder: str) -> None:
    """Each rank's DDP over a process group of its own (a data-parallel group beside a model-parallel one):
    its gradients, timed and not."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        groups = [dist.new_group([r]) for r in range(2)]
        grads = {}
        for timed in (False, True):
            ddp = DistributedDataParallel(model(), process_group=groups[rank])
            if timed:
                commtimer.install(ddp)
            torch.manual_seed(rank)
            ddp(torch.randn(8, 256)).square().mean().backward()
            grads[timed] = [p.grad for p in ddp.parameters()]
        torch.save(grads, Path(folder) / f"grouped{rank}.pt")
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_a_ddp_over_its_own_process_group_all_reduces_in_it_when_timed(tmp_path):
    """The timer's hook all-reduced every bucket over the default group, divided by its size, where DDP's
    `process_group` is the data-parallel group: a rank's gradients were averaged with ranks outside it, the
    training changed, saying nothing."""
    mp.start_processes(grouped_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        grads = torch.load(tmp_path / f"grouped{rank}.pt")
        for timed, untimed in zip(grads[True], grads[False]):
            torch.testing.assert_close(timed, untimed, rtol=0, atol=0)


def _entry(rank: int, store: str, folder: str) -> None:
    worker(rank, store, str(Path(folder) / f"rank{rank}.json"))
    # Leave as a forked rank would, without the interpreter's teardown: in the whole suite a spawned rank's
    # teardown once aborted ("terminate called without an active exception") after its results were written.
    os._exit(0)


def test_a_model_on_the_cpu_is_timed_on_the_cpu():
    assert commtimer.CommTimer().take_compute(1.0) is None                    # no all-reduce ran
    assert commtimer.CommTimer().take_compute(1.0, other_wait=0.25) == 0.75   # the checkpoint vote's wait
    timer = commtimer.CommTimer(FakeDeviceClock())
    assert timer.take_compute(1.0) is None                                     # no step mark, no bucket
