"""Models written the way users write them (tests/user_models.py), compiled with the tfsn backend,
against eager PyTorch: forward output, loss, input and parameter gradients, then three training
steps with SGD (momentum) and with AdamW, the optimizer step compiled too; and
F.scaled_dot_product_attention on its own, forward and backward, in the variants users call it.

Tolerances. fp32: generated kernels sum in a different order than ATen, so values match to
rtol=1e-4 and atol=1e-5 times the largest magnitude of the expected tensor, as in
tests/test_optimizer_correctness.py. fp64: the same tolerance in units of the dtype's epsilon
(2^-52 for 2^-23, so times 2^-29): an fp64 value computed anywhere in fp32 fails it.
bf16 (autocast): bf16 keeps 8 significant bits, so one rounding of a value to bf16 moves it by up to
2^-8 relative (half its epsilon, 2^-7). Where the compiled graph rounds a value to bf16 and eager
does not, or the other way (a fused kernel keeps an fp32 intermediate; a bf16 GEMM accumulates in
another order and its output rounds to the neighbouring bf16 value), the two differ by one such
rounding, and these models chain a few (input Linear, two blocks of two Linears, head) between
input and loss: rtol = atol factor = 2^-5, four bf16 roundings. (Measured: gradients up to 1.2e-2
of their scale apart, about three roundings; outputs and loss equal.)
fp16 (autocast, or a model cast to it): 11 significant bits, one rounding moves a value by up to 2^-11
relative; four such roundings, rtol = atol factor = 2^-9.
"""
from __future__ import annotations

import copy
import os
from typing import Callable

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch
import torch.nn as nn

from optimizer import backend
from optimizer.backend import make_backend
from tests.test_optimizer_correctness import fresh  # noqa: F401  (autouse: a shared compile cache, no dynamo state)
from tests.test_optimizer_correctness import record_compiled
from tests.user_models import ATTENTION, Attention, Case, cases

# float64's: float32's over 2^26, not 2^29 (the mantissas' difference): a long sum's order differs more in ulps
# there (Whisper's log-mel conv weight gradient on an AVX-512 CPU, 16-lane sums: 6.4e-16 at a scale of 0.0175, 2^-44.6
# of it, 1/4 of the tolerance), and a float64 step computed in float32 anywhere is still ~2^-24 off, 4e5x outside
TOLERANCE = {                     # dtype of the compared values: (rtol, atol factor of the scale)
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-4 * 2.0 ** -26, 1e-5 * 2.0 ** -26),
    torch.bfloat16: (2.0 ** -5, 2.0 ** -5),
    torch.float16: (2.0 ** -9, 2.0 ** -9),
}
# complex parameters (an FNO's spectral weights): the tolerance of their real and imaginary parts' dtype
TOLERANCE.update({torch.complex64: TOLERANCE[torch.float32], torch.complex128: TOLERANCE[torch.float64]})
LOSS_RTOL = 1e-4                  # losses over training steps, fp32 (as the existing suite)
TRAIN_STEPS = 3


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, dtype: torch.dtype | None = None) -> None:
    """actual == expected within the tolerance of `dtype` (default: expected's own dtype)."""
    rtol, atol = TOLERANCE[dtype or expected.dtype]
    scale = expected.detach().abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol * max(scale, 1e-3),
                               check_dtype=True, msg=lambda m: f"{what}: {m}")


def low_precision(case: Case) -> torch.dtype | None:
    """The 16-bit dtype whose tolerance all of the case's values get (its loss in fp32 too), else None."""
    return torch.bfloat16 if case.bf16 else torch.float16 if case.fp16 else None


def kernels() -> int:
    return backend.STATS["kernels"]


def leaves(inputs: tuple) -> tuple:
    """The batch as fresh leaves, the floating ones requiring grad."""
    return tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)


def stepped_eager(case: Case) -> tuple:
    """The case's model after eager's step on its batch (forward, loss, backward), that step's inputs,
    output and loss, and a copy of the model from before the step with fresh leaves of the same inputs."""
    torch.manual_seed(0)
    eager = case.build()
    mine = copy.deepcopy(eager)
    inputs, target = case.batch(torch.Generator().manual_seed(1))
    inputs_e, inputs_m = leaves(inputs), leaves(inputs)
    out_e, loss_e = case.step(eager, inputs_e, target)
    loss_e.backward()
    return eager, inputs_e, out_e, loss_e, mine, inputs_m, target


def zero_grad_mask(case: Case, name: str, p: torch.Tensor) -> torch.Tensor:
    """True at the elements of parameter `name` whose gradient is exactly zero in exact arithmetic."""
    mask = torch.zeros_like(p, dtype=torch.bool)
    for n, where in case.zero_grad:
        if n == name:
            mask[where] = True
    return mask


def compare_parameters(eager: nn.Module, mine: nn.Module, what: str, dtype: torch.dtype | None) -> None:
    named = dict(mine.named_parameters())
    for name, p in eager.named_parameters():
        close(named[name], p, f"{what}: {name}", dtype)
    buffers = dict(mine.named_buffers())
    for name, b in eager.named_buffers():          # BatchNorm running stats and batch counts
        if b.is_floating_point():
            close(buffers[name], b, f"{what}: buffer {name}", dtype)
        else:
            assert torch.equal(buffers[name], b), f"{what}: buffer {name}"


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_forward_and_gradients_match_eager(case):
    check_forward_and_gradients(case, make_backend())


# Every case passes through the Triton kernels too (checked once on 2026-12-06 under the interpreter, also with
# generated tl.dot GEMMs and split reductions); Triton's interpreter runs each program in Python, so CI runs
# the cheapest three of them.
THROUGH_TRITON = ["tiny_mlp", "graph", "convnet"]


@pytest.mark.parametrize("case", [c for c in cases() if c.name in THROUGH_TRITON], ids=lambda c: c.name)
def test_through_triton_forward_and_gradients_match_eager(case):
    pytest.importorskip("triton")
    check_forward_and_gradients(case, make_backend(codegen="triton"))


def fp64_gradients(case: Case) -> dict[str, torch.Tensor]:
    """The gradients of the case's step run eagerly in float64 (model and float inputs): "input I" and parameter
    names. The truth that an fp32 gradient further from eager's than the tolerance is judged against."""
    torch.manual_seed(0)
    model = case.build().double()
    inputs, target = case.batch(torch.Generator().manual_seed(1))
    inputs = leaves(tuple(t.double() if t.is_floating_point() else t for t in inputs))
    _, loss = case.step(model, inputs, target)
    loss.backward()
    return {**{f"input {i}": t.grad for i, t in enumerate(inputs) if t.grad is not None},
            **{name: p.grad for name, p in model.named_parameters() if p.grad is not None}}


def close_or_no_farther_from_truth(actual: torch.Tensor, expected: torch.Tensor, what: str, dtype: torch.dtype | None,
                                   truth: Callable[[], torch.Tensor | None]) -> None:
    """`close`, or, for an fp32 gradient where eager's own is not within the tolerance of the exact one (an
    ill-conditioned step: a log of a magnitude near its floor, a long sum), tfsn's gradient no more than twice as
    far from the float64 run's as eager's. parallel_wavegan's STFT loss on an AVX-512 CPU: eager 8.1e-6 from the
    float64 gradient, tfsn 6.9e-6 and 1.2e-5 from eager's, where the tolerance allows 2.2e-6."""
    try:
        close(actual, expected, what, dtype)
    except AssertionError:
        exact = truth() if dtype is None and expected.dtype == torch.float32 else None
        if exact is None:
            raise
        mine, eager = ((t.double() - exact).abs().max().item() for t in (actual, expected))
        assert mine <= 2 * eager, f"{what}: {mine:.3g} from the float64 run's, eager's {eager:.3g}"


def check_forward_and_gradients(case: Case, compile_with: Callable) -> None:
    """One step of `case` compiled with `compile_with` against eager's: output, loss, input and parameter
    gradients (an fp32 one outside the tolerance no farther from a float64 run's than eager's), buffers; and the
    compiled step generated kernels."""
    eager, inputs_e, out_e, loss_e, mine, inputs_m, target = stepped_eager(case)
    exact: dict[str, torch.Tensor] = {}

    def truth(name: str, where: torch.Tensor | None = None) -> Callable[[], torch.Tensor | None]:
        def run() -> torch.Tensor | None:          # the float64 step is run only where a comparison failed
            if not exact:
                exact.update(fp64_gradients(case))
            gradient = exact.get(name)
            return gradient if gradient is None or where is None else gradient[where]
        return run

    compiled = torch.compile(mine, backend=compile_with)
    before = kernels()
    out_m, loss_m = case.step(compiled, inputs_m, target)
    loss_m.backward()
    assert kernels() > before, "the backend generated no kernel: the model ran as plain ATen"

    dtype = low_precision(case)
    close(out_m, out_e, f"{case.name} output", dtype)
    close(loss_m, loss_e, f"{case.name} loss", dtype)
    for i, (a, b) in enumerate(zip(inputs_m, inputs_e)):
        if b.grad is not None:
            close_or_no_farther_from_truth(a.grad, b.grad, f"{case.name} grad of input {i}", dtype, truth(f"input {i}"))
    # All of the gradient's scale, for the elements whose gradient is zero in exact arithmetic: what
    # either run has there is cancellation noise of terms of the size of the model's gradients.
    grads = dict(mine.named_parameters())
    trained = [(name, p) for name, p in eager.named_parameters() if p.grad is not None]
    for name, p in eager.named_parameters():       # frozen, or read only under no_grad
        assert p.grad is not None or grads[name].grad is None, f"{case.name}: tfsn gives {name} a gradient, eager none"
    grad_scale = max(p.grad.abs().max().item() for _, p in trained)
    _, atol = TOLERANCE[dtype or torch.float32]
    for name, p in trained:
        zero = zero_grad_mask(case, name, p)
        close_or_no_farther_from_truth(grads[name].grad[~zero], p.grad[~zero], f"{case.name} grad of {name}", dtype,
                                       truth(name, ~zero))
        if zero.any():
            for run, g in (("eager", p.grad), ("tfsn", grads[name].grad)):
                noise = g[zero].abs().max().item()
                assert noise <= atol * grad_scale, \
                    f"{case.name} {run} grad of {name}: {noise} where exact arithmetic gives 0"
    compare_parameters(eager, mine, f"{case.name} after one forward", dtype)     # BatchNorm's buffers


def test_an_fp32_gradient_outside_the_tolerance_passes_only_no_farther_from_the_float64_one():
    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    close_or_no_farther_from_truth(torch.tensor([0.9985, 2.0]), torch.tensor([1.001, 2.0]), "near", None, lambda: exact)
    with pytest.raises(AssertionError):          # 3x as far from the truth as eager
        close_or_no_farther_from_truth(torch.tensor([1.003, 2.0]), torch.tensor([1.001, 2.0]), "far", None,
                                       lambda: exact)
    with pytest.raises(AssertionError):          # nearer the truth than eager, but a 16-bit run is not arbitrated
        close_or_no_farther_from_truth(torch.tensor([0.85, 2.0]), torch.tensor([1.2, 2.0]), "bf16", torch.bfloat16,
                                       lambda: exact)


OPTIMIZERS = {
    "sgd": lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
}


def train(model: nn.Module, case: Case, make_optimizer: Callable, compile_with=None,
          clip: float | None = None) -> tuple[list[float], int]:
    """TRAIN_STEPS steps on one batch, each clipping the gradients' norm to `clip` first where given; with a
    backend the model and the step (the optimizer's, or the clip + step function) are compiled. The losses,
    and how many kernels the compiled step generated."""
    opt = make_optimizer(model)

    def clip_and_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    step = opt.step if clip is None else clip_and_step
    fwd = model if compile_with is None else torch.compile(model, backend=compile_with)
    step = step if compile_with is None else torch.compile(step, backend=compile_with)
    inputs, target = case.batch(torch.Generator().manual_seed(1))
    losses, step_kernels = [], 0
    for _ in range(TRAIN_STEPS):
        opt.zero_grad(set_to_none=True)
        _, loss = case.step(fwd, inputs, target)
        loss.backward()
        before = kernels()
        step()
        step_kernels += kernels() - before
        losses.append(loss.item())
    return losses, step_kernels


# one of each kind (the SDPA path of nn.MultiheadAttention is trained inside the encoder layers)
TRAINED = ["gpt", "mha_key_padding", "encoder_postnorm_relu", "encoder_prenorm_gelu", "convnet", "mixer",
           "resmlp_bf16"]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("case", [c for c in cases() if c.name in TRAINED], ids=lambda c: c.name)
def test_training_steps_match_eager(case, optimizer):
    check_training(case, optimizer)


def check_training(case: Case, optimizer: str, make_optimizer: Callable | None = None, compile_with=None,
                   clip: float | None = None) -> None:
    """Three steps on one batch (`optimizer`: OPTIMIZERS' or made by `make_optimizer`; the gradients' norm
    clipped to `clip` first where given; compiled with `compile_with`, default the backend timing 2
    schedules): the loss of each step against eager's; after SGD (with momentum) also every parameter and buffer.

    Parameters after AdamW are not compared. Adam's step is lr * m / sqrt(v), about lr * sign(g) at
    first: it divides out the gradient's size, so an element's relative rounding error becomes an
    absolute error of lr times it in the parameter. The gradient comparison only bounds that
    relative error by rtol + atol * scale / |g|, which is large for small elements; measured here,
    elements at 1e-3..3e-2 of their tensor's largest gradient end 2e-6..2e-5 apart after 3 steps
    (fp32 tolerance of those parameters: 7e-7), elements whose gradient is 0 in exact arithmetic
    (`case.zero_grad`: rounding noise in both runs) move by a full lr of either sign, and under bf16
    autocast a few dozen elements at 1e-5..2e-2 of the largest flip sign (0.02 apart). The AdamW losses
    are compared at every step (steps 2 and 3 run on the updated parameters), and the update itself,
    given the same gradients, is compared exactly in test_optimizer_correctness.py
    (test_adamw_step_alone_matches_eager_and_is_generated). SGD moves every element by lr times its
    gradient, so its parameters carry the gradients' own tolerance: compared, zero-grad ones too."""
    make_optimizer = make_optimizer or OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    eager = case.build()
    mine = copy.deepcopy(eager)
    expected, _ = train(eager, case, make_optimizer, clip=clip)
    before = kernels()
    actual, step_kernels = train(mine, case, make_optimizer, compile_with or make_backend(top_k=2), clip)
    what = f"{'clipped ' if clip is not None else ''}{optimizer}"
    assert kernels() > before, "the backend generated no kernel: the model ran as plain ATen"
    assert step_kernels > 0, f"the {what} step generated no kernel: it ran as plain ATen"
    assert expected[-1] < expected[0], "the eager run should learn on one batch"

    low = low_precision(case)
    rtol = TOLERANCE[low][0] if low else LOSS_RTOL
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rtol * max(1.0, abs(e)), f"{case.name} {what} step {step}: tfsn loss {a} vs eager {e}"
    if optimizer.startswith("sgd"):
        compare_parameters(eager, mine, f"{case.name} after {TRAIN_STEPS} {what} steps", low)


@pytest.mark.parametrize("attn", ATTENTION, ids=lambda a: a.name)
def test_scaled_dot_product_attention_matches_eager(attn: Attention):
    """F.scaled_dot_product_attention between generated ops (so the graph has kernels and SDPA's
    inputs and output gradient come from them): output, gradients of q, k, v and of a float mask
    that requires grad. Catches a forward and backward that do not belong together (the decomposed
    forward with ATen's flash backward gave wrong q, k, v gradients)."""
    tensors = attn.inputs(torch.Generator().manual_seed(0))

    def fn(q, k, v, *mask):
        return attn(torch.tanh(q), k * 1.5, v + 0.5, *mask).sin()

    def grad_leaves():
        return [t.detach().clone().requires_grad_(i < 3 or attn.mask_grad) for i, t in enumerate(tensors)]
    ref, mine = grad_leaves(), grad_leaves()
    out = fn(*ref)
    compiled = torch.compile(fn, backend=make_backend())
    before = kernels()
    got = compiled(*mine)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    out.backward(grad)
    got.backward(grad)
    assert kernels() > before, "the backend generated no kernel: the graph ran as plain ATen"
    assert got.dtype == attn.dtype
    close(got, out, f"sdpa {attn.name} output")
    for a, b, name in zip(mine, ref, ("q", "k", "v", "mask")):
        if b.requires_grad:
            close(a.grad, b.grad, f"sdpa {attn.name} grad of {name}")


def test_bf16_autocast_conversions_and_pointwise_are_generated(monkeypatch):
    """Under bf16 autocast every fp32 <-> bf16 conversion, bf16 GEMM and bf16 pointwise op of the forward
    and backward graphs is a generated C kernel's member (not an ATen call per op), and output, loss and
    gradients match eager (bf16 tolerance)."""
    from optimizer import ir
    case = next(c for c in cases() if c.name == "resmlp_bf16")
    seen = record_compiled(monkeypatch)
    eager, inputs_e, out_e, loss_e, mine, inputs_m, target = stepped_eager(case)
    out_m, loss_m = case.step(torch.compile(mine, backend=make_backend(top_k=1)), inputs_m, target)
    loss_m.backward()

    assert len(seen) == 2, f"{len(seen)} graphs compiled where autocast's step is a forward and a backward"
    conversions = products = halves = 0
    for graph, groups in seen:
        as_aten = {n for g in groups if g.kind == "extern" for n in g.nodes}
        for node in graph.nodes:
            dtypes = {node.type.dtype, *(graph.nodes[i].type.dtype for i in node.inputs)} if node.type else set()
            if "bfloat16" not in dtypes or node.kind == ir.Kind.VIEW:
                continue
            if node.op in ("aten.mm.default", "aten.addmm.default"):
                products += 1
            elif node.op == "aten._to_copy.default":
                conversions += 1
            elif node.kind == ir.Kind.POINTWISE:
                halves += 1
            assert node.kind != ir.Kind.EXTERN and node.index not in as_aten, f"{node.name} ({node.op}) runs as ATen"
    assert conversions >= 10 and products >= 10 and halves > 0, \
        f"{conversions} conversions, {products} GEMMs, {halves} bf16 pointwise ops seen"
    close(out_m, out_e, "resmlp_bf16 output", torch.bfloat16)
    close(loss_m, loss_e, "resmlp_bf16 loss", torch.bfloat16)
    for name, p in mine.named_parameters():
        close(p.grad, dict(eager.named_parameters())[name].grad, f"resmlp_bf16 grad of {name}", torch.bfloat16)
