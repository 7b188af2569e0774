"""Healthy clusters that look unhealthy: the step-time disturbances no node should be replaced for.

Each one changes the simulated compute times of every rank at one step (health/sim.py), and none is
a node's fault, so any node replaced under one is a false replacement:
  transient     one node 20% slower for 50 steps (a noisy neighbour, a background job): costs ~50 s at
                5 s steps, less than a replacement's restart
  rack          256 ranks (32 nodes, a rack) 20% slower together from the onset on
  switch        128 ranks (16 nodes behind one leaf switch) 15% slower together
  quarter       a quarter of all ranks 20% slower together (a congested spine, a slow storage pool)
  noise_growth  every rank's step-to-step noise grows 2.5x at the onset (a noisier fabric or data mix)
  heavy_tails   step-time noise from a Student t with 3 degrees of freedom (unit variance) all run long
  gc_pauses     each rank pauses 2% of its steps for 30-100% of a step (Python's garbage collector)
  eval_steps    every 50th step all ranks run 3x as long (an evaluation inside the step), with 5% more noise
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HIDDEN_HEALTHY = ("transient", "rack", "switch", "quarter", "noise_growth", "heavy_tails", "gc_pauses", "eval_steps")


@dataclass(frozen=True)
class Disturbance:
    """One of HIDDEN_HEALTHY, from step `onset` on, over `ranks` ranks of `gpus_per_node` per node."""

    name: str
    onset: int
    ranks: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.name not in HIDDEN_HEALTHY:
            raise ValueError(f"unknown disturbance {self.name!r}; expected one of {', '.join(HIDDEN_HEALTHY)}")

    def noise(self, step: int, rng: np.random.Generator) -> tuple[float, np.ndarray | None]:
        """(scale of every rank's noise sigma, standard noise to use instead of a normal one or None)."""
        if self.name == "noise_growth" and step >= self.onset:
            return 2.5, None
        if self.name == "heavy_tails":
            return 1.0, rng.standard_t(3, self.ranks) / np.sqrt(3.0)     # t(3) has variance 3
        return 1.0, None

    def apply(self, step: int, times: np.ndarray, rng: np.random.Generator) -> None:
        """Change this step's compute `times` (in place) as the disturbance does."""
        n, name, on = self.ranks, self.name, step >= self.onset
        if name == "transient" and self.onset <= step < self.onset + 50:
            node = (n // 2) // self.gpus_per_node * self.gpus_per_node
            times[node:node + self.gpus_per_node] *= 1.2
        elif name in ("rack", "switch") and on:
            size = min(256 if name == "rack" else 128, n // 4)
            start = (n // 3) // self.gpus_per_node * self.gpus_per_node
            times[start:start + size] *= 1.2 if name == "rack" else 1.15
        elif name == "quarter" and on:
            times[: n // 4] *= 1.2
        elif name == "gc_pauses":
            paused = np.flatnonzero(rng.random(n) < 0.02)
            times[paused] *= 1 + rng.uniform(0.3, 1.0, paused.size)
        elif name == "eval_steps" and step % 50 == 0:
            times *= 3.0 * np.exp(0.05 * rng.standard_normal(n))
