"""The IR: a training-step graph of tensor ops with shapes, strides and dtypes.

Built from a core-ATen FX graph (after AOTAutograd and decomposition). Every FX node becomes one
IR node of a kind the generator understands (pointwise, reduction, view, matmul) or an extern
that calls the ATen op as it is, so every model runs. Views and broadcasts are index maps: a
consumer's loop index rewritten into the producer's, as C integer expressions.
"""
from __future__ import annotations

import enum
import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx

from optimizer.codegen.c_ops import CTYPES, POINTWISE

aten = torch.ops.aten


class Unsupported(Exception):
    """The graph cannot be lowered at all (symbolic shapes); the backend runs it as ATen."""


class Kind(enum.Enum):
    INPUT = "input"
    POINTWISE = "pointwise"
    REDUCE = "reduce"
    VIEW = "view"
    MATMUL = "matmul"
    EXTERN = "extern"


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str                               # a key of CTYPES, or torch's name for others

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Ref:
    """A reference, inside a node's args, to the value of node `index`."""
    index: int


@dataclass
class Node:
    index: int
    name: str
    kind: Kind
    op: str                                  # the ATen overload ("aten.add.Tensor"), or "input"/"getitem"
    target: Any                              # what an extern step calls (OpOverload, operator.getitem)
    args: tuple                              # FX args with node references as Ref
    kwargs: dict
    type: TensorType | None                  # None for values that are not one tensor (tuples, ints)
    params: dict = field(default_factory=dict)   # reductions: dims, keepdim, reduce
    users: list[int] = field(default_factory=list)

    @functools.cached_property
    def inputs(self) -> list[int]:
        """The nodes this one reads, once each (computed once: a node's args never change)."""
        found: list[int] = []
        torch.fx.node.map_aggregate((self.args, self.kwargs),
                                    lambda a: found.append(a.index) if isinstance(a, Ref) else None)
        return list(dict.fromkeys(found))


@dataclass
class Graph:
    nodes: list[Node]
    inputs: list[int]
    outputs: list                            # Ref or a literal, in the FX graph's output order
    # answers the passes keep about this graph (fusion's trial writes: a search plans it ~50 times)
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    # the float32 precision torch allowed when the graph was captured (`float32_precision`): on a GPU an
    # fp32 product runs on TF32 tensor cores only where the model asked for it, at ~7x the fp32 rate
    allow_tf32: bool = False                 # matmuls: torch.backends.cuda.matmul.allow_tf32 / 'high' | 'medium'
    cudnn_allow_tf32: bool = True            # convolutions: torch.backends.cudnn.allow_tf32 (True by default)

    def __len__(self) -> int:
        return len(self.nodes)


VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.permute.default",
         "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
         "aten.squeeze.default", "aten.t.default", "aten.transpose.int", "aten.slice.Tensor",
         "aten.select.int", "aten.alias.default"}
REDUCTIONS = {"aten.sum.dim_IntList": "sum", "aten.sum.default": "sum", "aten.amax.default": "max",
              "aten.amin.default": "min", "aten.mean.dim": "mean", "aten.mean.default": "mean"}
FLOAT_DTYPES = ("float32", "float64")


def float32_precision() -> dict[str, bool]:
    """TF32 use that torch allows now, for matmuls and cuDNN convolutions: what a graph captured now
    was written for (torch.set_float32_matmul_precision('high') sets allow_tf32 as well)."""
    matmul = bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    return {"allow_tf32": matmul, "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_type(value: Any) -> TensorType | None:
    if not isinstance(value, torch.Tensor):
        return None
    if any(not isinstance(s, int) for s in (*value.shape, *value.stride())):
        raise Unsupported("symbolic shapes")
    if value.device.type != "cpu" or value.layout != torch.strided:
        return None
    return TensorType(tuple(value.shape), tuple(value.stride()), dtype_name(value.dtype))


def from_fx(gm: torch.fx.GraphModule) -> Graph:
    """Lower an ATen FX graph; raises Unsupported only when shapes are symbolic."""
    nodes: list[Node] = []
    index_of: dict[torch.fx.Node, int] = {}
    inputs: list[int] = []
    outputs: list = []

    def add(name, kind, op, target, args, kwargs, type_, **params) -> int:
        nodes.append(Node(len(nodes), name, kind, op, target, args, kwargs, type_, params))
        return len(nodes) - 1

    def ref(a):
        if isinstance(a, torch.fx.Node):
            return Ref(index_of[a])
        return a

    for fx_node in gm.graph.nodes:
        val = fx_node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise Unsupported("symbolic scalars")
        if fx_node.op == "placeholder":
            index_of[fx_node] = add(fx_node.name, Kind.INPUT, "input", None, (), {}, tensor_type(val))
            inputs.append(index_of[fx_node])
            continue
        if fx_node.op == "output":
            result = fx_node.args[0]
            outputs = [ref(a) for a in (result if isinstance(result, (list, tuple)) else [result])]
            continue
        if fx_node.op == "get_attr":         # a constant tensor the graph holds: an extern that returns it
            value = torch.fx.graph_module._get_attr(gm, fx_node.target)
            index_of[fx_node] = add(fx_node.name, Kind.EXTERN, "constant", functools.partial(_constant, value),
                                    (), {}, tensor_type(value))
            continue
        if fx_node.op != "call_function":
            raise Unsupported(f"FX op {fx_node.op}")
        args = torch.fx.node.map_aggregate(fx_node.args, ref)
        kwargs = dict(torch.fx.node.map_aggregate(fx_node.kwargs, ref))
        type_ = tensor_type(val)
        op = str(fx_node.target) if isinstance(fx_node.target, torch._ops.OpOverload) else "getitem" \
            if fx_node.target is operator.getitem else str(fx_node.target)
        kind = classify(op, args, kwargs, type_, nodes)
        if op == "aten.addmm.default" and kind == Kind.MATMUL:  # mm + bias: the bias is an epilogue
            mm_type = TensorType(type_.shape, type_.strides, type_.dtype)
            mm = add(fx_node.name + "_mm", Kind.MATMUL, "aten.mm.default", aten.mm.default, args[1:3], {}, mm_type)
            index_of[fx_node] = add(fx_node.name, Kind.POINTWISE, "aten.add.Tensor", aten.add.Tensor,
                                    (Ref(mm), args[0]), {}, type_)
            continue
        params = {}
        if kind == Kind.REDUCE:
            params = reduce_params(op, args, kwargs, nodes)
        index_of[fx_node] = add(fx_node.name, kind, op, fx_node.target, args, kwargs, type_, **params)
    for node in nodes:
        for i in node.inputs:
            nodes[i].users.append(node.index)
    for o in outputs:
        if isinstance(o, Ref):
            nodes[o.index].users.append(-1)   # -1: the graph's output
    return Graph(nodes, inputs, outputs, **float32_precision())


def _constant(value: Any) -> Any:
    return value


def _tensor_args(args, kwargs, nodes) -> list[TensorType | None]:
    found: list = []
    torch.fx.node.map_aggregate((args, kwargs),
                                lambda a: found.append(nodes[a.index].type) if isinstance(a, Ref) else None)
    return found


def classify(op: str, args: tuple, kwargs: dict, type_: TensorType | None, nodes: list[Node]) -> Kind:
    """Which kind of IR node an ATen call becomes; extern whenever the generator is not sure."""
    if type_ is None or type_.dtype not in CTYPES or type_.numel == 0:
        return Kind.EXTERN
    tensors = _tensor_args(args, kwargs, nodes)
    if any(t is None or t.dtype not in CTYPES for t in tensors):
        return Kind.EXTERN
    if op in VIEWS:
        return Kind.VIEW
    if op in POINTWISE:
        extra = set(kwargs) - {"alpha", "dtype", "layout", "device", "pin_memory", "memory_format",
                               "non_blocking"}
        device = kwargs.get("device")
        if extra or (device is not None and torch.device(device).type != "cpu"):
            return Kind.EXTERN
        scalars_ok = all(isinstance(a, (Ref, int, float, bool)) or a is None
                         for a in args[1:] if op != "aten.full.default")
        return Kind.POINTWISE if scalars_ok else Kind.EXTERN
    if op in REDUCTIONS:
        src = nodes[args[0].index].type
        dtype_ok = src.dtype in FLOAT_DTYPES and type_.dtype == src.dtype
        return Kind.REDUCE if dtype_ok and src.numel > 0 else Kind.EXTERN
    if op in ("aten.mm.default", "aten.bmm.default", "aten.addmm.default"):
        if type_.dtype != "float32" or any(t.dtype != "float32" for t in tensors):
            return Kind.EXTERN
        if op == "aten.addmm.default" and (kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1):
            return Kind.EXTERN
        return Kind.MATMUL
    return Kind.EXTERN


def _reduce_dims(op: str, args: tuple, ndim: int) -> tuple[int, ...]:
    dims = args[1] if len(args) > 1 and op.endswith(("dim_IntList", "mean.dim")) else None
    if dims is None or len(dims) == 0:
        return tuple(range(ndim))
    return tuple(sorted({d % ndim for d in dims}))


def reduce_params(op: str, args: tuple, kwargs: dict, nodes: list[Node]) -> dict:
    ndim = len(nodes[args[0].index].type.shape)
    keepdim = bool(args[2]) if len(args) > 2 else bool(kwargs.get("keepdim", False))
    if ndim == 0:                   # a 0-d tensor reduced over dim 0 or -1 (or all): itself
        return {"dims": (), "keepdim": keepdim, "reduce": REDUCTIONS[op]}
    if op in ("aten.amax.default", "aten.amin.default"):
        dims = tuple(sorted(d % ndim for d in args[1])) if len(args) > 1 and args[1] else tuple(range(ndim))
    else:
        dims = _reduce_dims(op, args, ndim)
    return {"dims": dims, "keepdim": keepdim, "reduce": REDUCTIONS[op]}


# ---- index maps: a consumer's index (C expressions, one per dim) rewritten into its producer's ----

def _paren(e: str) -> str:
    return e if e.isidentifier() or e.lstrip("-").isdigit() or (e.startswith("(") and e.endswith(")")) else f"({e})"


def mul(e: str, k: int) -> str:
    if k == 0 or e == "0":
        return "0"
    return e if k == 1 else f"{_paren(e)}*{k}"


def add_terms(terms: Sequence[str]) -> str:
    terms = [t for t in terms if t != "0"]
    if not terms:
        return "0"
    return terms[0] if len(terms) == 1 else "(" + " + ".join(terms) + ")"


def broadcast_index(src: Sequence[int], dst: Sequence[int], idx: Sequence[str]) -> tuple[str, ...]:
    """ATen's implicit broadcasting: dims aligned right, a size-1 source dim always reads 0."""
    lead = len(dst) - len(src)
    return tuple("0" if s == 1 else idx[lead + i] for i, s in enumerate(src))


def reshape_index(src: Sequence[int], dst: Sequence[int], idx: Sequence[str]) -> tuple[str, ...]:
    """A reshape as an index map: dims grouped into runs of equal size product; only a run that
    splits or merges dims pays for a division."""
    out = ["0"] * len(src)
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
        linear = add_terms(terms[::-1])
        stride = 1
        for k, s in enumerate(reversed(s_run)):
            e = linear if stride == 1 else f"{_paren(linear)}/{stride}"
            out[s] = e if k == len(s_run) - 1 else f"({e})%{src[s]}"
            stride *= src[s]
    return tuple(out)


def _atomic(e: str) -> bool:
    """An identifier, a number, or one parenthesized whole: safe to read as the L of `L/D`."""
    if e.isidentifier() or e.isdigit():
        return True
    if not (e.startswith("(") and e.endswith(")")):
        return False
    depth = 0
    for k, ch in enumerate(e):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return k == len(e) - 1
    return False


def _split(e: str) -> tuple[str, int, int | None] | None:
    """(L, D, n) when index `e` is `(L/D)%n` as reshape_index writes it (D = 1: `(L)%n`; n = None:
    the outermost `L/D`), else None."""
    if e.endswith(")") or "%" not in e and "/" not in e:
        return None
    n = None
    if "%" in e:
        head, _, tail = e.rpartition("%")
        if not tail.isdigit() or not _atomic(head):
            return None
        e, n = head[1:-1], int(tail)
        if "/" not in e:
            return (_paren(e), 1, n) if _atomic(_paren(e)) else None
    head, _, tail = e.rpartition("/")
    if not tail.isdigit() or not _atomic(head):
        return (_paren(e), 1, n) if n is not None and _atomic(_paren(e)) else None
    return head, int(tail), n


def fold_splits(terms: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """Index terms (index, stride) with the divisions of a reshape undone where the strides allow:
    `(L/D)%n * s + (L/(D*n)) * (s*n)` is `(L/D) * s`. A [B, T, C] tensor read as [B*T, C] is then
    `i0*C` again, not `(i0/T)*(T*C) + (i0%T)*C`: two divisions less per element (per row in a
    column reduction, which ran 2 ms for a [1392, 768] bias gradient)."""
    parts: list[list] = []
    rest: list[tuple[str, int]] = []
    for e, stride in terms:
        form = _split(e)
        if form is None:
            rest.append((e, stride))
        else:
            parts.append([*form, stride, len(parts)])
    # a run's pieces of one L, by increasing D, each one's D the previous one's D * n: one pass
    kept: list[list] = []
    for part in sorted(parts, key=lambda p: (p[0], p[1])):
        last = kept[-1] if kept else None
        if last and last[0] == part[0] and last[2] is not None and part[1] == last[1] * last[2] \
                and part[3] == last[3] * last[2]:
            last[2] = None if part[2] is None else last[2] * part[2]
        else:
            kept.append(part)
    for L, D, n, stride, _ in sorted(kept, key=lambda p: p[4]):        # in the order they came
        e = L if D == 1 else f"{L}/{D}"
        rest.append((e if n is None else f"({e})%{n}", stride))
    return rest


def view_index(graph: Graph, node: Node, idx: Sequence[str]) -> tuple[int, tuple[str, ...]]:
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
        out = ["0"] * nd
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
        out = list(idx)
        out[dim] = add_terms([mul(idx[dim], step), str(start)])
        return base, tuple(out)
    if op == "aten.select.int":
        dim = args[1] % len(src)
        i = args[2] + src[dim] if args[2] < 0 else args[2]
        return base, tuple(idx[:dim]) + (str(i),) + tuple(idx[dim:])
    return base, reshape_index(src, dst, idx)      # view, reshape, squeeze, unsqueeze, alias
