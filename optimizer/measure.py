"""Timing of candidate kernels on this machine: the last step of the search, and the ground truth
of the cost model's accuracy benchmark.

The variants are compiled by one gcc run per CPU at once (each a C file of whole groups), are called through ctypes on buffers of
the group's real shapes and strides filled with random values, and are timed round-robin (each
round times every variant once) so that a burst of noise on a shared machine hits all of them alike.
A variant's time is its best round: other processes only ever add time, and a parallel kernel whose
second thread was descheduled by another process can take 10x longer in one round; the spread of
its rounds tells a win from a close call (search.Tie). A variant the search times has first given
the same output as its group's reference schedule on the same inputs (`agree`).
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from optimizer.codegen import compiler
from optimizer.codegen.c import Kernel, KernelWriter, library_source
from optimizer.ir import Graph
from optimizer.loopnest import Group
from optimizer.schedule import Schedule
from optimizer.target import Timing

log = logging.getLogger("tfsn.optimizer")

TARGET_BATCH_S = 0.001        # calls per timed batch: enough to last this long (timer resolution, noise)
# A candidate's error allowed near zero, relative to its output's largest value: sums in another order
# differ by ~eps x sqrt(length) x their terms, and a squashing epilogue keeps that error while it shrinks
# the output (tanh(x @ w), K = 16384: 2e-4 between the library and the generated GEMM; 1e-5 failed K = 256).
ABS_TOLERANCE = 1e-3
RTOL = 1e-4
# fp32 products in TF32 (where torch allowed it): operands rounded to 10 bits of mantissa, by cuBLAS and by
# Triton each its own way; a product's relative error is then ~2^-10, not fp32's
TF32_RTOL = 1e-2


def buffer(graph: Graph, n: int, generator: torch.Generator | None = None, device: str = "cpu") -> torch.Tensor:
    """A tensor of node n's shape, strides and dtype on `device`: random floats and booleans (`generator`
    on that device; a candidate that gets a mask wrong then writes other values), zero integers (an index of
    zeros is valid for any op that reads it, where a random one could read out of bounds). The values are
    written into the storage, which is then viewed with the node's strides: a broadcast input (stride 0,
    elements sharing memory) refuses an in-place fill."""
    t = graph.nodes[n].type
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.strides)) if all(t.shape) else 0
    storage = torch.empty(extent, dtype=getattr(torch, t.dtype), device=device)
    if storage.is_floating_point():
        storage.normal_(generator=generator)
    elif storage.dtype == torch.bool:
        storage.copy_(torch.rand(extent, generator=generator, device=device) < 0.5)
    else:
        storage.zero_()
    return storage.as_strided(t.shape, t.strides)


def c_function(lib: ctypes.CDLL, kernel: Kernel) -> Callable[..., None]:
    """A C kernel of `lib`, called with its parameters' data pointers."""
    fn = getattr(lib, kernel.name)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * len(kernel.params)
    return fn


def c_call(lib: ctypes.CDLL, kernel: Kernel) -> Callable[[Sequence[torch.Tensor]], None]:
    """A C kernel of `lib` as a call on its parameters' tensors."""
    fn = c_function(lib, kernel)
    return lambda tensors: fn(*[t.data_ptr() for t in tensors])


def agree(graph: Graph, reference: Kernel, candidates: Sequence[Kernel], lib: ctypes.CDLL) -> list[bool]:
    """Whether each C candidate (a schedule of the reference's group, in the same library) writes what
    the reference writes (agree_on)."""
    return agree_on(graph, reference, candidates, lambda k: c_call(lib, k))


def agree_on(graph: Graph, reference: Any, candidates: Sequence[Any],
             call: Callable[[Any], Callable[[Sequence[torch.Tensor]], None]], device: str = "cpu",
             rtol: float = RTOL) -> list[bool]:
    """Whether each candidate (a schedule of the reference's group; `call(kernel)` runs one on its
    parameters' tensors) writes what the reference writes from the same seeded inputs, each run on its
    own copy of every buffer (a kernel may write over an input): floats to `rtol` (at least their dtype's
    eps) and atol ABS_TOLERANCE x the largest finite reference magnitude, NaN where the reference has NaN; integers
    and bools exactly. Why: a schedule the generator gets wrong must never win on speed (tinygrad's
    BEAM_VALIDATE)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():     # inside torch.compile the ambient mode makes fake tensors: ours are real
        generator = torch.Generator().manual_seed(0)
        params = dict.fromkeys(p for k in (reference, *candidates) for p in k.params)
        inputs = {n: buffer(graph, n, generator) for n in params}

        def run(kernel: Any) -> dict[int, torch.Tensor]:
            buffers = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                       for n, t in inputs.items()}
            for n, t in inputs.items():      # the whole storage: a kernel addresses it by the node's strides
                buffers[n].untyped_storage().copy_(t.untyped_storage())
            call(kernel)([buffers[p] for p in kernel.params])
            return {n: buffers[n].cpu() for n in kernel.outputs}

        want = run(reference)
        return [_agrees(lambda: run(k), want, rtol) for k in candidates]


def _agrees(run: Callable[[], dict[int, torch.Tensor]], want: dict[int, torch.Tensor], rtol: float) -> bool:
    """Whether a candidate's run writes `want`; False where it cannot run: a GPU compiler refuses a launch
    shape it has not the resources for (Triton's OutOfResources), which the model only estimates."""
    try:
        return same_outputs(run(), want, rtol)
    except Exception as e:     # noqa: BLE001 - whatever the compiler or the launch raises: not a candidate
        log.warning("tfsn search: a candidate failed to run (%s: %s)", type(e).__name__, e)
        return False


def same_outputs(got: dict[int, torch.Tensor], want: dict[int, torch.Tensor], rtol: float = RTOL) -> bool:
    """Whether a candidate's outputs are the reference's, by agree's tolerances."""
    if got.keys() != want.keys():
        return False
    for n, w in want.items():
        if not w.is_floating_point():
            if not torch.equal(got[n], w):
                return False
            continue
        finite = w[torch.isfinite(w)]
        scale = finite.abs().max().item() if finite.numel() else 0.0
        # never finer than the dtype's own step: two right sums of a bf16 or fp16 product, in other orders (a
        # tile and the library's), round to neighbouring values one ulp apart (up to eps relative)
        close = max(rtol, torch.finfo(w.dtype).eps)
        if not torch.allclose(got[n], w, rtol=close, atol=ABS_TOLERANCE * scale, equal_nan=True):
            return False
    return True


def build_variants(graph: Graph, group: Group, buffers: set[int], schedules: Sequence[Schedule],
                   prefix: str = "v") -> tuple[list[Kernel], ctypes.CDLL]:
    """The group written once per schedule, compiled as one library."""
    return build_groups(graph, [(group, schedules)], buffers, prefix)[0]


def build_groups(graph: Graph, variants: Sequence[tuple[Group, Sequence[Schedule]]], buffers: set[int],
                 prefix: str = "v", inplace: dict[int, int] | None = None) -> list[tuple[list[Kernel], ctypes.CDLL]]:
    """Several groups, each written once per schedule of its own, compiled as one library per CPU
    (gcc runs side by side, the groups split between them by source size); `inplace` as the plan's
    (fusion.in_place_writes), so that what is timed and checked is the code that will run."""
    kernels = [[KernelWriter(graph, group, buffers, s, f"{prefix}{g}_{i}", inplace).write()
                for i, s in enumerate(schedules)] for g, (group, schedules) in enumerate(variants)]
    size = [sum(len(k.source) for k in ks) for ks in kernels]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    chunks: list[list[int]] = [[] for _ in range(max(1, min(len(kernels), cpus)))]
    for g in sorted(range(len(kernels)), key=lambda g: -size[g]):      # the largest into the lightest
        min(chunks, key=lambda c: sum(size[i] for i in c)).append(g)
    with ThreadPoolExecutor(len(chunks)) as pool:
        paths = list(pool.map(lambda c: compiler.build_library(library_source([k for g in c for k in kernels[g]])),
                              chunks))
    libs: dict[int, ctypes.CDLL] = {}
    for chunk, path in zip(chunks, paths):
        libs.update(dict.fromkeys(chunk, compiler.load_library(path)))
    return [(ks, libs[g]) for g, ks in enumerate(kernels)]


def time_variants(graph: Graph, kernels: Sequence[Kernel], lib: ctypes.CDLL, rounds: int = 5,
                  budget_s: float = 10.0) -> list[float]:
    """Seconds per call of each kernel of one library (a group's schedules): the best of `rounds`."""
    return [t.best for t in time_rounds(graph, [(k, lib) for k in kernels], rounds, budget_s)]


def time_kernels(graph: Graph, kernels: Sequence[tuple[Kernel, ctypes.CDLL]], rounds: int = 5,
                 budget_s: float = 10.0) -> list[float]:
    """Seconds per call of each (kernel, its library), timed in the same rounds: the best of `rounds`."""
    return [t.best for t in time_rounds(graph, kernels, rounds, budget_s)]


def time_rounds(graph: Graph, kernels: Sequence[tuple[Kernel, ctypes.CDLL]], rounds: int = 5,
                budget_s: float = 10.0) -> list[Timing]:
    """Each (kernel, its library)'s seconds per call in each of the same `rounds`."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():     # inside torch.compile the ambient mode makes fake tensors: ours are real
        return _time(graph, kernels, rounds, budget_s)


def _time(graph: Graph, kernels: Sequence[tuple[Kernel, ctypes.CDLL]], rounds: int, budget_s: float) -> list[Timing]:
    tensors = {n: buffer(graph, n) for k, _ in kernels for n in k.params}
    calls = [(c_function(lib, k), [tensors[p].data_ptr() for p in k.params]) for k, lib in kernels]
    return time_calls(calls, rounds, budget_s)


def time_calls(calls: Sequence[tuple[Callable, Sequence[Any]]], rounds: int = 5, budget_s: float = 10.0,
               sync: Callable[[], None] = lambda: None) -> list[Timing]:
    """Each (function, its arguments)'s seconds per call in each of the same `rounds` (round-robin, batches
    of calls lasting TARGET_BATCH_S): what every candidate is timed by, a kernel or an ATen call. `sync`
    waits for the calls made so far (a GPU's launches return before their kernels end)."""
    batches = []
    round_s = 0.0
    for fn, args in calls:
        fn(*args)                                                    # warm: page faults, caches
        sync()
        t0 = time.perf_counter()
        fn(*args)
        sync()
        once = time.perf_counter() - t0
        n = max(1, min(1000, int(TARGET_BATCH_S / max(once, 1e-7))))
        batches.append((fn, args, n))
        round_s += n * once
    rounds = max(1, min(rounds, int(budget_s / max(round_s, 1e-9))))
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for i, (fn, args, n) in enumerate(batches):
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn(*args)
            sync()
            samples[i].append((time.perf_counter() - t0) / n)
    return [Timing(tuple(s)) for s in samples]
