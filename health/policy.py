"""Policy: what to do about findings, with the hysteresis that keeps noise from replacing nodes.

Pure logic over (findings, now): no I/O, no clock of its own, so every rule is unit-tested.
Rules, in order, for each finding:
  1. a node already decided for replacement is left alone until `forget(node)`;
  2. the action is the configured one for the finding's kind; an info finding only warns;
  3. a warning whose ranks were replaced within the cooldown only warns (the new node is warming up);
  4. replace_node: critical replaces at once; a warning first checkpoints ("save now, don't
     replace") and replaces once it held for `replace_after_checks` consecutive checks; a replaced
     node is excluded from provisioning; a finding with no node to blame (a deadlock) fails the
     attempt instead;
  4b. a slowdown (a warning that says how much slower its rank is) is replaced only when it pays:
     a replacement costs a restart and a save (`Costs`: the job's measured figures, else the
     documented defaults `replace_restart_s`, `replace_save_s`). If the slowdown, kept for the rest
     of the run, would cost less than that, it is only warned about. Otherwise it is warned about
     until the time it has already cost reaches the replacement's cost (`replace_break_even` x it),
     then replaced: the rent-or-buy rule, never more than twice the best choice made in hindsight,
     so a transient shorter than a replacement's cost ends before anything is replaced. The time
     lost is summed over the checks the slowdown held; a gap shorter than a replacement's cost (the
     detector's windowed median dipping under its threshold for a check) does not start it over;
  5. more than `max_replacements` in `replacement_window_s` escalates to warn and says so: the cause
     is not one node, and replacing in a loop would only burn time;
  6. warn, checkpoint and fail are said once per episode (until the finding goes away).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from health.config import HealthConfig
from health.findings import Action, Decision, Finding, FindingKind, Severity

_ORDER = list(Action)


@dataclass(frozen=True)
class Costs:
    """What the job knows now of what a slowdown and a replacement cost (None: not known)."""

    step_s: float | None = None           # a step's wall time now (measured)
    remaining_steps: int | None = None    # steps left in the run (None: unknown, taken as long)
    restart_s: float | None = None        # the job's measured restart (None: config replace_restart_s)
    save_s: float | None = None           # the job's last save, as the training saw it (None: replace_save_s)


class Policy:
    """Turns the findings of each check into decisions; one per job, kept across its attempts."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self._streak: dict[tuple[str, FindingKind], int] = {}    # consecutive checks a finding held
        self._lost: dict[tuple[str, FindingKind], float] = {}    # seconds a slowdown has cost (rule 4b) ...
        self._held_at: dict[tuple[str, FindingKind], float] = {}  # ... and the last check it held
        self._checked_at: float | None = None
        self._costs = Costs()
        self._said: set[tuple[str, FindingKind, Action]] = set()  # once-per-episode decisions already made
        self._replacing: set[str] = set()                         # nodes decided, until forget()
        self._cooldown: dict[int, tuple[float, int | None]] = {}  # rank -> (time, step) of its replacement
        self._replaced_at: deque[float] = deque()
        self._excluded: set[str] = set()

    def decide(self, findings: Iterable[Finding], now: float, costs: Costs | None = None) -> list[Decision]:
        """Decisions for one check's findings (findings that hold now, as Monitor.check returns them)."""
        self._costs = costs or Costs()
        held: dict[tuple[str, FindingKind], Finding] = {}
        for finding in findings:                 # the most severe finding per (node, kind)
            key = (finding.node, finding.kind)
            if key not in held or _rank(finding.severity) > _rank(held[key].severity):
                held[key] = finding
        self._streak = {key: self._streak.get(key, 0) + 1 for key in held}
        self._count_losses(held, now)
        self._said = {said for said in self._said if said[:2] in held}
        decisions = []
        for key, finding in held.items():
            decision = self._decide(finding, self._streak[key], now)
            if decision is not None:
                decisions.append(decision)
        return decisions

    def forget(self, node: str) -> None:
        """The node left the job (replaced or released): it may be decided about again."""
        self._replacing.discard(node)
        self._streak = {key: n for key, n in self._streak.items() if key[0] != node}
        self._lost = {key: t for key, t in self._lost.items() if key[0] != node}
        self._held_at = {key: t for key, t in self._held_at.items() if key[0] != node}
        self._said = {said for said in self._said if said[0] != node}

    def state(self) -> dict:
        """What must outlive the controller process (JSON-safe): cooldowns, the replacement window and
        exclusions. Streaks and once-per-episode notes are rebuilt by the next checks."""
        return {"cooldown": {str(r): list(v) for r, v in self._cooldown.items()},
                "replaced_at": list(self._replaced_at), "excluded": sorted(self._excluded)}

    def restore(self, state: dict) -> None:
        """Take back what `state()` saved (a restarted controller, the same job)."""
        self._cooldown = {int(r): (float(at), None if step is None else int(step))
                          for r, (at, step) in state.get("cooldown", {}).items()}
        self._replaced_at = deque(sorted(float(t) for t in state.get("replaced_at", [])))
        self._excluded = set(state.get("excluded", []))

    def exclude(self, node_id_or_host: str) -> None:
        """Never provision this node (or host) again for the job."""
        self._excluded.add(node_id_or_host)

    def is_excluded(self, node_id_or_host: str) -> bool:
        """Asked by the provisioner before it takes a node."""
        return node_id_or_host in self._excluded

    # ---- rules ----------------------------------------------------------------------------------
    def _decide(self, finding: Finding, streak: int, now: float) -> Decision | None:
        cfg, node = self.config, finding.node
        if node in self._replacing:
            return None
        action = cfg.actions[finding.kind]
        if finding.severity == Severity.INFO and _ORDER.index(action) > _ORDER.index(Action.WARN):
            return self._once(Action.WARN, finding, f"{finding.severity.value}: {finding.kind.value} needs no "
                                                    f"action on the node (configured: {action.value})")
        if action != Action.REPLACE_NODE:
            if action == Action.IGNORE:
                return None
            return self._once(action, finding, f"configured for {finding.kind.value}")
        if not node:
            return self._once(Action.FAIL, finding, "no single node to blame: fail the attempt so that it "
                                                    "restarts from the last checkpoint")
        cooling = [r for r in finding.ranks if self._cooling(r, finding, now)]
        if cooling and finding.severity != Severity.CRITICAL:
            return self._once(Action.WARN, finding, f"rank(s) {cooling[:4]} replaced recently "
                                                    f"(cooldown {cfg.cooldown_steps} steps / {cfg.cooldown_s:.0f}s)")
        if finding.severity != Severity.CRITICAL and finding.slowdown is not None:
            wait = self._not_yet_worth_it(finding)
            if wait is not None:
                return self._once(Action.WARN, finding, wait)
        if finding.severity != Severity.CRITICAL and streak < cfg.replace_after_checks:
            return self._once(Action.CHECKPOINT, finding, f"save now; replace {node} if this holds for "
                                                          f"{cfg.replace_after_checks} checks")
        while self._replaced_at and now - self._replaced_at[0] > cfg.replacement_window_s:
            self._replaced_at.popleft()
        if len(self._replaced_at) >= cfg.max_replacements:
            return self._once(Action.WARN, finding, f"not replacing {node}: {len(self._replaced_at)} nodes replaced "
                                                    f"in the last {cfg.replacement_window_s:.0f}s (max "
                                                    f"{cfg.max_replacements}); the cause is likely not one node. "
                                                    "To fix: look for what the nodes share, or raise "
                                                    "health.thresholds.max_replacements")
        self._replacing.add(node)
        self.exclude(node)
        self._replaced_at.append(now)
        for rank in finding.ranks:
            self._cooldown[rank] = (now, finding.step)
        why = "critical" if finding.severity == Severity.CRITICAL else f"held for {streak} checks"
        return Decision(Action.REPLACE_NODE, node, finding, f"{why}: {finding.kind.value} on {node}")

    def _replacement(self) -> tuple[float, float, str]:
        """(restart, save, "measured" or "default"): what a replacement costs this job now."""
        cfg, costs = self.config, self._costs
        restart = costs.restart_s if costs.restart_s is not None else cfg.replace_restart_s
        save = costs.save_s if costs.save_s is not None else cfg.replace_save_s
        return restart, save, "measured" if costs.restart_s is not None else "default"

    def _count_losses(self, held: dict[tuple[str, FindingKind], Finding], now: float) -> None:
        """Add to each held slowdown the time it cost since the last check, if it held then too. A slowdown
        gone for longer than a replacement costs is over: the next one starts from nothing."""
        last, self._checked_at = self._checked_at, now
        for key, finding in held.items():
            if finding.slowdown is None:
                continue
            slow = max(finding.slowdown, 0.0)
            if key in self._lost and self._held_at[key] == last:
                self._lost[key] += (now - last) * slow / (1 + slow)
            self._lost.setdefault(key, 0.0)
            self._held_at[key] = now
        restart, save, _ = self._replacement()
        over = [key for key, at in self._held_at.items() if key not in held and now - at > restart + save]
        for key in over:
            del self._lost[key], self._held_at[key]

    def _not_yet_worth_it(self, finding: Finding) -> str | None:
        """Why a replacement does not pay yet for this slowdown (rule 4b), or None once it does."""
        cfg, costs, slow = self.config, self._costs, max(finding.slowdown or 0.0, 0.0)
        restart, save, where = self._replacement()
        cost = restart + save
        if costs.step_s and costs.remaining_steps is not None:
            # The whole job waits for its slowest rank: each step ahead loses slowdown / (1 + slowdown) of it.
            ahead = costs.remaining_steps * costs.step_s * slow / (1 + slow)
            if ahead < cost:
                return (f"not replacing {finding.node}: {slow:.0%} slower for the remaining {costs.remaining_steps} "
                        f"steps loses {ahead:.0f}s, less than a replacement ({restart:.0f}s restart ({where}) + "
                        f"{save:.0f}s save)")
        lost = self._lost[(finding.node, finding.kind)]
        if lost < cfg.replace_break_even * cost:
            return (f"watching {finding.node}: {slow:.0%} slower has cost {lost:.0f}s so far; replaced if it "
                    f"lasts until that reaches a replacement's {cost:.0f}s ({restart:.0f}s restart ({where}) + "
                    f"{save:.0f}s save): a transient ends before that")
        return None

    def _cooling(self, rank: int, finding: Finding, now: float) -> bool:
        """Within the cooldown of the rank's last replacement, in seconds or in steps (whichever ends last)."""
        if rank not in self._cooldown:
            return False
        at, step = self._cooldown[rank]
        in_steps = step is not None and finding.step is not None and finding.step - step < self.config.cooldown_steps
        return now - at < self.config.cooldown_s or in_steps

    def _once(self, action: Action, finding: Finding, reason: str) -> Decision | None:
        key = (finding.node, finding.kind, action)
        if key in self._said:
            return None
        self._said.add(key)
        return Decision(action, finding.node, finding, reason)


def _rank(severity: Severity) -> int:
    return list(Severity).index(severity)
