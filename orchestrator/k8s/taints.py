"""Taints on the Kubernetes nodes under failed tfsn nodes, so that no replacement is scheduled there.

The host of every node the controller fails (a failed pod, a silent agent, a health finding) is tainted as
its pod is deleted, before the replacement is asked for; a refused taint is tried again by the timer. Each
taint is queued as news for a Kubernetes event (the timer posts them) and remembered in `.status`.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from orchestrator.control.store import Job, Node, NodeState, Store, StoreError
from providers.base import ProviderError
from providers.kubernetes import UNHEALTHY_TAINT, KubernetesProvider


class Taints:
    """Which failed nodes' hosts are tainted, and the taints made since the timer last asked."""

    def __init__(self, store: Store, provider: KubernetesProvider, changed: Callable[[int], None]) -> None:
        self.store = store
        self.provider = provider
        self.changed = changed                      # the job's `.status` must be written again
        self.tainted: set[str] = set()              # ids of failed nodes whose host is tainted (also in .status)
        self._news: dict[int, list[tuple[str, str]]] = {}   # job id -> (host, failure) not yet an event
        self._news_lock = threading.Lock()

    def pod_deleted(self, node_id: str, host: str) -> None:
        """The controller deleted a pod. Deleted for a failure (the node is FAILED by then, its replacement not
        yet asked for), its host is tainted now, so the scheduler never puts the replacement there."""
        try:
            node = self.store.node(node_id)
        except StoreError:
            return
        if node.state == NodeState.FAILED and node_id not in self.tainted:
            self.taint(self.store.job(node.job_id), node, host)

    def retry(self, job: Job) -> None:
        """Taint the hosts of the job's failed nodes whose taint was refused before."""
        for node in self.store.nodes(job.id):
            host = self.provider.hosts.get(node.id) or node.host
            if node.state == NodeState.FAILED and host and node.id not in self.tainted:
                self.taint(job, node, host)

    def taint(self, job: Job, node: Node, host: str) -> bool:
        """Keep pods off the Kubernetes node a failed tfsn node ran on; False (tried again later) if refused."""
        try:
            self.provider.taint(host, f"tfsn node {node.id} of job {job.name}: {node.failure}")
        except ProviderError as err:
            self.store.add_event(job.id, "node", f"could not taint Kubernetes node {host}: {err}")
            return False
        self.tainted.add(node.id)
        with self._news_lock:
            self._news.setdefault(job.id, []).append((host, node.failure))
        self.store.add_event(job.id, "node", f"tainted Kubernetes node {host} ({UNHEALTHY_TAINT}): {node.failure}")
        self.changed(job.id)
        return True

    def news(self, job_id: int) -> list[tuple[str, str]]:
        """(host, failure) of every host tainted for the job since the last call."""
        with self._news_lock:
            return self._news.pop(job_id, [])
