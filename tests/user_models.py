"""Models written the way users write them, for tests/test_optimizer_user_models.py.

tests/optimizer_models.py holds models shaped to cover what the optimizer lowers; these are shaped
like ordinary training scripts instead: F.scaled_dot_product_attention, nn.MultiheadAttention,
nn.TransformerEncoderLayer, BatchNorm after a biased conv, a tied LM head, bf16 autocast, RoPE and
SwiGLU, a class token, a recurrent cell in a Python loop, residual conv blocks, a model too small for
its arithmetic to matter. Sizes are odd (no SIMD width divides them) and small enough for a 2-core
CPU. benchmarks/optimizer_vs_peers.py times the same models at larger batch sizes.

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


# --- 7. a Llama-style decoder ----------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    """Separate bias-free q, k, v projections, rotary position embeddings (the rotate_half form),
    causal SDPA."""

    def __init__(self, dim: int, n_head: int, max_seq: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(max_seq).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        cos, sin = self.cos[:T], self.sin[:T]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, hidden: int, max_seq: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = LlamaAttention(dim, n_head, max_seq)
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))              # SwiGLU


class Llama(nn.Module):
    """Token embedding, Llama blocks (RMSNorm, RoPE, SwiGLU), RMSNorm, untied output head; returns
    (logits, loss) like TinyGPT."""

    def __init__(self, vocab: int = 59, dim: int = 40, n_head: int = 4, hidden: int = 70, n_layer: int = 2,
                 max_seq: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([LlamaBlock(dim, n_head, hidden, max_seq) for _ in range(n_layer)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        h = self.tok(idx)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


# --- 8. a small vision transformer -------------------------------------------------------------------

class ViTBlock(nn.Module):
    """Pre-norm block: fused qkv, non-causal SDPA, projection; GELU MLP."""

    def __init__(self, dim: int, n_head: int, mlp: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(B, N, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(B, N, C))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patch embedding by a strided conv, a class token, learned positions, blocks, LayerNorm, the
    head on the class token."""

    def __init__(self, image: int = 20, patch: int = 5, dim: int = 30, n_head: int = 3, mlp: int = 50,
                 depth: int = 2, classes: int = 7) -> None:
        super().__init__()
        tokens = (image // patch) ** 2
        self.patch = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(dim, n_head, mlp) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


# --- 9. a recurrent loop -------------------------------------------------------------------------------

class GRUClassifier(nn.Module):
    """Embedding, an nn.GRUCell unrolled over the sequence by a Python loop, a head on the last state."""

    def __init__(self, vocab: int = 41, d: int = 19, hidden: int = 33, classes: int = 6) -> None:
        super().__init__()
        self.hidden = hidden
        self.emb = nn.Embedding(vocab, d)
        self.cell = nn.GRUCell(d, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.emb(idx)
        h = torch.zeros(idx.shape[0], self.hidden, device=idx.device)
        for t in range(idx.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


# --- 10. a residual convnet -----------------------------------------------------------------------------

class BasicBlock(nn.Module):
    """ResNet's basic block: two bias-free 3x3 convs with BatchNorm, a 1x1 projection shortcut when
    the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style: a 3x3 stem, a basic block at full resolution, one at half with more channels,
    global average pooling, a Linear head."""

    def __init__(self, width: int = 12, classes: int = 7) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


# --- 11. a tiny MLP: the call costs more than the arithmetic ---------------------------------------

def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))


# --- 12. T5-style relative position buckets and a padding mask ---------------------------------------

class T5Attention(nn.Module):
    """Self-attention with T5's learned bias per bucket of relative position: buckets made in the
    forward with integer ops, a log of the distance and a clamp; padded keys masked with -inf."""

    def __init__(self, d: int = 20, heads: int = 4, buckets: int = 8, max_distance: int = 16) -> None:
        super().__init__()
        self.heads, self.buckets, self.max_distance = heads, buckets, max_distance
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.rel = nn.Embedding(buckets, heads)

    def bucket(self, rel: Tensor) -> Tensor:
        half = self.buckets // 2                                # one half per direction
        exact = half // 2
        n = rel.abs()
        far = exact + (torch.log(n.float() / exact) / math.log(self.max_distance / exact) * (half - exact)).long()
        return (rel > 0).long() * half + torch.where(n < exact, n, far.clamp(max=half - 1))

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        pos = torch.arange(T)
        bias = self.rel(self.bucket(pos[None, :] - pos[:, None])).permute(2, 0, 1)     # (heads, T, T)
        scores = (q @ k.transpose(-1, -2) + bias).masked_fill(pad[:, None, None, :], float("-inf"))
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


class T5Classifier(nn.Module):
    def __init__(self, vocab: int = 31, d: int = 20, classes: int = 5) -> None:
        super().__init__()
        self.emb, self.norm, self.attn = nn.Embedding(vocab, d), nn.LayerNorm(d), T5Attention(d)
        self.head = nn.Linear(d, classes)

    def forward(self, idx: Tensor, pad: Tensor) -> Tensor:
        x = self.emb(idx)
        x = x + self.attn(self.norm(x), pad)
        keep = (~pad).float()[..., None]
        return self.head((x * keep).sum(1) / keep.sum(1))          # mean over the tokens that are not padding


# --- 13. a mixture of experts with top-k routing ---------------------------------------------------

class TopKMoE(nn.Module):
    """Each token goes to its top 2 of 5 experts (weights per expert in one parameter, einsum), gated
    by a softmax over the chosen logits; a load-balancing term counts the choices with scatter_add."""

    def __init__(self, d: int = 14, experts: int = 5, hidden: int = 18, classes: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, hidden) * 0.2)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, d) * 0.2)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        logits = self.router(flat)
        top, chosen = torch.topk(logits, 2, dim=-1)
        gates = top.softmax(-1)
        out = torch.zeros_like(flat)
        for e in range(self.w1.shape[0]):
            gate = (gates * (chosen == e)).sum(-1, keepdim=True)
            out = out + gate * torch.einsum("nh,hd->nd", F.gelu(torch.einsum("nd,dh->nh", flat, self.w1[e])), self.w2[e])
        counts = torch.zeros(logits.shape[1]).scatter_add(0, chosen.flatten(), torch.ones(chosen.numel()))
        balance = (logits.softmax(-1).mean(0) * counts / chosen.numel()).sum() * logits.shape[1]
        return self.head((out.view(B, T, D) + x).mean(1)), balance


# --- 14. message passing on a graph ----------------------------------------------------------------

class GraphNet(nn.Module):
    """A GCN layer and a GAT-style attention over edge lists: degree normalization with pow(-0.5) (inf
    at a node without edges, masked to 0), index_add aggregation, scores softmaxed per destination
    node with scatter_reduce(amax) and scatter_add."""

    def __init__(self, d: int = 8, hidden: int = 12, classes: int = 3) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(d, hidden), nn.Linear(hidden, classes)
        self.att_src = nn.Parameter(torch.randn(hidden) * 0.3)
        self.att_dst = nn.Parameter(torch.randn(hidden) * 0.3)

    def forward(self, x: Tensor, edges: Tensor) -> Tensor:
        n = x.shape[0]
        src, dst = edges
        inv_sqrt = torch.zeros(n).index_add(0, dst, torch.ones(dst.shape[0])).pow(-0.5)
        inv_sqrt = inv_sqrt.masked_fill(inv_sqrt == float("inf"), 0.0)
        h = self.lin1(x)
        h = F.relu(torch.zeros_like(h).index_add(0, dst, h[src] * (inv_sqrt[src] * inv_sqrt[dst])[:, None]))
        score = F.leaky_relu((h[src] * self.att_src).sum(-1) + (h[dst] * self.att_dst).sum(-1), 0.2)
        top = torch.full((n,), float("-inf")).scatter_reduce(0, dst, score, reduce="amax")
        w = torch.exp(score - top[dst])
        alpha = w / (torch.zeros(n).scatter_add(0, dst, w)[dst] + 1e-16)
        out = torch.zeros_like(h).scatter_add(0, dst[:, None].expand(-1, h.shape[1]), h[src] * alpha[:, None])
        return self.lin2(out + h)


# --- the cases -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[..., tuple]    # (generator, batch size=the tests') -> (model inputs (a tuple), target)
    step: Callable[[nn.Module, tuple, Tensor], tuple]    # (output, loss), as a training loop computes them
    zero_grad: tuple = ()          # (parameter name, slice): elements with an exactly-zero gradient
    bf16: bool = False             # run under torch.autocast("cpu", dtype=torch.bfloat16)
    fp16: bool = False             # run in float16 (autocast, or the model cast): compared at fp16's tolerance


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


def moe_step(model: nn.Module, inputs: tuple, target: Tensor) -> tuple:
    """The classifier's loss plus the router's load-balancing term, as MoE training adds it."""
    out, balance = model(*inputs)
    return out, F.cross_entropy(out, target) + 0.01 * balance


def _key_bias(prefix: str, d: int) -> tuple:
    # The key bias adds q·b_k to every score of a query's row; softmax ignores a per-row constant.
    return ((f"{prefix}.in_proj_bias", slice(d, 2 * d)),)


# Each batch function takes the batch size `n`; its default is the size the tests run.

def _gpt_batch(g: torch.Generator, n: int = 3) -> tuple:
    idx = torch.randint(0, 61, (n, 17), generator=g)
    return (idx,), torch.randint(0, 61, (n, 17), generator=g)


def _mha_batch(g: torch.Generator, n: int = 4) -> tuple:
    x = torch.randn(n, 9, 11, generator=g)
    lengths = torch.tensor([9, 5, 7, 2]).repeat(-(-n // 4))[:n]       # no sequence is all padding
    return (x, lengths), torch.randint(0, 7, (n,), generator=g)


def _encoder_batch(g: torch.Generator, n: int = 5) -> tuple:
    return (torch.randint(0, 53, (n, 13), generator=g),), torch.randint(0, 5, (n,), generator=g)


def _image_batch(g: torch.Generator, n: int = 6, size: int = 15) -> tuple:
    return (torch.randn(n, 3, size, size, generator=g),), torch.randint(0, 7, (n,), generator=g)


def _mlp_batch(g: torch.Generator, n: int = 13) -> tuple:
    return (torch.randn(n, 23, generator=g),), torch.randint(0, 9, (n,), generator=g)


def _llama_batch(g: torch.Generator, n: int = 3) -> tuple:
    idx = torch.randint(0, 59, (n, 15), generator=g)
    return (idx,), torch.randint(0, 59, (n, 15), generator=g)


def _vit_batch(g: torch.Generator, n: int = 4) -> tuple:
    return _image_batch(g, n, 20)


def _gru_batch(g: torch.Generator, n: int = 5) -> tuple:
    return (torch.randint(0, 41, (n, 6), generator=g),), torch.randint(0, 6, (n,), generator=g)


def _resnet_batch(g: torch.Generator, n: int = 4) -> tuple:
    return _image_batch(g, n, 16)


def _tiny_batch(g: torch.Generator, n: int = 8) -> tuple:
    return (torch.randn(n, 10, generator=g),), torch.randint(0, 4, (n,), generator=g)


def _t5_batch(g: torch.Generator, n: int = 3) -> tuple:
    lengths = torch.tensor([11, 6, 3]).repeat(-(-n // 3))[:n]      # no sequence is all padding
    pad = torch.arange(11)[None] >= lengths[:, None]
    return (torch.randint(0, 31, (n, 11), generator=g), pad), torch.randint(0, 5, (n,), generator=g)


def _moe_batch(g: torch.Generator, n: int = 4) -> tuple:
    return (torch.randn(n, 5, 14, generator=g),), torch.randint(0, 3, (n,), generator=g)


def _graph_batch(g: torch.Generator, n: int = 9) -> tuple:
    edges = torch.randint(0, n - 1, (2, 20), generator=g)          # the last node has no edges
    return (torch.randn(n, 8, generator=g), edges), torch.randint(0, 3, (n,), generator=g)


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
        Case("llama", Llama, _llama_batch, language_model),
        Case("vit", ViT, _vit_batch, classify,
             tuple((f"blocks.{i}.qkv.bias", slice(30, 60)) for i in range(2))),
        Case("gru", GRUClassifier, _gru_batch, classify),
        Case("resnet", ResNet, _resnet_batch, classify),
        Case("tiny_mlp", tiny_mlp, _tiny_batch, classify),
        Case("t5_relative", T5Classifier, _t5_batch, classify),
        Case("moe_top2", TopKMoE, _moe_batch, moe_step),
        Case("graph", GraphNet, _graph_batch, classify),
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
