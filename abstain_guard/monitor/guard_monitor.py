"""`GuardMonitor`: is the deployed guard's guarantee still holding?

Fed every decision (:meth:`GuardMonitor.observe`: the guard, the agent middleware and
``serve`` call it) and, where callers know it, whether an answer was right
(:meth:`GuardMonitor.record_feedback`), it runs three anytime-valid tests
(:mod:`abstain_guard.monitor.drift`): ``exchangeability`` and ``participation`` (label-free,
alarm at ``2/false_alarm`` each) and ``risk`` (feedback, alarm at
``1/feedback_false_alarm``); with per-group rules each group is tested against its own rule.
With ``log_path`` a restarted monitor resumes its log (:mod:`abstain_guard.monitor.resume`).
The monitor never changes the threshold. What the tests assume, what feedback can see, the
false-alarm bound over groups and restarts: docs/guarantees.md, "Monitoring the guarantee in
production".
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard.errors import (
    DuplicateFeedbackError,
    InvalidInputError,
    NotFittedError,
    UnknownRunError,
)
from abstain_guard.guarantee.decision import Decision, DecisionRule
from abstain_guard.guarantee.intervals import wilson_interval
from abstain_guard.monitor.log import MonitorRecord
from abstain_guard.monitor.resume import MonitorLogMixin
from abstain_guard.monitor.scope import (
    SHARING,
    Alarm,
    Scope,
    calibration_sha256,
    group_scopes,
    now,
    record_otel,
    risk_epsilon,
    scope_alarm,
)
from abstain_guard.monitor.state import (
    expected_participation,
    false_alarm_bound,
    feedback_summary,
    pooled_tests,
    scope_state,
    share,
    thresholds,
)

logger = logging.getLogger("abstain_guard")


class GuardMonitor(MonitorLogMixin):
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
        ``group_rules`` is the guard's :class:`~abstain_guard.guarantee.groups.GroupRules` and
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
        self.source_ = {"calibration_sha256": calibration_sha256(ref), **dict(source or {})}
        self.grouped_ = group_rules is not None
        self.sharing_ = sharing if self.grouped_ else None
        self.group_rules_ = group_rules
        if groups is None or group_rules is None:
            eps = risk_epsilon(rule, self.risk_target)
            self.scopes_ = {None: Scope(None, rule, "pooled", ref, rng, self.jump, eps)}
        else:
            self.scopes_ = group_scopes(ref, groups, group_rules, rng, self.jump, self.risk_target)
        self.thresholds_ = self._thresholds()
        self.records_ = OrderedDict()
        self.alarms_ = []
        self.decisions_ = 0
        self.unscored_ = 0
        self.unmonitored_ = 0
        self.answered_ = 0
        self.handed_off_ = {"interrupt": 0, "fallback": 0}
        self.feedback_ = {"n": 0, "answered": 0, "errors": 0, "abstained": 0}
        self.resumed_: dict[str, int] | None = None
        self._alarm_times = {}
        self._lock = threading.Lock()
        if events:
            self.resumed_ = self._replay(events)
        if self.log_path is not None:
            extra = {} if self.resumed_ is None else {"resumed": self.resumed_}
            self._append({"event": "start", **self._header(), **extra})
        return self

    def _thresholds(self) -> dict[str, float]:
        """Each test's alarm threshold: ``2·s/a`` label-free, ``s/a_feedback`` risk, with s
        how many tested scopes share each level (1: not shared)."""
        s = share(len(self.scopes_), self.sharing_)
        return thresholds(self.false_alarm, self.feedback_false_alarm, s)

    def fit_artifact(self, artifact: Any, config: Any = None) -> GuardMonitor:
        """:meth:`fit` on a :class:`~abstain_guard.GuardArtifact` and the rule of
        ``config`` (a :class:`~abstain_guard.config.GuardConfig`; default participation
        0.8). With ``config.group_by``, every group is tested against its own rule
        (``config.group_delta`` shares ``false_alarm``)."""
        source = {
            "artifact": None if artifact.path is None else str(artifact.path),
            "artifact_sha256": artifact.digest,
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
        self, decision: Decision, run_id: str | None = None, group: str | None = None
    ) -> str:
        """Record one decision (the guard's) and update the label-free
        tests; return its run id (``run_id``, or a new one), the key for feedback.

        ``group`` (default: the decision's) picks, with per-group rules, the group whose
        tests the decision enters. A decision without a score is counted but not tested. A
        step-gated run the guard stopped is ``censored``: its running maximum is ranked only
        as above its threshold (:func:`~abstain_guard.monitor.drift.censored_p_value`).

        Raises:
            InvalidInputError: ``run_id`` was already recorded.
        """
        self._fitted()
        rid = str(run_id) if run_id is not None else uuid.uuid4().hex
        score = decision.score
        score = float(score) if score is not None and math.isfinite(float(score)) else None
        threshold = float(
            decision.threshold if decision.threshold is not None else self.rule_.threshold
        )
        abstained = bool(decision.abstained)
        censored = (
            decision.gating == "steps" and abstained and score is not None
        ) and score > threshold
        with self._lock:
            if rid in self.records_:
                raise InvalidInputError(f"Run id {rid!r} was already recorded; ids must be unique.")
            record = MonitorRecord(
                index=self.decisions_ + 1,
                run_id=rid,
                time=now(),
                score=score,
                abstained=abstained,
                threshold=threshold,
                group=group if group is not None else decision.group,
                action=_run_action(decision),
                censored=bool(censored),
            )
            new = self._apply_decision(record)
            self._keep(record)
            if self.log_path is not None:
                self._append({"event": "decision", **asdict(record)})
        self._raise(new)
        return rid

    def _scope_of(self, group: str | None) -> Scope | None:
        """The scope a decision of ``group`` is tested in (None: not tested)."""
        if not self.grouped_:
            return self.scopes_[None]
        return None if group is None else self.scopes_.get(group)

    def _apply_decision(self, record: MonitorRecord) -> list[Alarm]:
        """Count one decision and, when scored and in a tested scope, update its scope's
        label-free tests (sets ``record.p_value``); the alarms it raises. Lock held."""
        self.decisions_ += 1
        self.answered_ += not record.abstained
        if record.action in self.handed_off_:  # a stopped run a human or fallback went on with
            self.handed_off_[record.action] += 1
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
        above = record.threshold if record.censored else None
        record.p_value = scope.exchangeability.update(record.score, above=above)
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
            new = self._apply_feedback(record, bool(correct), now())
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

    def _alarmed(self, scope: Scope) -> set[str]:
        return {a.test for a in self.alarms_ if a.group == scope.name}

    def _check(self, scope: Scope, test: str) -> list[Alarm]:
        threshold = self.thresholds_[test]
        found = scope.test(test)
        value = found.value
        if value < threshold or test in self._alarmed(scope):
            return []
        time = self._alarm_times.get((test, scope.name)) or now()
        alarm = scope_alarm(scope, test, float(value), float(threshold), int(found.seen), time)
        self.alarms_.append(alarm)
        return [alarm]

    def _expected(self) -> float:
        """The answered rate of exchangeable traffic (see :func:`expected_participation`)."""
        return expected_participation(list(self.scopes_.values()))

    def _raise(self, alarms: list[Alarm]) -> None:
        for alarm in alarms:
            logger.warning(alarm.message, extra={"abstain_guard_alarm": asdict(alarm)})
            record_otel(alarm)
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
        return false_alarm_bound(
            self.false_alarm,
            self.feedback_false_alarm,
            list(self.scopes_.values()),
            grouped=self.grouped_,
            sharing=self.sharing_,
            mode=self.rule_.mode,
            unmonitored=self.unmonitored_,
        )

    def state(self) -> dict[str, Any]:
        """Everything the monitor knows, JSON-ready: counts, rates with Wilson intervals,
        the guaranteed band, each test's e-value, its peak and threshold, the alarms, and
        the false-alarm bound in force, the stopped runs a human or a fallback went on with
        (``handed_off``: outside the certificate). With per-group rules, ``groups`` holds
        each tested group's rule, rates and tests, and ``tests`` summarises them (largest
        e-value)."""
        self._fitted()
        with self._lock:
            fb = dict(self.feedback_)
            groups: dict[str, Any] | None = None
            if self.grouped_:
                groups = {
                    str(s.name): scope_state(s, self.thresholds_, self._alarmed(s))
                    for s in self.scopes_.values()
                }
                tests = pooled_tests(groups, self.thresholds_)
            else:
                scope = self.scopes_[None]
                tests = scope.tests(self.thresholds_, self._alarmed(scope))
            scored = self.decisions_ - self.unscored_
            interval = None if self.grouped_ else self.rule_.guarantee.participation_interval
            band = None if interval is None else list(interval)
            return {
                "decisions": self.decisions_,
                "scored": scored,
                "unscored": self.unscored_,
                "unmonitored": self.unmonitored_,
                "answered": self.answered_,
                "answered_rate": self.answered_ / self.decisions_ if self.decisions_ else None,
                "answered_interval": wilson_interval(self.answered_, self.decisions_),
                "handed_off": dict(self.handed_off_),
                "mode": self.rule_.mode,
                "threshold": self.rule_.threshold,
                "band": band,
                "expected_participation": self._expected(),
                "feedback": feedback_summary(fb),
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


def _run_action(decision: Decision) -> str | None:
    """Where a decision's run went (its ``action``), except that a stopped step a human
    rejected ended the run with the abstention: ``"end"`` (not handed off)."""
    action = decision.action
    if action == "interrupt" and decision.review == "rejected":
        return "end"
    return None if action is None else str(action)
