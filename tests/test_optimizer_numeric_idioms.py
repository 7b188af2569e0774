"""Numerically tricky and rarely used operations as training code writes them, compiled by tfsn on the C
target and through Triton (on this CPU under TRITON_INTERPRET=1) against eager PyTorch, forward values and
input gradients: softmax and log-sum-exp over rows that are all -inf or hold +inf and NaN; variances with
every correction, over a dim of size 1; vector norms of every order and F.normalize at zero vectors;
distances at equal points; special functions near their poles and edges; the IEEE edge cases of atan2,
fmod, remainder and rounding divisions; integer divisions, remainders and shifts of negative numbers; sums of
bool masks (logical ors); losses
with their options (probability targets with label smoothing, weights and ignore_index; targets all
ignored; log targets; pos_weight with extreme logits); activations and clamps given NaN and inf.

NaN and inf must come out where eager's do (the NaN of an all-masked softmax row, of var over one element,
of nll_loss with every target ignored). Finite values: the tolerances of tests/test_optimizer_user_models.py,
scaled by the largest finite magnitude. Integers and bools: exact.

Not compared, as not what a user relies on: fp64 gradients where eager's ATen kernel itself rounds a
constant to fp32 (hardsigmoid's backward multiplies by fp32(1/6), binary_cross_entropy's backward clamps at
fp32(1e-12)) and torch's decomposition, which tfsn runs as Inductor does, keeps the fp64 value; a 16-bit
constant, such as F.normalize's eps of 1e-12, which eager rounds to fp16 (0, so a zero vector normalizes to
NaN) and a fused kernel keeps in fp32 (see the README); a 16-bit variance's gradient where eager rounds the
mean to 16 bits before centering (rows of 100 + noise: tfsn's is closer to the fp64 value than eager's).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from optimizer import backend  # noqa: E402
from optimizer.backend import make_backend  # noqa: E402
from optimizer.ops import MODULOS, ROUNDED_DIVISIONS  # noqa: E402
from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models import TOLERANCE  # noqa: E402
from tests.test_optimizer_user_models_more import no_graph_left_to_aten  # noqa: E402

INF, NAN = float("inf"), float("nan")
FP32, FP64, BF16, FP16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


def matches(actual: torch.Tensor, expected: torch.Tensor, what: str, exact: bool = False) -> None:
    """actual == expected: NaN and +-inf where eager has them, finite floats within their dtype's tolerance
    times the largest finite magnitude (or exactly), integers and bools exactly."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, eager's {expected.dtype}"
    if exact or not expected.is_floating_point():
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
        return
    rtol, atol = TOLERANCE[expected.dtype]
    finite = expected[torch.isfinite(expected)]
    scale = finite.abs().max().item() if finite.numel() else 1.0
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol * max(scale, 1e-3),
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


@dataclass(frozen=True)
class Idiom:
    """`fn` of `inputs(dtype)` in each of `dtypes`; through Triton in `triton_dtypes` too. `exact`: its
    values are exact in eager (whole numbers), so must be tfsn's: a float tolerance would pass 8388610
    for 8388609."""
    name: str
    fn: Callable[..., tuple]
    inputs: Callable[[torch.dtype], tuple]
    dtypes: tuple[torch.dtype, ...]
    triton_dtypes: tuple[torch.dtype, ...] = ()
    exact: bool = False


def forward_and_gradients(fn: Callable, inputs: tuple) -> list:
    """fn's outputs, then the gradients of its floating inputs for a fixed weighting of its floating outputs."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outputs = fn(*leaves)
    weighted = [o for o in outputs if o.requires_grad]
    if weighted:
        sum((o * torch.linspace(-1, 2, o.numel(), dtype=o.dtype).view(o.shape)).sum() for o in weighted).backward()
    return [*outputs, *(t.grad for t in leaves if t.is_floating_point())]


def check(idiom: Idiom, dtype: torch.dtype, codegen: str) -> None:
    inputs = idiom.inputs(dtype)
    expected = forward_and_gradients(idiom.fn, inputs)
    before = backend.STATS["kernels"]
    actual: list = []
    no_graph_left_to_aten(lambda: actual.extend(
        forward_and_gradients(torch.compile(idiom.fn, backend=make_backend(codegen=codegen)), inputs)))
    assert backend.STATS["kernels"] > before, "no kernel was generated"
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e is None:
            assert a is None, f"{idiom.name} value {i}: a gradient where eager has none"
        else:
            matches(a, e, f"{idiom.name} value {i}", idiom.exact)


def _rows(dtype: torch.dtype) -> tuple:
    """Rows all -inf, with +inf, with NaN, partly -inf, finite; and finite rows of random logits."""
    special = torch.tensor([[-INF, -INF, -INF, -INF, -INF], [1., INF, 2., 3., 0.], [1., NAN, 2., 3., 0.],
                            [-INF, 0.5, -INF, 2., 1.], [1., 2., 3., -1., 0.5], [INF, INF, 1., 0., 0.]])
    return special.to(dtype), torch.randn(6, 5, generator=torch.Generator().manual_seed(0)).to(dtype) * 3


def softmax_family(special: torch.Tensor, logits: torch.Tensor) -> tuple:
    """log-sum-exp, softmax and log_softmax over special rows; over masked logits, a causal-like mask that
    leaves a row all -inf (NaN in eager, and NaN gradients upstream of it)."""
    masked = logits.masked_fill(torch.ones(6, 5, dtype=torch.bool).tril(), -INF)
    return (torch.logsumexp(special, -1), torch.softmax(special, -1), torch.log_softmax(special, -1),
            torch.logsumexp(special, 0, keepdim=True), torch.softmax(masked, -1), torch.log_softmax(masked, -1),
            torch.logsumexp(logits.masked_fill(logits > 1, -INF), -1), F.softmin(logits, 0),
            torch.softmax(logits[:, :1], -1), torch.log_softmax(logits[:, :1], -1))


def variances(_: torch.Tensor, x: torch.Tensor) -> tuple:
    """var/std/var_mean/std_mean with correction 0, 1 and 2, over a dim of size 1 (NaN, or inf where
    n - correction < 0 divides a zero), of a constant row (std's gradient is NaN there) and over all dims."""
    one = x[:, :1]
    out = []
    for c in (0, 1, 2):
        out += [x.var(-1, correction=c), x.std(0, correction=c), *torch.var_mean(x, (0, 1), correction=c),
                one.var(-1, correction=c), one.std(-1, correction=c),
                *torch.std_mean(x[:1], 0, correction=c, keepdim=True)]
    return (*out, (x * 0 + 1).std(-1), x.var(unbiased=False), x.std(1, unbiased=True))


def _zero_rows(dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 7, generator=g), torch.randn(4, 7, generator=g)
    x[1], x[3, :3], y[0], y[2] = 0, 0, x[0], 0
    return x.to(dtype), y.to(dtype)


def norms(x: torch.Tensor, _: torch.Tensor) -> tuple:
    """vector_norm of every order users pick (their gradients at zero rows), F.normalize of zero vectors."""
    orders = (2, 1, INF, -INF, 0, 0.5, 3, -1)
    return (*(torch.linalg.vector_norm(x, ord=o, dim=-1) for o in orders), torch.linalg.vector_norm(x),
            torch.linalg.vector_norm(x, 3, dim=(0, 1)), x.norm(p=1, dim=1, keepdim=True),
            F.normalize(x, dim=-1), F.normalize(x, p=1, dim=0), F.normalize(x, p=INF, dim=1, eps=1e-6))


def distances(x: torch.Tensor, y: torch.Tensor) -> tuple:
    """cdist, pairwise_distance and cosine_similarity where points are equal or zero (their gradients there)."""
    return (*(torch.cdist(x, y, p=p) for p in (1.0, 2.0, INF, 0.5, 3.0)),
            torch.cdist(x[None], y[None], compute_mode="donot_use_mm_for_euclid_dist"),
            F.pairwise_distance(x[:4], y), F.pairwise_distance(x[:4], y, p=1, eps=0),
            F.cosine_similarity(x[:4], y, dim=-1), F.cosine_similarity(x[:4], y, dim=0, eps=1e-3),
            F.cosine_similarity(x[:1], y), F.pdist(x + 0.01 * torch.arange(7, dtype=x.dtype)))


def _edges(dtype: torch.dtype) -> tuple:
    """Signed zeros, tiny and huge values, infinities, NaN, halves; a second operand of the same kinds;
    positive values from 1e-30 to inf; values in and just outside [-1, 1]; probabilities and just outside."""
    edge = [0., -0., 1., -1., 0.5, -0.5, 1e-30, -1e-30, 2., -2., 1e30, -1e30, INF, -INF, NAN, 3.5, -3.5, 2.5, 7., -7.]
    other = [0., 0., -0., 2., -2., 0.5, 1e-30, 0., -3., 3., 1., -1e30, INF, 2., 1., -INF, 1.5, -1.5, 0., 3.]
    positive = [1e-30, 1e-6, 0.1, 0.5, 1., 1.5, 2., 10., 100., 0., INF, NAN, 1e-3, 3.5, 0.25, 5., 20., 50., 0.9, 1e30]
    unit = [-1., -0.999999, -0.9, -0.5, 0., 0.5, 0.9, 0.999999, 1., 1.5, -1.5, NAN, 0.1, -0.1, 0.3, 0.7, 0.99, -0.99,
            1e-8, -1e-8]
    prob = [0., 1e-30, 1e-7, 0.1, 0.5, 0.9, 1 - 1e-7, 1., 1.1, -0.1, NAN, 0.3, 0.7, 0.25, 0.75, 0.01, 0.99, 0.05, 0.95,
            0.5]
    return tuple(torch.tensor(v, dtype=torch.float64).to(dtype) for v in (edge, other, positive, unit, prob))


def special_functions(e: torch.Tensor, _: torch.Tensor, p: torch.Tensor, u: torch.Tensor, q: torch.Tensor) -> tuple:
    """torch.special near poles and edges: lgamma and digamma at 0 and -n - 0.5, erfinv at +-1, erfcx of
    large arguments, Bessel functions, xlogy and xlog1py with zero x, sinc at 0, logit with eps, log_ndtr,
    ndtri at 0 and 1, entr of negative values."""
    S = torch.special
    return (torch.lgamma(p), torch.digamma(p), torch.polygamma(1, p), torch.lgamma(-p - 0.5), torch.erfinv(u),
            S.erfcx(p), S.erfcx(-p), torch.erfc(u * 5), torch.i0(p.clamp(max=50)), S.i0e(p), S.i1(p.clamp(max=50)),
            S.i1e(-p), torch.xlogy(q, e), S.xlog1py(q, e), torch.xlogy(q, q), torch.xlogy(0.0 * q, e),
            torch.sinc(e), torch.sinc(e * 1e-3), torch.logit(q), torch.logit(q, eps=1e-6), torch.logit(q, eps=0.2),
            S.log_ndtr(e), S.ndtri(q), S.entr(e), S.entr(q), S.ndtr(e), S.expit(e), torch.log10(e))


def pointwise_edges(a: torch.Tensor, b: torch.Tensor, *_: torch.Tensor) -> tuple:
    """atan2 at (0, 0), hypot and copysign of infinities, logaddexp of infinities, fmod and remainder by
    negative and zero divisors, divisions rounding to zero and down, nan_to_num's defaults and custom values,
    clamp with min > max, where with a NaN in the branch not taken, heaviside, sgn, signbit, frac, round
    to decimals, trunc. (The rounding ops' gradients are zero; heaviside and floor_divide have none.)"""
    frozen_a, frozen_b = a.detach(), b.detach()
    return (torch.atan2(a, b), torch.hypot(a, b), torch.copysign(a, b), torch.copysign(a, -1.0),
            torch.logaddexp(a, b), torch.logaddexp2(a, b), torch.fmod(a, b), torch.remainder(a, b),
            torch.fmod(a, -2.5), torch.remainder(a, -2.5), a % 3, torch.floor_divide(frozen_a, frozen_b),
            torch.div(a, b, rounding_mode="trunc"), torch.div(a, b, rounding_mode="floor"),
            torch.div(a, -2.0, rounding_mode="floor"), torch.nan_to_num(a),
            torch.nan_to_num(a, nan=0.0, posinf=1e4, neginf=-1e4), torch.nan_to_num(a, posinf=7.0),
            torch.clamp(a, min=b, max=b - 1), torch.clamp(a, min=1.0, max=-1.0), torch.where(a > 0, a.log(), b),
            torch.where(torch.isnan(a), torch.zeros_like(a), a * b), torch.where(b != 0, a / b, 0.0),
            torch.heaviside(frozen_a, frozen_b), torch.sgn(a), torch.signbit(a), torch.frac(a),
            torch.round(a, decimals=2), torch.round(a * 0.37, decimals=-1), torch.trunc(a))


def _integers(dtype: torch.dtype) -> tuple:
    """Negative and positive dividends and divisors (none zero), the int32 extremes; uint8 their magnitudes."""
    a = torch.tensor([-7, -6, -5, -1, 0, 1, 5, 6, 7, 13, -13, 2 ** 31 - 1, -2 ** 31, 100, -100, 3])
    b = torch.tensor([2, -2, 3, -3, 1, -1, 4, -4, 5, 7, -7, 3, 3, -6, 6, -5])
    if dtype == torch.uint8:
        a, b = a.abs(), b.abs()
    return a.to(dtype), b.to(dtype), torch.linspace(-1, 1, 16)


def integer_arithmetic(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> tuple:
    """floor_divide, div with rounding modes, fmod and remainder (C's and Python's signs) of integers, by
    integers and floats; bitwise ops and shifts; the results scaling a float, whose gradient they carry."""
    return (torch.floor_divide(a, b), torch.div(a, b, rounding_mode="trunc"), torch.div(a, b, rounding_mode="floor"),
            torch.div(a, b), a // 3, torch.fmod(a, b), torch.remainder(a, b), torch.fmod(a, 3), a % 4,
            torch.fmod(a, 2.5), torch.remainder(a, -2.5), a & b, a | b, a ^ b, ~a, a << 2, a >> 1,
            torch.bitwise_left_shift(a, b.abs() % 4), torch.bitwise_right_shift(a, b.abs() % 4), a & 6,
            x * (a % 3), x * torch.fmod(a, b), x * ((a & 1) == 0), torch.clamp(a, -3, 6), torch.sign(a), x + a)


def _logits(dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(6, 5, generator=g).to(dtype) * 3,
            torch.softmax(torch.randn(6, 5, generator=g), -1).to(dtype))


LABELS = torch.tensor([0, 4, 2, -100, 1, 2])
SIGNS = torch.tensor([1., -1., 1., 1., -1., 0.])


def class_losses(x: torch.Tensor, p: torch.Tensor) -> tuple:
    """Classification losses with their options, reduced to a mean and not reduced: cross_entropy with class
    indices, label smoothing, class weights (one zero) and ignore_index, and with probability targets;
    nll_loss with every target ignored (0 / 0: NaN for the mean) and of a zero-weight class; kl_div with and
    without log targets and with zero targets."""
    w = torch.tensor([1., 0.5, 2., 0., 1.5], dtype=x.dtype)
    out = []
    for r in ("mean", "none"):
        out += [F.cross_entropy(x, LABELS, weight=w, ignore_index=-100, label_smoothing=0.1, reduction=r),
                F.cross_entropy(x, LABELS.clamp(min=0), ignore_index=2, reduction=r),
                F.cross_entropy(x, p, weight=w, label_smoothing=0.2, reduction=r),
                F.nll_loss(F.log_softmax(x, -1), torch.full((6,), -100), reduction=r),
                F.nll_loss(F.log_softmax(x, -1), torch.full((6,), 3), weight=w, reduction=r),
                F.kl_div(F.log_softmax(x, -1), p, reduction=r),
                F.kl_div(F.log_softmax(x, -1), p.log(), reduction=r, log_target=True),
                F.kl_div(F.log_softmax(x, -1), p * (p > 0.2), reduction=r)]
    return tuple(out)


def other_losses(x: torch.Tensor, p: torch.Tensor) -> tuple:
    """Poisson NLL with full=True (Stirling's term, zero targets); Huber with a delta; smooth_l1 with beta=0
    (an L1) and at zero residuals; margin ranking with a zero label; triplet margin with swap and p=1;
    multilabel soft margin with weights; BCE with logits, pos_weight and logits of +-300 and more, reduced to
    a mean and not reduced. (gaussian_nll_loss tests its variance for negatives on the host, a graph break;
    tests/user_models_fourth.py's MoreLosses has it.)"""
    w = torch.tensor([1., 0.5, 2., 0., 1.5], dtype=x.dtype)
    hard = (p > 0.2).to(x.dtype)
    out = []
    for r in ("mean", "none"):
        out += [F.poisson_nll_loss(x, p * 4, log_input=True, full=True, reduction=r),
                F.poisson_nll_loss(x.abs(), (p * 4).round(), log_input=False, full=True, reduction=r),
                F.huber_loss(x, p, delta=0.7, reduction=r), F.smooth_l1_loss(x, p, beta=0.0, reduction=r),
                F.smooth_l1_loss(x, x.detach(), beta=0.5, reduction=r),
                F.margin_ranking_loss(x[:, 0], x[:, 1], SIGNS.to(x.dtype), margin=0.3, reduction=r),
                F.triplet_margin_loss(x, p, x.flip(0), swap=True, reduction=r),
                F.triplet_margin_loss(x, x.detach(), p, p=1, margin=0.5, reduction=r),
                F.multilabel_soft_margin_loss(x, hard, weight=w, reduction=r),
                F.binary_cross_entropy_with_logits(x * 100, hard, pos_weight=w * 3, reduction=r),
                F.binary_cross_entropy_with_logits(x * 1e4, p, weight=w, reduction=r)]
    return tuple(out)


# multilabel_margin_loss's targets: class indices up to the first -1, the rest ignored; a row that starts with
# -1 (no targets), one with classes after its -1, one with every class a target, one with a class twice
MULTILABEL_TARGETS = torch.tensor([[3, 0, -1, 1, 1], [-1, 2, 0, 0, 0], [4, -1, 0, 2, 1], [0, 1, 2, 3, 4],
                                   [2, 2, 1, -1, 4], [1, 3, 0, 4, -1]])


def multilabel_margin(x: torch.Tensor, p: torch.Tensor) -> tuple:
    """multilabel_margin_loss reduced each way, over a batch and over one sample (a 1-d input, whose per-sample
    loss is 0-d). torch's decomposition summed the slots after the first -1 as more targets of class 0."""
    out = [F.multilabel_margin_loss(x, MULTILABEL_TARGETS, reduction=r) for r in ("mean", "sum", "none")]
    return (*out, F.multilabel_margin_loss(p[2], MULTILABEL_TARGETS[2], reduction="none"),
            F.multilabel_margin_loss(p[2] * 4, MULTILABEL_TARGETS[2]))


def _specials_row(dtype: torch.dtype) -> tuple:
    return (torch.tensor([[NAN, -INF, INF, -1., -0., 0., 0.5, 3., 6., 7., 1e-3, -1e-3, 2.9]]).to(dtype),)


def activations_given_nan(x: torch.Tensor) -> tuple:
    """Piecewise activations at NaN, +-inf and their kinks, which a comparison-based kernel can drop NaN at;
    clamps whose bound is NaN (torch: NaN everywhere), a tensor bound or a bound below the other."""
    return (F.relu(x), F.relu6(x), F.hardtanh(x, -2., 2.), F.leaky_relu(x, 0.1), F.threshold(x, 0.5, -3.),
            F.hardswish(x), F.softshrink(x, 0.5), F.hardshrink(x, 0.5), F.elu(x),
            F.prelu(x, torch.tensor([0.25], dtype=x.dtype)), F.glu(torch.cat([x, x.flip(-1)], -1), -1),
            F.softsign(x), F.tanhshrink(x), x.clamp(min=NAN), x.clamp(max=NAN), x.clamp_min(NAN) + x.clamp_max(1.0),
            x.clamp(min=torch.full_like(x, NAN)), x.clamp(max=x.flip(-1)), x.clamp(min=x.flip(-1), max=x.roll(3, -1)),
            torch.maximum(x, x.flip(-1)), torch.fmax(x, x.flip(-1)), torch.where(torch.isfinite(x), x, 0.0) * 2,
            torch.where(x > 0, x.sqrt(), -x))


def _whole_and_halves(dtype: torch.dtype) -> tuple:
    """Whole numbers past 2 ** 23 (every fp32 there is whole; x + 0.5 rounds up to the next), the largest fp32
    below 0.5 (0.49999997 + 0.5 rounds to 1.0 in fp32), ties, and the fp64 counterparts."""
    values = [8388609., -8388609., 16777215., 12582913., 0.49999997, -0.49999997, 0.5 - 2 ** -54, 2 ** 52 + 1,
              -(2 ** 52 + 1), 0.5, 1.5, 2.5, -2.5, -0.4, 0.0, INF, NAN, 1e10]
    return (torch.tensor(values, dtype=torch.float64).to(dtype),)


def rounding(x: torch.Tensor) -> tuple:
    """torch.round, half to even, on numbers already whole and on the largest below a half: fake quantization
    (round(x / scale) * scale) and integer-valued targets meet both."""
    return (torch.round(x), torch.round(x * 1.0) + 0.0, torch.round(x, decimals=0), torch.round(x * 4) / 4)


def _masks(dtype: torch.dtype) -> tuple:
    """Lengths and SpecAugment window starts of 3 rows of 7 steps, overlapping the padding in the last row."""
    g = torch.Generator().manual_seed(0)
    return torch.tensor([7, 2, 4]), torch.tensor([1, 0, 3]), torch.randn(3, 7, generator=g).to(dtype)


def mask_sums(lengths: torch.Tensor, starts: torch.Tensor, x: torch.Tensor) -> tuple:
    """A padding mask and a window mask added, as code combines masks: torch's sum of bools is their logical or
    (True + True is True), so where both hold it converts to 1.0 and counts once."""
    t = torch.arange(x.shape[1])
    padded = t[None] >= lengths[:, None]
    window = (t[None] >= starts[:, None]) & (t[None] < starts[:, None] + 2)
    blocked = padded + window
    return (blocked, x * blocked, blocked.float().sum(1), x.masked_fill(blocked, 0.0),
            torch.add(padded, window, alpha=True).to(x.dtype) * x, (blocked + padded + window).long() * 3)


IDIOMS = [
    Idiom("softmax_family", softmax_family, _rows, (FP32, FP64, BF16), (FP32,)),
    Idiom("variances", variances, _rows, (FP32, FP64, BF16), (FP32,)),
    Idiom("norms", norms, _zero_rows, (FP32, FP64, BF16), (FP32,)),
    Idiom("distances", distances, _zero_rows, (FP32, FP64)),
    Idiom("special_functions", special_functions, _edges, (FP32, FP64)),
    Idiom("pointwise_edges", pointwise_edges, _edges, (FP32, FP64), (FP32,)),
    Idiom("integer_arithmetic", integer_arithmetic, _integers, (torch.int64, torch.int32, torch.int8, torch.uint8),
          (torch.int64,)),
    Idiom("class_losses", class_losses, _logits, (FP32, FP64), (FP32,)),
    Idiom("other_losses", other_losses, _logits, (FP32, FP64)),
    Idiom("multilabel_margin", multilabel_margin, _logits, (FP32, FP64), (FP32,)),
    Idiom("activations_given_nan", activations_given_nan, _specials_row, (FP32, FP64, BF16, FP16), (FP32, FP64)),
    Idiom("rounding", rounding, _whole_and_halves, (FP32, FP64), (FP32, FP64), exact=True),
    Idiom("mask_sums", mask_sums, _masks, (FP32, FP64), (FP32,)),
]
TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
RUNS = [pytest.param(i, d, "c", id=f"{i.name}-{str(d)[6:]}-c") for i in IDIOMS for d in i.dtypes] + [
    pytest.param(i, d, "triton", id=f"{i.name}-{str(d)[6:]}-triton", marks=TRITON)
    for i in IDIOMS for d in i.triton_dtypes]


@pytest.mark.parametrize(("idiom", "dtype", "codegen"), RUNS)
def test_numeric_idiom_matches_eager(idiom: Idiom, dtype: torch.dtype, codegen: str) -> None:
    check(idiom, dtype, codegen)


def _signed_grid(dtype: torch.dtype, extremes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair of signed zeros, subnormals, ones, halves, the dtype's huge values (whose squares overflow),
    infinities and NaN (no subnormals and huge values unless `extremes`): the two operands of a pointwise
    function of two floats, as two flat tensors."""
    tiny, huge = {FP16: (1e-7, 6e4), FP64: (1e-310, 1e308)}.get(dtype, (1e-40, 3e38))
    values = [0., -0., 1., -1., 0.5, -2.5, 3., INF, -INF, NAN] + ([tiny, -tiny, huge, -huge] if extremes else [])
    grid = torch.tensor(values, dtype=torch.float64).to(dtype)
    return grid.repeat_interleave(len(grid)), grid.repeat(len(grid))


def atan2_and_hypot(y: torch.Tensor, x: torch.Tensor) -> tuple:
    return torch.atan2(y, x), torch.hypot(y, x), torch.atan2(-y, x.abs()), torch.hypot(y, -x)


@pytest.mark.parametrize("codegen", ["c", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("dtype", [FP32, FP64, BF16, FP16], ids=str)
def test_atan2_and_hypot_are_generated_not_left_to_aten(monkeypatch, dtype, codegen):
    """atan2 and hypot ran as ATen calls between kernels. They are pointwise ops now (libm's in C; in Triton
    Cephes' atan reduced from min/max of the magnitudes, and max * sqrt(1 + ratio ** 2)): values as eager's at
    every pair of signed zeros, subnormals, huge values (hypot's squares overflow, its value does not),
    infinities and NaN, with the sign of each zero; gradients too. (Not the gradients of bf16/fp16 subnormals
    and huge values: eager's backward rounds x * x + y * y to the half, where it underflows or overflows, and a
    kernel holds it in fp32, as it holds every value between two ops.)"""
    from tests.test_optimizer_correctness import left_to_aten, record_compiled
    compiled = record_compiled(monkeypatch)
    compiled_fn = torch.compile(atan2_and_hypot, backend=make_backend(codegen=codegen))
    inputs = _signed_grid(dtype)
    expected, actual = atan2_and_hypot(*inputs), compiled_fn(*inputs)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, rtol=TOLERANCE[dtype][0], atol=0, equal_nan=True,
                                   msg=lambda m: f"value {i}: {m}")
        zeros = e == 0
        assert torch.equal(a[zeros].signbit(), e[zeros].signbit()), f"value {i}: a zero's sign differs from eager's"
    inputs = _signed_grid(dtype, extremes=dtype in (FP32, FP64))
    for i, (a, e) in enumerate(zip(forward_and_gradients(compiled_fn, inputs)[4:],
                                   forward_and_gradients(atan2_and_hypot, inputs)[4:])):
        matches(a, e, f"gradient {i}")
    assert len(compiled) == 3, "the values' graph, then forward and backward, should each be one compiled graph"
    left = left_to_aten(compiled, {"aten.atan2.default", "aten.hypot.default"})
    assert not left, f"left to ATen: {left}"


def _exact_modulos(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """C's fmod and Python's remainder of each pair, exactly (numpy's fmod, in fp32 for the halves, whose
    values it holds exactly; remainder's move by b rounded once in the dtype, as ATen's)."""
    import numpy as np
    work = np.float64 if a.dtype == FP64 else np.float32
    x, y = (t.to(FP64 if a.dtype == FP64 else FP32).numpy() for t in (a, b))
    with np.errstate(all="ignore"):
        r = np.fmod(x, y)
        moved = np.where((r != 0) & ((r < 0) != (y < 0)), r + y, r)
    return tuple(torch.from_numpy(np.asarray(v, dtype=work)).to(a.dtype) for v in (r, moved))


def modulos(a: torch.Tensor, b: torch.Tensor) -> tuple:
    return torch.fmod(a, b), torch.remainder(a, b), a % 0.1, torch.fmod(a, -2.5)


@pytest.mark.parametrize("codegen", ["c", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("dtype", [FP32, FP64, BF16, FP16], ids=str)
def test_fmod_and_remainder_are_generated_and_exact(monkeypatch, dtype, codegen):
    """fmod and remainder ran as ATen calls between kernels (an angle wrapped by `% (2 * pi)`, a phase, a
    position modulo a period). They are pointwise ops now, exact as C's fmod: libm's in C; in Triton a long
    division by steps of 22 (fp32) or 51 (fp64) bits, each exact by one fma, since Triton's % is LLVM's
    frem, which a GPU computes as a - trunc(a / b) * b, wrong once the quotient passes 2^24. Checked against
    numpy's fmod at every pair of signed zeros, subnormals, huge values, infinities and NaN and at random
    pairs of magnitudes 2^(+-60) apart (quotients past 2^24, and past the dtype's range, where eager's
    vectorized CPU loop gives NaN: its scalar tail and CUDA give the exact value), with the sign of each
    zero; the gradients as eager's."""
    from tests.test_optimizer_correctness import left_to_aten, record_compiled
    compiled = record_compiled(monkeypatch)
    g = torch.Generator().manual_seed(3)
    spread = torch.randn(2, 400, generator=g, dtype=FP64) * torch.exp2(torch.randn(2, 400, generator=g) * 20)
    grid = _signed_grid(dtype, extremes=True)
    a, b = (torch.cat([edge, rand.to(dtype)]) for edge, rand in zip(grid, spread))
    compiled_fn = torch.compile(modulos, backend=make_backend(codegen=codegen))
    actual = compiled_fn(a, b)
    expected = (*_exact_modulos(a, b), _exact_modulos(a, torch.full_like(a, 0.1))[1],
                _exact_modulos(a, torch.full_like(a, -2.5))[0])
    for i, (got, want) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"value {i}: {m}")
        zeros = want == 0
        assert torch.equal(got[zeros].signbit(), want[zeros].signbit()), f"value {i}: a zero's sign differs"
    inputs = _signed_grid(dtype)
    for i, (got, want) in enumerate(zip(forward_and_gradients(compiled_fn, inputs)[4:],
                                        forward_and_gradients(modulos, inputs)[4:])):
        matches(got, want, f"gradient {i}")
    left = left_to_aten(compiled, set(MODULOS))
    assert not left, f"left to ATen: {left}"


@pytest.mark.parametrize("codegen", ["c", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8], ids=str)
def test_integer_modulos_by_a_positive_int_are_generated(monkeypatch, dtype, codegen):
    """`positions % period` and `torch.fmod(ids, n)` of integers by a positive Python int are generated (C's
    and Python's signs, the dtype's extremes too); by a tensor, a zero, or a negative int they stay ATen's:
    eager raises on a zero divisor where a kernel would trap, as INT_MIN % -1 traps."""
    from tests.test_optimizer_correctness import left_to_aten, record_compiled
    compiled = record_compiled(monkeypatch)
    info = torch.iinfo(dtype)
    a = torch.tensor([info.min, info.min + 1, -7, -6, -1, 0, 1, 5, 6, 7, info.max - 1, info.max]).clamp(
        info.min, info.max).to(dtype)

    def fn(a, b):
        return a % 3, torch.fmod(a, 5), torch.remainder(a, 1), a % b, torch.fmod(a, -3)
    divisor = torch.full_like(a, 4)
    for got, want in zip(torch.compile(fn, backend=make_backend(codegen=codegen))(a, divisor), fn(a, divisor)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    left = left_to_aten(compiled, set(MODULOS))
    assert sorted(left) == ["aten.fmod.Scalar", "aten.remainder.Tensor"], f"left to ATen: {left}"


def rounded_divisions(a: torch.Tensor, b: torch.Tensor) -> tuple:
    return (torch.div(a, b, rounding_mode="floor"), torch.div(a, b, rounding_mode="trunc"), a // 0.1,
            torch.div(a, -2.5, rounding_mode="trunc"), torch.floor_divide(a, 3), a // -0.0)


@pytest.mark.parametrize("codegen", ["c", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("dtype", [FP32, FP64, BF16, FP16], ids=str)
def test_rounded_divisions_are_generated_and_exact(monkeypatch, dtype, codegen):
    """`x // step` and torch.div(..., rounding_mode="trunc" / "floor") ran as ATen calls between kernels (a
    bin index, a period count, a quantizer's level). They are pointwise ops now, bit for bit eager's: trunc of
    the correctly rounded quotient (Triton's fp32 / is 2 ulp on a GPU, which can cross a whole number), floor
    division by ATen's own formula through the exact fmod. Checked at every pair of signed zeros, subnormals,
    huge values, infinities and NaN and at random pairs 2^(+-60) apart, with each zero's sign (-0.0 divisors
    too). A half by a tensor stays ATen's: eager's vectorized loop rounds each of its steps to the half."""
    from tests.test_optimizer_correctness import left_to_aten, record_compiled
    compiled = record_compiled(monkeypatch)
    g = torch.Generator().manual_seed(5)
    spread = torch.randn(2, 400, generator=g, dtype=FP64) * torch.exp2(torch.randn(2, 400, generator=g) * 20)
    grid = _signed_grid(dtype, extremes=True)
    a, b = (torch.cat([edge, rand.to(dtype)]) for edge, rand in zip(grid, spread))
    actual = torch.compile(rounded_divisions, backend=make_backend(codegen=codegen))(a, b)
    for i, (got, want) in enumerate(zip(actual, rounded_divisions(a, b))):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"value {i}: {m}")
        zeros = want == 0
        assert torch.equal(got[zeros].signbit(), want[zeros].signbit()), f"value {i}: a zero's sign differs"
    left = left_to_aten(compiled, set(ROUNDED_DIVISIONS))
    assert sorted(left) == (["aten.div.Tensor_mode"] * 2 if dtype in (BF16, FP16) else []), f"left to ATen: {left}"


def numbers_divided_by_tensors(a: torch.Tensor) -> tuple:
    return (5.0 // a, 0.1 // a, -0.0 // a, 7 // a, torch.div(torch.tensor(3.0), a, rounding_mode="trunc"),
            torch.div(-7.5, a, rounding_mode="trunc"), torch.div(1e-40, a, rounding_mode="floor"), (a * 3 - 1) // a)


@pytest.mark.parametrize("codegen", ["c", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("dtype", [FP32, FP64], ids=str)
def test_rounded_divisions_of_a_number_by_a_tensor(monkeypatch, dtype, codegen):
    """`steps // x` with a Python number (or a 0-d tensor) as the dividend (a period count of a Python step,
    FSQ's levels): the Triton kernel passed the bare literal to the prelude's tfsn_div_floor, which failed on
    its missing .shape (in the interpreter and when compiled for a GPU). Bit for bit eager's, zero signs too, at
    the signed grid's edge values, and generated (found by this session's review and its generative-model suite
    each)."""
    from tests.test_optimizer_correctness import left_to_aten, record_compiled
    compiled = record_compiled(monkeypatch)
    a = _signed_grid(dtype, extremes=True)[1]
    actual = torch.compile(numbers_divided_by_tensors, backend=make_backend(codegen=codegen))(a)
    for i, (got, want) in enumerate(zip(actual, numbers_divided_by_tensors(a))):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"value {i}: {m}")
        zeros = want == 0
        assert torch.equal(got[zeros].signbit(), want[zeros].signbit()), f"value {i}: a zero's sign differs"
    left = left_to_aten(compiled, set(ROUNDED_DIVISIONS))
    assert not left, f"left to ATen: {left}"


def fp32_ops_of_a_half_product(x: torch.Tensor, h1: torch.Tensor, h2: torch.Tensor) -> tuple:
    h = h1 * h2
    return x // h, torch.div(x, h, rounding_mode="trunc"), x % h, x + h, torch.where(x > 10, h, x)


@pytest.mark.parametrize("codegen", ["c", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("half", [BF16, FP16], ids=str)
def test_a_half_promoted_by_an_fp32_op_is_the_half(half, codegen):
    """x32 // (h1 * h2): eager's divisor is the 16-bit product, converted to fp32 by the promotion; the kernel
    held it unrounded in fp32 (only a first operand was rounded, and only for conversions and ROUNDINGS), so
    the quotient came out a whole step off (5 where eager has 4), x % h and x + h a 16-bit unit off. Every
    16-bit operand of an op of another dtype is rounded to it, as an explicit h.float() is."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(999, generator=g) * 30
    h1, h2 = ((torch.rand(999, generator=g) * 4 + 1).to(half) for _ in range(2))
    actual = torch.compile(fp32_ops_of_a_half_product, backend=make_backend(codegen=codegen))(x, h1, h2)
    for i, (got, want) in enumerate(zip(actual, fp32_ops_of_a_half_product(x, h1, h2))):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"value {i}: {m}")


WIDE_INT = 2 ** 60 + 2 ** 36 + 1     # fp32 rounds it up to 2^60 + 2^37; by way of fp64 (2^60 + 2^36, a tie), to 2^60


def ops_by_a_wide_int(x: torch.Tensor) -> tuple:
    return x // WIDE_INT, torch.div(x, WIDE_INT, rounding_mode="trunc"), x / WIDE_INT, x * WIDE_INT, x + WIDE_INT


@pytest.mark.parametrize("codegen", ["c", pytest.param("triton", marks=TRITON)])
def test_fp32_ops_by_an_int_wider_than_fp64s_mantissa(codegen):
    """x // n with a Python int n of more than 53 bits: eager converts n to fp32 once; the Triton kernel's
    literal went through a Python float (fp64) first, and the two roundings landed an fp32 unit off, so the
    quotient was a whole step off (2.0 where eager has 1.0) and x * n, x / n an ulp off."""
    x = torch.tensor([2.0 ** 60 + 2.0 ** 37 * 3, 2.0 ** 61, 1.0, 5e18, 2.0 ** 60 * 3, -2.0 ** 62, 0.0])
    actual = torch.compile(ops_by_a_wide_int, backend=make_backend(codegen=codegen))(x)
    for i, (got, want) in enumerate(zip(actual, ops_by_a_wide_int(x))):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"value {i}: {m}")


@pytest.mark.parametrize("codegen", ["c", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8], ids=str)
def test_integer_rounded_divisions_by_a_positive_int_are_generated(monkeypatch, dtype, codegen):
    """`positions // block` and torch.div(ids, n, rounding_mode="trunc") of integers by a positive Python int
    are generated (negative dividends, the dtype's extremes); by a tensor or a negative int they stay ATen's,
    and so does an int the dtype does not hold: eager wraps it into the dtype first (int8 // 200 and int8 % 200
    divide by -56; the kernel divided by 200, and % 256 would have trapped where eager raises)."""
    from tests.test_optimizer_correctness import left_to_aten, record_compiled
    compiled = record_compiled(monkeypatch)
    info = torch.iinfo(dtype)
    a = torch.tensor([info.min, info.min + 1, -7, -6, -1, 0, 1, 5, 6, 7, 100, info.max - 1, info.max]).clamp(
        info.min, info.max).to(dtype)

    def fn(a, b):
        return (a // 3, torch.div(a, 5, rounding_mode="trunc"), torch.div(a, 1, rounding_mode="floor"), a // b,
                torch.div(a, -3, rounding_mode="trunc"), a // 200, a % 200)
    divisor = torch.full_like(a, 4)
    for got, want in zip(torch.compile(fn, backend=make_backend(codegen=codegen))(a, divisor), fn(a, divisor)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    wrapped = ["aten.div.Tensor_mode", "aten.remainder.Scalar"] if dtype == torch.int8 else []
    left = left_to_aten(compiled, set(ROUNDED_DIVISIONS | MODULOS))
    assert sorted(left) == sorted(["aten.div.Tensor_mode"] * 2 + wrapped), f"left to ATen: {left}"


def nll_gradients(x: torch.Tensor, target: torch.Tensor) -> tuple:
    """cross_entropy and nll_loss in the forms whose backward scatters at the targets: mean, sum with an
    ignore_index, unreduced with class weights, label smoothing, a 1-d input (no batch dim), and the 2-d
    (per pixel) loss of a segmentation map."""
    w = torch.tensor([1., 0.5, 2., 0., 1.5, 1., 3.], dtype=x.dtype)
    pixels = x[:4].reshape(2, 2, 7).transpose(1, 2).reshape(2, 7, 2, 1)            # N, C=7, H=2, W=1
    return (F.cross_entropy(x, target), F.cross_entropy(x, target, reduction="sum", ignore_index=2),
            F.cross_entropy(x, target, weight=w, reduction="none"),
            F.cross_entropy(x, target, weight=w, ignore_index=1, label_smoothing=0.1),
            F.nll_loss(F.log_softmax(x[0], -1), target[0]),
            F.cross_entropy(pixels, target[:4].reshape(2, 2, 1), weight=w, ignore_index=3))


@pytest.mark.parametrize("codegen", ["c", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("dtype", [FP32, FP64, BF16], ids=str)
def test_cross_entropy_backward_is_generated_not_scattered(monkeypatch, dtype, codegen):
    """Cross-entropy's backward was a zeros kernel and an ATen scatter of -1 at the targets over the whole
    [rows, classes] gradient (a language model's logits: its largest tensor), read again by the softmax's
    backward. It is a where over the class positions now, fused into that backward: gradients as eager's in
    every form of nll_loss, no scatter left to ATen (fails before: one per loss)."""
    from tests.test_optimizer_correctness import left_to_aten, record_compiled
    compiled = record_compiled(monkeypatch)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(9, 7, generator=g) * 2).to(dtype)
    target = torch.tensor([0, 6, 2, 3, 1, 2, 5, 1, 4])
    actual = forward_and_gradients(torch.compile(nll_gradients, backend=make_backend(codegen=codegen)), (x, target))
    expected = forward_and_gradients(nll_gradients, (x, target))
    for i, (a, e) in enumerate(zip(actual, expected)):
        matches(a, e, f"value {i}")
    left = left_to_aten(compiled, {"aten.scatter.value", "aten.scatter.src"})
    assert not left, f"left to ATen: {left}"
