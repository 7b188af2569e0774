"""The parts of a training step outside its captured graphs, measured on this machine by `tfsn calibrate`.

A job's step on local nodes is its forward and backward (what the planner times, or the search prices) plus
three things the graphs do not hold: DDP's gradient all-reduce between the nodes' processes (gloo over
loopback, each process one core's share), the optimizer's update (torch.optim.AdamW, the default foreach
implementation, many small ATen ops per parameter tensor), and the framework around a compiled step (dynamo's
guards, AOTAutograd's wrappers, the autograd engine, DDP's hooks). None runs at a memory roofline here: gloo
pays a round trip per message and copies through the kernel, AdamW a dispatch per op and tensor, the framework
its Python. All are measured with one thread per process, as local workers run. The update is the fastest of
its rounds (as most figures of `tfsn calibrate`: on a shared machine noise only ever slows a run down), fitted
as a line: fixed + per tensor x tensors + per element x elements. The all-reduce's latency is the fastest tiny
all-reduce between barriers. The rest is read off a data-parallel step of a Linear as a worker's loop runs it
(compiled, DDP, AdamW, the SDK's vote), the median of back-to-back steps, at two sizes: a 4x4 one's step less
its update and latency is the fixed share every step pays; what 768 KiB more gradient adds, less its larger
update, is the loop's all-reduce rate (at most that gradient's all-reduce alone between barriers); the 4x4
one's step in one process alone, less its update, the fixed share of a one-process job. Why the median and the
loop here: the job's measured step is a median, and the drift between ranks and the wake-ups at each
collective are no noise but part of every step (between barriers a gloo all-reduce of a few MiB moved 1.5-5
GB/s here; in the loop, a fraction of that).

What being one of two ranks costs a step beyond the same step alone is measured with both processes running,
DDP with the vote against no collective, switched in blocks of steps (so the machine's drift weighs on both):
at no compute (a tiny Linear: the fixed share) and at a few milliseconds of compute with as small a gradient
(PAYLOAD): what the payload adds beyond the fixed share, over the square root of its step alone, is the wait
of a 1 ms step. Why the square root: each rank's own delays (a wake-up, another process on its core) add up
like a random walk over the step, and at each collective one rank waits for the other; on this 2-core VM
the wait of steps from 2 to 50 ms alone followed it, where a share proportional to the step overshot the
long ones. DDP's broadcast of a model's buffers at every forward is measured the same way, on and off.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from optimizer.threads import torch_threads

# The all-reduce's latency: a tiny message between barriers (what each DDP bucket pays at least)
LATENCY_FLOATS = 256
# The data-parallel loop steps timed: a Linear too small to cost anything (the fixed share) and one with
# 768 KiB of gradients, one DDP bucket (the rate at which the loop all-reduces gradients)
LOOP_LINEARS = ((4, 4), (256, 768))
# times the loop probe is taken where noise made the larger Linear's step add nothing beyond its update
LOOP_TRIES = 3
# process pairs the loop probe runs in, each figure their median: one pair's rate swung from 0.3 to 1.0 GB/s
# between runs here (two processes on two cores settle into faster or slower rhythms), a median of 3 holds
LOOP_PAIRS = 3
# (tensors, elements each) of the optimizer sets timed: the fixed cost, the per-tensor and the per-element
UPDATE_SETS = ((1, 1024), (96, 1024), (4, 1 << 18))
# (width, layers, rows) of the compute payload whose data-parallel step is timed against its step alone
PAYLOAD = (64, 4, 2048)

_ALLREDUCE_CHILD = r"""
import json, os, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
store, rank, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
out = {}
for key, n in zip(("latency", "isolated"), json.loads(sys.argv[4])):
    x = torch.ones(n)
    for _ in range(3):
        dist.all_reduce(x)
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    out[key] = min(times)
import copy
from torch.nn.parallel import DistributedDataParallel as DDP
BLOCK, vote, linears = 5, torch.zeros(2, dtype=torch.float64), json.loads(sys.argv[5])


def middle(times):
    # the median of the times (the upper one of an even count)
    return sorted(times)[len(times) // 2]


def loop_step(net, parallel, **ddp):
    # one step of `net` as a worker's loop runs it: compiled, DDP (`parallel`) with the SDK's vote, AdamW
    model = DDP(net, **ddp) if parallel else net
    step = torch.compile(model, backend="aot_eager", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run(x):
        step(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if parallel:
            dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    return run


# a data-parallel step as a worker's loop pays it: dynamo's guards, AOTAutograd's wrappers, autograd, DDP's
# hooks and its all-reduce, AdamW, and the one tiny all-reduce per step in which tfsn's SDK votes on
# checkpoints; steps back to back, no barrier between them, so the ranks' drift and each collective's
# wake-ups are in it as they are in a job
for inputs, outputs in linears:
    run, x = loop_step(torch.nn.Linear(inputs, outputs), True), torch.randn(2, inputs)
    times = []
    dist.barrier()
    for i in range(3 * rounds + 5):
        t0 = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - t0)
    out[f"step_{inputs}x{outputs}"] = middle(times[5:])


def sides(steps, inputs):
    # median seconds of two ways to run a step (steps[True], steps[False]: callables of inputs), switched every
    # BLOCK steps after a barrier, the first of each block left out: the ranks' rhythm and the machine's drift
    # weigh on both alike
    times = {True: [], False: []}
    for i in range(2 * BLOCK * (rounds // 2 + 2)):
        side = (i // BLOCK) % 2 == 0
        if i % BLOCK == 0:
            dist.barrier()
        t0 = time.perf_counter()
        steps[side](inputs)
        if i >= 2 * BLOCK and i % BLOCK:
            times[side].append(time.perf_counter() - t0)
    return middle(times[True]), middle(times[False])


# what DDP's broadcast of a module's buffers (broadcast_buffers, its default: a collective at every forward) adds
# to such a step: the tiny Linear with a buffer, its broadcast switched on and off
net = torch.nn.Linear(*linears[0])
net.register_buffer("seen", torch.zeros(1))
on, off = loop_step(net, True), loop_step(copy.deepcopy(net), True, broadcast_buffers=False)
with_broadcast, without = sides({True: on, False: off}, torch.randn(2, net.in_features))
out["broadcast"] = with_broadcast - without
# a data-parallel step against the same step alone (both processes at once, no collective) at two sizes: the
# tiny Linear, and a payload of compute with a small gradient (Linear layers over many rows): what being one of
# two ranks adds at no compute, and with some
width, layers, rows = json.loads(sys.argv[6])
tiny = torch.nn.Linear(*linears[0])
for key, net, x in (("tiny", tiny, torch.randn(2, tiny.in_features)),
                    ("payload", torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]),
                     torch.randn(rows, width))):
    out[f"{key}_parallel"], out[f"{key}_alone"] = sides({True: loop_step(net, True),
                                                         False: loop_step(copy.deepcopy(net), False)}, x)
if rank == 0:
    print(json.dumps(out), flush=True)
dist.destroy_process_group()
os._exit(0)      # gloo's teardown at interpreter exit aborts now and then (SIGABRT) after the figures are out
"""


class NoisyProbe(RuntimeError):
    """A probe whose figures noise made meaningless every time it was taken: to be run on an idle machine."""


@dataclass(frozen=True)
class StepFigures:
    allreduce_latency_us: float      # an all-reduce of a tiny gradient between two local processes
    allreduce_gbs: float             # bytes of gradient a data-parallel loop all-reduces per second beyond, GB/s
    step_overhead_us: float          # a data-parallel step's fixed share: guards, wrappers, autograd, hooks, sync
    step_overhead_solo_us: float     # the fixed share of a job's only process: guards, wrappers, autograd
    parallel_overhead_us: float      # what a data-parallel step pays beyond the same step alone, at no compute,
                                     # its gradient's all-reduce aside
    parallel_wait_us: float          # ... more where that step alone takes 1 ms: it grows as the square root of that
                                     # time (each rank's own delays add up like a random walk; the other waits)
    buffer_broadcast_us: float       # what DDP's broadcast of a model's buffers at each forward adds to a step
    update_fixed_us: float           # torch.optim.AdamW.step: per call
    update_tensor_us: float          # per parameter tensor
    update_element_ns: float         # per parameter element


def _step_key(inputs: int, outputs: int) -> str:
    return f"step_{inputs}x{outputs}"


def _gradient_floats(inputs: int, outputs: int) -> int:
    return inputs * outputs + outputs               # weight and bias


def measure_data_parallel(rounds: int, timeout_s: float = 120.0) -> dict[str, float]:
    """Seconds, between two processes of this machine: `latency`, a tiny gloo all-reduce between barriers;
    `isolated`, the larger Linear's gradient all-reduced so; and per Linear of LOOP_LINEARS (`step_IxO`), the
    median data-parallel loop step of it, update included."""
    with tempfile.TemporaryDirectory(prefix="tfsn-calibrate-") as folder:
        store = str(Path(folder) / "store")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        alone = [LATENCY_FLOATS, _gradient_floats(*LOOP_LINEARS[-1])]     # all-reduced between barriers
        args = [str(rounds), json.dumps(alone), json.dumps(LOOP_LINEARS), json.dumps(PAYLOAD)]
        procs = [subprocess.Popen([sys.executable, "-c", _ALLREDUCE_CHILD, store, str(rank), *args], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        try:
            outs = [p.communicate(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    times = _probe_figures(outs[0][0])
    if times is None:
        tail = " | ".join(line for out in outs for line in out[1].strip().splitlines()[-2:])
        raise RuntimeError(f"the all-reduce probe failed (exit codes {[p.returncode for p in procs]}): {tail[-500:]}")
    return times


def _probe_figures(stdout: str) -> dict | None:
    """Rank 0's figures, or None when it did not print them: a child that dies after printing (gloo's teardown
    can abort) still measured everything, so the exit code alone does not decide."""
    lines = stdout.strip().splitlines()
    try:
        times = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    keys = ["latency", "isolated", "broadcast", "tiny_parallel", "tiny_alone", "payload_parallel",
            "payload_alone"] + [_step_key(*linear) for linear in LOOP_LINEARS]
    if not isinstance(times, dict) or not all(isinstance(times.get(k), (int, float)) for k in keys):
        return None
    return times


def measure_update(rounds: int) -> tuple[float, float, float]:
    """(fixed, per tensor, per element) seconds of torch.optim.AdamW.step with one thread, least squares over
    UPDATE_SETS (each the fastest of `rounds` steps), each clamped at zero."""
    import torch

    rows, seconds = [], []
    with torch_threads(1):
        for tensors, elements in UPDATE_SETS:
            params = [torch.nn.Parameter(torch.randn(elements)) for _ in range(tensors)]
            for p in params:
                p.grad = torch.randn(elements)
            opt = torch.optim.AdamW(params, lr=1e-3)
            opt.step()                                        # the state is made at the first step
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            rows.append((1.0, tensors, tensors * elements))
            seconds.append(min(times))
    fit, *_ = np.linalg.lstsq(np.array(rows), np.array(seconds), rcond=None)
    fixed, per_tensor, per_element = (max(float(v), 0.0) for v in fit)
    return fixed, per_tensor, per_element


def measure_solo_step(rounds: int) -> float:
    """The median back-to-back step of the tiny Linear in this process alone, as a one-process job runs it
    (compiled, AdamW; no DDP, no collective), update included."""
    import torch

    with torch_threads(1):
        inputs, outputs = LOOP_LINEARS[0]
        model = torch.nn.Linear(inputs, outputs)
        step = torch.compile(model, backend="aot_eager", dynamic=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(2, inputs)
        times = []
        for _ in range(3 * rounds + 5):
            t0 = time.perf_counter()
            step(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
    return float(np.median(times[5:]))


def measure(quick: bool = False) -> StepFigures:
    """The figures, from the loop steps of LOOP_LINEARS: the tiny one's, less its update and its DDP bucket's
    latency, is the fixed share (in one process alone, less its update, a one-process job's); the gradient
    bytes the larger one adds over the time it adds beyond its larger update, the loop's all-reduce rate (its
    few extra MFLOPs, some microseconds, are left in). Against the same steps alone: the tiny model's data-parallel
    step adds a fixed share (at least its bucket's round trip), and what the payload's adds beyond that and its
    own gradient's all-reduce, over the square root of its step alone in ms, is a 1 ms step's wait. A probe
    whose noise left no rate or no wait is taken again."""
    rounds = 10 if quick else 30
    fixed, per_tensor, per_element = measure_update(rounds)
    params = [_gradient_floats(*linear) for linear in LOOP_LINEARS]       # two tensors each
    update = [fixed + 2 * per_tensor + n * per_element for n in params]
    width, layers, _ = PAYLOAD
    for _ in range(LOOP_TRIES):
        pairs = [measure_data_parallel(rounds) for _ in range(1 if quick else LOOP_PAIRS)]
        times = {key: float(np.median([pair[key] for pair in pairs])) for key in pairs[0]}
        step = [times[_step_key(*linear)] for linear in LOOP_LINEARS]
        added = step[1] - step[0] - (update[1] - update[0])
        if added <= 0:      # noise slowed the tiny loop: its bytes over no time would be no rate at all
            continue
        latency = times["latency"]
        # no faster than the same gradient all-reduced alone between barriers: a noisy loop whose larger Linear
        # added a few microseconds would otherwise give a rate no loop reaches
        isolated = times["isolated"] - latency
        alone = 4 * (params[1] - LATENCY_FLOATS) / isolated if isolated > 0 else math.inf
        rate = min(4 * (params[1] - params[0]) / added, alone)
        parallel = max(times["tiny_parallel"] - times["tiny_alone"], latency)
        payload = times["payload_parallel"] - times["payload_alone"] - 4 * layers * _gradient_floats(width, width) / rate
        if payload > parallel:  # else noise slowed the payload's steps alone as much as its data-parallel ones
            break
    else:
        raise NoisyProbe(f"the data-parallel loop probe was too noisy {LOOP_TRIES} times (the larger Linear's step "
                         f"took no longer than the tiny one's beyond its update, or a data-parallel step of "
                         f"{times['payload_alone'] * 1e3:.1f} ms of compute waited no longer than one of none)")
    wait = (payload - parallel) / math.sqrt(times["payload_alone"] * 1e3)
    overhead = max(step[0] - update[0] - latency, 0.0)
    solo = max(measure_solo_step(rounds) - update[0], 0.0)
    broadcast = max(times["broadcast"], latency)      # a collective: a round trip at least
    # figures of a spec are > 0: a fitted zero is written as the smallest the spec's rounding keeps
    return StepFigures(allreduce_latency_us=max(latency * 1e6, 1e-3), allreduce_gbs=max(rate / 1e9, 1e-3),
                       step_overhead_us=max(overhead * 1e6, 1e-3), step_overhead_solo_us=max(solo * 1e6, 1e-3),
                       parallel_overhead_us=max((parallel - latency) * 1e6, 1e-3), parallel_wait_us=wait * 1e6,
                       buffer_broadcast_us=broadcast * 1e6, update_fixed_us=max(fixed * 1e6, 1e-3),
                       update_tensor_us=max(per_tensor * 1e6, 1e-3), update_element_ns=max(per_element * 1e9, 1e-3))
