"""An eleventh set of models written the way users write them, for tests/test_optimizer_user_models_eleventh.py.

The earlier sets hold nanoGPT, Llama (rotate_half and complex RoPE, GQA), T5's relative bias, ALiBi, two MoEs
and the state-space and linear-attention families. These are the details of today's LLM training code as
HF-style and nanoGPT-style repositories write them: GPT-NeoX's parallel residual with partial rotary (RoPE on
a fraction of the head dim, the rest passed through) and its per-head interleaved fused qkv; Gemma's RMSNorm
with (1 + w) in fp32, the embedding scaled by sqrt(d) as a tensor in the hidden dtype, GeGLU with the tanh
GELU, attention and final logits soft-capped by tanh, local (sliding window) and global layers alternating,
a tied head; a Mistral/Qwen block with a sliding-window causal mask built from torch.triu/tril of ones with
diagonal offsets, qkv bias, QK-norm (LayerNorm per head) and packed sequences with a document mask from the
cumsum of boundaries; DeepSeek's MLA (low-rank kv compression, a decoupled rope key shared by the heads,
interleaved rope by the permute trick) with a MoE of a shared expert, routed experts with a capacity
(positions by cumsum of one_hot, overflow dropped), an aux load-balancing loss and the router's z-loss;
multi-token prediction heads; a muP-style GPT (1/d attention scale, output multiplier, tied head) with a
z-loss; a packed batch in flash-attn's varlen form (document ids by searchsorted of cu_seqlens) with a Switch
MoE dispatching by index_put into capacity buffers (overflow to a spare slot) and the LM loss summed over
uneven chunks; DPO with a frozen reference model under no_grad, per-sequence log-probs gathered from
log_softmax over a response mask; Gemma cast to bf16 whole; HF Llama over a left-padded batch (a
finfo.min mask whose all-padding rows are unmasked); gpt-oss (attention sinks, YaRN rope, a clamped SwiGLU
MoE softmaxed over its top-k logits); manual mixed precision (fp32 master weights cast to bf16 at each
matmul, an fp32 residual stream); fp16 casts of a few. Losses shift labels with ignore_index=-100,
label smoothing and reduction='sum' / the number of labelled tokens. Sizes are odd and tiny; every input comes from a seeded generator. Each model is a
`tests.user_models.Case`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tests.user_models import Case
from tests.user_models_fourth import fp16_autocast, half
from tests.user_models_more import bf16, fp64, own_loss

IGNORE = -100


def shifted_lm_loss(logits: Tensor, labels: Tensor, smoothing: float = 0.0) -> Tensor:
    """HF's causal-LM loss: predict labels[t + 1] from position t, ignore_index -100, in fp32; the sum over
    tokens divided by the number of labelled ones (as gradient-accumulation-correct trainers do)."""
    shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE, reduction="sum",
                            label_smoothing=smoothing)
    return total / (shift_labels != IGNORE).sum().clamp(min=1)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """HF's rotary embedding: inv_freq a buffer (so model.double() makes it fp64), cos and sin (…, T, dim)
    of the positions times it, the frequencies duplicated for rotate_half."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def sliding_window_causal(T: int, window: int, device: torch.device) -> Tensor:
    """Mistral's mask as written with ones: allowed where j <= i (tril) and j > i - window (triu, offset)."""
    ones = torch.ones(T, T, dtype=torch.bool, device=device)
    return torch.tril(ones) & torch.triu(ones, diagonal=-(window - 1))


# --- GPT-NeoX: parallel residual, partial rotary ------------------------------------------------------------

class NeoXAttention(nn.Module):
    """GPT-NeoX's attention: the fused qkv viewed per head as (H, 3 * hd) (q, k, v interleaved by head),
    rotary on the first rotary_pct of the head dim, the rest concatenated back, scores in fp32."""

    def __init__(self, d: int, heads: int, rotary_pct: float) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.rot = int(self.hd * rotary_pct)
        self.qkv = nn.Linear(d, 3 * d)
        self.dense = nn.Linear(d, d)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, D = x.shape
        qkv = self.qkv(x).view(B, T, self.heads, 3 * self.hd).permute(0, 2, 1, 3)
        q, k, v = qkv[..., :self.hd], qkv[..., self.hd:2 * self.hd], qkv[..., 2 * self.hd:]
        q_rot, q_pass = q[..., :self.rot], q[..., self.rot:]
        k_rot, k_pass = k[..., :self.rot], k[..., self.rot:]
        q = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)
        k = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(self.hd)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        probs = scores.softmax(-1).to(v.dtype)
        return self.dense((probs @ v).transpose(1, 2).reshape(B, T, D))


class NeoX(nn.Module):
    """x + attn(ln1(x)) + mlp(ln2(x)) (use_parallel_residual), untied embed_out, labels shifted inside."""

    def __init__(self, vocab: int = 13, d: int = 16, heads: int = 2, layers: int = 2, rotary_pct: float = 0.5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.ln1, block.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            block.attn = NeoXAttention(d, heads, rotary_pct)
            block.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.blocks.append(block)
        self.rotary = Rotary(self.blocks[0].attn.rot)
        self.ln_f = nn.LayerNorm(d)
        self.embed_out = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: Tensor, labels: Tensor) -> tuple:
        x = self.embed(ids)
        cos, sin = self.rotary(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = x + b.attn(b.ln1(x), cos, sin) + b.mlp(b.ln2(x))
        logits = self.embed_out(self.ln_f(x))
        return logits, shifted_lm_loss(logits, labels)


# --- Gemma 2: (1 + w) RMSNorm, sqrt(d) embedding scale, soft-capping, local/global layers -------------------

class GemmaRMSNorm(nn.Module):
    """Gemma's: normalised in fp32 and multiplied by (1 + w) in fp32, then cast (Llama casts before w)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(nn.Module):
    """GQA (k, v expanded to the query heads by [:, :, None].expand + reshape, as HF's repeat_kv), scores
    scaled by query_pre_attn_scalar^-0.5, soft-capped: cap * tanh(s / cap), an additive mask of finfo.min."""

    def __init__(self, d: int, heads: int, kv_heads: int, hd: int, cap: float, window: int | None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.cap, self.window = heads, kv_heads, hd, cap, window
        self.q_proj = nn.Linear(d, heads * hd, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, d, bias=False)

    def repeat_kv(self, x: Tensor) -> Tensor:
        B, H, T, hd = x.shape
        rep = self.heads // self.kv_heads
        return x[:, :, None].expand(B, H, rep, T, hd).reshape(B, H * rep, T, hd)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.hd ** -0.5
        scores = torch.tanh(scores / self.cap) * self.cap
        allowed = (sliding_window_causal(T, self.window, x.device) if self.window
                   else torch.ones(T, T, dtype=torch.bool, device=x.device).tril())
        bias = torch.zeros(T, T, dtype=scores.dtype, device=x.device).masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores + bias, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(B, T, -1))


class Gemma(nn.Module):
    """Gemma 2: the embedding times sqrt(d) as a tensor of the hidden dtype, sandwich norms (pre and post
    the attention and the MLP), GeGLU with the tanh GELU, alternating sliding-window and global layers,
    the tied head's logits soft-capped by 30 * tanh(l / 30) before the shifted, smoothed loss."""

    def __init__(self, vocab: int = 17, d: int = 10, heads: int = 4, kv_heads: int = 2, hd: int = 4,
                 layers: int = 2, window: int = 3, final_cap: float = 5.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.final_cap = final_cap
        self.rotary = Rotary(hd)
        self.layers = nn.ModuleList()
        for i in range(layers):
            layer = nn.Module()
            layer.input_norm, layer.post_attn_norm = GemmaRMSNorm(d), GemmaRMSNorm(d)
            layer.pre_ff_norm, layer.post_ff_norm = GemmaRMSNorm(d), GemmaRMSNorm(d)
            layer.attn = GemmaAttention(d, heads, kv_heads, hd, cap=2.0, window=window if i % 2 == 0 else None)
            layer.gate, layer.up = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, 3 * d, bias=False)
            layer.down = nn.Linear(3 * d, d, bias=False)
            self.layers.append(layer)
        self.norm = GemmaRMSNorm(d)
        for p in self.parameters():                         # norm weights off zero, so (1 + w) matters
            if p.dim() == 1:
                nn.init.normal_(p, std=0.3)

    def forward(self, ids: Tensor, labels: Tensor) -> tuple:
        h = self.embed(ids)
        h = h * torch.tensor(h.shape[-1] ** 0.5, dtype=h.dtype)
        cos, sin = self.rotary(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            h = h + layer.post_attn_norm(layer.attn(layer.input_norm(h), cos, sin))
            x = layer.pre_ff_norm(h)
            h = h + layer.post_ff_norm(layer.down(F.gelu(layer.gate(x), approximate="tanh") * layer.up(x)))
        logits = F.linear(self.norm(h), self.embed.weight)
        logits = torch.tanh(logits / self.final_cap) * self.final_cap
        return logits, shifted_lm_loss(logits, labels, smoothing=0.1)


# --- Qwen/Mistral: qkv bias, QK LayerNorm, sliding window, packed documents --------------------------------

class PackedQKNorm(nn.Module):
    """A packed row of documents (boundaries True at each document's first token): the document id by cumsum,
    positions restarting per document (arange minus the document's start, by cummax of the starts), rotary
    at those positions, q and k LayerNorm'ed per head (OLMo/Qwen3's QK-norm), qkv with bias, and the mask:
    same document, causal, within the sliding window (SDPA with a boolean attn_mask). SwiGLU MLP."""

    def __init__(self, vocab: int = 15, d: int = 12, heads: int = 3, window: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads, self.hd, self.window = heads, d // heads, window
        self.embed = nn.Embedding(vocab, d)
        self.rotary = Rotary(self.hd)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.norm1, layer.norm2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
            layer.qkv = nn.Linear(d, 3 * d, bias=True)
            layer.q_norm, layer.k_norm = nn.LayerNorm(self.hd), nn.LayerNorm(self.hd)
            layer.o = nn.Linear(d, d, bias=False)
            layer.gate_up = nn.Linear(d, 4 * d, bias=False)
            layer.down = nn.Linear(2 * d, d, bias=False)
            self.layers.append(layer)
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: Tensor, boundaries: Tensor, labels: Tensor) -> tuple:
        B, T = ids.shape
        doc = boundaries.long().cumsum(-1)
        index = torch.arange(T, device=ids.device).expand(B, T)
        start = torch.where(boundaries, index, 0).cummax(-1).values
        cos, sin = self.rotary(index - start)                        # (B, T, hd)
        cos, sin = cos[:, None], sin[:, None]
        mask = (doc[:, :, None] == doc[:, None, :]) & sliding_window_causal(T, self.window, ids.device)
        x = self.embed(ids)
        for layer in self.layers:
            q, k, v = layer.qkv(layer.norm1(x)).view(B, T, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
            q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
            x = x + layer.o(attn.transpose(1, 2).reshape(B, T, -1))
            gate, up = layer.gate_up(layer.norm2(x)).chunk(2, -1)
            x = x + layer.down(F.silu(gate) * up)
        logits = self.head(self.norm(x))
        # no loss across a document boundary: the label of each document's first token is ignored
        labels = labels.masked_fill(boundaries, IGNORE)
        return logits, shifted_lm_loss(logits, labels)


# --- DeepSeek: MLA with decoupled rope, MoE with a shared expert and capacity, MTP ------------------------

def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek-V2's HF code: the interleaved pairs (x0, x1, x2, x3, …) reordered to halves by
    view(…, d/2, 2).transpose(-1, -2).reshape, then rotate_half."""
    *lead, d = x.shape
    x = x.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)
    return x * cos + rotate_half(x) * sin


class MLA(nn.Module):
    """Multi-head latent attention: kv compressed to a rank-r latent (with a rope key of its own, shared by
    every head, expanded), RMSNorm'ed and expanded to per-head k_nope and v; q split into nope and rope parts;
    scores of [q_nope, q_pe] . [k_nope, k_pe]; softmax scale 1/sqrt(nope + rope dims)."""

    def __init__(self, d: int, heads: int, rank: int, nope: int, rope: int, v_dim: int) -> None:
        super().__init__()
        self.heads, self.nope, self.rope, self.v_dim, self.rank = heads, nope, rope, v_dim, rank
        self.q_proj = nn.Linear(d, heads * (nope + rope), bias=False)
        self.kv_a = nn.Linear(d, rank + rope, bias=False)
        self.kv_norm = nn.RMSNorm(rank, eps=1e-6)
        self.kv_b = nn.Linear(rank, heads * (nope + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, -1).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        latent, k_pe = torch.split(self.kv_a(x), [self.rank, self.rope], dim=-1)
        k_pe = k_pe.view(B, T, 1, self.rope).transpose(1, 2)
        kv = self.kv_b(self.kv_norm(latent)).view(B, T, self.heads, -1).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        q_pe, k_pe = rope_interleaved(q_pe, cos, sin), rope_interleaved(k_pe, cos, sin)
        query = torch.cat([q_nope, q_pe], dim=-1)
        key = torch.cat([k_nope, k_pe.expand(B, self.heads, T, self.rope)], dim=-1)
        scores = query @ key.transpose(2, 3) * (self.nope + self.rope) ** -0.5
        scores = scores + torch.full((T, T), float("-inf"), device=x.device).triu(1)
        out = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class CapacityMoE(nn.Module):
    """DeepSeek/Switch MoE: a shared SwiGLU expert on every token; routed experts by softmax top-k (weights
    renormalised), each expert taking at most `capacity` tokens in order (the position of a token in its
    expert's queue by cumsum of one_hot over the flattened token-slot assignments; the overflow dropped);
    the aux load-balancing loss E * sum(f_e * P_e) and the router's z-loss mean(logsumexp(logits)^2)."""

    def __init__(self, d: int, hidden: int, experts: int, top_k: int, capacity: int) -> None:
        super().__init__()
        self.experts, self.top_k, self.capacity = experts, top_k, capacity
        self.router = nn.Linear(d, experts, bias=False)
        self.w_gate = nn.Parameter(torch.randn(experts, d, hidden) * d ** -0.5)
        self.w_up = nn.Parameter(torch.randn(experts, d, hidden) * d ** -0.5)
        self.w_down = nn.Parameter(torch.randn(experts, hidden, d) * hidden ** -0.5)
        self.shared = nn.ModuleDict({"gate": nn.Linear(d, hidden, bias=False), "up": nn.Linear(d, hidden, bias=False),
                                     "down": nn.Linear(hidden, d, bias=False)})

    def forward(self, x: Tensor) -> tuple:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                            # (N, d)
        logits = self.router(x).float()
        probs = logits.softmax(-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)                          # (N, k)
        weight = weight / weight.sum(-1, keepdim=True)
        one_hot = F.one_hot(chosen, self.experts)                                # (N, k, E)
        # slots in priority order: every token's first choice before any token's second
        flat = one_hot.transpose(0, 1).reshape(-1, self.experts)                 # (k N, E)
        position = (flat.cumsum(0) - 1) * flat
        kept = (position < self.capacity) & flat.bool()
        kept = kept.view(self.top_k, -1, self.experts).transpose(0, 1)           # (N, k, E)
        dispatch = (kept.to(x.dtype) * weight.to(x.dtype)[..., None]).sum(1)     # (N, E) combine weights
        h = torch.einsum("nd,edh->enh", x, self.w_gate)
        h = F.silu(h) * torch.einsum("nd,edh->enh", x, self.w_up)
        routed = torch.einsum("enh,ehd->end", h, self.w_down)                   # every expert on every token
        out = torch.einsum("end,ne->nd", routed, dispatch)
        s = self.shared
        out = out + s["down"](F.silu(s["gate"](x)) * s["up"](x))
        fraction = one_hot.sum(1).float().mean(0)                               # f_e: tokens routed to e
        aux = self.experts * (fraction * probs.mean(0)).sum()
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return out.view(shape), aux, z_loss


class DeepSeekMTP(nn.Module):
    """A DeepSeek-V3-like LM: MLA + a dense first layer, a capacity MoE second layer; the main head and one
    multi-token-prediction module (the final hidden state, RMSNorm'ed, concatenated with the RMSNorm'ed
    embedding of the next token, projected, one more block of MLP, the shared head) predicting t + 2; the
    loss main + 0.3 * MTP + 0.01 * aux + 1e-3 * z-loss."""

    def __init__(self, vocab: int = 19, d: int = 10, heads: int = 2, rank: int = 5, nope: int = 3, rope: int = 4,
                 v_dim: int = 3, experts: int = 4, capacity: int = 7) -> None:
        super().__init__()
        self.rotary = Rotary(rope)
        self.embed = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.RMSNorm(d, eps=1e-6) for _ in range(4))
        self.attn = nn.ModuleList(MLA(d, heads, rank, nope, rope, v_dim) for _ in range(2))
        self.dense = nn.Sequential(nn.Linear(d, 2 * d, bias=False), nn.SiLU(), nn.Linear(2 * d, d, bias=False))
        self.moe = CapacityMoE(d, 6, experts, top_k=2, capacity=capacity)
        self.final_norm = nn.RMSNorm(d, eps=1e-6)
        self.head = nn.Linear(d, vocab, bias=False)
        self.mtp_h_norm, self.mtp_e_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.mtp_proj = nn.Linear(2 * d, d, bias=False)
        self.mtp_mlp = nn.Sequential(nn.RMSNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, ids: Tensor, labels: Tensor) -> tuple:
        B, T = ids.shape
        cos, sin = self.rotary(torch.arange(T, device=ids.device))
        h = self.embed(ids)
        h = h + self.attn[0](self.norms[0](h), cos, sin)
        h = h + self.dense(self.norms[1](h))
        h = h + self.attn[1](self.norms[2](h), cos, sin)
        moe_out, aux, z_loss = self.moe(self.norms[3](h))
        h = h + moe_out
        logits = self.head(self.final_norm(h))
        main = shifted_lm_loss(logits, labels)
        # MTP depth 1: position t sees h_t and the embedding of token t + 1, and predicts token t + 2
        nxt = self.embed(ids[:, 1:])
        m = self.mtp_proj(torch.cat([self.mtp_h_norm(h[:, :-1]), self.mtp_e_norm(nxt)], dim=-1))
        m = m + self.mtp_mlp(m)
        mtp = shifted_lm_loss(self.head(self.final_norm(m)), labels[:, 1:])
        return logits, main + 0.3 * mtp + 0.01 * aux + 1e-3 * z_loss


# --- muP GPT with a z-loss -----------------------------------------------------------------------------------

class MuPGPT(nn.Module):
    """A nanoGPT under muP: attention scaled by 1/head_dim (SDPA's scale=), the input embedding multiplied
    by a constant, the tied head's logits divided by the width multiplier; the loss the mean cross-entropy
    of the shifted tokens (ignore_index) plus PaLM's z-loss 1e-4 * mean(logsumexp(logits)^2) on the
    labelled ones."""

    def __init__(self, vocab: int = 14, d: int = 12, heads: int = 3, layers: int = 2, width_mult: float = 3.0,
                 block: int = 9) -> None:
        super().__init__()
        self.heads, self.width_mult, self.input_mult = heads, width_mult, 10.0
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            b = nn.Module()
            b.ln_1, b.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
            b.c_attn, b.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            b.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
            self.blocks.append(b)
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight                                   # tied

    def forward(self, ids: Tensor, labels: Tensor) -> tuple:
        B, T = ids.shape
        x = self.wte(ids) * self.input_mult + self.wpe(torch.arange(T, device=ids.device))
        for b in self.blocks:
            q, k, v = b.c_attn(b.ln_1(x)).split(x.shape[-1], dim=2)
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / q.shape[-1])
            x = x + b.c_proj(y.transpose(1, 2).reshape(B, T, -1))
            x = x + b.mlp(b.ln_2(x))
        logits = self.lm_head(self.ln_f(x)) / self.width_mult
        flat, target = logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        ce = F.cross_entropy(flat, target, ignore_index=IGNORE)
        labelled = (target != IGNORE).float()
        z_loss = (torch.logsumexp(flat, -1).pow(2) * labelled).sum() / labelled.sum()
        return logits, ce + 1e-4 * z_loss


# --- Switch MoE with index dispatch, document ids by searchsorted, a chunked loss --------------------------

class IndexDispatchMoE(nn.Module):
    """Switch Transformer's top-1 MoE as Mesh-TF/fairseq write it with indices: each token's slot in its
    expert's buffer by cumsum of one_hot, tokens over capacity sent to a spare slot that is cut off, the
    buffer (E * C + 1, d) filled by index_put, the experts run by bmm on (E, C, d), outputs brought back by
    index_select and scaled by the router probability (dropped tokens get 0: the residual carries them)."""

    def __init__(self, d: int, hidden: int, experts: int, capacity: int) -> None:
        super().__init__()
        self.experts, self.capacity = experts, capacity
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, hidden) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, d) * hidden ** -0.5)

    def forward(self, x: Tensor) -> tuple:
        N, d = x.shape
        probs = self.router(x).softmax(-1)
        gate, expert = probs.max(-1)
        one_hot = F.one_hot(expert, self.experts)
        slot = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)                      # (N,) place in its expert
        kept = slot < self.capacity
        spare = self.experts * self.capacity
        index = torch.where(kept, expert * self.capacity + slot, spare)
        buffer = x.new_zeros(spare + 1, d).index_put((index,), x)
        h = torch.bmm(F.relu(torch.bmm(buffer[:spare].view(self.experts, self.capacity, d), self.w1)), self.w2)
        h = torch.cat([h.reshape(spare, d), h.new_zeros(1, d)])
        out = h.index_select(0, index) * (gate * kept)[:, None]
        balance = self.experts * (one_hot.float().mean(0) * probs.mean(0)).sum()
        return out, balance


class SwitchVarlen(nn.Module):
    """A packed batch as flash-attn's varlen API takes it: tokens (N,) and cu_seqlens (docs + 1,); each
    token's document by searchsorted(cu_seqlens, arange, right=True) - 1, its position as the offset from
    cu_seqlens of its document; attention over (1, N) with a block-diagonal causal mask; a Switch MoE
    feed-forward; the LM loss in chunks of the sequence (uneven, as memory-saving trainers split it), the
    sum of each chunk's summed cross-entropy over the number of labelled tokens, plus the balance loss."""

    def __init__(self, vocab: int = 11, d: int = 8, heads: int = 2, max_pos: int = 8, chunk: int = 4) -> None:
        super().__init__()
        self.heads, self.chunk = heads, chunk
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_pos, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.moe = IndexDispatchMoE(d, 2 * d, experts=3, capacity=4)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: Tensor, cu_seqlens: Tensor, labels: Tensor) -> tuple:
        N = tokens.shape[0]
        index = torch.arange(N, device=tokens.device)
        doc = torch.searchsorted(cu_seqlens, index, right=True) - 1
        x = self.embed(tokens) + self.pos(index - cu_seqlens[doc])
        q, k, v = self.qkv(self.ln1(x)).view(N, 3, self.heads, -1).permute(1, 2, 0, 3)
        mask = (doc[:, None] == doc[None, :]) & (index[:, None] >= index[None, :])
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1).reshape(N, -1))
        moe_out, balance = self.moe(self.ln2(x))
        h = self.ln_f(x + moe_out)
        # the label of each document's last token is the next document's first: ignored
        target = torch.where(doc[:-1] == doc[1:], labels[1:], IGNORE)
        total = h.new_zeros(())
        for hc, tc in zip(h[:-1].split(self.chunk), target.split(self.chunk)):
            total = total + F.cross_entropy(self.head(hc).float(), tc, ignore_index=IGNORE, reduction="sum")
        return h, total / (target != IGNORE).sum() + 0.01 * balance


# --- DPO with a frozen reference model -----------------------------------------------------------------------

class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Conv1d(d, d, 3, padding=2, groups=d)                     # causal by cutting the tail
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        x = x + self.mix(x.transpose(1, 2))[..., :ids.shape[1]].transpose(1, 2)
        return self.head(x + self.mlp(x))


def sequence_logps(logits: Tensor, labels: Tensor, loss_mask: Tensor) -> Tensor:
    """TRL's: the log-probability of each sequence's response tokens, logits shifted against labels,
    gathered from log_softmax (in fp32), summed over the mask (prompt and padding masked out)."""
    logps = logits[:, :-1].float().log_softmax(-1)
    labels, mask = labels[:, 1:], loss_mask[:, 1:]
    per_token = torch.gather(logps, 2, torch.where(mask, labels, 0).unsqueeze(2)).squeeze(2)
    return (per_token * mask).sum(-1)


class DPO(nn.Module):
    """Direct preference optimisation: chosen and rejected sequences concatenated in one batch through the
    policy, and through a frozen reference copy under no_grad; the loss -logsigmoid(beta * (policy margin
    - reference margin)) with label smoothing (cDPO), the rewards returned as the output."""

    def __init__(self, vocab: int = 12, d: int = 8, beta: float = 0.5, smoothing: float = 0.1) -> None:
        super().__init__()
        self.beta, self.smoothing = beta, smoothing
        self.policy = TinyLM(vocab, d)
        self.reference = TinyLM(vocab, d)
        self.reference.requires_grad_(False)

    def forward(self, chosen: Tensor, rejected: Tensor, chosen_mask: Tensor, rejected_mask: Tensor) -> tuple:
        ids, mask = torch.cat([chosen, rejected]), torch.cat([chosen_mask, rejected_mask])
        policy = sequence_logps(self.policy(ids), ids, mask)
        with torch.no_grad():
            reference = sequence_logps(self.reference(ids), ids, mask)
        pi_chosen, pi_rejected = policy.chunk(2)
        ref_chosen, ref_rejected = reference.chunk(2)
        logits = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)
        loss = (-F.logsigmoid(self.beta * logits) * (1 - self.smoothing)
                - F.logsigmoid(-self.beta * logits) * self.smoothing).mean()
        rewards = self.beta * torch.stack([pi_chosen - ref_chosen, pi_rejected - ref_rejected], -1).detach()
        return rewards, loss


# --- HF Llama over a left-padded batch ------------------------------------------------------------------------

class LeftPaddedLlama(nn.Module):
    """HF Llama's handling of a left-padded batch (as in RLHF rollouts): position ids from the attention
    mask's cumsum (padding set to 1), cos/sin gathered at them, a 4-D additive mask of finfo.min from the
    causal and the padding mask in the hidden dtype, padded query rows then unmasked entirely by multiplying
    with ~all(row == min) (HF's _unmask_unattended, for SDPA's memory-efficient kernel); SDPA with that
    float mask; the loss over the real tokens only."""

    def __init__(self, vocab: int = 13, d: int = 12, heads: int = 3, layers: int = 2) -> None:
        super().__init__()
        self.heads, hd = heads, d // heads
        self.embed = nn.Embedding(vocab, d)
        self.rotary = Rotary(hd)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.input_layernorm, layer.post_attention_layernorm = nn.RMSNorm(d), nn.RMSNorm(d)
            layer.q, layer.k, layer.v, layer.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            layer.gate, layer.up, layer.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False), \
                nn.Linear(2 * d, d, bias=False)
            self.layers.append(layer)
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: Tensor, attention_mask: Tensor) -> tuple:
        B, T = ids.shape
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids = position_ids.masked_fill(attention_mask == 0, 1)
        x = self.embed(ids)
        cos, sin = self.rotary(position_ids)
        cos, sin = cos[:, None], sin[:, None]
        low = torch.finfo(x.dtype).min
        causal = torch.full((T, T), low, dtype=x.dtype, device=x.device).triu(1)
        mask = causal[None, None].expand(B, 1, T, T).clone()
        padding = mask + attention_mask[:, None, None, :].to(x.dtype)
        mask = mask.masked_fill(padding == 0, low)
        mask = mask.mul(~torch.all(mask == low, dim=-1, keepdim=True))
        for layer in self.layers:
            h = layer.input_layernorm(x)
            q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (layer.q, layer.k, layer.v))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
            x = x + layer.o(attn.transpose(1, 2).reshape(B, T, -1))
            h = layer.post_attention_layernorm(x)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        logits = self.lm_head(self.norm(x))
        labels = ids.masked_fill(attention_mask == 0, IGNORE)
        return logits, shifted_lm_loss(logits, labels)


# --- gpt-oss: attention sinks, YaRN rope, clamped SwiGLU, softmax over the top-k ----------------------------

class YaRNRotary(nn.Module):
    """YaRN's scaled rotary frequencies: interpolation (inv_freq / factor) and extrapolation (inv_freq) blended
    by a linear ramp over the dims between the low and high correction dims (clamped to [0, 1]), cos and sin
    multiplied by the attention factor 0.1 ln(factor) + 1."""

    def __init__(self, dim: int, factor: float = 4.0, base: float = 10000.0, original: int = 4,
                 beta_fast: float = 32.0, beta_slow: float = 1.0) -> None:
        super().__init__()
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2).float() - low) / max(high - low, 1e-3)).clamp(0, 1)
        extrapolation_weight = 1 - ramp
        inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = 0.1 * math.log(factor) + 1.0

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


class GptOss(nn.Module):
    """gpt-oss's block: attention with a learned sink logit per head (concatenated to each row's scores,
    the softmax taken with it, its column dropped), sliding-window and full layers alternating, qkv with
    bias; an MoE whose router takes the top-k logits first and softmaxes over them, experts of a clamped
    SwiGLU (gate clamped above, up clamped both sides, gate * sigmoid(1.702 gate) * (up + 1))."""

    def __init__(self, vocab: int = 15, d: int = 12, heads: int = 3, layers: int = 2, experts: int = 4,
                 top_k: int = 2, limit: float = 0.7, window: int = 3) -> None:
        super().__init__()
        self.heads, self.hd, self.top_k, self.limit, self.window = heads, d // heads, top_k, limit, window
        self.embed = nn.Embedding(vocab, d)
        self.rotary = YaRNRotary(self.hd)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.attn_norm, layer.mlp_norm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
            layer.qkv, layer.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            layer.sinks = nn.Parameter(torch.randn(heads) * 0.5)
            layer.gate = nn.Linear(d, experts)
            layer.w_in = nn.Parameter(torch.randn(experts, d, 2 * d) * d ** -0.5)
            layer.b_in = nn.Parameter(torch.zeros(experts, 2 * d))
            layer.w_out = nn.Parameter(torch.randn(experts, d, d) * d ** -0.5)
            self.layers.append(layer)
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.unembedding = nn.Linear(d, vocab, bias=False)

    def attention(self, layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, allowed: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = layer.qkv(x).view(B, T, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = (q @ k.transpose(-1, -2)) * self.hd ** -0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        sinks = layer.sinks.view(1, -1, 1, 1).expand(B, -1, T, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
        return layer.out((probs @ v).transpose(1, 2).reshape(B, T, D))

    def experts(self, layer: nn.Module, x: Tensor) -> Tensor:
        logits = layer.gate(x)
        top, chosen = torch.topk(logits, self.top_k, dim=-1, sorted=True)
        weights = F.softmax(top, dim=-1)
        h = torch.einsum("btd,edf->btef", x, layer.w_in) + layer.b_in
        gate, up = h[..., ::2], h[..., 1::2]                                      # interleaved, as gpt-oss
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        y = torch.einsum("btef,efd->bted", gate * torch.sigmoid(1.702 * gate) * (up + 1), layer.w_out)
        picked = torch.gather(y, 2, chosen[..., None].expand(*chosen.shape, y.shape[-1]))
        return (picked * weights[..., None]).sum(2)

    def forward(self, ids: Tensor, labels: Tensor) -> tuple:
        T = ids.shape[1]
        cos, sin = self.rotary(torch.arange(T, device=ids.device))
        full = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        local = sliding_window_causal(T, self.window, ids.device)
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = x + self.attention(layer, layer.attn_norm(x), cos, sin, local if i % 2 == 0 else full)
            x = x + self.experts(layer, layer.mlp_norm(x))
        logits = self.unembedding(self.norm(x))
        return logits, shifted_lm_loss(logits, labels)


# --- manual mixed precision: fp32 master weights cast to bf16 at each use ------------------------------------

class MasterWeightsLM(nn.Module):
    """Megatron/apex-style mixed precision without autocast: parameters stay fp32, each matmul casts its
    input and weight to bf16 (F.linear(x.to(bf16), w.to(bf16))), norms upcast to fp32 and cast back, the
    residual stream kept in fp32 (fp32 residual connection), attention by SDPA on bf16 with is_causal, and
    the logits upcast for the loss; the gradients reach the fp32 masters through the casts."""

    def __init__(self, vocab: int = 13, d: int = 12, heads: int = 3, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(2 * layers + 1))
        self.qkv = nn.ParameterList(nn.Parameter(torch.randn(3 * d, d) * d ** -0.5) for _ in range(layers))
        self.proj = nn.ParameterList(nn.Parameter(torch.randn(d, d) * d ** -0.5) for _ in range(layers))
        self.fc = nn.ParameterList(nn.Parameter(torch.randn(3 * d, d) * d ** -0.5) for _ in range(layers))
        self.fc_out = nn.ParameterList(nn.Parameter(torch.randn(d, 3 * d) * (3 * d) ** -0.5) for _ in range(layers))

    @staticmethod
    def linear(x: Tensor, w: Tensor) -> Tensor:
        return F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16))

    def forward(self, ids: Tensor, labels: Tensor) -> tuple:
        B, T = ids.shape
        x = self.embed(ids)                                                     # fp32 residual stream
        for i in range(len(self.qkv)):
            h = self.norms[2 * i](x.float()).to(torch.bfloat16)
            q, k, v = self.linear(h, self.qkv[i]).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
            x = x + self.linear(a, self.proj[i]).float()
            h = self.norms[2 * i + 1](x).to(torch.bfloat16)
            x = x + self.linear(F.gelu(self.linear(h, self.fc[i])), self.fc_out[i]).float()
        logits = self.linear(self.norms[-1](x), self.embed.weight)
        return logits, shifted_lm_loss(logits, labels)


# --- the cases ---------------------------------------------------------------------------------------------

def _lm(vocab: int, T: int, B: int = 2, pad: int = 2):
    """Token ids and labels (the ids, the last `pad` positions of row 0 ignored as padding)."""
    def batch(g: torch.Generator) -> tuple:
        ids = torch.randint(0, vocab, (B, T), generator=g)
        labels = ids.clone()
        labels[0, T - pad:] = IGNORE
        return (ids, labels), None
    return batch


def _packed(g: torch.Generator) -> tuple:
    ids = torch.randint(0, 15, (2, 9), generator=g)
    boundaries = torch.zeros(2, 9, dtype=torch.bool)
    boundaries[0, [0, 3, 4]] = True                                              # documents of 3, 1, 5 tokens
    boundaries[1, [0, 6]] = True
    labels = ids.clone()
    labels[1, 8] = IGNORE
    return (ids, boundaries, labels), None


def _varlen(g: torch.Generator) -> tuple:
    cu_seqlens = torch.tensor([0, 3, 4, 9, 11])                                 # documents of 3, 1, 5, 2 tokens
    tokens = torch.randint(0, 11, (11,), generator=g)
    return (tokens, cu_seqlens, tokens.clone()), None


def _preferences(g: torch.Generator) -> tuple:
    """Pairs sharing a prompt (the first 3 tokens, masked out), responses of different lengths, padded."""
    prompt = torch.randint(0, 12, (3, 3), generator=g)
    chosen = torch.cat([prompt, torch.randint(0, 12, (3, 5), generator=g)], 1)
    rejected = torch.cat([prompt, torch.randint(0, 12, (3, 5), generator=g)], 1)
    positions = torch.arange(8)
    chosen_mask = (positions >= 3) & (positions < torch.tensor([8, 6, 7])[:, None])
    rejected_mask = (positions >= 3) & (positions < torch.tensor([7, 8, 5])[:, None])
    return (chosen, rejected, chosen_mask, rejected_mask), None


def _left_padded(g: torch.Generator) -> tuple:
    ids = torch.randint(0, 13, (3, 7), generator=g)
    attention_mask = (torch.arange(7) >= torch.tensor([0, 3, 1])[:, None]).long()    # 0, 3 and 1 pads on the left
    return (ids, attention_mask), None


def cases() -> list[Case]:
    neox = Case("neox_parallel_partial_rotary", NeoX, _lm(13, 7), own_loss)
    gemma = Case("gemma2_softcap_local_global", Gemma, _lm(17, 7), own_loss)
    packed = Case("qwen_packed_qk_norm_window", PackedQKNorm, _packed, own_loss)
    deepseek = Case("deepseek_mla_moe_mtp", DeepSeekMTP, _lm(19, 8), own_loss)
    mup = Case("mup_gpt_z_loss", MuPGPT, _lm(14, 9), own_loss)
    varlen = Case("switch_varlen_chunked_loss", SwitchVarlen, _varlen, own_loss)
    dpo = Case("dpo_frozen_reference", DPO, _preferences, own_loss)
    pure_gemma = Case("gemma2_pure_bf16", lambda: Gemma().bfloat16(), _lm(17, 7), own_loss, bf16=True)
    left_padded = Case("llama_left_padded_unmasked_rows", LeftPaddedLlama, _left_padded, own_loss)
    gpt_oss = Case("gpt_oss_sinks_yarn_clamped_swiglu", GptOss, _lm(15, 8), own_loss)
    return [neox, gemma, packed, deepseek, mup, varlen, dpo, pure_gemma, left_padded, bf16(left_padded),
            gpt_oss, bf16(gpt_oss), half(left_padded), fp16_autocast(neox), half(mup),
            Case("master_weights_bf16_casts", MasterWeightsLM, _lm(13, 7), own_loss, bf16=True),
            bf16(gemma), bf16(deepseek), bf16(neox),   # not varlen: eager bf16 is 30x further from fp64 than tfsn
            # the others upcast to fp32 on purpose (norms, softmax, the router, logits.float() before the
            # loss): in fp64 their values and gradients would carry fp32's rounding, 1e-7 apart
            fp64(mup)]
