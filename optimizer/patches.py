"""Convolutions whose windows tile the input (a ViT's or an MLP-mixer's patch embedding: kernel ==
stride, no padding, dilation or groups) as GEMMs over the patches, forward and backward.

Such a convolution is a reshape of the input into one row per patch and a product with the weight
seen as a (out channels x patch elements) matrix. ATen's CPU convolution (oneDNN) pays a fixed
cost that dwarfs a small patch embedding: a mixer's 15x15 images in 5x5 patches took 94 us
forward and 122 us backward per step here, for products of a few microseconds. As GEMMs and
copies, the generator writes and fuses them (the bias becomes the GEMM's epilogue).

The output has ATen's strides, since the code after it was traced against them (a view merging
channels with rows, an as_strided, a returned output): channels-last, the layout the GEMM writes,
for a channels-last input or weight; else NCHW, a copy the generator fuses into its readers. Input rows
and columns past the last whole patch are not read, as the convolution does not read them, and
get a zero gradient. Every other convolution returns NotImplemented and stays ATen's.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._prims_common import suggest_memory_format

aten = torch.ops.aten


def _tiles(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
           dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int) -> bool:
    """Whether this is a 2-d convolution whose windows tile x: each input element in one window at most."""
    if x.dim() != 4 or weight.dim() != 4 or transposed or groups != 1 or not x.dtype.is_floating_point:
        return False
    window = tuple(weight.shape[2:])
    return tuple(stride) == window and not any(padding) and all(d == 1 for d in dilation) \
        and not any(output_padding) and x.shape[2] >= window[0] and x.shape[3] >= window[1]


def _channels_last(t: torch.Tensor) -> bool:
    """Whether ATen's CPU convolution (oneDNN) gives a channels-last output for this operand."""
    return suggest_memory_format(t) == torch.channels_last


def _patch_rows(x: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """(N * Ho * Wo, C * kh * kw): one row per patch, its elements in the weight's (C, kh, kw) order."""
    N, C, H, W = x.shape
    Ho, Wo = H // kh, W // kw
    x = x[:, :, :Ho * kh, :Wo * kw]
    return x.reshape(N, C, Ho, kh, Wo, kw).permute(0, 2, 4, 1, 3, 5).reshape(N * Ho * Wo, C * kh * kw)


def convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation,
                transposed: bool, output_padding, groups: int) -> Any:
    if not _tiles(x, weight, stride, padding, dilation, transposed, output_padding, groups):
        return NotImplemented
    N, _, H, W = x.shape
    O, _, kh, kw = weight.shape
    rows = _patch_rows(x, kh, kw)
    w = weight.reshape(O, -1)
    out = rows @ w.t() if bias is None else torch.addmm(bias, rows, w.t())
    nhwc = out.view(N, H // kh, W // kw, O).permute(0, 3, 1, 2)
    # ATen's strides: what follows (a view, an as_strided, the graph's output) was written against them
    return nhwc if _channels_last(x) or _channels_last(weight) else nhwc.contiguous()


def convolution_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias_sizes, stride, padding,
                         dilation, transposed: bool, output_padding, groups: int, output_mask: Sequence[bool]) -> Any:
    if not _tiles(x, weight, stride, padding, dilation, transposed, output_padding, groups):
        return NotImplemented
    N, C, H, W = x.shape
    O, _, kh, kw = weight.shape
    Ho, Wo = H // kh, W // kw
    g = grad.permute(0, 2, 3, 1).reshape(N * Ho * Wo, O)
    grad_x = grad_w = grad_b = None
    if output_mask[0]:
        patches = (g @ weight.reshape(O, -1)).view(N, Ho, Wo, C, kh, kw).permute(0, 3, 1, 4, 2, 5)
        grad_x = patches.reshape(N, C, Ho * kh, Wo * kw)
        if (Ho * kh, Wo * kw) != (H, W):                  # the rows and columns no window reads
            grad_x = aten.constant_pad_nd(grad_x, [0, W - Wo * kw, 0, H - Ho * kh])
    if output_mask[1]:
        grad_w = (g.t() @ _patch_rows(x, kh, kw)).view(weight.shape)
    if output_mask[2]:
        grad_b = g.sum(0)
    return grad_x, grad_w, grad_b


DECOMPOSITIONS = {aten.convolution.default: convolution,
                  aten.convolution_backward.default: convolution_backward}
