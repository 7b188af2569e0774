"""The GPU target: Triton kernels (codegen/triton.py), priced by the GPU model and, where the GPU is
present, built, checked against the reference schedule and timed on it, as the CPU target does with
its C (what the search settles a kernel's launch shape by when the model's ranking is close: its
Spearman on reductions was 0.55-0.70 on an H200).

Under TRITON_INTERPRET=1 the device is this CPU: the kernels are checked and timed by the interpreter,
which tests the path, not the speed."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import torch

from optimizer import graphs, measure
from optimizer.codegen.triton import PRELUDE, TritonKernel, TritonLibrary, TritonWriter
from optimizer.hardware import HardwareSpec
from optimizer.ir import Graph
from optimizer.loopnest import Group
from optimizer.schedule import Schedule
from optimizer.target import SpecModel, Timing

log = logging.getLogger("tfsn.optimizer")

Built = tuple[list[TritonKernel], TritonLibrary]      # a group's kernels, one per schedule, and their module


class TritonTarget(SpecModel):
    """optimizer.target.Target for a GPU spec and the device its kernels run on."""

    def __init__(self, spec: HardwareSpec, device: str) -> None:
        super().__init__(spec)
        self.device = device
        self.on_gpu = torch.device(device).type == "cuda"

    def render(self, graph: Graph, group: Group, buffers: set[int], schedule: Schedule,
               inplace: dict[int, int] | None) -> str:
        return TritonWriter(graph, group, buffers, schedule, "k", inplace).write().source

    def build(self, graph: Graph, variants: Sequence[tuple[Group, Sequence[Schedule]]], buffers: set[int],
              inplace: dict[int, int] | None) -> list[Built]:
        """Every variant in one module, compiled ahead for the device on a pool of threads."""
        kernels = [[TritonWriter(graph, group, buffers, s, f"v{g}_{i}", inplace).write() for i, s in enumerate(schedules)]
                   for g, (group, schedules) in enumerate(variants)]
        lib = TritonLibrary(PRELUDE + "\n\n".join(k.source for ks in kernels for k in ks))
        lib.precompile(graph, [k for ks in kernels for k in ks])
        return [(ks, lib) for ks in kernels]

    def _on_device(self) -> Any:
        """The graph's GPU made current (Triton launches on the current device, and a sync waits for it)."""
        return torch.cuda.device(self.device) if self.on_gpu else contextlib.nullcontext()

    def check(self, graph: Graph, built: Built, reference: int, candidates: Sequence[int]) -> list[bool]:
        kernels, lib = built
        rtol = measure.TF32_RTOL if kernels[reference].tf32 else measure.RTOL
        with self._on_device():
            return measure.agree_on(graph, kernels[reference], [kernels[i] for i in candidates], lib.launcher,
                                    self.device, rtol)

    def time(self, graph: Graph, kernels: Sequence[tuple[Built, int]], rounds: int, budget_s: float) -> list[Timing]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily(), self._on_device():    # inside torch.compile fake tensors are made: ours are real
            chosen = [built[0][i] for built, i in kernels]
            tensors = {n: measure.buffer(graph, n, device=self.device) for k in chosen for n in k.params}
            calls = [(built[1].launcher(k), ([tensors[p] for p in k.params],)) for (built, _), k in zip(kernels, chosen)]
            sync = torch.cuda.synchronize if self.on_gpu else lambda: None
            recorder = graphs.recorder_for(self.device)
            graphed = _graphed(recorder, calls) if recorder is not None else None
            if graphed is None:
                return measure.time_calls(calls, rounds, budget_s, sync)
            return [Timing(tuple(s / GRAPHED_LAUNCHES for s in t.samples))
                    for t in measure.time_calls(graphed, rounds, budget_s, sync)]


# Launches of one candidate per CUDA graph it is timed in: a step's graphs replay its kernels back to back,
# so a kernel's time there is the GPU's, not Triton's launch from Python (~10-20 us, more than many kernels
# take: timed one launch at a time, every short candidate would time alike and the pick would be noise).
GRAPHED_LAUNCHES = 20


def _graphed(recorder: graphs.Recorder, calls: Sequence[tuple[Any, tuple]]) -> list[tuple[Any, tuple]] | None:
    """Each call as the replay of a graph of GRAPHED_LAUNCHES of its launches (each call made once first:
    Triton compiles nothing during a capture); None where one cannot be captured, to time them all alike
    as launched (the step would then run unrecorded too)."""
    replays = []
    for fn, args in calls:
        fn(*args)
        try:
            _, replay = recorder.capture(lambda _inputs, fn=fn, args=args: [fn(*args) for _ in range(GRAPHED_LAUNCHES)],
                                         [])
        except Exception as e:     # noqa: BLE001 - whatever the capture raised, the launches are timed instead
            log.info("tfsn search: launch shapes timed as launched, not in a CUDA graph (%s: %s)", type(e).__name__, e)
            return None
        replays.append((replay, ([],)))
    return replays
