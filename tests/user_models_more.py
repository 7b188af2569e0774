"""More models written the way users write them, for tests/test_optimizer_user_models_more.py.

tests/user_models.py covers transformers, a ResNet, an MLP-mixer, a GRU cell, MoE routing and graph
message passing. These cover what that suite does not: depthwise-separable convs with squeeze-excite
and hard activations (MobileNetV3), nearest and bilinear upsampling with a skip concatenation and
GroupNorm (a UNet), InstanceNorm and dilated Conv1d, a CLIP contrastive loss, a sum of library losses
(label smoothing, KL, BCE with pos_weight, smooth L1, Huber), an LSTM cell written by hand, einsum
attention with a triu mask, layer scale with stochastic depth, a zoo of scans, reductions over inner
dims, tensor clamps, gathers and scatters, permutes and views, pooling variants, padding-masked token
losses, integer arithmetic on negatives, a straight-through estimator with a frozen layer and a
no_grad teacher, and the in-place idioms of user code on a channels_last batch. Sizes are odd (7, 9,
11, 13...) and small. Each model comes as a `tests.user_models.Case`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.user_models import Case, classify, classify_bf16

Tensor = torch.Tensor


# --- MobileNetV3-style inverted residuals ------------------------------------------------------------

class SqueezeExcite(nn.Module):
    def __init__(self, c: int, reduce: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(c, c // reduce, 1)
        self.fc2 = nn.Conv2d(c // reduce, c, 1)

    def forward(self, x: Tensor) -> Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    """1x1 expansion, 3x3 depthwise conv (groups = channels), squeeze-excite, 1x1 projection; BatchNorm
    and hardswish between; a residual when the shape allows."""

    def __init__(self, c_in: int, c_out: int, expand: int, stride: int) -> None:
        super().__init__()
        hidden = c_in * expand
        self.residual = stride == 1 and c_in == c_out
        self.expand = nn.Sequential(nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                                nn.BatchNorm2d(hidden), nn.Hardswish())
        self.se = SqueezeExcite(hidden)
        self.project = nn.Sequential(nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        y = self.project(self.se(self.dw(self.expand(x))))
        return x + y if self.residual else y


class MobileNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.blocks = nn.Sequential(InvertedResidual(8, 8, 3, 1), InvertedResidual(8, 12, 2, 2))
        self.head = nn.Linear(12, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


# --- a UNet-ish segmenter ---------------------------------------------------------------------------

class UNet(nn.Module):
    """Two conv + GroupNorm + SiLU stages, max pooling down, F.interpolate up (`mode`), the skip
    concatenated on channels; per-pixel logits."""

    def __init__(self, mode: str = "nearest", classes: int = 3) -> None:
        super().__init__()
        self.mode = mode
        self.enc1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU())
        self.enc2 = nn.Sequential(nn.Conv2d(8, 12, 3, padding=1), nn.GroupNorm(3, 12), nn.SiLU())
        self.dec = nn.Sequential(nn.Conv2d(20, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU())
        self.out = nn.Conv2d(8, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        s1 = self.enc1(x)
        s2 = self.enc2(F.max_pool2d(s1, 2))
        corners = {} if self.mode == "nearest" else {"align_corners": False}
        up = F.interpolate(s2, scale_factor=2, mode=self.mode, **corners)
        return self.out(self.dec(torch.cat([up, s1], dim=1)))


# --- InstanceNorm and GroupNorm on sequences ----------------------------------------------------------

class NormConv1d(nn.Module):
    """Conv1d + InstanceNorm1d (affine) + leaky ReLU, a dilated Conv1d + GroupNorm + ELU residual, max
    over time."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(5, 9, 3, padding=1)
        self.n1 = nn.InstanceNorm1d(9, affine=True)
        self.c2 = nn.Conv1d(9, 9, 3, padding=2, dilation=2)
        self.n2 = nn.GroupNorm(3, 9)
        self.head = nn.Linear(9, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = F.leaky_relu(self.n1(self.c1(x)), 0.1)
        h = h + F.elu(self.n2(self.c2(h)))
        return self.head(h.amax(-1))


# --- CLIP's contrastive loss --------------------------------------------------------------------------

class CLIP(nn.Module):
    """Two towers, F.normalize, a learned log temperature, cross-entropy over rows and over columns;
    forward returns (logits, loss)."""

    def __init__(self, d_img: int = 13, d_txt: int = 11, d: int = 16) -> None:
        super().__init__()
        self.img = nn.Sequential(nn.Linear(d_img, 24), nn.GELU(), nn.Linear(24, d))
        self.txt = nn.Sequential(nn.Linear(d_txt, 24), nn.GELU(), nn.Linear(24, d))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: Tensor, texts: Tensor) -> tuple[Tensor, Tensor]:
        a = F.normalize(self.img(images), dim=-1)
        b = F.normalize(self.txt(texts), dim=-1)
        logits = self.logit_scale.exp() * a @ b.t()
        labels = torch.arange(images.shape[0], device=images.device)
        return logits, (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


# --- library losses summed --------------------------------------------------------------------------

class MultiTask(nn.Module):
    """A Mish trunk, then label-smoothing cross-entropy, KL divergence to a temperature-softened teacher,
    multi-label BCE with pos_weight (a buffer), smooth L1 and Huber on a regression head."""

    def __init__(self, d: int = 17, classes: int = 7, tags: int = 5) -> None:
        super().__init__()
        self.body = nn.Linear(d, 32)
        self.cls, self.tags, self.reg = nn.Linear(32, classes), nn.Linear(32, tags), nn.Linear(32, 3)
        self.register_buffer("pos_weight", torch.linspace(0.5, 3.0, tags))

    def forward(self, x: Tensor, target: Tensor, teacher: Tensor, tags: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        h = F.mish(self.body(x))
        logits = self.cls(h)
        reg = self.reg(h)
        loss = (F.cross_entropy(logits, target, label_smoothing=0.1)
                + F.kl_div(F.log_softmax(logits, -1), F.softmax(teacher / 2.0, -1), reduction="batchmean")
                + F.binary_cross_entropy_with_logits(self.tags(h), tags, pos_weight=self.pos_weight)
                + F.smooth_l1_loss(reg, y, beta=0.5) + 0.5 * F.huber_loss(reg, y, delta=0.7))
        return logits, loss


# --- an LSTM cell by hand -------------------------------------------------------------------------------

class HandLSTM(nn.Module):
    """Gates from one input and one recurrent Linear, chunked in four; sigmoid/tanh; every step's state
    stacked, max-pooled over time plus the last state."""

    def __init__(self, vocab: int = 23, d: int = 9, hidden: int = 13, classes: int = 4) -> None:
        super().__init__()
        self.hidden = hidden
        self.emb = nn.Embedding(vocab, d)
        self.wx = nn.Linear(d, 4 * hidden)
        self.wh = nn.Linear(hidden, 4 * hidden, bias=False)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.emb(idx)
        h = x.new_zeros(x.shape[0], self.hidden)
        c = x.new_zeros(x.shape[0], self.hidden)
        states = []
        for t in range(x.shape[1]):
            i, f, g, o = (self.wx(x[:, t]) + self.wh(h)).chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            states.append(h)
        return self.head(torch.stack(states, dim=1).max(dim=1).values + h)


# --- einsum attention -----------------------------------------------------------------------------------

class EinsumAttention(nn.Module):
    """Pre-norm self-attention in einsum notation on (B, T, H, D) heads, a causal mask from torch.triu
    filled with -inf, head on the last token."""

    def __init__(self, d: int = 21, heads: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.heads = heads
        self.norm, self.qkv, self.o = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = (t.reshape(B, T, self.heads, D // self.heads) for t in self.qkv(self.norm(x)).chunk(3, -1))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D // self.heads)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
        attn = scores.masked_fill(causal, float("-inf")).softmax(-1)
        x = x + self.o(torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(B, T, D))
        return self.head(x[:, -1])


# --- layer scale and stochastic depth -----------------------------------------------------------------

class LayerScaleDropPath(nn.Module):
    """Pre-norm MLP blocks whose output is scaled per channel (CaiT's layer scale) and dropped per
    sample (stochastic depth); the keep mask is an input so that both runs drop the same samples."""

    def __init__(self, d: int = 19, depth: int = 3, classes: int = 4, keep_prob: float = 0.8) -> None:
        super().__init__()
        self.keep_prob = keep_prob
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(),
                                                   nn.Linear(2 * d, d)) for _ in range(depth)])
        self.gamma = nn.ParameterList([nn.Parameter(0.1 * torch.ones(d)) for _ in range(depth)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:         # keep: (depth, B) of 0. and 1.
        for block, gamma, k in zip(self.blocks, self.gamma, keep):
            x = x + k.view(-1, 1, 1) / self.keep_prob * (gamma * block(x))
        return self.head(x.mean(1))


# --- scans, reductions, clamps, gathers -----------------------------------------------------------------

class OpsZoo(nn.Module):
    """A running mean by cumsum of softplus, logsumexp minus amax over time, variance with correction 0
    and a std over two dims, clamp between tensor bounds, where of SiLU and ELU, a power with a learned
    exponent per channel, gather and scatter_add along time, index_select of channels, elementwise
    maximum and minimum, a cumprod."""

    def __init__(self, d: int = 13, classes: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.exponent = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.head = nn.Linear(4 * d, classes)

    def forward(self, x: Tensor, idx: Tensor, lo: Tensor, hi: Tensor) -> Tensor:   # x (B, T, d), idx (B, T)
        h = self.lin(x)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)
        running = torch.cumsum(F.softplus(h), dim=1) / steps
        spread = torch.logsumexp(h, dim=1) - h.amax(dim=1)                                  # (B, d)
        var = h.var(dim=1, correction=0) + 0.1 * h.std(dim=(0, 1), keepdim=True).squeeze(0)
        clamped = torch.clamp(h, min=lo, max=hi)
        act = torch.where(clamped > 0, F.silu(clamped), 0.3 * F.elu(clamped))
        powered = torch.pow(torch.sigmoid(h) + 0.1, self.exponent)
        along = idx.unsqueeze(-1).expand(-1, -1, h.shape[-1])
        gathered = torch.gather(h, 1, along)
        scattered = torch.zeros_like(h).scatter_add(1, along, act)
        picked = h.index_select(2, torch.tensor([3, 0, 5], device=x.device))
        mixed = (torch.maximum(powered, gathered).mean(1) + torch.minimum(running, scattered).mean(1)
                 + 0.01 * picked.sum((1, 2)).unsqueeze(-1))
        product = torch.cumprod(torch.sigmoid(h[:, :5]) + 0.5, dim=1)[:, -1]
        return self.head(torch.cat([spread, var.expand_as(spread), mixed, product], dim=-1))


class PermuteNet(nn.Module):
    """A channel mix through permute/contiguous/view and back, a norm written by hand (mean over H, W
    per sample; variance over batch and H, W with keepdim), a per-channel scale, a channel sum expanded
    back, a transpose and a reshape, then amax, amin and mean over the flattened pixels."""

    def __init__(self, c: int = 7, classes: int = 3) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(c, c) * 0.3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, c).view(1, c, 1, 1))
        self.head = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:     # (B, C, H, W)
        B, C, H, W = x.shape
        y = x.permute(0, 2, 3, 1).contiguous().view(B, H * W, C) @ self.w
        y = y.view(B, H, W, C).permute(0, 3, 1, 2)
        mu = y.mean(dim=(2, 3), keepdim=True)
        z = (y - mu) / torch.sqrt(((y - mu) ** 2).mean(dim=(0, 2, 3), keepdim=True) + 1e-5) * self.scale
        z = F.leaky_relu(z, 0.2) + 0.1 * z.sum(dim=1, keepdim=True).expand(-1, C, -1, -1)
        z = z.transpose(2, 3).reshape(B, C, -1)
        return self.head(z.amax(dim=2) - z.amin(dim=2) + z.mean(2))


# --- pooling variants -------------------------------------------------------------------------------------

class PoolZoo(nn.Module):
    """Reflect padding, PReLU per channel, average pooling without the padding and with ceil_mode, pixel
    shuffle, a transposed conv with output_padding, GLU, adaptive average and max pooling to a size that
    does not divide the input, torch.roll."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3)
        self.prelu = nn.PReLU(8)
        self.up = nn.ConvTranspose2d(2, 6, 3, stride=2, padding=1, output_padding=1)
        self.head = nn.Linear(6 * 9 + 3, classes)

    def forward(self, x: Tensor) -> Tensor:                                                   # (B, 3, 11, 11)
        h = self.prelu(self.c(F.pad(x, (1, 1, 1, 1), mode="reflect")))                       # (B, 8, 11, 11)
        h = F.avg_pool2d(h, 3, stride=2, padding=1, count_include_pad=False, ceil_mode=True)  # (B, 8, 6, 6)
        h = F.glu(self.up(F.pixel_shuffle(h, 2)), dim=1)                                      # (B, 3, 24, 24)
        h = torch.cat([F.adaptive_avg_pool2d(h, 3), F.adaptive_max_pool2d(h, 3)], 1).flatten(1)
        rolled = torch.roll(x, shifts=(2, -1), dims=(2, 3)).mean((2, 3))
        return self.head(torch.cat([h, rolled], 1))


# --- a padded token classifier ----------------------------------------------------------------------------

class TokenTagger(nn.Module):
    """Padding-aware losses: an embedding with padding_idx, class-weighted cross-entropy over dim 1 of
    (B, C, T) logits with ignore_index, a masked mean of per-token NLL, cosine similarity of neighbours,
    L1 and infinity norms; forward returns (logits, loss)."""

    def __init__(self, vocab: int = 19, d: int = 12, classes: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.lin, self.out = nn.Linear(d, d), nn.Linear(d, classes)
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, classes))

    def forward(self, idx: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(self.lin(self.emb(idx)))                                  # (B, T, d)
        logits = self.out(h)
        ce = F.cross_entropy(logits.transpose(1, 2), target, weight=self.class_weight, ignore_index=-100)
        keep = (idx != 0).flatten()
        nll = F.nll_loss(F.log_softmax(logits, -1).flatten(0, 1), target.clamp_min(0).flatten(), reduction="none")
        masked = (nll * keep).sum() / keep.sum().clamp_min(1)
        neighbours = F.cosine_similarity(h[:, 1:], h[:, :-1], dim=-1).mean()
        norms = 0.01 * h.norm(p=1, dim=-1).mean() + 0.1 * torch.linalg.vector_norm(h, ord=float("inf"), dim=(1, 2)).mean()
        return logits, ce + masked + 0.1 * neighbours + norms


# --- integer arithmetic ---------------------------------------------------------------------------------

class IntegerFeatures(nn.Module):
    """Embedding indices computed from signed integers: remainder and floor division of negatives
    (Python's rounding), fmod (C's), bitwise and/or/shift, an integer square; position weights by
    integer floor division; a where on the sign."""

    def __init__(self, d: int = 10, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, d)
        self.lin = nn.Linear(d, classes)

    def forward(self, ids: Tensor) -> Tensor:               # (B, T) int64, negatives included
        mixed = (torch.remainder(ids, 7) + torch.div(ids, 3, rounding_mode="floor").abs()
                 + torch.fmod(ids, 5).abs() + ((ids & 6) | (ids.abs() >> 1 & 1)) + (ids.abs() % 4) ** 2)
        pos = torch.arange(ids.shape[1], device=ids.device)
        weight = ((pos * 3) // 2).float() / ids.shape[1]
        h = self.emb(mixed % 32) * weight[None, :, None] + torch.where(ids[..., None] < 0, -0.5, 0.5)
        return self.lin(h.mean(1))


# --- a straight-through estimator ------------------------------------------------------------------------

class VectorQuantizer(nn.Module):
    """VQ-VAE's nearest code by argmin of distances, the commitment loss with detach, the straight-through
    estimator z + (q - z).detach(); a frozen Linear (requires_grad False) and a teacher run under no_grad
    for a distillation term; forward returns (logits, loss)."""

    def __init__(self, d_in: int = 9, d: int = 6, codes: int = 11, classes: int = 3) -> None:
        super().__init__()
        self.enc = nn.Linear(d_in, d)
        self.codebook = nn.Parameter(torch.randn(codes, d))
        self.frozen = nn.Linear(d, d).requires_grad_(False)
        self.teacher = nn.Linear(d_in, classes)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z = self.enc(x)
        dist = z.pow(2).sum(1, keepdim=True) - 2 * z @ self.codebook.t() + self.codebook.pow(2).sum(1)
        q = self.codebook[dist.argmin(1)]
        commit = F.mse_loss(z, q.detach()) + 0.25 * F.mse_loss(q, z.detach())
        with torch.no_grad():
            soft = F.softmax(self.teacher(x), -1)
        logits = self.head(F.relu(self.frozen(z + (q - z).detach())))
        return logits, commit - (soft * F.log_softmax(logits, -1)).sum(-1).mean()


# --- in-place idioms --------------------------------------------------------------------------------------

class InPlaceConvNet(nn.Module):
    """ReLU(inplace=True), `y += h`, F.leaky_relu_, masked_fill_ and mul_ on a pooled tensor, a BatchNorm
    without running statistics."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.act = nn.ReLU(inplace=True)
        self.c2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(6, track_running_stats=False)
        self.head = nn.Linear(6, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.bn1(self.c1(x)))
        y = self.bn2(self.c2(h))
        y += h
        y = F.leaky_relu_(y, 0.05)
        s = y.mean((2, 3))
        s.masked_fill_(s < -0.1, 0.0)
        s.mul_(2.0)
        return self.head(s)


# --- the cases --------------------------------------------------------------------------------------------

def own_loss(model: nn.Module, inputs: tuple, target: Tensor | None) -> tuple:
    """The model returns (output, loss) itself."""
    return model(*inputs)


def own_loss_bf16(model: nn.Module, inputs: tuple, target: Tensor | None) -> tuple:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(*inputs)


def fp64(case: Case) -> Case:
    """The case with the model and its float inputs in float64."""
    def batch(g: torch.Generator) -> tuple:
        inputs, target = case.batch(g)
        return tuple(t.double() if t.is_floating_point() else t for t in inputs), target
    return Case(f"{case.name}_fp64", lambda: case.build().double(), batch, case.step, case.zero_grad)


def bf16(case: Case) -> Case:
    """The case under bf16 autocast."""
    step = own_loss_bf16 if case.step is own_loss else classify_bf16
    return Case(f"{case.name}_bf16", case.build, case.batch, step, case.zero_grad, bf16=True)


def _images(g: torch.Generator, n: int, size: int, classes: int, channels_last: bool = False) -> tuple:
    x = torch.randn(n, 3, size, size, generator=g)
    return (x.to(memory_format=torch.channels_last) if channels_last else x,), torch.randint(0, classes, (n,), generator=g)


def _segmentation(g: torch.Generator) -> tuple:
    return (torch.randn(2, 3, 10, 10, generator=g),), torch.randint(0, 3, (2, 10, 10), generator=g)


def _sequences(g: torch.Generator) -> tuple:
    return (torch.randn(3, 5, 29, generator=g),), torch.randint(0, 4, (3,), generator=g)


def _pairs(g: torch.Generator) -> tuple:
    return (torch.randn(7, 13, generator=g), torch.randn(7, 11, generator=g)), None


def _multitask(g: torch.Generator) -> tuple:
    n = 9
    return (torch.randn(n, 17, generator=g), torch.randint(0, 7, (n,), generator=g), torch.randn(n, 7, generator=g),
            (torch.rand(n, 5, generator=g) > 0.5).float(), torch.randn(n, 3, generator=g)), None


def _tokens(g: torch.Generator) -> tuple:
    return (torch.randint(0, 23, (3, 5), generator=g),), torch.randint(0, 4, (3,), generator=g)


def _attention(g: torch.Generator) -> tuple:
    return (torch.randn(3, 11, 21, generator=g),), torch.randint(0, 5, (3,), generator=g)


def _drop_path(g: torch.Generator) -> tuple:
    keep = torch.tensor([[1.0, 1, 0, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 0, 1]])
    return (torch.randn(5, 7, 19, generator=g), keep), torch.randint(0, 4, (5,), generator=g)


def _zoo(g: torch.Generator) -> tuple:
    return ((torch.randn(3, 7, 13, generator=g), torch.randint(0, 7, (3, 7), generator=g),
             -torch.rand(13, generator=g), torch.rand(13, generator=g)), torch.randint(0, 3, (3,), generator=g))


def _permute(g: torch.Generator) -> tuple:
    return (torch.randn(3, 7, 5, 9, generator=g),), torch.randint(0, 3, (3,), generator=g)


def _tagged(g: torch.Generator) -> tuple:
    idx = torch.randint(1, 19, (3, 9), generator=g)
    idx[0, 6:] = 0                                          # padding
    idx[2, 3:] = 0
    target = torch.randint(0, 6, (3, 9), generator=g).masked_fill(idx == 0, -100)
    return (idx, target), None


def _signed(g: torch.Generator) -> tuple:
    return (torch.randint(-40, 40, (4, 7), generator=g),), torch.randint(0, 3, (4,), generator=g)


def _vectors(g: torch.Generator) -> tuple:
    return (torch.randn(10, 9, generator=g),), None


# Elements whose gradient is exactly zero in exact arithmetic (both runs hold rounding noise there).
# A per-channel constant added before a normalization over that channel (training-mode BatchNorm,
# InstanceNorm) is removed by it.
_MOBILENET_ZERO = (("blocks.0.project.1.bias", slice(None)),)   # feeds only block 1's 1x1 conv + BatchNorm
_NORMCONV_ZERO = (("c1.bias", slice(None)),)                    # Conv1d bias before InstanceNorm
_INPLACE_ZERO = (("c1.bias", slice(None)),)                     # conv bias before BatchNorm


def cases() -> list[Case]:
    unet_bilinear = Case("unet_bilinear", lambda: UNet("bilinear"), _segmentation, classify)
    normconv = Case("instance_group_norm", NormConv1d, _sequences, classify, _NORMCONV_ZERO)
    clip = Case("clip", CLIP, _pairs, own_loss)
    multitask = Case("multitask_losses", MultiTask, _multitask, own_loss)
    lstm = Case("hand_lstm", HandLSTM, _tokens, classify)
    einsum = Case("einsum_attention", EinsumAttention, _attention, classify)
    zoo = Case("ops_zoo", OpsZoo, _zoo, classify)
    permute = Case("permute_views", PermuteNet, _permute, classify)
    return [
        Case("mobilenet_channels_last", lambda: MobileNet().to(memory_format=torch.channels_last),
             lambda g: _images(g, 4, 13, 5, channels_last=True), classify, _MOBILENET_ZERO),
        Case("unet_nearest", UNet, _segmentation, classify), unet_bilinear, normconv, clip, multitask, lstm, einsum,
        Case("layer_scale_drop_path", LayerScaleDropPath, _drop_path, classify), zoo, permute,
        Case("pool_zoo", PoolZoo, lambda g: _images(g, 2, 11, 3), classify),
        Case("token_tagger", TokenTagger, _tagged, own_loss),
        Case("integer_features", IntegerFeatures, _signed, classify),
        Case("vector_quantizer", VectorQuantizer, _vectors, own_loss),
        Case("in_place_channels_last", InPlaceConvNet, lambda g: _images(g, 3, 7, 4, channels_last=True), classify,
             _INPLACE_ZERO),
        # fp64: the tolerance is fp32's in units of fp64's epsilon, so a value computed in fp32 anywhere fails.
        # (Not MobileNet: eager's CPU hardsigmoid_backward multiplies by 1/6 rounded to fp32 in fp64 too.)
        *(fp64(c) for c in (unet_bilinear, clip, multitask, lstm, einsum, zoo, permute)),
        # bf16 autocast: GroupNorm and InstanceNorm of bf16 activations, bf16 GEMMs inside a loss
        *(bf16(c) for c in (unet_bilinear, normconv, clip, multitask, einsum)),
    ]
