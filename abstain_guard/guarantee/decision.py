"""From calibration scores and a config to the rule the guard applies (a threshold on the
uncertainty score and the :class:`~.certificate.Certificate` it carries, participation or
risk mode; see ``docs/guarantees.md``), and the :class:`Decision` a rule makes on one
response."""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard.config import GuardConfig
from abstain_guard.errors import (
    ConfigError,
    InsufficientDataError,
    InvalidInputError,
    UncertifiableTargetError,
)
from abstain_guard.guarantee import conformal, truth
from abstain_guard.guarantee.action_risk import (
    ActionRiskCertificate,
    action_guarantee,
    joint_risk_threshold,
    require_action_statistics,
    uncertifiable_joint,
)
from abstain_guard.guarantee.certificate import Certificate, json_form, read_fields
from abstain_guard.guarantee.frontier import smallest_certifiable_risk
from abstain_guard.guarantee.judge_quality import judge_quality
from abstain_guard.guarantee.partial_release import (
    PartialReleaseCertificate,
    partial_release_certificate,
    partial_release_guarantee,
)
from abstain_guard.guarantee.selection import ScorerSelection, participation_lower_bound

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
        guarantee: what is guaranteed (see docs/guarantees.md).
    """

    threshold: float
    mode: str
    target: float
    guarantee: Certificate

    def answers(self, score: float) -> bool:
        """True when a response with this score is answered (``score <= threshold``)."""
        return bool(score <= self.threshold)


# --- the decision on one response --------------------------------------------------------

#: The keys of a decision the fallback's messages carry (not scored, no certificate).
_FALLBACK_KEYS = (
    "abstained",
    "score",
    "threshold",
    "scorer",
    "reason",
    "action",
    "certified",
    "continued_by",
    "gating",
    "tool_calls",
    "tool_steps",
    "stopped",
)
_TUPLES = ("tool_calls", "unknown_tool_calls")


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The guard's decision on one response (``response_metadata["abstention"]`` holds its
    :meth:`to_dict`, whose keys follow the fields' order; ``stopped`` only on a fallback's).

    Attributes:
        abstained: whether the response was withheld.
        score: its score (None: not scored).
        threshold: τ of the rule that decided.
        scorer: the scorer's name.
        reason, error: why (``"score <= threshold"``, ``"scoring failed"``, ...) and the
            error that prevented scoring (None: none).
        mode, target, guarantee: the rule's mode, target and certificate (None on a
            message a fallback made after the guard stopped the run: not decided).
        group, group_rule: with per-group rules, the question's group and whose rule
            decided (``"group"``, ``"pooled"`` or ``"abstain"``).
        step, step_score, run_statistic: step gating's model call (0-based), its own score
            and the run's running maximum the rule compared with τ.
        unknown_tool_calls: tool calls of the run whose step has no record.
        streaming: certified streaming's block (chunks decided and released).
        gating, tool_calls, tool_steps: an agent's gating, the call's tool names and the
            tool results before it.
        certified, action, review, continued_by: where an agent run went after a stop and
            whether it is still inside the certificate.
        model: on a decision of an answer the guard did not generate (``check``,
            ``abstain-guard score``), the fingerprint of the model whose calibration it
            relies on.
        stopped: on a fallback's message, the stopping decision's step, scores and τ.
        run_id: the monitor's key of the decision.
    """

    scorer: str = ""
    threshold: float | None = None
    mode: str | None = None
    target: float | None = None
    guarantee: Certificate | None = None
    group: str | None = None
    group_rule: str | None = None
    step: int | None = None
    step_score: float | None = None
    run_statistic: float | None = None
    unknown_tool_calls: tuple[str, ...] | None = None
    abstained: bool
    score: float | None
    reason: str = ""
    error: str | None = None
    streaming: Mapping[str, Any] | None = None
    gating: str | None = None
    tool_calls: tuple[str, ...] | None = None
    tool_steps: int | None = None
    certified: bool | None = None
    action: str | None = None
    review: str | None = None
    continued_by: str | None = None
    model: str | None = None
    run_id: str | None = None
    stopped: Mapping[str, Any] | None = None

    def replace(self, **changes: Any) -> Decision:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def _written(self, key: str) -> bool:
        if self.guarantee is None:
            return key in _FALLBACK_KEYS or getattr(self, key) is not None
        if key in _ALWAYS:
            return True
        if key == "group":
            return self.group_rule is not None
        if key in ("step_score", "run_statistic"):
            return self.step is not None
        return getattr(self, key) is not None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (what messages, traces, logs, journals and ``serve`` carry)."""
        keys = (*_FALLBACK_KEYS, "run_id") if self.guarantee is None else _DECISION_KEYS
        return {key: json_form(getattr(self, key)) for key in keys if self._written(key)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        """Read :meth:`to_dict`'s form back.

        Raises:
            InvalidInputError: a key no decision has, or a missing one.
        """
        values, unknown = read_fields(cls, data, _TUPLES)
        missing = sorted({"abstained", "score", "threshold", "scorer", "reason"} - set(data))
        if unknown or missing:
            raise InvalidInputError(
                f"not a guard decision: unknown keys {unknown}, missing keys {missing}"
            )
        if values.get("guarantee") is not None:
            values["guarantee"] = Certificate.from_dict(values["guarantee"])
        return cls(**values)


#: The JSON keys of a decision, in order; a field that does not apply is left out.
_DECISION_KEYS = tuple(f.name for f in dataclasses.fields(Decision) if f.name != "stopped")
#: The keys every decision of a rule writes (their None included).
_ALWAYS = frozenset(_DECISION_KEYS[:5]) | {"abstained", "score", "reason", "error"}


# --- the rule ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Calibration:
    """What a rule is computed from (:func:`decision_rule`'s arguments)."""

    scores: ArrayLike
    correct: ArrayLike
    selection: ScorerSelection | None = None
    action_statistic: ArrayLike | None = None
    stream_first: ArrayLike | None = None
    human: ArrayLike | None = None

    def level(self, delta: float) -> float:
        """δ per candidate scorer: δ/K after a selection, else δ."""
        return delta / self.selection.n_candidates if self.selection is not None else delta


def _uncertifiable(
    cal: _Calibration, res: conformal.RiskThreshold, delta: float
) -> UncertifiableTargetError:
    """The error for a risk target this calibration set cannot certify, naming the smallest
    one it can at the same delta (``res.delta`` is the level tested: δ/K after a selection)."""
    smallest = smallest_certifiable_risk(cal.scores, cal.correct, res.delta, cal.human)
    selection = cal.selection
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
    """The decision rule for ``config``'s target from calibration scores and labels.

    ``selection`` (the artifact's, :mod:`.selection`): risk mode certifies at δ/K and
    participation mode adds the PAC bound that accounts for the choice. ``stream_first``
    (each answer's first-chunk score under a chunk rule; ``scores`` are then the stream
    statistics): the guarantee carries the ``partial_release`` block (:mod:`.partial_release`).
    ``human`` (people's verdicts on a random sample, -1 not reviewed): risk mode certifies the
    true error rate (:mod:`.truth`) and the guarantee carries the judge's measured quality.
    """
    if config.partial_release_target is not None and stream_first is None:
        raise ConfigError(
            "partial_release_target needs an artifact calibrated with a chunk rule "
            "(calibrate with chunk_rule: 'sentence', 'clause' or 'tokens:K'); this one decides "
            "whole answers, which never release text before the decision"
        )
    cal = _Calibration(scores, correct, selection, action_statistic, stream_first, human)
    if config.mode == "risk":
        return _risk_rule(cal, config)
    return _participation_rule(cal, config)


# --- risk mode ---------------------------------------------------------------------------

_RiskTests = tuple[
    conformal.RiskThreshold, ActionRiskCertificate | None, PartialReleaseCertificate | None
]


def _risk_tests(cal: _Calibration, config: GuardConfig) -> _RiskTests:
    """The run-level risk threshold and, with their targets, the action-risk or
    partial-release certificate tested beside it (each at δ/2)."""
    assert config.risk_target is not None
    level = cal.level(config.delta)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always", conformal.ConformalWarning)
        if config.partial_release_target is not None:
            assert cal.stream_first is not None
            partial = partial_release_certificate(
                cal.stream_first, cal.scores, config.partial_release_target, level / 2
            )
            res = conformal.risk_threshold(
                cal.scores,
                cal.correct,
                config.risk_target,
                level / 2,
                ceiling=partial.ceiling,
                human=cal.human,
            )
            return res, None, partial
        if config.action_risk_target is None:
            res = conformal.risk_threshold(
                cal.scores, cal.correct, config.risk_target, level, human=cal.human
            )
            return res, None, None
        res, action = joint_risk_threshold(
            cal.scores,
            cal.correct,
            require_action_statistics(cal.action_statistic),
            config.risk_target,
            config.action_risk_target,
            level,
            human=cal.human,
        )
        return res, action, None


def _refuse_uncertifiable(cal: _Calibration, config: GuardConfig, tests: _RiskTests) -> None:
    """Raise when no threshold certifies the targets, unless ``on_infeasible="abstain_all"``."""
    res, action, partial = tests
    if res.feasible or config.on_infeasible == "abstain_all":
        return
    if action is not None:
        raise uncertifiable_joint(res, action, config.delta)
    if partial is not None:
        raise UncertifiableTargetError(
            f"risk_target={config.risk_target:g} and partial_release_target="
            f"{partial.target:g} cannot be certified together at delta={config.delta:g} from "
            f"these {res.n} calibration answers (each at {res.delta:.3g}; the partial-"
            f"release band alone is +-{partial.margin:.3f} per distribution function). "
            "Raise a target or delta, calibrate on more answers, or set "
            "on_infeasible='abstain_all'."
        )
    raise _uncertifiable(cal, res, config.delta)


def _risk_rule(cal: _Calibration, config: GuardConfig) -> DecisionRule:
    tests = _risk_tests(cal, config)
    _refuse_uncertifiable(cal, config, tests)
    res, action, partial = tests
    for note in res.warnings:
        logger.warning("abstain_guard risk threshold: %s", note)
    delta, level = config.delta, cal.level(config.delta)
    statement = (
        f"with probability >= {1 - delta:g} over the calibration set, the "
        f"{'true ' if cal.human is not None else ''}error rate among answered questions "
        f"is <= {res.risk_target:g}"
        + (_selection_text(cal.selection, level) if cal.selection is not None else "")
        + f"; {truth.labels_statement(res.reviewed, eligible=_eligible(cal.human))}"
    )
    certificate = Certificate(
        kind="risk",
        statement=statement,
        risk_target=res.risk_target,
        delta=delta,
        confidence=1.0 - delta,
        feasible=res.feasible,
        certified_bound=res.certified_bound,
        calibration_participation=res.participation,
        calibration_risk=res.empirical_risk,
        rank=res.rank,
        n=res.n,
        method=res.method,
        warnings=tuple(res.warnings),
        **_labels(cal),
        delta_per_candidate=level if cal.selection is not None else None,
        selection=cal.selection.summary() if cal.selection is not None else None,
        action_risk=(
            None
            if action is None
            else action_guarantee(action, require_action_statistics(cal.action_statistic), res)
        ),
        partial_release=(
            None
            if cal.stream_first is None
            else partial_release_guarantee(
                cal.stream_first,
                cal.scores,
                res.threshold,
                partial.level if partial is not None else level,
                partial,
                res.delta,
            )
        ),
    )
    return DecisionRule(res.threshold, "risk", res.risk_target, certificate)


# --- participation mode ------------------------------------------------------------------


def _participation_threshold(
    scores: ArrayLike, config: GuardConfig
) -> tuple[conformal.ParticipationThreshold, float, list[str]]:
    """The conformal threshold, τ after ``on_infeasible`` and the notes about them.

    Raises:
        InsufficientDataError: too few scores for a finite τ and ``on_infeasible="raise"``.
    """
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
    return part, threshold, notes


def _correctness_fields(cal: _Calibration, alpha: float, notes: list[str]) -> dict[str, Any]:
    """The conditional-correctness bound's certificate fields (its notes join ``notes``)."""
    try:
        cb = conformal.conditional_correctness_bound(cal.scores, cal.correct, alpha)
    except InsufficientDataError as exc:
        notes.append(f"conditional-correctness bound unavailable: {exc}")
        return {}
    notes.extend(n for n in cb.warnings if n not in notes)
    return {
        "conditional_correctness_bound": cb.bound,
        "coverage_correct": cb.coverage_correct,
        "beta": cb.beta,
        "sigma": _finite_or_none(cb.sigma),
        "accuracy": cb.accuracy,
        "c": cb.c,
    }


def _participation_rule(cal: _Calibration, config: GuardConfig) -> DecisionRule:
    part, threshold, notes = _participation_threshold(cal.scores, config)
    ties = conformal.ties_at_threshold(cal.scores, threshold)
    if ties > 1:
        notes.append(
            f"{ties} calibration scores equal the threshold {threshold:g}: with tied scores "
            "participation can exceed the upper end of the guaranteed interval (a scorer "
            "with continuous scores avoids this)."
        )
    correctness = _correctness_fields(cal, config.alpha, notes)
    partial = None
    if cal.stream_first is not None and math.isfinite(threshold):
        level = cal.level(config.delta)
        partial = partial_release_guarantee(
            cal.stream_first, cal.scores, threshold, level, None, 0.0
        )
    for note in notes:
        logger.warning("abstain_guard participation threshold: %s", note)
    certificate = Certificate(
        kind="participation",
        statement=(
            f"P(answered) is in [{part.interval.lower:g}, {part.interval.upper:g}) for an "
            "exchangeable test question"
        ),
        participation=part.participation,
        alpha=part.alpha,
        participation_interval=(part.interval.lower, part.interval.upper),
        rank=part.rank,
        n=part.n,
        infinite_threshold=part.infinite,
        on_infeasible=config.on_infeasible if part.infinite else None,
        ties_at_threshold=ties,
        **correctness,
        selection=(
            None
            if cal.selection is None
            else _participation_selection(cal.selection, config.delta, part)
        ),
        partial_release=partial,
        **_labels(cal),
        warnings=tuple(notes),
    )
    return DecisionRule(threshold, "participation", part.participation, certificate)


def _eligible(human: ArrayLike | None) -> int | None:
    """Answers a scoped review could draw (None: every answer could be)."""
    h = None if human is None else np.asarray(human)
    return None if h is None or not (h == truth.OUT_OF_SCOPE).any() else int((h >= -1).sum())


def _labels(cal: _Calibration) -> dict[str, Any]:
    """What the guarantee's labels are (``labels``: "human" or "judge", ``reviewed``: m) and,
    with a review, the judge's quality measured on it (:func:`.judge_quality.judge_quality`). In
    participation mode the participation guarantee needs no labels; its correctness bound
    is on the judge's labels either way."""
    human = cal.human
    reviewed = 0 if human is None else int((np.asarray(human) >= 0).sum())
    out: dict[str, Any] = {"labels": "human" if reviewed else "judge", "reviewed": reviewed}
    if reviewed:
        out["judge_quality"] = judge_quality(cal.correct, human).to_json()  # type: ignore[arg-type]
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
