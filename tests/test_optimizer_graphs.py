"""Compiled graphs replayed as CUDA graphs (optimizer/graphs.py), in the ways users write training loops.

On this CPU a stand-in keeps a CUDA graph's contract (`Rerun`): its capture runs nothing, its outputs
stay where the capture put them and every replay writes over them, and a replay whose inputs are not
where the capture saw them fails the test (a real graph would read stale memory). Every loop is
compared with eager PyTorch, step by step. With TFSN_TEST_DEVICE=cuda (benchmarks/gpu_check.sh) the
same loops run on the GPU's own CUDA graphs and Triton kernels.
"""
from __future__ import annotations

import copy
import itertools
import logging
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from optimizer import graphs
from optimizer.backend import make_backend
from optimizer.schedule import DEFAULT
from tests.optimizer_models import Block

DEVICE = os.environ.get("TFSN_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels run on CPU tensors
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TFSN_TEST_DEVICE=cuda but torch sees no GPU", allow_module_level=True)
STEPS = 6


def _distinct(x: torch.Tensor) -> torch.Tensor:
    """x's elements at distinct addresses: each stride-0 dim (an expand, as a backward's gradient of a mean
    returns) taken once, so that a replay can write them as a graph's kernels would."""
    return x[tuple(slice(0, 1) if s == 0 else slice(None) for s in x.stride())]


class Rerun:
    """A CUDA graph's contract on a CPU (see the module's docstring)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def capture(self, run, inputs):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        before = [_distinct(x).clone() if isinstance(x, torch.Tensor) else x for x in inputs]   # stride-0 dims once
        outputs = run(list(inputs))
        for x, b in zip(inputs, before):        # a capture runs nothing: what it wrote is put back,
            if isinstance(x, torch.Tensor):     # its version unchanged (autograd checks saved tensors')
                _distinct(x.data).copy_(b)
        mine = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        for o in outputs:                       # and what it allocated holds no value yet
            if isinstance(o, torch.Tensor) and o.is_floating_point() and o.untyped_storage().data_ptr() not in mine:
                _distinct(o.data).fill_(float("nan"))
        addresses = [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in inputs]

        def replay(now):
            assert [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in now] == addresses, \
                "replayed with an input away from the address its capture read"
            for o, n in zip(outputs, run(list(now))):
                if isinstance(o, torch.Tensor):
                    _distinct(o.data).copy_(_distinct(n))       # as a graph writes: no version counted
        return outputs, replay


@pytest.fixture(autouse=True)
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))
    if DEVICE == "cpu":
        monkeypatch.setattr(graphs, "recorder_for", lambda device: Rerun())
    torch._dynamo.reset()
    for k in graphs.COUNTS:
        graphs.COUNTS[k] = 0
    yield
    torch._dynamo.reset()


class Net(nn.Module):
    """A GPT-2 block and a head: LayerNorm, attention, GELU MLP, residuals. The attention's input bias is
    frozen: its key part's gradient is exactly zero in eager and rounding noise in any other order of
    sums, which AdamW turns into full steps."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = Block(24, 2), nn.Linear(24, 5)
        self.block.qkv.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x)).mean(1)


def backend(codegen: str = "c"):
    """On a GPU the default backend (Triton's kernels for a graph there); here the C kernels, or Triton's
    under its interpreter."""
    if DEVICE == "cuda":
        return make_backend()
    return make_backend(schedule=DEFAULT, codegen=codegen)


def pair(build=Net):
    torch.manual_seed(0)
    eager = build().to(DEVICE)
    return eager, copy.deepcopy(eager)


def batches(n: int, shape=(3, 7, 24)):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=g).to(DEVICE), torch.randint(0, 5, shape[:1], generator=g).to(DEVICE))
            for _ in range(n)]


def close(got, want, what):
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")


def trainers(eager, tfsn, codegen: str = "c"):
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_t = torch.optim.AdamW(tfsn.parameters(), lr=1e-2)
    return opt_e, opt_t, torch.compile(tfsn, backend=backend(codegen)), \
        torch.compile(opt_t.step, backend=backend(codegen))


@pytest.mark.parametrize("codegen", ["c", pytest.param("triton", marks=pytest.mark.skipif(
    DEVICE == "cuda", reason="on a GPU every test runs Triton's kernels"))])
def test_a_training_loop_is_replayed_from_its_third_step_and_matches_eager(codegen):
    if codegen == "triton":
        pytest.importorskip("triton")
    eager, tfsn = pair()
    opt_e, opt_t, model, step = trainers(eager, tfsn, codegen)
    for i, (x, y) in enumerate(batches(STEPS)):
        opt_e.zero_grad(set_to_none=True)
        opt_t.zero_grad(set_to_none=True)
        want = F.cross_entropy(eager(x), y)
        want.backward()
        opt_e.step()
        got = F.cross_entropy(model(x), y)
        got.backward()
        step()
        close(got.item(), want.item(), f"loss at step {i}")
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q, p, f"{name} after {STEPS} steps")
    # forward, backward and the optimizer's step: captured once each at the third step, replayed after;
    # copied in: the batch and the loss's gradient; the backward reads the activations where the forward's
    # replay left them, the optimizer the gradients where the backward's did, and both the weights in place
    replayed = STEPS - graphs.WARMUP_CALLS
    assert graphs.COUNTS == {"captures": 3, "replays": 3 * replayed, "unrecorded": 0, "inputs_copied": 2 * replayed}


def test_losses_kept_across_steps_are_not_overwritten_by_later_replays():
    eager, tfsn = pair()
    opt_e, opt_t, model, step = trainers(eager, tfsn)
    kept_e, kept_t = [], []
    for x, y in batches(STEPS):
        for m, opt, kept, s in ((eager, opt_e, kept_e, opt_e.step), (model, opt_t, kept_t, step)):
            opt.zero_grad()
            logits = m(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            s()
            kept.append((loss.detach(), logits.detach()))
    for i, ((le, oe), (lt, ot)) in enumerate(zip(kept_e, kept_t)):
        close(lt, le, f"loss kept from step {i}")
        close(ot, oe, f"logits kept from step {i}")
    assert graphs.COUNTS["replays"] >= 2 * (STEPS - graphs.WARMUP_CALLS) - 2, graphs.COUNTS


def test_gradients_accumulated_over_micro_batches_without_zero_grad():
    """SGD with momentum, not AdamW: Adam divides each element's step by that element's own gradient, so
    where an accumulated gradient is near zero it turns summation-order noise into steps (on an AMD EPYC,
    whose BLAS sums in another order, one weight of 2,304 ended 5e-5 from eager's after 6 AdamW steps,
    with or without this module). The accumulation is what this test is about; AdamW's replayed step is
    test_a_training_loop_is_replayed_from_its_third_step_and_matches_eager's."""
    eager, tfsn = pair()
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_t = torch.optim.SGD(tfsn.parameters(), lr=0.1, momentum=0.9)
    model, step = torch.compile(tfsn, backend=backend("c")), torch.compile(opt_t.step, backend=backend("c"))
    data = batches(3 * STEPS)
    for i in range(STEPS):
        for m, opt, s in ((eager, opt_e, opt_e.step), (model, opt_t, step)):
            for x, y in data[3 * i: 3 * i + 3]:
                (F.cross_entropy(m(x), y) / 3).backward()
            s()
            opt.zero_grad(set_to_none=i % 2 == 0)      # both ways: None, and zeros written in place
    for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
        close(q, p, f"{name} after {STEPS} accumulated steps")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


def test_two_forwards_before_one_backward():
    """The second forward's replay would write over the activations the first saved for the backward."""
    eager, tfsn = pair()
    model = torch.compile(tfsn, backend=backend())
    for i, ((x1, _), (x2, _)) in enumerate(zip(batches(STEPS), batches(STEPS, (3, 7, 24))[::-1])):
        for m in (eager, model):
            m.zero_grad()
            (m(x1).square().sum() - m(x2).sum()).backward()
        for (name, p), q in zip(eager.named_parameters(), tfsn.parameters()):
            close(q.grad, p.grad, f"grad of {name} at step {i}")


def test_a_parameter_given_new_storage_is_read_from_there():
    """`p.data = ...` moves a borrowed input: the replay must not read the old address."""
    eager, tfsn = pair()
    model = torch.compile(tfsn, backend=backend())
    for i, (x, _) in enumerate(batches(STEPS)):
        if i == 4:
            for m in (eager, tfsn):
                m.head.weight.data = torch.full_like(m.head.weight, 0.01) + m.head.weight
        with torch.no_grad():
            close(model(x), eager(x), f"output at step {i}")
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS


class Scaled(nn.Module):
    """A forward that writes over its input (kept in the graph as an in-place write) and a BatchNorm,
    whose running statistics it writes too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(24, 24), nn.BatchNorm1d(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return self.bn(self.lin(x))


def test_inputs_the_graph_writes_reach_the_caller():
    eager, tfsn = pair(Scaled)
    model = torch.compile(tfsn, backend=backend())
    for i, (x, _) in enumerate(batches(STEPS)):
        xe, xt = x.clone(), x.clone()
        with torch.no_grad():
            close(model(xt), eager(xe), f"output at step {i}")
        close(xt, xe, f"the input written over at step {i}")
        close(tfsn.bn.running_mean, eager.bn.running_mean, f"running mean at step {i}")
    assert graphs.COUNTS["replays"] >= STEPS - graphs.WARMUP_CALLS, graphs.COUNTS


@pytest.mark.skipif(DEVICE != "cpu", reason="the stand-in's failure; a GPU's own failures are its own")
def test_a_graph_whose_capture_fails_runs_unrecorded_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(graphs, "recorder_for", lambda device: Rerun(fail=True))
    eager, tfsn = pair()
    model = torch.compile(tfsn, backend=backend())
    with caplog.at_level(logging.WARNING, logger="tfsn.optimizer"):
        for i, (x, _) in enumerate(batches(STEPS)):
            with torch.no_grad():
                close(model(x), eager(x), f"output at step {i}")
    assert graphs.COUNTS["replays"] == 0 and graphs.COUNTS["captures"] == 0
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("capture failed: operation not permitted when stream is capturing" in m for m in said), said


def test_cuda_graphs_can_be_turned_off():
    eager, tfsn = pair()
    off = make_backend(cuda_graphs=False, **({} if DEVICE == "cuda" else {"schedule": DEFAULT}))
    model = torch.compile(tfsn, backend=off)
    for x, _ in batches(4):
        with torch.no_grad():
            close(model(x), eager(x), "output")
    assert not any(graphs.COUNTS.values()), graphs.COUNTS
    with pytest.raises(ValueError, match="cuda_graphs must be True or False"):
        make_backend(cuda_graphs="no")


def test_a_graph_on_a_gpu_gets_triton_kernels_by_default():
    """tfsn.optimize(model) on a GPU: C kernels run on the host and would leave every CUDA op to ATen."""
    from optimizer.backend import default_codegen
    assert default_codegen([torch.empty(2, device="meta"), torch.empty(2)]) == "triton"
    assert default_codegen([torch.empty(2), 3]) == "c"
    if DEVICE == "cuda":
        from optimizer import backend as b
        kernels = b.STATS["kernels"]
        eager, tfsn = pair()
        x, _ = batches(1)[0]
        close(torch.compile(tfsn, backend=make_backend())(x), eager(x), "output")
        assert b.STATS["kernels"] > kernels


def test_a_copied_input_keeps_its_alignment_and_values():
    """A moving input's buffer: same layout and values, and its data pointer as far from a 16-byte boundary
    as the input's (Triton specializes a kernel on that; a capture must not compile a new one)."""
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        base = torch.arange(40).to(dtype)
        for x in (base[1:31].view(5, 6)[:, 1:], base[3:27].view(4, 6).t(), base[8:]):
            buf = graphs._buffer_like(x)
            assert buf.stride() == x.stride() and torch.equal(buf, x)
            assert buf.data_ptr() % 16 == x.data_ptr() % 16 and buf.data_ptr() != x.data_ptr()


def cuda_data_ptrs_equal(tensors: list, data_ptrs: list, indices: list) -> bool:
    """torch._C._tensors_data_ptrs_at_indices_equal as CUDA builds have it (C++, pybind11 lists): each indexed
    element cast to a tensor and its recorded address to an int64, a failed cast a RuntimeError."""
    assert all(type(a) is list for a in (tensors, data_ptrs, indices))
    for i in indices:
        if not isinstance(tensors[i], torch.Tensor) or type(data_ptrs[i]) is not int:
            raise RuntimeError(f"Unable to cast Python instance of type {type(tensors[i])} to C++ type 'at::Tensor'")
        if tensors[i].data_ptr() != data_ptrs[i]:
            return False
    return True


CHECKS = [None, graphs._DATA_PTRS_EQUAL or cuda_data_ptrs_equal]     # the C++ helper itself where torch has it


@pytest.mark.parametrize("check", CHECKS, ids=["python", "cuda-build"])
def test_a_replay_reads_each_calls_inputs_after_a_tensor_moves_or_a_value_changes(monkeypatch, check):
    """What every replay checks first, in one pass over the inputs (an optimizer step's graph takes hundreds): a
    borrowed tensor found at another address is read from there (copied into the graph's buffer from then on),
    and a value input that changes stops the recording. Each call's result is the graph's on that call's inputs."""
    monkeypatch.setattr(graphs, "_DATA_PTRS_EQUAL", check)

    def run(args):
        x, w, k = args
        return [x * w + k]
    replay = graphs.GraphReplay(run, DEVICE, [], graphs.recorder_for(DEVICE), "x * w + k")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 5, generator=g).to(DEVICE)
    calls = [(w, 3)] * 4 + [(w.clone() * 2, 3)] * 5 + [(w, 4)] * 2
    for i, (weight, k) in enumerate(calls):
        x = torch.randn(4, 5, generator=g).to(DEVICE)       # a new batch each call: copied into a buffer
        close(replay([x, weight, k])[0], x * weight + k, f"call {i}")
    assert graphs.COUNTS["captures"] == 2 and graphs.COUNTS["replays"] >= 5, graphs.COUNTS
    assert replay.off.startswith("input 2 changes value"), replay.off


@pytest.mark.parametrize("check", CHECKS, ids=["python", "cuda-build"])
def test_an_input_that_turns_from_tensor_to_value_or_back_is_read_not_replayed(monkeypatch, check):
    """The one-pass check of every replay, in this CPU's Python and as a CUDA build's C++ helper: a value where
    the capture had a tensor, or a tensor (of one element or many) where it had a value, is what this call
    computes with, and no error: the graph's own result on this call's inputs."""
    monkeypatch.setattr(graphs, "_DATA_PTRS_EQUAL", check)

    def run(args):
        return [args[0] * 2 + args[1]]

    x = torch.arange(3.0).to(DEVICE)
    for first, then in [(3, torch.full((3,), 5.0)), (3, torch.tensor(3.0)), (torch.ones(3), 2.0)]:
        replay = graphs.GraphReplay(run, DEVICE, [], graphs.recorder_for(DEVICE), "x * 2 + k")
        first = first.to(DEVICE) if isinstance(first, torch.Tensor) else first
        then = then.to(DEVICE) if isinstance(then, torch.Tensor) else then
        for i, k in enumerate([first] * 4 + [then] * 4):
            close(replay([x, k])[0], x * 2 + k, f"call {i} of {first!r} then {then!r}")


def test_a_failed_capture_leaves_the_allocator_capturing_nothing(monkeypatch):
    """A capture invalidated by a synchronizing op: CUDAGraph::capture_end raises before it tells the caching
    allocator that the capture ended, so tfsn does (else every later empty_cache fails an assertion); one whose
    capture_end told it already ("not currently recording") is not ended twice, nor its pool released twice.
    The allocator's two calls are modelled here; the GPU test below runs the real ones."""
    underway, released = {(0, 7)}, []

    def end(device, pool):
        if pool not in underway:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        underway.discard(pool)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: released.append(pool), raising=False)
    graphs._end_failed_capture(0, (0, 7))
    assert not underway and released == [(0, 7)]
    graphs._end_failed_capture(0, (0, 8))
    assert released == [(0, 7)]


@pytest.mark.skipif(DEVICE != "cuda", reason="the real allocator's state after a failed CUDA graph capture")
def test_after_a_capture_a_sync_invalidated_the_gpu_empties_its_cache_and_captures_again():
    recorder = graphs.CudaRecorder(torch.device("cuda", torch.cuda.current_device()))
    x = torch.arange(4.0, device="cuda")

    def syncs(inputs):
        y = inputs[0] * 2
        y.sum().item()              # a sync: not permitted while the stream is capturing
        return [y]
    stream = torch.cuda.current_stream()
    with pytest.raises(RuntimeError):
        recorder.capture(syncs, [x])
    assert torch.cuda.current_stream() == stream
    torch.cuda.empty_cache()        # "captures_underway.empty() INTERNAL ASSERT FAILED" without _end_failed_capture
    outputs, replay = recorder.capture(lambda inputs: [inputs[0] * 3], [x])
    replay([x])
    torch.cuda.synchronize()
    assert torch.equal(outputs[0], x * 3)


def shares_memory_by_enumeration(x: torch.Tensor) -> bool:
    offsets = [sum(i * s for i, s in zip(index, x.stride())) for index in itertools.product(*map(range, x.shape))]
    return len(set(offsets)) < len(offsets)


@pytest.mark.parametrize("make", [
    lambda b: b, lambda b: b[:, :-1], lambda b: b[:, 1:, ::2], lambda b: b.transpose(0, 2),
    lambda b: b[::2, :, 1:].transpose(1, 2), lambda b: b[:1, 2:], lambda b: b[:, :0],
    lambda b: b[:, :1].expand(7, 4, 5), lambda b: b.flatten()[:12].as_strided((3, 2), (1, 1)),
    lambda b: b.flatten().as_strided((2, 3), (3, 1)), lambda b: b.flatten().as_strided((2, 3), (2, 1))])
def test_self_overlap_is_found_from_strides_where_torchs_check_gives_up(make):
    """A moving input is copied into a buffer of its layout for replay: a sliced or transposed one can be (it
    was refused, torch's check answering "too hard"), one whose elements share memory cannot."""
    x = make(torch.randn(7, 9, 5))
    assert graphs._overlaps_itself(x) == shares_memory_by_enumeration(x), (x.shape, x.stride())
