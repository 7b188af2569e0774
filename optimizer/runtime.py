"""Runs a compiled graph: extern ATen calls and generated kernels over one slot per IR node.

A kernel is one ctypes call on the tensors' data pointers; its outputs are allocated just before
it with the strides the code was generated for. Tensors that reach a kernel from outside (graph
inputs, extern results) are checked against those strides and copied to them when they differ,
so a layout the compiler did not see costs a copy, never a wrong result.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import time
from typing import Any, Callable, Sequence

import torch

from optimizer.codegen.c import Kernel
from optimizer.fusion import mutates
from optimizer.ir import Graph, Kind, Ref, TensorType
from optimizer.loopnest import Group

Step = Callable[[list], None]


def _resolve(a: Any, env: list) -> Any:
    if isinstance(a, Ref):
        return env[a.index]
    if isinstance(a, (list, tuple)):
        return type(a)(_resolve(x, env) for x in a)
    return a


def _holds_ref(a: Any) -> bool:
    return isinstance(a, Ref) or isinstance(a, (list, tuple)) and any(_holds_ref(x) for x in a)


def _conform(t: torch.Tensor, want: TensorType) -> torch.Tensor:
    if t.shape != want.shape:
        raise RuntimeError(f"tfsn: a tensor of shape {tuple(t.shape)} reached a kernel compiled for {want.shape}; "
                           "this is a bug in tfsn's guards, please report it")
    if t.stride() == want.strides:
        return t
    return torch.empty_strided(want.shape, want.strides, dtype=t.dtype, device=t.device).copy_(t)


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


class CompiledGraph:
    """A callable with AOTAutograd's boxed convention (one list of inputs, cleared on entry)."""

    def __init__(self, graph: Graph, groups: Sequence[Group], kernels: Sequence[Kernel | None],
                 lib: Any, inplace: dict[int, int] | None = None) -> None:
        """`lib`: the C kernels' shared object (ctypes), or a library whose `launcher(kernel)` runs a
        kernel on its tensors (codegen/triton.py)."""
        self._boxed_call = True     # on the instance: dynamo's wrappers copy __dict__, not class attributes
        self.size = len(graph)
        self.inputs = list(graph.inputs)
        self.outputs = list(graph.outputs)
        inplace = inplace or {}
        roots = view_roots(graph, groups, kernels)
        kernel_params = {roots.get(p, p) for k in kernels if k is not None for p in k.params}
        from_outside = {n.index for n in graph.nodes if n.kind in (Kind.INPUT, Kind.EXTERN, Kind.MATMUL)}
        self.checked = {i: graph.nodes[i].type for i in kernel_params & from_outside}
        # (slot, strides wanted, whether a step writes over it: then a copy made to conform is copied back)
        written = set(inplace.values()) | {
            n.args[0].index for n in graph.nodes if n.kind == Kind.EXTERN and n.args and isinstance(n.args[0], Ref)
            and mutates(n)}
        self.input_checks = [(i, self.checked[i], i in written) for i in self.inputs if i in self.checked]
        self.steps: list[Step] = []
        uses: list[set[int]] = []
        for group, kernel in zip(groups, kernels):
            if kernel is None:
                node = graph.nodes[group.nodes[0]]
                self.steps.append(self._extern(node.index, node.target, node.args, node.kwargs))
                uses.append(set(node.inputs))
            else:
                self.steps.append(self._kernel(graph, group, kernel, lib, inplace, roots, graph.device))
                uses.append({roots.get(p, p) for p in kernel.params})
        if os.environ.get("TFSN_PROFILE"):
            names = [f"{k.name} {lib._name}" if k is not None else "" for k in kernels]
            self.steps = [_profiled(step, f"{describe(graph, group)} {name}")
                          for step, group, name in zip(self.steps, groups, names)]
        keep = {o.index for o in self.outputs if isinstance(o, Ref)}
        last: dict[int, int] = {}
        for step, used in enumerate(uses):
            for slot in used:
                last[slot] = step
        self.free_after = [[] for _ in self.steps]
        for slot, step in last.items():
            if slot not in keep:
                self.free_after[step].append(slot)

    def _extern(self, n: int, target: Any, args: tuple, kwargs: dict) -> Step:
        want = self.checked.get(n)
        nested = any(isinstance(a, (list, tuple)) and _holds_ref(a) for a in args)
        if nested or any(_holds_ref(v) for v in kwargs.values()):
            # a list of tensors (cat, stack) or a tensor keyword: the arguments resolved in full
            def step(env: list) -> None:
                out = target(*_resolve(args, env), **{k: _resolve(v, env) for k, v in kwargs.items()})
                env[n] = out if want is None else _conform(out, want)
            return step
        # flat positional arguments (views, getitem, convolutions...): the node slots filled in place,
        # a few microseconds less per call than walking the arguments
        slots = [(i, a.index) for i, a in enumerate(args) if isinstance(a, Ref)]
        template = list(args)

        def flat_step(env: list) -> None:
            call = template.copy()
            for i, slot in slots:
                call[i] = env[slot]
            out = target(*call, **kwargs)
            env[n] = out if want is None else _conform(out, want)
        return flat_step

    @staticmethod
    def _kernel(graph: Graph, group: Group, kernel: Kernel, lib: Any, inplace: dict[int, int],
                roots: dict[int, int], device: str) -> Step:
        device = torch.device(device)
        launch = lib.launcher(kernel) if hasattr(lib, "launcher") else None
        if launch is None:
            fn = getattr(lib, kernel.name)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * len(kernel.params)
        allocs = [(n, graph.nodes[n].type.shape, graph.nodes[n].type.strides,
                   getattr(torch, graph.nodes[n].type.dtype)) for n in kernel.outputs
                  if graph.nodes[n].kind != Kind.INPUT]
        aliases = [(n, i) for n, i in inplace.items() if n in group.nodes]   # a value now held by its input
        params = [roots.get(p, p) for p in kernel.params]
        empty = any(d == 0 for d in group.domain)

        def step(env: list) -> None:
            for n, shape, strides, dtype in allocs:
                env[n] = torch.empty_strided(shape, strides, dtype=dtype, device=device)
            if empty:
                pass
            elif launch is None:
                fn(*[env[p].data_ptr() for p in params])
            else:
                launch([env[p] for p in params])
            for n, i in aliases:
                env[n] = env[i]
        return step

    def __call__(self, args: list) -> list:
        env: list = [None] * self.size
        for slot, value in zip(self.inputs, args):
            env[slot] = value
        args.clear()
        write_back = []
        for slot, want, written in self.input_checks:
            given = env[slot]
            env[slot] = _conform(given, want)
            if written and env[slot] is not given:
                write_back.append((given, env[slot]))
        for step, free in zip(self.steps, self.free_after):
            step(env)
            for slot in free:
                env[slot] = None
        for given, conformed in write_back:
            given.copy_(conformed)
        return [env[o.index] if isinstance(o, Ref) else o for o in self.outputs]


PROFILE: dict[str, list[float]] = {}


def describe(graph: Graph, group: Group) -> str:
    ops = "+".join(graph.nodes[n].op.removeprefix("aten.").split(".")[0] for n in group.nodes)
    return f"{group.kind} {list(group.domain) if group.kind != 'extern' else ''} {ops[:60]}"


def _profiled(step: Step, name: str) -> Step:
    """TFSN_PROFILE=1: time every step; the totals print at exit, slowest first."""
    record = PROFILE.setdefault(f"{len(PROFILE):4d} {name}", [0.0, 0])

    def timed(env: list) -> None:
        t0 = time.perf_counter()
        step(env)
        record[0] += time.perf_counter() - t0
        record[1] += 1
    return timed


@atexit.register
def _report() -> None:
    if PROFILE:
        total = sum(v[0] for v in PROFILE.values())
        print(f"tfsn profile: {total * 1e3:.1f} ms in {len(PROFILE)} steps")
        for name, (t, calls) in sorted(PROFILE.items(), key=lambda kv: -kv[1][0])[:25]:
            print(f"  {t * 1e3:9.2f} ms {t / total:6.1%} {calls:5d} calls  {name}")
