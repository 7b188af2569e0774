"""The CPU target: C/OpenMP kernels (codegen/c.py), priced by the CPU model and timed here through
ctypes (optimizer/measure.py)."""
from __future__ import annotations

import ctypes
from typing import Sequence

from optimizer import measure
from optimizer.codegen.c import Kernel, KernelWriter
from optimizer.ir import Graph
from optimizer.loopnest import Group
from optimizer.schedule import Schedule
from optimizer.target import SpecModel, Timing

Built = tuple[list[Kernel], ctypes.CDLL]      # a group's kernels, one per schedule, and their library


class CTarget(SpecModel):
    """optimizer.target.Target for C/OpenMP (for a GPU spec: its model, with C to tell kernels apart)."""

    def render(self, graph: Graph, group: Group, buffers: set[int], schedule: Schedule,
               inplace: dict[int, int] | None) -> str:
        return KernelWriter(graph, group, buffers, schedule, "k", inplace).write().source

    def build(self, graph: Graph, variants: Sequence[tuple[Group, Sequence[Schedule]]], buffers: set[int],
              inplace: dict[int, int] | None) -> list[Built]:
        return measure.build_groups(graph, variants, buffers, inplace=inplace)

    def check(self, graph: Graph, built: Built, reference: int, candidates: Sequence[int]) -> list[bool]:
        kernels, lib = built
        return measure.agree(graph, kernels[reference], [kernels[i] for i in candidates], lib)

    def time(self, graph: Graph, kernels: Sequence[tuple[Built, int]], rounds: int, budget_s: float) -> list[Timing]:
        return measure.time_rounds(graph, [(built[0][i], built[1]) for built, i in kernels], rounds=rounds,
                                   budget_s=budget_s)
