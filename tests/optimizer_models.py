"""The optimizer's suite: small models that cover what a training step is made of.

Shared by the correctness tests and benchmarks/optimizer_vs_peers.py. Each entry builds a model
and a batch; `loss(model, batch)` is the scalar a training step differentiates. Sizes are odd on
purpose (not multiples of the SIMD width) and small enough for a 2-core CI machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 37, hidden: int = 83, d_out: int = 10) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    """GPT-2 block: pre-norm causal self-attention and GELU MLP, with residuals."""

    def __init__(self, n_embd: int = 48, n_head: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.fc, self.out = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).tril().logical_not(), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class MaskedAttention(nn.Module):
    """Causal self-attention with its mask written the ways users write it: `mask` "tril" builds
    torch.tril(torch.ones(T, T)) in forward, "arange" compares torch.arange(T)[:, None] >= torch.arange(T),
    "buffer" reads a tril of ones registered as a buffer (nanoGPT's `bias`)."""

    def __init__(self, mask: str, n_embd: int = 24, n_head: int = 2, block: int = 16) -> None:
        super().__init__()
        self.mask, self.n_head = mask, n_head
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        if mask == "buffer":
            self.register_buffer("bias", torch.tril(torch.ones(block, block)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        if self.mask == "tril":
            hidden = torch.tril(torch.ones(T, T, device=x.device)) == 0
        elif self.mask == "arange":
            pos = torch.arange(T, device=x.device)
            hidden = ~(pos[:, None] >= pos)
        else:
            hidden = self.bias[:T, :T] == 0
        y = F.softmax(att.masked_fill(hidden, float("-inf")), dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def input_free(graph) -> set[int]:
    """The IR nodes of a graph (optimizer.ir.Graph) that read no graph input, directly or not: values
    made from constants alone, such as a causal mask built in forward."""
    from optimizer.ir import Kind
    found: set[int] = set()
    for node in graph.nodes:
        if node.kind != Kind.INPUT and all(i in found for i in node.inputs):
            found.add(node.index)
    return found


def input_free_kernels(graph, groups) -> list:
    """The kernels among `groups` (optimizer.loopnest.Group) whose members read no graph input: launches
    a step need not make, since each reader can compute such a value itself."""
    free = input_free(graph)
    return [g for g in groups if g.kind != "extern" and set(g.nodes) <= free]


class GPT(nn.Module):
    """Embedding + blocks + LM head: the language-model step, cross-entropy included."""

    def __init__(self, vocab: int = 67, n_embd: int = 48, n_layer: int = 2, block: int = 29) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd) for _ in range(n_layer)])
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


class CNN(nn.Module):
    """Convolutions (extern; no bias: BatchNorm follows) with BatchNorm and ReLU fused after them."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 12, 3, padding=1, bias=False), nn.BatchNorm2d(12)
        self.c2, self.b2 = nn.Conv2d(12, 20, 3, padding=1, bias=False), nn.BatchNorm2d(20)
        self.fc = nn.Linear(20, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.b2(self.c2(x)))
        return self.fc(x.mean(dim=(2, 3)))


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[..., tuple]   # (generator, batch size=the suite size's) -> (input, target)
    loss: Callable[[nn.Module, tuple], torch.Tensor]


def _ce(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _block_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def concatenations(x: torch.Tensor, w: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """torch.cat as models write it, on pieces of every layout: rotate_half of a projection's slices (a
    negative dim, read by a pointwise product), a class token expanded before a sequence, a transposed
    input's strided slices, an empty piece and a cat of one tensor; the backward of the projection's
    split concatenates its three gradients. x: (B, T, C) with C even, w: (3C, C), token: (1, 1, C)."""
    q, k, v = F.linear(x, w).split(x.shape[-1], dim=-1)
    half = q.shape[-1] // 2
    rotated = q * torch.cos(k) + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * torch.sin(k)
    sequence = torch.cat([token.expand(x.shape[0], -1, -1), rotated * v], dim=1)
    xt = x.transpose(1, 2)
    sides = torch.cat([xt[:, ::2], xt.new_empty(x.shape[0], 0, x.shape[1]), torch.tanh(xt[:, 1::2])], dim=-2)
    return torch.cat([sequence.flatten(1), sides.flatten(1), torch.cat([x.flatten(1) * 2])], dim=1)


def forward_and_backward(fn: Callable) -> Callable:
    """fn's outputs and the gradients of the sum of their squares with respect to every float input
    (squares: the sum of a softmax or a normalized row has a zero gradient, which would test nothing)."""
    def step(*args):
        args = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum((o.float() ** 2).sum() for o in outs if o.is_floating_point())
        return (*outs, *torch.autograd.grad(loss, [a for a in args if a.requires_grad]))
    return step


def _linear_gelu(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2)


def _merged_sums(x: torch.Tensor, w: torch.Tensor) -> tuple:
    """Sums of a [2, 3, 24] value over views of it: rows of merged axes (a bias gradient), keepdim, a kept run
    merged (2*3 rows of 24), and a split of its last axis (no merge of its axes)."""
    y = x * w
    return (y, y.view(-1, 24).sum(0), y.reshape(-1, 24).sum(0, keepdim=True), y.view(6, 24).sum(1),
            y.view(2, 3, 4, 6).sum(1))


def _centered(x: torch.Tensor, w: torch.Tensor) -> tuple:
    """A stored value read by two passes over its rows and by the members after them."""
    y = x * w
    m = y.mean(-1, keepdim=True)
    return y, m, ((y - m) ** 2).sum(-1), (y - m) * 2


def _channels_last_bias(x: torch.Tensor, w: torch.Tensor) -> tuple:
    """A per-channel scale of an NCHW tensor stored channels-last, and its sum over rows of channels (a bias
    gradient of a 1x1 convolution as a Linear over pixels)."""
    y = x * w[:, None, None]
    return y, y.permute(0, 2, 3, 1).reshape(-1, y.shape[1]).sum(0)


# pointwise values stored (returned, or read by a GEMM) and summed over rows: name -> (fn, its arguments);
# run through forward_and_backward, as eager's
SUMMED_STORES: dict[str, tuple[Callable, Callable[[], tuple]]] = {
    "linear_gelu": (_linear_gelu, lambda: (torch.randn(3, 7, 11), torch.randn(13, 11), torch.randn(13),
                                           torch.randn(5, 13))),
    "merged_sums": (_merged_sums, lambda: (torch.randn(2, 3, 24), torch.randn(24))),
    "centered": (_centered, lambda: (torch.randn(3, 7, 11), torch.randn(11))),
    "channels_last": (_channels_last_bias, lambda: (
        torch.randn(2, 5, 3, 4).contiguous(memory_format=torch.channels_last), torch.randn(5))),
}


SIZES = {"small": 1, "bench": 4}


def suite(size: str = "small", lm_layers: int = 2) -> list[Case]:
    """The suite at test size, or scaled up (`bench`) for the benchmark; `batch(g, n)` takes
    another batch size for the same model. `lm_layers`: lm_head_ce's blocks (one for Triton's interpreter,
    where a second block's kernels, those of the first again, doubled the test's minutes)."""
    k = SIZES[size]
    vocab, seq, embd = 67, 29 * k, 48 * k
    return [
        Case("mlp", lambda: MLP(37 * k, 83 * k, 10),
             lambda g, n=19 * k: (torch.randn(n, 37 * k, generator=g), torch.randint(0, 10, (n,), generator=g)), _ce),
        Case("gpt2_block", lambda: Block(embd, 4),
             lambda g, n=3 * k: (torch.randn(n, seq, embd, generator=g), torch.randn(n, seq, embd, generator=g)),
             _block_loss),
        Case("cnn", lambda: CNN(),
             lambda g, n=6 * k: (torch.randn(n, 3, 13 * k, 13 * k, generator=g), torch.randint(0, 10, (n,), generator=g)),
             _ce),
        Case("lm_head_ce", lambda: GPT(vocab, embd, lm_layers, seq),
             lambda g, n=3 * k: (torch.randint(0, vocab, (n, seq), generator=g),
                                 torch.randint(0, vocab, (n, seq), generator=g)), _ce),
    ]
