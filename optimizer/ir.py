"""The IR: a training-step graph of tensor ops with shapes, strides and dtypes.

Built from a core-ATen FX graph (after AOTAutograd and decomposition). Every FX node becomes one
IR node of a kind the generator understands (pointwise, reduction, view, matmul) or an extern
that calls the ATen op as it is, so every model runs. How a group of nodes becomes loops is
optimizer/loopnest.py; views there are index maps of a consumer's index into its producer's.
"""
from __future__ import annotations

import enum
import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx

from optimizer.ops import DTYPES, MODULOS, POINTWISE_OPS, ROUNDED_DIVISIONS

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
    dtype: str                               # torch's name ("float32"); generated code covers ops.DTYPES

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a row-major tensor of `shape` (a dim of size 0 or 1 steps as a dim of size 1)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


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
    # members and inlined values of the nests loopnest.lower was asked for on this Graph (each nest once): the
    # measure of planning work that bounds a search (search.PLANNING_BUDGET)
    lowered_nodes: int = field(default=0, repr=False, compare=False)
    # the keys of the nests loopnest.lower was asked for on this Graph: what lowered_nodes counts once each, so that
    # a memo shared with an earlier Graph of the same content (backend.planning_graph) bounds a search alike
    lowered_keys: set = field(default_factory=set, repr=False, compare=False)
    # the float32 precision torch allowed when the graph was captured (`float32_precision`): on a GPU an
    # fp32 product runs on TF32 tensor cores only where the model asked for it, at ~7x the fp32 rate
    allow_tf32: bool = False                 # matmuls: torch.backends.cuda.matmul.allow_tf32 / 'high' | 'medium'
    cudnn_allow_tf32: bool = True            # convolutions: torch.backends.cudnn.allow_tf32 (True by default)
    # where its kernels run and its buffers live: tensors elsewhere (a CPU scalar in a CUDA graph) are externs'
    device: str = "cpu"

    def __len__(self) -> int:
        return len(self.nodes)


VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.permute.default",
         "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
         "aten.squeeze.default", "aten.t.default", "aten.transpose.int", "aten.slice.Tensor",
         "aten.select.int", "aten.alias.default"}
REDUCTIONS = {"aten.sum.dim_IntList": "sum", "aten.sum.default": "sum", "aten.amax.default": "max",
              "aten.amin.default": "min", "aten.mean.dim": "mean", "aten.mean.default": "mean"}
CAT = "aten.cat.default"                    # pointwise: each element is a piece's (loopnest.Select)
FLIP = "aten.flip.default"                  # pointwise: each element is its input's at a reversed index
FLOAT_DTYPES = ("float32", "float64")
INTEGER_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "bool")
HALF_DTYPES = ("bfloat16", "float16")       # generated with from_fx(half=True) (fp32 math, rounded as eager rounds)


def float32_precision() -> dict[str, bool]:
    """TF32 use that torch allows now, for matmuls and cuDNN convolutions: what a graph captured now
    was written for (torch.set_float32_matmul_precision('high') sets allow_tf32 as well)."""
    matmul = bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    return {"allow_tf32": matmul, "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_type(value: Any, device: str = "cpu") -> TensorType | None:
    """The type of a tensor the generated kernels may touch: strided and on `device`; None otherwise."""
    if not isinstance(value, torch.Tensor):
        return None
    if any(not isinstance(s, int) for s in (*value.shape, *value.stride())):
        raise Unsupported("symbolic shapes")
    if not same_device(value.device, device) or value.layout != torch.strided:
        return None
    return TensorType(tuple(value.shape), tuple(value.stride()), dtype_name(value.dtype))


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two devices are one (a bare 'cuda' is the current CUDA device)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def graph_device(example_inputs: Sequence[Any]) -> str:
    """The device a graph's kernels run on: its tensor inputs' accelerator, else the CPU."""
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            return str(t.device)
    return "cpu"


def from_fx(gm: torch.fx.GraphModule, device: str = "cpu", half: bool = False) -> Graph:
    """Lower an ATen FX graph whose kernels will run on `device` (tensors elsewhere stay externs), with
    bf16/fp16 tensors in generated kernels when `half` (the backend's renderers, C and Triton, take them);
    raises Unsupported only when shapes are symbolic."""
    dtypes = DTYPES + HALF_DTYPES if half else DTYPES
    nodes: list[Node] = []
    index_of: dict[torch.fx.Node, int] = {}
    inputs: list[int] = []
    outputs: list = []
    split_pieces: dict[torch.fx.Node, list[tuple[Any, tuple]]] = {}
    rounded_operands: dict[tuple[torch.fx.Node, str], int] = {}   # rounded_to's: operands rounded to a half

    def add(name, kind, op, target, args, kwargs, type_, **params) -> int:
        nodes.append(Node(len(nodes), name, kind, op, target, args, kwargs, type_, params))
        return len(nodes) - 1

    def ref(a):
        if isinstance(a, torch.fx.Node):
            return Ref(index_of[a])
        return a

    def narrowed(name: str, index: int, half: str) -> int:
        """Node `index` converted to `half`, a 16-bit dtype's name."""
        source = nodes[index].type
        return add(name, Kind.POINTWISE, CONVERSION, aten._to_copy.default, (Ref(index),),
                   {"dtype": getattr(torch, half)}, TensorType(source.shape, source.strides, half))

    def half_rounded(names: tuple[str, str], index: int, half: str, dtype: torch.dtype) -> int:
        """Node `index` rounded to `half`, then at `dtype` (the one computed in) again: its value as a kernel that
        holds it in the half reads it. `names`: the narrowing's and the widening's."""
        return add(names[1], Kind.POINTWISE, CONVERSION, aten._to_copy.default,
                   (Ref(narrowed(names[0], index, half)),), {"dtype": dtype}, nodes[index].type)

    def rounded_to(half: str, a: torch.fx.Node) -> int:
        """`a` rounded to `half`, then at its own dtype again (once per node and half)."""
        if (a, half) not in rounded_operands:
            rounded_operands[a, half] = half_rounded((f"{a.name}_to_{half}", f"{a.name}_{half}_widened"),
                                                     index_of[a], half, a.meta["val"].dtype)
        return rounded_operands[a, half]

    for fx_node in gm.graph.nodes:
        val = fx_node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise Unsupported("symbolic scalars")
        if fx_node.op == "placeholder":
            type_ = None if _rng_state(fx_node) else tensor_type(val, device)
            index_of[fx_node] = add(fx_node.name, Kind.INPUT, "input", None, (), {}, type_)
            inputs.append(index_of[fx_node])
            continue
        if fx_node.op == "output":
            result = fx_node.args[0]
            outputs = [ref(a) for a in (result if isinstance(result, (list, tuple)) else [result])]
            continue
        if fx_node.op == "get_attr":         # a constant tensor the graph holds: an extern that returns it
            value = torch.fx.graph_module._get_attr(gm, fx_node.target)
            index_of[fx_node] = add(fx_node.name, Kind.EXTERN, "constant", functools.partial(_constant, value),
                                    (), {}, tensor_type(value, device))
            continue
        if fx_node.op != "call_function":
            raise Unsupported(f"FX op {fx_node.op}")
        type_ = None if _rng_state(fx_node) else tensor_type(val, device)
        if fx_node.target is operator.getitem and fx_node.args[0] in split_pieces:
            view, view_args = split_pieces[fx_node.args[0]][fx_node.args[1]]
            index_of[fx_node] = add(fx_node.name, classify(str(view), view_args, {}, type_, nodes, device, dtypes),
                                    str(view), view, view_args, {}, type_)
            continue
        args = torch.fx.node.map_aggregate(fx_node.args, ref)
        kwargs = dict(torch.fx.node.map_aggregate(fx_node.kwargs, ref))
        half = _half_kernel_piece(fx_node, type_, device)
        if half is not None and fx_node.target in LOGIT_BOUNDED and \
                str(fx_node.meta["original_aten"]) in LOGIT_OPS:
            args = tuple(_half_kernel_bound(a, half) for a in args)
        if half is not None and str(fx_node.meta["original_aten"]) in HALF_KERNEL_CONVERTED_OPERANDS:
            # an operand of another dtype that eager's kernel converts to the half: rounded, then fp32 again as
            # the decomposition computes on (once per operand and half); a Python number the decomposition
            # made a tensor of, as eager wraps it and converts it
            args = tuple(Ref(rounded_to(half, f)) if _half_kernel_operand(fx_node, f, half) else a
                         for f, a in zip(fx_node.args, args))
            if fx_node.target in SCALAR_TENSORS:
                args = (_in_half(args[0], half), *args[1:])
        read_back = _other_dim_half_operand(fx_node, half)
        if read_back is not None:
            args = (*args[:read_back], Ref(rounded_to(half, fx_node.args[read_back])), *args[read_back + 1:])
        pieces = _pieces(fx_node, args, nodes)
        if pieces is not None:               # a split: no node, each item a slice (or select) of the base
            split_pieces[fx_node] = pieces
            continue
        if fx_node.target in FACTORIES and fx_node.users and _only_read(fx_node) and type_ is not None \
                and not _tensor_args(args, kwargs, nodes):
            # a range of constant bounds, read and never written nor returned: made once, here
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            with unset_fake_temporarily():     # inside torch.compile the ambient mode makes fake tensors
                value = fx_node.target(*args, **kwargs)
            index_of[fx_node] = add(fx_node.name, Kind.EXTERN, "constant", functools.partial(_constant, value),
                                    (), {}, type_)
            continue
        op = str(fx_node.target) if isinstance(fx_node.target, torch._ops.OpOverload) else "getitem" \
            if fx_node.target is operator.getitem else str(fx_node.target)
        kind = classify(op, args, kwargs, type_, nodes, device, dtypes)
        args, kwargs = _cpu_half_scalars(fx_node, args, kwargs, type_, device)
        # a tensor operand that eager converts to the half first: an explicit conversion, rounded, for every renderer
        args = tuple(Ref(narrowed(f"{fx_node.name}_{a.index}_to_half", a.index, type_.dtype))
                     if _cpu_half_converted(fx_node, op, i, a, type_, device, nodes) else a for i, a in enumerate(args))
        if op == "aten.addmm.default" and kind == Kind.MATMUL:  # mm + bias: the bias is an epilogue
            # of a half addmm, the product is fp32: eager rounds once, after the bias
            mm_type = TensorType(type_.shape, type_.strides, "float32" if type_.dtype in HALF_DTYPES else type_.dtype)
            mm = add(fx_node.name + "_mm", Kind.MATMUL, "aten.mm.default", aten.mm.default, args[1:3], {}, mm_type)
            # the user's op: its half result rounded, as eager's addmm rounds it, before the next op reads it
            index_of[fx_node] = add(fx_node.name, Kind.POINTWISE, "aten.add.Tensor", aten.add.Tensor,
                                    (Ref(mm), args[0]), {}, type_,
                                    **({"rounded": True} if type_.dtype in HALF_DTYPES else {}))
            continue
        # eager rounds an op's 16-bit result before the next op reads it, and error-free transformations
        # (Kahan's compensation (t - p) - y, TwoSum) rely on that rounding; a sum's or mean's too
        # (x - x.sum(-1, keepdim=True))
        rounded = type_ is not None and type_.dtype in HALF_DTYPES and _op_result(fx_node)
        params = {"rounded": True} if kind == Kind.POINTWISE and rounded else {}
        if kind == Kind.REDUCE:
            params = {**reduce_params(op, args, kwargs, nodes), **({"rounded": True} if rounded else {})}
            unviewed = _reduced_through_view(op, args, params, nodes)
            if unviewed is not None:       # the same result, its shape as it was (loopnest.row_index maps it)
                base, dims = unviewed
                args = (Ref(base), list(dims), *args[2:])
                params = {**params, "dims": dims}
        index_of[fx_node] = add(fx_node.name, kind, op, fx_node.target, args, kwargs, type_, **params)
        if half is not None and kind in (Kind.POINTWISE, Kind.REDUCE) and _rounded_piece(fx_node):
            # rounded to the half as eager's kernel holds it, then fp32 again as its decomposition computes on
            index_of[fx_node] = half_rounded((fx_node.name + "_half", fx_node.name + "_widened"), index_of[fx_node],
                                             half, torch.float32)
    for node in nodes:
        for i in node.inputs:
            nodes[i].users.append(node.index)
    for o in outputs:
        if isinstance(o, Ref):
            nodes[o.index].users.append(-1)   # -1: the graph's output
    return Graph(nodes, inputs, outputs, **float32_precision(), device=device)


RESHAPES = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"}
DIM_REDUCTIONS = {"aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default", "aten.amin.default"}


def axis_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """A reshape of `src` into `dst` as runs of axes (src axes, dst axes) of equal size product, the fewest
    axes each (size-1 axes left out); None when the sizes do not match."""
    s_dims = [i for i, n in enumerate(src) if n != 1]
    d_dims = [i for i, n in enumerate(dst) if n != 1]
    runs, si, di = [], 0, 0
    while si < len(s_dims) and di < len(d_dims):
        s_run, d_run = [s_dims[si]], [d_dims[di]]
        s_prod, d_prod = src[s_dims[si]], dst[d_dims[di]]
        si, di = si + 1, di + 1
        while s_prod != d_prod:
            if s_prod < d_prod and si < len(s_dims):
                s_run.append(s_dims[si]); s_prod *= src[s_dims[si]]; si += 1
            elif d_prod < s_prod and di < len(d_dims):
                d_run.append(d_dims[di]); d_prod *= dst[d_dims[di]]; di += 1
            else:
                return None
        runs.append((tuple(s_run), tuple(d_run)))
    return runs if si == len(s_dims) and di == len(d_dims) else None


def _reduced_through_view(op: str, args: tuple, params: dict, nodes: list[Node]) -> tuple[int, tuple[int, ...]] | None:
    """For a reduction of a reshape that only merges axes of x (a bias gradient: `sum(view(g, [B*T, C]), [0])`
    of a [B, T, C] g): x and the axes of x that it reduces. Why: reduced over x's own domain, the sum can share
    one kernel with the pointwise ops that compute and store x. The result keeps its shape ([1, C] where
    keepdim), which then need not be x's with the reduced axes dropped or 1. A reshape that splits an axis of x
    stays: a kernel over its domain may hold the sum (LayerNorm's backward over [B, T, C] views of [B*T, C])."""
    if op not in DIM_REDUCTIONS or not isinstance(args[0], Ref):
        return None
    view = nodes[args[0].index]
    if view.kind != Kind.VIEW or view.op not in RESHAPES or not isinstance(view.args[0], Ref):
        return None
    base = nodes[view.args[0].index]
    runs = axis_runs(base.type.shape, view.type.shape)
    if runs is None or any(len(d_run) > 1 for _, d_run in runs):
        return None
    dims = [d for s_run, (d_run,) in runs if d_run in params["dims"] for d in s_run]
    return (base.index, tuple(sorted(dims))) if dims else None


def _constant(value: Any) -> Any:
    return value


# ATen's CPU add and sub convert a Python number to their 16-bit tensor's dtype before they add it, and pow its
# base, where its mul and div take it in fp32 (its CUDA kernels read such a scalar in fp32): bf16 x - 1.3 and
# 1.3 - x subtract 1.296875, 1.3 ** x raises 1.296875, fp16 x + 2049 adds 2048 (a tensor: CPU_HALF_CONVERTED_OPERANDS);
# add and sub convert their alpha too (alpha.to<scalar_t>()): bf16 x.add(y, alpha=0.97) adds 0.96875 * y
CPU_HALF_ROUNDED_SCALARS = frozenset({"aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.sub.Scalar",
                                      "aten.rsub.Scalar", "aten.rsub.Tensor", "aten.pow.Scalar"})


def _cpu_half_scalars(fx_node: torch.fx.Node, args: tuple, kwargs: dict, type_: TensorType | None,
                      device: str) -> tuple[tuple, dict]:
    """`args` and `kwargs` of a user's 16-bit add, sub, rsub or pow of a scalar on the CPU with its Python numbers
    (alpha too) rounded to the half, as eager rounds them (CPU_HALF_ROUNDED_SCALARS); any other node's as they
    are."""
    original = _users_op(fx_node)
    if type_ is None or type_.dtype not in HALF_DTYPES or torch.device(device).type != "cpu" or \
            original not in CPU_HALF_ROUNDED_SCALARS:
        return args, kwargs
    half = type_.dtype
    return tuple(_in_half(a, half) for a in args), {k: _in_half(v, half) if k == "alpha" else v
                                                    for k, v in kwargs.items()}


# ATen's CPU add, sub (rsub), pow, atan2 and hypot of two tensors convert a tensor operand of another dtype to their
# 16-bit result's dtype before computing (TensorIterator's common dtype), a 0-d one included: bf16 x + torch.tensor(0.1)
# adds 0.10009765625, fp16 x + torch.tensor(2049) adds 2048, bf16 x + an int64 tensor of 257s adds 256, bf16
# torch.atan2(x, torch.tensor(0.3)) is atan2(x, 0.30078125). Its mul and div
# too, except for a second operand of one element, which they read at its own value (x * torch.tensor(0.1) multiplies
# by 0.1 in fp32, torch.tensor(0.1) * x by 0.10009765625). Its CUDA kernels read a CPU scalar at its own value.
CPU_HALF_CONVERTED_OPERANDS = frozenset({"aten.add.Tensor", "aten.sub.Tensor", "aten.rsub.Tensor",
                                         "aten.pow.Tensor_Tensor", "aten.atan2.default", "aten.hypot.default"})
CPU_HALF_CONVERTED_UNLESS_SCALAR = frozenset({"aten.mul.Tensor", "aten.div.Tensor"})


def _cpu_half_converted(fx_node: torch.fx.Node, op: str, position: int, operand: Any, type_: TensorType | None,
                        device: str, nodes: list[Node]) -> bool:
    """Whether eager converts `operand`, the `position`th argument of `fx_node`, a 16-bit `op` on the CPU, to the
    op's dtype before computing: a tensor of another dtype (CPU_HALF_CONVERTED_OPERANDS), but for mul and div not a
    second operand of one element (CPU_HALF_CONVERTED_UNLESS_SCALAR). Dynamo writes p.add_(x, alpha=t) with a
    tensor t (SGD's step with a tensor lr) as fma(x, t, p), and eager's add converts t (t.item()) and x as any
    add does: bf16 p.add_(x, alpha=-torch.tensor(0.1)) adds -0.10009765625 * x. Not the fma of addcdiv_ and addcmul_
    (_fused_multiply_add_factor), whose kernel reads its value in fp32."""
    if type_ is None or type_.dtype not in HALF_DTYPES or torch.device(device).type != "cpu" or \
            not isinstance(operand, Ref) or nodes[operand.index].type is None or \
            nodes[operand.index].type.dtype == type_.dtype:
        return False
    if op in CPU_HALF_CONVERTED_UNLESS_SCALAR:
        return position != 1 or math.prod(nodes[operand.index].type.shape) != 1
    if op == "prims.fma.default":
        return not (isinstance(fx_node.args[0], torch.fx.Node) and _fused_multiply_add_factor(fx_node.args[0]))
    return op in CPU_HALF_CONVERTED_OPERANDS


def _users_op(fx_node: torch.fx.Node) -> str:
    """The op of the user's that `fx_node` computes or is a piece of: its original ATen op, or its own where that is
    a foreach op decomposed per tensor (backend.foreach_decompositions), since eager's CPU foreach ops loop over the
    per-tensor op (torch._foreach_add_(params, grads, alpha=-lr) is params[i].add_(grads[i], alpha=-lr))."""
    original = str(fx_node.meta.get("original_aten"))
    return str(fx_node.target) if original.startswith("aten._foreach_") else original


# Ops whose 16-bit CPU kernel computes pieces of its value in its scalar_t, the half, where their decompositions
# compute in fp32: those pieces' results are rounded to the half. xlogy's kernel is x * std::log(y) of BFloat16 (or
# Half) values, the log rounded before the product (xlog1py's log1p and entr's -x * std::log(x) likewise); logit's
# rounds 1 - x, the quotient and its log (Vectorized<scalar_t> ops, or MKL's log of the half quotient), between
# bounds eps and 1 - eps that are halves too, in its backward's kernel as well (eps.to<scalar_t>(): bf16 logit(x,
# eps=1e-3) of 1 is inf, as 1 - eps rounds to 1, and so is its gradient). logsumexp's is ATen's composite of ops on
# the half tensor (x - max, exp_, sum, log_, add_), each result rounded.
HALF_KERNEL_PIECES = {"aten.xlogy.Tensor": {"aten.log.default"},
                      "aten.xlogy.Scalar_Self": {"aten.log.default"},
                      "aten.xlogy.Scalar_Other": {"aten.log.default"},
                      "aten.special_xlog1py.default": {"aten.log1p.default"},
                      "aten.special_xlog1py.self_scalar": {"aten.log1p.default"},
                      "aten.special_xlog1py.other_scalar": {"aten.log1p.default"},
                      "aten.special_entr.default": {"aten.log.default"},
                      "aten.logit.default": {"aten.sub.Tensor", "aten.div.Tensor", "aten.log.default"},
                      "aten.logit_backward.default": set(),
                      "aten._log_softmax.default": {"aten.sum.dim_IntList", "aten.log.default"},
                      "aten.logsumexp.default": {"aten.sub.Tensor", "aten.exp.default", "aten.sum.dim_IntList",
                                                 "aten.log.default"}}
# Of those, the ops whose pieces are rounded only over the last dim: ATen's log_softmax over the last dim
# (_vec_log_softmax_lastdim) holds each row's sum of exp(x - max) and its log in scalar_t arrays, the half (its
# vectorized body and its tail alike), then computes x - max - log_sum in fp32, rounded once. Over another dim
# (_vec_log_softmax) it keeps fp32 throughout, as the decomposition does, and so does its backward on either.
LAST_DIM_HALF_KERNEL_PIECES = frozenset({"aten._log_softmax.default"})
# Ops whose 16-bit CPU kernel over a dim other than the last stores a piece in its output, the half, and reads
# it back: (the piece that reads it, the operand's position). ATen's _vec_softmax writes exp(x - max) to the
# output while summing it in fp32, then divides the stored halves by the sum; over the last dim it keeps fp32.
OTHER_DIM_HALF_KERNEL_OPERANDS = {"aten._softmax.default": ("aten.div.Tensor", 0)}
CONVERSION = "aten._to_copy.default"
LOGIT_BOUNDED = (aten.lt.Scalar, aten.gt.Scalar, aten.ge.Scalar, aten.le.Scalar, aten.scalar_tensor.default)
LOGIT_OPS = ("aten.logit.default", "aten.logit_backward.default")


# Ops whose 16-bit CPU kernel converts a tensor operand of another dtype to the half before computing
# (TensorIterator's common dtype), and a Python number it wraps, where their decompositions read either at its
# own value: bf16 torch.lerp(x, y, torch.tensor(0.1)) (an EMA's or a compiled optimizer's tensor weight) weighs by
# 0.10009765625, bf16 torch.xlogy(x, 0.3) is x * log(0.30078125), torch.logaddexp(x, torch.tensor(0.3)) likewise.
HALF_KERNEL_CONVERTED_OPERANDS = frozenset({
    "aten.lerp.Tensor", "aten.xlogy.Tensor", "aten.xlogy.Scalar_Self", "aten.xlogy.Scalar_Other",
    "aten.special_xlog1py.default", "aten.special_xlog1py.self_scalar", "aten.special_xlog1py.other_scalar",
    "aten.logaddexp.default", "aten.logaddexp2.default"})
# The ops of the three tables above: those whose pieces _half_kernel_piece finds the half of.
HALF_KERNEL_OPS = frozenset({*HALF_KERNEL_PIECES, *OTHER_DIM_HALF_KERNEL_OPERANDS, *HALF_KERNEL_CONVERTED_OPERANDS})
SCALAR_TENSORS = (aten.scalar_tensor.default, torch.ops.prims.scalar_tensor.default)


def _in_half(a: Any, half: str) -> Any:
    """A Python float or int `a` as the value of `half` that eager converts it to; anything else as it is."""
    return float(torch.tensor(a, dtype=torch.float64).to(getattr(torch, half))) if _number(a) else a


def _half_kernel_operand(fx_node: torch.fx.Node, operand: Any, half: str) -> bool:
    """Whether `operand` of `fx_node`, a piece of a HALF_KERNEL_CONVERTED_OPERANDS op computing in `half`, is an
    operand of that op (not another piece of its call) of a floating dtype other than the half."""
    if not isinstance(operand, torch.fx.Node) or not isinstance(operand.meta.get("val"), torch.Tensor):
        return False
    call = (str(fx_node.meta.get("original_aten")), fx_node.meta.get("seq_nr"))
    dtype = operand.meta["val"].dtype
    return (str(operand.meta.get("original_aten")), operand.meta.get("seq_nr")) != call and \
        dtype.is_floating_point and dtype_name(dtype) != half


def _half_kernel_piece(fx_node: torch.fx.Node, type_: TensorType | None, device: str) -> str | None:
    """The half that eager's CPU kernel computes `fx_node` in, a piece of a HALF_KERNEL_OPS op whose result is that
    half (its decomposition's last piece converts to it); None for any other node."""
    original = fx_node.meta.get("original_aten")
    if str(original) not in HALF_KERNEL_OPS or type_ is None or torch.device(device).type != "cpu":
        return None
    call = (str(original), fx_node.meta.get("seq_nr"))
    seen, pending = {fx_node}, [fx_node]
    while pending:                   # on through the decomposition to its result
        for a in pending.pop().users:
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor) and dtype_name(val.dtype) in HALF_DTYPES:
                return dtype_name(val.dtype)
            if a not in seen and (str(a.meta.get("original_aten")), a.meta.get("seq_nr")) == call:
                seen.add(a)
                pending.append(a)
    return None


def _rounded_piece(fx_node: torch.fx.Node) -> bool:
    """Whether `fx_node`, a piece of a HALF_KERNEL_PIECES op, is one its 16-bit CPU kernel rounds to the half;
    a piece of a LAST_DIM_HALF_KERNEL_PIECES op only where that op's reduction (the node, or the node it reads)
    runs over its input's last dim."""
    original = str(fx_node.meta["original_aten"])
    if str(fx_node.target) not in HALF_KERNEL_PIECES.get(original, ()):
        return False
    return original not in LAST_DIM_HALF_KERNEL_PIECES or _over_last_dim(fx_node)


def _over_last_dim(fx_node: torch.fx.Node) -> bool:
    """Whether the reduction of a softmax's decomposition that `fx_node` is or reads runs over its input's last
    dim (ATen's kernel for the last dim, rather than its kernel for another)."""
    reduction = next((n for n in (fx_node, *fx_node.all_input_nodes) if str(n.target) in DIM_REDUCTIONS), None)
    if reduction is None:
        return False
    rank = reduction.args[0].meta["val"].dim()
    dims = {d % max(rank, 1) for d in (reduction.args[1] or range(rank))}
    return dims == {rank - 1}


def _other_dim_half_operand(fx_node: torch.fx.Node, half: str | None) -> int | None:
    """The position of the operand of `fx_node`, a piece of an OTHER_DIM_HALF_KERNEL_OPERANDS op computing in
    `half` over a dim other than the last, that eager's kernel reads back from its half output; None elsewhere."""
    piece = OTHER_DIM_HALF_KERNEL_OPERANDS.get(str(fx_node.meta.get("original_aten")))
    if half is None or piece is None or str(fx_node.target) != piece[0] or _over_last_dim(fx_node):
        return None
    return piece[1]


def _half_kernel_bound(a: Any, half: str) -> Any:
    """A bound of logit's decomposition, eps or 1 - eps, as its 16-bit kernel holds it: eps in the half, and
    1 - eps computed in the half; anything else as it is."""
    if not isinstance(a, float) or not 0 < a < 1:
        return a
    dtype = getattr(torch, half)
    eps = torch.tensor(min(a, 1 - a), dtype=torch.float64).to(dtype)
    return float(eps if a < 0.5 else 1 - eps)


def _op_result(fx_node: torch.fx.Node) -> bool:
    """Whether `fx_node` computes the result of an op of the user's: the op itself, or the last piece of its
    decomposition, one that another op reads (x.sum() is sum.dim_IntList(x, []), var's last piece a division;
    a call is its op and autograd's seq_nr). Not the pieces inside: eager computes those in fp32. Each per-tensor
    op of a foreach op is one (_users_op): SGD's foreach weight decay, grads + wd * params, is rounded before
    params - lr * grads reads it, though both are pieces of _foreach_add.List of one seq_nr."""
    op = fx_node.meta.get("original_aten")
    if op is None or _fused_multiply_add_factor(fx_node) or _addcdiv_piece(fx_node):
        return False
    if _users_op(fx_node) == str(fx_node.target):
        return True
    call = (str(op), fx_node.meta.get("seq_nr"))
    return any(u.meta.get("original_aten") is not None and (str(u.meta["original_aten"]), u.meta.get("seq_nr")) != call
               for u in fx_node.users)


# torch.addcdiv(t, a, b, value=v) as Dynamo writes it (torch/_dynamo/variables/torch.py, handle_addcdiv): torch.div(a,
# b), torch.mul of that by v, torch.add(t, ...); each step (the op, the function that made it, the position the
# previous step's result takes in it). Not t.addcdiv(a, b, value=v), which stays one op.
ADDCDIV_STEPS = ((aten.div.Tensor, torch.div, None), (aten.mul.Tensor, torch.mul, 0), (aten.add.Tensor, torch.add, 1))


def _addcdiv_piece(fx_node: torch.fx.Node) -> bool:
    """Whether `fx_node` is the quotient a / b, or its product by v, of a torch.addcdiv(t, a, b, value=v) that Dynamo
    wrote as three calls (ADDCDIV_STEPS): a piece of the user's op, which eager's 16-bit CPU kernel computes in fp32,
    t + v * a / b rounded once (as _fused_multiply_add_factor's t.addcdiv_)."""
    targets = [target for target, _, _ in ADDCDIV_STEPS]
    if fx_node.target not in targets[:2]:
        return False
    node = fx_node
    for k in range(targets.index(fx_node.target), len(ADDCDIV_STEPS)):
        target, made_by, position = ADDCDIV_STEPS[k]
        if node.target is not target or _made_by(node) != [made_by]:
            return False
        if k + 1 < len(ADDCDIV_STEPS):
            users = list(node.users)
            if len(users) != 1 or len(users[0].args) < 2 or users[0].args[ADDCDIV_STEPS[k + 1][2]] is not node:
                return False
            node = users[0]
    return True


def _made_by(fx_node: torch.fx.Node) -> list:
    """The function of the user's code (as Dynamo traced it) that made `fx_node`: a list of it, or empty."""
    return [fn for _, fn in fx_node.meta.get("source_fn_stack") or ()][-1:]


def _fused_multiply_add_factor(fx_node: torch.fx.Node) -> bool:
    """Whether `fx_node` is a / b or a * b that Dynamo wrote as the first factor of an fma, its decomposition of
    t.addcdiv_(a, b, value=v) and t.addcmul_(a, b, value=v) (torch/_dynamo/variables/tensor.py; the updates of
    Adam, AdamW, RMSprop and Adagrad without foreach): a piece of the user's op, which eager's 16-bit CPU kernel
    computes in fp32, t + v * a / b rounded once. v is a number, or a 0-d tensor (a compiled optimizer's step size
    from its step tensor), where Dynamo's torch.div or torch.mul made the factor: its add_ with a tensor alpha also
    makes an fma, of whatever the user passed (an a * b of the user's, eager's op, rounded)."""
    if fx_node.target not in (aten.div.Tensor, aten.mul.Tensor) or not fx_node.users:
        return False
    made_by = _made_by(fx_node)
    return all(u.target is torch.ops.prims.fma.default and u.args[0] is fx_node and fx_node not in u.args[1:]
               and (isinstance(u.args[1], (int, float)) or made_by in ([torch.div], [torch.mul]))
               for u in fx_node.users)


def _rng_state(fx_node: torch.fx.Node) -> bool:
    """Whether the node is a random generator's state that activation checkpointing saves for the backward's
    recomputation of a random op (run_and_save_rng_state's first output, run_with_rng_state's first input).
    Why: its fake tensor has a symbolic size (a generator's state is as long as its device makes it), which
    sent every graph of a dropout under torch.utils.checkpoint to ATen; only those ops read it, so it is an
    opaque value that ATen calls pass along (type None)."""
    hops = torch.ops.higher_order
    if fx_node.op == "call_function" and fx_node.target is operator.getitem and fx_node.args[1] == 0:
        source = fx_node.args[0]
        if isinstance(source, torch.fx.Node) and source.target is hops.run_and_save_rng_state:
            return True
    users = list(fx_node.users)
    return bool(users) and all(u.target is hops.run_with_rng_state and u.args[0] is fx_node for u in users)


# ops that make a tensor from constant arguments alone, the same at every call
FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}


def _only_read(fx_node: torch.fx.Node) -> bool:
    """Whether no user writes the node's tensor or returns it, directly or through views of it (a view
    returned from a graph is the constant's storage: a caller's in-place update would change later calls)."""
    for u in fx_node.users:
        if u.op == "output" or isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable:
            return False
        aliases = u.target is operator.getitem or isinstance(u.target, torch._ops.OpOverload) and (
            u.target.is_view or str(u.target) in VIEWS or u.target in SPLITS)
        if aliases and not _only_read(u):
            return False
    return True


def _pieces(fx_node: torch.fx.Node, args: tuple, nodes: list[Node]) -> list[tuple[Any, tuple]] | None:
    """A split's (or unbind's) items as the slice (or select) view op and args each one is, or None when
    the node is no split whose every user takes one item. Why: ATen's split is one dispatch of several
    microseconds, then one per item; slices are index maps a kernel reads through, or one as_strided."""
    if fx_node.op != "call_function" or fx_node.target not in SPLITS or not isinstance(args[0], Ref) \
            or nodes[args[0].index].type is None or fx_node.kwargs \
            or not all(u.target is operator.getitem for u in fx_node.users):
        return None
    shape = nodes[args[0].index].type.shape
    if fx_node.target is aten.unbind.int:
        dim = (args[1] if len(args) > 1 else 0) % len(shape)
        return [(aten.select.int, (args[0], dim, i)) for i in range(shape[dim])]
    dim = (args[2] if len(args) > 2 else 0) % len(shape)
    if fx_node.target is aten.split.Tensor:
        step = args[1]
        sizes = [min(step, shape[dim] - start) for start in range(0, shape[dim], step)] or [0]
    else:
        sizes = list(args[1])
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(aten.slice.Tensor, (args[0], dim, start, start + size)) for start, size in zip(starts, sizes)]


def _tensor_args(args, kwargs, nodes) -> list[TensorType | None]:
    found: list = []
    torch.fx.node.map_aggregate((args, kwargs),
                                lambda a: found.append(nodes[a.index].type) if isinstance(a, Ref) else None)
    return found


def _positive_int(a, dtype: str) -> bool:
    """Whether `a` is a Python int above 0 that integer `dtype` holds: the divisors a kernel divides by without a
    check (eager wraps a larger one into the dtype: int8 % 200 divides by -56)."""
    return isinstance(a, int) and not isinstance(a, bool) and dtype != "bool" and \
        0 < a <= torch.iinfo(getattr(torch, dtype)).max


def _number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def classify(op: str, args: tuple, kwargs: dict, type_: TensorType | None, nodes: list[Node],
             device: str = "cpu", dtypes: tuple[str, ...] = DTYPES) -> Kind:
    """Which kind of IR node an ATen call becomes; extern whenever the generator is not sure."""
    if type_ is None or type_.dtype not in dtypes or type_.numel == 0:
        return Kind.EXTERN
    tensors = _tensor_args(args, kwargs, nodes)
    if any(t is None or t.dtype not in dtypes for t in tensors):
        return Kind.EXTERN
    if op in VIEWS:
        return Kind.VIEW
    if op == CAT:        # torch promotes pieces of mixed dtypes: those stay ATen's
        same_rank = all(t.numel == 0 or len(t.shape) == len(type_.shape) for t in tensors)
        return Kind.POINTWISE if same_rank and all(t.dtype == type_.dtype for t in tensors) else Kind.EXTERN
    if op == FLIP:
        return Kind.POINTWISE
    if op in MODULOS | ROUNDED_DIVISIONS:
        if type_.dtype in INTEGER_DTYPES and not _positive_int(args[1], type_.dtype):
            return Kind.EXTERN
        if op in ROUNDED_DIVISIONS and (kwargs.get("rounding_mode") not in ("trunc", "floor")
                                        or type_.dtype in HALF_DTYPES and not _number(args[1])):
            return Kind.EXTERN
    if op in POINTWISE_OPS:
        extra = set(kwargs) - {"alpha", "dtype", "layout", "device", "pin_memory", "memory_format",
                               "non_blocking", "rounding_mode"}
        made_on = kwargs.get("device")
        if extra or (made_on is not None and not same_device(made_on, device)):
            return Kind.EXTERN
        scalars_ok = all(isinstance(a, (Ref, int, float, bool)) or a is None
                         for a in args[1:] if op != "aten.full.default")
        return Kind.POINTWISE if scalars_ok else Kind.EXTERN
    if op in REDUCTIONS:
        src = nodes[args[0].index].type
        floats = src.dtype in FLOAT_DTYPES + HALF_DTYPES and type_.dtype == src.dtype
        # a sum of integers or bools (cross-entropy's count of targets not ignored) is int64, as torch's
        counts = REDUCTIONS[op] == "sum" and src.dtype in INTEGER_DTYPES and type_.dtype == "int64"
        return Kind.REDUCE if (floats or counts) and src.numel > 0 else Kind.EXTERN
    if op in ("aten.mm.default", "aten.bmm.default", "aten.addmm.default"):
        if type_.dtype not in ("float32", *HALF_DTYPES) or any(t.dtype != type_.dtype for t in tensors):
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
