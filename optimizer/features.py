"""What a fused group does, as the cost model's `KernelFeatures`: read off the IR and the group's
loop nest (optimizer.loopnest: its buffers, loops and the offset of every load), the one every
renderer prints, so the model sees the loops that will run.
"""
from __future__ import annotations

import dataclasses
from math import prod

from optimizer.costmodel import FLAT_ROW, GEMM, POINTWISE, PRECISIONS, REDUCTION, KernelFeatures
from optimizer.expr import stride_along
from optimizer.ir import Graph, Kind, Node
from optimizer.loopnest import Group, LoopNest, Pass, accumulator_dtype, bias_epilogue, fused_nodes, lower
from optimizer.ops import EXPENSIVE

ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def _itemsize(graph: Graph, n: int) -> int:
    return ITEMSIZE.get(graph.nodes[n].type.dtype, 4)


def _bytes(graph: Graph, n: int) -> float:
    return float(graph.nodes[n].type.numel * _itemsize(graph, n))


def kernel_features(graph: Graph, group: Group, buffers: set[int]) -> KernelFeatures:
    """The features of one non-extern group."""
    nest = lower(graph, group, buffers)
    dom = group.domain
    members = set(fused_nodes(graph, buffers, group))
    if group.kind == "gemm":
        return _gemm_features(graph, group, nest, members)
    reduced = group.reduced
    last = nest.order[-1] if dom else 0          # the axis innermost in memory
    column = bool(reduced) and last not in reduced
    var, inner = nest.inner_loop
    elements = float(prod(dom))
    if not reduced:
        rows = elements / inner if len(dom) > 1 else max(elements / FLAT_ROW, 1.0)
    else:
        kept = nest.kept
        rows = float(prod(dom[d] for d in (kept[:-1] if column else kept)))
    ops = math = row_ops = 0.0
    for n in members:
        node = graph.nodes[n]
        if node.kind not in (Kind.POINTWISE, Kind.REDUCE):
            continue
        if node.kind == Kind.POINTWISE and node.type.numel < elements and reduced:
            row_ops += 1.0                     # a per-row value (mean, rstd)
        elif node.op in EXPENSIVE:
            math += 1.0
        else:
            ops += 1.0
    reads = [p for p in nest.params if p not in nest.outputs]
    read_bytes = sum(_bytes(graph, p) for p in reads)
    write_bytes = sum(_bytes(graph, p) for p in nest.outputs)
    strided = {n for n, offset in nest.loads if inner > 1 and stride_along(offset, var) not in (0, 1)}
    passes = carried = 1.0
    if reduced:
        carried = passes = float(sum(isinstance(s, Pass) for s in nest.segments))
        passes += 1.0 if any(graph.nodes[n].kind == Kind.POINTWISE and graph.nodes[n].type.numel == elements
                             for n in group.nodes) else 0.0
    row_bytes = read_bytes / max(rows, 1.0) if reduced and not column else 0.0
    # a column program loads `chunk` adjacent elements of each input a row, one input after the other: the
    # narrowest input read whole decides how much of a sector its loads use (none: the bytes read per element)
    whole = [_itemsize(graph, p) for p in reads if graph.nodes[p].type.numel >= elements]
    load_bytes = float(min(whole)) if whole else min(max(read_bytes / max(elements, 1.0), 1.0), 8.0)
    return KernelFeatures(
        kind=REDUCTION if reduced else POINTWISE, elements=elements, rows=rows, inner=float(inner),
        ops=ops, math=math, row_ops=row_ops, read_bytes=read_bytes, write_bytes=write_bytes,
        strided_bytes=sum(_bytes(graph, n) for n in strided), passes=passes, row_bytes=row_bytes,
        carried=carried if reduced and not column else 0.0, columns=float(dom[last]) if column else 0.0,
        load_bytes=load_bytes, partials=_partials(graph, nest),
        flat=1.0 if len(dom) == 1 and not reduced else 0.0)


def _partials(graph: Graph, nest: LoopNest) -> float:
    """Bytes of one row's partial results of one slice of a split reduction (0: the nest cannot split)."""
    if not nest.splittable:
        return 0.0
    return float(sum(ITEMSIZE[accumulator_dtype(graph.nodes[r.node].type.dtype)] for r in nest.segments[0].reductions))


def gemm_precision(dtype: str, allow_tf32: bool) -> str:
    """The rate a product of `dtype` operands runs at on a GPU (a PRECISIONS name): bf16 / fp16 on tensor
    cores, fp32 on them as TF32 only where the captured model allowed it, else on the fp32 cores."""
    return {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "tf32" if allow_tf32 else "fp32")


def matmul_features(graph: Graph, mm: Node) -> KernelFeatures:
    """The product of a matmul node alone (no epilogue): what a GEMM costs whoever runs it."""
    a, b = (graph.nodes[r.index] for r in mm.args[:2])
    precision = PRECISIONS.index(gemm_precision(a.type.dtype, graph.allow_tf32))
    m, n = mm.type.shape[-2:]
    batch = mm.type.shape[0] if len(mm.type.shape) == 3 else 1
    return KernelFeatures(kind=GEMM, elements=float(batch * m * n), rows=float(batch * m), inner=float(n), ops=0.0,
                          m=float(m), n=float(n), k=float(a.type.shape[-1]), batch=float(batch),
                          b_strided=0.0 if b.type.strides[-1] == 1 else 1.0, precision=float(precision))


def _gemm_features(graph: Graph, group: Group, nest: LoopNest, members: set[int]) -> KernelFeatures:
    """The GEMM's product and its epilogue: the epilogue's arithmetic, reads and writes."""
    mm = graph.nodes[group.nodes[0]]
    operands = {r.index for r in mm.args[:2]}
    pointwise = [graph.nodes[i] for i in members if graph.nodes[i].kind == Kind.POINTWISE]
    math = float(sum(node.op in EXPENSIVE for node in pointwise))
    epilogue_reads = [p for p in nest.params if p not in nest.outputs and p not in operands]
    var, _ = nest.inner_loop
    strided = {i for i, off in nest.loads if i in epilogue_reads and stride_along(off, var) not in (0, 1)}
    return dataclasses.replace(
        matmul_features(graph, mm), ops=len(pointwise) - math, math=math,
        read_bytes=sum(_bytes(graph, p) for p in epilogue_reads),
        write_bytes=sum(_bytes(graph, p) for p in nest.outputs),
        strided_bytes=sum(_bytes(graph, i) for i in strided),
        bias=0.0 if bias_epilogue(graph, nest) is None else 1.0)
