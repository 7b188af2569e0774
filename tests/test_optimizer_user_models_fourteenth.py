"""A fourteenth set of user code (tests/user_models_fourteenth.py): hand-written and recent optimizers (Lion,
LAMB, Muon, Sophia, schedule-free AdamW, a factored Adafactor, Kahan-compensated and stochastically rounded
bf16 weights) and the training-step mechanics around them (gradient accumulation, an EMA by lerp_, a
GradScaler-like unscale that skips a step by torch.where, an lr as a 0-d tensor), each optimizer's step compiled
together with the EMA, and the model compiled, against eager PyTorch step by step: the losses, then every
parameter, optimizer state and averaged weight. T5's relative-position buckets and ALiBi's slopes computed in
the graph, as models: forward output, loss and gradients in fp32, fp64 and under bf16 autocast, on the C
target and a subset through the Triton kernels (on this CPU under TRITON_INTERPRET=1); SAM's two passes with
both half-steps compiled. Every compiled step must generate kernels and leave no graph to ATen.

torch.optim.Adafactor is not among them: its step calls .item() on the step count and the parameter's norm
inside its loop over the parameters, and Dynamo, which cannot resume a graph broken inside a loop, runs that
whole function eagerly (no graph reaches the backend: zero kernels, eager's values). With
capture_scalar_outputs=True the graph has data-dependent (unbacked) scalars, which tfsn runs as ATen, logged.
FactoredAdafactor is the same algorithm without .item()."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from optimizer.backend import make_backend  # noqa: E402
from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models import close, kernels  # noqa: E402
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, no_graph_left_to_aten  # noqa: E402
from tests.user_models_fourteenth import (LAMB, SAM, DynamicLossScaler, FactoredAdafactor, KahanSGD, Lion, Muon,  # noqa: E402
                                          NormedMLP, ScheduleFreeAdamW, SophiaG, StochasticRoundingAdamW, cases, muon_groups)

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["t5_relative_buckets"]

# The models are not trained with SGD and AdamW here (training_steps_test): the optimizers below train NormedMLP,
# and the graphs these two add to a step are their forward's and backward's, checked here.
test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)


# name: (the optimizer of a model, the model's dtype[, the dtype whose tolerance the results get: Muon's update is
# computed in bf16, so the parameters differ by lr times bf16's rounding of it])
OPTIMIZERS: dict[str, tuple] = {
    "lion": (lambda m: Lion(m.parameters(), lr=3e-3, weight_decay=0.1), torch.float32),
    "lamb": (lambda m: LAMB(m.parameters(), lr=2e-2), torch.float32),
    "muon": (lambda m: Muon(muon_groups(m)), torch.float32, torch.bfloat16),
    "sophia": (lambda m: SophiaG(m.parameters()), torch.float32),
    "schedule_free_adamw": (lambda m: ScheduleFreeAdamW(m.parameters()), torch.float32),
    "adafactor": (lambda m: FactoredAdafactor(m.parameters()), torch.float32),
    "kahan_sgd_bf16": (lambda m: KahanSGD(m.parameters()), torch.bfloat16),
    "stochastic_rounding_adamw_bf16": (lambda m: StochasticRoundingAdamW(m.parameters()), torch.bfloat16),
}
THROUGH_TRITON_OPTIMIZERS = ["lion"]
MICRO_BATCHES = 2
STEPS = 3
EMA_DECAY = 0.9


def micro_batches(dtype: torch.dtype) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 7, generator=g).to(dtype), torch.randint(0, 5, (5,), generator=g))
            for _ in range(MICRO_BATCHES)]


def train_with(model: nn.Module, optimizer: torch.optim.Optimizer, compile_with=None) -> tuple[list[float], list, int]:
    """STEPS steps, each accumulating the gradients of MICRO_BATCHES micro-batches (the loss divided by their
    count), then the optimizer's step and the EMA's lerp_ toward the new weights, one function (compiled with
    `compile_with` where given, as the model); Sophia's hessian refreshed every other step. The summed losses, the
    EMA, and how many kernels the compiled steps generated."""
    ema = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        optimizer.step()
        with torch.no_grad():
            for average, p in zip(ema, model.parameters()):
                average.lerp_(p, 1 - EMA_DECAY)
    forward = model if compile_with is None else torch.compile(model, backend=compile_with)
    step = step if compile_with is None else torch.compile(step, backend=compile_with)
    refresh = getattr(optimizer, "update_hessian", None)
    if refresh is not None and compile_with is not None:
        refresh = torch.compile(refresh, backend=compile_with)
    losses, step_kernels = [], 0
    for k in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in micro_batches(next(model.parameters()).dtype):
            loss = F.cross_entropy(forward(x), y) / MICRO_BATCHES
            loss.backward()
            total += loss.item()
        before = kernels()
        if refresh is not None and k % 2 == 0:
            refresh()
        step()
        step_kernels += kernels() - before
        losses.append(total)
    return losses, ema, step_kernels


@pytest.mark.parametrize("name, codegen", [(n, "c") for n in OPTIMIZERS]
                         + [(n, "triton") for n in THROUGH_TRITON_OPTIMIZERS])
def test_hand_written_optimizer_steps_match_eager(name: str, codegen: str):
    """The losses of every step, then every parameter, optimizer state and EMA weight, against eager's, at the
    tolerance of the model's dtype."""
    if codegen == "triton":
        pytest.importorskip("triton")
    make_optimizer, dtype, *precision = OPTIMIZERS[name]
    torch.manual_seed(0)
    eager = NormedMLP().to(dtype)
    mine = copy.deepcopy(eager)
    opt_e, opt_m = make_optimizer(eager), make_optimizer(mine)
    expected, ema_e, _ = train_with(eager, opt_e)
    actual = []

    def compiled_training() -> None:
        losses, ema_m, step_kernels = train_with(mine, opt_m, make_backend(codegen=codegen))
        actual.extend([losses, ema_m])
        assert step_kernels > 0, f"the {name} step generated no kernel: it ran as plain ATen"
    no_graph_left_to_aten(compiled_training)
    losses, ema_m = actual
    assert expected[-1] < expected[0], f"the eager {name} run should learn"
    precision = precision[0] if precision else dtype
    rtol = 2.0 ** -7 if precision == torch.bfloat16 else 1e-4 if precision == torch.float32 else 1e-12
    for k, (a, e) in enumerate(zip(losses, expected)):
        assert abs(a - e) <= rtol * max(1.0, abs(e)), f"{name} step {k}: tfsn loss {a} vs eager {e}"
    for (what, p), q, average_e, average_m in zip(eager.named_parameters(), mine.parameters(), ema_e, ema_m):
        close(q, p, f"{name} {what} after {STEPS} steps", precision)
        close(average_m, average_e, f"{name} EMA of {what}", precision)
        for key, value in compared_state(p, opt_e.state[p]).items():
            close(compared_state(q, opt_m.state[q])[key], value, f"{name} state {key} of {what}", precision)


def compared_state(p: torch.Tensor, state: dict) -> dict:
    """An optimizer's tensor state, as compared: Kahan's compensation is the part of the weight that bf16 rounds
    away, so where a gradient's rounding moves the rounded weight by an ulp it moves by one too; the
    compensated weight p - c is compared in its place."""
    compared = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
    if "compensation" in compared:
        compared["compensated weight"] = p.float() - compared.pop("compensation").float()
    return compared


def scaled_training(model: nn.Module, compile_with=None) -> tuple[list[float], DynamicLossScaler]:
    """Five steps of DynamicLossScaler's training, the loss times the scale backward, an inf in the third step's
    batch (its gradients NaN: the step is skipped), the lr tensor decayed in place after each step; the model
    and the step compiled with `compile_with` where given. The losses and the scaler."""
    scaler = DynamicLossScaler(model.parameters(), torch.tensor(0.05))
    forward = model if compile_with is None else torch.compile(model, backend=compile_with)
    step = scaler.step if compile_with is None else torch.compile(scaler.step, backend=compile_with)
    (x, y), _ = micro_batches(torch.float32)
    losses = []
    for k in range(5):
        for p in model.parameters():
            p.grad = None
        batch = x.clone()
        if k == 2:
            batch[1, 3] = float("inf")
        loss = F.cross_entropy(forward(batch), y)
        (loss * scaler.scale).backward()
        step()
        scaler.lr.mul_(0.7)
        losses.append(loss.item())
    return losses, scaler


def trained_eagerly_and_by_tfsn(training) -> tuple:
    """The same NormedMLP trained by `training(model, compile_with=None)` eagerly and with tfsn's backend (which
    must generate kernels and leave no graph to ATen): (eager's model, tfsn's model, eager's result, tfsn's)."""
    torch.manual_seed(0)
    eager = NormedMLP()
    mine = copy.deepcopy(eager)
    expected = training(eager)
    actual = []
    before = kernels()
    no_graph_left_to_aten(lambda: actual.extend(training(mine, make_backend())))
    assert kernels() > before, "the backend generated no kernel"
    return eager, mine, expected, tuple(actual)


def test_a_loss_scaled_step_that_skips_an_overflow_by_where_with_a_tensor_lr_matches_eager():
    """The losses (the overflow's NaN too), parameters, momenta, the scale (2^12 doubled after two clean steps,
    halved by the overflow, doubled again) and the count of clean steps against eager's; kernels generated."""
    eager, mine, (expected, scaler_e), (losses, scaler_m) = trained_eagerly_and_by_tfsn(scaled_training)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0, equal_nan=True)
    assert scaler_e.scale.item() == 2.0 ** 13 and scaler_m.scale.item() == scaler_e.scale.item()
    assert scaler_m.clean_steps.item() == scaler_e.clean_steps.item()
    for (what, p), q, buf_e, buf_m in zip(eager.named_parameters(), mine.parameters(), scaler_e.momenta,
                                          scaler_m.momenta):
        close(q, p, f"{what} after the loss-scaled steps")
        close(buf_m, buf_e, f"momentum of {what}")


def sam_training(model: nn.Module, compile_with=None) -> tuple[list[float], SAM]:
    """Three SAM steps (SGD with momentum as the base), each two forward and backward passes of the batch, the
    model and both half-steps compiled with `compile_with` where given. The first pass's losses and SAM."""
    sam = SAM(model.parameters(), torch.optim.SGD, rho=0.1, lr=0.05, momentum=0.9)
    compiled = (lambda f: f) if compile_with is None else (lambda f: torch.compile(f, backend=compile_with))
    forward, first_step, second_step = compiled(model), compiled(sam.first_step), compiled(sam.second_step)
    (x, y), _ = micro_batches(torch.float32)
    losses = []
    for _ in range(3):
        sam.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        first_step()
        sam.zero_grad(set_to_none=True)
        F.cross_entropy(forward(x), y).backward()
        second_step()
        losses.append(loss.item())
    return losses, sam


def test_sam_two_passes_with_both_half_steps_compiled_matches_eager():
    """The losses, parameters and the base SGD's momenta against eager's; the half-steps generated kernels."""
    eager, mine, (expected, sam_e), (losses, sam_m) = trained_eagerly_and_by_tfsn(sam_training)
    assert expected[-1] < expected[0], "the eager SAM run should learn"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    for (what, p), q in zip(eager.named_parameters(), mine.parameters()):
        close(q, p, f"{what} after the SAM steps")
        close(sam_m.base.state[q]["momentum_buffer"], sam_e.base.state[p]["momentum_buffer"], f"momentum of {what}")
