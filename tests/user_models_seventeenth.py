"""A seventeenth set of models written the way users write them, for tests/test_optimizer_user_models_seventeenth.py.

The earlier sets cover a soft Dice loss, weighted per-pixel cross-entropy with ignore_index and SegNet's unpooling
(tests/user_models_fifth.py), a UNet, an FPN with RetinaNet heads, per-sample hypernetwork weights applied by bmm,
Mixture-of-Depths routing by topk and DLRM's EmbeddingBag with per_sample_weights. These are the segmentation,
dense-prediction and routing models as their reference implementations write them: the Lovasz-softmax and Lovasz
hinge losses (errors sorted descending by torch.sort, the ground truth gathered by the permutation, the Jaccard
gradient by cumsum of intersections and unions and the difference jaccard[1:] - jaccard[:-1], a dot with the sorted
errors; per image in a Python loop, ignored pixels masked to a zero error); Dice, Tversky and focal-Tversky losses
with smoothing over one_hot(labels).permute(0, 3, 1, 2) and a boundary-weighted cross-entropy (the boundary found by
max pooling of the one-hot); segmentation_models_pytorch's Dice and Jaccard losses with ignore_index and absent
classes masked, its focal loss with a reduced threshold written into the tracked focal term, and MMSeg's OHEM pixel
sampler (a threshold read off the sorted ground-truth probabilities under no_grad); PSPNet's pyramid pooling
(adaptive_avg_pool2d to 1, 2, 3 and 6 of an odd-sized map, 1x1 convs, bilinear upsampling back, concatenation) and
HRNet's multi-resolution fusion (strided convs down, 1x1 convs and upsampling up, sums); CapsNet (squash, three
iterations of dynamic routing with u_hat detached in the inner iterations, the margin loss, the reconstruction
masked by the longest capsule) and gram-ai's CapsuleNet (primary capsules stacked from a list of convs, priors by a
5-d broadcast matmul, a softmax by transpose/contiguous/view, rows of torch.eye index_select'ed as the mask); FiLM
conditioning; CondInst's dynamic convolutions (per-instance weights from a controller head, applied by a grouped
F.conv2d with groups = instances and by bmm); CutMix in the step (a box pasted by slicing assignment from a permuted
batch, the labels mixed by area, once on a channels_last batch) and Mixup; a product-key memory (topk over two sets
of sub-key scores, Cartesian indices i * k + j, softmax over the top scores, F.embedding_bag with per_sample_weights
and a gather with a weighted sum). Sizes are odd and tiny; every input comes from a seeded generator. Each model is
a `tests.user_models.Case`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tests.user_models import Case
from tests.user_models_more import bf16, fp64, own_loss


def conv_bn_relu(c_in: int, c_out: int, k: int = 3, stride: int = 1) -> nn.Module:
    """The conv block segmentation backbones stack."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, k, stride, k // 2, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


# --- Lovasz losses (Berman et al.'s reference code) ------------------------------------------------------

def lovasz_grad(gt_sorted: Tensor) -> Tensor:
    """The gradient of the Lovasz extension of the Jaccard loss at the sorted errors."""
    p = len(gt_sorted)
    gts = gt_sorted.sum()
    intersection = gts - gt_sorted.cumsum(0)
    union = gts + (1 - gt_sorted).cumsum(0)
    jaccard = 1. - intersection / union
    if p > 1:
        jaccard[1:p] = jaccard[1:p] - jaccard[0:-1]
    return jaccard


def lovasz_hinge_flat(logits: Tensor, labels: Tensor, valid: Tensor) -> Tensor:
    """Binary Lovasz hinge of one image's flattened logits and {0, 1} labels; ignored pixels get a zero error."""
    signs = 2. * labels - 1.
    errors = (1. - logits * signs) * valid
    errors_sorted, perm = torch.sort(errors, dim=0, descending=True)
    gt_sorted = labels[perm] * valid[perm]
    grad = lovasz_grad(gt_sorted)
    return torch.dot(F.relu(errors_sorted), grad)


def lovasz_softmax_flat(probas: Tensor, labels: Tensor, valid: Tensor) -> Tensor:
    """Multi-class Lovasz-softmax of (P, C) probabilities, classes='all'."""
    losses = []
    for c in range(probas.shape[1]):
        fg = (labels == c).to(probas.dtype) * valid
        errors = (fg - probas[:, c]).abs() * valid
        errors_sorted, perm = torch.sort(errors, 0, descending=True)
        fg_sorted = fg[perm]
        losses.append(torch.dot(errors_sorted, lovasz_grad(fg_sorted)))
    return torch.stack(losses).mean()


class LovaszSeg(nn.Module):
    """A small segmentation net trained with the Lovasz-softmax (batched over the flattened pixels) plus the
    Lovasz hinge of a foreground head per image, as lovasz_losses.py's per_image=True loops; pixels labelled
    255 are ignored."""

    def __init__(self, c: int = 5, classes: int = 3, ignore: int = 255) -> None:
        super().__init__()
        self.classes, self.ignore = classes, ignore
        self.body = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.Tanh())
        self.seg, self.fg = nn.Conv2d(c, classes, 1), nn.Conv2d(c, 1, 1)

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        h = self.body(x)
        logits, fg_logits = self.seg(h), self.fg(h).squeeze(1)
        valid = (labels != self.ignore).to(x.dtype)
        clean = torch.where(labels == self.ignore, torch.zeros_like(labels), labels)
        probas = logits.softmax(1).permute(0, 2, 3, 1).reshape(-1, self.classes)
        softmax_loss = lovasz_softmax_flat(probas, clean.view(-1), valid.view(-1))
        hinge = [lovasz_hinge_flat(lg.view(-1), (lab > 0).to(x.dtype).view(-1), v.view(-1))
                 for lg, lab, v in zip(fg_logits, clean, valid)]
        return logits, softmax_loss + torch.stack(hinge).mean()


# --- overlap losses ----------------------------------------------------------------------------------------

class OverlapLosses(nn.Module):
    """segmentation_models_pytorch-style region losses on one head: soft Dice with smoothing over
    one_hot(labels).permute(0, 3, 1, 2) per class, Tversky (alpha for false positives, beta for false
    negatives), focal Tversky ((1 - TI) ** gamma), and a cross-entropy weighted up on class boundaries (a pixel
    is on a boundary where max pooling of the one-hot differs from the one-hot)."""

    def __init__(self, c: int = 5, classes: int = 4, smooth: float = 1.0) -> None:
        super().__init__()
        self.classes, self.smooth = classes, smooth
        self.net = nn.Sequential(conv_bn_relu(3, c), nn.Conv2d(c, classes, 3, padding=1))

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        logits = self.net(x)
        probs = logits.softmax(dim=1)
        onehot = F.one_hot(labels, self.classes).permute(0, 3, 1, 2).float()
        dims = (0, 2, 3)
        tp = (probs * onehot).sum(dims)
        fp = (probs * (1 - onehot)).sum(dims)
        fn = ((1 - probs) * onehot).sum(dims)
        dice = 1 - ((2 * tp + self.smooth) / (probs.sum(dims) + onehot.sum(dims) + self.smooth).clamp_min(1e-7))
        tversky_index = (tp + self.smooth) / (tp + 0.3 * fp + 0.7 * fn + self.smooth)
        tversky = 1 - tversky_index
        focal_tversky = (1 - tversky_index).pow(0.75)
        boundary = (F.max_pool2d(onehot, 3, stride=1, padding=1) - onehot).amax(1) > 0
        weight = 1 + 4 * boundary.float()
        pixel_ce = F.cross_entropy(logits, labels, reduction="none")
        bce = (weight * pixel_ce).sum() / weight.sum()
        return logits, dice.mean() + tversky.mean() + focal_tversky.mean() + bce


class SMPLosses(nn.Module):
    """segmentation_models_pytorch's multiclass losses as its code writes them, with ignore_index: DiceLoss and
    JaccardLoss over (N, C, H*W) (one_hot((y * mask).long()).permute(0, 2, 1) * mask, classes absent from the
    batch masked out of the mean), FocalLoss with a reduced threshold (focal_term[pt < threshold] = 1 written
    into the tracked tensor), and MMSeg's OHEM pixel sampler (the ground-truth probabilities sorted, the
    threshold at the min_kept-th, pixels under it weighted 1) weighting a per-pixel cross-entropy."""

    def __init__(self, c: int = 5, classes: int = 4, ignore: int = 255, smooth: float = 0.5) -> None:
        super().__init__()
        self.classes, self.ignore, self.smooth = classes, ignore, smooth
        self.net = nn.Sequential(conv_bn_relu(3, c), nn.Conv2d(c, classes, 3, padding=1))

    def region(self, logits: Tensor, labels: Tensor, jaccard: bool) -> Tensor:
        bs, dims = labels.size(0), (0, 2)
        y_pred = logits.log_softmax(dim=1).exp().view(bs, self.classes, -1)
        y_true = labels.view(bs, -1)
        mask = y_true != self.ignore
        y_pred = y_pred * mask.unsqueeze(1)
        y_true = F.one_hot((y_true * mask).to(torch.long), self.classes).permute(0, 2, 1) * mask.unsqueeze(1)
        y_true = y_true.type_as(y_pred)
        intersection = torch.sum(y_pred * y_true, dim=dims)
        cardinality = torch.sum(y_pred + y_true, dim=dims)
        if jaccard:
            scores = (intersection + self.smooth) / (cardinality - intersection + self.smooth).clamp_min(1e-7)
        else:
            scores = (2.0 * intersection + self.smooth) / (cardinality + self.smooth).clamp_min(1e-7)
        loss = (1.0 - scores) * (y_true.sum(dims) > 0).to(scores.dtype)
        return loss.mean()

    def focal(self, logits: Tensor, labels: Tensor, threshold: float = 0.5, gamma: float = 2.0) -> Tensor:
        loss = 0
        not_ignored = labels.view(-1) != self.ignore
        for c in range(self.classes):
            target = (labels.view(-1) == c).long()[not_ignored].type_as(logits)
            output = logits[:, c, ...].reshape(-1)[not_ignored]
            logpt = F.binary_cross_entropy_with_logits(output, target, reduction="none")
            pt = torch.exp(-logpt)
            focal_term = ((1.0 - pt) / threshold).pow(gamma)
            focal_term[pt < threshold] = 1
            loss = loss + (focal_term * logpt).sum() / focal_term.sum().clamp_min(1e-6)
        return loss

    def ohem(self, logits: Tensor, labels: Tensor, thresh: float = 0.7, min_kept: int = 20) -> Tensor:
        with torch.no_grad():
            valid = labels != self.ignore
            valid_label = labels * valid
            prob = logits.softmax(dim=1).gather(1, valid_label.unsqueeze(1)).squeeze(1)
            sort_prob, _ = prob[valid].sort()
            threshold = torch.clamp(sort_prob[min(min_kept, sort_prob.numel() - 1)], min=thresh)
            weight = ((prob < threshold) & valid).to(logits.dtype)
        pixel = F.cross_entropy(logits, labels, ignore_index=self.ignore, reduction="none")
        return (pixel * weight).sum() / weight.sum().clamp_min(1)

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        logits = self.net(x)
        loss = (self.region(logits, labels, False) + self.region(logits, labels, True)
                + self.focal(logits, labels) + self.ohem(logits, labels))
        return logits, loss


# --- multi-scale context --------------------------------------------------------------------------------

class PyramidPooling(nn.Module):
    """PSPNet's pyramid pooling module: adaptive average pooling to each bin size, 1x1 conv + BN + ReLU,
    bilinear upsampling back to the map, concatenated with the map; then a 3x3 bottleneck."""

    def __init__(self, c: int = 6, bins: tuple = (1, 2, 3, 6), align_corners: bool = False) -> None:
        super().__init__()
        self.bins, self.align_corners = bins, align_corners
        self.stages = nn.ModuleList(conv_bn_relu(c, 3, 1) for _ in bins)
        self.bottleneck = conv_bn_relu(c + 3 * len(bins), c)

    def forward(self, x: Tensor) -> Tensor:
        h, w = x.shape[-2:]
        pyramid = [x] + [F.interpolate(stage(F.adaptive_avg_pool2d(x, b)), size=(h, w), mode="bilinear",
                                       align_corners=self.align_corners)
                         for b, stage in zip(self.bins, self.stages)]
        return self.bottleneck(torch.cat(pyramid, dim=1))


class PSPNet(nn.Module):
    """A stem to an odd-sized map (11x9 from 21x17), the pyramid pooling module, a classifier, the logits
    upsampled to the input size; an auxiliary head's loss weighted 0.4 as PSPNet trains it."""

    def __init__(self, c: int = 6, classes: int = 3, align_corners: bool = False) -> None:
        super().__init__()
        self.align_corners = align_corners
        self.stem = nn.Sequential(conv_bn_relu(3, c, 3, 2), conv_bn_relu(c, c))
        self.ppm = PyramidPooling(c, align_corners=align_corners)
        self.cls, self.aux = nn.Conv2d(c, classes, 1), nn.Conv2d(c, classes, 1)

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        feats = self.stem(x)
        size = x.shape[-2:]
        up = dict(size=size, mode="bilinear", align_corners=self.align_corners)
        logits = F.interpolate(self.cls(self.ppm(feats)), **up)
        aux = F.interpolate(self.aux(feats), **up)
        main = F.cross_entropy(logits, labels, ignore_index=255)
        return logits, main + 0.4 * F.cross_entropy(aux, labels, ignore_index=255)


class HRNetFusion(nn.Module):
    """HRNet's exchange unit over three resolutions: each output branch sums every input branch, brought down by
    chains of strided 3x3 convs (BN, ReLU between) or up by a 1x1 conv + BN and nearest upsampling by the scale
    factor; then the branches are upsampled bilinearly to the finest, concatenated, and classified."""

    def __init__(self, widths: tuple = (4, 6, 8), classes: int = 3) -> None:
        super().__init__()
        self.widths = widths
        n = len(widths)
        self.inputs = nn.ModuleList(
            [conv_bn_relu(3, widths[0])] + [conv_bn_relu(widths[i - 1], widths[i], 3, 2) for i in range(1, n)])
        self.fuse = nn.ModuleList(nn.ModuleList(self._link(j, i) for j in range(n)) for i in range(n))
        self.head = nn.Conv2d(sum(widths), classes, 1)

    def _link(self, src: int, dst: int) -> nn.Module:
        w = self.widths
        if src == dst:
            return nn.Identity()
        if src > dst:
            return nn.Sequential(nn.Conv2d(w[src], w[dst], 1, bias=False), nn.BatchNorm2d(w[dst]),
                                 nn.Upsample(scale_factor=2 ** (src - dst), mode="nearest"))
        steps = []
        for k in range(dst - src):
            last = k == dst - src - 1
            c_out = w[dst] if last else w[src]
            steps += [nn.Conv2d(w[src], c_out, 3, 2, 1, bias=False), nn.BatchNorm2d(c_out)]
            steps += [] if last else [nn.ReLU()]
        return nn.Sequential(*steps)

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        branches = []
        for layer in self.inputs:
            x = layer(x)
            branches.append(x)
        fused = [F.relu(sum(link(b) for link, b in zip(links, branches))) for links in self.fuse]
        size = fused[0].shape[-2:]
        ups = [fused[0]] + [F.interpolate(f, size=size, mode="bilinear", align_corners=True) for f in fused[1:]]
        logits = self.head(torch.cat(ups, 1))
        return logits, F.cross_entropy(logits, labels)


# --- capsules ------------------------------------------------------------------------------------------------

def squash(s: Tensor, dim: int = -1, eps: float = 1e-8) -> Tensor:
    """Sabour et al.'s non-linearity: short vectors shrink to ~0, long ones to just under unit length."""
    norm_sq = (s ** 2).sum(dim, keepdim=True)
    return norm_sq / (1 + norm_sq) * s / torch.sqrt(norm_sq + eps)


class CapsNet(nn.Module):
    """A CapsNet (the gram-ai / XifengGuo reference form): a conv, primary capsules by a strided conv reshaped
    to (N, routes, dim) and squashed, u_hat by a per-route weight (einsum), three iterations of dynamic routing
    (softmax of the logits b over the digit capsules, weighted sum, squash, b += agreement), u_hat detached in
    every iteration but the last; the margin loss on the capsule lengths and a reconstruction from the capsules
    masked by the longest one (argmax, one_hot), weighted 0.0005 on a summed squared error."""

    def __init__(self, classes: int = 4, prim_dim: int = 4, out_dim: int = 6, iterations: int = 3) -> None:
        super().__init__()
        self.classes, self.prim_dim, self.iterations = classes, prim_dim, iterations
        self.conv = nn.Conv2d(1, 8, 3)
        self.primary = nn.Conv2d(8, 2 * prim_dim, 3, stride=2)
        routes = 2 * 3 * 3
        self.W = nn.Parameter(0.1 * torch.randn(routes, classes, out_dim, prim_dim))
        self.decoder = nn.Sequential(nn.Linear(classes * out_dim, 13), nn.ReLU(), nn.Linear(13, 9 * 9), nn.Sigmoid())

    def route(self, u_hat: Tensor) -> Tensor:
        b = torch.zeros(u_hat.shape[:3], dtype=u_hat.dtype)                  # (N, routes, classes)
        u_hat_detached = u_hat.detach()
        for i in range(self.iterations):
            c = b.softmax(dim=2)
            if i == self.iterations - 1:
                return squash((c[..., None] * u_hat).sum(dim=1))                 # (N, classes, out_dim)
            v = squash((c[..., None] * u_hat_detached).sum(dim=1))
            b = b + (u_hat_detached * v[:, None]).sum(-1)
        raise AssertionError("unreachable")

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        h = F.relu(self.conv(x))
        u = self.primary(h)                                                       # (N, 2 * dim, 3, 3)
        n = u.shape[0]
        u = squash(u.view(n, 2, self.prim_dim, 3, 3).permute(0, 1, 3, 4, 2).reshape(n, -1, self.prim_dim))
        u_hat = torch.einsum("rcop,nrp->nrco", self.W, u)
        v = self.route(u_hat)
        lengths = v.norm(dim=-1)
        t = F.one_hot(labels, self.classes).float()
        margin = (t * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - t) * F.relu(lengths - 0.1) ** 2).sum(1).mean()
        mask = F.one_hot(lengths.argmax(1), self.classes).float()
        recon = self.decoder((v * mask[..., None]).flatten(1))
        recon_loss = ((recon - x.view(n, -1)) ** 2).sum(1).mean()
        return lengths, margin + 0.0005 * recon_loss


def softmax_over(x: Tensor, dim: int) -> Tensor:
    """gram-ai's softmax along a dim: transposed to the last, made contiguous, viewed 2-D, softmaxed, back."""
    transposed = x.transpose(dim, x.dim() - 1)
    out = F.softmax(transposed.contiguous().view(-1, transposed.size(-1)), dim=-1)
    return out.view(*transposed.size()).transpose(dim, x.dim() - 1)


class CapsuleLayer(nn.Module):
    """gram-ai's CapsuleLayer: primary capsules as a list of convs stacked on a last dim; digit capsules with
    priors by a 5-d broadcast matmul x[None, :, :, None, :] @ W[:, None], routing logits zeros like the priors
    updated by (priors * outputs).sum(-1, keepdim=True) (no detach), outputs squashed over the last dim."""

    def __init__(self, capsules: int, routes: int, c_in: int, c_out: int, kernel: int | None = None,
                 stride: int | None = None, iterations: int = 3) -> None:
        super().__init__()
        self.routes, self.iterations = routes, iterations
        if routes != -1:
            self.route_weights = nn.Parameter(0.2 * torch.randn(capsules, routes, c_in, c_out))
        else:
            self.capsules = nn.ModuleList(nn.Conv2d(c_in, c_out, kernel, stride) for _ in range(capsules))

    def forward(self, x: Tensor) -> Tensor:
        if self.routes == -1:
            outputs = torch.stack([capsule(x).view(x.size(0), -1, 1) for capsule in self.capsules], dim=-1)
            return squash(outputs.view(x.size(0), -1, outputs.size(-1)))
        priors = x[None, :, :, None, :] @ self.route_weights[:, None, :, :, :]
        logits = torch.zeros(*priors.size(), dtype=x.dtype)
        for i in range(self.iterations):
            probs = softmax_over(logits, dim=2)
            outputs = squash((probs * priors).sum(dim=2, keepdim=True))
            if i != self.iterations - 1:
                logits = logits + (priors * outputs).sum(dim=-1, keepdim=True)
        return outputs


class GramCapsNet(nn.Module):
    """gram-ai's CapsuleNet: conv, primary capsules (4 convs of 3 channels), digit capsules; class lengths by a
    softmax of the norms; the reconstruction masked by rows of torch.eye index_select'ed at the argmax; the
    margin loss with the reconstruction's MSE summed."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.classes = classes
        self.conv = nn.Conv2d(1, 6, 3)
        self.primary = CapsuleLayer(4, -1, 6, 3, kernel=3, stride=2)
        self.digits = CapsuleLayer(classes, 3 * 3 * 3, 4, 5)
        self.decoder = nn.Sequential(nn.Linear(5 * classes, 11), nn.ReLU(), nn.Linear(11, 81), nn.Sigmoid())

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        h = F.relu(self.conv(x), inplace=True)
        h = self.digits(self.primary(h)).squeeze().transpose(0, 1)                # (N, classes, 5)
        classes = F.softmax((h ** 2).sum(dim=-1) ** 0.5, dim=-1)
        _, max_length_indices = classes.max(dim=1)
        mask = torch.eye(self.classes, dtype=x.dtype).index_select(dim=0, index=max_length_indices)
        recon = self.decoder((h * mask[:, :, None]).reshape(x.size(0), -1))
        target = torch.eye(self.classes, dtype=x.dtype).index_select(0, labels)
        left, right = F.relu(0.9 - classes) ** 2, F.relu(classes - 0.1) ** 2
        margin = (target * left + 0.5 * (1. - target) * right).sum()
        return classes, (margin + 0.0005 * F.mse_loss(recon, x.view(x.size(0), -1), reduction="sum")) / x.size(0)


# --- conditioning and dynamic weights ----------------------------------------------------------------------

class FiLMNet(nn.Module):
    """FiLM (Perez et al.): a conditioning embedding gives per-channel gamma and beta by one Linear and chunk;
    each block is conv, BN without affine, (1 + gamma) * h + beta, ReLU, with a residual."""

    def __init__(self, c: int = 5, cond: int = 4, classes: int = 3, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.embed = nn.Embedding(cond, 7)
        self.film = nn.ModuleList(nn.Linear(7, 2 * c) for _ in range(blocks))
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(blocks))
        self.norms = nn.ModuleList(nn.BatchNorm2d(c, affine=False) for _ in range(blocks))
        self.head = nn.Linear(c, classes)

    def forward(self, x: Tensor, condition: Tensor, labels: Tensor) -> tuple:
        h, e = F.relu(self.stem(x)), self.embed(condition)
        for film, conv, norm in zip(self.film, self.convs, self.norms):
            gamma, beta = film(e).chunk(2, dim=-1)
            h = h + F.relu((1 + gamma[..., None, None]) * norm(conv(h)) + beta[..., None, None])
        logits = self.head(h.mean((2, 3)))
        return logits, F.cross_entropy(logits, labels)


class CondInstHead(nn.Module):
    """CondInst's dynamic mask head: a controller predicts, per instance, the weights and biases of a
    two-layer 1x1 conv net (split by the parameter counts); mask features with relative coordinates are
    repeated per instance and run through the per-instance nets as one grouped F.conv2d (groups = instances);
    a second path applies the first layer by bmm. Mask loss: Dice on the sigmoid plus BCE."""

    def __init__(self, c: int = 5, hidden: int = 4, instances: int = 3) -> None:
        super().__init__()
        self.c_in, self.hidden, self.instances = c + 2, hidden, instances
        self.features = nn.Sequential(conv_bn_relu(3, c), nn.Conv2d(c, c, 3, padding=1))
        self.sizes = [self.c_in * hidden, hidden, hidden, 1]                  # w1, b1, w2, b2
        self.controller = nn.Linear(c, sum(self.sizes))

    def forward(self, x: Tensor, centres: Tensor, targets: Tensor) -> tuple:
        feats = self.features(x)                                              # (1, c, H, W)
        _, c, h, w = feats.shape
        ys = torch.linspace(-1, 1, h, dtype=x.dtype)
        xs = torch.linspace(-1, 1, w, dtype=x.dtype)
        grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
        inst_feat = feats[0, :, centres[:, 0], centres[:, 1]].t()              # (instances, c)
        params = self.controller(inst_feat)
        w1, b1, w2, b2 = params.split(self.sizes, dim=1)
        cy = ys[centres[:, 0]][:, None, None]
        cx = xs[centres[:, 1]][:, None, None]
        rel = torch.stack([grid_y[None] - cy, grid_x[None] - cx], dim=1)        # (instances, 2, H, W)
        inputs = torch.cat([feats.expand(self.instances, -1, -1, -1), rel], 1)  # (instances, c_in, H, W)
        k = self.instances
        hid = F.conv2d(inputs.reshape(1, -1, h, w), w1.reshape(k * self.hidden, self.c_in, 1, 1),
                       b1.reshape(-1), groups=k)
        masks = F.conv2d(F.relu(hid), w2.reshape(k, self.hidden, 1, 1), b2.reshape(-1), groups=k).view(k, h, w)
        hid_bmm = torch.bmm(w1.view(k, self.hidden, self.c_in), inputs.flatten(2)) + b1[..., None]
        masks_bmm = (torch.bmm(w2.view(k, 1, self.hidden), F.relu(hid_bmm)) + b2[..., None]).view(k, h, w)
        probs = masks.sigmoid().flatten(1)
        t = targets.flatten(1)
        dice = 1 - (2 * (probs * t).sum(1) + 1) / ((probs ** 2).sum(1) + (t ** 2).sum(1) + 1)
        bce = F.binary_cross_entropy_with_logits(masks_bmm, targets)
        return masks, dice.mean() + bce


class CutMixMixup(nn.Module):
    """CutMix as the reference train loop does it, inside the compiled step: a box of the batch (its corners
    Python ints from a seeded draw) replaced by slicing assignment with the same box of a permuted batch, the
    loss mixed by the box's actual area; then Mixup of the cut-mixed batch with its flip against mixed
    labels."""

    def __init__(self, c: int = 5, classes: int = 4, box: tuple = (2, 7, 1, 5), mix: float = 0.65) -> None:
        super().__init__()
        self.box, self.mix = box, mix
        self.net = nn.Sequential(conv_bn_relu(3, c), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))

    def forward(self, x: Tensor, labels: Tensor, index: Tensor) -> tuple:
        y1, y2, x1, x2 = self.box
        x = x.clone()
        x[:, :, y1:y2, x1:x2] = x[index, :, y1:y2, x1:x2]
        lam = 1 - (y2 - y1) * (x2 - x1) / (x.shape[-1] * x.shape[-2])
        cut = self.net(x)
        cutmix = lam * F.cross_entropy(cut, labels) + (1 - lam) * F.cross_entropy(cut, labels[index])
        mixed = self.mix * x + (1 - self.mix) * x.flip(0)
        out = self.net(mixed)
        mixup = self.mix * F.cross_entropy(out, labels) + (1 - self.mix) * F.cross_entropy(out, labels.flip(0))
        return cut, cutmix + mixup


# --- product-key memory ------------------------------------------------------------------------------------

class ProductKeyMemory(nn.Module):
    """Lample et al.'s product-key memory (the XLM HashingMemory form): a query split in two halves, each scored
    against its own sub-keys, topk of each, the k*k Cartesian candidates' scores summed and their indices
    i * n_keys + j, topk again, softmax over the kept scores, values read by F.embedding_bag with
    per_sample_weights (mode='sum'); a second read by gather of the value rows and a weighted sum."""

    def __init__(self, d: int = 6, n_keys: int = 5, k: int = 3, v_dim: int = 7, classes: int = 3) -> None:
        super().__init__()
        self.n_keys, self.k = n_keys, k
        self.query = nn.Sequential(nn.Linear(d, 2 * 4), nn.BatchNorm1d(2 * 4))
        self.keys = nn.Parameter(torch.randn(2, n_keys, 4) / 2)
        self.values = nn.EmbeddingBag(n_keys ** 2, v_dim, mode="sum")
        self.head = nn.Linear(2 * v_dim, classes)

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        q = self.query(x)
        q1, q2 = q.chunk(2, dim=-1)
        s1, i1 = (q1 @ self.keys[0].t()).topk(self.k, dim=1)
        s2, i2 = (q2 @ self.keys[1].t()).topk(self.k, dim=1)
        all_scores = (s1[:, :, None] + s2[:, None, :]).view(x.shape[0], -1)
        all_indices = (i1[:, :, None] * self.n_keys + i2[:, None, :]).view(x.shape[0], -1)
        scores, best = all_scores.topk(self.k, dim=1)
        indices = all_indices.gather(1, best)
        weights = scores.softmax(dim=-1)
        bag = self.values(indices, per_sample_weights=weights)
        gathered = (self.values.weight[indices] * weights[..., None]).sum(1)
        logits = self.head(torch.cat([bag, gathered], dim=-1))
        return logits, F.cross_entropy(logits, labels)


# --- the batches and cases ------------------------------------------------------------------------------

def _seg(n: int, h: int, w: int, classes: int, ignore: int | None = None):
    def batch(g: torch.Generator) -> tuple:
        labels = torch.randint(0, classes, (n, h, w), generator=g)
        if ignore is not None:
            labels[0, :2, :3] = ignore
            labels[-1, -1] = ignore
        return (torch.randn(n, 3, h, w, generator=g), labels), None
    return batch


def _capsules(g: torch.Generator) -> tuple:
    return (torch.rand(3, 1, 9, 9, generator=g), torch.randint(0, 4, (3,), generator=g)), None


def _capsules3(g: torch.Generator) -> tuple:
    return (torch.rand(3, 1, 9, 9, generator=g), torch.tensor([2, 0, 1])), None


def _film(g: torch.Generator) -> tuple:
    return (torch.randn(3, 3, 7, 9, generator=g), torch.tensor([2, 0, 3]), torch.randint(0, 3, (3,), generator=g)), None


def _condinst(g: torch.Generator) -> tuple:
    centres = torch.tensor([[1, 2], [5, 7], [3, 0]])
    return (torch.randn(1, 3, 7, 9, generator=g), centres, (torch.rand(3, 7, 9, generator=g) < 0.4).float()), None


def _cutmix(g: torch.Generator) -> tuple:
    return (torch.randn(5, 3, 9, 7, generator=g), torch.randint(0, 4, (5,), generator=g),
            torch.randperm(5, generator=g)), None


def _cutmix_channels_last(g: torch.Generator) -> tuple:
    x, labels, index = _cutmix(g)[0]
    return (x.to(memory_format=torch.channels_last), labels, index), None


def _pkm(g: torch.Generator) -> tuple:
    return (torch.randn(7, 6, generator=g), torch.randint(0, 3, (7,), generator=g)), None


def cases() -> list[Case]:
    lovasz = Case("lovasz_softmax_hinge", LovaszSeg, _seg(2, 5, 7, 3, ignore=255), own_loss)
    overlap = Case("dice_tversky_boundary_ce", OverlapLosses, _seg(2, 7, 9, 4), own_loss)
    smp = Case("smp_losses_ohem", SMPLosses, _seg(2, 7, 9, 4, ignore=255), own_loss)
    psp = Case("pspnet_pyramid_pooling", PSPNet, _seg(3, 21, 17, 3, ignore=255), own_loss)
    hrnet = Case("hrnet_fusion", HRNetFusion, _seg(2, 12, 12, 3), own_loss)
    caps = Case("capsnet_dynamic_routing", CapsNet, _capsules, own_loss)
    # a conv's or Linear's bias just before a BatchNorm: normalisation subtracts the per-channel constant it adds
    gram_caps = Case("capsnet_gram_ai", GramCapsNet, _capsules3, own_loss)
    film = Case("film_conditioning", FiLMNet, _film, own_loss,
                zero_grad=tuple((f"convs.{i}.bias", slice(None)) for i in range(2)))
    condinst = Case("condinst_dynamic_conv", CondInstHead, _condinst, own_loss)
    cutmix = Case("cutmix_mixup_in_step", CutMixMixup, _cutmix, own_loss)
    cutmix_cl = Case("cutmix_mixup_channels_last", CutMixMixup, _cutmix_channels_last, own_loss)
    # XLM's HashingMemory may make the values sparse (EmbeddingBag(sparse=True)); with per_sample_weights no AOT
    # backend compiles that (aot_eager neither): the fake-tensor run of its sparse backward refuses the shapes.
    pkm = Case("product_key_memory", ProductKeyMemory, _pkm, own_loss, zero_grad=(("query.0.bias", slice(None)),))
    # No bf16 product-key memory: under CPU autocast the softmaxed scores stay bf16 and eager's embedding_bag
    # refuses per_sample_weights of another dtype than its fp32 weight.
    # No bf16 PSPNet: its 1-bin stage normalises 3 values per channel, and the gradient of the conv before that
    # BatchNorm is ill-conditioned: eager's bf16 error against fp64 is 12% of its scale, tfsn's 17%.
    return [lovasz, overlap, smp, psp, hrnet, caps, gram_caps, film, condinst, cutmix, cutmix_cl, pkm,
            *(bf16(c) for c in (overlap, smp, caps, condinst)),
            *(fp64(c) for c in (lovasz, caps, condinst, pkm))]
