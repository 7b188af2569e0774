"""A graph's Triton program with each run of small independent kernels launched as one.

Why: a training step of a small model is bound by launches, not bytes. An optimizer's step is one kernel
per parameter (backend.foreach_decompositions), each a few programs on a GPU of 132 SMs: one after another,
even replayed from a CUDA graph, most SMs wait while each runs. Launched as one kernel, whose programs are
split among the parts by their id (`if pid < 4: part a, elif pid < 9: part b...`), they run side by side
and pay one launch; Inductor runs AdamW's foreach ops so, in one kernel for all parameters.

Kernels are combined only when nothing one writes is read or written by another (compared on the storage
each pointer reaches, through views and in-place writes). A run's kernels need not be consecutive: the
combined kernel runs at the first's place, so each later part moves earlier past the steps between, which it
may only where it reads no value they compute (through the graph's edges, transitively) and no storage one
writes is touched by the other; an extern that may write what it is not seen to (a mutating or unknown op)
is passed by none. A GPT-2 block's forward (tests/optimizer_models.py, at the benchmark's size on an H100) so
runs its q, k and v copies and attention's mask, with views, a constant and the scores' GEMM between, as two."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from optimizer.codegen.triton import PRELUDE, TritonKernel, TritonWriter, write_source
from optimizer.fusion import mutates, returns_alias
from optimizer.hardware import HardwareSpec
from optimizer.ir import Graph, Kind, Ref
from optimizer.loopnest import Group
from optimizer.schedule import Schedule

# A part's programs at most where no GPU spec says how many run at once (the interpreter, a GPU tfsn has no spec
# of): about one wave of a mid-size GPU (see part_programs).
COMBINED_PROGRAMS = 1024
# The externs of no ATen schema whose effects are known: a tuple's item, a tensor the graph holds (ir.py)
_PURE = ("getitem", "constant")
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
    combined: frozenset[str] = frozenset()      # the names of the kernels that run several groups' parts


def write_program(graph: Graph, groups: Sequence[Group], buffers: set[int], schedules: Sequence[Schedule],
                  inplace: dict[int, int] | None = None, spec: HardwareSpec | None = None,
                  combine: bool = True) -> Program:
    """The graph's kernels (triton.write_source's), each run of independent small ones (for `spec`'s GPU, see
    part_programs) combined into one kernel at its first's place, unless not `combine`: the steps in the order
    they run."""
    inplace = inplace or {}
    _, kernels = write_source(graph, groups, buffers, schedules, inplace)
    names = [None if k is None else k.name for k in kernels]
    steps: dict[int, tuple[Group, TritonKernel | None]] = {i: (g, k) for i, (g, k) in enumerate(zip(groups, kernels))}
    combined_names: set[str] = set()
    for run in combined_runs(graph, groups, kernels, inplace, spec) if combine else []:
        parts = [TritonWriter(graph, groups[i], buffers, schedules[i], f"k{i}_part", inplace, part=True).write()
                 for i in run]
        combined = _combined(f"c{run[0]}", parts)
        steps[run[0]] = (Group("kernel", tuple(n for i in run for n in groups[i].nodes)), combined)
        combined_names.add(combined.name)
        for i in run:
            names[i] = combined.name
            if i != run[0]:
                del steps[i]
    out_groups = [steps[i][0] for i in sorted(steps)]
    out_kernels = [steps[i][1] for i in sorted(steps)]
    source = PRELUDE + "\n\n".join(k.source for k in out_kernels if k is not None)
    return Program(source, out_groups, out_kernels, names, frozenset(combined_names))


def combined_runs(graph: Graph, groups: Sequence[Group], kernels: Sequence[TritonKernel | None],
                  inplace: dict[int, int], spec: HardwareSpec | None = None) -> list[list[int]]:
    """The runs of two or more groups whose kernels (write_source's) run as one launch, at the first's place:
    each combinable kernel joins the latest run it may run beside and move to (a run that starts no earlier
    than _Moves.earliest allows; _joins checks the run's own parts), or starts one."""
    moves = _Moves(graph, groups, kernels, inplace)
    runs: list[list[int]] = []
    for i, (group, kernel) in enumerate(zip(groups, kernels)):
        if not _combinable(group, kernel, spec):
            continue
        earliest = moves.earliest(i)
        run = next((r for r in reversed(runs) if r[0] >= earliest
                    and _joins(graph, inplace, [kernels[j] for j in r], kernel)), None)
        if run is None:
            runs.append([i])
        else:
            run.append(i)
    return [r for r in runs if len(r) > 1]


def part_programs(kernel: TritonKernel, spec: HardwareSpec | None) -> int:
    """The most programs a kernel may have to be a combined kernel's part: one wave of `spec`'s GPU, as many as
    its SMs hold at once at the kernel's warps. Such a kernel leaves SMs idle or finishes in one program's time,
    a few microseconds for a pointwise or row kernel, so its launch (launch_overhead_us, ~4-5 us) is much of
    its time and the parts beside it fill the SMs it leaves. A kernel of more waves is bound by its bytes or
    FLOPs, combining it saves a launch of its time's few percent while it delays the parts after it."""
    if spec is None or spec.kind != "gpu" or not spec.threads_per_unit:
        return COMBINED_PROGRAMS
    threads = dict(kernel.meta).get("num_warps", 4) * spec.simd_width
    return spec.compute_units * min(spec.blocks_per_unit, spec.threads_per_unit // threads)


def _combinable(group: Group, kernel: TritonKernel | None, spec: HardwareSpec | None) -> bool:
    """A pointwise or reduction kernel of one launch axis and few programs (a GEMM's tile or the library's
    product runs alone, and so does a split reduction, two launches; a kernel of an empty domain is not
    launched)."""
    return kernel is not None and group.kind == "kernel" and kernel.product is None and kernel.split is None \
        and len(kernel.grid) == 1 and all(group.domain) and kernel.grid[0] <= part_programs(kernel, spec)


class _Moves:
    """How early each kernel may run: past the steps before it while it needs no value one computes (read off
    the graph's edges, transitively: a value computed from one an extern between returns counts), writes no
    storage one reads or writes, reads none one writes, and none is a barrier (an extern that may write storage
    it is not seen to: a mutating ATen op, whose schema gives its writes per argument, or an op of no schema,
    whose effects are unknown)."""

    def __init__(self, graph: Graph, groups: Sequence[Group], kernels: Sequence[TritonKernel | None],
                 inplace: dict[int, int]) -> None:
        ancestors: list[int] = []       # per node, the bit set of every node its value is computed from
        for node in graph.nodes:
            bits = 0
            for i in node.inputs:
                bits |= ancestors[i] | 1 << i
            ancestors.append(bits)
        self.reads: list[set[int]] = []         # per step, the storage it reads
        self.writes: list[set[int]] = []        # ... and writes
        self.computes: list[int] = []           # ... the bit set of its group's nodes
        self.needs: list[int] = []              # ... the bit set of the nodes its values are computed from
        self.barrier: list[bool] = []
        for group, kernel in zip(groups, kernels):
            node = graph.nodes[group.nodes[0]]
            if kernel is not None:
                self.reads.append({_storage(graph, inplace, p) for p in kernel.params})
                self.writes.append({_storage(graph, inplace, o) for o in kernel.outputs})
            else:
                self.reads.append({_storage(graph, inplace, i) for i in node.inputs})
                fresh = node.kind != Kind.VIEW and not returns_alias(node) and node.op != "getitem"
                self.writes.append({node.index} if fresh else set())
            self.barrier.append(kernel is None and node.kind == Kind.EXTERN and node.op not in _PURE
                                and (mutates(node) or getattr(node.target, "_schema", None) is None))
            self.computes.append(sum(1 << n for n in set(group.nodes)))
            needs = 0
            for n in group.nodes:       # the values a kernel inlines are its members' ancestors too
                needs |= ancestors[n]
            self.needs.append(needs)

    def earliest(self, i: int) -> int:
        """The first step kernel i may run at: the one after the latest step before it that it may not pass."""
        reads, writes = self.reads[i], self.writes[i]
        for j in range(i - 1, -1, -1):
            if self.barrier[j] or self.needs[i] & self.computes[j] or writes & (self.reads[j] | self.writes[j]) \
                    or reads & self.writes[j]:
                return j + 1
        return 0


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
