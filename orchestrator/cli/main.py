"""The `tfsn` command line.

Commands read the store directly; launch and stop write a request into it and make sure a
controller is running to act on it. Bad input ends with one line on stderr and exit code 2.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from orchestrator.cli.interrupts import raise_if_interrupted
from orchestrator.cli.operator import operator_app
from orchestrator.cli.optimizer import register as register_optimizer_commands
from orchestrator.cli.down import register as register_down_command
from orchestrator.cli.view import (aligned, boot_failures, cost_text, follow, job_panel, job_summary, jobs_table,
                                   print_log)
from orchestrator.control import daemon
from orchestrator.control.cost import job_cost
from orchestrator.control.store import Job, JobState, Store, StoreError
from orchestrator.home import job_dir, tfsn_home
from orchestrator.planning.offers import candidate_text, hardware_lines, model_text, nodes_text
from orchestrator.spec import JobSpec, SpecError, checkpoint_url_scheme, job_name_problem, load_spec, spec_line

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="tfsn: train a PyTorch script on the cheapest capable nodes, and keep it running.")
controller_app = typer.Typer(no_args_is_help=True, help="Manage the background controller.")
app.add_typer(controller_app, name="controller")
health_app = typer.Typer(no_args_is_help=True, help="The health monitor: simulate it on a virtual cluster.")
app.add_typer(health_app, name="health")
catalog_app = typer.Typer(no_args_is_help=True, help="The instance catalog: list offers, refresh their prices.")
app.add_typer(catalog_app, name="catalog")
app.add_typer(operator_app, name="operator")
register_optimizer_commands(app)
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def _home() -> Path:
    """tfsn's folder, or a one-line error naming TFSN_HOME: a file there, or a place this user cannot write."""
    try:
        return tfsn_home()
    except OSError as err:
        where = os.environ.get("TFSN_HOME") or "~/.tfsn"
        why = "is a file" if os.path.isfile(os.path.expanduser(where)) else f"cannot be used ({err.strerror or err})"
        raise UsageError(f"TFSN_HOME {where} {why}: tfsn keeps its jobs in that folder. To fix: set TFSN_HOME to a "
                         "folder you can write to") from None


def _disk_failed(err: sqlite3.Error) -> bool:
    """Did SQLite fail for want of space (SQLITE_FULL, or EFBIG as SQLITE_IOERR), or of a working disk, rather
    than for the file's content?"""
    return any(words in str(err) for words in ("disk is full", "disk I/O error"))


def _store() -> Store:
    path = daemon.store_path(_home())
    try:
        return Store(path)
    except sqlite3.DatabaseError as err:     # another program's file, a damaged one, a read-only or full disk
        if _disk_failed(err):                # moving the store away would hide its jobs, and the disk stays full
            raise UsageError(f"{path}: cannot open tfsn's store ({err}): its disk is full or failing. To fix: free "
                             "space on it (the store and its jobs are kept as they are), or set TFSN_HOME to a "
                             "folder on another disk") from None
        if path.is_file() and not os.access(path.parent, os.W_OK):
            try:
                return Store(path, read_only=True)      # its jobs can still be shown; a change is refused
            except sqlite3.DatabaseError:
                pass
            raise UsageError(f"{path}: cannot open tfsn's store ({err}): TFSN_HOME is not writable. To fix: make it "
                             "writable, or set TFSN_HOME to another folder") from None
        raise UsageError(f"{path}: cannot open tfsn's store ({err}). To fix: move the file away (tfsn starts an "
                         "empty store) or set TFSN_HOME to another folder") from None


register_down_command(app, _store)


# `--env KEY=VALUE` of launch and validate: validate checks the file as launch takes it, $NAME in paths included
EnvPairs = Annotated[list[str], typer.Option("--env", help="KEY=VALUE added to the job's envs (repeatable)")]


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {pair!r}: expected KEY=VALUE. To fix: e.g. --env SEED=1")
        env[key] = value
    return env


def launch_problem(spec: JobSpec) -> tuple[tuple[str, ...], str] | None:
    """What would stop a launch of this valid spec, as (the field to blame, a message naming it), or None:
    a workdir that is not there, no capable offer where the job may run (the planner's reason), a workdir
    over the code size cap when the chosen offer's VMs get it packed (codesync.py), or checkpoints on a
    disk that the job's cloud nodes do not share. The clouds the plan was made without are warned of here, the one
    plan of the check (the job would go elsewhere than the user may expect, said after a launch only in its events)."""
    if not Path(spec.workdir).is_dir():
        return ("workdir",), (f"workdir: {spec.workdir} is not a directory. To fix: point workdir at the "
                              "folder of your script")
    from orchestrator.planning.placement import checkpoint_problem, plan_for, unread_lines
    from orchestrator.planning.planner import PlanError
    from providers.base import ProviderError
    from providers.catalog import CatalogError

    from orchestrator.control.boot import runs_boot_script
    from orchestrator.control.codesync import CodeSyncError, check_size

    try:
        plan = plan_for(spec)
    except (PlanError, ProviderError, CatalogError) as err:
        return (err.field if isinstance(err, PlanError) else ()), str(err)
    for line in unread_lines(plan):
        print(f"tfsn: warning: {line}", file=sys.stderr)
    if runs_boot_script(plan.chosen.offer.provider):   # its VMs get the workdir packed: refuse what is too big now
        try:
            check_size(Path(spec.workdir))
        except CodeSyncError as err:
            return ("workdir",), str(err)
    return checkpoint_problem(spec)


def _same_folder(a: str, b: str) -> bool:
    """Do two checkpoint.dir values name one folder (an object-store URL compared as written)?"""
    if checkpoint_url_scheme(a) or checkpoint_url_scheme(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def refuse_shared_checkpoints(file: Path, spec: JobSpec) -> Callable[[list[Job]], None]:
    """A guard for `Store.create_job`: two live jobs saving into one checkpoint.dir would restore and prune
    each other's checkpoints and collide on a step's name; the second is refused, naming the first."""
    def guard(active: list[Job]) -> None:
        mine = spec.checkpoint.dir
        for job in active if mine is not None else ():
            theirs = (job.spec.get("checkpoint") or {}).get("dir") if isinstance(job.spec, dict) else None
            if isinstance(theirs, str) and _same_folder(mine, theirs):
                raise UsageError(
                    f"{file}:{spec_line(file, ('checkpoint', 'dir'))}: checkpoint.dir: {mine} is in use by job "
                    f"{job.id} ({job.name}, {job.state.value}); two jobs saving there would overwrite each other's "
                    f"checkpoints. To fix: stop it first (tfsn stop {job.id}) or give this job another checkpoint.dir")
    return guard


SAFE_HEARTBEAT_TIMEOUT_S = 10.0   # a node's agent beats every second, late by seconds on a loaded machine


def heartbeat_warnings(spec: JobSpec) -> list[tuple[tuple[str, ...], str]]:
    """A heartbeat_timeout within a few heartbeats fails healthy nodes: 1s replaced both nodes of a local job as
    its first attempt started (a restart and two new nodes for nothing; on a cloud, two new VMs)."""
    from orchestrator.sdk.client import HEARTBEAT_S

    timeout = spec.health.heartbeat_timeout
    if timeout >= SAFE_HEARTBEAT_TIMEOUT_S:
        return []
    return [(("health", "heartbeat_timeout"),
             f"health.heartbeat_timeout: {timeout:g}s is a few heartbeats of a node's agent (one every "
             f"{HEARTBEAT_S:g}s, later on a busy node): healthy nodes may be failed and replaced. To fix: "
             f"{SAFE_HEARTBEAT_TIMEOUT_S:g}s or more (default 30s)")]


def checked_spec(file: Path, overrides: dict[str, str] | None = None) -> JobSpec:
    """`file` as a launch takes it: valid, and able to run. `validate` is this very check, so the two
    commands accept and refuse the same files with the same messages, and print the same warnings: what
    would likely fail on a node but may not (a VM with no credentials for the job's bucket)."""
    from orchestrator.planning.placement import identity_warnings

    spec = load_spec(file, overrides, check=launch_problem)
    for field, message in identity_warnings(spec) + heartbeat_warnings(spec):
        print(f"tfsn: warning: {file}:{spec_line(file, field)}: {message}", file=sys.stderr)
    return spec


@app.command()
def validate(file: Path = typer.Argument(..., help="the job spec (train.yaml)"), env: EnvPairs = []) -> None:
    """Check a job spec as `tfsn launch` would (workdir and planning included), and print what it resolves to."""
    spec = checked_spec(file, overrides=_env_pairs(env))
    console.print(f"{file}: valid job '{spec.name}': {spec.num_nodes} node(s) x {spec.nprocs()} worker(s), "
                  f"workdir {spec.workdir}", highlight=False)


@app.command()
def launch(file: Path = typer.Argument(..., help="the job spec (train.yaml)"),
           detach: bool = typer.Option(False, "--detach", "-d", help="return once the job is submitted"),
           env: EnvPairs = [],
           name: Optional[str] = typer.Option(None, "--name", help="job name (default: the spec's)")) -> None:
    """Launch a job and follow it (Ctrl-C stops it; use --detach to leave it running)."""
    spec = checked_spec(file, overrides=_env_pairs(env))
    if name:
        if problem := job_name_problem(name):
            raise UsageError(f"--name {problem}")
        try:
            spec = JobSpec.model_validate({**spec.model_dump(mode="json"), "name": name})
        except ValidationError:
            raise UsageError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (at most 63), "
                             "starting with a letter or digit") from None
    raise_if_interrupted()        # a Ctrl-C while it planned, though Python dropped its exception: submit nothing
    store = _store()
    job = store.create_job(spec.name, spec.model_dump(mode="json"), str(file.resolve()), secrets.token_urlsafe(32),
                           guard=refuse_shared_checkpoints(file, spec))
    try:   # from here on the job exists: a Ctrl-C while its controller starts stops it too, not only one later
        daemon.ensure_controller()
        if detach:
            console.print(f"job {job.id} ({job.name}) submitted.  Follow: tfsn logs {job.id} --follow   "
                          f"Status: tfsn status {job.id}   Stop: tfsn stop {job.id}", highlight=False)
            return
        console.print(f"job {job.id} ({job.name}) submitted; Ctrl-C stops it.", highlight=False)
        final = follow(store, job.id, job_dir(job.id) / "job.log", console,
                       keep_alive=lambda: _revive_controller(store))
    except KeyboardInterrupt:
        store.request_stop(job.id)
        console.print(f"stopping job {job.id}...")
        _revive_controller(store, announce=False)     # the one that acts on the stop (a Ctrl-C may have cut its start)
        final = _wait_terminal(store, job.id, timeout=120)
    _finish_message(store, final)
    raise typer.Exit(0 if final.state == JobState.SUCCEEDED else 1)


def _finish_message(store: Store, job: Job) -> None:
    took = (job.finished_at or time.time()) - job.created_at
    line = (f"job {job.id} {job.state.value} in {took:.0f}s after {job.restarts} restart(s); "
            f"cost: {cost_text(job_cost(job, store.nodes(job.id)), job.spec)}")
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


def _revive_controller(store: Store, announce: bool = True) -> None:
    """A controller that died with jobs in flight is started again, which picks them up (said, unless the caller
    knows why there is none: a Ctrl-C during `launch` may cut the first one's start short)."""
    if store.jobs(active_only=True) and daemon.read_info(_home()) is None:
        if announce:
            err_console.print("tfsn: the controller had stopped; starting it again (running jobs carry on)",
                              highlight=False, markup=False)
        try:
            daemon.ensure_controller()
        except daemon.ControllerStartError as err:   # what the store says can still be shown
            err_console.print(f"tfsn: warning: {err}", highlight=False, markup=False)


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
            console.print(jobs_table(store, jobs))
        return
    record = store.find_job(job)
    if as_json:
        print(json.dumps(job_summary(store, record)))
    else:
        console.print(job_panel(store, record, []))
        for event in store.events(record.id)[-10:]:
            console.print(f"  {time.strftime('%H:%M:%S', time.localtime(event.at))}  {event.message}",
                          highlight=False, markup=False)
        for line in boot_failures(store, record):
            console.print(line, highlight=False, markup=False)


@app.command("ls")
def list_jobs() -> None:
    """List all jobs."""
    store = _store()
    _revive_controller(store)
    console.print(jobs_table(store, store.jobs()))


@app.command()
def logs(job: str = typer.Argument(..., help="job id or name"),
         follow_: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job ends")) -> None:
    """Print a job's log (workers' output and tfsn's events)."""
    store = _store()
    record = store.find_job(job)
    log = job_dir(record.id) / "job.log"
    if not follow_:
        if not log.exists():      # printing nothing read as a job that ran and said nothing
            err_console.print(f"tfsn: job {record.id} ({record.state.value}) has no log yet. See: tfsn status "
                              f"{record.id}", highlight=False, markup=False)
        print_log(log, sys.stdout)
        return
    _revive_controller(store)
    follow(store, record.id, log, Console(force_terminal=False, soft_wrap=True),
           keep_alive=lambda: _revive_controller(store))


def _job_to_stop(store: Store, ref: str) -> Job:
    """The job `tfsn stop REF` means: by id, that job; by name, the live job of that name. Names repeat, and the newest
    job of the name was taken: once it had ended, `tfsn stop NAME` said "already STOPPED" while an older job of that
    name ran on. Several live ones are refused, to be named by id."""
    record = store.find_job(ref)
    if ref.isascii() and ref.isdigit():
        return record
    live = [j for j in store.jobs(active_only=True) if j.name == ref]
    if len(live) > 1:
        raise UsageError(f"{len(live)} live jobs are named {ref!r} (ids {', '.join(str(j.id) for j in live)}). To fix: "
                         f"stop each by its id, e.g. tfsn stop {live[-1].id}")
    return live[0] if live else record


@app.command()
def stop(job: str = typer.Argument(..., help="job id or name"),
         wait: bool = typer.Option(True, help="wait until the job has stopped")) -> None:
    """Stop a job and tear down its nodes (checkpoints are kept)."""
    store = _store()
    record = _job_to_stop(store, job)
    if record.state.terminal:
        console.print(f"job {record.id} already {record.state.value}")
        return
    store.request_stop(record.id)
    daemon.ensure_controller()
    if not wait:    # its state is still the one it ran in: "job 1 RUNNING" read as if the stop had not been taken
        console.print(f"job {record.id}: stop requested (it was {record.state.value}). Follow: tfsn status {record.id}",
                      highlight=False)
        return
    record = _wait_terminal(store, record.id, timeout=120)
    console.print(f"job {record.id} {record.state.value}")


@controller_app.command("start")
def controller_start() -> None:
    """Start the controller in the background (it also starts on demand)."""
    _home()                          # a one-line error where TFSN_HOME cannot be used
    info = daemon.ensure_controller()
    console.print(f"controller {info['pid']} on {info['url']}")


@controller_app.command("stop")
def controller_stop() -> None:
    """Stop the controller; running jobs keep running and are picked up by the next one."""
    console.print("controller stopped" if daemon.stop_controller(_home()) else "no controller running")


@controller_app.command("status")
def controller_status() -> None:
    """Is the controller running?"""
    info = daemon.read_info(_home())
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


@app.command("plan")
def plan_command(file: Path = typer.Argument(..., help="the job spec (train.yaml)"),
                 catalog: Optional[Path] = typer.Option(None, "--catalog", help="a vms.csv file or folder "
                                                        "(default: refreshed, SkyPilot's, or the shipped snapshot)"),
                 as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
                 limit: int = typer.Option(15, "--limit", min=1, help="rows of the ranked table")) -> None:
    """Rank every capable offer by the predicted cost of the whole run; show the choice and the naive one."""
    from orchestrator.planning.placement import plan_for, unread_lines
    from orchestrator.planning.planner import PlanError, memory_needed
    from providers.base import ProviderError
    from providers.catalog import CatalogError

    spec = load_spec(file)
    try:
        result = plan_for(spec, catalog=catalog, planning_only=True)
    except (CatalogError, PlanError, ProviderError) as err:
        raise UsageError(f"{file}:{spec_line(file, err.field)}: {err}" if isinstance(err, PlanError)
                         else str(err)) from None
    for line in unread_lines(result):   # as the controller's job events say it of a launch
        err_console.print(f"tfsn: warning: {line}", highlight=False, markup=False)
    need = None if result.reference_workload else memory_needed(result.workload, result.entry)
    hardware = result.hardware()
    if as_json:
        entry = result.entry
        print(json.dumps({"offers": [c.to_dict() for c in result], "chosen": result.chosen.to_dict(),
                          "naive": result.naive.to_dict(), "steps": result.steps, "nodes": result.nodes,
                          "workload": vars(result.workload) if result.workload is not None else None,
                          "reference_workload": result.reference_workload, "hardware": hardware,
                          "entry": None if entry is None else {"params": entry.params, "example_batch":
                                                               entry.example_batch, "dtype": entry.dtype,
                                                               "seconds": entry.seconds},
                          "memory_gib_per_device": None if need is None else round(need, 3),
                          "unread": {name: str(err) for name, err in result.unread.items()}}))
        return
    console.print(_plan_table(result, limit))
    for line in hardware_lines(result, hardware):
        console.print(line, highlight=False)
    assumed = " (no `steps:` in the spec: assumed)" if spec.steps is None else ""
    memory = "no memory check" if need is None else f"{need:.1f} GiB per worker (a whole replica each)"
    console.print(f"{result.steps} steps{assumed} of {model_text(result)}; {memory}; {len(result)} capable offer(s)",
                  highlight=False)
    chosen, naive = result.chosen, result.naive
    console.print(f"[bold]chosen[/]: {candidate_text(chosen)}", highlight=False)
    console.print(f"naive (cheapest per hour): {candidate_text(naive)}", highlight=False)
    if naive.cost > chosen.cost:
        console.print(f"tfsn's plan costs ${naive.cost - chosen.cost:,.2f} less ({1 - chosen.cost / naive.cost:.0%}) "
                      "than the naive plan", highlight=False)


def _plan_table(result, limit: int):
    from rich.table import Table

    table = Table(title=f"capable offers by predicted cost of the run ({nodes_text(result.nodes, result.spares)}, "
                        f"{'spot' if result.spot else 'on-demand'})", box=None, pad_edge=False)
    for column in ("#", "provider", "zone/region", "instance", "accel.", "$/node-h", "step s", "hours", "$ run"):
        table.add_column(column, no_wrap=True, justify="left" if column in ("provider", "zone/region", "instance",
                                                                             "accel.") else "right")
    naive = result.naive.offer
    for rank, c in enumerate(result.ranked(limit), start=1):
        o = c.offer
        table.add_row(f"{rank}{'*' if o is naive else ''}", o.provider, o.zone or o.region, o.instance_type,
                      f"{o.accelerator or 'CPU'}x{o.accelerator_count}", f"{c.price_per_hour:,.2f}",
                      f"{c.step_seconds:,.2f}", f"{c.hours:,.2f}", f"{c.cost:,.2f}")
    table.caption = "* the naive plan (cheapest per hour)" + (
        f"; {len(result) - limit} more: --limit N, or --json for all" if len(result) > limit else "")
    return table


@catalog_app.command("ls")
def catalog_ls(accelerator: Optional[str] = typer.Option(None, "--accelerator", help="e.g. H100 (any case)"),
               provider: Optional[str] = typer.Option(None, "--provider", help="aws, gcp or azure"),
               catalog: Optional[Path] = typer.Option(None, "--catalog", help="a vms.csv file or folder"),
               as_json: bool = typer.Option(False, "--json", help="print one JSON list")) -> None:
    """List the offers of the catalog, cheapest first per accelerator."""
    from providers.catalog import CatalogError, catalog_sources, load_offers

    try:
        offers = load_offers(path=catalog)
    except CatalogError as err:
        raise UsageError(str(err)) from None
    known = sorted({o.provider for o in offers})
    if provider and provider.lower() not in known:
        raise UsageError(f"--provider {provider}: the catalog has no offers of it. "
                         f"To fix: use one of {', '.join(known)}")
    if provider:
        offers = [o for o in offers if o.provider == provider.lower()]
    if accelerator:
        names = sorted({o.accelerator for o in offers if o.accelerator})
        offers = [o for o in offers if (o.accelerator or "").casefold() == accelerator.casefold()]
        if not offers:
            raise UsageError(f"--accelerator {accelerator}: no such accelerator in the catalog. To fix: use one of "
                             + ", ".join(names))
    offers.sort(key=lambda o: (o.accelerator or "", o.accelerator_count, o.price, o.provider, o.region, o.zone or ""))
    if as_json:
        print(json.dumps([vars(o) for o in offers]))
        return
    rows = [("provider", "zone/region", "instance", "accel.", "GiB/acc", "vCPUs", "GiB", "$/h", "spot $/h")]
    rows += [(o.provider, o.zone or o.region, o.instance_type, f"{o.accelerator or 'CPU'}x{o.accelerator_count}",
              f"{o.accelerator_memory_gib:g}", f"{o.vcpus:g}", f"{o.memory_gib:g}", f"{o.price:,.2f}",
              "-" if o.spot_price is None else f"{o.spot_price:,.2f}") for o in offers]
    for line in aligned(rows, left=4):
        print(line)
    print(f"{len(offers)} offer(s)")
    if catalog is None:
        for name, path in catalog_sources(provider).items():
            console.print(f"{name}: {path}", highlight=False)


@catalog_app.command("refresh")
def catalog_refresh(providers: Optional[list[str]] = typer.Argument(None, help="aws, gcp and/or azure (default: all)")
                    ) -> None:
    """Fetch instance types and prices from the clouds' own APIs into the local catalog cache."""
    import importlib

    from providers.base import ProviderError
    from providers.catalog import CATALOG_PROVIDERS, cache_dir, write_offers

    names = [p.lower() for p in providers] if providers else list(CATALOG_PROVIDERS)
    unknown = [p for p in names if p not in CATALOG_PROVIDERS]
    if unknown:
        raise UsageError(f"catalog refresh {unknown[0]}: not a catalog provider. To fix: use "
                         + ", ".join(CATALOG_PROVIDERS))
    failed = False
    for name in names:
        try:
            module = importlib.import_module(f"providers.{name}")
            offers = module.fetch_offers()
        except ModuleNotFoundError as err:
            failed = True
            missing = "its driver" if err.name == f"providers.{name}" else err.name
            err_console.print(f"tfsn: error: catalog refresh {name}: cannot import {missing}. "
                              f"To fix: pip install 'tfsn[{name}]'", highlight=False, markup=False)
            continue
        except ProviderError as err:
            failed = True
            err_console.print(f"tfsn: error: catalog refresh {name}: {err}", highlight=False, markup=False)
            continue
        if not offers:
            failed = True
            err_console.print(f"tfsn: error: catalog refresh {name}: the API returned no offers; the cache "
                              "was not changed. To fix: check the account's regions and permissions",
                              highlight=False, markup=False)
            continue
        path = write_offers(cache_dir() / f"{name}.csv", offers)
        console.print(f"{name}: {len(offers)} offers written to {path}", highlight=False)
    raise typer.Exit(1 if failed else 0)


def _exit_by_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exits_cleanly_on_hangup_and_term() -> dict[int, object]:
    """SIGTERM and SIGHUP (a closed terminal) end the command as an exception, so that what it started is cleaned up
    on the way out (`finally`): killed by the signal, `tfsn launch` left the child that imports model.entry searching
    on for minutes, and its temporary folder behind. A signal ignored by whoever started tfsn (`nohup`) stays so.
    Returns the handlers to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _exit_by_signal) for sig in (signal.SIGTERM, signal.SIGHUP)
            if signal.getsignal(sig) is not signal.SIG_IGN}


def main() -> None:
    """Entry point: bad input is one line on stderr and exit code 2, never a traceback."""
    previous = _exits_cleanly_on_hangup_and_term()
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
    except KeyboardInterrupt:       # a second Ctrl-C (while a stop is waited for), or one the command had no use for
        print("tfsn: interrupted", file=sys.stderr)
        sys.exit(130)
    except SystemExit as done:      # Typer makes a Ctrl-C in a command exit 130, saying nothing
        if done.code == 130:
            print("tfsn: interrupted", file=sys.stderr)
        raise
    except sqlite3.OperationalError as err:   # a store that opened but cannot be written: a read-only or full disk
        where = os.path.join(os.environ.get("TFSN_HOME") or "~/.tfsn", daemon.store_path(Path()).name)
        disk = any(word in str(err) for word in ("readonly", "full", "disk I/O", "unable to open"))
        print(f"tfsn: error: {where}: {err}. To fix: " + ("make TFSN_HOME writable (or free space on its disk), or "
              "set TFSN_HOME to another folder" if disk else "try again (another tfsn may hold the store)"),
              file=sys.stderr)
        sys.exit(1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
