"""Why a large training job stops, by Llama 3's published count, and how each cause shows itself.

Llama 3 405B pre-training on 16,384 H100s saw 419 unexpected interruptions in a 54-day snapshot
(Llama Team, "The Llama 3 Herd of Models", 2024, section 3.3.4, Table 5; also tabulated at
glennklockwood.com/garden/component-reliability): faulty GPU 148 (30.1%), GPU HBM3 memory 72
(17.2%), software bug 54 (12.9%), network switch/cable 35 (8.4%), host maintenance 32 (7.6%),
GPU SRAM memory 19 (4.5%), GPU system processor 17 (4.1%), NIC 7 (1.7%), NCCL watchdog timeouts 7
(1.7%), silent data corruption 6 (1.4%), GPU thermal interface + sensor 6 (1.4%), SSD 3, power
supply 3, server chassis 2, IO expansion board 2, dependency 2, CPU 2, system memory 2 (0.5-0.7%
each). 419 / (54 x 24 x 16,384) = 1.97e-5 interruptions per GPU-hour.

What each cause looks like to the job, and so how soon anyone can know (`Effect`):
  XID        the GPU raises an Xid (NVML event): tfsn sees it at the agent's next GPU sample and
             names the node. GPU, HBM3, SRAM, GSP faults (NVIDIA's Xid catalog: 79, 48, 94/95, 119/120,
             74 NVLink); a GPU that overheats through a failed thermal interface falls off the bus (79).
  EXIT       a process exits with an error: the agent sees torchrun end. Software bugs, dependencies,
             an SSD's I/O errors.
  HANG       no Xid, no exit: the collectives stop, the processes live (and heartbeat). Network switch
             or cable, a NIC, NCCL watchdog timeouts of unknown cause. Only a hang timeout tells, and it
             names no node: a NIC's node is found only when the restart fails on it again.
  NODE_LOST  the host goes away (maintenance, power supply, chassis, IO board, CPU, memory): its agent
             and ranks fall silent; the controller's node heartbeat timeout tells, and names the node.
  SILENT     silent data corruption: training goes on with wrong numbers. No detector here sees it;
             it is found later (a loss spike) and the run rolls back to before it.
About 40% of the interruptions (network, host maintenance, NIC, NCCL, SDC, host parts) give no Xid.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Effect(str, enum.Enum):
    XID = "xid"
    EXIT = "exit"
    HANG = "hang"
    NODE_LOST = "node_lost"
    SILENT = "silent"


@dataclass(frozen=True)
class Cause:
    """One row of Llama 3's Table 5: how many interruptions, what they look like, whether a node is at fault."""

    name: str
    count: int                  # of the 419
    effect: Effect
    node_fault: bool            # replacing its node removes the cause
    xid: int | None = None      # the Xid a GPU raises for it (effect XID)


LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
LLAMA3_FAILURES_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)   # 1.97e-5

LLAMA3_CAUSES: tuple[Cause, ...] = (
    Cause("faulty GPU", 148, Effect.XID, True, 79),
    Cause("GPU HBM3 memory", 72, Effect.XID, True, 48),
    Cause("software bug", 54, Effect.EXIT, False),
    Cause("network switch/cable", 35, Effect.HANG, False),
    Cause("host maintenance", 32, Effect.NODE_LOST, True),
    Cause("GPU SRAM memory", 19, Effect.XID, True, 95),
    Cause("GPU system processor", 17, Effect.XID, True, 119),
    Cause("NIC", 7, Effect.HANG, True),
    Cause("NCCL watchdog timeout", 7, Effect.HANG, False),
    Cause("silent data corruption", 6, Effect.SILENT, True),
    Cause("GPU thermal interface + sensor", 6, Effect.XID, True, 79),
    Cause("SSD", 3, Effect.EXIT, True),
    Cause("power supply", 3, Effect.NODE_LOST, True),
    Cause("server chassis", 2, Effect.NODE_LOST, True),
    Cause("IO expansion board", 2, Effect.NODE_LOST, True),
    Cause("dependency", 2, Effect.EXIT, False),
    Cause("CPU", 2, Effect.NODE_LOST, True),
    Cause("system memory", 2, Effect.NODE_LOST, True),
)
assert sum(c.count for c in LLAMA3_CAUSES) == LLAMA3_INTERRUPTIONS


def no_xid_share() -> float:
    """The share of interruptions no GPU reports with an Xid."""
    return sum(c.count for c in LLAMA3_CAUSES if c.effect != Effect.XID) / LLAMA3_INTERRUPTIONS
