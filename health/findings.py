"""The plain types of health: what a detector found, and what the policy decided about it.

They sit apart from the code that makes and weighs them, and import nothing of health, so that the
config, the policy and every detector can share them without importing each other.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


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

