"""`tfsn calibrate` and `tfsn optimize`: the optimizer's face on the command line.

Kept apart from the optimizer so that `tfsn` starts without torch or a compiler: both are reached only
inside a command. Mounted on the main app by `register(app)`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import typer


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"tfsn: error: {message}", err=True)
    raise typer.Exit(code)


def _size(mib: float) -> str:
    return f"{mib * 1024:.0f} KiB" if mib < 1 else f"{mib:.0f} MiB" if mib < 1024 else f"{mib / 1024:.1f} GiB"


def calibrate_command(json_out: bool = typer.Option(False, "--json", help="End with one JSON line of the figures."),
                      quick: bool = typer.Option(False, "--quick", help="Shorter measurements "
                                                        "(20 ms instead of 100, fewer rounds); noisier."),
                      threads: Optional[int] = typer.Option(None, "--threads", help="Threads to measure with "
                                                            "(default: torch's, what generated kernels use).")) -> None:
    """Measure this machine (bandwidth per cache level and DRAM, FMA peak, call and fork/join overheads, the
    all-reduce between local processes and the optimizer's update) and write its hardware spec, which the CPU
    cost model and the planner then use."""
    cpus = os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= cpus:
        _fail(f"--threads {threads}: this machine has {cpus} CPUs. To fix: use 1 to {cpus}, or leave it out")
    from optimizer.calibrate import calibrate, write_host_spec
    from optimizer.calibrate_step import NoisyProbe
    from optimizer.codegen.compiler import CompileError

    try:
        cal = calibrate(threads=threads, quick=quick)
        path = write_host_spec(cal)
    except NoisyProbe as err:
        _fail(f"calibration failed: {err}. To fix: calibrate again when the machine is idle", code=1)
    except (CompileError, OSError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _fail(f"calibration failed: {first}. To fix: calibrating needs gcc (with OpenMP) on PATH or in $CC, "
              "a writable cache folder ($TFSN_CACHE) and two torch processes that meet over loopback (gloo)", code=1)
    typer.echo(f"{cal.cpu_model}: {cal.threads} thread(s), {cal.simd_width} fp32 lanes, {cal.clock_ghz:.2f} GHz "
               f"({cal.clock_source}); measured in {cal.seconds:.1f} s")
    typer.echo(f"{'level':<6} {'size':>12} {'1 thread GB/s':>14} {f'all {cal.threads} GB/s':>16}")
    for level in cal.levels:
        typer.echo(f"{level.name:<6} {_size(level.size_mib):>12} {level.core_gbs:>14.1f} {level.all_gbs:>16.1f}")
    typer.echo(f"peak fp32 GFLOP/s: {cal.peak_gflops_core:.1f} on 1 thread, {cal.peak_gflops_all:.1f} on "
               f"{cal.threads}; library sgemm at {cal.library_gemm_efficiency:.0%} of that on 1 thread")
    typer.echo(f"overheads: kernel call {cal.call_overhead_us:.2f} us, OpenMP fork/join {cal.fork_join_us:.2f} us")
    step = cal.step
    typer.echo(f"outside the graphs, one thread: all-reduce between two local processes {step.allreduce_latency_us:.0f} us "
               f"+ {step.allreduce_gbs:.2f} GB/s in a training loop; a step's fixed share {step.step_overhead_us:.0f} us "
               f"data-parallel, {step.step_overhead_solo_us:.0f} us alone; as one of two ranks a step pays "
               f"{step.parallel_overhead_us:.0f} us + {step.parallel_wait_us:.0f} us x sqrt(its time alone in ms), "
               f"{step.buffer_broadcast_us:.0f} us more where DDP broadcasts buffers; AdamW step "
               f"{step.update_fixed_us:.0f} us + {step.update_tensor_us:.1f} us per tensor + "
               f"{step.update_element_ns:.2f} ns per element")
    for note in cal.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"wrote {path}")
    if json_out:
        typer.echo(json.dumps({**cal.figures(), "path": str(path)}))


def load_callable(ref: str, option: str):
    """`MODULE:FN` (a dotted module importable from here, or a path to a .py file) to the function."""
    import importlib
    import importlib.util
    import sys

    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        _fail(f"{option} {ref!r}: expected MODULE:FN, e.g. examples/optimize/models.py:gpt2_block or "
              "mypkg.models:build")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.is_file():
                _fail(f"{option}: no file {module_name}. To fix: give the path of a Python file, or a module name")
            spec = importlib.util.spec_from_file_location(f"tfsn_user_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except typer.Exit:
        raise
    except ModuleNotFoundError as err:
        # the module named or its package, not a module it imports (mlp_models importing a missing mlp)
        if err.name is not None and (module_name + ".").startswith(err.name + "."):
            _fail(f"{option}: no module {module_name} importable from {os.getcwd()}. To fix: give the path of a "
                  f"Python file (e.g. models.py:{attr}), or run from the folder the module is importable from")
        _fail(f"{option}: importing {module_name} failed: {type(err).__name__}: {err}", code=1)
    except Exception as err:      # the user's module failed to import: say where, without a traceback
        _fail(f"{option}: importing {module_name} failed: {type(err).__name__}: {err}", code=1)
    fn = getattr(module, attr, None)
    if not callable(fn):
        import difflib
        near = difflib.get_close_matches(attr, [n for n, v in vars(module).items() if callable(v)
                                               and getattr(v, "__module__", None) == module.__name__], n=1)
        _fail(f"{option}: {module_name} has no function {attr!r}"
              + (f". Did you mean {near[0]!r}? To fix: {option} {module_name}:{near[0]}" if near
                 else f". To fix: name a function defined in {module_name}"))
    return fn


def example_inputs(ref: str, made: Any) -> tuple:
    """What `--inputs` returned, as the model's positional arguments: a tuple (a single value is one argument).
    A model, a function or a module is not inputs (`--inputs` pointed at the model's builder, say)."""
    import torch

    from optimizer.entry import with_article
    example = made if isinstance(made, tuple) else (made,)
    for value in example:
        if isinstance(value, torch.nn.Module) or (callable(value) and not hasattr(value, "shape")):
            _fail(f"--inputs {ref} returned {with_article(type(value).__name__)}, not the model's example inputs. "
                  "To fix: point --inputs at a function returning a tuple of tensors, e.g. "
                  "examples/optimize/models.py:gpt2_inputs")
    return example


EMIT_HELP = ("write the chosen plan to DIR/plan.json (created if missing): every graph's fusion groups, each "
             "kernel's chosen schedule (on a GPU its launch shape: tile, warps, stages) and predicted time, each "
             "extern's class, FLOPs, bytes and predicted time, and the totals; for a GPU, the Triton kernels of "
             "that plan too, one module per graph (DIR/forward.py, DIR/backward.py)")


def _emit_dir(emit: str):
    """The folder `--emit` names, created and checked writable before any work: a bad DIR fails at once."""
    import tempfile

    path = Path(emit).expanduser()
    if path.exists() and not path.is_dir():
        _fail(f"--emit {emit}: exists and is not a folder. To fix: name a folder (created if missing), "
              "e.g. --emit plan-h100")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".tfsn-emit-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        _fail(f"--emit {emit}: cannot write there: {err.strerror or err}. To fix: name a folder you can write, "
              "e.g. --emit plan-h100")
    return path


def _print_report(report) -> dict:
    data = report.to_json()
    typer.echo(f"hardware: {data['hardware']} ({'measured here' if report.measured_here else 'predicted only'})")
    typer.echo(f"space: {data['space_size']:,} candidates over {data['graphs']} graph(s) (fusion plans x the sum of "
               f"their kernels' schedules); scored {data['scored']:,} ({data['plans_scored']} fusion plans; "
               f"{data['collapsed']:,} twins the model prices alike left out) at {data['scored_per_s']:,} candidates/s "
               f"(+{data['features_s']:.2f} s reading kernels); search with timing {data['search_s']:.2f} s, "
               f"whole step {data['seconds']:.1f} s")
    typer.echo(f"predicted step: {data['predicted_step_s'] * 1e3:.3f} ms (kernels and externs)")
    for i, chosen in enumerate(data["chosen"]):
        typer.echo(f"graph {i} ({report.name(i)}):")
        typer.echo(chosen)
    if data["measured"]:
        typer.echo("measured candidates (predicted -> measured, us):")
        typer.echo("  " + ", ".join(f"{m['predicted_s'] * 1e6:.0f}->{m['measured_s'] * 1e6:.0f}"
                                    for m in data["measured"][:64]))
    return data


def _hardware_spec(hardware: str):
    """The spec `--hardware` names (None: this machine, measured), or a one-line error."""
    from optimizer.hardware import find_hardware, load_all

    if hardware.casefold() in ("cpu", "host"):
        return None
    spec = find_hardware(hardware)
    if spec is None:
        known = ", ".join(sorted(n.lower() for n in load_all()))
        _fail(f"--hardware {hardware!r} is not a known chip. To fix: use cpu or one of {known}")
    return None if spec.kind == "cpu" and spec.name == "cpu-generic" else spec


def optimize_command(model: str = typer.Option(..., "--model", help="MODULE:FN (or FILE.py:FN) returning the model (an "
                                               "nn.Module), or a JAX training step (a function of its inputs, "
                                               "as given to jax.jit)"),
                     inputs: str = typer.Option(..., "--inputs", help="MODULE:FN (or FILE.py:FN) returning a tuple "
                                                "of example inputs"),
                     hardware: str = typer.Option("cpu", "--hardware", help="cpu (this machine: measured), or a "
                                                  "chip of configs/hardware: h100, h200, a100-80gb, l4, a10g, mi300x, ..."),
                     top_k: int = typer.Option(8, "--top-k", help="schedules per kernel compiled and timed (cpu only)"),
                     emit: Optional[str] = typer.Option(None, "--emit", metavar="DIR", help=EMIT_HELP),
                     json_out: bool = typer.Option(False, "--json", help="End with one JSON line of the results.")) -> None:
    """Search the training step (forward + backward) of a model, or a JAX training step: fusion plan and
    kernel schedules, chosen by the cost model; on this machine the top k of each kernel are compiled and timed."""
    if top_k < 1:
        _fail(f"--top-k {top_k}: must be at least 1 (1: the cost model's pick, nothing timed)")
    spec = _hardware_spec(hardware)
    folder = _emit_dir(emit) if emit is not None else None
    build, make_inputs = load_callable(model, "--model"), load_callable(inputs, "--inputs")
    try:
        module, example = build(), make_inputs()
    except Exception as err:
        _fail(f"building the model or its inputs failed: {type(err).__name__}: {err}", code=1)
    report = _step_report(model, module, example_inputs(inputs, example), spec, top_k)
    data = _print_report(report)
    if folder is not None:
        _emit(folder, emit, report)
    if json_out:
        typer.echo(json.dumps(data))


def _step_report(model: str, built, example: tuple, spec, top_k: int):
    """The search's report of a torch model's step, or of a JAX step function's; a failure is one line."""
    import torch

    if isinstance(built, torch.nn.Module):
        from optimizer.step import optimize_step as search_step
    elif callable(built):
        try:
            from optimizer.jax_backend import step_report as search_step
        except ImportError:
            _fail(f"--model {model} returned a function, which tfsn reads as a JAX training step, but JAX is not "
                  "installed. To fix: pip install 'tfsn[jax]', or return an nn.Module")
    else:
        _fail(f"--model {model} returned a {type(built).__name__}. To fix: return a torch.nn.Module, or a JAX "
              "training step function")
    try:
        return search_step(built, example, spec, top_k=top_k)
    except Exception as err:     # the model failed under capture: one line, the cause
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        _fail(f"the training step failed under capture: {type(err).__name__}: {first}", code=1)


def _emit(folder: Path, emit: str, report) -> None:
    """plan.json, and on a GPU the plan's Triton kernels: a module per graph, each group's kernel named in
    plan.json. Each file is written whole or not at all."""
    from optimizer.cache import atomic_write
    from optimizer.codegen.triton import Unsupported
    from optimizer.step import plan_json, triton_sources

    plan = plan_json(report)
    files = {}
    if report.kind == "gpu":
        try:
            sources = triton_sources(report)
        except Unsupported as err:      # an op with no Triton form: the plan is still worth having
            typer.echo(f"no Triton kernels written: {err}")
            sources = {}
        for graph in plan["graphs"]:
            if graph["name"] in sources:
                source, names = sources[graph["name"]]
                for group in graph["groups"]:
                    if names[group["group"]] is not None:
                        group["kernel"] = f"{graph['name']}.py:{names[group['group']]}"
                files[f"{graph['name']}.py"] = source
    files["plan.json"] = json.dumps(plan, indent=1) + "\n"
    for name, text in files.items():
        try:
            atomic_write(folder / name, text.encode())
        except OSError as err:
            _fail(f"--emit {emit}: writing {name} failed: {err.strerror or err}", code=1)
    typer.echo("wrote " + ", ".join(str(folder / name) for name in files))


def register(app: typer.Typer) -> None:
    """Add the optimizer's commands to `app` (the main `tfsn` app)."""
    app.command("calibrate")(calibrate_command)
    app.command("optimize")(optimize_command)
