"""The `tfsn` torch.compile backend: AOTAutograd captures forward and backward of the step as
core-ATen graphs; each graph is lowered to the IR, fused, generated as C, compiled and run.

    model = torch.compile(model, backend="tfsn")      # through the entry point
    model = optimizer.backend.optimize(model)          # the same, with options (tfsn.optimize)
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import torch

from optimizer.schedule import DEFAULT, Schedule

log = logging.getLogger("tfsn.optimizer")
aten = torch.ops.aten

# What this process compiled: graphs lowered to kernels, generated kernels, graphs left to ATen.
STATS = {"graphs": 0, "kernels": 0, "aten_graphs": 0}

OPTIONS = {"schedule": "a Schedule applied to every kernel (default: optimizer.schedule.DEFAULT)",
           "fuse": "False runs the captured ATen graphs as they are, without generated kernels"}

# Decomposed further than core ATen, so that the generator sees their pointwise and reduction
# parts (LayerNorm, softmax, GELU, BatchNorm, the optimizers' addcmul/lerp) and can fuse them.
EXTRA_DECOMPOSITIONS = [
    aten.native_layer_norm, aten.native_layer_norm_backward, aten._softmax, aten._softmax_backward_data,
    aten._log_softmax, aten._log_softmax_backward_data, aten.gelu, aten.gelu_backward, aten.silu,
    aten.silu_backward, aten.addcmul, aten.addcdiv, aten.lerp,
    aten._native_batch_norm_legit_functional, aten.native_batch_norm_backward, aten.sigmoid_backward,
    aten.tanh_backward, aten.tril, aten.triu, aten.linalg_vector_norm,
]


def _var_mean(x: torch.Tensor, dim=None, *, correction=None, keepdim: bool = False):
    """var_mean as two row reductions in ATen ops (torch's own goes to prims the generator skips)."""
    dims = list(range(x.dim())) if dim is None else [d % max(x.dim(), 1) for d in dim]
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


@functools.lru_cache(maxsize=None)
def decompositions() -> dict:
    from torch._decomp import core_aten_decompositions, get_decompositions
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(EXTRA_DECOMPOSITIONS))
    table[aten.var_mean.correction] = _var_mean
    table[aten.var.correction] = _var
    return table


def partition(joint: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any):
    """Split the joint graph into forward and backward, recomputing cheap pointwise values in the
    backward instead of saving them: the min-cut partitioner under the cost rules of a fusing
    compiler, since our kernels recompute such values inside loops that run anyway."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor",
                                               num_fwd_outputs=num_fwd_outputs, **kwargs)


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                  schedule: Schedule = DEFAULT, fuse: bool = True) -> Callable:
    """One ATen graph (forward, backward or inference) to a callable; never fails on an op:
    whatever the generator does not cover runs as ATen."""
    from torch._functorch.aot_autograd import make_boxed_func

    from optimizer import fusion, ir
    from optimizer.codegen import c, compiler
    from optimizer.runtime import CompiledGraph

    if not fuse:
        STATS["aten_graphs"] += 1
        return make_boxed_func(gm.forward)
    try:
        graph = ir.from_fx(gm)
    except ir.Unsupported as e:
        log.info("tfsn: running a graph as ATen (%s); mark nothing dynamic to get generated kernels", e)
        STATS["aten_graphs"] += 1
        return make_boxed_func(gm.forward)
    plan = fusion.plan(graph, gemm=compiler.sgemm_address() is not None)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("tfsn fusion plan:\n%s", fusion.describe(graph, plan))
    schedules = [schedule] * len(plan.groups)
    try:
        source, kernels = c.write_source(graph, plan.groups, plan.buffers, schedules)
        lib = compiler.load_library(compiler.build_library(source)) if any(kernels) else None
    except (c.NotFusable, compiler.CompileError) as e:   # a generator bug must not stop training
        log.warning("tfsn: running a graph as ATen, its generated code failed: %s", str(e)[:2000])
        STATS["aten_graphs"] += 1
        return make_boxed_func(gm.forward)
    STATS["graphs"] += 1
    STATS["kernels"] += sum(k is not None for k in kernels)
    return CompiledGraph(graph, plan.groups, kernels, lib)


def make_backend(**options: Any) -> Callable:
    """A torch.compile backend with these options (see OPTIONS)."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"tfsn: unknown option {sorted(unknown)[0]!r}; known options: {', '.join(OPTIONS)}")
    schedule = options.get("schedule", DEFAULT)
    if not isinstance(schedule, Schedule):
        raise ValueError(f"tfsn: schedule must be an optimizer.schedule.Schedule, not {type(schedule).__name__}")
    from torch._dynamo.backends.common import aot_autograd

    compiler = functools.partial(compile_graph, **options)
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition,
                        decompositions=decompositions)


def tfsn_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """The backend registered as `tfsn` (the `torch_dynamo_backends` entry point)."""
    return make_backend()(gm, example_inputs)


def optimize(model: Any, *, dynamic: bool | None = False, fullgraph: bool = False, **options: Any) -> Any:
    """`torch.compile(model, backend="tfsn")` with options. Shapes are static by default: a new
    shape recompiles, since generated kernels are specialized to their shapes and strides."""
    return torch.compile(model, backend=make_backend(**options), dynamic=dynamic, fullgraph=fullgraph)
