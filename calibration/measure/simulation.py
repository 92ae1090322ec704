"""The conformal resplit simulation: does the guarantee hold on held-out answers? ``R``
random calibration/test splits of the labeled set, all participation levels ``1−α`` and all
resplits at once on ``[R, n]`` matrices; the threshold's rank from
:func:`abstain_guard.guarantee.conformal.conformal_rank`. The paper's quantities (Eq. 8, 9):
docs/results.md, "The conformal resplit simulation"."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from abstain_guard.errors import InsufficientDataError, InvalidInputError
from abstain_guard.guarantee.conformal import conformal_rank
from abstain_guard.guarantee.validation import check_labels, check_scores

DEFAULT_LEVELS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# Upper bound on booleans materialised per chunk of resplits ([B, n, levels]).
_CHUNK_ELEMENTS = 8_000_000


def level_key(level: float) -> str:
    """The JSON key of a participation level: ``0.1 -> "0.1"``, ``0.25 -> "0.25"``."""
    return f"{float(level):g}"


def _rank(level: float, n: int) -> int:
    """The threshold's rank among ``n`` calibration scores for participation ``level = 1−α``."""
    return conformal_rank(1.0 - float(level), n)


def check_levels(levels: Sequence[float]) -> NDArray[np.float64]:
    """Validated participation targets ``1−α`` ``[levels]``, each strictly inside (0, 1)."""
    arr = np.asarray(levels, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise InvalidInputError("levels must be a non-empty list of participation targets 1−α.")
    if not np.all((arr > 0) & (arr < 1)):
        raise InvalidInputError(
            f"participation levels 1−α must lie strictly between 0 and 1; got {arr.tolist()}."
        )
    return arr


def _split_sizes(n: int, calibration_fraction: float) -> tuple[int, int]:
    if not 0.0 < calibration_fraction < 1.0:
        raise InvalidInputError(
            f"calibration_fraction must be in (0, 1), got {calibration_fraction}."
        )
    n_cal = round(calibration_fraction * n)
    if n_cal < 1 or n - n_cal < 1:
        raise InsufficientDataError(
            f"cannot split {n} labeled responses into a calibration part ({n_cal}) and a test "
            "part (both need at least one); label more responses."
        )
    return n_cal, n - n_cal


def resplit_permutations(
    n: int, n_resplits: int, seed: int | np.random.Generator = 0, chunk_size: int | None = None
) -> Iterator[NDArray[np.intp]]:
    """Yield the random orderings of the resplit simulation, ``[B, n]`` int arrays in chunks
    (``B ≤ chunk_size``) that together hold ``n_resplits`` rows.

    Row ``r`` is ``argsort`` of ``n`` uniform draws, so the rows are independent uniform
    permutations; the first ``n_cal`` entries of a row are its calibration indices. The rows do
    not depend on ``chunk_size`` (the generator's stream is consumed row by row).
    """
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    step = n_resplits if chunk_size is None else max(1, int(chunk_size))
    done = 0
    while done < n_resplits:
        b = min(step, n_resplits - done)
        yield np.argsort(rng.random((b, n)), axis=1, kind="stable")
        done += b


@dataclass(frozen=True)
class ResplitArrays:
    """Per-resplit results of the simulation; every array is ``[R, levels]``.

    Attributes:
        levels: ``[levels]`` participation targets ``1−α``.
        n_calibration, n_test: split sizes.
        threshold: ``τ`` per resplit (``+inf`` where the rank exceeds ``n_calibration``).
        participation: fraction of test questions answered (``u ≤ τ``).
        n_answered: number of test questions answered.
        conditional_correctness: accuracy among answered test questions (NaN: none answered).
        one_minus_beta: the paper's ``1−β`` from the calibration half.
        bound: the paper's conditional-correctness bound from the calibration half.
        calibration_accuracy: ``[R]`` ``c/n`` of the calibration half.
    """

    levels: NDArray[np.float64]
    n_calibration: int
    n_test: int
    threshold: NDArray[np.float64]
    participation: NDArray[np.float64]
    n_answered: NDArray[np.int64]
    conditional_correctness: NDArray[np.float64]
    one_minus_beta: NDArray[np.float64]
    bound: NDArray[np.float64]
    calibration_accuracy: NDArray[np.float64]


def _simulate_chunk(
    scores: NDArray[np.float64],
    correct: NDArray[np.int64],
    perms: NDArray[np.intp],
    levels: NDArray[np.float64],
    ranks: NDArray[np.int64],
    n_cal: int,
) -> dict[str, NDArray[Any]]:
    """The simulation for one chunk of resplits ``perms [B, n]``; arrays ``[B, levels]``."""
    s = scores[perms]  # [B, n]
    y = correct[perms].astype(bool)  # [B, n]
    cal_s, cal_y = s[:, :n_cal], y[:, :n_cal]
    test_s, test_y = s[:, n_cal:], y[:, n_cal:]
    n_test = test_s.shape[1]
    b = perms.shape[0]

    sorted_cal = np.sort(cal_s, axis=1)  # [B, n_cal]
    finite = ranks <= n_cal  # [L]
    tau = np.full((b, levels.size), np.inf)
    tau[:, finite] = sorted_cal[:, ranks[finite] - 1]

    answered = test_s[:, :, None] <= tau[:, None, :]  # [B, n_test, L]
    n_answered = answered.sum(axis=1)  # [B, L]
    n_answered_correct = (answered & test_y[:, :, None]).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cond = np.where(n_answered > 0, n_answered_correct / np.maximum(n_answered, 1), np.nan)

    c = cal_y.sum(axis=1)  # [B]
    m = ((cal_s[:, :, None] <= tau[:, None, :]) & cal_y[:, :, None]).sum(axis=1)  # [B, L]
    one_minus_beta = m / (c[:, None] + 1.0)  # with τ = +inf, m = c: 1−β = c/(c+1)
    bound = one_minus_beta / (levels[None, :] + 1.0 / (n_cal + 1)) * (c[:, None] / n_cal)
    return {
        "threshold": tau,
        "participation": n_answered / n_test,
        "n_answered": n_answered.astype(np.int64),
        "conditional_correctness": cond,
        "one_minus_beta": one_minus_beta,
        "bound": bound,
        "calibration_accuracy": c / n_cal,
    }


def resplit_arrays(
    scores: ArrayLike,
    correct: ArrayLike,
    levels: Sequence[float] = DEFAULT_LEVELS,
    n_resplits: int = 1000,
    calibration_fraction: float = 0.5,
    seed: int | np.random.Generator = 0,
    chunk_size: int | None = None,
) -> ResplitArrays:
    """The per-resplit arrays of the simulation on ``scores [n]`` (higher = more uncertain;
    ``+inf`` allowed) and 0/1 ``correct [n]``, for participation targets ``levels`` (1−α);
    the calibration half holds ``round(calibration_fraction·n)`` responses. ``chunk_size``
    resplits are processed at once (default: as many as keep the ``[B, n, levels]`` boolean
    temporaries under ~8 M elements); it does not change the result.

    Raises:
        InvalidInputError: NaN scores, bad labels or levels, ``n_resplits < 1``.
        InsufficientDataError: fewer than 2 responses.
    """
    s = check_scores(scores, name="scores", allow_inf=True)
    y = check_labels(correct, s.size)
    lv = check_levels(levels)
    if int(n_resplits) < 1:
        raise InvalidInputError(f"n_resplits must be at least 1, got {n_resplits}.")
    n = s.size
    n_cal, n_test = _split_sizes(n, calibration_fraction)
    ranks = np.array([_rank(p, n_cal) for p in lv], dtype=np.int64)
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // (n * lv.size))
    parts = [
        _simulate_chunk(s, y, perms, lv, ranks, n_cal)
        for perms in resplit_permutations(n, int(n_resplits), seed, chunk_size)
    ]
    joined = {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}
    return ResplitArrays(levels=lv, n_calibration=n_cal, n_test=n_test, **joined)


def _mean_sd(x: NDArray[np.float64]) -> tuple[float, float]:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return float("nan"), float("nan")
    return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else 0.0


def resplit_simulation(
    scores: ArrayLike,
    correct: ArrayLike,
    levels: Sequence[float] = DEFAULT_LEVELS,
    n_resplits: int = 1000,
    calibration_fraction: float = 0.5,
    seed: int | np.random.Generator = 0,
    chunk_size: int | None = None,
) -> dict[str, Any]:
    """The paper's conformal-abstention experiment (paper Figures 2 and 7), arguments as
    :func:`resplit_arrays`: ``{"n", "n_calibration", "n_test", "n_resplits",
    "calibration_fraction", "seed", "accuracy", "levels": {level_key: summary}}``; what each
    level's summary holds: docs/results.md, 'The conformal resplit simulation'."""
    arr = resplit_arrays(
        scores, correct, levels, n_resplits, calibration_fraction, seed, chunk_size
    )
    y = check_labels(correct)
    out_levels = {level_key(float(p)): _level_summary(arr, j) for j, p in enumerate(arr.levels)}
    return {
        "n": int(y.size),
        "n_calibration": arr.n_calibration,
        "n_test": arr.n_test,
        "n_resplits": arr.participation.shape[0],
        "calibration_fraction": float(calibration_fraction),
        "seed": seed if isinstance(seed, int) else None,
        "accuracy": float(y.mean()),
        "levels": out_levels,
    }


def _level_summary(arr: ResplitArrays, j: int) -> dict[str, Any]:
    """The summary of level ``j`` over the resplits."""
    p = float(arr.levels[j])
    n_cal, r = arr.n_calibration, arr.participation.shape[0]
    k = _rank(p, n_cal)
    lo, hi = p, p + 1.0 / (n_cal + 1)
    part_mean, part_sd = _mean_sd(arr.participation[:, j])
    part_se = part_sd / math.sqrt(r)
    cc = arr.conditional_correctness[:, j]
    has = np.isfinite(cc)
    cc_mean, cc_sd = _mean_sd(cc)
    b_mean, b_sd = _mean_sd(arr.bound[:, j])
    above = cc[has] >= arr.bound[has, j]
    gap_mean, gap_sd = _mean_sd(cc[has] - arr.bound[has, j])
    gap_se = gap_sd / math.sqrt(max(1, int(has.sum())))
    return {
        "target_participation": p,
        "band": [lo, hi],
        "calibration_rank": k,
        "threshold_infinite": bool(k > n_cal),
        "expected_participation": min(k, n_cal + 1) / (n_cal + 1),
        "empirical_participation": part_mean,
        "empirical_participation_sd": part_sd,
        "empirical_participation_se": part_se,
        "participation_in_band": bool(lo <= part_mean < hi),
        "participation_in_band_within_3se": bool(lo - 3 * part_se <= part_mean < hi + 3 * part_se),
        "mean_answered": float(arr.n_answered[:, j].mean()),
        "conditional_correctness": cc_mean,
        "conditional_correctness_sd": cc_sd,
        "n_resplits_none_answered": int((~has).sum()),
        "paper_bound": b_mean,
        "paper_bound_sd": b_sd,
        "one_minus_beta": float(arr.one_minus_beta[:, j].mean()),
        "correctness_at_or_above_bound": bool(has.any() and cc_mean >= b_mean),
        "correctness_minus_bound_mean": gap_mean,
        "correctness_minus_bound_se": gap_se,
        "correctness_at_or_above_bound_within_3se": bool(has.any() and gap_mean >= -3 * gap_se),
        "fraction_resplits_at_or_above_bound": float(above.mean()) if above.size else float("nan"),
    }
