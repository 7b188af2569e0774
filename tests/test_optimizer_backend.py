"""The ways a user reaches the optimizer: the backend callable, torch.compile(backend="tfsn")
through the entry point, and optimize(model, **options)."""
from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import os

import pytest
import torch
import torch.nn as nn

from optimizer import backend
from optimizer.backend import make_backend, optimize, tfsn_backend
from optimizer.schedule import Schedule


@pytest.fixture(autouse=True)
def fresh(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path_factory.getbasetemp() / "tfsn-cache"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def model_and_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 17), nn.GELU(), nn.LayerNorm(17), nn.Linear(17, 3))
    return model, torch.randn(5, 9)


def check(compiled, eager, x) -> None:
    """Forward and gradients of `compiled` (a compiled copy of `eager`) match eager's, and it ran kernels."""
    before = backend.STATS["kernels"]
    out = compiled(x)
    out.square().sum().backward()
    ref = eager(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    params = list(compiled.parameters()) if isinstance(compiled, nn.Module) else []
    for p, q in zip(params, eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert backend.STATS["kernels"] > before, "no generated kernel ran"


def test_backend_callable_with_torch_compile():
    eager, x = model_and_input()
    mine = copy.deepcopy(eager)
    check(torch.compile(mine, backend=tfsn_backend), eager, x)


def test_compiling_a_step_warns_the_user_of_nothing_torch_deprecated_in_itself():
    """Copying the joint graph deep-copied torch's own pytree LeafSpecs, which torch 2.13 deprecates: every
    worker of the example printed "FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated" lines."""
    import warnings
    eager, x = model_and_input()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        check(optimize(copy.deepcopy(eager)), eager, x)
    assert not [w for w in seen if "LeafSpec" in str(w.message)], [str(w.message) for w in seen]


def test_optimize_with_a_schedule():
    eager, x = model_and_input()
    mine = copy.deepcopy(eager)
    check(optimize(mine, schedule=Schedule(vector_width=8, gemm_block_rows=2)), eager, x)


def test_fuse_false_runs_the_captured_graphs_as_aten():
    eager, x = model_and_input()
    before = backend.STATS["aten_graphs"]
    torch.testing.assert_close(optimize(copy.deepcopy(eager), fuse=False)(x), eager(x))
    assert backend.STATS["aten_graphs"] > before


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_torch_compile_modes_reach_tfsn(mode):
    """torch.compile passes its `mode` (and `options`) to a backend other than Inductor as keywords, which the
    registered backend took none of: `torch.compile(model, backend="tfsn", mode="max-autotune")` failed at the
    first call with a TypeError inside Dynamo."""
    eager, x = model_and_input()
    check(torch.compile(copy.deepcopy(eager), backend=tfsn_backend, mode=mode), eager, x)
    torch._dynamo.reset()
    eager, x = model_and_input()        # no gradients yet
    check(optimize(copy.deepcopy(eager), mode=mode), eager, x)
    with pytest.raises(ValueError, match="unknown mode 'fastest'; modes: default"):
        optimize(eager, mode="fastest")


def test_an_option_that_contradicts_the_mode_is_refused():
    """`mode="max-autotune-no-cudagraphs", cuda_graphs=True` replayed CUDA graphs: the option silently won."""
    eager, _ = model_and_input()
    with pytest.raises(ValueError, match="sets cuda_graphs=False, and the options say cuda_graphs=True"):
        optimize(eager, mode="max-autotune-no-cudagraphs", cuda_graphs=True)
    optimize(eager, mode="max-autotune-no-cudagraphs", cuda_graphs=False)       # agreeing: taken


def test_torch_compile_options_are_tfsns():
    eager, x = model_and_input()
    check(torch.compile(copy.deepcopy(eager), backend=tfsn_backend, options={"top_k": 1}), eager, x)


def test_an_optimized_model_pickles_whole_and_runs_kernels_after():
    """`torch.save(tfsn.optimize(model))` (the whole module, or one sent to another process) failed: "Can't
    pickle local object 'traced_with_corrections.<locals>.backend'"; torch.compile(backend="tfsn") pickled."""
    import pickle
    eager, x = model_and_input()
    compiled = optimize(copy.deepcopy(eager), top_k=1)
    compiled(x)
    check(pickle.loads(pickle.dumps(compiled)), eager, x)


def test_a_model_optimized_with_a_report_pickles_after_it_compiled():
    """`tfsn.optimize(model, report=searches)` pickled before its first step, and failed after it ("<pybind11 ...
    function_record object> is not pickleable": the report holds the searched graphs). The caller's report stays
    with the caller: the unpickled model compiles and runs its own kernels."""
    import pickle
    eager, x = model_and_input()
    searches: list = []
    compiled = optimize(copy.deepcopy(eager), top_k=1, report=searches)
    compiled(x).sum().backward()
    assert searches
    restored = pickle.loads(pickle.dumps(compiled))
    restored.zero_grad()
    check(restored, eager, x)


def test_without_a_c_compiler_the_step_runs_as_aten_and_says_how_to_get_kernels(monkeypatch, tmp_path, caplog):
    """On a host without gcc (a slim container) the first call of `tfsn.optimize(model)` failed the training
    step: "BackendCompilerFailed ... FileNotFoundError: 'gcc'". It runs as ATen, said once, as without triton."""
    from optimizer.codegen import compiler
    eager, x = model_and_input()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    compiler.compiler_id.cache_clear()          # both asked once per process: this one's $CC is another
    compiler.missing_compiler.cache_clear()
    try:
        compiled = optimize(copy.deepcopy(eager))
        with caplog.at_level("WARNING", logger="tfsn.optimizer"):
            out = compiled(x)
        torch.testing.assert_close(out, eager(x))
        out.sum().backward()
    finally:
        compiler.compiler_id.cache_clear()
        compiler.missing_compiler.cache_clear()
    assert "no-such-cc' does not run" in caplog.text and "install gcc" in caplog.text
    assert eager[0].weight.grad is None and compiled._orig_mod[0].weight.grad is not None


def test_a_home_that_cannot_hold_the_cache_compiles_into_the_temp_folder(monkeypatch, tmp_path, caplog):
    """HOME unwritable (`docker run --user 1000`: HOME=/) and no TFSN_CACHE: the first step of `tfsn.optimize(model)`
    failed with BackendCompilerFailed (PermissionError, here NotADirectoryError, making ~/.cache/tfsn)."""
    import tempfile

    from optimizer import cache
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    monkeypatch.delenv("TFSN_CACHE")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cache.default_cache_dir.cache_clear()
    try:
        eager, x = model_and_input()
        with caplog.at_level("WARNING", logger="tfsn.optimizer"):
            check(optimize(copy.deepcopy(eager), top_k=1), eager, x)
    finally:
        cache.default_cache_dir.cache_clear()
    assert "cannot be used" in caplog.text and "set TFSN_CACHE" in caplog.text
    assert list((tmp_path / f"tfsn-cache-{os.getuid()}" / "search").glob("*.json"))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.fc(x))


def test_blocks_optimized_one_by_one_share_one_compiled_frame_past_dynamos_recompile_limit():
    """`tfsn.optimize(block)` for each block (torchtitan compiles FSDP2 blocks so): each call made a new backend,
    which Dynamo guards on, so the blocks' shared forward recompiled per block and blocks past the 9th ran eagerly."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    eager = nn.Sequential(*(Residual() for _ in range(10)))
    mine = nn.Sequential(*(optimize(block) for block in copy.deepcopy(eager)))
    frames = counters["stats"]["unique_graphs"]
    check(mine, eager, torch.randn(3, 6))
    assert counters["stats"]["unique_graphs"] - frames <= 2      # 2: the first block's input needs no gradient
    assert make_backend(top_k=1) == make_backend(top_k=1) != make_backend(top_k=2)
    assert make_backend(report=[]) != make_backend(report=[])   # a caller's own list: each gets its graphs


def test_a_model_torch_compile_already_compiled_is_refused():
    """`tfsn.optimize(torch.compile(net))` took torch's way (innermost_fn): net's bare `forward` compiled, a
    function, with no `parameters()`, net's hooks skipped and the user's torch.compile dropped, saying nothing."""
    eager, _ = model_and_input()
    with pytest.raises(ValueError, match=r"^tfsn: the model is already compiled by torch\.compile; pass the module "
                                         r"it wraps \(model\._orig_mod\)"):
        optimize(torch.compile(eager, backend="aot_eager"))


def test_a_ddp_module_torch_compile_already_compiled_is_refused(tmp_path):
    """`tfsn.optimize(DDP(torch.compile(net)))` compiled nn.Module's unimplemented `forward` over the
    OptimizedModule's, and the first step failed: 'Module [OptimizedModule] is missing the required "forward"
    function'. `tfsn.optimize(DDP(torch.jit.script(net)))` (or trace) failed with AttributeError: '_CachedForward'
    object has no attribute '__getattr__', reading its class's `forward`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    eager, x = model_and_input()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"^tfsn: DDP's module is already compiled by torch\.compile; put the "
                                             r"uncompiled module \(its \._orig_mod\) in DDP"):
            optimize(DistributedDataParallel(torch.compile(eager, backend="aot_eager")))
        for script in (torch.jit.script(eager), torch.jit.trace(eager, x)):
            with pytest.raises(ValueError, match=r"^tfsn: DDP's module is TorchScript \(torch\.jit\.script or "
                                                 r"torch\.jit\.trace\), which torch\.compile cannot compile; put the "
                                                 r"eager module in DDP"):
                optimize(DistributedDataParallel(script))
    finally:
        dist.destroy_process_group()


def registered() -> bool:
    return any(ep.name == "tfsn" for ep in importlib.metadata.entry_points(group="torch_dynamo_backends"))


@pytest.mark.skipif(not registered(), reason="the tfsn entry point is not installed (pip install -e .)")
def test_torch_compile_by_name():
    eager, x = model_and_input()
    mine = copy.deepcopy(eager)
    compiled = torch.compile(mine, backend="tfsn")
    before = backend.STATS["kernels"]
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)
    assert backend.STATS["kernels"] > before


@pytest.mark.parametrize("choice", ["recompute", "store"])
def test_either_partition_transposes_a_reused_weight_once(choice, tmp_path, monkeypatch):
    """A recurrent cell unrolled in Python applies the same Linear at every step, and the joint graph
    transposes its weight once per step. Whichever partition the search chooses (the one it decided
    is kept beside the search cache; here both are forced), the forward graph transposes it once, and
    the forward and gradients are eager's."""
    from functorch.compile import aot_function

    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / choice))
    w, u = torch.randn(7, 5, requires_grad=True), torch.randn(7, 7, requires_grad=True)
    x = torch.randn(3, 4, 5)

    def unrolled(x, w, u):
        h = torch.zeros(3, 7)
        for t in range(4):
            h = torch.tanh(x[:, t] @ w.t() + h @ u.t())
        return h

    def run_once() -> list[torch.fx.GraphModule]:
        graphs = []

        def keep(gm, _inputs):
            graphs.append(gm)
            return gm
        out = aot_function(unrolled, fw_compiler=keep, bw_compiler=keep,
                           partition_fn=backend.searched_partition())(x, w, u)
        grads = torch.autograd.grad(out.sum(), (w, u))
        want = unrolled(x, w, u)
        torch.testing.assert_close(out, want)
        for got, ref in zip(grads, torch.autograd.grad(want.sum(), (w, u))):
            torch.testing.assert_close(got, ref)
        return graphs

    run_once()                                            # decides, and keeps the decision
    decisions = list((tmp_path / choice).rglob("*.partition"))
    assert decisions, "the partition's choice was not kept"
    for path in decisions:
        path.write_text(choice)
    forward = run_once()[0]
    transposed = [n.args[0].name for n in forward.graph.nodes if n.op == "call_function"
                  and n.target in (torch.ops.aten.t.default, torch.ops.aten.permute.default)
                  and n.args[0].op == "placeholder"]
    assert sorted(transposed) == ["primals_2", "primals_3"], transposed      # w.t() and u.t(), once each


@pytest.mark.parametrize("choice", ["recompute", "store"])
def test_either_partition_leaves_a_causal_mask_built_in_forward_to_each_graph(choice, tmp_path, monkeypatch):
    """A causal mask built in forward from constants (torch.tril(torch.ones(T, T))) is not saved for the
    backward by either partition (both forced, as above): each graph computes it from no input, so their
    kernels can compute it where they read it; the gradients are eager's."""
    from functorch.compile import aot_function

    from tests.optimizer_models import MaskedAttention
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / choice))
    torch.manual_seed(0)
    model, x = MaskedAttention("tril"), torch.randn(2, 11, 24)
    params = dict(model.named_parameters())

    def loss(x, params):
        return torch.func.functional_call(model, params, (x,)).square().mean()

    def run_once() -> torch.fx.GraphModule:
        graphs = []

        def keep(gm, _inputs):
            graphs.append(gm)
            return gm
        got = torch.autograd.grad(aot_function(loss, fw_compiler=keep, bw_compiler=keep,
                                               partition_fn=backend.searched_partition())(x, params),
                                  list(params.values()))
        for g, want in zip(got, torch.autograd.grad(loss(x, params), list(params.values()))):
            torch.testing.assert_close(g, want)
        return graphs[0]

    run_once()
    for path in (tmp_path / choice).rglob("*.partition"):
        path.write_text(choice)
    forward = run_once()
    free: set[torch.fx.Node] = set()
    for node in forward.graph.nodes:
        if node.op == "call_function" and all(i in free for i in node.all_input_nodes):
            free.add(node)
    saved = [n.name for n in forward.graph.find_nodes(op="output")[0].all_input_nodes if n in free]
    assert not saved, f"the {choice} partition saves values made from no input: {saved}"


def test_a_gpu_search_is_cached_by_the_gpu_not_by_the_host(monkeypatch):
    """A GPU graph's search entry is named by the GPU (name, compute capability), Triton, torch and whether
    its graphs replay as CUDA graphs: the same GPU on a host with another compiler or CPU reads it, another
    GPU or graphs turned off do not; a CPU graph's entry still names the compiler and CPU model."""
    pytest.importorskip("triton")
    from optimizer import graphs, ir
    from optimizer.codegen import compiler
    from optimizer.hardware import find_hardware
    gpu = {"name": "NVIDIA H100 80GB HBM3", "capability": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu["name"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu["capability"])
    monkeypatch.setattr(graphs, "recorder_for",
                        lambda device: None if os.environ.get("TFSN_CUDA_GRAPHS") == "0" else object())
    host = {"cc": "gcc 12"}
    monkeypatch.setattr(compiler, "compiler_id", lambda: host["cc"])
    graph = ir.from_fx(torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1))
    h100 = find_hardware("H100")

    def key(device: str) -> str:
        return backend.search_cache_path(dataclasses.replace(graph, device=device), h100, None, True,
                                         suffix=".json").name
    first = key("cuda:0")
    host["cc"] = "clang 17"
    assert key("cuda:0") == first                           # another host, the same GPU
    on_clang = key("cpu")
    host["cc"] = "gcc 12"
    assert key("cpu") != on_clang                           # a CPU graph's entry names the compiler
    gpu["capability"] = (8, 0)
    assert key("cuda:0") != first
    gpu["capability"] = (9, 0)
    monkeypatch.setenv("TFSN_CUDA_GRAPHS", "0")
    assert key("cuda:0") != first
