"""The controller's own stalls: silence that is not the nodes' fault.

A node is failed when the controller has not heard from it for the job's heartbeat timeout, which assumes
the controller listened all along. When its process does not run (the laptop running `tfsn launch` suspends,
the process is SIGSTOPped, a loaded machine starves it), no heartbeat is recorded, and on resume every node
looks silent at once: the job would restart all of them from the last checkpoint for nothing.

So the loop notes the time at every pass and before every judgement (`Stalls.ran`); a gap between two notes
longer than a job's `bound` is a stall for that job. A node last heard before a stall counts its silence from
the stall's end (a fresh window, as after a controller restart), but only from the first stall since it was
last heard: one pardon per silence (`Pardons`). A node really dead is so failed within one timeout after the
controller runs again, whatever follows; a controller that stalls again and again (each gap just past the
bound) keeps pardoning the nodes it hears between stalls, never one it does not. (Kubernetes' node lifecycle
controller infers its own trouble instead, when every node of a zone looks down at once, and stops evicting;
measuring the loop's own gap says it directly, and blames no node for it.) The job's health watch pardons its
ranks' step and heartbeat clocks alike (health/hang.py).

Gaps are measured with `time.time()`, the clock of `heartbeat_at` (stored, so it outlives a controller
restart): the pardon must cover the silence as the timeout measures it. On Linux `time.monotonic()` stops
while the machine is suspended, so it would not see a laptop's suspend at all; a step of the wall clock
forward (NTP) ages every heartbeat at once just like a stall, and is pardoned alike, no node's fault either.
"""
from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

STALL_PASSES = 4     # a gap longer than this many of the loop's sleeps is not an ordinary pass
KEPT_GAPS = 1024     # gaps kept for the jobs' next checks; one dropped only pardons less (the old behaviour)


class Gap(NamedTuple):
    """A time the controller's loop did not run: from its last note to its next."""

    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Stalls:
    """The loop's own tick gaps (wall clock, see the module's docstring)."""

    def __init__(self, pass_s: float) -> None:
        """`pass_s`: the loop's longest sleep between two passes."""
        self.least = STALL_PASSES * pass_s
        self.ran_at = time.time()
        self.gaps: deque[Gap] = deque(maxlen=KEPT_GAPS)

    def ran(self) -> float:
        """The loop runs now (each pass, and before each judgement of a node): keep the gap since the last
        note if it is longer than any pass. Returns now."""
        now = time.time()
        if now - self.ran_at > self.least:
            self.gaps.append(Gap(self.ran_at, now))
        self.ran_at = now
        return now

    def bound(self, timeout: float) -> float:
        """The longest gap that is not a stall for a job with this heartbeat timeout: half of it, the other
        half (several heartbeats: the CLI warns under 10s) left to the node; never within a few passes."""
        return max(timeout / 2, self.least)

    def since(self, after: float, timeout: float) -> list[Gap]:
        """The stalls for a job with this heartbeat timeout that ended after `after`, oldest first."""
        bound = self.bound(timeout)
        return [g for g in self.gaps if g.end > after and g.seconds > bound]


class Pardons:
    """One pardon per silence, by key (a node): the time its silence counts from."""

    def __init__(self) -> None:
        self._granted: dict[str, tuple[float, float]] = {}   # key -> (last heard when pardoned, counted from)

    def window(self, key: str, heard: float, stalls: list[Gap]) -> float:
        """When the silence of `key`, last heard at `heard`, counts from: the end of the first of the new
        `stalls` that ended after `heard`, unless this silence was pardoned already (then that pardon's)."""
        granted = self._granted.get(key)
        if granted is not None and granted[0] == heard:
            return granted[1]
        stall = next((g for g in stalls if g.end > heard), None)
        if stall is None:
            return heard
        self._granted[key] = (heard, stall.end)
        return stall.end

    def forget(self, key: str) -> None:
        self._granted.pop(key, None)
