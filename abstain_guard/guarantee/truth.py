"""The certificate on the truth: a judge's labels on every calibration answer plus a human
verdict on a uniformly random sample of them.

At each rank the reviewed answers' own binomial test and the two-phase (double sampling)
test on a bound of the true error count run at half the rank's level each
(:func:`combined_rejections`); validity needs nothing of the judge. The tests, why they are
valid and the simulation that fixed :data:`MISS_SHARE` and :data:`REVIEWED_SHARE`:
docs/guarantees.md, section 5. With no review the judge's labels are certified, and the
statement says so (:func:`labels_statement`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats

from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee.risk_control import RiskPlan, plan_tests

#: Value of an answer no person reviewed in a human-label array (1 = correct, 0 = wrong).
NOT_REVIEWED = -1

#: Value of an answer outside the review's scope: a review drawn from the most confident
#: answers only (``review_scope``) could not have drawn it. Ranks with such an answer below
#: them are never certified (the reviewed ones would not be a uniform sample there).
OUT_OF_SCOPE = -2

MISS_SHARE = 0.5
"""w: the share of the two-phase test's level spent on the bound of the judge's misses (the
rest on the binomial test of the bounded error count); fixed before any data."""

REVIEWED_SHARE = 0.5
"""s: the share of each rank's level spent on the reviewed answers' own test (the rest: the
two-phase test); fixed before any data."""


def plan_on_reviewed(
    method: str, risk_target: float, delta: float, sorted_truth: NDArray[np.integer]
) -> RiskPlan:
    """The plan of ``method`` (:func:`.risk_control.plan_tests`) made for the m reviewed
    answers, its ranks moved onto the whole calibration order: reviewed rank r becomes the
    first rank with r reviewed answers below it (scores and draw only, never a label)."""
    positions = np.flatnonzero(np.asarray(sorted_truth) >= 0)
    base = plan_tests(method, risk_target, delta, int(positions.size))
    n = int(np.shape(sorted_truth)[-1])
    ranks = sorted(
        {int(positions[r - 1]) + 2 for r in base.ranks if int(positions[r - 1]) + 2 <= n}
    )
    return RiskPlan(base.method, base.kind, tuple(ranks), base.level)


def check_human_labels(
    values: ArrayLike, n: int, *, require_reviewed: bool = True
) -> NDArray[np.int8]:
    """The human labels as int8 ``[n]``: 1 correct, 0 wrong, :data:`NOT_REVIEWED` (-1),
    :data:`OUT_OF_SCOPE` (-2).

    Raises:
        InvalidInputError: another shape, another value, or (``require_reviewed``) no
            reviewed answer at all.
    """
    arr = np.asarray(values)
    if arr.shape != (n,):
        raise InvalidInputError(
            f"human labels must have one entry per calibration answer, shape ({n},); got "
            f"{arr.shape}."
        )
    if arr.dtype.kind not in "biu" or not np.isin(arr, (OUT_OF_SCOPE, NOT_REVIEWED, 0, 1)).all():
        raise InvalidInputError(
            "human labels must be 1 (correct), 0 (wrong), -1 (not reviewed) or -2 (outside "
            "the review's scope), as integers."
        )
    out = arr.astype(np.int8)
    if require_reviewed and not (out >= 0).any():
        raise InvalidInputError("human labels hold no reviewed answer (all -1).")
    return out


def miss_upper_bound(
    misses: NDArray[np.integer],
    reviewed: NDArray[np.integer],
    population: NDArray[np.integer],
    level: float,
) -> NDArray[np.int64]:
    """Exact upper confidence bound of the misses M among ``population`` answers judged
    right, from ``misses`` among a uniformly random ``reviewed`` of them (elementwise):
    ``max{M : P(Hypergeom(population, M, reviewed) ≤ misses) ≥ level}``, so that
    ``P(M > bound) ≤ level``. Bisection over M (the tail grows as M falls)."""
    u = np.asarray(misses, dtype=np.int64)
    h = np.asarray(reviewed, dtype=np.int64)
    t0 = np.asarray(population, dtype=np.int64)
    lo = u.copy()  # P(X <= u | M = u) = 1
    hi = t0 - (h - u)  # unreviewed ones all missed
    while True:
        active = lo < hi
        if not active.any():
            return lo
        mid = (lo + hi + 1) // 2
        ok = stats.hypergeom.cdf(u, t0, np.where(active, mid, lo), h) >= level
        lo = np.where(active & ok, mid, lo)
        hi = np.where(active & ~ok, mid - 1, hi)


def _below(x: NDArray[Any]) -> NDArray[np.int64]:
    """Counts strictly before each position along the last axis."""
    x = np.asarray(x, dtype=np.int64)
    return np.cumsum(x, axis=-1) - x


def _bounded_errors(
    sorted_judge_errors: NDArray[np.integer], sorted_truth: NDArray[np.integer], level: float
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """``(z, t)`` at every rank: z bounds the true errors among the t answers below it
    (reviewed errors + unreviewed judged wrong + the misses' bound at ``level`` − the misses
    seen), ``[..., n]`` each (module docstring)."""
    j = np.asarray(sorted_judge_errors, dtype=np.int64)
    y = np.asarray(sorted_truth, dtype=np.int64)
    reviewed = y >= 0
    t = np.broadcast_to(np.arange(j.shape[-1]), j.shape)
    misses = _below(reviewed & (j == 0) & (y == 1))
    bound = miss_upper_bound(
        misses,
        _below(reviewed & (j == 0)),  # the reviewed among them
        t - _below(j),  # judged right below
        level,
    )
    z = _below(np.where(reviewed, y, 0)) + _below(~reviewed & (j == 1)) + bound - misses
    return z, np.asarray(t)


def truth_rejections(
    sorted_judge_errors: NDArray[np.integer],
    sorted_truth: NDArray[np.integer],
    risk_target: float,
    level: float,
    miss_share: float = MISS_SHARE,
) -> NDArray[np.bool_]:
    """The two-phase test of "the true error rate at U_(k) is > ε" at ``level`` for every
    rank, ``[..., n]`` → ``[..., n]`` bool: ``sorted_judge_errors`` 1 where the judge called
    the answer wrong, ``sorted_truth`` the true errors (1 wrong, 0 correct, -1 not reviewed,
    -2 outside the review's scope), both by score; ``miss_share`` w of ``level`` goes to the
    misses' bound."""
    z, t = _bounded_errors(sorted_judge_errors, sorted_truth, miss_share * level)
    outside = _below(np.asarray(sorted_truth) == OUT_OF_SCOPE) > 0  # the draw could not reach
    p = stats.binom.cdf(z, t, risk_target)
    out = np.asarray((p <= (1.0 - miss_share) * level) & ~outside)
    out[..., 0] = False  # no answers below rank 1
    return out


def reviewed_rejections(
    sorted_truth: NDArray[np.integer], risk_target: float, level: float
) -> NDArray[np.bool_]:
    """The reviewed answers' own rank test at ``level`` for every rank: ``P(Binomial(h, ε) ≤
    y) ≤ level`` with h reviewed answers below the rank and y of them wrong, ``[..., n]`` →
    ``[..., n]`` bool."""
    y = np.asarray(sorted_truth, dtype=np.int64)
    h = _below(y >= 0)
    wrong = _below(y == 1)
    outside = _below(y == OUT_OF_SCOPE) > 0
    p = np.where(h > 0, stats.binom.cdf(wrong, np.maximum(h, 1), risk_target), 1.0)
    return np.asarray((p <= level) & ~outside)


def combined_rejections(
    sorted_judge_errors: NDArray[np.integer],
    sorted_truth: NDArray[np.integer],
    risk_target: float,
    level: float,
    reviewed_share: float = REVIEWED_SHARE,
) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
    """The certificate's test at ``level`` for every rank: the two-phase test
    (:func:`truth_rejections`) at ``(1 − s)·level`` or the reviewed answers' own test
    (:func:`reviewed_rejections`) at ``s·level`` (s = ``reviewed_share``; a union bound, so
    the level holds). Returns ``(two_phase, reviewed)``; a rank is rejected where either is."""
    two = truth_rejections(
        sorted_judge_errors, sorted_truth, risk_target, (1.0 - reviewed_share) * level
    )
    own = reviewed_rejections(sorted_truth, risk_target, reviewed_share * level)
    return two, own


def certifying_test(
    sorted_judge_errors: NDArray[np.integer],
    sorted_truth: NDArray[np.integer],
    rank: int,
    level: float,
    risk_target: float,
) -> tuple[int, int, float]:
    """``(errors, trials, level)`` of the test that certified ``rank`` at ``level`` (for the
    reported Clopper-Pearson bound): the two-phase test's bounded error count over the
    rank−1 answers below, else the reviewed answers' errors over the reviewed below."""
    below = np.asarray(sorted_judge_errors)[:rank], np.asarray(sorted_truth)[:rank]
    two, _ = combined_rejections(*below, risk_target, level)  # counts below: rank's prefix
    if two[rank - 1]:
        share = (1.0 - REVIEWED_SHARE) * level
        z, _ = _bounded_errors(*below, MISS_SHARE * share)
        return int(z[rank - 1]), rank - 1, share * (1.0 - MISS_SHARE)
    y = np.asarray(sorted_truth)[: rank - 1]
    return int((y == 1).sum()), int((y >= 0).sum()), REVIEWED_SHARE * level


def truth_p_values(
    sorted_judge_errors: NDArray[np.integer],
    sorted_truth: NDArray[np.integer],
    risk_target: float,
    levels: Sequence[float],
) -> NDArray[np.float64]:
    """For every rank, the smallest of ``levels`` at which :func:`combined_rejections`
    rejects (1 where none does): a p-value valid at each of ``levels``, the only ones a plan
    of :mod:`.risk_control` compares it with."""
    p = np.ones(np.shape(sorted_judge_errors), dtype=np.float64)
    for a in sorted(set(float(x) for x in levels), reverse=True):
        two, own = combined_rejections(sorted_judge_errors, sorted_truth, risk_target, a)
        p = np.where(two | own, a, p)
    return p


@dataclass(frozen=True)
class JudgeQuality:
    """How the judge agrees with the people on the reviewed answers (all of them, answered
    or not), with exact 95 % Clopper-Pearson intervals and a bootstrap interval for κ.

    ``lenient_rate``: among truly wrong answers, the share the judge called right (the error
    that inflates a judge-only certificate); ``strict_rate``: among truly right answers,
    the share it called wrong."""

    m: int
    agreement: float
    agreement_ci: tuple[float, float]
    kappa: float
    kappa_ci: tuple[float, float]
    lenient_rate: float | None
    lenient_ci: tuple[float, float] | None
    strict_rate: float | None
    strict_ci: tuple[float, float] | None
    wrong: int
    right: int

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (intervals as lists; None where a class was not reviewed)."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            out[k] = list(v) if isinstance(v, tuple) else v
        return out


def _cp(k: int, n: int) -> tuple[float, float] | None:
    if n == 0:
        return None
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return (float(ci.low), float(ci.high))


def _kappas(j: NDArray[np.int64], y: NDArray[np.int64]) -> NDArray[np.float64]:
    """Cohen's κ of binary labels along the last axis (``[..., m]`` → ``[...]``; 1 where
    both raters give one class only and agree, 0 where chance agreement is total); the core
    needs no scikit-learn."""
    po = (j == y).mean(axis=-1)
    pj, py = j.mean(axis=-1), y.mean(axis=-1)
    pe = pj * py + (1 - pj) * (1 - py)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = (po - pe) / (1 - pe)
    return np.where(pe >= 1.0, np.where(po >= 1.0, 1.0, 0.0), k)


def judge_quality(
    judge_correct: ArrayLike, human: ArrayLike, *, resamples: int = 1000, seed: int = 0
) -> JudgeQuality:
    """The judge's agreement with the human labels ``[n]`` (:func:`check_human_labels`) of
    the reviewed answers, from its labels ``[n]`` (1 correct); κ's percentile interval from
    ``resamples`` seeded bootstrap draws."""
    jc = np.asarray(judge_correct).astype(np.int64)
    hl = check_human_labels(human, jc.size)
    keep = hl >= 0
    j, y = jc[keep], hl[keep].astype(np.int64)
    m = int(keep.sum())
    agree = int((j == y).sum())
    wrong = int((y == 0).sum())
    right = m - wrong
    lenient = int(((y == 0) & (j == 1)).sum())
    strict = int(((y == 1) & (j == 0)).sum())
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, m, size=(resamples, m))
    boot = _kappas(j[draws], y[draws])
    return JudgeQuality(
        m=m,
        agreement=agree / m,
        agreement_ci=_cp(agree, m) or (0.0, 1.0),
        kappa=float(_kappas(j, y)),
        kappa_ci=(float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))),
        lenient_rate=lenient / wrong if wrong else None,
        lenient_ci=_cp(lenient, wrong),
        strict_rate=strict / right if right else None,
        strict_ci=_cp(strict, right),
        wrong=wrong,
        right=right,
    )


def labels_statement(m: int, judge: str | None = None, eligible: int | None = None) -> str:
    """What "wrong" means in a certificate: the people's verdicts (with ``m`` reviewed,
    drawn among ``eligible`` answers when the review had a scope) or the judge's (m = 0)."""
    if m > 0:
        among = (
            f" among the {eligible} most confident calibration answers"
            if eligible is not None
            else ""
        )
        return (
            f"certified on human labels (m = {m} reviewed answers, a uniformly random sample"
            f"{among} drawn by the tool; the judge's labels on the others, corrected by the "
            "review)"
        )
    who = f" ({judge})" if judge else ""
    return (
        f"certified on the judge's labels{who}, not on the truth: no answer was reviewed by a "
        "person, so the judge's errors pass into the certificate"
    )
