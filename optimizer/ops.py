"""The ops and dtypes the optimizer generates code for, by name: what fusion, the loop nest and the cost
model agree on, whatever the target. Each renderer has a table with one entry per op here
(codegen/c_ops.py for C); an op not here stays an extern ATen call.
"""
from __future__ import annotations

from typing import Iterable

DTYPES = ("float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")

POINTWISE_OPS = frozenset({
    "aten._to_copy.default", "aten.abs.default", "aten.add.Scalar", "aten.add.Tensor", "aten.atan2.default",
    "aten.bitwise_and.Tensor", "aten.bitwise_not.default", "aten.bitwise_or.Tensor", "aten.ceil.default",
    "aten.clamp.default", "aten.clamp_max.default", "aten.clamp_min.default", "aten.clone.default",
    "aten.copy.default", "aten.cos.default", "aten.div.Scalar", "aten.div.Scalar_mode", "aten.div.Tensor",
    "aten.div.Tensor_mode", "aten.eq.Scalar", "aten.eq.Tensor", "aten.erf.default", "aten.exp.default",
    "aten.exp2.default", "aten.expm1.default", "aten.fill.Scalar", "aten.floor.default", "aten.fmod.Scalar",
    "aten.fmod.Tensor", "aten.full.default", "aten.full_like.default", "aten.ge.Scalar", "aten.ge.Tensor",
    "aten.gt.Scalar", "aten.gt.Tensor", "aten.hypot.default", "aten.isnan.default", "aten.le.Scalar",
    "aten.le.Tensor", "aten.lift_fresh_copy.default", "aten.log.default", "aten.log1p.default",
    "aten.log2.default", "aten.logical_and.default", "aten.logical_not.default", "aten.logical_or.default",
    "aten.lt.Scalar", "aten.lt.Tensor", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
    "aten.maximum.default", "aten.minimum.default", "aten.mul.Scalar", "aten.mul.Tensor", "aten.ne.Scalar",
    "aten.ne.Tensor", "aten.neg.default", "aten.pow.Scalar", "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor",
    "aten.reciprocal.default", "aten.relu.default", "aten.remainder.Scalar", "aten.remainder.Tensor",
    "aten.round.default", "aten.rsqrt.default", "aten.rsub.Scalar", "aten.rsub.Tensor",
    "aten.scalar_tensor.default", "aten.sigmoid.default", "aten.sign.default", "aten.sin.default",
    "aten.sqrt.default", "aten.sub.Scalar", "aten.sub.Tensor", "aten.tanh.default", "aten.trunc.default",
    "aten.where.self", "prims.fma.default",
})

# ops that cost a polynomial or a divide per element (the cost model's `math`, fusion's recompute cost)
EXPENSIVE = frozenset({
    "aten.atan2.default", "aten.cos.default", "aten.div.Scalar_mode", "aten.div.Tensor", "aten.div.Tensor_mode",
    "aten.erf.default", "aten.exp.default", "aten.expm1.default", "aten.fmod.Scalar", "aten.fmod.Tensor",
    "aten.hypot.default", "aten.log.default", "aten.log1p.default", "aten.pow.Tensor_Tensor",
    "aten.remainder.Scalar", "aten.remainder.Tensor", "aten.rsqrt.default", "aten.sigmoid.default",
    "aten.sin.default", "aten.sqrt.default", "aten.tanh.default",
})

# C's fmod (the dividend's sign) and Python's remainder (the divisor's): exact in floats (the renderers'
# own algorithm where the target's is not). Integers are generated only for a positive Python int divisor that
# the dtype holds: a zero one raises in eager where C would trap, INT_MIN % -1 traps too, and eager wraps the
# int into the dtype first (an int8 % 200 is by -56, % 256 raises).
MODULOS = frozenset({"aten.fmod.Scalar", "aten.fmod.Tensor", "aten.remainder.Scalar", "aten.remainder.Tensor"})

# torch.div with rounding_mode "trunc" or "floor" (`//`, floor_divide): exact as ATen's, whose floor division of
# floats goes through fmod. Integers as MODULOS. A 16-bit float only by a Python number: eager divides by one
# in fp32 and rounds once, where by a tensor its vectorized loop rounds every step to the half.
ROUNDED_DIVISIONS = frozenset({"aten.div.Scalar_mode", "aten.div.Tensor_mode"})

# Functions to whole numbers: a step at each integer (or half), so where eager rounds a 16-bit operand to the
# half before it, a generated kernel holding that operand in fp32 must too (as comparisons do): eager's fp16
# 2.943 * 1.0195 is 3.0 and its ceil 3, where the fp32 product 3.0008 has ceil 4.
ROUNDINGS = frozenset({"aten.ceil.default", "aten.floor.default", "aten.round.default", "aten.trunc.default",
                       *ROUNDED_DIVISIONS})


# ATen's CPU pow of a bf16 tensor by 3 or -2 multiplies Vectorized<BFloat16> values, each product rounded to bf16
# (base * base * base, (base * base).reciprocal()): bf16 x ** 3 is (x * x) * x; fp16's is std::pow, rounded once
CPU_BF16_SQUARE_ROUNDED_POWERS = (3.0, -2.0)

# Conversions (.to(dtype), .float(), .half()): their result is rounded to its dtype, as eager's is.
CONVERSIONS = frozenset({"aten._to_copy.default"})


def eager_rounded(op: str, params: dict) -> bool:
    """Whether a generated op's result is rounded to its dtype where that is a 16-bit float held in fp32: a
    conversion, or an op the user wrote (ir.from_fx's params["rounded"]), whose 16-bit result eager rounds."""
    return op in CONVERSIONS or bool(params.get("rounded"))


def half_operand_rounded(op: str, half: str | None, out: str) -> bool:
    """Whether an operand of op, a value of the 16-bit dtype `half` held in fp32 (None: not a half), is rounded
    to `half` first: where eager's value was that half and the op does not round it again to the same dtype:
    one of another dtype converts it (fp16 x + finfo.min is -65504 whatever x; x32 // (h1 * h2) divides by the
    bf16 product, a whole step off by the fp32 one), and one that steps (ROUNDINGS) is a function of it."""
    return half is not None and (half != out or op in ROUNDINGS)


def comparison_dtype(operands: Iterable[tuple[str, bool, bool]]) -> str:
    """The dtype a comparison of (dtype, is a Python scalar, is a 0-d tensor) operands is made in: ATen's
    result_type. Dimensioned tensors decide, then 0-d tensors, then Python scalars (a float one as the
    default float32); a lower rank counts only where its category (bool < integer < float) is higher. So
    an fp32 tensor is compared with a 0-d fp64 threshold in fp32, a uint8 tensor with -1 in uint8 (-1
    wraps to 255), and an fp16 tensor with 0.1 in fp16 (0.1 rounded to 0.0999755859375), as eager does."""
    import torch

    def promoted(dtypes: list[str]):
        out = None
        for d in dtypes:
            t = getattr(torch, d)
            out = t if out is None else torch.promote_types(out, t)
        return out

    values = [(d, scalar, zero_dim) for d, scalar, zero_dim in operands if d != "none"]
    dims = promoted([d for d, scalar, zero_dim in values if not scalar and not zero_dim])
    zeros = promoted([d for d, scalar, zero_dim in values if zero_dim])
    wrapped = promoted(["float32" if d in ("float32", "float64") else d for d, scalar, _ in values if scalar])

    def combine(higher, lower):
        if higher is None or lower is None:
            return higher or lower
        if higher.is_floating_point:
            return higher
        if higher == torch.bool or lower.is_floating_point:
            return torch.promote_types(higher, lower)
        return higher
    return str(combine(dims, combine(zeros, wrapped))).removeprefix("torch.")
