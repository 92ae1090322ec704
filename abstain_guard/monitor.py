"""`GuardMonitor`: is the deployed guard's guarantee still holding?

The guarantee holds while live questions are exchangeable with the calibration questions.
The monitor is fed every decision (the guard, the agent middleware and ``serve`` call
:meth:`GuardMonitor.observe`) and, where callers know it, whether an answer was right
(:meth:`GuardMonitor.record_feedback`). It runs three anytime-valid tests
(:mod:`abstain_guard.drift`):

* ``exchangeability`` (label-free): a conformal test martingale on the live scores' ranks
  among the calibration scores and the earlier live scores;
* ``participation`` (label-free): the live answered rate against what exchangeability
  predicts from the calibration set (a Pólya urn starting at the guaranteed band);
* ``risk`` (feedback): the error rate among answered questions against ε.

Each alarms when its e-value first reaches its threshold: ``2/false_alarm`` for each
label-free test (so on exchangeable traffic the chance of *any* label-free false alarm,
ever, is at most ``false_alarm``: Ville's inequality and a union bound) and
``1/feedback_false_alarm`` for the risk test (false alarm at most that, when the error rate
among answered questions is at most ε; a risk-mode guard's ε holds with probability
``1−δ`` over its calibration set, so at most ``δ + feedback_false_alarm`` overall).

Per-group rules (``GuardConfig(group_by=...)``): the guard decides each group with its own
threshold and target, so the monitor tests each group against its own rule: the group's
decisions against the group's calibration scores, its τ_g and its ε_g (a group whose rule
is the pooled fallback: the pooled τ against its own calibration scores, no risk test; a
group that abstains on everything, and questions of an unknown group: counted, not tested).
``group_delta="per_group"`` keeps each group's tests at ``false_alarm`` (a per-group
statement; over G groups the bound is the union bound ``G · false_alarm``),
``"union"`` gives each ``false_alarm / G`` (``false_alarm`` over all groups).
:meth:`GuardMonitor.state` states the bound in force (``false_alarm_bound``).

A restart resumes: with ``log_path``, fitting on an existing log replays its decisions and
feedback in their logged order (the log records the seed of the smoothing uniforms), so the
tests go on as one process would have and the false-alarm bound holds over the deployment,
not per process; feedback for a decision made before the restart is accepted.

What feedback can see: only the questions a caller labels. Abstained questions usually get
none, so the risk test judges answered questions only (which is what ε bounds), and it is
valid only if *which* answered questions get feedback does not depend on whether they were
right (users who report mostly wrong answers inflate it). It cannot tell whether abstaining
was needed: the correctness of withheld answers is unseen unless a caller labels them (their
feedback is stored for recalibration but not tested).

An alarm is: a WARNING log record on the ``abstain_guard`` logger, an OpenTelemetry event
``drift_alarm`` (on the current span, or a span of its own), ``on_alarm``
callbacks, the :attr:`GuardMonitor.alarms` list and the ``alarm`` flag of
:meth:`GuardMonitor.state` (``serve`` exports them in ``/metrics``). The monitor never
changes the threshold: recalibrate (``abstain-guard recalibrate``) and redeploy.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from abstain_guard.decision import DecisionRule
from abstain_guard.drift import (
    ConformalTestMartingale,
    ParticipationEProcess,
    RiskEProcess,
    wilson_interval,
)
from abstain_guard.errors import (
    DuplicateFeedbackError,
    InvalidInputError,
    MonitorLogError,
    NotFittedError,
    UnknownRunError,
)
from abstain_guard.monitor_log import (
    LOG_FORMAT,
    MonitorRecord,
    json_default,
    read_log,
    write_events,
)

__all__ = ["LOG_FORMAT", "Alarm", "GuardMonitor", "MonitorRecord", "read_log"]

logger = logging.getLogger("abstain_guard")

TESTS = ("exchangeability", "participation", "risk")

#: How the false-alarm levels are shared over groups (the values of ``group_delta``).
SHARING = ("per_group", "union")

#: The header fields a resumed log must agree on with the monitor that resumes it, named.
_RESUME_KEYS = {
    "seed": "seed",
    "rule": "rule",
    "groups": "set of group rules",
    "tests": "monitor settings (false_alarm, feedback_false_alarm, jump, risk_target, sharing)",
}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def calibration_sha256(scores: ArrayLike) -> str:
    """Identity of a calibration set: sha256 of its scores as float64 bytes, in order."""
    return hashlib.sha256(np.asarray(scores, dtype=np.float64).tobytes()).hexdigest()


def _json_round_trip(value: Any) -> Any:
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


def _record_otel(alarm: Alarm) -> None:
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


class _Scope:
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
        rank = rule.guarantee.get("rank") if fixed else None
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


class GuardMonitor:
    """Anytime-valid drift and risk monitor of one deployed guard (see the module docstring).

    Example::

        monitor = GuardMonitor(false_alarm=0.01).fit_artifact(artifact, config)
        guard = AbstentionGuard(model, artifact=artifact, config=config, monitor=monitor)
        msg = guard.invoke("Who wrote Hamlet?")
        monitor.record_feedback(msg.response_metadata["abstention"]["run_id"], correct=True)
        monitor.state()["alarm"]

    Args:
        false_alarm: a in (0, 1): bound on the probability of any label-free false alarm
            (per group, or shared over groups: see the module docstring).
        risk_target: ε of the feedback test (default: the rule's target in risk mode, each
            group's own with per-group rules; in participation mode the risk test runs only
            when this is given, then against this ε in every group).
        feedback_false_alarm: bound on the risk test's false alarm (default ``false_alarm``).
        jump: the Simple Jumper's switching rate.
        seed: seeds the smoothing and tie-breaking uniforms (None: fresh entropy). The seed in
            effect is recorded in the log; a monitor resumed from a log uses the log's.
        max_records: decisions kept for feedback (the oldest are dropped beyond it).
        log_path: a JSONL file every decision and feedback is appended to (the input of
            ``abstain-guard recalibrate``, and what a restarted monitor resumes from); None
            keeps them in memory only (a restart then starts fresh tests).
        on_alarm: called with each :class:`Alarm` as it is raised.
    """

    def __init__(
        self,
        false_alarm: float = 0.01,
        *,
        risk_target: float | None = None,
        feedback_false_alarm: float | None = None,
        jump: float = 0.01,
        seed: int | None = None,
        max_records: int = 100_000,
        log_path: str | Path | None = None,
        on_alarm: Callable[[Alarm], None] | None = None,
    ) -> None:
        self.false_alarm = false_alarm
        self.risk_target = risk_target
        self.feedback_false_alarm = feedback_false_alarm
        self.jump = jump
        self.seed = seed
        self.max_records = max_records
        self.log_path = log_path
        self.on_alarm = on_alarm

    # --- fitting -----------------------------------------------------------------------

    def _check_params(self) -> None:
        for name in ("false_alarm", "feedback_false_alarm", "risk_target"):
            value = getattr(self, name)
            if value is not None and not 0.0 < float(value) < 1.0:
                raise InvalidInputError(f"{name} must lie strictly between 0 and 1, got {value}.")
        if int(self.max_records) < 1:
            raise InvalidInputError(f"max_records must be positive, got {self.max_records}.")

    def fit(
        self,
        scores: ArrayLike,
        rule: DecisionRule,
        source: Mapping[str, Any] | None = None,
        *,
        groups: ArrayLike | None = None,
        group_rules: Any = None,
        sharing: str = "per_group",
    ) -> GuardMonitor:
        """Start monitoring a guard with calibration ``scores`` ``[n]`` and ``rule``.

        ``source`` identifies the artifact in the log (see :meth:`fit_artifact`). With
        per-group rules, ``groups`` ``[n]`` names each calibration score's group,
        ``group_rules`` is the guard's :class:`~abstain_guard.groups.GroupRules` and
        ``sharing`` (``"per_group"`` or ``"union"``, the config's ``group_delta``) how
        ``false_alarm`` is shared over the tested groups.

        Refitting starts over (no records, no alarms) — unless ``log_path`` names an existing
        log: then the monitor resumes it (its decisions and feedback replayed in logged order).

        Raises:
            InvalidInputError: bad parameters, scores, or groups.
            MonitorLogError: the existing log cannot be resumed (another artifact, rule or
                monitor setting; a snapshot from :meth:`write_log`; its draws do not replay).
        """
        self._check_params()
        ref = np.asarray(scores, dtype=float).reshape(-1)
        if ref.size == 0 or not np.all(np.isfinite(ref)):
            raise InvalidInputError("The calibration scores must be a non-empty finite array.")
        if sharing not in SHARING:
            raise InvalidInputError(f"sharing must be one of {SHARING}, got {sharing!r}.")
        if (groups is None) != (group_rules is None):
            raise InvalidInputError("Per-group monitoring needs both groups and group_rules.")
        events = self._read_events()
        logged_seed = events[0].get("seed") if events else None
        if logged_seed is not None:
            self.seed_ = int(logged_seed)
        elif self.seed is not None:
            self.seed_ = int(self.seed)
        else:
            self.seed_ = int(np.random.SeedSequence().entropy)  # type: ignore[arg-type]
        rng = np.random.default_rng(self.seed_)
        self.rule_ = rule
        self.n_calibration_ = int(ref.size)
        self.source_ = {"calibration_sha256": calibration_sha256(ref), **dict(source or {})}
        self.grouped_ = group_rules is not None
        self.sharing_ = sharing if self.grouped_ else None
        self.group_rules_ = group_rules
        self.scopes_: dict[str | None, _Scope]
        if groups is None or group_rules is None:
            self.scopes_ = {
                None: _Scope(None, rule, "pooled", ref, rng, self.jump, self._eps(rule))
            }
        else:
            self.scopes_ = self._group_scopes(ref, groups, group_rules, rng)
        self.thresholds_ = self._thresholds()
        self.records_: OrderedDict[str, MonitorRecord] = OrderedDict()
        self.alarms_: list[Alarm] = []
        self.decisions_ = 0
        self.unscored_ = 0
        self.unmonitored_ = 0
        self.answered_ = 0
        self.feedback_ = {"n": 0, "answered": 0, "errors": 0, "abstained": 0}
        self.resumed_: dict[str, int] | None = None
        self._alarm_times: dict[tuple[str, str | None], str] = {}
        self._lock = threading.Lock()
        if events:
            self.resumed_ = self._replay(events)
        if self.log_path is not None:
            extra = {} if self.resumed_ is None else {"resumed": self.resumed_}
            self._append({"event": "start", **self._header(), **extra})
        return self

    def _eps(self, rule: DecisionRule, own: bool = True) -> float | None:
        """ε of a scope's risk test: ``risk_target``, else the rule's risk target when the
        rule certifies one for this scope (``own``)."""
        if self.risk_target is not None:
            return float(self.risk_target)
        return float(rule.target) if rule.mode == "risk" and own else None

    def _group_scopes(
        self,
        ref: NDArray[np.float64],
        groups: ArrayLike,
        group_rules: Any,
        rng: np.random.Generator,
    ) -> dict[str | None, _Scope]:
        """One scope per calibration group that answers (sorted by name): its own rule and
        ε, or the pooled τ (fallback, no risk test); abstain-everything groups get none."""
        g = np.asarray(groups).astype(str).reshape(-1)
        if g.shape != ref.shape:
            raise InvalidInputError(
                f"groups must name the group of each calibration score: expected shape "
                f"{ref.shape}, got {g.shape}."
            )
        scopes: dict[str | None, _Scope] = {}
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
            eps = self._eps(rule, own)
            scopes[name] = _Scope(name, rule, scope_kind, ref[mask], rng, self.jump, eps)
        if not scopes:
            raise InvalidInputError("No calibration group answers anything: nothing to monitor.")
        return scopes

    def _share(self) -> int:
        """How many tested scopes split each level (1: not split)."""
        return len(self.scopes_) if self.sharing_ == "union" else 1

    def _thresholds(self) -> dict[str, float]:
        """Each test's alarm threshold: ``2·s/a`` label-free, ``s/a_feedback`` risk, with s
        the :meth:`_share`."""
        fa = float(self.false_alarm)
        ffa = float(self.feedback_false_alarm or self.false_alarm)
        s = self._share()
        return {"exchangeability": 2.0 * s / fa, "participation": 2.0 * s / fa, "risk": s / ffa}

    def fit_artifact(self, artifact: Any, config: Any = None) -> GuardMonitor:
        """:meth:`fit` on a :class:`~abstain_guard.artifact.GuardArtifact` and the rule of
        ``config`` (a :class:`~abstain_guard.config.GuardConfig`; default participation
        0.8). With ``config.group_by``, every group is tested against its own rule
        (``config.group_delta`` shares ``false_alarm``)."""
        source = {
            "artifact": None if artifact.path is None else str(artifact.path),
            "created": artifact.created,
            "scorer": artifact.scorer.kind,
            "model_fingerprint": artifact.model_fingerprint,
            "n_calibration": artifact.n,
        }
        rule = artifact.decision_rule(config)
        if config is None or getattr(config, "group_by", None) is None:
            return self.fit(artifact.scores, rule, source)
        return self.fit(
            artifact.scores,
            rule,
            source,
            groups=artifact.groups,
            group_rules=artifact.group_rules(config),
            sharing=config.group_delta,
        )

    def _fitted(self) -> None:
        if not hasattr(self, "rule_"):
            raise NotFittedError(
                "This GuardMonitor is not fitted: call fit_artifact(artifact, config) (or pass "
                "it to AbstentionGuard / serve, which fit it) before observing decisions."
            )

    @property
    def alarms(self) -> list[Alarm]:
        """The alarms raised so far, in order (each test of each group alarms once)."""
        self._fitted()
        return list(self.alarms_)

    # --- observing -----------------------------------------------------------------------

    def observe(
        self, decision: Mapping[str, Any], run_id: str | None = None, group: str | None = None
    ) -> str:
        """Record one decision (the guard's ``abstention`` dict) and update the label-free
        tests; return its run id (``run_id``, or a new one), the key for feedback.

        ``group`` (default: the decision's ``group``, if any) is kept in the record and,
        with per-group rules, picks the group whose tests the decision enters. A decision
        without a score (scoring failed, input too long) is counted but not tested: it says
        nothing about the score distribution.

        Raises:
            InvalidInputError: ``run_id`` was already recorded.
        """
        self._fitted()
        rid = str(run_id) if run_id is not None else uuid.uuid4().hex
        score = decision.get("score")
        score = float(score) if score is not None and math.isfinite(float(score)) else None
        with self._lock:
            if rid in self.records_:
                raise InvalidInputError(f"Run id {rid!r} was already recorded; ids must be unique.")
            record = MonitorRecord(
                index=self.decisions_ + 1,
                run_id=rid,
                time=_now(),
                score=score,
                abstained=bool(decision.get("abstained")),
                threshold=float(decision.get("threshold", self.rule_.threshold)),
                group=group if group is not None else decision.get("group"),
            )
            new = self._apply_decision(record)
            self._keep(record)
            if self.log_path is not None:
                self._append({"event": "decision", **asdict(record)})
        self._raise(new)
        return rid

    def _scope_of(self, group: str | None) -> _Scope | None:
        """The scope a decision of ``group`` is tested in (None: not tested)."""
        if not self.grouped_:
            return self.scopes_[None]
        return None if group is None else self.scopes_.get(group)

    def _apply_decision(self, record: MonitorRecord) -> list[Alarm]:
        """Count one decision and, when scored and in a tested scope, update its scope's
        label-free tests (sets ``record.p_value``); the alarms it raises. Lock held."""
        self.decisions_ += 1
        self.answered_ += not record.abstained
        scope = self._scope_of(record.group)
        if scope is None:
            self.unmonitored_ += 1
        else:
            scope.decisions += 1
            scope.answered += not record.abstained
        if record.score is None:
            self.unscored_ += 1
            return []
        if scope is None:
            return []
        record.p_value = scope.exchangeability.update(record.score)
        scope.participation.update(record.score)
        return self._check(scope, "exchangeability") + self._check(scope, "participation")

    def _keep(self, record: MonitorRecord) -> None:
        """Keep ``record`` for feedback, dropping the oldest beyond ``max_records``."""
        self.records_[record.run_id] = record
        while len(self.records_) > int(self.max_records):
            self.records_.popitem(last=False)

    def record_feedback(self, run_id: str, correct: bool) -> MonitorRecord:
        """Label one recorded decision: ``correct`` is whether its answer (the withheld one,
        for an abstention) was right. Feedback on an answered decision enters its scope's
        risk test; on an abstained one it is kept for recalibration only.

        Raises:
            UnknownRunError: no recorded decision has this run id (or it was dropped).
            DuplicateFeedbackError: this decision already has feedback.
            InvalidInputError: ``correct`` is not a boolean.
        """
        self._fitted()
        if not isinstance(correct, (bool, np.bool_)):
            raise InvalidInputError(f"correct must be true or false, got {correct!r}.")
        with self._lock:
            record = self.records_.get(str(run_id))
            if record is None:
                raise UnknownRunError(
                    f"No decision with run id {run_id!r} was recorded by this monitor (or it is "
                    f"older than the last {self.max_records} decisions). Send feedback for the "
                    "id the guard returned (the completion id, or the decision's run_id)."
                )
            if record.correct is not None:
                raise DuplicateFeedbackError(
                    f"The decision {run_id!r} already has feedback (correct={record.correct}); "
                    "each decision is labeled once."
                )
            new = self._apply_feedback(record, bool(correct), _now())
            if self.log_path is not None:
                self._append(
                    {"event": "feedback", "run_id": record.run_id, "correct": record.correct,
                     "time": record.feedback_time}
                )  # fmt: skip
        self._raise(new)
        return record

    def _apply_feedback(
        self, record: MonitorRecord, correct: bool, time: str | None
    ) -> list[Alarm]:
        """Label ``record`` and update its scope's risk test (answered, scored decisions
        only); the alarms it raises. Lock held."""
        record.correct = correct
        record.feedback_time = time
        scope = self._scope_of(record.group)
        counts = [self.feedback_] if scope is None else [self.feedback_, scope.feedback]
        for fb in counts:
            fb["n"] += 1
            fb["abstained" if record.abstained else "answered"] += 1
            fb["errors"] += not record.abstained and not correct
        if record.abstained or scope is None or scope.risk is None or record.score is None:
            return []
        scope.risk.update(not correct)
        return self._check(scope, "risk")

    # --- alarms --------------------------------------------------------------------------

    def _alarmed(self, scope: _Scope) -> set[str]:
        return {a.test for a in self.alarms_ if a.group == scope.name}

    def _check(self, scope: _Scope, test: str) -> list[Alarm]:
        threshold = self.thresholds_[test]
        found = scope.test(test)
        value = found.value
        if value < threshold or test in self._alarmed(scope):
            return []
        at = found.seen
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
        alarm = Alarm(
            test=test,
            at=int(at),
            time=self._alarm_times.get((test, scope.name)) or _now(),
            e_value=float(value),
            threshold=float(threshold),
            message=f"abstain_guard drift alarm ({test}{where}, e-value {value:.3g} >= "
            f"{threshold:.3g} after {at}): {what}. The guarantee may no longer hold: find what "
            "changed, and recalibrate on recent traffic (abstain-guard recalibrate).",
            group=scope.name,
        )
        self.alarms_.append(alarm)
        return [alarm]

    def _expected(self) -> float:
        """The answered rate of exchangeable traffic: k/(n+1) (participation mode: inside
        the guaranteed band); with groups, each group's weighted by its share of the tested
        decisions (of the calibration set before any)."""
        scopes = list(self.scopes_.values())
        weights = np.array([s.decisions for s in scopes], dtype=float)
        if weights.sum() == 0:
            weights = np.array([s.n_calibration for s in scopes], dtype=float)
        rates = np.array([s.expected() for s in scopes])
        return float(np.dot(weights, rates) / weights.sum())

    def _raise(self, alarms: list[Alarm]) -> None:
        for alarm in alarms:
            logger.warning(alarm.message, extra={"abstain_guard_alarm": asdict(alarm)})
            _record_otel(alarm)
            if self.log_path is not None:
                with self._lock:
                    self._append({"event": "alarm", **asdict(alarm)})
            if self.on_alarm is not None:
                self.on_alarm(alarm)

    # --- reading -------------------------------------------------------------------------

    def false_alarm_bound(self) -> dict[str, Any]:
        """The false-alarm bound in force, JSON-ready: per tested scope (all decisions, or
        one group), over all of them (a union bound over groups), and in words."""
        self._fitted()
        fa = float(self.false_alarm)
        ffa = float(self.feedback_false_alarm or self.false_alarm)
        s, g = self._share(), len(self.scopes_)
        risk_scopes = sum(scope.risk is not None for scope in self.scopes_.values())
        bound = {
            "sharing": self.sharing_,
            "groups_tested": g if self.grouped_ else None,
            "label_free_per_scope": fa / s,
            "label_free_overall": min(1.0, g * fa / s),
            "risk_per_scope": ffa / s if risk_scopes else None,
            "risk_overall": min(1.0, risk_scopes * ffa / s) if risk_scopes else None,
        }
        bound["statement"] = self._bound_statement(bound, fa, ffa)
        return bound

    def _bound_statement(self, bound: Mapping[str, Any], fa: float, ffa: float) -> str:
        """The bound of :meth:`false_alarm_bound` in words."""
        risk = ""
        if bound["risk_per_scope"] is not None:
            risk = (
                f" The risk test's is at most {bound['risk_per_scope']:.3g} while the error "
                "rate among answered questions is at most its ε"
                + (" (in risk mode ε holds with probability 1−δ over calibration: add δ)."
                   if self.rule_.mode == "risk" else ".")
            )  # fmt: skip
        if not self.grouped_:
            return (
                f"On exchangeable traffic the chance of any label-free false alarm, ever, is at "
                f"most {fa:.3g} (Ville's inequality at 2/a for each of the two tests, a union "
                f"bound over them).{risk}"
            )
        g = bound["groups_tested"]
        untested = "" if self.unmonitored_ == 0 else (
            f" {self.unmonitored_} decisions (unknown groups, or groups that abstain on "
            "everything) are not tested."
        )  # fmt: skip
        if self.sharing_ == "union":
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

    def _scope_state(self, scope: _Scope) -> dict[str, Any]:
        """One group's part of :meth:`state`: its rule, counts, rates and tests."""
        fb = dict(scope.feedback)
        return {
            "rule": scope.kind,
            "threshold": scope.rule.threshold,
            "target": scope.rule.target,
            "band": scope.rule.guarantee.get("participation_interval"),
            "n_calibration": scope.n_calibration,
            "decisions": scope.decisions,
            "answered": scope.answered,
            "answered_rate": scope.answered / scope.decisions if scope.decisions else None,
            "answered_interval": wilson_interval(scope.answered, scope.decisions),
            "expected_participation": scope.expected(),
            "feedback": {
                **fb,
                "error_rate": fb["errors"] / fb["answered"] if fb["answered"] else None,
                "error_interval": wilson_interval(fb["errors"], fb["answered"]),
            },
            "tests": scope.tests(self.thresholds_, self._alarmed(scope)),
        }

    def _pooled_tests(self, groups: Mapping[str, Any]) -> dict[str, Any]:
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
                "threshold": self.thresholds_[test],
                "alarm": any(e["alarm"] for e in entries.values()),
                "groups": len(entries),
                "max_group": top,
            }
        return out

    def state(self) -> dict[str, Any]:
        """Everything the monitor knows, JSON-ready: counts, rates with Wilson intervals,
        the guaranteed band, each test's e-value, its peak and threshold, the alarms, and
        the false-alarm bound in force. With per-group rules, ``groups`` holds each tested
        group's rule, rates and tests, and ``tests`` summarises them (largest e-value)."""
        self._fitted()
        with self._lock:
            fb = dict(self.feedback_)
            groups: dict[str, Any] | None = None
            if self.grouped_:
                groups = {str(s.name): self._scope_state(s) for s in self.scopes_.values()}
                tests = self._pooled_tests(groups)
            else:
                scope = self.scopes_[None]
                tests = scope.tests(self.thresholds_, self._alarmed(scope))
            scored = self.decisions_ - self.unscored_
            band = None if self.grouped_ else self.rule_.guarantee.get("participation_interval")
            return {
                "decisions": self.decisions_,
                "scored": scored,
                "unscored": self.unscored_,
                "unmonitored": self.unmonitored_,
                "answered": self.answered_,
                "answered_rate": self.answered_ / self.decisions_ if self.decisions_ else None,
                "answered_interval": wilson_interval(self.answered_, self.decisions_),
                "mode": self.rule_.mode,
                "threshold": self.rule_.threshold,
                "band": band,
                "expected_participation": self._expected(),
                "feedback": {
                    **fb,
                    "error_rate": fb["errors"] / fb["answered"] if fb["answered"] else None,
                    "error_interval": wilson_interval(fb["errors"], fb["answered"]),
                },
                "tests": tests,
                "groups": groups,
                "false_alarm": self.false_alarm,
                "false_alarm_bound": self.false_alarm_bound(),
                "alarm": bool(self.alarms_),
                "alarms": [asdict(a) for a in self.alarms_],
                "resumed": None if self.resumed_ is None else dict(self.resumed_),
                "source": dict(self.source_),
            }

    def records(self) -> list[MonitorRecord]:
        """The records kept (the last ``max_records`` decisions), oldest first."""
        self._fitted()
        with self._lock:
            return list(self.records_.values())

    # --- the log -------------------------------------------------------------------------

    def _header(self, snapshot: bool = False) -> dict[str, Any]:
        """The log's ``start`` header: the artifact, the rule (and each tested group's), the
        tests' settings and the seed (what a resume must agree on). ``snapshot``: written
        by :meth:`write_log` (the kept records, not a history to resume)."""
        rule = self.rule_
        header: dict[str, Any] = {
            "format": LOG_FORMAT,
            "version": 2,
            "time": _now(),
            "seed": self.seed_,
            "source": dict(self.source_),
            "rule": {"mode": rule.mode, "target": rule.target, "threshold": rule.threshold},
            "groups": None if not self.grouped_ else {
                str(s.name): s.describe() for s in self.scopes_.values()},
            "tests": {"false_alarm": self.false_alarm,
                      "feedback_false_alarm": self.feedback_false_alarm, "jump": self.jump,
                      "risk_target": self.risk_target, "sharing": self.sharing_,
                      "thresholds": dict(self.thresholds_)},
        }  # fmt: skip
        if snapshot:
            header["snapshot"] = True
        return header

    def _append(self, event: Mapping[str, Any]) -> None:
        assert self.log_path is not None
        with open(self.log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(event, default=json_default) + "\n")

    def write_log(self, path: str | Path) -> Path:
        """Write the kept records (decisions with their feedback) as a monitor log (JSONL:
        a ``start`` header, then ``decision`` and ``feedback`` events) — a snapshot for
        ``abstain-guard recalibrate``, not a log to resume from (``log_path`` is that)."""
        self._fitted()
        target = Path(path)
        with open(target, "w", encoding="utf-8") as fh:
            write_events(
                fh, self._header(snapshot=True), self.records(), [asdict(a) for a in self.alarms]
            )
        return target

    # --- resuming ------------------------------------------------------------------------

    def _read_events(self) -> list[dict[str, Any]]:
        """The events of the existing log at ``log_path`` in file order (``[]``: none).

        Raises:
            MonitorLogError: a line is not a JSON event, or the log does not open with the
                start header of a monitor log.
        """
        if self.log_path is None:
            return []
        path = Path(self.log_path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        except (OSError, UnicodeDecodeError) as exc:
            raise MonitorLogError(f"Cannot read the monitor log {path}: {exc}") from exc
        events: list[dict[str, Any]] = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                event["line"] = number
                if "event" not in event:
                    raise KeyError("event")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise MonitorLogError(
                    f"{path}:{number}: not a monitor log event ({exc}); the monitor resumes "
                    "from this log: fix or remove the line, or log to a new file."
                ) from exc
            events.append(event)
        if events and (events[0]["event"] != "start" or events[0].get("format") != LOG_FORMAT):
            raise MonitorLogError(f"{path}: not an abstain_guard monitor log (no start header).")
        return events

    def _check_header(self, event: Mapping[str, Any]) -> None:
        """Refuse to resume a log whose start header another artifact, rule or monitor
        setting wrote (its tests are not this monitor's), or a snapshot."""
        where = f"{self.log_path}:{event['line']}"
        new_log = "log to a new file (--monitor-log): "
        if event.get("snapshot"):
            raise MonitorLogError(
                f"{where}: a snapshot written by write_log (the kept records only) cannot be "
                f"resumed; {new_log}log_path is the log a monitor resumes from."
            )
        if event.get("seed") is None:
            raise MonitorLogError(
                f"{where}: this log was written by a monitor that did not record its seed (an "
                f"older version): its tests cannot be replayed; {new_log}keep this one for "
                "abstain-guard recalibrate."
            )
        logged_sha = event.get("source", {}).get("calibration_sha256")
        if logged_sha != self.source_["calibration_sha256"]:
            raise MonitorLogError(
                f"{where}: this log monitors another artifact (another calibration set); "
                f"{new_log}one log per artifact."
            )
        mine = _json_round_trip(self._header())
        for key, label in _RESUME_KEYS.items():
            if event.get(key) != mine[key]:
                raise MonitorLogError(
                    f"{where}: this log was written with another {label} ({event.get(key)!r}, now "
                    f"{mine[key]!r}); resuming it would change the tests midway. Restart with "
                    f"the same settings, or {new_log}one log per rule and monitor setting."
                )

    def _replay(self, events: list[dict[str, Any]]) -> dict[str, int]:
        """Replay the logged decisions and feedback in file order (the tests draw the same
        uniforms: the seed is the log's); alarms are recomputed, not raised again.

        Returns:
            ``{"decisions": d, "feedback": f, "alarms": a}`` replayed.

        Raises:
            MonitorLogError: a header another setting wrote, a gap in the decisions' indices,
                feedback for an unknown or labeled decision, or a p-value that does not replay.
        """
        fields = set(MonitorRecord.__dataclass_fields__)
        self._alarm_times = {
            (str(e.get("test")), e.get("group")): str(e.get("time"))
            for e in events if e["event"] == "alarm"
        }  # fmt: skip
        n_feedback = 0
        for event in events:
            kind, where = event["event"], f"{self.log_path}:{event['line']}"
            if kind == "start":
                self._check_header(event)
            elif kind == "decision":
                record = self._logged_record(event, fields, where)
                logged_p = record.p_value
                record.p_value = None
                self._apply_decision(record)
                if record.p_value != logged_p:
                    raise MonitorLogError(
                        f"{where}: the replayed p-value {record.p_value!r} is not the logged "
                        f"{logged_p!r}: the log was not written by this monitor's tests; log to "
                        "a new file."
                    )
                self.records_[record.run_id] = record
            elif kind == "feedback":
                labeled = self.records_.get(str(event.get("run_id")))
                if labeled is None or labeled.correct is not None:
                    why = "no earlier decision" if labeled is None else "an already labeled one"
                    raise MonitorLogError(f"{where}: feedback for {why} ({event.get('run_id')!r}).")
                self._apply_feedback(labeled, bool(event.get("correct")), event.get("time"))
                n_feedback += 1
            elif kind != "alarm":
                raise MonitorLogError(f"{where}: unknown event {kind!r}.")
        while len(self.records_) > int(self.max_records):
            self.records_.popitem(last=False)
        self._alarm_times = {}
        replayed = {"decisions": self.decisions_, "feedback": n_feedback,
                    "alarms": len(self.alarms_)}  # fmt: skip
        logger.info("abstain_guard monitor: resumed %s from %s", replayed, self.log_path)
        return replayed

    def _logged_record(
        self, event: Mapping[str, Any], fields: set[str], where: str
    ) -> MonitorRecord:
        """The decision record of a logged ``decision`` event, the next in index order."""
        try:
            record = MonitorRecord(**{k: v for k, v in event.items() if k in fields})
        except TypeError as exc:
            raise MonitorLogError(f"{where}: malformed decision ({exc}).") from exc
        if record.index != self.decisions_ + 1 or record.run_id in self.records_:
            raise MonitorLogError(
                f"{where}: decision {record.index} ({record.run_id!r}) does not follow decision "
                f"{self.decisions_}: the log is not one monitor's whole history; log to a new "
                "file."
            )
        return record
