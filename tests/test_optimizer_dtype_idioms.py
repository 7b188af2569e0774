"""Dtype idioms of real training code, combined inside fused kernels, compiled by tfsn on the C target and
through Triton's kernels against eager PyTorch: forward values, gradients and buffers.

Single ops and their dtypes are fuzzed in tests/test_optimizer_ops.py; these are the combinations a
training step makes of them: uint8 images normalized by (3, 1, 1) buffers, int64 labels in label
smoothing, an int64 step counter and an fp64 EMA buffer updated in forward, a tensor loss scale with an
isfinite test of the gradients (GradScaler's), HF's position ids from a cumsum of an int mask, narrow
integers that wrap before they meet floats, argmax over ties and NaN. Float tolerances: those of
tests/test_optimizer_user_models.py (fp32 sums in another order). Integers and bools: exact.
"""
from __future__ import annotations

import copy
import os
from typing import Callable

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from optimizer import backend  # noqa: E402
from optimizer.backend import make_backend  # noqa: E402
from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models import close  # noqa: E402

CODEGENS = ["c", pytest.param("triton", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("triton"), reason="triton is not installed"))]


def same(actual, expected, what: str) -> None:
    """Eager's values: floats within their dtype's tolerance (an fp64 buffer fed by fp32 activations, within
    fp32's), integers and bools exactly."""
    if isinstance(expected, (tuple, list)):
        for i, (a, e) in enumerate(zip(actual, expected)):
            same(a, e, f"{what}[{i}]")
    elif expected.is_floating_point():
        close(actual, expected, what, torch.float32 if expected.dtype == torch.float64 else None)
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def compiled(fn: Callable, codegen: str) -> Callable:
    """`fn` under torch.compile with tfsn; the caller checks it generated kernels and no graph ran as ATen."""
    return torch.compile(fn, backend=make_backend(codegen=codegen))


def generated(run: Callable) -> None:
    """Run `run`; fail unless tfsn generated kernels and no graph fell back to ATen."""
    kernels, aten = backend.STATS["kernels"], backend.STATS["aten_graphs"]
    run()
    assert backend.STATS["kernels"] > kernels, "no kernel was generated"
    assert backend.STATS["aten_graphs"] == aten, "a graph ran as ATen: see the log for why"


class ImageNet(nn.Module):
    """A classifier normalizing uint8 images itself, counting its steps in an int64 buffer and keeping
    an fp64 EMA of its mean logits, updated in forward as users do."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(5, dtype=torch.float64))
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = (img.float() / 255 - self.mean) / self.std
        out = self.fc(self.bn(self.conv(x)).relu().mean((2, 3)))
        self.steps += 1
        self.ema.mul_(0.9).add_(out.detach().mean(0), alpha=0.1)
        return out


def scaled_step(model: nn.Module, img: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> tuple:
    """One GradScaler-like step: label-smoothed loss from one_hot of int64 labels, backward of the loss
    times a tensor scale, the gradients' finiteness and unscaled norm."""
    smooth = F.one_hot(labels, 5) * 0.9 + 0.1 / 5
    loss = -(smooth * model(img).log_softmax(-1)).sum(-1).mean()
    (loss * scale).backward()
    grads = [p.grad for p in model.parameters()]
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
    return loss, finite, torch.stack([g.norm() for g in grads]).norm() / scale


@pytest.mark.parametrize("codegen", CODEGENS)
def test_uint8_images_smoothed_labels_and_a_scaled_step_match_eager(codegen):
    torch.manual_seed(0)
    eager = ImageNet()
    mine = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(1)
    img, labels = torch.randint(0, 256, (2, 3, 6, 6), dtype=torch.uint8, generator=g), torch.tensor([1, 4])
    expected = scaled_step(eager, img, labels, torch.tensor(1024.0))
    got = []
    generated(lambda: got.extend(compiled(scaled_step, codegen)(mine, img, labels, torch.tensor(1024.0))))
    same(got, list(expected), "loss, finite, norm")
    for (name, p), q in zip(mine.named_parameters(), eager.parameters()):
        same(p.grad, q.grad, f"grad of {name}")
    for (name, b), c in zip(mine.named_buffers(), eager.buffers()):
        same(b, c, name)


def position_ids(input_ids: torch.Tensor, table: torch.Tensor, padding_idx: int = 1) -> torch.Tensor:
    """HF's create_position_ids_from_input_ids (RoBERTa), then the lookup: a cumsum of an int mask."""
    mask = input_ids.ne(padding_idx).int()
    positions = (torch.cumsum(mask, dim=1).type_as(mask)) * mask
    return table[positions.long() + padding_idx]


def wrapped_integers(u8: torch.Tensor, i8: torch.Tensor, i32: torch.Tensor, x: torch.Tensor) -> tuple:
    """Narrow integers that wrap (uint8 + 20, int8 * 2, int32 + 1) and floor-divide before they meet floats."""
    return (((u8 + 20) > 100) * x + (u8 - 250) * x, ((i8 * 2) + 100).float() * x,
            (i32 + 1).double().float() * x, torch.div(i8 * 3, 7, rounding_mode="floor") * x + (i8 % -3))


def argmax_and_counts(t: torch.Tensor) -> tuple:
    """argmax/argmin over ties and NaN (the first of equal values; NaN wins), and counts of bools."""
    return (t.argmax(-1), t.argmin(-1), t.argmax(0), t.max(-1).indices, (t > 2).sum(-1), torch.isnan(t).sum(),
            (t > 2).cumsum(-1))


@pytest.mark.parametrize("codegen", CODEGENS)
def test_integer_idioms_meeting_floats_match_eager(codegen):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, generator=g)
    table = torch.randn(12, 3, generator=g)
    nan = float("nan")
    cases = [
        (position_ids, (torch.tensor([[1, 5, 7, 1, 1], [5, 6, 7, 8, 9]]), table)),
        (wrapped_integers, (torch.arange(240, 256, dtype=torch.uint8).view(4, 4),
                            torch.arange(-128, 128, 16, dtype=torch.int8).view(4, 4),
                            torch.tensor([2 ** 31 - 1, -2 ** 31, 2 ** 30, 7], dtype=torch.int32).repeat(4, 1), x)),
        (argmax_and_counts,
         (torch.tensor([[1., 3., 3., 2.], [5., 5., 5., 5.], [nan, 1., 2., nan], [0., nan, 9., 9.]]),)),
    ]
    for fn, inputs in cases:
        torch._dynamo.reset()
        leaves_e = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        leaves_m = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out_e, out_m = fn(*leaves_e), []
        generated(lambda: out_m.append(compiled(fn, codegen)(*leaves_m)))
        same(out_m[0], out_e, fn.__name__)
        pairs = zip(*(o if isinstance(o, tuple) else (o,) for o in (out_m[0], out_e)))
        floats = [(m, e) for m, e in pairs if e.requires_grad]
        for side in (0, 1) if floats else ():
            sum((o[side] * torch.linspace(-1, 1, o[side].numel()).view(o[side].shape)).sum() for o in floats).backward()
        for i, (m, e) in enumerate(zip(leaves_m, leaves_e)):
            if e.grad is not None:
                same(m.grad, e.grad, f"{fn.__name__} grad of input {i}")


def global_add_pool(h: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """GNN code's sum of node features per graph by index_add_ into zeros of the features' dtype."""
    return torch.zeros(3, h.shape[1], dtype=h.dtype).index_add_(0, batch, h) * 2


def rows_by_index_select(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of a table picked by index_select, whose backward sums the rows' gradients by index_add."""
    return table.index_select(0, index) * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codegen", CODEGENS)
def test_a_16_bit_index_add_sums_as_eager(codegen, dtype):
    """Regression: index_add of fp16/bf16 values decomposed (torch's core decomposition) to an accumulating
    index_put in the 16-bit dtype, which rounds after every add, where ATen's index_add sums in fp32 and
    rounds once: 600 nodes of 0.1 pooled into one graph stalled at 32 in bf16 (57.4 in fp16) where eager
    gives 60, and so did the gradient of a table row that index_select picked 600 times. Now summed in fp32:
    eager's values and gradients, at the suites' 16-bit tolerances."""
    index = torch.cat([torch.zeros(600, dtype=torch.long), torch.tensor([2, 0, 2])])
    rows = torch.cat([torch.full((600, 4), 0.1), torch.randn(3, 4, generator=torch.Generator().manual_seed(0))])
    rows = rows.to(dtype)
    for fn, x, grad in ((global_add_pool, rows, torch.linspace(-1, 1, 12).view(3, 4)),
                        (rows_by_index_select, rows[-3:], rows / 2)):
        torch._dynamo.reset()
        xe, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_m = fn(xe, index), []
        generated(lambda: out_m.append(compiled(fn, codegen)(xm, index)))
        close(out_m[0], out_e, fn.__name__, dtype)
        out_e.backward(grad.to(dtype))
        out_m[0].backward(grad.to(dtype))
        close(xm.grad, xe.grad, f"{fn.__name__}: grad of the input", dtype)


def rounded_to_fp32_in_an_fp64_model(x: torch.Tensor) -> torch.Tensor:
    """LLaMA's RMSNorm upcast, x.float() ... .type_as(x), met by an fp64 model (a gradient check): the value
    rounded to fp32 and widened back; minus x, the rounding error itself."""
    return x.float().double() * 3 - x


@pytest.mark.parametrize("codegen", CODEGENS)
def test_fp64_rounded_through_fp32_keeps_the_rounding(codegen):
    """Regression: gcc 12 folded the SLP-vectorized (double)(float)x of the 2 elements after a 50-element
    loop's last whole vector to x, so those elements (and their gradients) kept their fp64 value where eager
    rounds them to fp32. Exact arithmetic besides the rounding: eager's values at fp64's tolerance."""
    x = torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 10
    grad = torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xe, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e, out_m = rounded_to_fp32_in_an_fp64_model(xe), []
    generated(lambda: out_m.append(compiled(rounded_to_fp32_in_an_fp64_model, codegen)(xm)))
    close(out_m[0], out_e, "x.float().double() * 3 - x")
    out_e.backward(grad)
    out_m[0].backward(grad)
    close(xm.grad, xe.grad, "its gradient")


def kahan_step_in_bf16(p: torch.Tensor, compensation: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
    """Kahan-compensated SGD written in the weights' own dtype (bf16 arithmetic, no fp32 master copy): what
    rounding p + y to bf16 lost, (t - p) - y, is carried into the next step. It relies on each op's result being
    rounded to bf16, as eager rounds it."""
    y = grad * -lr - compensation
    t = p + y
    compensation.copy_((t - p) - y)
    p.copy_(t)


@pytest.mark.parametrize("codegen", CODEGENS)
def test_kahan_compensated_bf16_weights_in_bf16_arithmetic_move_as_eager(codegen):
    """Regression: 50 steps of 1e-3 times gradients in [0.5, 1) on bf16 weights near 4 (ulp 2^-5) move eager's
    weights by -0.037 on average (the exact sum: -0.0375) through the compensation; tfsn's fused step held the
    bf16 sums in fp32 unrounded, computed (t - p) - y as 0, and the weights never moved. Now each op of the
    user's with a 16-bit result is rounded as eager rounds it. The movement and the compensation against
    eager's, at bf16's tolerance of their scale."""
    g = torch.Generator().manual_seed(0)
    start = (torch.randn(257, generator=g) + 4).bfloat16()
    grad = (torch.rand(257, generator=g) * 0.5 + 0.5).bfloat16()
    runs = {}
    for name, step in (("eager", kahan_step_in_bf16), ("tfsn", compiled(kahan_step_in_bf16, codegen))):
        p, compensation = start.clone(), torch.zeros_like(start)
        run = lambda: [step(p, compensation, grad, 1e-3) for _ in range(50)]  # noqa: E731
        run() if name == "eager" else generated(run)
        runs[name] = (p.float() - start.float(), compensation.float())
    close(runs["tfsn"][0], runs["eager"][0], "the weights' movement", torch.bfloat16)
    close(runs["tfsn"][1], runs["eager"][1], "the compensation", torch.bfloat16)


def halves_read_in_fp32(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> tuple:
    """16-bit values read by ops of another dtype: a product of the user's converted to fp32, a comparison with
    a Python number, a floor of a product, and a floor division by a 16-bit tensor."""
    return (x * y).float() + z, x > 0.5, torch.floor(x * 3), (x.float() * z) // y


# a value defined as a 16-bit float's exact value held in fp32 (a load or a rounding), and a value rounded to one
WIDENED = {"c": r"const float (t\d+) = tfsn_(?:bf16|fp16)_to_float\(",
           "triton": r"(t\d+) = (?:tfsn_bf16_widened\(|\(.*\)\.to\(tl\.float32\)$)"}
NARROWED = {"c": r"tfsn_float_to_(?:bf16|fp16)\(\(?(t\d+)\)?\)",
            "triton": r"tl\.cast\(\(?(t\d+)\)?, tl\.float32\)\)?\.to\(tl\.(?:bfloat16|float16)\)"
                      r"|tfsn_bf16_of\(tl\.cast\((?:tl\.cast\()?\(?(t\d+)\)?, tl\.float32\)"}


@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_half_held_exactly_is_not_rounded_again(monkeypatch, codegen, dtype):
    """A 16-bit value that a kernel loaded, or rounded after an op of the user's, already holds its half's value:
    where an op of another dtype or a floor reads it, rounding it again changes nothing and costs a round trip
    through 16 bits per element. The values are eager's exactly, and no kernel rounds such a value again except
    to store it."""
    import re
    sources: list[str] = []
    real = backend._compiled

    def recording(graph, groups, inplace, kernels, *more):
        sources.extend(k.source for k in kernels if k is not None)
        return real(graph, groups, inplace, kernels, *more)
    monkeypatch.setattr(backend, "_compiled", recording)
    g = torch.Generator().manual_seed(1)
    x, y = ((torch.rand(37, generator=g) * 4 + 0.5).to(dtype) for _ in range(2))
    z = torch.rand(37, generator=g) * 3
    step = compiled(halves_read_in_fp32, codegen)
    generated(lambda: same(step(x, y, z), halves_read_in_fp32(x, y, z), "outputs"))
    for a, e in zip(step(x, y, z), halves_read_in_fp32(x, y, z)):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    lines = [line.strip() for source in sources for line in source.splitlines()]
    exact = {m.group(1) for line in lines for m in [re.match(WIDENED[codegen], line)] if m}
    assert exact, "\n".join(sources)
    again = [line for line in lines if not line.startswith(("tl.store", "p"))
             for m in re.finditer(NARROWED[codegen], line) if set(m.groups()) & exact]
    assert not again, "rounded again:\n" + "\n".join(again)


def powers_of_halves(x: torch.Tensor, z: torch.Tensor) -> tuple:
    """A 16-bit power of the user's (x ** 2, a root, a reciprocal) read where its rounding shows: converted to
    fp32, added to an fp32 tensor, compared, and less the product it equals in the half (0 in eager)."""
    return (x ** 2).float(), x ** 0.5 + z, x ** -1 > 0.3, x ** 2 - x * x


@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_power_is_rounded_as_eager_rounds_it(codegen, dtype):
    """Regression: a half's power by a Python number (Triton: every exponent; C: fp16's 0.5 and -0.5, pow
    itself) returned its fp32 value unrounded, while loopnest.exact_halves counts an op of the user's as rounded:
    (x ** 2).float() and x ** 0.5 + z kept the fp32 power, x ** 2 - x * x was its rounding error, not 0. Eager's
    values bit for bit."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(37, generator=g) * 4 + 0.5).to(dtype)
    z = torch.rand(37, generator=g)
    step = compiled(powers_of_halves, codegen)
    generated(lambda: step(x, z))
    for k, (a, e) in enumerate(zip(step(x, z), powers_of_halves(x, z))):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m: f"output {k}: {m}")


def halves_shifted_by_numbers(x: torch.Tensor, step: int) -> tuple:
    """A half plus or minus Python numbers its dtype does not hold: a step count, 0.1, and a reversed sub."""
    return x + step, x - 0.1, 0.3 - x, x + step * 0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_sum_with_a_number_converts_the_number_as_eager_on_the_cpu(dtype):
    """Regression: eager on the CPU converts a number added to or subtracted from a half to that half first (an
    fp16 x + 2049 adds 2048, a bf16 x - 0.1 subtracts 0.10009765625; mul and div take it at its own value), and
    the C kernels added it at its fp32 value: one unit in the last place off in most elements past the half's
    whole numbers. The step is a constant in the first call's graph and a tensor input in the later ones'."""
    g = torch.Generator().manual_seed(0)
    step = compiled(halves_shifted_by_numbers, "c")
    x = (torch.rand(37, generator=g) * 4 - 2).to(dtype)
    generated(lambda: step(x, 1))
    for n in ([2049, 2051, 4097] if dtype == torch.float16 else [257, 259, 515]):
        x = (torch.rand(37, generator=g) * 4 - 2).to(dtype)
        for k, (a, e) in enumerate(zip(step(x, n), halves_shifted_by_numbers(x, n))):
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m: f"output {k} at step {n}: {m}")


def sigmoid_after_a_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple:
    """A Linear with bias (a half addmm: tfsn's fp32 product, then the bias) and an activation after it."""
    y = F.linear(x, w, b)
    return y, torch.sigmoid(y)


def sigmoid_after_a_linear_without_bias(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple:
    """A Linear without bias (a half mm; `b` unused), an activation after it (not SiLU: its decomposition
    converts its operand to fp32 first, which rounds it)."""
    y = F.linear(x, w)
    return y, torch.sigmoid(y)


def tanh_after_a_bmm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple:
    """Attention-like batched products of halves, an activation after them."""
    y = torch.bmm(x.view(2, -1, x.shape[-1]), w.t().expand(2, *w.t().shape))
    return y, torch.tanh(y)


def sigmoid_after_an_autocast_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple:
    """fp32 weights, the Linear computed in the half under autocast, an activation after it (fp32 after the
    region, as eager computes it)."""
    with torch.autocast("cpu", dtype=w.dtype):
        y = F.linear(x.float(), w.float(), b.float())
    return y, torch.sigmoid(y)


ACTIVATION_OF_PRODUCT = {sigmoid_after_a_linear: torch.sigmoid, sigmoid_after_a_linear_without_bias: torch.sigmoid,
                         tanh_after_a_bmm: torch.tanh, sigmoid_after_an_autocast_linear: torch.sigmoid}


@pytest.mark.parametrize("fn", list(ACTIVATION_OF_PRODUCT), ids=lambda fn: fn.__name__)
@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_an_activation_reads_a_16_bit_gemm_result_rounded_as_eager(codegen, dtype, fn):
    """Regression: a fused epilogue read a half GEMM's result (a Linear with or without bias, a bmm) as its fp32
    sum, unrounded, where eager rounds the mm, bmm or addmm to the half first: sigmoid(x @ w.T + b) of 64x48 @
    48x40 bf16 differed from eager's in 827 of 2560 elements. Summation order may differ from eager's, so the
    product is eager's at the half's tolerance, and the activation is eager's applied to tfsn's own product,
    bit for bit; gradients at the half's tolerance."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((14, 24), (11, 24), (11,)))
    product_e, out_e = fn(x, w, b)
    step = compiled(fn, codegen)
    outputs = []
    generated(lambda: outputs.append(step(x, w, b)))
    product, out = outputs[0]
    close(product, product_e, "the product", dtype)
    torch.testing.assert_close(out, ACTIVATION_OF_PRODUCT[fn](product), rtol=0, atol=0,
                               msg=lambda m: f"the activation of tfsn's product: {m}")
    xe, we, xm, wm = (t.clone().requires_grad_() for t in (x, w, x, w))
    grad = torch.randn(out_e.shape, generator=g).to(out_e.dtype)
    fn(xe, we, b)[1].backward(grad)
    step(xm, wm, b)[1].backward(grad)
    close(xm.grad, xe.grad, "grad of x", dtype)
    close(wm.grad, we.grad, "grad of w", dtype)


def centered_by_the_row_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x - x.sum(-1, keepdim=True)


def scaled_by_the_whole_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x.sum() is a sum.dim_IntList over no dims: a decomposition of one piece."""
    return x.sum() * x


def centered_by_the_column_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x - x.sum(0, keepdim=True)


def less_the_row_variance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """var: a decomposition whose last piece, a division, is var's result."""
    return x - x.var(-1, keepdim=True)


def product_centered_by_its_row_mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x @ w.t()
    return y - y.mean(-1, keepdim=True)


@pytest.mark.parametrize("fn", [centered_by_the_row_sum, scaled_by_the_whole_sum, centered_by_the_column_sum,
                                less_the_row_variance, product_centered_by_its_row_mean], ids=lambda fn: fn.__name__)
@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_an_op_reads_a_16_bit_reduction_rounded_as_eager(codegen, dtype, fn):
    """Regression: an op fused after a half sum, mean or var read its fp32 value unrounded, where eager rounds
    it to the half first (x - x.sum(-1, keepdim=True) of bf16 (14, 37): 23 of 518 elements off, up to 0.25;
    x.sum() * x: 283, up to 8). Elements are multiples of 1/64 below 16, so every sum is exact in fp32 whatever
    its order and the results are eager's bit for bit; gradients at the half's tolerance."""
    g = torch.Generator().manual_seed(0)
    x, w = ((torch.randint(-1024, 1025, shape, generator=g) / 64).to(dtype) for shape in ((14, 37), (11, 37)))
    step = compiled(fn, codegen)
    outputs = []
    generated(lambda: outputs.append(step(x, w)))
    torch.testing.assert_close(outputs[0], fn(x, w), rtol=0, atol=0)
    xe, xm = (x.clone().requires_grad_() for _ in range(2))
    grad = torch.randn(outputs[0].shape, generator=g).to(dtype)
    fn(xe, w).backward(grad)
    step(xm, w).backward(grad)
    close(xm.grad, xe.grad, "grad of x", dtype)


SCALAR_OPERATIONS = {"x - 1.3": lambda x: x - 1.3, "1.3 - x": lambda x: 1.3 - x, "x + 1e-3": lambda x: x + 1e-3,
                     "1.3 ** x": lambda x: 1.3 ** x, "x + 2049": lambda x: x + 2049, "x - 257": lambda x: x - 257}


@pytest.mark.parametrize("expression", list(SCALAR_OPERATIONS))
@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_add_sub_or_pow_of_a_float_rounds_it_as_cpu_eager(codegen, dtype, expression):
    """Regression: ATen's CPU add, sub and pow of a scalar convert a Python number to the tensor's half first
    (bf16 x - 1.3 subtracts 1.296875: 136 of 336 elements were 1 ulp off eager's), where mul and div take it in
    fp32. Forward bit for bit; the gradient at the half's tolerance."""
    fn = SCALAR_OPERATIONS[expression]
    x = (torch.randn(14, 24, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    step = compiled(fn, codegen)
    outputs = []
    generated(lambda: outputs.append(step(x)))
    torch.testing.assert_close(outputs[0], fn(x), rtol=0, atol=0)
    xe, xm = (x.clone().requires_grad_() for _ in range(2))
    fn(xe).sum().backward()
    step(xm).sum().backward()
    close(xm.grad, xe.grad, "grad of x", dtype)


ALPHA_OPERATIONS = {"x.add(y, alpha=0.97)": lambda x, y: x.add(y, alpha=0.97),
                    "x.sub(y, alpha=0.3)": lambda x, y: x.sub(y, alpha=0.3),
                    "torch.rsub(y, x, alpha=1.3)": lambda x, y: torch.rsub(y, x, alpha=1.3),
                    "x.add(y, alpha=2049)": lambda x, y: x.add(y, alpha=2049)}


@pytest.mark.parametrize("expression", list(ALPHA_OPERATIONS))
@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_add_or_sub_rounds_its_alpha_as_cpu_eager(codegen, dtype, expression):
    """Regression: ATen's CPU add and sub convert alpha to the tensor's half too (a pre-emphasis x[1:] - 0.97 x[:-1]
    written as torch.sub(.., alpha=0.97), an EMA's add_(p, alpha=1 - decay), SGD's add_(g, alpha=-lr) on bf16
    weights): bf16 x.add(y, alpha=0.97) adds 0.96875 * y, where tfsn added 0.97 * y (215 of 336 elements 1 ulp off
    eager's, and x = -0.96875 y gave -0.00125 y where eager gives 0). y holds signed powers of two, so alpha * y is
    exact in the half and eager's scalar tail loop (which rounds the product) agrees with its vector loop: forward
    bit for bit, with one row where x + alpha * y cancels exactly; the gradients at the half's tolerance."""
    fn = ALPHA_OPERATIONS[expression]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(14, 24, generator=g) * 3).to(dtype)
    signs = torch.where(torch.rand(14, 24, generator=g) < 0.5, -1.0, 1.0)
    y = (signs * 2.0 ** torch.randint(-3, 4, (14, 24), generator=g)).to(dtype)
    x[0] = fn(torch.zeros_like(x[0]), -y[0])          # eager's x + alpha * y is 0 there
    step = compiled(fn, codegen)
    outputs = []
    generated(lambda: outputs.append(step(x, y)))
    torch.testing.assert_close(outputs[0], fn(x, y), rtol=0, atol=0)
    (xe, ye), (xm, ym) = ((x.clone().requires_grad_(), y.clone().requires_grad_()) for _ in range(2))
    fn(xe, ye).sum().backward()
    step(xm, ym).sum().backward()
    close(xm.grad, xe.grad, "grad of x", dtype)
    close(ym.grad, ye.grad, "grad of y", dtype)


def _sgd_like_update(params: list, grads: list) -> list:
    for p, g in zip(params, grads):
        p.add_(g, alpha=-0.97)
    return params


def _foreach_update(params: list, grads: list) -> list:
    torch._foreach_add_(params, grads, alpha=-0.97)
    torch._foreach_sub_(params, grads, alpha=0.3)
    return params


@pytest.mark.parametrize("update", [_sgd_like_update, _foreach_update], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_in_place_or_foreach_update_rounds_its_alpha_as_cpu_eager(codegen, dtype, update):
    """Regression: an optimizer-style update of 16-bit weights, p.add_(g, alpha=-lr) per tensor or
    torch._foreach_add_ over the lists (eager's CPU foreach loops over the per-tensor add_), rounds alpha to the
    half as eager does. The foreach form kept alpha in fp32 after the per-tensor form was fixed (its nodes carry
    the foreach op as their original op): 0.125 off eager's at 19.5. Gradients are signed powers of two (see
    test_a_16_bit_add_or_sub_rounds_its_alpha_as_cpu_eager); bit for bit."""
    g = torch.Generator().manual_seed(0)
    shapes = ((16, 24), (32,))
    params = [(torch.randn(shape, generator=g) * 3).to(dtype) for shape in shapes]
    grads = [(torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
              * 2.0 ** torch.randint(-3, 4, shape, generator=g)).to(dtype) for shape in shapes]
    step = compiled(update, codegen)
    outputs = []
    generated(lambda: outputs.append(step([p.clone() for p in params], grads)))
    for actual, expected in zip(outputs[0], update([p.clone() for p in params], grads)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _tensor_alpha_update(params: list, grads: list, lr: torch.Tensor) -> list:
    for p, g in zip(params, grads):
        p.add_(g, alpha=-lr)
        p.add_(g, alpha=lr * 0.3)
    return params


def _sgd_steps(params: list, grads: list, lr: torch.Tensor, codegen: str | None) -> list:
    """Weights after 3 steps of SGD(foreach=False) with a tensor lr, eager's (codegen None) or compiled."""
    params = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.SGD(params, lr=lr, foreach=False)
    step = opt.step if codegen is None else compiled(opt.step, codegen)
    for k in range(3):
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        step() if codegen is None or k else generated(step)
    return [p.detach() for p in params]


@pytest.mark.parametrize("sgd", [False, True], ids=["add_", "SGD"])
@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_update_by_a_tensor_alpha_rounds_it_as_cpu_eager(codegen, dtype, sgd):
    """Regression: p.add_(g, alpha=-lr) with a 0-d fp32 tensor lr (torch.optim.SGD(foreach=False) with a tensor
    lr), which Dynamo writes as fma(g, -lr, p): eager's add takes alpha as a number (lr.item()) and rounds it to
    the half as for any alpha, bf16 -0.1 to -0.10009765625, where tfsn multiplied by -0.1 (bf16: 43 of 300 elements
    off eager's after one update, SGD 51 after 3 steps). Gradients are signed powers of two (see
    test_a_16_bit_add_or_sub_rounds_its_alpha_as_cpu_eager); bit for bit. (SGD(foreach=True) with a tensor lr
    multiplies grads by -lr only when compiling, torch's own branch, so it differs from eager under any backend.)"""
    g = torch.Generator().manual_seed(0)
    shapes = ((16, 24), (32,))
    params = [(torch.randn(shape, generator=g) * 3).to(dtype) for shape in shapes]
    grads = [(torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
              * 2.0 ** torch.randint(-3, 4, shape, generator=g)).to(dtype) for shape in shapes]
    lr = torch.tensor(0.1)
    if sgd:
        outputs, expected = _sgd_steps(params, grads, lr, codegen), _sgd_steps(params, grads, lr, None)
    else:
        step = compiled(_tensor_alpha_update, codegen)
        outputs = []
        generated(lambda: outputs.extend(step([p.clone() for p in params], grads, lr)))
        expected = _tensor_alpha_update([p.clone() for p in params], grads, lr)
    for actual, eager in zip(outputs, expected):
        torch.testing.assert_close(actual, eager, rtol=0, atol=0)


@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_bias_added_to_a_16_bit_product_reads_it_rounded_as_eager(codegen, dtype):
    """Regression: b + x @ w.T of halves (an mm, then an add: not F.linear's addmm) went to the library's addmm
    (loopnest.bias_epilogue), which adds the bias to the fp32 sum and rounds once, where eager rounds the product
    first: 387 of 1480 bf16 elements off eager's, up to 0.125. Elements are multiples of 1/8, so the products are
    exact in fp32 whatever the order and the result is eager's bit for bit."""
    g = torch.Generator().manual_seed(0)
    x, w, b = ((torch.randint(-64, 65, shape, generator=g) / 8).to(dtype) for shape in ((37, 24), (40, 24), (40,)))
    fn = lambda x, w, b: b + x @ w.t()  # noqa: E731
    step = compiled(fn, codegen)
    outputs = []
    generated(lambda: outputs.append(step(x, w, b)))
    torch.testing.assert_close(outputs[0], fn(x, w, b), rtol=0, atol=0)


TENSOR_OPERAND_OPERATIONS = {
    "x + torch.tensor(0.1)": lambda x, t, i: x + t,
    "torch.tensor(0.1) - x": lambda x, t, i: t - x,
    "x.add(torch.tensor(0.1), alpha=0.97)": lambda x, t, i: x.add(t, alpha=0.97),
    "x + torch.tensor(2049)": lambda x, t, i: x + torch.full_like(t, 2049, dtype=torch.int64),
    "x ** (torch.tensor(0.1) + 1.2)": lambda x, t, i: x.abs() ** (t + 1.2),
    "torch.tensor(0.1) * x": lambda x, t, i: t * x,
    "torch.tensor(0.1) / x": lambda x, t, i: t / x,
    "x * int64 tensor": lambda x, t, i: x * i,
    "int64 tensor - x": lambda x, t, i: i - x,
    "torch.lerp(x, x.flip(-1), torch.tensor(0.1))": lambda x, t, i: torch.lerp(x, x.flip(-1), t),
    "torch.lerp(x, x.flip(-1), torch.tensor(0.1) + 0.55)": lambda x, t, i: torch.lerp(x, x.flip(-1), t + 0.55),
    "torch.atan2(x, torch.tensor(0.1))": lambda x, t, i: torch.atan2(x, t),
    "torch.hypot(torch.tensor(0.1), x)": lambda x, t, i: torch.hypot(t, x),
    "torch.logaddexp(x, torch.tensor(0.1))": lambda x, t, i: torch.logaddexp(x, t),
    "torch.logaddexp2(torch.tensor(0.1), x)": lambda x, t, i: torch.logaddexp2(t, x),
    "torch.xlogy(torch.tensor(0.1), x.abs())": lambda x, t, i: torch.xlogy(t, x.abs()),
    "torch.xlogy(x, 0.3)": lambda x, t, i: torch.xlogy(x, 0.3),
    "torch.special.xlog1py(0.3, x.abs())": lambda x, t, i: torch.special.xlog1py(0.3, x.abs()),
}


@pytest.mark.parametrize("expression", list(TENSOR_OPERAND_OPERATIONS))
@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_op_converts_a_tensor_of_another_dtype_as_cpu_eager(codegen, dtype, expression):
    """Regression: ATen's CPU add, sub, pow, mul and div of a 16-bit result convert a tensor operand of another
    dtype to the half first (TensorIterator's common dtype): a 0-d fp32 or int64 one, and a dimensioned int64
    one; mul and div read only a one-element second operand at its own value (x * torch.tensor(0.1) multiplies by
    0.1, torch.tensor(0.1) * x by 0.10009765625 in bf16). The C renderer converted only a 0-d operand of add and
    sub, the Triton renderer (CPU tensors) none: bf16 x + torch.tensor(301.) 123 of 256 elements off eager's, by up
    to 2; bf16 x * an int64 tensor 52 of 256, up to 256; x ** a 0-d fp32 tensor 155 of 256. Its lerp converts a
    0-d fp32 weight too (an EMA's tensor weight), where lerp's decomposition read it in fp32: bf16 8 of 240
    elements off eager's, fp16 22. So do its atan2 and hypot, and logaddexp, logaddexp2, xlogy and xlog1py, a
    Python number of the last two as well (eager wraps it), which their decompositions read at its own value:
    bf16 torch.xlogy(x, 0.3) 32 of 256 elements off eager's, torch.atan2(x, torch.tensor(0.1)) 3, logaddexp 16,
    xlog1py 128. Forward bit for bit; the gradient at the half's tolerance."""
    fn = TENSOR_OPERAND_OPERATIONS[expression]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 64, generator=g) * 3).to(dtype)
    t = torch.tensor(0.1)
    i = torch.randint(200, 5000, (4, 64), generator=g)
    step = compiled(fn, codegen)
    outputs = []
    generated(lambda: outputs.append(step(x, t, i)))
    torch.testing.assert_close(outputs[0], fn(x, t, i), rtol=0, atol=0)
    xe, xm = (x.clone().requires_grad_() for _ in range(2))
    fn(xe, t, i).sum().backward()
    step(xm, t, i).sum().backward()
    close(xm.grad, xe.grad, "grad of x", dtype)


def _decayed_sgd_step(params: list, grads: list) -> list:
    """torch.optim.SGD(foreach=True, weight_decay=wd)'s update, without momentum: two calls of one foreach op."""
    grads = torch._foreach_add(grads, params, alpha=0.01)
    torch._foreach_add_(params, grads, alpha=-0.03)
    return params


@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_chained_16_bit_foreach_updates_round_each_result_as_eager(codegen, dtype):
    """Regression: SGD's foreach weight decay, grads + wd * params, is rounded to the half before the update
    params - lr * grads reads it, as eager's per-tensor adds round it. Both are pieces of _foreach_add.List of one
    seq_nr (-1 outside autograd), so tfsn took the first for a piece inside one op and kept it in fp32: a compiled
    torch.optim.SGD(foreach=True, weight_decay=0.01) step on bf16 weights moved 8 of 256 elements one ulp off the
    same graph run as ATen (aot_eager) in three steps. Bit for bit."""
    g = torch.Generator().manual_seed(0)
    shapes = ((4, 64), (64,))
    params = [(torch.randn(shape, generator=g) * 3).to(dtype) for shape in shapes]
    grads = [torch.randn(shape, generator=g).to(dtype) for shape in shapes]
    step = compiled(_decayed_sgd_step, codegen)
    outputs = []
    generated(lambda: outputs.append(step([p.clone() for p in params], grads)))
    for actual, expected in zip(outputs[0], _decayed_sgd_step([p.clone() for p in params], grads)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


ONE_KERNEL_OPERATIONS = {
    "t.addcdiv_(a, b, value=-0.5)": lambda t, a, b: t.clone().addcdiv_(a, b, value=-0.5),
    "t.addcmul_(a, b, value=-0.375)": lambda t, a, b: t.clone().addcmul_(a, b, value=-0.375),
    "torch.addcdiv(t, a, b, value=-0.5)": lambda t, a, b: torch.addcdiv(t, a, b, value=-0.5),
    "t ** 3": lambda t, a, b: t ** 3,
    "b ** -2": lambda t, a, b: b ** -2,
    "torch.xlogy(a, b)": lambda t, a, b: torch.xlogy(a, b),
    "torch.special.xlog1py(a, b)": lambda t, a, b: torch.special.xlog1py(a, b),
    "torch.logit(b.clamp(max=3) / 3, eps=1e-3)": lambda t, a, b: torch.logit(b.clamp(max=3) / 3, eps=1e-3),
    "torch.special.entr(b)": lambda t, a, b: torch.special.entr(b),
}


@pytest.mark.parametrize("expression", list(ONE_KERNEL_OPERATIONS))
@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_op_of_one_cpu_kernel_rounds_as_its_kernel(codegen, dtype, expression):
    """Regression: ops that eager computes in one 16-bit CPU kernel, rounding where that kernel rounds. Dynamo
    writes t.addcdiv_(a, b, value=v) and t.addcmul_ (Adam's and AdamW's updates without foreach) as a / b or a * b
    and an fma, and tfsn rounded the quotient or product to the half where eager's kernel computes t + v * a / b
    in fp32 and rounds once (bf16 addcdiv_: 59 of 336 elements off eager's; addcmul_: 95); torch.addcdiv(t, a, b,
    value=v) too, which Dynamo writes as torch.div, torch.mul and torch.add (59 of 336). The opposite for bf16
    x ** 3 and x ** -2: eager's kernel rounds the square x * x to bf16 before the third factor or the reciprocal,
    and tfsn rounded once (72 and 82 of 336 off; fp16's pow rounds once). Likewise xlogy's kernel rounds log(y)
    to the half before the product (xlog1py its log1p, entr's -x * log(x) its log: bf16 115 of 336 off), logit's
    rounds 1 - x, the quotient and the log, between bounds eps and 1 - eps held in the half (bf16's 1 - 1e-3 is 1,
    so logit(1) is inf, as its gradient), where their decompositions computed in fp32. Values where v * a / b and
    v * a * b are exact or scaled by a power of two, so the fp32 order of eager's kernel and Dynamo's pieces agree:
    forward bit for bit; gradients at the half's tolerance."""
    fn = ONE_KERNEL_OPERATIONS[expression]
    g = torch.Generator().manual_seed(0)
    t, a = ((torch.randn(14, 24, generator=g) * 3).to(dtype) for _ in range(2))
    b = (torch.rand(14, 24, generator=g) * 3 + 0.5).to(dtype)
    step = compiled(fn, codegen)
    outputs = []
    generated(lambda: outputs.append(step(t, a, b)))
    torch.testing.assert_close(outputs[0], fn(t, a, b), rtol=0, atol=0)
    eager_leaves, leaves = ([x.clone().requires_grad_() for x in (t, a, b)] for _ in range(2))
    grad = torch.randn(14, 24, generator=g).to(dtype)
    fn(*eager_leaves).backward(grad)
    step(*leaves).backward(grad)
    for name, mine, eager in zip("tab", leaves, eager_leaves):
        if eager.grad is not None:
            close(mine.grad, eager.grad, f"grad of {name}", dtype)


@pytest.mark.parametrize("optimizer", [torch.optim.RMSprop, torch.optim.Adagrad], ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_compiled_16_bit_optimizer_step_without_foreach_matches_eager(codegen, dtype, optimizer):
    """Regression: RMSprop's and Adagrad's steps without foreach update 16-bit weights by param.addcdiv_(g, d,
    value=-lr) and square averages by addcmul_, which Dynamo writes as a / b or a * b and an fma (with a 0-d
    tensor value under compile, Adagrad's step size from its step tensor), and tfsn rounded the quotient to the half
    where eager's kernel rounds once: bf16 weights 51 (RMSprop) and 6 (Adagrad) of 336 elements off eager's after 3
    steps. Now bit for bit. (Adam's compiled step computes its bias corrections in fp32 from the step tensor where
    eager takes step.item() in double, so a few of its elements differ in either backend: not tested here.)"""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=g).to(dtype) for shape in ((14, 24), (33,))]
    grads = [[(torch.randn(p.shape, generator=g) * 0.1).to(dtype) for p in start] for _ in range(3)]
    weights = {}
    for name in ("eager", "tfsn"):
        params = [p.clone().requires_grad_() for p in start]
        opt = optimizer(params, lr=1e-2, foreach=False)
        step = opt.step if name == "eager" else compiled(opt.step, codegen)
        for k, step_grads in enumerate(grads):
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
            step() if name == "eager" or k else generated(step)
        weights[name] = [p.detach() for p in params]
    for actual, expected in zip(weights["tfsn"], weights["eager"]):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


_TARGETS = torch.tensor([0, 29, -100, 3, 17, -100, 6, 11])    # class per row of 8, -100 ignored where asked
SOFTMAX_OPERATIONS = {
    "F.log_softmax(x, -1)": lambda x: F.log_softmax(x, -1),
    "F.log_softmax(x.view(2, 4, 30), 1)": lambda x: F.log_softmax(x.view(2, 4, 30), 1),
    "F.softmax(x, -1)": lambda x: F.softmax(x, -1),
    "F.softmax(x, 0)": lambda x: F.softmax(x, 0),
    "torch.logsumexp(x, -1)": lambda x: torch.logsumexp(x, -1),
    "torch.logsumexp(x, 0)": lambda x: torch.logsumexp(x, 0),
    "F.cross_entropy(x, t.clamp(min=0))": lambda x: F.cross_entropy(x, _TARGETS.clamp(min=0)),
    "F.cross_entropy(x, t, label_smoothing=0.1)": lambda x: F.cross_entropy(x, _TARGETS.clamp(min=0),
                                                                            label_smoothing=0.1),
    "F.cross_entropy(x, t, ignore_index=-100)": lambda x: F.cross_entropy(x, _TARGETS, ignore_index=-100),
}


@pytest.mark.parametrize("expression", list(SOFTMAX_OPERATIONS))
@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_softmax_rounds_as_its_cpu_kernel(codegen, dtype, expression):
    """Regression: ATen's 16-bit CPU softmax kernels round pieces to the half that the decompositions computed
    in fp32. log_softmax over the last dim (_vec_log_softmax_lastdim) holds each row's sum of exp(x - max) and its
    log in the half, then x - max - log_sum in fp32: bf16 F.log_softmax(x, -1) was 27 of 240 elements off eager's
    (fp16 13), and cross-entropy's gradient with it. softmax over another dim (_vec_softmax) divides exp(x - max)
    stored in its half output by the fp32 sum: bf16 F.softmax(x, 0) 58 of 240 off (fp16 49). logsumexp is a
    composite of ops on the half tensor, each rounded: bf16 3 of 8 rows off, its gradient by up to 0.0068. Over
    the other dims, and in the backward kernels, fp32 throughout, as the decompositions. Forward bit for bit;
    the gradient at the half's tolerance."""
    fn = SOFTMAX_OPERATIONS[expression]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 30, generator=g) * 3).to(dtype)
    step = compiled(fn, codegen)
    outputs = []
    generated(lambda: outputs.append(step(x)))
    torch.testing.assert_close(outputs[0], fn(x), rtol=0, atol=0)
    xe, xm = (x.clone().requires_grad_() for _ in range(2))
    grad = torch.randn(outputs[0].shape, generator=g).to(dtype)
    fn(xe).backward(grad)
    step(xm).backward(grad)
    close(xm.grad, xe.grad, "grad of x", dtype)


NORMS = {"batch_norm": lambda x, w, b: F.batch_norm(x, torch.zeros(24), torch.ones(24), w, b, training=True),
         "instance_norm": lambda x, w, b: F.instance_norm(x, weight=w, bias=b),     # BatchNorm without running stats
         "group_norm": lambda x, w, b: F.group_norm(x, 4, w, b),
         # a bias and no weight: the statistics' fp32 is the bias gradient's dtype
         "batch_norm, a bias alone": lambda x, w, b: F.batch_norm(x, None, None, None, b, training=True),
         "batch_norm eval, a bias alone": lambda x, w, b: F.batch_norm(x, torch.zeros(24), torch.ones(24), None, b)}


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("codegen", CODEGENS)
def test_a_norm_of_a_bf16_input_with_fp32_weights_backpropagates_as_eager(codegen, norm):
    """Regression: under autocast a BatchNorm, InstanceNorm or GroupNorm gets a bf16 input and its fp32 weights, and
    ATen's mixed-type CPU kernels save the statistics for the backward in fp32; torch's decompositions (and the ops'
    meta functions) said bf16, so the backward read them rounded: the weight's gradient was 2e-3 off eager's. With
    no weight, torch's decomposition rounded the bias's gradient to bf16, 0.02 off eager's fp32."""
    g = torch.Generator().manual_seed(0)
    x, grad = (torch.randn(6, 24, 8, generator=g).bfloat16() for _ in range(2))
    w, b = torch.randn(24, generator=g), torch.randn(24, generator=g)

    def backward(fn: Callable) -> list:
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        out = fn(*leaves)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves if t.grad is not None]
    expected, got = backward(NORMS[norm]), []
    generated(lambda: got.extend(backward(compiled(NORMS[norm], codegen))))
    assert len(got) == len(expected), f"{norm}: {len(got) - 1} gradients, eager's {len(expected) - 1}"
    same(got, expected, f"{norm}: output, gradients of x and the parameters")


@pytest.mark.parametrize("codegen", CODEGENS)
def test_a_layer_norm_under_autocast_backpropagates_as_eager(codegen):
    """Regression: torch's LayerNorm decomposition rounded the mean and inverse std of a bf16 input with fp32
    weights (autocast) to bf16 on a CPU where ATen's mixed-type kernel keeps fp32: the input's gradient was 1 bf16
    ulp off eager's, and the Linear before it got its weight gradient 0.09 off. (The LayerNorm's own weight and bias
    gradients ATen sums in bf16, a rounding not matched: they are not compared.)"""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 24), nn.LayerNorm(24))
    x, grad = torch.randn(6, 3, 8) * 2 + 1, torch.randn(6, 3, 24).bfloat16()

    def backward(model: nn.Module, run: Callable) -> list:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
        out.backward(grad)
        return [out.detach(), model[0].weight.grad, model[0].bias.grad]
    mine, got = copy.deepcopy(eager), []
    generated(lambda: got.extend(backward(mine, compiled(mine, codegen))))
    same(got, backward(eager, eager), "output, gradients of the Linear's weight and bias")
