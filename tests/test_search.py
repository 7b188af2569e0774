"""The search: plans from the fusion decisions, schedules from the cost model, the top k timed, the
result cached; and `tfsn optimize` on top of it."""
from __future__ import annotations

import json
import os
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from optimizer import backend, costmodel, features, fusion, ir, loopnest, search, space
from optimizer.backend import compile_graph, decompositions
from optimizer.codegen.c import KernelWriter, write_source
from optimizer.codegen.compiler import build_library, load_library
from optimizer.hardware import find_hardware, load_all
from optimizer.runtime import CompiledGraph
from optimizer.schedule import DEFAULT
from tests.user_models_eighth import wkv

ROOT = Path(__file__).resolve().parent.parent
HOST = load_all()["cpu-generic"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))


def mlp_step(x, w1, b1, w2, lw, lb):
    h = F.gelu(F.linear(x, w1, b1))
    y = F.layer_norm(h @ w2 + x, (x.shape[-1],), lw, lb)
    return y, torch.softmax(y, dim=-1).sum(0)


def inputs(rows=96, d=80, hidden=200):
    torch.manual_seed(0)
    return (torch.randn(rows, d), torch.randn(hidden, d), torch.randn(hidden), torch.randn(hidden, d),
            torch.randn(d), torch.randn(d))


def lowered(fn, args):
    gm = make_fx(fn, decomposition_table=decompositions())(*args)
    return gm, ir.from_fx(gm)


def run_plan(graph, plan, schedules, args):
    source, kernels = write_source(graph, plan.groups, plan.buffers, schedules)
    lib = load_library(build_library(source)) if any(kernels) else None
    return CompiledGraph(graph, plan.groups, kernels, lib)(list(args))


def test_searched_plan_computes_what_eager_does():
    args = inputs()
    _, graph = lowered(mlp_step, args)
    result = search.search_graph(graph, HOST, top_k=3, threads=torch.get_num_threads())
    assert result.scored > 1000 and result.plans_scored >= 1 and math.isfinite(result.predicted_s)
    out = run_plan(graph, result.plan, result.schedules, args)
    for got, want in zip(out, mlp_step(*args)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_kernel_repeated_by_layers_is_timed_once_and_shares_its_pick():
    def two_layers(x, w1, w2):
        return torch.tanh(x @ w1) @ w2, torch.tanh(x @ w2) @ w1      # the same GEMMs and tanh, twice
    torch.manual_seed(0)
    args = (torch.randn(256, 256), torch.randn(256, 256), torch.randn(256, 256))
    _, graph = lowered(two_layers, args)
    result = search.search_graph(graph, HOST, top_k=3, threads=torch.get_num_threads())
    by_code = {}
    for k in result.kernels:
        code = KernelWriter(graph, result.plan.groups[k.group], result.plan.buffers, DEFAULT, "k").write().source
        by_code.setdefault(code, []).append(k)
    repeated = [ks for ks in by_code.values() if len(ks) > 1]
    assert repeated, "the two layers share no kernel"
    for ks in repeated:
        assert sum(bool(k.timed) for k in ks) <= 1, "a repeated kernel was timed again"
        assert len({k.schedule for k in ks}) == 1 and len({k.measured_s for k in ks}) == 1
    for got, want in zip(run_plan(graph, result.plan, result.schedules, args), two_layers(*args)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_top_k_timing_keeps_the_fastest_measured():
    args = inputs(rows=512, d=256, hidden=512)
    _, graph = lowered(mlp_step, args)
    result = search.search_graph(graph, HOST, top_k=3, threads=torch.get_num_threads())
    timed = [k for k in result.kernels if k.timed]
    assert timed, "no kernel was worth timing at this size"
    for k in timed:
        assert 1 <= len(k.timed) <= 3
        assert k.measured_s == min(m for _, m in k.timed)
    assert len(result.measured) == sum(len(k.timed) for k in timed)
    untimed = search.search_graph(graph, HOST, timing=False)
    assert untimed.measured == [] and all(k.measured_s is None for k in untimed.kernels)


def test_few_decisions_are_searched_exhaustively_many_by_beam(monkeypatch):
    args = inputs()
    _, graph = lowered(mlp_step, args)
    points = fusion.decision_points(graph)
    assert points, "the step has no fusion decision to make"
    monkeypatch.setattr(search, "EXHAUSTIVE_MAX_DECISIONS", len(points))
    exhaustive = search.search_graph(graph, HOST, timing=False)
    assert exhaustive.plans_scored == 2 ** len(points)
    # the space covered: every plan, times the sum (given a plan, kernels are independent) of the
    # distinct schedules of the default plan's kernels, twins the model prices alike left out
    default = fusion.plan(graph)
    kernels = [features.kernel_features(graph, g, default.buffers) for g in default.groups if g.kind != "extern"]
    table = costmodel.FeatureTable(kernels)
    distinct = [len(costmodel.distinct(table, space.kernel_space(i, k), HOST)) for i, k in enumerate(kernels)]
    every = sum(len(space.kernel_space(i, k)) for i, k in enumerate(kernels))
    assert exhaustive.space_size == 2 ** len(points) * sum(distinct) < 2 ** len(points) * every
    assert exhaustive.collapsed > 0 and exhaustive.scored > 0
    monkeypatch.setattr(search, "EXHAUSTIVE_MAX_DECISIONS", 0)
    monkeypatch.setattr(search, "MAX_PLANS", 3)
    beam = search.search_graph(graph, HOST, timing=False)
    assert beam.plans_scored <= 3
    assert beam.predicted_s >= exhaustive.predicted_s - 1e-12     # the exhaustive search found the best


def test_a_recurrence_unrolled_in_python_is_searched_within_the_planning_budget():
    """The gradient of 8 steps of WKV is one graph of ~1,000 nodes whose groups grow to hundreds of members;
    a fusion pass lowers each group again at each member it takes, so its 48 plans lowered ~490,000 nodes
    (21 s here; RWKV over 6 tokens took 140 s to compile). The search stops at the planning budget, and the
    plan it found computes the gradients eager does."""
    torch.manual_seed(0)
    k, v, g = torch.randn(2, 8, 6), torch.randn(2, 8, 6), torch.randn(2, 8, 6)
    w, u = torch.randn(6), torch.randn(6)

    def gradients(k, v, w, u, g):
        return torch.autograd.grad(wkv(k, v, -torch.exp(w), u), (k, v, w, u), g)

    args = [t.requires_grad_() for t in (k, v, w, u)] + [g]
    _, graph = lowered(gradients, args)
    assert len(fusion.decision_points(graph)) > search.EXHAUSTIVE_MAX_DECISIONS    # searched by beam
    result = search.search_graph(graph, HOST, timing=False)
    assert result.plans_scored < search.MAX_PLANS, "the budget did not stop the search"
    assert graph.lowered_nodes < 2 * search.PLANNING_BUDGET
    expected = gradients(*args)
    actual = run_plan(graph, result.plan, result.schedules, [a.detach() for a in args])
    for name, a, e in zip("kvwu", actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=f"gradient of {name}")


def test_a_graph_planned_again_reuses_its_lowerings_and_finds_what_a_cold_search_finds(monkeypatch):
    """The recompute-vs-store decision plans a step's forward and backward (a bounded search), then compile_graph
    searches each in full from an ir.Graph of its own: backend.planning_graph gives the second the first's memo,
    so it lowers fewer nests, and it finds the plan and schedules a cold search finds, its planning budget
    counted as a cold search counts it."""
    gm, cold = lowered(mlp_step, inputs())
    lowerings = []
    real = loopnest._lowered
    monkeypatch.setattr(loopnest, "_lowered", lambda *a: lowerings.append(a) or real(*a))
    want = search.search_graph(cold, HOST, timing=False)
    cold_lowerings = len(lowerings)
    search.search_graph(backend.planning_graph(gm), HOST, timing=False, max_plans=backend.PARTITION_PLANS)
    lowerings.clear()
    again = backend.planning_graph(gm)
    got = search.search_graph(again, HOST, timing=False)
    assert len(lowerings) < cold_lowerings
    assert (got.choice, got.schedules, got.predicted_s) == (want.choice, want.schedules, want.predicted_s)
    assert again.lowered_nodes == cold.lowered_nodes


def test_fusion_choices_change_the_plan():
    args = inputs()
    _, graph = lowered(mlp_step, args)
    default = fusion.plan(graph)
    splits = [n for kind, n in fusion.decision_points(graph) if kind == "split"]
    assert splits, "the GEMM with a GELU epilogue offers no split"
    split = fusion.plan(graph, choice=fusion.Choice(split=frozenset(splits)))
    gemm_groups = lambda p: [g for g in p.groups if g.kind == "gemm"]    # noqa: E731
    assert len(gemm_groups(split)) < len(gemm_groups(default)) or \
        sum(len(g.nodes) for g in gemm_groups(split)) < sum(len(g.nodes) for g in gemm_groups(default))
    out = run_plan(graph, split, [search.DEFAULT] * len(split.groups), args)
    for got, want in zip(out, mlp_step(*args)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_backend_searches_once_then_reads_its_cache():
    args = inputs()
    gm, _ = lowered(mlp_step, args)
    before = backend.STATS["searches"]
    first = compile_graph(gm, args)(list(args))
    assert backend.STATS["searches"] == before + 1
    second = compile_graph(gm, args)(list(args))
    assert backend.STATS["searches"] == before + 1, "the second compile searched again"
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)


def test_a_search_that_timed_no_kernel_serves_every_top_k_above_one(monkeypatch):
    """A small graph's search times no kernel (each is predicted under MIN_TIMED_S), so its choice is every
    top_k > 1's: compiled again with another (a test's top_k=2 training step after the default 8) it reads
    that search instead of searching again. top_k=1 (the model's picks) searches for itself, and a search
    that timed kernels is kept for its own top_k only."""
    args = inputs(rows=6, d=8, hidden=12)
    gm, _ = lowered(mlp_step, args)
    before = backend.STATS["searches"]
    outs = [compile_graph(gm, args, top_k=top_k)(list(args)) for top_k in (8, 2)]
    assert backend.STATS["searches"] == before + 1, "another top_k searched the same untimed graph again"
    for out in outs:
        for got, want in zip(out, mlp_step(*args)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    compile_graph(gm, args, top_k=1)
    assert backend.STATS["searches"] == before + 2

    monkeypatch.setattr(search, "MIN_TIMED_S", 0.0)     # every kernel worth timing: the same graph, timed
    monkeypatch.setattr(backend, "SEARCH_VERSION", backend.SEARCH_VERSION + " timed")
    for top_k in (2, 3):
        compile_graph(gm, args, top_k=top_k)
    assert backend.STATS["searches"] == before + 4, "a search that timed kernels served another top_k"


def test_hardware_not_present_is_predicted_only():
    args = inputs()
    _, graph = lowered(mlp_step, args)
    h100 = search.search_graph(graph, find_hardware("H100"), timing=False)
    t4 = search.search_graph(graph, find_hardware("T4"), timing=False)
    assert h100.measured == [] and 0 < h100.predicted_s < t4.predicted_s


def tfsn(*argv: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tfsn.py"), *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "TFSN_CACHE": str(cache)})


MODELS = "examples/optimize/models.py"


def test_optimize_command_measures_here_and_predicts_elsewhere(tmp_path):
    proc = tfsn("optimize", "--model", f"{MODELS}:mlp", "--inputs", f"{MODELS}:mlp_inputs", "--top-k", "2",
                "--json", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("space_size", "scored", "scored_per_s", "predicted_step_s", "chosen", "measured"):
        assert key in data
    assert data["graphs"] == 2 and data["scored"] > 0 and data["predicted_step_s"] > 0
    assert data["measured"] and all(m["measured_s"] > 0 for m in data["measured"])
    proc = tfsn("optimize", "--model", f"{MODELS}:mlp", "--inputs", f"{MODELS}:mlp_inputs", "--hardware", "h100",
                "--json", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["hardware"] == "H100-SXM" and data["measured"] == [] and data["predicted_step_s"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "nowhere.py:mlp", "--inputs", f"{MODELS}:mlp_inputs"], "no file nowhere.py"),
    (["--model", f"{MODELS}:missing", "--inputs", f"{MODELS}:mlp_inputs"], "has no function 'missing'. To fix:"),
    (["--model", f"{MODELS}:mpl", "--inputs", f"{MODELS}:mlp_inputs"], f"Did you mean 'mlp'? To fix: --model {MODELS}:mlp"),
    (["--model", "nosuchmodule:mlp", "--inputs", f"{MODELS}:mlp_inputs"], "no module nosuchmodule importable from"),
    # the model's builder given as its inputs: 'Block' object has no attribute 'shape', from inside the capture
    (["--model", f"{MODELS}:mlp", "--inputs", f"{MODELS}:mlp"], "returned a Sequential, not the model's example inputs"),
    (["--model", f"{MODELS}", "--inputs", f"{MODELS}:mlp_inputs"], "expected MODULE:FN, e.g. examples/optimize/models.py"),
    (["--model", f"{MODELS}:mlp", "--inputs", f"{MODELS}:mlp_inputs", "--hardware", "tpu9"], "not a known chip"),
    (["--model", f"{MODELS}:mlp", "--inputs", f"{MODELS}:mlp_inputs", "--top-k", "0"], "--top-k 0"),
])
def test_optimize_command_bad_input_is_one_line(tmp_path, argv, message):
    proc = tfsn("optimize", *argv, cache=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("tfsn: error: ")
    assert message in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_module_whose_import_fails_is_not_called_missing(tmp_path, monkeypatch, capsys):
    """--model mlp_models:build, whose file imports a missing `mlp`: the import's own error, not 'no module
    mlp_models' (the module's name merely begins with the missing one's)."""
    import typer

    from orchestrator.cli.optimizer import load_callable
    (tmp_path / "mlp_models.py").write_text("import mlp\n\ndef build():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(typer.Exit) as exit_:
        load_callable("mlp_models:build", "--model")
    err = capsys.readouterr().err
    assert exit_.value.exit_code == 1 and "No module named 'mlp'" in err and "no module mlp_models" not in err, err


def test_optimize_command_emits_the_plan_with_kernels_and_externs_priced(tmp_path):
    out = tmp_path / "plan-h100"
    proc = tfsn("optimize", "--model", f"{MODELS}:gpt2_block", "--inputs", f"{MODELS}:gpt2_inputs", "--hardware",
                "h100", "--emit", str(out), "--json", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    plan = json.loads((out / "plan.json").read_text())
    assert plan["hardware"] == "H100-SXM" and [g["name"] for g in plan["graphs"]] == ["forward", "backward"]
    assert plan["totals"]["predicted_step_s"] == pytest.approx(summary["predicted_step_s"])
    assert plan["totals"]["predicted_step_s"] == pytest.approx(plan["totals"]["kernels_s"] + plan["totals"]["externs_s"])
    groups = [g for graph in plan["graphs"] for g in graph["groups"]]
    gemms = [g for g in groups if g["kind"] == "gemm"]
    # a GEMM says whose product it is: Triton's tl.dot tile (its depth and stages), or cuBLAS's, read back by
    # one program of the epilogue's tile (cuBLAS picks its own tile, depth and stages: none is printed)
    launch = {"generated": {"gemm", "block_m", "block_n", "block_k", "num_warps", "num_stages"},
              "library": {"gemm", "block_m", "block_n", "num_warps"}}
    assert gemms and all(set(g["schedule"]) == launch[g["schedule"].get("gemm")] for g in gemms), gemms
    assert any(g["schedule"]["gemm"] == "library" for g in gemms)        # gpt2_block's lone products, at least
    printed = [line for line in proc.stdout.splitlines()[:-1] if " gemm " in line]     # the table, not the JSON
    assert len(printed) == len(gemms) and all(("library" in line) != ("stages=" in line) for line in printed), printed
    assert all(g["predicted_s"] > 0 for g in groups if g["kind"] != "extern")
    attention = [g for g in groups if g["kind"] == "extern" and g["class"] == "attention"]
    assert len(attention) == 2 and all(g["predicted_s"] > 0 and g["flops"] > 0 for g in attention)   # forward, backward
    assert all(g["predicted_s"] == 0 for g in groups if g["kind"] == "extern" and g["class"] == "free")
    assert not plan["graphs"][0]["allow_tf32"]            # torch's default: fp32 products at the fp32 rate
    # the plan's Triton kernels: every generated group names its kernel, defined in its graph's module
    for graph in plan["graphs"]:
        source = (out / f"{graph['name']}.py").read_text()
        kernels = [g["kernel"] for g in graph["groups"] if g["kind"] != "extern"]
        assert kernels and all(k.startswith(f"{graph['name']}.py:") for k in kernels)
        assert all(f"def {k.split(':')[1]}(" in source for k in kernels) and "@triton.jit" in source
        compile(source, graph["name"], "exec")      # a module Python reads (Triton's own check needs the GPU)
        assert all("kernel" not in g for g in graph["groups"] if g["kind"] == "extern")
    # each GEMM's kernel is its tl.dot tile, or says that the library computes its product
    for graph in plan["graphs"]:
        source = (out / f"{graph['name']}.py").read_text()
        for g in (g for g in graph["groups"] if g["kind"] == "gemm"):
            name = g["kernel"].split(":")[1]
            body = source.split(f"def {name}(")[1].split("@triton.jit")[0]
            assert ("tl.dot(" in body) == (g["schedule"]["gemm"] == "generated") != ("by the library" in body), body


def test_optimize_command_refuses_an_emit_folder_it_cannot_write(tmp_path):
    (tmp_path / "a-file").write_text("kept")
    cases = [(tmp_path / "a-file", "exists and is not a folder"), (tmp_path / "a-file" / "sub", "cannot write there")]
    if os.geteuid() != 0:                  # root writes through permissions: there a read-only folder is not one
        (tmp_path / "locked").mkdir(mode=0o500)
        cases.append((tmp_path / "locked", "cannot write there: Permission denied"))
    for folder, message in cases:
        proc = tfsn("optimize", "--model", f"{MODELS}:mlp", "--inputs", f"{MODELS}:mlp_inputs", "--hardware", "h100",
                    "--emit", str(folder), cache=tmp_path)
        assert proc.returncode == 2 and f"--emit {folder}: {message}" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr + proc.stdout
        assert proc.stdout == ""           # refused before any capture or search
    assert (tmp_path / "a-file").read_text() == "kept"


def test_the_plan_takes_a_timed_kernel_at_no_less_than_its_measured_time(monkeypatch):
    """A kernel timed slower than the model priced it counts at its measured time in the step `tfsn plan`
    prices (on_plan), when searched and when read back from the search cache; one timed faster keeps its
    prediction (the timing's best run, caches warm, is a lower bound on its time inside a step)."""
    real, results = search.search_graph, []

    def slow_timing(*args, **kwargs):
        result = real(*args, **kwargs)
        for i, k in enumerate(result.kernels):     # every other one timed 3x slower than priced, the rest 2x faster
            k.measured_s = k.predicted_s * (3.0 if i % 2 == 0 else 0.5)
        results.append(result)
        return result

    monkeypatch.setattr(search, "search_graph", slow_timing)
    args = inputs()
    gm, graph = lowered(mlp_step, args)
    seen = []
    for _ in range(2):
        compile_graph(gm, args, on_plan=lambda seconds, fresh, entry: seen.append((seconds, fresh)))
    (result,) = results
    expected = sum(k.predicted_s * (3.0 if i % 2 == 0 else 1.0) for i, k in enumerate(result.kernels)) \
        + sum(result.externs.values())
    assert len(result.kernels) >= 2 and expected > result.predicted_s and result.expected_s == pytest.approx(expected)
    assert seen == [(pytest.approx(expected), True), (pytest.approx(expected), False)]
