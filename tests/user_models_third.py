"""A third set of models written the way users write them, for tests/test_optimizer_user_models_third.py.

tests/user_models.py and tests/user_models_more.py cover transformers (RoPE in the rotate_half form,
SDPA, nn.MultiheadAttention), convnets, mixers, recurrent cells, an einsum MoE and many library
losses. These cover what they do not: rotary embeddings in the complex form (view_as_complex,
polar) with grouped-query attention (repeat_interleave of k, v) and attention written by hand
with masked_fill(-inf) of a padding and causal mask; ALiBi slopes added to an SDPA's float
attn_mask, a tied embedding/LM head with label smoothing and ignore_index; a mixture of experts
whose tokens reach their experts by gather, index_add and scatter_add of the top-k's flat indices;
a decoder of depthwise-separable convs, ConvTranspose2d and bicubic F.interpolate on a non-contiguous
input; scans and masks (cumsum, cumprod, logcumsumexp, where with broadcasting, integer and boolean
masks, size-1 dims) with several losses of which some are 0-d and some a mean over a dim; ties
(amax, max, sort, median, clamp bounds of quantized values); attention rows masked entirely (NaN
softmax zeroed afterwards); unfold/fold, EmbeddingBag, cdist and grid_sample; nn.MultiheadAttention
as cross-attention with kdim/vdim; buffers written in forward (EMA, counters, a queue); overlapping
and strided views, negative and circular pads; a model cast to bfloat16; SDPA with enable_gqa and a
single query. Sizes are odd and tiny. Each model comes as a `tests.user_models.Case`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.user_models import Case, classify
from tests.user_models_more import bf16, fp64, own_loss

Tensor = torch.Tensor


# --- Llama with complex rotary embeddings, GQA and attention by hand ----------------------------------

class RMSNorm(nn.Module):
    """LLaMA's: the mean of squares in fp32, cast back to the input's dtype before the weight."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_cis(head_dim: int, seq: int, theta: float = 10000.0) -> Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    return torch.polar(torch.ones(seq, head_dim // 2), torch.outer(torch.arange(seq).float(), freqs))


def apply_rope(x: Tensor, cis: Tensor) -> Tensor:
    """x (B, T, H, D) rotated as complex pairs, the original LLaMA code."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis[None, :, None, :]).flatten(3).type_as(x)


class GQAttention(nn.Module):
    """q with 4 heads, k and v with 2 (repeat_interleave), RoPE, scores by matmul, a causal mask and a
    key padding mask filled with -inf, softmax in fp32."""

    def __init__(self, dim: int, heads: int = 4, kv_heads: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.register_buffer("cis", rope_cis(self.head_dim, seq), persistent=False)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:            # pad (B, T): True at padding
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.head_dim)
        k, v = self.wkv(x).view(B, T, 2, self.kv_heads, self.head_dim).unbind(2)
        q, k = apply_rope(q, self.cis[:T]), apply_rope(k, self.cis[:T])
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        mask = causal[None, None] & ~pad[:, None, None, :]
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = F.softmax(scores.float(), dim=-1).type_as(q)
        return self.wo((attn @ v).transpose(1, 2).reshape(B, T, -1))


class ComplexLlama(nn.Module):
    """Embedding, two blocks of RMSNorm + GQA + RMSNorm + SwiGLU, RMSNorm, head; the loss ignores the
    padded positions (ignore_index) and is computed in the model."""

    def __init__(self, vocab: int = 29, dim: int = 24, hidden: int = 37, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "n1": RMSNorm(dim), "attn": GQAttention(dim, seq=seq), "n2": RMSNorm(dim),
                "w1": nn.Linear(dim, hidden, bias=False), "w3": nn.Linear(dim, hidden, bias=False),
                "w2": nn.Linear(hidden, dim, bias=False)}))
        self.norm = RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: Tensor, pad: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        h = self.tok(idx)
        for b in self.blocks:
            h = h + b["attn"](b["n1"](h), pad)
            g = b["n2"](h)
            h = h + b["w2"](F.silu(b["w1"](g)) * b["w3"](g))
        logits = self.out(self.norm(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.masked_fill(pad, -100).flatten(), ignore_index=-100)


# --- ALiBi, a tied LM head, label smoothing -----------------------------------------------------------

def alibi_slopes(heads: int) -> Tensor:
    start = 2.0 ** (-8.0 / heads)
    return torch.tensor([start ** (i + 1) for i in range(heads)])


class ALiBiLM(nn.Module):
    """No position embeddings: a per-head linear distance bias (ALiBi) plus -inf above the diagonal, passed
    to F.scaled_dot_product_attention as a float attn_mask; LayerNorm without bias, GELU(tanh) MLP; the
    head's weight is the embedding's; label-smoothed cross-entropy with ignore_index."""

    def __init__(self, vocab: int = 31, dim: int = 18, heads: int = 3, seq: int = 13) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.ln1, self.ln2, self.lnf = (nn.LayerNorm(dim, bias=False) for _ in range(3))
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        pos = torch.arange(seq)
        distance = (pos[None, :] - pos[:, None]).float()                            # (T, T), <= 0 below
        bias = alibi_slopes(heads)[:, None, None] * distance
        self.register_buffer("bias", bias.masked_fill(distance > 0, float("-inf")), persistent=False)

    def forward(self, idx: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        B, T = idx.shape
        x = self.emb(idx)
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:, :T, :T])
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        x = x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        logits = self.head(self.lnf(x))
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1, label_smoothing=0.1)
        return logits, loss


# --- a mixture of experts dispatched by indices ----------------------------------------------------------

class IndexMoE(nn.Module):
    """Top-2 of 4 experts per token after a softmax over all experts (the weights renormalized); every
    expert runs on every token (a batched matmul over a (E, N, D) stack), each token's two outputs
    picked back by torch.gather and summed into place with index_add over flat token ids; the
    router's z-loss and a load-balancing term with scatter_add counts."""

    def __init__(self, d: int = 11, experts: int = 4, hidden: int = 13, classes: int = 5) -> None:
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(d, experts)
        self.w_in = nn.Parameter(torch.randn(experts, d, hidden) * 0.3)
        self.b_in = nn.Parameter(torch.zeros(experts, 1, hidden))
        self.w_out = nn.Parameter(torch.randn(experts, hidden, d) * 0.3)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        N = flat.shape[0]
        logits = self.router(flat)
        probs = logits.softmax(-1)
        weight, chosen = probs.topk(2, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        every = torch.bmm(F.relu(torch.bmm(flat.expand(self.experts, -1, -1), self.w_in) + self.b_in), self.w_out)
        picked = torch.gather(every.permute(1, 0, 2), 1, chosen[..., None].expand(-1, -1, D))   # (N, 2, D)
        token = torch.arange(N, device=x.device).repeat_interleave(2)
        out = torch.zeros_like(flat).index_add(0, token, (picked * weight[..., None]).reshape(-1, D))
        counts = torch.zeros(self.experts, device=x.device).scatter_add(0, chosen[:, 0], torch.ones(N, device=x.device))
        balance = self.experts * (counts / N * probs.mean(0)).sum()
        z_loss = torch.logsumexp(logits, -1).pow(2).mean()
        return self.head((flat + out).view(B, T, D).mean(1)), 0.01 * balance + 1e-3 * z_loss


def moe_loss(model: nn.Module, inputs: tuple, target: Tensor) -> tuple:
    out, aux = model(*inputs)
    return out, F.cross_entropy(out, target) + aux


# --- a conv decoder ---------------------------------------------------------------------------------------

class SeparableDecoder(nn.Module):
    """Depthwise-separable convs (depthwise 3x3 then pointwise 1x1) with BatchNorm and ReLU6, a stride-2
    ConvTranspose2d, bicubic F.interpolate to an odd size, a 1x1 conv to per-pixel logits; fed a
    non-contiguous (transposed) batch."""

    def __init__(self, c: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False)
        self.pw = nn.Conv2d(c, 2 * c, 1, bias=False)
        self.bn = nn.BatchNorm2d(2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 4, stride=2, padding=1)
        self.out = nn.Conv2d(c, classes, 1)

    def forward(self, x: Tensor) -> Tensor:                      # (B, 3, 9, 9), any strides
        h = F.relu6(self.bn(self.pw(self.dw(F.relu(self.stem(x))))))  # (B, 2c, 5, 5)
        h = F.silu(self.up(h))                                   # (B, c, 10, 10)
        return self.out(F.interpolate(h, size=(9, 9), mode="bicubic", align_corners=True))


# --- scans, masks, size-1 dims, several losses ----------------------------------------------------------

class ScanMasks(nn.Module):
    """A (B, 1, T, D) batch: cumsum and logcumsumexp over time, a cumprod of gates, an integer
    position mask built by comparisons and a boolean mask in torch.where broadcast over (1, T, 1)
    and (B, 1, D); squeeze/unsqueeze of size-1 dims; the loss adds a 0-d MSE, a mean over a dim
    reduced to 0-d afterwards and a detached-target term, with the prediction's scale computed under
    no_grad."""

    def __init__(self, d: int = 7, classes: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.gate = nn.Linear(d, 1)
        self.head = nn.Linear(2 * d, classes)

    def forward(self, x: Tensor, lengths: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        B, _, T, D = x.shape
        h = torch.tanh(self.lin(x)).squeeze(1)                           # (B, T, D)
        pos = torch.arange(T, device=x.device)
        valid = (pos[None, :] < lengths[:, None]).unsqueeze(-1)         # (B, T, 1) bool
        counts = valid.sum(1).clamp_min(1)                               # (B, 1) int
        running = torch.cumsum(h * valid, dim=1) / (pos + 1).view(1, T, 1)
        soft = torch.logcumsumexp(h, dim=1)
        keep = torch.cumprod(torch.sigmoid(self.gate(h)), dim=1)        # (B, T, 1)
        pick = torch.where(valid & (h > 0), running, soft * keep)       # (B, T, D)
        pooled = pick.sum(1) / counts
        last = torch.gather(h, 1, (lengths - 1).view(B, 1, 1).expand(B, 1, D)).squeeze(1)
        logits = self.head(torch.cat([pooled, last], -1))
        with torch.no_grad():
            scale = h.abs().amax().clamp_min(1e-3)
        recon = F.mse_loss(running[:, -1] / scale, h.mean(1).detach())                   # 0-d
        per_row = (pick.pow(2).mean(dim=-1) * valid.squeeze(-1)).sum(-1) / counts.squeeze(-1)  # (B,)
        return logits, F.cross_entropy(logits, target) + recon + 0.1 * per_row.mean()


# --- ties, fully masked rows, patches, cross-attention, state, views, pure bf16, SDPA variants ---------

class Ties(nn.Module):
    """Activations quantized to multiples of 0.5 by a straight-through estimator, so that values tie:
    amax, max(dim), amin, maximum of equal values, clamp at its exact bounds, relu/abs/hardtanh at 0,
    sort and median. Eager splits amax's gradient among ties and gives max(dim)'s to one index."""

    def __init__(self, d: int = 7, classes: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(8, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        q = h + (torch.round(h * 2) / 2 - h).detach()            # STE quantization: many ties
        a = q.amax(-1)
        m, _ = q.max(-1)
        mn = q.amin(-1)
        mx = torch.maximum(q, q.flip(-1)).mean(-1)
        cl = torch.clamp(q, -0.5, 0.5).mean(-1)
        r = (F.relu(q) + q.abs() + F.hardtanh(q, -0.5, 0.5)).mean(-1)
        s = torch.sort(q, dim=-1, descending=True).values[..., :2].sum(-1)
        med = q.median(-1).values
        return self.head(torch.stack([a, m, mn, mx, cl, r, s, med], -1))


class MaskedRows(nn.Module):
    """Attention by hand where some query rows are fully masked: softmax of all -inf gives NaN, the
    user zeroes those rows with masked_fill or nan_to_num afterwards (eager's gradient is finite)."""

    def __init__(self, d: int = 9, classes: int = 3) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:      # keep (B, T, T) bool, some rows all False
        q, k, v = self.qkv(x).chunk(3, -1)
        s = (q @ k.transpose(1, 2)).masked_fill(~keep, float("-inf"))
        a = s.softmax(-1).masked_fill(~keep.any(-1, keepdim=True), 0.0)
        b = torch.nan_to_num(s.softmax(-1), nan=0.0)
        return self.head(((a + b) @ v).mean(1))


class Patches(nn.Module):
    """F.unfold into patches, a Linear, F.fold back (overlapping, so sums), EmbeddingBag(mean) on
    offsets, torch.cdist to prototypes, F.grid_sample with an affine_grid from a predicted theta."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(3 * 9, 3 * 9)
        self.theta = nn.Linear(3, 6)
        self.protos = nn.Parameter(torch.randn(4, 3))
        self.bag = nn.EmbeddingBag(13, 4, mode="mean")
        self.head = nn.Linear(3 + 4 + 4, classes)

    def forward(self, x: Tensor, ids: Tensor, offsets: Tensor) -> Tensor:      # x (B, 3, 7, 7)
        B = x.shape[0]
        p = F.unfold(x, 3, padding=1, stride=2)                    # (B, 27, L)
        p = self.lin(p.transpose(1, 2)).transpose(1, 2)
        y = F.fold(p, (7, 7), 3, padding=1, stride=2)              # (B, 3, 7, 7)
        theta = torch.tanh(self.theta(y.mean((2, 3)))).view(B, 2, 3) * 0.3 + x.new_tensor([[1.0, 0, 0], [0, 1.0, 0]])
        grid = F.affine_grid(theta, (B, 3, 5, 5), align_corners=False)
        z = F.grid_sample(y, grid, align_corners=False).mean((2, 3))   # (B, 3)
        dist = torch.cdist(z, self.protos)                          # (B, 4)
        return self.head(torch.cat([z, dist, self.bag(ids, offsets)], -1))


class CrossMHA(nn.Module):
    """nn.MultiheadAttention as cross-attention: kdim/vdim != embed_dim, batch_first=False, a float
    attn_mask and key_padding_mask, the averaged weights used; ConvTranspose1d upsampling of the memory."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.up = nn.ConvTranspose1d(5, 6, 3, stride=2, padding=1, output_padding=1)
        self.mha = nn.MultiheadAttention(12, 3, kdim=6, vdim=6)
        self.head = nn.Linear(12, classes)

    def forward(self, q: Tensor, mem: Tensor, pad: Tensor, bias: Tensor) -> Tensor:  # q (L, B, 12), mem (B, 5, 4)
        m = F.gelu(self.up(mem)).permute(2, 0, 1)                  # (S, B, 6)
        out, w = self.mha(q, m, m, key_padding_mask=pad, attn_mask=bias)
        return self.head(out.mean(0) + w.amax((1, 2))[:, None])


class Stateful(nn.Module):
    """Buffers written in forward: an EMA of features under no_grad, an int step counter, a MoCo-style
    queue written at a pointer by index_copy_ and read back, a slice assignment into a buffer."""

    def __init__(self, d: int = 6, classes: int = 3, q: int = 10) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(d, d), nn.Linear(2 * d, classes)
        self.register_buffer("ema", torch.zeros(d))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue", torch.zeros(q, d))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("last", torch.zeros(2, d))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.lin(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
            self.steps += 1
            idx = (self.ptr + torch.arange(x.shape[0])) % self.queue.shape[0]
            self.queue.index_copy_(0, idx, h)
            self.ptr.copy_((self.ptr + x.shape[0]) % self.queue.shape[0])
            self.last[:, :] = h[:2]
        sim = h @ self.queue.t()                               # (B, q) against the queue (detached)
        feat = torch.cat([h - self.ema, sim.softmax(-1) @ self.queue], -1)
        return self.head(feat)


class ViewsZoo(nn.Module):
    """Tensor.unfold sliding windows (overlapping views), einsum diagonals ('bii->bi'), strided slices
    with steps, negative F.pad (crop), circular and replicate pads, an uneven split, narrow, baddbmm with
    alpha/beta, addcmul, lerp, torch.diff, as_strided."""

    def __init__(self, d: int = 7, classes: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.w = nn.Parameter(torch.randn(3, d) * 0.3)
        self.sq = nn.Parameter(torch.randn(d, d) * 0.3)
        self.head = nn.Linear(36, classes)

    def forward(self, x: Tensor) -> Tensor:                                    # (B, T=13, d=7)
        B, T, D = x.shape
        h = torch.tanh(self.lin(x))
        win = h.unfold(1, 3, 2)                              # (B, 6, D, 3) windows, overlapping
        conv = (win * self.w.t()).sum(-1).mean(1)            # (B, D)
        m = h.transpose(1, 2) @ h                            # (B, D, D)
        diag = torch.einsum("bii->bi", m)                    # (B, D)
        strided = h[:, 1::3, ::2].sum(1)                     # (B, 4)
        crop = F.pad(h, (-1, -2)).mean(1)                    # (B, 4)
        circ = F.pad(h.transpose(1, 2), (2, 1), mode="circular")[..., ::4].mean(-1)   # (B, D)
        rep = F.pad(h.transpose(1, 2), (1, 3), mode="replicate").amax(-1)   # (B, D)
        a, b, c = torch.split(h, [2, 5, 6], dim=1)
        nar = h.narrow(2, 2, 3).mean(1)                      # (B, 3)
        bmm = torch.baddbmm(m, a.transpose(1, 2), b[:, :2], alpha=0.5, beta=-0.3).mean(1)   # (B, D)
        ac = torch.addcmul(c.mean(1), conv, diag, value=0.2)
        le = torch.lerp(ac, rep, 0.3)
        dif = torch.diff(h, dim=1).abs().mean(1)
        ast = h.as_strided((B, 4, 2), (T * D, 3, 1), 1).sum(-1)   # (B, 4)
        feat = torch.cat([le + bmm, circ, strided, crop, nar, ast + dif[:, :4], dif[:, 4:] @ self.sq[:3]], -1)
        return self.head(feat)


class PureBF16(nn.Module):
    """A model cast to bfloat16 (no autocast): Linear, LayerNorm, GELU, softmax attention by hand, a
    residual, mean pooling; the loss in fp32 of the bf16 logits."""

    def __init__(self, d: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.ln, self.qkv = nn.LayerNorm(d), nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, -1)
        x = x + (q @ k.transpose(1, 2) / 4).softmax(-1) @ v
        x = x + self.mlp(x)
        return self.head(x.mean(1))


class SDPAVariants(nn.Module):
    """SDPA with enable_gqa (k, v with fewer heads), a (B, 1, 1, S) boolean key-padding mask, a single
    query (a decoding step) against expanded k, v with a float (B, H, 1, S) mask of -inf; head dim 13."""

    def __init__(self, d: int = 26, classes: int = 3) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * 13), nn.Linear(d, d)
        self.head = nn.Linear(2 * d, classes)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:      # x (B, T, 26), keep (B, T) bool
        B, T, D = x.shape
        q = self.q(x).view(B, T, 2, 13).transpose(1, 2)            # 2 heads
        k, v = self.kv(x).view(B, T, 1, 2, 13).permute(3, 0, 2, 1, 4)   # 1 kv head
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :], enable_gqa=True)
        last = q[:, :, -1:]                                         # (B, 2, 1, 13)
        bias = x.new_zeros(B, 2, 1, T).masked_fill(~keep[:, None, None, :], float("-inf"))
        z = F.scaled_dot_product_attention(last, k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1), attn_mask=bias,
                                           scale=0.2)
        y = self.o(y.transpose(1, 2).reshape(B, T, D)).mean(1)
        return self.head(torch.cat([y, z.reshape(B, D)], -1))


# --- the cases ----------------------------------------------------------------------------------------

def _llama(g: torch.Generator) -> tuple:
    idx = torch.randint(0, 29, (2, 7), generator=g)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    return (idx, pad, torch.randint(0, 29, (2, 7), generator=g)), None


def _alibi(g: torch.Generator) -> tuple:
    targets = torch.randint(0, 31, (3, 13), generator=g)
    targets[0, 10:] = -1
    return (torch.randint(0, 31, (3, 13), generator=g), targets), None


def _moe(g: torch.Generator) -> tuple:
    return (torch.randn(3, 5, 11, generator=g),), torch.randint(0, 5, (3,), generator=g)


def _decoder(g: torch.Generator) -> tuple:
    x = torch.randn(2, 3, 9, 9, generator=g).transpose(2, 3)          # non-contiguous
    return (x,), torch.randint(0, 3, (2, 9, 9), generator=g)


def _scans(g: torch.Generator) -> tuple:
    return ((torch.randn(4, 1, 13, 7, generator=g), torch.tensor([13, 5, 1, 9]),
             torch.randint(0, 3, (4,), generator=g)), None)


def _ties(g: torch.Generator) -> tuple:
    return (torch.randn(6, 7, generator=g),), torch.randint(0, 3, (6,), generator=g)


def _masked_rows(g: torch.Generator) -> tuple:
    keep = torch.rand(3, 5, 5, generator=g) > 0.4
    keep[1, :, 0] = True
    keep[0, 2] = False                                        # query rows that attend to nothing
    keep[2, 0] = False
    return (torch.randn(3, 5, 9, generator=g), keep), torch.randint(0, 3, (3,), generator=g)


def _patches(g: torch.Generator) -> tuple:
    return ((torch.randn(2, 3, 7, 7, generator=g), torch.randint(0, 13, (7,), generator=g), torch.tensor([0, 3])),
            torch.randint(0, 3, (2,), generator=g))


def _cross(g: torch.Generator) -> tuple:
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 6:] = True
    return ((torch.randn(5, 2, 12, generator=g), torch.randn(2, 5, 4, generator=g), pad, torch.randn(5, 8, generator=g)),
            torch.randint(0, 3, (2,), generator=g))


def _stateful(g: torch.Generator) -> tuple:
    return (torch.randn(4, 6, generator=g),), torch.randint(0, 3, (4,), generator=g)


def _views(g: torch.Generator) -> tuple:
    return (torch.randn(3, 13, 7, generator=g),), torch.randint(0, 3, (3,), generator=g)


def _pure_bf16(g: torch.Generator) -> tuple:
    return (torch.randn(3, 9, 16, generator=g).bfloat16(),), torch.randint(0, 5, (3,), generator=g)


def _sdpa(g: torch.Generator) -> tuple:
    keep = torch.ones(3, 7, dtype=torch.bool)
    keep[1, 4:] = False
    keep[2, 1:3] = False
    return (torch.randn(3, 7, 26, generator=g), keep), torch.randint(0, 3, (3,), generator=g)


def classify_fp32_loss(model: nn.Module, inputs: tuple, target: Tensor) -> tuple:
    """A bf16 model's logits, the cross-entropy of them in fp32."""
    out = model(*inputs)
    return out, F.cross_entropy(out.float(), target)


def cases() -> list[Case]:
    llama = Case("complex_rope_gqa", ComplexLlama, _llama, own_loss)
    alibi = Case("alibi_tied_lm", ALiBiLM, _alibi, own_loss)
    moe = Case("index_moe", IndexMoE, _moe, moe_loss)
    scans = Case("scan_masks", ScanMasks, _scans, own_loss)
    ties = Case("ties", Ties, _ties, classify)
    masked = Case("masked_rows", MaskedRows, _masked_rows, classify)
    views = Case("views_zoo", ViewsZoo, _views, classify)
    sdpa = Case("sdpa_variants", SDPAVariants, _sdpa, classify)
    return [llama, alibi, moe, scans, ties, masked, views, sdpa,
            Case("separable_decoder", SeparableDecoder, _decoder, classify),
            Case("patches", Patches, _patches, classify),
            Case("cross_mha", CrossMHA, _cross, classify),
            Case("stateful", Stateful, _stateful, classify),
            Case("pure_bf16", lambda: PureBF16().bfloat16(), _pure_bf16, classify_fp32_loss, bf16=True),
            # fp64: fp32's tolerance in units of fp64's epsilon, so a value computed in fp32 anywhere fails
            *(fp64(c) for c in (alibi, moe, scans, masked, views, sdpa)),
            bf16(alibi)]
