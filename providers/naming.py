"""Names and tags every driver puts on what it creates, written once so that a sweep finds them all."""
from __future__ import annotations

import hashlib
import re

from providers.base import NodeRequest

JOB_TAG = "tfsn-job"     # tag / label key: the job a resource belongs to
NODE_TAG = "tfsn-node"   # tag / label key: the node id a resource was created for
OWNER_TAG = "tfsn-owner"  # tag / label key: the store (TFSN_HOME) whose job it is; job ids repeat across stores


def dns_label(text: str) -> str:
    """`text` as a valid DNS label (lowercase alphanumerics and '-', at most 63 chars): the form pod, VM
    and cluster names and label values must take; with a digest suffix whenever it had to change, so
    that two ids never share a name."""
    clean = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if clean == text and len(clean) <= 63:
        return clean
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{clean[:54].rstrip('-')}-{digest}".lstrip("-")


def node_tags(request: NodeRequest, label_safe: bool = False) -> dict[str, str]:
    """The job and node tags of a request's resources; `label_safe` for clouds whose label values must
    be DNS labels (GCP, Kubernetes)."""
    owner = {OWNER_TAG: dns_label(request.owner) if label_safe else request.owner} if request.owner else {}
    if label_safe:
        return {JOB_TAG: dns_label(request.job_id), NODE_TAG: dns_label(request.node_id), **owner}
    return {JOB_TAG: request.job_id, NODE_TAG: request.node_id, **owner}
