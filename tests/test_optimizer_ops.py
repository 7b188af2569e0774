"""Differential fuzz of every lowering the generator accepts, against eager ATen.

Each example draws shapes (0-d, size 1, odd sizes, broadcast, non-contiguous), a dtype and values
with special ones mixed in (NaN, +-inf, -0.0, denormals, large magnitudes), builds one ATen graph
that applies every entry of the pointwise table (or a reduction, a chain of views, a GEMM with an
epilogue) and runs it through the generator under fixed schedules chosen to stress it, and through
the search. The op must really be generated (not left to ATen) wherever the generator claims it.

Tolerances (documented, never loosened to pass):
- integer and bool results, and ops exact in IEEE arithmetic (comparisons, selects, copies, casts,
  rounding, sign, abs, neg, max/min): exact, NaN equal to NaN;
- one rounded operation (+ - * /, sqrt, reciprocal): 2 ulp relative;
- a + alpha * b and prims.fma: 2 ulp of the largest operand (gcc may contract it into one fused multiply-add,
  which rounds once where ATen may round twice: under cancellation the result's own ulp is no bound);
- libm functions (exp, log, tanh, erf, sin, cos, pow, sigmoid, ...): rtol 1e-5 and atol 1e-6 for
  fp32 (the SIMD libm, SLEEF in ATen, and ours each promise a few ulp; tfsn_expf flushes results
  below 2.5e-38 to 0), 1e-12 / 1e-14 for fp64;
- sums and means: reordered by SIMD lanes and threads, rtol 1e-5 (fp32) and atol 1e-6 x the sum of
  magnitudes of the reduced elements.
Not compared: a float out of an integer type's range (NaN, inf) cast to that type (undefined in
torch as in C), and prims.fma where the product alone overflows (see `not_compared`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from optimizer import fusion, ir
from optimizer.backend import compile_graph
from optimizer.codegen.c_ops import POINTWISE
from optimizer.ops import MODULOS
from optimizer.runtime import CompiledGraph
from optimizer.schedule import Schedule

aten, prims = torch.ops.aten, torch.ops.prims

EXAMPLES = int(os.environ.get("TFSN_FUZZ_EXAMPLES", "12"))     # per test; raise it to fuzz longer
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("TFSN_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# schedules that stress the generator: scalar code with unroll; narrow vectors with unroll, small
# chunks and column blocks, every loop parallel; wide vectors with generated GEMM tiles of odd size
SCHEDULES = {
    "scalar": Schedule(vector_width=1, unroll=3, parallel_axis=-1),
    "narrow": Schedule(vector_width=4, unroll=2, chunk=3, parallel_min_elements=0, column_block=5,
                       gemm_block_rows=5),
    "wide": Schedule(vector_width=16, chunk=1, parallel_min_elements=0, column_block=3, gemm="generated",
                     gemm_mr=3, gemm_nr=20, gemm_kc=7, gemm_block_rows=7),
}

FLOATS = ("float32", "float64")
DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64", "uint8", "bool")
SPECIAL_FLOATS = (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-40, -3e-39, 5e-324, 1e30, -3e38, 3e38, 1.0, -1.0, 0.5, 88.8, -104.0)
# Python scalars (alpha, clamp bounds, fill values, exponents) of a float op: ordinary ones, and the IEEE
# edges a scalar argument can carry (5e-324, fp64's smallest subnormal, only for fp64: fp32 has none)
SPECIAL_SCALARS = (math.nan, math.inf, -math.inf, -0.0, 1e-40, 3e38)
SPECIAL_INTS = (0, 1, -1, 256, 2 ** 31 - 1, -2 ** 31, 2 ** 53 + 1, -2 ** 63, 2 ** 62 + 3, 255)


# ---- inputs ----

@st.composite
def shapes(draw, max_dims: int = 4) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.sampled_from([1, 1, 2, 3, 5, 7, 13, 17, 33]), max_size=max_dims)))


@st.composite
def broadcastable(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts against `shape`: some trailing dims, some of them 1."""
    keep = draw(st.integers(0, len(shape)))
    tail = shape[len(shape) - keep:]
    return tuple(1 if draw(st.booleans()) and draw(st.booleans()) else n for n in tail)


def values(shape: tuple[int, ...], dtype: str, seed: int, special: float, layout: int) -> torch.Tensor:
    """A tensor of `shape` and `dtype`: random values with a fraction `special` of special ones,
    laid out contiguous (layout 0), transposed (1) or as a strided slice of a larger tensor (2)."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    n = math.prod(shape)
    if dtype == "bool":
        flat = torch.rand(n, generator=g) < 0.5
    elif dt.is_floating_point:
        flat = torch.randn(n, generator=g, dtype=torch.float64) * 3
        pick = torch.rand(n, generator=g) < special
        pool = torch.tensor(SPECIAL_FLOATS, dtype=torch.float64)
        flat = torch.where(pick, pool[torch.randint(len(pool), (n,), generator=g)], flat).to(dt)
    else:
        info = torch.iinfo(dt)
        flat = torch.randint(max(info.min, -9), min(info.max, 9) + 1, (n,), generator=g, dtype=torch.int64)
        pick = torch.rand(n, generator=g) < special
        pool = torch.tensor([v for v in SPECIAL_INTS if info.min <= v <= info.max], dtype=torch.int64)
        flat = torch.where(pick, pool[torch.randint(len(pool), (n,), generator=g)], flat).to(dt)
    t = flat.reshape(shape)
    if layout == 1 and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == 2 and t.dim() >= 1:
        big = torch.zeros(*shape[:-1], shape[-1] * 2 + 1, dtype=dt)
        big[..., 1::2] = t
        return big[..., 1::2]
    return t


@dataclass(frozen=True)
class Operands:
    x: torch.Tensor          # the main operand
    x2: torch.Tensor         # same shape and dtype as x
    y: torch.Tensor          # broadcastable against x, same dtype
    c: torch.Tensor          # a bool condition broadcastable against x
    s: float | int | bool    # a Python scalar of x's kind


@st.composite
def operands(draw, dtypes=DTYPES) -> Operands:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes())
    special = draw(st.sampled_from([0.0, 0.1, 0.5]))
    seed = draw(st.integers(0, 2 ** 16))

    def make(shape, dtype, k):
        return values(shape, dtype, seed + k, special, draw(st.integers(0, 2)))
    s = {"bool": True}.get(dtype, 3 if dtype.startswith(("int", "uint")) else draw(st.sampled_from(
        (2.5, -0.75, 3.0) * 2 + SPECIAL_SCALARS + ((5e-324,) if dtype == "float64" else ()))))
    if dtype in ("bfloat16", "float16"):
        # one the dtype holds (fp16's 3e38 is inf, its 1e-40 is 0): a kernel keeps a 16-bit op's scalar in
        # fp32 where eager rounds it to 16 bits first (the README's 16-bit handling, as Inductor's default)
        s = torch.tensor(s, dtype=getattr(torch, dtype)).item()
    return Operands(make(shape, dtype, 0), make(shape, dtype, 1), make(draw(broadcastable(shape)), dtype, 2),
                    make(draw(broadcastable(shape)), "bool", 3), s)


# ---- the table's entries, each as calls of its ATen overload ----

EXACT, ROUNDED, FUSED, LIBM = "exact", "rounded", "fused", "libm"


@dataclass(frozen=True)
class Recipe:
    op: str                                        # the POINTWISE key it exercises
    call: Callable[[Operands], torch.Tensor]
    accuracy: str = EXACT
    grad: bool = False                             # differentiable in x: its backward is fuzzed too


def _inductor_prims():
    """torch.ops.prims with Inductor's prims registered (fma is one)."""
    import torch._inductor.inductor_prims  # noqa: F401
    return prims


def _casts() -> list[Recipe]:
    return [Recipe("aten._to_copy.default", (lambda o, d=d: aten._to_copy.default(o.x, dtype=getattr(torch, d))))
            for d in DTYPES]


RECIPES: list[Recipe] = [
    Recipe("aten.add.Tensor", lambda o: aten.add.Tensor(o.x, o.y, alpha=o.s), FUSED, True),
    Recipe("aten.add.Tensor", lambda o: aten.add.Tensor(o.x, o.y), ROUNDED, True),
    Recipe("aten.add.Scalar", lambda o: aten.add.Scalar(o.x, o.s), ROUNDED),
    Recipe("aten.sub.Tensor", lambda o: aten.sub.Tensor(o.x, o.y, alpha=o.s), FUSED, True),
    Recipe("aten.sub.Scalar", lambda o: aten.sub.Scalar(o.x, o.s), ROUNDED),
    Recipe("aten.rsub.Scalar", lambda o: aten.rsub.Scalar(o.x, o.s), ROUNDED),
    Recipe("aten.rsub.Tensor", lambda o: aten.rsub.Tensor(o.x, o.y, alpha=o.s), FUSED),
    Recipe("aten.mul.Tensor", lambda o: aten.mul.Tensor(o.x, o.y), ROUNDED, True),
    Recipe("aten.mul.Scalar", lambda o: aten.mul.Scalar(o.x, o.s), ROUNDED),
    Recipe("aten.div.Tensor", lambda o: aten.div.Tensor(o.x, o.y), ROUNDED, True),
    Recipe("aten.div.Scalar", lambda o: aten.div.Scalar(o.x, o.s), ROUNDED),
    Recipe("aten.neg.default", lambda o: aten.neg.default(o.x), EXACT, True),
    Recipe("aten.abs.default", lambda o: aten.abs.default(o.x), EXACT, True),
    Recipe("aten.exp.default", lambda o: aten.exp.default(o.x), LIBM, True),
    Recipe("aten.exp2.default", lambda o: aten.exp2.default(o.x), LIBM),
    Recipe("aten.expm1.default", lambda o: aten.expm1.default(o.x), LIBM, True),
    Recipe("aten.log.default", lambda o: aten.log.default(o.x), LIBM, True),
    Recipe("aten.log2.default", lambda o: aten.log2.default(o.x), LIBM),
    Recipe("aten.log1p.default", lambda o: aten.log1p.default(o.x), LIBM, True),
    Recipe("aten.sqrt.default", lambda o: aten.sqrt.default(o.x), ROUNDED, True),
    Recipe("aten.rsqrt.default", lambda o: aten.rsqrt.default(o.x), LIBM, True),
    Recipe("aten.reciprocal.default", lambda o: aten.reciprocal.default(o.x), ROUNDED, True),
    Recipe("aten.sin.default", lambda o: aten.sin.default(o.x), LIBM, True),
    Recipe("aten.cos.default", lambda o: aten.cos.default(o.x), LIBM, True),
    Recipe("aten.tanh.default", lambda o: aten.tanh.default(o.x), LIBM, True),
    Recipe("aten.erf.default", lambda o: aten.erf.default(o.x), LIBM, True),
    Recipe("aten.atan2.default", lambda o: aten.atan2.default(o.x, o.y), LIBM, True),
    Recipe("aten.hypot.default", lambda o: aten.hypot.default(o.x, o.y), LIBM, True),
    Recipe("aten.sigmoid.default", lambda o: aten.sigmoid.default(o.x), LIBM, True),
    Recipe("aten.fmod.Tensor", lambda o: aten.fmod.Tensor(o.x, o.y), EXACT, True),
    Recipe("aten.fmod.Scalar", lambda o: aten.fmod.Scalar(o.x, o.s)),
    Recipe("aten.remainder.Tensor", lambda o: aten.remainder.Tensor(o.x, o.y), EXACT, True),
    Recipe("aten.remainder.Scalar", lambda o: aten.remainder.Scalar(o.x, o.s)),
    *[Recipe("aten.div.Tensor_mode", (lambda o, m=m: aten.div.Tensor_mode(o.x, o.y, rounding_mode=m)), EXACT, True)
      for m in ("trunc", "floor")],
    *[Recipe("aten.div.Scalar_mode", (lambda o, m=m: aten.div.Scalar_mode(o.x, o.s, rounding_mode=m)))
      for m in ("trunc", "floor")],
    Recipe("aten.relu.default", lambda o: aten.relu.default(o.x), EXACT, True),
    Recipe("aten.floor.default", lambda o: aten.floor.default(o.x)),
    Recipe("aten.ceil.default", lambda o: aten.ceil.default(o.x)),
    Recipe("aten.trunc.default", lambda o: aten.trunc.default(o.x)),
    Recipe("aten.round.default", lambda o: aten.round.default(o.x)),
    Recipe("aten.sign.default", lambda o: aten.sign.default(o.x)),
    *[Recipe("aten.pow.Tensor_Scalar", (lambda o, e=e: aten.pow.Tensor_Scalar(o.x, e)), LIBM, True)
      for e in (2, 3, 0.5, 1.0, -1.0, -0.5, 1.7, 0, -2, -1.5, *SPECIAL_SCALARS)],
    Recipe("aten.pow.Tensor_Tensor", lambda o: aten.pow.Tensor_Tensor(o.x, o.y), LIBM, True),
    Recipe("aten.pow.Scalar", lambda o: aten.pow.Scalar(o.s, o.x), LIBM),
    Recipe("prims.fma.default", lambda o: _inductor_prims().fma.default(o.x, o.x2, o.x), FUSED),
    Recipe("aten.maximum.default", lambda o: aten.maximum.default(o.x, o.y), EXACT, True),
    Recipe("aten.minimum.default", lambda o: aten.minimum.default(o.x, o.y), EXACT, True),
    Recipe("aten.clamp_min.default", lambda o: aten.clamp_min.default(o.x, o.s), EXACT, True),
    Recipe("aten.clamp_max.default", lambda o: aten.clamp_max.default(o.x, o.s), EXACT, True),
    Recipe("aten.clamp.default", lambda o: aten.clamp.default(o.x, -o.s if not isinstance(o.s, bool) else False, o.s),
           EXACT, True),
    Recipe("aten.where.self", lambda o: aten.where.self(o.c, o.x, o.y), EXACT, True),
    Recipe("aten.masked_fill.Scalar", lambda o: aten.masked_fill.Scalar(o.x, o.c, o.s), EXACT, True),
    Recipe("aten.masked_fill.Tensor", lambda o: aten.masked_fill.Tensor(o.x, o.c, o.x2.reshape(-1)[:1].reshape(())
                                                                        if o.x2.numel() else torch.tensor(1, dtype=o.x.dtype))),
    *[Recipe(f"aten.{cmp}.Tensor", (lambda o, f=getattr(aten, cmp).Tensor: f(o.x, o.y)))
      for cmp in ("eq", "ne", "lt", "le", "gt", "ge")],
    *[Recipe(f"aten.{cmp}.Scalar", (lambda o, f=getattr(aten, cmp).Scalar: f(o.x, o.s)))
      for cmp in ("eq", "ne", "lt", "le", "gt", "ge")],
    Recipe("aten.logical_not.default", lambda o: aten.logical_not.default(o.x)),
    Recipe("aten.logical_and.default", lambda o: aten.logical_and.default(o.x, o.y)),
    Recipe("aten.logical_or.default", lambda o: aten.logical_or.default(o.x, o.y)),
    Recipe("aten.bitwise_and.Tensor", lambda o: aten.bitwise_and.Tensor(o.x, o.y)),
    Recipe("aten.bitwise_or.Tensor", lambda o: aten.bitwise_or.Tensor(o.x, o.y)),
    Recipe("aten.bitwise_not.default", lambda o: aten.bitwise_not.default(o.x)),
    Recipe("aten.isnan.default", lambda o: aten.isnan.default(o.x)),
    *_casts(),
    Recipe("aten.clone.default", lambda o: aten.clone.default(o.x), EXACT, True),
    Recipe("aten.lift_fresh_copy.default", lambda o: aten.lift_fresh_copy.default(o.x)),
    Recipe("aten.copy.default", lambda o: aten.copy.default(o.x, o.y), EXACT),
    Recipe("aten.fill.Scalar", lambda o: aten.fill.Scalar(o.x, o.s)),
    Recipe("aten.full.default", lambda o: aten.full.default(list(o.x.shape), o.s, dtype=o.x.dtype)),
    Recipe("aten.full_like.default", lambda o: aten.full_like.default(o.x, o.s)),
    Recipe("aten.scalar_tensor.default", lambda o: aten.scalar_tensor.default(o.s, dtype=o.x.dtype)),
]


def test_every_pointwise_entry_has_a_fuzz_recipe():
    assert set(POINTWISE) == {r.op for r in RECIPES}, \
        f"no recipe for {sorted(set(POINTWISE) - {r.op for r in RECIPES})}: add one to RECIPES"


# ---- comparison ----

def tolerance(accuracy: str, dtype: torch.dtype, scale: float = 1.0) -> tuple[float, float]:
    """(rtol, atol) of an accuracy class; `scale`: the largest finite operand magnitude."""
    if accuracy == EXACT or not dtype.is_floating_point:
        return 0.0, 0.0
    eps = torch.finfo(dtype).eps
    if accuracy == ROUNDED:
        return 2 * eps, 0.0
    if accuracy == FUSED:
        return 2 * eps, 2 * eps * scale
    if dtype in (torch.bfloat16, torch.float16):
        # libm's value rounded once to the half (ours) or eager's own (rsqrt(4.625) is 1 bf16 ulp off: 0.46289)
        return 2 * eps, 1e-6
    return (1e-5, 1e-6) if dtype != torch.float64 else (1e-12, 1e-14)


def compare(got: torch.Tensor, want: torch.Tensor, accuracy: str, what: str, scale: float = 1.0) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} where eager gives {want.dtype}{tuple(want.shape)}"
    rtol, atol = tolerance(accuracy, want.dtype, scale)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}\n got  {got.flatten()[:12].tolist()}\n want "
                                             f"{want.flatten()[:12].tolist()}")


ALPHA_PRODUCTS = {"aten.add.Tensor": "y", "aten.sub.Tensor": "y", "aten.rsub.Tensor": "x"}   # alpha times which


def not_compared(recipe: Recipe, o: Operands) -> torch.Tensor | None:
    """Where eager's value is not the op's to give, masked out: a float -> integer cast out of the
    target's range (undefined), and prims.fma and a + alpha * b where the product alone overflows
    (fused, it rounds once and a + inf - inf gives a's inf; unfused, inf - inf is NaN: eager fuses
    fp32 and fp64 and not bf16/fp16, gcc may contract either, the Triton interpreter never does); and fmod
    and remainder of floats where eager gives NaN and C's fmod a value (a finite dividend, a nonzero divisor,
    neither NaN): eager's vectorized CPU loop (Sleef) gives NaN where the quotient overflows the dtype
    (fmod(3e38, 0.1) in fp32), its scalar tail and CUDA the exact value (tests/test_optimizer_numeric_idioms.py
    checks the generated kernels' values there against C's fmod)."""
    if recipe.op in MODULOS and recipe.call(o).is_floating_point():
        divisor = o.y if recipe.op.endswith("Tensor") else torch.tensor(float(o.s))
        defined = o.x.isfinite() & (divisor != 0) & ~divisor.isnan()
        return (defined & recipe.call(o).isnan()).expand(recipe.call(o).shape)
    if recipe.op == "prims.fma.default" and o.x.is_floating_point():
        product = (o.x.double() * o.x2.double()).abs()
        return product > torch.finfo(o.x.dtype).max
    if recipe.accuracy == FUSED and recipe.op in ALPHA_PRODUCTS and o.x.is_floating_point():
        product = (getattr(o, ALPHA_PRODUCTS[recipe.op]).double() * float(o.s)).abs()
        computed_in = torch.promote_types(o.x.dtype, torch.float32)          # a 16-bit op's, fp32
        return (product > torch.finfo(computed_in).max).expand(recipe.call(o).shape)
    if recipe.op != "aten._to_copy.default" or not o.x.is_floating_point():
        return None
    target = recipe.call(o).dtype
    if target.is_floating_point or target == torch.bool:
        return None
    info = torch.iinfo(target)
    x = o.x.double()
    return ~((x > float(info.min) - 1) & (x < float(info.max) + 1))


def magnitude(o: Operands) -> float:
    """The largest finite magnitude among the operands (alpha included)."""
    finite = [t.double().abs().nan_to_num(0, 0, 0).max().item() for t in (o.x, o.x2, o.y) if t.numel()]
    top = max(finite + [0.0])
    return max(top * max(1.0, abs(float(o.s))), top * top)      # a product's magnitude too (fma)


def same_layout(t: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A copy with t's strides, on t's device or `device` (clone() makes a strided slice contiguous, and some
    ATen kernels round differently on the two layouts: the comparison must be of the same call)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device or t.device).copy_(t)


def eager_calls(recipes: list[Recipe], o: Operands) -> list[tuple[Recipe, torch.Tensor]]:
    """The recipes eager ATen accepts for these operands, with its results."""
    out = []
    for r in recipes:
        try:
            out.append((r, r.call(o)))
        except (RuntimeError, TypeError, ValueError, OverflowError):      # not defined for this dtype
            continue
    return out


def generated(fn: Callable, inputs: list[torch.Tensor], schedule: Schedule | None, top_k: int = 2,
              codegen: str | None = None):
    """fn traced to ATen (no decomposition: the graph holds exactly the ops called) and compiled by
    tfsn under `schedule` (None: the search), as C or as `codegen`; the compiled callable and the lowered graph."""
    gm = make_fx(fn)(*inputs)
    compiled = compile_graph(gm, inputs, schedule=schedule, top_k=top_k, codegen=codegen)
    assert isinstance(compiled, CompiledGraph), "the generated code failed to build: see the log"
    return compiled, ir.from_fx(gm, half=True)


def assert_lowered(graph: ir.Graph, ops: set[str]) -> None:
    """Every node of these ops that the IR claims (not an extern) is generated: a kernel's member, or
    inlined into one."""
    plan = fusion.plan(graph)
    as_aten = {n for g in plan.groups if g.kind == "extern" for n in g.nodes}
    for node in graph.nodes:
        if node.op in ops and node.kind != ir.Kind.EXTERN:
            assert node.index not in as_aten, f"{node.name} was not generated"


def run_table(o: Operands, schedule: Schedule | None, recipes: list[Recipe] = RECIPES,
              codegen: str | None = None) -> None:
    calls = eager_calls(recipes, o)
    inputs = [o.x, o.x2, o.y, o.c]

    def fn(x, x2, y, c):
        ops = Operands(x, x2, y, c, o.s)
        return [r.call(ops) for r, _ in calls]
    compiled, graph = generated(fn, inputs, schedule, codegen=codegen)
    assert_lowered(graph, {r.op for r, _ in calls})
    outs = compiled([same_layout(t) for t in inputs])
    for (r, want), got in zip(calls, outs):
        mask = not_compared(r, o)
        if mask is not None:
            got, want = got.masked_fill(mask, 0), want.masked_fill(mask, 0)
        compare(got, want, r.accuracy, f"{r.op} on {o.x.dtype} {tuple(o.x.shape)} with y {tuple(o.y.shape)}",
                scale=magnitude(o))


@contextlib.contextmanager
def fallbacks():
    """The backend's warnings, while inside, that a graph ran as ATen because its code failed."""
    found: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: found.append(r.getMessage()) if "running a graph as ATen" in r.getMessage() else None
    logger = logging.getLogger("tfsn.optimizer")
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


@pytest.fixture(autouse=True, scope="module")
def cache(tmp_path_factory):
    """A compile cache of this module's own: what it checks is built here, not found from a past run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFSN_CACHE", str(tmp_path_factory.mktemp("tfsn-cache")))
        yield


# ---- the tests ----

@pytest.mark.parametrize("name", list(SCHEDULES))
@FUZZ
@given(o=operands())
def test_pointwise_table_matches_eager(name, o):
    run_table(o, SCHEDULES[name])


@settings(FUZZ, max_examples=max(2, EXAMPLES // 4))
@given(o=operands(dtypes=("float32", "int64", "bool")))
def test_pointwise_table_matches_eager_under_the_search(o):
    run_table(o, None)


@pytest.mark.parametrize("name", list(SCHEDULES))
@settings(FUZZ, max_examples=max(2, EXAMPLES // 2))      # a torch.compile of forward and backward each
@given(o=operands(dtypes=FLOATS))
def test_pointwise_gradients_match_eager(name, o):
    """Each differentiable entry's backward (decomposed as the backend decomposes it) through the
    whole backend: forward and backward graphs generated under the stressing schedule."""
    from optimizer.backend import make_backend
    recipes = [r for r, _ in eager_calls([r for r in RECIPES if r.grad], o)]
    leaves = [o.x.detach().clone().requires_grad_() for _ in recipes]
    grads = [torch.randn(r.call(o).shape, dtype=o.x.dtype, generator=torch.Generator().manual_seed(7))
             for r in recipes]

    def loss(leaves, y, x2, c):
        total = 0
        for r, leaf, g in zip(recipes, leaves, grads):
            total = total + (r.call(Operands(leaf, x2, y, c, o.s)) * g).sum()
        return total
    want = torch.autograd.grad(loss(leaves, o.y, o.x2, o.c), leaves)
    torch._dynamo.reset()
    mine = [leaf.detach().clone().requires_grad_() for leaf in leaves]
    compiled = torch.compile(loss, backend=make_backend(schedule=SCHEDULES[name]), fullgraph=True)
    with fallbacks() as failed:
        got = torch.autograd.grad(compiled(mine, o.y, o.x2, o.c), mine)
    assert not failed, f"the generated code failed to build: {failed[0][:300]}"
    for r, a, b in zip(recipes, got, want):
        # a backward is a few ops deep: one rounding each, so the libm tolerance
        compare(a, b, LIBM if r.accuracy != EXACT else EXACT, f"d/dx {r.op} on {o.x.dtype} {tuple(o.x.shape)}")


# ---- reductions ----

REDUCTIONS = {
    "sum": lambda x, dims, keep: aten.sum.dim_IntList(x, dims, keep),
    "sum_all": lambda x, dims, keep: aten.sum.default(x),
    "mean": lambda x, dims, keep: aten.mean.dim(x, dims, keep),
    "mean_all": lambda x, dims, keep: aten.mean.default(x),
    "amax": lambda x, dims, keep: aten.amax.default(x, dims, keep),
    "amin": lambda x, dims, keep: aten.amin.default(x, dims, keep),
}


@st.composite
def reduction_cases(draw):
    o = draw(operands(dtypes=("float32", "float64", "float32", "int64", "bfloat16", "float16")))
    nd = o.x.dim()
    dims = sorted(draw(st.sets(st.integers(0, max(nd - 1, 0)), min_size=1))) if nd else []
    return o, draw(st.sampled_from(sorted(REDUCTIONS))), dims, draw(st.booleans())


@pytest.mark.parametrize("name", list(SCHEDULES))
@FUZZ
@given(case=reduction_cases())
def test_reductions_and_their_readers_match_eager(name, case):
    """A reduction, and a pointwise reader of it at the input's shape (softmax-like: x - max, x / sum),
    so both the row and the column loop shapes, and the per-row epilogue, are exercised."""
    o, kind, dims, keep = case
    if kind in ("amax", "amin") and not dims or kind.startswith("mean") and not o.x.is_floating_point():
        return                             # eager rejects these: nothing to compare
    reduce = REDUCTIONS[kind]

    def fn(x):
        r = reduce(x, dims, keep)
        reader = aten.sub.Tensor(x, r) if keep or r.dim() == 0 else aten.mul.Tensor(r, 2)
        return [r, reader]
    want = fn(o.x)
    compiled, graph = generated(fn, [o.x], SCHEDULES[name])
    assert_lowered(graph, {"aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default",
                           "aten.amax.default", "aten.amin.default"})
    got = compiled([same_layout(o.x)])
    exact = kind in ("amax", "amin") or not o.x.is_floating_point()
    # a sum reordered by SIMD lanes and threads: error bounded by eps x the sum of magnitudes
    scale = o.x.double().abs().nan_to_num(0, 0, 0).sum().item()
    eps = torch.finfo(o.x.dtype).eps if o.x.is_floating_point() else 0
    if not exact:
        # where the finite magnitudes alone can overflow, partial sums reach inf in some orders and
        # not others (inf - inf is NaN): torch fixes no order, so those rows are not compared
        finite = o.x.double().abs().nan_to_num(0, 0, 0)
        magnitude = finite.sum() if kind.endswith("_all") else aten.sum.dim_IntList(finite, dims, keep)
        overflow = magnitude > torch.finfo(o.x.dtype).max / 2
        got = [g.masked_fill(overflow, 0) for g in got]
        want = [w.masked_fill(overflow, 0) for w in want]
    for g, w, what in zip(got, want, ("reduction", "reader")):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{kind}{dims} {what}: {g.shape} vs {w.shape}"
        torch.testing.assert_close(g, w, rtol=0 if exact else 8 * eps, atol=0 if exact else 8 * eps * scale,
                                   equal_nan=True, msg=lambda m: f"{kind} over {dims} keepdim={keep} of "
                                                                 f"{o.x.dtype}{tuple(o.x.shape)}, {what}: {m}")


# ---- views: chains of index maps, read by a pointwise op ----

@st.composite
def view_chains(draw):
    """Operands and up to 4 view steps, each drawn for the shape the steps before it give."""
    o = draw(operands(dtypes=("float32", "int64")))
    steps = []
    probe = torch.empty(o.x.shape)
    for _ in range(draw(st.integers(1, 4))):
        shape, nd = list(probe.shape), probe.dim()
        choices = ["unsqueeze", "alias", "expand"] + (["permute", "transpose", "slice", "select", "reshape", "flatten"]
                                                      if nd else []) + (["t"] if nd == 2 else []) + \
            (["squeeze"] if 1 in shape else [])
        op = draw(st.sampled_from(choices))
        if op == "unsqueeze":
            step = (lambda v, d=draw(st.integers(0, nd)): aten.unsqueeze.default(v, d))
        elif op == "alias":
            step = aten.alias.default
        elif op == "permute":
            step = (lambda v, p=list(draw(st.permutations(range(nd)))): aten.permute.default(v, p))
        elif op == "transpose":
            step = (lambda v, a=draw(st.integers(-nd, nd - 1)), b=draw(st.integers(-nd, nd - 1)):
                    aten.transpose.int(v, a, b))
        elif op == "t":
            step = aten.t.default
        elif op == "slice":
            d = draw(st.integers(0, nd - 1))
            step = (lambda v, d=d, s=draw(st.integers(-shape[d], shape[d])), e=draw(st.integers(-shape[d], shape[d] + 2)),
                    k=draw(st.integers(1, 3)): aten.slice.Tensor(v, d, s, e, k))
        elif op == "select":
            d = draw(st.integers(0, nd - 1))
            if shape[d] == 0:
                continue
            step = (lambda v, d=d, i=draw(st.integers(-shape[d], shape[d] - 1)): aten.select.int(v, d, i))
        elif op in ("reshape", "flatten"):
            new = [math.prod(shape)] if op == "flatten" else list(draw(st.permutations(shape)))
            step = (lambda v, n=new: aten.reshape.default(v, n))
        elif op == "squeeze":
            step = (lambda v, d=shape.index(1): aten.squeeze.dim(v, d))
        else:
            new = [draw(st.sampled_from([2, 3])) if n == 1 else n for n in shape]
            new = ([2] if draw(st.booleans()) and nd < 4 else []) + new
            step = (lambda v, n=new: aten.expand.default(v, n))
        probe = step(probe)
        steps.append(step)
    return o, steps


@pytest.mark.parametrize("name", list(SCHEDULES))
@FUZZ
@given(case=view_chains())
def test_view_chains_read_by_kernels_match_eager(name, case):
    o, steps = case

    def fn(x):
        v = x
        for step in steps:
            v = step(v)
        return [aten.add.Tensor(v, 1), aten.mul.Tensor(v, 2), aten.sum.default(v)]
    want = fn(o.x)
    compiled, graph = generated(fn, [o.x], SCHEDULES[name])
    got = compiled([same_layout(o.x)])
    what = f"views of {o.x.dtype}{tuple(o.x.shape)}"
    compare(got[0], want[0], ROUNDED, what)
    compare(got[1], want[1], EXACT, what)
    if want[2].is_floating_point():        # a sum in another order (see the reductions' tolerance)
        scale = o.x.double().abs().nan_to_num(0, 0, 0).sum().item() * max(1, want[1].numel() // max(o.x.numel(), 1))
        torch.testing.assert_close(got[2], want[2], rtol=0, atol=8 * torch.finfo(want[2].dtype).eps * scale,
                                   equal_nan=True)
    else:
        compare(got[2], want[2], EXACT, what)


# ---- concatenations: each element one piece's, read by a pointwise op ----

@st.composite
def concatenations(draw):
    """A dim (negative or not) and 1-4 pieces of one shape but along it (0-size pieces too), each arriving
    contiguous, transposed, or as the base of a strided slice that the graph takes."""
    dtype = getattr(torch, draw(st.sampled_from(("float32", "int64", "bool"))))
    nd = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 5), min_size=nd, max_size=nd))
    dim = draw(st.integers(-nd, nd - 1))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    pieces = []
    for _ in range(draw(st.integers(1, 4))):
        size = list(shape)
        size[dim] = draw(st.integers(0, 4))
        layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
        stored = size[::-1] if layout == "transposed" else size[:-1] + [2 * size[-1]] if layout == "sliced" else size
        t = (torch.randn(stored, generator=g) * 4).to(dtype)
        pieces.append((t.permute(*reversed(range(nd))) if layout == "transposed" else t, layout == "sliced"))
    return dim, pieces


@pytest.mark.parametrize("name", list(SCHEDULES))
@FUZZ
@given(case=concatenations())
def test_concatenations_read_by_kernels_match_eager(name, case):
    dim, pieces = case

    def fn(*tensors):
        cat = aten.cat.default([aten.slice.Tensor(t, -1, 0, None, 2) if sliced else t
                                for t, (_, sliced) in zip(tensors, pieces)], dim)
        return [cat, aten.mul.Tensor(cat, cat)]
    inputs = [t for t, _ in pieces]
    want = fn(*inputs)
    compiled, graph = generated(fn, inputs, SCHEDULES[name])
    assert_lowered(graph, {"aten.cat.default"})
    got = compiled([same_layout(t) for t in inputs])
    what = f"cat along {dim} of {[(tuple(t.shape), t.stride(), s) for t, s in pieces]}"
    for g, w in zip(got, want):
        compare(g, w, EXACT, what)


# ---- GEMMs with epilogues ----

@st.composite
def gemm_cases(draw):
    m, n, k = (draw(st.sampled_from([1, 2, 5, 17, 33, 70])) for _ in range(3))
    batch = draw(st.sampled_from([0, 0, 1, 3]))
    seed = draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)

    def operand(rows, cols, transposed):
        lead = (batch,) if batch else ()
        t = torch.randn(*lead, cols, rows, generator=g).transpose(-1, -2) if transposed else \
            torch.randn(*lead, rows, cols, generator=g)
        return t
    a, b = operand(m, k, draw(st.booleans())), operand(k, n, draw(st.booleans()))
    dtype = getattr(torch, draw(st.sampled_from(["float32", "float32", "bfloat16", "float16"])))
    return (a.to(dtype), b.to(dtype), torch.randn(n, generator=g).to(dtype),
            draw(st.sampled_from(["none", "bias", "bias_gelu", "scale_residual"])))


@pytest.mark.parametrize("name", list(SCHEDULES))
@FUZZ
@given(case=gemm_cases())
def test_gemms_and_their_epilogues_match_eager(name, case):
    """mm, bmm and addmm (bias as an epilogue) with transposed operands and odd sizes, under tiles that
    leave edges on every side; finite values (BLAS itself gives no NaN/inf guarantees). bf16/fp16 as eager's
    CPU GEMM: exact products summed in fp32, the result rounded once, so a product or an addmm differs from
    eager's only where the other summation order crosses a rounding boundary (1 ulp, rarely); an epilogue
    after it rounds once where eager rounds after each op."""
    a, b, bias, epilogue = case

    def fn(a, b, bias):
        if a.dim() == 2 and epilogue != "none":
            c = aten.addmm.default(bias, a, b)
        else:
            c = aten.bmm.default(a, b) if a.dim() == 3 else aten.mm.default(a, b)
        if epilogue == "bias_gelu":
            c = aten.mul.Tensor(aten.mul.Tensor(c, 0.5), aten.add.Tensor(aten.erf.default(aten.mul.Tensor(c, 0.7071)), 1))
        elif epilogue == "scale_residual":
            c = aten.add.Tensor(aten.mul.Tensor(c, 0.125), c)
        return [c]
    want = fn(a, b, bias)
    compiled, graph = generated(fn, [a, b, bias], SCHEDULES[name])
    got = compiled([same_layout(a), same_layout(b), same_layout(bias)])
    # K products summed in another order: bounded by eps x K x |A||B|
    scale = (a.float().abs() @ b.float().abs()).max().item() + bias.float().abs().max().item()
    what = f"{a.dtype}{tuple(a.shape)} @ {tuple(b.shape)} {epilogue}"
    atol = 4 * torch.finfo(torch.float32).eps * scale
    if a.dtype == torch.float32:
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")
        return
    eps = torch.finfo(a.dtype).eps
    if epilogue not in ("none", "bias"):    # eager rounds after each of 2-4 ops, of values up to `scale` (gelu's
        atol = 4 * eps * scale              # erf(x) + 1 cancels: eager's rounded erf leaves up to eps there)
    torch.testing.assert_close(got[0], want[0], rtol=eps if epilogue in ("none", "bias") else 4 * eps,
                               atol=atol, msg=lambda m: f"{what}: {m}")
    if epilogue in ("none", "bias"):        # rounded to nearest once, as eager: a truncating kernel differs at ~1/2
        differ = (got[0] != want[0]).double().mean().item()
        assert differ <= 0.1, f"{what}: {differ:.0%} of the elements differ from eager's"
