"""The `tfsn` command line.

Commands read the store directly; launch and stop write a request into it and make sure a
controller is running to act on it. Bad input ends with one line on stderr and exit code 2.
"""
from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from orchestrator import daemon
from orchestrator.controller import requested_cpus
from orchestrator.home import job_dir, tfsn_home
from orchestrator.spec import JobSpec, SpecError, load_spec
from orchestrator.store import Job, JobState, Store, StoreError
from orchestrator.view import follow, job_panel, job_summary, jobs_table

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="tfsn: train a PyTorch script on the cheapest capable nodes, and keep it running.")
controller_app = typer.Typer(no_args_is_help=True, help="Manage the background controller.")
app.add_typer(controller_app, name="controller")
health_app = typer.Typer(no_args_is_help=True, help="The health monitor: simulate it on a virtual cluster.")
app.add_typer(health_app, name="health")
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def _store() -> Store:
    return Store(daemon.store_path(tfsn_home()))


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {pair!r}: expected KEY=VALUE. To fix: e.g. --env SEED=1")
        env[key] = value
    return env


def placement_error(spec: JobSpec) -> str | None:
    """Why no enabled provider can run `spec`, or None. (The planner of cloud offers comes later.)"""
    if not Path(spec.workdir).is_dir():
        return f"workdir {spec.workdir} is not a directory. To fix: point workdir at the folder of your script"
    infra = spec.resources.infra or ["local"]
    if "local" not in infra:
        return (f"resources.infra {infra}: tfsn has no driver for these providers yet. "
                "To fix: use infra: [local] (or remove infra) to run on this machine")
    if spec.resources.accelerators is not None:
        wanted = ", ".join(f"{a.name}:{a.count}" for a in spec.resources.accelerator_choices())
        return (f"resources.accelerators {wanted}: this machine has no such accelerator and no cloud is enabled. "
                "To fix: remove resources.accelerators to run on this machine's CPUs")
    cpus = requested_cpus(spec)
    if cpus is not None and cpus > (os.cpu_count() or 1):
        return f"resources.cpus {cpus}: this machine has {os.cpu_count()} CPUs. To fix: lower resources.cpus"
    return None


@app.command()
def validate(file: Path = typer.Argument(..., help="the job spec (train.yaml)")) -> None:
    """Check a job spec and print what it resolves to."""
    spec = load_spec(file)
    console.print(f"{file}: valid job '{spec.name}': {spec.num_nodes} node(s) x {spec.nprocs()} worker(s), "
                  f"workdir {spec.workdir}", highlight=False)


@app.command()
def launch(file: Path = typer.Argument(..., help="the job spec (train.yaml)"),
           detach: bool = typer.Option(False, "--detach", "-d", help="return once the job is submitted"),
           env: list[str] = typer.Option([], "--env", help="KEY=VALUE added to the job's envs (repeatable)"),
           name: Optional[str] = typer.Option(None, "--name", help="job name (default: the spec's)")) -> None:
    """Launch a job and follow it (Ctrl-C stops it; use --detach to leave it running)."""
    spec = load_spec(file, overrides=_env_pairs(env))
    if name:
        try:
            spec = JobSpec.model_validate({**spec.model_dump(mode="json"), "name": name})
        except ValidationError:
            raise UsageError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (at most 63), "
                             "starting with a letter or digit") from None
    problem = placement_error(spec)
    if problem:
        raise UsageError(f"{file}: {problem}")
    store = _store()
    job = store.create_job(spec.name, spec.model_dump(mode="json"), str(file.resolve()), secrets.token_urlsafe(32))
    daemon.ensure_controller()
    if detach:
        console.print(f"job {job.id} ({job.name}) submitted.  Follow: tfsn logs {job.id} --follow   "
                      f"Status: tfsn status {job.id}   Stop: tfsn stop {job.id}", highlight=False)
        return
    console.print(f"job {job.id} ({job.name}) submitted; Ctrl-C stops it.", highlight=False)
    try:
        final = follow(store, job.id, job_dir(job.id) / "job.log", console)
    except KeyboardInterrupt:
        store.request_stop(job.id)
        console.print(f"stopping job {job.id}...")
        final = _wait_terminal(store, job.id, timeout=120)
    _finish_message(final)
    raise typer.Exit(0 if final.state == JobState.SUCCEEDED else 1)


def _finish_message(job: Job) -> None:
    took = (job.finished_at or time.time()) - job.created_at
    line = f"job {job.id} {job.state.value} in {took:.0f}s after {job.restarts} restart(s)"
    if job.checkpoint_step:
        line += f"; last checkpoint: step {job.checkpoint_step} at {job.checkpoint_path}"
    console.print(line, highlight=False)
    if job.error:
        err_console.print(f"error: {job.error}", highlight=False, markup=False)


def _wait_terminal(store: Store, job_id: int, timeout: float) -> Job:
    deadline = time.monotonic() + timeout
    job = store.job(job_id)
    while not job.state.terminal and time.monotonic() < deadline:
        time.sleep(0.2)
        job = store.job(job_id)
    return job


def _revive_controller(store: Store) -> None:
    """A controller that died with jobs in flight is started again, which picks them up."""
    if store.jobs(active_only=True):
        daemon.ensure_controller()


@app.command()
def status(job: Optional[str] = typer.Argument(None, help="job id or name (default: all jobs)"),
           as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Show one job in detail, or all jobs."""
    store = _store()
    _revive_controller(store)
    if job is None:
        jobs = store.jobs()
        if as_json:
            print(json.dumps([job_summary(store, j) for j in jobs]))
        else:
            console.print(jobs_table(jobs))
        return
    record = store.find_job(job)
    if as_json:
        print(json.dumps(job_summary(store, record)))
    else:
        console.print(job_panel(store, record, []))
        for event in store.events(record.id)[-10:]:
            console.print(f"  {time.strftime('%H:%M:%S', time.localtime(event.at))}  {event.message}",
                          highlight=False, markup=False)


@app.command("ls")
def list_jobs() -> None:
    """List all jobs."""
    store = _store()
    _revive_controller(store)
    console.print(jobs_table(store.jobs()))


@app.command()
def logs(job: str = typer.Argument(..., help="job id or name"),
         follow_: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job ends")) -> None:
    """Print a job's log (workers' output and tfsn's events)."""
    store = _store()
    record = store.find_job(job)
    log = job_dir(record.id) / "job.log"
    if not follow_:
        if log.exists():
            sys.stdout.write(log.read_text(errors="replace"))
        return
    _revive_controller(store)
    follow(store, record.id, log, Console(force_terminal=False, soft_wrap=True))


@app.command()
def stop(job: str = typer.Argument(..., help="job id or name"),
         wait: bool = typer.Option(True, help="wait until the job has stopped")) -> None:
    """Stop a job and tear down its nodes (checkpoints are kept)."""
    store = _store()
    record = store.find_job(job)
    if record.state.terminal:
        console.print(f"job {record.id} already {record.state.value}")
        return
    store.request_stop(record.id)
    daemon.ensure_controller()
    if wait:
        record = _wait_terminal(store, record.id, timeout=120)
    console.print(f"job {record.id} {record.state.value}")


@controller_app.command("start")
def controller_start() -> None:
    """Start the controller in the background (it also starts on demand)."""
    info = daemon.ensure_controller()
    console.print(f"controller {info['pid']} on {info['url']}")


@controller_app.command("stop")
def controller_stop() -> None:
    """Stop the controller; running jobs keep running and are picked up by the next one."""
    console.print("controller stopped" if daemon.stop_controller() else "no controller running")


@controller_app.command("status")
def controller_status() -> None:
    """Is the controller running?"""
    info = daemon.read_info(tfsn_home())
    console.print(f"controller {info['pid']} on {info['url']}, Prometheus metrics on {info['metrics_url']}"
                  if info else "no controller running")


@health_app.command("simulate")
def health_simulate(ranks: int = typer.Option(512, "--ranks", help="ranks in the simulated job"),
                    steps: int = typer.Option(300, "--steps", help="training steps to simulate"),
                    throttle_rank: Optional[int] = typer.Option(None, "--throttle-rank", help="rank to slow down"),
                    slowdown: float = typer.Option(0.2, "--slowdown", help="0.10 = that rank is 10% slower"),
                    onset: int = typer.Option(100, "--onset", help="step at which the slowdown starts"),
                    seed: int = typer.Option(0, "--seed", help="random seed (same seed, same run)"),
                    as_json: bool = typer.Option(False, "--json", help="end with one JSON line")) -> None:
    """Run the detectors and policy on a simulated cluster: detection delay, false positives, ETTR."""
    from health.sim import simulate_command
    raise typer.Exit(simulate_command(ranks, steps, throttle_rank, slowdown, onset, seed, as_json))


def main() -> None:
    """Entry point: bad input is one line on stderr and exit code 2, never a traceback."""
    try:
        app()
    except SpecError as err:
        for message in err.messages:
            print(f"tfsn: error: {message}", file=sys.stderr)
        sys.exit(2)
    except (UsageError, StoreError) as err:
        print(f"tfsn: error: {err}", file=sys.stderr)
        sys.exit(2)
    except daemon.ControllerStartError as err:
        print(f"tfsn: error: {err}", file=sys.stderr)
        sys.exit(1)
