"""The judge's agreement with the people on the reviewed answers, with exact intervals: what
every decision with a review reports in ``guarantee["judge_quality"]``
(docs/guarantees.md, section 5, "The judge's quality")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats

from abstain_guard.guarantee.truth import check_human_labels


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
