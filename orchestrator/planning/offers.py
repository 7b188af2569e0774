"""How tfsn names an offer: one wording for people (events, `tfsn plan`, the live view) and one path
for machines (`tfsn status --json`). Both read an offer or its stored record (a dict), so a record
written by another tfsn version still shows."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from providers.base import Offer

if TYPE_CHECKING:   # the planner pulls in the optimizer's predictor: the CLI starts without it
    from orchestrator.planning.planner import Plan, PlannedOffer


def offer_text(offer: Offer | Mapping[str, Any], spot: bool = False) -> str:
    """`aws/us-east-1a p4d.24xlarge (8x A100) spot`; parts that repeat the provider's name are left out
    (a local node is just `local`)."""
    o = _record(offer)
    provider, where, instance = o.get("provider", "?"), o.get("zone") or o.get("region"), o.get("instance_type", "?")
    what = instance + (f" ({o.get('accelerator_count')}x {o['accelerator']})" if o.get("accelerator") else "")
    parts = [provider + ("" if where in (None, provider) else f"/{where}")]
    parts += [what] if what != provider else []
    return " ".join(parts + (["spot"] if spot else []))


def offer_path(offer: Offer | Mapping[str, Any]) -> str:
    """`aws/us-east-1a/p4d.24xlarge`: provider, zone (or region) and instance type, repeats left out."""
    o = _record(offer)
    return "/".join(dict.fromkeys(str(v) for v in (o.get("provider"), o.get("zone") or o.get("region"),
                                                   o.get("instance_type")) if v))


def nodes_text(nodes: int, spares: int) -> str:
    """`2 node(s) + 1 spare(s)`: every node the run pays for."""
    return f"{nodes} node(s)" + (f" + {spares} spare(s)" if spares else "")


def candidate_text(candidate: PlannedOffer) -> str:
    """An offer with its market and what the plan predicts of it: nodes, price, hours, cost of the run."""
    return (f"{offer_text(candidate.offer)} ({'spot' if candidate.spot else 'on-demand'}) "
            f"x{nodes_text(candidate.nodes, candidate.spares)}: "
            f"${candidate.price_per_hour:,.2f}/node-h, {candidate.hours:,.2f} h, ${candidate.cost:,.2f} for the run")


def model_text(plan: Plan) -> str:
    """What the plan priced: the job's own step (model.entry), its declared shape, or the reference workload."""
    w, entry = plan.workload, plan.entry
    if entry is not None:
        how = f"imported, captured and searched in {entry.seconds:.1f} s" if entry.seconds else "from the cache"
        text = (f"the step of model.entry ({entry.params / 1e6:.2f}M params, {entry.example_batch} examples per "
                f"rank, {entry.dtype}; {how})")
        fell_back = any(h.seconds is None for h in entry.hardware.values())
        return text + (", the declared shape where its search failed" if fell_back and w is not None else "")
    if plan.reference_workload:
        return (f"{w.params / 1e9:g}B params, {w.batch_size} x {w.seq_len} tokens, {w.dtype}: the reference workload "
                "(GPT-3 XL: add a `model:` section to describe yours)")
    return f"{w.params / 1e9:g}B params, {w.batch_size} x {w.seq_len} tokens, {w.dtype}: the spec's model"


def host_calibration_note() -> str | None:
    """What to know of this machine's spec before trusting its step: not calibrated, or calibrated by a tfsn
    that did not yet measure a training loop's figures (the planner prices them as 0); None when current."""
    from optimizer.hardware import load_host_spec
    spec = load_host_spec()
    if spec is None:
        return "this CPU is not calibrated: priced from a generic CPU's figures. To fix: run `tfsn calibrate`"
    if not spec.parallel_wait_us:
        return ("this CPU was calibrated by an older tfsn, without a training loop's figures. "
                "To fix: run `tfsn calibrate` again")
    return None


def hardware_lines(plan: Plan, rows: list[dict]) -> list[str]:
    """Per hardware type: the predicted step of the best offer of it and where it came from (Plan.hardware);
    under this machine's, what to know of its calibration."""
    lines = ["predicted step time per hardware type:"]
    for row in rows:
        name = "this machine's CPU" if row["hardware"] == "host" else row["hardware"]
        line = f"  {name}: {row['step_seconds'] * 1e3:,.2f} ms/step, {row['source']}"
        if row["searched_device_step_s"] is not None:
            timed = "" if row["kernels_predicted_s"] is None else (
                f", timed here less a step's fixed share (its kernels predicted "
                f"{row['kernels_predicted_s'] * 1e3:,.2f} ms)")
            line += (f" ({row['graphs']} graph(s), {row['searched_device_step_s'] * 1e3:,.2f} ms forward+backward "
                     f"per replica at the example batch{timed}{', cached' if row['cached'] else ''}; "
                     f"optimizer update {row['update_s'] * 1e3:,.2f} ms)")
        else:
            line += f" ({row['why_fallback']})"
        lines.append(line)
        note = host_calibration_note() if row["hardware"] == "host" else None
        if note:
            lines.append(f"    {note}")
    return lines


def _record(offer: Offer | Mapping[str, Any]) -> Mapping[str, Any]:
    return asdict(offer) if isinstance(offer, Offer) else offer
