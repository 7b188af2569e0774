"""Triton source for one fused group: its loop nest (optimizer.loopnest) printed as a Triton kernel,
shaped by a Schedule read as a GPU launch (see costmodel.predict_gpu and space.gpu_kernel_space).

Three kernel shapes, as the loop nest's:
- pointwise: one program per block of `chunk` elements of the domain (masked loads and stores);
- row reduction: one program per `chunk` rows of kept indices (a [rows, block] tile); each pass of
  reductions is a loop over the reduced axes in blocks of up to GPU_REDUCTION_BLOCK elements, accumulated
  in fp32 (fp64 for fp64) and summed along the block at the end, the per-row values between passes
  are [rows, 1] columns, then one more block loop runs the members over the whole domain; split
  (Schedule.reduction_split, where LoopNest.splittable): the programs of a first kernel each reduce one slice
  of the reduced axes into a scratch of partial results, and a second kernel combines each row's partials
  and runs the per-row values after them, so that a few long rows (x.sum(), a bias gradient) fill the SMs;
- GEMM, generated (Schedule.gemm "generated"): a `tl.dot` tile of gemm_block_rows x gemm_nr over depth
  steps of gemm_kc (fp32 in IEEE precision, TF32 only where the graph was captured with TF32 allowed),
  the epilogue on the tile while it is in registers, `gemm_mr` warps;
- GEMM, library ("library"): the product by the vendor's BLAS through torch (cuBLAS on NVIDIA: what
  eager and Inductor run), in fp32 for 16-bit operands as the generated tile's accumulator, then the
  same tiled program with the tile loaded from the product in place of the depth loop; no program at
  all when the product goes straight into the graph's tensor with nothing after it.
Launched on the tensors' device; under TRITON_INTERPRET=1 on CPU tensors (the tests).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from math import prod
from typing import Any, Callable, Sequence

from optimizer.cache import atomic_write, cache_dir, content_key
from optimizer.costmodel import GPU_MAX_DEPTH, GPU_REDUCTION_BLOCK
from optimizer.expr import Const, Expr, render
from optimizer.ir import HALF_DTYPES, Graph, Kind, Ref
from optimizer.loopnest import (Accumulate, Apply, Assign, Define, GemmElement, Group, Load, LoopNest, Name, Pass,
                                Reduction, RowSegment, Select, Stmt, Store, Temp, accumulator_dtype, bias_epilogue,
                                exact_halves, lower)
from optimizer.loopnest import Operand as LoopOperand
from optimizer.ops import CPU_BF16_SQUARE_ROUNDED_POWERS, comparison_dtype, eager_rounded, half_operand_rounded
from optimizer.schedule import Schedule
from optimizer.space import GPU_ROWS

log = logging.getLogger("tfsn.optimizer")

TL_TYPES = {"float32": "tl.float32", "float64": "tl.float64", "bfloat16": "tl.bfloat16", "float16": "tl.float16",
            "int64": "tl.int64", "int32": "tl.int32",
            "int16": "tl.int16", "int8": "tl.int8", "uint8": "tl.uint8", "bool": "tl.int1"}
FLOATS = ("float32", "float64")
# 16-bit floats are loaded into fp32 and computed in fp32, as Inductor does: rounded where a value is stored,
# where the graph converts to or from them (x.to(torch.bfloat16), h.float()) and after each op of the user's
# (ir.from_fx's params["rounded"]: eager rounds there, and Kahan's compensation relies on it), not after the
# pieces of a decomposed op. Eager runs log_softmax, layer_norm... as one op each, which tfsn sees decomposed:
# rounding each piece measured 5x eager's error on a bf16 cross-entropy, keeping fp32 between them well
# within it.


def _interpreted_bf16(dtype: str) -> bool:
    """Whether conversions between fp32 and `dtype` are made by their bits: bf16 under Triton's interpreter,
    whose own conversions truncate instead of rounding to nearest even and mangle subnormals (1e-40 -> 0,
    and a bf16 subnormal back to fp32 likewise). On a GPU they are the hardware's, as torch's."""
    return dtype == "bfloat16" and os.environ.get("TRITON_INTERPRET") == "1"


def _narrowed(expr: str, dtype: str) -> str:
    """`expr` converted to `dtype` (for a store, or a conversion the graph asks for)."""
    if _interpreted_bf16(dtype):
        return f"tfsn_bf16_of(tl.cast({expr}, tl.float32))"
    return f"({expr}).to({TL_TYPES[dtype]})"


def _widened(expr: str, dtype: str) -> str:
    """`expr`, a 16-bit float of `dtype`, as fp32 (exact)."""
    return f"tfsn_bf16_widened({expr})" if _interpreted_bf16(dtype) else f"({expr}).to(tl.float32)"


def _computed_in(dtype: str) -> str:
    """The dtype a value of `dtype` is held and computed in: fp32 for the 16-bit floats (as eager's opmath)."""
    return "float32" if dtype in HALF_DTYPES else dtype


def _rounded(expr: str, dtype: str) -> str:
    """`expr` (fp32) rounded to `dtype` and held in fp32 again, where `dtype` is a 16-bit float."""
    if dtype not in HALF_DTYPES:
        return expr
    # made fp32 first: `expr` may be a whole literal, and Triton's interpreter turns int -> bf16 into 0
    return _widened(_narrowed(f'tl.cast({expr}, tl.float32)', dtype), dtype)
DEFAULT_BLOCK = 1024        # elements per program when the schedule names none (a CPU schedule)
# A row reduction's program: `chunk` rows (a GPU schedule's rows per program, space.GPU_ROWS; 1 for any other
# chunk) by GPU_REDUCTION_BLOCK reduced elements per pass at most (longer rows loop): costmodel.predict_gpu's shape.
MAX_ROWS_PER_PROGRAM = max(GPU_ROWS)
# Triton's program ids and aranges are int32: a kernel whose domain or tensors reach this many elements (the
# logits of a 128k-vocabulary LM head over 32k tokens: 2**32) computes its indices in int64, as Inductor does.
INT32_INDEX_LIMIT = 2 ** 31


# Added to a pointer read or written at one element outside any block: a one-element block, not a scalar.
# Triton's interpreter gives a comparison of scalars the operands' dtype, so where the result is broadcast it
# becomes fp32 and `&` with a bool block fails (isnan(max) & isnan(x), amax's backward; tfsn_pow by a 0-d
# exponent); broadcasting a one-element block keeps the bools.
ONE = " + tl.zeros([1], tl.int32)"


@dataclass(frozen=True)
class Value:
    """A rendered operand: a Triton expression and its dtype."""
    expr: str
    dtype: str
    scalar: bool = False
    value: Any = None
    zero_dim: bool = False          # a 0-d tensor: ranks below dimensioned ones in promotion
    half: str | None = None         # a 16-bit float's own dtype, held as fp32 (dtype)
    exact: bool = False             # a half held as its exact value (loopnest.exact_halves)


NARROW_INTEGERS = {"int8": (8, True), "uint8": (8, False), "int16": (16, True), "int32": (32, True)}


def _wrapped(value: int, dtype: str) -> int:
    """A whole number as a narrow integer `dtype` holds it, wrapped: torch gives a Python int the tensor's
    dtype (int8 + 200 is int8 + -56), where Triton refuses a literal out of the dtype's range."""
    bits, signed = NARROW_INTEGERS[dtype]
    value &= (1 << bits) - 1
    return value - (1 << bits) if signed and value >> (bits - 1) else value


def _cast(v: Value, dtype: str) -> str:
    if v.scalar and dtype in FLOATS and v.dtype in FLOATS and v.value == 0 and math.copysign(1.0, v.value) < 0:
        # -0.0 made at run time: Triton before 3.7 turns a zero literal into +0.0 (`value == 0`), on a GPU too
        return f"(tl.full([], -1.0, {TL_TYPES[dtype]}) * 0.0)"
    if dtype == "float64" and v.scalar and v.dtype in FLOATS and _inexact_in_fp32(v.value):
        # Triton makes a float literal an fp32 constant: where it is a value of its own (a fill, where's or
        # masked_fill's operand, threshold's) and not one side of an fp64 arithmetic op, it stays fp32-rounded
        return f"tl.full([], {v.expr}, tl.float64)"
    if v.dtype == dtype or v.scalar and dtype in FLOATS and v.dtype in FLOATS:
        return v.expr
    if dtype == "bool":
        return f"({v.expr} != 0)"
    if v.scalar:
        if dtype in NARROW_INTEGERS:
            return str(_wrapped(int(v.value), dtype))
        if dtype == "float32" and v.dtype == "int64" and abs(v.value) > 2 ** 24:     # not all are fp32's
            return _literal(_int_in_fp32(v.value)).expr
        return v.expr if dtype in FLOATS or v.dtype != "float64" else str(int(v.value))
    return f"({v.expr}).to({TL_TYPES[dtype]})"


def _constant(v: Value, dtype: str) -> str:
    """A fill value as a value of its own (full, full_like, fill, scalar_tensor): a one-element block of the
    dtype, as ONE makes a 0-d load. A bare literal is typed by Triton, not by the graph: an int one stays an
    int32 constant (tl.log of full_like(x, 1) does not compile: Weibull.log_prob), a float one fp32 (an fp64
    kernel's exp of full_like(x, 2.5) came out in fp32), and a helper taking it beside a block (tfsn_pow,
    tfsn_atan2, tfsn_hypot: Kumaraswamy.log_prob) failed in the interpreter on `&` of a scalar's comparison."""
    if dtype not in FLOATS:
        return _cast(v, dtype)
    if v.value == 0 and math.copysign(1.0, v.value) < 0:
        return f"(tl.full([1], -1.0, {TL_TYPES[dtype]}) * 0.0)"        # -0.0 made at run time, as _cast does
    value = _int_in_fp32(v.value) if dtype == "float32" and v.dtype == "int64" else float(v.value)
    return f"tl.full([1], {_literal(value).expr}, {TL_TYPES[dtype]})"


def _int_in_fp32(value: int) -> float:
    """A Python int as fp32, rounded once as torch converts it: Triton reads an int beside an fp32 block as a
    Python float first, and an int of more than 53 bits rounded to fp64 and then to fp32 can land an fp32 unit
    off (x // (2**60 + 2**36 + 1) was a whole step off eager's)."""
    import torch
    return float(torch.tensor(value, dtype=torch.int64).to(torch.float32))


def _inexact_in_fp32(value: Any) -> bool:
    """Whether a Python float changes when rounded to fp32 (1/7 and 1e300 do; 0.5, inf and NaN do not)."""
    if not isinstance(value, float) or not math.isfinite(value):
        return False
    try:
        return struct.unpack("f", struct.pack("f", value))[0] != value
    except OverflowError:          # beyond fp32's range
        return True


def _literal(a: bool | int | float) -> Value:
    if isinstance(a, bool):
        return Value("True" if a else "False", "bool", True, a)
    if isinstance(a, int):
        return Value(str(a), "int64", True, a)
    if math.isnan(a):
        return Value('float("nan")', "float64", True, a)
    if math.isinf(a):
        return Value('float("inf")' if a > 0 else '(-float("inf"))', "float64", True, a)
    return Value(repr(float(a)), "float64", True, a)


def _binary(fmt: str) -> Callable:
    def render(ops, out, kw):
        return fmt.format(a=_cast(ops[0], out), b=_cast(ops[1], out))
    return render


def _quotient(a: str, b: str, dtype: str) -> str:
    """a / b correctly rounded, as eager's division on either device: Triton's fp32 / is the GPU's div.full (2 ulp;
    div.approx by a constant), whose error a floor, round or comparison after it can turn into a whole step
    (a fake quantizer's level). Inductor has the same option (eager_numerics.division_rounding), off by default."""
    return f"tl.div_rn({a}, {b})" if dtype == "float32" else f"({a} / {b})"


def _divide(ops, out, kw):
    return _quotient(_cast(ops[0], out), _block(ops[1], out), out)


def _reciprocal(ops, out, kw):
    return _quotient("1.0", _cast(ops[0], out), out)


def _or_for_bools(render: Callable) -> Callable:
    """`render` of a sum, made torch's logical or where the result is bool: computed in int32 and tested
    against zero, since Triton's 1-bit integers wrap (True + True is False)."""
    def rendered(ops, out, kw):
        return f"({render(ops, 'int32', kw)} != 0)" if out == "bool" else render(ops, out, kw)
    return rendered


def _alpha(sign: str, reverse: bool = False) -> Callable:
    @_or_for_bools
    def render(ops, out, kw):
        a, b = (_cast(o, out) for o in (ops[1::-1] if reverse else ops[:2]))
        alpha = kw.get("alpha", 1)
        if alpha != 1:      # a scalar as any other: -0.0 made at run time, inf as float("inf")
            b = f"({_cast(_literal(alpha), out)} * {b})"
        return f"({a} {sign} {b})"
    return render


def _unary(fmt: str) -> Callable:
    def render(ops, out, kw):
        return fmt.format(a=_cast(ops[0], out))
    return render


def _in_half(expr: str, v: Value, half: str) -> str:
    """`expr`, operand `v` in fp32, as a value of the 16-bit `half`: rounded to it, unless `v` holds one exactly."""
    return expr if v.exact and v.half == half else _rounded(expr, half)


def _compare(sign: str) -> Callable:
    """A comparison in its operands' result_type (an fp32 tensor with a 0-d fp64 one in fp32); in a half,
    both sides rounded to it as eager compares (an fp16 tensor's 0.1 is 0.0999755859375)."""
    def render(ops, out, kw):
        t = comparison_dtype((o.half or o.dtype, o.scalar, o.zero_dim) for o in ops[:2])
        a, b = (_in_half(_cast(o, "float32"), o, t) if t in HALF_DTYPES else _cast(o, t) for o in ops[:2])
        return f"({a} {sign} {b})"
    return render


def _block(v: Value, dtype: str) -> str:
    """An operand of a prelude function that takes blocks (tfsn_fmod, tfsn_div_floor, ...): a Python scalar as a
    one-element block (_constant), either side of the division (`5.0 // x` failed on 5.0's missing .shape)."""
    return _constant(v, dtype) if v.scalar else _cast(v, dtype)


def _modulo(name: str) -> Callable:
    """fmod or remainder (`name`) in the operands' result type: the prelude's exact long division for floats
    (a half's operands rounded to it, as eager divides the halves), Triton's % for integers (C's, exact; the
    divisor is a positive Python int, optimizer/ops.py MODULOS), moved into the divisor's sign for remainder."""
    def render(ops, out, kw):
        t = comparison_dtype((o.half or o.dtype, o.scalar, o.zero_dim) for o in ops[:2])
        if t in HALF_DTYPES:
            a, b = (_in_half(_block(o, "float32"), o, t) for o in ops[:2])
            return f"tfsn_{name}({a}, {b})"
        if out in FLOATS:
            return f"tfsn_{name}({_block(ops[0], out)}, {_block(ops[1], out)})"
        a, b = _cast(ops[0], out), _cast(ops[1], out)
        if name == "fmod":
            return f"({a} % {b})"
        return f"tl.where(({a} % {b}) < 0, ({a} % {b}) + {b}, {a} % {b})"     # b > 0: r moves where below 0
    return render


def _rounded_division(ops, out, kw):
    """torch.div with rounding_mode "trunc" or "floor" (`//`), as ATen's: the prelude's tfsn_div_trunc and
    tfsn_div_floor for floats (a correctly rounded quotient: Triton's fp32 / is div.full, 2 ulp, which can
    cross a whole number), a half divided in fp32 by a Python number as eager does; for integers by a
    positive Python int (optimizer/ops.py ROUNDED_DIVISIONS) Triton's //, C's truncation, one less for floor
    where the remainder is below 0."""
    floor = kw["rounding_mode"] == "floor"
    if out in FLOATS:
        return f"tfsn_div_{'floor' if floor else 'trunc'}({_block(ops[0], out)}, {_block(ops[1], out)})"
    a, b = _cast(ops[0], out), _cast(ops[1], out)
    return f"tl.where(({a} % {b}) < 0, {a} // {b} - 1, {a} // {b})" if floor else f"({a} // {b})"


POWI_LIMIT = 32     # whole exponents up to this are products (log2 n roundings); larger ones go through tfsn_pow


def _powi(b: str, n: int) -> str:
    """b ** n for a whole n >= 1 by repeated squaring: exact in sign, log2(n) products."""
    expr = b
    for bit in bin(n)[3:]:
        expr = f"tfsn_square({expr})" + (f" * {b}" if bit == "1" else "")
    return f"({expr})"


def _half_pow(base: Value, exponent: float, dtype: str, cpu: bool) -> str:
    """A 16-bit float to a scalar power as eager computes it (and codegen/c_ops.expression): the exponent
    rounded to the half first (bf16 x ** 1.7 is x ** 1.703125), and fp16 by 0.5 or -0.5 is pow itself,
    not sqrt or 1 / sqrt (pow(-inf, 0.5) is inf where sqrt(-inf) is NaN; pow(-0.0, -0.5) is +inf); on the `cpu`
    (the interpreter), bf16's x ** 3 and x ** -2 round the square to bf16 first (ops.CPU_BF16_SQUARE_ROUNDED_POWERS)."""
    import torch
    rounded = float(torch.tensor(float(exponent), dtype=torch.float64).to(getattr(torch, dtype)))
    if dtype == "float16" and rounded in (0.5, -0.5):
        return f"(tfsn_pow({base.expr}, {rounded!r} + tl.zeros_like({base.expr})))"
    if cpu and dtype == "bfloat16" and rounded in CPU_BF16_SQUARE_ROUNDED_POWERS:
        square = _rounded(f"({base.expr} * {base.expr})", dtype)
        return f"({square} * {base.expr})" if rounded == 3.0 else f"({_quotient('1.0', square, 'float32')})"
    return f"({_pow([base, _literal(rounded)], 'float32', {})})"


def _pow(ops, out, kw):
    """torch.pow: integers exact and wrapping; floats with C's pow's values (a negative base to a whole
    power has the power's sign, to a fractional one NaN; x ** 0 and 1 ** y are 1), whole exponents up to
    POWI_LIMIT as products, as ATen's own special cases (2, 3, 0.5, -0.5, -1, -2)."""
    base, exponent = ops
    if out not in FLOATS:
        if exponent.scalar and int(exponent.value) >= 1:
            return _powi(_cast(base, out), int(exponent.value))
        return f"tfsn_ipow({_cast(base, 'int64')}, {_cast(exponent, 'int64')}).to({TL_TYPES[out]})"
    b, e = _cast(base, out), _cast(exponent, out)
    if exponent.scalar:
        y = float(exponent.value)
        special = {2.0: f"({b} * {b})", 3.0: f"({b} * {b} * {b})", 0.5: _sqrt(b, out), 1.0: b,
                   -1.0: _quotient("1.0", b, out), -0.5: _quotient("1.0", _sqrt(b, out), out),
                   -2.0: _quotient("1.0", f"({b} * {b})", out),
                   0.0: f"(tl.zeros_like({b}) + 1.0)"}
        if y in special:
            return special[y]
        if y.is_integer() and abs(y) <= POWI_LIMIT:
            return _powi(b, int(y)) if y > 0 else _quotient("1.0", _powi(b, int(-y)), out)
        return f"tfsn_pow({b}, {e} + tl.zeros_like({b}))"
    if base.scalar and 0 < float(base.value) < math.inf and float(base.value) != 1:
        # beta ** step (the optimizers' bias corrections): the base's log taken here (not inf's: inf ** 0 is 1)
        return f"tl.exp2({math.log2(base.value)!r} * {e})"
    if base.scalar:      # spread over the exponent's shape, the sign of -0.0 kept
        return f"tfsn_pow((tl.zeros_like({e}) + 1.0) * {b}, {e})"
    return f"tfsn_pow({b}, {e})"


def _sqrt(x: str, dtype: str) -> str:
    """sqrt(x) correctly rounded, subnormals kept, as eager's (and Inductor's tl.sqrt_rn): Triton's tl.sqrt of fp32
    is the GPU's approximation flushing subnormals to zero (sqrt.approx.ftz.f32: sqrt(1e-40) is 0, not 1e-20);
    of fp64 it is sqrt.rn.f64 already."""
    return f"tl.sqrt_rn({x})" if dtype == "float32" else f"tl.sqrt({x})"


def _rsqrt(ops, out, kw):
    """1 / sqrt(x), of the correctly rounded sqrt: Triton's tl.rsqrt is an approximation in fp64 too
    (rsqrt.approx.f64) and flushes fp32 subnormals (rsqrt.approx.ftz.f32: inf for 1e-40)."""
    return _quotient("1.0", _sqrt(_cast(ops[0], out), out), out)


def _clamp(ops, out, kw):
    """torch.clamp by scalar bounds (clamp, clamp_min, clamp_max take Scalars; a tensor bound is a maximum or
    minimum); a NaN bound makes every result NaN in torch (x.clamp(min=nan)), which a comparison alone skips."""
    x = _cast(ops[0], out)
    lo = ops[1] if len(ops) > 1 else None
    hi = ops[2] if len(ops) > 2 else None
    for bound, sign in ((lo, "<"), (hi, ">")):
        if bound is None or bound.dtype == "none":
            continue
        b = _cast(bound, out)
        if isinstance(bound.value, float) and math.isnan(bound.value):
            x = f"({x} + {b})"          # NaN everywhere, in the block's shape
        else:
            x = f"tl.where({x} {sign} {b}, {b}, {x})"
    return x


def _nan_max(sign: str) -> Callable:
    def render(ops, out, kw):
        a, b = (_cast(o, out) for o in ops)
        return f"tl.where(({a} {sign} {b}) | ({a} != {a}), {a}, {b})"
    return render


def _float_only(fmt: str) -> Callable:
    """A rounding function: itself on floats, the identity on integers (whose value it is already)."""
    def render(ops, out, kw):
        a = _cast(ops[0], out)
        return fmt.format(a=a) if out in FLOATS else a
    return render


def _neg(ops, out, kw):
    """-x; a float as x * -1.0, which flips the sign of a zero too: Triton before 3.7 compiles `-x` as
    0 - x, and 0 - (+0.0) is +0.0."""
    a = _cast(ops[0], out)
    return f"({a} * -1.0)" if out in FLOATS else f"(-{a})"


def _bitwise_not(ops, out, kw):
    a = _cast(ops[0], out)
    if out == "uint8":      # as ~, which Triton 3.6's interpreter cannot build for unsigned types (np.full(-1))
        return f"({a} ^ 255)"
    return f"({a} == 0)" if out == "bool" else f"(~{a})"


NONE = Value("None", "none", True)

OPS: dict[str, Callable] = {
    "aten.add.Tensor": _alpha("+"), "aten.add.Scalar": _alpha("+"),
    "aten.sub.Tensor": _alpha("-"), "aten.sub.Scalar": _alpha("-"), "aten.rsub.Scalar": _alpha("-", True),
    "aten.rsub.Tensor": _alpha("-", True),
    "aten.mul.Tensor": _binary("({a} * {b})"), "aten.mul.Scalar": _binary("({a} * {b})"),
    "aten.div.Tensor": _divide, "aten.div.Scalar": _divide,
    "aten.div.Tensor_mode": _rounded_division, "aten.div.Scalar_mode": _rounded_division,
    "aten.neg.default": _neg, "aten.abs.default": _unary("tl.abs({a})"),
    "aten.exp.default": _unary("tl.exp({a})"), "aten.exp2.default": _unary("tl.exp2({a})"),
    "aten.expm1.default": _unary("tfsn_expm1({a})"), "aten.log.default": _unary("tl.log({a})"),
    "aten.log2.default": _unary("tl.log2({a})"), "aten.log1p.default": _unary("tfsn_log1p({a})"),
    "aten.sqrt.default": lambda o, out, kw: _sqrt(_cast(o[0], out), out), "aten.rsqrt.default": _rsqrt,
    "aten.reciprocal.default": _reciprocal, "aten.sin.default": _unary("tl.sin({a})"),
    "aten.cos.default": _unary("tl.cos({a})"), "aten.tanh.default": _unary("tfsn_tanh({a})"),
    "aten.erf.default": _unary("tl.erf({a})"), "aten.sigmoid.default": _unary("tl.sigmoid({a})"),
    "aten.fmod.Tensor": _modulo("fmod"), "aten.fmod.Scalar": _modulo("fmod"),
    "aten.remainder.Tensor": _modulo("remainder"), "aten.remainder.Scalar": _modulo("remainder"),
    "aten.atan2.default": _binary("tfsn_atan2({a}, {b})"), "aten.hypot.default": _binary("tfsn_hypot({a}, {b})"),
    "aten.relu.default": _unary("tl.where({a} < 0, 0, {a})"), "aten.floor.default": _float_only("tl.floor({a})"),
    "aten.ceil.default": _float_only("tl.ceil({a})"),
    "aten.trunc.default": _float_only("tl.where({a} < 0, tl.ceil({a}), tl.floor({a}))"),
    "aten.round.default": _float_only("tfsn_round({a})"),
    "aten.bitwise_and.Tensor": _binary("({a} & {b})"), "aten.bitwise_or.Tensor": _binary("({a} | {b})"),
    "aten.bitwise_not.default": _bitwise_not,
    "aten.sign.default": _unary("(({a} > 0).to(tl.float32) - ({a} < 0).to(tl.float32))"),
    "aten.pow.Tensor_Scalar": _pow, "aten.pow.Tensor_Tensor": _pow, "aten.pow.Scalar": _pow,
    "prims.fma.default": _or_for_bools(lambda o, out, kw: f"({_cast(o[0], out)} * {_cast(o[1], out)} + "
                                                          f"{_cast(o[2], out)})"),
    "aten.maximum.default": _nan_max(">="), "aten.minimum.default": _nan_max("<="),
    "aten.clamp_min.default": lambda o, out, kw: _clamp([o[0], o[1]], out, kw),
    "aten.clamp_max.default": lambda o, out, kw: _clamp([o[0], NONE, o[1]], out, kw),
    "aten.clamp.default": _clamp,
    "aten.where.self": lambda o, out, kw: f"tl.where({_cast(o[0], 'bool')}, {_cast(o[1], out)}, {_cast(o[2], out)})",
    "aten.masked_fill.Scalar": lambda o, out, kw: f"tl.where({_cast(o[1], 'bool')}, {_cast(o[2], out)}, {_cast(o[0], out)})",
    "aten.masked_fill.Tensor": lambda o, out, kw: f"tl.where({_cast(o[1], 'bool')}, {_cast(o[2], out)}, {_cast(o[0], out)})",
    "aten.eq.Tensor": _compare("=="), "aten.eq.Scalar": _compare("=="),
    "aten.ne.Tensor": _compare("!="), "aten.ne.Scalar": _compare("!="),
    "aten.lt.Tensor": _compare("<"), "aten.lt.Scalar": _compare("<"),
    "aten.le.Tensor": _compare("<="), "aten.le.Scalar": _compare("<="),
    "aten.gt.Tensor": _compare(">"), "aten.gt.Scalar": _compare(">"),
    "aten.ge.Tensor": _compare(">="), "aten.ge.Scalar": _compare(">="),
    "aten.logical_not.default": lambda o, out, kw: f"({_cast(o[0], 'bool')} == 0)",
    "aten.logical_and.default": lambda o, out, kw: f"({_cast(o[0], 'bool')} & {_cast(o[1], 'bool')})",
    "aten.logical_or.default": lambda o, out, kw: f"({_cast(o[0], 'bool')} | {_cast(o[1], 'bool')})",
    "aten.isnan.default": lambda o, out, kw: f"({o[0].expr} != {o[0].expr})",
    "aten._to_copy.default": _unary("{a}"), "aten.clone.default": _unary("{a}"),
    "aten.lift_fresh_copy.default": _unary("{a}"), "aten.copy.default": lambda o, out, kw: _cast(o[1], out),
    "aten.fill.Scalar": lambda o, out, kw: _constant(o[1], out),
    "aten.full.default": lambda o, out, kw: _constant(o[1], out),
    "aten.full_like.default": lambda o, out, kw: _constant(o[1], out),
    "aten.scalar_tensor.default": lambda o, out, kw: _constant(o[0], out),
}


REDUCTION_INITS = {"sum": "0", "mean": "0", "max": '-float("inf")', "min": 'float("inf")'}
REDUCTION_TOTALS = {"sum": "tl.sum", "mean": "tl.sum", "max": "tl.max", "min": "tl.min"}


def triton_index(e: Expr) -> str:
    """An index expression in Python/Triton syntax (non-negative values: // is C's /)."""
    return render(e, lambda a, k: f"({a}) * {k}", lambda a, d: f"(({a}) // {d})", lambda a, n: f"(({a}) % {n})")


class Unsupported(Exception):
    """A loop nest this renderer does not print (an op with no Triton entry): the group stays C/ATen."""


@dataclass(frozen=True)
class LibraryProduct:
    """A GEMM group's product left to torch's matmul (`Schedule.gemm == "library"`): which parameters are its
    operands, the views of them it multiplies, and where the product goes; the kernel (if `epilogue`) then
    reads it as one more pointer argument, after the group's parameters."""
    a: int                           # positions in the kernel's params
    b: int
    a_view: tuple[tuple[int, ...], tuple[int, ...]]     # the operand's shape and strides, from its pointer
    b_view: tuple[tuple[int, ...], tuple[int, ...]]
    shape: tuple[int, ...]           # the product's shape and strides
    strides: tuple[int, ...]
    into: int | None                 # position of the output the product is written into; None: a fp32 scratch
    epilogue: bool                   # whether the kernel runs after the product
    bias: int | None = None          # position of a bias the library adds along the rows (addmm), the whole epilogue
                                     # but a cast of it to the output's dtype

    @staticmethod
    def scratch_dtype(operands: Any) -> Any:
        """The dtype of a product not written into the graph's tensor: fp32, the accumulator a tile would
        have, or the operands' dtype when wider."""
        import torch
        return torch.promote_types(operands, torch.float32)

    def run(self, tensors: Sequence[Any]) -> Any:
        """The product of the operands among `tensors`, into the graph's tensor or a scratch."""
        import torch
        a, b = (tensors[i].as_strided(*view) for i, view in ((self.a, self.a_view), (self.b, self.b_view)))
        out = tensors[self.into].as_strided(self.shape, self.strides) if self.into is not None else \
            torch.empty_strided(self.shape, self.strides, dtype=self.scratch_dtype(a.dtype), device=a.device)
        matmul = torch.bmm if len(self.shape) == 3 else torch.mm
        if self.bias is not None:
            bias = tensors[self.bias].to(out.dtype)     # a cast the epilogue made (autocast's), rounded as there
            if a.is_cuda or a.dtype not in (torch.bfloat16, torch.float16):
                torch.addmm(bias, a, b, out=out)
            else:      # a 16-bit addmm on a CPU: summed and biased in fp32, rounded once, as on a GPU
                out.copy_(torch.addmm(bias.float(), a.float(), b.float()))
        elif a.dtype == out.dtype:
            matmul(a, b, out=out)
        elif a.is_cuda and _sums_16_bits_into_fp32():    # 16-bit operands on the tensor cores, summed into fp32
            matmul(a, b, out_dtype=out.dtype, out=out)
        else:          # no 16-bit-in, fp32-out product here (a CPU, an older torch): the operands widened, exactly
            matmul(a.to(out.dtype), b.to(out.dtype), out=out)
        return out


@functools.cache
def _sums_16_bits_into_fp32() -> bool:
    """Whether torch has mm and bmm of 16-bit operands into a fp32 result (aten::mm.dtype_out, CUDA only)."""
    import torch
    return all(hasattr(getattr(torch.ops.aten, op), "dtype_out") for op in ("mm", "bmm"))


@functools.cache
def launch_options() -> dict[str, Any]:
    """Triton compiler options every kernel is launched (and precompiled) with on this machine's GPU: on NVIDIA's,
    nvidia_launch_options(); none elsewhere (a CPU under the interpreter, which takes none, an AMD GPU)."""
    import torch
    return nvidia_launch_options() if torch.cuda.is_available() and not torch.version.hip else {}


def nvidia_launch_options() -> dict[str, Any]:
    """libdevice's functions (log, log2, exp2, sin, erf... of fp32) keep subnormals, as torch's CUDA kernels do,
    where this Triton lets one ask (enable_reflect_ftz, triton-lang/triton#8762, 2025-11): by default Triton
    compiles libdevice to flush them to zero (nvvm-reflect-ftz: fma.rn.ftz, ex2.approx.ftz in the PTX), and
    log(1e-40) was -inf where eager's is -92.1, 1e-40 ** -0.5 inf where it is 1e20."""
    from triton.backends.nvidia.compiler import CUDAOptions
    return {"enable_reflect_ftz": False} if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__ else {}


@dataclass(frozen=True)
class SplitReduction:
    """A split reduction's second kernel (TritonWriter.split_reduction) and the scratch both kernels take after
    the group's parameters: per reduction, a [rows, slices] tensor of partial results in its accumulator's
    dtype, made at each launch on the tensors' device (in a CUDA graph's capture, from its private pool, as a
    library product's scratch)."""
    name: str
    grid: tuple[int, ...]
    meta: tuple[tuple[str, int], ...]      # constexpr arguments, then num_warps
    shape: tuple[int, int]
    dtypes: tuple[str, ...]

    def scratch(self, device: Any) -> list[Any]:
        import torch
        return [torch.empty(self.shape, dtype=getattr(torch, d), device=device) for d in self.dtypes]


@dataclass(frozen=True)
class TritonKernel:
    name: str
    source: str
    params: tuple[int, ...]          # node indices whose tensors are the kernel's pointer arguments, in order
    outputs: tuple[int, ...]
    grid: tuple[int, ...]            # programs along each launch axis
    meta: tuple[tuple[str, int], ...]   # constexpr arguments (block sizes) and num_warps / num_stages
    product: LibraryProduct | None = None     # a library GEMM's product, computed before the kernel runs
    tf32: bool = False               # a product of fp32 operands that may round them to TF32 (the graph allowed it)
    split: SplitReduction | None = None     # a split reduction's second kernel, launched after this one

    def launches(self) -> list[tuple[str, tuple[int, ...], tuple[tuple[str, int], ...]]]:
        """Its kernels' names, grids and launch arguments, in the order they run."""
        return [(self.name, self.grid, self.meta)] + ([] if self.split is None else
                                                      [(self.split.name, self.split.grid, self.split.meta)])

    def pointer_dtypes(self, graph: Graph) -> list[Any]:
        """The torch dtypes of the pointers it is launched with: its parameters', then a library product's or a
        split reduction's scratch."""
        import torch
        dtypes = [getattr(torch, graph.nodes[p].type.dtype) for p in self.params]
        if self.product is not None:
            dtypes.append(LibraryProduct.scratch_dtype(dtypes[self.product.a]))
        if self.split is not None:
            dtypes += [getattr(torch, d) for d in self.split.dtypes]
        return dtypes


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << max(0, (int(n) - 1).bit_length()))


class TritonWriter:
    """Writes one group's loop nest as a Triton kernel. Raises NotFusable (no loop nest) or Unsupported."""

    def __init__(self, graph: Graph, group: Group, buffers: set[int], schedule: Schedule, name: str,
                 inplace: dict[int, int] | None = None, part: bool = False) -> None:
        """`part`: written as a function of its program id (argument `pid`), for a kernel that runs several
        (codegen/triton_combo.py), not one launched on its own."""
        self.g, self.group, self.buffers, self.s, self.name = graph, group, buffers, schedule, name
        self.inplace, self.part = inplace or {}, part

    def write(self) -> TritonKernel:
        self.nest: LoopNest = lower(self.g, self.group, self.buffers, self.inplace)
        self.exact = exact_halves(self.g, self.nest)
        self.names = {n: f"p{k}" for k, n in enumerate(self.nest.params)}
        self.mask, self.zero = "None", "0"
        self.wide = self.widest() >= INT32_INDEX_LIMIT
        shape = self.nest.shape
        self.product: LibraryProduct | None = None
        self.split: SplitReduction | None = None
        self.tf32 = False
        body, grid, meta = (self.gemm() if shape == "gemm" else self.reduction() if shape == "reduction"
                            else self.pointwise())
        # the prologue runs before the kernel's blocks (and their masks) exist: its loads are at constant offsets,
        # which may still be expressions ((2) * 8 + 3 for x[2, 3]), read unmasked
        self.mask, self.zero = "None", "0"
        prologue = [self.statement(d) for d in self.nest.prologue]
        pointers = [*self.names.values(), *(["prod"] if self.product is not None else []),
                    *(f"s{j}" for j in range(len(self.split.dtypes) if self.split is not None else 0))]

        def function(name: str, code: list[str], constants: tuple) -> list[str]:
            args = ", ".join([*pointers, *(["pid"] if self.part else []), *(f"{k}: tl.constexpr" for k, _ in constants)])
            return ["@triton.jit", f"def {name}({args}):"] + [f"    {line}" for line in prologue + code]
        lines = function(self.name, body, meta)
        if self.split is not None:
            lines += ["", ""] + function(self.split.name, self.combine, self.split.meta[:-1])
        stages = shape == "gemm" and self.product is None
        launch = (*meta, ("num_warps", self.warps()), *((("num_stages", self.s.gemm_stages),) if stages else ()))
        return TritonKernel(self.name, "\n".join(lines) + "\n", self.nest.params, self.nest.outputs, grid, launch,
                            self.product, self.tf32, self.split)

    def widest(self) -> int:
        """Elements the kernel's indices reach: its domain's, or a parameter's span from its base pointer (a view
        is passed as the tensor it views)."""
        spans = [prod(self.group.domain)]
        for p in self.nest.params:
            node = self.g.nodes[p]
            while True:
                t = node.type
                if t is not None and all(t.shape):
                    spans.append(1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.strides)))
                if node.kind != Kind.VIEW or not node.args or not isinstance(node.args[0], Ref):
                    break
                node = self.g.nodes[node.args[0].index]
        return max(spans)

    def program(self) -> str:
        """This program's id, in int64 where the kernel's indices can pass int32 (self.wide)."""
        pid = "pid" if self.part else "tl.program_id(0)"
        return f"{pid}.to(tl.int64)" if self.wide else pid

    def arange(self, block: str) -> str:
        return f"tl.arange(0, {block}).to(tl.int64)" if self.wide else f"tl.arange(0, {block})"

    def warps(self) -> int:
        return self.s.gemm_mr if self.s.gemm_mr in (1, 2, 4, 8, 16) else 4

    # ---- statements ----
    def value(self, name: Name) -> str:
        return f"t{name.id}" if isinstance(name, Temp) else f"{name.kind}{name.node}"

    def apply(self, a: Apply) -> str:
        node = self.g.nodes[a.node]
        if node.op not in OPS:
            raise Unsupported(f"no Triton rendering of {node.op}")
        ops = [Value(self.value(x.name), _computed_in(x.dtype), zero_dim=x.zero_dim,
                     half=x.dtype if x.dtype in HALF_DTYPES else None, exact=self.exact.get(x.name) == x.dtype)
               if isinstance(x, LoopOperand) else
               _literal(x) if isinstance(x, (bool, int, float)) else NONE for x in a.args]
        out = node.type.dtype
        if out in HALF_DTYPES and node.op == "aten.pow.Tensor_Scalar" and ops[1].scalar:
            value = _half_pow(ops[0], ops[1].value, out, self.g.device == "cpu")
        else:
            # a half computed in fp32 and converted or rounded to a whole number: eager's value was the half
            ops = [replace(o, expr=_rounded(o.expr, o.half), exact=True)
                   if not o.exact and half_operand_rounded(node.op, o.half, out) else o for o in ops]
            value = f"({OPS[node.op](ops, _computed_in(out), node.kwargs)})"
        # every path: loopnest.exact_halves counts such a result as its half's exact value
        return _rounded(value, out) if eager_rounded(node.op, node.params) else value

    def select(self, v: Select) -> str:
        """A concatenation's element: nested tl.where (every piece's element was loaded in range)."""
        at = triton_index(v.index)
        chosen = self.value(v.values[-1])
        for b, x in zip(reversed(v.bounds), reversed(v.values[:-1])):
            chosen = f"tl.where({at} < {b}, {self.value(x)}, {chosen})"
        return chosen

    def statement(self, s: Stmt) -> str:
        if isinstance(s, Define):
            v = s.value
            if isinstance(v, Load):
                stored = self.g.nodes[v.buffer].type.dtype
                if isinstance(v.offset, Const) or self.mask == "None":
                    load = f"tl.load({self.names[v.buffer]} + {triton_index(v.offset)}{ONE})"
                else:
                    load = f"tl.load({self.names[v.buffer]} + {triton_index(v.offset)} + {self.zero}, " \
                           f"mask={self.mask}, other=0)"
                return f"t{s.name.id} = {_widened(load, stored) if stored in HALF_DTYPES else load}"
            if isinstance(v, GemmElement):
                return f"t{s.name.id} = {_rounded('acc', self.g.nodes[v.node].type.dtype)}"
            if isinstance(v, Select):
                return f"t{s.name.id} = {self.select(v)}"
            return f"t{s.name.id} = {self.apply(v)}"
        if isinstance(s, Store):
            value = _narrowed(self.value(s.value), self.g.nodes[s.buffer].type.dtype)
            pointer = f"{self.names[s.buffer]} + {triton_index(s.offset)}"
            if self.mask == "None":
                return f"tl.store({pointer}{ONE}, {value})"
            # masked: the pointer as a block of the mask's shape, even where the offset is one element
            return f"tl.store({pointer} + {self.zero}, {value}, mask={self.mask})"
        if isinstance(s, Assign):
            return f"{self.value(s.name)} = {self.apply(s.value)}"
        raise TypeError(f"not a statement of this loop: {s!r}")

    def lines(self, stmts: Sequence[Stmt]) -> list[str]:
        return [self.statement(s) for s in stmts]

    def decompose(self, flat: str, dims: Sequence[int]) -> list[str]:
        """Axis variables i{d} of `dims` (row-major) from a flat index, and each merged loop's m-variable."""
        dom, out, stride = self.group.domain, [], prod(self.group.domain[d] for d in dims)
        for d in dims:
            stride //= dom[d]
            out.append(f"i{d} = ({flat} // {stride}) % {dom[d]}")
        for first, run in self.nest.runs.items():
            if set(run) <= set(dims):
                inner, terms = 1, []
                for d in reversed(run):
                    terms.append(f"i{d} * {inner}")
                    inner *= dom[d]
                out.append(f"m{first} = " + " + ".join(reversed(terms)))
        return out

    # ---- kernels ----
    def pointwise(self) -> tuple[list[str], tuple[int, ...], tuple]:
        dom = self.group.domain
        numel = prod(dom)
        block = min(_pow2(self.s.chunk if self.s.chunk >= 16 else DEFAULT_BLOCK), _pow2(numel, 16))
        self.mask, self.zero = ("xmask" if dom else "None"), "xzero"
        code = [f"x = {self.program()} * XBLOCK + tl.arange(0, XBLOCK)", f"xmask = x < {numel}", "xzero = x * 0"]
        code += self.decompose("x", list(range(len(dom))))
        code += self.lines(self.nest.body)
        return code, (-(-numel // block),), (("XBLOCK", block),)

    def reduction(self) -> tuple[list[str], tuple[int, ...], tuple]:
        dom, nest = self.group.domain, self.nest
        self.count = prod(dom[d] for d in nest.reduced)
        self.rows = prod(dom[d] for d in nest.kept)
        per = _pow2(self.s.chunk) if 1 <= self.s.chunk <= MAX_ROWS_PER_PROGRAM else 1
        meta = (("XROWS", min(per, _pow2(self.rows))), ("RBLOCK", min(GPU_REDUCTION_BLOCK, _pow2(self.count, 16))))
        programs = -(-self.rows // meta[0][1])
        # a split's slices are whole blocks, none of them empty
        span = -(-self.count // max(self.s.reduction_split, 1) // meta[1][1]) * meta[1][1]
        if nest.splittable and span < self.count:
            return self.split_reduction(programs, span, meta)
        code = self.row_block(self.program())
        for segment in nest.segments:
            if isinstance(segment, RowSegment):
                code += self.lines(segment.body)
                continue
            code += self.accumulated(segment)
            for red in segment.reductions:
                code += self.combined(red, f"acc{red.node}", f"nan{red.node}", self.count)
            code += [self.statement(r.store) for r in segment.reductions]
        if nest.epilogue is not None:
            self.mask, self.zero = "rmask", "rzero"
            code += self.block_loop(self.lines(nest.epilogue))
        return code, (programs,), meta

    def row_block(self, program: str) -> list[str]:
        """A reduction program's rows down its tile's first axis ([XROWS, 1]; the reduced elements of a pass
        run along its second), for the program `program`; per-row statements are masked to them."""
        self.mask, self.zero = "xmask", "xzero"
        return [f"row = {program} * XROWS + tl.arange(0, XROWS)[:, None]", f"xmask = row < {self.rows}",
                "xzero = row * 0"] + [line for line in self.decompose("row", sorted(self.nest.kept))
                                      if line.startswith("i")]

    def block_loop(self, body: list[str], start: str = "", extent: int | None = None) -> list[str]:
        """`body` over `extent` reduced elements (all of them) from `start` on, in blocks of RBLOCK."""
        return [f"for r0 in range(0, {self.count if extent is None else extent}, RBLOCK):",
                f"    r = {start}r0 + {self.arange('RBLOCK')}[None, :]", f"    rmask = (r < {self.count}) & xmask",
                "    rzero = r * 0 + xzero"] + \
            [f"    {line}" for line in self.decompose("r", sorted(self.nest.reduced)) + body]

    def accumulated(self, segment: Pass, start: str = "", extent: int | None = None) -> list[str]:
        """The pass's block loop into acc{node} (and, for max and min, whether a NaN was met: nan{node})."""
        code = []
        for red in segment.reductions:
            acc_t = TL_TYPES[accumulator_dtype(self.g.nodes[red.node].type.dtype)]
            code.append(f"acc{red.node} = tl.full([XROWS, RBLOCK], {REDUCTION_INITS[red.op]}, {acc_t})")
            if red.op in ("max", "min"):
                code.append(f"nan{red.node} = tl.zeros([XROWS, RBLOCK], tl.int32)")
        self.mask, self.zero = "rmask", "rzero"
        code += self.block_loop([self.accumulate(s) if isinstance(s, Accumulate) else self.statement(s)
                                 for s in segment.body], start, extent)
        self.mask, self.zero = "xmask", "xzero"
        return code

    def split_reduction(self, programs: int, span: int, meta: tuple) -> tuple[list[str], tuple[int, ...], tuple]:
        """A split reduction (LoopNest.splittable): this kernel's programs each reduce one slice of `span`
        reduced elements of XROWS rows into a scratch of [rows, slices] partial results per reduction (in its
        accumulator's dtype, NaN where a max or min met one); a second kernel (self.split) combines each
        row's partials, a mean divided by the whole count once, then runs the per-row values after them.
        Members over the whole domain run here, on each slice after its pass."""
        split = -(-self.count // span)
        # the last slice's blocks run up to split * span, past the count: an index of int32 would wrap there (a split
        # other than a power of 2 of 2**31 - 1 elements) into a negative one that passes `r < count`
        self.wide = self.wide or split * span >= INT32_INDEX_LIMIT
        first, *after = self.nest.segments
        scratch = [f"s{j}" for j in range(len(first.reductions))]
        code = [f"pid = {self.program()}", f"part = pid % {split}", *self.row_block(f"(pid // {split})"),
                *self.accumulated(first, f"part * {span} + ", span)]
        for red, at in zip(first.reductions, scratch):
            code += self.combined(red, f"acc{red.node}", f"nan{red.node}", None)
            code.append(f"tl.store({at} + row * {split} + part + xzero, red{red.node}, mask=xmask)")
        if self.nest.epilogue is not None:       # reading no per-row value: on the slice just read
            self.mask, self.zero = "rmask", "rzero"
            code += self.block_loop(self.lines(self.nest.epilogue), f"part * {span} + ", span)
        combine = self.row_block(self.program()) + [f"s = {self.arange('SBLOCK')}[None, :]",
                                                     f"smask = (s < {split}) & xmask"]
        for red, at in zip(first.reductions, scratch):
            combine.append(f"part{red.node} = tl.load({at} + row * {split} + s, mask=smask, "
                           f"other={REDUCTION_INITS[red.op]})")
            combine += self.combined(red, f"part{red.node}", f"(part{red.node} != part{red.node}).to(tl.int32)",
                                     self.count)
        combine += [self.statement(r.store) for r in first.reductions]
        for segment in after:
            combine += self.lines(segment.body)
        self.combine = combine
        self.split = SplitReduction(f"{self.name}_combine", (programs,),
                                    (meta[0], ("SBLOCK", _pow2(split)), ("num_warps", self.warps())),
                                    (self.rows, split),
                                    tuple(accumulator_dtype(self.g.nodes[r.node].type.dtype) for r in first.reductions))
        return code, (programs * split,), meta

    def combined(self, red: Reduction, values: str, nans: str, count: int | None) -> list[str]:
        """red{node}: a [XROWS, n] block of `values` combined along its rows, NaN where a max or min's `nans`
        flag is set, a mean divided by `count` (None: a partial sum), a whole half sum or mean of the user's
        rounded to its half, as eager rounds it before the ops after it."""
        total = f"{REDUCTION_TOTALS[red.op]}({values}, 1)[:, None]" + \
            (f" / {count}" if red.op == "mean" and count is not None else "")
        node = self.g.nodes[red.node]
        if count is not None and red.op in ("sum", "mean") and eager_rounded(node.op, node.params):
            total = _rounded(total, node.type.dtype)
        lines = [f"red{red.node} = {total}"]
        if red.op in ("max", "min"):
            lines.append(f'red{red.node} = tl.where(tl.max({nans}, 1)[:, None] > 0, float("nan"), red{red.node})')
        return lines

    def accumulate(self, s: Accumulate) -> str:
        acc, v = f"acc{s.node}", self.value(s.value)
        if s.op in ("sum", "mean") and self.g.nodes[s.node].type.dtype == "int64":     # a count
            return f"{acc} = {acc} + tl.where(rmask, {v}, 0).to(tl.int64)"
        if s.op in ("sum", "mean"):
            return f"{acc} = {acc} + tl.where(rmask, {v}, 0.0)"
        better = ">" if s.op == "max" else "<"
        return (f"{acc} = tl.where(rmask & ({v} {better} {acc}), {v}, {acc}); "
                f"nan{s.node} = nan{s.node} | (rmask & ({v} != {v})).to(tl.int32)")

    def gemm(self) -> tuple[list[str], tuple[int, ...], tuple]:
        mm = self.g.nodes[self.group.nodes[0]]
        a, b = (self.g.nodes[r.index] for r in mm.args[:2])
        batched = len(mm.type.shape) == 3
        M, N = mm.type.shape[-2:]
        K = a.type.shape[-1]
        batch = mm.type.shape[0] if batched else 1
        bm = min(_pow2(self.s.gemm_block_rows, 16), _pow2(M, 16))
        bn = min(_pow2(self.s.gemm_nr, 16), _pow2(N, 16))
        bk = min(_pow2(self.s.gemm_kc, 16), _pow2(K, 16), GPU_MAX_DEPTH)
        sa, sb = a.type.strides, b.type.strides
        pa, pb = self.names[a.index], self.names[b.index]
        # fp32: IEEE products, or TF32 where torch allowed it for this graph; bf16/fp16: the tensor cores' own
        # products into the fp32 accumulator.
        # Triton's interpreter multiplies bf16 tiles as their uint16 bits, so there (tests on a CPU) they are
        # widened to fp32 first, exactly: their products and sums are then the GPU's up to summation order.
        widen = a.type.dtype == "bfloat16" and os.environ.get("TRITON_INTERPRET") == "1"
        self.tf32 = self.g.allow_tf32 and a.type.dtype == "float32"
        fp32_dot = "tf32" if self.tf32 else "ieee"
        dot_precision = f', input_precision="{"ieee" if widen else fp32_dot}"' if a.type.dtype == "float32" or widen \
            else ""
        operands = f"{_widened('x', 'bfloat16')}, {_widened('y', 'bfloat16')}" if widen else "x, y"
        i_row, i_col = (triton_index(e) for e in self.nest.idx[-2:])
        code = [f"pid = {self.program()}", f"tiles_n = {-(-N // bn)}", f"tiles = {-(-M // bm)} * tiles_n",
                "bi = pid // tiles", "pm = (pid % tiles) // tiles_n", "pn = pid % tiles_n",
                "rm = pm * BM + tl.arange(0, BM)", "rn = pn * BN + tl.arange(0, BN)"]
        stored = mm.index in self.nest.outputs
        if self.s.gemm == "library":
            code += self._library_product(mm, a, b, batched, stored)
            stored = stored and self.product.into is None
        else:
            code += ["acc = tl.zeros([BM, BN], tl.float32)",
                     f"for k0 in range(0, {K}, BK):",
                     f"    rk = k0 + {self.arange('BK')}",
                     f"    x = tl.load({pa} + bi * {sa[0] if batched else 0} + rm[:, None] * {sa[-2]} + "
                     f"rk[None, :] * {sa[-1]}, mask=(rm[:, None] < {M}) & (rk[None, :] < {K}), other=0.0)",
                     f"    y = tl.load({pb} + bi * {sb[0] if batched else 0} + rk[:, None] * {sb[-2]} + "
                     f"rn[None, :] * {sb[-1]}, mask=(rk[:, None] < {K}) & (rn[None, :] < {N}), other=0.0)",
                     f"    acc += tl.dot({operands}{dot_precision})"]
        code += [f"{i_row} = rm[:, None]", f"{i_col} = rn[None, :]",
                 f"cmask = ({i_row} < {M}) & ({i_col} < {N})", f"czero = {i_row} * 0 + {i_col} * 0"]
        if batched:
            code.append(f"{triton_index(self.nest.idx[0])} = bi")
        self.mask, self.zero = "cmask", "czero"
        if stored:
            out = mm.type.strides
            code.append(f"tl.store({self.names[mm.index]} + bi * {out[0] if batched else 0} + {i_row} * {out[-2]} + "
                        f"{i_col} * {out[-1]}, {_narrowed('acc', mm.type.dtype)}, mask=cmask)")
        code += self.lines(self.nest.body)
        grid = (batch * -(-M // bm) * -(-N // bn),)
        return code, grid, (("BM", bm), ("BN", bn)) + ((("BK", bk),) if self.product is None else ())

    def _library_product(self, mm, a, b, batched: bool, stored: bool) -> list[str]:
        """The tile loaded from the library's product (self.product, set here): straight from the graph's
        own tensor when the product is written there (an output no other kernel writes over, in fp32, or in
        16 bits with nothing after it: the library sums in fp32 and rounds once, as the tile would), else
        from a fp32 scratch. The kernel then runs only if it has more to do than that store."""
        params = list(self.nest.params)
        t = mm.type
        alone = not self.nest.body and len(self.nest.outputs) == 1    # nothing after the product but its store
        direct = stored and mm.index not in self.inplace and (t.dtype == "float32" or alone)
        scratch = t.strides if direct else tuple(prod(t.shape[i + 1:]) for i in range(len(t.shape)))
        bias = bias_epilogue(self.g, self.nest)
        out = self.g.nodes[self.nest.outputs[0]]
        if bias is not None and out.index not in self.inplace:     # the library's addmm writes the group's output
            into, shape, strides, epilogue = out, out.type.shape, out.type.strides, False
        else:                                                      # into None: a fp32 scratch
            bias, into, shape, strides, epilogue = None, mm if direct else None, t.shape, scratch, not (direct and alone)
        self.product = LibraryProduct(
            params.index(a.index), params.index(b.index), (a.type.shape, a.type.strides),
            (b.type.shape, b.type.strides), shape, strides, None if into is None else params.index(into.index),
            epilogue=epilogue, bias=None if bias is None else params.index(bias))
        M, N = t.shape[-2:]
        names = [self.names[a.index], self.names[b.index]]
        unlaunched = [] if epilogue else [f"# not launched: the product is written into {self.names[into.index]}"]
        plus = f" + {self.names[bias]}[None, :]" if bias is not None else ""
        return [f"# prod = {names[0]}{list(a.type.shape)}:{list(a.type.strides)} @ "        # what runs before: the
                f"{names[1]}{list(b.type.shape)}:{list(b.type.strides)}{plus}, by the library",  # code says all it does
                *unlaunched,
                f"acc = tl.load(prod + bi * {scratch[0] if batched else 0} + rm[:, None] * {scratch[-2]} + "
                f"rn[None, :] * {scratch[-1]}, mask=(rm[:, None] < {M}) & (rn[None, :] < {N}), other=0.0)"
                ".to(tl.float32)"]


def _horner(var: str, coefficients: Sequence[float]) -> str:
    """coefficients[0] + var * (coefficients[1] + var * (...)), as one expression."""
    expr = repr(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        expr = f"{c!r} + {var} * ({expr})"
    return expr


# Helpers the kernels call: functions whose one-line forms lose digits or signs. They are written with
# + - * /, exp, log, where only, so they mean the same on every backend and in the interpreter (which
# runs no libdevice); the polynomials are Taylor series cut where the next term is below the dtype's
# precision on |x| < 0.5.
_EXPM1 = {d: [1 / math.factorial(k) for k in range(1, n + 1)] for d, n in (("32", 9), ("64", 15))}
_LOG1P = {d: [1 / (2 * k + 1) for k in range(n + 1)] for d, n in (("32", 8), ("64", 16))}
# atan on [-0.66, 0.66] as t + t z P(z) / Q(z), z = t * t (fp64), and on [-tan(pi/8), tan(pi/8)] as t + t z P(z)
# (fp32): Cephes' atan and atanf, lowest power first
_ATAN_P64 = [-6.485021904942025371773E1, -1.228866684490136173410E2, -7.500855792314704667340E1,
             -1.615753718733365076637E1, -8.750608600031904122785E-1]
_ATAN_Q64 = [1.945506571482613964425E2, 4.853903996359136964868E2, 4.328810604912902668951E2,
             1.650270098316988542046E2, 2.485846490142306297962E1, 1.0]
_ATAN_P32 = [-3.33329491539E-1, 1.99777106478E-1, -1.38776856032E-1, 8.05374449538e-2]
PRELUDE = f'''import triton
import triton.language as tl


@triton.jit
def tfsn_square(x):
    return x * x


@triton.jit
def tfsn_ipow(a, b):
    """a ** b in int64, wrapping as torch's; a negative b gives 1 ** b, (-1) ** b, else 0 (C's tfsn_ipow)."""
    x = a + b * 0
    e = b + a * 0
    r = x * 0 + 1
    n = e
    for _ in range(63):
        r = tl.where((n & 1) != 0, r * x, r)
        x = x * x
        n = n >> 1
    negative = tl.where(a == 1, 1, tl.where(a == -1, tl.where((b & 1) != 0, -1, 1), 0))
    return tl.where(b < 0, negative, r)


@triton.jit
def tfsn_bf16_of(x):
    """fp32 x as bf16, rounded to nearest even by its bits (NaN -> 0x7FC0, as torch's): the interpreter's path."""
    bits = x.to(tl.int32, bitcast=True)
    top = tl.where(x != x, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
    return top.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def tfsn_bf16_widened(x):
    """bf16 x as fp32 by its bits (exact, subnormals too): the interpreter's path."""
    return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def tfsn_signbit(x):
    """Whether x's sign bit is set, -0.0 included, read off its bits: on a GPU the compiler folds
    `1 / x < 0` into `x < 0`, which loses -0.0 (seen on an H200: (-0.0) ** 41 came out +0.0)."""
    if x.dtype == tl.float64:
        return x.to(tl.int64, bitcast=True) < 0
    else:
        return x.to(tl.int32, bitcast=True) < 0


@triton.jit
def tfsn_pow(x, y):
    """C's pow: |x| ** y through exp2 and log2; the sign of a negative x (-0.0 too) for an odd whole y; NaN
    for a finite negative x and a fractional y; 1 for y == 0, for x == 1, and for x == -1 with y infinite."""
    whole = tl.floor(y) == y
    odd = whole & (tl.floor(y * 0.5) * 2.0 != y)
    a = tl.abs(x)
    r = tl.exp2(tl.log2(a) * y)
    negative = tfsn_signbit(x)
    r = tl.where(negative & odd, r * -1.0, r)
    r = tl.where((x < 0) & (x > -float("inf")) & (whole == 0), float("nan"), r)
    return tl.where((y == 0) | (x == 1) | ((a == 1) & (tl.abs(y) == float("inf"))), 1.0, r)


@triton.jit
def tfsn_expm1(x):
    """exp(x) - 1 without its cancellation near 0 (a polynomial there)."""
    if x.dtype == tl.float64:
        p = x * ({_horner("x", _EXPM1["64"])})
    else:
        p = x * ({_horner("x", _EXPM1["32"])})
    return tl.where(tl.abs(x) < 0.5, p, tl.exp(x) - 1.0)


@triton.jit
def tfsn_log1p(x):
    """log(1 + x) without rounding 1 + x near 0: 2 atanh(x / (2 + x)), a polynomial in s = x / (2 + x)."""
    t = 2.0 / (2.0 + x)
    s = 0.5 * x * t
    z = s * s
    if x.dtype == tl.float64:
        p = x * t * ({_horner("z", _LOG1P["64"])})
    else:
        p = x * t * ({_horner("z", _LOG1P["32"])})
    return tl.where(tl.abs(x) < 0.5, p, tl.log(1.0 + x))


@triton.jit
def tfsn_tanh(x):
    """tanh through expm1 of -2|x|: no cancellation near 0, 1 for large |x|, NaN for NaN, x's sign (-0.0 too)."""
    e = tfsn_expm1(-2.0 * tl.abs(x))
    t = e / (2.0 + e) * -1.0
    return tl.where(tfsn_signbit(x), t * -1.0, t)


@triton.jit
def tfsn_atan_unit(a):
    """atan(a) for a in [0, 1] (or NaN): Cephes' range reduction to (a - 1) / (a + 1) above 0.66 (fp64) or
    tan(pi/8) (fp32), then its rational (fp64) or polynomial (fp32) form; ~2 ulp."""
    if a.dtype == tl.float64:
        high = a > 0.66
        t = tl.where(high, (a - 1.0) / (a + 1.0), a)
        z = t * t
        p = t + t * z * ({_horner("z", _ATAN_P64)}) / ({_horner("z", _ATAN_Q64)})
        r = tl.where(high, p + 0.7853981633974483 + 3.061616997868383e-17, p)
    else:
        high = a > 0.41421356237309503
        t = tl.where(high, tl.div_rn(a - 1.0, a + 1.0), a)     # fp32 / is the GPU's div.full (2 ulp)
        z = t * t
        p = t + t * z * ({_horner("z", _ATAN_P32)})
        r = tl.where(high, p + 0.7853981633974483, p)
    return r


@triton.jit
def tfsn_ordered_ratio(x, y):
    """The reduction atan2 and hypot share: min(|x|, |y|) / max(|x|, |y|) (the smaller itself, 0 or NaN, where
    the larger is 0), the larger, and whether |y| is the larger."""
    ax = tl.abs(x)
    ay = tl.abs(y)
    swap = ay > ax
    big = tl.where(swap, ay, ax)
    small = tl.where(swap, ax, ay)
    if x.dtype == tl.float64:
        ratio = small / big
    else:
        ratio = tl.div_rn(small, big)       # Triton's fp32 / is the GPU's div.full (2 ulp)
    return tl.where(big == 0, small, ratio), big, swap


@triton.jit
def tfsn_atan2(y, x):
    """C's atan2: atan of min(|x|, |y|) / max(|x|, |y|) (1 where both are infinite, the NaN or 0 of the smaller
    where the larger is 0), reflected to pi/2 - r where |y| > |x| and to pi - r where x's sign bit is set (-0.0
    too), then given y's sign bit: atan2(-0.0, -0.0) is -pi, atan2(+-inf, -inf) +-3pi/4, NaN where either is."""
    a, _, swap = tfsn_ordered_ratio(x, y)
    a = tl.where((tl.abs(x) == float("inf")) & (tl.abs(y) == float("inf")), 1.0, a)
    r = tfsn_atan_unit(a)
    r = tl.where(swap, 1.5707963267948966 - r, r)
    r = tl.where(tfsn_signbit(x), 3.141592653589793 - r, r)
    return tl.where(tfsn_signbit(y), r * -1.0, r)


@triton.jit
def tfsn_hypot(x, y):
    """C's hypot without overflow or underflow in between: max(|x|, |y|) * sqrt(1 + r * r) of their ratio r;
    inf where either is infinite (NaN or not the other), NaN where either is NaN otherwise."""
    r, big, _ = tfsn_ordered_ratio(x, y)
    if x.dtype == tl.float64:
        h = big * tl.sqrt(1.0 + r * r)
    else:
        h = big * tl.sqrt_rn(1.0 + r * r)   # tl.sqrt of fp32 is the GPU's sqrt.approx
    return tl.where((tl.abs(x) == float("inf")) | (tl.abs(y) == float("inf")), float("inf"), h)


@triton.jit
def tfsn_div_rn(a, b):
    """a / b correctly rounded (fp64's / is; fp32's is the GPU's div.full, 2 ulp)."""
    if a.dtype == tl.float64:
        q = a / b
    else:
        q = tl.div_rn(a, b)
    return q


@triton.jit
def tfsn_exponent(v):
    """floor(log2(v)) of a positive finite v, exactly: read off its bits, a subnormal's once scaled by 2^64."""
    if v.dtype == tl.float64:
        tiny = v < 2.2250738585072014e-308
        w = tl.where(tiny, v * 18446744073709551616.0, v)
        e = ((w.to(tl.int64, bitcast=True) >> 52) & 2047) - 1023
    else:
        tiny = v < 1.1754943508222875e-38
        w = tl.where(tiny, v * 18446744073709551616.0, v)
        e = ((w.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    return tl.where(tiny, e - 64, e)


@triton.jit
def tfsn_scaled(y, k):
    """y * 2^k, exactly, for a whole 0 <= k < 2 * (the dtype's largest exponent) where the product is finite:
    two powers of two made from their bits, each normal."""
    h = k // 2
    if y.dtype == tl.float64:
        p1 = ((h + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
        p2 = ((k - h + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    else:
        p1 = ((h + 127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
        p2 = ((k - h + 127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return y * p1 * p2


@triton.jit
def tfsn_fmod_step(r, y, ey, bits):
    """One exact long-division step of r mod y (r, y > 0): y scaled by 2^k to s, the largest for which r / s
    is below 2^bits (whole quotients are exact there), and r - q s by one fma (exact: a multiple of s's ulp
    below s), q = floor(r / s) corrected by one where the division rounded across a whole number (a correctly
    rounded division: Triton's fp32 / is the GPU's div.full, 2 ulp, which could miss by more). Each step
    takes `bits` off the exponents' gap; r where it is below y already."""
    k = tl.maximum(tfsn_exponent(r) - ey - bits, 0)
    s = tfsn_scaled(y, k)
    q = tl.floor(tfsn_div_rn(r, s))
    t = tl.fma(q * -1.0, s, r)
    t = tl.where(t < 0, t + s, t)
    t = tl.where(t >= s, t - s, t)
    return tl.where(r >= y, t, r)


@triton.jit
def tfsn_fmod(a, b):
    """C's fmod, exactly, as torch's on either device: the remainder of |a| by |b| by long division (13 steps
    of 22 bits cover fp32's exponents, subnormals included; 43 of 51 fp64's), with a's sign (-0.0 too); NaN
    where b is 0, a infinite or either NaN; a itself where b is infinite. Triton's own % is LLVM's frem,
    which NVPTX computes as a - trunc(a / b) * b: wrong once the quotient passes 2^24, or where the division
    rounds it up to a whole number (a negative remainder)."""
    # |a| as a block b's size: a one-element a (a 0-d tensor's, 5.0 of 5.0 // x) would make the loop's r change
    # shape from [1] to b's, which Triton's compiler refuses (its interpreter does not)
    x = tl.abs(a) + tl.zeros_like(b)
    y = tl.abs(b)
    ey = tfsn_exponent(y)
    r = x
    if a.dtype == tl.float64:
        for _ in range(43):
            r = tfsn_fmod_step(r, y, ey, 51)
    else:
        for _ in range(13):
            r = tfsn_fmod_step(r, y, ey, 22)
    r = tl.where(y == float("inf"), x, r)
    r = tl.where(tfsn_signbit(a), r * -1.0, r)
    return tl.where((y == 0) | (x == float("inf")) | (x != x) | (y != y), float("nan"), r)


@triton.jit
def tfsn_remainder(a, b):
    """Python's (and torch's) remainder of floats: fmod, moved by b where its sign differs from b's (ATen's
    own formula, so remainder(-1e-30, 1.0) rounds to 1.0 as eager's)."""
    r = tfsn_fmod(a, b)
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def tfsn_div_trunc(a, b):
    """torch.div(a, b, rounding_mode="trunc") of floats: the correctly rounded quotient, truncated."""
    q = tfsn_div_rn(a, b - tl.zeros_like(a))        # b as a block like a; - 0.0 keeps a -0.0 divisor's sign
    return tl.where(q < 0, tl.ceil(q), tl.floor(q))


@triton.jit
def tfsn_div_floor(a, b):
    """torch's floor division of floats (`//`), as ATen's: (a - fmod(a, b)) / b (a whole number up to the
    division's rounding), one less where fmod's sign differs from b's, then rounded to the nearest whole
    number; a zero with a / b's sign, and a / b itself for a zero b."""
    b = b - tl.zeros_like(a)
    mod = tfsn_fmod(a, b)
    q = tfsn_div_rn(a - mod, b)
    q = tl.where((mod != 0) & ((b < 0) != (mod < 0)), q - 1.0, q)
    whole = tl.floor(q)
    whole = tl.where(q - whole > 0.5, whole + 1.0, whole)
    quotient = tfsn_div_rn(a, b)
    whole = tl.where(q == 0, quotient * 0.0, whole)
    return tl.where(b == 0, quotient, whole)


@triton.jit
def tfsn_zero_signed(r, x):
    """r, or a zero r with x's sign (x * 0.0 is -0.0 for a negative x)."""
    return tl.where(r == 0, x * 0.0, r)


@triton.jit
def tfsn_round(x):
    """x rounded half to even, as torch.round, decided by floor(x) and x - floor(x), which is exact where it
    can be 0.5: floor(x + 0.5) rounds x + 0.5 first (fp32 8388609.0 + 0.5 is 8388610.0, a whole number
    rounded to its neighbour). A zero result takes x's sign (round(-0.4) is -0.0)."""
    r = tl.floor(x)
    d = x - r
    up = (d > 0.5) | ((d == 0.5) & (r % 2 != 0))
    return tfsn_zero_signed(tl.where(up, r + 1.0, r), x)


'''


def write_source(graph: Graph, groups: Sequence[Group], buffers: set[int], schedules: Sequence[Schedule],
                 inplace: dict[int, int] | None = None) -> tuple[str, list[TritonKernel | None]]:
    """One Python module of Triton kernels for a whole graph; None for extern groups."""
    kernels: list[TritonKernel | None] = []
    for i, (group, schedule) in enumerate(zip(groups, schedules)):
        kernels.append(None if group.kind == "extern" else
                       TritonWriter(graph, group, buffers, schedule, f"k{i}", inplace).write())
    return PRELUDE + "\n\n".join(k.source for k in kernels if k is not None), kernels


class TritonLibrary:
    """The kernels of one module, loaded (runtime.CompiledGraph calls `launcher`). Triton reads a
    kernel's source from its file, so the module is written to the cache, named by its content."""

    def __init__(self, source: str) -> None:
        path = cache_dir() / "triton" / f"{content_key(source)}.py"
        if not path.exists():
            atomic_write(path, source.encode())
        spec = importlib.util.spec_from_file_location(f"tfsn_triton_{path.stem}", path)
        self.module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.module)
        self.path = path

    def precompile(self, graph: Graph, kernels: Sequence[TritonKernel | None]) -> list[tuple[str, BaseException]]:
        """Every kernel compiled for the graph's GPU before the first step, on a pool of threads: Triton
        would compile each at its first launch, one after another (its LLVM and ptxas stages run outside
        the GIL). The kernels that failed, by name, with Triton's error: run, they would fail the step."""
        import torch
        from triton.runtime import driver
        if graph.device == "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
            return []
        todo = [k for k in kernels if k is not None and (k.product is None or k.product.epilogue)]
        driver.active       # made here, once: its first use builds and loads Triton's C utilities, unlocked

        def compile_one(k: TritonKernel) -> None:
            with torch.cuda.device(torch.device(graph.device)):
                for name, grid, meta in k.launches():
                    getattr(self.module, name).warmup(*k.pointer_dtypes(graph), grid=grid, **dict(meta),
                                                      **launch_options())
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 16) or 1) as pool:
            compiled = [(k, pool.submit(compile_one, k)) for k in todo]
        # Triton parses each kernel's source with ast.parse, which CPython 3.11 does not make thread-safe: a parse
        # while another thread's garbage collection runs Python code can raise a spurious SystemError ("AST
        # constructor recursion depth mismatch", python/cpython#106905), which would send the graph to ATen. So a
        # kernel that failed on the pool is compiled again here, alone: only one that fails then has failed.
        failed = []
        for k, future in compiled:
            if future.exception() is not None:
                try:
                    compile_one(k)
                except Exception as e:  # noqa: BLE001 - whatever Triton raised is the caller's report
                    failed.append((k.name, e))
        return failed

    def launcher(self, kernel: TritonKernel) -> Callable[[Sequence[Any]], None]:
        fn = getattr(self.module, kernel.name)[kernel.grid]
        meta = dict(kernel.meta) | launch_options()
        product, split = kernel.product, kernel.split
        if split is not None:
            combine, combine_meta = getattr(self.module, split.name)[split.grid], dict(split.meta) | launch_options()

            def launch(tensors: Sequence[Any]) -> None:
                scratch = split.scratch(tensors[0].device)
                fn(*tensors, *scratch, **meta)
                combine(*tensors, *scratch, **combine_meta)
        elif product is None:
            def launch(tensors: Sequence[Any]) -> None:
                fn(*tensors, **meta)
        elif product.epilogue:
            def launch(tensors: Sequence[Any]) -> None:
                fn(*tensors, product.run(tensors), **meta)
        else:
            launch = product.run
        return launch
