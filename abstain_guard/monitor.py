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
from numpy.typing import ArrayLike

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


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def calibration_sha256(scores: ArrayLike) -> str:
    """Identity of a calibration set: sha256 of its scores as float64 bytes, in order."""
    return hashlib.sha256(np.asarray(scores, dtype=np.float64).tobytes()).hexdigest()


@dataclass(frozen=True)
class Alarm:
    """A test whose e-value reached its threshold (evidence that the guarantee no longer
    holds). ``at`` counts the test's own observations (scored decisions, or feedback)."""

    test: str
    at: int
    time: str
    e_value: float
    threshold: float
    message: str


def _record_otel(alarm: Alarm) -> None:
    try:
        from opentelemetry import trace
    except ImportError:
        return
    attrs = {f"abstain_guard.alarm.{k}": v for k, v in asdict(alarm).items()}
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


class GuardMonitor:
    """Anytime-valid drift and risk monitor of one deployed guard (see the module docstring).

    Example::

        monitor = GuardMonitor(false_alarm=0.01).fit_artifact(artifact, config)
        guard = AbstentionGuard(model, artifact=artifact, config=config, monitor=monitor)
        msg = guard.invoke("Who wrote Hamlet?")
        monitor.record_feedback(msg.response_metadata["abstention"]["run_id"], correct=True)
        monitor.state()["alarm"]

    Args:
        false_alarm: a in (0, 1): bound on the probability of any label-free false alarm.
        risk_target: ε of the feedback test (default: the rule's target in risk mode; in
            participation mode the risk test runs only when this is given).
        feedback_false_alarm: bound on the risk test's false alarm (default ``false_alarm``).
        jump: the Simple Jumper's switching rate.
        seed: seeds the smoothing and tie-breaking uniforms (None: fresh entropy).
        max_records: decisions kept for feedback (the oldest are dropped beyond it).
        log_path: a JSONL file every decision and feedback is appended to (the input of
            ``abstain-guard recalibrate``); None keeps them in memory only.
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
        self, scores: ArrayLike, rule: DecisionRule, source: Mapping[str, Any] | None = None
    ) -> GuardMonitor:
        """Start monitoring a guard with calibration ``scores`` ``[n]`` and ``rule``.

        ``source`` identifies the artifact in the log (see :meth:`fit_artifact`). Refitting
        starts over (no records, no alarms).
        """
        self._check_params()
        ref = np.asarray(scores, dtype=float).reshape(-1)
        if ref.size == 0 or not np.all(np.isfinite(ref)):
            raise InvalidInputError("The calibration scores must be a non-empty finite array.")
        rng = np.random.default_rng(self.seed)
        self.rule_ = rule
        self.n_calibration_ = int(ref.size)
        self.source_ = {"calibration_sha256": calibration_sha256(ref), **dict(source or {})}
        self.exchangeability_ = ConformalTestMartingale(ref, self.jump, rng)
        self.participation_ = ParticipationEProcess(ref, rule.threshold, rng)
        eps = self.risk_target if self.risk_target is not None else None
        if eps is None and rule.mode == "risk":
            eps = rule.target
        self.risk_ = RiskEProcess(float(eps)) if eps is not None else None
        fa = float(self.false_alarm)
        ffa = float(self.feedback_false_alarm or self.false_alarm)
        self.thresholds_ = {"exchangeability": 2.0 / fa, "participation": 2.0 / fa, "risk": 1 / ffa}
        self.records_: OrderedDict[str, MonitorRecord] = OrderedDict()
        self.alarms_: list[Alarm] = []
        self.decisions_ = 0
        self.unscored_ = 0
        self.answered_ = 0
        self.feedback_ = {"n": 0, "answered": 0, "errors": 0, "abstained": 0}
        self._lock = threading.Lock()
        if self.log_path is not None:
            self._append({"event": "start", **self._header()})
        return self

    def fit_artifact(self, artifact: Any, config: Any = None) -> GuardMonitor:
        """:meth:`fit` on a :class:`~abstain_guard.artifact.GuardArtifact` and the rule of
        ``config`` (a :class:`~abstain_guard.config.GuardConfig`; default participation
        0.8)."""
        source = {
            "artifact": None if artifact.path is None else str(artifact.path),
            "created": artifact.created,
            "scorer": artifact.scorer.kind,
            "model_fingerprint": artifact.model_fingerprint,
            "n_calibration": artifact.n,
        }
        return self.fit(artifact.scores, artifact.decision_rule(config), source)

    def _fitted(self) -> None:
        if not hasattr(self, "rule_"):
            raise NotFittedError(
                "This GuardMonitor is not fitted: call fit_artifact(artifact, config) (or pass "
                "it to AbstentionGuard / serve, which fit it) before observing decisions."
            )

    @property
    def alarms(self) -> list[Alarm]:
        """The alarms raised so far, in order (each test alarms once)."""
        self._fitted()
        return list(self.alarms_)

    # --- observing -----------------------------------------------------------------------

    def observe(
        self, decision: Mapping[str, Any], run_id: str | None = None, group: str | None = None
    ) -> str:
        """Record one decision (the guard's ``abstention`` dict) and update the label-free
        tests; return its run id (``run_id``, or a new one), the key for feedback.

        ``group`` (default: the decision's ``group``, if any) is kept in the record.
        A decision without a score (scoring failed, input too long) is counted but not
        tested: it says nothing about the score distribution.

        Raises:
            InvalidInputError: ``run_id`` was already recorded.
        """
        self._fitted()
        rid = str(run_id) if run_id is not None else uuid.uuid4().hex
        score = decision.get("score")
        score = float(score) if score is not None and math.isfinite(float(score)) else None
        abstained = bool(decision.get("abstained"))
        with self._lock:
            if rid in self.records_:
                raise InvalidInputError(f"Run id {rid!r} was already recorded; ids must be unique.")
            self.decisions_ += 1
            self.answered_ += not abstained
            record = MonitorRecord(
                index=self.decisions_,
                run_id=rid,
                time=_now(),
                score=score,
                abstained=abstained,
                threshold=float(decision.get("threshold", self.rule_.threshold)),
                group=group if group is not None else decision.get("group"),
            )
            new: list[Alarm] = []
            if score is None:
                self.unscored_ += 1
            else:
                record.p_value = self.exchangeability_.update(score)
                self.participation_.update(score)
                new += self._check("exchangeability", self.exchangeability_.value)
                new += self._check("participation", self.participation_.value)
            self.records_[rid] = record
            while len(self.records_) > int(self.max_records):
                self.records_.popitem(last=False)
            if self.log_path is not None:
                self._append({"event": "decision", **asdict(record)})
        self._raise(new)
        return rid

    def record_feedback(self, run_id: str, correct: bool) -> MonitorRecord:
        """Label one recorded decision: ``correct`` is whether its answer (the withheld one,
        for an abstention) was right. Feedback on an answered decision enters the risk test;
        on an abstained one it is kept for recalibration only.

        Raises:
            UnknownRunError: no recorded decision has this run id (or it was dropped).
            DuplicateFeedbackError: this decision already has feedback.
            InvalidInputError: ``correct`` is not a boolean.
        """
        self._fitted()
        if not isinstance(correct, (bool, np.bool_)):
            raise InvalidInputError(f"correct must be true or false, got {correct!r}.")
        new: list[Alarm] = []
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
            record.correct = bool(correct)
            record.feedback_time = _now()
            self.feedback_["n"] += 1
            if record.abstained:
                self.feedback_["abstained"] += 1
            else:
                self.feedback_["answered"] += 1
                self.feedback_["errors"] += not correct
                if self.risk_ is not None and record.score is not None:
                    self.risk_.update(not correct)
                    new += self._check("risk", self.risk_.value)
            if self.log_path is not None:
                self._append(
                    {"event": "feedback", "run_id": record.run_id, "correct": record.correct,
                     "time": record.feedback_time}
                )  # fmt: skip
        self._raise(new)
        return record

    # --- alarms --------------------------------------------------------------------------

    def _check(self, test: str, value: float) -> list[Alarm]:
        threshold = self.thresholds_[test]
        if value < threshold or any(a.test == test for a in self.alarms_):
            return []
        at = {
            "exchangeability": self.exchangeability_.seen,
            "participation": self.participation_.seen,
            "risk": self.risk_.seen if self.risk_ is not None else 0,
        }[test]
        what = {
            "exchangeability": "the live scores are not exchangeable with the calibration "
            "scores (their ranks drifted)",
            "participation": "the live answered rate left what the calibration set predicts "
            f"({self.participation_.answered}/{self.participation_.seen} answered; "
            f"exchangeable traffic is answered at about {self._expected():.3g})",
            "risk": f"the error rate among answered questions exceeds ε = "
            f"{self.risk_.epsilon if self.risk_ else None} "
            f"({self.feedback_['errors']}/{self.feedback_['answered']} wrong in feedback)",
        }[test]
        alarm = Alarm(
            test=test,
            at=int(at),
            time=_now(),
            e_value=float(value),
            threshold=float(threshold),
            message=f"abstain_guard drift alarm ({test}, e-value {value:.3g} >= "
            f"{threshold:.3g} after {at}): {what}. The guarantee may no longer hold: find what "
            "changed, and recalibrate on recent traffic (abstain-guard recalibrate).",
        )
        self.alarms_.append(alarm)
        return [alarm]

    def _expected(self) -> float:
        """k/(n+1): the answered rate of exchangeable traffic (participation mode: inside
        the guaranteed band)."""
        return self.participation_.k / (self.participation_.n + 1)

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

    def state(self) -> dict[str, Any]:
        """Everything the monitor knows, JSON-ready: counts, rates with Wilson intervals,
        the guaranteed band, each test's e-value, its peak and threshold, and the alarms."""
        self._fitted()
        with self._lock:
            part, exch, risk = self.participation_, self.exchangeability_, self.risk_
            fb = dict(self.feedback_)
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
                    entry["threshold"] = self.thresholds_[name]
                    entry["alarm"] = any(a.test == name for a in self.alarms_)
            scored = self.decisions_ - self.unscored_
            guarantee = self.rule_.guarantee
            return {
                "decisions": self.decisions_,
                "scored": scored,
                "unscored": self.unscored_,
                "answered": self.answered_,
                "answered_rate": self.answered_ / self.decisions_ if self.decisions_ else None,
                "answered_interval": wilson_interval(self.answered_, self.decisions_),
                "mode": self.rule_.mode,
                "threshold": self.rule_.threshold,
                "band": guarantee.get("participation_interval"),
                "expected_participation": self._expected(),
                "feedback": {
                    **fb,
                    "error_rate": fb["errors"] / fb["answered"] if fb["answered"] else None,
                    "error_interval": wilson_interval(fb["errors"], fb["answered"]),
                },
                "tests": tests,
                "false_alarm": self.false_alarm,
                "alarm": bool(self.alarms_),
                "alarms": [asdict(a) for a in self.alarms_],
                "source": dict(self.source_),
            }

    def records(self) -> list[MonitorRecord]:
        """The records kept (the last ``max_records`` decisions), oldest first."""
        self._fitted()
        with self._lock:
            return list(self.records_.values())

    # --- the log -------------------------------------------------------------------------

    def _header(self) -> dict[str, Any]:
        rule = self.rule_
        return {
            "format": LOG_FORMAT,
            "version": 1,
            "time": _now(),
            "source": dict(self.source_),
            "rule": {"mode": rule.mode, "target": rule.target, "threshold": rule.threshold},
        }

    def _append(self, event: Mapping[str, Any]) -> None:
        assert self.log_path is not None
        with open(self.log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(event, default=json_default) + "\n")

    def write_log(self, path: str | Path) -> Path:
        """Write the kept records (decisions with their feedback) as a monitor log (JSONL:
        a ``start`` header, then ``decision`` and ``feedback`` events)."""
        self._fitted()
        target = Path(path)
        with open(target, "w", encoding="utf-8") as fh:
            write_events(fh, self._header(), self.records(), [asdict(a) for a in self.alarms])
        return target
