"""Binding a drift monitor to a guard: the guard fits an unfitted monitor on its artifact
and config, and refuses a fitted one that watches another calibration set or another rule
(its tests would check a threshold and target the guard does not use). Shared by
:class:`~abstain_guard.AbstentionGuard` and the agent middleware."""

from __future__ import annotations

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.errors import ArtifactMismatchError, InvalidInputError
from abstain_guard.guarantee.decision import DecisionRule
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.scope import calibration_sha256


def fit_monitor(monitor: GuardMonitor | None, artifact: GuardArtifact, config: GuardConfig) -> None:
    """Fit ``monitor`` on the artifact and config unless it is fitted (then it must have been
    fitted on this artifact's calibration set)."""
    if monitor is None:
        return
    if not isinstance(monitor, GuardMonitor):
        raise InvalidInputError(f"monitor must be a GuardMonitor, got {type(monitor).__name__}.")
    if not hasattr(monitor, "rule_"):
        monitor.fit_artifact(artifact, config)
    elif monitor.source_.get("calibration_sha256") != calibration_sha256(artifact.scores):
        raise ArtifactMismatchError(
            "The monitor was fitted on another artifact's calibration set; pass an unfitted "
            "GuardMonitor (the guard fits it) or fit it with fit_artifact(artifact, config)."
        )
    else:
        problems = rule_mismatches(monitor, artifact, config)
        if problems:
            raise ArtifactMismatchError(
                "The monitor was fitted for another decision rule than the guard's ("
                + "; ".join(problems)
                + "): its tests would check a threshold and target the guard does not use. "
                "Pass an unfitted GuardMonitor (the guard fits it) or fit it with "
                "fit_artifact(artifact, config) for this config."
            )


def _rule_key(rule: DecisionRule) -> tuple[str, float, float]:
    return (rule.mode, float(rule.target), float(rule.threshold))


def rule_mismatches(
    monitor: GuardMonitor, artifact: GuardArtifact, config: GuardConfig
) -> list[str]:
    """How the rule a fitted ``monitor`` tests differs from the guard's (mode, target,
    threshold; each group's with ``config.group_by``). Empty: the same."""
    problems = []
    guard_rule = artifact.decision_rule(config)
    if _rule_key(monitor.rule_) != _rule_key(guard_rule):
        problems.append(
            f"monitor (mode, target, threshold) = {_rule_key(monitor.rule_)}, "
            f"guard {_rule_key(guard_rule)}"
        )
    theirs = monitor.group_rules_
    ours = artifact.group_rules(config) if config.group_by is not None else None
    if (theirs is None) != (ours is None):
        problems.append(
            f"the monitor tests {'per-group' if theirs else 'pooled'} rules, the guard "
            f"uses {'per-group' if ours else 'pooled'} rules"
        )
    elif theirs is not None and ours is not None:
        for group in sorted(set(theirs.rules) | set(ours.rules)):
            a, b = theirs.rules.get(group), ours.rules.get(group)
            if a is None or b is None or _rule_key(a) != _rule_key(b):
                problems.append(
                    f"group {group!r}: monitor {a and _rule_key(a)}, guard {b and _rule_key(b)}"
                )
    return problems
