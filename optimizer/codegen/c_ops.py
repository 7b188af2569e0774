"""The pointwise ATen ops the C generator covers, each as a C expression of its operands.

Operands arrive already rendered (a C expression and the dtype it has); each entry returns the
expression of the result in the node's output dtype. The table has one entry per op of
optimizer.ops.POINTWISE_OPS (the target-neutral list of what is fused) and CTYPES one per ops.DTYPES.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from optimizer.ir import HALF_DTYPES
from optimizer.ops import CPU_BF16_SQUARE_ROUNDED_POWERS, comparison_dtype, half_operand_rounded

CTYPES = {"float32": "float", "float64": "double", "int64": "int64_t", "int32": "int32_t",
          "int16": "int16_t", "int8": "int8_t", "uint8": "uint8_t",
          "bool": "uint8_t"}   # torch bools are bytes of 0/1; GCC will not vectorize loads of _Bool
FLOATS = ("float32", "float64")
NARROW_INTS = ("int16", "int8", "uint8")
# 16-bit floats (ir.HALF_DTYPES) are held and computed in fp32, as eager's opmath and Inductor do: widened
# where loaded, rounded to nearest even where stored, where the graph converts to them (_to_copy) and after
# each op of the user's (ir.from_fx's params["rounded"]), not after the pieces of a decomposed op (see
# the comment on 16-bit floats in codegen/triton.py for why). In memory: their 16 bits, converted by the prelude.
BUFFER_CTYPES = {**CTYPES, "bfloat16": "uint16_t", "float16": "uint16_t"}


def computed_in(dtype: str) -> str:
    """The dtype a value of `dtype` is held and computed in: fp32 for the 16-bit floats."""
    return "float32" if dtype in HALF_DTYPES else dtype


def widened(expr: str, dtype: str) -> str:
    """A loaded element `expr` of a `dtype` buffer as the value computed with (a half as fp32, exactly)."""
    return {"bfloat16": f"tfsn_bf16_to_float({expr})", "float16": f"tfsn_fp16_to_float({expr})"}.get(dtype, expr)


def narrowed(expr: str, dtype: str) -> str:
    """A computed value as an element of a `dtype` buffer (a half rounded to nearest even, as torch rounds)."""
    return {"bfloat16": f"tfsn_float_to_bf16({expr})", "float16": f"tfsn_float_to_fp16({expr})"}.get(dtype, expr)


def rounded(expr: str, dtype: str) -> str:
    """An fp32 value rounded to `dtype` and held in fp32 again, where `dtype` is a half."""
    return widened(narrowed(expr, dtype), dtype) if dtype in HALF_DTYPES else expr


@dataclass(frozen=True)
class Operand:
    """A rendered input: a C expression and its dtype ('float64'/'int64'/'bool' for Python scalars)."""
    expr: str
    dtype: str
    scalar: bool = False
    value: float | int | bool | None = None    # a Python scalar's own value, for special cases (x ** 2)
    zero_dim: bool = False                     # a 0-d tensor: ranks below dimensioned ones in promotion
    half: str | None = None                    # a 16-bit float's own dtype, held as fp32 (dtype)
    exact: bool = False                        # a half held as its exact value (loopnest.exact_halves)


def literal(value: float | int | bool) -> Operand:
    """A Python scalar as a C literal; inf and nan spelled as C spells them."""
    if isinstance(value, bool):
        return Operand("1" if value else "0", "bool", True, value)
    if isinstance(value, int):
        return Operand(f"INT64_C({value})", "int64", True, value)
    if math.isnan(value):
        return Operand("NAN", "float64", True, value)
    if math.isinf(value):
        return Operand("INFINITY" if value > 0 else "(-INFINITY)", "float64", True, value)
    return Operand(repr(float(value)), "float64", True, value)


NONE = Operand("None", "none", True)   # an argument that is not a value (a size list, None)


def cast(op: Operand, dtype: str) -> str:
    """`op` as a C value of `dtype` (the compiler folds casts of literals). To bool is a test against
    zero, as torch casts: `(uint8_t)0.5` is 0 and `(uint8_t)256` is 0 where torch gives True. A float
    to a narrow integer goes through int64, whose conversion wraps as torch's does (300.0 -> uint8 44,
    -129.5 -> int8 127); C leaves a float out of the narrow type's range undefined, and GCC kept the
    int32 value (int8 -135 where torch has 121)."""
    if op.dtype == dtype:
        return op.expr
    if dtype == "bool":
        return f"(({op.expr}) != 0)"
    if op.dtype in FLOATS and dtype in NARROW_INTS:
        return f"(({CTYPES[dtype]})(int64_t)({op.expr}))"
    return f"(({CTYPES[dtype]})({op.expr}))"


Render = Callable[[list[Operand], str, dict], str]


def _binary(fmt: str) -> Render:
    def render(ops, out, kw):
        a, b = (cast(o, out) for o in ops[:2])
        return fmt.format(a=a, b=b)
    return render


def _or_for_bools(render: Render) -> Render:
    """`render` of a sum, made torch's logical or where the result is bool (True + True is True): computed in
    int32 and tested against zero. A bool is held as an int32 in a loop and stored as a byte, so the plain
    sum stored 2, which reads back as 2.0 where converted to a float (and counts twice where summed)."""
    def rendered(ops, out, kw):
        return f"({render(ops, 'int32', kw)} != 0)" if out == "bool" else render(ops, out, kw)
    return rendered


def _alpha(sign: str, reverse: bool = False) -> Render:
    @_or_for_bools
    def render(ops, out, kw):
        a, b = (cast(o, out) for o in (ops[1::-1] if reverse else ops[:2]))
        alpha = kw.get("alpha", 1)
        if alpha != 1 and out in FLOATS:
            # one fused multiply-add, as ATen computes a + alpha * b: rounded once, so inf + alpha * -3e38
            # stays inf where a separate product would overflow to -inf and the sum become NaN
            return f"fma({cast(literal(alpha if sign == '+' else -alpha), out)}, {b}, {a})"
        if alpha != 1:
            b = f"({cast(literal(alpha), out)} * {b})"
        return f"({a} {sign} {b})"
    return render


def _unary(fmt: str) -> Render:
    def render(ops, out, kw):
        return fmt.format(a=cast(ops[0], out), one=cast(literal(1.0), out) if out in FLOATS else "1")
    return render


def _libm(name: str) -> Render:
    """A libm function at the operand's precision: `tanhf` for fp32, which the prelude declares
    SIMD (glibc's libmvec) so loops of it vectorize; `tanh` (double) for everything else."""
    def render(ops, out, kw):
        return f"{name}{'f' if out == 'float32' else ''}({cast(ops[0], out)})"
    return render


def _libm2(name: str) -> Render:
    """A libm function of two operands at their precision (`atan2f` for fp32, `atan2` for fp64): C99's Annex F
    cases, as torch's (signed zeros and infinities of atan2, hypot's inf of an infinity and a NaN)."""
    def render(ops, out, kw):
        return f"{name}{'f' if out == 'float32' else ''}({cast(ops[0], out)}, {cast(ops[1], out)})"
    return render


def in_half(o: Operand, half: str) -> str:
    """Operand `o` as a value of the 16-bit `half`, in fp32: rounded to it, unless it holds such a value exactly."""
    return cast(o, "float32") if o.exact and o.half == half else rounded(cast(o, "float32"), half)


def _modulo(name: str) -> Render:
    """fmod or remainder (`name`, the prelude's for int64 and floats) in the operands' result type: libm's
    exact fmod; a half's operands are rounded to it, as eager divides the halves (an fp16 x % 0.1 divides by
    0.0999755859375, and a step at each multiple makes x's own rounding matter as for floor)."""
    def render(ops, out, kw):
        t = comparison_dtype((o.half or o.dtype, o.scalar, o.zero_dim) for o in ops[:2])
        if t in HALF_DTYPES:
            a, b = (in_half(o, t) for o in ops[:2])
            return f"tfsn_{name}f({a}, {b})"
        if out in FLOATS:
            return f"tfsn_{name}{'f' if out == 'float32' else ''}({cast(ops[0], out)}, {cast(ops[1], out)})"
        return cast(Operand(f"tfsn_{name}_i64({cast(ops[0], 'int64')}, {cast(ops[1], 'int64')})", "int64"), out)
    return render


def _rounded_division(ops, out, kw):
    """torch.div with rounding_mode "trunc" or "floor" (`//`), as ATen's: the correctly rounded quotient
    truncated, or the prelude's tfsn_div_floor (ATen's own, through fmod). A half is divided in fp32 by a
    Python number, as eager does (no rounding of either to the half); an integer by a positive Python int
    (optimizer/ops.py ROUNDED_DIVISIONS)."""
    floor = kw["rounding_mode"] == "floor"
    if out in FLOATS:
        a, b, suffix = cast(ops[0], out), cast(ops[1], out), "f" if out == "float32" else ""
        return f"tfsn_div_floor{suffix}({a}, {b})" if floor else f"trunc{suffix}({a} / {b})"
    a, b = cast(ops[0], "int64"), cast(ops[1], "int64")
    return cast(Operand(f"tfsn_div_floor_i64({a}, {b})" if floor else f"({a} / {b})", "int64"), out)


def _exp(fmt: str) -> Render:
    """exp through the prelude's vectorizable tfsn_expf for fp32, libm's otherwise."""
    def render(ops, out, kw):
        a = cast(ops[0], out)
        e = (lambda v: f"tfsn_expf({v})") if out == "float32" else (lambda v: f"exp({v})")
        one = cast(literal(1.0), out)
        return fmt.format(a=a, exp=e(a), exp_neg=e(f"-{a}"), one=one)
    return render


def _compare(sign: str) -> Render:
    """A comparison in its operands' result_type; in a half, both sides rounded to it as eager compares
    (an fp16 tensor's 0.1 is 0.0999755859375, equal to fp16(0.1) and less than 0.1)."""
    def render(ops, out, kw):
        t = comparison_dtype((o.half or o.dtype, o.scalar, o.zero_dim) for o in ops[:2])
        a, b = (in_half(o, t) if t in HALF_DTYPES else cast(o, t) for o in ops[:2])
        return f"({a} {sign} {b})"
    return render


def _pow(ops, out, kw):
    base, exponent = ops
    if out not in FLOATS:       # integers: exact, wrapping, as torch's powi (libm's pow is a double)
        return f"(({CTYPES[out]})tfsn_ipow({cast(base, 'int64')}, {cast(exponent, 'int64')}))"
    if exponent.scalar:
        e = float(exponent.value)
        b = cast(base, out)
        if e == 2.0:
            return f"({b} * {b})"
        if e == 3.0:
            return f"({b} * {b} * {b})"
        if e == 0.5:
            return f"sqrt({b})"
        if e == 1.0:
            return b
        if e == -1.0:
            return f"({cast(literal(1.0), out)} / {b})"
        # ATen's own special cases too, whose values differ from pow's at -inf and -0.0
        # (rsqrt(-inf) is NaN where pow(-inf, -0.5) is +0)
        if e == -0.5:
            return f"({cast(literal(1.0), out)} / sqrt({b}))"
        if e == -2.0:
            return f"({cast(literal(1.0), out)} / ({b} * {b}))"
    return f"pow({cast(base, out)}, {cast(exponent, out)})"


def _clamp(ops, out, kw):
    x = cast(ops[0], out)
    lo = ops[1] if len(ops) > 1 else None
    hi = ops[2] if len(ops) > 2 else None
    # a NaN bound makes every result NaN in torch, which a comparison alone would skip
    if lo is not None and lo is not NONE:
        b = cast(lo, out)
        x = f"({x} < {b} || {b} != {b} ? {b} : {x})" if out in FLOATS else f"({x} < {b} ? {b} : {x})"
    if hi is not None and hi is not NONE:
        b = cast(hi, out)
        x = f"({x} > {b} || {b} != {b} ? {b} : {x})" if out in FLOATS else f"({x} > {b} ? {b} : {x})"
    return x


def _where(ops, out, kw):
    return f"({ops[0].expr} ? {cast(ops[1], out)} : {cast(ops[2], out)})"


def _masked_fill(ops, out, kw):
    return f"({ops[1].expr} ? {cast(ops[2], out)} : {cast(ops[0], out)})"


def _identity(ops, out, kw):
    return cast(ops[0], out)


def _float_only(fmt: str) -> Render:
    """A rounding function: itself on floats, the identity on integers (whose value it is already;
    through a double it would lose an int64's low bits)."""
    def render(ops, out, kw):
        return fmt.format(a=cast(ops[0], out)) if out in FLOATS else cast(ops[0], out)
    return render


def _abs(ops, out, kw):
    a = cast(ops[0], out)
    return f"fabs({a})" if out in FLOATS else f"({a} < 0 ? -{a} : {a})"


def _constant(index: int) -> Render:
    """Ops whose value is one of their scalar arguments (full, fill, scalar_tensor)."""
    def render(ops, out, kw):
        return cast(ops[index], out)
    return render


def _copy(ops, out, kw):
    return cast(ops[1], out)


def _nan_max(sign: str) -> Render:
    # torch.maximum/minimum propagate NaN (a plain comparison would drop it) and return their
    # first operand on a tie (-0.0 vs 0.0 keeps its sign), hence >= / <=. The two conditions are
    # added, not ||-ed (a branch) nor |-ed: gcc 12 vectorizes neither of those in a chain of
    # maxima (a 2x2 max pool ran scalar, mispredicting on random data)
    def render(ops, out, kw):
        a, b = (cast(o, out) for o in ops)
        return f"((({a} {sign} {b}) + ({a} != {a})) ? {a} : {b})"
    return render


def _logical(sign: str) -> Render:
    """and/or of truth values, both sides always evaluated (branch-free, as `_nan_max`)."""
    def render(ops, out, kw):
        a, b = (f"({o.expr} != 0)" for o in ops[:2])
        return f"({a} {sign} {b})"
    return render


POINTWISE: dict[str, Render] = {
    "aten.add.Tensor": _alpha("+"), "aten.add.Scalar": _alpha("+"),
    "aten.sub.Tensor": _alpha("-"), "aten.sub.Scalar": _alpha("-"), "aten.rsub.Scalar": _alpha("-", True),
    "aten.rsub.Tensor": _alpha("-", True),
    "aten.mul.Tensor": _binary("({a} * {b})"), "aten.mul.Scalar": _binary("({a} * {b})"),
    "aten.div.Tensor": _binary("({a} / {b})"), "aten.div.Scalar": _binary("({a} / {b})"),
    "aten.div.Tensor_mode": _rounded_division, "aten.div.Scalar_mode": _rounded_division,
    "aten.neg.default": _unary("(-{a})"), "aten.abs.default": _abs,
    "aten.exp.default": _exp("{exp}"), "aten.exp2.default": _unary("exp2({a})"),
    "aten.expm1.default": _libm("expm1"), "aten.log.default": _libm("log"),
    "aten.log2.default": _unary("log2({a})"), "aten.log1p.default": _libm("log1p"),
    "aten.sqrt.default": _unary("sqrt({a})"), "aten.rsqrt.default": _unary("({one} / sqrt({a}))"),
    "aten.reciprocal.default": _unary("({one} / {a})"), "aten.sin.default": _libm("sin"),
    "aten.cos.default": _libm("cos"), "aten.tanh.default": _libm("tanh"),
    "aten.erf.default": _libm("erf"), "aten.atan2.default": _libm2("atan2"), "aten.hypot.default": _libm2("hypot"),
    "aten.sigmoid.default": _exp("({one} / ({one} + {exp_neg}))"),
    "aten.fmod.Tensor": _modulo("fmod"), "aten.fmod.Scalar": _modulo("fmod"),
    "aten.remainder.Tensor": _modulo("remainder"), "aten.remainder.Scalar": _modulo("remainder"),
    "aten.relu.default": _unary("({a} < 0 ? 0 : {a})"), "aten.floor.default": _float_only("floor({a})"),
    "aten.ceil.default": _float_only("ceil({a})"), "aten.trunc.default": _float_only("trunc({a})"),
    "aten.round.default": _float_only("nearbyint({a})"),
    "aten.sign.default": _unary("(({a} > 0) - ({a} < 0))"),
    "aten.pow.Tensor_Scalar": _pow, "aten.pow.Tensor_Tensor": _pow, "aten.pow.Scalar": _pow,
    # Inductor's prim (torch._inductor.inductor_prims), which its decompositions of lerp and addcmul
    # use once Inductor is loaded: a * b + c rounded once, as C's fma
    "prims.fma.default": _or_for_bools(lambda o, out, kw: (
        f"fma({cast(o[0], out)}, {cast(o[1], out)}, {cast(o[2], out)})" if out in FLOATS else
        f"({cast(o[0], out)} * {cast(o[1], out)} + {cast(o[2], out)})")),  # integers wrap in their own type
    "aten.maximum.default": _nan_max(">="), "aten.minimum.default": _nan_max("<="),
    "aten.clamp_min.default": lambda o, out, kw: _clamp([o[0], o[1]], out, kw),
    "aten.clamp_max.default": lambda o, out, kw: _clamp([o[0], NONE, o[1]], out, kw),
    "aten.clamp.default": _clamp,
    "aten.where.self": _where, "aten.masked_fill.Scalar": _masked_fill, "aten.masked_fill.Tensor": _masked_fill,
    "aten.eq.Tensor": _compare("=="), "aten.eq.Scalar": _compare("=="),
    "aten.ne.Tensor": _compare("!="), "aten.ne.Scalar": _compare("!="),
    "aten.lt.Tensor": _compare("<"), "aten.lt.Scalar": _compare("<"),
    "aten.le.Tensor": _compare("<="), "aten.le.Scalar": _compare("<="),
    "aten.gt.Tensor": _compare(">"), "aten.gt.Scalar": _compare(">"),
    "aten.ge.Tensor": _compare(">="), "aten.ge.Scalar": _compare(">="),
    "aten.logical_not.default": lambda o, out, kw: f"(!{o[0].expr})",
    "aten.logical_and.default": _logical("&"), "aten.logical_or.default": _logical("|"),
    "aten.bitwise_and.Tensor": lambda o, out, kw: f"({cast(o[0], out)} & {cast(o[1], out)})",
    "aten.bitwise_or.Tensor": lambda o, out, kw: f"({cast(o[0], out)} | {cast(o[1], out)})",
    "aten.bitwise_not.default": lambda o, out, kw: f"(!{o[0].expr})" if out == "bool" else f"(~{o[0].expr})",
    "aten.isnan.default": lambda o, out, kw: f"({o[0].expr} != {o[0].expr})",
    "aten._to_copy.default": _identity, "aten.clone.default": _identity,
    "aten.lift_fresh_copy.default": _identity, "aten.copy.default": _copy,
    "aten.fill.Scalar": _constant(1), "aten.full.default": _constant(1), "aten.full_like.default": _constant(1),
    "aten.scalar_tensor.default": _constant(0),
}


def expression(op: str, operands: list[Operand], out: str, kw: dict, result_rounded: bool = False) -> str:
    """The C expression of an `op` node of dtype `out`: a half computed in fp32, its result rounded where
    `result_rounded` (ops.eager_rounded: loopnest.exact_halves counts on it, whatever the op), a half operand
    not held exactly rounded where an op of another dtype or a function to whole numbers reads it
    (ops.half_operand_rounded)."""
    value = _computed(op, operands, out, kw)
    return rounded(value, out) if result_rounded else value


def _computed(op: str, operands: list[Operand], out: str, kw: dict) -> str:
    """`expression`'s value before its result is rounded. Eager's pow of a half by a scalar rounds the exponent
    to the half first (x ** 1.7 in bf16 is x ** 1.703125), and for fp16 by 0.5 or -0.5 is pow itself, not sqrt
    or 1 / sqrt as for the other floats (pow(-inf, 0.5) is inf where sqrt(-inf) is NaN); bf16's x ** 3 and
    x ** -2 round the square x * x to bf16 first (ops.CPU_BF16_SQUARE_ROUNDED_POWERS)."""
    if out in HALF_DTYPES and op == "aten.pow.Tensor_Scalar" and operands[1].scalar:
        import torch
        exponent = float(torch.tensor(float(operands[1].value), dtype=torch.float64).to(getattr(torch, out)))
        operands = [operands[0], literal(exponent)]
        if out == "float16" and exponent in (0.5, -0.5):
            return f"pow({cast(operands[0], 'float32')}, {cast(operands[1], 'float32')})"
        if out == "bfloat16" and exponent in CPU_BF16_SQUARE_ROUNDED_POWERS:
            base = cast(operands[0], "float32")
            square = rounded(f"({base} * {base})", out)
            return f"({square} * {base})" if exponent == 3.0 else f"({cast(literal(1.0), 'float32')} / {square})"
    # a half computed in fp32 and converted or rounded to a whole number: eager's value was the half
    # (fp16 x + finfo.min is -65504 whatever x, so a fully masked row's softmax is uniform, not softmax(x))
    operands = [replace(o, expr=rounded(o.expr, o.half), exact=True)
                if not o.exact and half_operand_rounded(op, o.half, out) else o for o in operands]
    return POINTWISE[op](operands, computed_in(out), kw)
