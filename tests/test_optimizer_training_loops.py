"""Compiled models across training loops as researchers write them, step by step against eager PyTorch:
validation in eval mode and under no_grad / inference_mode between steps, epochs that end on a smaller
batch, sequence lengths that change every batch, a temperature annealed every step, an lr schedule with
the optimizer's step compiled, fine-tuning (layers frozen mid-run, a parameter group added), loss scaling
with skipped steps, clipping by value, an EMA of the weights, seeded dropout, and a checkpoint of a compiled
model restored into a plain one. Besides the values, each test counts what was compiled: a recompile every
step, or a graph left to ATen, is a failure here, not only a slow step.
"""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before optimizer imports triton: kernels run on CPU tensors

import copy  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import tfsn  # noqa: E402
from optimizer import backend, graphs  # noqa: E402
from optimizer.backend import make_backend  # noqa: E402
from optimizer.schedule import DEFAULT  # noqa: E402
from tests.test_optimizer_graphs import Rerun, close  # noqa: E402


@pytest.fixture(autouse=True)
def fresh(tmp_path_factory, monkeypatch):
    """A compile cache shared by this module's tests (the same models' graphs searched and built once), and no
    dynamo state or backend STATS carried between them."""
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path_factory.getbasetemp() / "tfsn-cache-training-loops"))
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(backend, "STATS", dict.fromkeys(backend.STATS, 0))    # what this test compiled
    yield
    torch._dynamo.reset()


class SeededRerun(Rerun):
    """Rerun, drawing no random numbers while capturing: a CUDA graph's capture runs nothing, and each replay
    draws what an eager run would (the generator's offset is advanced per replay)."""

    def capture(self, run, inputs):
        state = torch.get_rng_state()
        try:
            return super().capture(run, inputs)
        finally:
            torch.set_rng_state(state)


@pytest.fixture
def replayed(monkeypatch):
    """Every graph replayed as the stand-in of a CUDA graph (optimizer/graphs.py's contract on this CPU)."""
    monkeypatch.setattr(graphs, "recorder_for", lambda device: SeededRerun())
    for k in graphs.COUNTS:
        graphs.COUNTS[k] = 0
    return graphs.COUNTS


def frames() -> int:
    """Frames Dynamo compiled so far (each recompile is one more)."""
    return counters["stats"]["unique_graphs"]


def same_weights(mine: nn.Module, eager: nn.Module, what: str) -> None:
    for (name, p), q in zip(eager.state_dict().items(), mine.state_dict().values()):
        close(q.float(), p.float(), f"{name} {what}")


class BatchNormNet(nn.Module):
    """Linear (no bias: BatchNorm removes it, its gradient is exactly zero only in eager's order of sums),
    BatchNorm, ReLU, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def loader(sizes, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_epochs_ending_on_a_smaller_batch_with_validation_between_match_eager_with_generated_kernels(codegen):
    """DataLoader(drop_last=False) through `torch.compile(model, backend=...)`: the smaller last batch makes
    Dynamo's graph dynamic, and that graph serves every later step. It ran as ATen (a log line once), so from
    the first epoch's end nothing was generated; it now compiles at each shape it meets (backend.PerShape).
    Between epochs: eval under no_grad and under inference_mode, then train again (BatchNorm switches to its
    running stats and back, which must match eager's)."""
    if codegen == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    eager = BatchNormNet()
    mine = copy.deepcopy(eager)
    model = torch.compile(mine, backend=make_backend(schedule=DEFAULT, codegen=codegen))
    opt_e, opt_m = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, mine))
    epoch, (val, _) = loader((6, 6, 4)), loader((5,), seed=2)[0]
    for e in range(2):
        for i, (x, y) in enumerate(epoch):
            losses = []
            for m, opt in ((eager, opt_e), (model, opt_m)):
                opt.zero_grad()
                losses.append(F.cross_entropy(m(x), y))
                losses[-1].backward()
                opt.step()
            close(losses[1], losses[0], f"loss at epoch {e} batch {i}")
        eager.eval(), mine.eval()
        with torch.no_grad():
            close(model(val), eager(val), f"validation under no_grad after epoch {e}")
        with torch.inference_mode():
            close(model(val), eager(val), f"validation under inference_mode after epoch {e}")
        eager.train(), mine.train()
        same_weights(mine, eager, f"after epoch {e}")
    assert backend.STATS["aten_graphs"] == 0, f"a graph ran as ATen: {backend.STATS}"


class CumulativeNorm(nn.Module):
    """BatchNorm with momentum=None (a cumulative average: 1 / num_batches_tracked, a graph break in Dynamo)
    and one that keeps no running stats."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16, momentum=None), \
            nn.Linear(16, 3, bias=False)
        self.out = nn.BatchNorm1d(3, affine=False, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc2(F.relu(self.bn(self.fc1(x)))))


def whole_step(model, opt, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward, backward, step and zero_grad in one function, compiled as one (Dynamo splits it)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def ema_loop(average: nn.Module, model: nn.Module, decay: float) -> None:
    """An EMA by a Python loop over parameters, buffers copied."""
    with torch.no_grad():
        for a, p in zip(average.parameters(), model.parameters()):
            a.mul_(decay).add_(p.detach(), alpha=1 - decay)
        for a, b in zip(average.buffers(), model.buffers()):
            a.copy_(b)


def test_one_compiled_step_function_train_mode_under_no_grad_eval_with_input_gradients_and_a_loop_ema():
    """Beside the steps: a train-mode forward under no_grad (BatchNorm's stats still move), an eval forward
    with gradients on and an input that requires them (a saliency map), and an EMA of another module."""
    be = make_backend(schedule=DEFAULT)
    torch.manual_seed(0)
    eager = CumulativeNorm()
    mine = copy.deepcopy(eager)
    averages = copy.deepcopy(eager), copy.deepcopy(eager)
    model = torch.compile(mine, backend=be)
    opt_e, opt_m = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (eager, mine))
    step, ema = torch.compile(whole_step, backend=be), torch.compile(ema_loop, backend=be)
    for i, (x, y) in enumerate(loader([6] * 6)):
        close(step(model, opt_m, x, y), whole_step(eager, opt_e, x, y), f"loss at step {i}")
        ema(averages[1], mine, 0.8)
        ema_loop(averages[0], eager, 0.8)
        with torch.no_grad():
            close(model(x), eager(x), f"train-mode output under no_grad at step {i}")
        eager.eval(), mine.eval()
        inputs = [x.clone().requires_grad_() for _ in range(2)]
        outs = [eager(inputs[0]), model(inputs[1])]
        close(outs[1], outs[0], f"eval output at step {i}")
        for out in outs:
            out.sum().backward()
        close(inputs[1].grad, inputs[0].grad, f"input's gradient in eval at step {i}")
        eager.train(), mine.train()
        same_weights(mine, eager, f"at step {i}")
        same_weights(averages[1], averages[0], f"(EMA) at step {i}")
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


class Tokens(nn.Module):
    """Embedding, LayerNorm, a GELU MLP and a head, over sequences of any length."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln, self.fc, self.head = nn.Embedding(11, 12), nn.LayerNorm(12), nn.Linear(12, 12), \
            nn.Linear(12, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + F.gelu(self.fc(self.ln(h)))
        return self.head(h)


def test_sequence_lengths_that_change_every_batch_are_all_generated_past_dynamos_recompile_limit():
    """tfsn.optimize compiled with dynamic=False: a frame recompiled at each length until Dynamo's limit (8),
    then ran in eager for good (a warning from Dynamo). Now Dynamo's graph turns dynamic at the second length
    and tfsn generates each length once (the first a static graph, then SHAPES_PER_GRAPH shapes of the dynamic
    one: 9 lengths, one more than Dynamo's limit)."""
    torch.manual_seed(0)
    eager = Tokens()
    mine = copy.deepcopy(eager)
    model = tfsn.optimize(mine, schedule=DEFAULT)
    g = torch.Generator().manual_seed(1)
    lengths = range(3, 3 + 1 + backend.SHAPES_PER_GRAPH)
    for t in lengths:
        tokens = torch.randint(0, 11, (2, t), generator=g)
        before = backend.STATS["graphs"]
        for m in (eager, model):
            F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        assert backend.STATS["graphs"] == before + 2, f"length {t}: no forward and backward generated"
        for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
            close(q.grad, p.grad, f"grad of {name} after length {t}")
    assert frames() <= 2, f"{frames()} frames compiled for {len(lengths)} lengths"
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


class Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.tau = nn.Linear(8, 5), 1.0

    def forward(self, x: torch.Tensor, weight: float) -> torch.Tensor:
        return F.log_softmax(self.fc(x) / self.tau, -1) * weight


def test_a_temperature_annealed_every_step_compiles_once_through_tfsn_optimize():
    """A float attribute and a float argument that change every step: Dynamo makes them graph inputs from
    their second value. With tfsn.optimize's former dynamic=False they were constants: 8 recompiles, then
    eager for the rest of the run."""
    eager = Tempered()
    mine = copy.deepcopy(eager)
    model = tfsn.optimize(mine, schedule=DEFAULT)
    x = torch.randn(4, 8)
    for i in range(12):
        eager.tau = mine.tau = 1.0 - 0.05 * i
        outs = [m(x, 0.5 + 0.1 * i) for m in (eager, model)]
        for out in outs:
            out.sum().backward()
        close(outs[1], outs[0], f"output at step {i}")
        close(mine.fc.weight.grad, eager.fc.weight.grad, f"weight's gradient at step {i}")
    assert frames() <= 2, f"{frames()} frames compiled for 12 steps"
    assert backend.STATS["graphs"] <= 4 and backend.STATS["aten_graphs"] == 0, backend.STATS


class WarmedUp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * (1.0 / (1 + step)) + step * 0.01 - step


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_a_step_number_passed_as_an_int_every_call_compiles_once_and_matches_eager(codegen, replayed):
    """An int argument that changes every call (a step or epoch number scaling the output), in epochs that end on
    a smaller batch: Dynamo makes it a symbolic int from its second value, which PerShape specialized per value
    (and per batch): a search and a compile at every step, and from the 9th step on the step ran as ATen. Its
    scalar is now an input of the generated graph, which is generated once per batch size."""
    eager = WarmedUp()
    mine = copy.deepcopy(eager)
    model = tfsn.optimize(mine, top_k=1, codegen=codegen)
    for step in range(12):
        x = torch.randn(3 if step % 4 == 3 else 4, 8)
        outs = [m(x, step) for m in (eager, model)]
        for out in outs:
            out.square().sum().backward()
        close(outs[1], outs[0], f"output at step {step}")
        close(mine.fc.weight.grad, eager.fc.weight.grad, f"weight's gradient at step {step}")
    assert frames() <= 3, f"{frames()} frames compiled for 12 steps"
    assert backend.STATS["graphs"] <= 8 and backend.STATS["aten_graphs"] == 0, backend.STATS
    assert replayed["replays"] > 0, replayed


class CountedInInt32(nn.Module):
    """A model counting the steps it has seen in a 0-d int32 buffer, the step added to it every call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.register_buffer("seen", torch.tensor(7, dtype=torch.int32))

    def forward(self, x: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tanh(self.fc(x)) - step, self.seen + step, self.seen * step


def test_a_step_int_beside_a_0_d_int32_counter_keeps_the_counters_dtype_and_wraps_as_eager():
    """Regression: the step, made a 0-d int64 tensor where it meets a tensor directly, promoted a 0-d int32
    counter (two 0-d tensors promote each other; a Python int does not): `seen + step` came back int64 where eager
    gives int32, from the second step on, in epochs that end on a smaller batch. As a tensor of the counter's
    dtype, a step past int32 wraps as eager wraps it (torch.scalar_tensor raised on the overflow)."""
    eager = CountedInInt32()
    mine = copy.deepcopy(eager)
    model = tfsn.optimize(mine, top_k=1)
    for k, step in enumerate([0, 1, 2, 3, 2**31 + 5, 5, -3]):
        x = torch.randn(3 if k % 4 == 3 else 4, 8)
        outs = [m(x, step) for m in (eager, model)]
        for out in outs:
            out[0].square().sum().backward()
        close(outs[1][0], outs[0][0], f"output at step {step}")
        for a, e in zip(outs[1][1:], outs[0][1:]):
            assert a.dtype == e.dtype and torch.equal(a, e), (step, a, e)
        close(mine.fc.weight.grad, eager.fc.weight.grad, f"weight's gradient at step {step}")
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


def warmup_cosine(step: int) -> float:
    return min(1.0, (step + 1) / 4) * 0.5 * (1 + math.cos(math.pi * step / 12))


def test_an_lr_schedule_changing_lr_every_step_with_the_step_compiled_matches_eager_without_recompiles():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    mine = copy.deepcopy(eager)
    model = torch.compile(mine, backend=make_backend(schedule=DEFAULT))
    opt_e, opt_m = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (eager, mine))
    sched_e, sched_m = (torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine) for o in (opt_e, opt_m))
    step = torch.compile(opt_m.step, backend=make_backend(schedule=DEFAULT))
    for i, (x, y) in enumerate(loader([6] * 12)):
        for m, opt, s, sched in ((eager, opt_e, opt_e.step, sched_e), (model, opt_m, step, sched_m)):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            s()
            sched.step()
        same_weights(mine, eager, f"at step {i}")
    assert frames() <= 5, f"{frames()} frames compiled for 12 steps: the lr recompiles the step"
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


class FineTuned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU())
        self.head, self.extra = nn.Linear(16, 3), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + 0.5 * self.extra(h)


def ema_update(average: list, params: list, decay: float) -> None:
    with torch.no_grad():
        torch._foreach_mul_(average, decay)
        torch._foreach_add_(average, [p.detach() for p in params], alpha=1 - decay)


def unscale(params: list, inverse_scale: float) -> torch.Tensor:
    """GradScaler's unscale_ by hand: whether every gradient is finite."""
    grads = [p.grad for p in params if p.grad is not None]
    torch._foreach_mul_(grads, inverse_scale)
    return torch.stack([torch.isfinite(g).all() for g in grads]).all()


def fine_tune(codegen: str) -> None:
    """Head only at first (extra frozen), then the body frozen at step 4 and extra unfrozen as a new param group
    at step 6; loss scaled by 2**10 and unscaled in a compiled function (by inf at step 7: skipped), gradients
    clipped by value, an EMA of the weights updated by a compiled foreach function; zero_grad to None and to
    zeros in turn. Every step against eager."""
    be = make_backend(schedule=DEFAULT, codegen=codegen)
    torch.manual_seed(0)
    eager = FineTuned()
    mine = copy.deepcopy(eager)
    for m in (eager, mine):
        m.extra.requires_grad_(False)
    averages = [[p.detach().clone() for p in m.parameters()] for m in (eager, mine)]
    opts = [torch.optim.AdamW([p for n, p in m.named_parameters() if not n.startswith("extra")], lr=1e-2,
                              weight_decay=0.1) for m in (eager, mine)]
    runs = [(eager, eager, opts[0], opts[0].step, unscale, ema_update, averages[0]),
            (mine, torch.compile(mine, backend=be), opts[1], torch.compile(opts[1].step, backend=be),
             torch.compile(unscale, backend=be), torch.compile(ema_update, backend=be), averages[1])]
    for i, (x, y) in enumerate(loader([6] * 9)):
        if i == 4:
            for m, *_ in runs:
                m.body.requires_grad_(False)
        if i == 6:
            for m, _, opt, *_ in runs:
                m.extra.requires_grad_(True)
                opt.add_param_group({"params": list(m.extra.parameters()), "lr": 3e-3})
        scale = float("inf") if i == 7 else 2.0 ** 10      # an overflow: the step is skipped
        finite = []
        for m, call, opt, step, unscale_, ema, average in runs:
            opt.zero_grad(set_to_none=i % 2 == 0)
            (F.cross_entropy(call(x), y) * scale).backward()
            finite.append(bool(unscale_(list(m.parameters()), 1 / scale)))
            torch.nn.utils.clip_grad_value_(m.parameters(), 0.05)
            if finite[-1]:
                step()
            ema(average, list(m.parameters()), 0.9)
        assert finite == [i != 7] * 2, f"step {i}: finite gradients (eager, tfsn) {finite}"
        same_weights(mine, eager, f"at step {i}")
        for a, b in zip(*averages):
            close(b, a, f"EMA at step {i}")
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_fine_tuning_with_frozen_layers_a_new_group_loss_scaling_clipping_and_an_ema_matches_eager(codegen):
    if codegen == "triton":
        pytest.importorskip("triton")
    fine_tune(codegen)


def test_fine_tuning_replayed_as_cuda_graphs_matches_eager(replayed):
    fine_tune("c")
    assert replayed["replays"] > 0, replayed


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


def dropout_losses(compile_with, seed: int = 0) -> list[float]:
    """Training losses (dropout on) and validation losses (eval: off) of a seeded run."""
    torch.manual_seed(0)
    net = Dropped()
    model = torch.compile(net, backend=compile_with)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.manual_seed(seed)
    losses = []
    for x, y in loader([5] * 5):
        net.train()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        net.eval()
        with torch.no_grad():
            losses += [loss.item(), F.cross_entropy(model(x), y).item()]
    return losses


def test_seeded_dropout_gives_the_same_losses_run_to_run_and_aot_eagers(replayed):
    """The same seed, the same masks: tfsn draws dropout's random numbers as AOTAutograd's graph does (ATen's
    rand), replayed or not."""
    tfsn_backend = make_backend(schedule=DEFAULT)
    first = dropout_losses(tfsn_backend)
    assert dropout_losses(tfsn_backend) == first
    assert dropout_losses(tfsn_backend, seed=1) != first
    torch.testing.assert_close(first, dropout_losses("aot_eager"), rtol=1e-5, atol=1e-6)
    assert replayed["replays"] > 0, replayed


def test_a_checkpoint_of_a_compiled_model_restores_into_a_plain_one_and_back(tmp_path):
    """torch.compile's module keys its state `_orig_mod.`-prefixed (load_state_dict between a compiled and a
    plain model fails, as with any backend); the SDK's checkpoints are keyed without it, so a run saved
    compiled resumes plain and the other way, its losses those of an uninterrupted run."""
    def build():
        torch.manual_seed(0)
        return BatchNormNet()
    data = loader([6] * 6)

    def train(net, compiled: bool, stop: int, run=None) -> list[float]:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        model = tfsn.optimize(net, schedule=DEFAULT) if compiled else net
        step = torch.compile(opt.step, backend=make_backend(schedule=DEFAULT)) if compiled else opt.step
        start = run.restore(model=model, optimizer=opt) if run else 0
        losses = []
        for i in range(start, stop):
            opt.zero_grad()
            loss = F.cross_entropy(model(data[i][0]), data[i][1])
            loss.backward()
            step()
            losses.append(loss.item())
            if run:
                run.step = i
                run.checkpoint(model=model, optimizer=opt)
        return losses
    assert list(tfsn.optimize(build()).state_dict())[0].startswith("_orig_mod.")
    uninterrupted = train(build(), False, 6)
    for saved_compiled in (True, False):
        folder = tmp_path / str(saved_compiled)
        first = train(build(), saved_compiled, 4, tfsn.init(checkpoint_dir=folder, checkpoint_interval=3,
                                                            async_save=False))
        rest = train(build(), not saved_compiled, 6, tfsn.init(checkpoint_dir=folder, checkpoint_interval=3,
                                                               async_save=False))
        torch.testing.assert_close(first[:3] + rest, uninterrupted, rtol=1e-5, atol=1e-6)


def test_adversarial_training_alternating_inputs_that_require_grad_and_not_matches_eager(replayed):
    """FGSM: the input's gradient by autograd.grad (a batch that requires grad: forward and backward graphs
    of their own), then a step on the perturbed batch (one that does not), replayed."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3))
    mine = copy.deepcopy(eager)
    model = torch.compile(mine, backend=make_backend(schedule=DEFAULT))
    opt_e, opt_m = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, mine))
    for i, (x, y) in enumerate(loader([6] * 6)):
        results = []
        for m, opt in ((eager, opt_e), (model, opt_m)):
            attacked = x.clone().requires_grad_()
            loss = F.cross_entropy(m(attacked), y)
            grad, = torch.autograd.grad(loss, attacked)
            opt.zero_grad()
            adversarial = F.cross_entropy(m((x + 0.1 * grad.sign()).detach()), y)
            adversarial.backward()
            opt.step()
            results.append((loss.detach(), grad, adversarial.detach()))
        for got, want, what in zip(*results[::-1], ("loss", "input's gradient", "adversarial loss")):
            close(got, want, f"{what} at step {i}")
        same_weights(mine, eager, f"at step {i}")
    assert replayed["replays"] > 0 and backend.STATS["aten_graphs"] == 0, (replayed, backend.STATS)


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


def clipped_step(model, module: nn.Module, opt, x: torch.Tensor, y: torch.Tensor, foreach: bool, norm_type: float,
                 overflow: bool) -> tuple:
    """Backward, clip_grad_norm_ (an inf gradient planted on an overflow: error_if_nonfinite=False lets it
    through, the total norm is inf and the gradients NaN or zero as in eager), clip_grad_value_, step."""
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if overflow:
        module.fc1.bias.grad[0] = float("inf")
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5, norm_type=norm_type, foreach=foreach,
                                          error_if_nonfinite=False)
    torch.nn.utils.clip_grad_value_(module.parameters(), 0.05, foreach=foreach)
    opt.step()
    return loss, norm


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_and_value_compiled_with_the_step_match_eager_through_an_inf_gradient(foreach, norm_type):
    torch.manual_seed(0)
    eager = NormedMLP()
    mine = copy.deepcopy(eager)
    be = make_backend(schedule=DEFAULT)
    model = torch.compile(mine, backend=be)
    opt_e, opt_m = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, mine))
    step = torch.compile(clipped_step, backend=be)
    for i, (x, y) in enumerate(loader([6] * 3)):
        got = step(model, mine, opt_m, x, y, foreach, norm_type, i == 1)
        want = clipped_step(eager, eager, opt_e, x, y, foreach, norm_type, i == 1)
        for g, w, what in zip(got, want, ("loss", "total norm")):
            torch.testing.assert_close(g, w, rtol=2e-4, atol=2e-5, equal_nan=True, msg=lambda m: f"{what} {i}: {m}")
        for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
            torch.testing.assert_close(q, p, rtol=2e-4, atol=2e-5, equal_nan=True, msg=lambda m: f"{name} {i}: {m}")
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_bf16_weights_with_fp32_masters_and_fp16_loss_scaling_by_hand_match_eager(codegen):
    """Two low-precision recipes written by hand: a bf16 model whose AdamW steps fp32 master copies (gradients
    upcast, weights copied back); an fp16 model trained with a static loss scale, unscaled with mul_, the
    step skipped when torch.isfinite(...).all() says an inf got in (a scale of inf at step 2)."""
    if codegen == "triton":
        pytest.importorskip("triton")
    be = make_backend(schedule=DEFAULT, codegen=codegen)
    torch.manual_seed(0)
    eager = NormedMLP().bfloat16()
    mine = copy.deepcopy(eager)
    masters = [[p.detach().float().clone().requires_grad_() for p in m.parameters()] for m in (eager, mine)]
    runs = [(eager, eager, masters[0], torch.optim.AdamW(masters[0], lr=1e-2)),
            (mine, torch.compile(mine, backend=be), masters[1], torch.optim.AdamW(masters[1], lr=1e-2))]
    for i, (x, y) in enumerate(loader([6] * 3)):
        for m, call, master, opt in runs:
            m.zero_grad(set_to_none=True)
            F.cross_entropy(call(x.bfloat16()).float(), y).backward()
            for p, q in zip(m.parameters(), master):
                q.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for p, q in zip(m.parameters(), master):
                    p.copy_(q)
        for a, b in zip(*masters):      # bf16 gradients: eager's and tfsn's roundings differ by an ulp
            torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2, msg=lambda m: f"master weight at step {i}: {m}")
    torch.manual_seed(0)
    eager = NormedMLP().half()
    mine = copy.deepcopy(eager)
    runs = [(eager, eager), (mine, torch.compile(mine, backend=be))]
    for i, (x, y) in enumerate(loader([6] * 4)):
        scale = math.inf if i == 2 else 2.0 ** 8
        finite = []
        for m, call in runs:
            m.zero_grad()
            (F.cross_entropy(call(x.half()).float(), y) * scale).backward()
            grads = [p.grad for p in m.parameters()]
            torch._foreach_mul_(grads, 1 / scale)
            finite.append(bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()))
            if finite[-1]:
                with torch.no_grad():
                    torch._foreach_add_(list(m.parameters()), grads, alpha=-0.1)
        assert finite == [i != 2] * 2, f"step {i}: finite gradients (eager, tfsn) {finite}"
        for (name, p), q in zip(eager.named_parameters(), mine.parameters()):   # fp16: an ulp is 1e-3 at 1
            torch.testing.assert_close(q.float(), p.float(), rtol=1e-2, atol=1e-2, msg=lambda m: f"{name} {i}: {m}")
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


class TiedLM(nn.Module):
    """The head's weight is the embedding's (gradients of both uses summed), a frozen projection between."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.frozen, self.ln = nn.Embedding(13, 10), nn.Linear(10, 10), nn.LayerNorm(10)
        self.head = nn.Linear(10, 13, bias=False)
        self.head.weight = self.emb.weight
        self.frozen.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.head(self.ln(F.relu(self.frozen(h)) + h))


def keep_first_rows(grad: torch.Tensor) -> torch.Tensor:
    """A partially frozen embedding: the first three tokens' rows get no gradient."""
    grad = grad.clone()
    grad[:3] = 0
    return grad


def test_a_tied_embedding_with_a_row_freezing_hook_and_a_frozen_layer_matches_eager():
    torch.manual_seed(0)
    eager = TiedLM()
    mine = copy.deepcopy(eager)
    assert mine.head.weight is mine.emb.weight
    for m in (eager, mine):
        m.emb.weight.register_hook(keep_first_rows)
    model = torch.compile(mine, backend=make_backend(schedule=DEFAULT))
    opts = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (eager, mine)]
    frozen_rows = eager.emb.weight[:3].detach().clone()
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        tokens = torch.randint(0, 13, (3, 6), generator=g)
        for call, opt in ((eager, opts[0]), (model, opts[1])):
            opt.zero_grad()
            F.cross_entropy(call(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opt.step()
        close(mine.emb.weight.grad, eager.emb.weight.grad, f"tied weight's gradient at step {i}")
        same_weights(mine, eager, f"at step {i}")
    assert mine.frozen.weight.grad is None and torch.equal(mine.emb.weight[:3], frozen_rows)   # no decay
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


class CrossAttention(nn.Module):
    """MultiheadAttention with keys and values of their own widths, per-head weights returned, and a causal,
    padded TransformerEncoder (nested tensors off) over its output."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(12, 3, kdim=7, vdim=5, batch_first=True)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(12, 3, 20, dropout=0.0, batch_first=True), 2,
                                         enable_nested_tensor=False)

    def forward(self, q, k, v, key_pad, query_pad) -> tuple:
        h, weights = self.attn(q, k, v, key_padding_mask=key_pad, need_weights=True, average_attn_weights=False)
        causal = nn.Transformer.generate_square_subsequent_mask(q.shape[1])
        return self.enc(h, mask=causal, src_key_padding_mask=query_pad, is_causal=True), weights


def attention_batch(n: int, g: torch.Generator) -> tuple:
    key_pad, query_pad = torch.zeros(n, 6, dtype=torch.bool), torch.zeros(n, 4, dtype=torch.bool)
    key_pad[-1, -2:] = query_pad[0, -1] = True
    return torch.randn(n, 4, 12, generator=g), torch.randn(n, 6, 7, generator=g), torch.randn(n, 6, 5, generator=g), \
        key_pad, query_pad


def test_multihead_attention_per_head_weights_and_a_masked_encoder_train_and_evaluate_as_eager():
    """SGD, not Adam: the key projection's bias has a gradient of zero in exact arithmetic (softmax ignores a
    shift shared by every key), so its rounding noise, which differs between any two orders of sums (eager
    against eager in another order too), would be blown up to steps of lr by Adam's normalisation."""
    torch.manual_seed(0)
    eager = CrossAttention()
    mine = copy.deepcopy(eager)
    model = torch.compile(mine, backend=make_backend(schedule=DEFAULT))
    opt_e, opt_m = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, mine))
    g = torch.Generator().manual_seed(1)
    validation = attention_batch(2, g)
    for i, n in enumerate((3, 3, 2)):
        batch = attention_batch(n, g)
        results = []
        for m, opt in ((eager, opt_e), (model, opt_m)):
            opt.zero_grad()
            out, weights = m(*batch)
            (out.square().mean() + (weights * torch.arange(6.0)).sum()).backward()
            opt.step()
            results.append((out, weights))
        close(results[1][0], results[0][0], f"output at step {i}")
        close(results[1][1], results[0][1], f"per-head attention weights at step {i}")
        same_weights(mine, eager, f"at step {i}")
        eager.eval(), mine.eval()
        with torch.no_grad():
            close(model(*validation)[0], eager(*validation)[0], f"validation after step {i}")
        eager.train(), mine.train()
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


class ConvBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.fc = nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.gelu(self.conv2(F.relu(self.bn(self.conv1(x))))).mean((2, 3)))


def test_a_channels_last_conv_net_fed_channels_last_transposed_and_partial_batches_matches_eager():
    """The model in channels_last, its inputs channels_last, then a smaller batch, then a transposed view;
    BatchNorm's running stats checked after each step and an inference_mode evaluation between steps."""
    torch.manual_seed(0)
    eager = ConvBatchNorm().to(memory_format=torch.channels_last)
    mine = copy.deepcopy(eager)
    model = torch.compile(mine, backend=make_backend(schedule=DEFAULT))
    opt_e, opt_m = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, mine))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(n, 3, 7, 9, generator=g).contiguous(memory_format=torch.channels_last) for n in (3, 3, 2)]
    batches.append(torch.randn(3, 3, 9, 7, generator=g).transpose(2, 3))
    for i, x in enumerate(batches):
        losses = []
        for m, opt in ((eager, opt_e), (model, opt_m)):
            opt.zero_grad()
            losses.append(m(x).square().mean())
            losses[-1].backward()
            opt.step()
        close(losses[1], losses[0], f"loss at step {i}")
        same_weights(mine, eager, f"at step {i}")
        eager.eval(), mine.eval()
        with torch.inference_mode():
            close(model(batches[0]), eager(batches[0]), f"evaluation after step {i}")
        eager.train(), mine.train()
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


class Constrained(nn.Module):
    """Parametrized and stat-keeping layers that write buffers or rebuild weights at every forward: a Conv1d
    under spectral_norm (its power iteration updates u and v in train mode), InstanceNorm1d keeping running
    stats (averaged over the batch, then used in eval), a Linear kept orthogonal."""

    def __init__(self) -> None:
        super().__init__()
        P = nn.utils.parametrizations
        self.conv = P.spectral_norm(nn.Conv1d(3, 6, 3, padding=1))
        self.norm = nn.InstanceNorm1d(6, affine=True, track_running_stats=True)
        self.mix, self.head = P.orthogonal(nn.Linear(6, 6)), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.norm(self.conv(x)), 0.2).mean(-1)
        return self.head(torch.tanh(self.mix(h)))


def test_spectral_norm_instance_norm_running_stats_and_an_orthogonal_weight_train_and_evaluate_as_eager():
    torch.manual_seed(0)
    eager = Constrained()
    mine = copy.deepcopy(eager)
    model = torch.compile(mine, backend=make_backend(schedule=DEFAULT))
    opt_e, opt_m = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, mine))
    g = torch.Generator().manual_seed(1)
    validation = torch.randn(2, 3, 7, generator=g)
    for i, n in enumerate((4, 4, 3)):
        x = torch.randn(n, 3, 7, generator=g)
        for m, opt in ((eager, opt_e), (model, opt_m)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        same_weights(mine, eager, f"(u, v and running stats too) at step {i}")
        eager.eval(), mine.eval()
        with torch.no_grad():
            close(model(validation), eager(validation), f"validation after step {i}")
        eager.train(), mine.train()
    assert backend.STATS["aten_graphs"] == 0, backend.STATS


def test_a_language_model_fed_token_slices_is_replayed_and_matches_eager(replayed, caplog):
    """tokens[:, :-1] of each new batch: an input that moves between calls and is not contiguous (strides
    (T + 1, 1)). torch._debug_has_internal_overlap answers "too hard" for it, which was read as "overlaps
    itself": the forward graph ran unrecorded for good (no CUDA graph in every LM training loop that slices
    its inputs). graphs._overlaps_itself decides from the strides."""
    torch.manual_seed(0)
    eager = Tokens()
    mine = copy.deepcopy(eager)
    model = torch.compile(mine, backend=make_backend(schedule=DEFAULT))
    opt_e, opt_m = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, mine))
    g = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.INFO, logger="tfsn.optimizer"):
        for i in range(6):
            tokens = torch.randint(0, 11, (3, 6), generator=g)
            for m, opt in ((eager, opt_e), (model, opt_m)):
                opt.zero_grad()
                F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
                opt.step()
            same_weights(mine, eager, f"at step {i}")
    unrecorded = [r.getMessage() for r in caplog.records if "runs unrecorded" in r.getMessage()]
    assert not unrecorded and replayed["replays"] > 0, (unrecorded, replayed)
