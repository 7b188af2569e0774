"""The policy's hysteresis, cooldown, cap and exclusion; the health config and its errors."""
from __future__ import annotations

import pytest

from health.config import HealthConfig
from health.findings import Action, Finding, FindingKind, Severity
from health.policy import Policy

CONFIG = HealthConfig.load()


def finding(node: str = "n1", kind: FindingKind = FindingKind.STRAGGLER, severity: Severity = Severity.WARNING,
            ranks: tuple[int, ...] = (9,), step: int | None = 100) -> Finding:
    return Finding(kind, severity, node, None, ranks, "evidence", 0.0, step)


def actions(policy: Policy, findings: list[Finding], now: float) -> list[tuple[Action, str]]:
    return [(d.action, d.node) for d in policy.decide(findings, now)]


def test_a_critical_finding_replaces_its_node_at_once_and_only_once():
    policy = Policy(CONFIG)
    crit = finding(kind=FindingKind.XID, severity=Severity.CRITICAL, ranks=())
    (decision,) = policy.decide([crit], 0.0)
    assert (decision.action, decision.node, decision.finding) == (Action.REPLACE_NODE, "n1", crit)
    assert "critical" in decision.reason
    assert policy.is_excluded("n1") and not policy.is_excluded("n2")
    assert actions(policy, [crit], 1.0) == []                # latched until forget
    policy.forget("n1")
    assert actions(policy, [crit], 2.0) == [(Action.REPLACE_NODE, "n1")]


def test_a_warning_checkpoints_first_and_replaces_only_if_it_persists():
    policy = Policy(CONFIG)
    assert actions(policy, [finding()], 0.0) == [(Action.CHECKPOINT, "n1")]
    assert actions(policy, [], 5.0) == []                    # a blip: the streak starts over
    assert actions(policy, [finding()], 10.0) == [(Action.CHECKPOINT, "n1")]
    for i in range(CONFIG.replace_after_checks - 2):
        assert actions(policy, [finding()], 11.0 + i) == []
    assert actions(policy, [finding()], 20.0) == [(Action.REPLACE_NODE, "n1")]


def test_info_findings_only_warn_once_per_episode():
    policy = Policy(CONFIG)
    info = finding(kind=FindingKind.THROTTLE, severity=Severity.INFO, ranks=())
    (decision,) = policy.decide([info], 0.0)
    assert decision.action == Action.WARN and "info" in decision.reason
    for t in range(1, 10):
        assert actions(policy, [info], float(t)) == []
    assert actions(policy, [], 10.0) == []
    assert actions(policy, [info], 11.0) == [(Action.WARN, "n1")]   # a new episode


def test_a_finding_for_the_whole_job_fails_the_attempt():
    policy = Policy(CONFIG)
    deadlock = finding(node="", kind=FindingKind.HANG, severity=Severity.CRITICAL, ranks=(0, 1, 2))
    assert actions(policy, [deadlock], 0.0) == [(Action.FAIL, "")]
    assert actions(policy, [deadlock], 1.0) == []


def test_replaced_ranks_cool_down_before_they_are_blamed_again():
    policy = Policy(CONFIG)
    policy.decide([finding()], 0.0)
    assert actions(policy, [finding()], 1.0) == [(Action.REPLACE_NODE, "n1")]
    policy.forget("n1")
    new = finding(node="n1-new", ranks=(9,), step=150)
    (decision,) = policy.decide([new], 60.0)                  # rank 9 on its new node, warming up
    assert decision.action == Action.WARN and "cooldown" in decision.reason
    assert actions(policy, [new], 61.0) == []
    crit = finding(node="n1-new", kind=FindingKind.XID, severity=Severity.CRITICAL, ranks=(9,), step=151)
    assert actions(policy, [crit], 62.0) == [(Action.REPLACE_NODE, "n1-new")]   # hardware evidence: no cooldown
    later = finding(node="n2", ranks=(9,), step=151 + CONFIG.cooldown_steps)     # cooled down in steps ...
    assert actions(policy, [later], 62 + CONFIG.cooldown_s - 1)[0][0] == Action.WARN   # ... but not in seconds
    # It held through the cooldown, so once that ends it has persisted long enough.
    assert actions(policy, [later], 62 + CONFIG.cooldown_s + 1) == [(Action.REPLACE_NODE, "n2")]


def test_replacements_are_capped_per_window_and_the_decision_says_so():
    policy = Policy(CONFIG)
    crit = [finding(node=f"n{i}", kind=FindingKind.XID, severity=Severity.CRITICAL, ranks=())
            for i in range(CONFIG.max_replacements + 1)]
    done = [policy.decide([f], float(i)) for i, f in enumerate(crit)]
    assert [d[0].action for d in done] == [Action.REPLACE_NODE] * CONFIG.max_replacements + [Action.WARN]
    assert "max_replacements" in done[-1][0].reason and not policy.is_excluded(crit[-1].node)
    # Once the window has passed, replacing is allowed again.
    assert actions(policy, [crit[-1]], CONFIG.replacement_window_s + 10) == [(Action.REPLACE_NODE, crit[-1].node)]


def test_cooldowns_caps_and_exclusions_survive_a_restart_through_their_saved_state():
    import json

    policy = Policy(CONFIG)
    crit = [finding(node=f"n{i}", kind=FindingKind.XID, severity=Severity.CRITICAL, ranks=(i,))
            for i in range(CONFIG.max_replacements)]
    for i, f in enumerate(crit):
        assert actions(policy, [f], float(i)) == [(Action.REPLACE_NODE, f.node)]
    saved = json.loads(json.dumps(policy.state()))     # what the controller keeps in its store

    again = Policy(CONFIG)                               # a restarted controller
    again.restore(saved)
    assert again.is_excluded("n0") and not again.is_excluded("m0")
    new = finding(node="n0-new", ranks=(0,), step=150)
    (decision,) = again.decide([new], 30.0)
    assert decision.action == Action.WARN and "cooldown" in decision.reason
    one_more = finding(node="m", kind=FindingKind.XID, severity=Severity.CRITICAL, ranks=())
    (decision,) = again.decide([one_more], 40.0)
    assert decision.action == Action.WARN and "max_replacements" in decision.reason
    assert Policy(CONFIG).decide([one_more], 40.0)[0].action == Action.REPLACE_NODE, "without the state it would"


def test_configured_actions_apply_per_kind():
    config = HealthConfig.load({"actions": {"straggler": "warn", "ecc": "ignore", "hang": "checkpoint"}})
    policy = Policy(config)
    got = actions(policy, [finding(node="a"), finding(node="b", kind=FindingKind.ECC, ranks=()),
                           finding(node="c", kind=FindingKind.HANG, severity=Severity.CRITICAL)], 0.0)
    assert got == [(Action.WARN, "a"), (Action.CHECKPOINT, "c")]


def test_exclusion_by_host_name():
    policy = Policy(CONFIG)
    policy.exclude("ip-10-0-0-7")
    assert policy.is_excluded("ip-10-0-0-7") and not policy.is_excluded("ip-10-0-0-8")


# ---- config ---------------------------------------------------------------------------------------

def test_shipped_defaults_load_and_every_kind_has_an_action():
    assert CONFIG.straggler_window == 8 and CONFIG.heartbeat_timeout_s == 30.0
    assert set(CONFIG.actions) == set(FindingKind)
    with pytest.raises(TypeError):
        CONFIG.actions[FindingKind.XID] = Action.WARN       # frozen


def test_overrides_are_applied_and_typed():
    config = HealthConfig.load({"thresholds": {"straggler_window": 12, "hang_min_s": 300}, "actions": {"xid": "warn"}})
    assert config.straggler_window == 12 and isinstance(config.straggler_window, int)
    assert config.hang_min_s == 300.0 and config.actions[FindingKind.XID] == Action.WARN
    assert config.actions[FindingKind.HANG] == Action.REPLACE_NODE


@pytest.mark.parametrize("overrides, message", [
    ({"treshold": {}}, "health: unknown key 'treshold'; did you mean 'thresholds'?"),
    ({"thresholds": {"straggler_windw": 4}}, "unknown threshold 'straggler_windw'; did you mean 'straggler_window'?"),
    ({"thresholds": {"straggler_window": 2.5}}, "health.thresholds.straggler_window: expected a whole number, got 2.5"),
    ({"thresholds": {"hang_min_s": "1m"}}, "health.thresholds.hang_min_s: expected a number, got '1m'"),
    ({"thresholds": {"hang_min_s": True}}, "expected a number, got True"),
    ({"thresholds": {"cooldown_s": -1}}, "health.thresholds.cooldown_s: must be greater than 0, got -1"),
    ({"thresholds": {"throttle_clock_ratio": 1.5}}, "throttle_clock_ratio: must be between 0 and 1, got 1.5"),
    ({"actions": {"stragler": "warn"}}, "unknown finding kind 'stragler'; did you mean 'straggler'?"),
    ({"actions": {"xid": "replace"}}, "health.actions.xid: unknown action 'replace'; did you mean 'replace_node'?"),
    ({"thresholds": [1, 2]}, "health.thresholds: expected a mapping"),
])
def test_bad_overrides_are_one_line_errors(overrides, message):
    with pytest.raises(ValueError) as err:
        HealthConfig.load(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "To fix: " in str(err.value) or "did you mean" in str(err.value) or "mapping" in str(err.value)


# ---- rule 4b: replace a slow node only when it pays (issue 18, deliverable 2) ---------------------------

def slow(node: str = "n1", slowdown: float = 0.2, step: int = 100) -> Finding:
    return Finding(FindingKind.STRAGGLER, Severity.WARNING, node, None, (9,), "evidence", 0.0, step, slowdown=slowdown)


def test_a_slowdown_is_replaced_once_it_has_cost_what_a_replacement_costs():
    from health.policy import Costs
    policy, costs = Policy(CONFIG), Costs(step_s=5.0, remaining_steps=100_000, restart_s=60.0, save_s=0.5)
    (first,) = policy.decide([slow()], 0.0, costs)
    assert first.action == Action.WARN and "60s restart (measured) + 0s save" in first.reason
    # 20% slower: the job loses 1/6 of its time, so 60.5 s of replacement cost is reached after 363 s
    for t in range(5, 360, 5):
        assert [d.action for d in policy.decide([slow()], float(t), costs)] == [], t
    (replace,) = policy.decide([slow()], 365.0, costs)
    assert (replace.action, replace.node) == (Action.REPLACE_NODE, "n1") and policy.is_excluded("n1")


def test_a_transient_shorter_than_a_replacement_is_only_warned_about():
    from health.policy import Costs
    policy, costs = Policy(CONFIG), Costs(step_s=5.0, remaining_steps=100_000)   # default costs: 120 + 2 s
    for t in range(0, 250, 5):                    # 20% slower for 50 steps: ~42 s lost
        assert all(d.action == Action.WARN for d in policy.decide([slow()], float(t), costs))
    assert policy.decide([], 250.0, costs) == []
    assert not policy.is_excluded("n1")
    later = [d for t in range(255, 700, 5) for d in policy.decide([slow()], float(t), costs)]
    assert [d.action for d in later] == [Action.WARN], "a new episode starts from nothing"


def test_a_persistent_slowdown_that_blinks_out_for_a_check_is_still_replaced():
    # The straggler test blames a rank only while the median of its last 8 steps is >= 5% slow: a rank 10%
    # slower under 5% noise dips under that for a check every few minutes. Measured through the Monitor, such
    # a rank was never replaced in 20,000 steps, each dip starting the rent-or-buy count from nothing.
    from health.policy import Costs
    policy, costs = Policy(CONFIG), Costs(step_s=5.0, remaining_steps=100_000, restart_s=60.0, save_s=0.5)
    decisions = [d for t in range(0, 2000, 5)
                 for d in policy.decide([] if t % 100 == 95 else [slow()], float(t), costs)]
    replaced = [d for d in decisions if d.action == Action.REPLACE_NODE]
    assert [d.node for d in replaced] == ["n1"], [d.reason for d in decisions]
    # 20% slower costs 1/6 of the time it holds; with a 5 s dip every 100 s the 60.5 s are reached by ~385 s
    assert policy.is_excluded("n1")


def test_a_slowdown_gone_longer_than_a_replacement_costs_starts_over():
    from health.policy import Costs
    policy, costs = Policy(CONFIG), Costs(step_s=5.0, remaining_steps=100_000, restart_s=60.0, save_s=0.5)
    for start in range(0, 3000, 300):             # 200 s slow (33 s lost), then 100 s healthy: 10 episodes
        for t in range(start, start + 300, 5):
            held = [slow()] if t < start + 200 else []
            assert all(d.action == Action.WARN for d in policy.decide(held, float(t), costs)), t
    assert not policy.is_excluded("n1")


def test_a_slowdown_the_rest_of_the_run_cannot_pay_for_is_never_replaced():
    from health.policy import Costs
    policy = Policy(CONFIG)
    costs = Costs(step_s=5.0, remaining_steps=60, restart_s=120.0, save_s=2.0)    # 60 steps: ~50 s at stake
    decisions = [d for t in range(0, 5000, 5) for d in policy.decide([slow()], float(t), costs)]
    assert [d.action for d in decisions] == [Action.WARN]
    assert "less than a replacement" in decisions[0].reason


def test_a_shared_slowdown_warns_and_replaces_nothing():
    shared = Finding(FindingKind.STRAGGLER, Severity.INFO, "", None, tuple(range(256)), "shared", 0.0, 100,
                     slowdown=0.2)
    policy = Policy(CONFIG)
    assert actions(policy, [shared], 0.0) == [(Action.WARN, "")]
    assert all(actions(policy, [shared], float(t)) == [] for t in range(1, 5000, 50))


def test_hardware_evidence_still_replaces_at_once():
    crit = Finding(FindingKind.THROTTLE, Severity.CRITICAL, "n1", 3, (9,), "HW_THERMAL", 0.0, 100, slowdown=0.2)
    assert actions(Policy(CONFIG), [crit], 0.0) == [(Action.REPLACE_NODE, "n1")]
