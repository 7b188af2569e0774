"""A twentieth set of models written the way users write them, for tests/test_optimizer_user_models_twentieth.py.

The earlier sets cover SSIM by depthwise Gaussian convs, Charbonnier, a Laplacian pyramid and total variation as a
restoration loss, grid_sample and unsupervised flow warping, pixel_shuffle, Conv3d on channels_last_3d clips
(tests/user_models_seventh.py), Swin's shifted windows (tests/user_models_fifth.py), and a per-sample hypernetwork
and the higher-order torch.func steps of force training (tests/user_models_sixteenth.py). These are the image
restoration, style transfer, video, optical flow and meta-learning models as their reference implementations write
them:
- Restoration: NAFNet's block (its LayerNorm2d as NAFNet's own torch.autograd.Function with a hand-written
  backward, SimpleGate by chunk, simplified channel attention by AdaptiveAvgPool2d and a 1x1 conv, learned beta and
  gamma residual scales) under its PSNR loss; Restormer's MDTA (transposed attention over channels, q and k
  F.normalize'd over pixels, a learned per-head temperature, depthwise qkv) and gated-dconv FFN with its
  WithBias and BiasFree LayerNorms by var(unbiased=False); ESRGAN's RRDB (dense blocks of concatenations scaled by
  0.2, nearest upsampling) with the relativistic average GAN losses of generator and discriminator.
- Style transfer: AdaIN (instance statistics by var(unbiased=False) + eps and by the unbiased var the reference's
  calc_mean_std uses, a frozen encoder, content and mean/std style losses) and Johnson's transformer net
  (reflection padding, InstanceNorm2d, upsample-convolutions) under Gram-matrix style losses by bmm over a frozen
  loss network and a total-variation loss.
- Video: TimeSformer's divided space-time attention (time and space rearranged by view/permute, the class token
  repeated over frames and averaged back, a temporal fc); SlowFast's lateral connection (a Conv3d strided in time,
  fast features concatenated onto the slow path) and the temporal shift module, writing into zeros_like by slicing
  (TSM's reference), by torch.cat with zeros, and by TSM's InplaceShift autograd.Function (writes into .data).
- Optical flow: RAFT (the all-pairs correlation volume by matmul / sqrt(dim), a pyramid by avg_pool2d, lookup by
  grid_sample with align_corners=True at coordinates built from meshgrid plus a linspace window, coordinates
  detached between iterations, convex upsampling by F.unfold and a softmax over 9 neighbours, the sequence loss with
  exponentially decaying weights over the iterations and a validity mask); PWC-Net (a local cost volume by shifted
  slices of a padded map in a Python loop, the warp by grid_sample with a mask of warped ones rounded by
  torch.where, flow and features upsampled by ConvTranspose2d, the multi-scale robust loss).
- Meta-learning: MAML's inner loop by torch.func.grad of a torch.func.functional_call (second order, also through a
  conv learner with batch-statistics BatchNorm2d and max pooling) and first-order MAML (the inner gradients
  detached, or torch.autograd.grad without create_graph), and functorch's example vmapping the inner loop over the
  tasks; Reptile's interpolation of meta weights held as a buffer towards the adapted ones (lerp_ under no_grad);
  prototypical networks (class means by index_add_ and by a one_hot matmul, squared Euclidean distances by
  broadcasting and by the expanded |a|^2 - 2 a.b + |b|^2, log_softmax of the negative distances).
bf16 autocast runs NAFNet (its autograd.Function) and RAFT, whole-model bf16 casts Johnson's net and the
prototypical network, fp64 MAML, the prototypical network and PWC-Net (Restormer, AdaIN, TimeSformer, ESRGAN,
SlowFast and Reptile passed in bf16 and fp64 too, and were left out to keep the suite short).
Left out: MAML's inner loop by torch.autograd.grad(create_graph=True), which PyTorch's AOTAutograd refuses for every
backend ("torch.compile with aot_autograd does not currently support double backward", aot_eager too; only
backend="eager" runs it), so second order here is torch.func.grad as higher-order code traces it; and SlowFast with
TSM cast to bf16 whole, where eager is the less accurate side (at the input gradient's element where the two differ
most, eager gives -3.8e-4, tfsn -4.8e-4 and the fp64 run -5.1e-4; over all parameters eager's largest errors against
fp64 are the larger or equal in 13 of 15 tensors).
Sizes are odd and tiny; every input comes from a seeded generator. Each model is a `tests.user_models.Case`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tests.user_models import Case, classify
from tests.user_models_more import bf16, fp64, own_loss
from tests.user_models_nineteenth import cast_bf16


# --- image restoration ---------------------------------------------------------------------------------------

class LayerNormFunction(torch.autograd.Function):
    """NAFNet's channel LayerNorm with its own backward (basicsr/models/archs/arch_util.py)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        ctx.eps = eps
        c = x.size(1)
        mu = x.mean(1, keepdim=True)
        var = (x - mu).pow(2).mean(1, keepdim=True)
        y = (x - mu) / (var + eps).sqrt()
        ctx.save_for_backward(y, var, weight)
        return weight.view(1, c, 1, 1) * y + bias.view(1, c, 1, 1)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple:
        c = grad_output.size(1)
        y, var, weight = ctx.saved_tensors
        g = grad_output * weight.view(1, c, 1, 1)
        mean_g = g.mean(dim=1, keepdim=True)
        mean_gy = (g * y).mean(dim=1, keepdim=True)
        gx = 1. / torch.sqrt(var + ctx.eps) * (g - y * mean_gy - mean_g)
        return (gx, (grad_output * y).sum(dim=3).sum(dim=2).sum(dim=0),
                grad_output.sum(dim=3).sum(dim=2).sum(dim=0), None)


class LayerNorm2d(nn.Module):
    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(channels))
        self.bias = nn.Parameter(0.1 * torch.randn(channels))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return LayerNormFunction.apply(x, self.weight, self.bias, self.eps)


class SimpleGate(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=1)
        return x1 * x2


class NAFBlock(nn.Module):
    """NAFNet's block; beta and gamma start at zero in the reference, here at small values (as after training),
    so that every branch has a gradient."""

    def __init__(self, c: int, expand: int = 2) -> None:
        super().__init__()
        dw = c * expand
        self.conv1 = nn.Conv2d(c, dw, 1)
        self.conv2 = nn.Conv2d(dw, dw, 3, padding=1, groups=dw)
        self.conv3 = nn.Conv2d(dw // 2, c, 1)
        self.sca = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(dw // 2, dw // 2, 1))
        self.sg = SimpleGate()
        self.conv4 = nn.Conv2d(c, 2 * c, 1)
        self.conv5 = nn.Conv2d(c, c, 1)
        self.norm1, self.norm2 = LayerNorm2d(c), LayerNorm2d(c)
        self.beta = nn.Parameter(0.3 * torch.randn(1, c, 1, 1))
        self.gamma = nn.Parameter(0.3 * torch.randn(1, c, 1, 1))

    def forward(self, inp: Tensor) -> Tensor:
        x = self.conv2(self.conv1(self.norm1(inp)))
        x = self.sg(x)
        x = x * self.sca(x)
        y = inp + self.conv3(x) * self.beta
        x = self.conv5(self.sg(self.conv4(self.norm2(y))))
        return y + x * self.gamma


class NAFNetPSNR(nn.Module):
    """Intro conv, two NAF blocks, ending conv plus the input; NAFNet's PSNRLoss (10 / ln 10 times the log of the
    per-image MSE + 1e-8, averaged)."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.intro = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(NAFBlock(c), NAFBlock(c))
        self.ending = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x: Tensor, target: Tensor) -> tuple:
        out = self.ending(self.blocks(self.intro(x))) + x
        scale = 10 / math.log(10)
        return out, scale * torch.log(((out - target) ** 2).mean(dim=(1, 2, 3)) + 1e-8).mean()


class RestormerLayerNorm(nn.Module):
    """Restormer's LayerNorm over channels of (b, h*w, c): WithBias subtracts the mean, BiasFree does not; both
    divide by sqrt(var(unbiased=False) + 1e-5)."""

    def __init__(self, c: int, with_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(c))
        self.bias = nn.Parameter(0.1 * torch.randn(c)) if with_bias else None

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        x = x.flatten(2).transpose(1, 2)                    # b c h w -> b (h w) c
        sigma = x.var(-1, keepdim=True, unbiased=False)
        if self.bias is None:
            x = x / torch.sqrt(sigma + 1e-5) * self.weight
        else:
            x = (x - x.mean(-1, keepdim=True)) / torch.sqrt(sigma + 1e-5) * self.weight + self.bias
        return x.transpose(1, 2).reshape(b, c, h, w)


class MDTA(nn.Module):
    """Restormer's multi-Dconv head transposed attention: a (c, c) attention map per head."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.temperature = nn.Parameter(1 + 0.2 * torch.randn(heads, 1, 1))
        self.qkv = nn.Conv2d(dim, dim * 3, 1, bias=False)
        self.qkv_dwconv = nn.Conv2d(dim * 3, dim * 3, 3, padding=1, groups=dim * 3, bias=False)
        self.project_out = nn.Conv2d(dim, dim, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv_dwconv(self.qkv(x)).chunk(3, dim=1)
        q, k, v = (t.reshape(b, self.heads, c // self.heads, h * w) for t in (q, k, v))
        q = F.normalize(q, dim=-1)
        k = F.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1)) * self.temperature
        out = attn.softmax(dim=-1) @ v
        return self.project_out(out.reshape(b, c, h, w))


class GDFN(nn.Module):
    """Restormer's gated-Dconv feed-forward: gelu(x1) * x2 after a depthwise conv."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.project_in = nn.Conv2d(dim, hidden * 2, 1, bias=False)
        self.dwconv = nn.Conv2d(hidden * 2, hidden * 2, 3, padding=1, groups=hidden * 2, bias=False)
        self.project_out = nn.Conv2d(hidden, dim, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = self.dwconv(self.project_in(x)).chunk(2, dim=1)
        return self.project_out(F.gelu(x1) * x2)


class Restormer(nn.Module):
    """Two Restormer transformer blocks (one WithBias, one BiasFree LayerNorm) between an embedding and an
    output conv, a global residual, an L1 loss."""

    def __init__(self, dim: int = 6, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 3, padding=1, bias=False)
        self.blocks = nn.ModuleList(nn.ModuleList([RestormerLayerNorm(dim, with_bias), MDTA(dim, heads),
                                                   RestormerLayerNorm(dim, with_bias), GDFN(dim, 5)])
                                    for with_bias in (True, False))
        self.output = nn.Conv2d(dim, 3, 3, padding=1, bias=False)

    def forward(self, x: Tensor, target: Tensor) -> tuple:
        y = self.embed(x)
        for norm1, attn, norm2, ffn in self.blocks:
            y = y + attn(norm1(y))
            y = y + ffn(norm2(y))
        out = self.output(y) + x
        return out, F.l1_loss(out, target)


class ResidualDenseBlock(nn.Module):
    """ESRGAN's dense block: each conv sees the concatenation of all before it; out * 0.2 + x."""

    def __init__(self, nf: int, gc: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(nf + i * gc, gc if i < 4 else nf, 3, padding=1) for i in range(5))

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for conv in self.convs[:-1]:
            features.append(F.leaky_relu(conv(torch.cat(features, 1)), 0.2))
        return self.convs[-1](torch.cat(features, 1)) * 0.2 + x


class ESRGAN(nn.Module):
    """An RRDB generator (two dense blocks in a residual-in-residual, nearest x2 upsampling) and a small
    discriminator trained together as ESRGAN's model does: the generator's L1 plus its relativistic average
    loss (real logits detached), the discriminator's on the detached fake."""

    def __init__(self, nf: int = 5, gc: int = 3) -> None:
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, padding=1)
        self.rrdb = nn.Sequential(ResidualDenseBlock(nf, gc), ResidualDenseBlock(nf, gc))
        self.trunk_conv = nn.Conv2d(nf, nf, 3, padding=1)
        self.upconv = nn.Conv2d(nf, nf, 3, padding=1)
        self.conv_last = nn.Conv2d(nf, 3, 3, padding=1)
        self.discriminator = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.LeakyReLU(0.2),
                                           nn.Conv2d(4, 5, 3, stride=2, padding=1), nn.LeakyReLU(0.2),
                                           nn.Flatten(), nn.Linear(5 * 3 * 4, 1))

    def generate(self, x: Tensor) -> Tensor:
        fea = self.conv_first(x)
        fea = fea + self.trunk_conv(self.rrdb(fea) * 0.2)
        fea = F.leaky_relu(self.upconv(F.interpolate(fea, scale_factor=2, mode="nearest")), 0.2)
        return self.conv_last(fea)

    def forward(self, lr: Tensor, hr: Tensor) -> tuple:
        sr = self.generate(lr)
        real, fake = self.discriminator(hr).detach(), self.discriminator(sr)
        bce = F.binary_cross_entropy_with_logits
        g_gan = (bce(real - fake.mean(), torch.zeros_like(real)) + bce(fake - real.mean(), torch.ones_like(fake))) / 2
        real_d, fake_d = self.discriminator(hr), self.discriminator(sr.detach())
        d_loss = (bce(real_d - fake_d.mean(), torch.ones_like(real_d))
                  + bce(fake_d - real_d.mean(), torch.zeros_like(fake_d))) / 2
        return sr, F.l1_loss(sr, hr) + 0.05 * g_gan + d_loss


def _restoration(g: torch.Generator, n: int = 2) -> tuple:
    target = torch.rand(n, 3, 7, 9, generator=g)
    return (target + 0.1 * torch.randn(n, 3, 7, 9, generator=g), target), None


def _super_resolution(g: torch.Generator, n: int = 2) -> tuple:
    hr = torch.rand(n, 3, 10, 14, generator=g)
    return (F.avg_pool2d(hr, 2) + 0.05 * torch.randn(n, 3, 5, 7, generator=g), hr), None



# --- neural style transfer -----------------------------------------------------------------------------------

def frozen(module: nn.Module) -> nn.Module:
    """A pretrained feature network held fixed, as style-transfer code holds its VGG."""
    return module.requires_grad_(False)


def instance_mean_std(feat: Tensor, eps: float = 1e-5, unbiased: bool = False) -> tuple:
    """Per-sample, per-channel statistics: AdaIN's calc_mean_std (unbiased var in naoto0804's reference, the
    population var in most re-implementations) + eps under the sqrt."""
    n, c = feat.shape[:2]
    var = feat.view(n, c, -1).var(dim=2, unbiased=unbiased) + eps
    return feat.view(n, c, -1).mean(dim=2).view(n, c, 1, 1), var.sqrt().view(n, c, 1, 1)


class AdaIN(nn.Module):
    """AdaIN style transfer: a frozen two-stage encoder, AdaIN of the content features to the style's statistics,
    a trained decoder (nearest upsampling, reflection padding); the content loss against the AdaIN target and the
    style loss on the means and stds of each encoder stage (the unbiased form)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = frozen(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()))
        self.enc2 = frozen(nn.Sequential(nn.MaxPool2d(2, ceil_mode=True), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU()))
        self.decoder = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(6, 4, 3), nn.ReLU(),
                                     nn.Upsample(scale_factor=2, mode="nearest"),
                                     nn.ReflectionPad2d(1), nn.Conv2d(4, 3, 3))

    def encode(self, x: Tensor) -> list:
        f1 = self.enc1(x)
        return [f1, self.enc2(f1)]

    def forward(self, content: Tensor, style: Tensor) -> tuple:
        style_feats = self.encode(style)
        content_feat = self.encode(content)[-1]
        c_mean, c_std = instance_mean_std(content_feat)
        s_mean, s_std = instance_mean_std(style_feats[-1])
        t = (content_feat - c_mean.expand_as(content_feat)) / c_std.expand_as(content_feat) * s_std + s_mean
        g = self.decoder(t)[..., :content.shape[-2], :content.shape[-1]]
        g_feats = self.encode(g)
        loss_c = F.mse_loss(g_feats[-1], t)
        loss_s = content.new_zeros(())
        for gf, sf in zip(g_feats, style_feats):
            gm, gs = instance_mean_std(gf, unbiased=True)
            sm, ss = instance_mean_std(sf, unbiased=True)
            loss_s = loss_s + F.mse_loss(gm, sm) + F.mse_loss(gs, ss)
        return g, loss_c + 10 * loss_s


def gram_matrix(y: Tensor) -> Tensor:
    """fast_neural_style's Gram matrix: features (b, ch, h*w) times their transpose by bmm, over ch*h*w."""
    b, ch, h, w = y.size()
    features = y.view(b, ch, w * h)
    return features.bmm(features.transpose(1, 2)) / (ch * h * w)


class ConvLayer(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, upsample: int | None = None) -> None:
        super().__init__()
        self.upsample = upsample
        self.pad = nn.ReflectionPad2d(kernel // 2)
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride)

    def forward(self, x: Tensor) -> Tensor:
        if self.upsample:
            x = F.interpolate(x, mode="nearest", scale_factor=self.upsample)
        return self.conv(self.pad(x))


class JohnsonStyleTransfer(nn.Module):
    """fast_neural_style's TransformerNet in miniature (reflection-padded convs, InstanceNorm2d with affine, a
    residual block, an upsample-conv) trained with Gram-matrix style losses of a frozen loss network's stages
    (MSE against the style image's Grams, repeated over the batch), a content loss and a total-variation loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(ConvLayer(3, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.ReLU(),
                                 ConvLayer(4, 6, 3, stride=2), nn.InstanceNorm2d(6, affine=True), nn.ReLU())
        self.res = nn.Sequential(ConvLayer(6, 6, 3), nn.InstanceNorm2d(6, affine=True), nn.ReLU(), ConvLayer(6, 6, 3))
        self.up = nn.Sequential(ConvLayer(6, 4, 3, upsample=2), nn.InstanceNorm2d(4, affine=True), nn.ReLU(),
                                ConvLayer(4, 3, 3))
        stage1 = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.ReLU())
        stage2 = nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(5, 7, 3, padding=1), nn.ReLU())
        self.loss_net = frozen(nn.ModuleList([stage1, stage2]))

    def features(self, x: Tensor) -> list:
        out = []
        for stage in self.loss_net:
            x = stage(x)
            out.append(x)
        return out

    def forward(self, content: Tensor, style: Tensor) -> tuple:
        h = self.net(content)
        y = self.up(h + self.res(h))
        with torch.no_grad():
            style_grams = [gram_matrix(f) for f in self.features(style)]
        fy, fx = self.features(y), self.features(content)
        content_loss = F.mse_loss(fy[1], fx[1])
        style_loss = sum(F.mse_loss(gram_matrix(f), gs.repeat(y.shape[0], 1, 1)) for f, gs in zip(fy, style_grams))
        tv = (torch.sum(torch.abs(y[:, :, :, :-1] - y[:, :, :, 1:]))
              + torch.sum(torch.abs(y[:, :, :-1, :] - y[:, :, 1:, :])))
        return y, content_loss + 1e2 * style_loss + 1e-4 * tv


def _style(g: torch.Generator, n: int = 2) -> tuple:
    return (torch.rand(n, 3, 9, 11, generator=g), torch.rand(1, 3, 9, 11, generator=g).expand(n, -1, -1, -1)), None


def _johnson(g: torch.Generator, n: int = 2) -> tuple:
    return (torch.rand(n, 3, 10, 12, generator=g), torch.rand(1, 3, 10, 12, generator=g)), None


# --- video ---------------------------------------------------------------------------------------------------

class Attention(nn.Module):
    """timm-style attention: fused qkv, (q @ k^T) * scale, softmax, @ v."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class DividedSpaceTimeBlock(nn.Module):
    """TimeSformer's divided space-time block; tokens are ordered (h w t) after the class token, as its patch
    embedding leaves them. einops' 'b (h w t) m -> (b h w) t m' and 'b (h w t) m -> (b t) (h w) m' by view/permute."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.temporal_norm1, self.temporal_attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.temporal_fc = nn.Linear(dim, dim)
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor, t: int, hw: int) -> Tensor:
        b, _, m = x.shape
        xt = x[:, 1:, :].reshape(b * hw, t, m)                                 # b (hw t) m -> (b hw) t m
        res_temporal = self.temporal_attn(self.temporal_norm1(xt)).reshape(b, hw * t, m)
        xt = x[:, 1:, :] + self.temporal_fc(res_temporal)
        init_cls_token = x[:, 0, :].unsqueeze(1)
        cls_token = init_cls_token.repeat(1, t, 1).reshape(b * t, m).unsqueeze(1)
        xs = xt.view(b, hw, t, m).permute(0, 2, 1, 3).reshape(b * t, hw, m)   # -> (b t) (hw) m
        res_spatial = self.attn(self.norm1(torch.cat((cls_token, xs), 1)))
        cls_token = res_spatial[:, 0, :].reshape(b, t, m).mean(1, True)
        res_spatial = res_spatial[:, 1:, :].reshape(b, t, hw, m).permute(0, 2, 1, 3).reshape(b, hw * t, m)
        x = torch.cat((init_cls_token, xt), 1) + torch.cat((cls_token, res_spatial), 1)
        return x + self.mlp(self.norm2(x))


class TimeSformer(nn.Module):
    """Per-frame patch embedding by Conv2d over (b t), tokens to (h w t) order, a class token, spatial and
    temporal position embeddings, a divided block, the class token classified."""

    def __init__(self, dim: int = 12, heads: int = 3, frames: int = 3, patches: int = 6, classes: int = 5) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, patches + 1, dim))
        self.time_embed = nn.Parameter(0.02 * torch.randn(1, frames, dim))
        self.blocks = nn.ModuleList([DividedSpaceTimeBlock(dim, heads)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, video: Tensor) -> Tensor:
        b, c, t, h, w = video.shape
        x = self.patch(video.transpose(1, 2).reshape(b * t, c, h, w)).flatten(2).transpose(1, 2)   # (b t) n m
        n, m = x.shape[1:]
        x = torch.cat((self.cls_token.expand(b * t, -1, -1), x), 1) + self.pos_embed
        cls_tokens = x[:b, 0, :].unsqueeze(1)
        x = x[:, 1:].reshape(b, t, n, m).permute(0, 2, 1, 3).reshape(b * n, t, m) + self.time_embed
        x = torch.cat((cls_tokens, x.reshape(b, n * t, m)), 1)
        for block in self.blocks:
            x = block(x, t, n)
        return self.head(self.norm(x)[:, 0])


def temporal_shift_in_place(x: Tensor, n_segment: int, fold_div: int = 3) -> Tensor:
    """TSM's reference shift: a fold of channels from the next frame, one from the previous, into zeros_like."""
    nt, c, h, w = x.size()
    x = x.view(nt // n_segment, n_segment, c, h, w)
    fold = c // fold_div
    out = torch.zeros_like(x)
    out[:, :-1, :fold] = x[:, 1:, :fold]
    out[:, 1:, fold: 2 * fold] = x[:, :-1, fold: 2 * fold]
    out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
    return out.view(nt, c, h, w)


def temporal_shift_cat(x: Tensor, n_segment: int, fold_div: int = 3) -> Tensor:
    """The same shift by torch.cat of slices with zeros (mmaction's and many re-implementations' form)."""
    nt, c, h, w = x.size()
    x = x.view(nt // n_segment, n_segment, c, h, w)
    fold = c // fold_div
    zeros = x.new_zeros(x.shape[0], 1, fold, h, w)
    left = torch.cat((x[:, 1:, :fold], zeros), 1)
    right = torch.cat((zeros, x[:, :-1, fold: 2 * fold]), 1)
    return torch.cat((left, right, x[:, :, 2 * fold:]), 2).view(nt, c, h, w)


class InplaceShift(torch.autograd.Function):
    """TSM's inplace=True shift: the input's .data shifted in place through a zeroed buffer, the gradient shifted
    back the same way in backward."""

    @staticmethod
    def forward(ctx, input: Tensor, fold: int) -> Tensor:
        ctx.fold_ = fold
        n, t, c, h, w = input.size()
        buffer = input.data.new(n, t, fold, h, w).zero_()
        buffer[:, :-1] = input.data[:, 1:, :fold]
        input.data[:, :, :fold] = buffer
        buffer.zero_()
        buffer[:, 1:] = input.data[:, :-1, fold: 2 * fold]
        input.data[:, :, fold: 2 * fold] = buffer
        return input

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple:
        fold = ctx.fold_
        n, t, c, h, w = grad_output.size()
        buffer = grad_output.data.new(n, t, fold, h, w).zero_()
        buffer[:, 1:] = grad_output.data[:, :-1, :fold]
        grad_output.data[:, :, :fold] = buffer
        buffer.zero_()
        buffer[:, :-1] = grad_output.data[:, 1:, fold: 2 * fold]
        grad_output.data[:, :, fold: 2 * fold] = buffer
        return grad_output, None


def temporal_shift_function(x: Tensor, n_segment: int, fold_div: int = 3) -> Tensor:
    """The shift by InplaceShift, on a copy: the residual here still reads the unshifted x."""
    nt, c, h, w = x.size()
    return InplaceShift.apply(x.clone().view(nt // n_segment, n_segment, c, h, w), c // fold_div).view(nt, c, h, w)


class SlowFastTSM(nn.Module):
    """A SlowFast pair of Conv3d pathways (slow: every alpha-th frame, fast: all frames at beta of the channels)
    with the lateral connection, a Conv3d of kernel (5, 1, 1) strided alpha in time, concatenated onto the slow
    path; and TSM residual blocks (a 2-D conv per frame after the shift, in each of its three forms) on the fused
    features."""

    def __init__(self, alpha: int = 4, slow: int = 8, fast: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.alpha = alpha
        self.slow_stem = nn.Sequential(nn.Conv3d(3, slow, (1, 3, 3), padding=(0, 1, 1), bias=False),
                                       nn.BatchNorm3d(slow), nn.ReLU())
        self.fast_stem = nn.Sequential(nn.Conv3d(3, fast, (3, 3, 3), padding=1, bias=False),
                                       nn.BatchNorm3d(fast), nn.ReLU())
        self.lateral = nn.Conv3d(fast, 2 * fast, (5, 1, 1), stride=(alpha, 1, 1), padding=(2, 0, 0), bias=False)
        channels = slow + 2 * fast
        self.shift_convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(3))
        self.head = nn.Linear(channels + fast, classes)

    def forward(self, clip: Tensor) -> Tensor:
        slow = self.slow_stem(clip[:, :, ::self.alpha])
        fast = self.fast_stem(clip)
        slow = torch.cat([slow, self.lateral(fast)], 1)
        b, c, t, h, w = slow.shape
        x = slow.transpose(1, 2).reshape(b * t, c, h, w)
        shifts = (temporal_shift_in_place, temporal_shift_cat, temporal_shift_function)
        for shift, conv in zip(shifts, self.shift_convs):
            x = x + F.relu(conv(shift(x, t)))
        pooled = torch.cat([x.view(b, t, c, h, w).mean((1, 3, 4)), fast.mean((2, 3, 4))], 1)
        return self.head(pooled)


def _video(g: torch.Generator, n: int = 2) -> tuple:
    return (torch.randn(n, 3, 3, 4, 6, generator=g),), torch.randint(0, 5, (n,), generator=g)


def _clip(g: torch.Generator, n: int = 2) -> tuple:
    return (torch.randn(n, 3, 12, 5, 7, generator=g),), torch.randint(0, 5, (n,), generator=g)


# --- optical flow --------------------------------------------------------------------------------------------

def coords_grid(batch: int, ht: int, wd: int, like: Tensor) -> Tensor:
    coords = torch.meshgrid(torch.arange(ht, device=like.device), torch.arange(wd, device=like.device), indexing="ij")
    coords = torch.stack(coords[::-1], dim=0).to(like.dtype)
    return coords[None].repeat(batch, 1, 1, 1)


def bilinear_sampler(img: Tensor, coords: Tensor) -> Tensor:
    """RAFT's sampler: pixel coordinates to [-1, 1] by 2 x / (W - 1) - 1, grid_sample with align_corners."""
    h, w = img.shape[-2:]
    xgrid, ygrid = coords.split([1, 1], dim=-1)
    grid = torch.cat([2 * xgrid / (w - 1) - 1, 2 * ygrid / (h - 1) - 1], dim=-1)
    return F.grid_sample(img, grid, align_corners=True)


class CorrBlock:
    """RAFT's all-pairs correlation pyramid and its lookup in a (2r + 1)^2 window at each level."""

    def __init__(self, fmap1: Tensor, fmap2: Tensor, num_levels: int = 2, radius: int = 1) -> None:
        self.num_levels, self.radius = num_levels, radius
        batch, dim, ht, wd = fmap1.shape
        corr = torch.matmul(fmap1.view(batch, dim, ht * wd).transpose(1, 2), fmap2.view(batch, dim, ht * wd))
        corr = corr / torch.sqrt(torch.tensor(dim).to(fmap1.dtype))
        corr = corr.reshape(batch * ht * wd, 1, ht, wd)
        self.corr_pyramid = [corr]
        for _ in range(num_levels - 1):
            corr = F.avg_pool2d(corr, 2, stride=2)
            self.corr_pyramid.append(corr)

    def __call__(self, coords: Tensor) -> Tensor:
        r = self.radius
        coords = coords.permute(0, 2, 3, 1)
        batch, h1, w1, _ = coords.shape
        out_pyramid = []
        for i, corr in enumerate(self.corr_pyramid):
            dx = torch.linspace(-r, r, 2 * r + 1, dtype=coords.dtype)
            dy = torch.linspace(-r, r, 2 * r + 1, dtype=coords.dtype)
            delta = torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1)
            centroid_lvl = coords.reshape(batch * h1 * w1, 1, 1, 2) / 2 ** i
            corr = bilinear_sampler(corr, centroid_lvl + delta.view(1, 2 * r + 1, 2 * r + 1, 2))
            out_pyramid.append(corr.view(batch, h1, w1, -1))
        return torch.cat(out_pyramid, dim=-1).permute(0, 3, 1, 2).contiguous()


class RAFT(nn.Module):
    """RAFT in miniature: a shared feature encoder at 1/2 resolution, a context encoder, the correlation lookup,
    an update block (a convolutional GRU-like tanh state, a flow delta head and a convex-upsampling mask head
    scaled by 0.25) iterated with coordinates detached, convex upsampling x2, and the sequence loss with weights
    gamma^(n - i - 1) over a validity mask (valid >= 0.5 and |flow| < max_flow)."""

    def __init__(self, dim: int = 5, hidden: int = 6, iters: int = 3, levels: int = 2, radius: int = 1) -> None:
        super().__init__()
        self.iters, self.levels, self.radius = iters, levels, radius
        self.fnet = nn.Sequential(nn.Conv2d(3, dim, 3, stride=2, padding=1), nn.InstanceNorm2d(dim), nn.ReLU(),
                                  nn.Conv2d(dim, dim, 1))
        self.cnet = nn.Sequential(nn.Conv2d(3, 2 * hidden, 3, stride=2, padding=1), nn.ReLU())
        corr_channels = levels * (2 * radius + 1) ** 2
        self.gru = nn.Conv2d(hidden * 2 + corr_channels + 2, hidden, 3, padding=1)
        self.flow_head = nn.Sequential(nn.Conv2d(hidden, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 3, padding=1))
        self.mask = nn.Sequential(nn.Conv2d(hidden, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4 * 9, 1))

    @staticmethod
    def upsample_flow(flow: Tensor, mask: Tensor, scale: int = 2) -> Tensor:
        """RAFT's convex upsampling: each fine pixel a softmax-weighted combination of its 3x3 coarse neighbours."""
        n, _, h, w = flow.shape
        mask = torch.softmax(mask.view(n, 1, 9, scale, scale, h, w), dim=2)
        up_flow = F.unfold(scale * flow, [3, 3], padding=1).view(n, 2, 9, 1, 1, h, w)
        up_flow = torch.sum(mask * up_flow, dim=2).permute(0, 1, 4, 2, 5, 3)
        return up_flow.reshape(n, 2, scale * h, scale * w)

    def forward(self, image1: Tensor, image2: Tensor, flow_gt: Tensor, valid: Tensor,
                gamma: float = 0.8, max_flow: float = 400.0) -> tuple:
        fmap1, fmap2 = self.fnet(image1), self.fnet(image2)
        corr_fn = CorrBlock(fmap1, fmap2, self.levels, self.radius)
        net, inp = torch.split(self.cnet(image1), [self.gru.out_channels, self.gru.out_channels], dim=1)
        net, inp = torch.tanh(net), torch.relu(inp)
        n, _, h, w = fmap1.shape
        coords0 = coords_grid(n, h, w, fmap1)
        coords1 = coords_grid(n, h, w, fmap1)
        predictions = []
        for _ in range(self.iters):
            coords1 = coords1.detach()
            corr = corr_fn(coords1)
            flow = coords1 - coords0
            net = torch.tanh(self.gru(torch.cat([net, inp, corr, flow], 1)))
            coords1 = coords1 + self.flow_head(net)
            predictions.append(self.upsample_flow(coords1 - coords0, 0.25 * self.mask(net)))
        mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
        valid = (valid >= 0.5) & (mag < max_flow)
        loss = flow_gt.new_zeros(())
        for i, prediction in enumerate(predictions):
            weight = gamma ** (len(predictions) - i - 1)
            loss = loss + weight * (valid[:, None] * (prediction - flow_gt).abs()).mean()
        return predictions[-1], loss


def _flow(g: torch.Generator, n: int = 2) -> tuple:
    h, w = 10, 14
    image1 = torch.rand(n, 3, h, w, generator=g)
    flow_gt = 1.5 * torch.randn(n, 2, h, w, generator=g)
    flow_gt[0, :, 0, 0] = 500.0                                    # one pixel over max_flow
    return (image1, image1.roll(1, -1) + 0.05 * torch.rand(n, 3, h, w, generator=g), flow_gt,
            torch.rand(n, h, w, generator=g)), None


def pwc_warp(x: Tensor, flo: Tensor) -> Tensor:
    """PWC-Net's warp: a pixel grid by arange/repeat plus the flow, normalised by max(W - 1, 1), grid_sample with
    align_corners, and the mask of a warped image of ones rounded to 0 or 1 by torch.where at 0.9999."""
    b, _, h, w = x.size()
    xx = torch.arange(0, w).view(1, -1).repeat(h, 1)
    yy = torch.arange(0, h).view(-1, 1).repeat(1, w)
    grid = torch.cat((xx.view(1, 1, h, w).repeat(b, 1, 1, 1), yy.view(1, 1, h, w).repeat(b, 1, 1, 1)), 1).to(x.dtype)
    vgrid = grid + flo
    vgrid = torch.stack([2.0 * vgrid[:, 0] / max(w - 1, 1) - 1.0, 2.0 * vgrid[:, 1] / max(h - 1, 1) - 1.0], 1)
    vgrid = vgrid.permute(0, 2, 3, 1)
    output = F.grid_sample(x, vgrid, align_corners=True)
    mask = F.grid_sample(torch.ones_like(x), vgrid, align_corners=True)
    return output * torch.where(mask < 0.9999, 0.0, 1.0)


def local_cost_volume(f1: Tensor, f2: Tensor, d: int = 2) -> Tensor:
    """PWC-Net's correlation over a (2d + 1)^2 neighbourhood written in Python: f2 padded, one shifted slice per
    displacement, the channel mean of the product, leaky_relu(0.1)."""
    f2 = F.pad(f2, [d] * 4)
    h, w = f1.shape[-2:]
    cost = [(f1 * f2[:, :, i:i + h, j:j + w]).mean(1, keepdim=True) for i in range(2 * d + 1) for j in range(2 * d + 1)]
    return F.leaky_relu(torch.cat(cost, 1), 0.1)


class PWCNet(nn.Module):
    """A two-level PWC-Net: feature pyramids by strided convs, the coarse flow estimated from a cost volume, upsampled
    by a ConvTranspose2d (and its features), the second image's features warped by the upsampled flow times 2, a
    cost volume on the warped features, a refined flow; the multi-scale loss of the two levels against the ground
    truth downsampled by avg_pool2d and scaled by 1/20 (PWC-Net's 0.05), by the robust |x|_1 + eps to the 0.4."""

    def __init__(self, d: int = 1) -> None:
        super().__init__()
        self.d = d
        self.level1 = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.LeakyReLU(0.1))
        self.level2 = nn.Sequential(nn.Conv2d(4, 5, 3, stride=2, padding=1), nn.LeakyReLU(0.1))
        cost = (2 * d + 1) ** 2
        self.estimator2 = nn.Sequential(nn.Conv2d(cost + 5, 6, 3, padding=1), nn.LeakyReLU(0.1))
        self.flow2 = nn.Conv2d(6, 2, 3, padding=1)
        self.upflow = nn.ConvTranspose2d(2, 2, 4, stride=2, padding=1)
        self.upfeat = nn.ConvTranspose2d(6, 2, 4, stride=2, padding=1)
        self.estimator1 = nn.Sequential(nn.Conv2d(cost + 4 + 2 + 2, 6, 3, padding=1), nn.LeakyReLU(0.1),
                                        nn.Conv2d(6, 2, 3, padding=1))

    def forward(self, image1: Tensor, image2: Tensor, flow_gt: Tensor) -> tuple:
        c11, c21 = self.level1(image1), self.level1(image2)
        c12, c22 = self.level2(c11), self.level2(c21)
        x = self.estimator2(torch.cat([local_cost_volume(c12, c22, self.d), c12], 1))
        flow2 = self.flow2(x)
        up_flow = self.upflow(flow2)[..., :c11.shape[-2], :c11.shape[-1]]
        up_feat = self.upfeat(x)[..., :c11.shape[-2], :c11.shape[-1]]
        warped = pwc_warp(c21, up_flow * 2.0)
        cost = local_cost_volume(c11, warped, self.d)
        flow1 = self.estimator1(torch.cat([cost, c11, up_flow, up_feat], 1)) + up_flow
        target = flow_gt * 0.05
        loss = flow_gt.new_zeros(())
        for weight, flow in ((0.32, flow1), (0.08, flow2)):
            scaled = F.adaptive_avg_pool2d(target, flow.shape[-2:])
            loss = loss + weight * ((flow - scaled).abs().sum(1) + 0.01).pow(0.4).sum() / flow.shape[0]
        return flow1, loss


def _flow_pair(g: torch.Generator, n: int = 2) -> tuple:
    (image1, image2, flow_gt, _), _ = _flow(g, n)
    return (image1, image2, flow_gt), None


# --- meta-learning -------------------------------------------------------------------------------------------

class Learner(nn.Module):
    """The few-shot classifier every meta-learner here adapts."""

    def __init__(self, d_in: int = 5, hidden: int = 9, ways: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, ways))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class ConvLearner(nn.Module):
    """MAML's Omniglot learner in miniature: conv, BatchNorm2d on the batch's statistics (no running stats, as
    learn2learn's and the MAML reference's), ReLU, max pooling, a linear head."""

    def __init__(self, ways: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False),
                                      nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(4, 5, 3, padding=1), nn.BatchNorm2d(5, track_running_stats=False),
                                      nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(5, ways)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x.view(-1, 1, 5, 5)).flatten(1))


class MAML(nn.Module):
    """MAML over a batch of tasks: inner SGD steps on each task's support set by torch.func.grad of the loss of a
    torch.func.functional_call (differentiated through, second order, or detached, first order), or first order by
    torch.autograd.grad without create_graph as learn2learn's and most FOMAML code write it; the query loss of
    the adapted weights averaged over the tasks."""

    def __init__(self, first_order: bool = False, by_autograd_grad: bool = False, inner_steps: int = 2,
                 inner_lr: float = 0.4, learner: type = Learner) -> None:
        super().__init__()
        self.learner = learner()
        self.first_order, self.inner_steps, self.inner_lr = first_order or by_autograd_grad, inner_steps, inner_lr
        self.by_autograd_grad = by_autograd_grad

    def support_loss(self, params: dict, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(torch.func.functional_call(self.learner, params, (x,)), y)

    def forward(self, xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> tuple:
        losses, logits = [], []
        for task in range(xs.shape[0]):
            params = dict(self.learner.named_parameters())
            for _ in range(self.inner_steps):
                if self.by_autograd_grad:
                    loss = self.support_loss(params, xs[task], ys[task])
                    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
                else:
                    grads = torch.func.grad(self.support_loss)(params, xs[task], ys[task])
                if self.first_order:
                    grads = {name: g.detach() for name, g in grads.items()}
                params = {name: p - self.inner_lr * grads[name] for name, p in params.items()}
            out = torch.func.functional_call(self.learner, params, (xq[task],))
            logits.append(out)
            losses.append(F.cross_entropy(out, yq[task]))
        return torch.stack(logits), torch.stack(losses).mean()


class VmapMAML(MAML):
    """functorch's MAML example: the inner loop of one task by torch.func.grad, torch.func.vmap'ed over the tasks
    with the parameters shared (in_dims None)."""

    def forward(self, xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> tuple:
        def inner_loop(params: dict, x_spt: Tensor, y_spt: Tensor, x_qry: Tensor, y_qry: Tensor) -> tuple:
            for _ in range(self.inner_steps):
                grads = torch.func.grad(self.support_loss)(params, x_spt, y_spt)
                params = {name: p - self.inner_lr * grads[name] for name, p in params.items()}
            logits = torch.func.functional_call(self.learner, params, (x_qry,))
            return F.cross_entropy(logits, y_qry), logits

        params = dict(self.learner.named_parameters())
        losses, logits = torch.func.vmap(inner_loop, in_dims=(None, 0, 0, 0, 0))(params, xs, ys, xq, yq)
        return logits, losses.mean()


class Reptile(nn.Module):
    """Reptile: a few SGD steps from the meta weights on a task (torch.func.grad of a functional_call), the query
    loss of the adapted weights as the training signal, and the meta weights, a buffer copy, interpolated towards
    the adapted ones by lerp_ under no_grad (epsilon 0.3)."""

    def __init__(self, inner_steps: int = 3, inner_lr: float = 0.3, epsilon: float = 0.3) -> None:
        super().__init__()
        self.learner = Learner()
        for name, p in self.learner.named_parameters():
            self.register_buffer("meta_" + name.replace(".", "_"), p.detach().clone())
        self.inner_steps, self.inner_lr, self.epsilon = inner_steps, inner_lr, epsilon

    def forward(self, xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> tuple:
        def loss_of(params: dict, x: Tensor, y: Tensor) -> Tensor:
            return F.cross_entropy(torch.func.functional_call(self.learner, params, (x,)), y)

        params = dict(self.learner.named_parameters())
        for _ in range(self.inner_steps):
            grads = torch.func.grad(loss_of)(params, xs[0], ys[0])
            params = {name: p - self.inner_lr * grads[name] for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                getattr(self, "meta_" + name.replace(".", "_")).lerp_(p, self.epsilon)
        out = torch.func.functional_call(self.learner, params, (xq[0],))
        return out, F.cross_entropy(out, yq[0])


class PrototypicalNetwork(nn.Module):
    """Prototypical networks: an embedding of support and query points, class prototypes as means (by index_add_
    over the labels divided by their counts, and by a one_hot matmul), squared Euclidean distances (by broadcasting
    and by the expanded form), log_softmax of the negative distances, the NLL of the query labels; both forms'
    losses summed."""

    def __init__(self, d_in: int = 5, d: int = 7, ways: int = 3) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, 11), nn.ReLU(), nn.Linear(11, d))
        self.ways = ways

    def forward(self, xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> tuple:
        support, query = self.encoder(xs[0]), self.encoder(xq[0])
        counts = torch.zeros(self.ways, dtype=support.dtype).index_add_(0, ys[0], torch.ones_like(support[:, 0]))
        prototypes = torch.zeros(self.ways, support.shape[1], dtype=support.dtype).index_add_(0, ys[0], support)
        prototypes = prototypes / counts[:, None]
        dists = (query[:, None, :] - prototypes[None]).pow(2).sum(-1)
        log_p = F.log_softmax(-dists, dim=1)
        loss = -log_p.gather(1, yq[0][:, None]).squeeze(1).mean()
        one_hot = F.one_hot(ys[0], self.ways).to(support.dtype)
        means = (one_hot.t() @ support) / one_hot.sum(0)[:, None]
        expanded = query.pow(2).sum(1, keepdim=True) - 2 * query @ means.t() + means.pow(2).sum(1)[None]
        loss = loss + F.nll_loss(F.log_softmax(-expanded, dim=1), yq[0])
        return log_p, loss


def _tasks(g: torch.Generator, n: int = 2, ways: int = 3, shots: int = 3, queries: int = 4) -> tuple:
    """`n` tasks of `ways` classes, each a cluster around its own centre; every class has `shots` support points."""
    centres = 2 * torch.randn(n, ways, 5, generator=g)
    ys = torch.arange(ways).repeat(shots)[torch.randperm(ways * shots, generator=g)].expand(n, -1).contiguous()
    yq = torch.randint(0, ways, (n, queries), generator=g)
    xs = torch.gather(centres, 1, ys[..., None].expand(-1, -1, 5)) + torch.randn(n, ways * shots, 5, generator=g)
    xq = torch.gather(centres, 1, yq[..., None].expand(-1, -1, 5)) + torch.randn(n, queries, 5, generator=g)
    return (xs, ys, xq, yq), None


def _image_tasks(g: torch.Generator, n: int = 2) -> tuple:
    """Tasks as `_tasks` draws them, of 25 features: 5x5 single-channel images."""
    def widen(x: Tensor) -> Tensor:
        return torch.cat([x] * 5, -1) + 0.3 * torch.randn(*x.shape[:-1], 25, generator=g)
    (xs, ys, xq, yq), _ = _tasks(g, n)
    return (widen(xs), ys, widen(xq), yq), None


def cases() -> list[Case]:
    nafnet = Case("nafnet_psnr_loss", NAFNetPSNR, _restoration, own_loss)
    restormer = Case("restormer_mdta_gdfn", Restormer, _restoration, own_loss)
    esrgan = Case("esrgan_rrdb_relativistic", ESRGAN, _super_resolution, own_loss)
    adain = Case("adain_style_transfer", AdaIN, _style, own_loss)
    # A conv's bias right before an InstanceNorm2d is subtracted again with the instance mean.
    johnson = Case("johnson_gram_tv", JohnsonStyleTransfer, _johnson, own_loss,
                   zero_grad=tuple((f"{conv}.conv.bias", slice(None)) for conv in ("net.0", "net.3", "res.0", "up.0")))
    timesformer = Case("timesformer_divided_attention", TimeSformer, _video, classify)
    slowfast = Case("slowfast_lateral_tsm", SlowFastTSM, _clip, classify)
    raft = Case("raft_correlation_convex_upsampling", RAFT, _flow, own_loss)
    pwcnet = Case("pwcnet_cost_volume_warp", PWCNet, _flow_pair, own_loss)
    maml = Case("maml_second_order", MAML, _tasks, own_loss)
    fomaml = Case("maml_first_order", lambda: MAML(first_order=True), _tasks, own_loss)
    fomaml_autograd = Case("maml_first_order_autograd_grad", lambda: MAML(by_autograd_grad=True), _tasks, own_loss)
    # Each conv's bias is taken out again by the BatchNorm after it, in the inner steps and in the query loss.
    maml_conv = Case("maml_second_order_conv_batchnorm_maxpool", lambda: MAML(inner_steps=1, learner=ConvLearner),
                     _image_tasks, own_loss, zero_grad=(("learner.features.0.bias", slice(None)),
                                                        ("learner.features.4.bias", slice(None))))
    maml_vmap = Case("maml_vmap_over_tasks", VmapMAML, _tasks, own_loss)
    reptile = Case("reptile_meta_interpolation", Reptile, _tasks, own_loss)
    # The embedding's last bias shifts support and query points alike: no distance depends on it.
    protonet = Case("prototypical_network", PrototypicalNetwork, _tasks, own_loss,
                    zero_grad=(("encoder.2.bias", slice(None)),))
    return [nafnet, restormer, esrgan, adain, johnson, timesformer, slowfast, raft, pwcnet, maml, fomaml,
            fomaml_autograd, maml_conv, maml_vmap, reptile, protonet,
            *(bf16(c) for c in (nafnet, raft)),
            *(cast_bf16(c) for c in (johnson, protonet)),
            *(fp64(c) for c in (maml, protonet, pwcnet))]
