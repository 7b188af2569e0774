"""Lowering: one fused group of the IR as a target-neutral loop nest, which every renderer prints.

A `LoopNest` is what a group computes and in what loops: its shape (pointwise, row reduction
with its passes, or GEMM with its epilogue), the order of the domain's axes in memory, the axes
merged into one loop, and the members' values as numbered statements (loads at symbolic offsets,
applications of pointwise ops, stores, accumulations) in the order they are computed. It holds
no target text: fusion asks it whether a group is one loop nest at all (`lower` raises
NotFusable), the cost model reads its loads and loops (features.py), and codegen/c.py (C/OpenMP)
prints it. Views and broadcasts are index maps: a consumer's index (optimizer.expr) rewritten
into its producer's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from typing import Sequence, Union

from optimizer.expr import Const, Div, Expr, Mod, add, const, divides, mul, offset, var
from optimizer.ir import CAT, FLIP, HALF_DTYPES, Graph, Kind, Node, Ref
from optimizer.ops import eager_rounded

MERGE_BELOW = 1024      # an innermost loop shorter than this takes in the next axis where memory allows (merge)
TABLE_MAX = 512         # a merged loop that reads per-lane tables is at most this long (the tables stay in L1)
LANE_COLUMNS = 64       # a column reduction keeping fewer columns than this runs its SIMD lanes across whole rows


class NotFusable(Exception):
    """The group as given cannot be one loop nest (a member read at another index, ...)."""


@dataclass(frozen=True)
class Group:
    """One step of the program: a fused kernel, a GEMM with its epilogue, or one extern call.
    This is the fusion decision as data: the search rewrites lists of these."""
    kind: str                        # "kernel" | "gemm" | "extern"
    nodes: tuple[int, ...]           # members in topological order (a gemm's first is its matmul)
    domain: tuple[int, ...] = ()     # the loop nest's shape
    reduced: tuple[int, ...] = ()    # axes of the domain that reductions sum over (kernel only)


def row_shapes(domain: tuple[int, ...], reduced: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Shapes of a per-row value of a reduction group (reduced axes as 1, or dropped)."""
    if not reduced:
        return ()
    return (tuple(1 if d in reduced else n for d, n in enumerate(domain)),
            tuple(n for d, n in enumerate(domain) if d not in reduced))


# ---- index maps: a consumer's index rewritten into its producer's ----

def broadcast_index(src: Sequence[int], dst: Sequence[int], idx: Sequence[Expr]) -> tuple[Expr, ...]:
    """ATen's implicit broadcasting: dims aligned right, a size-1 source dim always reads 0."""
    lead = len(dst) - len(src)
    return tuple(Const(0) if s == 1 else idx[lead + i] for i, s in enumerate(src))


def reshape_index(src: Sequence[int], dst: Sequence[int], idx: Sequence[Expr]) -> tuple[Expr, ...]:
    """A reshape as an index map: dims grouped into runs of equal size product; only a run that
    splits or merges dims pays for a division."""
    out: list[Expr] = [Const(0)] * len(src)
    s_dims = [i for i, n in enumerate(src) if n != 1]
    d_dims = [i for i, n in enumerate(dst) if n != 1]
    si = di = 0
    while si < len(s_dims) or di < len(d_dims):
        s_run, d_run = [s_dims[si]], [d_dims[di]]
        s_prod, d_prod = src[s_dims[si]], dst[d_dims[di]]
        si, di = si + 1, di + 1
        while s_prod != d_prod:
            if s_prod < d_prod:
                s_run.append(s_dims[si]); s_prod *= src[s_dims[si]]; si += 1
            else:
                d_run.append(d_dims[di]); d_prod *= dst[d_dims[di]]; di += 1
        if len(s_run) == 1 and len(d_run) == 1:
            out[s_run[0]] = idx[d_run[0]]
            continue
        stride, terms = 1, []
        for d in reversed(d_run):
            terms.append(mul(idx[d], stride))
            stride *= dst[d]
        linear = add(terms[::-1])
        stride = 1
        for k, s in enumerate(reversed(s_run)):
            e = linear if stride == 1 else Div(linear, stride)
            out[s] = e if k == len(s_run) - 1 else Mod(e, src[s])
            stride *= src[s]
    return tuple(out)


def view_index(graph: Graph, node: Node, idx: Sequence[Expr]) -> tuple[int, tuple[Expr, ...]]:
    """The producer and the producer's index that `node`'s element `idx` reads."""
    base = node.args[0].index
    src, dst = graph.nodes[base].type.shape, node.type.shape
    op, args = node.op, node.args
    if op in ("aten.permute.default", "aten.t.default", "aten.transpose.int"):
        nd = len(src)
        if op == "aten.permute.default":
            perm = [d % nd for d in args[1]]
        else:
            perm = list(range(nd))
            if nd == 2 or op == "aten.transpose.int":
                a, b = (0, 1) if op == "aten.t.default" else (args[1] % nd, args[2] % nd)
                perm[a], perm[b] = perm[b], perm[a]
        out: list[Expr] = [Const(0)] * nd
        for k, p in enumerate(perm):
            out[p] = idx[k]
        return base, tuple(out)
    if op == "aten.expand.default":
        return base, broadcast_index(src, dst, idx)
    if op == "aten.slice.Tensor":
        dim = (args[1] if len(args) > 1 else 0) % len(src)
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        step = args[4] if len(args) > 4 else 1
        start = min(max(start + src[dim] if start < 0 else start, 0), src[dim])
        sliced = list(idx)
        sliced[dim] = add([mul(idx[dim], step), const(start)])
        return base, tuple(sliced)
    if op == "aten.select.int":
        dim = args[1] % len(src)
        i = args[2] + src[dim] if args[2] < 0 else args[2]
        return base, tuple(idx[:dim]) + (const(i),) + tuple(idx[dim:])
    return base, reshape_index(src, dst, idx)      # view, reshape, squeeze, unsqueeze, alias


def flip_index(node: Node, idx: Sequence[Expr]) -> tuple[Expr, ...]:
    """The index of flip `node`'s input that its element `idx` is: n - 1 - i along each flipped dim of size n,
    an affine index like a slice's (never negative), so a flip is read in place, not copied by ATen."""
    shape = node.type.shape
    flipped = {d % len(shape) for d in node.args[1]} if shape else set()
    return tuple(add([const(shape[d] - 1), mul(e, -1)]) if d in flipped and shape[d] > 1 else e
                 for d, e in enumerate(idx))


def cat_pieces(graph: Graph, node: Node) -> tuple[int, list[tuple[int, int, int]]]:
    """The dim of concatenation `node` and its non-empty pieces, as (node, start, size) along that dim."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim %= len(node.type.shape)
    pieces, start = [], 0
    for r in node.args[0]:
        piece = graph.nodes[r.index].type
        if piece.numel:              # an empty piece (even a legacy 1-d one of shape [0]) adds nothing
            pieces.append((r.index, start, piece.shape[dim]))
            start += piece.shape[dim]
    return dim, pieces


# ---- GEMM operands ----

def gemm_operand(strides: Sequence[int], rows: int, cols: int) -> tuple[str, int]:
    """How a GEMM reads a row-major (rows x cols) operand with these strides: ("N", ld) when rows
    are contiguous, ("T", ld) when columns are (BLAS's names). NotFusable otherwise (the GEMM stays
    an ATen call)."""
    s_row, s_col = strides
    if (s_col == 1 or cols == 1) and s_row >= max(cols, 1):
        return "N", max(s_row, cols, 1)
    if (s_row == 1 or rows == 1) and s_col >= max(rows, 1):
        return "T", max(s_col, rows, 1)
    raise NotFusable("GEMM operand with strides BLAS cannot read")


def gemm_fits(graph: Graph, mm: int) -> bool:
    node = graph.nodes[mm]
    a, b = (graph.nodes[r.index] for r in node.args[:2])
    if node.type.strides[-1] != 1 or node.type.strides[-2] < node.type.shape[-1]:
        return False
    M, N = node.type.shape[-2:]
    K = a.type.shape[-1]
    if min(M, N, K) == 0:
        return False
    try:
        gemm_operand(a.type.strides[-2:], M, K)
        gemm_operand(b.type.strides[-2:], K, N)
    except NotFusable:
        return False
    return True


# ---- the loop nest: values and statements ----

@dataclass(frozen=True)
class Temp:
    """A value computed once per iteration of the loop it is in (or once, before every loop)."""
    id: int


@dataclass(frozen=True)
class RowVar:
    """A per-row value of a reduction: "row" (a pointwise value of the row: mean, rstd), "red" (a
    reduction's result) or "acc" / "nan" (its accumulator and NaN flag during its pass)."""
    kind: str
    node: int


Name = Union[Temp, RowVar]


@dataclass(frozen=True)
class Operand:
    """An argument of a pointwise op that is a value: its name, dtype and whether it is 0-d."""
    name: Name
    dtype: str
    zero_dim: bool


@dataclass(frozen=True)
class Load:
    buffer: int                      # the node whose memory is read (a kernel parameter)
    offset: Expr


@dataclass(frozen=True)
class Apply:
    """Pointwise op `node` on its arguments: Operand, a Python scalar, or None (not a value)."""
    node: int
    args: tuple


@dataclass(frozen=True)
class GemmElement:
    """The product of GEMM `node` at the current index, while its block is in cache: rounded to the node's dtype
    where that is a half (eager's mm/bmm result; a half addmm's product is an fp32 node, rounded after its bias)."""
    node: int


@dataclass(frozen=True)
class Select:
    """Element `index` of concatenation `node` along its dim: values[k] for the first k whose bound
    exceeds the index (the last value past every bound). Each value is its piece's element at an index
    wrapped into the piece, so every load made for a value not selected reads an element that exists."""
    node: int
    index: Expr
    bounds: tuple[int, ...]          # where each piece but the last ends
    values: tuple[Name, ...]


@dataclass(frozen=True)
class Define:
    name: Temp
    value: Union[Load, Apply, Select, GemmElement]


@dataclass(frozen=True)
class Store:
    buffer: int                      # the node whose memory is written (a member, or the input it replaces)
    offset: Expr
    value: Name


@dataclass(frozen=True)
class Assign:
    """A per-row pointwise value of the current row."""
    name: RowVar
    value: Apply


@dataclass(frozen=True)
class Accumulate:
    """One element into reduction `node`'s accumulator ("sum", "mean", "max" or "min")."""
    node: int
    op: str
    value: Name


Stmt = Union[Define, Store, Assign, Accumulate]


# Names and operands are shared between loop nests, not made per statement: a search keeps every nest
# it lowered (graph.memo), and the collector's full passes cost in proportion to the objects kept.
@lru_cache(maxsize=None)
def _temp(k: int) -> Temp:
    return Temp(k)


@lru_cache(maxsize=4096)
def _operand(name: Name, dtype: str, zero_dim: bool) -> Operand:
    return Operand(name, dtype, zero_dim)


@dataclass(frozen=True)
class Reduction:
    node: int
    op: str
    store: Store                     # its result, written when the pass is done


@dataclass
class RowSegment:
    """A per-row pointwise value between passes (LayerNorm's mean and rstd)."""
    node: int
    body: list[Stmt]


@dataclass
class Pass:
    """Reductions that share one pass over the reduced axes."""
    reductions: list[Reduction]
    body: list[Stmt]


@dataclass
class LoopNest:
    """One group, lowered (see the module's docstring)."""
    group: Group
    order: tuple[int, ...]                         # the domain's axes, outermost first, as loops nest them
    runs: dict[int, tuple[int, ...]]               # axes run by one loop: its outermost axis -> the axes
    idx: tuple[Expr, ...]                          # the index of the domain at the current iteration
    params: tuple[int, ...]                        # nodes whose memory the kernel reads or writes, in order
    outputs: tuple[int, ...]                       # of those, the ones it writes
    prologue: list[Define]                         # loop-invariant values, computed once before the loops
    loads: list[tuple[int, Expr]]                  # (buffer, offset) of every load: the access pattern
    body: list[Stmt] = field(default_factory=list)          # pointwise: the loop body; gemm: the epilogue
    segments: list[Union[RowSegment, Pass]] = field(default_factory=list)   # reduction: per row, in order
    epilogue: list[Stmt] | None = None             # reduction: the members over the whole domain, if any

    @property
    def shape(self) -> str:
        """"pointwise", "reduction" or "gemm"."""
        return "gemm" if self.group.kind == "gemm" else "reduction" if self.group.reduced else "pointwise"

    @property
    def splittable(self) -> bool:
        """Whether its reductions may run as partial results over slices of the reduced axes, combined by a
        second kernel (a GPU's split reduction): one pass, first (no per-row value feeds it), and nothing but
        per-row values after it (they run in the second kernel); its sums, means, maxima and minima combine.
        Members over the whole domain may follow where they read no per-row value (a LayerNorm backward's
        weight gradient beside its input's): they run on each slice after its pass, so nothing the kernel
        writes may be read (in place) by it."""
        if self.shape != "reduction" or not self.segments or not isinstance(self.segments[0], Pass) \
                or any(isinstance(s, Pass) for s in self.segments[1:]):
            return False
        if self.epilogue is None:
            return True
        names = [n for s in self.epilogue for n in _names(s)]
        loads = [s.value.buffer for s in self.segments[0].body + self.epilogue
                 if isinstance(s, Define) and isinstance(s.value, Load)]
        return not any(isinstance(n, RowVar) for n in names) and not set(loads) & set(self.outputs)

    @property
    def column(self) -> bool:
        """A reduction that keeps the axis innermost in memory (a bias gradient): SIMD across columns."""
        return bool(self.group.reduced) and self.order[-1] not in self.group.reduced

    @property
    def lane_run(self) -> tuple[int, ...] | None:
        """A column reduction's SIMD lanes when they run across rows of whole columns (the merged
        loop holding the kept innermost axis and the reduced axes around it in memory): its values
        per column are arrays of one slot per lane, and its per-column statements run at the first
        columns-many lanes (where the reduced axes of the run are 0)."""
        if not self.column:
            return None
        return next((run for run in self.runs.values() if self.order[-1] in run), None)

    def statements(self) -> list[Stmt]:
        """Every statement, in the order the values they define are defined."""
        segments = [s for seg in self.segments for s in seg.body]
        return [*self.prologue, *self.body, *segments, *(self.epilogue or [])]

    def tabled(self, load: Load) -> bool:
        """Whether a load is read from a table of its values along the merged loop: its offset divides
        the merged index (a BatchNorm's per-channel weight at m % C), depends on nothing else, and
        this kernel does not write what it reads (the table is filled before the loops)."""
        merged = {f"m{d}" for d in self.runs}
        return divides(load.offset, merged) and load.offset.names() <= merged and load.buffer not in self.outputs

    def lanes(self, first: int) -> int:
        """The length of the merged loop that starts at axis `first`."""
        return prod(self.group.domain[d] for d in self.runs[first])

    @property
    def kept(self) -> list[int]:
        return [d for d in self.order if d not in self.group.reduced]

    @property
    def reduced(self) -> list[int]:
        return [d for d in self.order if d in self.group.reduced]

    @property
    def inner_loop(self) -> tuple[str, int]:
        """The innermost loop's variable and length (the SIMD loop): what strides are read along."""
        dom = self.group.domain
        if not dom:
            return "i0", 1
        if self.group.kind == "gemm":
            return f"i{len(dom) - 1}", dom[-1]
        reduced = self.group.reduced
        inner = self.order[-1] if not reduced or self.order[-1] not in reduced else \
            [d for d in self.order if d in reduced][-1]
        for first, run in self.runs.items():
            if inner in run:
                return f"m{first}", prod(dom[d] for d in run)
        return f"i{inner}", dom[inner]


def exact_halves(graph: Graph, nest: LoopNest) -> dict[Name, str]:
    """The values that hold a 16-bit float's value exactly, each with its dtype: loads of a half's buffer,
    results the renderers round to their half (ops.eager_rounded, a half GEMM's product) and concatenations of
    those. Renderers hold halves in fp32 and round a half where an op of another dtype reads it
    (ops.half_operand_rounded); these need no second rounding."""
    exact: dict[Name, str] = {}
    for s in nest.statements():
        if not isinstance(s, (Define, Assign)):
            continue
        v, dtype = s.value, None
        if isinstance(v, Load):
            dtype = graph.nodes[v.buffer].type.dtype
        elif isinstance(v, GemmElement) or (
                isinstance(v, Apply) and eager_rounded(graph.nodes[v.node].op, graph.nodes[v.node].params)):
            dtype = graph.nodes[v.node].type.dtype
        elif isinstance(v, Select) and len({exact.get(x) for x in v.values}) == 1:
            dtype = exact.get(v.values[0])
        if dtype in HALF_DTYPES:
            exact[s.name] = dtype
    return exact


def _names(s: Stmt) -> list[Name]:
    """The values statement `s` reads."""
    v = s.value
    if isinstance(v, Apply):
        return [a.name for a in v.args if isinstance(a, Operand)]
    if isinstance(v, Select):
        return list(v.values)
    return [v] if isinstance(v, (Temp, RowVar)) else []


def accumulator_dtype(dtype: str) -> str:
    """The dtype a reduction of `dtype` values accumulates in: fp64 and int64 (counts) as themselves, else fp32."""
    return dtype if dtype in ("float64", "int64") else "float32"


def bias_epilogue(graph: Graph, nest: LoopNest) -> int | None:
    """The bias of a 2-D GEMM whose whole epilogue is `product + bias` along its rows, stored in the operands'
    dtype (a Linear's addmm), the bias maybe cast to that dtype first (autocast's): the node of that 1-D bias,
    which the library's addmm adds itself (a 16-bit one sums in fp32 and rounds once, as the tile would); None
    for any other epilogue, and for a 16-bit mm's product (b + x @ w.T), which eager rounds before the add (a
    half addmm's product is an fp32 node: ir.from_fx)."""
    if nest.shape != "gemm" or len(nest.body) not in (4, 5) or len(nest.outputs) != 1:
        return None
    mm = graph.nodes[nest.group.nodes[0]]
    defined = {s.name: s.value for s in nest.body if isinstance(s, Define)}
    store = nest.body[-1]
    if len(mm.type.shape) != 2 or mm.type.dtype in HALF_DTYPES or len(defined) != len(nest.body) - 1 or \
            not isinstance(store, Store) or not isinstance(defined.get(store.value), Apply):
        return None
    add, apply = graph.nodes[store.buffer], defined[store.value]
    args = [defined.get(getattr(a, "name", None)) for a in apply.args]
    loads = [v for v in defined.values() if isinstance(v, Load)]
    if add.op != "aten.add.Tensor" or add.kwargs.get("alpha", 1) != 1 or apply.node != add.index or \
            len(args) != 2 or sum(isinstance(a, GemmElement) for a in args) != 1 or len(loads) != 1 or \
            loads[0].offset != nest.idx[-1]:
        return None
    bias = next(a for a in args if not isinstance(a, GemmElement))
    if isinstance(bias, Apply):              # a cast of the loaded bias to the output's dtype, and nothing else
        cast = graph.nodes[bias.node]
        if cast.op != "aten._to_copy.default" or set(cast.kwargs) != {"dtype"} or len(bias.args) != 1 or \
                defined.get(getattr(bias.args[0], "name", None)) != loads[0] or \
                not graph.nodes[loads[0].buffer].type.dtype.startswith(("float", "bfloat")):
            return None
    elif bias != loads[0]:
        return None
    dtype = graph.nodes[mm.args[0].index].type.dtype
    raw = graph.nodes[loads[0].buffer]
    bias_dtype = graph.nodes[bias.node].type.dtype if isinstance(bias, Apply) else raw.type.dtype
    same = bias_dtype == add.type.dtype == dtype and graph.nodes[mm.args[1].index].type.dtype == dtype
    return raw.index if same and raw.type.shape == (mm.type.shape[1],) else None


def lower(graph: Graph, group: Group, buffers: set[int], inplace: dict[int, int] | None = None,
          tables: bool = False) -> LoopNest:
    """The loop nest of a non-extern group, NotFusable when it is none. `inplace` (member -> graph
    input) are values written over an input instead of a buffer of their own. `tables`: the renderer
    reads a load that repeats along a merged loop from a table of it (LoopNest.tabled), so such loads
    no longer keep axes from merging (the C renderer; the nest is otherwise the same). Kept in
    graph.memo: a search plans a graph ~50 times and most groups recur."""
    members_inplace = tuple(sorted((n, i) for n, i in (inplace or {}).items() if n in group.nodes))
    kernel = kernel_key(graph, buffers, group)
    key = ("loopnest", kernel, members_inplace, tables)
    if key not in graph.lowered_keys:
        _, fused, _ = kernel
        graph.lowered_keys.add(key)
        graph.lowered_nodes += len(fused)     # the search's budget (PLANNING_BUDGET): whole groups, extended or not
    if key not in graph.memo:
        try:
            graph.memo[key] = _lowered(graph, group, buffers, dict(members_inplace), tables, kernel)
        except NotFusable as e:
            # the reason, not the exception: a kept exception keeps its traceback's frames (the whole
            # lowering), and each raise of it again would lengthen that traceback
            graph.memo[key] = str(e)
    found = graph.memo[key]
    if isinstance(found, str):
        raise NotFusable(found)
    return found


# How many groups' lowerings (and fused nodes) are kept to be extended by one member (see _lowered and
# _fused): the latest, since fusion grows each of its few open groups one member at a time. 0 keeps none:
# every group is lowered whole (benchmarks/compile_time.py compares the two).
KEPT = 64


def _lowered(graph: Graph, group: Group, buffers: set[int], inplace: dict[int, int], tables: bool,
             kernel: tuple) -> LoopNest:
    """lower's nest of `group`, made by extending the kept lowering of the group less its last member
    where there is one (a pointwise group lowers its members in order, so the nest of a group with one
    more member is that lowering with the member computed after it); else lowered whole. Why: fusion
    asks whether a group is one loop nest each time it would take a member, so lowering each whole
    made a fusion pass quadratic in the size of its groups (an RNN-T loss over an 11 x 8 lattice took
    229 s to compile, nearly all of it re-lowering the same members)."""
    kept = graph.memo.setdefault("kept lowerings", {})
    pointwise = group.kind == "kernel" and not group.reduced and not inplace
    if pointwise and len(group.nodes) > 1 and kept:
        prefix = Group(group.kind, group.nodes[:-1], group.domain)
        state = kept.get((kernel_key(graph, buffers, prefix), tables))
        if state is not None:
            lowering = _Lowering(graph, group, buffers, inplace, tables)
            nest = lowering.extended(state, kernel[1])
            if nest is not None:
                _keep(kept, (kernel, tables), lowering.state())
                return nest
    lowering = _Lowering(graph, group, buffers, inplace, tables)
    nest = lowering.run()
    if pointwise and lowering.first_try():
        _keep(kept, (kernel, tables), lowering.state())
    return nest


def _keep(kept: dict, key: object, value: object) -> None:
    """`value` under `key`, as the latest of the KEPT entries of `kept`."""
    kept.pop(key, None)
    kept[key] = value
    while len(kept) > KEPT:
        del kept[next(iter(kept))]


def kernel_key(graph: Graph, buffers: set[int], group: Group) -> tuple:
    """What decides a group's loop nest: its members, the values they inline and which members are
    stored (the same group under two plans is the same kernel when these agree)."""
    return group, _fused(graph, buffers, group), frozenset(buffers.intersection(group.nodes))


@dataclass(frozen=True)
class _Fused:
    """A group's fused_nodes, with the buffers they depend on besides its members."""
    nodes: tuple[int, ...]          # fused_nodes, in graph order
    found: frozenset[int]           # the same, as a set
    deciders: frozenset[int]        # the pointwise values the fused nodes read: each inlined unless stored
    stored: frozenset[int]          # those of them in buffers


def _fused(graph: Graph, buffers: set[int], group: Group) -> tuple[int, ...]:
    """fused_nodes(graph, buffers, group), from the kept answer for the group, or for the group less its
    last member extended by what that member inlines, where the buffers that decided the kept answer
    agree (the walk from the members meets the same stored values, so it finds the same nodes). Why:
    lower keys its memo on them and fusion lowers a group at each member it would take, so walking
    every member's inlined expressions each time was quadratic in the group's size."""
    if group.kind == "extern":
        return tuple(fused_nodes(graph, buffers, group))
    kept = graph.memo.setdefault("kept fused nodes", {})
    same = kept.get(group.nodes)
    if same is not None and buffers.intersection(same.deciders) == same.stored:
        return same.nodes
    prefix = kept.get(group.nodes[:-1])
    if prefix is not None and buffers.intersection(prefix.deciders) == prefix.stored:
        found, deciders, todo = set(prefix.found), set(prefix.deciders), [group.nodes[-1]]
        found.add(group.nodes[-1])
    else:
        found, deciders, todo = set(group.nodes), set(), list(group.nodes)
    _inline(graph, buffers, found, todo, deciders)
    fused = _Fused(tuple(sorted(found)), frozenset(found), frozenset(deciders),
                   frozenset(buffers.intersection(deciders)))
    _keep(kept, group.nodes, fused)
    return fused.nodes


def _inline(graph: Graph, buffers: set[int], found: set[int], todo: list[int], deciders: set[int]) -> None:
    """Into `found`, the values inlined into the nodes of `todo` and into those, transitively: views, and
    pointwise values not stored (in `buffers`); into `deciders`, every pointwise value the walk reads, whose
    being stored or not decided what it found."""
    while todo:
        for i in graph.nodes[todo.pop()].inputs:
            kind = graph.nodes[i].kind
            if kind == Kind.POINTWISE:
                deciders.add(i)
            if i not in found and (kind == Kind.VIEW or kind == Kind.POINTWISE and i not in buffers):
                found.add(i)
                todo.append(i)


def fused_nodes(graph: Graph, buffers: set[int], group: Group) -> list[int]:
    """A group's members and the values inlined into them, in graph order."""
    if group.kind == "extern":
        return list(group.nodes)
    found = set(group.nodes)
    _inline(graph, buffers, found, list(group.nodes), set())
    return sorted(found)


class _Lowering:
    """Walks a group's members in the order a loop nest computes them."""

    def __init__(self, graph: Graph, group: Group, buffers: set[int], inplace: dict[int, int],
                 tables: bool = False) -> None:
        self.g, self.group, self.buffers, self.inplace = graph, group, buffers, inplace
        self.members = set(group.nodes)
        self.targets = {i for n, i in inplace.items() if n in self.members}
        self.order = self.memory_order()
        self.merging, self.tables, self.merge_max = True, tables, None
        self.reset()

    def reset(self) -> None:
        """The state of one lowering of the group (run() may lower it twice, see there)."""
        self.written: set[int] = set()            # inputs this body has already written over
        self.runs: dict[int, tuple[int, ...]] = {}
        self.params: list[int] = []
        self.outputs: list[int] = []
        self.lines: list[Stmt] = []
        self.cse: dict[tuple, Name] = {}
        self.locals: dict[int, Name] = {}         # members already computed at the current index
        self.row: dict[int, RowVar] = {}          # per-row values of the current row
        self.computed: set[int] = set()           # members over the domain an earlier pass computed and stored
        self.idx: tuple[Expr, ...] = tuple(var(f"i{d}") for d in range(len(self.group.domain)))
        self.gemm = False
        self.tmp = 0
        self.prologue: list[Define] = []
        self.hoisted: dict[tuple, Name] = {}
        self.loads: list[tuple[int, Expr]] = []

    def run(self) -> LoopNest:
        """The nest with merged loops where every offset still follows them: an offset that divides a
        merged index undoes the merge, unless it is a load the renderer reads from a table (`tables`),
        and then the merged loop is at most TABLE_MAX long."""
        nest = self.nest()
        if not self.undo_merges(nest):
            return nest
        self.reset()
        return self.run()

    def undo_merges(self, nest: LoopNest) -> bool:
        """Whether the nest's merged loops do not fit its offsets (see run): then the merges are undone
        or shortened for the next try."""
        merged = {f"m{d}" for d in self.runs}
        if not merged:
            return False
        divided = [(s, off) for s, off in self.offsets(nest) if divides(off, merged)]
        if any(not (self.tables and isinstance(s, Define) and nest.tabled(s.value)) for s, _ in divided):
            self.merging = False
        elif divided and max(nest.lanes(d) for d in self.runs) > TABLE_MAX:
            self.merge_max = TABLE_MAX
        else:
            return False
        return True

    def first_try(self) -> bool:
        """Whether the nest is run's first (its merges were kept)."""
        return self.merging and self.merge_max is None

    # the attributes of a pointwise lowering's state (see reset) that its nest depends on
    _STATE = ("written", "runs", "params", "outputs", "lines", "cse", "locals", "idx", "tmp", "prologue",
              "hoisted", "loads")

    def state(self) -> dict:
        """The lowering's state after its nest: what `extended` continues from. Its lists and dicts are
        the nest's own (body, prologue, loads), so they are copied when it continues, never changed."""
        return {name: getattr(self, name) for name in (*self._STATE, "order")}

    def extended(self, state: dict, fused: tuple[int, ...]) -> LoopNest | None:
        """The nest of this pointwise group from `state`, the first-try lowering of the group less its
        last member, with that member computed after it; None where that would not be the nest run()
        makes: the loops' order changes with the member, a value the state lowered reads it (there it
        was loaded, here it is computed), or its offsets undo a merge. `fused`: the group's fused_nodes.
        Raises NotFusable as run() does (its first try reaches the same member in the same state)."""
        n = self.group.nodes[-1]
        if self.order != state["order"] or any(u in fused for u in self.g.nodes[n].users):
            return None
        for name in self._STATE:
            value = state[name]
            setattr(self, name, value.copy() if isinstance(value, (list, dict, set)) else value)
        self.compute_member(n)
        nest = LoopNest(self.group, self.order, dict(self.runs), self.idx, tuple(self.params), tuple(self.outputs),
                        self.prologue, self.loads, self.lines, [], None)
        return None if self.undo_merges(nest) else nest

    @staticmethod
    def offsets(nest: LoopNest) -> list[tuple[Stmt, Expr]]:
        """The loads and stores run at every index of the merged loops, with their offsets (not the
        per-column statements of a nest with lanes, which run at its first C indices only)."""
        stmts = list(nest.prologue) + list(nest.body) + list(nest.epilogue or [])
        for s in nest.segments:
            if nest.lane_run is None or isinstance(s, Pass):
                stmts += s.body
            if isinstance(s, Pass) and nest.lane_run is None:
                stmts += [r.store for r in s.reductions]
        return [(s, s.value.offset if isinstance(s, Define) else s.offset)
                for s in stmts if isinstance(s, Store) or isinstance(s, Define) and isinstance(s.value, Load)]

    def nest(self) -> LoopNest:
        shape = "gemm" if self.group.kind == "gemm" else "reduction" if self.group.reduced else "pointwise"
        body, segments, epilogue = [], [], None
        if shape == "gemm":
            body = self.gemm_epilogue()
        elif shape == "reduction":
            segments, epilogue = self.reduction()
        else:
            if len(self.group.domain) > 1:
                self.merge(self.order, keep_outer=True)
            body = self.body(self.group.nodes)
        return LoopNest(self.group, self.order, dict(self.runs), self.idx, tuple(self.params), tuple(self.outputs),
                        self.prologue, self.loads, body, segments, epilogue)

    # ---- values ----
    def param(self, n: int, output: bool = False) -> None:
        if n not in self.params:
            self.params.append(n)
        if output and n not in self.outputs:
            self.outputs.append(n)

    def define(self, value: Union[Load, Apply, Select, GemmElement], hoist: bool = False) -> Temp:
        self.tmp += 1
        name = _temp(self.tmp)
        (self.prologue if hoist else self.lines).append(Define(name, value))
        return name

    def is_row_value(self, node: Node) -> bool:
        return node.type.shape != self.group.domain and \
            node.type.shape in row_shapes(self.group.domain, self.group.reduced)

    def row_index(self, node: Node) -> tuple[Expr, ...]:
        """The index at which a per-row member's value belongs to the current row: a reduction reduced
        through a reshape (ir._reduced_through_view) may be of another shape of the kept axes."""
        red = self.group.reduced
        ones, dropped = row_shapes(self.group.domain, red)
        if node.type.shape == ones:
            return tuple(Const(0) if d in red else e for d, e in enumerate(self.idx))
        kept = tuple(e for d, e in enumerate(self.idx) if d not in red)
        return kept if node.type.shape == dropped else reshape_index(node.type.shape, dropped, kept)

    def offset(self, node: Node, idx: Sequence[Expr]) -> Expr:
        return offset(idx, node.type.strides, node.type.shape)

    def load(self, n: int, idx: tuple[Expr, ...]) -> Name:
        key = (n, idx)
        if key in self.cse:
            return self.cse[key]
        if key in self.hoisted:
            return self.hoisted[key]
        node = self.g.nodes[n]
        # An element at a constant index (a 0-d step count, beta ** step) is the same in every
        # iteration: computed once before the loops, not per element.
        hoist = n not in self.members and all(isinstance(e, Const) for e in idx) and not (
            node.kind in (Kind.POINTWISE, Kind.VIEW) and n not in self.buffers and self.reads(n))
        if n in self.members:
            if n in self.row and idx == self.row_index(node):
                return self.row[n]
            if node.kind == Kind.MATMUL and self.gemm and idx == self.idx:
                value = self.define(GemmElement(n))
            elif n in self.locals and idx == self.idx:
                return self.locals[n]
            elif n in self.computed and idx == self.idx:     # stored by an earlier pass: computed again
                value = self.compute(node, idx)
            else:
                raise NotFusable(f"{node.name} is read at another index, or before it is computed")
        elif n in self.buffers or node.kind in (Kind.INPUT, Kind.EXTERN, Kind.MATMUL, Kind.REDUCE):
            off = self.offset(node, idx)
            if n in self.targets and (n in self.written or off != self.offset(node, self.idx)):
                raise NotFusable(f"{node.name} is read after, or elsewhere than, where this kernel writes over it")
            self.loads.append((n, off))
            self.param(n)
            value = self.define(Load(n, off), hoist)
        elif node.kind == Kind.VIEW:
            base, base_idx = view_index(self.g, node, idx)
            value = self.load(base, base_idx)
        elif node.kind == Kind.POINTWISE:
            value = self.compute(node, idx, hoist)
        else:
            raise NotFusable(f"{node.name} has no value to read")
        (self.hoisted if hoist else self.cse)[key] = value
        return value

    def compute(self, node: Node, idx: tuple[Expr, ...], hoist: bool = False) -> Name:
        """A pointwise node's value at idx."""
        if node.op == CAT:
            return self.concatenated(node, idx)
        if node.op == FLIP:
            return self.load(node.args[0].index, flip_index(node, idx))
        return self.define(self.apply(node, idx), hoist)

    def concatenated(self, node: Node, idx: tuple[Expr, ...]) -> Name:
        """A concatenation's element at idx: its piece's, chosen at compile time when the index along the
        dim is a constant, else selected among every piece's element (see Select)."""
        dim, pieces = cat_pieces(self.g, node)
        at = idx[dim]
        values, bounds = [], []
        for n, start, size in pieces:
            if isinstance(at, Const) and not start <= at.value < start + size:
                continue
            within = const(at.value - start) if isinstance(at, Const) else Const(0) if size == 1 else \
                Mod(add([at, const(-start % size)]), size)
            values.append(self.load(n, idx[:dim] + (within,) + idx[dim + 1:]))
            bounds.append(start + size)
        if len(values) == 1:
            return values[0]
        return self.define(Select(node.index, at, tuple(bounds[:-1]), tuple(values)))

    def apply(self, node: Node, idx: tuple[Expr, ...]) -> Apply:
        if node.op in (CAT, FLIP):
            raise NotFusable(f"{node.name} reads its inputs at other indices, which a per-row value cannot")
        args = []
        for a in node.args:
            if isinstance(a, Ref):
                src = self.g.nodes[a.index].type
                args.append(_operand(self.load(a.index, broadcast_index(src.shape, node.type.shape, idx)),
                                     src.dtype, not src.shape))
            elif isinstance(a, (bool, int, float)):
                args.append(a)
            else:
                args.append(None)
        return Apply(node.index, tuple(args))

    def compute_member(self, n: int) -> None:
        """A pointwise member at the current index: its value, stored to its buffer if it has one."""
        node = self.g.nodes[n]
        if node.kind == Kind.POINTWISE:
            value = self.compute(node, self.idx)
        elif node.kind == Kind.REDUCE and not node.params["dims"]:     # of a 0-d tensor: its one element
            value = self.load(node.args[0].index, self.idx)
        else:
            value = self.load(n, self.idx)
        self.locals[n] = value
        if n in self.buffers:
            self.lines.append(self.store(n, self.idx, value))

    def store(self, n: int, idx: tuple[Expr, ...], value: Name) -> Store:
        """Member n's value at idx, to its own buffer or over the graph input it replaces (an
        in-place update: the optimizer's parameters, BatchNorm's running stats)."""
        target = self.inplace.get(n, n)
        if target != n:
            self.written.add(target)
        self.param(target, output=True)
        return Store(target, self.offset(self.g.nodes[target], idx), value)

    def body(self, members: Sequence[int]) -> list[Stmt]:
        self.lines, self.cse, self.locals = [], {}, {}
        for n in members:
            self.compute_member(n)
        return self.lines

    # ---- loops ----
    def merge(self, dims: Sequence[int], keep_outer: bool) -> None:
        """Run the innermost of `dims` (outermost first) as one loop while the innermost loop is
        shorter than MERGE_BELOW: a [24, 12, 52, 52] tensor's last two axes are one loop of 2704,
        not 52 loops of 52 (each a SIMD remainder and a loop set-up). The axes' indices become
        divisions of the merged index, which expr.fold_splits takes out of every offset where the
        strides allow; run() checks that it did. `keep_outer`: leave one axis for the outer loop."""
        dom = self.group.domain
        if not self.merging or len(dims) < 2:
            return
        run = [dims[-1]]
        while len(run) < len(dims) - keep_outer and self.takes(run, dims[len(dims) - 1 - len(run)]):
            run.insert(0, dims[len(dims) - 1 - len(run)])
        if len(run) < 2:
            return
        m, inner, idx = var(f"m{run[0]}"), 1, list(self.idx)
        for k, d in enumerate(reversed(run)):
            idx[d] = Mod(m, dom[d]) if k == 0 else Div(m, inner) if k == len(run) - 1 else Mod(Div(m, inner), dom[d])
            inner *= dom[d]
        self.idx = tuple(idx)
        self.runs[run[0]] = tuple(run)

    def merge_lanes(self) -> None:
        """A column reduction's lanes (LoopNest.lane_run): the kept innermost axis, when it is short
        (the channels of a channels-last BatchNorm: 10 columns are one vector and a scalar remainder
        of 2, which runs erf or exp scalar), merged with the reduced axes next to it in memory, to at
        most TABLE_MAX lanes (its values are arrays of one slot per lane)."""
        order = self.order
        if not (self.tables and self.group.domain[order[-1]] < LANE_COLUMNS) or any(
                self.g.nodes[n].params["reduce"] not in ("sum", "mean")
                for n in self.group.nodes if self.g.nodes[n].kind == Kind.REDUCE):
            return
        first = len(order) - 1
        while first > 0 and order[first - 1] in self.group.reduced:
            first -= 1
        self.merge_max = TABLE_MAX
        self.merge(order[first:], keep_outer=False)

    def takes(self, run: list[int], outer: int) -> bool:
        """Whether the merged loop `run` takes in axis `outer` next (see merge)."""
        length = prod(self.group.domain[d] for d in run)
        if self.order.index(outer) != self.order.index(run[0]) - 1:    # not next in memory
            return False
        if self.merge_max is not None:
            return length * self.group.domain[outer] <= self.merge_max
        return length < MERGE_BELOW

    def memory_order(self) -> tuple[int, ...]:
        """The domain's axes by decreasing stride of the group's main tensor (its first stored member of
        the domain's shape, else the first such tensor it reads), so that the innermost loop walks
        memory: a channels-last activation runs with its channels innermost. The logical order when
        that tensor is laid out in it (the usual case)."""
        dom = self.group.domain
        logical = tuple(range(len(dom)))
        if self.group.kind == "gemm" or len(dom) < 2:
            return logical
        main = next((self.g.nodes[n] for n in self.group.nodes
                     if n in self.buffers and self.g.nodes[n].type.shape == dom), None)
        seen, todo = set(), list(self.group.nodes)
        while main is None and todo:
            node = self.g.nodes[todo.pop(0)]
            for i in node.inputs:
                src = self.g.nodes[i]
                if i in seen or src.type is None:
                    continue
                seen.add(i)
                stored = i in self.buffers or src.kind in (Kind.INPUT, Kind.EXTERN, Kind.MATMUL)
                if stored and src.type.shape == dom and i not in self.members:
                    main = src
                    break
                if src.kind == Kind.POINTWISE and not stored:
                    todo.append(i)
        if main is None:
            return logical
        strides = [main.type.strides[d] if dom[d] != 1 and main.type.strides[d] != 0 else None for d in logical]
        sized = [st for st in strides if st is not None]
        if sized == sorted(sized, reverse=True):
            return logical
        return tuple(sorted(logical, key=lambda d: (strides[d] is not None, -(strides[d] or 0), d)))

    def reduction(self) -> tuple[list[Union[RowSegment, Pass]], list[Stmt] | None]:
        """Per row of kept indices: passes of reductions over the reduced axes, the per-row values
        between them (mean, rstd), then the members over the whole domain."""
        if self.order[-1] in self.group.reduced:      # not a column reduction: the reduced axes may merge
            self.merge([d for d in self.order if d in self.group.reduced], keep_outer=False)
        else:
            self.merge_lanes()
        self.row, self.computed = {}, set()
        epilogue: list[int] = []
        out: list[Union[RowSegment, Pass]] = []
        for kind, nodes in self.segments(epilogue):
            self.lines, self.cse, self.locals = [], {}, {}
            if kind == "row":
                node = self.g.nodes[nodes[0]]
                name = RowVar("row", node.index)
                self.lines.append(Assign(name, self.apply(node, self.row_index(node))))
                if node.index in self.buffers:
                    self.lines.append(self.store(node.index, self.row_index(node), name))
                self.row[node.index] = name
                out.append(RowSegment(node.index, self.lines))
                continue
            reductions = []
            for n in nodes:
                node = self.g.nodes[n]
                if node.kind != Kind.REDUCE:          # a member over the whole domain that the pass reads
                    self.compute_member(n)
                    continue
                op = node.params["reduce"]
                value = self.load(node.args[0].index, self.idx)
                self.lines.append(Accumulate(n, op, value))
                red = RowVar("red", n)
                reductions.append(Reduction(n, op, self.store(n, self.row_index(node), red)))
                self.row[n] = red
            out.append(Pass(reductions, self.lines))
            self.computed.update(n for n in nodes if self.g.nodes[n].kind != Kind.REDUCE)
        return out, (self.body(epilogue) if epilogue else None)

    def segments(self, epilogue: list[int]) -> list[tuple[str, list[int]]]:
        """Members in order as row segments: ("pass", reductions sharing one pass over the row, after the
        members over the whole domain they read, which the pass computes and stores: a bias gradient's
        pointwise gradient) or ("row", [a per-row pointwise value]); the other members over the whole
        domain go to `epilogue`."""
        out: list[tuple[str, list[int]]] = []
        pending: list[int] = []              # members over the whole domain, not yet in a pass
        for n in self.group.nodes:
            node = self.g.nodes[n]
            if node.kind == Kind.REDUCE:
                needed, todo, deps = set(), [n], set()
                while todo:                  # the pending members it reads, through each other
                    found = self.reads(todo.pop())
                    deps |= found
                    todo += [m for m in found if m in pending and m not in needed]
                    needed |= found & set(pending)
                computed = [m for m in pending if m in needed]
                pending = [m for m in pending if m not in needed]
                last = out[-1][1] if out and out[-1][0] == "pass" else []
                if last and not deps & {m for m in last if self.g.nodes[m].kind == Kind.REDUCE}:
                    last += computed + [n]
                else:
                    out.append(("pass", computed + [n]))
            elif self.is_row_value(node):
                out.append(("row", [n]))
            else:
                pending.append(n)
        epilogue += pending
        return out

    def reads(self, n: int) -> set[int]:
        """Members that node n's inlined expression reads."""
        seen, todo, found = set(), list(self.g.nodes[n].inputs), set()
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            if m in self.members:
                found.add(m)
                continue
            node = self.g.nodes[m]
            if node.kind in (Kind.VIEW, Kind.POINTWISE) and m not in self.buffers:
                todo += node.inputs
        return found

    def gemm_epilogue(self) -> list[Stmt]:
        """The GEMM's operands (its first parameters) and its epilogue on the product's elements."""
        mm, *epilogue = self.group.nodes
        node = self.g.nodes[mm]
        a, b = (self.g.nodes[r.index] for r in node.args[:2])
        M, N = node.type.shape[-2:]
        gemm_operand(a.type.strides[-2:], M, a.type.shape[-1])
        gemm_operand(b.type.strides[-2:], a.type.shape[-1], N)
        for operand in (a, b):       # the product reads every element of its operands, not only the one written
            while operand.kind == Kind.VIEW:
                operand = self.g.nodes[operand.args[0].index]
            if operand.index in self.targets:
                raise NotFusable(f"the product reads {operand.name}, which this kernel writes over")
        self.param(a.index)
        self.param(b.index)
        if mm in self.buffers:
            self.param(mm, output=True)
        self.gemm = True
        return self.body(epilogue) if epilogue else []
