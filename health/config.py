"""Health thresholds and actions: shipped defaults (configs/health.yaml) overlaid by a job's `health:`.

The defaults live in data, not code, so an operator can read every number with the reason for it
next to it; this module only knows their names, types and what each measures, and refuses what it does not know.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from health.findings import Action, FindingKind

# The configs package shipped beside this one, by path: imported by name, a `configs` folder of the user's (first
# on sys.path as the training script's folder is) would be read in its place.
SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"

SHIPPED = "health.yaml"
SECONDS = "is in seconds"
# What each threshold measures, said where a value of another kind is written: a duration ("5 min") is seconds,
# taken by the ones in seconds only (straggler_window: 5 min was a window of 300 steps).
MEASURES = {
    **{name: SECONDS for name in ("gather_s", "hang_min_s", "heartbeat_timeout_s", "phase_timeout_min_s",
                                  "phase_timeout_max_s", "replace_restart_s", "replace_save_s", "cooldown_s",
                                  "replacement_window_s")},
    **{name: "counts steps" for name in ("straggler_window", "straggler_baseline", "straggler_warmup_steps",
                                         "straggler_learn_steps", "gather_steps", "cooldown_steps")},
    **{name: "is a fraction" for name in ("straggler_min_slowdown", "straggler_noise_floor", "throttle_clock_ratio")},
    **{name: "is a factor" for name in ("hang_step_factor", "phase_timeout_factor", "replace_break_even")},
    **{name: "counts noise sigmas" for name in ("straggler_cusum_k", "straggler_clip")},
    "straggler_false_alarm_steps": "counts rank-steps", "straggler_min_ranks": "counts ranks",
    "straggler_shared_nodes": "counts nodes", "throttle_samples": "counts samples",
    "ecc_sbe_per_hour": "counts errors per hour", "replace_after_checks": "counts checks",
    "max_replacements": "counts replacements",
}
_RATIOS = {"straggler_min_slowdown", "throttle_clock_ratio"}   # must lie strictly between 0 and 1


@dataclass(frozen=True)
class HealthConfig:
    """Every threshold of the detectors and the policy (meanings in configs/health.yaml)."""

    straggler_window: int
    straggler_baseline: int
    straggler_warmup_steps: int
    straggler_min_slowdown: float
    straggler_cusum_k: float
    straggler_false_alarm_steps: float
    straggler_clip: float
    straggler_noise_floor: float
    straggler_min_ranks: int
    straggler_learn_steps: int
    straggler_shared_nodes: int
    gather_steps: int
    gather_s: float
    throttle_clock_ratio: float
    throttle_samples: int
    ecc_sbe_per_hour: int
    hang_min_s: float
    hang_step_factor: float
    heartbeat_timeout_s: float
    phase_timeout_factor: float
    phase_timeout_min_s: float
    phase_timeout_max_s: float
    replace_after_checks: int
    replace_restart_s: float
    replace_save_s: float
    replace_break_even: float
    cooldown_steps: int
    cooldown_s: float
    max_replacements: int
    replacement_window_s: float
    actions: Mapping[FindingKind, Action]

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None) -> HealthConfig:
        """The shipped defaults with a job's `health:` mapping ({thresholds: ..., actions: ...}) on top."""
        shipped = yaml.safe_load((SHIPPED_CONFIGS / SHIPPED).read_text())
        values = _thresholds(shipped.get("thresholds") or {}, f"configs/{SHIPPED}: thresholds")
        actions = _actions(shipped.get("actions") or {}, f"configs/{SHIPPED}: actions")
        missing = ({f.name for f in dataclasses.fields(cls)} - {"actions"}) - set(values)
        if missing or set(actions) != set(FindingKind):
            absent = sorted(missing) + sorted(k.value for k in set(FindingKind) - set(actions))
            raise ValueError(f"configs/{SHIPPED} lacks {', '.join(absent)}. To fix: restore the shipped file")
        if overrides:
            if not isinstance(overrides, Mapping):
                raise ValueError(f"health: expected a mapping with 'thresholds' and 'actions', got {overrides!r}")
            for key in overrides:
                if key not in ("thresholds", "actions"):
                    raise ValueError(f"health: unknown key {key!r}{_did_you_mean(key, ['thresholds', 'actions'])}")
            values.update(_thresholds(overrides.get("thresholds") or {}, "health.thresholds"))
            actions.update(_actions(overrides.get("actions") or {}, "health.actions"))
        low, high = values["phase_timeout_min_s"], values["phase_timeout_max_s"]
        if high < low:     # the clamp would give every phase, and an attempt's first step, `high` seconds
            raise ValueError(f"health.thresholds: phase_timeout_max_s {high:g} is below phase_timeout_min_s {low:g}: "
                             f"a save, an eval or a first step longer than {high:g}s would be a hang. To fix: make "
                             "phase_timeout_max_s at least phase_timeout_min_s")
        return cls(**values, actions=MappingProxyType(actions))


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(word), choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; expected one of {', '.join(choices)}"


# The largest whole-number thresholds: the straggler test keeps window + baseline steps of every rank in
# memory, so a typo of 10^12 there must be refused, not tried (2 x 4096 steps x 4096 ranks x 8 B = 256 MiB).
MAX_RING, MAX_COUNT = 4096, 10**9
_RINGS = {"straggler_window", "straggler_baseline", "gather_steps"}   # gather_steps: steps of every rank held
_KEEP_SHIPPED = f"change it, or remove it to keep the shipped value (configs/{SHIPPED})"


def _thresholds(raw: Any, where: str) -> dict[str, int | float]:
    """Names checked against HealthConfig, values coerced to its types and range-checked."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping of name -> number, got {raw!r}")
    types = {f.name: f.type for f in dataclasses.fields(HealthConfig) if f.name != "actions"}
    out: dict[str, int | float] = {}
    for name, value in raw.items():
        if name not in types:
            raise ValueError(f"{where}: unknown threshold {name!r}{_did_you_mean(name, sorted(types))}")
        whole = types[name] == "int"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                whole and math.isfinite(value) and value != int(value)):    # inf and nan: refused by the bounds
            kind = "a whole number" if whole else "a number"
            raise ValueError(f"{where}.{name}: expected {kind}, got {value!r}. To fix: {_KEEP_SHIPPED}")
        most = MAX_RING if name in _RINGS else MAX_COUNT
        if not value > 0 or (name in _RATIOS and not value < 1) or not math.isfinite(value) or (
                whole and value > most):
            bound = ("between 0 and 1" if name in _RATIOS else "greater than 0" if not value > 0
                     else f"at most {most}" if whole else "a finite number")
            raise ValueError(f"{where}.{name}: must be {bound}, got {value!r}. To fix: {_KEEP_SHIPPED}")
        out[name] = int(value) if whole else float(value)
    return out


def _actions(raw: Any, where: str) -> dict[FindingKind, Action]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping of finding kind -> action, got {raw!r}")
    kinds, names = [k.value for k in FindingKind], [a.value for a in Action]
    out: dict[FindingKind, Action] = {}
    for kind, action in raw.items():
        if kind not in kinds:
            raise ValueError(f"{where}: unknown finding kind {kind!r}{_did_you_mean(kind, kinds)}")
        if action not in names:
            raise ValueError(f"{where}.{kind}: unknown action {action!r}{_did_you_mean(action, names)}")
        out[FindingKind(kind)] = Action(action)
    return out
