"""A jaxpr (jax.make_jaxpr of a training step: its value_and_grad and its update) lowered to the IR.

Each lax primitive the generator covers becomes the IR node of the ATen op that means the same
(add -> aten.add.Tensor, reduce_sum -> aten.sum.dim_IntList, broadcast_in_dim -> a view and an
expand, dot_general -> permutes, views and mm/bmm), so that fusion, the loop nests, the search and
the C renderer work on it unchanged. Every node's `target` is a JAX callable taking that ATen op's
arguments: what runs when the node is a step of its own (optimizer/jax_runtime.py). Any other
primitive (gather, scatter-add, iota, concatenate, argmax, a bf16 op...) is an extern node that
binds the primitive itself, so it runs in XLA exactly as under jax.jit. Nested jaxprs (jit,
custom_jvp_call, custom_vjp_call, remat) are inlined.

Values live in XLA buffers: row-major and contiguous. A view node has the strides it has over its
base's buffer (a transpose's permuted strides, a broadcast's zeros), so generated kernels read it
in place; a reshape that no strides express (of a transposed value) is an extern copy instead.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from optimizer.ir import Graph, Kind, Node, Ref, TensorType, classify, contiguous_strides, reduce_params

# lax primitives with an ATen op of the same meaning and the same operands
POINTWISE = {
    "add": "aten.add.Tensor", "add_any": "aten.add.Tensor", "sub": "aten.sub.Tensor", "mul": "aten.mul.Tensor",
    "max": "aten.maximum.default", "min": "aten.minimum.default", "neg": "aten.neg.default",
    "exp": "aten.exp.default", "exp2": "aten.exp2.default", "log": "aten.log.default",
    "log1p": "aten.log1p.default", "expm1": "aten.expm1.default", "tanh": "aten.tanh.default",
    "logistic": "aten.sigmoid.default", "erf": "aten.erf.default", "sqrt": "aten.sqrt.default",
    "rsqrt": "aten.rsqrt.default", "abs": "aten.abs.default", "sin": "aten.sin.default", "cos": "aten.cos.default",
    "floor": "aten.floor.default", "ceil": "aten.ceil.default", "pow": "aten.pow.Tensor_Tensor",
    "eq": "aten.eq.Tensor", "ne": "aten.ne.Tensor", "lt": "aten.lt.Tensor", "le": "aten.le.Tensor",
    "gt": "aten.gt.Tensor", "ge": "aten.ge.Tensor", "and": "aten.bitwise_and.Tensor",
    "or": "aten.bitwise_or.Tensor", "not": "aten.bitwise_not.default",
    "convert_element_type": "aten._to_copy.default", "copy": "aten.clone.default", "copy_p": "aten.clone.default",
}
FLOAT_ONLY = {"div": "aten.div.Tensor"}     # integer division by zero is defined in XLA, undefined in C
COMMUTATIVE = {"add", "add_any", "mul", "max", "min", "eq", "ne", "and", "or"}
REDUCTIONS = {"reduce_sum": "aten.sum.dim_IntList", "reduce_max": "aten.amax.default",
              "reduce_min": "aten.amin.default"}
IDENTITIES = {"stop_gradient", "optimization_barrier"}     # their value is their operand's
CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")               # params holding the jaxpr of a call to inline
INLINED = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"}


def from_jaxpr(closed: Any) -> Graph:
    """The IR of a ClosedJaxpr (jax.make_jaxpr's result); the graph's inputs are its invars in order."""
    builder = _Builder()
    consts = [builder.constant(c, v.aval) for c, v in zip(closed.consts, closed.jaxpr.constvars)]
    inputs = [builder.input(v) for v in closed.jaxpr.invars]
    outputs = builder.lower(closed.jaxpr, consts, inputs)
    return builder.graph(inputs, outputs)


def view_strides(shape: Sequence[int], strides: Sequence[int], new: Sequence[int]) -> tuple[int, ...] | None:
    """The strides of a reshape to `new` that reads the same memory, None where there are none
    (ATen's computeStride: dims that are contiguous with each other may merge or split)."""
    if math.prod(shape) <= 1:
        return contiguous_strides(new)
    out = [0] * len(new)
    view_d = len(new) - 1
    base = strides[-1]
    tensor_numel = view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != tensor_numel * base):
            while view_d >= 0 and (view_numel < tensor_numel or new[view_d] == 1):
                out[view_d] = view_numel * base
                view_numel *= new[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                base, tensor_numel, view_numel = strides[d - 1], 1, 1
    return tuple(out) if view_d == -1 else None


def transposed_products(jaxpr: Any) -> dict:
    """The dot_generals of `jaxpr` read only by a transpose that swaps their lhs and rhs free dims
    (JAX's gradient of x @ w with respect to w is dot_general(g, x) transposed), by output var:
    each is lowered as the product of its operands swapped, which is that transpose written in
    row-major order. Why: a kernel reading the product through the transpose's strides reads it
    across rows, one element per row (the Adam update of a weight read its gradient so: 4x the time)."""
    readers: dict[Any, list] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                readers.setdefault(v, []).append(eqn)
    outputs = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    found = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "dot_general" or eqn.outvars[0] in outputs:
            continue
        users = readers.get(eqn.outvars[0], [])
        if len(users) != 1 or users[0].primitive.name != "transpose":
            continue
        (lc, _), (lb, _) = eqn.params["dimension_numbers"]
        lhs, rhs = (v.aval.ndim for v in eqn.invars)
        nb, nl = len(lb), lhs - len(lc) - len(lb)
        nr = eqn.outvars[0].aval.ndim - nb - nl
        swap = [*range(nb), *range(nb + nl, nb + nl + nr), *range(nb, nb + nl)]
        if list(users[0].params["permutation"]) == swap:
            found[eqn.outvars[0]] = users[0]
    return found


def _bind(primitive: Any, params: dict, picks: tuple[int, ...], literals: dict, *args: Any) -> Any:
    """The primitive on the operands it had in the jaxpr: `args` are the node's (ATen-ordered)
    arguments, picks[k] the one that is operand k, literals[k] operand k's typed value where the
    jaxpr had a literal there."""
    operands = [literals[k] if k in literals else args[p] for k, p in enumerate(picks)]
    return primitive.bind(*operands, **primitive.get_bind_params(params))   # as jax.core.eval_jaxpr binds


def _full(dtype: Any, shape: Sequence[int], value: Any) -> Any:
    return jnp.full(tuple(shape), value, dtype)


def _reshape(x: Any, shape: Sequence[int]) -> Any:
    return jnp.reshape(x, tuple(shape))


def _expand(x: Any, shape: Sequence[int]) -> Any:
    return jnp.broadcast_to(x, tuple(shape))


def _permute(x: Any, perm: Sequence[int]) -> Any:
    return jnp.transpose(x, tuple(perm))


def _constant(value: Any) -> Any:
    return value


class _Literal:
    """A jaxpr literal as an operand: its typed value (for XLA) and its Python scalar (for ATen)."""

    def __init__(self, value: Any) -> None:
        self.array = np.asarray(value)
        self.scalar = self.array.item() if self.array.ndim == 0 else None


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []

    # ---- nodes ----
    def add(self, name: str, op: str, target: Any, args: tuple, shape: Sequence[int], dtype: Any,
            kind: Kind | None = None, strides: Sequence[int] | None = None) -> int:
        """A node; its kind from ir.classify (extern wherever the generator is not sure) unless
        given. A view keeps `strides` over its base; any other node is contiguous."""
        if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):     # a PRNG key: only XLA's ops read it
            self.nodes.append(Node(len(self.nodes), name, Kind.INPUT if kind == Kind.INPUT else Kind.EXTERN, op,
                                   target, args, {}, None, {}))
            return len(self.nodes) - 1
        type_ = TensorType(tuple(shape), contiguous_strides(shape), np.dtype(dtype).name)
        kind = kind or classify(op, args, {}, type_, self.nodes)
        if kind == Kind.VIEW:
            if strides is None:
                kind = Kind.EXTERN
                op = op.replace("aten.", "jax.", 1)
            else:
                type_ = TensorType(type_.shape, tuple(strides), type_.dtype)
        params = reduce_params(op, args, {}, self.nodes) if kind == Kind.REDUCE else {}
        self.nodes.append(Node(len(self.nodes), name, kind, op, target, args, {}, type_, params))
        return len(self.nodes) - 1

    def input(self, var: Any) -> Ref:
        return Ref(self.add(f"in{len(self.nodes)}", "input", None, (), var.aval.shape, var.aval.dtype, Kind.INPUT))

    def constant(self, value: Any, aval: Any) -> Ref:
        return Ref(self.add(f"const{len(self.nodes)}", "constant", functools.partial(_constant, value), (),
                            aval.shape, aval.dtype, Kind.EXTERN))

    def type_of(self, v: Any) -> TensorType | None:
        return self.nodes[v.index].type if isinstance(v, Ref) else None

    def float_to_int(self, x: Any, dtype: Any) -> bool:
        """Whether converting operand x to dtype takes a float to an integer type (bool aside)."""
        t = self.type_of(x)
        source = x.array.dtype if isinstance(x, _Literal) else jnp.dtype(t.dtype) if t is not None else None
        return source is not None and jnp.issubdtype(source, jnp.floating) and jnp.issubdtype(dtype, jnp.integer)

    def view(self, x: Ref, shape: Sequence[int]) -> Ref:
        t = self.type_of(x)
        if tuple(shape) == t.shape:
            return x
        strides = view_strides(t.shape, t.strides, shape)
        return Ref(self.add("view", "aten.view.default", _reshape, (x, list(shape)), shape, t.dtype, strides=strides))

    def permute(self, x: Ref, perm: Sequence[int]) -> Ref:
        t = self.type_of(x)
        if list(perm) == list(range(len(perm))):
            return x
        return Ref(self.add("permute", "aten.permute.default", _permute, (x, list(perm)),
                            [t.shape[p] for p in perm], t.dtype, strides=[t.strides[p] for p in perm]))

    def expand(self, x: Ref, shape: Sequence[int]) -> Ref:
        t = self.type_of(x)
        if tuple(shape) == t.shape:
            return x
        strides = [0 if n == 1 and m != 1 else s for n, m, s in zip(t.shape, shape, t.strides)]
        return Ref(self.add("expand", "aten.expand.default", _expand, (x, list(shape)), shape, t.dtype,
                            strides=strides))

    # ---- equations ----
    def lower(self, jaxpr: Any, consts: list, inputs: list) -> list:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, inputs))
        swapped = transposed_products(jaxpr)

        def read(v: Any) -> Any:
            return _Literal(v.val) if isinstance(v, jcore.Literal) else env[v]

        for eqn in jaxpr.eqns:
            if all(isinstance(v, jcore.DropVar) for v in eqn.outvars) and not eqn.effects:
                continue
            if eqn in swapped.values():          # its product was computed in its order already
                env[eqn.outvars[0]] = read(eqn.invars[0])
                continue
            transpose = swapped.get(eqn.outvars[0])
            if transpose is not None:
                lhs, rhs = (read(v) for v in eqn.invars)
                (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
                product = self.dot_general(rhs, lhs, {"dimension_numbers": ((rc, lc), (rb, lb))},
                                           transpose.outvars[0].aval)
                if product is not None:
                    env[eqn.outvars[0]] = product
                    continue
                del swapped[eqn.outvars[0]]
            outs = self.equation(eqn, [read(v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn: Any, operands: list) -> list:
        """The values of one equation's outputs: Refs to the nodes it lowered to (or operands)."""
        name = eqn.primitive.name
        params = eqn.params
        if name in INLINED and not eqn.effects:
            inner = next((params[k] for k in CALLS if k in params), None)
            if inner is not None:
                jaxpr, consts = (inner.jaxpr, list(inner.consts)) if hasattr(inner, "consts") else (inner, [])
                consts = [self.constant(c, v.aval) for c, v in zip(consts, jaxpr.constvars)]
                return self.lower(jaxpr, consts, operands)
        if name in IDENTITIES and all(isinstance(x, Ref) for x in operands):
            return list(operands)
        out = eqn.outvars[0].aval if len(eqn.outvars) == 1 else None
        lowered = self.lowered(eqn, operands, out) if out is not None and not eqn.effects else None
        return [lowered] if lowered is not None else self.extern(eqn, operands)

    def lowered(self, eqn: Any, xs: list, out: Any) -> Ref | None:
        """The equation as ATen-named nodes, or None where it stays an extern."""
        name, params = eqn.primitive.name, eqn.params
        literals = {k: x.array for k, x in enumerate(xs) if isinstance(x, _Literal)}
        if not xs or any(isinstance(x, _Literal) and x.scalar is None for x in xs):   # iota; an array literal
            return None
        floating = jnp.issubdtype(out.dtype, jnp.floating)
        if name == "convert_element_type" and self.float_to_int(xs[0], out.dtype):
            return None     # XLA clamps to the type's range and makes NaN 0; the C cast wraps, as torch's does
        op = POINTWISE.get(name) or (FLOAT_ONLY.get(name) if floating else None)
        if op is not None:
            picks = tuple(range(len(xs)))
            if isinstance(xs[0], _Literal) and len(xs) == 2 and name in COMMUTATIVE:
                xs, picks = xs[::-1], (1, 0)
            if isinstance(xs[0], _Literal):      # a scalar first operand (1 - x): a 0-d tensor of it
                lit = xs[0]
                xs = [Ref(self.add("full", "aten.full.default", functools.partial(_full, lit.array.dtype),
                                   ([], lit.scalar), (), lit.array.dtype)), *xs[1:]]
            args = tuple(x.scalar if isinstance(x, _Literal) else x for x in xs)
            return self.bound(name, op, eqn, args, picks, literals, out)
        if isinstance(xs[0], _Literal):
            return self.full(xs[0], out) if name == "broadcast_in_dim" else None
        x = xs[0]
        if name == "integer_pow":
            return self.bound(name, "aten.pow.Tensor_Scalar", eqn, (x, params["y"]), (0,), {}, out)
        if name == "square":
            return self.bound(name, "aten.pow.Tensor_Scalar", eqn, (x, 2), (0,), {}, out)
        if name == "select_n" and len(xs) == 3 and self.type_of(x).dtype == "bool":
            args = (x, *(v.scalar if isinstance(v, _Literal) else v for v in (xs[2], xs[1])))
            return self.bound(name, "aten.where.self", eqn, args, (0, 2, 1), literals, out)
        if name in REDUCTIONS:
            if not params["axes"]:
                return x
            return self.bound(name, REDUCTIONS[name], eqn, (x, list(params["axes"]), False), (0,), {}, out)
        if name in ("reshape", "squeeze") and len(xs) == 1 and params.get("dimensions") is None:
            return self.view(x, out.shape)
        if name == "transpose":
            return self.permute(x, params["permutation"])
        if name == "broadcast_in_dim" and len(xs) == 1:
            mid = [1] * len(out.shape)
            for i, d in enumerate(params["broadcast_dimensions"]):
                mid[d] = self.type_of(x).shape[i]
            return self.expand(self.view(x, mid), out.shape)
        if name == "dot_general" and all(isinstance(v, Ref) for v in xs):
            return self.dot_general(xs[0], xs[1], params, out)
        return None

    def bound(self, name: str, op: str, eqn: Any, args: tuple, picks: tuple, literals: dict, out: Any) -> Ref:
        target = functools.partial(_bind, eqn.primitive, dict(eqn.params), picks, literals)
        return Ref(self.add(name, op, target, args, out.shape, out.dtype))

    def full(self, value: _Literal, out: Any) -> Ref:
        return Ref(self.add("full", "aten.full.default", functools.partial(_full, out.dtype),
                            (list(out.shape), value.scalar), out.shape, out.dtype))

    def dot_general(self, lhs: Ref, rhs: Ref, params: dict, out: Any) -> Ref | None:
        """A contraction as a (batched) matrix product: each operand permuted to (batch, free,
        contracted) and (batch, contracted, free), seen as 2-d or 3-d, the product seen as `out`
        (whose dims dot_general orders batch, lhs free, rhs free)."""
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        ls, rs = self.type_of(lhs), self.type_of(rhs)
        if not (ls.dtype == rs.dtype == np.dtype(out.dtype).name == "float32"):
            return None
        lf = [d for d in range(len(ls.shape)) if d not in lc and d not in lb]
        rf = [d for d in range(len(rs.shape)) if d not in rc and d not in rb]
        batch = [ls.shape[d] for d in lb]
        m, k, n = (math.prod(ls.shape[d] for d in lf), math.prod(ls.shape[d] for d in lc),
                   math.prod(rs.shape[d] for d in rf))
        lead = [math.prod(batch)] if lb else []
        a = self.view(self.permute(lhs, [*lb, *lf, *lc]), [*lead, m, k])
        b = self.view(self.permute(rhs, [*rb, *rc, *rf]), [*lead, k, n])
        op = "aten.bmm.default" if lb else "aten.mm.default"
        product = Ref(self.add("dot", op, jnp.matmul, (a, b), [*lead, m, n], out.dtype))
        return self.view(product, out.shape)

    def extern(self, eqn: Any, operands: list) -> list:
        """The equation as it is: one node that binds the primitive (a tuple for several results,
        each then taken by a getitem node, as FX does)."""
        args = tuple(x.array if isinstance(x, _Literal) else x for x in operands)
        target = functools.partial(_bind, eqn.primitive, dict(eqn.params), tuple(range(len(args))), {})
        name = eqn.primitive.name
        if not eqn.primitive.multiple_results:
            out = eqn.outvars[0].aval
            return [Ref(self.add(name, f"jax.{name}", target, args, out.shape, out.dtype, Kind.EXTERN))]
        whole = self.add(name, f"jax.{name}", target, args, (), np.float32, Kind.EXTERN)
        self.nodes[whole].type = None
        return [Ref(self.add(f"{name}_{i}", "getitem", operator.getitem, (Ref(whole), i), v.aval.shape,
                             v.aval.dtype, Kind.EXTERN)) for i, v in enumerate(eqn.outvars)]

    def graph(self, inputs: list[Ref], outputs: list) -> Graph:
        for node in self.nodes:
            for i in node.inputs:
                self.nodes[i].users.append(node.index)
        refs = []
        for o in outputs:
            if isinstance(o, Ref):
                self.nodes[o.index].users.append(-1)
                refs.append(o)
            else:
                refs.append(o.array)
        return Graph(self.nodes, [r.index for r in inputs], refs, device="cpu")
