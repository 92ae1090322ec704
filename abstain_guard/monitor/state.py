"""What a :class:`~abstain_guard.GuardMonitor` reports, as pure functions of its
scopes: the alarm thresholds and the false-alarm bound they give (in numbers and in words),
each group's part of :meth:`~abstain_guard.GuardMonitor.state`, and the tests
summarised over groups."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from abstain_guard.guarantee.intervals import wilson_interval
from abstain_guard.monitor.scope import TESTS, Scope


def share(n_scopes: int, sharing: str | None) -> int:
    """How many tested scopes split each level (1: not split)."""
    return n_scopes if sharing == "union" else 1


def thresholds(false_alarm: float, feedback_false_alarm: float | None, s: int) -> dict[str, float]:
    """Each test's alarm threshold: ``2·s/a`` label-free, ``s/a_feedback`` risk, with s
    the :func:`share`."""
    fa = float(false_alarm)
    ffa = float(feedback_false_alarm or false_alarm)
    return {"exchangeability": 2.0 * s / fa, "participation": 2.0 * s / fa, "risk": s / ffa}


def expected_participation(scopes: Sequence[Scope]) -> float:
    """The answered rate of exchangeable traffic: k/(n+1) (participation mode: inside
    the guaranteed band); with groups, each group's weighted by its share of the tested
    decisions (of the calibration set before any)."""
    weights = np.array([s.decisions for s in scopes], dtype=float)
    if weights.sum() == 0:
        weights = np.array([s.n_calibration for s in scopes], dtype=float)
    rates = np.array([s.expected() for s in scopes])
    return float(np.dot(weights, rates) / weights.sum())


def false_alarm_bound(
    false_alarm: float,
    feedback_false_alarm: float | None,
    scopes: Sequence[Scope],
    *,
    grouped: bool,
    sharing: str | None,
    mode: str,
    unmonitored: int,
) -> dict[str, Any]:
    """The false-alarm bound in force, JSON-ready: per tested scope (all decisions, or
    one group), over all of them (a union bound over groups), and in words."""
    fa = float(false_alarm)
    ffa = float(feedback_false_alarm or false_alarm)
    s, g = share(len(scopes), sharing), len(scopes)
    risk_scopes = sum(scope.risk is not None for scope in scopes)
    bound = {
        "sharing": sharing,
        "groups_tested": g if grouped else None,
        "label_free_per_scope": fa / s,
        "label_free_overall": min(1.0, g * fa / s),
        "risk_per_scope": ffa / s if risk_scopes else None,
        "risk_overall": min(1.0, risk_scopes * ffa / s) if risk_scopes else None,
    }
    bound["statement"] = bound_statement(
        bound, fa, grouped=grouped, sharing=sharing, mode=mode, unmonitored=unmonitored
    )
    return bound


def bound_statement(
    bound: Mapping[str, Any],
    fa: float,
    *,
    grouped: bool,
    sharing: str | None,
    mode: str,
    unmonitored: int,
) -> str:
    """The bound of :func:`false_alarm_bound` in words."""
    risk = ""
    if bound["risk_per_scope"] is not None:
        risk = (
            f" The risk test's is at most {bound['risk_per_scope']:.3g} while the error "
            "rate among answered questions is at most its ε"
            + (" (in risk mode ε holds with probability 1−δ over calibration: add δ)."
               if mode == "risk" else ".")
        )  # fmt: skip
    if not grouped:
        return (
            f"On exchangeable traffic the chance of any label-free false alarm, ever, is at "
            f"most {fa:.3g} (Ville's inequality at 2/a for each of the two tests, a union "
            f"bound over them).{risk}"
        )
    g = bound["groups_tested"]
    untested = "" if unmonitored == 0 else (
        f" {unmonitored} decisions (unknown groups, or groups that abstain on "
        "everything) are not tested."
    )  # fmt: skip
    if sharing == "union":
        return (
            f"Each of the {g} tested groups is tested against its own rule at a/{g} = "
            f"{bound['label_free_per_scope']:.3g}, so on exchangeable traffic the chance of "
            f"any label-free false alarm in any group, ever, is at most {fa:.3g} (a union "
            f"bound over groups; group_delta='union').{risk}{untested}"
        )
    return (
        f"Each of the {g} tested groups is tested against its own rule at a = {fa:.3g}: "
        f"for each group the chance of a label-free false alarm, ever, is at most "
        f"{fa:.3g}. Over all {g} groups together only the union bound holds: at most "
        f"{bound['label_free_overall']:.3g} (G·a; group_delta='per_group'; "
        f"group_delta='union' tests each group at a/G to keep a overall). Per group:"
        f"{risk or ' no risk test.'} Over all groups the risk bound is "
        f"{bound['risk_overall'] if bound['risk_overall'] is not None else 'n/a'}."
        f"{untested}"
    )


def feedback_summary(fb: Mapping[str, int]) -> dict[str, Any]:
    """Feedback counts with the error rate among answered questions and its Wilson
    interval."""
    return {
        **fb,
        "error_rate": fb["errors"] / fb["answered"] if fb["answered"] else None,
        "error_interval": wilson_interval(fb["errors"], fb["answered"]),
    }


def _listed(interval: tuple[float, float] | None) -> list[float] | None:
    return None if interval is None else list(interval)


def scope_state(scope: Scope, thresholds: Mapping[str, float], alarmed: set[str]) -> dict[str, Any]:
    """One group's part of ``GuardMonitor.state``: its rule, counts, rates and tests."""
    return {
        "rule": scope.kind,
        "threshold": scope.rule.threshold,
        "target": scope.rule.target,
        "band": _listed(scope.rule.guarantee.participation_interval),
        "n_calibration": scope.n_calibration,
        "decisions": scope.decisions,
        "answered": scope.answered,
        "answered_rate": scope.answered / scope.decisions if scope.decisions else None,
        "answered_interval": wilson_interval(scope.answered, scope.decisions),
        "expected_participation": scope.expected(),
        "feedback": feedback_summary(dict(scope.feedback)),
        "tests": scope.tests(thresholds, alarmed),
    }


def pooled_tests(groups: Mapping[str, Any], thresholds: Mapping[str, float]) -> dict[str, Any]:
    """With groups, each test over all groups: the largest e-value and peak (every group
    has the same threshold, so it reaches it iff some group alarmed), the total count,
    and whether any group alarmed (None: no group runs the test)."""
    out: dict[str, Any] = {}
    for test in TESTS:
        entries = {g: e["tests"][test] for g, e in groups.items() if e["tests"][test]}
        if not entries:
            out[test] = None
            continue
        top = max(entries, key=lambda g: entries[g]["e_value"])
        out[test] = {
            "e_value": entries[top]["e_value"],
            "peak": max(e["peak"] for e in entries.values()),
            "n": sum(e["n"] for e in entries.values()),
            "threshold": thresholds[test],
            "alarm": any(e["alarm"] for e in entries.values()),
            "groups": len(entries),
            "max_group": top,
        }
    return out
