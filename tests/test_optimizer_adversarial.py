"""Models written to break a compiler, compiled with the tfsn backend and checked against eager
PyTorch: forward outputs, the loss, the gradients of every input and parameter, the buffers
(running stats, EMA state the forward updates), then AdamW steps with the loss of each step and
the parameters and buffers at the end. Each model holds what a researcher writes and a compiler
gets wrong: a tensor constant built in forward, a buffer updated in place in forward and read
before and after the update, in-place writes into views, integer and bool values inside the graph.

Tolerances: fp32 as tests/test_optimizer_user_models.py (rtol 1e-4, atol 1e-5 times the largest
magnitude of the expected tensor); integers and bools exact. Parameters after AdamW at atol 1e-4 of
their scale: lr=1e-3 moves an element by at most ~lr per step, and no gradient of these models is
zero in exact arithmetic (Adam would turn rounding noise there into a full lr of either sign).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from optimizer import backend
from optimizer.backend import make_backend
from tests.test_optimizer_correctness import fresh  # noqa: F401  (autouse: a shared compile cache, no dynamo state)

STEPS = 2


def close(actual, expected, what: str, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    if isinstance(expected, (tuple, list)):
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            close(a, e, f"{what}[{i}]", rtol, atol)
        return
    if not expected.is_floating_point():
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{what}: {actual} != {expected}"
        return
    scale = expected.detach().abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol * max(scale, 1e-3),
                               msg=lambda m: f"{what}: {m}")


def weighted_sum(out) -> torch.Tensor:
    """One scalar from every floating output, each element weighted differently (never by zero), so
    that every output element reaches every gradient."""
    if isinstance(out, (tuple, list)):
        return sum(weighted_sum(o) for o in out if o.is_floating_point())
    weight = 1 + 0.5 * torch.sin(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape)
    return (out * weight).sum()


def check_training(build, batch, mode: str = "train") -> None:
    """Forward, gradients and buffers after one call, then STEPS AdamW steps: eager against tfsn."""
    torch.manual_seed(0)
    eager = build().train(mode == "train")
    mine = copy.deepcopy(eager)
    compiled = torch.compile(mine, backend=make_backend(top_k=1))
    inputs = batch(torch.Generator().manual_seed(1))
    leaves_e = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    leaves_m = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    before = backend.STATS["kernels"]
    out_e, out_m = eager(*leaves_e), compiled(*leaves_m)
    assert backend.STATS["kernels"] > before, "the backend generated no kernel: the model ran as plain ATen"
    close(out_m, out_e, "output")
    weighted_sum(out_e).backward()
    weighted_sum(out_m).backward()
    for i, (a, e) in enumerate(zip(leaves_m, leaves_e)):
        if e.grad is not None:
            close(a.grad, e.grad, f"grad of input {i}")
    params_m = dict(mine.named_parameters())
    for name, p in eager.named_parameters():
        close(params_m[name].grad, p.grad, f"grad of {name}")
    buffers_m = dict(mine.named_buffers())
    for name, b in eager.named_buffers():
        close(buffers_m[name], b, f"buffer {name} after one call")

    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_m = torch.optim.AdamW(mine.parameters(), lr=1e-3)
    for step in range(STEPS):
        for model, opt in ((eager, opt_e), (compiled, opt_m)):
            opt.step()
            opt.zero_grad()
        inputs = batch(torch.Generator().manual_seed(2 + step))
        loss_e, loss_m = weighted_sum(eager(*inputs)), weighted_sum(compiled(*inputs))
        loss_e.backward()
        loss_m.backward()
        close(loss_m, loss_e, f"loss of step {step}")
    for name, p in eager.named_parameters():
        close(params_m[name], p, f"{name} after {STEPS} AdamW steps", atol=1e-4)
    for name, b in eager.named_buffers():
        close(buffers_m[name], b, f"buffer {name} after {STEPS} steps")


class CodebookEMA(nn.Module):
    """A VQ-VAE quantizer whose codebook is an EMA of the encodings, updated in place in forward
    under no_grad after the codes were looked up: the commitment loss must use the codebook as it
    was at the lookup. (Before: the min-cut partitioner saved the codebook itself and recomputed the
    lookup in the backward, after the update: wrong input and weight gradients, no error.)"""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(7, 5)
        self.register_buffer("code", torch.randn(11, 5))
        self.register_buffer("usage", torch.ones(11))

    def forward(self, x: torch.Tensor):
        z = self.proj(x)
        idx = (z[:, None, :] - self.code[None]).pow(2).sum(-1).argmin(-1)
        q = self.code[idx]
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, 11).to(z.dtype)
                self.usage.mul_(0.9).add_(onehot.sum(0), alpha=0.1)
                self.code.mul_(0.9).add_(onehot.t() @ z.detach() * 0.1 / self.usage[:, None].clamp(min=1e-3))
        return z + (q - z).detach(), ((q - z) ** 2).mean(), idx


class ConstantIndex(nn.Module):
    """A tensor constant built in forward (`torch.tensor([...])` of indices) with index_select,
    gather and cumsum/cumprod around an Embedding with padding_idx. (Before: copying the joint graph
    for the partitioners under the fake mode failed the compile: BackendCompilerFailed.)"""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 11, padding_idx=0)
        self.head = nn.Linear(11, 5)

    def forward(self, idx: torch.Tensor, pick: torch.Tensor):
        h = self.emb(idx)
        picked = torch.gather(h, 1, pick[:, :, None].expand(-1, -1, 11))
        cols = h.index_select(2, torch.tensor([0, 3, 3, 10]))
        return self.head(picked).sum(1), cols.cumsum(1), (cols.abs() + 0.5).cumprod(1)



class InPlaceOnViews(nn.Module):
    """In-place writes into slices and transposes of activations, an in-place ReLU, and a buffer
    read before and after the forward updates it (with a step counter): what fusion's in-place
    writes and the runtime's view roots must keep in order."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(13, 13)
        self.out = nn.Linear(13, 7)
        self.register_buffer("ema", torch.linspace(-1, 1, 13))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        h = self.inp(x)
        h[:, :3] += y[:, :3]
        h.mul_(0.5)
        h = F.relu(h, inplace=True).clone()
        h[:, 5:] *= 2
        h.t()[1:4].sub_(1.0)
        before = h + self.ema
        with torch.no_grad():
            self.ema.mul_(0.5).add_(h.mean(0) * 0.5)
            self.calls += 1
        return self.out(before + self.ema * h), (self.ema[None] * before).sum(-1) * self.calls

def _codebook_batch(g: torch.Generator) -> tuple:
    return (torch.randn(13, 7, generator=g),)


def _index_batch(g: torch.Generator) -> tuple:
    idx = torch.randint(0, 17, (3, 13), generator=g)
    idx[0, :4] = 0                                    # padding rows: no gradient into emb.weight[0]
    return idx, torch.randint(0, 13, (3, 5), generator=g)


def test_codebook_updated_in_forward_keeps_gradients_of_the_lookup():
    check_training(CodebookEMA, _codebook_batch)


def test_in_place_writes_on_views_and_buffers_match():
    check_training(InPlaceOnViews, lambda g: (torch.randn(7, 13, generator=g), torch.randn(7, 13, generator=g)))


def test_tensor_constant_in_forward_compiles_and_matches():
    check_training(ConstantIndex, _index_batch)



def check_inference(model: nn.Module, *inputs: torch.Tensor) -> None:
    """Outputs of an eval-mode model under no_grad: eager against tfsn, NaN and inf where eager has them."""
    model.eval()
    compiled = torch.compile(copy.deepcopy(model), backend=make_backend(top_k=1))
    with torch.no_grad():
        expected = model(*inputs)
        before = backend.STATS["kernels"]
        actual = compiled(*inputs)
    assert backend.STATS["kernels"] > before, "the backend generated no kernel: the model ran as plain ATen"
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a.isinf(), e.isinf()) and torch.equal(a.isnan(), e.isnan()), f"output {i}: inf/nan differ"
        finite = e.isfinite()
        close(a[finite], e[finite], f"output {i}")


class LogOfSoftmax(nn.Module):
    """log(softmax) written out, as many do instead of log_softmax, on confident logits: probabilities
    below 1.2e-38 are denormals in eager, and their log finite. (Before: the generated exp flushed
    results below 2.5e-38 to 0, so these logs were -inf.)"""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor):
        probs = F.softmax(self.head(x) * 40.0, dim=-1)
        return torch.log(probs), torch.exp(-x.abs() * 20.0 - 80.0).log()


class FakeQuantInt8(nn.Module):
    """Int8 fake quantization written by hand without the clamp: values past int8's range wrap in
    eager (torch converts through a wider integer). (Before: the fused C cast kept the int32 value,
    -135 where eager has 121.)"""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 13)

    def forward(self, x: torch.Tensor):
        h = self.proj(x) * 400.0
        return (h.round().to(torch.int8).float(), h.to(torch.uint8).to(torch.int32), h.to(torch.int16) * 3)


def test_log_of_softmax_keeps_denormal_probabilities():
    torch.manual_seed(0)
    x = torch.randn(13, 5, generator=torch.Generator().manual_seed(1)) * 3
    model = LogOfSoftmax()
    probs = F.softmax(model.head(x) * 40.0, dim=-1)
    assert ((probs > 0) & (probs < 1.17e-38)).any(), "the batch should reach denormal probabilities"
    check_inference(model, x)


def test_float_to_narrow_int_wraps_as_eager():
    torch.manual_seed(0)
    x = torch.randn(11, 5, generator=torch.Generator().manual_seed(1)) * 3
    model = FakeQuantInt8()
    assert (model.proj(x).abs() * 400 > 300).any(), "the batch should reach values past int8 and uint8"
    check_inference(model, x)
