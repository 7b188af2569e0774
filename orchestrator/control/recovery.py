"""Recovery: a running attempt is watched until it ends; a failed one is blamed, and restarted from the
checkpoint on replacement nodes (or the job gives up).

Where a node gets replaced, from fault to restart:
1. the node is failed: its agent went silent or exited (`Nodes.check`), a worker died of a signal that
   blames the machine (`Recovery.recover`, NODE_FAULT_SIGNALS), or the health policy decided to replace
   it (`HealthWatch.act`: a checkpoint is asked first, then the node is failed; a hung one at once);
   `Nodes.fail` marks it FAILED and has its provider terminate it;
2. the attempt stops: every rank is told to stop, and once each has reported (or STOP_GRACE_S passed),
   `recover` moves the job to RECOVERING, or FAILED when max_restarts is spent or the same error
   came back with no progress in between;
3. provisioning (`Provisioner.provision`, orchestrator/control/provisioning.py) gives the empty rank a
   ready spare or a new node, kept off the hosts the policy excluded (`avoid_hosts`), on the next
   candidate of the plan if the old offer is now blocked;
4. once every rank is ready, a new attempt starts and the SDK in each worker restores the last
   checkpoint (`Run.restore`), so no progress before it is lost.
"""
from __future__ import annotations

import re
import time
from typing import Any

from orchestrator.control.context import ControlContext
from orchestrator.control.health_watch import HealthWatch
from orchestrator.control.nodes import Nodes
from orchestrator.control.store import Job, JobState, Node, NodeState
from orchestrator.spec import JobSpec

STOP_GRACE_S = 15.0           # how long a failed attempt waits for every node to report before deciding
# A worker killed by one of these is blamed on its node (OOM killer, hardware, kill -9), not the code.
NODE_FAULT_SIGNALS = {9, 7, 11, 6}  # SIGKILL, SIGBUS, SIGSEGV, SIGABRT
# What differs between two runs of the same failure, in the order applied (see failure_signature).
_VOLATILE = [
    (re.compile(r"^(\[rank\d+\]:\s*)+"), ""),
    (re.compile(r"(?<![\w./-])(?:/private)?/(?:tmp|var/tmp|dev/shm|var/folders)\b[^\s'\"`:,;()\[\]{}<>]*"), "<tmp>"),
    (re.compile(r"\btmp[a-z0-9_]{6,}\b"), "<tmp>"),
    (re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"), "<uuid>"),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\[[0-9a-fA-F:.]*:[0-9a-fA-F:.]*\](?::\d+)?"), "<addr>"),
    (re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b"), "<time>"),                       # log timestamps
    (re.compile(r"\b(pid|process)([ =:#]+)\d+", re.IGNORECASE), r"\1\2<n>"),
    (re.compile(r"\b\d+\.\d+\s*(?:s|ms|sec|seconds|[KMGT]i?B)\b"), "<amount>"),   # durations, sizes free
    (re.compile(r"(?<=[-_])(?=[0-9a-f]*\d)[0-9a-f]{4,7}\b"), "<id>"),                     # short random suffixes
    (re.compile(r"\b(?:0x[0-9a-fA-F]+|(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{8,})\b"), "<hex>"),
    (re.compile(r"\d{4,}"), "<n>"),
]


def _short_of_steps(job: Job, spec: JobSpec) -> str:
    """' at step 4 of 8 (...)' for workers that all exited 0 before the spec's `steps` (a script's early
    sys.exit(0), a loop of its own length): the job still succeeds, as torchrun says, but not silently. '' when
    the steps were done, or the job reported none (a script without the SDK)."""
    done = max(job.step + 1 if job.step_time is not None else 0, job.checkpoint_step or 0)
    if not spec.steps or not 0 < done < spec.steps:
        return ""
    return (f" at step {done} of {spec.steps} (the workers exited with code 0 before `steps`; "
            "their last lines are in `tfsn logs`)")


class Recovery:
    """Ends a RUNNING attempt: success, or a stop of every rank followed by a restart decision."""

    def __init__(self, ctx: ControlContext, nodes: Nodes, health: HealthWatch) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.health = health

    def watch_attempt(self, job: Job, spec: JobSpec) -> None:
        running = job.attempt_state == "running"
        if running:
            self.health.act(job, spec)  # may fail a node or the attempt: read the state after it
            job = self.ctx.store.job(job.id)
        nodes = {n.id: n for n in self.ctx.store.nodes(job.id)}
        ranked = [n for n in nodes.values() if n.rank is not None and n.state.active]
        results = self.ctx.store.results(job.id, job.attempt)
        by_node = {r.node_id: r for r in results}
        if running:
            failures = [r for r in results if r.returncode != 0]
            if len(ranked) < spec.num_nodes or failures or job.attempt_state == "stopping":
                what = failures[0].summary if failures else job.pending_reason or "a node failed"
                self.ctx.store.update_job(job.id, attempt_state="stopping", attempt_changed_at=time.time())
                self.ctx.event(job.id, "attempt", f"attempt {job.attempt} failed: {what}; stopping all ranks")
                self.ctx.wake.set()
            elif len(ranked) == spec.num_nodes and all(by_node.get(n.id) for n in ranked):
                self.nodes.teardown(job)
                self.ctx.transition(job, JobState.SUCCEEDED, f"all {spec.num_nodes} node(s) finished"
                                    + _short_of_steps(job, spec))
            return
        # stopping: wait until every live ranked node reported (or the grace ran out), then decide
        waiting = [n for n in ranked if n.id not in by_node]
        if waiting and time.time() - job.attempt_changed_at < STOP_GRACE_S:
            return
        self.recover(job, spec, nodes, results)

    def recover(self, job: Job, spec: JobSpec, nodes: dict[str, Node], results: list[Any]) -> None:
        """Blame nodes, replace them, and restart every rank from the checkpoint (or give up)."""
        first_failures = [r for r in results if r.returncode != 0 and not r.stopped]
        blamed = [r for r in first_failures if r.signal in NODE_FAULT_SIGNALS]
        for r in blamed:
            node = nodes[r.node_id]
            if node.state.active:
                self.nodes.fail(job, node, f"a worker was killed by signal {r.signal}")
        dead = [n for n in nodes.values() if n.state == NodeState.FAILED and n.updated_at >= job.attempt_started_at]
        infra = bool(blamed) or bool(dead) or not first_failures
        # a node's fault is the cause of its peers' errors after it ("Connection reset by peer"), whichever came first
        summary = (blamed[0].summary if blamed else "; ".join(f"{n.id}: {n.failure}" for n in dead)
                   or (_after_early_exits(first_failures[0].summary, results, nodes) if first_failures
                       else job.pending_reason or "a node was lost"))
        signature = f"{'node' if infra else failure_signature(summary)}|{job.checkpoint_step}"
        if not infra and signature == job.last_failure:
            self.nodes.give_up(job, f"failed the same way twice with no progress in between: {summary}")
            return
        if job.restarts >= spec.recovery.max_restarts:
            self.nodes.give_up(job, f"gave up after {job.restarts} restart(s) (recovery.max_restarts); "
                                    f"last failure: {summary}")
            return
        # the workers restore the newest valid checkpoint: one committed just before the failure may not have been
        # reported yet (a crash at step 5 said 'step 2', and the restart restored step 4)
        reported = f"last reported: step {job.checkpoint_step}" if job.checkpoint_step else "none reported yet"
        self.ctx.transition(job, JobState.RECOVERING, f"restart {job.restarts + 1} of {spec.recovery.max_restarts}"
                            f" from the newest valid checkpoint ({reported}): {summary}",
                            restarts=job.restarts + 1, attempt_state="idle", attempt_changed_at=time.time(),
                            last_failure=signature, pending_replace="", pending_reason="")
        self.ctx.metrics.restart(str(job.id))
        self.ctx.wake.set()


def _after_early_exits(summary: str, results: list[Any], nodes: dict[str, Node]) -> str:
    """`summary` of a failed rank, after the nodes whose workers exited with code 0 while it ran: a script that
    returned early on one rank makes its peers' next collective fail ('Connection reset by peer'), and that error
    alone reads as a network fault."""
    early = [nodes[r.node_id] for r in results if r.returncode == 0 and not r.stopped and r.node_id in nodes]
    if not early:
        return summary
    which = ", ".join(f"node {n.id} (rank {n.rank})" for n in early)
    return f"{which} exited with code 0 while the other ranks still ran; then {summary}"


def failure_signature(summary: str) -> str:
    """What stays the same when a failure repeats: `summary` without the parts that differ from run to
    run, so that "failed the same way twice" is not defeated by a temp name. It strips, in order:
    the `[rankN]:` prefixes (the same error on another rank is the same error); temporary paths
    (under /tmp, /var/tmp, /dev/shm, /var/folders) and tempfile names (tmpXXXXXX); UUIDs; IPv4
    addresses and [IPv6] ones, with their port; clock times ("07:09:52,123"); pids ("pid 1234",
    "Process 1234"); decimal durations and sizes ("30.12s", "3.44 MiB"); short random suffixes with a
    digit ("run-7f3a"); hex runs of 8 or more with letters and digits, or with 0x (addresses, nonces,
    request ids, hashes); and runs of 4 or more digits (ports, ids, dates, sizes). Short numbers stay:
    "exit code 1" is not "2", nor "step 12" "step 13".
    """
    for pattern, replacement in _VOLATILE:
        summary = pattern.sub(replacement, summary)
    return summary

