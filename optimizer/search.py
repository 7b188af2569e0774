"""The search: for one captured graph (a forward or a backward of the training step), the fusion
plan and the schedule of every kernel, chosen by the cost model and settled by timing.

The space is the product of the fusion decisions (store or recompute each value read by several
kernels, fuse each GEMM's epilogue or not: `fusion.decision_points`) and, for every kernel of a
plan, its schedule space (`space.kernel_space`: vector width, unroll, parallel axis and chunk,
column blocks, library GEMM or a generated micro-kernel with its register and cache tiles).
Kernels of one plan are independent given the plan, so a plan's cost is the sum of its kernels'
best predictions; the plans themselves are searched exhaustively when there are few decisions,
else by a beam search that flips one decision at a time. Then only the top k schedules of each
kernel worth timing are compiled (one library), checked against the output of the kernel's default
schedule on the same inputs (a candidate that computes something else is discarded), and timed
here; the fastest measured wins. A win within the timing noise is a tie, timed again on later runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from optimizer import costmodel, externs, features, fusion
from optimizer.hardware import HardwareSpec
from optimizer.ir import Graph, Kind
from optimizer.loopnest import Group, NotFusable, kernel_key
from optimizer.schedule import DEFAULT, Schedule
from optimizer.target import Target, Timing, target_for

log = logging.getLogger("tfsn.optimizer")

EXHAUSTIVE_MAX_DECISIONS = 6      # up to 2^6 plans: all of them
BEAM_WIDTH = 4
MAX_PLANS = 48                    # plans a beam search scores per graph at most (each costs a fusion pass)
# Nodes the fusion passes of one search may lower (ir.Graph.lowered_nodes) after its first plan, ~6 s on a
# 2-core CPU; the suite's models take under 3,000. A fusion pass lowers each group again as it grows, so
# groups of hundreds of members (a recurrence unrolled in Python: RWKV over 9 tokens took 188 s to its first
# step, most of it in 48 plans of its backward) make each plan cost seconds: such a graph scores fewer plans.
PLANNING_BUDGET = 100_000
MIN_TIMED_S = 20e-6               # kernels predicted faster than this are not worth timing: the model's pick
TOP_K = 8
NEAR_BEST = 1.5                   # candidates predicted within this factor of the best are close calls
RETIMES = 3                       # later runs that time a tied kernel again, at most: then its choice stays


@dataclass
class KernelResult:
    """One kernel of the chosen plan: its schedule and what the model and the clock said."""
    group: int
    predicted_s: float
    measured_s: float | None
    schedule: Schedule
    timed: list[tuple[float, float]] = field(default_factory=list)   # (predicted, measured) of each timed candidate


@dataclass
class Tie:
    """A kernel whose fastest candidates were too close to call: the winner's best time plus its
    spread reached another's best. Why: on a loaded machine either could have won; the choice is
    timed again on later runs (backend.searched_plan, `retime`) instead of pinned for good."""
    groups: list[int]              # the plan's groups that run this kernel (layers repeat kernels)
    schedules: list[Schedule]      # the tied candidates, fastest measured first
    retimed: int = 0               # re-timings so far, at most RETIMES


@dataclass
class SearchResult:
    plan: fusion.Plan
    choice: fusion.Choice
    schedules: list[Schedule]          # per group of the plan (DEFAULT for externs)
    space_size: int                    # fusion plans x the sum of their kernels' distinct schedules (default plan)
    plans_scored: int
    scored: int                        # (kernel, schedule) candidates the model scored
    collapsed: int                     # candidates not scored: the model prices them as a scored twin
    score_seconds: float               # time in the cost model's scoring
    feature_seconds: float             # time reading the kernels' features off the generator
    seconds: float                     # the whole search, timing included
    predicted_s: float                 # the chosen plan at its chosen schedules, predicted (what the model prices;
                                       # on a GPU, less the launches its kernels run together save)
    kernels: list[KernelResult]
    ties: list[Tie] = field(default_factory=list)     # kernels whose choice was too close to call
    externs: dict[int, float] = field(default_factory=dict)   # predicted seconds of each extern group, by group
    externs_measured: dict[int, float] = field(default_factory=dict)   # the timed ones' (attention), by group

    @property
    def expected_s(self) -> float:
        """The chosen plan's time on this machine: a kernel or extern the search timed at no less than its
        measured time (its best run, caches warm from the runs before: inside a step it runs no faster), the
        rest as predicted. What a step of this graph is planned to take (`tfsn plan` on local nodes)."""
        return sum(max(k.predicted_s, k.measured_s or 0.0) for k in self.kernels) + \
            sum(max(s, self.externs_measured.get(g, 0.0)) for g, s in self.externs.items())

    @property
    def measured(self) -> list[dict]:
        return [{"predicted_s": p, "measured_s": m} for k in self.kernels for p, m in k.timed]


class _Scorer:
    """Features and best predictions per distinct kernel, shared by every plan that contains it."""

    def __init__(self, graph: Graph, target: Target, threads: int | None) -> None:
        self.graph, self.target, self.threads = graph, target, threads
        self.features: list[costmodel.KernelFeatures] = []
        self.tables: list[costmodel.Candidates] = []   # per kernel: its candidates, their predictions, the best
        self.predicted: list[np.ndarray] = []
        self.best: list[float] = []
        self.index: dict[tuple, int] = {}
        self.externs: dict[int, float] = {}
        self.scored = 0
        self.collapsed = 0             # candidates left out as twins of a scored one (costmodel.distinct)
        self.seconds = 0.0             # in the cost model's scoring
        self.feature_seconds = 0.0     # reading kernels' features off the generator

    def key(self, group: Group, buffers: set[int]) -> tuple:
        return kernel_key(self.graph, buffers, group)

    def score_plans(self, plans: list[fusion.Plan]) -> list[float]:
        """Each plan's sum of the best predicted time of its kernels; the kernels no plan scored
        before are extracted, then scored together in one vectorized batch."""
        keys = [[self.key(g, p.buffers) if g.kind != "extern" else None for g in p.groups] for p in plans]
        t0 = time.perf_counter()
        start = len(self.features)
        broken = set()
        for i, (plan, plan_keys) in enumerate(zip(plans, keys)):
            for g, k in zip(plan.groups, plan_keys):
                if k is not None and k not in self.index:
                    try:
                        kernel = features.kernel_features(self.graph, g, plan.buffers)
                    except NotFusable:          # a plan the generator cannot write: never chosen
                        broken.add(i)
                        continue
                    self.index[k] = len(self.features)
                    self.features.append(kernel)
        self.feature_seconds += time.perf_counter() - t0
        if len(self.features) > start:
            t0 = time.perf_counter()
            new_kernels = self.features[start:]      # rows index them from 0
            table = costmodel.FeatureTable(new_kernels)
            cands = costmodel.Candidates.concat([self.target.schedule_space(i, f) for i, f in enumerate(new_kernels)])
            distinct = costmodel.distinct(table, cands, self.target.spec)
            self.collapsed += len(cands) - len(distinct)
            cands = cands.take(distinct)
            predicted = self.target.predict(table, cands, self.threads)
            bounds = np.flatnonzero(np.diff(cands.kernel)) + 1
            for rows, preds in zip(np.split(np.arange(len(cands)), bounds), np.split(predicted, bounds)):
                self.tables.append(cands.take(rows))
                self.predicted.append(preds)
                self.best.append(float(preds.min()))
            self.seconds += time.perf_counter() - t0
            self.scored += len(cands)
        return [math.inf if i in broken or any(k is not None and k not in self.index for k in plan_keys) else
                sum(self.best[self.index[k]] if k is not None else self.extern_s(g)
                    for g, k in zip(plan.groups, plan_keys)) for i, (plan, plan_keys) in enumerate(zip(plans, keys))]

    def extern_s(self, group: Group) -> float:
        """An ATen call's predicted time (optimizer/externs.py: a roofline per class of library kernel);
        on a CPU, a matmul left to the library is priced as our library GEMM of one block with no epilogue,
        so that fused and unfused plans compare alike."""
        node = self.graph.nodes[group.nodes[0]]
        if node.index not in self.externs:
            if self.target.spec.kind == "cpu" and node.kind == Kind.MATMUL and node.type is not None:
                kernel = features.matmul_features(self.graph, node)
                one_call = dataclasses.replace(DEFAULT, gemm="library", gemm_block_rows=max(int(kernel.m), 1),
                                               parallel_axis=-1)
                self.externs[node.index] = float(self.target.predict(
                    costmodel.FeatureTable([kernel]), costmodel.Candidates.of(0, [one_call]), self.threads)[0])
            else:
                self.externs[node.index] = externs.extern_cost(self.graph, node, self.target.spec,
                                                               self.threads).seconds
        return self.externs[node.index]

    def fits(self, group: Group, buffers: set[int], schedule: Schedule) -> bool:
        """Whether the chip can run this kernel under `schedule`, by the model (which prices a launch a GPU
        refuses, a tile over a block's shared memory or registers, at infinity)."""
        table = costmodel.FeatureTable([self.features[self.index[self.key(group, buffers)]]])
        return bool(np.isfinite(self.target.predict(table, costmodel.Candidates.of(0, [schedule]), self.threads)[0]))

    def ranked(self, group: Group, buffers: set[int]) -> tuple[costmodel.Candidates, np.ndarray]:
        i = self.index[self.key(group, buffers)]
        order = np.argsort(self.predicted[i], kind="stable")
        return self.tables[i].take(order), self.predicted[i][order]


@contextlib.contextmanager
def _older_objects_frozen():
    """The search makes and keeps many small objects (every loop nest it lowers stays in graph.memo), so
    the collector runs full passes during it, and each would walk the whole process's heap (torch, the
    model). The objects older than the search are left out of those passes (gc.freeze) while it runs,
    unless the caller froze objects of its own or turned the collector off."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def search_graph(graph: Graph, target: Target | HardwareSpec, *, gemm: bool = True, top_k: int = TOP_K,
                 timing: bool = True, threads: int | None = None, max_plans: int | None = None) -> SearchResult:
    """The best plan and schedules for `graph` on `target` (or a hardware spec's target:
    target.target_for); `timing=False` (hardware not present) keeps the model's picks; `max_plans`
    bounds the fusion plans scored (default MAX_PLANS)."""
    with _older_objects_frozen():
        return _search_graph(graph, target, gemm=gemm, top_k=top_k, timing=timing, threads=threads,
                             max_plans=max_plans)


def _search_graph(graph: Graph, target: Target | HardwareSpec, *, gemm: bool, top_k: int, timing: bool,
                  threads: int | None, max_plans: int | None) -> SearchResult:
    if isinstance(target, HardwareSpec):
        target = target_for(target)
    bounded = max_plans is not None
    max_plans = MAX_PLANS if max_plans is None else max_plans
    t0 = time.perf_counter()
    scorer = _Scorer(graph, target, threads)
    points = fusion.decision_points(graph, gemm)
    costs: dict[tuple[bool, ...], float] = {}
    plans: dict[tuple[bool, ...], fusion.Plan] = {}

    start = (False,) * len(points)
    planned_from = None           # graph.lowered_nodes once the first plan is built

    def over_budget() -> bool:
        return planned_from is not None and graph.lowered_nodes - planned_from > PLANNING_BUDGET

    def evaluate(batch: list[tuple[bool, ...]]) -> None:
        """Plan and score every new decision vector of `batch` (one scoring call for all), those after
        the first plan while the planning budget lasts."""
        nonlocal planned_from
        built = []
        for flips in dict.fromkeys(f for f in batch if f not in costs):
            if over_budget():
                log.info("tfsn: search of a %d-node graph stopped after %d plans: their fusion passes lowered "
                         "%d nodes (PLANNING_BUDGET)", len(graph.nodes), len(costs) + len(built),
                         graph.lowered_nodes - planned_from)
                break
            plans[flips] = fusion.plan(graph, gemm=gemm, choice=fusion.choice_of(points, flips))
            built.append(flips)
            if planned_from is None:
                planned_from = graph.lowered_nodes
        for flips, cost in zip(built, scorer.score_plans([plans[f] for f in built])):
            costs[flips] = cost

    # every plan when there are few decisions (up to 2^6 for a full search; a bounded one stays in its bound)
    if len(points) <= EXHAUSTIVE_MAX_DECISIONS and (not bounded or 2 ** len(points) <= max_plans):
        evaluate(list(itertools.product((False, True), repeat=len(points))))
    else:
        evaluate([start])
        beam = [start]
        while len(costs) < max_plans and not over_budget():
            moves = [b[:i] + (not b[i],) + b[i + 1:] for b in beam for i in range(len(points))]   # best parent first
            moves = [m for m in dict.fromkeys(moves) if m not in costs][:max_plans - len(costs)]
            evaluate(moves)
            best = sorted(costs, key=costs.get)[:BEAM_WIDTH]
            if best == beam or not moves:
                break
            beam = best
    flips = min(costs, key=costs.get)
    if math.isinf(costs[flips]):
        raise NotFusable("no fusion plan of this graph can be generated")
    plan = plans[flips]
    kernels, ties = _settle(graph, plan, scorer, top_k if timing else 1)
    schedules = [DEFAULT] * len(plan.groups)
    for k in kernels:
        schedules[k.group] = k.schedule
    keys = [scorer.key(g, plans[start].buffers) for g in plans[start].groups if g.kind != "extern"]
    # given a plan its kernels are independent, so their schedules add: the space the search covers
    space_size = 2 ** len(points) * sum(len(scorer.tables[scorer.index[k]]) for k in keys if k in scorer.index)
    extern_times = {i: scorer.extern_s(g) for i, g in enumerate(plan.groups) if g.kind == "extern"}
    extern_measured: dict[int, float] = {}
    _choose_attention(graph, plan, target.spec, timing and top_k > 1, scorer.threads, schedules, extern_times,
                      extern_measured)
    predicted = sum(k.predicted_s for k in kernels) + sum(extern_times.values()) - \
        target.launches_saved(graph, plan, schedules) * target.spec.launch_overhead_us * 1e-6
    return SearchResult(plan=plan, choice=fusion.choice_of(points, flips), schedules=schedules,
                        space_size=space_size, plans_scored=len(costs),
                        scored=scorer.scored, collapsed=scorer.collapsed, score_seconds=scorer.seconds,
                        feature_seconds=scorer.feature_seconds, seconds=time.perf_counter() - t0,
                        predicted_s=predicted, kernels=kernels, ties=ties, externs=extern_times,
                        externs_measured=extern_measured)


def _choose_attention(graph: Graph, plan: fusion.Plan, spec: HardwareSpec, timing: bool, threads: int | None,
                      schedules: list[Schedule], extern_times: dict[int, float],
                      extern_measured: dict[int, float]) -> None:
    """ATen's flash attention or our generated pair for each attention extern (optimizer/attention.py),
    into `schedules`, its predicted time into `extern_times` and, where timed, the chosen one's measured
    time into `extern_measured`; calls of one shape are decided once."""
    from optimizer import attention
    decided: dict[tuple, attention.Choice | None] = {}
    for i, g in enumerate(plan.groups):
        node = graph.nodes[g.nodes[0]]
        call = attention.call_of(graph, node) if g.kind == "extern" else None
        if call is None:
            continue
        # the code of a call: its shape and layouts (layers repeat it on other nodes)
        key = (call.backward, call.shape, call.results, tuple(graph.nodes[n].type for n in call.operands))
        if key not in decided:
            decided[key] = attention.choose(graph, node, spec, timing, threads)
        choice = decided[key]
        if choice is not None:
            schedules[i], extern_times[i] = choice.schedule, choice.predicted_s
            if choice.measured_s is not None:
                extern_measured[i] = choice.measured_s


def _settle(graph: Graph, plan: fusion.Plan, scorer: _Scorer, top_k: int) -> tuple[list[KernelResult], list[Tie]]:
    """Each kernel's schedule: the model's pick, or the fastest measured of its top k among those that
    compute what its reference schedule does; and the kernels whose timings were too close to call."""
    results: list[KernelResult] = []
    timed: list[tuple[KernelResult, list[Schedule], list[float], Schedule]] = []
    first: dict[str, KernelResult] = {}       # a kernel's code -> its first copy (layers repeat kernels)
    copies: list[tuple[KernelResult, KernelResult]] = []
    for i, group in enumerate(plan.groups):
        if group.kind == "extern":
            continue
        cands, predicted = scorer.ranked(group, plan.buffers)
        result = KernelResult(i, float(predicted[0]), None, cands.schedule(0))
        results.append(result)
        # a GEMM's default tile is priced as launched; other kernels' default shapes are the renderer's own
        reference, code = _reference(scorer.target, graph, plan, i, cands.schedule(0),
                                     group.kind != "gemm" or scorer.fits(group, plan.buffers, DEFAULT))
        if code in first:                     # the same loop nest on the same shapes: timed once
            copies.append((result, first[code]))
            continue
        first[code] = result
        if top_k > 1 and predicted[0] >= MIN_TIMED_S:
            rows = _diverse_top(cands, predicted, top_k, gpu=scorer.target.spec.kind == "gpu")
            timed.append((result, [cands.schedule(r) for r in rows], [float(predicted[r]) for r in rows], reference))
    ties: dict[int, Tie] = {}                 # by the group of the kernel's first copy
    measured = _checked_timings(scorer.target, graph, plan, [(r.group, picks, ref) for r, picks, _, ref in timed])
    for (result, picks, preds, reference), runs in zip(timed, measured):
        if not runs:                          # every candidate wrong: the reference runs, untimed
            result.schedule = reference
            continue
        best, timing = min(runs, key=lambda run: run[1].best)
        result.schedule, result.measured_s, result.predicted_s = picks[best], timing.best, preds[best]
        result.timed = [(preds[i], t.best) for i, t in runs]
        tied = _tied(picks, runs)
        if tied:
            ties[result.group] = Tie([result.group], tied)
    for copy, original in copies:
        copy.schedule, copy.measured_s, copy.predicted_s = original.schedule, original.measured_s, original.predicted_s
        if original.group in ties:
            ties[original.group].groups.append(copy.group)
    return results, list(ties.values())


def retime(graph: Graph, plan: fusion.Plan, ties: list[Tie], target: Target) -> list[tuple[Schedule, Tie | None]]:
    """The tied candidates of each kernel timed again (and checked again, as in the search): its
    fastest, and the tie still open while they stay too close to call and RETIMES allows, else None."""
    references = [_reference(target, graph, plan, t.groups[0], t.schedules[0])[0] for t in ties]
    measured = _checked_timings(target, graph, plan, [(t.groups[0], t.schedules, r) for t, r in zip(ties, references)])
    settled: list[tuple[Schedule, Tie | None]] = []
    for tie, reference, runs in zip(ties, references, measured):
        if not runs:
            settled.append((reference, None))
            continue
        tied = _tied(tie.schedules, runs)
        retimed = tie.retimed + 1
        best = min(runs, key=lambda run: run[1].best)[0]
        settled.append((tie.schedules[best], Tie(tie.groups, tied, retimed) if tied and retimed < RETIMES else None))
    return settled


def _reference(target: Target, graph: Graph, plan: fusion.Plan, group: int, top: Schedule,
               default_fits: bool = True) -> tuple[Schedule, str]:
    """The schedule a group's candidates must agree with, and its code: the hand-written default, or the
    model's `top` candidate where the default cannot be written or does not fit the chip (a GPU GEMM
    tile over a block's shared memory would not launch, and a reference that fails fails the compile)."""
    def code(schedule: Schedule) -> str:
        return target.render(graph, plan.groups[group], plan.buffers, schedule, plan.inplace)
    if default_fits:
        try:
            return DEFAULT, code(DEFAULT)
        except NotFusable:
            pass
    return top, code(top)


def _checked_timings(target: Target, graph: Graph, plan: fusion.Plan, todo: list[tuple[int, list[Schedule], Schedule]]
                     ) -> list[list[tuple[int, Timing]]]:
    """For each (group, candidates, reference): the candidates whose output matches the reference's
    on the same inputs, as (index, timing); each other one is discarded with a warning. The
    reference is built beside the candidates when it is not one of them, all as one library per CPU."""
    if not todo:
        return []
    built = target.build(graph, [(plan.groups[g], picks if ref in picks else [*picks, ref])
                                 for g, picks, ref in todo], plan.buffers, plan.inplace)
    checked = []
    for (g, picks, reference), group in zip(todo, built):
        valid = target.check(graph, group, picks.index(reference) if reference in picks else len(picks),
                             range(len(picks)))
        for schedule, ok in zip(picks, valid):
            if not ok:
                log.warning("tfsn search: discarded a candidate whose output differs from the %s schedule's "
                            "(a generator bug; please report it): group %d (%s), %s",
                            "default" if reference == DEFAULT else f"reference {reference}", g,
                            _ops(graph, fusion.fused_nodes(graph, plan.buffers, plan.groups[g])), schedule)
        keep = [i for i, ok in enumerate(valid) if ok]
        timings = target.time(graph, [(group, i) for i in keep], rounds=3, budget_s=2.0)
        checked.append(list(zip(keep, timings)))
    return checked


def _tied(picks: list[Schedule], runs: list[tuple[int, Timing]]) -> list[Schedule]:
    """The candidates whose best time is within the fastest one's best plus its spread, fastest
    first; empty when the fastest won clearly."""
    ranked = sorted(runs, key=lambda run: run[1].best)
    winner = ranked[0][1]
    close = [picks[i] for i, t in ranked if t.best <= winner.best + winner.spread]
    return close if len(close) > 1 else []


def _ops(graph: Graph, nodes: Sequence[int]) -> str:
    return "+".join(graph.nodes[n].op.removeprefix("aten.").split(".")[0] for n in nodes)


def _diverse_top(cands: costmodel.Candidates, predicted: np.ndarray, top_k: int, gpu: bool = False) -> list[int]:
    """Rows to time (`cands` sorted by prediction): first the best of each class predicted within NEAR_BEST
    of the best, then the next best. On a CPU the classes are vector width, GEMM kind (and tile depth) and
    kind of vector loop (omp simd, or unrolled): the model cannot tell a 512-bit vector run on 256-bit
    pipes from a native one, nor how well gcc vectorizes a loop of mixed types or unrolls a vector one.
    On a GPU they are warps and pipeline stages: on an H200 a reduction's launch shapes predicted within
    6% of each other ran 1.8x apart, mostly with their warps, and stages the model prices alike (3 and 4)
    are twins to time once; and a GEMM's product by the vendor's library is always timed beside the
    generated tiles (how near Triton's tiles come to cuBLAS is what the model knows least). Close calls
    between such classes are settled by the clock, not by the model."""
    near = predicted <= predicted[0] * NEAR_BEST
    if gpu and (cands.chunk > 0).all():      # programs of `chunk` elements or rows: pointwise, reductions
        picks = _spread(cands, near, top_k)
    else:
        picks = _best_of_each_class(cands, near, gpu)
    for r in range(len(cands)):
        if len(picks) >= top_k:
            break
        if r not in picks:
            picks.append(r)
    return sorted(picks[:top_k], key=lambda r: predicted[r])


def _best_of_each_class(cands: costmodel.Candidates, near: np.ndarray, gpu: bool) -> list[int]:
    """The best close call of each class (see _diverse_top), a GPU GEMM's library product first."""
    # a generated GEMM's tiles also by how many accumulators they keep in flight (< 8, 8-15, 16+):
    # the latency of a thin tile is as close a call as its vector width
    chains = np.where(cands.generated > 0,
                      np.minimum(cands.mr * np.ceil(cands.nr / cands.vector_width) // 8, 2), 0)

    def cls(r: int) -> tuple:
        return (cands.generated[r], cands.mr[r], min(cands.stages[r], 3)) if gpu else \
            (cands.vector_width[r], cands.generated[r], chains[r], cands.vector_width[r] > 1 and cands.unroll[r] > 1)
    picks: list[int] = []
    if gpu and (cands.generated > 0).any():
        picks.append(int(np.flatnonzero(cands.generated == 0)[0]))
    classes = {cls(r) for r in picks}
    for r in np.flatnonzero(near):
        if cls(r) not in classes:
            classes.add(cls(r))
            picks.append(int(r))
    return picks


def _spread(cands: costmodel.Candidates, near: np.ndarray, top_k: int) -> list[int]:
    """A GPU pointwise or reduction kernel's rows to time: the model's pick, then each time a close call of
    warps not yet picked (on an H200 a reduction's shapes predicted within 6% ran 1.8x apart, mostly with
    their warps), the farthest from those picked in elements (rows) per program and warps, on log scales. The
    model prices many of these shapes alike (a bias + GELU's 27 within 3% on an H100), and the next ones by
    its order were the space's first, the smallest programs (all four of that GELU's timed shapes were 256
    elements a program), so the clock gets shapes from across the close calls instead."""
    rows = np.flatnonzero(near)
    if not rows.size or rows[0] != 0:          # no finite prediction to be near: the model's order
        return []
    warps = cands.mr[rows]
    at = np.stack([np.log2(cands.chunk[rows]), np.log2(np.maximum(warps, 1))], axis=1)
    span = np.ptp(at, axis=0)
    at = at / np.where(span > 0, span, 1.0)
    picked = [0]
    apart = np.linalg.norm(at - at[0], axis=1)
    while len(picked) < min(top_k, len(rows)) and apart.max() > 0:
        new = ~np.isin(warps, warps[picked])
        i = int(np.argmax(np.where(new, apart, -1.0) if new.any() else apart))   # the first of equals: better predicted
        picked.append(i)
        apart = np.minimum(apart, np.linalg.norm(at - at[i], axis=1))
    return [int(rows[i]) for i in picked]


def describe(graph: Graph, result: SearchResult, gpu: bool = False) -> str:
    """The chosen plan, one line per kernel with its schedule and times: what `tfsn optimize` prints
    (`gpu`: the schedule columns read as a GPU launch shape, see costmodel.predict_gpu)."""
    lines = []
    by_group = {k.group: k for k in result.kernels}
    for i, g in enumerate(result.plan.groups):
        ops = _ops(graph, g.nodes)[:60]
        k = by_group.get(i)
        if k is None:
            cost = result.externs.get(i, 0.0)
            generated = " [generated]" if result.schedules[i].attention == "generated" else ""
            lines.append(f"{i:3d} extern  {ops}{generated}" + (f"  predicted {cost * 1e6:.1f} us" if cost else ""))
            continue
        s = k.schedule
        if gpu:
            library = g.kind == "gemm" and s.gemm == "library"      # cuBLAS's product, then the epilogue's tiles
            knobs = (f"library, epilogue tile={s.gemm_block_rows}x{s.gemm_nr}" if library
                     else f"tile={s.gemm_block_rows}x{s.gemm_nr}x{s.gemm_kc} stages={s.gemm_stages}" if g.kind == "gemm"
                     else f"{'rows' if g.reduced else 'elements'}/program={s.chunk}") + f" warps={s.gemm_mr}" + \
                (f" split={s.reduction_split}" if s.reduction_split > 1 else "")
            lines.append(f"{i:3d} {g.kind:7s} {ops}  [{knobs}]  predicted {k.predicted_s * 1e6:.1f} us")
            continue
        knobs = (f"gemm={s.gemm}" + (f" tile={s.gemm_mr}x{s.gemm_nr}x{s.gemm_kc}" if s.gemm == "generated" else "")
                 + f" rows={s.gemm_block_rows} " if g.kind == "gemm" else "") + \
            f"vw={s.vector_width} unroll={s.unroll} " + ("serial" if s.parallel_axis < 0 else f"parallel chunk={s.chunk}")
        measured = f" measured {k.measured_s * 1e6:.1f} us" if k.measured_s is not None else ""
        lines.append(f"{i:3d} {g.kind:7s} {ops}  [{knobs}]  predicted {k.predicted_s * 1e6:.1f} us{measured}")
    return "\n".join(lines)

