"""Provisioning: from the ranked plan to nodes for every rank, with failover, then an attempt started.

A node is recorded in the store before its provider is asked for it (a crash never leaks a machine). A
provisioning error blocks what its scope says (the offer, zone, region or provider) and the next node
goes to the next candidate of the plan; nodes already placed elsewhere follow it, since one job's nodes
must share a zone. A transient error (throttling, network, a 5xx) is retried with backoff, TRANSIENT_TRIES times in
a row at most: a create on the same offer, a plan (a catalog call that failed) as a whole, each counted apart.

Planning and creating run off the loop (calls.py): a node stays REQUESTED, its rank taken, while its create is in
flight, and the call's end decides (STARTING, or a refusal as above). A create past its deadline is a refusal too:
the offer is blocked, and the node is terminated once the hung call returns (by the id its late answer gives).
"""
from __future__ import annotations

import functools
import os
import secrets
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict

from orchestrator.control.artifacts import BUILD_TIMEOUT_S, ArtifactError
from orchestrator.control.boot import NODE_WORKDIR, artifacts_ready, boot_files, prepare_artifacts, record_artifacts
from orchestrator.control.calls import DEADLINES_S, Call, DeadlineError, deadline_s
from orchestrator.control.codesync import CodeSyncError
from orchestrator.control.context import ControlContext
from orchestrator.control.credentials import agent_token
from orchestrator.control.health_watch import HealthWatch, rank_nodes
from orchestrator.control.nodes import Nodes, site, workers_per_node
from orchestrator.control.store import Job, JobState, Node, NodeState
from orchestrator.home import job_dir
from orchestrator.planning.offers import offer_text
from orchestrator.planning.placement import plan_for, unread_error, unread_lines
from orchestrator.planning.planner import Blocklist, NoCapacityError, Plan, PlanError, PlannedOffer
from orchestrator.sdk.client import CA_FINGERPRINT_ENV, CA_PEM_ENV
from orchestrator.spec import JobSpec
from providers.base import CapacityError, NodeHandle, NodeRequest, ProviderError
from providers.catalog import CatalogError

# What a remote node's agent is given from this machine's environment (how to install tfsn there).
REMOTE_SETTINGS = ("TFSN_INSTALL_SPEC",)
TRANSIENT_TRIES = 5           # a create (a plan) that fails transiently this often in a row is blocked (fails the job)
PLAN_KEEP = 50                # ranked candidates kept in the store for failover
CREATES_PER_PASS = 16         # creates of one job in flight, so at most this many a pass (others' turn comes between)
PLANNER = "planner"           # the lane of planning calls: they read every provider's offers
# What a plan fails with for the job (else a bug): no capable offer, a cloud that cannot be read, a catalog file
# that does not parse (the user fixes that file: planned again each pass, it would fail the same)
PLAN_ERRORS = (PlanError, ProviderError, CatalogError)
ARTIFACTS = "artifacts"       # the lane that packs jobs' code and builds tfsn's wheel for cloud nodes
ARTIFACTS_DEADLINE_S = BUILD_TIMEOUT_S + 300.0   # the wheel's build, then a large workdir's packing


class Provisioner:
    """Plans a job, creates its nodes (spares first), and starts an attempt once every rank is ready."""

    def __init__(self, ctx: ControlContext, nodes: Nodes, health: HealthWatch) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.health = health
        # (job id, "node" for its creates or "plan" for its planning) -> (transient failures in a row, retry at): apart,
        # so that neither's errors count towards the other's TRANSIENT_TRIES, nor its outcome resets the other's
        self.backoff: dict[tuple[int, str], tuple[int, float]] = {}

    def forget(self, job_id: int) -> None:
        """The job ended: drop its backoffs (kept in memory for as long as the controller runs, else)."""
        for kind in ("node", "plan"):
            self.backoff.pop((job_id, kind), None)

    def _backing_off(self, job_id: int, kind: str) -> bool:
        """Whether the job's last create (`kind` "node") or plan ("plan") hit a transient error and its backoff has
        not passed yet."""
        return time.monotonic() < self.backoff.get((job_id, kind), (0, 0.0))[1]

    def _retry_later(self, job_id: int, kind: str, what: str, err: BaseException) -> bool:
        """Whether `err` is transient (throttled, unreachable: the same request may well succeed) and the job's
        `kind` of request ("node", "plan") has not failed TRANSIENT_TRIES times in a row: then its next try waits a
        backoff, and its event says what failed. Else the count starts again and the caller gives up on the request."""
        key = (job_id, kind)
        failures = self.backoff.get(key, (0, 0.0))[0] + 1
        if not (isinstance(err, ProviderError) and err.retryable and not isinstance(err, CapacityError)
                and failures < TRANSIENT_TRIES):
            self.backoff.pop(key, None)
            return False
        self.backoff[key] = (failures, time.monotonic() + min(60.0, 2.0 ** failures))
        self.ctx.event(job_id, kind, f"{what}: {err} (transient, attempt {failures} of {TRANSIENT_TRIES}; "
                                     "trying again)")
        return True

    def plan(self, job: Job, spec: JobSpec) -> None:
        """Plan off the loop (the planner reads every provider's offers); at its end, PENDING -> PROVISIONING with
        the plan's best candidates in the store, or FAILED if none is capable (PENDING still after a transient
        error: planned again after the backoff)."""
        self._start_planning(job, spec, lambda call: self._planned(job.id, spec, call))

    def _start_planning(self, job: Job, spec: JobSpec, on_done: Callable[[Call], None]) -> None:
        if self._backing_off(job.id, "plan"):
            return   # the last plan hit a transient error: wait before the next
        providers = self.ctx.providers
        self.ctx.calls.start(("plan", job.id), PLANNER, f"planning of job {job.id}",
                             lambda: plan_for(spec, providers), DEADLINES_S["offers"], on_done)

    def _planned(self, job_id: int, spec: JobSpec, call: Call) -> None:
        job = self.ctx.store.job(job_id)
        if job.state != JobState.PENDING:   # stopped meanwhile
            return
        if call.error is not None and self._retry_later(job_id, "plan", "planning failed", call.error):
            return
        if isinstance(call.error, PLAN_ERRORS):
            self.ctx.transition(job, JobState.FAILED, str(call.error), error=str(call.error))
            return
        if call.error is not None:   # a bug: said by the calls' collector; the next pass plans again
            raise call.error
        self.backoff.pop((job_id, "plan"), None)
        self._say_unread(job_id, call.value)
        chosen, naive = call.value.chosen, call.value.naive
        self.ctx.transition(job, JobState.PROVISIONING, f"{spec.num_nodes} node(s) on {_text(chosen)}" + (
            "" if chosen == naive else f" (the cheapest per hour, {_text(naive)}, would cost ${naive.cost:,.2f})"),
            plan=[c.to_record() for c in call.value.ranked(PLAN_KEEP)])

    def provision(self, job: Job, spec: JobSpec) -> None:
        """Give every rank a node (a spare first), keep the spares topped up, then start an attempt."""
        reason = self._hopeless(job, spec)
        if reason:
            self.nodes.give_up(job, reason)
            return
        if not self._fill(job, spec):
            return
        nodes = self.ctx.store.nodes(job.id, active_only=True)
        ready = [n for n in nodes if n.rank is not None and n.state == NodeState.READY]
        first = next((n for n in ready if n.rank == 0), None)
        if spec.num_nodes > 1 and first is not None and not first.addr and not self.ctx.shares_host(first.provider):
            # the other nodes' workers would wait for a rendezvous on loopback until they time out
            self.nodes.fail(job, first, "its agent reported no address the other nodes can reach")
            return
        if len(ready) == spec.num_nodes:
            self._start_attempt(job, spec, ready)

    def _hopeless(self, job: Job, spec: JobSpec) -> str:
        """Why provisioning should stop and the job fail, or "" to go on."""
        # Nodes created that never came up (no heartbeat). Refused requests are failover's business (the
        # plan's candidates bound them); nodes lost after they ran are charged to max_restarts.
        failed = [n for n in self.ctx.store.nodes(job.id)
                  if n.state == NodeState.FAILED and n.handle is not None and n.heartbeat_at is None]
        if len(failed) > spec.num_nodes + spec.recovery.spares + spec.recovery.max_restarts + 2:
            return f"{len(failed)} nodes failed to start; last: {failed[-1].failure}"
        setup_failure = next((r for r in self.ctx.store.results(job.id, 0) if r.returncode != 0), None)
        if setup_failure is not None:
            return f"setup failed on node {setup_failure.node_id}: {setup_failure.summary}"
        return ""

    def _fill(self, job: Job, spec: JobSpec) -> bool:
        """Every rank without a node gets a spare, else a new node; then the spares are topped up. At most
        CREATES_PER_PASS creates of the job in flight (and so at most that many new a pass): the loop gets round
        to other jobs and their stops, and no create waits in its lane's queue until its deadline.
        False if the job ended, a stop was asked (see `_interrupted`) or the job has its share in flight."""
        nodes = self.ctx.store.nodes(job.id, active_only=True)
        ranked = {n.rank: n for n in nodes if n.rank is not None}
        spares = sorted((n for n in nodes if n.rank is None), key=lambda s: s.state != NodeState.READY)
        creating = sum(n.state == NodeState.REQUESTED for n in nodes)
        for rank in range(spec.num_nodes):
            if rank in ranked:
                continue
            if spares:
                spare = spares.pop(0)
                self.ctx.store.update_node(spare.id, rank=rank)
                self.ctx.event(job.id, "node", f"spare node {spare.id} takes rank {rank}")
            elif creating >= CREATES_PER_PASS:
                return False
            else:
                self._create_node(job, spec, rank)
                creating += 1
            if self._interrupted(job):
                return False
        for _ in range(spec.recovery.spares - len(spares)):
            if creating >= CREATES_PER_PASS:
                return False
            self._create_node(job, spec, None)
            creating += 1
            if self._interrupted(job):
                return False
        return True

    def _interrupted(self, job: Job) -> bool:
        """The job ended (no capacity anywhere, an unreachable controller) or the user asked it to stop: a
        big job's nodes are created one by one, and `tfsn stop` must not wait for all of them (the
        controller's next step tears down what was created)."""
        now = self.ctx.store.job(job.id)
        return now.state.terminal or bool(now.stop_requested)

    def _start_attempt(self, job: Job, spec: JobSpec, ready: list[Node]) -> None:
        attempt = job.attempt + 1
        self.health.watch(job, spec).start_attempt(attempt, rank_nodes(ready, workers_per_node(spec, ready)))
        self.ctx.transition(job, JobState.RUNNING, f"attempt {attempt} on " + ", ".join(
            n.id for n in sorted(ready, key=lambda n: n.rank)), attempt=attempt, attempt_state="running",
            attempt_changed_at=time.time(), attempt_started_at=time.time(), master_port=free_port())
        self.ctx.wake.set()

    def _candidate(self, job: Job, spec: JobSpec) -> PlannedOffer | None:
        """The best planned offer that no provisioning failure has ruled out. The store keeps the plan's best
        PLAN_KEEP; when blocks used them all up (or the job predates plans), None while the job is planned again
        off the loop (then the fresh plan is in the store, or the job gave up)."""
        candidate = _first_unblocked(job)
        if candidate is None and not job.state.terminal:
            self._start_planning(job, spec, lambda call: self._replanned(job.id, call))
            candidate = _first_unblocked(self.ctx.store.job(job.id))   # where the caller waits: the fresh plan
        return candidate

    def _replanned(self, job_id: int, call: Call) -> None:
        job = self.ctx.store.job(job_id)
        if job.state.terminal:
            return
        blocked = Blocklist.from_records(job.blocked)
        if call.error is not None and not isinstance(call.error, PLAN_ERRORS):
            raise call.error   # a bug: said by the calls' collector
        fresh = [] if call.error else [c for c in call.value.ranked() if not blocked.blocks(c.offer)][:PLAN_KEEP]
        # the blocks ruled out the others' offers: the clouds that could not be read may still have some
        error = call.error or (unread_error(call.value.unread) if not fresh and call.value.unread else None)
        if error is not None and self._retry_later(job_id, "plan", "planning again failed", error):
            return   # the next pass plans again after the backoff
        self.backoff.pop((job_id, "plan"), None)   # planned, or the job gives up below (at a collect: never forgotten)
        if fresh:
            self._say_unread(job_id, call.value)
            self.ctx.store.update_job(job_id, plan=[c.to_record() for c in fresh])
        else:
            self.nodes.give_up(job, str(error or NoCapacityError(blocked.history)))   # why no plan, first

    def _say_unread(self, job_id: int, plan: Plan) -> None:
        """One event per provider left out of the job's plan because its offers could not be read."""
        for line in unread_lines(plan):
            self.ctx.event(job_id, "plan", line)

    def _create_node(self, job: Job, spec: JobSpec, rank: int | None) -> None:
        """Record the node, then ask the provider for it off the loop (the order keeps crashes from leaking nodes)."""
        if self._backing_off(job.id, "node"):
            return   # the last request hit a transient error (throttling, network): wait before the next
        candidate = self._candidate(job, spec)
        if candidate is None:
            return   # planned again off the loop: the next pass has a fresh candidate, or the job gave up
        offer = candidate.offer
        provider = self.ctx.provider(offer.provider)
        local = self.ctx.shares_host(provider.name)
        unreachable = None if local else _unreachable(self.ctx.url)
        if unreachable:
            self.nodes.give_up(job, unreachable)
            return
        ranked_sites = {site(n.offer) for n in self.ctx.store.nodes(job.id, active_only=True)
                        if n.rank is not None and n.offer is not None}
        if rank is None and ranked_sites and ranked_sites != {site(offer)}:
            return   # a spare serves only where the ranks are: none while its site there is blocked
        self._gather(job, candidate)
        runs_boot = getattr(provider, "runs_boot_script", False)
        if runs_boot and not artifacts_ready(self.ctx, job):
            self._prepare_artifacts(job, spec)
            job = self.ctx.store.job(job.id)
            if job.state.terminal or not artifacts_ready(self.ctx, job):
                return   # packed and built off the loop: the create goes on at a pass after that
        try:   # a VM installs tfsn and fetches the job's code from here as it boots
            boot = boot_files(self.ctx, job, spec) if runs_boot else None
        except (CodeSyncError, ArtifactError) as err:
            self.nodes.give_up(job, str(err))
            return
        # Unique beyond this store: the local provider finds a node's processes by its id.
        node_id = f"{job.name}-{job.id}-n{len(self.ctx.store.nodes(job.id))}-{secrets.token_hex(2)}"
        self.ctx.store.add_node(node_id, job.id, rank, provider.name, offer=asdict(offer), spot=candidate.spot)
        request = NodeRequest(
            job_id=str(job.id), node_id=node_id, workdir=NODE_WORKDIR if boot else spec.workdir, boot=boot,
            log_path=str(job_dir(job.id, self.ctx.home) / f"{node_id}.log"),
            command=agent_command(local), cpus=requested_cpus(spec),
            env=agent_env(self.ctx.url, job, node_id, local, self.ctx.trust), offer=offer, spot=candidate.spot,
            avoid_hosts=self._excluded_hosts(job, spec), placement=spec.placement(provider.name),
            identity=spec.resources.identity(provider.name), owner=self.ctx.store.owner)
        role = f"rank {rank}" if rank is not None else "spare"
        created = functools.partial(self._created, job.id, spec, node_id, candidate, role)
        self.ctx.calls.start(("change", node_id), provider.name, f"{provider.name}: create of node {node_id}",
                             lambda: provider.provision(request), deadline_s(provider, "create"), created,
                             on_late=created)

    def _prepare_artifacts(self, job: Job, spec: JobSpec) -> None:
        """Pack the job's code and build tfsn's wheel in a worker (a large workdir or a first wheel build takes
        seconds to minutes, and the loop watches every job meanwhile); the result is recorded on the loop."""
        def prepared(call: Call) -> None:
            now = self.ctx.store.job(job.id)
            if now.state.terminal:
                if call.error is None and "code" not in job.artifacts:   # it was packed, for no one now
                    self.ctx.artifacts.settled(call.value["code"])
                return
            if isinstance(call.error, (CodeSyncError, ArtifactError, DeadlineError)):
                self.nodes.give_up(now, str(call.error))
            elif call.error is not None:
                raise call.error   # a bug: said by the calls' collector
            else:
                record_artifacts(self.ctx, now, spec, call.value)
        self.ctx.calls.start(("artifacts", job.id), ARTIFACTS, f"job {job.id}: code archive and tfsn wheel",
                             lambda: prepare_artifacts(self.ctx, job, spec), ARTIFACTS_DEADLINE_S, prepared)

    def _created(self, job_id: int, spec: JobSpec, node_id: str, candidate: PlannedOffer, role: str,
                 call: Call) -> None:
        """A create returned (or passed its deadline): the node starts, or the refusal is dealt with. One that
        returns for a node let go meanwhile (a stop, a move, its deadline) records what it made: the sweep deletes
        that by the id the cloud gave (a search by tag may not see a fresh machine yet), and it is billed till then."""
        node = self.ctx.store.node(node_id)
        if node.state != NodeState.REQUESTED:
            if call.error is None:
                self.ctx.store.update_node(node_id, handle=call.value.__dict__, provisioned_at=time.time())
            return
        if call.error is not None:
            err = call.error
            if not isinstance(err, ProviderError):   # a provider bug or an OS error must not leave the node REQUESTED
                err = ProviderError(f"{type(err).__name__}: {err}", provider=candidate.offer.provider)
            self._refused(self.ctx.store.job(job_id), spec, node_id, candidate, err)
            return
        handle: NodeHandle = call.value
        self.backoff.pop((job_id, "node"), None)
        self.ctx.store.update_node(node_id, state=NodeState.STARTING, handle=handle.__dict__,
                                   provisioned_at=time.time())
        self.ctx.event(job_id, "node", f"node {node_id} provisioned on {_text(candidate)} ({role})")

    def _refused(self, job: Job, spec: JobSpec, node_id: str, candidate: PlannedOffer, err: ProviderError) -> None:
        """A provider refused a node (or did not answer in time): try the same offer again later if the error is
        transient, else block what the error's scope says (the next node goes to the next candidate)."""
        self.ctx.store.update_node(node_id, state=NodeState.FAILED, failure=str(err))
        # The cloud may have taken the request before the error (a timeout after EC2 accepted the
        # ClientToken, an operation that failed half-way): make sure nothing is left running.
        self.nodes.terminate(self.ctx.store.node(node_id))
        if self._retry_later(job.id, "node", f"node {node_id} could not be created on {_text(candidate)}", err):
            return
        self.nodes.block(job, asdict(candidate.offer), candidate.spot, str(err), err.scope)
        following = self._candidate(self.ctx.store.job(job.id), spec)
        self.ctx.event(job.id, "node", f"node {node_id} could not be created on {_text(candidate)}: {err} "
                       f"(blocked this {err.scope}; " + (f"next: {_text(following)})" if following else
                                                         "planning again)" if self.ctx.calls.busy(("plan", job.id))
                                                         or (job.id, "plan") in self.backoff
                                                         else "no candidate left)"))

    def _excluded_hosts(self, job: Job, spec: JobSpec) -> tuple[str, ...]:
        """The machines under the nodes the health policy replaced: a new node must not land there."""
        policy = self.health.watch(job, spec).policy
        return tuple(sorted({n.host for n in self.ctx.store.nodes(job.id) if n.host and policy.is_excluded(n.id)}))

    def _gather(self, job: Job, candidate: PlannedOffer) -> None:
        """Release the job's nodes that are not where its next node goes (they are recreated there)."""
        offer = candidate.offer
        where = f"{offer.provider}/{offer.zone or offer.region}"
        for node in self.ctx.store.nodes(job.id, active_only=True):
            if node.offer is not None and site(node.offer) != site(offer):
                self.nodes.release(node, failure=f"moved with the job to {where}")
                self.ctx.event(job.id, "node", f"node {node.id} released: the job moves to {where}")


def _first_unblocked(job: Job) -> PlannedOffer | None:
    """The best candidate of the job's plan that no provisioning failure has ruled out."""
    blocked = Blocklist.from_records(job.blocked)
    return next((c for c in map(PlannedOffer.from_record, job.plan) if not blocked.blocks(c.offer)), None)


def _text(candidate: PlannedOffer) -> str:
    return offer_text(candidate.offer, candidate.spot)


def requested_cpus(spec: JobSpec) -> int | None:
    """The vCPUs each node asks for (None: the provider's default)."""
    return int(spec.resources.cpus.count) if spec.resources.cpus else None


def free_port() -> int:
    """A TCP port free on loopback now, for the workers' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unreachable(url: str) -> str | None:
    """Why nodes elsewhere could not reach the controller at `url`, or None."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in ("", "0.0.0.0", "::") or host == "localhost" or host.startswith("127.") or host == "::1":
        return (f"cloud nodes could not reach this controller at {url or 'an unset address'}. To fix: restart it "
                "with TFSN_API_HOST=0.0.0.0 and TFSN_API_ADVERTISE=<an address the nodes reach> (and TFSN_API_PORT "
                "for a fixed port): `tfsn controller stop`, then launch again")
    return None


def agent_command(local: bool = True) -> list[str]:
    """How a node starts its agent: with this very Python here, with the node's own Python elsewhere."""
    return [sys.executable if local else "python3", "-m", "orchestrator.agent"]


def agent_env(url: str, job: Job, node_id: str, local: bool = True,
              trust: dict[str, str] | None = None) -> dict[str, str]:
    """The agent's environment: the controller's address, what to trust it by (`trust`: its CA and the CA's
    fingerprint, public; the agent's workers inherit them) and the node's own token. A local node inherits
    this process's environment; a remote one gets only tfsn's settings (never this machine's credentials,
    paths or devices: they would end up in the VM's metadata)."""
    job_specific = {"TFSN_CONTROLLER_URL", "TFSN_TOKEN", "TFSN_JOB_ID", "TFSN_NODE_ID", "TFSN_HOME", "TFSN_WORKDIR",
                    CA_PEM_ENV, CA_FINGERPRINT_ENV}
    keep = {k: v for k, v in os.environ.items()
            if k not in job_specific and (local or k in REMOTE_SETTINGS)}
    return {**keep, **(trust or {}), "TFSN_CONTROLLER_URL": url, "TFSN_TOKEN": agent_token(job.token, node_id),
            "TFSN_JOB_ID": str(job.id), "TFSN_NODE_ID": node_id}
