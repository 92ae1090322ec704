"""From calibration scores and a config to the rule the guard applies: a threshold on the
uncertainty score and the guarantee it carries (participation or risk mode; see
``docs/guarantees.md``)."""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard.config import GuardConfig
from abstain_guard.errors import ConfigError, InsufficientDataError, UncertifiableTargetError
from abstain_guard.guarantee import conformal, truth
from abstain_guard.guarantee.action_risk import (
    ActionRiskCertificate,
    action_guarantee,
    joint_risk_threshold,
    require_action_statistics,
    uncertifiable_joint,
)
from abstain_guard.guarantee.frontier import smallest_certifiable_risk
from abstain_guard.guarantee.partial_release import (
    PartialReleaseCertificate,
    partial_release_certificate,
    partial_release_guarantee,
)
from abstain_guard.guarantee.selection import ScorerSelection, participation_lower_bound

__all__ = ["DecisionRule", "decision_rule"]

logger = logging.getLogger("abstain_guard")


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


@dataclass(frozen=True)
class DecisionRule:
    """How the guard decides: answer when ``score <= threshold``.

    Attributes:
        threshold: τ (``inf``: answer everything; ``-inf``: abstain on everything).
        mode: ``"participation"`` or ``"risk"``.
        target: 1−α (participation mode) or ε (risk mode).
        guarantee: JSON-ready description of what is guaranteed (see docs/guarantees.md).
    """

    threshold: float
    mode: str
    target: float
    guarantee: dict[str, Any] = field(default_factory=dict)

    def answers(self, score: float) -> bool:
        """True when a response with this score is answered (``score <= threshold``)."""
        return bool(score <= self.threshold)


def _uncertifiable(
    scores: ArrayLike,
    correct: ArrayLike,
    res: conformal.RiskThreshold,
    delta: float,
    selection: ScorerSelection | None = None,
) -> UncertifiableTargetError:
    """The error for a risk target this calibration set cannot certify, naming the smallest
    one it can at the same delta (``res.delta`` is the level tested: δ/K after a selection)."""
    smallest = smallest_certifiable_risk(scores, correct, res.delta)
    at = f"delta={delta:g}" + (
        f" ({res.delta:.3g} per candidate: {selection.account()})" if selection is not None else ""
    )
    can = (
        f"the smallest risk_target it certifies at {at} is {smallest:g}"
        if smallest is not None
        else f"it certifies no risk_target below 1 at {at}"
    )
    return UncertifiableTargetError(
        f"risk_target={res.risk_target:g} cannot be certified at {at} from "
        f"these {res.n} calibration answers: {can}. Raise risk_target or delta, calibrate on "
        "more questions (abstain-guard evaluate prints the certifiable frontier), or set "
        "on_infeasible='abstain_all' to deploy a guard that abstains on every question.",
        smallest_risk_target=smallest,
    )


def _selection_text(selection: ScorerSelection, level: float) -> str:
    return (
        f"; {selection.account()}, and every one of the K is certified at "
        f"delta/{selection.n_candidates} = {level:.3g} (Bonferroni), so the choice is accounted "
        "for"
    )


def decision_rule(
    scores: ArrayLike,
    correct: ArrayLike,
    config: GuardConfig,
    selection: ScorerSelection | None = None,
    action_statistic: ArrayLike | None = None,
    stream_first: ArrayLike | None = None,
    human: ArrayLike | None = None,
) -> DecisionRule:
    """Compute the decision rule for ``config``'s target from calibration scores and labels.

    ``selection``: how the scorer was chosen on these answers (the artifact's
    :class:`~abstain_guard.guarantee.selection.ScorerSelection`); risk mode then certifies at
    ``config.delta`` / K, so ``config.delta`` holds for the chosen scorer
    (:mod:`abstain_guard.guarantee.selection`), and participation mode adds the PAC lower bound that
    accounts for the choice. ``stream_first``: each answer's first-chunk score when the
    artifact was calibrated with a chunk rule (``scores`` are then the stream statistics);
    the guarantee then carries the ``partial_release`` block, and
    ``config.partial_release_target`` restricts τ to the thresholds certified to keep it
    (:mod:`abstain_guard.guarantee.partial_release`). ``human``: people's verdicts on a
    uniformly random sample of the calibration answers (1 / 0, -1 not reviewed): risk mode
    then certifies the true error rate (:mod:`abstain_guard.guarantee.truth`) and every
    guarantee carries the judge's measured quality; without it the guarantee says it is
    about the judge's labels.
    """
    if config.partial_release_target is not None and stream_first is None:
        raise ConfigError(
            "partial_release_target needs an artifact calibrated with a chunk rule "
            "(calibrate with chunk_rule: 'sentence', 'clause' or 'tokens:K'); this one decides "
            "whole answers, which never release text before the decision"
        )
    if config.mode == "risk":
        assert config.risk_target is not None
        action: ActionRiskCertificate | None = None
        partial: PartialReleaseCertificate | None = None
        delta = config.delta
        level = delta / selection.n_candidates if selection is not None else delta
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always", conformal.ConformalWarning)
            if config.partial_release_target is not None:  # both targets, each at δ/2
                assert stream_first is not None
                partial = partial_release_certificate(
                    stream_first, scores, config.partial_release_target, level / 2
                )
                res = conformal.risk_threshold(
                    scores,
                    correct,
                    config.risk_target,
                    level / 2,
                    ceiling=partial.ceiling,
                    human=human,
                )
            elif config.action_risk_target is None:
                res = conformal.risk_threshold(
                    scores, correct, config.risk_target, level, human=human
                )
            else:  # both targets: the run-level one and the action risk, each at δ/2
                res, action = joint_risk_threshold(
                    scores,
                    correct,
                    require_action_statistics(action_statistic),
                    config.risk_target,
                    config.action_risk_target,
                    level,
                    human=human,
                )
                if not res.feasible and config.on_infeasible != "abstain_all":
                    raise uncertifiable_joint(res, action, config.delta)
        if partial is not None and not res.feasible and config.on_infeasible != "abstain_all":
            raise UncertifiableTargetError(
                f"risk_target={config.risk_target:g} and partial_release_target="
                f"{partial.target:g} cannot be certified together at delta={delta:g} from "
                f"these {res.n} calibration answers (each at {res.delta:.3g}; the partial-"
                f"release band alone is +-{partial.margin:.3f} per distribution function). "
                "Raise a target or delta, calibrate on more answers, or set "
                "on_infeasible='abstain_all'."
            )
        if not res.feasible and config.on_infeasible != "abstain_all":
            raise _uncertifiable(scores, correct, res, delta, selection)
        for note in res.warnings:
            logger.warning("abstain_guard risk threshold: %s", note)
        guarantee: dict[str, Any] = {
            "kind": "risk",
            "statement": (
                f"with probability >= {1 - delta:g} over the calibration set, the "
                f"{'true ' if human is not None else ''}error rate among answered questions "
                f"is <= {res.risk_target:g}"
                + (_selection_text(selection, level) if selection is not None else "")
                + f"; {truth.labels_statement(res.reviewed, eligible=_eligible(human))}"
            ),
            "risk_target": res.risk_target,
            "delta": delta,
            "confidence": 1.0 - delta,
            "feasible": res.feasible,
            "certified_bound": res.certified_bound,
            "calibration_participation": res.participation,
            "calibration_risk": res.empirical_risk,
            "rank": res.rank,
            "n": res.n,
            "method": res.method,
            "warnings": list(res.warnings),
            **_labels_block(correct, human),
        }
        if selection is not None:
            guarantee["delta_per_candidate"] = level
            guarantee["selection"] = selection.summary()
        if action is not None:
            guarantee.update(
                action_guarantee(action, require_action_statistics(action_statistic), res)
            )
        if stream_first is not None:
            guarantee.update(
                partial_release_guarantee(
                    stream_first,
                    scores,
                    res.threshold,
                    partial.level if partial is not None else level,
                    partial,
                    res.delta,
                )
            )
        return DecisionRule(res.threshold, "risk", res.risk_target, guarantee)

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always", conformal.ConformalWarning)
        part = conformal.participation_threshold(scores, config.alpha)
    notes = list(part.warnings)
    threshold = part.threshold
    if part.infinite:
        need = conformal.min_calibration_size(config.alpha)
        if config.on_infeasible == "raise":
            raise InsufficientDataError(
                f"Participation {part.participation:g} needs at least {need} calibration "
                f"scores for a finite threshold (rank ⌈(1−α)(n+1)⌉ = {part.rank} > n = "
                f"{part.n}). Calibrate on more questions, lower the participation target, or "
                "set on_infeasible='answer_all' / 'abstain_all' to choose explicitly."
            )
        if config.on_infeasible == "abstain_all":
            threshold = -math.inf
            notes = [
                f"rank {part.rank} > n = {part.n}: on_infeasible='abstain_all', the guard "
                f"abstains on every question (needs n >= {need} for this target)."
            ]
    ties = conformal.ties_at_threshold(scores, threshold)
    if ties > 1:
        notes.append(
            f"{ties} calibration scores equal the threshold {threshold:g}: with tied scores "
            "participation can exceed the upper end of the guaranteed interval (a scorer "
            "with continuous scores avoids this)."
        )
    guarantee = {
        "kind": "participation",
        "statement": (
            f"P(answered) is in [{part.interval.lower:g}, {part.interval.upper:g}) for an "
            "exchangeable test question"
        ),
        "participation": part.participation,
        "alpha": part.alpha,
        "participation_interval": [part.interval.lower, part.interval.upper],
        "rank": part.rank,
        "n": part.n,
        "infinite_threshold": part.infinite,
        "on_infeasible": config.on_infeasible if part.infinite else None,
        "ties_at_threshold": ties,
    }
    try:
        cb = conformal.conditional_correctness_bound(scores, correct, config.alpha)
    except InsufficientDataError as exc:
        notes.append(f"conditional-correctness bound unavailable: {exc}")
        guarantee["conditional_correctness_bound"] = None
    else:
        notes.extend(n for n in cb.warnings if n not in notes)
        guarantee.update(
            {
                "conditional_correctness_bound": cb.bound,
                "coverage_correct": cb.coverage_correct,
                "beta": cb.beta,
                "sigma": _finite_or_none(cb.sigma),
                "accuracy": cb.accuracy,
                "c": cb.c,
            }
        )
    if selection is not None:
        guarantee["selection"] = _participation_selection(selection, config.delta, part)
    if stream_first is not None and math.isfinite(threshold):
        level = config.delta / (selection.n_candidates if selection is not None else 1)
        guarantee.update(
            partial_release_guarantee(stream_first, scores, threshold, level, None, 0.0)
        )
    guarantee.update(_labels_block(correct, human))
    guarantee["warnings"] = notes
    for note in notes:
        logger.warning("abstain_guard participation threshold: %s", note)
    return DecisionRule(threshold, "participation", part.participation, guarantee)


def _eligible(human: ArrayLike | None) -> int | None:
    """Answers a scoped review could draw (None: every answer could be)."""
    h = None if human is None else np.asarray(human)
    return None if h is None or not (h == truth.OUT_OF_SCOPE).any() else int((h >= -1).sum())


def _labels_block(correct: ArrayLike, human: ArrayLike | None) -> dict[str, Any]:
    """What the guarantee's labels are (``labels``: "human" or "judge", ``reviewed``: m) and,
    with a review, the judge's quality measured on it (:func:`.truth.judge_quality`). In
    participation mode the participation guarantee needs no labels; its correctness bound
    is on the judge's labels either way."""
    reviewed = 0 if human is None else int((np.asarray(human) >= 0).sum())
    out: dict[str, Any] = {"labels": "human" if reviewed else "judge", "reviewed": reviewed}
    if reviewed:
        out["judge_quality"] = truth.judge_quality(correct, human).to_json()  # type: ignore[arg-type]
    return out


def _participation_selection(
    selection: ScorerSelection, delta: float, part: conformal.ParticipationThreshold
) -> dict[str, Any]:
    """What a participation guarantee says about a scorer chosen on its calibration data: the
    interval assumes a scorer fixed beforehand; with probability >= 1-δ over the calibration
    set the participation is at least the Beta(k, n+1-k) quantile at δ/K, for every
    candidate at once (:func:`abstain_guard.guarantee.selection.participation_lower_bound`)."""
    level = delta / selection.n_candidates
    lower = participation_lower_bound(part.rank, part.n, level)
    return {
        **selection.summary(),
        "delta": delta,
        "delta_per_candidate": level,
        "participation_lower_bound": lower,
        "statement": (
            f"{selection.account()}: with probability >= {1 - delta:g} over the calibration set, "
            f"P(answered) >= {lower:.4g} (every candidate at delta/{selection.n_candidates}); "
            "the interval above assumes a scorer fixed before calibration, and so does the "
            "conditional-correctness bound, which is not adjusted for the choice (risk mode "
            "certifies the error rate among answered questions at delta/K)"
        ),
        "correctness_bound_adjusted": False,
    }
