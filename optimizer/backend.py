"""The `tfsn` torch.compile backend: AOTAutograd captures forward and backward of the step as
core-ATen graphs; each graph is lowered to the IR, fused, generated as C, compiled and run.

    model = torch.compile(model, backend="tfsn")      # through the entry point
    model = optimizer.backend.optimize(model)          # the same, with options (tfsn.optimize)
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import os
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from optimizer import layout, patches, pooling
from optimizer.schedule import Schedule

if TYPE_CHECKING:
    from optimizer.fusion import Plan
    from optimizer.loopnest import Group
    from optimizer.search import Tie

log = logging.getLogger("tfsn.optimizer")
aten = torch.ops.aten

# What this process compiled: graphs lowered to kernels, generated kernels (of which generated attention
# calls, forward or backward, in place of ATen's), graphs left to ATen, searches run.
STATS = {"graphs": 0, "kernels": 0, "attention_kernels": 0, "aten_graphs": 0, "searches": 0}

OPTIONS = {"schedule": "one Schedule for every kernel, with the heuristic fusion plan: no search",
           "fuse": "False runs the captured ATen graphs as they are, without generated kernels",
           "top_k": "schedules per kernel compiled and timed by the search (default $TFSN_TOP_K, else 8 on "
                    "a CPU and 4 on a GPU); "
                    "1 keeps the cost model's pick untimed",
           "report": "a list the search appends each graph's (ir.Graph, search.SearchResult) to",
           "codegen": "'c' (C/OpenMP, searched) or 'triton' (Triton kernels launched on the tensors' device: on a "
                      "GPU tfsn has a spec of, the GPU cost model's plan and launch shapes timed there; else the "
                      "heuristic plan under `schedule`; TRITON_INTERPRET=1 runs them on a CPU); default: Triton "
                      "for a graph on a GPU, C for one on the CPU",
           "cuda_graphs": "False launches a GPU graph's kernels one by one (default: each graph is replayed as one "
                          "CUDA graph after two calls, optimizer/graphs.py; also TFSN_CUDA_GRAPHS=0)",
           "on_plan": "called with each searched graph's expected seconds (search.SearchResult.expected_s) and "
                      "whether it was searched now (False: read from the search cache), and the name of its search "
                      "cache entry; what `tfsn plan` prices this machine's step from (and ships to cloud nodes)"}

# Decomposed further than core ATen, so that the generator sees their pointwise and reduction
# parts (LayerNorm, softmax, GELU, BatchNorm, the optimizers' addcmul/lerp) and can fuse them.
EXTRA_DECOMPOSITIONS = [
    aten.native_layer_norm, aten.native_layer_norm_backward, aten._softmax, aten._softmax_backward_data,
    aten._log_softmax, aten._log_softmax_backward_data, aten.gelu, aten.gelu_backward, aten.silu,
    aten.silu_backward, aten.addcmul, aten.addcdiv, aten.lerp,
    aten._native_batch_norm_legit_functional, aten.native_batch_norm_backward, aten.sigmoid_backward,
    aten.tanh_backward, aten.tril, aten.triu, aten.linalg_vector_norm, aten.native_group_norm,
    # activations core ATen keeps whole (MobileNet's relu6 is hardtanh, GANs' leaky_relu, SELU's elu), and
    # clamp by tensor bounds: each was an ATen call between two kernels, a round trip through memory
    aten.hardtanh, aten.leaky_relu, aten.elu, aten.clamp.Tensor,
]


# Kept as ATen calls although core ATen decomposes them. torch's decomposition of CPU flash attention
# returns the attention probabilities where the op returns the log-sum-exp, and the backward that
# autograd records is the flash backward, which reads that log-sum-exp: a decomposed forward with
# an ATen backward gives wrong gradients upstream of every F.scaled_dot_product_attention (Inductor
# excludes this decomposition for the same reason). Forward and backward stay one consistent pair.
KEPT_WHOLE = [aten._scaled_dot_product_flash_attention_for_cpu.default]


def _var_mean(x: torch.Tensor, dim=None, *, correction=None, keepdim: bool = False):
    """var_mean as two row reductions in ATen ops (torch's own goes to prims the generator skips)."""
    # dim=[] reduces over every dim, as sum's does (an empty list counted 1 element and squeezed none)
    dims = list(range(x.dim())) if not dim else [d % max(x.dim(), 1) for d in dim]
    n = 1
    for d in dims:
        n *= x.shape[d]
    mean = aten.sum.dim_IntList(x, dims, True) / n
    centered = x - mean
    var = aten.sum.dim_IntList(centered * centered, dims, True) / max(n - (1 if correction is None else correction), 0)
    if not keepdim:
        mean, var = aten.squeeze.dims(mean, dims), aten.squeeze.dims(var, dims)
    return var, mean


def _var(x: torch.Tensor, dim=None, *, correction=None, keepdim: bool = False):
    return _var_mean(x, dim, correction=correction, keepdim=keepdim)[0]


def _weight_norm_backward(grad_w: torch.Tensor, v: torch.Tensor, g: torch.Tensor, norm: torch.Tensor, dim: int):
    """weight_norm's gradients (ATen's formula, in fp32 for fp16/bf16 as its kernels sum), for any dtype of
    `norm`. Why: core ATen's forward decomposition returns fp16 norms for fp16 weights, which ATen's CPU
    backward refuses (it wants the fp32 norms its own forward returns): every fp16 weight_norm step failed."""
    acc = torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype
    grad_w, v32, g32, norm = (t.to(acc) for t in (grad_w, v, g, norm))
    sums = aten.sum.dim_IntList(grad_w * v32, [d for d in range(v.dim()) if d != dim % v.dim()], True)
    grad_v = g32 / norm * (grad_w - v32 * (sums / (norm * norm)))
    return grad_v.to(v.dtype), (sums / norm).to(g.dtype)


# torch.optim's foreach updates (foreach=True: the default for CUDA parameters) and other elementwise `_foreach_*`
# ops, per tensor. Left whole, each is one ATen call over every parameter and each result is copied back over its
# parameter or state by one more ATen call (AdamW on 12 parameters: 19 foreach calls and 48 copy_, no generated
# kernel). Per tensor, a parameter's whole update fuses into one generated kernel that writes parameter and state
# in place, as the single-tensor updates (the CPU's default) already do. Core ATen has no decomposition of these.
FOREACH_ELEMENTWISE = ("abs", "add", "addcdiv", "addcmul", "ceil", "clamp_max", "clamp_min", "copy", "cos", "div",
                       "erf", "exp", "expm1", "floor", "lerp", "log", "log1p", "log2", "maximum", "minimum", "mul",
                       "neg", "pow", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin", "sqrt", "sub", "tanh",
                       "trunc")
# overloads with no per-tensor twin of the same arguments: a tensor of per-list scalars
FOREACH_KEPT = {("addcdiv", "Tensor"), ("addcmul", "Tensor")}
# overloads whose per-tensor twin has another name: maximum/minimum take a tensor, clamp a scalar (both keep NaN)
FOREACH_TWIN = {("maximum", "Scalar"): aten.clamp_min, ("maximum", "ScalarList"): aten.clamp_min,
                ("minimum", "Scalar"): aten.clamp_max, ("minimum", "ScalarList"): aten.clamp_max}


def _per_tensor(op: Any, *args: Any, **kwargs: Any) -> list:
    """A foreach op as `op` on each position of its lists (Tensor[] and Scalar[] arguments alike)."""
    if op in (aten.addcmul, aten.addcdiv) and len(args) == 4:     # the foreach form takes `value` positionally
        *args, kwargs["value"] = args
    n = len(next(a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))))

    def at(i: int, a: Any) -> Any:
        return a[i] if isinstance(a, (list, tuple)) else a
    return [op(*(at(i, a) for a in args), **{k: at(i, v) for k, v in kwargs.items()}) for i in range(n)]


def foreach_decompositions() -> dict:
    """Every functional overload of the FOREACH_ELEMENTWISE ops, as its per-tensor op (`_per_tensor`)."""
    table = {}
    for name in FOREACH_ELEMENTWISE:
        packet = getattr(aten, f"_foreach_{name}")
        for overload in packet.overloads():
            if not overload.endswith("out") and (name, overload) not in FOREACH_KEPT:
                twin = FOREACH_TWIN.get((name, overload), getattr(aten, name))
                table[getattr(packet, overload)] = functools.partial(_per_tensor, twin)
    return table


def _index_add(x: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *, alpha=1) -> torch.Tensor:
    """index_add as an accumulating index_put in the op's computation dtype (fp32 for fp16/bf16), rounded
    once, as ATen's CPU index_add sums. torch's decomposition accumulates in the 16-bit dtype itself,
    rounding after every add: 600 rows of 0.1 pooled into one bf16 row (a graph's global add pool) stalled
    at 32 where eager gives 60 (57.4 in fp16); so did index_select's gradient, which autograd sums by
    index_add."""
    from torch._decomp.decompositions import index_add
    if x.dtype not in (torch.float16, torch.bfloat16):
        return index_add(x, dim, index, source, alpha=alpha)
    return index_add(x.float(), dim, index, source.float(), alpha=alpha).to(x.dtype)


def _constant_pad(x: torch.Tensor, pad: list, value: float = 0) -> torch.Tensor:
    """constant_pad_nd (F.pad's constant mode, ZeroPad2d, causal Conv1d pads, RWKV's token shift) as slices for
    its negative pads and a cat with `full` pieces for its positive ones, all of which the generator fuses. Left
    whole it was an ATen call between two kernels (a launch and a round trip through memory), and torch's own
    decomposition goes to prims.copy_to, which the generator cannot take. Like ATen, it narrows before it pads,
    fills with the value cast to x's dtype, and returns a new tensor (a clone when nothing is padded)."""
    if len(pad) % 2 or len(pad) // 2 > x.dim():
        return NotImplemented                       # ATen raises its own error
    result, padded = x, False
    for i in range(len(pad) // 2):
        dim, before, after = x.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]
        if before < 0 or after < 0:
            result = aten.narrow.default(result, dim, max(-before, 0),
                                         result.shape[dim] + min(before, 0) + min(after, 0))
        pieces = []
        for amount in (before, after):
            if amount > 0:
                shape = list(result.shape)
                shape[dim] = amount
                pieces.append(aten.full.default(shape, value, dtype=x.dtype, device=x.device))
        if pieces:
            pieces.insert(1 if before > 0 else 0, result)
            result, padded = aten.cat.default(pieces, dim), True
    return result if padded else aten.clone.default(result)     # narrowing alone is a view of x


def _repeat(x: torch.Tensor, repeats: list) -> torch.Tensor:
    """Tensor.repeat (tiling) as Inductor lowers it: x viewed with a size-1 dim before each of its dims, expanded
    to the repeats there, made contiguous and viewed as the tiled shape. The expand is an index map a kernel
    reads through (a broadcast) and the copy a pointwise kernel, which fuses with what reads the tiles; left
    whole, repeat was an ATen call between kernels. Repeats of 0 stay ATen's (an empty result)."""
    if len(repeats) < x.dim() or 0 in repeats:
        return NotImplemented                       # ATen raises its own error, or makes the empty tensor
    shape = [1] * (len(repeats) - x.dim()) + list(x.shape)
    interleaved = [n for size in shape for n in (1, size)]
    tiles = [n for r, size in zip(repeats, shape) for n in (r, size)]
    copied = aten.clone.default(aten.expand.default(aten.view.default(x, interleaved), tiles),
                                memory_format=torch.contiguous_format)
    return aten.view.default(copied, [r * size for r, size in zip(repeats, shape)])


def _roll(x: torch.Tensor, shifts: list, dims: list = ()) -> torch.Tensor:
    """torch.roll (Swin's shifted windows, a sequence shifted by some steps) as a cat of the two slices of each
    rolled dim, which the generator fuses (a cat is an index select inside the kernel). torch's decomposition
    gathers by index_select of (arange + shift) % n: three ATen calls between kernels, in the forward and in the
    backward (a roll back). Without dims, x is rolled flattened, as ATen rolls it."""
    if not dims:
        if len(shifts) != 1:
            return NotImplemented                   # ATen raises its own error
        return aten.reshape.default(_roll(aten.reshape.default(x, [-1]), shifts, [0]), list(x.shape))
    if len(shifts) != len(dims):
        return NotImplemented
    result, rolled = x, False
    for shift, dim in zip(shifts, dims):
        n = x.shape[dim]
        if n and shift % n:
            start = n - shift % n
            result = aten.cat.default([aten.slice.Tensor(result, dim, start, n),
                                       aten.slice.Tensor(result, dim, 0, start)], dim)
            rolled = True
    return result if rolled else aten.clone.default(x)


def _fp32_statistics(decomposed: Callable, otherwise: Callable) -> Callable:
    """A norm's forward (its output, then the statistics its backward reads) on a 16-bit input whose weights or
    running stats are fp32 (BatchNorm, GroupNorm, InstanceNorm, LayerNorm under autocast) as ATen's mixed-type CPU
    kernels compute it: `decomposed` on the input in fp32, the statistics kept in fp32, the output rounded once.
    torch's decompositions (and the ops' meta functions) round the statistics to the input's dtype on a CPU, and
    the backward read them so: a bf16 BatchNorm's weight gradient was off eager's by 0.012 in 5.4, its input's by
    1/64. Any other input is `otherwise`'s."""
    def norm(x: torch.Tensor, *args: Any) -> Any:
        if x.dtype not in (torch.bfloat16, torch.float16) or \
                not any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in args):
            return otherwise(x, *args)
        out, *saved = decomposed(aten._to_copy.default(x, dtype=torch.float32), *args)
        return (aten._to_copy.default(out, dtype=x.dtype), *saved)
    return norm


def _fp32_parameter_gradients(decomposed: Callable) -> Callable:
    """native_batch_norm_backward as ATen's mixed-type CPU kernel computes it for a 16-bit input with no weight but
    fp32 statistics (a bias alone, or none): the bias's gradient in fp32, the statistics' dtype. torch's
    decomposition takes a missing weight for the input's dtype and rounded it to bf16 (0.02 off eager's in 4.5).
    A weight of ones (the same values: the input's gradient is multiplied by 1) gives the decomposition the dtype."""
    def backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, *rest: Any) -> Any:
        statistics = [t for t in rest[:4] if isinstance(t, torch.Tensor)]
        if weight is None and x.dtype in (torch.bfloat16, torch.float16) and \
                any(t.dtype == torch.float32 for t in statistics):
            weight = aten.full.default([x.shape[1]], 1.0, dtype=torch.float32, device=x.device)
        return decomposed(grad, x, weight, *rest)
    return backward


def _kept(*args: Any) -> Any:
    """A decomposition's answer for an op it leaves to ATen."""
    return NotImplemented


def _nll_loss_backward(grad_output: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                       reduction: int, ignore_index: int, total_weight: torch.Tensor) -> torch.Tensor:
    """nll_loss's gradient (cross-entropy's, and nll_loss2d's over pixels) as ATen's kernel computes it:
    -weight[t] * grad (divided by the total weight for a mean) at each row's target t, 0 elsewhere and on rows
    of ignore_index; as a where over the class positions, which fuses with log_softmax's backward. torch's
    decomposition scatters -1 at the targets into zeros: a zeros kernel and an ATen scatter over the whole
    [rows, classes] tensor (a language model's logits), read again by the softmax's backward. The targets
    are in range: the forward's gather (an ATen call, which checks them) read them."""
    channel = 0 if x.dim() < 2 else 1
    if x.dim() == 1 and target.dim() > 0:           # no batch dim: ATen reads target[0] only
        target = aten.select.int(target, 0, 0)
    target = aten.unsqueeze.default(target, channel)
    kept = aten.ne.Scalar(target, ignore_index)
    grad = aten.div.Tensor(grad_output, total_weight) if reduction == 1 else grad_output    # 1: Reduction.MEAN
    if x.dim() > grad.dim() > 0:
        grad = aten.unsqueeze.default(grad, channel)
    along = [1] * x.dim()
    along[channel] = x.shape[channel]
    if weight is not None:
        grad = aten.mul.Tensor(grad, aten.view.default(weight, along))
    positions = aten.view.default(aten.arange.default(x.shape[channel], dtype=target.dtype, device=x.device), along)
    at_target = aten.logical_and.default(aten.eq.Tensor(positions, target), kept)
    zero = aten.full.default([], 0, dtype=x.dtype, device=x.device)
    return aten.where.self(at_target, aten.neg.default(grad), zero)


def _efficient_zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None) -> torch.Tensor:
    """aten._efficientzerotensor as a dense zeros. Autograd formulas make it for a gradient known to be zero
    (torch.func's jacrev/hessian of a function of parameters and inputs: the mm backward of a weight with
    no tangent); the ZeroTensor it returns has no data (data_ptr 0), which only ATen's ZeroTensor dispatch
    knows: a generated kernel or GEMM reading it as an extern's output dereferenced null and segfaulted."""
    return aten.full.default(size, 0, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)


def _neg_copy(x: torch.Tensor) -> torch.Tensor:
    """aten._neg_view as a negated copy. `z.conj().imag` traces to view_as_real, _neg_view, select: the view
    only sets a lazy negation bit on the same memory, which an extern's result keeps and a kernel reading the
    memory ignored (the imaginary parts of a conjugate came out with their sign flipped)."""
    return aten.neg.default(x)


def _conj_copy(x: torch.Tensor | complex) -> Any:
    """aten._conj as a conjugated copy (conj_physical): the view only sets a lazy conjugation bit, which the
    memory a kernel reads does not hold (the pair of _neg_view). A Python number is left to the trace as
    aten._conj (NotImplemented): the backward of `1j * t` conjugates the scalar, which the trace holds as a
    number, and conj_physical takes only tensors; ATen's _conj of it is a complex 0-d tensor, which only
    externs read (kernels take no complex dtype)."""
    if not isinstance(x, torch.Tensor):
        return NotImplemented
    return aten.conj_physical.default(x)


def _multilabel_margin_loss_forward(x: torch.Tensor, target: torch.Tensor, reduction: int) -> tuple:
    """multilabel_margin_loss as ATen computes it: for each sample, the target slots before the first -1 each
    add sum over non-target classes c of max(0, 1 - x[target] + x[c]) / C. torch's decomposition (run at the
    Autograd key while AOTAutograd traces) gathered class 0 for every slot after the first -1 and summed those
    slots too: a target row [1, -1, 0, 0] was counted as [1, 0, 0, 0] (F.multilabel_margin_loss 1.33 where eager
    gives 0.47, and the matching wrong gradient). Also gives a 1-d input's per-sample loss ATen's 0-d shape."""
    x2, target2 = torch.atleast_2d(x), torch.atleast_2d(target)
    classes = torch.arange(x2.shape[1], device=x.device)
    end = torch.amin(torch.where(target2 == -1, classes, x2.shape[1]), dim=-1, keepdim=True)
    slot = classes < end                                                    # (N, slots): slot j holds a target
    gathered = torch.gather(x2, -1, torch.where(slot, target2, 0))          # x at each slot's target
    is_target = torch.any(classes == torch.where(slot, target2, -1).unsqueeze(-1), dim=1)      # (N, C)
    hinge = torch.clamp_min(1.0 - gathered.unsqueeze(-1) + x2.unsqueeze(1), 0) / x2.shape[1]  # (N, slots, C)
    hinge = torch.where(slot.unsqueeze(-1) & ~is_target.unsqueeze(1), hinge, 0)
    per_sample = hinge.sum(dim=(1, 2))
    if reduction == 1:                                                      # torch's Reduction: 0 none, 1 mean
        loss = per_sample.mean()
    elif reduction == 2:
        loss = per_sample.sum()
    else:
        loss = per_sample.reshape(x.shape[:-1])
    return loss, is_target.to(x.dtype).reshape(target.shape)


# torch decompositions registered at the Autograd key (py_impl(DispatchKey.Autograd)): while AOTAutograd traces,
# they replace the op before autograd and before the decomposition table is read, so a wrong one is corrected by
# swapping that kernel for the trace (`corrected_autograd_decompositions`) and in the table.
AUTOGRAD_KEY_CORRECTIONS = {aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward}


@contextlib.contextmanager
def corrected_autograd_decompositions():
    """AUTOGRAD_KEY_CORRECTIONS' kernels at the Autograd key while in the block (a trace), torch's after."""
    from torch._C import DispatchKey
    saved = {op: op.py_kernels.get(DispatchKey.Autograd) for op in AUTOGRAD_KEY_CORRECTIONS}
    for op, corrected in AUTOGRAD_KEY_CORRECTIONS.items():
        op.py_kernels[DispatchKey.Autograd] = corrected
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in saved.items():
            if kernel is None:
                op.py_kernels.pop(DispatchKey.Autograd, None)
            else:
                op.py_kernels[DispatchKey.Autograd] = kernel
            op._dispatch_cache.clear()


def traced_with_corrections(trace: Callable) -> Callable:
    """An AOTAutograd backend `trace` that traces under corrected_autograd_decompositions."""
    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        with corrected_autograd_decompositions():
            return trace(gm, example_inputs)
    return backend


@functools.lru_cache(maxsize=None)
def decompositions() -> dict:
    from torch._decomp import core_aten_decompositions, get_decompositions
    table = dict(core_aten_decompositions())
    for op in KEPT_WHOLE:
        table.pop(op, None)
    table.update(get_decompositions(EXTRA_DECOMPOSITIONS))
    table.update(pooling.DECOMPOSITIONS)
    table.update(patches.DECOMPOSITIONS)
    table[aten.var_mean.correction] = _var_mean
    table[aten.var.correction] = _var
    table[aten._weight_norm_interface_backward.default] = _weight_norm_backward
    table[aten._efficientzerotensor.default] = _efficient_zeros
    table[aten._neg_view.default] = _neg_copy
    table[aten._conj.default] = _conj_copy
    table[aten.index_add.default] = _index_add
    table[aten.constant_pad_nd.default] = _constant_pad
    table[aten.repeat.default] = _repeat
    table[aten.roll.default] = _roll
    for op in (aten._native_batch_norm_legit_functional.default, aten.native_group_norm.default,
               aten.native_layer_norm.default):
        table[op] = _fp32_statistics(table[op], table[op])
    # BatchNorm without running stats (InstanceNorm's): an ATen call, but for the mixed case
    no_stats = aten._native_batch_norm_legit.no_stats
    table[no_stats] = _fp32_statistics(get_decompositions([no_stats])[no_stats], _kept)
    table[aten.native_batch_norm_backward.default] = _fp32_parameter_gradients(
        table[aten.native_batch_norm_backward.default])
    table[aten.nll_loss_backward.default] = _nll_loss_backward
    table[aten.nll_loss2d_backward.default] = _nll_loss_backward
    table.update(AUTOGRAD_KEY_CORRECTIONS)
    table.update(foreach_decompositions())
    return table


def partition(joint: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any):
    """Split the joint graph into forward and backward, recomputing cheap pointwise values in the
    backward instead of saving them: the min-cut partitioner under the cost rules of a fusing
    compiler, since our kernels recompute such values inside loops that run anyway."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    layout.channels_last_convolutions(joint)
    mutated = mutated_inputs(joint)
    cut = _copy(joint) if mutated else joint        # the fallback below takes the joint untagged
    recompute_constants(cut)
    pair = min_cut_rematerialization_partition(cut, joint_inputs, compiler="inductor",
                                               num_fwd_outputs=num_fwd_outputs, **kwargs)
    if not mutated or not mutated & {n.name for n in pair[1].graph.find_nodes(op="placeholder")}:
        return pair
    # The min-cut saved an input the step mutates (an EMA buffer, a codebook updated in forward) to
    # recompute from it in the backward, which runs after the update and would read the new value:
    # silently wrong gradients (torch's own min-cut does this, Inductor's too). The default partition
    # saves what eager autograd saves, and eager's version counters forbid reading a mutated input.
    log.info("tfsn: the recomputing partition reads inputs mutated by the step (%s) in the backward; saving "
             "activations instead", ", ".join(sorted(mutated)))
    return default_partition(copy_constants(joint), joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)


def constants(joint: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The forward's values computed from no input (a causal mask from ones().tril() or from arange
    comparisons, a scalar_tensor), random ops aside, in graph order. Why: saved for the backward, such
    a mask is written by a forward kernel of its own (one launch per step) and read from memory, where
    each graph can compute it inside the kernels that read it."""
    from torch._functorch.partitioners import _has_tag_is_forward
    found: set[torch.fx.Node] = set()
    for node in joint.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
                and not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags \
                and isinstance(node.meta.get("val"), torch.Tensor) and _has_tag_is_forward(node) \
                and all(i in found for i in node.all_input_nodes):
            found.add(node)
    return [n for n in joint.graph.nodes if n in found]


def recompute_constants(joint: torch.fx.GraphModule) -> None:
    """Tag the `constants` for the min-cut partitioner to recompute in the backward, never to save
    (it saved the causal mask, untagged)."""
    from torch.utils.checkpoint import CheckpointPolicy
    for node in constants(joint):
        node.meta.setdefault("recompute", CheckpointPolicy.MUST_RECOMPUTE)


def copy_constants(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`joint` with the backward reading copies of the `constants` of its own, for the default
    partition, which saves every forward value the backward reads (and takes no recompute tags on a
    graph that mutates inputs). Run after any CSE pass (_merged_repeats): that would merge them back."""
    from torch._functorch.partitioners import _has_tag_is_forward
    found = constants(joint)
    read = {n: [u for u in n.users if not _has_tag_is_forward(u) and u.op != "output"] for n in found}
    first = next((n for n in joint.graph.nodes if any(n in users for users in read.values())), None)
    if first is None:
        return joint
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    with joint.graph.inserting_before(first):
        for node in found:                          # graph order: a node's inputs are copied before it
            copies[node] = joint.graph.node_copy(node, lambda i: copies[i])
            copies[node].meta = {k: v for k, v in node.meta.items() if k != "partitioner_tag"}
    for node, users in read.items():
        for u in users:
            u.replace_input_with(node, copies[node])
    for copy in reversed(copies.values()):          # the copies the backward does not read
        if not copy.users:
            joint.graph.erase_node(copy)
    joint.recompile()
    return joint


def mutated_inputs(joint: torch.fx.GraphModule) -> set[str]:
    """Names of the joint graph's nodes that alias an input the graph writes (copy_ into a placeholder):
    the placeholder and every view of it, what a backward must not read once the forward has run."""
    written = _written_placeholders(joint)
    names = set()
    for node in joint.graph.nodes:
        base = node.args[0] if node.op == "call_function" and node.args else None
        if node in written or (isinstance(base, torch.fx.Node) and base.name in names
                               and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view):
            names.add(node.name)
    return names


PARTITION_PLANS = 8     # fusion plans per graph priced for the recompute-vs-store decision

# The planning memos (ir.Graph.memo: the nests loopnest.lower lowered) of the latest graphs planned, by content. Why:
# the recompute-vs-store decision (searched_partition) plans the forward and backward that compile_graph then
# searches in full, each from its own ir.Graph; sharing the memo spares the second the lowerings of the first.
_PLANNING_MEMOS: collections.OrderedDict[str, dict] = collections.OrderedDict()
PLANNING_MEMOS_KEPT = 4     # the decision's two pairs (forward and backward each)


def planning_graph(gm: torch.fx.GraphModule, device: str = "cpu"):
    """ir.from_fx(gm, device, half=True), with the planning memo of the latest graph of the same content and
    device where one of the last PLANNING_MEMOS_KEPT had it (its answers depend on nothing else)."""
    from optimizer import ir
    graph = ir.from_fx(gm, device, half=True)
    key = graph_signature(graph) + "|" + device
    graph.memo = _PLANNING_MEMOS.pop(key, graph.memo)
    _PLANNING_MEMOS[key] = graph.memo
    while len(_PLANNING_MEMOS) > PLANNING_MEMOS_KEPT:
        _PLANNING_MEMOS.popitem(last=False)
    return graph


def searched_partition(spec=None) -> Callable:
    """A partitioner that chooses between recomputing activations in the backward (min-cut) and
    saving every one the backward reads (the default partition), by the cost model's prediction of
    the forward and backward graphs each yields: the step's recompute-vs-store decision."""
    def choose(joint: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any):
        from torch._functorch.partitioners import default_partition
        from torch.utils import _pytree as pytree

        from optimizer import ir, search
        from optimizer.cache import atomic_write
        from optimizer.codegen import compiler
        from optimizer.hardware import cpu_spec

        def saving() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
            return default_partition(copy_constants(_merged_repeats(_copy(joint))), joint_inputs,
                                     num_fwd_outputs=num_fwd_outputs, **kwargs)

        layout.channels_last_convolutions(joint)       # before the two partitions: both see it
        recompute = partition(_copy(joint), joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        if spec is None and ir.graph_device(pytree.tree_leaves(joint_inputs)) != "cpu":   # priced for this CPU
            return recompute
        store = None
        try:
            chip, threads = spec or cpu_spec(), torch.get_num_threads() if spec is None else None
            gemm = spec is not None or compiler.sgemm_address() is not None
            path = search_cache_path(ir.from_fx(joint, half=True), chip, threads, gemm, str(num_fwd_outputs),
                                     suffix=".partition")
            choice = path.read_text() if path.exists() else ""
            if choice not in ("recompute", "store"):       # not decided here before
                store = saving()
                # each side by the model alone, over a few fusion plans: the decision is between two
                # graphs, and the full search of the chosen one follows
                cost = [sum(search.search_graph(planning_graph(gm), chip, gemm=gemm, timing=False,
                                                threads=threads, max_plans=PARTITION_PLANS).predicted_s
                            for gm in pair)
                        for pair in (recompute, store)]
                log.info("tfsn: recompute %.3f ms vs store %.3f ms predicted", cost[0] * 1e3, cost[1] * 1e3)
                choice = "recompute" if cost[0] <= cost[1] else "store"
                atomic_write(path, choice.encode())
        except Exception as e:      # symbolic shapes, a graph the IR cannot take: keep the min-cut
            log.info("tfsn: recompute-vs-store not searched (%s); recomputing", e)
            return recompute
        if choice == "recompute":
            return recompute
        return store or saving()
    return choose


def _merged_repeats(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`joint` with repeated computations merged (torch's fx_graph_cse, which the min-cut partitioner
    runs first; the default partition does not): a recurrent cell unrolled in Python transposes its
    weights once per time step, and the saving partition kept each transpose as a view of its own."""
    from torch._functorch import config as functorch_config
    from torch._functorch.compile_utils import fx_graph_cse

    if functorch_config.cse:
        joint.graph = fx_graph_cse(joint.graph)
        joint.recompile()
    return joint


def _copy(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the joint graph for one partitioner to cut. Outside AOTAutograd's fake mode: a tensor
    constant of the model (`torch.tensor([0, 3])` in a forward) is a real tensor attribute of the graph,
    and copying its storage under the fake mode fails the whole compile. Copying the graph's pytree specs
    makes torch's own LeafSpecs anew, which torch 2.13 deprecates with a FutureWarning on every compile: not
    the user's to act on, so not shown."""
    import copy
    import warnings

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*\bLeafSpec\b.* is deprecated", category=FutureWarning)
        return copy.deepcopy(joint)


def default_top_k(default: int | None = None) -> int:
    """$TFSN_TOP_K, else `default` (the CPU search's search.TOP_K when None)."""
    from optimizer.search import TOP_K
    value = os.environ.get("TFSN_TOP_K", "")
    if not value:
        return TOP_K if default is None else default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"TFSN_TOP_K is {value!r}; set it to a whole number >= 1 (1: no timing)")
    return int(value)


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                  schedule: Schedule | None = None, fuse: bool = True, top_k: int | None = None,
                  report: list | None = None, codegen: str | None = None, cuda_graphs: bool = True,
                  on_plan: Callable[[float, bool, str], None] | None = None) -> Callable:
    """One ATen graph (forward, backward or inference) to a callable; never fails on an op:
    whatever the generator does not cover runs as ATen. Without a fixed `schedule`, the fusion plan
    and every kernel's schedule come from the search (optimizer/search.py), cached on disk."""
    compiled = _compile_graph(gm, example_inputs, schedule=schedule, fuse=fuse, top_k=top_k, report=report,
                              codegen=codegen, cuda_graphs=cuda_graphs, on_plan=on_plan)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    # a backward's output gradients (tangents) come with whatever bits the caller's gradient has, each call
    tangents = {i for i, p in enumerate(placeholders) if p.name.startswith("tangents")}
    lazy = [i for i, a in enumerate(example_inputs)
            if i in tangents or isinstance(a, torch.Tensor) and (a.is_neg() or a.is_conj())]
    if not lazy:
        return compiled
    written = _written_placeholders(gm)
    return LazyInputsResolved(compiled, lazy, {i for i, p in enumerate(placeholders) if p in written})


def _written_placeholders(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The graph's inputs it writes over (copy_ into a placeholder: AOTAutograd's input mutations)."""
    return {n.args[0] for n in gm.graph.find_nodes(op="call_function", target=aten.copy_.default)
            if n.args[0].op == "placeholder"}


class LazyInputsResolved:
    """A compiled graph called with inputs that may carry a lazy negation or conjugation bit: forward inputs
    that have one (`z.conj().imag`, which Dynamo guards on, so the same positions each call), and every
    output gradient of a backward (`out.backward(torch._neg_view(g))`: not guarded, any call). Their memory
    holds the values before the bit, which a generated kernel would read as they are (it reads data
    pointers). Each is resolved to a copy before the call (a no-op without a bit), and the copies of inputs
    the graph writes are copied back through the bit."""

    def __init__(self, compiled: Callable, lazy: Sequence[int], written: set[int]) -> None:
        self._boxed_call = True
        self.compiled, self.lazy, self.written = compiled, lazy, [i for i in lazy if i in written]

    def __call__(self, args: list) -> Any:
        given = [args[i] for i in self.written]
        for i in self.lazy:
            if isinstance(args[i], torch.Tensor):
                args[i] = args[i].resolve_conj().resolve_neg()
        resolved = [args[i] for i in self.written]
        out = self.compiled(args)
        for g, r in zip(given, resolved):
            g.copy_(r)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)       # the compiled graph's own attributes (its source...)


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                   schedule: Schedule | None = None, fuse: bool = True, top_k: int | None = None,
                   report: list | None = None, codegen: str | None = None, cuda_graphs: bool = True,
                   on_plan: Callable[[float, bool, str], None] | None = None) -> Callable:
    from torch._functorch.aot_autograd import make_boxed_func

    from optimizer import fusion, ir
    from optimizer.codegen import c, compiler
    from optimizer.loopnest import NotFusable

    if not fuse:
        STATS["aten_graphs"] += 1
        return make_boxed_func(gm.forward)
    if codegen is None:
        codegen = default_codegen(example_inputs)
    if codegen == "c" and (missing := compiler.missing_compiler()) is not None:
        _log_once(f"tfsn: {missing}, so the step runs as ATen, without generated kernels: install gcc (apt-get "
                  "install gcc) or set CC to a C compiler")
        STATS["aten_graphs"] += 1
        return make_boxed_func(gm.forward)
    try:   # C kernels run on the host; Triton's on the inputs' device (the CPU under TRITON_INTERPRET=1)
        graph = planning_graph(gm, ir.graph_device(example_inputs) if codegen == "triton" else "cpu")
    except ir.Unsupported as e:
        if _symbolic(gm):
            again = functools.partial(_compile_graph, schedule=schedule, fuse=fuse, top_k=top_k, report=report,
                                      codegen=codegen, cuda_graphs=cuda_graphs, on_plan=on_plan)
            as_tensors = _scalars_as_tensors(gm)
            if as_tensors is not None:
                static, recipe, passed = as_tensors
                inputs = [n.meta["val"] for n in static.graph.find_nodes(op="placeholder")]
                return ScalarsAsTensors(again(static, inputs), recipe, passed)
            log.info("tfsn: a graph of symbolic sizes (%s) compiles once per shape it is called with", e)
            return PerShape(gm, again)
        log.warning("tfsn: running a graph as ATen (%s)", e)
        STATS["aten_graphs"] += 1
        return make_boxed_func(gm.forward)
    if codegen == "triton":
        return _triton_graph(gm, graph, schedule, report, cuda_graphs, top_k, on_plan)
    gemm = compiler.sgemm_address() is not None
    try:
        if schedule is not None:
            plan = fusion.plan(graph, gemm=gemm)
            schedules = [schedule] * len(plan.groups)
        else:
            plan, schedules = searched_plan(graph, gemm, default_top_k() if top_k is None else top_k, report, on_plan)
    except (NotFusable, compiler.CompileError) as e:   # a generator bug must not stop training
        return _as_aten(gm, "its generated code failed", e)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("tfsn fusion plan:\n%s", fusion.describe(graph, plan))
    try:
        source, kernels = c.write_source(graph, plan.groups, plan.buffers, schedules, plan.inplace)
        lib = compiler.load_library(compiler.build_library(source)) if any(kernels) else None
    except (NotFusable, compiler.CompileError) as e:   # a generator bug must not stop training
        return _as_aten(gm, "its generated code failed", e)
    return _compiled(graph, plan.groups, plan.inplace, kernels, lib, cuda_graphs)


def _symbolic(gm: torch.fx.GraphModule) -> bool:
    """Whether a graph has sizes or scalars Dynamo left symbolic (its dynamic shapes)."""
    def symbolic(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return any(not isinstance(s, int) for s in (*v.shape, *v.stride()))
        return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))
    return any(symbolic(n.meta.get("val")) for n in gm.graph.nodes)


def _scalars_as_tensors(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[tuple], list[tuple]] | None:
    """A copy of `gm` taking, in place of each symbolic int or float input that only `aten.scalar_tensor` reads
    (an int argument Dynamo made dynamic once it changed: a step or epoch number in `x / (1 + step)`), that op's
    0-d tensor as an input; an output that is such an input (a forward saving it for its backward) is None there.
    With it, the recipe of its inputs from `gm`'s, (position, None, None) for one passed as it is and (position,
    dtype, device) for a scalar made a tensor, and the (output, position) of each input passed through. None where
    no input is such a scalar. Why: PerShape specialized the graph to each value of the int, so a step number
    compiled the step again at every call, then ran it as ATen; the copy is static, or PerShape's by sizes alone."""
    def made_tensor(p: torch.fx.Node) -> bool:
        return isinstance(p.meta.get("val"), (torch.SymInt, torch.SymFloat)) and all(
            u.target is aten.scalar_tensor.default or u.op == "output" or _int_operand(u, p) for u in p.users)

    # by position: the copy's placeholders are gm's, in order (and the edits below keep each answer the same)
    made = [made_tensor(p) for p in gm.graph.find_nodes(op="placeholder")]
    if not any(made):
        return None
    static = _copy(gm)
    for p, made_here in zip(static.graph.find_nodes(op="placeholder"), made):
        if made_here:
            for u in [u for u in p.users if _int_operand(u, p)]:
                _operand_as_tensor(static, u)
    (output,) = static.graph.find_nodes(op="output")
    results = output.args[0]
    if not isinstance(results, (list, tuple)):
        return None
    results = list(results)
    recipe: list[tuple] = []
    passed: list[tuple] = []
    for position, (p, made_here) in enumerate(zip(static.graph.find_nodes(op="placeholder"), made)):
        if not made_here:
            recipe.append((position, None, None))
            continue
        for made in [u for u in p.users if u.op != "output"]:
            with static.graph.inserting_before(p):
                tensor = static.graph.placeholder(f"{made.name}_input")
            tensor.meta = dict(made.meta)
            made.replace_all_uses_with(tensor)
            static.graph.erase_node(made)
            recipe.append((position, made.meta["val"].dtype, made.meta["val"].device))
        for k, r in enumerate(results):
            if r is p:
                results[k] = None
                passed.append((k, position))
        output.args = (type(output.args[0])(results),)
        static.graph.erase_node(p)
    static.recompile()
    return static, recipe, passed


# ops whose second operand, a Python int, may be a 0-d tensor instead: the same result and dtype (see _int_dtype)
INT_OPERAND_OPS = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor)


def _int_operand(node: torch.fx.Node, p: torch.fx.Node) -> bool:
    """Whether `node` reads the symbolic int `p` only as the second operand of one of INT_OPERAND_OPS."""
    return (node.target in INT_OPERAND_OPS and len(node.args) == 2 and node.args[1] is p and node.args[0] is not p
            and isinstance(p.meta.get("val"), torch.SymInt) and p not in node.kwargs.values()
            and isinstance(node.meta.get("val"), torch.Tensor) and isinstance(node.args[0], torch.fx.Node)
            and isinstance(node.args[0].meta.get("val"), torch.Tensor))


def _int_dtype(first: torch.Tensor) -> torch.dtype:
    """The dtype of the 0-d tensor that stands for a Python int beside the tensor `first`. int64: a 0-d tensor
    promotes as a Python scalar does within its kind, and an int's kind is the lowest but bool's. But two 0-d
    tensors promote each other: beside a 0-d tensor of a narrower integer dtype (an int32 step counter + step,
    int32 in eager, was int64), that dtype, to which eager converts the int too."""
    narrower = first.dim() == 0 and not first.is_floating_point() and not first.is_complex() \
        and first.dtype not in (torch.bool, torch.int64)
    return first.dtype if narrower else torch.int64


def _operand_as_tensor(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """`node`'s int operand made a 0-d tensor by aten.scalar_tensor before it (see _int_operand)."""
    from torch._subclasses.fake_tensor import FakeTensor
    fake_mode = next(v.fake_mode for n in gm.graph.nodes if isinstance(v := n.meta.get("val"), FakeTensor))
    dtype = _int_dtype(node.args[0].meta["val"])
    with gm.graph.inserting_before(node):
        tensor = gm.graph.call_function(aten.scalar_tensor.default, (node.args[1],), {"dtype": dtype})
    with fake_mode:
        tensor.meta["val"] = torch.empty((), dtype=dtype, device=node.meta["val"].device)
    node.args = (node.args[0], tensor)


def _scalar_tensor(value: int | float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.scalar_tensor(value), an int wrapped into a narrower integer `dtype` as eager converts it beside such a
    tensor (uint8 counter + 300 adds 44); torch.scalar_tensor raises on the overflow."""
    if isinstance(value, int) and not dtype.is_floating_point and not dtype.is_complex \
            and dtype not in (torch.bool, torch.int64):
        info = torch.iinfo(dtype)
        value = (value - info.min) % (info.max - info.min + 1) + info.min
    return torch.scalar_tensor(value, dtype=dtype, device=device)


class ScalarsAsTensors:
    """A graph compiled by `_scalars_as_tensors`: called with the original inputs, each scalar made its tensor,
    and returning the scalars it passes through."""

    def __init__(self, compiled: Callable, recipe: list[tuple], passed: list[tuple]) -> None:
        self._boxed_call = True
        self.compiled, self.recipe, self.passed = compiled, recipe, passed

    def __call__(self, args: list) -> Any:
        inputs = [args[i] if dtype is None else _scalar_tensor(args[i], dtype, device)
                  for i, dtype, device in self.recipe]
        scalars = [(k, args[i]) for k, i in self.passed]
        args.clear()
        out = self.compiled(inputs)
        if not scalars:
            return out
        results = list(out)
        for k, value in scalars:
            results[k] = value
        return type(out)(results)


def _shape_key(args: Sequence[Any]) -> tuple:
    """What a graph specialized to `args` was generated for: each tensor's shape, strides, dtype and device, and
    each other argument's value (a size Dynamo passes for a symbol)."""
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args)


SHAPES_PER_GRAPH = 8   # shapes a graph of symbolic sizes is generated for; later ones run as ATen (Dynamo's own
                       # recompile limit is 8 too): each is a search and a compile, seconds to a minute


class PerShape:
    """A graph of symbolic sizes (Dynamo's automatic dynamic shapes: after a smaller last batch, or sequence
    lengths that change), traced again with its sizes fixed and compiled at each new shape it is called with,
    up to SHAPES_PER_GRAPH of them. Generated kernels are specialized to their shapes: without this, such a
    graph ran as ATen, and so did every later step, the full batches included (Dynamo's newest graph, the
    dynamic one, is the one it tries first)."""

    def __init__(self, gm: torch.fx.GraphModule, compile: Callable[[torch.fx.GraphModule, Sequence[Any]], Callable]):
        self._boxed_call = True
        self.gm, self.compile = gm, compile
        self.graphs: dict[tuple, Callable] = {}
        self.aten: Callable | None = None       # the graph as ATen, for good: no shape makes it static
        self.beyond: Callable | None = None     # the graph as ATen for shapes past SHAPES_PER_GRAPH

    def __call__(self, args: list) -> Any:
        if self.aten is not None:
            return self.aten(args)
        key = _shape_key(args)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._specialized(key, args) if len(self.graphs) < SHAPES_PER_GRAPH else self._beyond()
        return graph(args)

    def _beyond(self) -> Callable:
        """ATen for a shape past the limit: a compile at every new length would cost more than it saves."""
        if self.beyond is None:
            self.beyond = _as_aten(self.gm, f"at sizes past the {SHAPES_PER_GRAPH} it was generated for (a "
                                   "length or an int argument that changes at every call: pad batches to a "
                                   "few lengths, pass a changing int such as a step number as a tensor)",
                                   ValueError(f"more than {SHAPES_PER_GRAPH} shapes"))
        return self.beyond

    def _specialized(self, key: tuple, args: list) -> Callable:
        from torch.fx.experimental.proxy_tensor import make_fx
        try:
            specialized = make_fx(self.gm, tracing_mode="fake")(*args)      # sizes now constants: nothing runs
        except Exception as e:      # a generator bug must not stop training
            self.aten = _as_aten(self.gm, "it could not be traced again at its call's sizes", e)
            return self.aten
        if _symbolic(specialized):  # sizes that depend on values (nonzero, a boolean mask): specialized again,
            self.aten = _as_aten(self.gm, "its sizes depend on its values",   # it would be a PerShape again
                                 ValueError("a data-dependent size (an unbacked symbol)"))
            return self.aten
        example = [n.meta.get("val", a) for n, a in zip(specialized.graph.find_nodes(op="placeholder"), args)]
        graph = self.graphs[key] = self.compile(specialized, example)
        return graph


def default_codegen(example_inputs: Sequence[Any]) -> str:
    """Triton for a graph on a GPU (C kernels run on the host: a CUDA tensor would leave every op to ATen),
    C for one on the CPU; C too where triton is not installed (said once)."""
    from optimizer import ir
    if ir.graph_device(example_inputs) == "cpu":
        return "c"
    if importlib.util.find_spec("triton") is None:
        _log_once("tfsn: triton is not installed, so a GPU graph runs as ATen; install it (pip install "
                  "'tfsn[gpu]') to get generated kernels")
        return "c"
    return "triton"


def _as_aten(gm: torch.fx.GraphModule, why: str, error: Exception) -> Callable:
    """The graph run as its ATen calls, with the reason logged: a generator bug must not stop training."""
    from torch._functorch.aot_autograd import make_boxed_func
    log.warning("tfsn: running a graph as ATen, %s: %s", why, str(error)[:2000])
    STATS["aten_graphs"] += 1
    return make_boxed_func(gm.forward)


def _compiled(graph, groups: Sequence[Group], inplace: dict[int, int], kernels: Sequence[Any], lib: Any,
              cuda_graphs: bool) -> Callable:
    """The graph's entry, running `groups` by their `kernels` (None: an extern); replayed as one CUDA graph
    where its device records them (optimizer/graphs.py)."""
    from optimizer import graphs
    from optimizer.codegen.c_attention import AttentionKernel
    from optimizer.runtime import CompiledGraph, written_nodes
    STATS["graphs"] += 1
    STATS["kernels"] += sum(k is not None for k in kernels)
    STATS["attention_kernels"] += sum(isinstance(k, AttentionKernel) for k in kernels)
    compiled = CompiledGraph(graph, groups, kernels, lib, inplace)
    recorder = graphs.recorder_for(graph.device) if cuda_graphs else None
    if recorder is None:
        return compiled
    written = written_nodes(graph, inplace)
    return graphs.GraphReplay(compiled.run, graph.device, [p for p, i in enumerate(graph.inputs) if i in written],
                              recorder, f"a graph of {len(graph)} nodes and {sum(k is not None for k in kernels)} "
                              "kernels")


def _triton_graph(gm: torch.fx.GraphModule, graph, schedule: Schedule | None, report: list | None,
                  cuda_graphs: bool, top_k: int | None,
                  on_plan: Callable[[float, bool, str], None] | None = None) -> Callable:
    """The graph as Triton kernels; ATen where a kernel cannot be written (logged, as for C). On a GPU
    whose spec tfsn knows, the fusion plan is the GPU cost model's pick and each kernel's launch shape
    the fastest on the GPU of the model's top k (gpu_searched_plan); elsewhere, or under a fixed
    `schedule`, the heuristic plan under that one schedule."""
    from optimizer import fusion
    from optimizer.codegen import triton
    from optimizer.codegen.triton_combo import write_program
    from optimizer.loopnest import NotFusable
    try:
        spec = gpu_spec(graph.device) if schedule is None else None
        if spec is not None:
            plan, schedules = gpu_searched_plan(graph, spec, report, top_k, on_plan)
        else:
            plan = fusion.plan(graph)
            schedules = [schedule or Schedule()] * len(plan.groups)
        program = write_program(graph, plan.groups, plan.buffers, schedules, plan.inplace, spec)
        lib, failed = _precompiled(graph, program)
        refused = [(name, e) for name, e in failed if name in program.combined]
        if refused:     # each part compiles alone (the parts are the kernels of the plan): launched one by one
            log.warning("tfsn: Triton did not compile the combined kernel %s of %s (%s); its parts run as kernels "
                        "of their own", refused[0][0], lib.path, str(refused[0][1]).splitlines()[0][:300])
            program = write_program(graph, plan.groups, plan.buffers, schedules, plan.inplace, spec, combine=False)
            lib, failed = _precompiled(graph, program)
    except (NotFusable, triton.Unsupported) as e:
        return _as_aten(gm, "its Triton code failed", e)
    if failed:       # launched, the kernel would fail the training step
        name, error = failed[0]
        return _as_aten(gm, f"Triton did not compile {len(failed)} of its kernels (kernel {name} of "
                            f"{lib.path})", error)
    return _compiled(graph, program.groups, plan.inplace, program.kernels, lib, cuda_graphs)


def _precompiled(graph, program) -> tuple[Any, list[tuple[str, BaseException]]]:
    """The program's module, its kernels compiled ahead for the graph's GPU, and those Triton refused."""
    from optimizer.codegen import triton
    lib = triton.TritonLibrary(program.source) if any(program.kernels) else None
    return lib, lib.precompile(graph, program.kernels) if lib is not None else []


def gpu_spec(device: str):
    """The hardware spec of a CUDA device, by its name ('NVIDIA H200' -> configs/hardware/h200.yaml), or
    None (a CPU; a GPU tfsn has no spec of, logged once)."""
    if torch.device(device).type != "cuda":
        return None
    from optimizer.hardware import find_hardware
    name = torch.cuda.get_device_name(torch.device(device))
    words = name.replace("NVIDIA", "").replace("AMD", "").split()
    for i in range(len(words), 0, -1):       # "H100 80GB HBM3": H100-80GB-HBM3, H100-80GB, H100
        spec = find_hardware("-".join(words[:i]))
        if spec is not None and spec.kind == "gpu":
            return spec
    _log_once(f"tfsn: no hardware spec names the GPU {name!r}; its Triton kernels use the heuristic plan "
              "(add a spec under configs/hardware with this name among its aliases)")
    return None


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    log.warning(message)


GPU_TOP_K = 4      # launch shapes per kernel built and timed on the GPU (each a Triton compile of ~0.5 s)


def gpu_searched_plan(graph, spec, report: list | None, top_k: int | None = None,
                      on_plan: Callable[[float, bool, str], None] | None = None) -> tuple[Plan, list[Schedule]]:
    """The GPU cost model's plan for this graph on `spec`, and each kernel's launch shape: the fastest
    measured on the graph's GPU of the model's top `top_k` (default $TFSN_TOP_K, else GPU_TOP_K; 1: the model's pick),
    from the disk cache when this graph was searched for that GPU before (its ties timed again, as
    searched_plan's); `on_plan` as searched_plan's."""
    from optimizer import search
    from optimizer.target import target_for
    top_k = default_top_k(GPU_TOP_K) if top_k is None else top_k
    path = search_cache_path(graph, spec, None, True, "triton", f"top{top_k}", suffix=".json")
    target = target_for(spec, graph.device)
    return _saved_or_searched(path, graph, True, target, report, on_plan,
                              lambda: search.search_graph(graph, target, gemm=True, top_k=top_k, timing=top_k > 1))


SEARCH_VERSION = "46"     # bump when the search or the model changes what a cached result means

# Set by the controller in a job's workers: the hardware `tfsn plan` searched the job's step for on this node
# (planned_hardware), so that a worker that must search says whether its node is of another type.
PLANNED_HARDWARE_ENV = "TFSN_PLANNED_HARDWARE"


def _say_why_searching(spec) -> None:
    """In a job tfsn launched, a search on the node is news: its plan was searched at `tfsn plan`. Say why
    (in the job log), once per process: the node is another hardware type, or this graph was not planned."""
    planned = os.environ.get(PLANNED_HARDWARE_ENV, "")
    if not planned:
        return
    from optimizer.hardware import planned_hardware
    here = planned_hardware(spec)
    if planned != here:
        _log_once(f"tfsn: this node's hardware ({here}) is not what the job's plan was searched for ({planned}): "
                  "searching its step here")
    else:
        _log_once(f"tfsn: a graph of the step is not in the job's plan for {here} (the code, the batch or the "
                  "threads differ from what `tfsn plan` captured): searching it here")


def searched_plan(graph, gemm: bool, top_k: int, report: list | None,
                  on_plan: Callable[[float, bool, str], None] | None = None) -> tuple[Plan, list[Schedule]]:
    """The search's plan and schedules for this graph on this host, from the disk cache when this
    graph was searched here before (same graph, host spec, compiler, threads and top_k, or any top_k > 1
    where that search timed no kernel): by `tfsn plan`,
    which searches a job's step this way for the host its local nodes run on, or by an earlier run. A kernel
    whose choice the search could not call (search.Tie) has its tied candidates timed again on each
    of the next few runs, until one wins clearly or search.RETIMES is reached."""
    from optimizer import search
    from optimizer.hardware import cpu_spec
    from optimizer.target import target_for

    spec, threads = cpu_spec(), torch.get_num_threads()
    path = search_cache_path(graph, spec, threads, gemm, str(top_k), suffix=".json")
    # A search that timed no kernel (each predicted under search.MIN_TIMED_S: a small model's) chose what a
    # search of any other top_k > 1 chooses, and is kept for those too. Why: a training step compiled with
    # another top_k than the step before (a test's top_k=2 after the default 8) searched its forward and
    # backward again, to the same plan.
    untimed = search_cache_path(graph, spec, threads, gemm, "top_k > 1, no kernel timed", suffix=".json") \
        if top_k > 1 else None
    if untimed is not None and report is None and not path.exists() and untimed.exists():
        path = untimed

    def search_now():
        result = search.search_graph(graph, spec, gemm=gemm, top_k=top_k, threads=threads)
        if untimed is not None and path != untimed and all(k.predicted_s < search.MIN_TIMED_S for k in result.kernels):
            _write_search_entry(untimed, result)
        return result
    return _saved_or_searched(path, graph, gemm, target_for(spec), report, on_plan, search_now)


def _saved_or_searched(path: Path, graph, gemm: bool, target, report: list | None,
                       on_plan: Callable[[float, bool, str], None] | None,
                       search_now: Callable[[], Any]) -> tuple[Plan, list[Schedule]]:
    """The plan and schedules saved at `path` (its ties timed again on `target`; not when a `report` wants the
    search itself), else `search_now()`'s, saved there; `on_plan` is told either way."""
    saved = _read_search_entry(path, graph, gemm) if report is None else None
    if saved is not None:
        _retime_ties(path, graph, saved, target)
        if on_plan is not None:
            on_plan(saved.expected_s, False, path.name)
        return saved.plan, saved.schedules
    _say_why_searching(target.spec)
    result = search_now()
    STATS["searches"] += 1
    log.info("tfsn search: %d plans, %d candidates scored in %.3f s, %d timed; %.2f s in all",
             result.plans_scored, result.scored, result.score_seconds, len(result.measured), result.seconds)
    if report is not None:
        report.append((graph, result))
    if on_plan is not None:
        on_plan(result.expected_s, True, path.name)
    _write_search_entry(path, result)
    return result.plan, result.schedules


def _retime_ties(path: Path, graph, saved: _SavedSearch, target) -> None:
    """A cached search's ties (search.Tie) timed again on `target`, each one's winner written into
    `saved.schedules`, and the entry rewritten with the ties still open. A job's workers run the plan as it
    was searched instead (restarts and ranks alike, so that a run resumed from a checkpoint computes what
    the one that never stopped did)."""
    from optimizer import search
    from optimizer.cache import atomic_write
    from optimizer.codegen import compiler
    from optimizer.loopnest import NotFusable
    if not saved.ties or os.environ.get(PLANNED_HARDWARE_ENV):
        return
    try:
        settled = search.retime(graph, saved.plan, saved.ties, target)
    except (NotFusable, compiler.CompileError) as e:    # the cached choice still runs: keep it, settled
        log.warning("tfsn: tied kernels not timed again, their code failed: %s", str(e)[:2000])
        settled = []
    for tie, (schedule, _) in zip(saved.ties, settled):
        for g in tie.groups:
            saved.schedules[g] = schedule
    still = [tie for _, tie in settled if tie is not None]
    log.info("tfsn search: %d tied kernels timed again, %d still tied", len(saved.ties), len(still))
    atomic_write(path, _search_entry(saved.choice, saved.schedules, still, saved.expected_s))


@dataclasses.dataclass
class _SavedSearch:
    """A search cache entry read back: the plan its choice gives this graph, and what was decided for it."""
    plan: Plan
    schedules: list[Schedule]
    ties: list[Tie]
    choice: dict[str, list[int]]
    expected_s: float


def _read_search_entry(path: Path, graph, gemm: bool) -> _SavedSearch | None:
    """The entry at `path` for `graph`, or None: none there, unreadable (logged), or made for another plan."""
    from optimizer import fusion, search
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
        plan = fusion.plan(graph, gemm=gemm,
                           choice=fusion.Choice(**{k: frozenset(v) for k, v in saved["choice"].items()}))
        if len(plan.groups) != len(saved["schedules"]):
            return None
        ties = [search.Tie(t["groups"], [Schedule(**s) for s in t["schedules"]], t["retimed"])
                for t in saved.get("unsettled", [])]
        return _SavedSearch(plan, [Schedule(**s) for s in saved["schedules"]], ties, saved["choice"],
                            float(saved["expected_s"]))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        log.warning("tfsn: search cache %s unreadable (%s); searching again", path, e)
        return None


def _write_search_entry(path: Path, result) -> None:
    from optimizer.cache import atomic_write
    choice = {k: sorted(getattr(result.choice, k)) for k in ("store", "recompute", "split")}
    atomic_write(path, _search_entry(choice, result.schedules, result.ties, result.expected_s))


def _search_entry(choice: dict[str, list[int]], schedules: Sequence[Schedule], ties: Sequence[Tie],
                  expected_s: float) -> bytes:
    """A search cache entry: the fusion choice, every group's schedule, the kernels whose choice is
    unsettled (search.Tie) with their tied candidates and re-timings so far, and the plan's expected time
    (search.SearchResult.expected_s)."""
    return json.dumps({"choice": choice, "schedules": [dataclasses.asdict(s) for s in schedules],
                       "expected_s": expected_s,
                       "unsettled": [{"groups": t.groups, "schedules": [dataclasses.asdict(s) for s in t.schedules],
                                      "retimed": t.retimed} for t in ties]}).encode()


def search_cache_path(graph, spec, threads: int | None, gemm: bool, *extra: str, suffix: str) -> Path:
    """Where a search decision about `graph` is kept: named by everything it depends on (the graph,
    the chip spec, what builds and runs its kernels, threads, whether BLAS is there, and the caller's own
    `extra`)."""
    from optimizer.cache import content_key, search_dir
    key = content_key(graph_signature(graph), repr(spec), *_builder_ids(graph.device), SEARCH_VERSION, str(threads),
                      str(gemm), *extra)
    return search_dir() / f"{key}{suffix}"


def _builder_ids(device: str) -> tuple[str, ...]:
    """What a graph's kernels are built by and timed on: on a CPU the C compiler and the CPU model; on a GPU
    the GPU (its name and compute capability), Triton and torch (cuBLAS), and whether the step's graphs
    replay as CUDA graphs (the search times in them or not). The host's CPU and compiler are not a GPU
    search's: the same GPU on another host reads the same entry."""
    dev = torch.device(device)
    if dev.type != "cuda":
        from optimizer.codegen import compiler
        return compiler.compiler_id(), compiler.hardware_id()
    import triton
    from optimizer import graphs
    major, minor = torch.cuda.get_device_capability(dev)
    return (torch.cuda.get_device_name(dev), f"sm_{major}{minor}", f"triton {triton.__version__}",
            f"torch {torch.__version__}", f"cuda graphs {graphs.recorder_for(device) is not None}")


def graph_signature(graph) -> str:
    """Everything that decides the code of a graph: ops, arguments, shapes, strides, dtypes, and the
    float32 precision it was captured with (TF32 or not prices a GPU's products differently)."""
    return repr([(n.op, n.kind.value, n.type, n.args, sorted(n.kwargs.items()), n.params) for n in graph.nodes]
                + [graph.inputs, graph.outputs, graph.allow_tf32, graph.cudnn_allow_tf32])


def make_backend(**options: Any) -> Callable:
    """A torch.compile backend with these options (see OPTIONS)."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"tfsn: unknown option {sorted(unknown)[0]!r}; known options: {', '.join(OPTIONS)}")
    schedule = options.get("schedule")
    if schedule is not None and not isinstance(schedule, Schedule):
        raise ValueError(f"tfsn: schedule must be an optimizer.schedule.Schedule, not {type(schedule).__name__}")
    if options.get("codegen") not in (None, "c", "triton"):
        raise ValueError(f"tfsn: codegen must be 'c' or 'triton', not {options['codegen']!r}")
    if not isinstance(options.get("cuda_graphs", True), bool):
        raise ValueError(f"tfsn: cuda_graphs must be True or False, not {options['cuda_graphs']!r}")
    top_k = options.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"tfsn: top_k must be a whole number >= 1, not {top_k!r}")
    return Backend(options)


BY_IDENTITY = ("report", "on_plan")     # options that are the caller's own objects: the same only if the same one


class Backend:
    """The torch.compile backend make_backend returns. Two with the same options are equal, as Inductor's are:
    Dynamo guards every compiled frame on its backend, so a new closure per call recompiled a frame shared by
    several modules (per-block `tfsn.optimize(block)` or `block.compile(backend=...)`, as torchtitan compiles
    FSDP2 blocks) once per module, each recompile searched and built again, and past Dynamo's recompile limit (8)
    the later blocks ran eagerly."""

    __name__ = "tfsn"       # what Dynamo's errors name the backend by (else `<optimizer.backend.Backend object at ...>`)

    def __init__(self, options: dict[str, Any]) -> None:
        from torch._dynamo.backends.common import aot_autograd

        self.options = options
        compiler = functools.partial(compile_graph, **options)
        searched = (options.get("schedule") is None and options.get("fuse") is not False
                    and options.get("codegen") != "triton")
        partition_fn = searched_partition() if searched else partition
        # input mutations (optimizer updates, BatchNorm's running stats) stay in the graph as copy_:
        # the kernel that computes the new value then writes it over the input (fusion.in_place_writes)
        self.trace = traced_with_corrections(aot_autograd(
            fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition_fn, decompositions=decompositions,
            keep_inference_input_mutations=True))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        return self.trace(gm, example_inputs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Backend) or self.options.keys() != other.options.keys():
            return False
        return all(value is other.options[name] if name in BY_IDENTITY else value == other.options[name]
                   for name, value in self.options.items())

    def __hash__(self) -> int:
        return hash(frozenset(self.options))

    def __reduce__(self) -> tuple:
        """Pickled as its options (its trace is a closure): `torch.save(tfsn.optimize(model))`, or a compiled
        model sent to another process, failed with "Can't pickle local object" where torch.compile(backend="tfsn")
        pickled. Less the caller's own objects (BY_IDENTITY): a `report` list holds the searched graphs, which do
        not pickle, so a model optimized with `report=` failed to pickle once it had compiled; the copy could not
        append to the caller's list anyway."""
        return Backend, ({name: value for name, value in self.options.items() if name not in BY_IDENTITY},)

    def __deepcopy__(self, memo: dict) -> Backend:
        """Itself: a backend holds no state but its options, and `copy.deepcopy(optimized_model)` keeps reporting
        to the caller's `report` and `on_plan` (a copy of the list would be one nobody reads)."""
        return self


# torch.compile's modes, as tfsn's options: the search already times each kernel's candidates on the chip (what
# max-autotune turns on in Inductor), and a GPU graph is replayed as a CUDA graph (reduce-overhead's) by default.
MODES = {"default": {}, "reduce-overhead": {}, "max-autotune": {}, "max-autotune-no-cudagraphs": {"cuda_graphs": False}}


def mode_options(mode: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """tfsn's `options` with those of a torch.compile `mode` (None: the default). An option that contradicts the
    mode is an error: `mode="max-autotune-no-cudagraphs", cuda_graphs=True` replayed CUDA graphs, saying nothing."""
    if mode is None:
        return options
    if mode not in MODES:
        raise ValueError(f"tfsn: unknown mode {mode!r}; modes: {', '.join(MODES)}")
    for name, value in MODES[mode].items():
        if name in options and options[name] != value:
            raise ValueError(f"tfsn: mode {mode!r} sets {name}={value!r}, and the options say {name}="
                             f"{options[name]!r}: drop one of them")
    return {**MODES[mode], **options}


def tfsn_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                 options: dict[str, Any] | None = None) -> Callable:
    """The backend registered as `tfsn` (the `torch_dynamo_backends` entry point). torch.compile passes its
    `mode` and `options` here (`torch.compile(model, backend="tfsn", mode="max-autotune")` failed with a TypeError
    inside Dynamo); `options` are tfsn's (OPTIONS)."""
    return make_backend(**mode_options(mode, options or {}))(gm, example_inputs)


def optimize(model: Any, *, mode: str | None = None, dynamic: bool | None = None, fullgraph: bool = False,
             **options: Any) -> Any:
    """`torch.compile(model, backend="tfsn")` with options, and torch.compile's `mode` (MODES). Generated kernels
    are specialized to their shapes and strides: each new shape compiles once, also in a graph Dynamo made dynamic
    (`PerShape`). Dynamo's default `dynamic=None` is kept: with `dynamic=False` a float argument or attribute that
    changes every step (an annealed temperature, a loss weight) recompiled the frame every step, until Dynamo's
    recompile limit (8) sent the model to eager for good."""
    _refuse_compiled(model)
    compiler = make_backend(**mode_options(mode, options))
    if _wrapped_torch_module(model):
        inner = model.module     # a method bound to it: a deepcopy (an EMA model) binds its own, a pickle its class's
        inner.forward = types.MethodType(torch.compile(type(inner).forward, backend=compiler, dynamic=dynamic,
                                                       fullgraph=fullgraph), inner)
    return torch.compile(model, backend=compiler, dynamic=dynamic, fullgraph=fullgraph)


def _refuse_compiled(model: Any) -> None:
    """Refuses a model, or DDP's module, that torch.compile already wrapped: one compiler must own the forward.
    torch.compile on one unwraps it to the bare `forward` (a function: no `parameters()`, the module's hooks
    skipped, the first backend dropped, saying nothing), and tfsn's own compile of DDP's module put nn.Module's
    unimplemented `forward` over the OptimizedModule's. Unwrapping `_orig_mod` here would drop the user's
    torch.compile (and rename DDP's state dict) as silently. A TorchScript module in DDP failed with AttributeError
    (its class's `forward` cannot be read), and torch.compile refuses one outside DDP itself."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, OptimizedModule):
        raise ValueError("tfsn: the model is already compiled by torch.compile; pass the module it wraps "
                         "(model._orig_mod), or the model before torch.compile")
    if isinstance(model, DistributedDataParallel) and isinstance(model.module, OptimizedModule):
        raise ValueError("tfsn: DDP's module is already compiled by torch.compile; put the uncompiled module "
                         "(its ._orig_mod) in DDP: tfsn.optimize(DDP(net))")
    if isinstance(model, DistributedDataParallel) and isinstance(model.module, torch.jit.ScriptModule):
        raise ValueError("tfsn: DDP's module is TorchScript (torch.jit.script or torch.jit.trace), which torch.compile "
                         "cannot compile; put the eager module in DDP: tfsn.optimize(DDP(net))")


def _wrapped_torch_module(model: Any) -> bool:
    """Whether `model` is DDP around one of torch's own modules (`DDP(nn.Sequential(...))`). Dynamo breaks the graph
    where DDP's forward enters `_inside_ddp_forward`, and traces what follows only from a frame of the user's code,
    never torch's: a user's module class is compiled, a Sequential was not, and the model ran eagerly, saying
    nothing (Inductor the same). Its forward is then compiled itself, in place: the names in the state dict stay."""
    from torch.nn.parallel import DistributedDataParallel
    # an fx GraphModule's generated forward has `__module__` None (it was an AttributeError)
    return isinstance(model, DistributedDataParallel) and \
        (getattr(type(model.module).forward, "__module__", None) or "").startswith("torch.nn.")
