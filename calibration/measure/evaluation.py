"""Evaluation of uncertainty scorers: ranking metrics, the conformal resplit simulation, the
paper's hypothesis checks, and the results layout that
:mod:`abstain_guard.calibration.measure.report` renders.

Everything here is pure numpy/scipy/scikit-learn on already computed scores; no model runs.

Conformal abstention, exactly as the paper's section 3 (and :mod:`abstain_guard.conformal`):
with ``n`` calibration scores and participation target ``1−α``, the threshold ``τ`` is the
``k = ⌈(1−α)(n+1)⌉``-th smallest calibration score (``+inf`` when ``k > n``); a question is
answered when its score ``u ≤ τ``; ``P(answered) ∈ [1−α, 1−α+1/(n+1))``. With ``c`` correct
calibration answers of which ``m`` have a score ``≤ τ``, the paper's ``1−β`` (Eq. 8) is
``m/(c+1)`` (``c/(c+1)`` when ``τ = +inf``), and its conditional-correctness bound (Eq. 9) is
``(1−β) / (1−α+1/(n+1)) · c/n``.

The resplit simulation repeats, ``R`` times, a random split of the labeled set into a
calibration half and a test half, thresholds on the calibration half and measures on the test
half — for all participation levels and all resplits at once on ``[R, n]`` matrices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats

from abstain_guard.calibration.measure.metrics import (
    INTERVAL_METRICS,
    auprc,
    auroc,
    bootstrap_draws,
    bootstrap_intervals,
    check_labels,
    check_scores,
    percentile_interval,
    prr,
)
from abstain_guard.errors import InsufficientDataError, InvalidInputError

__all__ = [
    "DEFAULT_LEVELS",
    "IMPORTANCE_FAMILIES",
    "SCHEMA_VERSION",
    "ResplitArrays",
    "build_results",
    "conformal_rank",
    "evaluate_dataset",
    "evaluate_scores",
    "hypothesis_checks",
    "level_key",
    "resplit_arrays",
    "resplit_permutations",
    "resplit_simulation",
    "scorer_metrics",
    "scorer_table",
    "validate_importance",
]

SCHEMA_VERSION = 1
DEFAULT_LEVELS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
IMPORTANCE_FAMILIES: tuple[str, ...] = ("omega", "theta", "phi_in", "phi_out")
IMPORTANCE_KEYS: tuple[str, ...] = (
    "auroc_drop_mean",
    "auroc_drop_sd",
    "auprc_drop_mean",
    "auprc_drop_sd",
)
# Upper bound on booleans materialised per chunk of resplits ([B, n, levels]).
_CHUNK_ELEMENTS = 8_000_000


# --- conformal pieces ------------------------------------------------------------------


def level_key(level: float) -> str:
    """The JSON key of a participation level: ``0.1 -> "0.1"``, ``0.25 -> "0.25"``."""
    return f"{float(level):g}"


def conformal_rank(level: float, n: int) -> int:
    """``k = ⌈level·(n+1)⌉``: the rank (1-based) of the threshold among ``n`` calibration
    scores for participation target ``level = 1−α``; ``k > n`` means ``τ = +inf``.

    A 1e-9 slack absorbs float error (``0.7·10`` is ``7.000000000000001`` in binary).
    """
    return math.ceil(level * (n + 1) - 1e-9)


def _check_levels(levels: Sequence[float]) -> NDArray[np.float64]:
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
):
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
    """Run the resplit simulation and return the per-resplit arrays (see :class:`ResplitArrays`).

    Args:
        scores: ``[n]`` uncertainty scores (higher = more uncertain; ``+inf`` allowed).
        correct: ``[n]`` 0/1 correctness labels.
        levels: participation targets ``1−α`` in (0, 1).
        n_resplits: number ``R`` of random calibration/test splits.
        calibration_fraction: share of the ``n`` responses in the calibration half
            (``n_cal = round(fraction·n)``).
        seed: seed or numpy Generator for the splits (see :func:`resplit_permutations`).
        chunk_size: resplits processed at once (default: as many as keep the ``[B, n, levels]``
            boolean temporaries under ~8 M elements); does not change the result.

    Raises:
        InvalidInputError: NaN scores, bad labels or levels, ``n_resplits < 1``.
        InsufficientDataError: fewer than 2 responses.
    """
    s = check_scores(scores, name="scores")
    y = check_labels(correct, s.size)
    lv = _check_levels(levels)
    if int(n_resplits) < 1:
        raise InvalidInputError(f"n_resplits must be at least 1, got {n_resplits}.")
    n = s.size
    n_cal, n_test = _split_sizes(n, calibration_fraction)
    ranks = np.array([conformal_rank(float(p), n_cal) for p in lv], dtype=np.int64)
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
    """The paper's conformal-abstention experiment, summarised over ``n_resplits`` random
    calibration/test splits (paper Figures 2 and 7).

    Args: as :func:`resplit_arrays`.

    Returns:
        ``{"n", "n_calibration", "n_test", "n_resplits", "calibration_fraction", "seed",
        "accuracy", "levels": {level_key: summary}}`` where each summary holds:

        - ``target_participation`` (``1−α``) and ``band`` ``[1−α, 1−α+1/(n_cal+1)]`` — the
          guarantee ``P(answered) ∈ [lo, hi)``;
        - ``calibration_rank`` ``k`` and ``threshold_infinite`` (``k > n_cal``);
        - ``expected_participation`` ``k/(n_cal+1)``: the exact expectation over random splits
          when scores have no ties;
        - ``empirical_participation`` (mean over resplits of the test-half answered fraction),
          ``empirical_participation_sd``, ``empirical_participation_se`` (Monte-Carlo standard
          error of the mean), ``participation_in_band`` (mean in ``[lo, hi)``) and
          ``participation_in_band_within_3se`` (the same allowing 3 Monte-Carlo standard errors);
        - ``conditional_correctness`` (mean over resplits that answered at least one test
          question of the accuracy among answered ones), its ``_sd``, and
          ``n_resplits_none_answered`` (resplits left out of that mean);
        - ``paper_bound`` (mean of Eq. 9 from the calibration half), ``paper_bound_sd``,
          ``one_minus_beta`` (mean);
        - ``correctness_at_or_above_bound`` (mean correctness ≥ mean bound),
          ``correctness_minus_bound_mean`` / ``_se`` (paired over resplits),
          ``correctness_at_or_above_bound_within_3se`` (the gap ≥ −3 Monte-Carlo s.e.) and
          ``fraction_resplits_at_or_above_bound`` (share of resplits, among those that
          answered something, whose correctness is ≥ their own bound);
        - ``mean_answered`` test questions answered per resplit.
    """
    arr = resplit_arrays(
        scores, correct, levels, n_resplits, calibration_fraction, seed, chunk_size
    )
    y = check_labels(correct)
    n_cal, r = arr.n_calibration, arr.participation.shape[0]
    out_levels: dict[str, dict[str, Any]] = {}
    for j, p in enumerate(arr.levels):
        k = conformal_rank(float(p), n_cal)
        lo, hi = float(p), float(p) + 1.0 / (n_cal + 1)
        part_mean, part_sd = _mean_sd(arr.participation[:, j])
        part_se = part_sd / math.sqrt(r)
        cc = arr.conditional_correctness[:, j]
        has = np.isfinite(cc)
        cc_mean, cc_sd = _mean_sd(cc)
        b_mean, b_sd = _mean_sd(arr.bound[:, j])
        above = cc[has] >= arr.bound[has, j]
        gap_mean, gap_sd = _mean_sd(cc[has] - arr.bound[has, j])
        gap_se = gap_sd / math.sqrt(max(1, int(has.sum())))
        out_levels[level_key(float(p))] = {
            "target_participation": float(p),
            "band": [lo, hi],
            "calibration_rank": k,
            "threshold_infinite": bool(k > n_cal),
            "expected_participation": min(k, n_cal + 1) / (n_cal + 1),
            "empirical_participation": part_mean,
            "empirical_participation_sd": part_sd,
            "empirical_participation_se": part_se,
            "participation_in_band": bool(lo <= part_mean < hi),
            "participation_in_band_within_3se": bool(
                lo - 3 * part_se <= part_mean < hi + 3 * part_se
            ),
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
            "fraction_resplits_at_or_above_bound": (
                float(above.mean()) if above.size else float("nan")
            ),
        }
    return {
        "n": int(y.size),
        "n_calibration": n_cal,
        "n_test": arr.n_test,
        "n_resplits": r,
        "calibration_fraction": float(calibration_fraction),
        "seed": seed if isinstance(seed, int) else None,
        "accuracy": float(y.mean()),
        "levels": out_levels,
    }


# --- ranking metrics per scorer --------------------------------------------------------


def scorer_metrics(uncertainty: ArrayLike, correct: ArrayLike) -> dict[str, float]:
    """AUROC, AUPRC (paper: positive = correct), AUPRC with positive = incorrect, and PRR
    (quality = correctness) of one scorer; see :mod:`abstain_guard.calibration.measure.metrics`."""
    return {
        "auroc": auroc(uncertainty, correct),
        "auprc": auprc(uncertainty, correct, positive="correct"),
        "auprc_incorrect": auprc(uncertainty, correct, positive="incorrect"),
        "prr": prr(uncertainty, check_labels(correct)),
    }


def _select_finite(
    name: str, scores: ArrayLike, y: NDArray[np.int64], nan_policy: str
) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
    """Scores as float ``[n]`` and the mask of rows to use (NaN rows dropped under 'omit')."""
    try:
        s = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"scores of scorer {name!r} are not numeric ({exc}).") from exc
    if s.ndim != 1 or s.size != y.size:
        raise InvalidInputError(
            f"scorer {name!r} has {s.size if s.ndim == 1 else s.shape} scores for {y.size} "
            "labels; pass one score per labeled response, in the same order."
        )
    keep = ~np.isnan(s)
    if not keep.all() and nan_policy == "raise":
        raise InvalidInputError(
            f"scorer {name!r} has {int((~keep).sum())} NaN score(s) of {s.size}; fix the scorer "
            "or pass nan_policy='omit' to evaluate it on the responses it could score."
        )
    return s, keep


def _check_nan_policy(nan_policy: str) -> None:
    if nan_policy not in ("raise", "omit"):
        raise InvalidInputError(f"nan_policy must be 'raise' or 'omit', got {nan_policy!r}.")


def _within_group(
    s: NDArray[np.float64],
    y: NDArray[np.int64],
    groups: NDArray[Any],
    n_boot: int = 0,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """Within-type AUROC of scores ``s [n]``, labels ``y [n]``, question types ``groups [n]``.

    With ``n_boot > 0`` each used group gets ``auroc_ci`` and the plain mean ``mean_auroc_ci``:
    every bootstrap resample resamples the correct and the incorrect answers *within each
    group* (group sizes and class counts kept), the mean over groups is taken per resample, and
    its percentiles form the interval. Groups are resampled in sorted order from one
    Generator seeded with ``seed``.
    """
    per_group: dict[str, dict[str, Any]] = {}
    draws: list[NDArray[np.float64]] = []
    rng = np.random.default_rng(seed)
    skipped: dict[str, str] = {}
    has_group = np.array([v is not None for v in groups.tolist()], dtype=bool)
    names = groups.astype(str)
    for g in sorted({str(v) for v in groups.tolist() if v is not None}):
        mask = has_group & (names == g)
        yg = y[mask]
        if yg.size < 2 or yg.min() == yg.max():
            skipped[g] = (
                f"one class only ({int(yg.sum())} correct of {yg.size})"
                if yg.size
                else "no responses"
            )
            continue
        per_group[g] = {
            "auroc": auroc(s[mask], yg),
            "n": int(yg.size),
            "n_correct": int(yg.sum()),
            "n_incorrect": int(yg.size - yg.sum()),
            "accuracy": float(yg.mean()),
        }
        if n_boot > 0:
            d = bootstrap_draws(s[mask], yg, ("auroc",), n_boot=n_boot, seed=rng)["auroc"]
            per_group[g]["auroc_ci"] = list(percentile_interval(d, confidence))
            draws.append(d)
    aurocs = np.array([v["auroc"] for v in per_group.values()])
    sizes = np.array([v["n"] for v in per_group.values()], dtype=np.float64)
    ci = list(percentile_interval(np.mean(draws, axis=0), confidence)) if draws else None
    return {
        "groups": per_group,
        "n_correct": sum(v["n_correct"] for v in per_group.values()),
        "n_incorrect": sum(v["n_incorrect"] for v in per_group.values()),
        "skipped_groups": skipped,
        "n_groups_used": len(per_group),
        "n_without_group": int((~has_group).sum()),
        "mean_auroc": float(aurocs.mean()) if aurocs.size else float("nan"),
        "mean_auroc_ci": ci,
        "weighted_mean_auroc": (
            float((aurocs * sizes).sum() / sizes.sum()) if aurocs.size else float("nan")
        ),
    }


def scorer_table(
    scores_by_scorer: Mapping[str, ArrayLike],
    correct: ArrayLike,
    groups: ArrayLike | None = None,
    nan_policy: Literal["raise", "omit"] = "raise",
    n_boot: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Ranking metrics of every scorer on the same labeled responses.

    Args:
        scores_by_scorer: scorer name → ``[n]`` uncertainty scores.
        correct: ``[n]`` 0/1 labels.
        groups: optional ``[n]`` question type of each response (the probe's relation, any
            ``--group-by`` field). Then each scorer's entry also has ``within_group``: AUROC
            inside every group that has both classes (one-class groups listed in
            ``skipped_groups`` with the reason), their plain ``mean_auroc`` (the within-type
            figure) with its interval ``mean_auroc_ci``, the size-weighted mean (no interval),
            and ``n_correct`` / ``n_incorrect`` of the groups used.
        nan_policy: ``"raise"`` on NaN scores, or ``"omit"`` to drop those responses for that
            scorer (the entry's ``n_omitted`` says how many); under ``"omit"`` a scorer left
            with too little data (e.g. all NaN, or one class) gets ``{"n", "n_omitted",
            "error"}`` instead of metrics.
        n_boot: bootstrap resamples for the intervals (0: no intervals).
        confidence: interval level.
        seed: bootstrap seed. Scorers with the same responses get the same resamples (a
            paired bootstrap), so their intervals move together.

    Returns:
        scorer → ``{"auroc", "auprc", "auprc_incorrect", "prr", "n", "n_omitted",
        "n_correct", "n_incorrect", "accuracy"}``, with ``n_boot > 0`` also
        ``"auroc_ci"``, ``"auprc_ci"``, ``"auprc_incorrect_ci"``, ``"prr_ci"``: ``[low, high]``
        percentile bootstrap intervals, class-stratified (see
        :func:`abstain_guard.calibration.measure.metrics.bootstrap_draws`);
        + ``"within_group"`` when ``groups`` is given (with ``mean_auroc_ci``, see
        :func:`_within_group`).
    """
    _check_nan_policy(nan_policy)
    if int(n_boot) < 0:
        raise InvalidInputError(f"n_boot must be 0 (no intervals) or more, got {n_boot}.")
    if not scores_by_scorer:
        raise InvalidInputError("scores_by_scorer is empty; pass at least one scorer's scores.")
    y = check_labels(correct)
    g_arr: NDArray[Any] | None = None
    if groups is not None:
        g_arr = np.asarray(groups, dtype=object)
        if g_arr.ndim != 1 or g_arr.size != y.size:
            raise InvalidInputError(
                f"groups must have one entry per response ({y.size}); got shape {g_arr.shape}."
            )
    table: dict[str, dict[str, Any]] = {}
    for name, scores in scores_by_scorer.items():
        s, keep = _select_finite(name, scores, y, nan_policy)
        counts = {"n": int(keep.sum()), "n_omitted": int((~keep).sum())}
        try:
            entry: dict[str, Any] = scorer_metrics(s[keep], y[keep])
        except InsufficientDataError as exc:
            if nan_policy == "raise":
                raise
            # Under 'omit' one broken scorer must not sink the whole table: record why.
            table[name] = {**counts, "error": str(exc)}
            continue
        n_correct = int(y[keep].sum())
        entry.update(
            counts,
            n_correct=n_correct,
            n_incorrect=counts["n"] - n_correct,
            accuracy=float(y[keep].mean()),
        )
        if n_boot > 0:
            intervals = bootstrap_intervals(
                s[keep], y[keep], INTERVAL_METRICS, n_boot=n_boot, confidence=confidence, seed=seed
            )
            entry.update({f"{m}_ci": list(lo_hi) for m, lo_hi in intervals.items()})
        if g_arr is not None:
            entry["within_group"] = _within_group(
                s[keep], y[keep], g_arr[keep], n_boot, confidence, seed
            )
        table[name] = entry
    return table


# --- hypothesis checks (paper Figure 8) ------------------------------------------------


def _geometry_array(geom: Mapping[str, Any], key: str, i: int, width: int) -> NDArray[np.float64]:
    try:
        a = np.asarray(geom[key], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"geometry {i}: {key!r} is not numeric ({exc}).") from exc
    if a.size == 0:
        return a.reshape(0, width)
    if a.ndim != 2 or a.shape[1] != width:
        raise InvalidInputError(
            f"geometry {i}: {key!r} has shape {a.shape}; expected [tokens, 2L-1] = "
            f"[N, {width}] for num_layers L = {(width + 1) // 2}."
        )
    return a


def _per_response_features(
    geometries: Sequence[Mapping[str, Any] | None],
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.bool_], NDArray[np.bool_], int]:
    """Token-averaged ``Ω⊙Θ`` and ``Φ^in−Φ^out`` per response: ``[n, 2L−1]`` each (NaN rows
    where a response has no geometry, no tokens or no Φ), the masks of usable rows, and ``L``."""
    if len(geometries) == 0:
        raise InsufficientDataError("no geometries given; pass one geometry dict per response.")
    num_layers: int | None = None
    ot_rows: list[NDArray[np.float64]] = []
    phi_rows: list[NDArray[np.float64]] = []
    ot_ok: list[bool] = []
    phi_ok: list[bool] = []
    missing: list[int] = []
    for i, geom in enumerate(geometries):
        if geom is None:  # the response carries no geometry (capture off or failed)
            missing.append(i)
            continue
        if not isinstance(geom, Mapping) or "omega" not in geom or "theta" not in geom:
            raise InvalidInputError(
                f"geometry {i} is not a geometry dict with 'num_layers', 'omega', 'theta' "
                "(response_metadata['geometry'] of a GeometryChatModel answer)."
            )
        n_layers = int(geom.get("num_layers") or 0)
        if n_layers < 1:
            raise InvalidInputError(f"geometry {i}: num_layers must be a positive integer.")
        if num_layers is None:
            num_layers = n_layers
        elif n_layers != num_layers:
            raise InvalidInputError(
                f"geometry {i} has num_layers={n_layers} but earlier ones {num_layers}; "
                "hypothesis checks need responses of one model."
            )
        width = 2 * n_layers - 1
        omega = _geometry_array(geom, "omega", i, width)
        theta = _geometry_array(geom, "theta", i, width)
        if omega.shape != theta.shape:
            raise InvalidInputError(
                f"geometry {i}: omega {omega.shape} and theta {theta.shape} differ in shape."
            )
        usable = omega.shape[0] > 0
        ot_rows.append((omega * theta).mean(axis=0) if usable else np.full(width, np.nan))
        ot_ok.append(usable)
        if geom.get("phi_in") is not None and geom.get("phi_out") is not None and usable:
            phi_in = _geometry_array(geom, "phi_in", i, width)
            phi_out = _geometry_array(geom, "phi_out", i, width)
            if phi_in.shape != omega.shape or phi_out.shape != omega.shape:
                raise InvalidInputError(
                    f"geometry {i}: phi_in {phi_in.shape} / phi_out {phi_out.shape} must match "
                    f"omega {omega.shape}."
                )
            phi_rows.append((phi_in - phi_out).mean(axis=0))
            phi_ok.append(True)
        else:
            phi_rows.append(np.full(width, np.nan))
            phi_ok.append(False)
    if num_layers is None:
        raise InsufficientDataError(
            "no response carries geometry (all entries are None); generate with a "
            "GeometryChatModel to run the hypothesis checks."
        )
    width = 2 * num_layers - 1
    for i in missing:  # restore the input order with empty rows for missing geometry
        ot_rows.insert(i, np.full(width, np.nan))
        phi_rows.insert(i, np.full(width, np.nan))
        ot_ok.insert(i, False)
        phi_ok.insert(i, False)
    return (
        np.vstack(ot_rows),
        np.vstack(phi_rows),
        np.array(ot_ok),
        np.array(phi_ok),
        num_layers,
    )


def _compare(
    values: NDArray[np.float64],
    y: NDArray[np.int64],
    expected: Literal["greater", "less"],
    significance: float,
) -> dict[str, Any]:
    """Correct-vs-incorrect comparison of per-response features ``values [n, 2L−1]``."""
    corr, inc = values[y == 1], values[y == 0]
    if corr.shape[0] == 0 or inc.shape[0] == 0:
        raise InsufficientDataError(
            f"hypothesis checks need correct and incorrect responses; got {corr.shape[0]} "
            f"correct and {inc.shape[0]} incorrect with usable geometry."
        )
    n_c, n_i = corr.shape[0], inc.shape[0]

    def sem(a: NDArray[np.float64]) -> NDArray[np.float64]:
        if a.shape[0] < 2:
            return np.zeros(a.shape[1])
        return np.asarray(a.std(axis=0, ddof=1) / math.sqrt(a.shape[0]), dtype=np.float64)

    per_layer_p = np.asarray(
        stats.mannwhitneyu(corr, inc, axis=0, alternative="two-sided").pvalue, dtype=np.float64
    )
    per_layer_p = np.where(np.isnan(per_layer_p), 1.0, per_layer_p)
    q = stats.false_discovery_control(per_layer_p, method="bh")
    diff = corr.mean(axis=0) - inc.mean(axis=0)
    agrees = diff > 0 if expected == "greater" else diff < 0

    # The paper's per-sample aggregate: average over the 2L−1 interleaved layers.
    agg_c, agg_i = corr.mean(axis=1), inc.mean(axis=1)
    test = stats.mannwhitneyu(agg_c, agg_i, alternative="two-sided")
    prob_greater = float(test.statistic / (n_c * n_i))  # P(correct > incorrect) + ties/2
    direction_ok = bool(
        agg_c.mean() > agg_i.mean() if expected == "greater" else agg_c.mean() < agg_i.mean()
    )
    return {
        "expected_direction": f"correct {expected} than incorrect",
        "n_correct": int(n_c),
        "n_incorrect": int(n_i),
        "per_layer": {
            "mean_correct": corr.mean(axis=0).tolist(),
            "mean_incorrect": inc.mean(axis=0).tolist(),
            "sem_correct": sem(corr).tolist(),
            "sem_incorrect": sem(inc).tolist(),
            "p_value": per_layer_p.tolist(),
            "q_value_bh": np.asarray(q, dtype=np.float64).tolist(),
        },
        "n_layers_significant": int((q < significance).sum()),
        "n_layers_significant_expected_direction": int(((q < significance) & agrees).sum()),
        "n_layer_indices": int(values.shape[1]),
        "aggregate": {
            "values_correct": agg_c.tolist(),
            "values_incorrect": agg_i.tolist(),
            "mean_correct": float(agg_c.mean()),
            "mean_incorrect": float(agg_i.mean()),
            "median_correct": float(np.median(agg_c)),
            "median_incorrect": float(np.median(agg_i)),
            "mann_whitney_p": float(test.pvalue),
            "prob_correct_greater": prob_greater,
        },
        "supported": bool(direction_ok and float(test.pvalue) < significance),
    }


def hypothesis_checks(
    geometries: Sequence[Mapping[str, Any] | None],
    correct: ArrayLike,
    significance: float = 0.05,
) -> dict[str, Any]:
    """The paper's hypothesis validation (Figure 8) on responses' geometry.

    For each response, ``Ω⊙Θ`` and ``Φ^in−Φ^out`` (``[tokens, 2L−1]``, interleaved
    dir¹, prop¹, …, dir^L) are averaged over its tokens, giving ``[2L−1]`` per response;
    those are compared between correct and incorrect responses per layer index (means, SEMs,
    two-sided Mann–Whitney p-values with Benjamini–Hochberg q-values) and, as in the paper,
    after also averaging over layers (one number per response; Mann–Whitney p-value and
    ``P(correct > incorrect)``).

    Hypothesis 1 (knowledge interaction): correct responses have larger ``Ω⊙Θ``.
    Hypothesis 2 (anisotropy): correct responses have smaller ``Φ^in−Φ^out`` (closer to the
    in-distribution mean). ``supported`` = the layer-averaged means differ in the expected
    direction with p < ``significance``.

    Args:
        geometries: one ``response_metadata["geometry"]`` dict per response (``None`` for a
            response without geometry: left out, counted in ``n_without_tokens``).
        correct: ``[n]`` 0/1 labels.

    Returns:
        ``{"num_layers", "n", "n_without_tokens", "knowledge_interaction": {...},
        "relative_angular_distance": {...} | None, "n_without_phi"}``; the second is ``None``
        when no response carries Φ (reference means not fitted).

    Raises:
        InvalidInputError: malformed geometry dicts, length mismatch.
        InsufficientDataError: no correct or no incorrect response with tokens.
    """
    y = check_labels(correct)
    if len(geometries) != y.size:
        raise InvalidInputError(
            f"length mismatch: {len(geometries)} geometries but {y.size} labels."
        )
    ot, phi, ot_ok, phi_ok, num_layers = _per_response_features(geometries)
    result: dict[str, Any] = {
        "num_layers": num_layers,
        "n": int(y.size),
        "n_without_tokens": int((~ot_ok).sum()),
        "n_without_phi": int((~phi_ok).sum()),
        "significance": significance,
        "knowledge_interaction": _compare(ot[ot_ok], y[ot_ok], "greater", significance),
        "relative_angular_distance": None,
    }
    if phi_ok.any():
        result["relative_angular_distance"] = _compare(phi[phi_ok], y[phi_ok], "less", significance)
    return result


def validate_importance(importance: Any) -> dict[str, Any]:
    """Check a permutation-importance result and return it as family → ``{"auroc_drop_mean",
    "auroc_drop_sd", "auprc_drop_mean", "auprc_drop_sd"}`` of plain floats.

    Accepted forms:

    * family → ``{"auroc_drop_mean", "auroc_drop_sd", "auprc_drop_mean", "auprc_drop_sd"}``
      (other keys are kept);
    * ``GeometryScorer.feature_importance(...)`` itself or its ``to_dict()``:
      ``{"auroc", "auprc", "drops": {family: {"auroc_mean", "auroc_sd", "auprc_mean",
      "auprc_sd"}}}`` — the unpermuted ``auroc``/``auprc`` are kept in every family's entry as
      ``unpermuted_auroc`` / ``unpermuted_auprc``.
    """
    if hasattr(importance, "to_dict") and callable(importance.to_dict):
        importance = importance.to_dict()
    hint = (
        "importance must be family → {auroc_drop_mean, auroc_drop_sd, auprc_drop_mean, "
        "auprc_drop_sd}, or GeometryScorer.feature_importance(...) / its to_dict()."
    )
    if not isinstance(importance, Mapping) or not importance:
        raise InvalidInputError(hint)
    extra: dict[str, float] = {}
    if isinstance(importance.get("drops"), Mapping):
        for key in ("auroc", "auprc"):
            if isinstance(importance.get(key), (int, float, np.integer, np.floating)):
                extra[f"unpermuted_{key}"] = float(importance[key])
        renamed: dict[str, dict[str, Any]] = {}
        for family, entry in importance["drops"].items():
            if not isinstance(entry, Mapping):
                raise InvalidInputError(f"importance drops[{family!r}] must be a dict. {hint}")
            renamed[family] = {
                (
                    f"{k[:5]}_drop_{k[6:]}"
                    if k in ("auroc_mean", "auroc_sd", "auprc_mean", "auprc_sd")
                    else k
                ): v
                for k, v in entry.items()
            }
        importance = renamed
    out: dict[str, Any] = {}
    for family, entry in importance.items():
        if not isinstance(entry, Mapping):
            raise InvalidInputError(f"importance[{family!r}] must be a dict of numbers. {hint}")
        missing = [k for k in IMPORTANCE_KEYS if k not in entry]
        if missing:
            raise InvalidInputError(
                f"importance[{family!r}] lacks {missing}; expected keys {list(IMPORTANCE_KEYS)}."
            )
        clean: dict[str, Any] = {}
        for k, v in entry.items():
            clean[k] = float(v) if isinstance(v, (int, float, np.integer, np.floating)) else v
        clean.update(extra)
        out[str(family)] = clean
    if not out:
        raise InvalidInputError(f"importance has no feature families. {hint}")
    return out


# --- the results layout ----------------------------------------------------------------


def _scorer_entries(
    scores_by_scorer: Mapping[str, ArrayLike],
    y: NDArray[np.int64],
    groups: ArrayLike | None,
    levels: Sequence[float],
    n_resplits: int,
    calibration_fraction: float,
    seed: int,
    nan_policy: Literal["raise", "omit"],
    progress: bool,
    desc: str,
    n_boot: int,
    confidence: float,
) -> dict[str, dict[str, Any]]:
    from tqdm.auto import tqdm

    table = scorer_table(
        scores_by_scorer,
        y,
        groups=groups,
        nan_policy=nan_policy,
        n_boot=n_boot,
        confidence=confidence,
        seed=seed,
    )
    for name in tqdm(list(scores_by_scorer), desc=desc, disable=not progress, leave=False):
        if "error" in table[name]:
            continue
        s, keep = _select_finite(name, scores_by_scorer[name], y, nan_policy)
        sim = resplit_simulation(
            s[keep],
            y[keep],
            levels=levels,
            n_resplits=n_resplits,
            calibration_fraction=calibration_fraction,
            seed=seed,
        )
        table[name]["participation"] = sim.pop("levels")
        table[name]["resplit"] = sim
    return table


def evaluate_dataset(
    name: str,
    scores_by_scorer: Mapping[str, ArrayLike],
    correct: ArrayLike,
    groups: ArrayLike | None = None,
    geometries: Sequence[Mapping[str, Any] | None] | None = None,
    importance: Any = None,
    calibrated_scores_by_scorer: Mapping[str, ArrayLike] | None = None,
    levels: Sequence[float] = DEFAULT_LEVELS,
    n_resplits: int = 1000,
    calibration_fraction: float = 0.5,
    seed: int = 0,
    nan_policy: Literal["raise", "omit"] = "raise",
    progress: bool = False,
    n_boot: int = 2000,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Everything the report shows for one data set, as a JSON-ready dict.

    Args:
        name: the data set's name (a key of ``results["datasets"]``).
        scores_by_scorer: scorer → ``[n]`` uncertainty scores of the *test* responses.
        correct: ``[n]`` 0/1 labels of those responses.
        groups: optional ``[n]`` question types → within-type AUROC.
        geometries: optional ``[n]`` geometry dicts → hypothesis checks (Figure 8).
        importance: optional permutation importance (Figure 9), see :func:`validate_importance`.
        calibrated_scores_by_scorer: optional scores of the calibrated baselines (appendix
            tables), evaluated exactly like the raw scorers.
        levels, n_resplits, calibration_fraction, seed: the resplit simulation (``seed`` also
            seeds the bootstrap).
        nan_policy: see :func:`scorer_table`.
        progress: show a tqdm bar over scorers.
        n_boot, confidence: bootstrap intervals of the ranking metrics (``n_boot=0``: none);
            see :func:`scorer_table`.

    Returns:
        ``{"name", "n", "n_correct", "n_incorrect", "accuracy", "levels", "bootstrap",
        "scorers": {scorer: {"auroc", "auroc_ci", "auprc", "auprc_ci", "auprc_incorrect",
        "auprc_incorrect_ci", "prr", "prr_ci", "n", "n_omitted", "n_correct", "n_incorrect",
        "accuracy", "participation": {level_key: {...}}, "resplit": {...}}},
        "calibrated_scorers": {...} | None, "within_group": {scorer: {...}} | None,
        "n_groups": int | None, "hypothesis": {...} | None, "importance": {...} | None}``.
        ``bootstrap`` records how the intervals were made (``None`` when ``n_boot=0``).
        Participation summaries are described in :func:`resplit_simulation`.
    """
    _check_nan_policy(nan_policy)
    y = check_labels(correct)
    lv = [float(v) for v in _check_levels(levels)]
    scorers = _scorer_entries(
        scores_by_scorer,
        y,
        groups,
        lv,
        n_resplits,
        calibration_fraction,
        seed,
        nan_policy,
        progress,
        f"{name}: scorers",
        n_boot,
        confidence,
    )
    calibrated = None
    if calibrated_scores_by_scorer:
        calibrated = _scorer_entries(
            calibrated_scores_by_scorer,
            y,
            None,
            lv,
            n_resplits,
            calibration_fraction,
            seed,
            nan_policy,
            progress,
            f"{name}: calibrated",
            n_boot,
            confidence,
        )
    within = None
    n_groups = None
    if groups is not None:
        within = {
            s: entry.pop("within_group") for s, entry in scorers.items() if "error" not in entry
        }
        n_groups = len({str(g) for g in np.asarray(groups, dtype=object).tolist() if g is not None})
    hypothesis = None
    if geometries is not None:
        hypothesis = hypothesis_checks(geometries, y)
    return {
        "name": name,
        "n": int(y.size),
        "n_correct": int(y.sum()),
        "n_incorrect": int(y.size - y.sum()),
        "accuracy": float(y.mean()),
        "levels": [level_key(v) for v in lv],
        "bootstrap": (
            {
                "n_boot": int(n_boot),
                "confidence": float(confidence),
                "seed": seed,
                "method": "percentile, resampling correct and incorrect answers separately",
            }
            if n_boot > 0
            else None
        ),
        "scorers": scorers,
        "calibrated_scorers": calibrated,
        "within_group": within,
        "n_groups": n_groups,
        "hypothesis": hypothesis,
        "importance": validate_importance(importance) if importance is not None else None,
    }


def build_results(
    datasets: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]],
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble :func:`evaluate_dataset` outputs into the results document
    ``{"schema_version", "metadata", "datasets": {name: entry}}`` that
    :func:`abstain_guard.calibration.measure.report.write_report` renders (``metadata``: free-form,
    e.g. model, commands, sizes)."""
    entries = list(datasets.values()) if isinstance(datasets, Mapping) else list(datasets)
    by_name: dict[str, Any] = {}
    for entry in entries:
        if "name" not in entry or "scorers" not in entry:
            raise InvalidInputError("each data set entry must come from evaluate_dataset().")
        if entry["name"] in by_name:
            raise InvalidInputError(f"data set {entry['name']!r} appears twice.")
        by_name[entry["name"]] = dict(entry)
    return {
        "schema_version": SCHEMA_VERSION,
        "metadata": dict(metadata or {}),
        "datasets": by_name,
    }


def evaluate_scores(
    scores_by_scorer: Mapping[str, ArrayLike],
    correct: ArrayLike,
    name: str = "dataset",
    metadata: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """One-data-set shortcut: ``build_results([evaluate_dataset(name, ...)], metadata)``;
    ``kwargs`` go to :func:`evaluate_dataset`."""
    return build_results([evaluate_dataset(name, scores_by_scorer, correct, **kwargs)], metadata)
