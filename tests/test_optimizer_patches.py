"""Patch embeddings (convolutions whose windows tile the input) as GEMMs: optimizer/patches.py. Values
and gradients as eager's for the shapes users give them, and no ATen convolution left; other
convolutions stay ATen's and still match."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from optimizer.backend import decompositions, make_backend
from optimizer.schedule import DEFAULT
from tests.test_optimizer_correctness import fresh  # noqa: F401  (autouse: a shared compile cache, no dynamo state)


def trained_as_eager(conv: torch.nn.Conv2d, x: torch.Tensor) -> None:
    """The convolution under a ViT's flatten and transpose, forward and backward, compiled against eager."""
    compiled_conv = copy.deepcopy(conv)
    step = torch.compile(lambda t: torch.tanh(compiled_conv(t)).flatten(2).transpose(1, 2),
                         backend=make_backend(schedule=DEFAULT))
    x1, x2 = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    want, got = torch.tanh(conv(x1)).flatten(2).transpose(1, 2), step(x2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    want.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(conv.named_parameters(), compiled_conv.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("channels,out,kernel,size,bias,channels_last", [
    (3, 20, 5, (15, 15), True, False),          # a mixer's patch embedding
    (3, 8, 4, (18, 17), False, False),          # sizes no whole number of patches: the rest is not read
    (2, 5, (2, 3), (8, 9), True, True),         # rectangular patches of a channels-last input
    (1, 1, 3, (3, 3), True, False),             # one patch, one channel in and out
])
def test_a_patch_embedding_trains_as_eager(channels, out, kernel, size, bias, channels_last):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(channels, out, kernel, stride=kernel, bias=bias)
    x = torch.randn(3, channels, *size)
    trained_as_eager(conv, x.to(memory_format=torch.channels_last) if channels_last else x)


def convolutions_in_step(conv: torch.nn.Conv2d, x: torch.Tensor) -> list[str]:
    """The convolution ops left in the forward and backward of conv, traced with tfsn's decompositions."""
    def step(x, weight, bias):
        y = torch.nn.functional.conv2d(x, weight, bias, conv.stride, conv.padding)
        return torch.autograd.grad(y.square().sum(), (x, weight, bias))
    gm = make_fx(step, decomposition_table=decompositions())(x.requires_grad_(), conv.weight, conv.bias)
    return [str(n.target) for n in gm.graph.nodes if "convolution" in str(n.target)]


def test_a_patch_embedding_is_no_aten_convolution_and_other_convolutions_are():
    torch.manual_seed(0)
    assert convolutions_in_step(torch.nn.Conv2d(3, 6, 4, stride=4), torch.randn(2, 3, 8, 8)) == []
    overlapping = torch.nn.Conv2d(3, 6, 3, stride=1, padding=1)
    assert convolutions_in_step(overlapping, torch.randn(2, 3, 8, 8)) == [
        "aten.convolution.default", "aten.convolution_backward.default"]
    trained_as_eager(overlapping, torch.randn(2, 3, 8, 8))
    trained_as_eager(torch.nn.Conv2d(3, 6, 2, stride=2, padding=1), torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_patch_embedding_has_the_strides_of_atens_convolution(layout):
    """Code after the convolution sees the strides eager's has (NCHW for an NCHW input): a view merging
    channels with rows failed to compile, an as_strided read other elements, and a returned output
    took another view than eager's."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 5, 2, stride=2)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(2, 3, 4, 6).to(memory_format=fmt)

    def step(x):
        y = conv(x)
        return y, y.reshape(2, -1) * 2, y.as_strided((2, 30), (30, 1)) * 3
    got, want = torch.compile(step, backend=make_backend(schedule=DEFAULT))(x), step(x)
    for g, w in zip(got, want):
        assert g.stride() == w.stride()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
