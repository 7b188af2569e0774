"""Max pooling as ops the generator fuses, for the common case of windows that tile the input
(kernel == stride, no padding or dilation, sizes divisible): each window element is a strided
view of the input, the max is a chain of `maximum`, the index a chain of `where`. ATen's CPU
max_pool2d_with_indices is an opaque call (4.3 ms for a 24x12x52x52 input on one core here, the
generated loop 0.2 ms) that also keeps the BatchNorm/ReLU before it from fusing with anything.

The results are ATen's exactly, ties and NaN included: ATen scans a window row by row, keeps the
first maximum (a later equal value does not replace it) and takes a NaN whenever it meets one
(so the last NaN of a window wins, and the value is NaN). Other cases (overlapping windows,
padding) return NotImplemented and stay ATen calls.

The backward stays ATen's max_pool2d_with_indices_backward (a scatter through the indices): as
pointwise ops it would read the indices at every input element, and the min-cut partition then
recomputes them there from the forward's input, four windows' worth of BatchNorm and ReLU per
element (a BatchNorm backward went from 1.2 to 6.6 ms).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

aten = torch.ops.aten
MAX_WINDOW = 16          # window elements up to which the chains are worth writing out (4x4)


def _pair(v: Sequence[int] | int, default: Sequence[int] | None = None) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    v = list(v) or list(default or ())
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def _tiling(x: torch.Tensor, kernel_size, stride, padding, dilation, ceil_mode) -> tuple[int, int] | None:
    """The window (kh, kw) when windows tile x exactly; None for every other case."""
    if x.dim() != 4 or not x.dtype.is_floating_point:
        return None
    kh, kw = _pair(kernel_size)
    if _pair(stride, (kh, kw)) != (kh, kw) or _pair(padding) != (0, 0) or _pair(dilation) != (1, 1):
        return None
    H, W = x.shape[-2:]
    if kh * kw > MAX_WINDOW or H % kh or W % kw:       # (then ceil_mode adds no window either)
        return None
    return kh, kw


def _positions(H: int, W: int, kh: int, kw: int, device: torch.device) -> torch.Tensor:
    """(Ho, Wo) int64: the flat index h * W + w of each window's first element."""
    ho = torch.arange(H // kh, device=device).view(-1, 1) * (kh * W)
    return ho + torch.arange(W // kw, device=device) * kw


def max_pool2d_with_indices(x: torch.Tensor, kernel_size, stride=(), padding=0, dilation=1,
                            ceil_mode: bool = False) -> Any:
    tiling = _tiling(x, kernel_size, stride, padding, dilation, ceil_mode)
    if tiling is None:
        return NotImplemented
    kh, kw = tiling
    N, C, H, W = x.shape
    windows = x.reshape(N, C, H // kh, kh, W // kw, kw)
    elements = [(a * W + b, windows.select(5, b).select(3, a)) for a in range(kh) for b in range(kw)]
    value = elements[0][1]
    for _, e in elements[1:]:
        value = torch.maximum(value, e)            # NaN-propagating, as ATen's max is
    base = _positions(H, W, kh, kw, x.device)
    index = base + elements[-1][0]
    for offset, e in reversed(elements[:-1]):      # the first maximum in scan order
        index = torch.where(e == value, base + offset, index)
    for offset, e in elements:                     # ... unless a NaN: the last one in scan order
        index = torch.where(e != e, base + offset, index)
    return value, index


DECOMPOSITIONS = {aten.max_pool2d_with_indices.default: max_pool2d_with_indices}
