"""Which providers a job may use, and what they offer: the planner's input, for launch and for `tfsn plan`.

A launch uses a cloud only when the job names it in `resources.infra` or the user enabled it in
`TFSN_CLOUDS` (e.g. `aws,gcp`): asking a cloud for nodes costs money, and probing every SDK's
credential chain on each launch is slow and noisy. `tfsn plan` only reads catalogs, so it prices
every cloud of the catalog unless the job's `infra` says otherwise.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from orchestrator.planning.planner import HOST, Plan, PlanError, check_accelerators, hardware_to_search, plan_job
from orchestrator.spec import JobSpec, checkpoint_url_scheme
from providers.base import Offer, Provider, ProviderError
from providers.identity import KINDS
from providers.registry import load_provider

# Clouds whose offers are rows of the instance catalog (configs/catalog, or a refreshed copy).
CATALOG_PROVIDERS = ("aws", "gcp", "azure")


def enabled_clouds() -> list[str]:
    """The clouds the user enabled for jobs that name no `infra` (TFSN_CLOUDS, comma separated)."""
    return [name.strip().lower() for name in os.environ.get("TFSN_CLOUDS", "").split(",") if name.strip()]


def allowed_providers(spec: JobSpec, planning_only: bool = False) -> list[str]:
    """The job's `infra`; without one, this machine plus the enabled clouds (every catalog cloud when
    only planning)."""
    if spec.resources.infra:
        return list(spec.resources.infra)
    clouds = list(CATALOG_PROVIDERS) if planning_only else enabled_clouds()
    return ["local"] + [name for name in clouds if name != "local"]


def offers_for(spec: JobSpec, providers: dict[str, Provider] | None = None, catalog: Path | None = None,
               planning_only: bool = False) -> tuple[list[Offer], dict[str, ProviderError]]:
    """Every offer of every provider the job may use, and the providers whose offers() failed with their error: a
    cloud that cannot be read (unreachable, throttled, refused credentials) is left out, not the whole plan. A
    `catalog` file stands in for the clouds' catalog: all its rows count (the planner still applies `infra`)."""
    from providers.catalog import load_offers

    offers: list[Offer] = load_offers(path=catalog) if catalog is not None else []
    unread: dict[str, ProviderError] = {}
    for name in allowed_providers(spec, planning_only):
        if catalog is None or name not in CATALOG_PROVIDERS:
            provider = (providers or {}).get(name) or load_provider(name)
            try:
                offers.extend(provider.offers())
            except ProviderError as err:
                unread[name] = err
    return offers, unread


def plan_for(spec: JobSpec, providers: dict[str, Provider] | None = None, catalog: Path | None = None,
             planning_only: bool = False) -> Plan:
    """The job's offers ranked by predicted run cost (planner.PlanError says why none is capable). Providers whose
    offers could not be read are in the plan's `unread`; when the others have no capable offer, the error of one
    of them is raised instead (a retryable one first: the caller's backoff may see the cloud answer again)."""
    check_accelerators(spec)
    allowed = allowed_providers(spec, planning_only)
    if spec.resources.accelerators is not None and allowed == ["local"]:
        wanted = ", ".join(f"{a.name}:{a.count}" for a in spec.resources.accelerator_choices())
        raise PlanError(f"no capable offer: resources.accelerators {wanted}: this machine's GPUs are not planned "
                        "and no cloud is enabled for this job. To fix: name clouds in resources.infra (e.g. "
                        "infra: [aws, gcp]) or set TFSN_CLOUDS=aws,gcp; or remove resources.accelerators to run "
                        "on this machine's CPUs", field=("resources", "accelerators"))
    offers, unread = offers_for(spec, providers, catalog, planning_only)
    return replace(_ranked(spec, offers, allowed, unread), unread=unread)


def unread_lines(plan: Plan) -> list[str]:
    """What a plan says of each provider it was made without (the controller's job events, `tfsn plan`'s warnings)."""
    return [f"{name}'s offers could not be read ({err}): planned without them" for name, err in plan.unread.items()]


def unread_error(unread: Mapping[str, ProviderError]) -> ProviderError:
    """The error that stands for the unread providers when the others cannot place the job: a retryable one's kind
    first, so that the caller's backoff may see that cloud answer again; its message names every such provider with
    its error (a driver's error does not name its cloud, and the others' fixes must not wait for this one's)."""
    ordered = sorted(unread.items(), key=lambda item: not item[1].retryable)
    name, first = ordered[0]
    error = type(first)("; ".join(f"{n}'s offers could not be read ({e})" for n, e in ordered), provider=name,
                        scope=first.scope)
    error.retryable = first.retryable
    return error


def _ranked(spec: JobSpec, offers: list[Offer], allowed: list[str], unread: Mapping[str, ProviderError]) -> Plan:
    """plan_job over the offers, this machine's left out when the job is too big for it; when none is capable and
    some providers were not read, one of their errors (they may have had one). The spec's own problems (model.entry's
    search) raise as they are."""
    too_big = _too_big_for_local(spec)
    dropped = too_big is not None and any(o.provider == "local" for o in offers)
    if too_big is not None:   # local nodes and workers are processes of this machine: a core each, or a runaway
        if allowed == ["local"]:
            raise too_big
        offers = [o for o in offers if o.provider != "local"]
    entry = _searched_entry(spec, offers) if spec.model is not None and spec.model.entry else None
    try:
        return plan_job(spec, offers, entry=entry, host_providers=HOST_PROVIDERS)
    except PlanError as err:
        if unread:
            raise unread_error(unread) from None
        if not dropped:   # the local offer was the one that fit (a CPU job): its limit is the cause, not
            raise         # the constraint that removed the clouds' offers after it
        raise PlanError(f"{too_big}; and of the other offers: {err}", field=too_big.field) from None


def _too_big_for_local(spec: JobSpec) -> PlanError | None:
    """Why the local provider cannot run the job (more nodes, or workers, than this machine has cores), or None."""
    most = local_node_limit()
    workers = spec.num_nodes * spec.nprocs(0)
    if spec.num_nodes > most:
        return PlanError(f"no capable offer: num_nodes {spec.num_nodes}: this machine runs at most {most} local "
                         "nodes (one per core, 4 at least). To fix: lower num_nodes, or name clouds in "
                         "resources.infra", field=("num_nodes",))
    if workers > most:   # 256 workers importing torch on a laptop: out of memory before the first step
        return PlanError(f"no capable offer: nproc_per_node {spec.nprocs(0)} on {spec.num_nodes} node(s) is "
                         f"{workers} workers: this machine runs at most {most} local workers (one per core, 4 at "
                         "least). To fix: lower nproc_per_node, or name clouds in resources.infra",
                         field=("nproc_per_node",))
    return None


# Providers whose offers are this machine: their step is searched with this CPU's spec (calibrated where
# `tfsn calibrate` ran), with the threads each worker gets (the controller splits the cores between nodes).
HOST_PROVIDERS = ("local",)


def _searched_entry(spec: JobSpec, offers: list[Offer]):
    """model.entry's step searched for every hardware type among the offers the job could run on. The search
    imports the job's code from its workdir, which may be gone by a restart's planning (deleted, moved)."""
    from orchestrator.planning.entry import price_entry

    if not Path(spec.workdir).is_dir():
        raise PlanError(f"workdir: {spec.workdir} is not a directory (deleted or moved since the launch?). To fix: "
                        "put the job's code back there, or launch again from where it is now", field=("workdir",))
    keys = hardware_to_search(spec, offers, HOST_PROVIDERS)
    threads = local_worker_threads(spec, spec.nprocs(0))
    return price_entry(spec, [(key, threads if key == HOST else None) for key in keys],
                       data_parallel=spec.num_nodes * spec.nprocs(0) > 1)


def local_worker_threads(spec: JobSpec, workers_per_node: int) -> int:
    """The threads each worker of a job on this machine's local nodes gets (the controller's OMP_NUM_THREADS):
    the nodes split the cores (or each has the `resources.cpus` it asked for), and a node's workers its share."""
    cpus = int(spec.resources.cpus.count) if spec.resources.cpus else max(1, (os.cpu_count() or 1) // spec.num_nodes)
    return max(1, cpus // workers_per_node)


def planned_hardware(offer: dict, on_this_machine: bool) -> str:
    """The hardware model.entry's step was searched for on nodes of `offer` (an Offer's fields), as the workers'
    tfsn.optimize names its own (optimizer.hardware.planned_hardware): this machine's CPU for its local nodes,
    else the offer's accelerator (a CPU-only cloud node: `?`, nothing was searched for it)."""
    from optimizer.hardware import cpu_spec, find_hardware, planned_hardware as named

    spec = cpu_spec() if on_this_machine else find_hardware(offer.get("accelerator"))
    return named(spec) if spec is not None else "?"


def local_node_limit() -> int:
    """How many nodes the local provider may run for one job: one per core, and 4 on any machine."""
    return max(4, os.cpu_count() or 1)


# Providers whose nodes all see this machine's disk: the local provider's nodes are its processes.
SHARED_DISK_PROVIDERS = ("local",)
_BUCKET_URL = {"aws": "s3://BUCKET/PATH", "gcp": "gs://BUCKET/PATH", "azure": "az://CONTAINER/PATH"}


def _name_max(folder: str) -> int:
    """The longest file name, in bytes, that `folder`'s filesystem takes (255 on Linux's, and where it cannot say)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def folder_problem(path: str) -> str | None:
    """Why this machine could not save into folder `path` (made on the first save if missing), as one line with
    the fix; or None. Said at launch: the job would otherwise train up to its first checkpoint, fail there, and
    fail again after a restart."""
    probe = path
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:   # the nearest part that exists
        probe = os.path.dirname(probe)
    where = "is" if probe == path else f"is below {probe},"
    if os.path.islink(probe) and not os.path.exists(probe):
        return (f"{path} {where} a link to {os.readlink(probe)}, which does not exist. To fix: make that folder, or "
                "name another")
    if not os.path.isdir(probe):
        return f"{path} {where} a file, not a folder. To fix: name a folder (it is made if missing)"
    longest = max(os.path.relpath(path, probe).split(os.sep), key=lambda name: len(os.fsencode(name)))
    most = _name_max(probe)
    if len(os.fsencode(longest)) > most:     # lexists() said "missing" (ENAMETOOLONG): the first save would fail
        return (f"{path}: a folder name of {len(os.fsencode(longest))} bytes ({longest[:12]}...), longer than the "
                f"{most} bytes a name may have in {probe}. To fix: shorten it")
    if not os.access(probe, os.W_OK | os.X_OK):
        return (f"{path}: this user cannot write in {probe}. To fix: choose a folder you can write to, or change "
                "its permissions")
    try:        # where the permission bits say yes to root and the filesystem says no (/proc, /sys)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        return f"{path}: cannot write in {probe} ({err.strerror or err}). To fix: choose a folder you can write to"
    return None


def checkpoint_problem(spec: JobSpec) -> tuple[tuple[str, ...], str] | None:
    """Why the job's checkpoints would be lost with a node, as (field, one line with the fix); or None.

    A path is on one machine's disk: on a cloud node it goes with the node, and a replacement restarts
    from step 0. Only the user knows a path is a filesystem every node mounts (`local_ok`)."""
    ckpt = spec.checkpoint
    if checkpoint_url_scheme(ckpt.dir) or ckpt.local_ok:
        return None
    allowed = allowed_providers(spec)
    remote = [name for name in allowed if name not in SHARED_DISK_PROVIDERS]
    if not remote:
        unusable = ckpt.dir and folder_problem(ckpt.dir)
        return (("checkpoint", "dir"), f"checkpoint.dir: {unusable}") if unusable else None
    where = (f"checkpoint.dir: {ckpt.dir} is" if ckpt.dir
             else "checkpoint.dir: unset, checkpoints go to the controller's disk,")
    urls = " or ".join(dict.fromkeys(_BUCKET_URL.get(name, "s3://, gs:// or az://BUCKET/PATH") for name in remote))
    alone = ", or resources.infra: [local] to run on this machine only" if "local" in allowed else ""
    field = ("checkpoint", "dir") if ckpt.dir else ("resources", "infra") if spec.resources.infra else ("checkpoint",)
    return field, (
        f"{where} not storage that {', '.join(remote)} nodes share: a replaced node would restart from "
        f"step 0. To fix: set checkpoint.dir to {urls}, or checkpoint.local_ok: true if every node mounts "
        f"that path{alone}")


# Each VM cloud's own object store: the one its VM identity (resources.remote_identity) can reach.
OWN_STORE = {"aws": "s3", "gcp": "gs", "azure": "az"}
# The variables that give a node a store's credentials without an identity (the job's envs reach the workers over
# the controller's API, never in VM metadata): s3fs, gcsfs and adlfs read them.
STORE_CREDENTIAL_ENVS = {
    "s3": ("AWS_ACCESS_KEY_ID",), "gs": ("GOOGLE_APPLICATION_CREDENTIALS",),
    "az": ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
           "AZURE_STORAGE_CLIENT_SECRET"),
}


def identity_warnings(spec: JobSpec) -> list[tuple[tuple[str, ...], str]]:
    """Why the job's VMs on a cloud it may run on would find no credentials for its checkpoint bucket, as (the
    field to blame, one line with the fix) per cloud. Warnings, not refusals: an image may hold credentials."""
    url, scheme = spec.checkpoint.dir, checkpoint_url_scheme(spec.checkpoint.dir)
    if scheme is None or any(name in spec.envs for name in STORE_CREDENTIAL_ENVS[scheme]):
        return []
    envs = " or ".join(STORE_CREDENTIAL_ENVS[scheme])
    found = []
    for cloud in (name for name in allowed_providers(spec) if name in OWN_STORE):
        if OWN_STORE[cloud] == scheme and not spec.resources.identity(cloud):
            kind = KINDS[cloud]
            found.append((("resources", "remote_identity", cloud), (
                f"resources.remote_identity.{cloud} is unset: {cloud} VMs get no credentials for {url}, so the "
                f"job's first checkpoint there would fail. To fix: set it to {kind.what} that may read and write "
                f"the bucket (e.g. {kind.example}), or give credentials in envs ({envs}) or in the image")))
        elif OWN_STORE[cloud] != scheme:
            found.append((("checkpoint", "dir"), (
                f"checkpoint.dir: {cloud} VMs have no credentials for {url} (resources.remote_identity.{cloud} "
                f"reaches {cloud}'s own storage only), so the job's first checkpoint there would fail. To fix: give "
                f"{scheme}:// credentials in envs ({envs}) or in the image, or keep the job on the bucket's cloud "
                "(resources.infra)")))
    return found
