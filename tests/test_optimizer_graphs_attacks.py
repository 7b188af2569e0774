"""Review of optimizer/graphs.py: training and inference loops written as users write them, each compared
with eager PyTorch step by step through the stand-in recorder of tests/test_optimizer_graphs.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from optimizer import graphs
from tests import test_optimizer_graphs as base
from tests.test_optimizer_graphs import STEPS, backend, batches, close, pair

setup = base.setup      # its autouse fixture: the stand-in recorder, counts reset


class Two(nn.Module):
    """Several outputs in a dict: an activation, a view of it, a transposed view, and a view of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(24, 24), nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> dict:
        h = torch.tanh(self.lin(x))
        return {"h": h, "first": h[:, 0], "t": h.transpose(1, 2), "x0": x[:, 1], "logits": self.head(h).mean(1)}


def grads_close(eager, tfsn, what):
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        if p.grad is None:
            assert q.grad is None, f"{what}: {name}"
        else:
            close(q.grad, p.grad, f"{what}: grad of {name}")


def test_dict_of_outputs_views_of_each_other_and_of_a_moving_offset_input():
    eager, tfsn = pair(Two)
    model = torch.compile(tfsn, backend=backend())
    g = torch.Generator().manual_seed(3)
    for i in range(STEPS):
        big = torch.randn(3, 9, 24, generator=g)
        x = big[:, 2:9]                    # a view with a storage offset, a new storage each step
        for m in (eager, model):
            m.zero_grad()
        oe, ot = eager(x), model(x)
        for k in oe:
            close(ot[k], oe[k], f"{k} at step {i}")
        assert ot["first"].untyped_storage().data_ptr() == ot["h"].untyped_storage().data_ptr()
        assert ot["x0"].data_ptr() == x[:, 1].data_ptr(), "x0 must alias the caller's input"
        for o in (oe, ot):
            (o["logits"].square().sum() + o["first"].sum() + o["t"][:, 3].sum()).backward()
        grads_close(eager, tfsn, f"step {i}")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


def test_user_writes_outputs_in_place_and_keeps_them():
    """`out.add_(1)` on an output, kept in a list; views of outputs kept too."""
    eager, tfsn = pair(Two)
    model = torch.compile(tfsn, backend=backend())
    kept_e, kept_t = [], []
    for i, (x, _) in enumerate(batches(STEPS)):
        with torch.no_grad():
            for m, kept in ((eager, kept_e), (model, kept_t)):
                o = m(x)
                o["logits"].add_(1)
                kept.append((o["logits"], o["h"][:, 0]))
                o["h"].mul_(2)          # written through the base: the kept view sees it
    for i, ((le, fe), (lt, ft)) in enumerate(zip(kept_e, kept_t)):
        close(lt, le, f"logits kept from step {i}")
        close(ft, fe, f"view kept from step {i}")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


def test_retain_graph_then_second_backward_and_autograd_grad():
    eager, tfsn = pair()
    model = torch.compile(tfsn, backend=backend())
    for i, (x, y) in enumerate(batches(STEPS)):
        res = []
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x), y)
            loss.backward(retain_graph=True)
            first = [p.grad.clone() for p in m.parameters() if p.grad is not None]
            loss.backward(retain_graph=True)
            ag = torch.autograd.grad(2 * loss, [p for p in m.parameters() if p.requires_grad])
            res.append((first, ag))
        for a, b in zip(res[0][0], res[1][0]):
            close(b, a, f"first backward at step {i}")
        for a, b in zip(res[0][1], res[1][1]):
            close(b, a, f"autograd.grad at step {i}")
        grads_close(eager, tfsn, f"two backwards at step {i}")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


class Drop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(24, 24), nn.BatchNorm1d(7), nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.lin(x)))).mean(1)


def test_training_with_batchnorm_interleaved_with_no_grad_eval_and_mode_switches():
    eager, tfsn = pair(Drop)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_t = torch.optim.SGD(tfsn.parameters(), lr=0.1, momentum=0.9)
    model = torch.compile(tfsn, backend=backend())
    val = batches(1, (3, 7, 24))[0][0] + 1
    for i, (x, y) in enumerate(batches(2 * STEPS)):
        for m, opt in ((eager, opt_e), (model, opt_t)):
            m.train()
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        close(tfsn.bn.running_mean, eager.bn.running_mean, f"running mean at step {i}")
        close(tfsn.bn.running_var, eager.bn.running_var, f"running var at step {i}")
        if i % 2:
            for m in (eager, model):
                m.eval()
            with torch.no_grad():
                close(model(val), eager(val), f"eval at step {i}")
            with torch.no_grad():       # train-mode forward without grad: writes the statistics
                for m in (eager, model):
                    m.train()
                close(model(val), eager(val), f"no-grad train forward at step {i}")
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q, p, f"{name} at the end")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


class TwoIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(24, 5), nn.Linear(7, 5)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum(1) + self.b(z.transpose(1, 2)).sum(1)


@pytest.mark.parametrize("how", ["same", "transposed", "expanded", "overwritten"])
def test_inputs_aliased_strided_expanded_or_overwritten_in_place(how):
    eager, tfsn = pair(TwoIn)
    model = torch.compile(tfsn, backend=backend())
    static = torch.zeros(3, 7, 24)
    for i, (x, _) in enumerate(batches(STEPS)):
        if how == "same":
            args = (x, x)
        elif how == "transposed":
            base = x.transpose(1, 2).contiguous()       # (3, 24, 7), new storage each step
            args = (base.transpose(1, 2), x)
        elif how == "expanded":
            args = (x[:1].expand(3, 7, 24), x[1:2].expand(3, 7, 24))
        else:
            static.copy_(x)
            args = (static, static)
        for m in (eager, model):
            m.zero_grad()
        oe, ot = eager(*args), model(*args)
        close(ot, oe, f"{how} output at step {i}")
        oe.square().sum().backward()
        ot.square().sum().backward()
        grads_close(eager, tfsn, f"{how} step {i}")


def test_a_normal_loop_holding_out_and_loss_until_the_next_call_is_replayed():
    """FAILED before the review's fix: the labels are an input of the graph that moves, so its buffer was
    left uninitialised at the capture, and the stand-in (which runs the capture) raised an index error: the
    graph ran unrecorded, no replay at all. On a GPU the capture runs nothing, so this hid only coverage:
    no graph reading labels or token ids was ever replayed in these tests.
    `out = model(x)` keeps the last step's output alive while the next call runs; a loss computed in
    the model too; a grad norm clipped in place; gradients logged by reference."""
    eager, tfsn = pair()
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_t = torch.optim.AdamW(tfsn.parameters(), lr=1e-2)

    def step_fn(m, x, y):
        out = m(x)
        return out, F.cross_entropy(out, y)

    compiled = torch.compile(lambda x, y: step_fn(tfsn, x, y), backend=backend())
    logged_e, logged_t = [], []
    for i, (x, y) in enumerate(batches(2 * STEPS)):
        for run, m, opt, logged in ((lambda x, y: step_fn(eager, x, y), eager, opt_e, logged_e),
                                    (compiled, tfsn, opt_t, logged_t)):
            out, loss = run(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            logged.append(m.head.weight.grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
    for i, (a, b) in enumerate(zip(logged_e, logged_t)):
        close(b, a, f"logged gradient of step {i}")
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q, p, f"{name} at the end")
    assert graphs.COUNTS["replays"] >= STEPS, graphs.COUNTS


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


class Stack(nn.Module):
    """Blocks of one class compiled one by one (regional compilation): one code object, one graph per
    shape, called once per block with that block's parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Layer() for _ in range(4))
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean(1)


def test_regional_compilation_blocks_share_one_graph():
    eager, tfsn = pair(Stack)
    for b in tfsn.blocks:
        b.compile(backend=backend())
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(tfsn.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches(STEPS)):
        for m, opt in ((eager, opt_e), (tfsn, opt_t)):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q, p, f"{name} at the end")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


def test_shared_parameter_two_models_and_a_varying_last_batch():
    eager, tfsn = pair()
    other_e = nn.Linear(24, 5)
    other_t = copy.deepcopy(other_e)
    other_e.weight = eager.head.weight              # tied
    other_t.weight = tfsn.head.weight
    m1, m2 = torch.compile(tfsn, backend=backend()), torch.compile(other_t, backend=backend())
    opt_e = torch.optim.SGD(list(eager.parameters()) + [other_e.bias], lr=0.1)
    opt_t = torch.optim.SGD(list(tfsn.parameters()) + [other_t.bias], lr=0.1)
    data = batches(STEPS) + batches(2, (2, 7, 24)) + batches(STEPS)
    for i, (x, y) in enumerate(data):
        for a, b, opt in ((eager, other_e, opt_e), (m1, m2, opt_t)):
            opt.zero_grad()
            (F.cross_entropy(a(x), y) + b(x).mean()).backward()
            opt.step()
        close(tfsn.head.weight, eager.head.weight, f"tied weight at step {i}")
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q, p, f"{name} at the end")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


class Cell(nn.Module):
    """A recurrent cell: the state it returns is its next input; a graph break in the middle."""

    def __init__(self, brk: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.head, self.brk = nn.Linear(24, 24), nn.Linear(24, 24), nn.Linear(24, 5), brk

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = torch.tanh(self.a(x) + h)
        if self.brk:
            torch._dynamo.graph_break()
        h = torch.tanh(self.b(u)) * 0.5 + h * 0.5
        return self.head(h).mean(1), h


@pytest.mark.parametrize("brk", [False, True])
def test_recurrent_state_fed_back_with_truncated_backprop(brk):
    eager, tfsn = pair(lambda: Cell(brk))
    model = torch.compile(tfsn, backend=backend())
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(tfsn.parameters(), lr=0.1)
    he = ht = torch.zeros(3, 7, 24)
    for i, (x, y) in enumerate(batches(3 * STEPS)):
        oe, he = eager(x, he)
        ot, ht = model(x, ht)
        close(ot, oe, f"output at step {i}")
        for o, opt in ((oe, opt_e), (ot, opt_t)):
            opt.zero_grad()
            F.cross_entropy(o, y).backward()
            opt.step()
        he, ht = he.detach(), ht.detach()
        close(ht, he, f"state at step {i}")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


def test_a_model_applied_to_its_own_output():
    eager, tfsn = pair(Layer)
    model = torch.compile(tfsn, backend=backend())
    for i, (x, _) in enumerate(batches(STEPS)):
        with torch.no_grad():
            close(model(model(x)), eager(eager(x)), f"twice at step {i}")
        tfsn.zero_grad()
        eager.zero_grad()
        model(model(x)).sum().backward()
        eager(eager(x)).sum().backward()
        grads_close(eager, tfsn, f"step {i}")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


def test_compiled_adamw_after_a_parameter_moves_and_inference_mode_evaluation():
    """A parameter given new storage after the optimizer's graph was captured: the step must write the
    parameter the model reads, not a buffer of its own."""
    eager, tfsn = pair()
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_t = torch.optim.AdamW(tfsn.parameters(), lr=1e-2)
    model, step = torch.compile(tfsn, backend=backend()), torch.compile(opt_t.step, backend=backend())
    val = batches(1)[0][0] - 1
    for i, (x, y) in enumerate(batches(3 * STEPS)):
        if i in (4, 9):
            for m in (eager, tfsn):
                m.head.weight.data = m.head.weight.data.clone()
        for m, opt, s in ((eager, opt_e, opt_e.step), (model, opt_t, step)):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            s()
        close(tfsn.head.weight, eager.head.weight, f"moved weight after step {i}")
        if i % 3 == 2:
            with torch.inference_mode():
                close(model(val), eager(val), f"inference at step {i}")
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q, p, f"{name} at the end")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


def test_two_threads_serving_one_compiled_model(monkeypatch):
    """An inference server: request threads share one compiled model. A replay that lets go of the GIL
    (a GPU's graph.replay() does; the stand-in sleeps to say so) lets another thread's replay write over
    the outputs the first is about to return."""
    import threading
    import time

    class Slow(base.Rerun):
        def capture(self, run, inputs):
            outputs, replay = super().capture(run, inputs)

            def slow(now):
                replay(now)
                time.sleep(0.01)
            return outputs, slow

    monkeypatch.setattr(graphs, "recorder_for", lambda device: Slow())
    eager, tfsn = pair(Layer)
    model = torch.compile(tfsn, backend=backend())
    static = {k: torch.zeros(3, 7, 24) for k in range(2)}
    wrong = []

    def serve(k):
        g = torch.Generator().manual_seed(k)
        for i in range(STEPS):
            static[k].copy_(torch.randn(3, 7, 24, generator=g))      # each thread's own request buffer
            with torch.no_grad():
                got, want = model(static[k]), eager(static[k])
            if not torch.allclose(got, want, rtol=2e-4, atol=2e-5):
                wrong.append((k, i))
    with torch.no_grad():
        for _ in range(3):
            model(static[0])            # captured before the threads start
    threads = [threading.Thread(target=serve, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, f"(thread, request) answered with another request's output: {wrong}; {graphs.COUNTS}"


@pytest.mark.parametrize("dynamic", [False, None])
def test_epochs_whose_last_batch_is_smaller_keep_replaying(dynamic):
    """DataLoader's default drop_last=False: each epoch ends on a smaller batch. With dynamic=False a graph for
    each batch size, each recorded apart; left to Dynamo's automatic dynamic shapes (tfsn.optimize's default),
    the smaller batch makes a graph of symbolic sizes serve every later step, which tfsn compiles at each
    shape (backend.PerShape), each of those recorded apart. (It ran such a graph as ATen: no kernel of its
    own and no replay from the first epoch's end on.)"""
    eager, tfsn = pair()
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(tfsn.parameters(), lr=0.1)
    model = torch.compile(tfsn, backend=backend(), dynamic=dynamic)
    epoch = batches(4) + batches(1, (2, 7, 24))
    replays = []
    for e in range(4):
        for i, (x, y) in enumerate(epoch):
            for m, opt in ((eager, opt_e), (model, opt_t)):
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                opt.step()
        replays.append(graphs.COUNTS["replays"])
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q, p, f"{name} at the end")
    assert replays[-1] > replays[-2], f"replays counted after each epoch: {replays}; {graphs.COUNTS}"
