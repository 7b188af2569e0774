"""Models written the way users write them, for tests/test_optimizer_user_models.py.

tests/optimizer_models.py holds models shaped to cover what the optimizer lowers; these are shaped
like ordinary training scripts instead: F.scaled_dot_product_attention, nn.MultiheadAttention,
nn.TransformerEncoderLayer, BatchNorm after a biased conv, a tied LM head, bf16 autocast. Sizes are
odd (no SIMD width divides them) and small enough for a 2-core CPU.

Each `Case` builds a model and a batch and says how a training loop calls it (`step`: the output
and the loss). `zero_grad` names the parameter elements whose gradient is exactly zero in exact
arithmetic (each entry says why); in floating point both runs hold rounding noise there, which the
tests compare against zero at the scale of the model's gradients rather than against each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Tensor = torch.Tensor


# --- 1. a small GPT, nanoGPT style ---------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    """Fused qkv projection, heads split by view/transpose, causal SDPA, output projection."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTBlock(nn.Module):
    """Pre-norm residual block: LayerNorm, attention, LayerNorm, GELU MLP."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, blocks, final LayerNorm, LM head tied to the token embedding;
    the cross-entropy is computed inside forward when targets are given (as nanoGPT does)."""

    def __init__(self, vocab: int = 61, block_size: int = 17, n_embd: int = 36, n_head: int = 3,
                 n_layer: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([GPTBlock(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.tok.weight                  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


# --- 2. nn.MultiheadAttention ----------------------------------------------------------------------

class MHAClassifier(nn.Module):
    """Sequence classifier: input projection, one nn.MultiheadAttention layer with a residual and
    LayerNorm, masked mean pooling, linear head. `mask` picks how padding/causality is given:
    None, "key_padding" (a boolean key_padding_mask; True marks padding) or "causal" (a boolean
    attn_mask; True marks a masked pair). `need_weights=False` sends nn.MultiheadAttention through
    F.scaled_dot_product_attention; the default (True) computes the attention matrix itself."""

    def __init__(self, d_in: int = 11, d_model: int = 30, n_head: int = 5, classes: int = 7,
                 mask: str | None = None, need_weights: bool = True) -> None:
        super().__init__()
        self.mask, self.need_weights = mask, need_weights
        self.inp = nn.Linear(d_in, d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head, batch_first=True)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        B, T, _ = x.shape
        h = self.inp(x)
        pad = torch.arange(T, device=x.device)[None, :] >= lengths[:, None]         # (B, T), True = padding
        key_padding_mask = pad if self.mask == "key_padding" else None
        attn_mask = (torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
                     if self.mask == "causal" else None)
        a, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                         need_weights=self.need_weights)
        h = self.norm(h + a)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1)
        return self.head(pooled)


# --- 3. nn.TransformerEncoderLayer -----------------------------------------------------------------

class EncoderClassifier(nn.Module):
    """Embedding, learned positions, one nn.TransformerEncoderLayer (post- or pre-norm), mean-pool
    head."""

    def __init__(self, vocab: int = 53, seq: int = 13, d_model: int = 28, n_head: int = 4,
                 ff: int = 45, classes: int = 5, norm_first: bool = False, activation: str = "relu") -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(1, seq, d_model) * 0.02)
        self.layer = nn.TransformerEncoderLayer(d_model, n_head, dim_feedforward=ff, dropout=0.0,
                                                activation=activation, batch_first=True, norm_first=norm_first)
        self.head = nn.Linear(d_model, classes)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.layer(self.emb(idx) + self.pos)
        return self.head(h.mean(dim=1))


# --- 4. a convnet ------------------------------------------------------------------------------------

class ConvNet(nn.Module):
    """Conv (with the default bias) + BatchNorm + GELU, a stride-2 conv, max pooling, global
    average pooling, a Linear head."""

    def __init__(self, classes: int = 7) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 10, kernel_size=3, padding=1), nn.BatchNorm2d(10), nn.GELU(),
            nn.Conv2d(10, 18, kernel_size=3, stride=2, padding=1), nn.BatchNorm2d(18), nn.GELU(),
            nn.MaxPool2d(2),
            nn.Conv2d(18, 22, kernel_size=3, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(22, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


# --- 5. an MLP-mixer ----------------------------------------------------------------------------------

class MixerBlock(nn.Module):
    """Token mixing (an MLP across patches, through transposes) then channel mixing, each pre-norm
    with a residual."""

    def __init__(self, tokens: int, channels: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens))
        self.norm2 = nn.LayerNorm(channels)
        self.channel_mlp = nn.Sequential(nn.Linear(channels, channel_hidden), nn.GELU(),
                                         nn.Linear(channel_hidden, channels))

    def forward(self, x: Tensor) -> Tensor:                       # (B, tokens, channels)
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    """Patch embedding by a strided conv, two mixer blocks, LayerNorm, mean over patches, head."""

    def __init__(self, image: int = 15, patch: int = 5, channels: int = 20, depth: int = 2,
                 classes: int = 7) -> None:
        super().__init__()
        tokens = (image // patch) ** 2
        self.stem = nn.Conv2d(3, channels, kernel_size=patch, stride=patch)
        self.blocks = nn.Sequential(*[MixerBlock(tokens, channels, 13, 37) for _ in range(depth)])
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)               # (B, tokens, channels)
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


# --- 6. an MLP trained under bf16 autocast --------------------------------------------------------

class ResMLP(nn.Module):
    """Input Linear, two pre-norm residual GELU MLP blocks, LayerNorm, head; fp32 parameters that
    autocast runs in bf16 where torch's autocast policy says so (the Linears)."""

    def __init__(self, d_in: int = 23, d: int = 40, hidden: int = 71, classes: int = 9) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(),
                                                   nn.Linear(hidden, d)) for _ in range(2)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


# --- the cases -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple]            # (model inputs (a tuple), target)
    step: Callable[[nn.Module, tuple, Tensor], tuple]    # (output, loss), as a training loop computes them
    zero_grad: tuple = ()          # (parameter name, slice): elements with an exactly-zero gradient
    bf16: bool = False             # run under torch.autocast("cpu", dtype=torch.bfloat16)


def classify(model: nn.Module, inputs: tuple, target: Tensor) -> tuple:
    """The usual loop: the compiled model gives logits, the loss is computed outside it."""
    out = model(*inputs)
    return out, F.cross_entropy(out, target)


def classify_bf16(model: nn.Module, inputs: tuple, target: Tensor) -> tuple:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*inputs)
        loss = F.cross_entropy(out, target)               # autocast runs cross-entropy in fp32
    return out, loss


def language_model(model: nn.Module, inputs: tuple, target: Tensor) -> tuple:
    """nanoGPT style: forward returns (logits, loss), the cross-entropy compiled with the model."""
    return model(*inputs, target)


def _key_bias(prefix: str, d: int) -> tuple:
    # The key bias adds q·b_k to every score of a query's row; softmax ignores a per-row constant.
    return ((f"{prefix}.in_proj_bias", slice(d, 2 * d)),)


def _gpt_batch(g: torch.Generator) -> tuple:
    idx = torch.randint(0, 61, (3, 17), generator=g)
    return (idx,), torch.randint(0, 61, (3, 17), generator=g)


def _mha_batch(g: torch.Generator) -> tuple:
    x = torch.randn(4, 9, 11, generator=g)
    lengths = torch.tensor([9, 5, 7, 2])                  # no sequence is all padding
    return (x, lengths), torch.randint(0, 7, (4,), generator=g)


def _encoder_batch(g: torch.Generator) -> tuple:
    return (torch.randint(0, 53, (5, 13), generator=g),), torch.randint(0, 5, (5,), generator=g)


def _image_batch(g: torch.Generator) -> tuple:
    return (torch.randn(6, 3, 15, 15, generator=g),), torch.randint(0, 7, (6,), generator=g)


def _mlp_batch(g: torch.Generator) -> tuple:
    return (torch.randn(13, 23, generator=g),), torch.randint(0, 9, (13,), generator=g)


def cases() -> list[Case]:
    gpt_key_bias = tuple((f"blocks.{i}.attn.c_attn.bias", slice(36, 72)) for i in range(2))
    mha = [Case(f"mha_{mask or 'nomask'}{'' if need else '_sdpa'}",
                lambda mask=mask, need=need: MHAClassifier(mask=mask, need_weights=need), _mha_batch, classify,
                _key_bias("attn", 30))
           for mask, need in ((None, True), ("key_padding", True), ("causal", True),
                              (None, False), ("key_padding", False), ("causal", False))]
    encoders = [Case(f"encoder_{'prenorm' if first else 'postnorm'}_{act}",
                     lambda first=first, act=act: EncoderClassifier(norm_first=first, activation=act),
                     _encoder_batch, classify, _key_bias("layer.self_attn", 28))
                for first in (False, True) for act in ("relu", "gelu")]
    return [
        Case("gpt", TinyGPT, _gpt_batch, language_model, gpt_key_bias),
        *mha,
        *encoders,
        # a conv bias followed by training-mode BatchNorm is subtracted back out with the batch mean
        Case("convnet", ConvNet, _image_batch, classify,
             (("features.0.bias", slice(None)), ("features.3.bias", slice(None)))),
        # the token-mixing output bias adds one constant to every channel of a token, and every
        # reader of the residual stream is a LayerNorm over channels, which removes it
        Case("mixer", Mixer, _image_batch, classify,
             tuple((f"blocks.{i}.token_mlp.2.bias", slice(None)) for i in range(2))),
        Case("resmlp_bf16", ResMLP, _mlp_batch, classify_bf16, bf16=True),
    ]


def case(name: str) -> Case:
    return next(c for c in cases() if c.name == name)


# --- 7. F.scaled_dot_product_attention on its own --------------------------------------------------

@dataclass(frozen=True)
class Attention:
    """One call of F.scaled_dot_product_attention: q (B, H, L, E), k (B, H, S, E), v (B, H, S, Ev)."""
    name: str
    L: int = 11
    S: int = 11
    E: int = 9
    Ev: int = 9
    causal: bool = False
    mask: str | None = None        # None, "bool" (True = attend) or "float" (added to the scores)
    mask_grad: bool = False        # the float mask is a leaf that requires grad
    scale: float | None = None
    dtype: torch.dtype = torch.float32

    def inputs(self, g: torch.Generator) -> list[Tensor]:
        B, H = 2, 3
        q = torch.randn(B, H, self.L, self.E, generator=g, dtype=self.dtype)
        k = torch.randn(B, H, self.S, self.E, generator=g, dtype=self.dtype)
        v = torch.randn(B, H, self.S, self.Ev, generator=g, dtype=self.dtype)
        tensors = [q, k, v]
        if self.mask == "bool":
            keep = torch.rand(B, 1, self.L, self.S, generator=g) > 0.3
            keep[..., 0] = True                       # every query attends to something
            tensors.append(keep)
        elif self.mask == "float":
            tensors.append(torch.randn(self.L, self.S, generator=g, dtype=self.dtype))    # broadcast over B, H
        return tensors

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, scale=self.scale)


ATTENTION = [
    Attention("causal", causal=True),
    Attention("full"),
    Attention("bool_mask", mask="bool"),
    Attention("float_mask", mask="float"),
    Attention("float_mask_grad", mask="float", mask_grad=True),
    Attention("scale", scale=0.3),
    Attention("scale_causal", causal=True, scale=1 / math.sqrt(2.0)),
    Attention("cross", L=7, S=13),
    Attention("cross_value_dim", L=7, S=13, Ev=5),
    Attention("cross_causal", L=13, S=7, causal=True),
    Attention("cross_float_mask_grad", L=7, S=13, Ev=5, mask="float", mask_grad=True),
    Attention("causal_fp64", causal=True, dtype=torch.float64),
    Attention("bool_mask_fp64", mask="bool", dtype=torch.float64),
    Attention("float_mask_grad_fp64", mask="float", mask_grad=True, dtype=torch.float64),
    Attention("cross_fp64", L=7, S=13, Ev=5, scale=0.4, dtype=torch.float64),
]
