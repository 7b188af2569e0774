"""Step-time and memory prediction for a transformer training step on a hardware spec.

This is the first-order model the planner needs before the full analytical cost model exists: a
roofline over the whole step, plus the data-parallel gradient all-reduce. Every assumption is a named
constant below with its unit and source, and every function is vectorized over hardware so that the
planner prices 100k offers at once.

Model of one optimizer step (synchronous data parallelism, one replica per accelerator):

- FLOPs = tokens x (6 x params + 12 x layers x seq_len x hidden): 6N per token for the dense layers'
  forward and backward (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1) plus
  the attention score and value products, 2 x 2 x seq x hidden per token and layer forward, x3 with the
  backward (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", eq. 3).
- compute time = FLOPs / (devices x peak(dtype) x ACHIEVABLE_FRACTION).
- memory time = HBM bytes moved per device / HBM bandwidth (weights read forward and backward,
  gradients written and read, optimizer state read and written, activations written and read back).
- step time = max(compute, memory) + all-reduce of the gradients + kernel launches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from optimizer.hardware import HardwareSpec

BYTES_PER_ELEMENT = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
TRAIN_DTYPES = ("bf16", "fp16", "fp32")

# Fraction of the dtype's dense peak a well-tuned training step sustains (model FLOPs utilization).
# GPUs: 0.45, between Megatron-LM's 44-52% on A100 (Narayanan et al. 2021, Table 1) and PaLM's 46.2%
# (Chowdhery et al. 2022, Table 3). CPUs: 0.30, an assumption (framework kernels are far less tuned).
ACHIEVABLE_FRACTION = {"gpu": 0.45, "cpu": 0.30}

# Bytes of training state per parameter with Adam: weights + gradients in the training dtype, plus an
# fp32 master copy (mixed precision only) and two fp32 moments. 2+2+4+4+4 = 16 for bf16/fp16 (Rajbhandari
# et al. 2020, "ZeRO", sec. 3.1); 4+4+4+4 = 16 for fp32.
ADAM_MOMENT_BYTES = 8

# Activation bytes kept for the backward pass, per token, layer and hidden unit, in a 16-bit dtype:
# 34 (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 1,
# without the 5·heads·seq/hidden attention-matrix term, which fused (flash) attention does not store).
ACTIVATION_BYTES_16BIT = 34.0

# CUDA context, allocator fragmentation and workspace per device, GiB (assumption).
FRAMEWORK_OVERHEAD_GIB = 1.0

# Kernels launched per layer per step (forward + backward + optimizer), for the launch-overhead term
# (assumption: ~15 forward, ~25 backward kernels per transformer block in eager PyTorch).
KERNELS_PER_LAYER = 40

# Network between nodes when the catalog does not say: 100 Gbps = 12.5 GB/s per node (assumption; the
# common baseline NIC on GPU instances without EFA / RDMA).
DEFAULT_INTER_NODE_GBS = 12.5


@dataclass(frozen=True)
class Workload:
    """A decoder-only transformer trained with Adam; the unit of `batch_size` is sequences per step (global)."""

    params: float            # trainable parameters (count)
    layers: int              # transformer blocks
    hidden: int              # model width (d_model)
    seq_len: int             # tokens per sequence
    batch_size: int          # sequences per optimizer step, all ranks together
    dtype: str = "bf16"      # training dtype: bf16 | fp16 | fp32

    def __post_init__(self) -> None:
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(TRAIN_DTYPES)}")
        for name in ("params", "layers", "hidden", "seq_len", "batch_size"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")

    @property
    def tokens_per_step(self) -> float:
        return float(self.batch_size) * self.seq_len

    @property
    def flops_per_step(self) -> float:
        """Forward + backward FLOPs of one step (see the module docstring)."""
        per_token = 6.0 * self.params + 12.0 * self.layers * self.seq_len * self.hidden
        return self.tokens_per_step * per_token

    @property
    def element_bytes(self) -> int:
        return BYTES_PER_ELEMENT[self.dtype]

    def activation_bytes_per_token(self) -> float:
        """Activations kept for backward, per token (all layers), in the training dtype."""
        return ACTIVATION_BYTES_16BIT * (self.element_bytes / 2) * self.layers * self.hidden


# The reference workload used when a job spec describes no model: GPT-3 XL (1.3B parameters, 24 layers,
# d_model 2048, context 2048, batch 0.5M tokens = 256 sequences), from Brown et al. 2020, "Language Models
# are Few-Shot Learners", Table 2.1; trained in bf16.
REFERENCE_WORKLOAD = Workload(params=1.3e9, layers=24, hidden=2048, seq_len=2048, batch_size=256, dtype="bf16")


def state_bytes_per_param(workload: Workload) -> float:
    """Weights + gradients + Adam state per parameter (16 bytes for every training dtype here)."""
    return _state_bytes(workload.dtype)


def _state_bytes(dtype: str) -> float:
    master = 4 if dtype != "fp32" else 0
    return 2 * BYTES_PER_ELEMENT[dtype] + master + ADAM_MOMENT_BYTES


def memory_gib_needed(workload: Workload) -> float:
    """GiB of accelerator memory one data-parallel replica needs, at its smallest.

    Full training state (weights, gradients, Adam) plus the activations of one sequence (gradient
    accumulation makes up the global batch), plus FRAMEWORK_OVERHEAD_GIB. A device with less memory
    cannot train the model without sharding, which this planner does not assume.
    """
    activations = workload.activation_bytes_per_token() * workload.seq_len
    return training_state_gib(workload.params, workload.dtype) + activations / 2**30


def training_state_gib(params: float, dtype: str) -> float:
    """GiB of weights, gradients and Adam state of `params` parameters trained in `dtype`, plus
    FRAMEWORK_OVERHEAD_GIB: the memory of one replica before its activations."""
    return params * _state_bytes(dtype) / 2**30 + FRAMEWORK_OVERHEAD_GIB


def _traffic_bytes_per_device(workload: Workload, devices: np.ndarray) -> np.ndarray:
    """HBM bytes each device moves per step: a lower bound (perfect reuse inside each kernel).

    Weights read in forward and backward, gradients written then read by the optimizer (4 x element
    bytes per parameter), fp32 master and moments read and written (2 x 12 bytes, 2 x 8 in fp32), and
    each stored activation written once and read once.
    """
    optimizer_state = state_bytes_per_param(workload) - 2 * workload.element_bytes
    per_param = 4 * workload.element_bytes + 2 * optimizer_state
    tokens = workload.tokens_per_step / devices
    return workload.params * per_param + 2 * workload.activation_bytes_per_token() * tokens


def step_seconds_many(workload: Workload, hardware: Sequence[HardwareSpec], counts: Sequence[int] | np.ndarray,
                      nodes: int = 1, inter_node_gbs: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
    """Predicted seconds per optimizer step for each (hardware[i], counts[i] accelerators per node).

    `nodes` nodes of the same kind train together; `inter_node_gbs[i]` is the network bandwidth of a
    node in GB/s (default DEFAULT_INTER_NODE_GBS). A count of 0 means a CPU-only node (one replica).
    The gradient all-reduce is a ring: inside a node over the accelerator link, 2(g-1)/g x gradient bytes
    per device; across nodes, 2(n-1)/n x gradient bytes through each node's NIC (hierarchical all-reduce).
    It is assumed not to overlap the backward pass (an upper bound on its cost).
    """
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    g = np.maximum(np.asarray(counts, dtype=float), 1.0)
    n = float(nodes)
    kind = np.array([h.kind for h in hardware])
    frac = np.where(kind == "gpu", ACHIEVABLE_FRACTION["gpu"], ACHIEVABLE_FRACTION["cpu"])
    peak = np.array([h.peak_flops(workload.dtype) for h in hardware])
    mem_bw = np.array([h.main_memory.bandwidth_gbs for h in hardware]) * 1e9
    launch = np.array([h.launch_overhead_us for h in hardware]) * 1e-6

    devices = g * n
    compute = workload.flops_per_step / (devices * peak * frac)
    memory = _traffic_bytes_per_device(workload, devices) / mem_bw
    grad_bytes = workload.params * workload.element_bytes
    launches = workload.layers * KERNELS_PER_LAYER * launch
    return np.maximum(compute, memory) + allreduce_seconds_many(grad_bytes, hardware, counts, nodes, inter_node_gbs) \
        + launches


def allreduce_seconds_many(grad_bytes: float, hardware: Sequence[HardwareSpec], counts: Sequence[int] | np.ndarray,
                           nodes: int = 1, inter_node_gbs: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
    """Seconds of one data-parallel gradient all-reduce of `grad_bytes` for each (hardware[i], counts[i]
    replicas per node) on `nodes` nodes: a ring inside a node over the accelerator link, 2(g-1)/g x the
    bytes per device, and across nodes 2(n-1)/n x the bytes through each node's NIC (`inter_node_gbs[i]`,
    GB/s; default DEFAULT_INTER_NODE_GBS). Not overlapped with the backward pass: an upper bound."""
    g = np.maximum(np.asarray(counts, dtype=float), 1.0)
    n = float(nodes)
    link = np.array([h.interconnect_gbs for h in hardware]) * 1e9
    net = (np.full(len(hardware), DEFAULT_INTER_NODE_GBS) if inter_node_gbs is None
           else np.asarray(inter_node_gbs, dtype=float)) * 1e9
    return 2.0 * (g - 1.0) / g * grad_bytes / link + 2.0 * (n - 1.0) / n * grad_bytes / net


def adam_update_seconds(params: float, dtype: str, hardware: HardwareSpec) -> float:
    """Seconds of the optimizer's update on one replica: memory bound, each parameter's gradient read, its
    weight read and written, its two fp32 moments read and written (and its fp32 master copy, in mixed
    precision), at the main memory's bandwidth. The searched training step leaves the update out."""
    element = BYTES_PER_ELEMENT[dtype]
    master = 0 if dtype == "fp32" else 2 * 4
    return params * (3 * element + 2 * ADAM_MOMENT_BYTES + master) / (hardware.main_memory.bandwidth_gbs * 1e9)


def predict_step_seconds(workload: Workload, hardware: HardwareSpec, count: int, nodes: int = 1,
                         inter_node_gbs: float | None = None) -> float:
    """Seconds per step of `workload` on `nodes` nodes of `count` x `hardware` (see step_seconds_many)."""
    net = None if inter_node_gbs is None else [inter_node_gbs]
    return float(step_seconds_many(workload, [hardware], [count], nodes, net)[0])


# DDP's buckets (torch.distributed's defaults): the first holds 1 MiB of gradients, each later one 25 MiB; each is
# one all-reduce, each paying the link's latency.
DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES = 1 << 20, 25 << 20


def ddp_buckets(grad_bytes: float) -> int:
    """All-reduces DDP issues per step for `grad_bytes` of gradients."""
    return 1 + math.ceil(max(0.0, grad_bytes - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES)


def local_allreduce_seconds(grad_bytes: float, ranks: int, hardware: HardwareSpec) -> float | None:
    """Seconds of DDP's gradient all-reduce between `ranks` processes of this machine, from the two-process
    gloo figures `tfsn calibrate` measured (None where it did not): a ring, 2(r-1)/r x the bytes at the
    measured rate, and r-1 latencies for each bucket."""
    if not hardware.allreduce_gbs:
        return None
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * ddp_buckets(grad_bytes) * hardware.allreduce_latency_us * 1e-6 \
        + 2.0 * (ranks - 1) / ranks * grad_bytes / (hardware.allreduce_gbs * 1e9)


def measured_update_seconds(tensors: int, params: float, hardware: HardwareSpec) -> float | None:
    """Seconds of torch.optim.AdamW.step over `tensors` parameter tensors of `params` elements in all, from the
    figures `tfsn calibrate` measured on this machine (None where it did not)."""
    if not hardware.update_element_ns:
        return None
    return (hardware.update_fixed_us + hardware.update_tensor_us * tensors) * 1e-6 \
        + hardware.update_element_ns * 1e-9 * params
