"""What the search needs of a target (a chip and the code generator for it), and nothing more.

The search (optimizer/search.py) works on loop nests and the cost model; a `Target` gives it the
schedule space of a kernel, the model's prediction of each candidate, the code of a kernel under
a schedule, and a way to build, check and time candidates on the chip when the chip is here.
The CPU target is C/OpenMP (optimizer/codegen/c_target.py), the GPU one Triton
(optimizer/codegen/triton_target.py); `target_for` picks the target of a hardware spec.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from optimizer import costmodel, space
from optimizer.costmodel import Candidates, FeatureTable, KernelFeatures
from optimizer.hardware import HardwareSpec
from optimizer.ir import Graph
from optimizer.loopnest import Group
from optimizer.schedule import Schedule


@dataclass(frozen=True)
class Timing:
    """One kernel's seconds per call in each round."""
    samples: tuple[float, ...]

    @property
    def best(self) -> float:
        """The time the kernel takes: other processes only ever add time."""
        return min(self.samples)

    @property
    def spread(self) -> float:
        """How far the machine's noise moved it (median - best): a winner by less than this is no winner."""
        return statistics.median(self.samples) - self.best


class Target(Protocol):
    """A chip and its code generator, as the search sees them. `Built` (what `build` returns per
    group) is the target's own: compiled kernels and whatever runs them."""

    spec: HardwareSpec

    def schedule_space(self, kernel: int, features: KernelFeatures) -> Candidates:
        """Every candidate schedule of one kernel (row `kernel` of the feature table)."""

    def predict(self, features: FeatureTable, candidates: Candidates, threads: int | None) -> np.ndarray:
        """The model's seconds for each candidate."""

    def launches_saved(self, graph: Graph, plan: Any, schedules: Sequence[Schedule]) -> int:
        """Launches the plan's program under `schedules` makes fewer than its kernels (kernels run as one)."""

    def render(self, graph: Graph, group: Group, buffers: set[int], schedule: Schedule,
               inplace: dict[int, int] | None) -> str:
        """The code of one group under one schedule (raises loopnest.NotFusable)."""

    def build(self, graph: Graph, variants: Sequence[tuple[Group, Sequence[Schedule]]], buffers: set[int],
              inplace: dict[int, int] | None) -> list[Any]:
        """Each group compiled once per schedule of its own: one built object per group."""

    def check(self, graph: Graph, built: Any, reference: int, candidates: Sequence[int]) -> list[bool]:
        """Whether each candidate (by index into the group's schedules) computes what the reference does."""

    def time(self, graph: Graph, kernels: Sequence[tuple[Any, int]], rounds: int, budget_s: float) -> list[Timing]:
        """Seconds per call of each (built group, schedule index), timed in the same rounds."""


class SpecModel:
    """What every target shares: its chip's schedule space and cost model, from the hardware spec."""

    def __init__(self, spec: HardwareSpec) -> None:
        self.spec = spec
        self._space = space.space_for(spec.kind)

    def schedule_space(self, kernel: int, features: KernelFeatures) -> Candidates:
        return self._space(kernel, features)

    def predict(self, features: FeatureTable, candidates: Candidates, threads: int | None) -> np.ndarray:
        return costmodel.predict_on(features, candidates, self.spec, threads=threads)

    def launches_saved(self, graph: Graph, plan: Any, schedules: Sequence[Schedule]) -> int:
        """Launches a plan's program makes fewer than its kernels: on a GPU, the runs of kernels its Triton
        program launches as one (codegen/triton_combo.py); none on a CPU, whose C kernels are each a call."""
        if self.spec.kind != "gpu":
            return 0
        from optimizer.codegen.triton import Unsupported, write_source
        from optimizer.codegen.triton_combo import combined_runs
        from optimizer.loopnest import NotFusable
        try:
            _, kernels = write_source(graph, plan.groups, plan.buffers, schedules, plan.inplace)
        except (NotFusable, Unsupported):     # no Triton program of this plan: its kernels priced one by one
            return 0
        return sum(len(run) - 1 for run in combined_runs(graph, plan.groups, kernels, plan.inplace, self.spec))


def target_for(spec: HardwareSpec, device: str | None = None) -> Target:
    """The target of a hardware spec. Every chip kind is priced by its own model. A GPU spec with the
    device its kernels run on is the Triton target (built, checked and timed there); without one, the
    C target's code only tells identical kernels apart, searched with timing=False."""
    if spec.kind == "gpu" and device is not None:
        from optimizer.codegen.triton_target import TritonTarget
        return TritonTarget(spec, device)
    from optimizer.codegen.c_target import CTarget
    return CTarget(spec)
