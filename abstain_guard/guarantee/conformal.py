"""Conformal abstention: thresholds and guarantees (paper section 3), pure numpy.

Conventions: a *score* is an uncertainty (higher = less reliable); the guard answers when
``score <= threshold`` and abstains otherwise. ``correct`` holds the calibration labels
(1 = the model's answer was judged correct). ``alpha`` is always the abstention budget α
(the target participation is 1−α). All functions validate their inputs
(:mod:`abstain_guard.guarantee.validation`: finite scores, 0/1 labels) and raise typed errors from
:mod:`abstain_guard.errors`; they never return NaN.

Functions:

* :func:`participation_threshold` - τ = the ⌈(1−α)(n+1)⌉-th smallest score (paper Eq. 3).
* :func:`participation_interval` - the participation guarantee ``[1−α, 1−α+1/(n+1))``.
* :func:`conditional_correctness_bound` - the paper's Eq. (8)-(9), with all of its parts.
* :func:`risk_threshold` - the largest threshold whose error among answered questions is
  ≤ ε with probability ≥ 1−δ (Learn-then-Test over ranks, exact binomial tails; the
  procedures live in :mod:`abstain_guard.guarantee.risk_control`).

See ``docs/guarantees.md`` for the statements and their assumptions.
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

__all__ = [
    "ConformalWarning",
    "CorrectnessBound",
    "ParticipationInterval",
    "ParticipationThreshold",
    "RiskThreshold",
    "conditional_correctness_bound",
    "conformal_rank",
    "participation_interval",
    "participation_threshold",
    "risk_threshold",
]

_RANK_RTOL = 1e-10
"""Relative tolerance when rounding (1−α)(n+1) up, so that 0.8·10 = 8.000000000000002
gives rank 8, not 9 (floating-point noise must not cost a whole rank)."""


class ConformalWarning(UserWarning):
    """A conformal computation succeeded but its result is degenerate (τ = ±∞)."""


# --- results -----------------------------------------------------------------------------


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
    """Result of :func:`participation_threshold`.

    Attributes:
        threshold: τ; ``inf`` when ``rank > n`` (the guard then answers everything).
        rank: k = ⌈(1−α)(n+1)⌉, the 1-based rank of τ among the sorted scores.
        n: number of calibration scores.
        alpha: the abstention budget α (target participation is 1−α).
        interval: the guaranteed participation interval ``[1−α, 1−α+1/(n+1))``.
        infinite: True when ``rank > n`` (too few calibration scores for this α).
        warnings: human-readable notes about degenerate results (empty when all is well).
    """

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
    """The paper's conditional-correctness bound, Eq. (8)-(9), with all of its parts.

    ``bound = coverage_correct / participation_upper * accuracy`` lower-bounds
    ``P(J = 1 | U ≤ τ)`` (correct given answered).

    Attributes:
        threshold: τ (from :func:`participation_threshold` at the same α).
        alpha: the abstention budget α.
        n: number of calibration samples.
        c: number of correct calibration samples (|𝒰|).
        retained_correct: m = #{correct samples with score ≤ τ}.
        coverage_correct: 1−β = sup{q : Quantile(⌈q(c+1)⌉/c, 𝒰) ≤ τ} = m/(c+1).
        beta: β = 1 − coverage_correct.
        sigma: σ = the m-th smallest correct score (``-inf`` when m = 0).
        accuracy: c/n.
        participation_upper: 1−α+1/(n+1), the upper end of the participation interval.
        bound: (1−β)/(1−α+1/(n+1)) · c/n.
        warnings: notes about degenerate results.
    """

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
    """Result of :func:`risk_threshold`.

    With probability ≥ 1−δ over the calibration set, the error rate among answered
    questions at ``threshold`` is ≤ ``risk_target`` (see ``docs/guarantees.md``).

    Attributes:
        threshold: the chosen τ; ``-inf`` when no threshold could be certified
            (``feasible`` is False and the guard abstains on everything).
        rank: K, the number of calibration samples with score ≤ τ (0 when infeasible).
        n: number of calibration samples.
        risk_target: ε, the maximal error rate among answered questions.
        delta: δ, the allowed probability that the certificate is wrong.
        participation: K/n, the fraction answered on the calibration set.
        empirical_risk: errors among the K answered calibration samples / K
            (0.0 when infeasible).
        certified_bound: the (1−level) Clopper-Pearson upper bound on the risk at τ from
            the tested statistic (≤ ε whenever feasible; 1.0 when infeasible).
        p_value: the exact binomial p-value of the certifying test (1.0 when infeasible).
        feasible: whether a threshold was certified.
        min_rank: the smallest rank the procedure can certify, fixed before the labels are
            read (the first chain start or grid rank; 0 when no rank ≤ n can be certified).
        method: the procedure's name, a key of
            :data:`abstain_guard.guarantee.risk_control.RISK_METHODS`.
        warnings: notes about degenerate results.
        level: the significance level the certifying test was run at (δ for one chain,
            δ/s for one of s chains, δ/m on a Bonferroni grid, Holm's step level; 0.0
            when infeasible). ``certified_bound`` is the (1−level) upper bound.
        reviewed: m, the answers with a human label the certificate used (0: it certifies
            the judge's labels; > 0: the true error rate, :mod:`.truth`).
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


# --- validation --------------------------------------------------------------------------


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


# --- participation -----------------------------------------------------------------------


def conformal_rank(alpha: float, n: int) -> int:
    """k = ⌈(1−α)(n+1)⌉: the 1-based rank of the conformal threshold among ``n`` sorted
    calibration scores; ``k > n`` means τ = +inf (answer everything).

    Args:
        alpha: the abstention budget α in (0, 1), *not* the participation: a caller holding a
            participation target ``p = 1−α`` (the resplit simulation) passes ``1 − p``.
        n: number of calibration scores, at least 1.

    (1−α)(n+1) is rounded up with a relative slack of ``_RANK_RTOL``, so that float noise
    (``(1 − 0.2)·10 = 8.000000000000002``, ``(1 − 0.3)·10 = 7.000000000000001``) does not
    cost a whole rank.
    """
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
    """The participation guarantee ``[1−α, 1−α+1/(n+1))`` for n calibration scores.

    For exchangeable calibration and test questions with almost surely distinct scores,
    ``P(U_{n+1} ≤ τ)`` lies in this interval (paper Eq. 4).
    """
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
    """τ = the ⌈(1−α)(n+1)⌉-th smallest calibration score (paper Eq. 3).

    Args:
        scores: calibration uncertainty scores, shape ``[n]``, finite.
        alpha: abstention budget in (0, 1); the target participation is 1−α.

    Returns:
        A :class:`ParticipationThreshold`. When the rank exceeds n the threshold is
        ``inf``, ``infinite`` is True and a :class:`ConformalWarning` is issued.
    """
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


# --- conditional correctness ---------------------------------------------------------------


def conditional_correctness_bound(
    scores: ArrayLike, correct: ArrayLike, alpha: float
) -> CorrectnessBound:
    """The paper's lower bound on ``P(correct | answered)``, Eq. (8)-(9).

    With 𝒰 the scores of the c correct calibration samples and τ the participation
    threshold at α, 1−β = sup{q ∈ (0,1) : Quantile(⌈q(c+1)⌉/c, 𝒰) ≤ τ}. The
    ⌈q(c+1)⌉-th smallest element of 𝒰 is ≤ τ exactly when ⌈q(c+1)⌉ ≤ m (m = number of
    correct scores ≤ τ), so the supremum is m/(c+1) (0 when m = 0), and
    σ = Quantile(⌈(1−β)(c+1)⌉/c, 𝒰) is the m-th smallest correct score.

    Args:
        scores: calibration scores, shape ``[n]``.
        correct: calibration labels (0/1), shape ``[n]``; both classes must occur.
        alpha: abstention budget in (0, 1).

    Returns:
        A :class:`CorrectnessBound` with every part of the bound.
    """
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


# --- risk control ------------------------------------------------------------------------


def _min_rank(risk_target: float, delta: float) -> int:
    """Smallest rank k whose test (k−1 trials, 0 errors) can reject: (1−ε)^(k−1) ≤ δ."""
    return risk_control.min_rank(risk_target, delta)


def plan_levels(plan: risk_control.RiskPlan) -> list[float]:
    """Every level ``plan`` compares a p-value with: its one level, or Holm's δ/m … δ."""
    if plan.kind != "holm":
        return [plan.level]
    m = len(plan.ranks)
    return [plan.level * m / (m - j) for j in range(m)]


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

    Learn-then-Test over ranks: sort the calibration scores (ties: incorrect answers
    first); rank k answers the k lowest scores, threshold ``U_(k)``. Its null hypothesis
    "risk at U_(k) > ε" is tested with the exact binomial p-value
    ``P(Binomial(k−1, ε) ≤ e_k)``, e_k the errors among the k−1 answers strictly below
    U_(k) (conditionally on U_(k) they are i.i.d. draws from the answered region). A
    procedure fixed before the labels are read (``method``, see
    :mod:`abstain_guard.guarantee.risk_control` for each one and why it is valid) decides which
    ranks are tested at which level; the threshold is the largest rejected rank. Only ends of tie
    groups are candidates. See ``docs/guarantees.md`` for the guarantee, its assumptions
    and the simulation that chose the default.

    Args:
        scores: calibration scores, shape ``[n]``.
        correct: calibration labels (0/1), shape ``[n]``; both classes must occur.
        risk_target: ε in (0, 1), the largest acceptable error rate among answered.
        delta: δ in (0, 1), the allowed failure probability of the certificate.
        method: the procedure, a key of :data:`abstain_guard.guarantee.risk_control.RISK_METHODS`;
            ``"fixed_sequence"`` is the original one.
        ceiling: only thresholds strictly below it are candidates (another certificate's
            bound, :mod:`abstain_guard.guarantee.action_risk`): a rank at or above it fails its
            test, so a chain stops there and the rejected ranks are a subset of those without it —
            the guarantee is unchanged, whatever data the ceiling came from.
        human: people's verdicts on a uniformly random sample of these answers (1 correct,
            0 wrong, -1 not reviewed; :mod:`abstain_guard.guarantee.truth`): the ranks are
            then tested on a bound of the *true* error count (the two-phase test), so the
            certificate is about the truth, not the judge; ``correct`` stays the judge's
            labels of every answer.

    Returns:
        A :class:`RiskThreshold`; when no threshold can be certified the threshold is
        ``-inf`` (abstain on everything), ``feasible`` is False and a
        :class:`ConformalWarning` is issued.

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
    n = int(s.size)
    plan = risk_control.plan_tests(method, eps, dlt, n)

    order = np.lexsort((j.astype(np.int8), s))  # by score, then incorrect (0) before correct
    s_sorted = s[order]
    err_sorted = (~j[order]).astype(np.int64)
    truth_sorted = None
    if human is None:
        p_values = risk_control.rank_p_values(err_sorted, eps)
    else:
        h = truth.check_human_labels(human, n, require_reviewed=False)
        truth_sorted = np.where(h < 0, h, 1 - h)[order]  # errors; -1 / -2 kept
        plan = truth.plan_on_reviewed(method, eps, dlt, truth_sorted)
        p_values = truth.truth_p_values(err_sorted, truth_sorted, eps, plan_levels(plan))
    if ceiling < math.inf:
        p_values = np.where(s_sorted < ceiling, p_values, 1.0)
    rank, level = risk_control.select_rank(plan, p_values, risk_control.candidate_ranks(s_sorted))
    k = int(rank)

    if k == 0:
        start = (
            f"the first test needs at least {plan.first_rank} samples and few errors among "
            "the most confident"
            if plan.ranks
            else f"no test on {n} samples can reject (a perfect scorer needs at least "
            f"{_min_rank(eps, dlt)})"
        )
        note = (
            f"No threshold certifies an error rate ≤ {eps:g} among answered questions with "
            f"confidence {1 - dlt:g} on these {n} calibration samples ({start}). The guard "
            "will abstain on everything. Raise risk_target or delta, calibrate on more data, "
            "or use a better scorer."
        )
        warnings.warn(note, ConformalWarning, stacklevel=2)
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
            reviewed=0 if human is None else int((np.asarray(human) >= 0).sum()),
        )

    errors_below = int(err_sorted[: k - 1].sum())
    trials = k - 1
    tested_level = float(level)
    reviewed = 0
    if truth_sorted is not None:  # the test that certified: its errors, trials and level
        errors_below, trials, tested_level = truth.certifying_test(
            err_sorted, truth_sorted, k, tested_level, eps
        )
        reviewed = int((truth_sorted >= 0).sum())
    if errors_below >= trials:  # pragma: no cover - cannot be rejected, kept for safety
        cp_upper = 1.0
    else:
        cp_upper = float(
            stats.beta.ppf(1.0 - tested_level, errors_below + 1, trials - errors_below)
        )
    return RiskThreshold(
        threshold=float(s_sorted[k - 1]),
        rank=k,
        n=n,
        risk_target=eps,
        delta=dlt,
        participation=k / n,
        empirical_risk=float(err_sorted[:k].sum()) / k,
        certified_bound=cp_upper,
        p_value=float(p_values[k - 1]),
        feasible=True,
        min_rank=plan.first_rank,
        method=plan.method,
        warnings=(),
        level=float(level),
        reviewed=reviewed,
    )
