"""`tfsn down`: find what tfsn left running in the clouds and delete it.

Every cloud driver tags what it creates with the job it is for (providers.naming); this command asks
every cloud configured on this machine for what carries the tag (providers.sweep), keeps what belongs
to a job that is live in this store (its controller owns it) and what another store made (job ids restart
at 1 in every TFSN_HOME: its owner tag says whose it is), shows the rest and deletes it. Mounted on the
main app by `register(app, store)`.
"""
from __future__ import annotations

import re
import time
from typing import Callable, Optional

import typer
from rich.console import Console

from orchestrator.cli.view import aligned
from orchestrator.control.store import Store

CLOUDS = ("aws", "gcp", "azure", "kubernetes")   # the drivers that tag what they create
LIST_TIMEOUT_S = 120.0                           # every cloud's listing, all in parallel


def chosen(resources: list, live: set[str], job: str | None, everything: bool, owner: str,
           untagged: bool = True) -> tuple[list, list]:
    """(to delete, kept) of the tagged resources found. Kept: those another store than `owner` made (always: its
    jobs are not ours, whatever their ids), those of a live job (but with --all), those of another job than `job`
    when one is given, and what jobs share (a region's network) unless --all. A resource made before the owner
    tag counts as `owner`'s if `untagged`."""
    take, keep = [], []
    for resource in resources:
        if resource.owner != owner and (resource.owner is not None or not untagged):
            wanted = False
        elif job is not None:
            wanted = resource.job == job and (everything or job not in live)
        else:
            wanted = everything or (resource.job is not None and resource.job not in live)
        (take if wanted else keep).append(resource)
    return take, keep


def table(resources: list) -> list[str]:
    """One aligned line per resource, under a header; plain text, so that no terminal width cuts a name."""
    rows = [("CLOUD", "KIND", "NAME", "WHERE", "JOB", "NODE")]
    rows += [(r.provider, r.kind, r.name, r.where, r.job or "(shared)", r.node or "-")
             for r in sorted(resources, key=lambda r: (r.provider, r.kind, r.where, r.name))]
    return aligned(rows)


def down(store: Store, drivers: list, job_ref: str | None, everything: bool, dry_run: bool, out: Console,
         err: Console, timeout_s: float, owner: str | None = None) -> int:
    """The command (see the module docstring): 0 when everything chosen is gone (or --dry-run), 1 when a cloud
    could not be listed or a resource not deleted, each said in one line. StoreError for an unknown job.
    `owner`: sweep for another store (a lost TFSN_HOME) instead, all of its jobs taken as ended."""
    from providers.sweep import NotConfigured, delete_resources, list_resources

    job = str(store.find_job(job_ref).id) if job_ref is not None else None   # "" (an unset $JOB) is no job
    failed = False
    found = []
    for name, result in list_resources(drivers, time.monotonic() + LIST_TIMEOUT_S).items():
        if isinstance(result, NotConfigured):
            out.print(f"{name}: skipped, not configured here ({result})", highlight=False, markup=False)
        elif isinstance(result, BaseException):
            failed = True
            err.print(f"tfsn: error: {name}: cannot list tfsn's resources: {result}", highlight=False, markup=False)
        else:
            found += result
    # Live jobs are read after the listing: a job launched while the clouds were listed owns what it made.
    owner = owner or store.owner
    live = {str(j.id) for j in store.jobs(active_only=True)} if owner == store.owner else set()
    take, keep = chosen(found, live, job, everything, owner, untagged=owner == store.owner)
    _say_kept(keep, live, job, owner, out)
    if not take:
        out.print("nothing to delete" + (f" of job {job}" if job else ""), highlight=False)
        return int(failed)
    for line in table(take):
        out.print(line, highlight=False, markup=False)
    if dry_run:
        out.print(f"dry run: {len(take)} resource(s) would be deleted; nothing was", highlight=False)
        return int(failed)
    outcome = delete_resources({d.name: d for d in drivers}, take, time.monotonic() + timeout_s)
    errors = {r: e for r, e in outcome.items() if e is not None}
    for resource, error in sorted(errors.items(), key=lambda item: (item[0].provider, item[0].name)):
        err.print(f"tfsn: error: {resource.provider} {resource.kind} {resource.name} ({resource.where}): "
                  f"{' '.join(str(error).split()) or type(error).__name__}", highlight=False, markup=False)
    out.print(f"deleted {len(take) - len(errors)} of {len(take)} resource(s)", highlight=False)
    return int(failed or bool(errors))


def _say_kept(keep: list, live: set[str], job: str | None, owner: str, out: Console) -> None:
    """One line each for what is kept because another store made it, because its job is live, and for what jobs
    share."""
    others = [r for r in keep if r.owner is not None and r.owner != owner]
    if others:
        stores = ", ".join(sorted({r.owner for r in others}))
        out.print(f"kept {len(others)} resource(s) of other tfsn stores ({stores}; this one is {owner}): `tfsn down` "
                  "run where they were launched deletes them (`tfsn down --owner ID` for a home that is lost)",
                  highlight=False)
    keep = [r for r in keep if r not in others]
    if job is not None and job in live:
        out.print(f"job {job} is live: its resources are kept. To fix: `tfsn stop {job}` tears them down "
                  "(or add --all)", highlight=False)
    owners = sorted({r.job for r in keep if r.job in live}, key=int)
    if owners:
        out.print(f"kept {sum(r.job in live for r in keep)} resource(s) of live job(s) {', '.join(owners)}",
                  highlight=False)
    shared = [r for r in keep if r.job is None]
    if shared:
        out.print(f"kept {len(shared)} resource(s) that jobs share ({', '.join(sorted({r.kind for r in shared}))}); "
                  "--all deletes them too", highlight=False)


def register(app: typer.Typer, store: Callable[[], Store]) -> None:
    """Mount `tfsn down` on the main app; `store` opens the user's job store."""

    @app.command("down")
    def down_command(job: Optional[str] = typer.Argument(None, help="only this job's resources (id or name)"),
                     everything: bool = typer.Option(False, "--all", help="also those of live jobs, and what "
                                                     "jobs share (a region's network)"),
                     dry_run: bool = typer.Option(False, "--dry-run", help="list them, delete nothing"),
                     timeout: float = typer.Option(900.0, "--timeout", min=1.0, help="seconds to wait for the "
                                                   "deletions, all clouds together"),
                     owner: Optional[str] = typer.Option(None, "--owner", help="the id of another (lost) tfsn "
                                                         "store, as `tfsn down` prints it: delete all its jobs' "
                                                         "resources")) -> None:
        """Delete what tfsn left in the clouds (instances, volumes, disks, NICs, networks, pods) that no live
        job owns; every cloud configured on this machine, in parallel."""
        from providers.registry import load_provider

        problem = ("--owner: not a store id (12 hex digits, as `tfsn down` prints it)"
                   if owner is not None and not re.fullmatch(r"[0-9a-f]{12}", owner) else
                   "name a JOB or --owner, not both: a JOB is a job of this store" if owner and job else "")
        if problem:
            Console(stderr=True).print(f"tfsn: error: {problem}", highlight=False, markup=False)
            raise typer.Exit(2)
        code = down(store(), [load_provider(name) for name in CLOUDS], job, everything, dry_run,
                    Console(soft_wrap=True), Console(stderr=True, soft_wrap=True), timeout, owner)
        raise typer.Exit(code)
