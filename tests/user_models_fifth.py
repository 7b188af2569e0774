"""A fifth set of models written the way users write them, for tests/test_optimizer_user_models_fifth.py.

The earlier sets (tests/user_models.py, _more, _third, _fourth) cover transformers, convnets, recurrent nets,
many losses and view idioms. These follow the reference code people copy for what they do not: LoRA adapters
on frozen Linears (loralib's form, a layer that merges B @ A into the weight in forward, and minLoRA's
parametrization), with only the adapters and the head trained; ConvNeXt blocks (depthwise 7x7 conv, NHWC
LayerNorm, inverted MLP, layer scale) with ConvNeXt's hand-written channels-first LayerNorm in the
downsampling layer and ConvNeXt V2's global response norm; Swin's shifted-window attention (torch.roll, window
partition by view/permute, a relative position bias table indexed by a long buffer, the shifted-window mask
built in __init__, patch merging); a Perceiver (learned latents expanded to the batch, cross-attention by hand
with a boolean mask filled with -finfo.max, latent self-attention through nn.MultiheadAttention, GEGLU);
sinusoidal position embeddings computed in forward and a diffusion UNet's timestep embedding driving a
scale-shift; a VAE (eps as an input, sigmoid with F.binary_cross_entropy and the KL term); MAE's random masking
(argsort of a noise, gather, the order restored by gather, the patchify einsum); a guided-diffusion UNet
(GroupNorm in fp32, scale-shift ResBlocks, QKV attention by einsum, alphas_cumprod indexed by t); SegNet's
MaxUnpool2d by pooling indices with mixup against soft targets, weighted per-pixel cross-entropy with
ignore_index and label smoothing, and a Dice loss. Sizes are odd and tiny. Each model comes as a
`tests.user_models.Case`."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from tests.user_models import Case, classify
from tests.user_models_more import _images, fp64, own_loss

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
        adapted = self.lora_dropout(x) @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)
        return result + adapted * self.scaling


class LoRAParametrization(nn.Module):
    """minLoRA's form (and PyTorch's parametrize tutorial's): the adapter as a parametrization of the weight,
    W + (B @ A) * scaling, registered with torch.nn.utils.parametrize on a plain nn.Linear."""

    def __init__(self, fan_in: int, fan_out: int, rank: int = 2, alpha: float = 3.0) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(rank, fan_in))
        self.lora_B = nn.Parameter(torch.randn(fan_out, rank) * 0.1)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, X: Tensor) -> Tensor:
        return X + torch.matmul(self.lora_B, self.lora_A).view(X.shape) * self.scaling


class LoRABlock(nn.Module):
    """A pre-norm transformer block whose q and v projections carry adapters (the paper's choice), k one as
    a parametrization, the rest frozen; the MLP's first Linear merges its adapter into the weight."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = LoRALinear(d, d), nn.Linear(d, d), LoRALinear(d, d)
        parametrize.register_parametrization(self.k, "weight", LoRAParametrization(d, d))
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
    """Patch embedding (conv, flatten, LayerNorm), a shifted window block, patch merging, LayerNorm, mean
    over tokens, head."""

    def __init__(self, dim: int = 9, heads: int = 3, res: int = 6, ws: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.patch_embed, self.patch_norm = nn.Conv2d(3, dim, 2, stride=2), nn.LayerNorm(dim)
        self.block = SwinBlock(dim, res, heads, ws, ws // 2)    # the second of a stage's pair: the shifted one
        self.merge = PatchMerging(res, dim)
        self.norm, self.head = nn.LayerNorm(2 * dim), nn.Linear(2 * dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_norm(self.patch_embed(x).flatten(2).transpose(1, 2))
        x = self.norm(self.merge(self.block(x)))
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
    self-attention block (nn.MultiheadAttention, need_weights=False) with a GEGLU feed-forward, mean pool."""

    def __init__(self, d_in: int = 7, latents: int = 5, d: int = 12, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(latents, d))
        self.norm_x, self.norm_ctx = nn.LayerNorm(d), nn.LayerNorm(d_in)
        self.cross = CrossAttention(d, d_in, 1, 8)
        self.norm_self = nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.self_ff, self.norm_ff2 = GEGLUFeedForward(d), nn.LayerNorm(d)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, classes))

    def forward(self, data: Tensor, mask: Tensor) -> Tensor:
        x = self.latents.unsqueeze(0).expand(data.shape[0], -1, -1)
        x = self.cross(self.norm_x(x), self.norm_ctx(data), mask) + x
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


# --- a masked autoencoder --------------------------------------------------------------------------

def sincos_2d(d: int, grid: int, cls_token: bool) -> Tensor:
    """MAE's fixed 2D sin-cos positions: half the features for each axis, a zero row for the class token."""
    omega = 1.0 / 10000 ** (torch.arange(d // 4, dtype=torch.float64) / (d / 4.0))
    hh, ww = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                            indexing="ij")
    axis = [torch.einsum("m,d->md", pos.reshape(-1), omega) for pos in (ww, hh)]
    emb = torch.cat([torch.cat([torch.sin(a), torch.cos(a)], dim=1) for a in axis], dim=1).float()
    return torch.cat([torch.zeros(1, d), emb]) if cls_token else emb


class MAE(nn.Module):
    """MAE's reference code: patches by conv, fixed sin-cos positions (frozen Parameters), random masking
    by argsort of a noise (given as an input; torch.rand in MAE) and gather, a class token, an encoder
    layer, a decoder head that restores the order by gather with mask tokens, the patchify einsum
    ('nchpwq->nhwpqc'), the normalized-pixel MSE averaged over the masked patches."""

    def __init__(self, img: int = 8, patch: int = 2, d: int = 12, dec: int = 8, mask_ratio: float = 0.75) -> None:
        super().__init__()
        self.patch, self.mask_ratio = patch, mask_ratio
        grid = img // patch
        self.patch_embed = nn.Conv2d(3, d, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos_embed = nn.Parameter(sincos_2d(d, grid, True).unsqueeze(0), requires_grad=False)
        self.block = nn.TransformerEncoderLayer(d, 3, 2 * d, dropout=0.0, activation="gelu", batch_first=True,
                                                norm_first=True)
        self.norm = nn.LayerNorm(d)
        self.decoder_embed = nn.Linear(d, dec)
        self.mask_token = nn.Parameter(torch.randn(1, 1, dec) * 0.02)
        self.decoder_pos_embed = nn.Parameter(sincos_2d(dec, grid, True).unsqueeze(0), requires_grad=False)
        self.decoder_norm, self.decoder_pred = nn.LayerNorm(dec), nn.Linear(dec, patch ** 2 * 3)

    def patchify(self, imgs: Tensor) -> Tensor:
        p = self.patch
        h = w = imgs.shape[2] // p
        x = imgs.reshape(imgs.shape[0], 3, h, p, w, p)
        x = torch.einsum("nchpwq->nhwpqc", x)
        return x.reshape(imgs.shape[0], h * w, p ** 2 * 3)

    def random_masking(self, x: Tensor, noise: Tensor) -> tuple:
        N, L, D = x.shape
        len_keep = int(L * (1 - self.mask_ratio))
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, dim=1, index=ids_keep.unsqueeze(-1).repeat(1, 1, D))
        mask = torch.ones([N, L], device=x.device)
        mask[:, :len_keep] = 0
        return x_masked, torch.gather(mask, dim=1, index=ids_restore), ids_restore

    def forward(self, imgs: Tensor, noise: Tensor) -> tuple:
        x = self.patch_embed(imgs).flatten(2).transpose(1, 2) + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, noise)
        cls_tokens = (self.cls_token + self.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        x = self.norm(self.block(torch.cat((cls_tokens, x), dim=1)))
        x = self.decoder_embed(x)
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
        x_ = torch.gather(x_, dim=1, index=ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1) + self.decoder_pos_embed
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:, :]     # (MAE's decoder has blocks before this)
        target = self.patchify(imgs)
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.e-6) ** .5                 # norm_pix_loss
        loss = ((pred - target) ** 2).mean(dim=-1)
        return pred, (loss * mask).sum() / mask.sum()


# --- a guided-diffusion UNet -----------------------------------------------------------------------

class GroupNorm32(nn.GroupNorm):
    """guided-diffusion's: the statistics in fp32 whatever the input's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.float()).type(x.dtype)


class ResBlock(nn.Module):
    """guided-diffusion's ResBlock with use_scale_shift_norm: the timestep embedding's scale and shift
    around the second GroupNorm; a 1x1 conv skip when the channels change."""

    def __init__(self, ch: int, emb_ch: int, out: int) -> None:
        super().__init__()
        self.in_layers = nn.Sequential(GroupNorm32(2, ch), nn.SiLU(), nn.Conv2d(ch, out, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_ch, 2 * out))
        self.out_layers = nn.Sequential(GroupNorm32(2, out), nn.SiLU(), nn.Dropout(p=0.0),
                                        nn.Conv2d(out, out, 3, padding=1))
        self.skip_connection = nn.Identity() if out == ch else nn.Conv2d(ch, out, 1)

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.in_layers(x)
        emb_out = self.emb_layers(emb).type(h.dtype)
        while len(emb_out.shape) < len(h.shape):
            emb_out = emb_out[..., None]
        out_norm, out_rest = self.out_layers[0], self.out_layers[1:]
        scale, shift = torch.chunk(emb_out, 2, dim=1)
        h = out_rest(out_norm(h) * (1 + scale) + shift)
        return self.skip_connection(x) + h


class AttentionBlock(nn.Module):
    """guided-diffusion's spatial self-attention (QKVAttentionLegacy): 1x1 Conv1d to qkv, both sides
    scaled by ch^-1/4, einsum, the softmax in fp32."""

    def __init__(self, ch: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm, self.qkv, self.proj_out = GroupNorm32(2, ch), nn.Conv1d(ch, 3 * ch, 1), nn.Conv1d(ch, ch, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, *spatial = x.shape
        x = x.reshape(b, c, -1)
        qkv = self.qkv(self.norm(x))
        bs, width, length = qkv.shape
        ch = width // (3 * self.heads)
        q, k, v = qkv.reshape(bs * self.heads, ch * 3, length).split(ch, dim=1)
        scale = 1 / math.sqrt(math.sqrt(ch))
        weight = torch.einsum("bct,bcs->bts", q * scale, k * scale)
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        h = torch.einsum("bts,bcs->bct", weight, v).reshape(bs, -1, length)
        return (x + self.proj_out(h)).reshape(b, c, *spatial)


class DiffusionUNet(nn.Module):
    """A two-level UNet (stride-2 conv down, nearest x2 upsampling up, skips concatenated) with the
    timestep embedding MLP; training computes x_t from the linear-schedule alphas_cumprod buffer indexed
    by t and returns the MSE of the predicted noise."""

    def __init__(self, ch: int = 4, steps: int = 50) -> None:
        super().__init__()
        self.ch = ch
        betas = torch.linspace(1e-4, 0.02, steps, dtype=torch.float64)
        self.register_buffer("alphas_cumprod", torch.cumprod(1.0 - betas, dim=0).float())
        emb = 4 * ch
        self.time_embed = nn.Sequential(nn.Linear(ch, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.down_res, self.down = ResBlock(ch, emb, ch), nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1)
        self.mid_attn = AttentionBlock(2 * ch, 2)
        self.up_conv, self.up_res = nn.Conv2d(2 * ch, 2 * ch, 3, padding=1), ResBlock(3 * ch, emb, ch)
        self.out = nn.Sequential(GroupNorm32(2, ch), nn.SiLU(), nn.Conv2d(ch, 3, 3, padding=1))

    def forward(self, x0: Tensor, t: Tensor, noise: Tensor) -> tuple:
        a = self.alphas_cumprod[t].float()[..., None, None, None]
        x = a.sqrt() * x0 + (1 - a).sqrt() * noise
        emb = self.time_embed(timestep_embedding(t, self.ch))
        h1 = self.down_res(self.inp(x), emb)
        h = self.mid_attn(self.down(h1))
        h = self.up_conv(F.interpolate(h, scale_factor=2, mode="nearest"))
        pred = self.out(self.up_res(torch.cat([h, h1], dim=1), emb))
        return pred, F.mse_loss(pred, noise)


# --- SegNet with mixup and segmentation losses --------------------------------------------------------

class SegNet(nn.Module):
    """SegNet's pooling indices: MaxPool2d(return_indices=True) down, MaxUnpool2d with those indices up;
    convs with padding="same" and dilation, reflect and circular padding modes. The loss: mixup of the
    batch with its flip (x.flip(0)) against soft targets (cross-entropy with class probabilities and
    label smoothing), per-pixel cross-entropy with class weights, ignore_index and label smoothing, and
    a soft Dice loss on the softmax against one_hot targets."""

    def __init__(self, c: int = 5, classes: int = 3, lam: float = 0.7) -> None:
        super().__init__()
        self.classes, self.lam = classes, lam
        self.enc = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(c), nn.ReLU())
        self.pool, self.unpool = nn.MaxPool2d(2, 2, return_indices=True), nn.MaxUnpool2d(2, 2)
        self.mid = nn.Conv2d(c, c, 3, padding="same", dilation=2)
        self.dec = nn.Conv2d(c, classes, 3, padding=1, padding_mode="circular")
        self.register_buffer("class_weight", torch.tensor([0.5, 1.0, 2.0]))

    def forward(self, x: Tensor, seg: Tensor) -> tuple:
        x = self.lam * x + (1 - self.lam) * x.flip(0)
        h = self.enc(x)
        p, idx = self.pool(h)
        h = self.unpool(F.relu(self.mid(p)), idx, output_size=h.shape[-2:]) + h
        logits = self.dec(h)                                             # (N, classes, H, W)
        onehot = F.one_hot(seg.clamp(min=0), self.classes).permute(0, 3, 1, 2).float()
        soft = self.lam * onehot + (1 - self.lam) * onehot.flip(0)
        mixup = F.cross_entropy(logits, soft, label_smoothing=0.1)
        pixel = F.cross_entropy(logits, seg, weight=self.class_weight, ignore_index=-1, label_smoothing=0.05)
        probs = logits.softmax(dim=1)
        inter = (probs * onehot).sum((0, 2, 3))
        dice = 1 - ((2 * inter + 1) / (probs.sum((0, 2, 3)) + onehot.sum((0, 2, 3)) + 1)).mean()
        return logits, mixup + pixel + dice


# --- the batches and cases ---------------------------------------------------------------------------

def _lora(g: torch.Generator) -> tuple:
    return (torch.randint(0, 23, (3, 7), generator=g),), torch.randint(0, 4, (3,), generator=g)


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


def _mae(g: torch.Generator) -> tuple:
    return (torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, 16, generator=g)), None


def _diffusion(g: torch.Generator) -> tuple:
    return (torch.randn(2, 3, 8, 8, generator=g), torch.tensor([3, 41]), torch.randn(2, 3, 8, 8, generator=g)), None


def _segnet(g: torch.Generator) -> tuple:
    seg = torch.randint(0, 3, (3, 7, 9), generator=g)
    seg[0, :2] = -1                                                      # unlabeled pixels
    return (torch.randn(3, 3, 7, 9, generator=g), seg), None


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
        Case("mae", MAE, _mae, own_loss),
        Case("diffusion_unet", DiffusionUNet, _diffusion, own_loss),
        Case("segnet_mixup", SegNet, _segnet, own_loss, (("enc.0.bias", slice(None)),)),   # a bias before BatchNorm
        # fp64: fp32's tolerance in units of fp64's epsilon, so a value computed in fp32 anywhere fails (not
        # the denoiser: its positions and timestep embedding are fp32 by construction, as in the reference code)
        fp64(vae),
    ]
