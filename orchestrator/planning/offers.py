"""How tfsn names an offer to a person: one wording for events, `tfsn plan` and the live view."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from providers.base import Offer

if TYPE_CHECKING:   # the planner pulls in the optimizer's predictor: the CLI starts without it
    from orchestrator.planning.planner import PlannedOffer


def offer_text(offer: Offer | Mapping[str, Any], spot: bool = False) -> str:
    """`aws/us-east-1a p4d.24xlarge (8x A100) spot`; parts that repeat the provider's name are left out
    (a local node is just `local`)."""
    o = offer if isinstance(offer, Offer) else Offer(**offer)
    where = o.zone or o.region
    what = o.instance_type + (f" ({o.accelerator_count}x {o.accelerator})" if o.accelerator else "")
    parts = [o.provider + ("" if where == o.provider else f"/{where}")]
    parts += [what] if what != o.provider else []
    return " ".join(parts + (["spot"] if spot else []))


def candidate_text(candidate: PlannedOffer) -> str:
    """An offer with what the plan predicts of it: nodes, price, hours and the cost of the run."""
    return (f"{offer_text(candidate.offer, candidate.spot)} x{candidate.nodes} node(s): "
            f"${candidate.price_per_hour:,.2f}/node-h, {candidate.hours:,.2f} h, ${candidate.cost:,.2f} for the run")
