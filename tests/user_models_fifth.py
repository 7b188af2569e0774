"""A fifth set of models written the way users write them, for tests/test_optimizer_user_models_fifth.py.

The earlier sets (tests/user_models.py, _more, _third, _fourth) cover transformers, convnets, recurrent
nets, many losses and view idioms. These follow the reference code people copy for what they do not:
LoRA adapters on frozen Linears (loralib's form, and a layer that merges B @ A into the weight in
forward), with only the adapters and the head trained; ConvNeXt blocks (depthwise 7x7 conv, NHWC
LayerNorm, inverted MLP, layer scale) with ConvNeXt's hand-written channels-first LayerNorm in the
downsampling layer and ConvNeXt V2's global response norm; Swin's shifted-window attention (torch.roll,
window partition by view/permute, a relative position bias table indexed by a long buffer, the
shifted-window mask built in __init__, patch merging); a Perceiver (learned latents expanded to the
batch, cross-attention by hand with a boolean mask filled with -finfo.max, latent self-attention
through nn.MultiheadAttention, GEGLU); sinusoidal position embeddings computed in forward and a
diffusion UNet's timestep embedding driving a scale-shift; a VAE (eps as an input, sigmoid with
F.binary_cross_entropy and the KL term); the full nn.Transformer with a causal mask. Sizes are odd
and tiny. Each model comes as a `tests.user_models.Case`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.user_models import Case, classify
from tests.user_models_more import fp64, own_loss

Tensor = torch.Tensor


# --- LoRA ---------------------------------------------------------------------------------------------

class LoRALinear(nn.Linear):
    """loralib's Linear: the pretrained weight frozen, x @ A^T @ B^T * alpha / r added (B is zero at
    init in the paper; random here so that every gradient is non-trivial)."""

    def __init__(self, d_in: int, d_out: int, r: int = 3, alpha: float = 6.0, merge: bool = False) -> None:
        super().__init__(d_in, d_out)
        self.lora_A = nn.Parameter(torch.empty(r, d_in))
        self.lora_B = nn.Parameter(torch.randn(d_out, r) * 0.1)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / r
        self.lora_dropout = nn.Dropout(p=0.0)
        self.merge = merge
        self.weight.requires_grad_(False)
        self.bias.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        if self.merge:                                  # the adapted weight, as merge_weights computes it
            return F.linear(x, self.weight + (self.lora_B @ self.lora_A) * self.scaling, self.bias)
        result = F.linear(x, self.weight, bias=self.bias)
        return result + (self.lora_dropout(x) @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)) * self.scaling


class LoRABlock(nn.Module):
    """A pre-norm transformer block whose q and v projections carry adapters (the paper's choice), the
    rest frozen; the MLP's first Linear merges its adapter into the weight."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = LoRALinear(d, d), nn.Linear(d, d), LoRALinear(d, d)
        self.o = nn.Linear(d, d)
        self.fc1, self.fc2 = LoRALinear(d, 2 * d, merge=True), nn.Linear(2 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LoRAClassifier(nn.Module):
    """A frozen embedding and block (all but the adapters, as mark_only_lora_as_trainable leaves them), a
    trained head."""

    def __init__(self, vocab: int = 23, d: int = 12, heads: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = LoRABlock(d, heads)
        self.head = nn.Linear(d, classes)
        for name, p in self.named_parameters():
            if "lora_" not in name and not name.startswith("head"):
                p.requires_grad_(False)

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(self.block(self.emb(idx)).mean(1))


# --- ConvNeXt -----------------------------------------------------------------------------------------

class ChannelsFirstLayerNorm(nn.Module):
    """ConvNeXt's LayerNorm(data_format="channels_first"): statistics over dim 1 of (B, C, H, W)."""

    def __init__(self, c: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class GRN(nn.Module):
    """ConvNeXt V2's global response norm on NHWC: the L2 norm over H, W divided by its channel mean."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.randn(1, 1, 1, c) * 0.1), nn.Parameter(torch.zeros(1, 1, 1, c))

    def forward(self, x: Tensor) -> Tensor:
        gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * nx) + self.beta + x


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 conv, permute to NHWC, LayerNorm, Linear 4x, GELU (GRN in V2), Linear, layer scale,
    permute back, residual."""

    def __init__(self, c: int, v2: bool = False) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, kernel_size=7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.pwconv1, self.pwconv2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.act = nn.GELU()
        self.grn = GRN(4 * c) if v2 else nn.Identity()
        self.gamma = nn.Parameter(torch.full((c,), 0.5))       # layer_scale_init_value (1e-6 in the paper)

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x
        x = self.dwconv(x).permute(0, 2, 3, 1)                  # (N, C, H, W) -> (N, H, W, C)
        x = self.pwconv2(self.grn(self.act(self.pwconv1(self.norm(x)))))
        x = (self.gamma * x).permute(0, 3, 1, 2)
        return shortcut + x


class ConvNeXt(nn.Module):
    """A patchify stem with a channels-first LayerNorm, a block, a downsampling layer (channels-first
    LayerNorm, stride-2 conv), a V2 block, global average pooling, LayerNorm, head."""

    def __init__(self, c: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 2, stride=2), ChannelsFirstLayerNorm(c))
        self.stage1 = ConvNeXtBlock(c)
        self.down = nn.Sequential(ChannelsFirstLayerNorm(c), nn.Conv2d(c, 2 * c, 2, stride=2))
        self.stage2 = ConvNeXtBlock(2 * c, v2=True)
        self.norm = nn.LayerNorm(2 * c, eps=1e-6)
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean([-2, -1])))


# --- Swin ---------------------------------------------------------------------------------------------

def window_partition(x: Tensor, ws: int) -> Tensor:
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, C)


def window_reverse(windows: Tensor, ws: int, H: int, W: int) -> Tensor:
    B = int(windows.shape[0] / (H * W / ws / ws))
    x = windows.view(B, H // ws, W // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)


class WindowAttention(nn.Module):
    """Swin's window attention: a (2ws-1)^2 x heads bias table indexed by relative_position_index."""

    def __init__(self, dim: int, ws: int, heads: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * ws - 1) * (2 * ws - 1), heads) * 0.02)
        coords = torch.stack(torch.meshgrid([torch.arange(ws), torch.arange(ws)], indexing="ij"))
        coords_flatten = torch.flatten(coords, 1)
        relative_coords = (coords_flatten[:, :, None] - coords_flatten[:, None, :]).permute(1, 2, 0).contiguous()
        relative_coords[:, :, 0] += ws - 1
        relative_coords[:, :, 1] += ws - 1
        relative_coords[:, :, 0] *= 2 * ws - 1
        self.register_buffer("relative_position_index", relative_coords.sum(-1))
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(N, N, -1)
        attn = attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, N, N)
        x = (self.softmax(attn) @ v).transpose(1, 2).reshape(B_, N, C)
        return self.proj(x)


class SwinBlock(nn.Module):
    """Norm, cyclic shift by -shift, windows, masked window attention, reverse, shift back; MLP."""

    def __init__(self, dim: int, res: int, heads: int, ws: int, shift: int) -> None:
        super().__init__()
        self.res, self.ws, self.shift = res, ws, shift
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, ws, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        attn_mask = None
        if shift > 0:
            img_mask = torch.zeros((1, res, res, 1))
            slices = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
            cnt = 0
            for h in slices:
                for w in slices:
                    img_mask[:, h, w, :] = cnt
                    cnt += 1
            mask_windows = window_partition(img_mask, ws).view(-1, ws * ws)
            attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
            attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))
        self.register_buffer("attn_mask", attn_mask)

    def forward(self, x: Tensor) -> Tensor:
        H = W = self.res
        B, L, C = x.shape
        shortcut = x
        x = self.norm1(x).view(B, H, W, C)
        if self.shift > 0:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        windows = window_partition(x, self.ws).view(-1, self.ws * self.ws, C)
        windows = self.attn(windows, mask=self.attn_mask).view(-1, self.ws, self.ws, C)
        x = window_reverse(windows, self.ws, H, W)
        if self.shift > 0:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = shortcut + x.view(B, H * W, C)
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """2x2 neighbours concatenated on channels by strided slices, LayerNorm, Linear 4C -> 2C."""

    def __init__(self, res: int, dim: int) -> None:
        super().__init__()
        self.res = res
        self.norm, self.reduction = nn.LayerNorm(4 * dim), nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, L, C = x.shape
        x = x.view(B, self.res, self.res, C)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x.view(B, -1, 4 * C)))


class Swin(nn.Module):
    """Patch embedding (conv, flatten, LayerNorm), a regular and a shifted window block, patch merging,
    LayerNorm, mean over tokens, head."""

    def __init__(self, dim: int = 9, heads: int = 3, res: int = 6, ws: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.patch_embed, self.patch_norm = nn.Conv2d(3, dim, 2, stride=2), nn.LayerNorm(dim)
        self.blocks = nn.Sequential(SwinBlock(dim, res, heads, ws, 0), SwinBlock(dim, res, heads, ws, ws // 2))
        self.merge = PatchMerging(res, dim)
        self.norm, self.head = nn.LayerNorm(2 * dim), nn.Linear(2 * dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_norm(self.patch_embed(x).flatten(2).transpose(1, 2))
        x = self.norm(self.merge(self.blocks(x)))
        return self.head(x.mean(1))


# --- Perceiver ----------------------------------------------------------------------------------------

class CrossAttention(nn.Module):
    """lucidrains' Perceiver cross-attention: einsum scores, a boolean mask (True keeps a key) filled
    in place with -finfo.max."""

    def __init__(self, q_dim: int, kv_dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads, self.scale = heads, head_dim ** -0.5
        self.to_q, self.to_kv = nn.Linear(q_dim, inner, bias=False), nn.Linear(kv_dim, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, q_dim)

    def forward(self, x: Tensor, context: Tensor, mask: Tensor) -> Tensor:
        h = self.heads
        q, (k, v) = self.to_q(x), self.to_kv(context).chunk(2, dim=-1)
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, -1).permute(0, 2, 1, 3).flatten(0, 1) for t in (q, k, v))
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        mask = mask[:, None, None, :].expand(-1, h, 1, -1).flatten(0, 1)          # (b h) 1 j
        sim.masked_fill_(~mask, -torch.finfo(sim.dtype).max)
        out = torch.einsum("b i j, b j d -> b i d", sim.softmax(dim=-1), v)
        out = out.unflatten(0, (-1, h)).permute(0, 2, 1, 3).flatten(2)
        return self.to_out(out)


class GEGLUFeedForward(nn.Module):
    def __init__(self, d: int, mult: int = 2) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(d, d * mult * 2), nn.Linear(d * mult, d)

    def forward(self, x: Tensor) -> Tensor:
        x, gates = self.proj(x).chunk(2, dim=-1)
        return self.out(x * F.gelu(gates))


class Perceiver(nn.Module):
    """Learned latents expanded to the batch, pre-norm cross-attention to the (padded) inputs, a latent
    self-attention block (nn.MultiheadAttention, need_weights=False), GEGLU feed-forwards, mean pool."""

    def __init__(self, d_in: int = 7, latents: int = 5, d: int = 12, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(latents, d))
        self.norm_x, self.norm_ctx = nn.LayerNorm(d), nn.LayerNorm(d_in)
        self.cross = CrossAttention(d, d_in, 1, 8)
        self.cross_ff, self.norm_ff = GEGLUFeedForward(d), nn.LayerNorm(d)
        self.norm_self = nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.self_ff, self.norm_ff2 = GEGLUFeedForward(d), nn.LayerNorm(d)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, classes))

    def forward(self, data: Tensor, mask: Tensor) -> Tensor:
        x = self.latents.unsqueeze(0).expand(data.shape[0], -1, -1)
        x = self.cross(self.norm_x(x), self.norm_ctx(data), mask) + x
        x = self.cross_ff(self.norm_ff(x)) + x
        h = self.norm_self(x)
        x = self.self_attn(h, h, h, need_weights=False)[0] + x
        x = self.self_ff(self.norm_ff2(x)) + x
        return self.head(x.mean(dim=-2))


# --- sinusoidal positions and a diffusion timestep embedding -----------------------------------------

def sinusoidal_positions(T: int, d: int) -> Tensor:
    """"Attention is all you need": sin at even, cos at odd features, interleaved by stack and flatten."""
    position = torch.arange(T, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    return torch.stack([torch.sin(position * div_term), torch.cos(position * div_term)], dim=-1).flatten(1)


def timestep_embedding(timesteps: Tensor, dim: int, max_period: int = 10000) -> Tensor:
    """The guided-diffusion UNet's: cos and sin of t times geometric frequencies; a zero column for odd dims."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
    args = timesteps[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


class TokenDenoiser(nn.Module):
    """Token embeddings scaled by sqrt(d) plus sinusoidal positions; the timestep embedding through an MLP
    gives a scale and shift (AdaLN, as DiT) around a LayerNorm and a GELU MLP; the predicted noise's MSE."""

    def __init__(self, vocab: int = 19, d: int = 10, t_dim: int = 7) -> None:
        super().__init__()
        self.d, self.t_dim = d, t_dim
        self.emb = nn.Embedding(vocab, d)
        self.time_embed = nn.Sequential(nn.Linear(t_dim, 4 * d), nn.SiLU(), nn.Linear(4 * d, 2 * d))
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))
        self.out = nn.Linear(d, d)

    def forward(self, idx: Tensor, t: Tensor, noise: Tensor) -> tuple:
        T = idx.shape[1]
        x = self.emb(idx) * math.sqrt(self.d) + sinusoidal_positions(T, self.d)
        scale, shift = self.time_embed(timestep_embedding(t, self.t_dim)).chunk(2, dim=-1)
        x = x + self.mlp(self.norm(x) * (1 + scale[:, None]) + shift[:, None])
        pred = self.out(x)
        return pred, F.mse_loss(pred, noise)


# --- a VAE ----------------------------------------------------------------------------------------

class VAE(nn.Module):
    """The PyTorch examples' VAE: an encoder to mu and logvar, the reparameterization with eps given as an
    input (torch.randn_like in the example), a sigmoid decoder, BCE (sum) plus the KL term."""

    def __init__(self, d: int = 13, hidden: int = 11, z: int = 3) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(d, hidden), nn.Linear(hidden, z), nn.Linear(hidden, z)
        self.fc3, self.fc4 = nn.Linear(z, hidden), nn.Linear(hidden, d)

    def forward(self, x: Tensor, eps: Tensor) -> tuple:
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        zs = mu + eps * torch.exp(0.5 * logvar)
        recon = torch.sigmoid(self.fc4(F.relu(self.fc3(zs))))
        bce = F.binary_cross_entropy(recon, x, reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        return recon, (bce + kld) / x.shape[0]


# --- the full nn.Transformer -----------------------------------------------------------------------

class Translator(nn.Module):
    """nn.Transformer (one encoder and one decoder layer, with their final norms) between shared
    embeddings with sinusoidal positions; a causal tgt_mask from generate_square_subsequent_mask and a
    padding mask of the source; cross-entropy with label smoothing over the target's next tokens."""

    def __init__(self, vocab: int = 17, d: int = 8) -> None:
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(vocab, d)
        self.transformer = nn.Transformer(d, 2, 1, 1, 3 * d, dropout=0.0, batch_first=True)
        self.generator = nn.Linear(d, vocab)

    def forward(self, src: Tensor, tgt: Tensor, src_pad: Tensor) -> tuple:
        embed = lambda t: self.emb(t) * math.sqrt(self.d) + sinusoidal_positions(t.shape[1], self.d)  # noqa: E731
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
        mask = self.transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        y = self.transformer(embed(src), embed(tgt_in), tgt_mask=mask, src_key_padding_mask=src_pad,
                             memory_key_padding_mask=src_pad)
        logits = self.generator(y)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1), label_smoothing=0.1)


# --- the batches and cases ---------------------------------------------------------------------------

def _lora(g: torch.Generator) -> tuple:
    return (torch.randint(0, 23, (3, 7), generator=g),), torch.randint(0, 4, (3,), generator=g)


def _images(g: torch.Generator, n: int, size: int, classes: int) -> tuple:
    return (torch.randn(n, 3, size, size, generator=g),), torch.randint(0, classes, (n,), generator=g)


def _perceiver(g: torch.Generator) -> tuple:
    keep = torch.ones(3, 9, dtype=torch.bool)
    keep[0, 6:] = False
    keep[2, 2:] = False
    return (torch.randn(3, 9, 7, generator=g), keep), torch.randint(0, 3, (3,), generator=g)


def _denoise(g: torch.Generator) -> tuple:
    t = torch.tensor([0, 17, 999])
    return (torch.randint(0, 19, (3, 6), generator=g), t, torch.randn(3, 6, 10, generator=g)), None


def _vae(g: torch.Generator) -> tuple:
    return (torch.rand(5, 13, generator=g), torch.randn(5, 3, generator=g)), None


def _translate(g: torch.Generator) -> tuple:
    src_pad = torch.zeros(2, 7, dtype=torch.bool)
    src_pad[1, 4:] = True
    return (torch.randint(1, 17, (2, 7), generator=g), torch.randint(1, 17, (2, 6), generator=g), src_pad), None


def cases() -> list[Case]:
    denoiser = Case("sinusoidal_denoiser", TokenDenoiser, _denoise, own_loss)
    vae = Case("vae", VAE, _vae, own_loss)
    lora = Case("lora", LoRAClassifier, _lora, classify)
    return [
        lora,
        Case("convnext", ConvNeXt, lambda g: _images(g, 2, 14, 3), classify),
        Case("swin", Swin, lambda g: _images(g, 2, 12, 4), classify),
        Case("perceiver", Perceiver, _perceiver, classify),
        denoiser, vae,
        Case("transformer_seq2seq", Translator, _translate, own_loss),
        # fp64: fp32's tolerance in units of fp64's epsilon, so a value computed in fp32 anywhere fails (not
        # the denoiser: its positions and timestep embedding are fp32 by construction, as in the reference code)
        *(fp64(c) for c in (lora, vae)),
    ]
