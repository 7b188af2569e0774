"""tfsn.jax.optimize: a JAX training step through tfsn's optimizer, called as jax.jit's result is.

    import tfsn
    step = tfsn.jax.optimize(train_step)           # as jax.jit(train_step)
    params, opt_state, loss = step(params, opt_state, batch)

Per signature of its arguments (their tree, shapes and dtypes, as jax.jit caches), the step is
traced to a jaxpr, lowered to the IR (frontends/jax.py), planned and scheduled by the same fusion
and search as a torch graph, its kernels generated as C and registered as XLA FFI custom calls
(codegen/xla_ffi.py), and the whole step jitted as one XLA program (jax_runtime.py) in which
everything the generator does not cover runs as XLA runs it. A step whose lowering or code fails
runs as jax.jit(step_fn), with the reason logged: a generator bug must not stop training.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Sequence

import jax

from optimizer.schedule import Schedule
from optimizer.threads import torch_threads

log = logging.getLogger("tfsn.optimizer")

__all__ = ["optimize", "compile_jaxpr", "step_report"]


# Threads each generated kernel runs with inside the XLA program, where the step is not raced: one,
# on the XLA worker thread that calls it, since XLA's pool already runs independent ops on every core
# (codegen/xla_ffi.py says why). A searched step races one thread against torch's count.
KERNEL_THREADS = 1


def compile_jaxpr(closed: Any, *, schedule: Schedule | None = None, top_k: int | None = None,
                  donate: Sequence[int] = (), threads: int | None = None,
                  matmuls: str | None = None) -> tuple[Callable, dict]:
    """A ClosedJaxpr as a jitted function of its flat inputs returning its flat outputs, and what
    was generated ({"kernels": n, "externs": n, "matmuls": "tfsn" | "xla", "threads": n}). Without a
    fixed `schedule`, the plan and every kernel's schedule come from the search (cached on disk, as
    for torch graphs), priced and timed with the threads each kernel runs with, and the step is
    built each way that `matmuls` and `threads` leave open and the fastest kept (_faster): the
    matmuls as tfsn's GEMMs with their fused epilogues or as XLA's dots with the rest of the step
    generated around them; the kernels on one thread or on torch's count. A fixed `schedule` takes
    tfsn's GEMMs and one thread unless told otherwise."""
    import torch

    from optimizer.codegen import compiler
    from optimizer.frontends.jax import from_jaxpr
    from optimizer.ir import Kind

    graph = from_jaxpr(closed)
    gemm = compiler.sgemm_address() is not None
    products = gemm and any(n.kind == Kind.MATMUL for n in graph.nodes)
    if schedule is not None:
        ways = [(matmuls != "xla" and gemm, threads or KERNEL_THREADS)]
    else:
        ways = [(g, t) for g in ([gemm and matmuls != "xla"] if matmuls or not products else [True, False])
                for t in ([threads] if threads else sorted({1, torch.get_num_threads()}))]
    if len(ways) == 1:
        program, stats = _program(graph, *ways[0], schedule, top_k, donate)
        return jax.jit(program, donate_argnums=tuple(donate)), stats
    candidates = [_program(from_jaxpr(closed), g, t, None, top_k, donate) for g, t in ways]
    jitted = [jax.jit(program) for program, _ in candidates]
    times = _faster(jitted, [v.aval for v in closed.jaxpr.invars])
    best = min(range(len(times)), key=times.__getitem__)
    program, stats = candidates[best]
    raced = {f"{s['matmuls']}/{s['threads']}": t * 1e3 for (_, s), t in zip(candidates, times)}
    stats = {**stats, "measured_ms": raced}
    return (jax.jit(program, donate_argnums=tuple(donate)) if donate else jitted[best]), stats


def _program(graph: Any, gemm: bool, threads: int, schedule: Schedule | None, top_k: int | None,
             donate: Sequence[int] = ()) -> tuple[Any, dict]:
    """The graph's plan, its kernels registered with XLA to run on `threads` threads, as a traceable
    Program; `gemm=False` leaves every matmul to XLA's dot. A value that a kernel can write over a
    `donate`d input (flat positions) is written there: its custom call aliases that input's buffer."""
    from optimizer import fusion
    from optimizer.backend import default_top_k, searched_plan
    from optimizer.codegen import c, xla_ffi
    from optimizer.jax_runtime import Program

    if schedule is not None:
        plan = fusion.plan(graph, gemm=gemm)
        schedules = [schedule] * len(plan.groups)
    else:
        with torch_threads(threads):
            plan, schedules = searched_plan(graph, gemm, default_top_k() if top_k is None else top_k, None)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("tfsn fusion plan (jax):\n%s", fusion.describe(graph, plan))
    donated = fusion.donated_writes(graph, plan.groups, plan.buffers, {graph.inputs[i] for i in donate})
    _, kernels = c.write_source(graph, plan.groups, plan.buffers, schedules, {**plan.inplace, **donated})
    targets = xla_ffi.register(kernels, threads) if any(kernels) else {}
    stats = {"kernels": sum(k is not None for k in kernels), "externs": sum(k is None for k in kernels),
             "matmuls": "tfsn" if gemm else "xla", "threads": threads, "written_in_place": len(donated)}
    return Program(graph, plan.groups, kernels, targets, {t: v for v, t in donated.items()}), stats


def step_report(step_fn: Callable, inputs: Sequence[Any], spec: Any = None, top_k: int | None = None) -> Any:
    """`tfsn optimize` of a JAX training step: the step traced once on `inputs` to one jaxpr (forward,
    backward and update together), lowered to the IR and searched, as a StepReport of that one graph.
    On this machine (`spec` None) the search times the top k schedules of each kernel on the threads
    the kernels run with; for a spec of other hardware it predicts only."""
    import time

    from optimizer import search
    from optimizer.backend import default_top_k, searched_plan
    from optimizer.codegen import compiler
    from optimizer.frontends.jax import from_jaxpr
    from optimizer.step import StepReport

    t0 = time.perf_counter()
    graph = from_jaxpr(jax.make_jaxpr(step_fn)(*inputs))
    report = StepReport(hardware="this machine" if spec is None else spec.name,
                        kind="cpu" if spec is None else spec.kind, measured_here=spec is None, names=("step",))
    if spec is None:
        with torch_threads(KERNEL_THREADS):
            searched_plan(graph, compiler.sgemm_address() is not None,
                          default_top_k() if top_k is None else top_k, report.graphs)
    else:
        report.graphs.append((graph, search.search_graph(graph, spec, timing=False)))
    report.seconds = time.perf_counter() - t0
    return report


STEP_ROUNDS = 9                  # rounds of the step variants' race; each round runs every variant once
ROUND_S = 0.004                  # calls per round: enough to last about this long


def _faster(variants: Sequence[Callable], avals: Sequence[Any]) -> list[float]:
    """Seconds per call of each jitted variant on inputs of the step's shapes (ones: no denormals,
    indices in range), timed round-robin; a variant's time is its best round, as the search's
    timing takes it (measure.py): other processes on a shared machine only ever add time. Calls
    are not left to overlap: in training each step reads the last one's parameters, and calls in
    flight at once would favour the variant that leaves cores idle."""
    import time

    inputs = [jax.numpy.ones(a.shape, a.dtype) for a in avals]
    once = []
    for fn in variants:                               # compiles, and one call's time sizes the rounds
        jax.block_until_ready(fn(*inputs))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        once.append(time.perf_counter() - t0)
    calls = max(1, int(ROUND_S / max(min(once), 1e-6)))
    rounds: list[list[float]] = [[] for _ in variants]
    for _ in range(STEP_ROUNDS):
        for fn, times in zip(variants, rounds):
            t0 = time.perf_counter()
            for _ in range(calls):        # each call waited for, as a step that the next one reads
                jax.block_until_ready(fn(*inputs))
            times.append((time.perf_counter() - t0) / calls)
    return [min(t) for t in rounds]


class Optimized:
    """What optimize returns: called as jax.jit(step_fn) is; one compiled program per signature."""

    def __init__(self, fn: Callable, static_argnums: Sequence[int], static_argnames: Sequence[str],
                 donate_argnums: Sequence[int], options: dict) -> None:
        self.fn = fn
        self.static_argnums, self.static_argnames = _static_arguments(fn, static_argnums, static_argnames)
        self.donate_argnums = tuple(donate_argnums)
        self.options = options
        self.compiled: dict[Any, tuple[Callable, Any]] = {}
        self.stats: dict[Any, dict] = {}         # per signature: kernels generated, externs left to XLA
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run, out_tree, leaves = self._program(args, kwargs)
        return jax.tree_util.tree_unflatten(out_tree, run(*leaves))

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The XLA program these arguments run, as jax.jit(fn).lower(...) gives it (its .as_text(),
        its .compile().as_text() after XLA's passes): where the generated kernels' custom calls are seen."""
        run, _, leaves = self._program(args, kwargs)
        return run.lower(*leaves)

    def _program(self, args: tuple, kwargs: dict) -> tuple[Callable, Any, list]:
        """The jitted program of these arguments' signature (compiled on its first call), its
        output tree and the arguments' flat leaves."""
        static = tuple(args[i] for i in self.static_argnums if i < len(args))
        static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        dynamic = [a for i, a in enumerate(args) if i not in self.static_argnums]
        dynamic_kw = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, tree = jax.tree_util.tree_flatten((dynamic, dynamic_kw))
        key = (tree, static, static_kw, bool(jax.config.jax_enable_x64),     # x64 changes what the trace makes
               tuple((jax.numpy.shape(x), jax.numpy.result_type(x), _weak(x)) for x in leaves))
        if key not in self.compiled:
            run, out_tree, self.stats[key] = self._compile(args, dict(static_kw), dynamic, dynamic_kw)
            self.compiled[key] = run, out_tree
        run, out_tree = self.compiled[key]
        return run, out_tree, leaves

    def _compile(self, args: tuple, static_kw: dict, dynamic: list, dynamic_kw: dict) -> tuple[Callable, Any, dict]:
        def flat_fn(dynamic_args: list, kw: dict) -> Any:
            full, it = [], iter(dynamic_args)
            for i in range(len(args)):
                full.append(args[i] if i in self.static_argnums else next(it))
            return self.fn(*full, **kw, **static_kw)

        closed, shape = jax.make_jaxpr(flat_fn, return_shape=True)(dynamic, dynamic_kw)
        out_tree = jax.tree_util.tree_structure(shape)
        donate = _donated_leaves(args, self.static_argnums, self.donate_argnums)
        try:
            run, stats = compile_jaxpr(closed, donate=donate, **self.options)
        except Exception as e:     # noqa: BLE001 - a generator bug must not stop training
            log.warning("tfsn: running a JAX step as jax.jit, its generated code failed: %s", str(e)[:2000])
            run, stats = jax.jit(jax.extend.core.jaxpr_as_fun(closed), donate_argnums=donate), {"fallback": str(e)}
        return run, out_tree, stats


def _static_arguments(fn: Callable, nums: Sequence[int], names: Sequence[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The static positions and names as jax.jit reads them off fn's signature: a negative position
    counts from the last positional parameter, and a static argument is static whether it is passed
    by position or by name."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):     # no signature (a builtin): the positions and names as given
        return tuple(nums), tuple(names)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    positions = {n + len(positional) if n < 0 else n for n in nums} | {positional.index(n) for n in names
                                                                       if n in positional}
    return tuple(sorted(positions)), tuple(sorted(set(names) | {positional[n] for n in positions
                                                                 if 0 <= n < len(positional)}))


def _weak(x: Any) -> bool:
    return bool(getattr(x, "weak_type", False)) or isinstance(x, (int, float, bool, complex))


def _donated_leaves(args: tuple, static: Sequence[int], donated: Sequence[int]) -> tuple[int, ...]:
    """Flat input positions of the donated arguments' leaves (static arguments have none)."""
    out, pos = [], 0
    for i, a in enumerate(args):
        if i in static:
            continue
        n = len(jax.tree_util.tree_leaves(a))
        if i in donated:
            out += range(pos, pos + n)
        pos += n
    return tuple(out)


def optimize(fn: Callable, *, static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
             donate_argnums: int | Sequence[int] = (), schedule: Schedule | None = None,
             top_k: int | None = None, matmuls: str | None = None, threads: int | None = None) -> Callable:
    """`fn` (a function of JAX arrays: a training step, a loss and its gradients) compiled through
    tfsn's optimizer; called as jax.jit(fn, static_argnums=..., static_argnames=..., donate_argnums=...)
    is. `schedule` fixes every kernel's schedule (no search); `top_k`: candidates the search times;
    `matmuls`: "tfsn" (generated or library GEMMs with fused epilogues) or "xla" (XLA's dots) for
    every matmul; `threads`: each kernel's threads. Where either is None, the step is timed each way
    and the fastest kept (compile_jaxpr)."""
    if matmuls not in (None, "tfsn", "xla"):
        raise ValueError(f"tfsn.jax.optimize: matmuls={matmuls!r}; give 'tfsn', 'xla' or None (measured)")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"tfsn.jax.optimize: threads={threads!r}; give a thread count >= 1 or None (measured)")

    def as_tuple(v):
        return (v,) if isinstance(v, (int, str)) else tuple(v)
    return Optimized(fn, as_tuple(static_argnums), as_tuple(static_argnames), as_tuple(donate_argnums),
                     {"schedule": schedule, "top_k": top_k, "matmuls": matmuls, "threads": threads})
