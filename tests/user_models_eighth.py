"""An eighth set of models written the way users write them, for tests/test_optimizer_user_models_eighth.py.

The earlier sets cover transformers (softmax attention, RoPE in the rotate_half and complex forms), convnets,
recurrent cells, generative and scientific models. These are the sub-quadratic sequence models that replace
softmax attention, written as their reference implementations are: a Mamba block (in_proj split into x and
a gate, a causal depthwise Conv1d by F.pad on the left, dt by softplus, A = -exp(A_log) discretized as
exp(dt * A), the selective scan once as a Python loop over time and once in parallel as Mamba-2's segment sum
(cumsum, differences masked by torch.tril to -inf, exp, einsum)); a minGRU whose parallel mode is Heinsen's
log-space scan (cumsum of log coefficients, torch.logcumsumexp); S4D with a Vandermonde kernel from complex
parameters held by view_as_real and a Hyena operator whose implicit filters are an MLP of sinusoidal
positions with an exponential decay window, both convolving by torch.fft.rfft / irfft at twice the length;
RWKV-4 (token shift by nn.ZeroPad2d with a negative pad, the WKV recurrence with its max-trick
stabilization, squared-relu channel mixing); causal linear attention (elu + 1 features, a cumsum of outer
products); RetNet's retention (decay mask from arange and masked_fill(inf) then exp and nan_to_num, xPos with
interleaved pairs rotated by stack/flatten, GroupNorm over heads, a swish gate) and rotary embeddings on
interleaved pairs by view_as_complex of a (..., 2) view; running extrema (cummax / cummin values and indices)
with torch.triu / torch.tril masks off the main diagonal; segment pooling by index_add and scatter_reduce
(amax, mean, include_self=False); GLU variants (SwiGLU, ReGLU, GeGLU with the tanh approximation); and
Mixture-of-Depths routing (topk capacity, sorted indices, gather, a block, scatter back onto the residual).
Sizes are odd and tiny. Each model comes as a `tests.user_models.Case`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tests.user_models import Case, classify
from tests.user_models_more import bf16, fp64, own_loss


class MambaBlock(nn.Module):
    """Mamba's mixer on (B, L, D): in_proj to x and z, a causal depthwise conv (kernel 4, padded on the left),
    SiLU, x_proj to (dt, B, C), dt_proj and softplus, the selective scan over A = -exp(A_log) (S4D-real init),
    the skip D * x, the gate silu(z), out_proj. `parallel` picks the scan: a Python loop over time, or the
    segment-sum form (h_t = sum_{s <= t} exp(cumsum(dt A)_t - cumsum(dt A)_s) dt_s B_s x_s)."""

    def __init__(self, d_model: int = 5, d_state: int = 3, expand: int = 2, d_conv: int = 4,
                 parallel: bool = False) -> None:
        super().__init__()
        d_inner = expand * d_model
        self.d_state, self.d_conv, self.parallel = d_state, d_conv, parallel
        self.dt_rank = math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner)
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def selective_scan_loop(self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
        dA = torch.exp(dt.unsqueeze(-1) * A)                                   # (b, l, d, n)
        dBx = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
        h = torch.zeros_like(dA[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = dA[:, t] * h + dBx[:, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
        return torch.stack(ys, dim=1)

    def selective_scan_segsum(self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
        L = x.shape[1]
        a_cum = torch.cumsum(dt.unsqueeze(-1) * A, dim=1)                      # (b, l, d, n)
        segsum = a_cum.unsqueeze(2) - a_cum.unsqueeze(1)                       # (b, t, s, d, n)
        causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=x.device))
        decay = torch.exp(segsum.masked_fill(~causal[None, :, :, None, None], float("-inf")))
        dBx = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)              # (b, s, d, n)
        h = torch.einsum("btsdn,bsdn->btdn", decay, dBx)
        return torch.einsum("btdn,btn->btd", h, C)

    def forward(self, hidden: Tensor) -> Tensor:
        L = hidden.shape[1]
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        x = self.conv1d(F.pad(x.transpose(1, 2), (self.d_conv - 1, 0)))[..., :L].transpose(1, 2)
        x = F.silu(x)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))
        A = -torch.exp(self.A_log.float())
        scan = self.selective_scan_segsum if self.parallel else self.selective_scan_loop
        y = scan(x, dt, A, B, C) + x * self.D
        return self.out_proj(y * F.silu(z))


class MambaLM(nn.Module):
    """Token embedding, two pre-RMSNorm Mamba blocks with residuals, a final norm and a tied head; the
    next-token cross-entropy. forward returns (logits, loss)."""

    def __init__(self, vocab: int = 11, d_model: int = 5, parallel: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(MambaBlock(d_model, parallel=parallel) for _ in range(2))
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in range(2))
        self.norm_f = nn.RMSNorm(d_model)

    def forward(self, tokens: Tensor) -> tuple:
        h = self.embedding(tokens)
        for norm, layer in zip(self.norms, self.layers):
            h = h + layer(norm(h))
        logits = self.norm_f(h) @ self.embedding.weight.T
        return logits, F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def log_g(x: Tensor) -> Tensor:
    """log of minGRU's g(x) = x + 0.5 for x >= 0, sigmoid(x) below: positive, so the scan runs in log space."""
    return torch.where(x >= 0, (F.relu(x) + 0.5).log(), -F.softplus(-x))


def heinsen_scan(log_coeffs: Tensor, log_values: Tensor) -> Tensor:
    """h_t = a_t h_{t-1} + b_t in parallel: log h = a* + logcumsumexp(log b - a*), a* = cumsum(log a)."""
    a_star = log_coeffs.cumsum(dim=1)
    log_h = a_star + torch.logcumsumexp(log_values - a_star, dim=1)
    return log_h.exp()


class MinGRU(nn.Module):
    """minGRU (Feng et al., "Were RNNs all we needed?") in its parallel mode: z = sigmoid(k), h~ = g(h), the
    scan by heinsen_scan from h_0 = g(h0) prepended; two layers with residuals, a classifier on the mean."""

    def __init__(self, d_in: int = 4, hidden: int = 7, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, hidden)
        self.to_hidden_and_gate = nn.ModuleList(nn.Linear(hidden, 2 * hidden, bias=False) for _ in range(2))
        self.h0 = nn.Parameter(torch.randn(hidden) * 0.1)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for layer in self.to_hidden_and_gate:
            hidden, gate = layer(h).chunk(2, dim=-1)
            log_coeffs = -F.softplus(gate)                                     # log(1 - z)
            log_z = -F.softplus(-gate)
            log_h0 = log_g(self.h0).expand(h.shape[0], 1, -1)
            log_values = torch.cat([log_h0, log_z + log_g(hidden)], dim=1)
            log_coeffs = F.pad(log_coeffs, (0, 0, 1, 0))
            h = h + heinsen_scan(log_coeffs, log_values)[:, 1:]
        return self.head(h.mean(1))


def fft_conv(u: Tensor, k: Tensor) -> Tensor:
    """The causal convolution of u (B, H, L) with a length-L kernel k (H, L), by rfft / irfft at 2L."""
    L = u.shape[-1]
    k_f = torch.fft.rfft(k, n=2 * L)
    u_f = torch.fft.rfft(u, n=2 * L)
    return torch.fft.irfft(u_f * k_f, n=2 * L)[..., :L]


class S4DKernel(nn.Module):
    """S4D's diagonal SSM kernel: A = -exp(log_A_real) + i A_imag (S4D-Lin init), dt = exp(log_dt), C complex
    held as a view_as_real parameter; K = 2 Re(sum_n C (exp(dt A) - 1) / A * exp(dt A)^l), the Vandermonde
    product by an einsum over the powers exp(dt A * arange(L))."""

    def __init__(self, h: int, n: int = 3, dt_min: float = 0.001, dt_max: float = 0.1) -> None:
        super().__init__()
        log_dt = torch.rand(h) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        self.log_dt = nn.Parameter(log_dt)
        self.C = nn.Parameter(torch.view_as_real(torch.randn(h, n, dtype=torch.cfloat)))
        self.log_A_real = nn.Parameter(torch.log(0.5 * torch.ones(h, n)))
        self.A_imag = nn.Parameter(math.pi * torch.arange(n).float().repeat(h, 1))

    def forward(self, L: int) -> Tensor:
        dt = torch.exp(self.log_dt)
        C = torch.view_as_complex(self.C)
        A = -torch.exp(self.log_A_real) + 1j * self.A_imag
        dtA = A * dt.unsqueeze(-1)
        K = dtA.unsqueeze(-1) * torch.arange(L, device=A.device)
        C = C * (torch.exp(dtA) - 1.0) / A
        return 2 * torch.einsum("hn,hnl->hl", C, torch.exp(K)).real


class S4D(nn.Module):
    """S4D layers on (B, L, d_in): an encoder, per layer the SSM by fft_conv plus u * D, GELU, a 1x1 Conv1d to
    2h and GLU, a residual and a LayerNorm; a classifier on the mean over time."""

    def __init__(self, d_in: int = 3, h: int = 5, layers: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.encoder = nn.Linear(d_in, h)
        self.kernels = nn.ModuleList(S4DKernel(h) for _ in range(layers))
        self.Ds = nn.ParameterList(nn.Parameter(torch.randn(h)) for _ in range(layers))
        self.outs = nn.ModuleList(nn.Sequential(nn.Conv1d(h, 2 * h, 1), nn.GLU(dim=-2)) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(h) for _ in range(layers))
        self.head = nn.Linear(h, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.encoder(x).transpose(-1, -2)                                 # (B, H, L)
        for kernel, D, out, norm in zip(self.kernels, self.Ds, self.outs, self.norms):
            u = x
            y = fft_conv(u, kernel(u.shape[-1])) + u * D.unsqueeze(-1)
            y = out(F.gelu(y))
            x = norm((y + u).transpose(-1, -2)).transpose(-1, -2)
        return self.head(x.mean(-1))


class Sin(nn.Module):
    """Hyena's filter activation sin(w x) with a learned frequency per channel."""

    def __init__(self, dim: int, w: float = 10.0) -> None:
        super().__init__()
        self.freq = nn.Parameter(w * torch.ones(1, dim))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(self.freq * x)


class HyenaOperator(nn.Module):
    """Hyena of order 2 on (B, L, D): in_proj to 3D, a short causal depthwise conv (kernel 3) over all three,
    the implicit long filters h = MLP(t, sin/cos(t f)) * exp(-|alpha| t) (an ExponentialModulation window),
    v <- x1 * fft_conv(v, h1) + bias, then again with x2; out_proj. forward returns (y, MSE to a target)."""

    def __init__(self, d: int = 5, emb: int = 5, filter_hidden: int = 8, max_len: int = 9) -> None:
        super().__init__()
        self.d = d
        self.in_proj = nn.Linear(d, 3 * d)
        self.short_filter = nn.Conv1d(3 * d, 3 * d, 3, padding=2, groups=3 * d)
        self.out_proj = nn.Linear(d, d)
        t = torch.linspace(0, 1, max_len)[None, :, None]                       # (1, L, 1)
        bands = (emb - 1) // 2
        f = torch.linspace(1e-4, bands - 1, bands)[None, None]
        z = torch.exp(-1j * 2 * math.pi * f * torch.linspace(0, max_len - 1, max_len)[None, :, None] / max_len)
        self.register_buffer("z", torch.cat([t, z.real, z.imag], dim=-1))      # (1, L, emb)
        self.register_buffer("t", t)
        self.implicit_filter = nn.Sequential(nn.Linear(emb, filter_hidden), Sin(filter_hidden),
                                             nn.Linear(filter_hidden, filter_hidden), Sin(filter_hidden),
                                             nn.Linear(filter_hidden, 2 * d, bias=False))
        self.deltas = nn.Parameter(torch.linspace(math.log(1e-2) / 0.3, math.log(1e-2) / 1.5, 2 * d)[None, None])
        self.filter_bias = nn.Parameter(torch.randn(2 * d))

    def forward(self, u: Tensor, target: Tensor) -> tuple:
        L = u.shape[1]
        uc = self.short_filter(self.in_proj(u).transpose(1, 2))[..., :L]        # (B, 3D, L), causal
        x1, x2, v = uc.split(self.d, dim=1)
        h = self.implicit_filter(self.z[:, :L]) * torch.exp(-self.t[:, :L] * self.deltas.abs())
        h = h[0].transpose(0, 1)                                                # (2D, L)
        for i, x in enumerate((x1, x2)):
            hi, bi = h[i * self.d:(i + 1) * self.d], self.filter_bias[i * self.d:(i + 1) * self.d]
            v = x * (fft_conv(v, hi) + v * bi.unsqueeze(-1))
        y = self.out_proj(v.transpose(1, 2))
        return y, F.mse_loss(y, target)


def wkv(k: Tensor, v: Tensor, w: Tensor, u: Tensor) -> Tensor:
    """RWKV-4's WKV recurrence over time (k, v: (B, T, C)) with its max trick, unrolled in Python as its
    reference code is: w the per-channel decay (negative), u the current token's bonus."""
    aa = torch.zeros_like(k[:, 0])
    bb = torch.zeros_like(k[:, 0])
    pp = torch.full_like(k[:, 0], -1e38)
    out = []
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        ww = u + kt
        p = torch.maximum(pp, ww)
        e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
        out.append((e1 * aa + e2 * vt) / (e1 * bb + e2))
        ww = pp + w
        p = torch.maximum(ww, kt)
        e1, e2 = torch.exp(ww - p), torch.exp(kt - p)
        aa, bb, pp = e1 * aa + e2 * vt, e1 * bb + e2, p
    return torch.stack(out, dim=1)


class RWKVTimeMix(nn.Module):
    """RWKV-4's time mixing: token shift (nn.ZeroPad2d((0, 0, 1, -1))) mixed into k, v, r by learned ratios,
    the WKV recurrence over time with the max trick (p = max(pp, ww); e1 = exp(pp - p), e2 = exp(ww - p)),
    sigmoid(r) * wkv, an output Linear."""

    def __init__(self, d: int) -> None:
        super().__init__()
        ratio = torch.arange(d, dtype=torch.float32) / d
        self.time_decay = nn.Parameter(-5 + 8 * (torch.arange(d) / (d - 1)) ** 0.7)
        self.time_first = nn.Parameter(torch.ones(d) * math.log(0.3) + 0.5 * (((torch.arange(d) + 1) % 3) - 1))
        self.time_mix_k = nn.Parameter(ratio[None, None])
        self.time_mix_v = nn.Parameter(ratio[None, None] + 0.3)
        self.time_mix_r = nn.Parameter(0.5 * ratio[None, None])
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.key, self.value, self.receptance = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.output = nn.Linear(d, d, bias=False)

    def wkv(self, k: Tensor, v: Tensor) -> Tensor:
        return wkv(k, v, -torch.exp(self.time_decay), self.time_first)

    def forward(self, x: Tensor) -> Tensor:
        xx = self.time_shift(x)
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xv = x * self.time_mix_v + xx * (1 - self.time_mix_v)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        return self.output(torch.sigmoid(self.receptance(xr)) * self.wkv(self.key(xk), self.value(xv)))


class RWKVChannelMix(nn.Module):
    """RWKV's channel mixing: token shift, k = relu(key(xk))^2, sigmoid(receptance(xr)) * value(k)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.time_mix_k = nn.Parameter(torch.rand(1, 1, d))
        self.time_mix_r = nn.Parameter(torch.rand(1, 1, d))
        self.key, self.value = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        xx = self.time_shift(x)
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        return torch.sigmoid(self.receptance(xr)) * self.value(torch.square(torch.relu(self.key(xk))))


class RWKV(nn.Module):
    """An RWKV-4 language model: embedding, ln0, one block (LayerNorm, time mix, LayerNorm, channel mix),
    ln_out, a head; the next-token cross-entropy. forward returns (logits, loss)."""

    def __init__(self, vocab: int = 13, d: int = 6, hidden: int = 11) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln0, self.ln1, self.ln2, self.ln_out = (nn.LayerNorm(d) for _ in range(4))
        self.att, self.ffn = RWKVTimeMix(d), RWKVChannelMix(d, hidden)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: Tensor) -> tuple:
        x = self.ln0(self.emb(tokens))
        x = x + self.att(self.ln1(x))
        x = x + self.ffn(self.ln2(x))
        logits = self.head(self.ln_out(x))
        return logits, F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


class LinearAttention(nn.Module):
    """Causal linear attention (Katharopoulos et al.): phi = elu + 1 on q and k, the running sums of the outer
    products k v^T and of k by cumsum over time, num / (q . sum k + eps); heads by view and transpose,
    a GLU-variant MLP (`glu`: swiglu, reglu or geglu with tanh GELU) after, both pre-LayerNorm."""

    def __init__(self, d: int = 6, heads: int = 2, hidden: int = 7, glu: str = "swiglu", eps: float = 1e-6) -> None:
        super().__init__()
        self.heads, self.eps, self.glu = heads, eps, glu
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.w12, self.w3 = nn.Linear(d, 2 * hidden, bias=False), nn.Linear(hidden, d, bias=False)

    def attend(self, x: Tensor) -> Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        kv = torch.cumsum(torch.einsum("bhld,bhle->bhlde", k, v), dim=2)
        num = torch.einsum("bhld,bhlde->bhle", q, kv)
        den = torch.einsum("bhld,bhld->bhl", q, k.cumsum(dim=2)) + self.eps
        return self.proj((num / den.unsqueeze(-1)).transpose(1, 2).reshape(B, L, D))

    def mlp(self, x: Tensor) -> Tensor:
        a, b = self.w12(x).chunk(2, dim=-1)
        act = {"swiglu": F.silu, "reglu": F.relu, "geglu": lambda t: F.gelu(t, approximate="tanh")}[self.glu]
        return self.w3(act(a) * b)

    def forward(self, x: Tensor, target: Tensor) -> tuple:
        x = x + self.attend(self.norm1(x))
        y = x + self.mlp(self.norm2(x))
        return y, F.smooth_l1_loss(y, target)


def rotate_every_two(x: Tensor) -> Tensor:
    """(x0, x1, x2, x3, ...) to (-x1, x0, -x3, x2, ...): the interleaved pairs' quarter turn."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class RetNet(nn.Module):
    """RetNet's multi-scale retention (torchscale's parallel form): per head a decay log(1 - 2^(-5 - h)); the
    mask from arange differences, masked_fill of the upper triangle with inf, exp(mask * decay), nan_to_num,
    rows normalized by their sqrt sum; xPos on q and k (sin/cos of interleaved pairs, a scale per position
    from scale_base, k by its inverse); retention scores normalized by their clamped abs row sum; GroupNorm
    over heads, a swish gate, an output Linear; then a feed-forward; a classifier on the last position."""

    def __init__(self, d: int = 8, heads: int = 2, classes: int = 3, scale_base: float = 512.0) -> None:
        super().__init__()
        self.heads, self.head_dim, self.scale_base = heads, d // heads, scale_base
        self.q, self.k, self.v, self.g, self.out = (nn.Linear(d, d, bias=False) for _ in range(5))
        self.group_norm = nn.GroupNorm(heads, d, affine=False)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, classes)
        angle = 1.0 / (10000 ** torch.linspace(0, 1, self.head_dim // 2))
        self.register_buffer("angle", angle.unsqueeze(-1).repeat(1, 2).flatten())
        self.register_buffer("decay", torch.log(1 - 2 ** (-5 - torch.arange(heads, dtype=torch.float))))
        self.register_buffer("xpos_scale", (torch.arange(0, self.head_dim, 2) + 0.4 * self.head_dim) / (1.4 * self.head_dim))

    def retention_rel_pos(self, L: int, device: torch.device) -> tuple:
        index = torch.arange(L, device=device).to(self.decay)
        sin, cos = torch.sin(index[:, None] * self.angle[None, :]), torch.cos(index[:, None] * self.angle[None, :])
        mask = torch.tril(torch.ones(L, L, device=device))
        mask = torch.masked_fill(index[:, None] - index[None, :], ~mask.bool(), float("inf"))
        mask = torch.exp(mask * self.decay[:, None, None])
        mask = torch.nan_to_num(mask)
        mask = mask / mask.sum(dim=-1, keepdim=True).sqrt()
        scale = self.xpos_scale ** (index / self.scale_base)[:, None]
        scale = scale.repeat_interleave(2, dim=-1)
        return sin, cos, mask, scale

    def forward(self, x: Tensor) -> Tensor:
        B, L, D = x.shape
        sin, cos, mask, scale = self.retention_rel_pos(L, x.device)
        h = self.ln1(x)
        q = self.q(h).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(B, L, self.heads, self.head_dim).transpose(1, 2) * self.head_dim ** -0.5
        v = self.v(h).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        qr = (q * cos + rotate_every_two(q) * sin) * scale
        kr = (k * cos + rotate_every_two(k) * sin) / scale
        qk = qr @ kr.transpose(-1, -2) * mask
        qk = qk / qk.detach().abs().sum(dim=-1, keepdim=True).clamp(min=1)
        o = (qk @ v).transpose(1, 2).reshape(B, L, D)
        o = self.group_norm(o.reshape(B * L, D)).view(B, L, D)
        x = x + self.out(F.silu(self.g(h)) * o)
        x = x + self.ffn(self.ln2(x))
        return self.head(x[:, -1])


def apply_rotary_interleaved(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Rotary on interleaved pairs: x (B, L, H, hd) viewed as (..., hd/2, 2), view_as_complex, times e^{i m
    theta}, view_as_real and flatten back; computed in float32 and cast back, as Llama's apply_rotary_emb."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None]).flatten(3).type_as(x)


class RunningExtrema(nn.Module):
    """Rotary self-attention whose causal mask is torch.triu(ones, diagonal=1) and which also may not look
    more than `window` steps back (torch.tril(ones, diagonal=-window)); then running extrema of the sequence:
    cummax and cummin values over time, the cummax indices as a feature (how far back the maximum is),
    ReGLU; a classifier on the mean over time."""

    def __init__(self, d: int = 6, heads: int = 3, window: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(d, 3 * d)
        hd = d // heads
        theta = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("theta", theta)
        self.mix = nn.Linear(3 * d + 1, 2 * d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        B, L, D = x.shape
        freqs_cis = torch.polar(torch.ones(L, self.theta.numel()), torch.outer(torch.arange(L).float(), self.theta))
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).unbind(2)
        q, k = apply_rotary_interleaved(q, freqs_cis), apply_rotary_interleaved(k, freqs_cis)
        scores = torch.einsum("blhd,bmhd->bhlm", q, k) / math.sqrt(D // self.heads)
        ones = torch.ones(L, L, dtype=torch.bool, device=x.device)
        blocked = torch.triu(ones, diagonal=1) | torch.tril(ones, diagonal=-self.window)
        att = scores.masked_fill(blocked, float("-inf")).softmax(-1)
        h = torch.einsum("bhlm,bmhd->blhd", att, v).reshape(B, L, D)
        running_max, argmax = torch.cummax(h, dim=1)
        running_min = torch.cummin(h, dim=1).values
        since = (torch.arange(L, device=x.device)[None, :, None] - argmax).float().mean(-1, keepdim=True)
        a, b = self.mix(torch.cat([h, running_max, running_min, since / L], -1)).chunk(2, -1)
        return self.head((F.relu(a) * b).mean(1))


class SegmentPool(nn.Module):
    """Pooling node features into their graphs (a `batch` vector, as PyG's global pools): the sum by
    index_add_, the max by scatter_reduce("amax", include_self=False) onto zeros, the mean by
    scatter_reduce("mean", include_self=False); an empty graph pools to zeros. GeGLU (tanh) on the concat."""

    def __init__(self, d: int = 4, hidden: int = 5, graphs: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.graphs = graphs
        self.node = nn.Sequential(nn.Linear(d, hidden), nn.Tanh())
        self.w12 = nn.Linear(3 * hidden, 2 * hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor, batch: Tensor) -> Tensor:
        h = self.node(x)
        size = (self.graphs, h.shape[1])
        summed = torch.zeros(size, dtype=h.dtype, device=h.device).index_add_(0, batch, h)
        index = batch[:, None].expand_as(h)
        peak = torch.zeros(size, dtype=h.dtype, device=h.device).scatter_reduce(0, index, h, "amax", include_self=False)
        mean = torch.zeros(size, dtype=h.dtype, device=h.device).scatter_reduce(0, index, h, "mean", include_self=False)
        a, b = self.w12(torch.cat([summed, peak, mean], -1)).chunk(2, -1)
        return self.head(F.gelu(a, approximate="tanh") * b)


class MoDBlock(nn.Module):
    """Mixture-of-Depths: a router scores every token, the top `capacity` per sequence (indices sorted, to keep
    causal order) are gathered, run through a pre-norm attention + SwiGLU block whose output is scaled by the
    router weight, and scattered back onto the residual stream; the others skip the block."""

    def __init__(self, d: int = 6, heads: int = 2, hidden: int = 7, capacity: float = 0.5) -> None:
        super().__init__()
        self.heads, self.capacity = heads, capacity
        self.router = nn.Linear(d, 1)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w2, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False), \
            nn.Linear(hidden, d, bias=False)

    def block(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, D // self.heads).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, D))
        h = self.norm2(x)
        return x + self.w3(F.silu(self.w1(h)) * self.w2(h))

    def forward(self, x: Tensor) -> Tensor:
        B, L, D = x.shape
        k = max(1, int(self.capacity * L))
        weights = self.router(x).squeeze(-1)                                   # (B, L)
        top_w, top_i = torch.topk(weights, k, dim=1, sorted=False)
        top_i, order = torch.sort(top_i, dim=1)
        top_w = torch.gather(top_w, 1, order)
        index = top_i.unsqueeze(-1).expand(-1, -1, D)
        selected = torch.gather(x, 1, index)
        processed = (self.block(selected) - selected) * torch.sigmoid(top_w).unsqueeze(-1)
        return torch.scatter_add(x, 1, index, processed)


class MoDTransformer(nn.Module):
    """Embedding, alternating MoD and (full) blocks as the paper's interleaved setup, a classifier on the mean."""

    def __init__(self, vocab: int = 11, d: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([MoDBlock(d), MoDBlock(d, capacity=1.0), MoDBlock(d, capacity=0.3)])
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


# --- the cases --------------------------------------------------------------------------------------------

def _tokens(vocab: int, length: int = 9) -> Callable:
    """Token ids (2, length), and a class per sequence (the models with their own loss ignore it)."""
    def batch(g: torch.Generator) -> tuple:
        return (torch.randint(0, vocab, (2, length), generator=g),), torch.randint(0, 3, (2,), generator=g)
    return batch


def _series(g: torch.Generator) -> tuple:
    return (torch.randn(3, 7, 4, generator=g),), torch.randint(0, 3, (3,), generator=g)


def _signals(g: torch.Generator) -> tuple:
    return (torch.randn(3, 9, 3, generator=g),), torch.randint(0, 3, (3,), generator=g)


def _hyena(g: torch.Generator) -> tuple:
    return (torch.randn(2, 9, 5, generator=g), torch.randn(2, 9, 5, generator=g)), None


def _linear_attention(g: torch.Generator) -> tuple:
    return (torch.randn(2, 7, 6, generator=g), torch.randn(2, 7, 6, generator=g)), None


def _sequences(d: int) -> Callable:
    def batch(g: torch.Generator) -> tuple:
        return (torch.randn(3, 7, d, generator=g),), torch.randint(0, 3, (3,), generator=g)
    return batch


def _graphs(g: torch.Generator) -> tuple:
    batch = torch.tensor([0, 0, 0, 1, 3, 3, 3, 3, 1])                        # graph 2 is empty, unsorted nodes
    return (torch.randn(9, 4, generator=g), batch), torch.randint(0, 3, (4,), generator=g)


def cases() -> list[Case]:
    mamba = Case("mamba_loop_scan", MambaLM, _tokens(11), own_loss)
    mamba_segsum = Case("mamba_segsum_scan", lambda: MambaLM(parallel=True), _tokens(11), own_loss)
    min_gru = Case("min_gru_log_space", MinGRU, _series, classify)
    s4d = Case("s4d_fft_conv", S4D, _signals, classify)
    linear = Case("linear_attention_swiglu", LinearAttention, _linear_attention, own_loss)
    return [mamba, mamba_segsum, min_gru, s4d,
            Case("hyena", HyenaOperator, _hyena, own_loss),
            Case("rwkv4", RWKV, _tokens(13, 4), own_loss),
            linear,
            Case("linear_attention_reglu", lambda: LinearAttention(glu="reglu"), _linear_attention, own_loss),
            Case("linear_attention_geglu", lambda: LinearAttention(glu="geglu"), _linear_attention, own_loss),
            Case("retnet_xpos", RetNet, _sequences(8), classify),
            Case("rotary_interleaved_running_extrema", RunningExtrema, _sequences(6), classify),
            Case("segment_pool", SegmentPool, _graphs, classify),
            Case("mixture_of_depths", MoDTransformer, _tokens(11), classify),
            bf16(linear),
            *(fp64(c) for c in (mamba, min_gru, s4d))]
