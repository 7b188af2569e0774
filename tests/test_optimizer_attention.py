"""The generated attention pair (optimizer/attention.py, codegen/c_attention.py): models that call
F.scaled_dot_product_attention as users do, compiled with the generated forward and backward in place of
ATen's flash attention, against eager: outputs and the gradients of q, k, v and of every parameter, fp32
tolerances (those of tests/test_optimizer_user_models.py). Odd lengths and head dims (not multiples of a
block), causal or not, a custom scale, batch 1 and 3. Then the choice: the search keeps whichever of ATen's
and ours its clock finds faster, and ATen's stays for what the pair does not cover (dropout, a mask).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from optimizer import attention, backend
from optimizer.backend import make_backend
from optimizer.codegen import c_attention
from optimizer.schedule import Schedule
from tests.test_optimizer_correctness import fresh  # noqa: F401  (autouse: a shared compile cache, no dynamo state)
from tests.test_optimizer_user_models import close

GENERATED = Schedule(attention="generated", attention_block=16)     # blocks smaller than T = 33: several


class SelfAttention(nn.Module):
    """A causal or bidirectional self-attention block as nanoGPT writes it."""

    def __init__(self, dim: int, heads: int, causal: bool, scale: float | None) -> None:
        super().__init__()
        self.heads, self.causal, self.scale = heads, causal, scale
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def attention_kernels() -> int:
    return backend.STATS["attention_kernels"]


def compare_module(model: nn.Module, x: torch.Tensor, schedule: Schedule | None = GENERATED, **options) -> int:
    """The compiled model's output and gradients (input and parameters) against eager's; the generated
    attention kernels it compiled."""
    torch.manual_seed(0)
    mine = copy.deepcopy(model)
    xe, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = model(xe)
    before = attention_kernels()
    got = torch.compile(mine, backend=make_backend(schedule=schedule, **options) if schedule else
                        make_backend(**options))(xm)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    expected.backward(grad)
    got.backward(grad)
    close(got, expected, "output")
    close(xm.grad, xe.grad, "grad of the input")
    for (name, p), q in zip(model.named_parameters(), mine.parameters()):
        close(q.grad, p.grad, f"grad of {name}")
    return attention_kernels() - before


@pytest.mark.parametrize("batch,length,heads,head_dim,causal,scale", [
    (1, 7, 2, 8, False, None),
    (3, 33, 2, 24, True, None),
    (3, 33, 3, 8, False, 0.3),
    (1, 33, 1, 24, True, 0.7),
    (3, 7, 4, 24, True, None),
    (1, 33, 3, 10, False, None),          # a head dim that is no whole number of vectors
    (3, 17, 2, 12, True, 0.5),
    (3, 9, 2, 1, True, None),             # head dim 1: the default scale is 1.0, a whole number
    (1, 9, 2, 8, False, 1.0),
    (1, 9, 2, 8, False, 0.0),             # (causal, ATen's own gives NaN: its mask times 0)
    (1, 9, 2, 8, False, -2.0),
])
def test_generated_attention_in_a_model_matches_eager(batch, length, heads, head_dim, causal, scale):
    torch.manual_seed(0)
    model = SelfAttention(heads * head_dim, heads, causal, scale)
    x = torch.randn(batch, length, heads * head_dim)
    assert compare_module(model, x) == 2, "the forward and the backward should each run the generated kernel"


@pytest.mark.parametrize("block", [8, 16, 24])       # any multiple of 8 a Schedule takes, not only of 16
@pytest.mark.parametrize("causal", [False, True])
def test_generated_attention_of_cross_lengths_and_strided_operands(causal, block):
    """q, k, v as leaves: queries and keys of different odd lengths (top-left causal alignment, as ATen's),
    v read through a transpose; the gradients of q, k and v themselves."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 17, 24, generator=g)
    k = torch.randn(3, 2, 40, 24, generator=g)
    v = torch.randn(3, 40, 2, 24, generator=g).transpose(1, 2)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(torch.tanh(q), k * 1.5, v + 0.5, is_causal=causal).sin()

    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    mine = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*ref)
    before = attention_kernels()
    schedule = Schedule(attention="generated", attention_block=block)
    got = torch.compile(fn, backend=make_backend(schedule=schedule))(*mine)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    got.backward(grad)
    assert attention_kernels() - before == 2
    close(got, out, "output")
    for a, b, name in zip(mine, ref, "qkv"):
        close(a.grad, b.grad, f"grad of {name}")


def test_generated_forward_alone_under_no_grad():
    """Inference: the forward's log-sum-exp is taken by no one (its layout is then ATen's default)."""
    torch.manual_seed(0)
    model, x = SelfAttention(24, 2, True, None), torch.randn(3, 33, 24)
    with torch.no_grad():
        expected = model(x)
        before = attention_kernels()
        got = torch.compile(copy.deepcopy(model), backend=make_backend(schedule=GENERATED))(x)
    assert attention_kernels() - before == 1
    close(got, expected, "output")


def test_multihead_attention_runs_the_generated_pair():
    """nn.MultiheadAttention (batch_first, no weights returned) reaches the flash op in training."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(24, 3, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    assert compare_module(Block(), torch.randn(3, 33, 24)) == 2


def test_mask_and_dropout_stay_aten():
    """What the pair does not cover runs as ATen's call even under a schedule asking for the generated
    pair: a mask (output and gradients still eager's), and dropout (which torch sends to its math path on
    a CPU, so the flash op is only ever seen with dropout_p given explicitly)."""
    import dataclasses
    torch.manual_seed(0)

    class Masked(SelfAttention):
        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
            mask = torch.ones(t, t, dtype=torch.bool).tril(-1).logical_not()
            return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d))

    assert compare_module(Masked(16, 2, False, None), torch.randn(3, 7, 16)) == 0
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    masked = _captured(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                       *(torch.randn(2, 2, 7, 8) for _ in range(3)))
    node = next(n for n in masked.nodes if n.op == attention.FORWARD)     # the mask reaches the flash op
    assert attention.call_of(masked, node) is None
    plain = _captured(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                      *(torch.randn(2, 2, 7, 8) for _ in range(3)))
    node = next(n for n in plain.nodes if n.op == attention.FORWARD)
    assert attention.call_of(plain, node) is not None
    assert attention.call_of(plain, dataclasses.replace(node, args=(*node.args[:3], 0.5))) is None


def _captured(fn, *inputs):
    """The IR of fn's forward graph as the backend sees it."""
    from optimizer import ir
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(ir.from_fx(gm))
        return gm.forward
    from torch._dynamo.backends.common import aot_autograd
    torch.compile(fn, backend=aot_autograd(fw_compiler=keep, decompositions=backend.decompositions))(*inputs)
    return graphs[0]


def _search_with_clock(monkeypatch, tmp_path, forward_faster: bool, backward_faster: bool) -> int:
    """Compile and train a causal block through the search (a cache of its own: nothing searched before),
    the clock stubbed to say whether ours is faster than ATen's, for the forward and for the backward: the
    generated kernels it compiled (its outputs and gradients checked against eager's)."""
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path))

    def clock(graph, node, call, schedules):
        faster = backward_faster if call.backward else forward_faster
        return [2.0 if faster else 1.0] + [1.0 if faster else 2.0] * len(schedules)
    monkeypatch.setattr(c_attention, "time_against_library", clock)
    torch.manual_seed(0)
    return compare_module(SelfAttention(16, 2, True, None), torch.randn(3, 33, 16), schedule=None, top_k=2)


def test_search_keeps_the_generated_pair_where_its_clock_finds_it_faster(monkeypatch, tmp_path):
    assert _search_with_clock(monkeypatch, tmp_path, True, True) == 2


def test_search_keeps_aten_where_its_clock_finds_it_faster(monkeypatch, tmp_path):
    assert _search_with_clock(monkeypatch, tmp_path, False, False) == 0


@pytest.mark.parametrize("forward_faster", [True, False])
def test_generated_and_aten_halves_mix(monkeypatch, tmp_path, forward_faster):
    """Ours for one direction, ATen's for the other: each reads the other's log-sum-exp and output."""
    assert _search_with_clock(monkeypatch, tmp_path, forward_faster, not forward_faster) == 1


def test_choice_times_both_and_checks_ours_against_aten():
    """Untouched clock: ATen's and each generated block size are timed (a block past the length only
    once), and the pick is the fastest measured."""
    from optimizer.hardware import cpu_spec
    gm = _captured(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   *(torch.randn(1, 2, 40, 8) for _ in range(3)))
    node = next(n for n in gm.nodes if n.op == attention.FORWARD)
    choice = attention.choose(gm, node, cpu_spec(), timing=True)
    assert set(choice.measured) == {"library", "generated/32", "generated/64"}
    fastest = min(choice.measured, key=choice.measured.get)
    assert choice.schedule.attention == ("library" if fastest == "library" else "generated")
    model = attention.choose(gm, node, cpu_spec(), timing=False)
    assert model.measured == {} and model.predicted_s > 0


def test_a_generated_attention_that_fails_to_build_leaves_aten_to_run_it(monkeypatch, tmp_path):
    """A generator bug that gcc rejects (a bad float literal, as a whole-number scale once made) costs the
    search that one call's candidates, not the graph's other kernels: ATen's attention runs among them."""
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path))
    monkeypatch.setattr(c_attention, "_flt", lambda x: "1f")
    aten_graphs, kernels = backend.STATS["aten_graphs"], backend.STATS["kernels"]
    torch.manual_seed(0)
    assert compare_module(SelfAttention(16, 2, True, None), torch.randn(3, 33, 16), schedule=None, top_k=2) == 0
    assert backend.STATS["aten_graphs"] == aten_graphs and backend.STATS["kernels"] > kernels


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_a_scale_that_is_no_number_stays_aten(scale):
    """A scale C cannot write as a float literal (inf, nan) is no call of the pair: ATen's runs it (gcc
    rejected the generated one, which sent the whole graph to ATen)."""
    gm = _captured(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=scale),
                   *(torch.randn(2, 2, 7, 8) for _ in range(3)))
    node = next(n for n in gm.nodes if n.op == attention.FORWARD)
    assert attention.call_of(gm, node) is None


def test_a_timed_attention_is_planned_at_no_less_than_its_measured_time(monkeypatch, tmp_path):
    """What `tfsn plan` prices this machine's step from (SearchResult.expected_s) holds the clock's time of the
    attention code the search chose where it timed it, as for its kernels: the model's roofline had priced
    ATen's small-head attention at a twentieth of what a step measured."""
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path))
    monkeypatch.setattr(c_attention, "time_against_library",
                        lambda graph, node, call, schedules: [0.5] + [1.0] * len(schedules))   # ATen's faster
    report = []
    torch.manual_seed(0)
    step = backend.optimize(SelfAttention(16, 2, True, None), report=report, top_k=2)
    step(torch.randn(3, 33, 16)).sum().backward()
    timed = [result for _, result in report if result.externs_measured]
    assert len(timed) == 2                                    # the forward's graph and the backward's
    for result in timed:
        assert all(s == 0.5 for s in result.externs_measured.values())
        assert result.predicted_s < 0.5 <= result.expected_s - 0.5 * (len(result.externs_measured) - 1)


def test_a_timed_attentions_time_is_in_the_plan_read_back_from_the_search_cache(monkeypatch, tmp_path):
    """`tfsn plan` mostly reads its step's graphs back from the search cache (its child searched them, or an earlier
    run did): the expected seconds it reads there hold the attention's measured time as the search's own did."""
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path))
    monkeypatch.setattr(c_attention, "time_against_library",
                        lambda graph, node, call, schedules: [0.5] + [1.0] * len(schedules))
    plans = []
    for _ in range(2):
        torch.manual_seed(0)
        torch._dynamo.reset()
        step = backend.optimize(SelfAttention(16, 2, True, None), top_k=2,
                                on_plan=lambda seconds, searched, name: plans.append((name, searched, seconds)))
        step(torch.randn(3, 33, 16)).sum().backward()
    searched = {name: s for name, now, s in plans if now}
    read = {name: s for name, now, s in plans if not now}
    assert len(searched) == 2 and read == searched and all(s >= 0.5 for s in read.values())
