"""Runs a compiled graph as one generated Python function: its kernels, externs and views in order.

At compile time the graph's steps are written out as the straight-line body of one function per
graph (`write_entry`, built with compile/exec), so that a call pays for no interpreter loop over step
objects, no slot list and no argument walking: a kernel is an allocation of its outputs with the
strides its code was generated for and one ctypes call on the tensors' data pointers (or a Triton
launch on the tensors), an extern is one call of its ATen op, and a tensor is dropped (`del`) right
after its last reader.

Views are resolved at compile time wherever strides are static: a view (or a chain of views) of a
tensor the graph allocated itself becomes one `as_strided` of that tensor at an offset and strides
computed once, on meta tensors; a view of a tensor from outside (a graph input, an extern's result)
becomes the same `as_strided` when that tensor has the strides the graph was traced with, and replays
the chain of ATen view ops otherwise. Views that only kernels read are no tensor at all
(fusion.pointer_view): the kernel gets their base's data pointer.

Tensors that reach a kernel from outside (graph inputs, extern results) are checked against the
strides the kernel was generated for and copied to them when they differ, so a layout the compiler
did not see costs a copy, never a wrong result.
"""
from __future__ import annotations

import atexit
import ctypes
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from optimizer.codegen.c import Kernel
from optimizer.codegen.c_attention import AttentionKernel
from optimizer.fusion import mutates
from optimizer.ir import Graph, Kind, Node, Ref, TensorType
from optimizer.loopnest import Group


def _empty_strided_cpu() -> Any:
    """torch's private fast CPU allocator (Inductor's wrapper code calls it), or None on a torch without it."""
    try:
        from torch._C._dynamo.guards import _empty_strided_cpu as fast
    except ImportError:
        return None
    return fast


def _conform(t: torch.Tensor, want: TensorType) -> torch.Tensor:
    if t.shape != want.shape:
        raise RuntimeError(f"tfsn: a tensor of shape {tuple(t.shape)} reached a kernel compiled for {want.shape}; "
                           "this is a bug in tfsn's guards, please report it")
    dtype = getattr(torch, want.dtype)
    if t.stride() == want.strides and t.dtype == dtype:
        return t
    return torch.empty_strided(want.shape, want.strides, dtype=dtype, device=t.device).copy_(t)


def view_roots(graph: Graph, groups: Sequence[Group], kernels: Sequence[Kernel | None]) -> dict[int, int]:
    """Kernel parameters that are views with no step of their own (fusion.pointer_view: no torch view
    is made of them), and the tensor whose data pointer each is passed: the nearest base that is a
    tensor at run time (a view with its own step, a slice say, is one)."""
    made = {g.nodes[0] for g in groups if g.kind == "extern"}
    roots = {}
    for p in {p for k in kernels if k is not None for p in k.params}:
        root = p
        while graph.nodes[root].kind == Kind.VIEW and root not in made:
            root = graph.nodes[root].args[0].index
        if root != p:
            roots[p] = root
    return roots


@dataclass(frozen=True)
class StaticView:
    """A view as its layout: `root`'s storage at `offset` (from the root's own) with `shape` and `strides`,
    and the ATen view ops from the root (`chain`) that make it when the root's strides are not `root_strides`."""
    root: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    root_strides: tuple[int, ...]
    chain: tuple[Node, ...]


def static_view(graph: Graph, n: int) -> StaticView | None:
    """View node n as a layout of the nearest tensor that is no view, computed on meta tensors; None where
    it is not one (a reshape that copies, a view op with a tensor argument, a root of no known type)."""
    chain: list[Node] = []
    node = graph.nodes[n]
    while node.kind == Kind.VIEW:
        if not node.args or not isinstance(node.args[0], Ref) or any(
                isinstance(a, Ref) for a in (*node.args[1:], *node.kwargs.values())):
            return None
        chain.append(node)
        node = graph.nodes[node.args[0].index]
    root = node.type
    if root is None or node.kind == Kind.VIEW:
        return None
    base = torch.empty_strided(root.shape, root.strides, dtype=getattr(torch, root.dtype), device="meta")
    t = base
    try:
        for view in reversed(chain):
            t = view.target(t, *view.args[1:], **view.kwargs)
    except (RuntimeError, TypeError, ValueError):
        return None
    want = graph.nodes[n].type
    if not isinstance(t, torch.Tensor) or t._base is not base or want is None \
            or (tuple(t.shape), tuple(t.stride())) != (want.shape, want.strides):
        return None
    return StaticView(node.index, want.shape, want.strides, t.storage_offset(), root.strides, tuple(reversed(chain)))


@dataclass
class _Step:
    lines: list[str]
    uses: set[int]
    defines: set[int]
    name: str = ""
    pure: bool = False          # a view: dropped when nothing reads what it makes


class _EntryWriter:
    """The source of one graph's entry function, and the objects its names stand for."""

    def __init__(self, graph: Graph, groups: Sequence[Group], kernels: Sequence[Kernel | None], lib: Any,
                 inplace: dict[int, int]) -> None:
        self.graph, self.lib, self.inplace = graph, lib, inplace
        self.roots = view_roots(graph, groups, kernels)
        self.names: dict[int, Any] = {}          # id(object) -> its name in the namespace
        self.namespace: dict[str, Any] = {"empty": torch.empty_strided, "conform": _conform,
                                          "device": torch.device(graph.device)}
        self.fast_empty = _empty_strided_cpu() if torch.device(graph.device).type == "cpu" else None
        if self.fast_empty is not None:
            self.namespace["empty_cpu"] = self.fast_empty
        kernel_params = {self.roots.get(p, p) for k in kernels if k is not None for p in k.params}
        from_outside = {n.index for n in graph.nodes if n.kind in (Kind.INPUT, Kind.EXTERN, Kind.MATMUL)}
        self.checked = {i: graph.nodes[i].type for i in kernel_params & from_outside}
        # slots that hold the very tensor a kernel step allocated (no storage offset, the graph's strides)
        aliased = {n for n in inplace if any(n in g.nodes for g in groups)}
        self.owned = {n for k in kernels if k is not None for n in k.outputs
                      if graph.nodes[n].kind != Kind.INPUT and n not in aliased}
        self.views = {g.nodes[0]: v for g, k in zip(groups, kernels)
                      if k is None and graph.nodes[g.nodes[0]].kind == Kind.VIEW
                      for v in [static_view(graph, g.nodes[0])] if v is not None}
        self.direct = self._dense_views(groups, kernels)
        steps = [self._extern(graph.nodes[g.nodes[0]]) if k is None else
                 self._attention(graph.nodes[g.nodes[0]], k) if isinstance(k, AttentionKernel) else self._kernel(g, k)
                 for g, k in zip(groups, kernels)]
        self.steps = [s for s in steps if s is not None]

    def _dense_views(self, groups: Sequence[Group], kernels: Sequence[Kernel | None]) -> dict[int, int]:
        """Kernel outputs that are a tensor only to be viewed once, densely (a weight's gradient transposed
        back, a row sum seen without its kept dim), and that view: the kernel writes into the view's own
        allocation, and neither the output nor an as_strided of it is made."""
        keep = {o.index for o in self.graph.outputs if isinstance(o, Ref)}
        # views some tensor is made of: read by a kernel, by an extern that is no resolved view, or returned
        read = keep | {self.roots.get(p, p) for k in kernels if k is not None for p in k.params} | {
            i for g, k in zip(groups, kernels) if k is None and g.nodes[0] not in self.views
            for i in self.graph.nodes[g.nodes[0]].inputs}
        readers: dict[int, list[int]] = {}
        for g, k in zip(groups, kernels):
            n = g.nodes[0]
            if k is None and (n not in self.views or n in read):
                for i in [self.views[n].root] if n in self.views else self.graph.nodes[n].inputs:
                    readers.setdefault(i, []).append(n)
        direct = {}
        for n, view in self.views.items():
            r, root = view.root, self.graph.nodes[view.root].type
            if r in self.owned and r not in keep and readers.get(r) == [n] and view.offset == 0 \
                    and math.prod(view.shape) == math.prod(root.shape) \
                    and _dense(root.shape, root.strides) and _dense(view.shape, view.strides):
                direct[r] = n
        return direct

    def empty(self, shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype) -> str:
        """The source of an uninitialized tensor on the graph's device: on a CPU, the allocator Inductor's
        generated code calls (0.4 us against torch.empty_strided's 1.2 here: a small graph makes dozens)."""
        if self.fast_empty is not None:
            return f"empty_cpu({shape}, {strides}, {self.name(dtype)})"
        return f"empty({shape}, {strides}, dtype={self.name(dtype)}, device=device)"

    def name(self, value: Any, prefix: str = "c") -> str:
        """The namespace's name for an object (a constant argument, an op, a kernel)."""
        if id(value) not in self.names:
            self.names[id(value)] = f"{prefix}{len(self.names)}"
            self.namespace[self.names[id(value)]] = value
        return self.names[id(value)]

    def expr(self, a: Any) -> str:
        """An extern's argument as source: a node's local, a list of them, or a named constant."""
        if isinstance(a, Ref):
            return f"v{a.index}"
        if isinstance(a, (list, tuple)) and any(isinstance(x, (Ref, list, tuple)) for x in a):
            inner = ", ".join(self.expr(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner},)"
        if a is None or isinstance(a, (bool, int, str)) or isinstance(a, float) and math.isfinite(a):
            return repr(a)
        return self.name(a)

    def call(self, node: Node, args: list[str]) -> str:
        kwargs = [f"{k}={self.expr(v)}" for k, v in node.kwargs.items()]
        return f"{self.name(node.target, 'op')}({', '.join(args + kwargs)})"

    def _kernel(self, group: Group, kernel: Kernel) -> _Step:
        lines = []
        made = [n for n in kernel.outputs if self.graph.nodes[n].kind != Kind.INPUT]
        for n in made:
            t = self.graph.nodes[n].type
            if n in self.direct:
                n, t = self.direct[n], self.graph.nodes[self.direct[n]].type
            lines.append(f"v{n} = {self.empty(t.shape, t.strides, getattr(torch, t.dtype))}")
        params = [self.direct.get(p, p) for p in (self.roots.get(p, p) for p in kernel.params)]
        if any(d == 0 for d in group.domain):
            pass
        elif hasattr(self.lib, "launcher"):
            lines.append(f"{self.name(self.lib.launcher(kernel), 'k')}([{', '.join(f'v{p}' for p in params)}])")
        else:
            fn = getattr(self.lib, kernel.name)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * len(params)
            lines.append(f"{self.name(fn, 'k')}({', '.join(f'v{p}.data_ptr()' for p in params)})")
        aliases = [(n, i) for n, i in self.inplace.items() if n in group.nodes]   # a value now held by its input
        lines += [f"v{n} = v{i}" for n, i in aliases]
        defines = {self.direct.get(n, n) for n in made} | {n for n, _ in aliases}
        return _Step(lines, set(params), defines, f"{describe(self.graph, group)} {kernel.name}")

    def _attention(self, node: Node, kernel: AttentionKernel) -> _Step:
        """A generated attention in place of ATen's call: its operands at the strides it was generated for,
        its results allocated as ATen's, and the tuple ATen's op returns, for the getitems that follow."""
        lines = [f"if v{p}.stride() != {self.graph.nodes[p].type.strides}: v{p} = conform(v{p}, "
                 f"{self.name(self.graph.nodes[p].type)})" for p in dict.fromkeys(kernel.params)]
        results = [self.empty(t.shape, t.strides, torch.float32) for t in kernel.results]
        fn = getattr(self.lib, kernel.name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * (len(kernel.params) + len(kernel.results))
        lines += [f"v{node.index} = ({', '.join(results)},)",
                  f"{self.name(fn, 'k')}({', '.join(f'v{p}.data_ptr()' for p in kernel.params)}, "
                  f"*[r.data_ptr() for r in v{node.index}])"]
        return _Step(lines, set(kernel.params), {node.index}, f"attention (generated) {kernel.name}")

    def _extern(self, node: Node) -> _Step | None:
        n = node.index
        if n in self.views:
            return None if n in self.direct.values() else self._view(n, self.views[n])
        if node.op == "getitem" and isinstance(node.args[0], Ref) and isinstance(node.args[1], int):
            lines = [f"v{n} = v{node.args[0].index}[{node.args[1]}]", *self._as_traced(node)]
            return _Step(lines, {node.args[0].index}, {n}, pure=True)
        lines = [f"v{n} = {self.call(node, [self.expr(a) for a in node.args])}"]
        if node.kind != Kind.VIEW:
            lines += self._as_traced(node)
        return _Step(lines, set(node.inputs), {n}, pure=node.kind == Kind.VIEW)

    def _as_traced(self, node: Node) -> list[str]:
        """Source that gives an extern's result the dtype it was traced with, and the strides a kernel reading
        it was generated for. Kernels, and the graphs that take a saved tensor, read raw memory as the traced
        dtype, and a kernel can disagree with its meta function: ATen's native_group_norm of a bf16 input with
        fp32 weight returns fp32 mean and rstd where the trace says bf16 (bf16 GroupNorm's gradients were NaN
        while it ran as an extern), and so may a custom op."""
        n, t = node.index, node.type
        if t is None:
            return []
        dtype = self.name(getattr(torch, t.dtype))
        want = self.checked.get(n)
        if want is None:
            return [f"if v{n}.dtype != {dtype}: v{n} = v{n}.to({dtype})"]
        return [f"if v{n}.stride() != {want.strides} or v{n}.dtype != {dtype}: v{n} = conform(v{n}, {self.name(want)})"]

    def _view(self, n: int, view: StaticView) -> _Step:
        r = view.root
        if r in self.owned:
            line = f"v{n} = v{r}.as_strided({view.shape}, {view.strides}, {view.offset})"
        else:
            replay = f"v{r}"
            for node in view.chain:
                replay = self.call(node, [replay] + [self.expr(a) for a in node.args[1:]])
            line = (f"v{n} = v{r}.as_strided({view.shape}, {view.strides}, v{r}.storage_offset() + {view.offset}) "
                    f"if v{r}.stride() == {view.root_strides} else {replay}")
        return _Step([line], {r}, {n}, pure=True)


def write_entry(graph: Graph, groups: Sequence[Group], kernels: Sequence[Kernel | None], lib: Any,
                inplace: dict[int, int], profile: dict | None = None) -> tuple[str, dict[str, Any]]:
    """The source of the graph's entry function `run(args)` (AOTAutograd's boxed convention: the list of
    inputs, cleared on entry) and its namespace. With `profile`, each step adds its seconds and calls there."""
    w = _EntryWriter(graph, groups, kernels, lib, inplace)
    keep = {o.index for o in graph.outputs if isinstance(o, Ref)}
    steps = _live(w.steps, keep)
    written = written_nodes(graph, inplace)
    body = [f"{', '.join(f'v{i}' for i in graph.inputs)}{',' if len(graph.inputs) == 1 else ''} = args"
            if graph.inputs else "pass", "args.clear()"]
    write_back = any(i in written for i in w.checked)
    if write_back:
        body.append("written_back = []")
    for i in graph.inputs:
        want = w.checked.get(i)
        if want is None:
            continue
        fix = f"given = v{i}; v{i} = conform(v{i}, {w.name(want)}); written_back.append((given, v{i}))" \
            if i in written else f"v{i} = conform(v{i}, {w.name(want)})"
        body.append(f"if v{i}.stride() != {want.strides}: {fix}")     # conform checks the shape
    last: dict[int, int] = {}
    for s, step in enumerate(steps):
        for slot in step.uses | step.defines:
            last[slot] = s
    for s, step in enumerate(steps):
        dead = [f"v{slot}" for slot in sorted(step.uses | step.defines) if last[slot] == s and slot not in keep]
        lines = step.lines + ([f"del {', '.join(dead)}"] if dead else [])
        if profile is not None:
            record = profile.setdefault(f"{len(profile):4d} {step.name or lines[0][:70]}", [0.0, 0])
            lines = ["t0 = perf_counter()", *lines,
                     f"{w.name(record)}[0] += perf_counter() - t0; {w.name(record)}[1] += 1"]
        body += lines
    if write_back:
        body.append("for given, conformed in written_back: given.copy_(conformed)")
    body += ["return [" + ", ".join(f"v{o.index}" if isinstance(o, Ref) else w.expr(o) for o in graph.outputs) + "]"]
    w.namespace["perf_counter"] = time.perf_counter
    device = torch.device(graph.device)
    if hasattr(lib, "launcher") and device.type == "cuda" and device.index is not None:
        # Triton launches on the current device's current stream, not the tensors': a graph on cuda:1 called
        # with cuda:0 current would run its kernels in cuda:0's context on cuda:1's memory (Inductor's
        # generated code guards the same way)
        w.namespace["on_device"] = torch.cuda._DeviceGuard
        body = body[:2] + [f"with on_device({device.index}):"] + [f"    {line}" for line in body[2:]]
    return "def run(args):\n" + "".join(f"    {line}\n" for line in body), w.namespace


def written_nodes(graph: Graph, inplace: dict[int, int]) -> set[int]:
    """The nodes whose tensor the graph writes over: inputs a kernel writes in place (an optimizer's
    update, BatchNorm's running statistics) and the first argument of every mutating extern."""
    return set(inplace.values()) | {
        n.args[0].index for n in graph.nodes if n.kind == Kind.EXTERN and n.args and isinstance(n.args[0], Ref)
        and mutates(n)}


def _dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a layout covers its storage from offset 0, each element once (so any two such layouts of as
    many elements cover the same bytes)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(shape, strides) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return math.prod(shape) > 0


def _live(steps: list[_Step], keep: set[int]) -> list[_Step]:
    """The steps less the views nothing reads (a chain resolved to one as_strided leaves its links unread)."""
    while True:
        read = keep.union(*(s.uses for s in steps))
        live = [s for s in steps if not s.pure or s.defines & read]
        if len(live) == len(steps):
            return steps
        steps = live


class CompiledGraph:
    """A callable with AOTAutograd's boxed convention (one list of inputs, cleared on entry): the
    graph's generated entry function (write_entry; its source is `self.source`)."""

    def __init__(self, graph: Graph, groups: Sequence[Group], kernels: Sequence[Kernel | None],
                 lib: Any, inplace: dict[int, int] | None = None) -> None:
        """`lib`: the C kernels' shared object (ctypes), or a library whose `launcher(kernel)` runs a
        kernel on its tensors (codegen/triton.py)."""
        self._boxed_call = True     # on the instance: dynamo's wrappers copy __dict__, not class attributes
        self.source, namespace = write_entry(graph, groups, kernels, lib, inplace or {},
                                             PROFILE if os.environ.get("TFSN_PROFILE") else None)
        exec(compile(self.source, f"<tfsn graph of {len(graph)} nodes>", "exec"), namespace)
        self.run = namespace["run"]

    def __call__(self, args: list) -> list:
        return self.run(args)


PROFILE: dict[str, list[float]] = {}


def describe(graph: Graph, group: Group) -> str:
    ops = "+".join(graph.nodes[n].op.removeprefix("aten.").split(".")[0] for n in group.nodes)
    return f"{group.kind} {list(group.domain) if group.kind != 'extern' else ''} {ops[:60]}"


@atexit.register
def _report() -> None:
    if PROFILE:
        total = sum(v[0] for v in PROFILE.values())
        print(f"tfsn profile: {total * 1e3:.1f} ms in {len(PROFILE)} steps")
        for name, (t, calls) in sorted(PROFILE.items(), key=lambda kv: -kv[1][0])[:25]:
            print(f"  {t * 1e3:9.2f} ms {t / total:6.1%} {calls:5d} calls  {name}")
