"""A graph's Triton program with each run of small independent kernels launched as one.

Why: a training step of a small model is bound by launches, not bytes. An optimizer's step is one kernel
per parameter (backend.foreach_decompositions), each a few programs on a GPU of 132 SMs: one after another,
even replayed from a CUDA graph, most SMs wait while each runs. Launched as one kernel, whose programs are
split among the parts by their id (`if pid < 4: part a, elif pid < 9: part b...`), they run side by side
and pay one launch; Inductor runs AdamW's foreach ops so, in one kernel for all parameters.

Kernels are combined only when nothing one writes is read or written by another (compared on the storage
each pointer reaches, through views and in-place writes), and only when they are consecutive in the
program, so that running them at the first's place reorders nothing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from optimizer.codegen.triton import PRELUDE, TritonKernel, TritonWriter, write_source
from optimizer.fusion import returns_alias
from optimizer.ir import Graph, Kind, Ref
from optimizer.loopnest import Group
from optimizer.schedule import Schedule

# A part's programs at most: a kernel of more already fills the largest GPU for a few waves, and combining it
# saves a launch of its time's few percent while its registers could limit the other parts' occupancy.
COMBINED_PROGRAMS = 1024
# Pointers of one combined kernel at most (a CUDA kernel's arguments are 4 KiB; Triton adds its own).
COMBINED_POINTERS = 128


@dataclass(frozen=True)
class Program:
    """The module's source, its steps (groups and their kernels, None for an extern, in order; a combined
    kernel's group holds all its parts' nodes) and each planned group's kernel name, for `--emit`."""
    source: str
    groups: list[Group]
    kernels: list[TritonKernel | None]
    kernel_names: list[str | None]


def write_program(graph: Graph, groups: Sequence[Group], buffers: set[int], schedules: Sequence[Schedule],
                  inplace: dict[int, int] | None = None) -> Program:
    """The graph's kernels (triton.write_source's), each run of consecutive independent small ones combined."""
    inplace = inplace or {}
    _, kernels = write_source(graph, groups, buffers, schedules, inplace)
    out_groups, out_kernels, names = list(groups), list(kernels), [None if k is None else k.name for k in kernels]
    for run in reversed(combined_runs(graph, groups, kernels, inplace)):
        parts = [TritonWriter(graph, groups[i], buffers, schedules[i], f"k{i}_part", inplace, part=True).write()
                 for i in run]
        combined = _combined(f"c{run[0]}", parts)
        members = tuple(n for i in run for n in groups[i].nodes)
        out_groups[run[0]:run[-1] + 1] = [Group("kernel", members)]
        out_kernels[run[0]:run[-1] + 1] = [combined]
        for i in run:
            names[i] = combined.name
    source = PRELUDE + "\n\n".join(k.source for k in out_kernels if k is not None)
    return Program(source, out_groups, out_kernels, names)


def combined_runs(graph: Graph, groups: Sequence[Group], kernels: Sequence[TritonKernel | None],
                  inplace: dict[int, int]) -> list[list[int]]:
    """The runs of two or more consecutive groups whose kernels (write_source's) run as one launch."""
    runs: list[list[int]] = []
    for i, (group, kernel) in enumerate(zip(groups, kernels)):
        if _combinable(group, kernel) and runs and runs[-1][-1] == i - 1 and \
                _joins(graph, inplace, [kernels[j] for j in runs[-1]], kernel):
            runs[-1].append(i)
        elif _combinable(group, kernel):
            runs.append([i])
    return [r for r in runs if len(r) > 1]


def _combinable(group: Group, kernel: TritonKernel | None) -> bool:
    """A pointwise or reduction kernel of one launch axis and few programs (a GEMM's tile or the library's
    product runs alone, and so does a split reduction, two launches; a kernel of an empty domain is not
    launched)."""
    return kernel is not None and group.kind == "kernel" and kernel.product is None and kernel.split is None \
        and len(kernel.grid) == 1 and all(group.domain) and kernel.grid[0] <= COMBINED_PROGRAMS


def _joins(graph: Graph, inplace: dict[int, int], run: Sequence[TritonKernel], kernel: TritonKernel) -> bool:
    """Whether `kernel` may run side by side with the run's kernels: no storage one writes is touched by
    another, and the pointers stay within COMBINED_POINTERS."""
    if len({p for k in (*run, kernel) for p in k.params}) > COMBINED_POINTERS:
        return False
    reads = {_storage(graph, inplace, p) for p in kernel.params}
    writes = {_storage(graph, inplace, o) for o in kernel.outputs}
    return all(not writes & {_storage(graph, inplace, p) for p in k.params}
               and not reads & {_storage(graph, inplace, o) for o in k.outputs} for k in run)


def _storage(graph: Graph, inplace: dict[int, int], n: int) -> int:
    """The node whose tensor holds node n's memory: through in-place writes (a value held by the input it
    is written over), views (their base), the aliases ATen calls return (a diagonal, as_strided: their first
    argument) and getitems (the call they take from, so a split's piece is its input's). Fusion writes no input
    in place that such an alias is of; this check does not rely on it."""
    while True:
        node = graph.nodes[n]
        if n in inplace:
            n = inplace[n]
        elif (node.kind == Kind.VIEW or returns_alias(node) or node.op == "getitem") and node.args \
                and isinstance(node.args[0], Ref):
            n = node.args[0].index
        else:
            return n


def _combined(name: str, parts: Sequence[TritonKernel]) -> TritonKernel:
    """One kernel running `parts` (written with TritonWriter(part=True)): each its own range of program ids,
    its pointers among the combined kernel's (each distinct tensor once), on the most warps any part asked for."""
    params = list(dict.fromkeys(p for k in parts for p in k.params))
    lines = ["@triton.jit", f"def {name}({', '.join(f'p{i}' for i in range(len(params)))}):",
             "    pid = tl.program_id(0)"]
    start = 0
    for n, k in enumerate(parts):
        pointers = [f"p{params.index(p)}" for p in k.params]
        constexprs = [f"{key}={value}" for key, value in k.meta if key not in ("num_warps", "num_stages")]
        call = f"{k.name}({', '.join([*pointers, f'pid - {start}' if start else 'pid', *constexprs])})"
        start += k.grid[0]
        test = "else:" if n == len(parts) - 1 else f"{'if' if n == 0 else 'elif'} pid < {start}:"
        lines += [f"    {test}", f"        {call}"]
    warps = max(dict(k.meta).get("num_warps", 4) for k in parts)
    source = "\n\n".join([*(k.source for k in parts), "\n".join(lines) + "\n"])
    outputs = tuple(dict.fromkeys(o for k in parts for o in k.outputs))
    return TritonKernel(name, source, tuple(params), outputs, (start,), (("num_warps", warps),))
