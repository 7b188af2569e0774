"""The local provider: a node is a process tree on this machine.

The embedded default: N nodes are N agent processes, each in its own session, all tagged with
the environment variable `TFSN_LOCAL_NODE=<node_id>`. The tag is what makes a local node a unit
of failure and replacement: torchrun starts its workers in new sessions and a killed agent leaves
orphans behind, so terminating a node kills every process that carries its tag, wherever it was
reparented to.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from providers.base import InvalidRequestError, NodeHandle, NodeRequest, NodeStatus, Offer, ProviderError
from providers.processes import pids_with_env, start_time

NODE_TAG = "TFSN_LOCAL_NODE"
TERMINATE_GRACE_S = 5.0


# A cgroup's memory limit, by its hierarchy's type: v2's memory.max ("max": none), v1's limit_in_bytes (~2^63: none).
CGROUP_MEMORY_LIMITS = {"cgroup2": "memory.max", "cgroup": "memory.limit_in_bytes"}


def _host_memory_gib(root: Path = Path("/")) -> float:
    """GiB the jobs started here may use: MemTotal, or this process's cgroup limit where lower (a CI container,
    `docker run -m 4g`: the kernel kills a job beyond it, however big the host); 0.0 where MemTotal is unknown.
    `root` is the filesystem the files are read under."""
    try:
        total = next((int(line.split()[1]) * 1024 for line in (root / "proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:")), 0)
    except (OSError, ValueError, IndexError):
        return 0.0
    limits = []
    for directory, name in _memory_cgroups(root):
        try:
            limits.append(int((directory / name).read_text().strip()))
        except (OSError, ValueError):       # no memory controller in this hierarchy, or v2's "max"
            pass
    return min([total, *limits]) / 2**30


def _memory_cgroups(root: Path) -> list[tuple[Path, str]]:
    """This process's cgroup and its ancestors up to where their hierarchy is mounted, each with its limit file's
    name: a limit is set on the process's own cgroup or one above (a systemd service's MemoryMax, its slice's, a
    Slurm job's --mem), not on the hierarchy's root, the only one read before, which a process sees as its own
    only in a container with its own cgroup namespace."""
    try:
        own = [line.split(":", 2) for line in (root / "proc/self/cgroup").read_text().splitlines()
               if line.count(":") >= 2]
        mounts = [line.split() for line in (root / "proc/self/mountinfo").read_text().splitlines()]
    except OSError:
        return []
    found = []
    for fields in mounts:   # id parent dev root mountpoint options [optional...] - type source super-options
        if len(fields) < 5:     # not a mount line the kernel writes
            continue
        kind, _, options = (fields[fields.index("-") + 1:] + ["", "", ""])[:3] if "-" in fields else ("", "", "")
        if kind == "cgroup2":
            path = next((p for hierarchy, names, p in own if hierarchy == "0" and not names), None)
        elif kind == "cgroup" and "memory" in options.split(","):
            path = next((p for _, names, p in own if "memory" in names.split(",")), None)
        else:
            continue
        if path is None:
            continue
        top = root / fields[4].lstrip("/")
        # the path as the mount shows it: within a container's cgroup mounted as the hierarchy's top, from there
        directory = top / (Path(path).relative_to(fields[3]) if Path(path).is_relative_to(fields[3]) else "")
        found += [(d, CGROUP_MEMORY_LIMITS[kind]) for d in [directory, *directory.parents] if d.is_relative_to(top)]
    return found


def tagged_pids(node_id: str) -> list[int]:
    """Every live process on this machine that belongs to the local node `node_id`."""
    return pids_with_env(**{NODE_TAG: node_id})


class LocalProvider:
    """Nodes as process trees on this machine (see the module docstring)."""

    name = "local"
    shares_host = True   # every node runs on this one machine: the controller splits its cores
    status_poll_s = 0.0  # asking costs a /proc read: every reconcile
    start_timeout_s = 60.0  # an agent process sends its first heartbeat within seconds

    def __init__(self) -> None:
        # Children started by this process, reaped on status() so they do not linger as zombies.
        self._children: dict[str, subprocess.Popen] = {}

    def offers(self) -> list[Offer]:
        """This machine, free: CPU only (GPUs here are used by the job but not priced or planned)."""
        return [Offer(provider=self.name, region="local", zone=None, instance_type="local",
                      accelerator=None, accelerator_count=0, accelerator_memory_gib=0.0,
                      vcpus=float(os.cpu_count() or 1), memory_gib=_host_memory_gib(), price=0.0)]

    def provision(self, request: NodeRequest) -> NodeHandle:
        host_cpus = os.cpu_count() or 1
        if request.cpus is not None and request.cpus > host_cpus:
            raise InvalidRequestError(
                f"a local node cannot have {request.cpus} CPUs: this machine has {host_cpus}. "
                "To fix: lower resources.cpus or pick a cloud in resources.infra.", provider=self.name)
        existing = self._children.get(request.node_id)
        if existing is not None and existing.poll() is None:  # idempotent: already running
            return self._handle(request.node_id, existing.pid)
        env = {**request.env, NODE_TAG: request.node_id}
        # the node's log may hold what the job printed: this user's only, like the rest of TFSN_HOME
        log = (open(request.log_path, "ab", opener=lambda name, flags: os.open(name, flags, 0o600))
               if request.log_path else subprocess.DEVNULL)
        try:
            proc = subprocess.Popen(request.command, cwd=request.workdir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        self._children[request.node_id] = proc
        return self._handle(request.node_id, proc.pid)

    def _handle(self, node_id: str, pid: int) -> NodeHandle:
        return NodeHandle(provider=self.name, node_id=node_id, data={"pid": pid, "start_time": start_time(pid)})

    def status(self, handle: NodeHandle) -> NodeStatus:
        child = self._children.get(handle.node_id)
        if child is not None and child.poll() is not None:
            return NodeStatus.TERMINATED
        pid, started = handle.data.get("pid"), handle.data.get("start_time")
        if pid is None or started is None or start_time(pid) != started:
            return NodeStatus.TERMINATED
        return NodeStatus.RUNNING

    def terminate(self, handle: NodeHandle) -> None:
        """SIGTERM the whole tagged tree, then SIGKILL what is left after a grace period."""
        deadline = time.monotonic() + TERMINATE_GRACE_S
        sig = signal.SIGTERM
        while True:
            pids = tagged_pids(handle.node_id)
            if self.status(handle) is NodeStatus.RUNNING:
                pids.append(handle.data["pid"])
            if not pids:
                break
            if time.monotonic() > deadline + TERMINATE_GRACE_S:
                # Only a process stuck in the kernel (D state) outlives SIGKILL; waiting longer
                # would stall the controller for every job.
                raise ProviderError(f"local node {handle.node_id}: processes {sorted(set(pids))} survive "
                                    "SIGKILL (stuck in the kernel); they will go when the kernel lets them",
                                    provider=self.name)
            if time.monotonic() > deadline:
                sig = signal.SIGKILL
            for pid in set(pids):
                try:
                    os.kill(pid, sig)
                    os.kill(pid, signal.SIGCONT)  # a stopped (hung) process acts on SIGTERM only once resumed
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        child = self._children.pop(handle.node_id, None)
        if child is not None:
            child.wait()
