"""`tfsn calibrate` (and, later, the other optimizer commands): the optimizer's face on the command line.

Kept apart from the optimizer so that `tfsn` starts without torch or a compiler: both are reached only
inside a command. Mounted on the main app by `register(app)`.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import typer


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _size(mib: float) -> str:
    return f"{mib * 1024:.0f} KiB" if mib < 1 else f"{mib:.0f} MiB" if mib < 1024 else f"{mib / 1024:.1f} GiB"


def calibrate_command(json_out: bool = typer.Option(False, "--json", help="End with one JSON line of the figures."),
                      quick: bool = typer.Option(False, "--quick", help="About a second instead of ~10; noisier."),
                      threads: Optional[int] = typer.Option(None, "--threads", help="Threads to measure with "
                                                            "(default: torch's, what generated kernels use).")) -> None:
    """Measure this machine (bandwidth per cache level and DRAM, FMA peak, call and fork/join overheads)
    and write its hardware spec, which the CPU cost model then uses."""
    cpus = os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= cpus:
        _fail(f"--threads {threads}: this machine has {cpus} CPUs. To fix: use 1 to {cpus}, or leave it out")
    from optimizer.calibrate import calibrate, write_host_spec
    from optimizer.codegen.compiler import CompileError

    try:
        cal = calibrate(threads=threads, quick=quick)
        path = write_host_spec(cal)
    except (CompileError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _fail(f"calibration failed: {first}. To fix: calibrating needs gcc (with OpenMP) on PATH or in $CC, "
              "and a writable cache folder ($TFSN_CACHE)", code=1)
    typer.echo(f"{cal.cpu_model}: {cal.threads} thread(s), {cal.simd_width} fp32 lanes, {cal.clock_ghz:.2f} GHz "
               f"({cal.clock_source}); measured in {cal.seconds:.1f} s")
    typer.echo(f"{'level':<6} {'size':>12} {'1 thread GB/s':>14} {f'all {cal.threads} GB/s':>16}")
    for level in cal.levels:
        typer.echo(f"{level.name:<6} {_size(level.size_mib):>12} {level.core_gbs:>14.1f} {level.all_gbs:>16.1f}")
    typer.echo(f"peak fp32 GFLOP/s: {cal.peak_gflops_core:.1f} on 1 thread, {cal.peak_gflops_all:.1f} on "
               f"{cal.threads}")
    typer.echo(f"overheads: kernel call {cal.call_overhead_us:.2f} us, OpenMP fork/join {cal.fork_join_us:.2f} us")
    for note in cal.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"wrote {path}")
    if json_out:
        typer.echo(json.dumps({**cal.figures(), "path": str(path)}))


def register(app: typer.Typer) -> None:
    """Add the optimizer's commands to `app` (the main `tfsn` app)."""
    app.command("calibrate")(calibrate_command)
