"""A compiled graph replayed as one CUDA graph: its launches recorded once, then issued by one call.

Why: at the sizes researchers debug and fine-tune at, a step on a GPU is bound by launching its
kernels from Python, tens of microseconds each (the suite's steps ran at 0.44-0.60x eager on an H200
with every kernel launched one by one). A CUDA graph issues every launch of a graph, its ATen calls
included, for the price of one.

A replay reads its inputs and writes its outputs at the addresses its capture saw. How each of those
assumptions is kept, so that a replay never computes something other than the graph would:
- Inputs. A tensor input whose address did not change over the calls before the capture (a parameter,
  an optimizer's state, an activation a replayed forward saved for the backward) is read where it lives
  ("borrowed"), and so is one that is an output of another replayed graph (whose address stays while
  that graph does). Any other ("owned") is copied into a buffer of the graph's own before each replay,
  and copied back after it when the graph writes it. A borrowed input that arrives elsewhere later
  becomes owned, and the graph is captured again.
- Outputs. A replay writes over the outputs of the previous one. When one of those is still held (a
  loss kept for logging, two forwards before one backward, gradients accumulated without zero_grad),
  that call runs unrecorded, that output is returned as a copy from then on, and the graph is captured
  again (its earlier outputs stay with whoever holds them).
- Host. A graph with an input off its device, called under inference mode, or whose capture fails (an
  op that synchronizes with the host) runs unrecorded, as it would without this module. So does one
  captured MAX_CAPTURES times already.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Protocol, Sequence

import torch

log = logging.getLogger("tfsn.optimizer")

WARMUP_CALLS = 2        # unrecorded calls before the capture: Triton and cuBLAS set up, addresses seen twice
MAX_CAPTURES = 4        # a graph whose inputs keep moving or whose outputs keep being held runs unrecorded

# What this process's graphs did: captures, calls replayed, calls run unrecorded once recording was tried, and
# inputs copied into a graph's own buffers.
COUNTS = {"captures": 0, "replays": 0, "unrecorded": 0, "inputs_copied": 0}

# Storages (by address) that replayed graphs write their outputs to: fixed while their graph is kept.
REPLAYED: set[int] = set()

Run = Callable[[list], list]            # AOTAutograd's boxed convention: the list of inputs, cleared
Replay = Callable[[list], None]


class Recorder(Protocol):
    """Records a graph's run and replays it."""

    def capture(self, run: Run, inputs: list) -> tuple[list, Replay]:
        """`run(inputs)` recorded, not run: its outputs (where every replay writes them) and the replay,
        which is given the inputs (at the addresses recorded) each time."""


POOL_SHARE = 0.1        # a graph whose private pool would hold more of its GPU's memory is not kept
_CAPTURING = threading.Lock()           # one capture at a time in this process, as Inductor's
_STREAMS: dict[torch.device, Any] = {}  # the side stream each device captures on


class CudaRecorder:
    """torch.cuda.CUDAGraph on a private memory pool, captured on a side stream of tfsn's own per device.
    cuBLAS keeps a workspace per stream: it is dropped before and after the capture, so that one made
    while capturing lives in this graph's pool and no later run shares it (Inductor does the same). A
    capture that fails leaves the thread on the stream it was on, and the allocator no longer capturing
    (_end_failed_capture). A graph whose pool would hold more than POOL_SHARE of the GPU's memory is not
    kept: that memory is worth more than its launches."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def capture(self, run: Run, inputs: list) -> tuple[list, Replay]:
        with _CAPTURING, torch.cuda.device(self.device):
            stream = _STREAMS.setdefault(self.device, torch.cuda.Stream(self.device))
            before = torch.cuda.current_stream()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(self.device)
            graph = torch.cuda.CUDAGraph()
            pool = torch.cuda.graph_pool_handle()      # named here, so that a failed capture can hand it back
            torch._C._cuda_clearCublasWorkspaces()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    outputs = run(list(inputs))
            except BaseException:
                _end_failed_capture(torch.cuda.current_device(), pool)
                raise
            finally:
                torch.cuda.set_stream(before)       # torch.cuda.graph leaves it on the side stream when capture fails
                torch._C._cuda_clearCublasWorkspaces()
            grown = torch.cuda.memory_reserved(self.device) - reserved
            if grown > POOL_SHARE * torch.cuda.get_device_properties(self.device).total_memory:
                raise MemoryError(f"its memory pool would hold {grown / 2 ** 30:.1f} GiB, over {POOL_SHARE:.0%} "
                                  "of the GPU's")
        return outputs, lambda _inputs: graph.replay()


def _end_failed_capture(device: int, pool: Any) -> None:
    """After a capture that raised, the caching allocator told that it ended, and the pool given back.
    Why: CUDAGraph::capture_end tells the allocator only after cudaStreamEndCapture succeeds, which it
    does not for a capture invalidated by a synchronizing op; the allocator then stays "capturing" for
    good, and every later torch.cuda.empty_cache() (the next graph's capture, the user's own) fails its
    assertion that no capture is underway. Where capture_end got as far as telling it ("not currently
    recording"), the graph's own destruction releases the pool."""
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:
        return
    torch._C._cuda_releasePool(device, pool)


def recorder_for(device: str) -> Recorder | None:
    """The recorder of a graph's device: CUDA graphs on an NVIDIA GPU unless TFSN_CUDA_GRAPHS=0, else
    none (a CPU step has no launch to save; a ROCm build's graphs are not tested)."""
    dev = torch.device(device)
    if dev.type != "cuda" or torch.version.hip is not None or os.environ.get("TFSN_CUDA_GRAPHS", "1") == "0":
        return None
    return CudaRecorder(dev)


def _address(x: Any) -> Any:
    """Where a tensor input is read (its device is checked before any capture), or a value's self."""
    return x.data_ptr() if isinstance(x, torch.Tensor) else x


_DATA_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)   # CUDA builds only


def _buffer_like(x: torch.Tensor) -> torch.Tensor:
    """A tensor of x's layout and values whose data pointer has x's alignment to 16 bytes (so a Triton kernel
    specialized on the calls before the capture, which checks it, is not compiled again while capturing)."""
    offset = x.storage_offset() % max(1, 16 // x.element_size())
    span = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) if x.numel() else 0
    base = torch.empty(offset + span, dtype=x.dtype, device=x.device)
    return base.as_strided(x.shape, x.stride(), offset).copy_(x)


def _overlaps_itself(x: torch.Tensor) -> bool:
    """Whether two of x's elements may share memory (a stride-0 dim of an expand). torch's own check answers
    "too hard" for any non-contiguous layout, a slice such as tokens[:, :-1] among them. Here, with the dims
    of more than one element sorted by stride, each stride must pass the last element the smaller ones
    reach: never "no" for a tensor that overlaps, "yes" only for interleaved layouts such as strides (2, 3)."""
    reach = 0
    for s, n in sorted((s, n) for n, s in zip(x.shape, x.stride()) if n > 1):
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


def _uses(storage: torch.UntypedStorage) -> int:
    """How many tensors (and storage objects) hold this storage now."""
    return torch._C._storage_Use_Count(storage._cdata)


class GraphReplay:
    """A compiled graph's entry (`run`) under the rules of this module's docstring; callable as `run`."""

    def __init__(self, run: Run, device: str, written: Sequence[int], recorder: Recorder, name: str) -> None:
        """`written`: the positions of the inputs the graph writes over."""
        self._boxed_call = True
        self.run, self.device, self.written, self.recorder, self.name = run, torch.device(device), set(written), \
            recorder, name
        self.calls = self.captures = 0
        self.seen: list[Any] | None = None          # each input's address (or value) on every call so far
        self.moved: set[int] = set()                # tensor inputs seen at more than one address
        self.copied: set[int] = set()               # outputs returned as copies
        self.off = ""                               # why this graph runs unrecorded from now on
        self.lock = threading.Lock()                # one call at a time: threads share the buffers and outputs
        self._drop()

    def __del__(self) -> None:
        self._drop()

    def _drop(self) -> None:
        """Forget the capture: its pool is freed once nothing holds its outputs."""
        for storage, _, _ in getattr(self, "watched", []):
            REPLAYED.discard(storage.data_ptr())
        self.replay: Replay | None = None
        self.buffers: dict[int, torch.Tensor] = {}      # owned input -> the buffer the graph reads
        self.addresses: list[Any] = []                  # each input's address (or value) at the capture
        self.borrowed: list[int] = []                   # the tensor inputs read where they live
        self.borrowed_at: list[int] = []                # and their addresses
        self.values: list[tuple[int, Any]] = []         # the inputs that are values, with their value
        self.outputs: list = []
        self.watched: list[tuple[torch.UntypedStorage, int, list[int]]] = []   # (storage, uses when free, outputs)

    def _stop(self, why: str, level: int = logging.INFO) -> None:
        self.off = why
        self._drop()
        log.log(level, "tfsn: %s runs unrecorded (no CUDA graph): %s", self.name, why)

    def __call__(self, args: list) -> list:
        if self.off:
            return self.run(args)
        with self.lock:         # another thread's call sees this one's outputs held once it has them
            return self._call(args)

    def _call(self, args: list) -> list:
        inputs = list(args)
        args.clear()
        if torch.is_inference_mode_enabled():
            self._stop("called under inference mode")
            return self.run(inputs)
        if self.replay is None:
            why = self._observe(inputs)
            if why:
                self._stop(why)
                return self.run(inputs)
            if self.calls <= WARMUP_CALLS:
                return self.run(inputs)
            return self._capture(inputs)
        if self._held() or self._moved(inputs):
            if self.captures >= MAX_CAPTURES:
                self._stop(f"captured {self.captures} times: its inputs keep moving or its outputs are kept")
            else:
                self._drop()            # the next call captures again, with what was learned
            COUNTS["unrecorded"] += 1
            return self.run(inputs)
        return self._replay(inputs)

    def _observe(self, inputs: list) -> str:
        """Notes where each input is on a call before the capture; why the graph cannot be recorded, or ''."""
        self.calls += 1
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and x.device != self.device:
                return f"input {i} is on {x.device}, not {self.device}"
        now = [_address(x) for x in inputs]
        if self.seen is not None:
            for i, (a, b) in enumerate(zip(self.seen, now)):
                if a != b:
                    if not isinstance(inputs[i], torch.Tensor):
                        return f"input {i} changes value between calls ({a!r}, {b!r})"
                    self.moved.add(i)
        self.seen = now
        return ""

    def _capture(self, inputs: list) -> list:
        owned = {i for i in self.moved if inputs[i].untyped_storage().data_ptr() not in REPLAYED}
        for i in owned:
            x = inputs[i]
            if _overlaps_itself(x):
                self._stop(f"input {i} moves between calls and overlaps itself (strides {x.stride()})")
                return self.run(inputs)
        # filled with this call's values: a capture that runs its ops (a recorder without a GPU's) must not read
        # garbage, which indices (labels, token ids) turn into errors; on a GPU one copy per capture
        self.buffers = {i: _buffer_like(inputs[i]) for i in owned}
        static = [self.buffers.get(i, x) for i, x in enumerate(inputs)]
        try:
            outputs, replay = self.recorder.capture(self.run, static)
        except Exception as e:          # an op that synchronizes, a library that cannot be captured
            self._stop(f"its capture failed: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}",
                       logging.WARNING)       # what a slow step on a GPU is then explained by
            return self.run(inputs)
        self.captures += 1
        COUNTS["captures"] += 1
        self.replay, self.outputs = replay, outputs
        self.addresses = [_address(x) for x in static]
        self.borrowed = [i for i, x in enumerate(static) if isinstance(x, torch.Tensor) and i not in self.buffers]
        self.borrowed_at = [self.addresses[i] for i in self.borrowed]
        self.values = [(i, x) for i, x in enumerate(static) if not isinstance(x, torch.Tensor)]
        borrowed = {x.untyped_storage().data_ptr() for i, x in enumerate(inputs)
                    if isinstance(x, torch.Tensor) and i not in self.buffers}
        by_storage: dict[int, tuple[torch.UntypedStorage, list[int]]] = {}
        for j, o in enumerate(outputs):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in borrowed:
                storage = o.untyped_storage()
                by_storage.setdefault(storage.data_ptr(), (storage, []))[1].append(j)
        del static
        self.watched = [(storage, _uses(storage), js) for storage, js in by_storage.values()]
        REPLAYED.update(by_storage)
        log.debug("tfsn: %s captured (%d owned inputs, %d outputs watched)", self.name, len(self.buffers),
                  len(self.watched))
        return self._replay(inputs)

    def _held(self) -> bool:
        """Whether an output of the last replay is still held outside; its outputs are copies from now on."""
        held = False
        for storage, free, js in self.watched:
            if _uses(storage) > free:
                self.copied.update(js)
                held = True
        return held

    def _borrowed_in_place(self, inputs: list) -> bool:
        """Whether every borrowed input is at its capture's address: in C++ where this torch has it (CUDA builds:
        Inductor's CUDA graphs check their static inputs with it), else in Python."""
        try:
            if _DATA_PTRS_EQUAL is not None:
                return _DATA_PTRS_EQUAL(inputs, self.addresses, self.borrowed)
            return [inputs[i].data_ptr() for i in self.borrowed] == self.borrowed_at
        except (AttributeError, RuntimeError):      # a value where the capture had a tensor: _moved's loop stops
            return False                            # the graph

    def _moved(self, inputs: list) -> bool:
        """Whether a borrowed input arrived at another address than its capture's (it is owned from now on).
        Checked on every call, so first in one pass (a step's optimizer graph takes hundreds of tensors); a value
        input is compared as the loop below compares it, by _address (a tensor arriving there equals no value)."""
        if self._borrowed_in_place(inputs) and all(_address(inputs[i]) == v for i, v in self.values):
            return False
        moved = False
        for i, (x, a) in enumerate(zip(inputs, self.addresses)):
            if i not in self.buffers and _address(x) != a:
                if not isinstance(x, torch.Tensor):
                    self._stop(f"input {i} changes value between calls ({a!r}, {x!r})")
                    return True
                self.moved.add(i)
                moved = True
        return moved

    def _replay(self, inputs: list) -> list:
        static = inputs
        if self.buffers:        # copied in one launch on a GPU, not one each
            torch._foreach_copy_(list(self.buffers.values()), [inputs[i] for i in self.buffers])
            static = list(inputs)
            for i, buffer in self.buffers.items():
                static[i] = buffer
        self.replay(static)
        COUNTS["replays"] += 1
        COUNTS["inputs_copied"] += len(self.buffers)
        for i in self.written & self.buffers.keys():
            inputs[i].copy_(self.buffers[i])
        return [(o.clone() if j in self.copied else o.detach()) if isinstance(o, torch.Tensor) else o
                for j, o in enumerate(self.outputs)]
