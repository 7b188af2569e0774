"""Fusion: which values are written to memory, and which ops share one loop nest.

The answer is data, a list of `Group`s in execution order, so that a search can rewrite it.
The default here is greedy and local: a pointwise value is inlined into its readers unless it is
needed as a tensor or is costly to recompute; a node joins an open group of the same loop
domain when it reads one of its members or shares an input with them, and the result lowers to
one loop nest (optimizer.loopnest). Reductions over the same axes share a row loop (LayerNorm, softmax,
cross-entropy); pointwise ops on a GEMM's output become its epilogue.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Sequence

from optimizer.ir import Graph, Kind, Node, Ref
from optimizer.loopnest import Group, NotFusable, fused_nodes, gemm_fits, lower, row_shapes
from optimizer.ops import EXPENSIVE

INLINE_MAX_COST = 12         # a value read several times is recomputed (not stored) up to this cost;
                             # exp counts 4: softmax recomputes exp(x - max) rather than storing it


@dataclass
class Plan:
    groups: list[Group]      # execution order
    buffers: set[int]        # nodes whose value is written to memory by a kernel
    inplace: dict[int, int] = field(default_factory=dict)   # value -> graph input it is written over


@dataclass(frozen=True)
class Choice:
    """The fusion decisions a search makes, as departures from the greedy heuristic's own."""
    store: frozenset[int] = frozenset()        # pointwise values written once, though the heuristic recomputes them
    recompute: frozenset[int] = frozenset()    # values the heuristic stores, recomputed in each reader instead
    split: frozenset[int] = frozenset()        # GEMMs whose pointwise readers run as a kernel of their own


DEFAULT_CHOICE = Choice()


def decision_points(graph: Graph, gemm: bool = True) -> list[tuple[str, int]]:
    """Every fusion decision of this graph the search may flip: ("store" | "recompute", node) for a
    pointwise value read by several kernels, ("split", matmul) for a GEMM with an epilogue."""
    need = needs_tensor(graph)
    default = choose_buffers(graph)
    points: list[tuple[str, int]] = []
    for node in graph.nodes:
        if node.kind == Kind.POINTWISE and node.index not in need and len(compute_readers(graph, node.index)) > 1:
            points.append(("recompute" if node.index in default else "store", node.index))
        elif node.kind == Kind.MATMUL and gemm and gemm_fits(graph, node.index) and any(
                graph.nodes[r].kind == Kind.POINTWISE for r in compute_readers(graph, node.index) if r >= 0):
            points.append(("split", node.index))
    return points


def choice_of(points: list[tuple[str, int]], flipped: tuple[bool, ...]) -> Choice:
    """The Choice that flips the decision points marked True."""
    picked = [p for p, f in zip(points, flipped) if f]
    return Choice(store=frozenset(n for kind, n in picked if kind == "store"),
                  recompute=frozenset(n for kind, n in picked if kind == "recompute"),
                  split=frozenset(n for kind, n in picked if kind == "split"))


@dataclass
class _Open:
    kind: str
    nodes: list[int]
    domain: tuple[int, ...]
    reduced: tuple[int, ...] = ()
    reads: set[int] = field(default_factory=set)

    def frozen(self) -> Group:
        return Group(self.kind, tuple(self.nodes), self.domain, self.reduced)


def _graph_answer(graph: Graph, name: str, answer: Callable[[Graph], object]) -> object:
    """`answer(graph)`, once per graph: kept in graph.memo (a graph's nodes never change once built). Why: a
    search plans a graph up to ~50 times (search.MAX_PLANS) and these answers depend on the graph alone; each
    plan computed them again (on an AdamW step of ~1,000 nodes, a fifth of a plan's time)."""
    key = ("fusion", name)
    if key not in graph.memo:
        graph.memo[key] = answer(graph)
    return graph.memo[key]


def needs_tensor(graph: Graph) -> frozenset[int]:
    """Values that must exist as tensors: graph outputs, extern arguments and GEMM operands
    (and, through views, the bases of those)."""
    return _graph_answer(graph, "needs_tensor", _needs_tensor)


def _needs_tensor(graph: Graph) -> frozenset[int]:
    need: set[int] = set()

    def mark(i: int) -> None:
        while i not in need:
            need.add(i)
            node = graph.nodes[i]
            if node.kind != Kind.VIEW:
                return
            i = node.args[0].index

    for node in graph.nodes:
        if node.kind in (Kind.EXTERN, Kind.MATMUL):
            for i in node.inputs:
                mark(i)
    for o in graph.outputs:
        if isinstance(o, Ref):
            mark(o.index)
    return frozenset(need)


def choose_buffers(graph: Graph) -> frozenset[int]:
    """Which computed values are written to memory (the rest are inlined into their readers): the heuristic's
    choice, which a search's Choice departs from."""
    return _graph_answer(graph, "choose_buffers", _choose_buffers)


def _choose_buffers(graph: Graph) -> frozenset[int]:
    need = needs_tensor(graph)
    buffers = {n.index for n in graph.nodes if n.kind in (Kind.REDUCE, Kind.MATMUL)}
    buffers |= {i for i in need if graph.nodes[i].kind == Kind.POINTWISE}
    cost: dict[int, int] = {}
    for node in graph.nodes:
        if node.kind != Kind.POINTWISE:
            continue
        own = 4 if node.op in EXPENSIVE else 1
        cost[node.index] = own + sum(cost.get(i, 0) for i in node.inputs if i not in buffers)
    for node in reversed(graph.nodes):
        if node.kind != Kind.POINTWISE or node.index in buffers:
            continue
        readers = compute_readers(graph, node.index)
        # a value broadcast to its readers is stored once rather than recomputed per element; not a
        # single element: the C writer computes that once per kernel, before its loops
        broadcast = node.type.numel > 1 and any(graph.nodes[r].type.numel > node.type.numel for r in readers if r >= 0)
        if len(readers) > 1 and (cost[node.index] > INLINE_MAX_COST or broadcast and cost[node.index] > 1):
            buffers.add(node.index)
    return frozenset(buffers)


def compute_readers(graph: Graph, n: int) -> set[int]:
    """The non-view nodes that read n, directly or through views."""
    found, todo = set(), list(graph.nodes[n].users)
    while todo:
        u = todo.pop()
        if u >= 0 and graph.nodes[u].kind == Kind.VIEW:
            todo += graph.nodes[u].users
        else:
            found.add(u)
    return found


def plan(graph: Graph, gemm: bool = True, choice: Choice = DEFAULT_CHOICE) -> Plan:
    """The fusion plan of a graph under `choice` (default: the heuristic's); `gemm=False` leaves
    every matmul to ATen."""
    need = needs_tensor(graph)
    buffers = set((choose_buffers(graph) | choice.store) - (choice.recompute - need))

    @lru_cache(maxsize=None)
    def reads(n: int) -> frozenset[int]:
        """Materialized values node n reads once its inlined inputs are expanded."""
        out: set[int] = set()
        for i in graph.nodes[n].inputs:
            kind = graph.nodes[i].kind
            if kind == Kind.VIEW or (kind == Kind.POINTWISE and i not in buffers):
                out |= reads(i)
            else:
                out.add(i)
        return frozenset(out)

    groups: list[Group] = []
    open_groups: list[_Open] = []
    owner: dict[int, _Open] = {}

    def close(group: _Open) -> None:
        open_groups.remove(group)
        groups.append(group.frozen())     # a GEMM alone too: one library call, or our own micro-kernel
        for n in group.nodes:
            owner.pop(n, None)

    def close_owners(deps, keep: _Open | None = None, everything: bool = False) -> None:
        for g in list(open_groups):
            if g is not keep and (everything or any(owner.get(d) is g for d in deps)):
                close(g)

    def fits(group: _Open, n: int, reduced: tuple[int, ...]) -> bool:
        """Whether the group with n, reducing `reduced`, is one loop nest."""
        return writable(graph, Group(group.kind, (*group.nodes, n), group.domain, reduced), buffers)

    placed: set[int] = set()
    for node, early in sums_early(graph, scalars_first(graph), buffers, reads):
        n = node.index
        if n in placed:
            continue
        if node.kind == Kind.INPUT or (node.kind == Kind.POINTWISE and n not in buffers):
            continue
        if node.kind == Kind.VIEW:
            if n in need and not pointer_view(graph, n, gemm):   # a view some extern reads: a torch view of its base
                close_owners(reads(n))
                groups.append(Group("extern", (n,)))
            continue
        deps = reads(n)
        if node.kind == Kind.EXTERN or (node.kind == Kind.MATMUL and not (gemm and gemm_fits(graph, n))):
            # an op that writes over a tensor (copy_ into an input) runs after every kernel before it,
            # since one still open may read the old value
            close_owners(deps, everything=mutates(node))
            groups.append(Group("extern", (n,)))
            continue
        if node.kind == Kind.MATMUL:
            close_owners(deps)
            g = _Open("gemm", [n], node.type.shape, reads=set(deps))
            open_groups.append(g)
            owner[n] = g
            continue
        if node.kind == Kind.REDUCE:
            domain = graph.nodes[node.args[0].index].type.shape
            reduced = node.params["dims"]
        else:
            domain, reduced = node.type.shape, None
        joined = None
        for g in reversed(open_groups):
            reads_member = any(owner.get(d) is g for d in deps)
            same = g.domain == domain and (reduced is None or (g.kind == "kernel" and g.reduced == reduced)) \
                or reduced is None and g.kind == "kernel" and domain in row_shapes(g.domain, g.reduced)
            # a reduction of a stored pointwise value (a bias gradient) sums it in the pass that computes it
            summed = reduced is not None and g.kind == "kernel" and not g.reduced and g.domain == domain \
                and reads_member
            related = reads_member or bool(g.reads & deps) or domain == ()
            split = g.kind == "gemm" and g.nodes[0] in choice.split
            if (same and related or summed) and not split and fits(g, n, g.reduced or reduced or ()):
                joined = g
                break
        if early and joined is None:     # no kernel to join yet: the sum waits for its place in the graph
            continue
        close_owners(deps, keep=joined)
        placed.add(n)
        if joined is None:
            joined = _Open("kernel", [], domain, reduced or ())
            open_groups.append(joined)
        joined.reduced = joined.reduced or reduced or ()
        joined.nodes.append(n)
        joined.reads |= {d for d in deps if owner.get(d) is not joined}
        owner[n] = joined
    for g in list(open_groups):
        close(g)
    result = Plan(groups, buffers)
    gemms = [(i, g) for i, g in enumerate(groups) if g.kind == "gemm" and g.nodes[0] not in need]
    if gemms:                   # a GEMM read only by its own epilogue needs no buffer
        readers: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            for n in fused_nodes(graph, buffers, g):
                for r in graph.nodes[n].inputs:
                    if not readers.get(r) or readers[r][-1] != i:
                        readers.setdefault(r, []).append(i)
        for i, g in gemms:
            if readers.get(g.nodes[0], []) == [i]:
                buffers.discard(g.nodes[0])
    result.inplace = in_place_writes(graph, groups, buffers)
    return result


COPY_INTO = "aten.copy_.default"


def in_place_writes(graph: Graph, groups: list[Group], buffers: set[int]) -> dict[int, int]:
    """The input mutations (`copy_(input, value)` at the end of a graph: the optimizer's updates of
    parameters and moments, BatchNorm's running stats) whose value the kernel computing it can
    write straight over the input, with the copy_ steps so replaced removed from `groups`.

    Why: a copy per mutated tensor per step, and a buffer allocated for each new value, cost as
    much as the update itself on a small model. Safe only when no step after that kernel reads the
    input's old value (directly or through a view), the kernel reads it only at the element it
    writes, before writing it (loopnest.lower checks that), and neither the input nor the value is
    also a graph output."""
    copies = [n for n in graph.nodes if n.op == COPY_INTO and n.kind == Kind.EXTERN and len(n.args) >= 2
              and not n.users]
    if not copies:
        return {}
    outputs = {o.index for o in graph.outputs if isinstance(o, Ref)}
    step_of = {n: k for k, g in enumerate(groups) if g.kind != "extern" for n in g.nodes}
    readers: dict[int, list[int]] = {}       # value -> the steps that read it, in order
    for j, g in enumerate(groups):
        for v in _base_reads(graph, buffers, g):
            readers.setdefault(v, []).append(j)

    def chosen(lowers: Callable[[Group, dict[int, int]], bool]) -> tuple[dict[int, int], dict[int, dict[int, int]],
                                                                       set[int]]:
        """The writes taken in the copies' order, each where `lowers` says its kernel is one loop nest with it
        and the writes taken before it into that kernel; the same by kernel (step); the copy_ steps they replace."""
        done: dict[int, int] = {}
        into: dict[int, dict[int, int]] = {}
        targets: set[int] = set()
        removed: set[int] = set()
        for copy in copies:
            dst, src = (a.index if isinstance(a, Ref) else None for a in copy.args[:2])
            if dst is None or src is None or dst in targets or src in done or dst in outputs or src in outputs:
                continue
            target, value = graph.nodes[dst], graph.nodes[src]
            k = step_of.get(src)
            if target.kind != Kind.INPUT or value.kind != Kind.POINTWISE or value.type != target.type or k is None:
                continue
            group = groups[k]
            if group.kind != "kernel" or group.reduced or group.domain != value.type.shape or src not in buffers:
                continue
            later = any(j > k and groups[j].nodes != (copy.index,) for j in readers.get(dst, ()))
            if later or _views_escape(graph, dst, outputs) or _aliased_by_extern(graph, dst):
                continue
            if not lowers(group, {**into.get(k, {}), src: dst}):
                continue
            done[src] = into.setdefault(k, {})[src] = dst
            targets.add(dst)
            removed.add(copy.index)
        return done, into, removed

    # Each kernel lowered once with every write it may take, and only where one does not lower, write by write
    # as it takes them. Equal answers: a nest that lowers with some writes lowers with fewer (lower's checks are
    # of the inputs written over, the same loop nest else). Why: an optimizer step's kernel of many parameters'
    # updates was lowered again at each of its writes, in every plan of the search (an AdamW step of a
    # 36-write kernel: most of a plan's time).
    done, into, removed = chosen(lambda group, writes: True)
    if not all(writable(graph, groups[k], buffers, writes) for k, writes in into.items()):
        done, into, removed = chosen(lambda group, writes: writable(graph, group, buffers, writes))
    groups[:] = [g for g in groups if not (g.kind == "extern" and g.nodes[0] in removed)]
    return done


def donated_writes(graph: Graph, groups: list[Group], buffers: set[int], donated: set[int]) -> dict[int, int]:
    """For a step whose caller donates some inputs (jax.jit's donate_argnums): the values a kernel can
    write over a donated input of their type, as in_place_writes maps them (value -> input). Why: the
    update of a parameter or an optimizer moment then lands in the buffer the caller gave up, with no
    new allocation. The kernel must read the input only at the element it writes, before writing it
    (loopnest.lower checks that; a GEMM's epilogue may, its product may not), and be the only step that
    reads the input: XLA, which owns the buffers, copies an input that other ops read (before or
    after) rather than order them around the write (measured: the block's weights were copied twice)."""
    step_of = {n: k for k, g in enumerate(groups) if g.kind != "extern" for n in g.nodes}
    reads = [_base_reads(graph, buffers, g) for g in groups]
    outputs = {o.index for o in graph.outputs if isinstance(o, Ref)}
    done: dict[int, int] = {}
    for target in sorted(donated - outputs):
        node = graph.nodes[target]
        if node.kind != Kind.INPUT or node.type is None or _aliased_by_extern(graph, target):
            continue
        readers = [k for k, r in enumerate(reads) if target in r]
        # read by that kernel alone: XLA copies an input that other ops read before writing over it
        if len(readers) != 1 or groups[readers[-1]].kind not in ("kernel", "gemm") or groups[readers[-1]].reduced:
            continue
        group = groups[readers[-1]]
        for value in group.nodes:
            if (value in buffers and value not in done and step_of.get(value) == readers[-1]
                    and graph.nodes[value].type == node.type and group.domain == node.type.shape
                    and writable(graph, group, buffers, {**{v: t for v, t in done.items() if v in group.nodes},
                                                         value: target})):
                done[value] = target
                break
    return done


def writable(graph: Graph, group: Group, buffers: set[int], inplace: dict[int, int] | None = None) -> bool:
    """Whether the group is one loop nest (with these in-place writes); loopnest.lower keeps its
    answer in graph.memo, since a search plans a graph ~50 times and most groups recur."""
    try:
        lower(graph, group, buffers, inplace)
        return True
    except NotFusable:
        return False


def _base_reads(graph: Graph, buffers: set[int], group: Group) -> set[int]:
    """Every value a step reads, and through views the values those views are of."""
    found: set[int] = set()
    todo = [i for n in fused_nodes(graph, buffers, group) for i in graph.nodes[n].inputs]
    while todo:
        i = todo.pop()
        if i not in found:
            found.add(i)
            if graph.nodes[i].kind == Kind.VIEW:
                todo += graph.nodes[i].inputs
    return found


def _views_escape(graph: Graph, n: int, outputs: set[int]) -> bool:
    """Whether a view of n is a graph output (it would show the value written over n)."""
    todo = list(graph.nodes[n].users)
    while todo:
        u = todo.pop()
        if u < 0 or u in outputs:
            return True
        if graph.nodes[u].kind == Kind.VIEW:
            todo += graph.nodes[u].users
    return False


def _aliased_by_extern(graph: Graph, n: int) -> bool:
    """Whether an ATen call the IR does not see as a view (diagonal, split, chunk) returns an alias
    of n: what reads it reads n's memory, out of sight of the in-place checks."""
    todo = list(graph.nodes[n].users)
    while todo:
        u = todo.pop()
        if u < 0:
            continue
        node = graph.nodes[u]
        if node.kind == Kind.VIEW:
            todo += node.users
            continue
        if returns_alias(node):
            return True
    return False


def returns_alias(node: Node) -> bool:
    """Whether an extern returns an alias of a tensor argument (its schema says so: diagonal, as_strided,
    split) without writing it."""
    schema = getattr(node.target, "_schema", None)
    return node.kind == Kind.EXTERN and schema is not None and not schema.is_mutable and any(
        r.alias_info is not None for r in schema.returns)


# views that keep their base's first element (no slice or select), so a view's data pointer is its base's
POINTER_VIEWS = {"aten.permute.default", "aten.t.default", "aten.transpose.int", "aten.view.default",
                 "aten._unsafe_view.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
                 "aten.squeeze.default", "aten.expand.default", "aten.alias.default"}


def pointer_view(graph: Graph, n: int, gemm: bool = True) -> bool:
    """Whether view n (a transposed weight, a batch of rows seen as a matrix) needs no torch view at
    run time: it starts where its base does and only kernels read it, the generated GEMMs from its
    base's data pointer with the view's strides (see runtime.view_roots). Why: an ATen permute or view
    call costs about as much as a small kernel, and the backward of a linear layer has several."""
    root = graph.nodes[n]
    while root.kind == Kind.VIEW:
        if root.op not in POINTER_VIEWS:
            return False
        root = graph.nodes[root.args[0].index]
    todo = list(graph.nodes[n].users)            # a slice of it (an ATen view at run time) reads it
    while todo:
        u = todo.pop()
        if u >= 0 and graph.nodes[u].kind == Kind.VIEW:
            if graph.nodes[u].op not in POINTER_VIEWS:
                return False
            todo += graph.nodes[u].users
    return all(r >= 0 and (graph.nodes[r].kind in (Kind.POINTWISE, Kind.REDUCE) or graph.nodes[r].kind == Kind.MATMUL
                           and gemm and gemm_fits(graph, r)) for r in compute_readers(graph, n))


def mutates(node: Node) -> bool:
    """Whether the node's ATen op writes over one of its arguments (copy_ into an input)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def scalars_first(graph: Graph) -> tuple[Node, ...]:
    """The nodes in an order that runs first every single-element pointwise value computed from inputs
    alone (the optimizer's step counts and bias corrections, one set per parameter), so that they
    share one kernel instead of a call each between the parameters' updates."""
    return _graph_answer(graph, "scalars_first", _scalars_first)


def _scalars_first(graph: Graph) -> tuple[Node, ...]:
    scalar: set[int] = set()
    for node in graph.nodes:
        if node.kind == Kind.POINTWISE and node.type.shape == () and all(
                graph.nodes[i].kind == Kind.INPUT or i in scalar for i in node.inputs):
            scalar.add(node.index)
    return tuple([graph.nodes[i] for i in sorted(scalar)] + [n for n in graph.nodes if n.index not in scalar])


def sums_early(graph: Graph, nodes: Sequence[Node], buffers: set[int],
               reads: Callable[[int], frozenset[int]]) -> list[tuple[Node, bool]]:
    """`nodes`, each as (node, False), and each reduction of a stored pointwise value (a bias gradient's sum
    of the gradient GEMMs also read) once more as (node, True) just after the last value it reads: there it
    meets that value's group while it is still open (a GEMM reading the value closes it), and it is planned
    there if it joins a group, else at its own place."""
    position = {n.index: k for k, n in enumerate(nodes)}
    order = [((k, 0), (node, False)) for k, node in enumerate(nodes)]
    for node in nodes:
        arg = node.args[0] if node.kind == Kind.REDUCE else None
        if isinstance(arg, Ref) and graph.nodes[arg.index].kind == Kind.POINTWISE and arg.index in buffers:
            order.append(((max(position[d] for d in reads(node.index)), 1), (node, True)))
    return [item for _, item in sorted(order, key=lambda o: o[0])]


def describe(graph: Graph, plan: Plan) -> str:
    """The plan, one line per group (members marked * are written to memory): what a person reads
    to see what fused. Logged at DEBUG by the backend (logger "tfsn.optimizer")."""
    lines = []
    for i, g in enumerate(plan.groups):
        ops = ", ".join(f"{graph.nodes[n].name}={graph.nodes[n].op.removeprefix('aten.')}"
                        + ("*" if n in plan.buffers else "") for n in fused_nodes(graph, plan.buffers, g)
                        if graph.nodes[n].kind != Kind.VIEW or g.kind == "extern")
        shape = f" domain={list(g.domain)}" + (f" reduce={list(g.reduced)}" if g.reduced else "")
        lines.append(f"{i:3d} {g.kind:6s}{shape if g.kind != 'extern' else ''}  {ops}")
    return "\n".join(lines)
