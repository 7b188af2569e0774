"""The generated entry of a compiled graph (optimizer/runtime.py): views resolved at compile time compute
what eager's view ops do (values, strides, aliasing), from kernels' outputs, from graph inputs whose
layout is not the one traced, and from externs' results; and a model whose step is views, slices,
expands, aliased outputs and an in-place update through a strided view trains as eager does."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from optimizer.backend import compile_graph, decompositions, make_backend
from optimizer.runtime import CompiledGraph
from optimizer.schedule import DEFAULT


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn, *args) -> CompiledGraph:
    gm = make_fx(fn, decomposition_table=decompositions())(*args)
    graph = compile_graph(gm, args, schedule=DEFAULT)
    assert isinstance(graph, CompiledGraph), "the graph ran as ATen: see the log"
    return graph


def same_as_eager(got: list, want: tuple) -> None:
    """Values, shapes, strides and storage offsets as eager's, and the same outputs sharing memory."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert (g.stride(), g.storage_offset()) == (w.stride(), w.storage_offset())
    shares = [[a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in outs]
              for outs in (got, want) for a in outs]
    assert shares[:len(got)] == shares[len(got):], "outputs alias each other where eager's do not, or the reverse"


def views_of_a_product(x, w):
    y = torch.tanh(x @ w)                                  # a kernel's output: the root of every view below
    return (y, y.t(), y[:, ::2], y[1:, 3:10:3], y.unsqueeze(0).expand(3, -1, -1), y.view(-1)[5:],
            y.t()[::2].t(), y.view(4, 3, 12).permute(2, 0, 1)[1:, :, ::2], y.select(1, 4))


def test_views_of_a_kernel_output_are_one_as_strided_each_and_alias_it_as_eager_does():
    torch.manual_seed(0)
    x, w = torch.randn(12, 7), torch.randn(7, 12)
    graph = compiled(views_of_a_product, x, w)
    same_as_eager(graph([x, w]), views_of_a_product(x, w))
    body = graph.source.splitlines()
    assert sum("as_strided" in line for line in body) == 8
    assert not any("op" in line.split("=")[-1] for line in body), f"an ATen view op is still called:\n{graph.source}"


def only_viewed(x, w):
    return (torch.tanh(x @ w).t(), (x * 2).sum(1, keepdim=True).view(-1), (x * 3)[:2], (x + 4)[:, ::2],
            (x - 1).t().unsqueeze(0))


def test_a_kernel_output_only_viewed_densely_is_allocated_as_the_view_and_no_other():
    torch.manual_seed(0)
    x, w = torch.randn(6, 7), torch.randn(7, 5)
    graph = compiled(only_viewed, x, w)
    same_as_eager(graph([x, w]), only_viewed(x, w))
    # the transposed product, the row sums and x - 1 are written where their views lie; the first rows and
    # every other column of a tensor are views of one (no kernel writes a part of a tensor alone)
    assert sum("as_strided" in line for line in graph.source.splitlines()) == 2, graph.source


def views_of_an_input(x):
    return x.t()[::2], x[1:, ::3], x.view(-1, 2) if x.is_contiguous() else x.reshape(-1, 2).clone(), x * 2


@pytest.mark.parametrize("layout", ["traced", "offset", "transposed"])
def test_views_of_an_input_follow_the_layout_it_arrives_in(layout):
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    graph = compiled(lambda x: views_of_an_input(x)[:2], x)
    given = {"traced": x, "offset": torch.randn(9, 8)[3:],                           # same strides, storage offset
             "transposed": torch.randn(8, 6).t()}[layout]                            # other strides: the ops replayed
    same_as_eager(graph([given]), views_of_an_input(given)[:2])


def strided_slice_of_an_extern(x, y):
    z = torch.cat([x, y], dim=1).flip(0)                 # flip: an ATen call, its result's layout is ATen's
    return z[:, 1::3].t(), torch.sigmoid(z)[::2]


def test_views_of_an_extern_result_match_eager():
    torch.manual_seed(0)
    x, y = torch.randn(5, 4), torch.randn(5, 7)
    graph = compiled(strided_slice_of_an_extern, x, y)
    same_as_eager(graph([x, y]), strided_slice_of_an_extern(x, y))


class Viewy(nn.Module):
    """Transposes, strided slices, expands and a running buffer updated in place through a strided view."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 12)
        self.b = nn.Linear(6, 5)
        self.register_buffer("running", torch.zeros(8))

    def forward(self, x):
        h = torch.relu(self.a(x))                            # (n, 12)
        left, right = h[:, ::2], h[:, 1::2]                  # strided slices of a kernel's output
        mixed = left * right.flip(1) + h.t()[:6].t()
        with torch.no_grad():
            self.running[::2].mul_(0.5).add_(mixed.mean().detach())
        out = self.b(mixed).unsqueeze(1).expand(-1, 3, -1)   # (n, 3, 5)
        return out, out.transpose(1, 2), h.view(-1, 4, 3)[:, 1]


def test_a_model_of_views_trains_as_eager_with_aliased_outputs_and_an_in_place_update_through_a_view():
    torch.manual_seed(0)
    eager = Viewy()
    tfsn = copy.deepcopy(eager)
    step = torch.compile(tfsn, backend=make_backend(schedule=DEFAULT))
    for i in range(2):
        x = torch.randn(7, 10, generator=torch.Generator().manual_seed(i))
        outs = [step(x), eager(x)]
        for got, want in zip(*outs):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert got.stride() == want.stride()
        for o in outs:
            (o[0].square().sum() + o[1][:, ::2].sum() + o[2].exp().sum()).backward()
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")
    torch.testing.assert_close(tfsn.running, eager.running, rtol=1e-5, atol=1e-6)


def rotated_heads(x, w):
    q = (x @ w).view(2, 5, 2, 6).transpose(1, 2)           # a product seen once densely (heads), by a kernel
    rotated = torch.cat((-q[..., 3:], q[..., :3].flip(-1)), -1)     # and sliced for an extern (flip)
    return (q * 2.0 + rotated * 3.0,)


def test_a_product_viewed_densely_by_a_kernel_and_sliced_for_an_extern_is_allocated_once():
    """The product may be written into its dense view's allocation only when that view is its one reader
    at run time: here the extern's slice reads the product too (as ATen's cat's did in a Llama's rotate_half)."""
    torch.manual_seed(0)
    x, w = torch.randn(10, 4), torch.randn(4, 12)
    graph = compiled(rotated_heads, x, w)
    same_as_eager(graph([x, w]), rotated_heads(x, w))


def aten_calls(graph: CompiledGraph) -> list[str]:
    """The ATen ops the graph's entry calls at run time, once per call in its source."""
    names = {k: str(v) for k, v in graph.run.__globals__.items() if isinstance(v, torch._ops.OpOverload)}
    return [names[word] for line in graph.source.splitlines() for word in re.findall(r"(\w+)\(", line)
            if word in names]


def split_every_way(x):
    y = torch.tanh(x)                                      # a kernel's output
    a, b, c = y.split([2, 3, 4], dim=-1)                   # uneven sizes, a negative dim
    d, e = x.t().chunk(2)                                  # an input's transpose, an odd size in two chunks
    f, g, h = y[:, 1:4].unbind(1)                          # items of a slice
    parts = torch.split(y, 4, 1)                           # the last part short
    return a * 2 + c[:, :2], b.sum(1), d, e * 3, f + g - h, parts[2], parts[0].t()


def test_split_chunk_and_unbind_are_slices_and_selects_not_aten_calls():
    torch.manual_seed(0)
    x = torch.randn(5, 9)
    graph = compiled(split_every_way, x)
    same_as_eager(graph([x]), split_every_way(x))
    called = set(aten_calls(graph))
    assert not called & {"aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int"}, called


class GatedCell(nn.Module):
    """A GRU-like cell over a short sequence: its gates are one Linear split in three, its input steps
    an unbind, and a position range (arange) is added to the input."""

    def __init__(self) -> None:
        super().__init__()
        self.x2h, self.h2h = nn.Linear(6, 24), nn.Linear(8, 24)

    def forward(self, x):                                  # (batch, time, 6)
        x = x + torch.arange(x.shape[1], dtype=x.dtype)[:, None] / 10
        h = x.new_zeros(x.shape[0], 8)
        for xt in x.unbind(1):
            r, z, n = (self.x2h(xt) + self.h2h(h)).chunk(3, -1)
            h = torch.sigmoid(z) * h + (1 - torch.sigmoid(z)) * torch.tanh(n * torch.sigmoid(r))
        return h


def test_a_cell_of_chunks_and_unbinds_trains_as_eager():
    torch.manual_seed(0)
    eager = GatedCell()
    tfsn = copy.deepcopy(eager)
    step = torch.compile(tfsn, backend=make_backend(schedule=DEFAULT))
    x = torch.randn(3, 4, 6)
    for model in (step, eager):
        out = model(x)
        out.square().sum().backward()
    torch.testing.assert_close(step(x), eager(x), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")


def ranges(x):
    positions = torch.arange(2, 11, 3)                     # read by a kernel only: made once, at compile time
    return x * positions, torch.arange(4) * 0 + torch.arange(4), torch.arange(3), torch.arange(6.0).view(2, 3)[1:]


def test_a_range_read_by_kernels_is_made_once_and_a_returned_range_is_fresh_at_every_call():
    x = torch.randn(2, 3)
    graph = compiled(ranges, x)
    first = graph([x])
    same_as_eager(first, ranges(x))
    assert sum("arange" in op for op in aten_calls(graph)) == 2, f"not only the returned ranges are made per call:\n{graph.source}"
    first[2].add_(100)                                     # a caller's in-place change of a returned range
    first[3].add_(100)                                     # and of a returned view of one
    second = graph([x])
    torch.testing.assert_close(second[2], torch.arange(3))
    torch.testing.assert_close(second[3], torch.tensor([[3.0, 4.0, 5.0]]))
    torch.testing.assert_close(second[0], x * torch.tensor([2, 5, 8]))


def counts(x, target, ints):
    valid = target != -100                                 # cross-entropy's targets not ignored
    return valid.sum(), (ints * 3).sum(1), (x > 0).sum((0, 2), keepdim=True), ints.to(torch.int8).sum(), \
        (x * valid[:, None, None]).sum()


def test_sums_of_bools_and_integers_are_generated_in_int64_as_torch_sums_them():
    x, target = torch.randn(5, 7, 3), torch.tensor([1, -100, 3, 4, -100])
    ints = torch.randint(-2 ** 30, 2 ** 30, (5, 9), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    graph = compiled(counts, x, target, ints)
    got, want = graph([x, target, ints]), counts(x, target, ints)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0)     # integers exactly (the int32 products wrap)
    assert not any(op.startswith("aten.sum") for op in aten_calls(graph)), graph.source


@torch.library.custom_op("tfsn_tests::row_mean_fp32", mutates_args=())
def row_mean_fp32(x: torch.Tensor) -> torch.Tensor:
    """A kernel that returns fp32 whatever its input, where its meta function (below) says the input's dtype."""
    return x.float().mean(-1, keepdim=True)


@row_mean_fp32.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], 1)


def test_extern_results_of_another_dtype_than_traced_are_converted_to_it():
    """An ATen call or custom op whose kernel returns another dtype than its meta function (what torch.compile
    traces with) says: ATen's native_group_norm of a bf16 input with fp32 weight returned fp32 mean and rstd
    where the trace said bf16 (NaN gradients for every GroupNorm of a bf16 activation, before GroupNorm was
    decomposed). The kernels that read such a result took its fp32 bytes for bf16 values; it is converted to
    the traced dtype, so the output matches eager's within one bf16 rounding of the mean."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=g).bfloat16()

    def centered(x):
        return (x.float() - row_mean_fp32(x).float()) * 2.0
    got = torch.compile(centered, backend=make_backend(top_k=1))(x)
    torch.testing.assert_close(got, centered(x), rtol=2 ** -7, atol=2 ** -7)
