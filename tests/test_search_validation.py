"""The search's timing step: a candidate must compute what its kernel's default schedule computes
before its time counts, and a win within the timing noise is timed again on later runs instead of
cached for good. Timings are injected (measure.time_rounds), so the outcomes do not depend on this
machine's load."""
from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from optimizer import backend, fusion, ir, measure, search
from optimizer.backend import compile_graph, decompositions
from optimizer.cache import cache_dir
from optimizer.codegen.c import Kernel, KernelWriter
from optimizer.hardware import cpu_spec
from optimizer.schedule import DEFAULT

ARGS = (torch.randn(384, 1024, generator=torch.Generator().manual_seed(0)),)


def tanh2(x):
    return torch.tanh(x) * 2.0


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(search, "MIN_TIMED_S", 0.0)       # the kernel is timed whatever the model predicts


@pytest.fixture
def gm():
    return make_fx(tanh2, decomposition_table=decompositions())(*ARGS)


def wrong(kernel: Kernel, mark: str = "") -> Kernel:
    """`kernel` writing x + 1 where it wrote x: a planted generator bug."""
    return dataclasses.replace(kernel, source=re.sub(r"(\] = )(t\d+);", rf"\1\2 + 1.0f;{mark}", kernel.source))


def saved_entry() -> dict:
    (path,) = (cache_dir() / "search").glob("*.json")
    return json.loads(path.read_text())


class Clock:
    """Stands in for measure.time_rounds: each call's kernels get the rounds `timing(call, kernel)` says."""

    def __init__(self, timing) -> None:
        self.timing, self.calls = timing, []

    def __call__(self, graph, kernels, rounds=5, budget_s=10.0):
        self.calls.append([k for k, _ in kernels])
        return [measure.Timing(self.timing(len(self.calls) - 1, k)) for k, _ in kernels]


def test_a_wrong_candidate_never_wins_is_logged_and_never_cached(monkeypatch, caplog, gm):
    """The first schedule other than the default that the search builds is made to write x + 1 (a
    planted generator bug) and is timed the fastest by far: without the check it would win."""
    planted = []
    write = KernelWriter.write

    def planted_write(self):
        kernel = write(self)
        if self.s != DEFAULT and self.name.startswith("v") and not planted:     # measure.build_groups's
            planted.append(self.s)
        return wrong(kernel, " /* planted */") if planted and self.s == planted[0] else kernel
    monkeypatch.setattr(KernelWriter, "write", planted_write)
    clock = Clock(lambda call, k: (1e-6,) * 3 if "planted" in k.source else (1e-5,) * 3)
    monkeypatch.setattr(measure, "time_rounds", clock)
    with caplog.at_level(logging.WARNING, logger="tfsn.optimizer"):
        compiled = compile_graph(gm, list(ARGS), top_k=4)
    assert planted, "the search built no candidate but the default"
    discarded = [r for r in caplog.records if "discarded a candidate" in r.getMessage()]
    assert len(discarded) == 1 and discarded[0].levelno == logging.WARNING
    assert str(planted[0]) in discarded[0].getMessage() and "tanh" in discarded[0].getMessage()
    assert clock.calls and all("planted" not in k.source for call in clock.calls for k in call), \
        "the wrong candidate was timed"
    torch.testing.assert_close(compiled(list(ARGS))[0], tanh2(*ARGS))
    entry = saved_entry()
    cached = entry["schedules"] + [s for tie in entry["unsettled"] for s in tie["schedules"]]
    assert dataclasses.asdict(planted[0]) not in cached


def test_when_every_candidate_but_the_default_is_wrong_the_default_runs(monkeypatch, caplog, gm):
    write = KernelWriter.write
    monkeypatch.setattr(KernelWriter, "write", lambda self: write(self) if self.s == DEFAULT else wrong(write(self)))
    with caplog.at_level(logging.WARNING, logger="tfsn.optimizer"):
        result = search.search_graph(ir.from_fx(gm), cpu_spec(), top_k=4, threads=torch.get_num_threads())
    assert any("discarded a candidate" in r.getMessage() for r in caplog.records)
    assert all(s == DEFAULT for s, g in zip(result.schedules, result.plan.groups) if g.kind != "extern")
    assert result.ties == []


def test_a_kernel_writing_over_its_inputs_is_checked_on_what_it_writes_there():
    """An optimizer update writes its new values over the parameter and the moment (fusion.in_place_writes):
    those inputs are the kernel's outputs, and a candidate that writes them wrong is caught."""
    def momentum_update(p, g, m):
        m.mul_(0.9).add_(g, alpha=0.1)
        p.sub_(m * 0.01 + p * 1e-3)
    inputs = [torch.randn(64, 1024) for _ in range(3)]
    gm = make_fx(torch.func.functionalize(momentum_update, remove="mutations"),
                 decomposition_table=decompositions())(*inputs)
    graph = ir.from_fx(gm)
    plan = fusion.plan(graph)
    (group,) = [g for g in plan.groups if g.kind != "extern"]
    schedules = [DEFAULT, dataclasses.replace(DEFAULT, vector_width=8, unroll=2)]
    ((reference, candidate), lib), = measure.build_groups(graph, [(group, schedules)], plan.buffers,
                                                          inplace=plan.inplace)
    assert set(candidate.outputs) == set(plan.inplace.values()) and set(candidate.outputs) <= set(graph.inputs)
    assert measure.agree(graph, reference, [reference, candidate], lib) == [True, True]
    with pytest.MonkeyPatch.context() as mp:
        write = KernelWriter.write
        mp.setattr(KernelWriter, "write", lambda self: wrong(write(self)) if self.s != DEFAULT else write(self))
        ((reference, planted), lib), = measure.build_groups(graph, [(group, schedules)], plan.buffers, "w",
                                                            inplace=plan.inplace)
    assert measure.agree(graph, reference, [planted], lib) == [False]


def test_a_broadcast_input_is_checked_and_compiled():
    """A graph input expanded from one row (stride 0: its elements share memory, as a user's
    `x.expand(...)` or a batched product's broadcast operand) gets the check's random values too:
    filling it in place raised out of the search, and torch.compile failed on the model."""
    row = torch.randn(1, 1024, generator=torch.Generator().manual_seed(0)).expand(384, 1024)
    gm = make_fx(tanh2, decomposition_table=decompositions())(row)
    torch.testing.assert_close(compile_graph(gm, [row], top_k=4)([row])[0], tanh2(row))


def test_a_tie_is_timed_again_on_the_next_runs_then_kept(monkeypatch, gm):
    """Candidates whose rounds overlap are an unsettled choice: each later compile times just them
    again and counts it, until search.RETIMES re-timings; then the choice stays and nothing is timed."""
    clock = Clock(lambda call, k: (1e-5, 1.2e-5, 1.3e-5))         # everyone's best within everyone's spread
    monkeypatch.setattr(measure, "time_rounds", clock)
    searches = backend.STATS["searches"]
    compile_graph(gm, list(ARGS), top_k=4)
    assert backend.STATS["searches"] == searches + 1 and len(clock.calls) == 1
    (tie,) = saved_entry()["unsettled"]
    assert tie["retimed"] == 0 and len(tie["schedules"]) == len(clock.calls[0]) >= 2
    for retimed in range(1, search.RETIMES + 1):
        compile_graph(gm, list(ARGS), top_k=4)
        assert len(clock.calls) == 1 + retimed, "the tied kernel was not timed again"
        assert len(clock.calls[-1]) == len(tie["schedules"])      # just the tied candidates
        entry = saved_entry()
        assert entry["unsettled"] == ([] if retimed == search.RETIMES else [{**tie, "retimed": retimed}])
    compile_graph(gm, list(ARGS), top_k=4)
    assert len(clock.calls) == 1 + search.RETIMES, "timed again past the bound"
    assert backend.STATS["searches"] == searches + 1
    assert entry["schedules"][tie["groups"][0]] in tie["schedules"]


def test_a_retiming_with_a_clear_winner_settles_the_choice(monkeypatch, gm):
    """The runner-up of a tie wins clearly when timed again: it becomes the kernel's schedule, settled."""
    def timing(call, k):
        if call == 0:
            return (1e-5, 1.1e-5, 1.1e-5)
        return (2e-6,) * 3 if k.name.endswith("_1") else (1e-5,) * 3   # the second tied candidate
    clock = Clock(timing)
    monkeypatch.setattr(measure, "time_rounds", clock)
    compiled = compile_graph(gm, list(ARGS), top_k=4)
    (tie,) = saved_entry()["unsettled"]
    retimed = compile_graph(gm, list(ARGS), top_k=4)
    entry = saved_entry()
    assert len(clock.calls) == 2 and entry["unsettled"] == []
    assert all(entry["schedules"][g] == tie["schedules"][1] for g in tie["groups"])
    compile_graph(gm, list(ARGS), top_k=4)
    assert len(clock.calls) == 2
    for run in (compiled, retimed):
        torch.testing.assert_close(run(list(ARGS))[0], tanh2(*ARGS))


def test_a_clear_win_is_cached_settled_and_not_timed_again(monkeypatch, gm):
    clock = Clock(lambda call, k: (1e-5 * (1 + int(k.name.rsplit("_", 1)[1])),) * 3)
    monkeypatch.setattr(measure, "time_rounds", clock)
    compile_graph(gm, list(ARGS), top_k=4)
    compile_graph(gm, list(ARGS), top_k=4)
    assert len(clock.calls) == 1 and saved_entry()["unsettled"] == []


def test_spread_is_median_minus_best():
    timing = measure.Timing((3e-6, 1e-6, 2e-6, 9e-6))
    assert timing.best == 1e-6 and timing.spread == pytest.approx(1.5e-6)


def test_the_checks_masks_hold_both_values_and_its_indices_are_zeros():
    """The inputs a candidate is checked on: a mask of random booleans (all False, as before, every candidate
    that mishandled a mask would agree with the reference), indices of zeros (in bounds for any read)."""
    def masked(x, mask, index):
        return torch.where(mask, x, 0.0).sum(1), x.gather(1, index)
    args = [torch.randn(64, 32), torch.rand(64, 32) < 0.5, torch.zeros(64, 4, dtype=torch.long)]
    graph = ir.from_fx(make_fx(masked, decomposition_table=decompositions())(*args))
    mask = measure.buffer(graph, graph.inputs[1], torch.Generator().manual_seed(0))
    index = measure.buffer(graph, graph.inputs[2], torch.Generator().manual_seed(0))
    assert mask.dtype == torch.bool and 0.3 < mask.float().mean().item() < 0.7
    assert index.dtype == torch.long and not index.any()
