"""What a cloud VM needs from the controller to boot (providers/bootstrap.py runs it): tfsn's wheel and the
job's code archive, recorded on the job so that every node of it, replacements too, gets the same files,
and only the job's own nodes may fetch them (api.py's artifacts route, with the node's agent token).

A node of a provider that runs the boot script gets its own workdir (NODE_WORKDIR, under the node's root
folder) holding the archive's files; a local node runs in the user's workdir itself, which it shares.
A boot that failed is reported by the script (api.py's boot-failure route); BOOT_FAILURES_PER_OFFER such
failures on one offer (instance type in a zone) block it for the job, and the next offer is tried.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

from orchestrator.control.context import ControlContext
from orchestrator.control.store import Job
from orchestrator.spec import CHECKPOINT_DRIVERS, CHECKPOINT_URL_SCHEMES, JobSpec, checkpoint_url_scheme
from providers.base import BootFiles
from providers.bootstrap import INSTALL_SPEC_ENV
from providers.registry import DRIVERS

NODE_WORKDIR = "workdir"        # relative: under the node's root folder (BootFiles.root)
BOOT_FAILURES_PER_OFFER = 2     # boot failures on one offer before the job stops asking for it


def runs_boot_script(provider: str) -> bool:
    """Whether the provider's nodes boot with bootstrap.startup_script (cloud VMs), without loading it."""
    if provider not in DRIVERS:
        return False
    module, cls = DRIVERS[provider]
    return bool(getattr(getattr(importlib.import_module(module), cls), "runs_boot_script", False))


def artifacts_ready(ctx: ControlContext, job: Job) -> bool:
    """Whether `job`'s code archive is recorded and tfsn's wheel built (or TFSN_INSTALL_SPEC names what nodes
    install): then boot_files returns at once; else it packs and builds, which the loop leaves to a worker."""
    return "code" in job.artifacts and (bool(os.environ.get(INSTALL_SPEC_ENV)) or ctx.artifacts.wheel_digest is not None)


def prepare_artifacts(ctx: ControlContext, job: Job, spec: JobSpec) -> dict[str, str]:
    """The slow part, safe off the loop (it writes files, not the store): the workdir packed (with the plan's search
    entries, plan_entries) unless the job has its archive, the wheel built on first use. The job's artifacts record
    as it should be. CodeSyncError or ArtifactError when either cannot be made (the message says how to fix it)."""
    recorded = dict(job.artifacts)
    packed = "code" not in recorded
    if packed:
        recorded["code"] = ctx.artifacts.add_code(Path(spec.workdir), plan_entries(job))
    try:
        wheel = None if os.environ.get(INSTALL_SPEC_ENV) else ctx.artifacts.wheel()
    except BaseException:
        if packed:   # no job will record the archive: pruning may take it
            ctx.artifacts.settled(recorded["code"])
        raise
    if wheel is not None:
        recorded["wheel"] = wheel.sha256
    return recorded


def plan_entries(job: Job) -> list[Path]:
    """The search cache entries `tfsn plan` left for the workers of the job's candidates (its chosen hardware and
    the fallbacks), shipped in its code archive: a node of that hardware finds them by the same content key."""
    from optimizer.cache import search_dir
    return [search_dir() / name for name in sorted({n for c in job.plan for n in c.get("search_entries", ())})]


def record_artifacts(ctx: ControlContext, job: Job, spec: JobSpec, recorded: dict[str, str]) -> None:
    """On the loop: keep `recorded` on the job, so that every node of it (replacements too) gets the same files;
    a fresh archive is said in the job's events, and archives no active job needs are pruned (not those packed for
    a job and not yet recorded: their jobs are not active by their archive yet)."""
    packed = job.artifacts.get("code") != recorded["code"]
    if recorded != job.artifacts:
        ctx.store.update_job(job.id, artifacts=recorded)
    if packed:
        ctx.artifacts.settled(recorded["code"])   # the job names it now
        size = ctx.artifacts.path(recorded["code"]).stat().st_size
        ctx.event(job.id, "code", f"packed {spec.workdir} for the nodes: {size / 2**20:.1f} MiB, sha256 "
                                  f"{recorded['code'][:12]}")
        ctx.artifacts.prune({j.artifacts.get("code", "") for j in ctx.store.jobs(active_only=True)})


def boot_files(ctx: ControlContext, job: Job, spec: JobSpec) -> BootFiles:
    """The wheel and code archive of `job`'s VMs: the code packed on the first VM (once per launch) and kept
    for the job; the wheel of this controller's tfsn, unless TFSN_INSTALL_SPEC names what nodes install; the
    extra with the driver of the job's checkpoint store (s3fs for s3://, ...), which nodes install with it.
    Packs and builds in place when they are not ready (the loop prepares them off its thread first)."""
    job = ctx.store.job(job.id)
    record_artifacts(ctx, job, spec, prepare_artifacts(ctx, job, spec))
    recorded = ctx.store.job(job.id).artifacts
    wheel = None if os.environ.get(INSTALL_SPEC_ENV) else ctx.artifacts.wheel()
    scheme = checkpoint_url_scheme(spec.checkpoint.dir)
    return BootFiles(wheel=wheel.name if wheel else "", wheel_sha256=wheel.sha256 if wheel else "",
                     code_sha256=recorded["code"], extra=CHECKPOINT_URL_SCHEMES.get(scheme, ""),
                     extra_module=CHECKPOINT_DRIVERS.get(scheme, ""))


def boot_failure_summary(body: dict) -> str:
    """One line for a boot failure report: its stage, its exit code, and the last line that says why."""
    lines = [line for line in str(body.get("tail", "")).splitlines()
             if line.strip() and not line.startswith("[tfsn] boot failed")]
    cause = lines[-1].strip() if lines else "no output"
    return f"boot failed in stage {body.get('stage') or '?'} (exit code {body.get('returncode')}): {cause}"[:500]


def failed_boots_on(ctx: ControlContext, job: Job, offer: dict) -> int:
    """How many of the job's nodes on `offer` (the same instance type in the same zone) failed to boot."""
    key = {k: offer.get(k) for k in ("provider", "region", "zone", "instance_type")}
    return sum(1 for n in ctx.store.nodes(job.id) if n.boot_failure and n.heartbeat_at is None and n.offer
               and {k: n.offer.get(k) for k in key} == key)
