"""The controller's answers to agents and SDKs (the API's `Handlers`): heartbeats, results, logs,
telemetry, GPU samples and checkpoints in; what a node must do now out. Runs on the API's threads, so
it only records and wakes the loop; decisions are the loop's.

The job's `run` command and `envs` (which may hold the user's API keys) go to a node's agent once per
attempt, in the answer to its own `attempt` request, never in the heartbeats it sends every second."""
from __future__ import annotations

import time
from pathlib import Path, PurePosixPath
from typing import Any

from health.telemetry import Sample
from orchestrator.control.boot import boot_failure_summary
from orchestrator.control.context import ControlContext, plain
from orchestrator.control.credentials import sdk_token
from orchestrator.control.health_watch import HealthWatch
from orchestrator.control.nodes import workers_per_node
from orchestrator.control.store import Job, JobState, Node, NodeState
from orchestrator.home import job_dir
from orchestrator.planning.placement import local_worker_threads, planned_hardware
from orchestrator.spec import JobSpec


MAX_JOB_LOG_BYTES = 4 << 30   # a job's log takes the nodes' lines up to this size
# glibc's malloc hands a step's freed activations back to the kernel and faults them in again at the next
# step (measured under `tfsn launch`: 2.9 thousand page faults and 4.2 ms of system time in a 21 ms step of a
# small convnet, none with these). A training process needs the same memory every step, so its CPU workers keep
# what they freed, as PyTorch's caching allocator does on GPUs: nothing goes back below 1 GiB of free heap,
# and blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap. A job's `envs` may set them, or
# leave glibc its own with an empty value (which glibc would read as 0: every block mapped and unmapped).
WORKER_MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


class ApiHandlers:
    def __init__(self, ctx: ControlContext, health: HealthWatch) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.health = health
        self._log_full: dict[int, bool] = {}     # jobs whose log passed MAX_JOB_LOG_BYTES (said once)

    def heartbeat(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        node = self._node_of(job_id, node_id)
        job = self.store.job(job_id)
        if job.state.terminal or not node.state.active:   # nothing to record: the agent is told to exit
            return {"action": "exit"}
        self.store.update_node(node_id, heartbeat_at=time.time(), agent_state=str(body.get("state", "")),
                               addr=str(body.get("addr") or node.addr), host=str(body.get("host") or node.host))
        # Only a STARTING node becomes READY: the loop may have failed it meanwhile.
        if body.get("state") == "ready" and self.store.promote_node(node_id, NodeState.STARTING, NodeState.READY):
            self.ctx.event(job_id, "node", f"node {node_id} ready" + (f" (rank {node.rank})" if node.rank is not None
                                                                         else " (spare)"))
            self.ctx.wake.set()
        return self.command(self.store.job(job_id), self.store.node(node_id))

    def result(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """How setup (attempt 0) or the current attempt (a ranked node, even one failed meanwhile: its summary
        says why) ended here. A result of an earlier attempt arrives late after a restart: taken, ignored."""
        node = self._node_of(job_id, node_id)
        attempt, current = int(body["attempt"]), self.store.job(job_id).attempt
        if 0 < attempt < current:
            return {}
        if attempt != 0 and (node.rank is None or attempt != current):   # a spare runs no attempt
            raise ValueError(f"node {node_id} does not run attempt {attempt}")
        signal = body.get("signal")
        self.store.record_result(job_id, node_id, int(body["attempt"]), int(body["returncode"]),
                                 None if signal is None else int(signal), bool(body.get("stopped")),
                                 str(body.get("summary", ""))[-4000:])
        self.ctx.wake.set()
        return {}

    def attempt(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """The command of the attempt a heartbeat told the node to run: torchrun's arguments, the job's
        `run` and its environment (with the SDK's token). Anything else the node should do instead if
        that attempt is no longer the one to run."""
        node = self._node_of(job_id, node_id)
        job = self.store.job(job_id)
        command = self.command(job, node)
        if command["action"] != "run" or int(body["attempt"]) != job.attempt:
            return command
        spec = JobSpec.model_validate(job.spec)
        return {**command, "run": spec.run, "workdir": spec.workdir, "nnodes": spec.num_nodes,
                "node_rank": node.rank, "nproc_per_node": workers_per_node(spec, [node]),
                "master_addr": self._master_addr(job),
                "master_port": job.master_port, "env": self._worker_env(job, spec)}

    def logs(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """A node's output lines. Only the controller and the node's own agent may speak as `[tfsn]`: a line
        that claims it otherwise (a worker printing "[tfsn] job 1 succeeded", colours or concealed text
        before it) is marked with its node."""
        self._node_of(job_id, node_id)
        log = job_dir(job_id, self.ctx.home) / "job.log"
        if log.exists() and log.stat().st_size > MAX_JOB_LOG_BYTES:   # a node that floods must not fill the disk
            if not self._log_full.get(job_id):
                self._log_full[job_id] = True
                self.ctx.event(job_id, "log", f"the job log passed {MAX_JOB_LOG_BYTES >> 30} GiB: nodes' lines are "
                                              "dropped from now on (tfsn's own events are kept)")
            return {}
        own = f"[tfsn] node {node_id}:"   # the agent's own lines; any other with "[tfsn]" in what a terminal
        self.ctx.log(job_id, [line if line.startswith(own) or "[tfsn]" not in plain(line)   # shows is marked
                              else f"[node {node_id}] {line}" for line in map(str, body.get("lines", []))])
        return {}

    def boot_failure(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """A VM's boot script failed (it powers the machine off): the end of its boot log is kept on the node
        for `tfsn status`; the loop fails the node (boot.py counts such failures per offer)."""
        self._node_of(job_id, node_id)
        summary = boot_failure_summary(body)
        self.store.update_node(node_id, boot_failure=str(body["tail"]) or "(empty boot log)", failure=summary)
        self.ctx.event(job_id, "node", f"node {node_id}: {summary}")
        self.ctx.wake.set()
        return {}

    def artifact(self, job_id: int, node_id: str, digest: str) -> Path:
        """The file a node of the job may fetch as it boots (its code archive, tfsn's wheel): KeyError for any
        other, so that one job's node never gets another job's code."""
        self._node_of(job_id, node_id, active=True)
        path = self.ctx.artifacts.path(digest) if digest in self.store.job(job_id).artifacts.values() else None
        if path is None:
            raise KeyError(f"node {node_id} has no file {digest}")
        return path

    def telemetry(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]:
        """Step records and heartbeats of one rank; the answer asks for a checkpoint when one is wanted."""
        attempt, rank, records = int(body["attempt"]), int(body["rank"]), list(body["records"])
        self.store.record_steps(job_id, attempt, rank, records)
        watch = self.health.existing(job_id)
        if watch is not None:
            watch.post(attempt, rank, body, time.time())
        job = self.store.job(job_id)
        return {"checkpoint": job.checkpoint_request} if job.checkpoint_request > job.checkpoint_at else {}

    def samples(self, job_id: int, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """GPU samples (NVML, DCGM) from a node's agent (each checked by requests.GpuSample)."""
        self._node_of(job_id, node_id, active=True)
        watch = self.health.existing(job_id)
        if watch is not None:
            for raw in body.get("samples", []):
                watch.observe_device(Sample(**{**raw, "node": node_id}))
        return {}

    def checkpoint(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]:
        step, path = int(body["step"]), str(body["path"])
        job = self.store.job(job_id)
        root = self._checkpoint_dir(job, JobSpec.model_validate(job.spec))
        nothing = bool(body.get("restored")) and step == 0 and path.rstrip("/") == root.rstrip("/")
        if not nothing and not _inside(path, root):
            raise ValueError(f"checkpoint path {path!r} is not in the job's checkpoint directory {root}")
        if body.get("restored"):
            self.store.update_job(job_id, restored_step=step)
            self.ctx.event(job_id, "checkpoint",
                           _restored_text(job, step, path, nothing, root, body.get("skipped", [])))
        else:
            self.store.update_job(job_id, checkpoint_step=step, checkpoint_path=path, checkpoint_at=time.time())
            watch = self.health.existing(job_id)
            if watch is not None:
                watch.saved(float(body.get("seconds", 0.0)))
            self.ctx.event(job_id, "checkpoint", f"saved step {step} in {body.get('seconds', 0):.2f}s to {path}")
        return {}

    def command(self, job: Job, node: Node) -> dict[str, Any]:
        """What `node`'s agent must do now: setup, idle, run an attempt, or exit."""
        if job.state.terminal or not node.state.active:
            return {"action": "exit"}
        spec = JobSpec.model_validate(job.spec)
        if node.state == NodeState.STARTING:
            return {"action": "setup", "setup": spec.setup or "", "workdir": spec.workdir}
        if node.rank is None or job.state != JobState.RUNNING or job.attempt_state != "running":
            return {"action": "idle"}
        return {"action": "run", "attempt": job.attempt}   # the command itself: `attempt`

    def _master_addr(self, job: Job) -> str:
        """Where the workers meet: rank 0's node, as its agent reported it (loopback on one machine)."""
        first = next((n for n in self.store.nodes(job.id, active_only=True) if n.rank == 0), None)
        if first is None or self.ctx.shares_host(first.provider) or not first.addr:
            return "127.0.0.1"
        return first.addr

    def _worker_env(self, job: Job, spec: JobSpec) -> dict[str, str]:
        ckpt = spec.checkpoint
        ranked = [n for n in self.store.nodes(job.id, active_only=True) if n.rank is not None]
        # CPU nodes only: a GPU node's activations are not on the heap, and its data loaders would keep memory
        on_cpus = not spec.resources.accelerators and not any((n.offer or {}).get("accelerator") for n in ranked)
        envs = {k: v for k, v in {**(WORKER_MALLOC_ENV if on_cpus else {}), **spec.envs}.items()
                if v or k not in WORKER_MALLOC_ENV}
        env = {**envs, "TFSN_ATTEMPT": str(job.attempt), "TFSN_NUM_NODES": str(spec.num_nodes),
               "TFSN_CHECKPOINT_DIR": self._checkpoint_dir(job, spec), "TFSN_JOB_NAME": job.name,
               "TFSN_TOKEN": sdk_token(job.token)}   # the workers' own, narrower than their agent's
        # The spec overrides the script's own settings only where the user wrote them down.
        if "interval" in ckpt.model_fields_set:
            env["TFSN_CHECKPOINT_INTERVAL"] = str(ckpt.interval)
        if "keep" in ckpt.model_fields_set:
            env["TFSN_CHECKPOINT_KEEP"] = str(ckpt.keep)
        if "async_save" in ckpt.model_fields_set:
            env["TFSN_CHECKPOINT_ASYNC"] = "1" if ckpt.async_save else "0"
        if spec.steps is not None:
            env["TFSN_STEPS"] = str(spec.steps)
        if ranked and all(self.ctx.shares_host(n.provider) for n in ranked) and "OMP_NUM_THREADS" not in spec.envs:
            # Nodes that share this machine split its cores instead of each taking all of them.
            env["OMP_NUM_THREADS"] = str(local_worker_threads(spec, workers_per_node(spec, ranked)))
        offer = next((n.offer for n in ranked if n.offer), None)
        if ranked and offer is not None:     # what `tfsn plan` searched the step for on these nodes
            env.setdefault("TFSN_PLANNED_HARDWARE", planned_hardware(offer, self.ctx.shares_host(ranked[0].provider)))
        return env

    def _checkpoint_dir(self, job: Job, spec: JobSpec) -> str:
        return spec.checkpoint.dir or str(job_dir(job.id, self.ctx.home) / "checkpoints")

    def _node_of(self, job_id: int, node_id: str, active: bool = False) -> Node:
        node = self.store.node(node_id)
        if node.job_id != job_id:
            raise ValueError(f"node {node_id} is not part of job {job_id}")
        if active and not node.state.active:
            raise ValueError(f"node {node_id} is {node.state.value}: it takes no more reports")
        return node


def _restored_text(job: Job, step: int, path: str, nothing: bool, root: str, skipped: list[str]) -> str:
    """What a restore found, said so that a restart that could not resume from the last checkpoint the job saved
    (corrupt, deleted, unreadable: `skipped` says why) is never taken for a resume."""
    text = f"no checkpoint to restore in {root}: training starts at step 0" if nothing else \
        f"restored step {step} from {path}"
    if job.checkpoint_step and job.checkpoint_step > step:
        text += (f"; WARNING: the last checkpoint saved was step {job.checkpoint_step} ({job.checkpoint_path}), "
                 "and it could not be restored" + ("" if skipped else " (the workers' warnings say why)"))
    if skipped:
        text += f"; skipped {len(skipped)} newer: " + "; ".join(skipped)
    return text


def _inside(path: str, root: str) -> bool:
    """Whether `path` is under `root` as the SDK writes it (`<root>/step-N`), with no `..` to climb out."""
    if "://" not in root:
        root = str(PurePosixPath(root))
    return ".." not in path.split("/") and path.startswith(root.rstrip("/") + "/")
