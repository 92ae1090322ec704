"""Conformal abstention: thresholds and guarantees (paper section 3), pure numpy.

A *score* is an uncertainty (higher = less reliable): the guard answers when
``score <= threshold``. ``correct`` holds the calibration labels (1 = judged correct) and
``alpha`` is the abstention budget α (target participation 1−α). Inputs are validated
(:mod:`.validation`); errors are typed (:mod:`abstain_guard.errors`), never NaN. The
statements and their assumptions: ``docs/guarantees.md``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from abstain_guard.errors import InsufficientDataError, InvalidInputError
from abstain_guard.guarantee import risk_control, truth
from abstain_guard.guarantee.validation import check_labels, check_scores, require_both_classes

_RANK_RTOL = 1e-10  # rounding (1−α)(n+1) up: 0.8·10 = 8.000000000000002 is rank 8, not 9


class ConformalWarning(UserWarning):
    """A conformal computation succeeded but its result is degenerate (τ = ±∞)."""


@dataclass(frozen=True)
class ParticipationInterval:
    """The participation guarantee ``P(U ≤ τ) ∈ [lower, upper)`` (paper Eq. 4).

    Unpacks like a tuple: ``lower, upper = participation_interval(alpha, n)``.
    """

    lower: float
    upper: float

    def __iter__(self) -> Iterator[float]:
        return iter((self.lower, self.upper))


@dataclass(frozen=True)
class ParticipationThreshold:
    """Result of :func:`participation_threshold`: τ, the k-th smallest of n scores
    (k = ⌈(1−α)(n+1)⌉; ``infinite`` and τ = ``inf`` when k > n), its guaranteed
    ``interval`` and notes about degenerate results."""

    threshold: float
    rank: int
    n: int
    alpha: float
    interval: ParticipationInterval
    infinite: bool
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def participation(self) -> float:
        """The target participation 1−α."""
        return 1.0 - self.alpha


@dataclass(frozen=True)
class CorrectnessBound:
    """The paper's conditional-correctness bound, Eq. (8)-(9), with all of its parts:
    ``bound = coverage_correct / participation_upper * accuracy`` lower-bounds
    ``P(correct | answered)``, with c correct samples, m = ``retained_correct`` of them
    scored ≤ τ, 1−β = ``coverage_correct`` = m/(c+1), σ the m-th smallest correct score
    (``-inf`` when m = 0) and ``accuracy`` = c/n."""

    threshold: float
    alpha: float
    n: int
    c: int
    retained_correct: int
    coverage_correct: float
    beta: float
    sigma: float
    accuracy: float
    participation_upper: float
    bound: float
    warnings: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class RiskThreshold:
    """Result of :func:`risk_threshold`: with probability ≥ 1−δ over the calibration set,
    the error rate among answered questions at ``threshold`` is ≤ ``risk_target``.

    ``rank`` K answers the K most confident of ``n`` (``participation`` K/n,
    ``empirical_risk`` their error rate); ``certified_bound`` is the (1−``level``)
    Clopper-Pearson bound of the certifying test, ``p_value`` its p-value; ``min_rank`` the
    smallest rank the label-free plan can certify; ``reviewed`` the human labels used (0:
    the judge's labels are certified); ``arm`` which test certified (``"human"``: the
    reviewed answers' own, ``"judge"``: the judge's labels, corrected by the review when
    there is one). Infeasible: τ = ``-inf``, rank 0, bound 1.
    """

    threshold: float
    rank: int
    n: int
    risk_target: float
    delta: float
    participation: float
    empirical_risk: float
    certified_bound: float
    p_value: float
    feasible: bool
    min_rank: int
    method: str
    warnings: tuple[str, ...] = field(default_factory=tuple)
    level: float = 0.0
    reviewed: int = 0
    arm: str = ""


def _check_unit_interval(value: float, name: str, hint: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"{name} must be a number in (0, 1), got {value!r}. {hint}"
        ) from exc
    if not (0.0 < v < 1.0) or math.isnan(v):
        raise InvalidInputError(f"{name} must lie strictly between 0 and 1, got {v!r}. {hint}")
    return v


def _check_alpha(alpha: float) -> float:
    return _check_unit_interval(
        alpha,
        "alpha",
        "alpha is the abstention budget: alpha=0.2 targets 80% participation.",
    )


def _calibration(scores: ArrayLike, correct: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Validated calibration ``(scores [n] float64, correct [n] bool)`` with both classes."""
    s = check_scores(scores)
    j = check_labels(correct, s.size).astype(bool)
    require_both_classes(
        j,
        what="The calibration",
        hint="check the correctness judge, or calibrate on more (or harder) questions.",
    )
    return s, j


def conformal_rank(alpha: float, n: int) -> int:
    """k = ⌈(1−α)(n+1)⌉ (α the abstention budget, not the participation), the 1-based rank
    of the conformal threshold among ``n ≥ 1`` sorted scores; ``k > n``: τ = +inf."""
    alpha = _check_alpha(alpha)
    if int(n) < 1:
        raise InsufficientDataError(f"n must be at least 1, got {n}.")
    x = (1.0 - alpha) * (int(n) + 1)
    return max(1, math.ceil(x - _RANK_RTOL * x))


def min_calibration_size(alpha: float) -> int:
    """Smallest n with a finite participation threshold: ⌈(1−α)(n+1)⌉ ≤ n."""
    alpha = _check_alpha(alpha)
    n = max(1, math.ceil((1.0 - alpha) / alpha - 1e-9))
    while conformal_rank(alpha, n) > n:  # guard the float edge of the closed form
        n += 1
    return n


def ties_at_threshold(scores: ArrayLike, threshold: float) -> int:
    """How many calibration scores equal ``threshold`` exactly (0 for an infinite one)."""
    if not math.isfinite(threshold):
        return 0
    return int(np.count_nonzero(check_scores(scores) == threshold))


def participation_interval(alpha: float, n: int) -> ParticipationInterval:
    """``[1−α, 1−α+1/(n+1))``: ``P(U_{n+1} ≤ τ)`` for exchangeable questions with almost
    surely distinct scores (paper Eq. 4)."""
    alpha = _check_alpha(alpha)
    if int(n) < 1:
        raise InsufficientDataError(f"n must be at least 1, got {n}.")
    return ParticipationInterval(lower=1.0 - alpha, upper=1.0 - alpha + 1.0 / (int(n) + 1))


def _infinite_note(k: int, n: int, alpha: float) -> str:
    return (
        f"rank ⌈(1−α)(n+1)⌉ = {k} exceeds n = {n}: threshold is +inf and the guard will "
        f"answer every question. Use at least {math.ceil(1.0 / alpha) - 1} calibration "
        f"scores for alpha={alpha:g}, or a larger alpha."
    )


def participation_threshold(scores: ArrayLike, alpha: float) -> ParticipationThreshold:
    """τ = the ⌈(1−α)(n+1)⌉-th smallest of the scores ``[n]`` (paper Eq. 3); when that rank
    exceeds n, τ = ``inf`` with a :class:`ConformalWarning`."""
    alpha = _check_alpha(alpha)
    s = check_scores(scores)
    n = int(s.size)
    k = conformal_rank(alpha, n)
    notes: tuple[str, ...] = ()
    if k > n:
        tau = math.inf
        notes = (_infinite_note(k, n, alpha),)
        warnings.warn(notes[0], ConformalWarning, stacklevel=2)
    else:
        tau = float(np.partition(s, k - 1)[k - 1])
    return ParticipationThreshold(
        threshold=tau,
        rank=k,
        n=n,
        alpha=alpha,
        interval=participation_interval(alpha, n),
        infinite=k > n,
        warnings=notes,
    )


def conditional_correctness_bound(
    scores: ArrayLike, correct: ArrayLike, alpha: float
) -> CorrectnessBound:
    """The paper's lower bound on ``P(correct | answered)``, Eq. (8)-(9), from scores and
    labels ``[n]`` (both classes) at α: 1−β = m/(c+1) in closed form (docs/guarantees.md,
    section 2)."""
    alpha = _check_alpha(alpha)
    s, j = _calibration(scores, correct)
    n = int(s.size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConformalWarning)
        part = participation_threshold(s, alpha)
    tau = part.threshold
    u = np.sort(s[j])
    c = int(u.size)
    m = int(np.searchsorted(u, tau, side="right"))  # number of correct scores ≤ τ
    coverage = m / (c + 1)
    sigma = float(u[m - 1]) if m > 0 else -math.inf
    upper = part.interval.upper
    accuracy = c / n
    notes = list(part.warnings)
    if m == 0:
        notes.append(
            "No correct calibration answer has a score ≤ τ: 1−β = 0 and the bound is 0. "
            "The scorer does not separate correct answers at this participation level."
        )
    return CorrectnessBound(
        threshold=tau,
        alpha=alpha,
        n=n,
        c=c,
        retained_correct=m,
        coverage_correct=coverage,
        beta=1.0 - coverage,
        sigma=sigma,
        accuracy=accuracy,
        participation_upper=upper,
        bound=coverage / upper * accuracy,
        warnings=tuple(notes),
    )


@dataclass(frozen=True)
class _Ranked:
    """The calibration sorted for the rank tests (ties: incorrect answers first), ``[n]`` each;
    ``true_errors``: the reviewed answers' true errors (-1 / -2 kept), None without a review."""

    scores: np.ndarray
    errors: np.ndarray
    true_errors: np.ndarray | None


def _ranked(s: np.ndarray, j: np.ndarray, human: np.ndarray | None) -> _Ranked:
    order = np.lexsort((j.astype(np.int8), s))  # by score, then incorrect (0) before correct
    true_errors = None if human is None else np.where(human < 0, human, 1 - human)[order]
    return _Ranked(s[order], (~j[order]).astype(np.int64), true_errors)


def _infeasible(
    plan: risk_control.RiskPlan, n: int, eps: float, dlt: float, reviewed: int
) -> RiskThreshold:
    start = (
        f"the first test needs at least {plan.first_rank} samples and few errors among "
        "the most confident"
        if plan.ranks
        else f"no test on {n} samples can reject (a perfect scorer needs at least "
        f"{risk_control.min_rank(eps, dlt)})"
    )
    note = (
        f"No threshold certifies an error rate ≤ {eps:g} among answered questions with "
        f"confidence {1 - dlt:g} on these {n} calibration samples ({start}). The guard "
        "will abstain on everything. Raise risk_target or delta, calibrate on more data, "
        "or use a better scorer."
    )
    warnings.warn(note, ConformalWarning, stacklevel=3)
    return RiskThreshold(
        threshold=-math.inf,
        rank=0,
        n=n,
        risk_target=eps,
        delta=dlt,
        participation=0.0,
        empirical_risk=0.0,
        certified_bound=1.0,
        p_value=1.0,
        feasible=False,
        min_rank=plan.first_rank,
        method=plan.method,
        warnings=(note,),
        level=0.0,
        reviewed=reviewed,
    )


def _clopper_pearson(errors: int, trials: int, level: float) -> float:
    """The one-sided (1−level) upper bound of ``errors`` among ``trials``."""
    if errors >= trials:  # pragma: no cover - cannot be rejected, kept for safety
        return 1.0
    return float(stats.beta.ppf(1.0 - level, errors + 1, trials - errors))


def _certified(
    ranked: _Ranked,
    k: int,
    plan: risk_control.RiskPlan,
    test: truth.CertifyingTest,
    target: tuple[float, float],
) -> RiskThreshold:
    """The result at certified rank ``k``, from the test behind it; ``target``: (ε, δ)."""
    n = int(ranked.scores.size)
    reviewed = 0 if ranked.true_errors is None else int((ranked.true_errors >= 0).sum())
    return RiskThreshold(
        threshold=float(ranked.scores[k - 1]),
        rank=k,
        n=n,
        risk_target=target[0],
        delta=target[1],
        participation=k / n,
        empirical_risk=float(ranked.errors[:k].sum()) / k,
        certified_bound=_clopper_pearson(test.errors, test.trials, test.level),
        p_value=test.p_value,
        feasible=True,
        min_rank=plan.first_rank,
        method=plan.method,
        warnings=(),
        level=test.level,
        reviewed=reviewed,
        arm=test.arm,
    )


def _on_judge(
    ranked: _Ranked, method: str, eps: float, dlt: float, ceiling: float
) -> RiskThreshold:
    """The certificate on the judge's labels: Learn-then-Test over all ranks."""
    n = int(ranked.scores.size)
    plan = risk_control.plan_tests(method, eps, dlt, n)
    p_values = risk_control.rank_p_values(ranked.errors, eps)
    candidate = risk_control.candidate_ranks(ranked.scores) & (ranked.scores < ceiling)
    rank, level = risk_control.select_rank(plan, p_values, candidate)
    k = int(rank)
    if k == 0:
        return _infeasible(plan, n, eps, dlt, 0)
    errors = int(ranked.errors[: k - 1].sum())
    test = truth.CertifyingTest("judge", errors, k - 1, float(level), float(p_values[k - 1]))
    return _certified(ranked, k, plan, test, (eps, dlt))


def _on_truth(
    s: np.ndarray,
    j: np.ndarray,
    human: ArrayLike,
    eps: float,
    dlt: float,
    method: str,
    ceiling: float,
) -> RiskThreshold:
    """The certificate on the truth (:mod:`.truth`): the larger of the human-only and the
    judge-assisted thresholds; answers the review's planning read take no part."""
    h = truth.check_human_labels(human, s.size, require_reviewed=False)
    keep = h != truth.PLANNING
    ranked = _ranked(s[keep], j[keep], h[keep])
    assert ranked.true_errors is not None
    n, m = int(ranked.scores.size), int((h >= 0).sum())
    plan = truth.plan_truth(method, eps, dlt, n, m, int((h >= truth.NOT_REVIEWED).sum()))
    arms = truth.arm_ranks(plan, ranked.scores, ranked.errors, ranked.true_errors, eps, ceiling)
    k = int(arms.rank)
    if k == 0:
        return _infeasible(plan.human, n, eps, dlt, m)
    test = truth.certifying_test(arms, ranked.scores, ranked.errors, ranked.true_errors, eps)
    return _certified(ranked, k, plan.judge or plan.human, test, (eps, dlt))


def risk_threshold(
    scores: ArrayLike,
    correct: ArrayLike,
    risk_target: float,
    delta: float,
    method: str = risk_control.DEFAULT_RISK_METHOD,
    *,
    ceiling: float = math.inf,
    human: ArrayLike | None = None,
) -> RiskThreshold:
    """The largest threshold whose error rate among answered questions is ≤ ε w.p. ≥ 1−δ.

    Learn-then-Test over ranks with exact binomial p-values; ``method`` (a key of
    :data:`~abstain_guard.guarantee.risk_control.RISK_METHODS`) fixes which ranks are tested
    at which level before any label is read (docs/guarantees.md, section 3). ``ceiling``:
    only thresholds strictly below it are candidates (another certificate's bound,
    :mod:`.action_risk`), which keeps the guarantee. ``human``: people's verdicts on a
    uniformly random sample (:func:`.truth.check_human_labels`): the larger of the
    human-only and the judge-assisted thresholds on the truth is certified (:mod:`.truth`);
    ``correct`` stays the judge's labels.

    Returns:
        A :class:`RiskThreshold`; when nothing is certified the threshold is ``-inf``,
        ``feasible`` is False and a :class:`ConformalWarning` is issued.

    Raises:
        InvalidInputError: ε or δ outside (0, 1), an unknown method, bad scores or labels.
        InsufficientDataError: empty input or labels of one class only.
    """
    eps = _check_unit_interval(
        risk_target,
        "risk_target",
        "risk_target is the largest acceptable error rate among answered questions, e.g. 0.2.",
    )
    dlt = _check_unit_interval(
        delta, "delta", "delta is the allowed failure probability of the guarantee, e.g. 0.1."
    )
    s, j = _calibration(scores, correct)
    if human is not None:
        return _on_truth(s, j, human, eps, dlt, method, ceiling)
    return _on_judge(_ranked(s, j, None), method, eps, dlt, ceiling)
