"""What an extern costs: an ATen call the generator leaves as it is (a library GEMM, flash attention,
a convolution, an embedding's backward, a concatenation) priced by a roofline of its FLOPs and bytes,
read off its shapes, at a documented fraction of the chip's peak for its class of library kernel.

Why: on a GPU the externs are much of a training step (attention and convolutions are never generated),
and a plan that prices them at zero ranks offers, and the recompute-vs-store partition, by the wrong
numbers. The time of one extern is

    max(flops / (peak(precision) x compute efficiency), bytes / (bandwidth x memory efficiency))
      + launches x launch overhead

with the precision of its operands (an fp32 product runs on TF32 tensor cores only where the captured
graph allowed it: ir.Graph.allow_tf32 for matmuls, cudnn_allow_tf32 for convolutions), the bandwidth of
the smallest memory level that holds what it moves, and each class's efficiency below. Accuracy is
measured on the chip by benchmarks/gpu_costmodel_check.py, never assumed.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from optimizer.costmodel import GPU_LIBRARY_GEMM_COMPUTE, GPU_LIBRARY_GEMM_MEMORY
from optimizer.features import gemm_precision
from optimizer.hardware import HardwareSpec
from optimizer.ir import VIEWS, Graph, Kind, Node, Ref


@dataclass(frozen=True)
class Efficiency:
    """What a class of library kernel reaches on large shapes, and how many kernels one call starts."""

    compute: float              # fraction of the precision's dense peak
    memory: float               # fraction of the memory level's bandwidth
    launches: float = 1.0       # kernels one call launches


# GPUs. gemm: cuBLAS at 0.80 of the dense peak: an 8192^3 bf16 product through torch ran at 769-798 TFLOP/s
# of an H200's 989 (measured on this workplace's H200, .library/device/KINDS.md, 2026-11-04). conv: cuDNN's
# implicit GEMM at 0.60, below cuBLAS for its im2col addressing and small channel counts (an assumption
# until measured by benchmarks/gpu_costmodel_check.py); forward and backward are separate kernels. attention:
# FlashAttention-2 (torch's SDPA kernel) reaches 50-73% of an A100's peak forward (Dao 2023, "FlashAttention-2",
# sec. 4.1) but 35-50% of an H100's (Shah et al. 2024, "FlashAttention-3", fig. 5-6): 0.40; its backward
# (3 kernels: a pre-pass, the main loop, a dq conversion) counts 2.5x the forward's FLOPs below. memory:
# a device-to-device copy moved 4.3 TB/s of an H200's 4.8 (KINDS.md), 0.90; ATen's elementwise kernels
# somewhat less, 0.80. gather (embedding, index): rows at random, 0.60 (assumption). scatter (embedding
# backward, index_put with accumulate): atomic read-modify-write of the rows, 0.40 (assumption).
GPU = {"gemm": Efficiency(GPU_LIBRARY_GEMM_COMPUTE, GPU_LIBRARY_GEMM_MEMORY), "conv": Efficiency(0.60, 0.80), "attention": Efficiency(0.40, 0.80),
       "memory": Efficiency(1.0, 0.80), "gather": Efficiency(1.0, 0.60), "scatter": Efficiency(1.0, 0.40, 2.0)}
# CPUs: the BLAS at the spec's library_gemm_efficiency (measured by `tfsn calibrate`; the 0.85 of a vendor
# spec otherwise); oneDNN convolutions and ATen's CPU flash attention at lower fractions of the FMA peak,
# 0.50 and 0.30 (assumptions: both block the product into small GEMMs with packing and a softmax between);
# memory-bound ATen loops at 0.70 of a level's bandwidth (assumption: one pass, no blocking).
CPU = {"gemm": Efficiency(0.85, 0.70), "conv": Efficiency(0.50, 0.70), "attention": Efficiency(0.30, 0.70),
       "memory": Efficiency(1.0, 0.70), "gather": Efficiency(1.0, 0.50), "scatter": Efficiency(1.0, 0.40)}
ATTENTION_BACKWARD_FLOPS = 2.5  # FlashAttention's backward: 5 products of the forward's 2 sizes (Dao 2023, sec. 3.2)
ATTENTION_BACKWARD_LAUNCHES = 3.0

GEMM_OPS = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default"}
CONV_OPS = {"aten.convolution.default", "aten.convolution_backward.default"}
GATHER_OPS = {"aten.embedding.default", "aten.index.Tensor", "aten.gather.default", "aten.index_select.default"}
SCATTER_OPS = {"aten.embedding_dense_backward.default", "aten.index_put.default", "aten.index_put_.default",
               "aten._unsafe_index_put.default", "aten.scatter_add.default", "aten.index_add.default"}
# no kernel: views (split and unbind return views too), tuple items, constants, allocations, sizes
FREE_OPS = VIEWS | {"getitem", "constant", "aten.detach.default", "aten.as_strided.default", "aten.lift_fresh.default",
                    "aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int", "aten.chunk.default",
                    "aten.unfold.default", "aten.diagonal.default", "aten.empty.memory_format",
                    "aten.empty_strided.default", "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default"}
_GPU_LEVELS_SKIPPED = ("registers", "shared")     # a library kernel's operands start in L2 or main memory


@dataclass(frozen=True)
class ExternCost:
    """One extern's price and what it was read from (for `tfsn optimize --emit`'s plan)."""

    op: str
    kind: str                   # gemm | conv | attention | gather | scatter | memory | free
    precision: str              # the peak its FLOPs run at ("" where it does no arithmetic)
    flops: float
    bytes: float
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "class": self.kind, "precision": self.precision, "flops": self.flops,
                "bytes": self.bytes, "predicted_s": self.seconds}


def bound_args(node: Node) -> dict[str, Any]:
    """The call's arguments by their schema names (positional and keyword alike)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    found = {a.name: v for a, v in zip(schema.arguments, node.args)}
    found.update(node.kwargs)
    return found


def _type(graph: Graph, value: Any):
    return graph.nodes[value.index].type if isinstance(value, Ref) else None


def _nbytes(t) -> float:
    if t is None:
        return 0.0
    try:
        itemsize = getattr(torch, t.dtype).itemsize
    except (AttributeError, TypeError):
        itemsize = 4
    return float(t.numel * itemsize)


def _output_bytes(graph: Graph, node: Node) -> float:
    """Bytes the call writes: its tensor, or the tensors its getitem users take out of its tuple."""
    if node.type is not None:
        return _nbytes(node.type)
    return sum(_nbytes(graph.nodes[u].type) for u in node.users if u >= 0 and graph.nodes[u].op == "getitem")


def _input_bytes(graph: Graph, node: Node) -> float:
    return sum(_nbytes(graph.nodes[i].type) for i in node.inputs)


def _float_dtype(graph: Graph, node: Node) -> str:
    for i in node.inputs:
        t = graph.nodes[i].type
        if t is not None and t.dtype in ("float32", "bfloat16", "float16", "float64"):
            return t.dtype
    return "float32"


def _gemm_flops(graph: Graph, node: Node, args: dict) -> float:
    a = _type(graph, args.get("mat1", args.get("batch1", args.get("self"))))
    out = node.type
    return 2.0 * out.numel * a.shape[-1] if a is not None and out is not None and a.shape else 0.0


def _conv_flops(graph: Graph, node: Node, args: dict) -> float:
    """One convolution's product (non-transposed: output x input channels per group x window), times
    the gradients a backward computes (input and weight: one such product each)."""
    weight = _type(graph, args.get("weight"))
    if weight is None or len(weight.shape) < 3:
        return 0.0
    window = prod(weight.shape[2:])
    if node.op == "aten.convolution.default":
        source = node.type if not args.get("transposed") else _type(graph, args.get("input"))
        return 2.0 * (source.numel if source else 0) * weight.shape[1] * window
    grad = _type(graph, args.get("grad_output")) if not args.get("transposed") else _type(graph, args.get("input"))
    mask = args.get("output_mask") or (True, True, False)
    return 2.0 * (grad.numel if grad else 0) * weight.shape[1] * window * (bool(mask[0]) + bool(mask[1]))


def _attention_flops(graph: Graph, args: dict) -> tuple[float, bool]:
    """Q K^T and P V of one attention call (half of them under a causal mask), and whether it is a backward."""
    q, k, v = (_type(graph, args.get(name)) for name in ("query", "key", "value"))
    if q is None or k is None or v is None:
        return 0.0, False
    pairs = prod(q.shape[:-1]) * k.shape[-2]            # batch x heads x L x S
    flops = 2.0 * pairs * (q.shape[-1] + v.shape[-1])
    if args.get("is_causal"):
        flops /= 2.0
    backward = "grad_out" in args or "grad_out_" in args
    return flops * (ATTENTION_BACKWARD_FLOPS if backward else 1.0), backward


def classify(node: Node) -> str:
    """The class of library kernel an extern node runs (see the module docstring)."""
    if node.kind == Kind.VIEW or node.op in FREE_OPS:
        return "free"
    if node.op in GEMM_OPS or node.kind == Kind.MATMUL:
        return "gemm"
    if node.op in CONV_OPS:
        return "conv"
    if "scaled_dot_product" in node.op:
        return "attention"
    if node.op in GATHER_OPS:
        return "gather"
    if node.op in SCATTER_OPS:
        return "scatter"
    return "memory"


def _bandwidth(spec: HardwareSpec, moved: float, threads: int | None = None) -> float:
    """Bytes/s of the smallest memory level that holds `moved` bytes (GPUs: L2 or main memory); on a CPU,
    what `threads` threads draw from it (each at most a core's bandwidth), all of the chip's when None."""
    levels = [lv for lv in spec.memory if spec.kind == "cpu" or lv.name.lower() not in _GPU_LEVELS_SKIPPED]
    level = next((lv for lv in levels if moved <= lv.size_mib * 2**20), spec.main_memory)
    if spec.kind != "cpu" or threads is None or threads >= spec.compute_units:
        return level.bandwidth_gbs * 1e9
    core = level.core_bandwidth_gbs or level.bandwidth_gbs / spec.compute_units
    return min(level.bandwidth_gbs, max(threads, 1) * core) * 1e9


def extern_cost(graph: Graph, node: Node, spec: HardwareSpec, threads: int | None = None,
                efficiency: Efficiency | None = None) -> ExternCost:
    """The predicted time of one extern node on `spec`, with its FLOPs and bytes; on a CPU run with `threads`
    threads (a local worker's OMP_NUM_THREADS; all of the chip's when None): ATen's kernels use the threads
    they are given, at one core's rate each. `efficiency` in place of its class's (our generated attention,
    priced as ATen's at its own: optimizer/attention.py)."""
    kind = classify(node)
    if kind == "free":
        return ExternCost(node.op, kind, "", 0.0, 0.0, 0.0)
    args = bound_args(node)
    table = GPU if spec.kind == "gpu" else CPU
    eff = efficiency or table[kind]
    out_bytes, in_bytes = _output_bytes(graph, node), _input_bytes(graph, node)
    moved = in_bytes + out_bytes
    flops, launches, precision = 0.0, eff.launches, ""
    dtype = _float_dtype(graph, node)
    if kind == "gemm":
        flops, precision = _gemm_flops(graph, node, args), gemm_precision(dtype, graph.allow_tf32)
    elif kind == "conv":
        flops, precision = _conv_flops(graph, node, args), gemm_precision(dtype, graph.cudnn_allow_tf32)
        if node.op == "aten.convolution_backward.default":
            launches = float(sum(bool(m) for m in (args.get("output_mask") or (True, True, False))))
    elif kind == "attention":
        flops, backward = _attention_flops(graph, args)
        precision = gemm_precision(dtype, False)       # no TF32 path: fp32 attention runs on the fp32 cores
        launches = ATTENTION_BACKWARD_LAUNCHES if backward and spec.kind == "gpu" else launches
    elif kind == "gather":
        index = sum(_nbytes(graph.nodes[i].type) for i in node.inputs
                    if graph.nodes[i].type is not None and not graph.nodes[i].type.dtype.startswith(("float", "bfloat")))
        moved = 2.0 * out_bytes + index                 # the rows it picks, not the whole table
    elif kind == "scatter":
        moved = out_bytes + 2.0 * in_bytes              # the output cleared, the updates read-modify-written
    compute_eff = spec.library_gemm_efficiency if spec.kind == "cpu" and kind == "gemm" else eff.compute
    peak = spec.threads_peak_flops(precision, threads) if spec.kind == "cpu" else spec.peak_flops(precision)
    compute_s = flops / (peak * compute_eff) if flops else 0.0
    memory_s = moved / (_bandwidth(spec, moved, threads) * eff.memory)
    overhead = (spec.launch_overhead_us if spec.kind == "gpu" else spec.call_overhead_us) * 1e-6 * launches
    return ExternCost(node.op, kind, precision, flops, moved, max(compute_s, memory_s) + overhead)
