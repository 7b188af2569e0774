"""Runs a compiled JAX graph as one traced function: the plan's steps in order, kernels as XLA FFI
custom calls (codegen/xla_ffi.py), externs as the JAX calls the front end gave them
(frontends/jax.py). jax.jit of it is one XLA program, so XLA owns every buffer and schedules the
custom calls beside the ops the generator left to it.

A kernel reads views from their base's buffer: every view node of a JAX graph starts where its
base does (slices are externs there), and has the strides the kernel was written for.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from optimizer.codegen.c import Kernel
from optimizer.codegen.xla_ffi import operands
from optimizer.ir import Graph, Kind, Ref
from optimizer.loopnest import Group

Step = Callable[[list], None]


def root(graph: Graph, n: int) -> int:
    """The buffer that view n reads (n itself when it is no view)."""
    while graph.nodes[n].kind == Kind.VIEW:
        n = graph.nodes[n].args[0].index
    return n


class Program:
    """The graph's steps as a function of its inputs (flat, in graph.inputs order) that returns its
    outputs; meant to be traced by jax.jit."""

    def __init__(self, graph: Graph, groups: Sequence[Group], kernels: Sequence[Kernel | None],
                 targets: dict[str, str], written_over: dict[int, int] | None = None) -> None:
        """`written_over`: donated graph input -> the value a kernel writes over its buffer (the kernel
        was written with that in-place write: fusion.donated_writes)."""
        self.graph = graph
        self.written_over = written_over or {}
        self.steps: list[Step] = [self._extern(g.nodes[0]) if k is None else self._kernel(g, k, targets[k.name])
                                  for g, k in zip(groups, kernels)]

    def value(self, env: list, n: int) -> Any:
        """Node n's value; a view that no step made (one a kernel reads in place) is made here."""
        if env[n] is None and self.graph.nodes[n].kind == Kind.VIEW:
            self._extern(n)(env)
        return env[n]

    def resolve(self, env: list, a: Any) -> Any:
        if isinstance(a, Ref):
            return self.value(env, a.index)
        if isinstance(a, (list, tuple)):
            return type(a)(self.resolve(env, x) for x in a)
        return a

    def _extern(self, n: int) -> Step:
        node = self.graph.nodes[n]

        def step(env: list) -> None:
            env[n] = node.target(*self.resolve(env, node.args))
        return step

    def _kernel(self, group: Group, kernel: Kernel, target: str) -> Step:
        ins = [root(self.graph, p) for p in operands(kernel)]
        types = [self.graph.nodes[o].type for o in kernel.outputs]
        results = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in types]
        outs = list(kernel.outputs)
        # an output written over a donated input: that input is one more operand, its buffer the output's
        over = [o for o in outs if o in self.written_over]
        aliases = {len(ins) + j: outs.index(o) for j, o in enumerate(over)}
        ins += over
        call = jax.ffi.ffi_call(target, results, input_output_aliases=aliases or None)
        outs = [self.written_over.get(o, o) for o in outs]

        def step(env: list) -> None:
            if any(d == 0 for d in group.domain):           # nothing to compute: empty outputs
                values = [jnp.zeros(t.shape, t.dtype) for t in types]
            else:
                values = call(*[env[i] for i in ins])
            for o, v in zip(outs, values):
                env[o] = v
        return step

    def __call__(self, *inputs: Any) -> list:
        env: list = [None] * len(self.graph.nodes)
        for slot, value in zip(self.graph.inputs, inputs):
            env[slot] = value
        for step in self.steps:
            step(env)
        return [self.value(env, o.index) if isinstance(o, Ref) else jnp.asarray(o) for o in self.graph.outputs]
