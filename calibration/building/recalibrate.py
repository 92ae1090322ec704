"""``abstain-guard recalibrate``: a new artifact from labeled live decisions, no model run.

The monitor log (:mod:`abstain_guard.monitor_log`) holds every live decision's score, computed
by the artifact's own scorer on the deployed model's answers, and the feedback labels. Those
(score, correct) pairs are calibration data for the *same* scorer: the new artifact keeps the
old scorer, model fingerprint and deployment record and replaces the calibration set, so the
guard re-thresholds on the live traffic. What the guarantee then needs:

* **Labels from a score-blind sample.** The conformal threshold is valid for future traffic
  exchangeable with the calibration set. Labels only for answered questions are a sample
  selected by the old threshold (every score below it): a threshold computed from them
  answers far fewer questions than its target. Label a random sample of *all* decisions
  (for an abstention, judge its withheld answer: ``response_metadata["withheld_response"]``).
  The command refuses a log whose labeling rate differs between answered and abstained
  decisions (Fisher's exact test, p < 0.01), and says why.
* **Recent traffic only.** After a drift alarm, calibrate on decisions after the shift
  (``--last N``: the most recent N labeled decisions), not on a mix of before and after.
* **Pooling** (``--pool``: old calibration set + live labels) is valid only when the old
  calibration questions and the live ones are exchangeable with each other and with future
  traffic — the same distribution, e.g. growing a small calibration set with live labels
  while no alarm fired. After a shift the old set is from another distribution and pooling
  breaks the guarantee. The command refuses ``--pool`` when the log recorded a drift alarm or
  the live scores differ from the old calibration scores (two-sample Kolmogorov–Smirnov,
  p < 0.01). Not rejecting is not proof of exchangeability: pool only when nothing changed.

The new artifact's metadata ``calibration_source`` records where its calibration set came
from: the old artifact (path, creation time, calibration checksum), the log (path, sha256,
decision and label counts, time span, the run ids used) and whether it was pooled.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from abstain_guard.artifact import GuardArtifact
from abstain_guard.errors import InsufficientDataError, InvalidInputError, MonitorLogError
from abstain_guard.monitor import calibration_sha256
from abstain_guard.monitor_log import MonitorRecord, read_log

__all__ = ["RecalibrationSummary", "recalibrate"]

#: Significance of the checks that refuse a selected sample or an invalid pool.
CHECK_LEVEL = 0.01
#: Old-calibration metadata that does not describe the new calibration set.
_OLD_CALIBRATION_KEYS = ("calibration_ids", "test_ids", "split_sizes", "accuracy", "judgments")


@dataclass(frozen=True)
class RecalibrationSummary:
    """What :func:`recalibrate` wrote."""

    out: Path
    n_live: int
    n_old: int
    pooled: bool
    accuracy: float
    source: dict[str, Any]

    def to_text(self) -> str:
        """One paragraph for the command line."""
        pooled = f" pooled with {self.n_old} old calibration answers" if self.pooled else ""
        return (
            f"recalibrated artifact written to {self.out}: {self.n_live} labeled live "
            f"decisions{pooled} (n = {self.n_live + self.n_old}, accuracy "
            f"{self.accuracy:.3f}); its calibration_source records where they came from."
        )


def selection_check(records: list[MonitorRecord]) -> dict[str, Any]:
    """Fisher's exact test of "whether a decision was labeled does not depend on whether it
    was answered" over ``records`` (all scored decisions of the window)."""
    table = np.zeros((2, 2), dtype=int)
    for r in records:
        table[int(r.abstained), int(r.correct is None)] += 1
    labeled_answered, labeled_abstained = int(table[0, 0]), int(table[1, 0])
    p_value = float(stats.fisher_exact(table).pvalue) if table.sum() else 1.0
    return {
        "labeled_answered": labeled_answered,
        "answered": int(table[0].sum()),
        "labeled_abstained": labeled_abstained,
        "abstained": int(table[1].sum()),
        "fisher_p_value": p_value,
        "passed": p_value >= CHECK_LEVEL,
    }


def pool_check(old: np.ndarray, live: np.ndarray, alarms: list[dict[str, Any]]) -> dict[str, Any]:
    """Evidence against pooling: the log's drift alarms and a two-sample KS test."""
    ks = stats.ks_2samp(old, live)
    return {
        "ks_statistic": float(ks.statistic),
        "ks_p_value": float(ks.pvalue),
        "alarms": [a.get("test") for a in alarms],
        "passed": float(ks.pvalue) >= CHECK_LEVEL and not alarms,
    }


def _window(records: list[MonitorRecord], last: int | None) -> list[MonitorRecord]:
    """The scored decisions from the first of the ``last`` most recent labeled ones on (all
    scored decisions when ``last`` is None)."""
    scored = [r for r in records if r.score is not None]
    if last is None:
        return scored
    if last < 1:
        raise InvalidInputError(f"--last must be a positive integer, got {last}.")
    labeled_at = [i for i, r in enumerate(scored) if r.correct is not None]
    if not labeled_at:
        return []
    return scored[labeled_at[max(0, len(labeled_at) - last)] :]


def recalibrate(
    artifact: str | Path,
    feedback: str | Path,
    out: str | Path,
    *,
    pool: bool = False,
    last: int | None = None,
    overwrite: bool = False,
) -> RecalibrationSummary:
    """Build a new artifact at ``out`` from the labeled decisions in the monitor log
    ``feedback`` of the guard running ``artifact`` (see the module docstring).

    Raises:
        MonitorLogError: the log is malformed or belongs to another artifact.
        InsufficientDataError: no labeled decisions, or the labels are a selected sample, or
            ``pool`` was asked where the old and live questions are not exchangeable.
    """
    old = GuardArtifact.load(artifact)
    header, records = read_log(feedback)
    logged = header.get("source", {}).get("calibration_sha256")
    if logged != calibration_sha256(old.scores):
        raise MonitorLogError(
            f"The monitor log {feedback} was written by a guard with another calibration set "
            f"than {artifact} (calibration sha256 {logged} vs {calibration_sha256(old.scores)}); "
            "its scores come from another scorer or artifact. Recalibrate the artifact that "
            "served the logged traffic."
        )
    window = _window(records, last)
    labeled = [r for r in window if r.correct is not None]
    if not labeled:
        raise InsufficientDataError(
            f"The monitor log {feedback} has no labeled decisions with a score"
            + (f" among the last {last}" if last else "")
            + ". Send feedback (monitor.record_feedback or POST /v1/feedback) for a random "
            "sample of decisions first."
        )
    selection = selection_check(window)
    if not selection["passed"]:
        raise InsufficientDataError(
            f"The labeled decisions are not a score-blind sample: {selection['labeled_answered']}"
            f" of {selection['answered']} answered decisions have feedback but "
            f"{selection['labeled_abstained']} of {selection['abstained']} abstained ones "
            f"(Fisher p = {selection['fisher_p_value']:.2g}). A threshold from labels chosen by "
            "the old threshold does not hold on new traffic. Label a random sample of all "
            "decisions, abstentions included (judge the withheld answer), then run again."
        )
    scores = np.array([r.score for r in labeled], dtype=float)
    correct = np.array([bool(r.correct) for r in labeled])
    check = None
    if pool:
        check = pool_check(old.scores, scores, header.get("alarms", []))
        if not check["passed"]:
            why = (
                f"the log recorded drift alarms ({', '.join(check['alarms'])})"
                if check["alarms"]
                else f"the live scores differ from the calibration scores (KS p = "
                f"{check['ks_p_value']:.2g})"
            )
            raise InsufficientDataError(
                f"Pooling needs the old calibration questions and the live ones to be "
                f"exchangeable, but {why}. Recalibrate on the live feedback alone (drop --pool)."
            )
        scores = np.concatenate([old.scores, scores])
        correct = np.concatenate([old.correct, correct])
    log_bytes = Path(feedback).read_bytes()
    source = {
        "kind": "live_feedback+calibration" if pool else "live_feedback",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "recalibrated_from": {
            "artifact": str(artifact),
            "created": old.created,
            "n_calibration": old.n,
            "calibration_sha256": calibration_sha256(old.scores),
        },
        "feedback": {
            "log": str(feedback),
            "sha256": hashlib.sha256(log_bytes).hexdigest(),
            "decisions": len(records),
            "window": len(window),
            "labeled": len(labeled),
            "last": last,
            "first_time": labeled[0].time,
            "last_time": labeled[-1].time,
            "run_ids": [r.run_id for r in labeled],
            "label_source": "monitor feedback",
        },
        "pooled": pool,
        "selection_check": selection,
        "pool_check": check,
    }
    metadata = {k: v for k, v in old.metadata.items() if k not in _OLD_CALIBRATION_KEYS}
    metadata["calibration_source"] = source
    new = GuardArtifact.from_calibration(
        scorer=old.scorer,
        scores=scores,
        correct=correct,
        model_fingerprint=old.model_fingerprint,
        metadata=metadata,
    )
    path = new.save(out, overwrite=overwrite)
    return RecalibrationSummary(
        out=path,
        n_live=len(labeled),
        n_old=old.n if pool else 0,
        pooled=pool,
        accuracy=float(correct.mean()),
        source=source,
    )
