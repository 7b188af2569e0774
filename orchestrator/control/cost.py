"""What a job has cost so far, and what its plan said the whole run would cost.

Spent: every node is billed from the moment its provider confirmed it (`provisioned_at`) until the
provider confirmed its deletion (`released_at`), at the node-hour price of the offer it was requested
on (spot or on-demand). A node whose deletion is not confirmed yet is still billed: it counts until
now. Predicted: the planner's cost of the run on the offer the job runs on (its newest node's), which
is the price times the nodes times the predicted hours of the run. A job whose spec has no `model:` has none:
its plan ranked the offers with the planner's reference workload (a 1.3B-parameter transformer), whose hours
say nothing of the job's own.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from orchestrator.control.store import Job, Node


@dataclass(frozen=True)
class JobCost:
    node_hours: float                    # node-hours billed so far
    spent_usd: float                     # their price
    predicted_node_hours: float | None   # the plan's nodes and spares x predicted hours (None: no plan, or no model:)
    predicted_usd: float | None          # the plan's predicted cost of the whole run

    def to_dict(self) -> dict[str, Any]:
        return {key: None if value is None else round(value, 6) for key, value in asdict(self).items()}


def billed_hours(node: Node, now: float) -> float:
    """Hours between the provider's confirmation of the node and of its deletion (or now, while unconfirmed)."""
    if node.provisioned_at is None:   # never confirmed: the provider refused it, or it is being requested
        return 0.0
    end = now
    if node.released:   # a store made before released_at: its last update is when the deletion was confirmed
        end = node.released_at if node.released_at is not None else node.updated_at
    return max(0.0, end - node.provisioned_at) / 3600


def hourly_price(node: Node) -> float:
    """The node-hour price of the node's offer on its market; 0 where the offer has none (this machine)."""
    offer = node.offer or {}
    return float((offer.get("spot_price") if node.spot else offer.get("price")) or 0.0)


def _site(record: dict[str, Any]) -> tuple:
    return tuple(record.get(key) for key in ("provider", "region", "zone", "instance_type"))


def chosen_candidate(job: Job, nodes: list[Node]) -> dict[str, Any] | None:
    """The plan's candidate the job runs on: the one of the offer and market of its newest node the provider
    confirmed (else of its newest node: all were refused so far), else the plan's first."""
    placed = [n for n in nodes if n.offer is not None]
    if placed:
        newest = max(placed, key=lambda n: (n.provisioned_at is not None, n.created_at))
        for candidate in job.plan:
            if _site(candidate) == _site(newest.offer) and candidate.get("spot") == newest.spot:
                return candidate
    return job.plan[0] if job.plan else None


def job_cost(job: Job, nodes: list[Node], now: float | None = None) -> JobCost:
    """The job's cost so far and the plan's prediction (see the module docstring)."""
    now = time.time() if now is None else now
    hours = [(billed_hours(n, now), hourly_price(n)) for n in nodes]
    candidate = chosen_candidate(job, nodes) if job.spec.get("model") is not None else None
    return JobCost(
        node_hours=sum(h for h, _ in hours), spent_usd=sum(h * price for h, price in hours),
        predicted_node_hours=None if candidate is None else candidate["predicted_hours"] * (
            candidate["nodes"] + candidate.get("spares", 0)),
        predicted_usd=None if candidate is None else candidate["predicted_cost"])
