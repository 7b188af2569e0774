"""Attention: when ATen's CPU flash attention (forward or backward) may run as our generated pair
instead (codegen/c_attention.py), what each costs, and which one the search keeps.

The call stays an extern node of the plan (one ATen op returning a tuple); its group's Schedule says
which code runs it (`attention`: "library" or "generated", with `attention_block`). The generated pair
covers what the op's signature carries (a finite scale, is_causal, any lengths, head dims, batch and heads,
any strides) in fp32 without dropout or a mask; the rest stays ATen's. Forward and backward may differ:
the log-sum-exp each writes is the same value, so either backward reads either forward's.

Which one runs is the search's call, as for every kernel: the model's pick when timing is off (a
roofline of the same FLOPs and bytes, no query x key term in either, at each one's efficiency), else
each generated block size is checked against ATen's output on the same inputs and timed against ATen
in the same rounds, and the fastest measured wins.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from optimizer import externs
from optimizer.hardware import HardwareSpec
from optimizer.ir import Graph, Node, Ref, TensorType, contiguous_strides
from optimizer.schedule import DEFAULT, Schedule

log = logging.getLogger("tfsn.optimizer")

FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
BLOCKS = (32, 64, 128)          # query/key rows per block the search times
# Our pair as a fraction of the FMA peak, against ATen's 0.30 (externs.CPU): register-tiled products
# like ATen's, and an exp per score in each direction. Measured at 1 thread on this workplace's AMD EPYC
# (shared, under load): 0.8-1.6x ATen's time at batch 3-4, 4 heads, 128-256 tokens, head dims 32-64;
# faster than ATen's below ~64 tokens, where ATen's fixed cost per call dominates. 0.25: a little below.
GENERATED_CPU = externs.Efficiency(0.25, 0.70)


@dataclass(frozen=True)
class Shape:
    """One attention call as the kernels see it: batch, heads, query and key lengths, head dims of
    query/key (e) and value (ev), the score scale and whether keys after the query's row are masked."""
    batch: int
    heads: int
    queries: int
    keys: int
    e: int
    ev: int
    scale: float
    causal: bool


@dataclass(frozen=True)
class Call:
    """An attention node the generated pair can run: its shape, its tensor arguments in the kernel's
    order (forward: q, k, v; backward: grad_out, q, k, v, out, lse) and the layouts of what it returns."""
    backward: bool
    shape: Shape
    operands: tuple[int, ...]
    results: tuple[TensorType, ...]


def _type(graph: Graph, value: Any) -> TensorType | None:
    return graph.nodes[value.index].type if isinstance(value, Ref) else None


def _result_types(graph: Graph, node: Node, defaults: tuple[TensorType, ...]) -> tuple[TensorType, ...]:
    """The layouts ATen's op returns, read off the getitem nodes that take them; one nothing takes out of
    the tuple gets its default (no reader sees it)."""
    found = {graph.nodes[u].args[1]: graph.nodes[u].type for u in node.users
             if u >= 0 and graph.nodes[u].op == "getitem"}
    return tuple(found.get(i) or d for i, d in enumerate(defaults))


def _dense(shape: tuple[int, ...]) -> TensorType:
    return TensorType(shape, contiguous_strides(shape), "float32")


def call_of(graph: Graph, node: Node) -> Call | None:
    """The call, when node is an attention the generated pair covers; else None (it stays ATen's)."""
    if node.op not in (FORWARD, BACKWARD):
        return None
    args = externs.bound_args(node)
    backward = node.op == BACKWARD
    if args.get("dropout_p", 0.0) or args.get("attn_mask") is not None:
        return None
    names = ("grad_out", "query", "key", "value", "out", "logsumexp") if backward else ("query", "key", "value")
    types = [_type(graph, args.get(n)) for n in names]
    if any(t is None or t.dtype != "float32" for t in types):
        return None
    q, k, v = types[1:4] if backward else types
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4 or q.shape[:2] != k.shape[:2] \
            or k.shape[:2] != v.shape[:2] or k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3] \
            or 0 in q.shape or 0 in k.shape or 0 in v.shape:
        return None
    (b, h, length, e), keys, ev = q.shape, k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(e) if args.get("scale") is None else float(args["scale"])
    if not math.isfinite(scale):       # no C float literal: ATen's
        return None
    shape = Shape(b, h, length, keys, e, ev, scale, bool(args.get("is_causal", False)))
    if backward:
        defaults = (_dense(q.shape), _dense(k.shape), _dense(v.shape))
    else:    # ATen's own: (batch, length, heads, dim) seen as (batch, heads, length, dim)
        defaults = (TensorType((b, h, length, ev), (length * h * ev, ev, h * ev, 1), "float32"),
                    TensorType((b, h, length), (length * h, 1, h), "float32"))
    results = _result_types(graph, node, defaults)
    if any(t.dtype != "float32" for t in results):
        return None
    return Call(backward, shape, tuple(args[n].index for n in names), results)


def predicted_s(graph: Graph, node: Node, spec: HardwareSpec, generated: bool, threads: int | None = None) -> float:
    """The model's seconds of the call run by ATen or by the generated pair with `threads` threads: the same
    FLOPs and the bytes of its operands and results (no query x key tensor in either), each at its own
    efficiency."""
    return externs.extern_cost(graph, node, spec, threads, GENERATED_CPU if generated else None).seconds


@dataclass(frozen=True)
class Choice:
    """The search's pick for one attention call: its schedule, the model's seconds of it, and what the
    clock said (seconds of ATen's and of each generated block size timed; empty when not timed)."""
    schedule: Schedule
    predicted_s: float
    measured: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def measured_s(self) -> float | None:
        """The clock's seconds of the code chosen (None: not timed)."""
        name = "library" if self.schedule.attention != "generated" else f"generated/{self.schedule.attention_block}"
        return self.measured.get(name)


def choose(graph: Graph, node: Node, spec: HardwareSpec, timing: bool, threads: int | None = None) -> Choice | None:
    """The schedule of an attention extern (None: not an attention the pair covers, or not a CPU):
    the model's pick, or with `timing` the fastest measured of ATen and the generated block sizes whose
    output matched ATen's on the same inputs."""
    call = call_of(graph, node)
    if call is None or spec.kind != "cpu":
        return None
    library_s = predicted_s(graph, node, spec, False, threads)
    generated_s = predicted_s(graph, node, spec, True, threads)
    generated = dataclasses.replace(DEFAULT, attention="generated")
    if not timing:
        return Choice(generated, generated_s) if generated_s < library_s else Choice(DEFAULT, library_s)
    from optimizer.codegen import c_attention, compiler
    longest = max(call.shape.queries, call.shape.keys)
    # a block past the longest length is the same kernel as the smallest such one: timed once
    blocks = [b for b in BLOCKS if b < longest] + [next((b for b in BLOCKS if b >= longest), BLOCKS[-1])]
    schedules = [dataclasses.replace(generated, attention_block=b) for b in dict.fromkeys(blocks)]
    try:
        seconds = c_attention.time_against_library(graph, node, call, schedules)
    except compiler.CompileError as e:     # a generator bug: this call's candidates lost, not the graph's
        log.warning("tfsn search: kept ATen's attention: the generated one failed to build (a generator bug; "
                    "please report it): %s: %s", call, str(e)[:2000])
        return Choice(DEFAULT, library_s)
    measured = {"library": seconds[0], **{f"generated/{s.attention_block}": t
                                          for s, t in zip(schedules, seconds[1:]) if t is not None}}
    best = min(measured, key=measured.get)
    log.info("tfsn search: %s %s: %s", "attention backward" if call.backward else "attention", call.shape,
             ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in measured.items()))
    if best == "library":
        return Choice(DEFAULT, library_s, measured)
    return Choice(schedules[[f"generated/{s.attention_block}" for s in schedules].index(best)], generated_s, measured)
