"""The plain types of health: what a detector found, and what the policy decided about it.

They sit apart from the code that makes and weighs them, and import nothing of health, so that the
config, the policy and every detector can share them without importing each other. With them, how a
finding's evidence names ranks, so that every detector names them the same way.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

SHOWN_RANKS = 8                # ranks spelled out in one line of evidence


class FindingKind(str, enum.Enum):
    STRAGGLER = "straggler"
    THROTTLE = "throttle"
    XID = "xid"
    HANG = "hang"
    ECC = "ecc"


class Severity(str, enum.Enum):
    INFO = "info"            # worth a line in the log; no action on the node
    WARNING = "warning"      # a fault if it persists
    CRITICAL = "critical"    # a fault now


@dataclass(frozen=True, slots=True)
class Finding:
    """One detector's verdict on one node (node "" = the whole job).

    `ranks` are the ranks the step-time detectors blame; a device finding (Xid, ECC, a throttled GPU
    with no slow rank) names the node and GPU and no ranks, since NVML's GPU index is not the rank's.
    """

    kind: FindingKind
    severity: Severity
    node: str
    gpu: int | None
    ranks: tuple[int, ...]
    evidence: str            # one line, with the numbers that led to it
    time: float
    step: int | None
    slowdown: float | None = None   # how much slower the blamed rank computes (0.2: 1.2x the others), if known


class Action(str, enum.Enum):
    IGNORE = "ignore"
    WARN = "warn"                  # log and raise the metric; nothing else
    CHECKPOINT = "checkpoint"      # save now, don't replace
    REPLACE_NODE = "replace_node"  # checkpoint if the job still runs, replace the node, restart from the checkpoint
    FAIL = "fail"                  # end this attempt as failed; the controller's restart rules decide what follows


@dataclass(frozen=True, slots=True)
class Decision:
    """One thing to do now, and why."""

    action: Action
    node: str                      # "" for the whole job
    finding: Finding
    reason: str



def ranks_by_node(rank_nodes: Sequence[str], ranks: Sequence[int]) -> dict[str, list[int]]:
    """`ranks` grouped by the node each runs on: nodes in the order of their first rank, ranks in the given order."""
    out: dict[str, list[int]] = {}
    for rank in ranks:
        out.setdefault(rank_nodes[rank], []).append(int(rank))
    return out


def ranks_text(ranks: Sequence[int]) -> str:
    """The ranks for one line of evidence: the first few, and how many more."""
    shown = ", ".join(str(r) for r in ranks[:SHOWN_RANKS])
    return shown + (f" and {len(ranks) - SHOWN_RANKS} more" if len(ranks) > SHOWN_RANKS else "")
