"""The tfsn backend trains every suite model like eager PyTorch does.

Tolerances (fp32): generated kernels sum in a different order than ATen (SIMD lanes, row blocks),
so values match to rtol=1e-4 and atol=1e-5 times the largest magnitude of the expected tensor;
losses over several training steps stay within 1e-4 relative of eager's.
"""
from __future__ import annotations

import copy
import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch
import torch.nn as nn
import torch.nn.functional as F

from optimizer import backend
from optimizer.backend import make_backend, optimize
from optimizer.schedule import DEFAULT
from optimizer.fusion import compute_readers
from optimizer.ir import Kind, Ref
from tests.optimizer_models import MaskedAttention, concatenations, input_free, input_free_kernels, suite

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def fresh(tmp_path_factory, monkeypatch):
    """A shared compile cache for this module, and no dynamo state carried between tests (its
    recompile limit would otherwise send later models to eager without a word)."""
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path_factory.getbasetemp() / "tfsn-cache"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.detach().abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=RTOL, atol=ATOL * max(scale, 1e-3),
                               msg=lambda m: f"{what}: {m}")


def compiled_kernels(fn) -> int:
    """Run fn; how many generated kernels the backend compiled meanwhile."""
    before = backend.STATS["kernels"]
    fn()
    return backend.STATS["kernels"] - before


@pytest.mark.parametrize("case", suite(), ids=lambda c: c.name)
def test_suite_model_loss_and_gradients_match_eager(case):
    torch.manual_seed(0)
    eager = case.build()
    tfsn = copy.deepcopy(eager)
    batch = case.batch(torch.Generator().manual_seed(1))
    loss = case.loss(eager, batch)
    loss.backward()
    compiled = torch.compile(tfsn, backend=make_backend())

    def step():
        out = case.loss(compiled, batch)
        out.backward()
        close(out, loss, f"{case.name} loss")
    assert compiled_kernels(step) > 0, "the backend generated no kernel: the model ran as plain ATen"
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q.grad, p.grad, f"{case.name} grad of {name}")
    for (name, b), c in zip(eager.named_buffers(), tfsn.buffers()):   # BatchNorm running stats
        close(c, b, f"{case.name} buffer {name}")


def train(model: nn.Module, case, steps: int, compile_with=None) -> list[float]:
    """`steps` AdamW steps on one batch; the optimizer step compiled too when a backend is given."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    fwd = model if compile_with is None else torch.compile(model, backend=compile_with)
    opt_step = opt.step if compile_with is None else torch.compile(opt.step, backend=compile_with)
    batch = case.batch(torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = case.loss(fwd, batch)
        loss.backward()
        opt_step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["gpt2_block", "lm_head_ce"])
def test_training_with_adamw_tracks_the_eager_loss_curve(name):
    case = next(c for c in suite() if c.name == name)
    torch.manual_seed(0)
    eager = case.build()
    tfsn = copy.deepcopy(eager)
    expected = train(eager, case, 4)
    actual = train(tfsn, case, 4, make_backend())
    assert expected[-1] < expected[0], "the eager run should learn on one batch"
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= 1e-4 * max(1.0, abs(e)), f"step {step}: tfsn loss {a} vs eager {e}"
    # Weights are not compared here: the key bias of attention has an exactly-zero gradient
    # (softmax ignores a per-row constant), and Adam turns rounding noise there into full steps.
    # test_adamw_step_alone_matches_eager_and_is_generated checks the update itself.


def test_gpt2_blocks_bias_gradients_are_summed_by_the_kernels_that_store_their_gradients(monkeypatch):
    """In the GPT-2 block's backward, each value a GEMM reads and a Linear's bias gradient sums over rows (GELU's
    gradient, the attention output's, the concatenated q, k, v gradient) is summed by the kernel that computes
    and stores it, not by a kernel of its own; the step's gradients as eager's."""
    compiled = record_compiled(monkeypatch)
    case = next(c for c in suite() if c.name == "gpt2_block")
    torch.manual_seed(0)
    eager = case.build()
    mine = copy.deepcopy(eager)
    batch = case.batch(torch.Generator().manual_seed(0))
    case.loss(eager, batch).backward()
    case.loss(torch.compile(mine, backend=make_backend()), batch).backward()
    for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
        close(q.grad, p.grad, f"grad of {name}")
    graph, groups = compiled[-1]
    group_of = {n: k for k, g in enumerate(groups) for n in g.nodes}
    summed = [(n.index, n.args[0].index) for n in graph.nodes if n.kind == Kind.REDUCE
              and graph.nodes[n.args[0].index].kind == Kind.POINTWISE and any(
                  graph.nodes[r].kind == Kind.MATMUL for r in compute_readers(graph, n.args[0].index))]
    assert len(summed) >= 3, "the backward's bias gradients no longer sum values a GEMM reads"
    apart = [graph.nodes[s].name for s, value in summed if group_of.get(s) != group_of.get(value)]
    assert not apart, f"summed by kernels of their own: {apart}"


def test_adamw_step_alone_matches_eager_and_is_generated():
    torch.manual_seed(0)
    params = [torch.randn(37, 19), torch.randn(83), torch.randn(5, 3, 7)]
    grads = [torch.randn_like(p) for p in params]
    mine = [p.clone().requires_grad_() for p in params]
    ref = [p.clone().requires_grad_() for p in params]
    for group, gs in ((mine, grads), (ref, grads)):
        for p, g in zip(group, gs):
            p.grad = g.clone()
    opt_ref = torch.optim.AdamW(ref, lr=1e-2)
    opt_mine = torch.optim.AdamW(mine, lr=1e-2)
    step = torch.compile(opt_mine.step, backend=make_backend())
    generated = 0
    for _ in range(3):
        opt_ref.step()
        generated += compiled_kernels(step)
    for p, q in zip(mine, ref):
        close(p, q, "AdamW parameter")
    for name in ("exp_avg", "exp_avg_sq"):
        for p, q in zip(mine, ref):
            close(opt_mine.state[p][name], opt_ref.state[q][name], f"AdamW {name}")
    # one kernel per parameter writes its update over parameter and moments (no copy back), and one
    # more computes every step count and bias correction
    assert generated == len(params) + 1, f"the AdamW update took {generated} kernels, not {len(params) + 1}"


def _foreach_arguments(op) -> list:
    """Arguments for a foreach overload, from its schema: lists of two tensors of other shapes (positive, so that
    sqrt, log and pow stay real), a scalar, a list of two scalars, a 0-d tensor, False (copy's non_blocking)."""
    g = torch.Generator().manual_seed(0)

    def tensors() -> list[torch.Tensor]:
        return [torch.rand(3, 5, generator=g) + 0.5, torch.rand(7, generator=g) + 0.5]
    made = {"List[Tensor]": tensors, "number": lambda: 0.75, "List[number]": lambda: [0.75, 1.5],
            "Tensor": lambda: torch.tensor(1.25), "bool": lambda: False}
    return [made[str(a.type)]() for a in op._schema.arguments if not a.kwarg_only]


@pytest.mark.parametrize("op", sorted(backend.foreach_decompositions(), key=str), ids=str)
def test_foreach_decompositions_compute_what_the_foreach_op_does(op):
    args = _foreach_arguments(op)
    want = op(*args)
    got = backend.foreach_decompositions()[op](*args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, equal_nan=True)


FOREACH_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01,
                                               foreach=True),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True, momentum=0.9, weight_decay=0.01,
                                                       foreach=True),
    "radam_decoupled": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True,
                                                    foreach=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, momentum_decay=4e-3, weight_decay=0.01, foreach=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-1, lr_decay=0.01, initial_accumulator_value=0.1,
                                              weight_decay=0.01, foreach=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=0.01, foreach=True),
    # its sign/where step-size update, and the previous gradient kept by _foreach_copy_
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2, step_sizes=(1e-3, 0.05), foreach=True),
}


@pytest.mark.parametrize("name", FOREACH_OPTIMIZERS)
def test_foreach_optimizer_steps_match_eager_and_are_generated(name):
    """torch.optim's foreach updates (the default on a GPU) as generated kernels, one per parameter that writes
    parameter and state in place: no foreach op or copy back left to ATen."""
    torch.manual_seed(0)
    params = [torch.randn(37, 19), torch.randn(83), torch.randn(5, 3, 7)]
    mine = [p.clone().requires_grad_() for p in params]
    ref = [p.clone().requires_grad_() for p in params]
    opt_ref, opt_mine = FOREACH_OPTIMIZERS[name](ref), FOREACH_OPTIMIZERS[name](mine)
    report: list = []
    step = torch.compile(opt_mine.step, backend=make_backend(report=report))
    for i in range(3):
        for p, q in zip(mine, ref):
            p.grad = q.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        opt_ref.step()
        step()
    for p, q in zip(mine, ref):
        close(p, q, f"{name} parameter")
        for key, value in opt_ref.state[q].items():
            close(opt_mine.state[p][key], value, f"{name} {key}")
    assert report, "the step was not searched: no graph compiled to kernels"
    for graph, result in report:
        left = [graph.nodes[g.nodes[0]].op for g in result.plan.groups if g.kind == "extern"]
        assert not [op for op in left if "_foreach_" in op or "copy_" in op], left
        kernels = [g for g in result.plan.groups if g.kind != "extern"]
        assert len(kernels) <= len(params) + 1, f"{len(kernels)} kernels for {len(params)} parameters"


def test_foreach_scalar_maximum_minimum_match_eager_and_are_generated():
    """_foreach_maximum/_foreach_minimum with a scalar or scalar list (ASGD's mu = max(1, ...)) as generated
    clamps that keep NaN, as eager does: no foreach op left to ATen."""
    xs = [torch.randn(37, 19), torch.randn(83)]
    xs[0][3, 4] = float("nan")

    def clamped(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return torch._foreach_minimum(torch._foreach_maximum(xs, -0.5), [0.5, 1.0])
    report: list = []
    for got, expected in zip(torch.compile(clamped, backend=make_backend(report=report))(xs), clamped(xs)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    left = [graph.nodes[g.nodes[0]].op for graph, result in report for g in result.plan.groups if g.kind == "extern"]
    assert report and not [op for op in left if "_foreach_" in op], left


class OddShapes(nn.Module):
    """Residual add + LayerNorm + softmax + bias/GELU on sizes no SIMD width divides."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.ln = nn.Linear(13, 13), nn.LayerNorm(13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x + F.gelu(self.fc(x)))
        return F.softmax(h, dim=-1) * h.sum(dim=0, keepdim=True)


def check_forward_backward(model: nn.Module, *inputs: torch.Tensor, what: str) -> None:
    torch.manual_seed(0)
    eager = model
    mine = copy.deepcopy(model)
    leaves_e = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    leaves_m = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out_e = eager(*leaves_e)
    compiled = torch.compile(mine, backend=make_backend())
    out_m = compiled(*leaves_m)
    close(out_m, out_e, f"{what} output")
    grad = torch.randn_like(out_e)
    out_e.backward(grad)
    out_m.backward(grad)
    for a, b in zip(leaves_m, leaves_e):
        if b.grad is not None:
            close(a.grad, b.grad, f"{what} input grad")
    for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
        close(q.grad, p.grad, f"{what} grad of {name}")


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_odd_sizes(rows):
    check_forward_backward(OddShapes(), torch.randn(rows, 13), what=f"{rows} rows of 13")


def test_non_contiguous_inputs():
    x = torch.randn(13, 2 * 9)[:, ::2].t()          # (9, 13), strided both ways
    assert not x.is_contiguous()
    check_forward_backward(OddShapes(), x, what="transposed, strided input")


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(11, 11)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)                   # a buffer mutated in place
        h = self.fc(x)
        h.add_(x)                            # in-place residual
        h = torch.tanh(h) * 3.0
        h.sub_(1.0)
        return h.relu_()                     # in-place activation


def test_in_place_ops_and_buffer_mutation():
    model = InPlace()
    check_forward_backward(model, torch.randn(6, 11), what="in-place ops")
    compiled_model = InPlace()
    compiled = torch.compile(compiled_model, backend=make_backend())
    with torch.no_grad():
        compiled(torch.randn(2, 11))
        compiled(torch.randn(2, 11))
    assert compiled_model.calls.item() == 2.0


class Unusual(nn.Module):
    """Ops the generator does not cover (sort, cumsum, an integer floor-divide, topk)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        s, _ = torch.sort(h, dim=-1)
        c = torch.cumsum(s, dim=-1)
        k = torch.topk(h, 3, dim=-1).values.sum(-1, keepdim=True)
        idx = torch.div(torch.arange(10), 3, rounding_mode="floor")
        return c * k + h.index_select(1, idx)


def test_unsupported_ops_fall_back_to_aten():
    check_forward_backward(Unusual(), torch.randn(5, 10), what="sort/cumsum/topk")


def test_new_shape_recompiles_and_stays_correct():
    torch.manual_seed(0)
    model = OddShapes()
    compiled = optimize(copy.deepcopy(model))
    for rows in (4, 9, 4):
        x = torch.randn(rows, 13)
        close(compiled(x), model(x), f"{rows} rows")


def test_dynamic_shapes_compile_once_per_shape_and_stay_correct():
    """A graph of symbolic sizes is generated for each shape it runs at (backend.PerShape), not run as ATen."""
    torch.manual_seed(0)
    model = OddShapes()
    compiled = optimize(copy.deepcopy(model), dynamic=True)
    before = dict(backend.STATS)
    for rows in (4, 9, 4):
        x = torch.randn(rows, 13)
        close(compiled(x), model(x), f"{rows} rows, dynamic")
    assert backend.STATS["aten_graphs"] == before["aten_graphs"]
    assert backend.STATS["graphs"] == before["graphs"] + 2, "not one graph for each of the two shapes"


def test_shapes_past_the_limit_run_as_aten_and_the_first_keep_their_kernels(monkeypatch):
    """Sequence lengths that change at every batch would search and compile the graph at each: past
    SHAPES_PER_GRAPH shapes a new one runs as ATen (said once), while the shapes generated keep their kernels."""
    monkeypatch.setattr(backend, "SHAPES_PER_GRAPH", 2)
    torch.manual_seed(0)
    model = OddShapes()
    compiled = optimize(copy.deepcopy(model), dynamic=True)
    before = dict(backend.STATS)
    for rows in (4, 9, 5, 6, 4, 9):
        x = torch.randn(rows, 13)
        close(compiled(x), model(x), f"{rows} rows, dynamic")
    assert backend.STATS["graphs"] == before["graphs"] + 2, "not one graph for each of the first two shapes"
    assert backend.STATS["aten_graphs"] == before["aten_graphs"] + 1, "shapes past the limit not one ATen graph"


@pytest.mark.timeout(120)
def test_sizes_that_depend_on_values_run_as_aten_and_stay_correct():
    """A boolean mask's and nonzero's sizes (captured by Dynamo when asked) stay symbolic at any input shape:
    such a graph runs as ATen. Regression: traced again for its shape, it was a PerShape again, recursing
    without end."""
    lin = nn.Linear(6, 6)

    def masked(x):
        h = lin(x)
        return h[h > 0].sum() + x.nonzero().shape[0]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = optimize(masked)
        before = backend.STATS["aten_graphs"]
        for rows in (4, 5):
            x = torch.randn(rows, 6)
            close(compiled(x), masked(x), f"{rows} rows")
    assert backend.STATS["aten_graphs"] > before


def test_cast_to_bool_is_a_test_against_zero():
    """Regression: the generated cast was `(uint8_t)x`, so 0.5 and the int64 256 became False."""
    def fn(x, n):
        return (x * 0.5).bool(), (n * 2).bool(), (x * 0.5).to(torch.uint8)
    x = torch.tensor([0.25, 1.0, 1.5, -0.0, float("nan"), -0.75, 0.0])
    n = torch.tensor([128, 0, -1, 2 ** 40, 7, 0, 3])
    before = backend.STATS["kernels"]
    got = torch.compile(fn, backend=make_backend())(x, n)
    assert backend.STATS["kernels"] > before
    for g, w in zip(got, fn(x, n)):
        assert torch.equal(g, w), f"{g} where eager gives {w}"


def test_amax_and_amin_propagate_nan_as_torch_does():
    """Regression: the max/min accumulators compared past NaN and dropped it, in rows and columns."""
    def fn(x):
        return x.amax(-1), x.amin(-1), x.amax(0), x.amin(0), torch.softmax(x, -1)
    x = torch.randn(5, 37)
    x[1, 20] = float("nan")
    x[3, 0] = float("nan")
    before = backend.STATS["kernels"]
    got = torch.compile(fn, backend=make_backend())(x)
    assert backend.STATS["kernels"] > before
    for g, w in zip(got, fn(x)):
        torch.testing.assert_close(g, w, equal_nan=True)


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_gradients_match_eager(causal):
    """Regression: the forward of F.scaled_dot_product_attention was decomposed while its backward
    ran ATen's flash backward on the decomposition's probabilities in place of its log-sum-exp."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 11, 8, requires_grad=True) for _ in range(3))
    mine = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q.tanh(), k, v * 2, is_causal=causal)
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))
    got = torch.compile(fn, backend=make_backend())(*mine)
    got.backward(torch.ones_like(got))
    close(got, out, "sdpa output")
    for a, b, name in zip(mine, (q, k, v), "qkv"):
        close(a.grad, b.grad, f"sdpa grad of {name}")


def record_compiled(monkeypatch) -> list:
    """Each graph the backend compiles from now on, as (ir.Graph, the groups it runs), in the list returned."""
    compiled: list = []
    real = backend._compiled

    def recording(graph, groups, *more):
        compiled.append((graph, groups))
        return real(graph, groups, *more)
    monkeypatch.setattr(backend, "_compiled", recording)
    return compiled


def left_to_aten(compiled: list, ops: set[str]) -> list[str]:
    """The calls of `ops` that graphs recorded by record_compiled run as ATen calls (externs)."""
    return [n.op for graph, groups in compiled for g in groups if g.kind == "extern"
            for n in (graph.nodes[g.nodes[0]],) if n.op in ops]


def masked_attention_matches_eager(monkeypatch, mask: str, device: str = "cpu", **options) -> None:
    """MaskedAttention(mask) on `device` compiled by make_backend(**options): loss and gradients as eager's, and
    no value made from constants alone (the causal mask) is a kernel of its own or saved for the backward."""
    compiled = record_compiled(monkeypatch)
    torch.manual_seed(0)
    eager = MaskedAttention(mask).to(device)
    mine = copy.deepcopy(eager)
    x = torch.randn(3, 13, 24).to(device)
    x_eager, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = eager(x_eager).square().mean()
    loss.backward()
    got = torch.compile(mine, backend=make_backend(**options))(x_mine).square().mean()
    got.backward()
    close(got, loss, f"{mask} loss")
    close(x_mine.grad, x_eager.grad, f"{mask} grad of x")
    for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
        close(q.grad, p.grad, f"{mask} grad of {name}")
    assert len(compiled) == 2, f"{len(compiled)} graphs compiled where the step is a forward and a backward"
    for graph, groups in compiled:
        assert not input_free_kernels(graph, groups), f"a kernel computes the mask alone: {groups}"
    forward = compiled[0][0]
    saved = {o.index for o in forward.outputs if isinstance(o, Ref)} & input_free(forward)
    assert not saved, f"the forward returns values made from constants: {[forward.nodes[i].name for i in saved]}"


@pytest.mark.parametrize("mask", ["tril", "arange", "buffer"])
def test_causal_mask_is_computed_in_the_kernels_that_read_it(monkeypatch, mask):
    """A causal mask built in forward (a tril of ones, an arange comparison) is computed inside the
    softmax kernels of the forward and of the backward: no launch of its own, not saved between them.
    (The min-cut already recomputed the arange form; the tril form was saved. A mask kept as a buffer
    is a graph input: that case checks the values only.)"""
    masked_attention_matches_eager(monkeypatch, mask)


def matches_eager(fn, *args, **options) -> None:
    """fn compiled by tfsn (with these backend options) gives eager's results exactly (NaN equal to NaN),
    with kernels generated."""
    torch._dynamo.reset()
    before = backend.STATS["kernels"]
    got = torch.compile(fn, backend=make_backend(**options))(*args)
    assert backend.STATS["kernels"] > before, "no kernel was generated"
    for g, w in zip(got, fn(*args)):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1.3e-6, atol=1e-6)


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_comparisons_promote_as_aten_does(codegen):
    """Regression (review): a 0-d fp64 operand (how dynamo passes a Python float after the first call)
    made the comparison fp64 where eager compares in fp32 (Triton's too, until the dtype idioms fuzz);
    integers were always compared as int64, where eager wraps the scalar into the tensor's type (uint8 >
    -1 is False). Regression (dtype idioms fuzz): a bf16/fp16 tensor was compared with a Python float or
    a 0-d fp32/fp64 tensor in fp32, where eager rounds the other side to the half first: fp16 x == 0.1
    was False for x = fp16(0.1), and bf16(0.2) > 0.2 True."""
    if codegen == "triton":
        pytest.importorskip("triton")
    x = torch.tensor([0.1, 0.2, 0.3])
    for threshold in (0.1, 0.2):
        matches_eager(lambda x, t: (x == t, x <= t, x > t), x, torch.tensor(threshold, dtype=torch.float64),
                      codegen=codegen)
    matches_eager(lambda u: (u + 0 > -1, u * 1 == 255), torch.tensor([0, 3, 255], dtype=torch.uint8), codegen=codegen)
    matches_eager(lambda i: (i + 0 == 256, i * 1 < 2.5), torch.tensor([0, 1, -128], dtype=torch.int8), codegen=codegen)
    matches_eager(lambda n, t: (n * 1 > t,), torch.tensor([16777216, 3]), torch.tensor(16777216.5, dtype=torch.float64),
                  codegen=codegen)
    for half in (torch.float16, torch.bfloat16):
        h = torch.tensor([0.1, 0.2, 0.3, 1 / 3], dtype=half)
        matches_eager(lambda h: (h == 0.1, h > 0.2, h <= 0.3, h * (h < 1 / 3), torch.where(h != 0.2, h, 0.0)), h,
                      codegen=codegen)
        matches_eager(lambda h, t: (h == t, h >= t.double()), h, torch.tensor(0.1), codegen=codegen)
    # GradScaler's overflow test of fp16 values times the scale: isinf and nan_to_num compare |x| with inf,
    # which the product reaches only rounded to fp16 (all-finite was True where eager finds the overflow)
    h = torch.tensor([1.5, -3.0, 0.25], dtype=torch.float16)
    matches_eager(lambda h, s: (torch.isfinite(h * s).all(), torch.isinf(h * s), torch.nan_to_num(h * s)), h,
                  torch.tensor(65536.0), codegen=codegen)


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_conversions_from_halves_round_as_eager(codegen):
    """Regression (dtype idioms fuzz): a bf16/fp16 value computed in fp32 and converted from its half (h.float(),
    .int(), a half softmax's upcast) kept its fp32 bits where eager's value is the half: HF's fp16 mask
    s + finfo.min is -65504 whatever s, so eager's fully masked row has a uniform softmax, tfsn's was
    softmax(s); and the gradient of x.half() * scale (fp32 x) was no fp16 value (4e-4 relative off)."""
    if codegen == "triton":
        pytest.importorskip("triton")
    s = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    keep = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 1, 1]])
    for half in (torch.float16, torch.bfloat16):
        def masked(s, keep, half=half):
            scores = s.to(half) + (1.0 - keep.to(half)) * torch.finfo(half).min
            return scores.float().softmax(-1), scores.softmax(-1), (s.to(half) * 7.3).int()
        matches_eager(masked, s, keep, codegen=codegen)

    def gradient(fn, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        (fn(x).float() * torch.linspace(-2, 2, x.numel()).view(x.shape)).sum().backward()
        return x.grad
    scaled = lambda x: x.half() * torch.tensor(0.3)
    torch._dynamo.reset()
    torch.testing.assert_close(gradient(torch.compile(scaled, backend=make_backend(codegen=codegen)), s),
                               gradient(scaled, s), rtol=0, atol=0)


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_whole_numbers_of_halves_round_the_half_first(codegen):
    """Regression (zoo7a, RoI pooling in fp16): floor, ceil, round and trunc of a bf16/fp16 value computed in
    fp32 stepped at the fp32 value where eager's operand is the half: fp16 2.943 * 1.0195 is 3.0 in eager, its
    ceil 3, where the kernel's fp32 product 3.0008 had ceil 4 (round: 3.4997 in fp32 is 3.5 in fp16, and
    eager rounds that tie to 4). A sampling grid's floor().long() indices moved by a whole pixel so."""
    if codegen == "triton":
        pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    for half in (torch.float16, torch.bfloat16):
        x = torch.linspace(1, 3, 2001).to(half)
        y = (torch.rand(2001, generator=g) * 3).to(half)
        matches_eager(lambda x, y: ((x * y).floor(), (x * y).ceil(), (x * y).round(), (x * y).trunc(),
                                    (x * y).floor().long()), x, y, codegen=codegen)

def test_nan_clamp_bounds_var_over_no_dims_and_0d_reductions():
    """Regressions (review): a NaN clamp bound was ignored; var/var_mean with dim=[] counted one
    element; a 0-d tensor reduced over dim 0 crashed the lowering; an integer prims.fma went
    through a double."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers prims.fma)
    x = torch.randn(5, 7)
    matches_eager(lambda x: ((x * 2).clamp(min=float("nan")), (x * 2).clamp(max=float("nan"))), x)
    matches_eager(lambda x: (*torch.var_mean(x * 2, dim=[]), torch.var(x * 2, dim=[], correction=0)), x)
    a = torch.tensor(3.0)
    matches_eager(lambda a: ((a * 2).sum(dim=0), (a * 2).amax(dim=0, keepdim=True), (a * 2).mean(-1)), a)
    i, j = torch.tensor(6, dtype=torch.int32), torch.tensor(2147483647, dtype=torch.int32)
    matches_eager(lambda i, j: (torch.ops.prims.fma.default(i * 1, j, i),), i, j)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_concatenations_match_eager_forward_and_backward(layout):
    """torch.cat on pieces of every layout (see concatenations), from an input contiguous or not."""
    class Concat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(24, 8) * 0.3)
            self.token = nn.Parameter(torch.randn(1, 1, 8))

        def forward(self, x):
            return concatenations(x, self.w, self.token)

    x = torch.randn(3, 5, 8) if layout == "contiguous" else torch.randn(5, 3, 8).transpose(0, 1)
    check_forward_backward(Concat(), x, what=f"concatenations of a {layout} input")


def test_concatenations_are_generated_kernels_forward_and_backward():
    """Every aten.cat of the forward and the backward (rotate_half's, the class token's, the split's
    gradients') is computed in a generated kernel, none by an ATen call: a cat costs 5-11 us of dispatch
    on tensors of a few hundred elements, a kernel's element a select between its pieces."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from optimizer import fusion, ir
    from optimizer.backend import decompositions
    from optimizer.loopnest import fused_nodes

    def step(x, w, token):
        return torch.autograd.grad(concatenations(x, w, token).square().sum(), (x, w, token))

    args = [torch.randn(3, 5, 8, requires_grad=True), torch.randn(24, 8, requires_grad=True),
            torch.randn(1, 1, 8, requires_grad=True)]
    graph = ir.from_fx(make_fx(step, decomposition_table=decompositions())(*args))
    plan = fusion.plan(graph)
    cats = {n.index for n in graph.nodes if n.op == "aten.cat.default"}
    in_kernels = {n for g in plan.groups if g.kind != "extern" for n in fused_nodes(graph, plan.buffers, g)}
    assert len(cats) >= 6, fusion.describe(graph, plan)          # 5 forward, the split's backward
    assert cats <= in_kernels, fusion.describe(graph, plan)


def test_a_buffer_rolled_by_a_cat_of_its_own_slice_matches_eager():
    """A window updated as cat(window[:, 1:], new) copied back over it: the kernel computing the cat
    reads the window at other elements than it writes, so it must not write over it in place."""
    class Roll(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("window", torch.arange(12.0).view(3, 4))
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():
                self.window.copy_(torch.cat([self.window[:, 1:], x.mean(1, keepdim=True)], dim=1))
            return self.fc(self.window * x)

    torch.manual_seed(0)
    eager = Roll()
    mine = copy.deepcopy(eager)
    compiled = torch.compile(mine, backend=make_backend())
    for step in range(3):
        x = torch.randn(3, 4)
        close(compiled(x), eager(x), f"step {step} output")
        close(mine.window, eager.window, f"step {step} window")


def test_a_buffer_read_through_its_chunks_then_updated_in_place_matches_eager():
    """The chunks of a buffer are slices (views) kernels read; the kernel that writes the buffer's update
    over it in place (an inference graph keeps the mutation) must not run before a read of its old value
    through them, even one the graph makes after the update (a clone inlined into its reader)."""
    class Halves(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("state", torch.arange(12.0).view(4, 3))
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            first, second = self.state.chunk(2)
            old = first.clone()                 # read (inlined into its reader) after the update
            self.state.mul_(0.5).add_(x.mean())
            return self.fc((x * old + second).sum(0))

    torch.manual_seed(0)
    eager = Halves()
    mine = copy.deepcopy(eager)
    compiled = torch.compile(mine, backend=make_backend(schedule=DEFAULT))
    for step in range(3):
        x = torch.randn(2, 3)
        with torch.no_grad():
            close(compiled(x), eager(x), f"step {step} output")
        close(mine.state, eager.state, f"step {step} state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_weight_norm_gradients_match_eager_in_every_float_dtype(dtype):
    """Regression: weight_norm (parametrizations, over dim 0 of a Linear and the last dim of a Conv1d) in a
    model cast to fp16 failed every backward ("expected scalar type Float but found Half": core ATen's
    decomposition returns fp16 norms, ATen's CPU backward wants fp32 ones). Forward and gradients against
    eager: fp32 at the suite's tolerance, fp16/bf16 at four roundings (2^-9, 2^-6 of the scale)."""
    from torch.nn.utils import parametrizations
    torch.manual_seed(0)
    eager = nn.Sequential(parametrizations.weight_norm(nn.Conv1d(3, 5, 3, padding=1), dim=2), nn.Flatten(),
                          nn.Tanh(), parametrizations.weight_norm(nn.Linear(35, 4))).to(dtype)
    mine = copy.deepcopy(eager)
    x = torch.randn(6, 3, 7).to(dtype)
    x_e, x_m = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e = eager(x_e)
    before = backend.STATS["aten_graphs"]
    out_m = torch.compile(mine, backend=make_backend())(x_m)
    grad = torch.randn(out_e.shape).to(dtype)
    out_e.backward(grad)
    out_m.backward(grad)
    assert backend.STATS["aten_graphs"] == before, "a graph ran as ATen"
    tol = {torch.float32: (RTOL, ATOL), torch.float16: (2.0 ** -9, 2.0 ** -9), torch.bfloat16: (2.0 ** -6, 2.0 ** -6)}
    rtol, atol = tol[dtype]
    pairs = [(out_m, out_e, "output"), (x_m.grad, x_e.grad, "input grad")]
    pairs += [(q.grad, p.grad, f"grad of {n}") for (n, p), q in zip(eager.named_parameters(), mine.parameters())]
    for a, e, what in pairs:
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol * e.abs().max().item(), msg=lambda m: f"{what}: {m}")


def test_dropout_under_activation_checkpointing_is_generated_and_matches_eager():
    """Regression: a dropout inside torch.utils.checkpoint (use_reentrant=False) saves the generator's state
    for the backward's recomputation, a byte tensor whose fake size is symbolic; both graphs ran as ATen
    ("symbolic shapes"). Now generated, and with eager's seed the same mask: output and gradients as eager's."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 3)

        def dropped(self, x):
            return F.dropout(torch.tanh(self.fc(x)), 0.3, training=True)

        def forward(self, x):
            return self.out(checkpoint(self.dropped, x, use_reentrant=False))

    torch.manual_seed(0)
    eager = Block()
    mine = copy.deepcopy(eager)
    x = torch.randn(5, 8)
    torch.manual_seed(3)
    out_e = eager(x)
    out_e.square().sum().backward()
    compiled = torch.compile(mine, backend=make_backend())
    before, kernels = backend.STATS["aten_graphs"], backend.STATS["kernels"]
    torch.manual_seed(3)
    out_m = compiled(x)
    out_m.square().sum().backward()
    assert backend.STATS["aten_graphs"] == before, "a graph ran as ATen"
    assert backend.STATS["kernels"] > kernels, "no kernel was generated"
    close(out_m, out_e, "output")
    for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
        close(q.grad, p.grad, f"grad of {name}")


def test_efficient_zero_tensors_of_a_torch_func_hessian_are_generated_as_zeros(monkeypatch):
    """Regression: a PINN's Laplacian by torch.func (vmap of hessian of a functional_call) has a backward graph
    with aten._efficientzerotensor (autograd's gradient known to be zero). It ran as an extern whose ZeroTensor
    has no data (data_ptr 0), and the generated GEMM that read it segfaulted the process. Now a dense zeros:
    no graph holds the op, gradients as eager's (the last bias gets none: the Laplacian does not depend on it)."""
    from torch.func import functional_call, hessian, vmap
    compiled = record_compiled(monkeypatch)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    mine = copy.deepcopy(eager)

    def laplacian_loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        def u(params, point):
            return functional_call(net, params, (point,)).squeeze(-1)
        h = vmap(hessian(u, argnums=1), in_dims=(None, 0))(dict(net.named_parameters()), x)
        return h.diagonal(dim1=-2, dim2=-1).sum(-1).pow(2).mean()

    x = torch.rand(9, 2)
    loss_e = laplacian_loss(eager, x)
    loss_e.backward()
    before = backend.STATS["aten_graphs"]
    loss_m = torch.compile(lambda x: laplacian_loss(mine, x), backend=make_backend())(x)
    loss_m.backward()
    assert backend.STATS["aten_graphs"] == before, "a graph ran as ATen"
    assert len(compiled) == 2, f"{len(compiled)} graphs compiled where a forward and a backward were expected"
    assert not [n.name for graph, _ in compiled for n in graph.nodes if n.op == "aten._efficientzerotensor.default"]
    close(loss_m, loss_e, "loss")
    for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{name}: a gradient in one run only"
        if p.grad is not None:
            close(q.grad, p.grad, f"grad of {name}")


def test_imaginary_parts_of_a_conjugate_keep_their_sign():
    """Regression: `z.conj().imag` traces to _conj, view_as_real, _neg_view and select; the two views only set
    lazy conjugation and negation bits on the same memory, and they ran as externs whose results a kernel read
    as raw memory: every imaginary part of a conjugate came out with its sign flipped (the spectrum of an
    rfft, as a Fourier layer reads it), while the gradients were right. Now negated and conjugated copies:
    outputs and gradients as eager's, and a write through such a view still lands in its base."""
    def spectrum(x, w):
        z = torch.fft.rfft(x * w).conj()
        return torch.tanh(z.imag) * 2 + z.real.sin()

    def written_through(z):
        y = z * 1.0
        y.conj().imag.mul_(2)
        return y

    x, w = torch.randn(3, 8), torch.randn(3, 8)
    xe, we, xm, wm = (t.clone().requires_grad_() for t in (x, w, x, w))
    before = backend.STATS["aten_graphs"]
    out_e, out_m = spectrum(xe, we), torch.compile(spectrum, backend=make_backend())(xm, wm)
    grad = torch.randn(out_e.shape)
    out_e.backward(grad)
    out_m.backward(grad)
    z = torch.randn(3, 4, dtype=torch.cfloat)
    got = torch.compile(written_through, backend=make_backend())(z)
    assert backend.STATS["aten_graphs"] == before, "a graph ran as ATen"
    close(out_m, out_e, "output")
    close(xm.grad, xe.grad, "grad of x")
    close(wm.grad, we.grad, "grad of w")
    torch.testing.assert_close(got, written_through(z))


def test_a_complex_scalar_times_a_real_tensor_differentiates():
    """Regression: the backward of `1j * t` (S4D's A = -exp(log_A_real) + 1j * A_imag) conjugates the scalar 1j,
    which the trace holds as a Python number; the backend's _conj decomposition called conj_physical on it,
    which takes only tensors, and the compile failed ("Expected a value of type 'Tensor' ... found type
    'complex'"). Now a number is left to ATen's _conj: loss and gradients as eager's."""
    def ssm_eigenvalues(log_a, a_imag):
        a = -torch.exp(log_a) + 1j * a_imag
        return (torch.exp(a * 0.3) / a).real.sum()

    log_a, a_imag = torch.randn(5), torch.randn(5)
    le, ie, lm, im = (t.clone().requires_grad_() for t in (log_a, a_imag, log_a, a_imag))
    before = backend.STATS["aten_graphs"]
    loss_e, loss_m = ssm_eigenvalues(le, ie), torch.compile(ssm_eigenvalues, backend=make_backend())(lm, im)
    loss_e.backward()
    loss_m.backward()
    assert backend.STATS["aten_graphs"] == before, "a graph ran as ATen"
    close(loss_m, loss_e, "loss")
    close(lm.grad, le.grad, "grad of log_a")
    close(im.grad, ie.grad, "grad of a_imag")


def test_inputs_with_a_lazy_negation_bit_are_read_as_their_values():
    """Regression: an input that is `z.conj().imag` (the imaginary parts of a conjugated spectrum) carries a
    lazy negation bit over z's memory; the generated kernels read its data pointer and so the values without
    their sign (every element off, by up to 3.5 here). Now resolved before the call: outputs as eager's, and
    a write into such an input lands in z as eager's does. Through Triton: tests/test_optimizer_triton.py."""
    lazy_negation_inputs_match_eager("c")


def test_output_gradients_with_a_lazy_negation_bit_are_read_as_their_values():
    """Regression: `out.backward(g)` with g carrying a lazy negation bit (`torch._neg_view`, the gradient of a
    `.imag` of a conjugate) reached the backward graph as a tangent, which Dynamo does not guard on; the
    kernels read its memory without the sign (every input gradient negated). Now each call's tangents are
    resolved. Through Triton: tests/test_optimizer_triton.py."""
    lazy_negation_gradients_match_eager("c")


def lazy_negation_gradients_match_eager(codegen: str) -> None:
    fn = torch.compile(lambda x: x.sin() * x, backend=make_backend(codegen=codegen))
    g = torch.randn(3, 4)
    for grad in (g, torch._neg_view(g)):       # the same compiled backward: a plain gradient, then a lazy one
        xe, xm = (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_() for _ in "em")
        (xe.sin() * xe).backward(grad)
        fn(xm).backward(grad)
        close(xm.grad, xe.grad, f"grad of x (lazy negation bit: {grad.is_neg()})")


def lazy_negation_inputs_match_eager(codegen: str) -> None:
    def scaled(x, w):
        return (x * w).exp()

    def written(x, w):
        x.add_(w)
        return x.sin() * 2

    z, w = torch.randn(3, 4, dtype=torch.cfloat), torch.randn(3, 4)
    close(torch.compile(scaled, backend=make_backend(codegen=codegen))(z.conj().imag, w), scaled(z.conj().imag, w),
          "output")
    z_eager, z_mine = z.clone(), z.clone()
    expected = written(z_eager.conj().imag, w)
    close(torch.compile(written, backend=make_backend(codegen=codegen))(z_mine.conj().imag, w), expected,
          "output of the in-place graph")
    torch.testing.assert_close(z_mine, z_eager)


class ClampedActivations(nn.Module):
    """MobileNet's ReLU6 and hardtanh, a GAN's LeakyReLU, ELU and SELU, and a clamp between per-feature
    tensor bounds (a learned range), as layers between Linears."""

    def __init__(self, d: int = 11) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.low, self.high = nn.Parameter(torch.full((d,), -0.5)), nn.Parameter(torch.full((d,), 0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu6(self.a(x) * 4) + F.hardtanh(x, -0.3, 0.4) + F.leaky_relu(x, 0.2)
        h = F.elu(self.b(h), alpha=0.7) + F.selu(h)
        return torch.clamp(h, self.low, self.high).sum(-1)


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_clamped_activations_are_generated_not_left_to_aten(monkeypatch, codegen):
    """relu6/hardtanh, leaky_relu, elu (SELU's too) and clamp by tensors are core ATen ops torch keeps whole:
    each ran as an ATen call between kernels. They are decomposed into the kernels now; values and gradients
    as eager's, at the elements on the clamps' edges too."""
    if codegen == "triton":
        pytest.importorskip("triton")
    compiled = record_compiled(monkeypatch)
    torch.manual_seed(0)
    eager = ClampedActivations()
    mine = copy.deepcopy(eager)
    x = torch.randn(7, 11)
    x[0, :3] = torch.tensor([-0.3, 0.4, 0.0])
    xe, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = eager(xe)
    actual = torch.compile(mine, backend=make_backend(codegen=codegen))(xm)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    actual.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(xm.grad, xe.grad, rtol=1e-5, atol=1e-5, equal_nan=True)
    for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)
    kept = {"aten.hardtanh.default", "aten.leaky_relu.default", "aten.elu.default", "aten.clamp.Tensor",
            "aten.hardtanh_backward.default", "aten.leaky_relu_backward.default", "aten.elu_backward.default"}
    assert len(compiled) == 2, "forward and backward should each be one compiled graph"
    left = left_to_aten(compiled, kept)
    assert not left, f"left to ATen: {left}"


def constant_pads(x: torch.Tensor, last: torch.Tensor, half: torch.Tensor, flags: torch.Tensor,
                  counts: torch.Tensor) -> tuple:
    """F.pad's constant mode as models use it: left/right and top/bottom pads, narrowing (negative) pads, a
    -inf pad (before a max), RWKV's token shift ZeroPad2d((0, 0, 1, -1)), a pad of three dims, a pad of nothing,
    a channels_last input, and bf16, bool and int tensors (the value cast as ATen casts it)."""
    return (F.pad(x, (2, 1)), F.pad(x, (0, 0, 3, 1), value=1.5), F.pad(x, (-2, 1, 1, -3)),
            F.pad(x, (1, 0), value=float("-inf")), nn.ZeroPad2d((0, 0, 1, -1))(x), F.pad(x, (1, 1, 2, 0, 0, 1)),
            F.pad(x, (0, 0)), F.pad(last, (1, 2, -1, 1)), F.pad(half, (3, -1), value=1.5),
            F.pad(flags, (1, 2), value=0.5), F.pad(counts, (2, -1), value=-1.7))


def shape_op_inputs() -> tuple:
    """fp32 [2, 3, 5, 7] with NaN, +-inf and -0.0, a channels_last [2, 3, 5, 4], a bf16 [3, 6], a bool [3, 5]
    and an int32 [3, 5]: what shape_ops_match_eager passes the function it checks."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 7)
    x[0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    last, half = torch.randn(2, 3, 5, 4).to(memory_format=torch.channels_last), torch.randn(3, 6).bfloat16()
    flags, counts = torch.randn(3, 5) > 0, torch.randint(-5, 5, (3, 5), dtype=torch.int32)
    return x, last, half, flags, counts


def shape_ops_match_eager(monkeypatch, codegen: str, fn, ops: set[str]) -> tuple:
    """fn(*shape_op_inputs()) compiled by tfsn (`codegen`): its outputs, and the gradients of its three float
    inputs for random weights of its outputs, as eager's; no call of `ops` left to ATen, in forward or backward.
    Returns the compiled outputs and inputs."""
    if codegen == "triton":
        pytest.importorskip("triton")
    compiled = record_compiled(monkeypatch)
    x, last, half, flags, counts = shape_op_inputs()
    eager_inputs = [t.clone().requires_grad_() for t in (x, last, half)]
    my_inputs = [t.clone().requires_grad_() for t in (x, last, half)]
    expected = fn(*eager_inputs, flags, counts)
    actual = torch.compile(fn, backend=make_backend(codegen=codegen))(*my_inputs, flags, counts)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, equal_nan=True, msg=lambda m: f"output {i}: {m}")
    differentiable = [i for i, e in enumerate(expected) if e.requires_grad]
    weights = [torch.randn_like(expected[i]) for i in differentiable]
    expected_grads = torch.autograd.grad([expected[i] for i in differentiable], eager_inputs, weights)
    actual_grads = torch.autograd.grad([actual[i] for i in differentiable], my_inputs, weights)
    for name, a, e in zip(("x", "channels_last", "bf16"), actual_grads, expected_grads):
        torch.testing.assert_close(a, e, equal_nan=True, msg=lambda m: f"gradient of {name}: {m}")
    assert len(compiled) == 2, "forward and backward should each be one compiled graph"
    left = left_to_aten(compiled, ops)
    assert not left, f"left to ATen: {left}"
    return actual, my_inputs


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_constant_pads_are_generated_not_left_to_aten(monkeypatch, codegen):
    """constant_pad_nd ran as an ATen call between kernels (torch's decomposition goes to prims the generator
    cannot take). It is slices and a cat of constants now, which fuse; values and gradients as eager's."""
    actual, my_inputs = shape_ops_match_eager(monkeypatch, codegen, constant_pads, {"aten.constant_pad_nd.default"})
    assert actual[6].data_ptr() != my_inputs[0].data_ptr(), "a pad of nothing is a new tensor, not x"


def flips(x: torch.Tensor, last: torch.Tensor, half: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor) -> tuple:
    """torch.flip as models use it: a bidirectional pass's reversed sequence concatenated with the forward one,
    flips of several and negative dims, of a dim of size 1, of an input also read unflipped, of computed
    values, of a transposed and a channels_last input, of a sum, a flip read by a reduction, flips of flips,
    and bf16, fp16, fp64, bool and int tensors."""
    h = x.tanh()
    return (torch.cat([h, h.flip(2)], -1), x.flip((0, -1)) * 2, x[:, :1].flip(1), x.flip(3) + x,
            x.sin().flip(1).cos(), x.transpose(1, 3).flip(1), last.flip((1, 2)), x.sum(-1, keepdim=True).flip(2),
            (x.flip(-1) * x).sum(-1), x.flip(0).flip(0, 1), half.flip(0) * 1.5, x[0, 1].half().flip(1),
            x.double().flip(2), flags.flip(0), counts.flip(-1))


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_flips_are_generated_not_left_to_aten(monkeypatch, codegen):
    """torch.flip (and its backward, a flip) ran as an ATen call between kernels. A flipped element is its
    input's at index n - 1 - i, which a kernel reads in place; values and gradients as eager's."""
    shape_ops_match_eager(monkeypatch, codegen, flips, {"aten.flip.default"})


def tiles(x: torch.Tensor, last: torch.Tensor, half: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor) -> tuple:
    """Tensor.repeat as models tile: along some dims, with new leading dims, of nothing (a new tensor), of a
    channels_last and a transposed input, of computed values, of a 0-d sum, a tiling summed again, and bf16,
    bool and int tensors."""
    return (x.repeat(2, 1, 3, 1), x.repeat(2, 1, 1, 1, 2), x.repeat(1, 1, 1, 1), last.repeat(1, 2, 1, 3),
            x.transpose(2, 3).repeat(1, 1, 2, 1), x.sin().repeat(1, 2, 1, 1).sum(1), x.sum().repeat(4),
            half.repeat(3, 2), flags.repeat(2, 1), counts.repeat(1, 2, 2))


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_repeats_are_generated_not_left_to_aten(monkeypatch, codegen):
    """Tensor.repeat ran as an ATen call between kernels. It is an expand read through and copied contiguous
    (as Inductor lowers it), which fuses; values and gradients as eager's, and a new tensor."""
    actual, my_inputs = shape_ops_match_eager(monkeypatch, codegen, tiles, {"aten.repeat.default"})
    assert actual[2].data_ptr() != my_inputs[0].data_ptr(), "a repeat of ones is a new tensor, not x"


def rolls(x: torch.Tensor, last: torch.Tensor, half: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor) -> tuple:
    """torch.roll as models use it: Swin's shifted windows rolled by (-s, -s) over two dims and back, a roll
    along one dim, by more than its size, by 0 (a new tensor), negative dims, a roll of the flattened tensor,
    of computed values, of a channels_last input, and bf16, bool and int tensors."""
    shifted = x.roll((-2, -3), (2, 3))
    return (shifted * 2, shifted.tanh().roll((2, 3), (2, 3)), x.roll(1, -1), x.roll(12, 2), x.roll(0, 1),
            x.roll(5), x.sin().roll(1, 0).cos(), last.roll((1, -1), (1, 3)), x.roll((1, 1), (3, 3)),
            half.roll(2, 1), flags.roll(1, 0), counts.roll(-2, -1))


@pytest.mark.parametrize("codegen", ["c", "triton"])
def test_rolls_are_generated_not_left_to_aten(monkeypatch, codegen):
    """torch.roll ran as ATen calls between kernels (torch's decomposition: an index_select of (arange + shift)
    % n), in the forward and in its backward. It is a cat of two slices per rolled dim now, which fuses; values
    and gradients as eager's, and a new tensor."""
    actual, my_inputs = shape_ops_match_eager(monkeypatch, codegen, rolls,
                                              {"aten.roll.default", "aten.index_select.default", "aten.fmod.Scalar"})
    assert actual[4].data_ptr() != my_inputs[0].data_ptr(), "a roll by 0 is a new tensor, not x"
