"""``abstain-guard recalibrate``: a new artifact from live decisions, no model run.

The monitor log (:mod:`abstain_guard.monitor.log`) holds every live decision's score (by the
artifact's own scorer on the deployed model's answers), its group and the feedback labels;
the new artifact keeps the old scorer, model fingerprint and deployment record and replaces
the calibration set. Participation mode takes every scored decision of the window (no labels
needed); risk mode the labeled ones, refused unless they are a score-blind sample; ``last``
keeps recent traffic only and ``pool`` adds the old calibration set, refused after a drift
alarm or a shift. Why each rule holds, and what the metadata records
(``calibration_source``, ``recalibrated_from``): docs/guarantees.md, "Recalibration from
feedback".
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from scipy import stats

from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.errors import InsufficientDataError, InvalidInputError, MonitorLogError
from abstain_guard.monitor.log import MonitorRecord, read_log
from abstain_guard.monitor.scope import calibration_sha256

Mode = Literal["participation", "risk"]

#: Default significance level of the checks that refuse a selected sample or an invalid pool.
CHECK_LEVEL = 0.01
#: Settings of the old ``config`` metadata that load the deployed model (read by
#: :func:`abstain_guard.guard.chains.load_guard_chain`); they stay true for the new artifact. The
#: rest of ``config`` (data, judge, splits, targets) described the old calibration set.
_MODEL_CONFIG_KEYS = (
    "model",
    "gguf_file",
    "max_new_tokens",
    "batch_decode",
    "prefix_cache",
    "agent",
    "agent_step_limit",
)
#: Old metadata that stays at the top level: how the deployed answers are generated.
_DEPLOYMENT_KEYS = ("deployment",)


@dataclass(frozen=True)
class RecalibrationSummary:
    """What :func:`recalibrate` wrote.

    Attributes:
        n_live: live decisions in the new calibration set.
        n_labeled: how many of them have feedback (all of them in risk mode).
        n_old: old calibration answers kept (``pool``), else 0.
        accuracy: accuracy of the labeled answers of the new set (None without labels).
        source: the new artifact's ``calibration_source`` metadata.
    """

    out: Path
    n_live: int
    n_labeled: int
    n_old: int
    pooled: bool
    mode: str
    accuracy: float | None
    source: dict[str, Any]

    def to_text(self) -> str:
        """One paragraph for the command line."""
        pooled = f" pooled with {self.n_old} old calibration answers" if self.pooled else ""
        accuracy = "no labels" if self.accuracy is None else f"accuracy {self.accuracy:.3f}"
        unlabeled = self.n_live - self.n_labeled
        note = (
            f" {unlabeled} unlabeled decisions are stored as incorrect (a participation "
            "threshold uses the scores only)."
            if unlabeled
            else ""
        )
        return (
            f"recalibrated artifact written to {self.out} ({self.mode} mode): {self.n_live} live "
            f"decisions, {self.n_labeled} labeled{pooled} (n = {self.n_live + self.n_old}, "
            f"{accuracy} among the labeled); its calibration_source and recalibrated_from "
            f"metadata record where they came from.{note}"
        )


def _check_level(level: float) -> float:
    """``level`` as a float in (0, 1).

    Raises:
        InvalidInputError: it is not.
    """
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise InvalidInputError(
            f"check_level must be a significance level in (0, 1) such as 0.01, got {level!r}."
        )
    return float(level)


def rank_test(labeled: np.ndarray, unlabeled: np.ndarray) -> float:
    """p-value of the two-sided Mann–Whitney U test of "labeled and unlabeled decisions have
    the same score distribution" (1.0 when either side is empty: nothing to compare)."""
    if labeled.size == 0 or unlabeled.size == 0:
        return 1.0
    return float(stats.mannwhitneyu(labeled, unlabeled, alternative="two-sided").pvalue)


def selection_check(records: list[MonitorRecord], level: float = CHECK_LEVEL) -> dict[str, Any]:
    """Evidence that the labels over ``records`` (the scored decisions of the window) are a
    score-selected sample: withheld decisions exist but none is labeled, or the labeled
    decisions' scores differ from the unlabeled ones' (:func:`rank_test`, p < ``level``).

    Returns the counts, the rank test's p-value, ``level``, ``passed`` and, when it did not
    pass, ``reason``.
    """
    level = _check_level(level)
    answered = [r for r in records if not r.abstained]
    withheld = [r for r in records if r.abstained]
    labeled = np.array([r.score for r in records if r.correct is not None], dtype=float)
    unlabeled = np.array([r.score for r in records if r.correct is None], dtype=float)
    check: dict[str, Any] = {
        "labeled_answered": sum(r.correct is not None for r in answered),
        "answered": len(answered),
        "labeled_abstained": sum(r.correct is not None for r in withheld),
        "abstained": len(withheld),
        "rank_test": "Mann-Whitney U, two-sided: labeled vs unlabeled scores",
        "rank_p_value": rank_test(labeled, unlabeled),
        "level": level,
    }
    if withheld and not check["labeled_abstained"]:
        check["reason"] = f"none of the {len(withheld)} withheld decisions is labeled"
    elif check["rank_p_value"] < level:
        check["reason"] = (
            f"the labeled decisions' scores (median {np.median(labeled):.4g}) differ from the "
            f"unlabeled ones' (median {np.median(unlabeled):.4g}): Mann-Whitney p = "
            f"{check['rank_p_value']:.2g} < {level:g}"
        )
    check["passed"] = "reason" not in check
    return check


def pool_check(
    old: np.ndarray, live: np.ndarray, alarms: list[dict[str, Any]], level: float = CHECK_LEVEL
) -> dict[str, Any]:
    """Evidence against pooling: the log's drift alarms and a two-sample KS test at ``level``."""
    ks = stats.ks_2samp(old, live)
    return {
        "ks_statistic": float(ks.statistic),
        "ks_p_value": float(ks.pvalue),
        "level": level,
        "alarms": [a.get("test") for a in alarms],
        "passed": float(ks.pvalue) >= level and not alarms,
    }


def _window(records: list[MonitorRecord], last: int | None, mode: Mode) -> list[MonitorRecord]:
    """The scored decisions from the first of the ``last`` most recent counted ones on
    (labeled ones in risk mode, every scored one in participation mode); all scored
    decisions when ``last`` is None."""
    scored = [r for r in records if r.score is not None]
    if last is None:
        return scored
    if last < 1:
        raise InvalidInputError(f"--last must be a positive integer, got {last}.")
    if mode == "participation":
        return scored[-last:]
    labeled_at = [i for i, r in enumerate(scored) if r.correct is not None]
    if not labeled_at:
        return []
    return scored[labeled_at[max(0, len(labeled_at) - last)] :]


def _mode(mode: str | None, header: dict[str, Any]) -> Mode:
    """The recalibration mode: ``mode``, else the logged rule's, else ``"risk"`` (the
    label-based mode, whose checks refuse what the other would accept).

    Raises:
        InvalidInputError: ``mode`` is neither ``"participation"`` nor ``"risk"``.
    """
    chosen = mode if mode is not None else header.get("rule", {}).get("mode", "risk")
    if chosen == "participation":
        return "participation"
    if chosen == "risk":
        return "risk"
    raise InvalidInputError(f"mode must be 'participation' or 'risk', got {chosen!r}.")


def _check_log(
    old: GuardArtifact, artifact: str | Path, feedback: str | Path, header: dict[str, Any]
) -> None:
    """Refuse a log written by a guard with another calibration set than ``old``'s."""
    logged = header.get("source", {}).get("calibration_sha256")
    if logged != calibration_sha256(old.scores):
        raise MonitorLogError(
            f"The monitor log {feedback} was written by a guard with another calibration set "
            f"than {artifact} (calibration sha256 {logged} vs {calibration_sha256(old.scores)}); "
            "its scores come from another scorer or artifact. Recalibrate the artifact that "
            "served the logged traffic."
        )


def _calibration_records(
    window: list[MonitorRecord], mode: Mode, feedback: str | Path, last: int | None, level: float
) -> tuple[list[MonitorRecord], dict[str, Any] | None]:
    """The window's decisions the new calibration set takes (every one in participation
    mode, the labeled ones in risk mode) and the selection check (risk mode only).

    Raises:
        InsufficientDataError: nothing to calibrate on, or (risk mode) no labels or labels
            from a score-selected sample.
    """
    among = f" among the last {last}" if last else ""
    if mode == "participation":
        if not window:
            raise InsufficientDataError(
                f"The monitor log {feedback} has no scored decisions{among}: nothing to take "
                "a participation threshold from. Serve traffic with the monitor logging first."
            )
        return window, None
    labeled = [r for r in window if r.correct is not None]
    if not labeled:
        raise InsufficientDataError(
            f"The monitor log {feedback} has no labeled decisions with a score{among}. A "
            "risk-mode threshold needs labels: send feedback (monitor.record_feedback or POST "
            "/v1/feedback) for a random sample of all decisions first."
        )
    selection = selection_check(window, level)
    if not selection["passed"]:
        raise InsufficientDataError(
            f"The labeled decisions are not a score-blind sample: {selection['reason']} "
            f"({selection['labeled_answered']} of {selection['answered']} answered and "
            f"{selection['labeled_abstained']} of {selection['abstained']} withheld decisions "
            "have feedback). A risk threshold from labels chosen by their score does not hold "
            "on new traffic. Label a random sample of all decisions, abstentions included "
            "(judge the withheld answer), then run again; or recalibrate in participation "
            "mode, which needs no labels."
        )
    return labeled, selection


def _grouped(
    records: list[MonitorRecord],
) -> tuple[list[MonitorRecord], list[str] | None, int]:
    """The records a grouped calibration set keeps, their groups and how many were left out
    for having no group; ``records``, None and 0 when no decision has a group."""
    named = [r for r in records if isinstance(r.group, str) and r.group.strip()]
    if not named:
        return records, None, 0
    return named, [str(r.group) for r in named], len(records) - len(named)


def _old_provenance(old: GuardArtifact, artifact: str | Path) -> dict[str, Any]:
    """Where the old artifact came from: its identity and its whole metadata."""
    where = Path(artifact).resolve() if isinstance(artifact, (str, Path)) else artifact
    return {
        "artifact": str(where),  # absolute: a relative path names nothing once moved
        "created": old.created,
        "model_fingerprint": old.model_fingerprint,
        "n_calibration": old.n,
        "calibration_sha256": calibration_sha256(old.scores),
        "metadata": dict(old.metadata),
    }


def _new_metadata(
    old: GuardArtifact, artifact: str | Path, source: dict[str, Any]
) -> dict[str, Any]:
    """The new artifact's metadata: the deployment record and the model-loading part of
    ``config`` (still true), ``calibration_source`` and the old provenance under
    ``recalibrated_from``."""
    metadata = {k: old.metadata[k] for k in _DEPLOYMENT_KEYS if k in old.metadata}
    config = old.metadata.get("config")
    if isinstance(config, dict):
        metadata["config"] = {k: config[k] for k in _MODEL_CONFIG_KEYS if k in config}
    metadata["calibration_source"] = source
    metadata["recalibrated_from"] = _old_provenance(old, artifact)
    return metadata


def _feedback_source(
    feedback: str | Path,
    records: list[MonitorRecord],
    window: list[MonitorRecord],
    live: list[MonitorRecord],
    last: int | None,
) -> dict[str, Any]:
    """Where the live part of the calibration set came from: the log and its counts."""
    return {
        "log": str(feedback),
        "sha256": hashlib.sha256(Path(feedback).read_bytes()).hexdigest(),
        "decisions": len(records),
        "window": len(window),
        "last": last,
        "used": len(live),
        "labeled": sum(r.correct is not None for r in live),
        "unlabeled_stored_as_incorrect": sum(r.correct is None for r in live),
        "first_time": live[0].time,
        "last_time": live[-1].time,
        "run_ids": [r.run_id for r in live],
        "label_source": "monitor feedback",
    }


def _pool(
    old: GuardArtifact,
    live: np.ndarray,
    header: dict[str, Any],
    level: float,
) -> dict[str, Any]:
    """The pool check, or a refusal that says why.

    Raises:
        InsufficientDataError: the log recorded alarms or the KS test rejects.
    """
    check = pool_check(old.scores, live, header.get("alarms", []), level)
    if not check["passed"]:
        why = (
            f"the log recorded drift alarms ({', '.join(map(str, check['alarms']))})"
            if check["alarms"]
            else f"the live scores differ from the calibration scores (KS p = "
            f"{check['ks_p_value']:.2g} < {level:g})"
        )
        raise InsufficientDataError(
            f"Pooling needs the old calibration questions and the live ones to be "
            f"exchangeable, but {why}. Recalibrate on the live feedback alone (drop --pool)."
        )
    return check


def _pooled_groups(
    old: GuardArtifact, live_groups: list[str] | None, pool: bool
) -> list[str] | None:
    """The new set's groups: the live ones, after the old set's when pooled (None when
    either side has none: a grouped set needs a group for every answer)."""
    if live_groups is None or not pool:
        return live_groups
    if old.groups is None:
        return None
    return [*old.groups.tolist(), *live_groups]


def _arrays(
    old: GuardArtifact, live: list[MonitorRecord], pool: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The new set's scores, labels (an unlabeled decision stored as incorrect) and which
    entries carry a label; the old calibration set first when ``pool``."""
    scores = np.array([r.score for r in live], dtype=float)
    correct = np.array([r.correct is True for r in live], dtype=bool)
    labeled = np.array([r.correct is not None for r in live], dtype=bool)
    if not pool:
        return scores, correct, labeled
    return (
        np.concatenate([old.scores, scores]),
        np.concatenate([old.correct, correct]),
        np.concatenate([np.ones(old.n, dtype=bool), labeled]),
    )


def recalibrate(
    artifact: str | Path,
    feedback: str | Path,
    out: str | Path,
    *,
    pool: bool = False,
    last: int | None = None,
    overwrite: bool = False,
    mode: Mode | None = None,
    check_level: float = CHECK_LEVEL,
) -> RecalibrationSummary:
    """Build a new artifact at ``out`` from the decisions in the monitor log ``feedback``
    of the guard running ``artifact`` (see the module docstring): ``pool`` keeps the old
    calibration set too, ``last`` only the most recent N decisions (labeled ones in risk
    mode), ``mode`` defaults to the logged rule's, ``check_level`` is the significance level
    of the selection and pooling tests.

    Raises:
        MonitorLogError: the log is malformed or belongs to another artifact.
        InvalidInputError: ``last``, ``mode`` or ``check_level`` is out of range.
        InsufficientDataError: nothing to calibrate on, no labels in risk mode, labels from
            a score-selected sample, or ``pool`` where old and live questions are not
            exchangeable.
    """
    level = _check_level(check_level)
    old = GuardArtifact.load(artifact)
    header, records = read_log(feedback)
    _check_log(old, artifact, feedback, header)
    chosen = _mode(mode, header)
    window = _window(records, last, chosen)
    taken, selection = _calibration_records(window, chosen, feedback, last, level)
    live, live_groups, ungrouped = _grouped(taken)
    check = _pool(old, _arrays(old, live, pool=False)[0], header, level) if pool else None
    groups = _pooled_groups(old, live_groups, pool)
    source = {
        "kind": "live_feedback+calibration" if pool else "live_feedback",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": chosen,
        "labels": "monitor feedback",
        "feedback": _feedback_source(feedback, records, window, live, last),
        "pooled": pool,
        "selection_check": selection,
        "pool_check": check,
        "groups": {"kept": groups is not None, "left_out_without_group": ungrouped},
    }
    scores, correct, labeled = _arrays(old, live, pool)
    new = GuardArtifact.from_calibration(
        scorer=old.scorer,
        calibration=CalibrationSet(
            scores, correct, groups=None if groups is None else np.asarray(groups)
        ),
        model_fingerprint=old.model_fingerprint,
        metadata=_new_metadata(old, artifact, source),
    )
    return RecalibrationSummary(
        out=new.save(out, overwrite=overwrite),
        n_live=len(live),
        n_labeled=int(labeled.sum()) - (old.n if pool else 0),
        n_old=old.n if pool else 0,
        pooled=pool,
        mode=chosen,
        accuracy=float(correct[labeled].mean()) if labeled.any() else None,
        source=source,
    )
