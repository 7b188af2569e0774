"""A seventh set of models written the way users write them, for tests/test_optimizer_user_models_seventh.py.

The other suites have one grid_sample (bilinear, zero padding), bilinear and bicubic upsampling, a
pixel_shuffle and an unfold/fold. These are the geometric and detection code of vision repositories: a
spatial transformer (a localization net's theta, F.affine_grid, F.grid_sample in each mode, padding mode
and align_corners); resizing by F.interpolate (bilinear and bicubic without aligned corners at a
fractional scale_factor, nearest-exact, area, antialiased bicubic, trilinear); ESPCN super-resolution
(pixel_unshuffle in, pixel_shuffle out); a convolution by hand (F.unfold with dilation and stride, a
matmul, F.fold of overlapping patches divided by the fold of ones); conv nets with reflect, replicate and
circular padding modes, depthwise-separable and dilated convs, ConvTranspose2d with stride, output_padding,
dilation and groups; Sobel and Gaussian filters held as fixed-weight buffers (a gradient magnitude); a
dense detection head (anchors built in forward by arange and meshgrid, log-space box decoding with a clamp,
GIoU loss, torchvision's sigmoid focal loss); RoI pooling by index_select and gather on integer bin
coordinates; CenterNet's penalty-reduced focal loss on a heatmap (pow and where) and size regression
gathered at the object centres; a Conv3d net on channels_last_3d clips with InstanceNorm3d and adaptive
pooling to sizes that do not divide; YOLOv5's Detect layer (view, permute, a cell grid and an anchor grid
by meshgrid and expand); integral pose regression (a soft-argmax over linspace coordinates); a restoration
loss (Laplacian pyramid, SSIM by depthwise Gaussian convs, Charbonnier, total variation); unsupervised
optical flow (grid_sample of a meshgrid + flow grid, a homography's warp by einsum on homogeneous
coordinates); a bilinear sampler written by hand (floor, four gathered neighbours, validity masks) under a
deformable-attention head; CenterNet's max-pool NMS on a channels_last heatmap; YOLOv3-era code writing in
place (into slices of the head's output, clamp_ on stepped views, an integer input clamped, buffers under
no_grad); a feature pyramid with RetinaNet heads shared by its levels. Sizes are odd and tiny. Each model comes as a `tests.user_models.Case`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tests.user_models import Case, classify
from tests.user_models_fourth import half
from tests.user_models_more import fp64, own_loss


# --- a spatial transformer -------------------------------------------------------------------------------

class SpatialTransformer(nn.Module):
    """The PyTorch tutorial's STN: a conv localization net regresses theta (its last layer zeroed and
    biased to the identity, plus a small learned perturbation so the grid is not the identity), F.affine_grid
    and F.grid_sample warp the input (`mode`, `padding_mode`, `align_corners`); a conv classifier after.
    forward returns (warped image, cross-entropy)."""

    def __init__(self, mode: str, padding_mode: str, align_corners: bool) -> None:
        super().__init__()
        self.mode, self.padding_mode, self.align_corners = mode, padding_mode, align_corners
        self.loc = nn.Sequential(nn.Conv2d(2, 4, 3), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(4 * 3 * 3, 6))
        with torch.no_grad():
            self.loc[-1].weight.mul_(0.3)
            self.loc[-1].bias.copy_(torch.tensor([0.9, 0.2, 0.1, -0.25, 1.1, -0.05]))
        self.head = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(3, 3))

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, [x.shape[0], x.shape[1], 7, 9], align_corners=self.align_corners)
        warped = F.grid_sample(x, grid, mode=self.mode, padding_mode=self.padding_mode,
                               align_corners=self.align_corners)
        return warped, F.cross_entropy(self.head(warped), labels)


# --- resizing -------------------------------------------------------------------------------------------

class ResizeZoo(nn.Module):
    """F.interpolate as image and video code calls it: bilinear and bicubic at a fractional scale_factor
    without aligned corners, nearest-exact to an odd size, area downsampling, antialiased bicubic
    downsampling, linear on a sequence, trilinear on a clip; each after a conv, all pooled into a head."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 3, 3, padding=1)
        self.c3 = nn.Conv3d(1, 2, 3, padding=1)
        self.head = nn.Linear(3 * 6 + 2 + 2, 4)

    def forward(self, x: Tensor, clip: Tensor) -> Tensor:
        h = torch.tanh(self.c(x))                                                          # (B, 3, 9, 11)
        feats = [
            F.interpolate(h, scale_factor=1.7, mode="bilinear", align_corners=False),
            F.interpolate(h, scale_factor=(1.5, 0.8), mode="bicubic", align_corners=False),
            F.interpolate(h, size=(13, 5), mode="nearest-exact"),
            F.interpolate(h, size=(4, 5), mode="area"),
            F.interpolate(h, size=(5, 4), mode="bicubic", antialias=True, align_corners=False),
            F.interpolate(h, size=(6, 7), mode="bilinear", align_corners=True),
        ]
        pooled = [f.square().mean((2, 3)) for f in feats]                                  # 6 x (B, 3)
        seq = F.interpolate(h.flatten(2)[:, :2], scale_factor=1.3, mode="linear")          # (B, 2, 128)
        vid = F.interpolate(torch.relu(self.c3(clip)), size=(4, 3, 5), mode="trilinear")   # (B, 2, 4, 3, 5)
        return self.head(torch.cat(pooled + [seq.amax(-1), vid.mean((2, 3, 4))], 1))


class ESPCN(nn.Module):
    """Shi et al.'s efficient sub-pixel network, with the low-resolution input made by pixel_unshuffle of
    the high-resolution one: 5x5 conv, tanh, 3x3 conv, tanh, 3x3 conv to C r^2, pixel_shuffle(r). forward
    returns (super-resolved image, MSE to the target)."""

    def __init__(self, r: int = 3, c: int = 2) -> None:
        super().__init__()
        self.r = r
        self.body = nn.Sequential(nn.Conv2d(c * r * r, 8, 5, padding=2), nn.Tanh(),
                                  nn.Conv2d(8, 5, 3, padding=1), nn.Tanh(),
                                  nn.Conv2d(5, c * r * r, 3, padding=1))

    def forward(self, hr: Tensor) -> tuple:
        lr = F.pixel_unshuffle(hr, self.r)                                                 # (B, C r^2, H/r, W/r)
        sr = F.pixel_shuffle(self.body(lr), self.r)
        return sr, F.mse_loss(sr, hr)


class Im2ColConv(nn.Module):
    """A convolution written as im2col: F.unfold with dilation, padding and stride, a matmul with the
    flattened weight, the columns back to an image by view; then a patch-wise Linear folded back with
    F.fold (overlapping patches summed) and divided by the fold of ones, the usual overlap-add average."""

    def __init__(self, c_in: int = 3, c_out: int = 4, k: int = 3) -> None:
        super().__init__()
        self.k = k
        self.weight = nn.Parameter(torch.randn(c_out, c_in, k, k) * 0.3)
        self.bias = nn.Parameter(torch.randn(c_out) * 0.1)
        self.patch = nn.Linear(c_out * 4, c_out * 4)
        self.head = nn.Linear(c_out, 3)

    def forward(self, x: Tensor) -> Tensor:
        B, _, H, W = x.shape
        cols = F.unfold(x, self.k, dilation=2, padding=1, stride=(1, 2))                  # (B, C k k, L)
        Ho = (H + 2 - 2 * (self.k - 1) - 1) // 1 + 1
        Wo = (W + 2 - 2 * (self.k - 1) - 1) // 2 + 1
        y = (self.weight.flatten(1) @ cols + self.bias[:, None]).view(B, -1, Ho, Wo)
        y = F.gelu(y)
        p = F.unfold(y, 2, stride=1)                                                      # overlapping 2x2
        p = self.patch(p.transpose(1, 2)).transpose(1, 2)
        summed = F.fold(p, (Ho, Wo), 2, stride=1)
        counts = F.fold(torch.ones_like(p), (Ho, Wo), 2, stride=1)
        return self.head((summed / counts).mean((2, 3)))


class PaddedConvs(nn.Module):
    """Conv2d with padding_mode reflect, replicate and circular (odd paddings per side), a depthwise-separable
    block, a dilated conv, ConvTranspose2d with a stride per axis, output_padding, dilation and groups."""

    def __init__(self) -> None:
        super().__init__()
        self.reflect = nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode="reflect")
        self.replicate = nn.Conv2d(4, 4, (3, 5), padding=(2, 1), padding_mode="replicate")
        self.circular = nn.Conv2d(4, 6, 3, padding=1, padding_mode="circular", stride=(2, 1))
        self.depthwise = nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False)
        self.pointwise = nn.Conv2d(6, 4, 1)
        self.dilated = nn.Conv2d(4, 4, 3, padding=2, dilation=2)
        self.up = nn.ConvTranspose2d(4, 6, 3, stride=(2, 3), padding=1, output_padding=(1, 2), dilation=2, groups=2)
        self.head = nn.Linear(6, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.reflect(x))
        h = F.silu(self.replicate(h))
        h = F.silu(self.circular(h))
        h = F.relu6(self.pointwise(self.depthwise(h)))
        h = h + F.leaky_relu(self.dilated(h), 0.1)
        h = self.up(h)
        return self.head(h.mean((2, 3)))


def gaussian_kernel(size: int, sigma: float) -> Tensor:
    coords = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    g = torch.exp(-coords ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    return g[:, None] * g[None, :]


class EdgeFilters(nn.Module):
    """Fixed Sobel and Gaussian kernels registered as buffers, applied per channel (groups = C) after a
    learned conv: Gaussian blur, Sobel x and y, gradient magnitude sqrt(gx^2 + gy^2 + eps) and its
    orientation by atan2, a Canny-like soft threshold; forward returns (edges, an edge-aware smoothness loss)."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.c = c
        sobel_x = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
        self.register_buffer("sobel", torch.stack([sobel_x, sobel_x.t()])[:, None].repeat(c, 1, 1, 1))  # (2C,1,3,3)
        self.register_buffer("gauss", gaussian_kernel(5, 1.1)[None, None].repeat(c, 1, 1, 1))
        self.conv = nn.Conv2d(2, c, 3, padding=1)
        self.threshold = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: Tensor) -> tuple:
        h = self.conv(x)
        blurred = F.conv2d(F.pad(h, (2, 2, 2, 2), mode="replicate"), self.gauss, groups=self.c)
        g = F.conv2d(F.pad(blurred, (1, 1, 1, 1), mode="reflect"), self.sobel, groups=self.c)
        gx, gy = g[:, 0::2], g[:, 1::2]
        magnitude = torch.sqrt(gx ** 2 + gy ** 2 + 1e-6)
        angle = torch.atan2(gy, gx + 1e-3)
        edges = torch.sigmoid(8 * (magnitude - self.threshold))
        dx = (h[..., :, 1:] - h[..., :, :-1]).abs() * torch.exp(-edges[..., :, 1:])
        dy = (h[..., 1:, :] - h[..., :-1, :]).abs() * torch.exp(-edges[..., 1:, :])
        loss = dx.mean() + dy.mean() + 0.1 * (angle.cos() * edges).mean() + F.mse_loss(blurred.mean(1), x.mean(1))
        return edges, loss


# --- detection ------------------------------------------------------------------------------------------

def make_anchors(h: int, w: int, stride: float, sizes: tuple, device, dtype) -> Tensor:
    """(h * w * len(sizes), 4) anchors in (x1, y1, x2, y2), centred on each cell, built by arange and meshgrid."""
    shifts_x = (torch.arange(w, device=device, dtype=dtype) + 0.5) * stride
    shifts_y = (torch.arange(h, device=device, dtype=dtype) + 0.5) * stride
    sy, sx = torch.meshgrid(shifts_y, shifts_x, indexing="ij")
    centres = torch.stack([sx, sy, sx, sy], -1).reshape(-1, 1, 4)
    half = torch.tensor(sizes, device=device, dtype=dtype)[:, None] * torch.tensor([-0.5, -0.5, 0.5, 0.5],
                                                                                     device=device, dtype=dtype)
    return (centres + half[None]).reshape(-1, 4)


def decode_boxes(deltas: Tensor, anchors: Tensor, clip: float = 4.135) -> Tensor:
    """torchvision's BoxCoder.decode: (dx, dy, dw, dh) in log space, dw/dh clamped at log(1000/16)."""
    widths, heights = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    cx, cy = anchors[:, 0] + 0.5 * widths, anchors[:, 1] + 0.5 * heights
    dx, dy, dw, dh = deltas.unbind(-1)
    dw, dh = dw.clamp(max=clip), dh.clamp(max=clip)
    pcx, pcy = dx * widths + cx, dy * heights + cy
    pw, ph = torch.exp(dw) * widths, torch.exp(dh) * heights
    return torch.stack([pcx - 0.5 * pw, pcy - 0.5 * ph, pcx + 0.5 * pw, pcy + 0.5 * ph], -1)


def encode_boxes(gt: Tensor, anchors: Tensor) -> Tensor:
    """torchvision's BoxCoder.encode: the log-space targets decode_boxes inverts."""
    aw, ah = anchors[..., 2] - anchors[..., 0], anchors[..., 3] - anchors[..., 1]
    acx, acy = anchors[..., 0] + 0.5 * aw, anchors[..., 1] + 0.5 * ah
    gw, gh = gt[..., 2] - gt[..., 0], gt[..., 3] - gt[..., 1]
    gcx, gcy = gt[..., 0] + 0.5 * gw, gt[..., 1] + 0.5 * gh
    return torch.stack([(gcx - acx) / aw, (gcy - acy) / ah, torch.log(gw / aw), torch.log(gh / ah)], -1)


def giou_loss(boxes1: Tensor, boxes2: Tensor, eps: float = 1e-7) -> Tensor:
    """torchvision.ops.generalized_box_iou_loss, reduction none."""
    x1, y1, x2, y2 = boxes1.unbind(-1)
    x1g, y1g, x2g, y2g = boxes2.unbind(-1)
    xkis1, ykis1 = torch.max(x1, x1g), torch.max(y1, y1g)
    xkis2, ykis2 = torch.min(x2, x2g), torch.min(y2, y2g)
    intsct = torch.zeros_like(x1)
    mask = (ykis2 > ykis1) & (xkis2 > xkis1)
    intsct[mask] = (xkis2[mask] - xkis1[mask]) * (ykis2[mask] - ykis1[mask])
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - intsct
    iou = intsct / (union + eps)
    xc1, yc1 = torch.min(x1, x1g), torch.min(y1, y1g)
    xc2, yc2 = torch.max(x2, x2g), torch.max(y2, y2g)
    area_c = (xc2 - xc1) * (yc2 - yc1)
    return 1 - (iou - ((area_c - union) / (area_c + eps)))


def sigmoid_focal_loss(inputs: Tensor, targets: Tensor, alpha: float = 0.25, gamma: float = 2.0) -> Tensor:
    """torchvision.ops.sigmoid_focal_loss, reduction sum."""
    p = torch.sigmoid(inputs)
    ce = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (alpha_t * loss).sum()


class DenseDetector(nn.Module):
    """A RetinaNet-lite / FCOS-lite head on one feature level: anchors made in forward, class logits and box
    deltas per anchor; the targets are each anchor's matched ground-truth box (by IoU in the batch function)
    and a foreground mask: focal loss over all anchors, GIoU of the decoded boxes and smooth L1 of the encoded
    deltas over the foreground, normalized by the number of foreground anchors (clamped at 1)."""

    def __init__(self, classes: int = 3, sizes: tuple = (6.0, 11.0)) -> None:
        super().__init__()
        self.classes, self.sizes, self.stride = classes, sizes, 4.0
        self.trunk = nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.GroupNorm(2, 6), nn.ReLU(),
                                   nn.Conv2d(6, 6, 3, stride=2, padding=1), nn.ReLU())
        self.cls = nn.Conv2d(6, len(sizes) * classes, 3, padding=1)
        self.box = nn.Conv2d(6, len(sizes) * 4, 3, padding=1)
        with torch.no_grad():
            self.cls.bias.fill_(-2.0)                            # RetinaNet's prior-probability init
            self.box.weight.mul_(0.1)

    def forward(self, images: Tensor, gt_boxes: Tensor, gt_labels: Tensor, fg: Tensor) -> tuple:
        f = self.trunk(images)
        B, _, h, w = f.shape
        anchors = make_anchors(h, w, self.stride, self.sizes, f.device, f.dtype)          # (A, 4)
        logits = self.cls(f).permute(0, 2, 3, 1).reshape(B, -1, self.classes)             # (B, A, K)
        deltas = self.box(f).permute(0, 2, 3, 1).reshape(B, -1, 4)                        # (B, A, 4)
        onehot = F.one_hot(gt_labels, self.classes).to(logits.dtype) * fg[..., None]
        n_fg = fg.sum().clamp(min=1).to(logits.dtype)
        cls_loss = sigmoid_focal_loss(logits, onehot) / n_fg
        boxes = decode_boxes(deltas.reshape(-1, 4), anchors.repeat(B, 1)).view(B, -1, 4)
        fg_mask = fg.bool()
        reg = giou_loss(boxes[fg_mask], gt_boxes[fg_mask]).sum() / n_fg
        target_deltas = encode_boxes(gt_boxes, anchors[None].expand(B, -1, -1))
        l1 = F.smooth_l1_loss(deltas[fg_mask], target_deltas[fg_mask], beta=1 / 9, reduction="sum") / n_fg
        return boxes, cls_loss + reg + l1


class RoIPoolGather(nn.Module):
    """RoI max pooling written with indexing, as detection repos do without torchvision.ops: each box's
    feature-map coordinates, a P x P grid of sample points by arange, floor and clamp to integer indices,
    the image's map picked by index_select of the box's batch index, the points gathered from its
    flattened H * W, the max over 2 x 2 samples per bin; a head classifies each RoI."""

    def __init__(self, pooled: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.p = pooled
        self.trunk = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(), nn.Conv2d(5, 5, 3, stride=2, padding=1))
        self.head = nn.Linear(5 * pooled * pooled, classes)

    def forward(self, images: Tensor, rois: Tensor, batch_index: Tensor) -> Tensor:
        f = self.trunk(images)                                                            # (B, C, H, W)
        _, C, H, W = f.shape
        boxes = rois * 0.5                                                                # spatial scale 1/2
        steps = (torch.arange(2 * self.p, device=f.device, dtype=f.dtype) + 0.5) / (2 * self.p)
        xs = boxes[:, 0:1] + steps * (boxes[:, 2:3] - boxes[:, 0:1])                      # (R, 2P)
        ys = boxes[:, 1:2] + steps * (boxes[:, 3:4] - boxes[:, 1:2])
        xi = xs.floor().long().clamp(0, W - 1)
        yi = ys.floor().long().clamp(0, H - 1)
        flat = (yi[:, :, None] * W + xi[:, None, :]).flatten(1)                           # (R, 4P^2)
        maps = f.flatten(2).index_select(0, batch_index)                                  # (R, C, H W)
        samples = maps.gather(2, flat[:, None, :].expand(-1, C, -1))                      # (R, C, 4P^2)
        samples = samples.view(-1, C, self.p, 2, self.p, 2).amax((3, 5))                  # (R, C, P, P)
        return self.head(samples.flatten(1))


class CenterNet(nn.Module):
    """CenterNet's heads on a stride-2 feature map: a heatmap per class through a clamped sigmoid and the
    penalty-reduced focal loss (pos = gt == 1, (1 - gt)^4 weighting the negatives, pow and where), width
    and height regression read at the object centres by gather on flattened indices, an L1 loss under an
    object mask, normalized by the object count."""

    def __init__(self, classes: int = 2) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                                   nn.Conv2d(6, 6, 3, padding=1), nn.ReLU())
        self.heat = nn.Conv2d(6, classes, 1)
        self.wh = nn.Conv2d(6, 2, 1)
        with torch.no_grad():
            self.heat.bias.fill_(-2.19)

    def forward(self, images: Tensor, heatmap: Tensor, index: Tensor, wh: Tensor, obj_mask: Tensor) -> tuple:
        f = self.trunk(images)
        pred = torch.clamp(torch.sigmoid(self.heat(f)), min=1e-4, max=1 - 1e-4)
        pos = heatmap.eq(1).to(pred.dtype)
        neg_weights = torch.pow(1 - heatmap, 4)
        pos_loss = (torch.log(pred) * torch.pow(1 - pred, 2) * pos).sum()
        neg_loss = torch.where(heatmap < 1, torch.log(1 - pred) * torch.pow(pred, 2) * neg_weights,
                               torch.zeros_like(pred)).sum()
        num_pos = pos.sum()
        focal = torch.where(num_pos > 0, -(pos_loss + neg_loss) / num_pos.clamp(min=1), -neg_loss)
        size = self.wh(f).flatten(2)                                                      # (B, 2, H W)
        picked = size.gather(2, index[:, None, :].expand(-1, 2, -1)).transpose(1, 2)     # (B, K, 2)
        m = obj_mask[..., None].to(picked.dtype)
        l1 = F.l1_loss(picked * m, wh * m, reduction="sum") / (m.sum() + 1e-4)
        return pred, focal + 0.1 * l1


class Clip3D(nn.Module):
    """A video classifier on channels_last_3d clips: Conv3d (temporal stride), InstanceNorm3d (affine),
    a (1, 3, 3) spatial conv, MaxPool3d with ceil_mode, adaptive average and max pooling to sizes that do
    not divide, InstanceNorm2d on the time-averaged map, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(2, 4, 3, stride=(2, 1, 1), padding=1)
        self.n1 = nn.InstanceNorm3d(4, affine=True)
        self.c2 = nn.Conv3d(4, 5, (1, 3, 3), padding=(0, 1, 1), bias=False)
        self.pool = nn.MaxPool3d(2, ceil_mode=True)
        self.n2 = nn.InstanceNorm2d(5, affine=True)
        self.head = nn.Linear(5 * (2 * 3 * 2) + 5 * 3 * 2, 3)

    def forward(self, clip: Tensor) -> Tensor:
        h = F.gelu(self.n1(self.c1(clip)))
        h = self.pool(F.relu(self.c2(h)))                                                 # (B, 5, 2, 4, 5)
        a = F.adaptive_avg_pool3d(h, (2, 3, 2)).flatten(1)
        m = F.adaptive_max_pool2d(self.n2(h.mean(2)), (3, 2)).flatten(1)
        return self.head(torch.cat([a, m], 1))


# --- dense geometry: YOLO's decoding, soft-argmax, SSIM, flow warping, a bilinear sampler by hand -------

class YOLOHead(nn.Module):
    """YOLOv5's Detect layer on two levels: a 1x1 conv to na * (5 + nc) channels, view(bs, na, no, ny, nx)
    .permute(0, 1, 3, 4, 2).contiguous(), a grid of cell offsets and an anchor grid made by meshgrid and
    expand, xy = (sigmoid * 2 - 0.5 + grid) * stride, wh = (sigmoid * 2) ** 2 * anchor; the decoded boxes
    cat over levels; the loss: CIoU-free box L1 to the targets plus BCE of the objectness."""

    def __init__(self, nc: int = 2, anchors: tuple = ((3.0, 4.0, 7.0, 5.0), (9.0, 11.0, 13.0, 8.0))) -> None:
        super().__init__()
        self.nc, self.no, self.na = nc, nc + 5, len(anchors[0]) // 2
        self.register_buffer("anchors", torch.tensor(anchors).view(len(anchors), -1, 2))
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.SiLU())
        self.down = nn.Sequential(nn.Conv2d(6, 6, 3, stride=2, padding=1), nn.SiLU())
        self.m = nn.ModuleList(nn.Conv2d(6, self.no * self.na, 1) for _ in anchors)
        self.strides = (2.0, 4.0)

    def _make_grid(self, nx: int, ny: int, i: int) -> tuple:
        d, t = self.anchors.device, self.anchors.dtype
        shape = 1, self.na, ny, nx, 2
        y, x = torch.arange(ny, device=d, dtype=t), torch.arange(nx, device=d, dtype=t)
        yv, xv = torch.meshgrid(y, x, indexing="ij")
        grid = torch.stack((xv, yv), 2).expand(shape) - 0.5
        anchor_grid = (self.anchors[i] * self.strides[i]).view((1, self.na, 1, 1, 2)).expand(shape)
        return grid, anchor_grid

    def forward(self, images: Tensor, targets: Tensor, objectness: Tensor) -> tuple:
        feats = [self.stem(images)]
        feats.append(self.down(feats[0]))
        z, obj_logits = [], []
        for i, f in enumerate(feats):
            x = self.m[i](f)
            bs, _, ny, nx = x.shape
            x = x.view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
            grid, anchor_grid = self._make_grid(nx, ny, i)
            xy, wh, conf = x.sigmoid().split((2, 2, self.nc + 1), 4)
            xy = (xy * 2 + grid) * self.strides[i]
            wh = (wh * 2) ** 2 * anchor_grid
            z.append(torch.cat((xy, wh, conf), 4).view(bs, self.na * nx * ny, self.no))
            obj_logits.append(x[..., 4].reshape(bs, -1))
        boxes = torch.cat(z, 1)
        box_loss = (boxes[..., :4] - targets).abs().mean()
        obj_loss = F.binary_cross_entropy_with_logits(torch.cat(obj_logits, 1), objectness)
        return boxes, 0.05 * box_loss + obj_loss


class SoftArgmaxPose(nn.Module):
    """Integral pose regression: a heatmap per keypoint, softmax over the flattened H * W with a learned
    temperature, the expected x and y under it with torch.linspace coordinates in [-1, 1], an L1 loss to
    the target keypoints where visible plus a Jensen-Shannon-free variance term."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(), nn.Conv2d(5, k, 3, padding=1))
        self.log_beta = nn.Parameter(torch.tensor(0.7))

    def forward(self, images: Tensor, keypoints: Tensor, visible: Tensor) -> tuple:
        heat = self.net(images)
        B, K, H, W = heat.shape
        prob = F.softmax(heat.flatten(2) * self.log_beta.exp(), -1).view(B, K, H, W)
        xs = torch.linspace(-1, 1, W, device=heat.device, dtype=heat.dtype)
        ys = torch.linspace(-1, 1, H, device=heat.device, dtype=heat.dtype)
        ex = (prob.sum(2) * xs).sum(-1)
        ey = (prob.sum(3) * ys).sum(-1)
        coords = torch.stack([ex, ey], -1)                                                  # (B, K, 2)
        var = (prob.sum(2) * (xs - ex[..., None]) ** 2).sum(-1) + (prob.sum(3) * (ys - ey[..., None]) ** 2).sum(-1)
        v = visible[..., None].to(coords.dtype)
        loss = ((coords - keypoints).abs() * v).sum() / v.sum().clamp(min=1) + 0.1 * var.mean()
        return coords, loss


def ssim(x: Tensor, y: Tensor, window: Tensor, c1: float = 0.01 ** 2, c2: float = 0.03 ** 2) -> Tensor:
    """pytorch-ssim's: Gaussian-weighted local means, variances and covariance by a depthwise conv2d."""
    ch = x.shape[1]
    mu_x = F.conv2d(x, window, padding=window.shape[-1] // 2, groups=ch)
    mu_y = F.conv2d(y, window, padding=window.shape[-1] // 2, groups=ch)
    sxx = F.conv2d(x * x, window, padding=window.shape[-1] // 2, groups=ch) - mu_x.pow(2)
    syy = F.conv2d(y * y, window, padding=window.shape[-1] // 2, groups=ch) - mu_y.pow(2)
    sxy = F.conv2d(x * y, window, padding=window.shape[-1] // 2, groups=ch) - mu_x * mu_y
    ssim_map = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x.pow(2) + mu_y.pow(2) + c1) * (sxx + syy + c2))
    return ssim_map.mean()


class Restoration(nn.Module):
    """An image-restoration net trained by a mixed loss: a residual conv body on a Laplacian pyramid (avg_pool2d
    down, bilinear up, the band-pass differences, reconstructed coarse to fine), then 1 - SSIM with a Gaussian
    window buffer, a Charbonnier term ((d^2 + eps^2) ** 0.45) and total variation."""

    def __init__(self, c: int = 2) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, 6, 3, padding=1), nn.PReLU(6), nn.Conv2d(6, c, 3, padding=1))
        self.register_buffer("window", gaussian_kernel(5, 1.5)[None, None].repeat(c, 1, 1, 1))

    def forward(self, noisy: Tensor, clean: Tensor) -> tuple:
        x = noisy + self.body(noisy)
        levels, cur = [], x
        for _ in range(2):
            down = F.avg_pool2d(cur, 2, ceil_mode=True, count_include_pad=False)
            levels.append(cur - F.interpolate(down, size=cur.shape[-2:], mode="bilinear", align_corners=False))
            cur = down
        for band in reversed(levels):
            cur = F.interpolate(cur, size=band.shape[-2:], mode="bilinear", align_corners=False) + band * 1.1
        charbonnier = ((cur - clean) ** 2 + 1e-3 ** 2).pow(0.45).mean()
        tv = (cur[..., 1:, :] - cur[..., :-1, :]).abs().mean() + (cur[..., :, 1:] - cur[..., :, :-1]).abs().mean()
        return cur, 1 - ssim(cur, clean, self.window) + charbonnier + 0.01 * tv


class FlowWarp(nn.Module):
    """Unsupervised optical flow: a conv predicts the flow from the concatenated frames, the second frame is
    warped back by grid_sample on meshgrid + flow normalized to [-1, 1] (border, align_corners=True), a
    homography's warp of the first frame too (3x3 parameters applied to homogeneous pixel coordinates by
    einsum, divided by a clamped z); photometric Charbonnier loss under a mask of pixels warped from inside
    the frame, and a first-order smoothness loss weighted by the image gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = nn.Sequential(nn.Conv2d(6, 8, 3, padding=1), nn.LeakyReLU(0.1), nn.Conv2d(8, 2, 3, padding=1))
        self.h = nn.Parameter(torch.tensor([[1.02, 0.03, 0.4], [-0.02, 0.98, -0.3], [1e-3, -2e-3, 1.0]]))

    def forward(self, frame1: Tensor, frame2: Tensor) -> tuple:
        B, _, H, W = frame1.shape
        flow = self.flow(torch.cat([frame1, frame2], 1))
        ys, xs = torch.meshgrid(torch.arange(H, dtype=frame1.dtype, device=frame1.device),
                                torch.arange(W, dtype=frame1.dtype, device=frame1.device), indexing="ij")
        px = xs[None] + flow[:, 0]
        py = ys[None] + flow[:, 1]
        grid = torch.stack([2 * px / (W - 1) - 1, 2 * py / (H - 1) - 1], -1)
        warped = F.grid_sample(frame2, grid, mode="bilinear", padding_mode="border", align_corners=True)
        inside = ((grid.abs() <= 1).all(-1)).to(frame1.dtype)[:, None]
        homogeneous = torch.stack([xs, ys, torch.ones_like(xs)], -1)                       # (H, W, 3)
        mapped = torch.einsum("ij,hwj->hwi", self.h, homogeneous)
        z = mapped[..., 2:].clamp(min=1e-2)
        hgrid = mapped[..., :2] / z / torch.tensor([W - 1, H - 1], dtype=z.dtype, device=z.device) * 2 - 1
        hwarp = F.grid_sample(frame1, hgrid[None].expand(B, -1, -1, -1), align_corners=True)
        photo = (((warped - frame1) ** 2 + 1e-6) ** 0.4 * inside).sum() / inside.sum().clamp(min=1)
        dx = flow[..., :, 1:] - flow[..., :, :-1]
        dy = flow[..., 1:, :] - flow[..., :-1, :]
        wx = torch.exp(-10 * (frame1[..., :, 1:] - frame1[..., :, :-1]).abs().mean(1, keepdim=True))
        wy = torch.exp(-10 * (frame1[..., 1:, :] - frame1[..., :-1, :]).abs().mean(1, keepdim=True))
        smooth = (dx.abs() * wx).mean() + (dy.abs() * wy).mean()
        return warped, photo + 0.1 * smooth + F.mse_loss(hwarp, frame2)


def bilinear_sample(feature: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Sample (B, C, H, W) at float pixel coordinates x, y (B, N) by hand, as deformable-attention and
    optical-flow repos do: floor to the four neighbours, their weights, each neighbour gathered from the
    flattened map where it is inside the image (zero outside, by a validity mask)."""
    B, C, H, W = feature.shape
    x0, y0 = x.floor(), y.floor()
    x1, y1 = x0 + 1, y0 + 1
    out = 0
    flat = feature.flatten(2)
    for xc, yc, w in ((x0, y0, (x1 - x) * (y1 - y)), (x1, y0, (x - x0) * (y1 - y)),
                      (x0, y1, (x1 - x) * (y - y0)), (x1, y1, (x - x0) * (y - y0))):
        valid = ((xc >= 0) & (xc <= W - 1) & (yc >= 0) & (yc <= H - 1)).to(feature.dtype)
        idx = (yc.clamp(0, H - 1) * W + xc.clamp(0, W - 1)).long()
        v = flat.gather(2, idx[:, None, :].expand(-1, C, -1))
        out = out + v * (w * valid)[:, None, :]
    return out                                                                          # (B, C, N)


class DeformableSampler(nn.Module):
    """Deformable-DETR-lite: each query predicts offsets around a reference point and attention weights over
    its sampling points (softmax); features are bilinearly sampled by hand at reference + offsets and mixed
    by the weights, then projected to class logits."""

    def __init__(self, c: int = 4, queries: int = 5, points: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.points = points
        self.proj = nn.Conv2d(3, c, 3, padding=1)
        self.query = nn.Parameter(torch.randn(queries, 6))
        self.ref = nn.Parameter(torch.rand(queries, 2))
        self.offsets = nn.Linear(6, points * 2)
        self.weights = nn.Linear(6, points)
        self.head = nn.Linear(c, classes)

    def forward(self, images: Tensor) -> Tensor:
        f = self.proj(images)
        B, C, H, W = f.shape
        Q = self.query.shape[0]
        off = self.offsets(self.query).view(Q, self.points, 2) * 2.0
        ref = self.ref.sigmoid() * torch.tensor([W - 1, H - 1], dtype=f.dtype, device=f.device)
        loc = (ref[:, None, :] + off).reshape(1, -1, 2).expand(B, -1, -1)                  # (B, Q P, 2)
        sampled = bilinear_sample(f, loc[..., 0], loc[..., 1]).view(B, C, Q, self.points)
        attn = F.softmax(self.weights(self.query), -1)                                     # (Q, P)
        mixed = (sampled * attn).sum(-1).transpose(1, 2)                                   # (B, Q, C)
        return self.head(mixed).mean(1)


class HeatmapPeaks(nn.Module):
    """CenterNet's decoding made differentiable for a loss: the 3x3 max-pool NMS (heat == max_pool2d(heat))
    keeping local peaks, a peak-weighted mean of a size map, the peaks' count; channels_last input."""

    def __init__(self) -> None:
        super().__init__()
        self.heat = nn.Conv2d(3, 2, 3, padding=1)
        self.size = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, images: Tensor, target_size: Tensor) -> tuple:
        heat = torch.sigmoid(self.heat(images))
        hmax = F.max_pool2d(heat, 3, stride=1, padding=1)
        keep = (hmax == heat).to(heat.dtype)
        peaks = heat * keep
        size = F.softplus(self.size(images))
        pooled = (peaks[:, :, None] * size[:, None]).sum((3, 4)) / peaks.sum((2, 3))[..., None].clamp(min=1e-3)
        return peaks, F.smooth_l1_loss(pooled, target_size) + 0.01 * keep.sum() / keep.numel()


class InPlaceYOLO(nn.Module):
    """YOLOv3-era code that writes in place: sigmoid and exp written back into slices of the permuted head
    output (p[..., :2] = torch.sigmoid(p[..., :2])), boxes clipped by clamp_ on stepped views, a border row
    zeroed by assignment, masked_fill_, the caller's integer centre indices clamped in place, and under
    no_grad an EMA of the anchors and a count of images seen updated in their buffers."""

    def __init__(self, na: int = 2, no: int = 6) -> None:
        super().__init__()
        self.na, self.no = na, no
        self.conv = nn.Conv2d(3, na * no, 3, padding=1)
        self.register_buffer("anchor_ema", torch.tensor([[1.0, 1.5], [2.0, 0.7]]))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, images: Tensor, index: Tensor, targets: Tensor) -> tuple:
        B, _, H, W = images.shape
        p = self.conv(images).view(B, self.na, self.no, H, W).permute(0, 1, 3, 4, 2).contiguous()
        p[..., :2] = torch.sigmoid(p[..., :2])
        p[..., 2:4] = torch.exp(p[..., 2:4]) * self.anchor_ema.clone().view(1, self.na, 1, 1, 2)
        boxes = p[..., :4].clone()
        boxes[..., 0::2].clamp_(0.1, 0.9)
        boxes[..., 1::2].clamp_(max=1.5)
        boxes[:, :, 0, :, :] = 0
        index.clamp_(0, H * W - 1)
        picked = boxes.flatten(2, 3).gather(2, index[:, None, :, None].expand(-1, self.na, -1, 4))
        with torch.no_grad():
            self.anchor_ema.mul_(0.9).add_(0.1 * p[..., 2:4].mean((0, 2, 3)))
            self.seen += B
        obj = p[..., 4]
        obj.masked_fill_(obj.abs() > 2.5, 0.0)
        return boxes, F.smooth_l1_loss(picked, targets) + obj.sigmoid().mean()


class FPNRetina(nn.Module):
    """A three-stage backbone (bias-free convs before BatchNorm), a feature pyramid (1x1 laterals, the top-down
    path by nearest F.interpolate to each lateral's odd size, 3x3 output convs) and RetinaNet's heads shared by
    every level (their weights get one gradient summed over the levels), a learned scale per level on the box
    logits, exp; the levels' anchors concatenated. forward returns (class logits, boxes)."""

    def __init__(self, c: int = 6, classes: int = 3, na: int = 2) -> None:
        super().__init__()
        self.classes = classes
        widths = (3, 4, 8, 10)
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU())
            for a, b in zip(widths, widths[1:]))
        self.lateral = nn.ModuleList(nn.Conv2d(w, c, 1) for w in widths[1:])
        self.smooth = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in widths[1:])
        self.cls_head = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.GroupNorm(2, c), nn.ReLU(),
                                      nn.Conv2d(c, na * classes, 3, padding=1))
        self.box_head = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, na * 4, 3, padding=1))
        self.scales = nn.Parameter(torch.tensor([1.0, 0.8, 1.2]))

    def forward(self, x: Tensor) -> tuple:
        feats = []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        laterals = [lat(f) for lat, f in zip(self.lateral, feats)]
        pyramid = [laterals[-1]]
        for lat in reversed(laterals[:-1]):
            pyramid.insert(0, lat + F.interpolate(pyramid[0], size=lat.shape[-2:], mode="nearest"))
        logits, boxes = [], []
        for i, p in enumerate(pyramid):
            p = self.smooth[i](p)
            B = p.shape[0]
            logits.append(self.cls_head(p).permute(0, 2, 3, 1).reshape(B, -1, self.classes))
            boxes.append((self.box_head(p) * self.scales[i]).exp().permute(0, 2, 3, 1).reshape(B, -1, 4))
        return torch.cat(logits, 1), torch.cat(boxes, 1)


def retina_loss(model: nn.Module, inputs: tuple, target: Tensor | None) -> tuple:
    """BCE of the class logits to multi-hot targets, L1 of the boxes; the loss computed outside the model."""
    images, cls_target, box_target = inputs
    logits, boxes = model(images)
    return logits, F.binary_cross_entropy_with_logits(logits, cls_target) + F.l1_loss(boxes, box_target)


# --- the cases --------------------------------------------------------------------------------------------

def _labelled_images(g: torch.Generator) -> tuple:
    return (torch.randn(3, 2, 8, 8, generator=g), torch.randint(0, 3, (3,), generator=g)), None


def _resize(g: torch.Generator) -> tuple:
    return (torch.randn(2, 2, 9, 11, generator=g), torch.randn(2, 1, 3, 5, 4, generator=g)), \
        torch.randint(0, 4, (2,), generator=g)


def _hr_images(g: torch.Generator) -> tuple:
    return (torch.rand(2, 2, 9, 12, generator=g),), None


def _images(g: torch.Generator, c: int = 3, h: int = 9, w: int = 11, classes: int = 3) -> tuple:
    return (torch.randn(2, c, h, w, generator=g),), torch.randint(0, classes, (2,), generator=g)


def _im2col(g: torch.Generator) -> tuple:
    return _images(g, 3, 9, 12)


def _padded(g: torch.Generator) -> tuple:
    return _images(g, 3, 7, 9, classes=5)


def _edges(g: torch.Generator) -> tuple:
    return (torch.randn(2, 2, 9, 10, generator=g),), None


def _detection(g: torch.Generator) -> tuple:
    """Images 2 x 3 x 15 x 13 (feature map 4 x 4, 32 anchors); two gt boxes per image, each anchor matched to
    the gt of highest IoU, foreground when it is above 0.2."""
    images = torch.randn(2, 3, 15, 13, generator=g)
    xy = torch.rand(2, 2, 2, generator=g) * 8
    wh = 3 + torch.rand(2, 2, 2, generator=g) * 6
    gts = torch.cat([xy, xy + wh], -1)                                                   # (B, 2, 4)
    labels = torch.randint(0, 3, (2, 2), generator=g)
    anchors = make_anchors(4, 4, 4.0, (6.0, 11.0), None, torch.float32)
    lt = torch.max(anchors[None, :, None, :2], gts[:, None, :, :2])
    rb = torch.min(anchors[None, :, None, 2:], gts[:, None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (anchors[:, 2:] - anchors[:, :2]).prod(-1)[None, :, None]
    area_g = (gts[..., 2:] - gts[..., :2]).prod(-1)[:, None, :]
    best, idx = (inter / (area_a + area_g - inter)).max(-1)                              # (B, A)
    matched = torch.gather(gts, 1, idx[..., None].expand(-1, -1, 4))
    return (images, matched, torch.gather(labels, 1, idx), (best > 0.2).float()), None


def _rois(g: torch.Generator) -> tuple:
    images = torch.randn(2, 3, 11, 13, generator=g)
    xy = torch.rand(5, 2, generator=g) * 8
    rois = torch.cat([xy, xy + 2 + torch.rand(5, 2, generator=g) * 6], -1)              # some past the edge
    return (images, rois, torch.tensor([0, 1, 1, 0, 1])), torch.randint(0, 4, (5,), generator=g)


def _centers(g: torch.Generator) -> tuple:
    """Images 2 x 3 x 13 x 11 (maps 7 x 6); Gaussian peaks of value exactly 1 at up to 3 centres per image
    (the last slot of the second image empty), their flattened indices and sizes."""
    H, W = 7, 6
    heat = torch.zeros(2, 2, H, W)
    index = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ys, xs = torch.meshgrid(torch.arange(H, dtype=torch.float32), torch.arange(W, dtype=torch.float32), indexing="ij")
    for b in range(2):
        for k in range(3):
            if mask[b, k]:
                cy, cx = int(torch.randint(0, H, (1,), generator=g)), int(torch.randint(0, W, (1,), generator=g))
                c = int(torch.randint(0, 2, (1,), generator=g))
                gauss = torch.exp(-((ys - cy) ** 2 + (xs - cx) ** 2) / 2)
                heat[b, c] = torch.max(heat[b, c], gauss)
                index[b, k] = cy * W + cx
    wh = 1 + 3 * torch.rand(2, 3, 2, generator=g)
    return (torch.randn(2, 3, 13, 11, generator=g), heat, index, wh, mask), None


def _clips(g: torch.Generator) -> tuple:
    clip = torch.randn(2, 2, 7, 8, 9, generator=g).contiguous(memory_format=torch.channels_last_3d)
    return (clip,), torch.randint(0, 3, (2,), generator=g)


def _yolo(g: torch.Generator) -> tuple:
    """Images 2 x 3 x 13 x 11: levels of 7 x 6 and 4 x 3, two anchors each, 108 boxes."""
    return (torch.randn(2, 3, 13, 11, generator=g), 20 * torch.rand(2, 108, 4, generator=g),
            (torch.rand(2, 108, generator=g) > 0.8).float()), None


def _poses(g: torch.Generator) -> tuple:
    return (torch.randn(2, 3, 7, 9, generator=g), torch.rand(2, 3, 2, generator=g) * 2 - 1,
            torch.tensor([[1, 1, 0], [1, 0, 1]])), None


def _restoration(g: torch.Generator) -> tuple:
    clean = torch.rand(2, 2, 11, 9, generator=g)
    return (clean + 0.1 * torch.randn(2, 2, 11, 9, generator=g), clean), None


def _frames(g: torch.Generator) -> tuple:
    f1 = torch.rand(2, 3, 7, 10, generator=g)
    f2 = torch.roll(f1, 1, -1) + 0.05 * torch.randn(2, 3, 7, 10, generator=g)
    return (f1.contiguous(memory_format=torch.channels_last), f2), None


def _heat_images(g: torch.Generator) -> tuple:
    return (torch.randn(2, 3, 9, 8, generator=g).contiguous(memory_format=torch.channels_last),
            torch.rand(2, 2, 2, generator=g) * 3), None


def _in_place(g: torch.Generator) -> tuple:
    """Centre indices partly outside [0, H W), for the model to clamp."""
    return (torch.randn(2, 3, 5, 7, generator=g), torch.randint(-5, 40, (2, 3), generator=g),
            torch.rand(2, 2, 3, 4, generator=g)), None


def _pyramid(g: torch.Generator) -> tuple:
    """Images 2 x 3 x 21 x 19: levels of 11 x 10, 6 x 5 and 3 x 3, two anchors per cell, 278 in all."""
    anchors = 2 * (11 * 10 + 6 * 5 + 3 * 3)
    return (torch.randn(2, 3, 21, 19, generator=g), (torch.rand(2, anchors, 3, generator=g) > 0.9).float(),
            torch.rand(2, anchors, 4, generator=g)), None


def _classify_3d(model: nn.Module, inputs: tuple, target: Tensor) -> tuple:
    """The model in channels_last_3d too, as video code converts it (idempotent on each call)."""
    model.to(memory_format=torch.channels_last_3d)
    out = model(*inputs)
    return out, F.cross_entropy(out, target)


# Elements whose gradient is exactly zero in exact arithmetic (both runs hold rounding noise there): a conv's
# bias before a norm that removes the per-channel mean.
_CENTERNET_ZERO = (("trunk.0.bias", slice(None)),)       # before BatchNorm2d
_CLIP3D_ZERO = (("c1.bias", slice(None)),)               # before InstanceNorm3d
_POSE_ZERO = (("net.2.bias", slice(None)),)              # a constant per heatmap, which its softmax removes


def stn(mode: str, padding_mode: str, align_corners: bool) -> Case:
    name = f"stn_{mode}_{padding_mode}" + ("_corners" if align_corners else "")
    return Case(name, lambda: SpatialTransformer(mode, padding_mode, align_corners), _labelled_images, own_loss)


def cases() -> list[Case]:
    stns = [stn("bilinear", "border", True), stn("nearest", "reflection", False),
            stn("bilinear", "reflection", True), stn("bilinear", "reflection", False),
            stn("nearest", "zeros", True), stn("bicubic", "border", False), stn("bilinear", "zeros", True)]
    espcn = Case("espcn", ESPCN, _hr_images, own_loss)
    detector = Case("dense_detector_focal_giou", DenseDetector, _detection, own_loss)
    centernet = Case("centernet", CenterNet, _centers, own_loss, _CENTERNET_ZERO)
    roi = Case("roi_pool_gather", RoIPoolGather, _rois, classify)
    return [*stns,
            Case("resize_zoo", ResizeZoo, _resize, classify),
            espcn,
            Case("im2col_conv", Im2ColConv, _im2col, classify),
            Case("padded_convs", PaddedConvs, _padded, classify),
            Case("edge_filters", EdgeFilters, _edges, own_loss),
            detector,
            roi,
            centernet,
            Case("clip3d_channels_last", Clip3D, _clips, _classify_3d, _CLIP3D_ZERO),
            Case("yolo_detect", YOLOHead, _yolo, own_loss),
            Case("soft_argmax_pose", SoftArgmaxPose, _poses, own_loss, _POSE_ZERO),
            Case("restoration_ssim_pyramid", Restoration, _restoration, own_loss),
            Case("flow_warp_homography", FlowWarp, _frames, own_loss),
            Case("deformable_sampler", DeformableSampler, lambda g: _images(g, 3, 7, 8), classify),
            Case("heatmap_peaks_nms", HeatmapPeaks, _heat_images, own_loss),
            Case("yolo_v3_in_place", InPlaceYOLO, _in_place, own_loss),
            Case("fpn_retina_shared_heads", FPNRetina, _pyramid, retina_loss),
            *(fp64(c) for c in (stns[0], stns[1], espcn, detector, centernet)),
            # fp16: the RoI's sample points floor()ed from fp16 coordinates (a kernel stepped at the fp32 value)
            half(roi)]
