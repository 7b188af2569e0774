"""The whole training step through the search, as one report: what `tfsn optimize` prints.

The step is the model's forward on the example inputs and the backward of its loss (the output if
it is a scalar, else the sum of the outputs), captured by AOTAutograd as a forward and a backward
graph. On this machine (`hardware=None`) the graphs are compiled by the tfsn backend, so its search
times the top k schedules of each kernel; on a spec of hardware that is not here, the same graphs
are searched with the cost model only, and run as ATen so that the capture completes.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from optimizer.hardware import HardwareSpec


GRAPH_NAMES = ("forward", "backward")     # a torch step's graphs, as AOTAutograd captures them


@dataclass
class StepReport:
    hardware: str
    kind: str                       # "cpu" or "gpu": how the schedules read
    measured_here: bool
    graphs: list[tuple[Any, Any]] = field(default_factory=list)     # (ir.Graph, search.SearchResult)
    seconds: float = 0.0                                               # capture + search + compile + one step
    names: tuple[str, ...] = GRAPH_NAMES                               # what each graph is (a JAX step: one)

    def name(self, n: int) -> str:
        return self.names[n] if n < len(self.names) else f"graph{n}"

    @property
    def space_size(self) -> int:
        """The candidates the search covers: the graphs are searched one after the other, so their spaces add."""
        return sum(r.space_size for _, r in self.graphs)

    @property
    def collapsed(self) -> int:
        return sum(r.collapsed for _, r in self.graphs)

    @property
    def scored(self) -> int:
        return sum(r.scored for _, r in self.graphs)

    @property
    def scored_per_s(self) -> float:
        seconds = sum(r.score_seconds for _, r in self.graphs)
        return self.scored / seconds if seconds else 0.0

    @property
    def predicted_step_s(self) -> float:
        return sum(r.predicted_s for _, r in self.graphs)

    def to_json(self) -> dict:
        from optimizer import search
        return {"hardware": self.hardware, "measured_here": self.measured_here, "graphs": len(self.graphs),
                "space_size": self.space_size, "space_log10": round(math.log10(self.space_size), 1)
                if self.space_size else 0.0, "scored": self.scored, "collapsed": self.collapsed, "scored_per_s": round(self.scored_per_s),
                "plans_scored": sum(r.plans_scored for _, r in self.graphs),
                "score_s": round(sum(r.score_seconds for _, r in self.graphs), 4),
                "features_s": round(sum(r.feature_seconds for _, r in self.graphs), 3),
                "search_s": round(sum(r.seconds for _, r in self.graphs), 3), "seconds": round(self.seconds, 3),
                "predicted_step_s": self.predicted_step_s,
                "chosen": [search.describe(g, r, gpu=self.kind == "gpu") for g, r in self.graphs],
                "measured": [m for _, r in self.graphs for m in r.measured]}


def plan_json(report: StepReport) -> dict:
    """The chosen plan of every graph as data (`tfsn optimize --emit`): each fusion group with its ops,
    domain, chosen schedule and predicted time; each extern with its class, FLOPs, bytes and predicted
    time; and the totals. GPU schedules read as launch shapes (see costmodel.predict_gpu)."""
    from optimizer import externs, fusion, search

    graphs = []
    for n, (graph, result) in enumerate(report.graphs):
        by_group = {k.group: k for k in result.kernels}
        groups = []
        for i, group in enumerate(result.plan.groups):
            ops = search._ops(graph, fusion.fused_nodes(graph, result.plan.buffers, group))
            if group.kind == "extern":
                cost = externs.extern_cost(graph, graph.nodes[group.nodes[0]], _spec_of(report))
                groups.append({"group": i, "kind": "extern", "ops": ops, **cost.as_dict(),
                               "predicted_s": result.externs.get(i, 0.0)})
                continue
            kernel = by_group[i]
            kind = "gemm" if group.kind == "gemm" else "reduction" if group.reduced else "pointwise"
            entry = {"group": i, "kind": kind, "ops": ops,
                     "domain": list(group.domain), "predicted_s": kernel.predicted_s}
            entry["schedule"] = _gpu_launch(group, kernel.schedule) if report.kind == "gpu" \
                else dataclasses.asdict(kernel.schedule)
            if kernel.measured_s is not None:
                entry["measured_s"] = kernel.measured_s
            groups.append(entry)
        kernels_s = sum(k.predicted_s for k in result.kernels)
        graphs.append({"name": report.name(n),
                       "allow_tf32": graph.allow_tf32, "cudnn_allow_tf32": graph.cudnn_allow_tf32,
                       "groups": groups, "kernels_s": kernels_s, "externs_s": sum(result.externs.values()),
                       "predicted_s": result.predicted_s})
    return {"hardware": report.hardware, "kind": report.kind, "measured_here": report.measured_here,
            "graphs": graphs, "totals": {"kernels_s": sum(g["kernels_s"] for g in graphs),
                                         "externs_s": sum(g["externs_s"] for g in graphs),
                                         "predicted_step_s": report.predicted_step_s}}


def triton_sources(report: StepReport) -> dict[str, tuple[str, list[str | None]]]:
    """Each graph's chosen plan as one Triton module (`tfsn optimize --hardware GPU --emit`): its source and
    the kernel name of every group (None for an extern), by graph name."""
    from optimizer.codegen.triton_combo import write_program
    sources, spec = {}, _spec_of(report)
    for n, (graph, result) in enumerate(report.graphs):
        plan = result.plan
        program = write_program(graph, plan.groups, plan.buffers, result.schedules, plan.inplace, spec)
        sources[report.name(n)] = (program.source, program.kernel_names)
    return sources


def _gpu_launch(group, schedule) -> dict:
    """A GPU candidate's schedule as the launch shape it stands for (the columns predict_gpu reads)."""
    if group.kind == "gemm" and schedule.gemm == "library":    # cuBLAS's product, then the epilogue's tiles
        return {"gemm": "library", "block_m": schedule.gemm_block_rows, "block_n": schedule.gemm_nr,
                "num_warps": schedule.gemm_mr}
    if group.kind == "gemm":
        return {"gemm": "generated", "block_m": schedule.gemm_block_rows, "block_n": schedule.gemm_nr,
                "block_k": schedule.gemm_kc, "num_warps": schedule.gemm_mr, "num_stages": schedule.gemm_stages}
    per = "rows_per_program" if group.reduced else "elements_per_program"
    return {per: schedule.chunk, "num_warps": schedule.gemm_mr}


def _spec_of(report: StepReport) -> HardwareSpec:
    from optimizer.hardware import cpu_spec, find_hardware
    return cpu_spec() if report.measured_here else find_hardware(report.hardware)


def optimize_step(model: torch.nn.Module, inputs: Sequence[Any], spec: HardwareSpec | None = None,
                  top_k: int | None = None) -> StepReport:
    """Search the training step of `model` on `inputs` for `spec` (None: this machine, measured)."""
    from optimizer.backend import make_backend

    report = StepReport(hardware="this machine" if spec is None else spec.name,
                        kind="cpu" if spec is None else spec.kind, measured_here=spec is None)
    backend = make_backend(top_k=top_k, report=report.graphs) if spec is None else _predicting_backend(spec, report)
    t0 = time.perf_counter()
    torch._dynamo.reset()
    try:
        out = torch.compile(model, backend=backend, dynamic=False)(*inputs)
        loss = out if isinstance(out, torch.Tensor) and out.dim() == 0 else _sum_outputs(out)
        if loss.requires_grad:
            loss.backward()
    finally:
        torch._dynamo.reset()
    report.seconds = time.perf_counter() - t0
    return report


def _sum_outputs(out: Any) -> torch.Tensor:
    tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model returned no floating-point tensor to differentiate")
    return sum(t.sum() for t in tensors)


def _predicting_backend(spec: HardwareSpec, report: StepReport):
    """AOTAutograd whose compilers search each graph for `spec` with the model alone and run it as ATen."""
    from optimizer import search
    return predicting_backend(spec, lambda graph: report.graphs.append(
        (graph, search.search_graph(graph, spec, timing=False))))


def predicting_backend(spec: HardwareSpec, on_graph: Callable[[Any], None],
                       on_unsupported: Callable[[str], None] | None = None):
    """AOTAutograd with our decompositions and the partitioner searched for `spec`, whose compilers hand
    each graph (as IR) to `on_graph` and run it as ATen, so that a capture for hardware that is not here
    completes. A graph the IR cannot express goes to `on_unsupported` with the reason (default: skipped)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from optimizer import ir
    from optimizer.backend import decompositions, searched_partition, traced_with_corrections

    def compile_for_spec(gm: torch.fx.GraphModule, example_inputs):
        try:
            graph = ir.from_fx(gm, half=True)
        except ir.Unsupported as err:
            if on_unsupported is not None:
                on_unsupported(str(err))
            return make_boxed_func(gm.forward)
        on_graph(graph)
        return make_boxed_func(gm.forward)

    return traced_with_corrections(aot_autograd(fw_compiler=compile_for_spec, bw_compiler=compile_for_spec,
                                                partition_fn=searched_partition(spec), decompositions=decompositions))
