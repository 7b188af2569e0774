"""A job's own training step, priced per hardware spec: run as a child process by the planner.

    python -m optimizer.entry REQUEST.json RESULT.json

The request names the job's workdir, an entry `FILE.py:FUNCTION` in it and the hardware to price it
on. The child imports FILE (as a module, not as `__main__`, so a script that guards its training with
`if __name__ == "__main__":` only defines things), calls FUNCTION, which returns `(model, batch,
loss_fn)`, and checks that shape. For each hardware it captures the training step (the loss of the
batch and its backward) and searches every graph with that chip's spec and the cost model alone
(`search_graph(timing=False)`, as `tfsn optimize --hardware` does). Each graph's predicted time is kept
in the search cache under the graph's signature and the spec, so pricing the same step again searches
nothing.

The result is one JSON object: the step's figures, or `{"error": {"stage", "message"}}` naming what in
the user's code went wrong (file and line where there is one). A hardware whose capture or search
fails gets an `error` of its own: the planner prices it with its roofline instead. Running in a child
keeps the user's imports, threads and crashes out of the planner, and lets it be stopped at a timeout.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

STAGES = ("file", "import", "function", "call", "shape")


class EntryProblem(Exception):
    """The user's entry cannot be used; `stage` is one of STAGES, the message one line."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


def _where(err: BaseException, path: Path) -> str:
    """`train.py:12: NameError: ...`: the deepest line of the user's file in the error's traceback."""
    lines = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    if isinstance(err, SyntaxError) and err.lineno and Path(err.filename or "").resolve() == path.resolve():
        place = f"{path.name}:{err.lineno}: "
    else:
        place = f"{path.name}:{lines[-1].lineno}: " if lines else ""
    text = str(err).strip().splitlines()
    return f"{place}{type(err).__name__}" + (f": {text[0]}" if text else "")


def load_entry(workdir: Path, file: str, function: str) -> tuple[Any, Any, Any]:
    """Import `file` from `workdir` and call `function`: (model, batch as a tuple, loss_fn or None)."""
    path = (workdir / file)
    if not path.is_file():
        raise EntryProblem("file", f"no file {file} in the workdir {workdir}")
    sys.path.insert(0, str(workdir))
    os.chdir(workdir)
    sys.argv = [str(path)]
    spec = importlib.util.spec_from_file_location("tfsn_entry", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tfsn_entry"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as err:     # SystemExit too: the script's own exit at import
        raise EntryProblem("import", f"importing {file} failed: {_where(err, path)}") from None
    build = getattr(module, function, None)
    if not callable(build):
        import difflib            # a near name defined in the file (Build for build, build_model for buildmodel)
        near = difflib.get_close_matches(function, [n for n, v in vars(module).items() if callable(v)
                                                    and getattr(v, "__module__", None) == "tfsn_entry"], n=1)
        raise EntryProblem("function", f"{file} has no function {function!r}"
                           + (f"; did you mean {near[0]!r}?" if near else ""))
    try:
        built = build()
    except BaseException as err:
        raise EntryProblem("call", f"{function}() failed: {_where(err, path)}") from None
    return checked(built, function)


def with_article(name: str) -> str:
    """`a list`, `an int`: a type's name with its article."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def checked(built: Any, function: str) -> tuple[Any, tuple, Any]:
    """`built` as (model, batch tuple, loss_fn), or EntryProblem("shape") saying what is wrong."""
    import torch

    expected = "(model, batch, loss_fn): an nn.Module, a tensor or tuple of tensors, and a function or None"
    if not isinstance(built, (tuple, list)) or len(built) != 3:
        what = with_article(type(built).__name__) + (f" of {len(built)}" if isinstance(built, (tuple, list)) else "")
        raise EntryProblem("shape", f"{function}() returned {what}; expected {expected}")
    model, batch, loss_fn = built
    if not isinstance(model, torch.nn.Module):
        raise EntryProblem("shape", f"{function}() returned {with_article(type(model).__name__)} as the model; "
                                    f"expected {expected}")
    batch = (batch,) if isinstance(batch, torch.Tensor) else batch
    if not isinstance(batch, (tuple, list)) or not batch or not isinstance(batch[0], torch.Tensor) \
            or batch[0].dim() < 1:
        raise EntryProblem("shape", f"{function}() returned a batch whose first item is not a tensor with a batch "
                                    f"dimension; expected {expected}")
    if loss_fn is not None and not callable(loss_fn):
        raise EntryProblem("shape", f"{function}() returned {with_article(type(loss_fn).__name__)} as loss_fn; "
                                    f"expected {expected}")
    return model, tuple(batch), loss_fn


def training_step(model: Any, loss_fn: Any) -> Any:
    """The module whose forward is the step's loss: `loss_fn(model, batch)`, or `model(*batch)`."""
    import torch

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *batch):
            return self.model(*batch) if loss_fn is None else loss_fn(self.model, batch)

    return Step()


# DDP's gradient bucket (its default bucket_cap_mb, 25): dynamo splits a DDP model's graph at these buckets
DDP_BUCKET_BYTES = 25 * 1024 * 1024


# The step as a worker's loop runs it, timed where the workers run (`price_here`): after one untimed step, at
# least TIMED_STEPS[0] steps and then more until TIMED_STEPS[1] or TIMED_BUDGET_S
TIMED_STEPS = (3, 30)
TIMED_BUDGET_S = 3.0


@contextlib.contextmanager
def _captured(model: Any, batch: tuple, loss_fn: Any, backend: Any, data_parallel: bool) -> Iterator[Any]:
    """Run the step (loss and backward) once through `backend` and give the compiled step. In a data-parallel
    job the graphs are split at DDP's gradient buckets first, as dynamo splits a DDP model's (DDPOptimizer), so
    that the graphs searched here are the very graphs the workers compile."""
    import torch

    if data_parallel:
        from torch._dynamo.backends.distributed import DDPOptimizer
        backend = DDPOptimizer(bucket_bytes_cap=DDP_BUCKET_BYTES, backend_compile_fn=backend).compile_fn
    torch._dynamo.reset()
    try:
        step = torch.compile(training_step(model, loss_fn), backend=backend, dynamic=False)
        loss = step(*batch)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
            raise ValueError("the loss is not a scalar tensor that requires grad")
        loss.backward()
        yield step
    finally:
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)


def _timed_steps(step: Any, model: Any, batch: tuple) -> tuple[float, float] | None:
    """(forward and backward, update): median seconds over steps of the compiled `step` as a worker's loop runs
    it (zero_grad(set_to_none=True), backward, AdamW.step); None where that loop cannot run (no trainable
    parameter, sparse gradients). Why: what a kernel costs inside a step differs from its own timing (caches
    cold, outputs freshly allocated), around the graphs the step pays dynamo's guards, AOTAutograd's wrappers
    and autograd's engine in proportion to the model's tensors, and the update after that backward is slower
    than alone. The model's state (parameters, buffers) is put back afterwards."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    saved = {name: value.detach().clone() for name, value in model.state_dict().items()}
    forward_backward, update = [], []
    try:
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        began = time.perf_counter()
        for i in range(TIMED_STEPS[1] + 1):
            t0 = time.perf_counter()
            loss = step(*batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            t1 = time.perf_counter()
            optimizer.step()
            if i:         # the first: the optimizer's state is made
                forward_backward.append(t1 - t0)
                update.append(time.perf_counter() - t1)
            if i >= TIMED_STEPS[0] and time.perf_counter() - began > TIMED_BUDGET_S:
                break
    except (RuntimeError, ValueError):      # torch's AdamW refuses the parameters: the step is not timed
        return None
    finally:
        with torch.no_grad():
            model.load_state_dict(saved)
    return statistics.median(forward_backward), statistics.median(update)


def price(model: Any, batch: tuple, loss_fn: Any, spec: Any, threads: int | None, data_parallel: bool = False) -> dict:
    """Capture the step on `batch` and search each graph for `spec` (cost model only; cached per graph)."""
    from optimizer import search
    from optimizer.backend import search_cache_path
    from optimizer.cache import atomic_write
    from optimizer.step import predicting_backend

    seconds, cached, unsupported = [], [], []

    def on_graph(graph) -> None:
        path = search_cache_path(graph, spec, threads, True, "predicted-step", suffix=".json")
        try:
            seconds.append(float(json.loads(path.read_text())["predicted_s"]))
            cached.append(True)
            return
        except (OSError, ValueError, KeyError, TypeError):
            pass
        result = search.search_graph(graph, spec, timing=False, threads=threads)
        atomic_write(path, json.dumps({"predicted_s": result.predicted_s}).encode())
        seconds.append(result.predicted_s)
        cached.append(False)

    with _captured(model, batch, loss_fn, predicting_backend(spec, on_graph, unsupported.append), data_parallel):
        pass
    if unsupported:
        raise ValueError(f"a graph the optimizer cannot express: {unsupported[0].splitlines()[0]}")
    return {"seconds": sum(seconds), "graphs": len(seconds), "cached": all(cached)}


def price_here(model: Any, batch: tuple, loss_fn: Any, threads: int | None, data_parallel: bool = False) -> dict:
    """The step compiled as the job's workers on this machine compile it (`tfsn.optimize`: tfsn's backend,
    searched and timed here, with the threads each worker gets), so that its searches and kernels land in the
    caches under the keys the workers look up and a worker searches nothing. Priced at the chosen plans'
    predicted times; a graph the generator cannot take fails it (the workers would run it as ATen). `entries`: the
    names of those search cache entries, which the controller ships with the job's code to its cloud nodes."""
    from optimizer import backend
    from optimizer.threads import torch_threads

    seconds, searched, entries = [], [], []
    aten_graphs = backend.STATS["aten_graphs"]

    def on_plan(predicted_s: float, fresh: bool, entry: str) -> None:
        seconds.append(predicted_s)
        searched.append(fresh)
        entries.append(entry)

    with torch_threads(threads), _captured(model, batch, loss_fn, backend.make_backend(on_plan=on_plan),
                                           data_parallel) as step:
        graphs = len(seconds)
        timed = _timed_steps(step, model, batch)
        if len(seconds) > graphs:     # it compiled again while timed (a forward that changes Python state):
            timed = None              # those steps paid compiles, and its workers will run it as ATen
            del seconds[graphs:], searched[graphs:], entries[graphs:]
    if backend.STATS["aten_graphs"] > aten_graphs or not seconds:
        raise ValueError("a graph of the step runs as ATen here (the generator cannot take it)")
    return {"predicted_s": sum(seconds), "graphs": len(seconds), "cached": not any(searched),
            "entries": sorted(set(entries)),
            **({"timed_s": timed[0], "timed_update_s": timed[1]} if timed is not None else {})}


def _host_step(priced: dict, spec: Any, tensors: int, params: int, has_buffers: bool) -> dict:
    """This machine's step for the planner. Forward and backward: as timed alone (`_timed_steps`), less the
    fixed share of a one-process step that `tfsn calibrate` measured (`overhead_solo_s`, paid whatever the
    batch) in `seconds` (what a larger per-rank batch scales); where the step was not timed, its kernels'
    predicted sum. The update: as timed, else as calibrated (torch's AdamW per call, tensor and element). As one
    of several local ranks a step also pays what `tfsn calibrate` measured a data-parallel step to pay beyond
    the same step alone: a fixed share (`overhead_s`: collectives, DDP's hooks; for a model with buffers, DDP's
    broadcast of them at each forward) and a wait for the other ranks that grows as the square root of its own
    time (`parallel_wait_s`: a 1 ms step's)."""
    from optimizer.predict import measured_update_seconds

    solo = spec.step_overhead_solo_us * 1e-6
    timed = "timed_s" in priced
    return {"seconds": max(priced["timed_s"] - solo, priced["predicted_s"]) if timed else priced["predicted_s"],
            "update_s": priced["timed_update_s"] if timed else measured_update_seconds(tensors, params, spec) or 0.0,
            "overhead_solo_s": solo,
            "overhead_s": (spec.parallel_overhead_us + spec.buffer_broadcast_us * has_buffers) * 1e-6,
            "parallel_wait_s": spec.parallel_wait_us * 1e-6}


def _hardware(name: str):
    from optimizer.hardware import cpu_spec, find_hardware
    return cpu_spec() if name == "host" else find_hardware(name)


def run(request: dict) -> dict:
    """The result of a request (see the module docstring)."""
    t0 = time.perf_counter()
    try:
        model, batch, loss_fn = load_entry(Path(request["workdir"]), request["file"], request["function"])
    except EntryProblem as err:
        return {"error": {"stage": err.stage, "message": str(err)}}
    import torch

    from optimizer.predict import adam_update_seconds

    params = {id(p): p for p in model.parameters() if p.requires_grad}
    first = batch[0]
    out = {"params": sum(p.numel() for p in params.values()), "tensors": len(params),
           "grad_bytes": sum(p.numel() * p.element_size() for p in params.values()),
           "example_batch": int(first.shape[0]), "hardware": {}}
    float_params = [p for p in params.values() if p.is_floating_point()]
    out["dtype"] = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(float_params[0].dtype, "fp32") \
        if float_params else "fp32"
    for target in request["hardware"]:
        name, threads = target["name"], target.get("threads")
        t1 = time.perf_counter()
        spec = _hardware(name)
        try:
            if spec is None:
                raise ValueError(f"no hardware spec named {name!r}")
            dp = bool(request.get("data_parallel"))
            priced = price_here(model, batch, loss_fn, threads, dp) if name == "host" else \
                price(model, batch, loss_fn, spec, threads, dp)
        except Exception as err:       # the optimizer could not price it: the planner uses its roofline
            text = str(err).strip().splitlines()
            out["hardware"][name] = {"error": f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")}
            continue
        if name == "host":
            buffers = any(True for _ in model.buffers())
            out["hardware"][name] = {**priced, **_host_step(priced, spec, len(params), out["params"], buffers),
                                     "spec": spec.name, "search_s": round(time.perf_counter() - t1, 3)}
        else:
            out["hardware"][name] = {**priced, "spec": spec.name, "search_s": round(time.perf_counter() - t1, 3),
                                     "update_s": adam_update_seconds(out["params"], out["dtype"], spec)}
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[1]).read_text())
    result = run(request)
    Path(argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
