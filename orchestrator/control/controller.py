"""The controller: drives every job through its state machine, from the store.

PENDING -> PROVISIONING -> RUNNING -> (RECOVERING -> RUNNING)* -> SUCCEEDED | FAILED | STOPPED

`reconcile(job)` is a pure function of what the store holds and what providers see, so the
controller can be killed at any point and started again: it re-reads its jobs and carries on.
Agents poll the controller (heartbeat) and get back what their node should be doing now.

The work is split by concern, each part a module of this package: `nodes` (liveness and release),
`provisioning` (plan, failover, start an attempt), `health_watch` (findings to decisions),
`recovery` (end an attempt, restart it on replacement nodes) and `handlers` (the API's answers).

The loop never waits on a cloud: every provider call (plan, create, status, terminate) runs in a bounded pool of
worker threads with a deadline (`calls`), and its result is folded into the job's state at the loop's next pass.
One hung or slow cloud call holds up only what needs its answer; heartbeats, failures and stops of every other
job are seen at the next pass.
"""
from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from health.metrics import Metrics
from orchestrator.control.calls import ProviderCalls
from orchestrator.control.context import ControlContext
from orchestrator.control.handlers import ApiHandlers
from orchestrator.control.health_watch import HealthWatch
from orchestrator.control.nodes import Nodes
from orchestrator.control.provisioning import Provisioner
from orchestrator.control.recovery import Recovery
from orchestrator.control.store import JobState, Store
from orchestrator.spec import JobSpec
from providers.base import Provider

if TYPE_CHECKING:
    from orchestrator.control.api import ApiServer

PASS_S = 0.5           # the loop's longest sleep between two passes (the API and finished calls wake it sooner)
EXIT_GRACE_S = 3.0     # how long a stopping loop waits for calls about to end (a hung one is left to its thread)


class Controller:
    """Reconciles active jobs; `handlers` serves the API."""

    def __init__(self, store: Store, home: Path, providers: dict[str, Provider], url: str = "") -> None:
        self.ctx = ControlContext(store, home, providers, url)
        self.store = store
        self.nodes = Nodes(self.ctx, PASS_S)
        self.health = HealthWatch(self.ctx, self.nodes)
        self.provisioner = Provisioner(self.ctx, self.nodes, self.health)
        self.recovery = Recovery(self.ctx, self.nodes, self.health)
        self.handlers = ApiHandlers(self.ctx, self.health)

    @property
    def url(self) -> str:
        """Where agents reach the API (set by `listen`, once the server listens)."""
        return self.ctx.url

    def listen(self, server: ApiServer) -> None:
        """Agents reach the API at `server`'s URL and trust its CA only (none: plain HTTP on loopback)."""
        self.ctx.url, self.ctx.trust = server.url, server.trust

    @property
    def wake(self) -> threading.Event:
        """Set by the API and the operator when something happened: the loop runs at once."""
        return self.ctx.wake

    @property
    def metrics(self) -> Metrics:
        return self.ctx.metrics

    @property
    def calls(self) -> ProviderCalls:
        """The provider calls in flight, off the loop."""
        return self.ctx.calls

    def run_forever(self, stop: threading.Event, idle_exit_s: float) -> None:
        """Reconcile every active job until `stop` is set or nothing was active for `idle_exit_s`. A pass never
        waits on a provider: it folds in the calls that ended, takes each job one step (which may start calls),
        and asks again for the deletes not confirmed."""
        self.nodes.reconcile_intents()
        idle_since = time.monotonic()
        while not stop.is_set():
            self.nodes.stalls.ran()   # the loop's own tick: a gap since the last is a stall (stalls.py)
            self.wake.clear()
            self.calls.collect()
            active = self.store.jobs(active_only=True)
            for job in active:
                try:
                    self._reconcile(job.id)
                except Exception:  # one broken job must not stop the others
                    print(f"job {job.id}: reconcile failed\n{traceback.format_exc()}", flush=True)
            self.nodes.sweep_releases()
            if active or self.store.unreleased_nodes() or self.calls.in_flight():
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > idle_exit_s:
                break
            self.wake.wait(PASS_S)
        self.calls.settle(EXIT_GRACE_S)

    def reconcile(self, job_id: int) -> None:
        """One step of the job's state machine, each provider call it starts waited for (up to its deadline) and
        folded in before it returns: how a caller outside the loop (tests) drives a job step by step. The loop
        itself never waits: see `run_forever`."""
        with self.calls.waiting():
            self._reconcile(job_id)

    def _reconcile(self, job_id: int) -> None:
        try:
            self._step(job_id)
        finally:   # a job that ended is never reconciled again: whatever failed after, drop its watch now
            if self.store.job(job_id).state.terminal:
                self.health.forget(job_id)
                self.nodes.forget(job_id)
                self.provisioner.forget(job_id)

    def _step(self, job_id: int) -> None:
        job = self.store.job(job_id)
        if job.stop_requested:
            self.nodes.teardown(job)
            self.ctx.transition(job, JobState.STOPPED, "stopped by the user")
            return
        spec = JobSpec.model_validate(job.spec)
        if job.state == JobState.PENDING:
            self.provisioner.plan(job, spec)
            job = self.store.job(job_id)
            if job.state == JobState.PENDING or job.state.terminal:
                return   # planning off the loop; the next pass goes on
        self.nodes.check(job, spec)
        if job.state in (JobState.PROVISIONING, JobState.RECOVERING):
            self.provisioner.provision(self.store.job(job_id), spec)
        elif job.state == JobState.RUNNING:
            self.recovery.watch_attempt(self.store.job(job_id), spec)
