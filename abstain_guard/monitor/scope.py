"""The parts of a :class:`~abstain_guard.GuardMonitor`: one scope's three tests
(:class:`Scope`: every decision, or one group's), the :class:`Alarm` a test raises, and the
small helpers they share (timestamps, the calibration set's identity, OpenTelemetry)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee.decision import DecisionRule
from abstain_guard.monitor.drift import ConformalTestMartingale, ParticipationEProcess, RiskEProcess
from abstain_guard.monitor.log import json_default

logger = logging.getLogger("abstain_guard")

TESTS = ("exchangeability", "participation", "risk")

#: How the false-alarm levels are shared over groups (the values of ``group_delta``).
SHARING = ("per_group", "union")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def calibration_sha256(scores: ArrayLike) -> str:
    """Identity of a calibration set: sha256 of its scores as float64 bytes, in order."""
    return hashlib.sha256(np.asarray(scores, dtype=np.float64).tobytes()).hexdigest()


def json_round_trip(value: Any) -> Any:
    """``value`` as it reads back from the log (tuples become lists, numpy scalars floats)."""
    return json.loads(json.dumps(value, default=json_default))


@dataclass(frozen=True)
class Alarm:
    """A test whose e-value reached its threshold (evidence that the guarantee no longer
    holds). ``at`` counts the test's own observations (scored decisions, or feedback);
    ``group`` is the group whose test alarmed (None without per-group rules)."""

    test: str
    at: int
    time: str
    e_value: float
    threshold: float
    message: str
    group: str | None = None


def record_otel(alarm: Alarm) -> None:
    try:
        from opentelemetry import trace
    except ImportError:
        return
    attrs = {f"abstain_guard.alarm.{k}": v for k, v in asdict(alarm).items() if v is not None}
    try:
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event("drift_alarm", attributes=attrs)
            return
        tracer = trace.get_tracer("abstain_guard")
        with tracer.start_as_current_span("drift_alarm") as own:
            own.add_event("drift_alarm", attributes=attrs)
    except Exception:  # pragma: no cover - never let tracing break a decision
        logger.debug("Could not record the alarm on OpenTelemetry", exc_info=True)


class Scope:
    """The three tests of one scope: every decision (no groups), or one group's.

    Args:
        name: the group (None: all decisions, no per-group rules).
        rule: the rule its decisions are made with (τ of the participation test).
        kind: ``"pooled"`` (no groups), ``"group"`` (the group's own rule) or
            ``"fallback"`` (the pooled rule applied to the group).
        reference: the scope's calibration scores ``[n_g]``.
        rng: draws the smoothing uniforms and tie-breaking marks (shared, so that a replay
            in logged order draws the same numbers).
        jump: the Simple Jumper's switching rate.
        epsilon: ε of the risk test (None: no risk test in this scope).
    """

    def __init__(
        self,
        name: str | None,
        rule: DecisionRule,
        kind: str,
        reference: NDArray[np.float64],
        rng: np.random.Generator,
        jump: float,
        epsilon: float | None,
    ) -> None:
        self.name = name
        self.rule = rule
        self.kind = kind
        self.n_calibration = int(reference.size)
        self.exchangeability = ConformalTestMartingale(reference, jump, rng)
        # participation mode fixes the rank before the scores are seen: the urn is exact
        # (a fallback group's pooled rank is not a rank among its own scores)
        fixed = rule.mode == "participation" and kind != "fallback"
        rank = rule.guarantee.rank if fixed else None
        self.participation = ParticipationEProcess(reference, rule.threshold, rng, rank=rank)
        self.risk = RiskEProcess(float(epsilon)) if epsilon is not None else None
        self.decisions = 0
        self.answered = 0
        self.feedback = {"n": 0, "answered": 0, "errors": 0, "abstained": 0}

    def test(self, name: str) -> ConformalTestMartingale | ParticipationEProcess | RiskEProcess:
        """The test called ``name`` (one of :data:`TESTS`; the risk test must exist)."""
        if name == "exchangeability":
            return self.exchangeability
        if name == "participation":
            return self.participation
        assert self.risk is not None
        return self.risk

    def expected(self) -> float:
        """k/(n+1): the answered rate of exchangeable traffic (participation mode: inside
        the guaranteed band)."""
        return self.participation.k / (self.participation.n + 1)

    def tests(self, thresholds: Mapping[str, float], alarmed: set[str]) -> dict[str, Any]:
        """Each test's e-value, peak, count, threshold and alarm flag (risk: None without
        a risk test)."""
        part, exch, risk = self.participation, self.exchangeability, self.risk
        tests: dict[str, Any] = {
            "exchangeability": {"e_value": exch.value, "peak": exch.peak, "n": exch.seen},
            "participation": {"e_value": part.value, "peak": part.peak, "n": part.seen,
                              "predicted_next": part.predicted},
            "risk": None if risk is None else {
                "e_value": risk.value, "peak": risk.peak, "n": risk.seen,
                "risk_target": risk.epsilon},
        }  # fmt: skip
        for name, entry in tests.items():
            if entry is not None:
                entry["threshold"] = thresholds[name]
                entry["alarm"] = name in alarmed
        return tests

    def describe(self) -> dict[str, Any]:
        """JSON-ready identity for the log header: rule kind, τ, target, calibration size."""
        return {
            "rule": self.kind,
            "threshold": self.rule.threshold,
            "target": self.rule.target,
            "n": self.n_calibration,
            "risk_target": None if self.risk is None else self.risk.epsilon,
        }


def risk_epsilon(rule: DecisionRule, risk_target: float | None, own: bool = True) -> float | None:
    """ε of a scope's risk test: ``risk_target``, else the rule's risk target when the
    rule certifies one for this scope (``own``)."""
    if risk_target is not None:
        return float(risk_target)
    return float(rule.target) if rule.mode == "risk" and own else None


def group_scopes(
    ref: NDArray[np.float64],
    groups: ArrayLike,
    group_rules: Any,
    rng: np.random.Generator,
    jump: float,
    risk_target: float | None,
) -> dict[str | None, Scope]:
    """One scope per calibration group that answers (sorted by name): its own rule and
    ε, or the pooled τ (fallback, no risk test); abstain-everything groups get none."""
    g = np.asarray(groups).astype(str).reshape(-1)
    if g.shape != ref.shape:
        raise InvalidInputError(
            f"groups must name the group of each calibration score: expected shape "
            f"{ref.shape}, got {g.shape}."
        )
    scopes: dict[str | None, Scope] = {}
    for name in sorted(group_rules.rules):
        kind = group_rules.kinds[name]
        if kind == "abstain":
            continue
        mask = g == name
        if not mask.any():
            raise InvalidInputError(f"group {name!r} has a rule but no calibration score.")
        rule = group_rules.rules[name]
        own = kind == "group"
        scope_kind = "group" if own else "fallback"
        eps = risk_epsilon(rule, risk_target, own)
        scopes[name] = Scope(name, rule, scope_kind, ref[mask], rng, jump, eps)
    if not scopes:
        raise InvalidInputError("No calibration group answers anything: nothing to monitor.")
    return scopes


def scope_alarm(
    scope: Scope, test: str, value: float, threshold: float, at: int, time: str
) -> Alarm:
    """The alarm of ``scope``'s test ``test`` (its e-value ``value`` reached ``threshold``
    after ``at`` observations), with a message saying what drifted."""
    part = scope.participation
    what = {
        "exchangeability": "the live scores are not exchangeable with the calibration "
        "scores (their ranks drifted)",
        "participation": "the live answered rate left what the calibration set predicts "
        f"({part.answered}/{part.seen} answered; exchangeable traffic is answered at "
        f"about {scope.expected():.3g})",
        "risk": f"the error rate among answered questions exceeds ε = "
        f"{scope.risk.epsilon if scope.risk else None} "
        f"({scope.feedback['errors']}/{scope.feedback['answered']} wrong in feedback)",
    }[test]
    where = "" if scope.name is None else f" in group {scope.name!r}"
    return Alarm(
        test=test,
        at=int(at),
        time=time,
        e_value=float(value),
        threshold=float(threshold),
        message=f"abstain_guard drift alarm ({test}{where}, e-value {value:.3g} >= "
        f"{threshold:.3g} after {at}): {what}. The guarantee may no longer hold: find what "
        "changed, and recalibrate on recent traffic (abstain-guard recalibrate).",
        group=scope.name,
    )
