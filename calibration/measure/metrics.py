"""Ranking metrics for uncertainty scores (higher = more uncertain; ``correct`` 1 = judged
correct): AUROC, AUPRC, prediction-rejection ratio, and their class-stratified bootstrap
intervals. Conventions and definitions: docs/results.md, "Ranking metrics and their
intervals"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.metrics import average_precision_score, roc_auc_score

from abstain_guard.errors import InsufficientDataError, InvalidInputError
from abstain_guard.guarantee.validation import check_labels, check_scores, require_both_classes


def _uncertainty(uncertainty: ArrayLike, name: str = "uncertainty") -> NDArray[np.float64]:
    """Validated ``uncertainty [n]`` as float64, ``±inf`` kept (a score only has to rank)."""
    return check_scores(uncertainty, name=name, allow_inf=True)


def check_nan_policy(nan_policy: str) -> None:
    """Raise :class:`InvalidInputError` unless ``nan_policy`` is ``"raise"`` or ``"omit"``."""
    if nan_policy not in ("raise", "omit"):
        raise InvalidInputError(f"nan_policy must be 'raise' or 'omit', got {nan_policy!r}.")


def _both_classes(labels: NDArray[np.int64], what: str) -> None:
    require_both_classes(labels, what=what, hint="evaluate on a larger or more varied set.")


def _finite_ranks(arr: NDArray[np.float64]) -> NDArray[np.float64]:
    """Replace ±inf by values just beyond the finite range (order and ties preserved)."""
    if np.all(np.isfinite(arr)):
        return arr
    out = arr.copy()
    finite = arr[np.isfinite(arr)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    out[np.isposinf(arr)] = hi + 1.0
    out[np.isneginf(arr)] = lo - 1.0
    return out


def auroc(uncertainty: ArrayLike, correct: ArrayLike) -> float:
    """AUROC of ``uncertainty [n]`` for detecting incorrect answers (``correct [n]``).

    Raises:
        InvalidInputError: NaN scores, non-binary labels, length mismatch.
        InsufficientDataError: empty input or only one class.
    """
    u = _uncertainty(uncertainty)
    y = check_labels(correct, u.size)
    _both_classes(y, "AUROC")
    return float(roc_auc_score(1 - y, _finite_ranks(u)))


def auprc(
    uncertainty: ArrayLike,
    correct: ArrayLike,
    positive: Literal["correct", "incorrect"] = "correct",
) -> float:
    """Area under the precision–recall curve (average precision) of ``uncertainty [n]``:
    ``positive="correct"`` (the paper's Table 1) ranks correct answers by ``−uncertainty``,
    ``"incorrect"`` ranks incorrect answers by ``uncertainty``.

    Raises:
        InvalidInputError: NaN scores, non-binary labels, length mismatch, unknown ``positive``.
        InsufficientDataError: empty input or only one class.
    """
    u = _uncertainty(uncertainty)
    y = check_labels(correct, u.size)
    _both_classes(y, "AUPRC")
    u = _finite_ranks(u)
    if positive == "correct":
        return float(average_precision_score(y, -u))
    if positive == "incorrect":
        return float(average_precision_score(1 - y, u))
    raise InvalidInputError(f"positive must be 'correct' or 'incorrect', got {positive!r}.")


def _check_quality(quality: ArrayLike, n: int) -> NDArray[np.float64]:
    q = _uncertainty(quality, name="quality")
    if not np.all(np.isfinite(q)):
        raise InvalidInputError("quality must be finite (e.g. 0/1 correctness or a 0–1 grade).")
    if q.size != n:
        raise InvalidInputError(
            f"length mismatch: {n} scores but {q.size} quality values; pass one per response."
        )
    return q


def rejection_curve(
    uncertainty: ArrayLike, quality: ArrayLike
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Prediction-rejection curve of ``uncertainty [n]`` (rejected first) and ``quality [n]``
    (0/1 correctness or a graded score): ``(rejection_rate [n], mean_quality [n])``, for
    ``k = n, n−1, …, 1`` answers kept ``rejection_rate = 1 − k/n`` and the mean quality of the
    ``k`` least uncertain answers. Ties in ``uncertainty`` are resolved by their expectation
    over random tie-breaking (the kept quality within a tied block grows linearly), so the
    curve does not depend on the input order.
    """
    u = _uncertainty(uncertainty)
    q = _check_quality(quality, u.size)
    n = u.size
    order = np.argsort(u, kind="stable")
    u_sorted, q_sorted = _finite_ranks(u)[order], q[order]
    # Expected cumulative quality of the k least uncertain answers, ties averaged.
    boundaries = np.flatnonzero(np.diff(u_sorted)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [n]])
    block_sum = np.add.reduceat(q_sorted, starts)
    block_mean = block_sum / (ends - starts)
    cum_before = np.concatenate([[0.0], np.cumsum(block_sum)[:-1]])
    block_of = np.repeat(np.arange(starts.size), ends - starts)
    k = np.arange(1, n + 1)
    expected_cumsum = cum_before[block_of] + (k - starts[block_of]) * block_mean[block_of]
    kept_mean = expected_cumsum / k
    # Order by rejection rate ascending: k = n first.
    return 1.0 - k[::-1] / n, kept_mean[::-1]


def rejection_area(uncertainty: ArrayLike, quality: ArrayLike, max_rejection: float = 1.0) -> float:
    """Area under the prediction-rejection curve (lm-polygraph's un-normalised PRR).

    The mean, over rejection rates ``0, 1/n, …`` up to ``max_rejection`` (exclusive of
    rejecting everything), of the mean quality of the kept answers.
    """
    if not 0.0 < max_rejection <= 1.0:
        raise InvalidInputError(f"max_rejection must be in (0, 1], got {max_rejection}.")
    rates, kept = rejection_curve(uncertainty, quality)
    n_points = max(1, int(np.ceil(max_rejection * rates.size - 1e-9)))
    return float(np.mean(kept[:n_points]))


def prr(uncertainty: ArrayLike, quality: ArrayLike, max_rejection: float = 1.0) -> float:
    """Prediction-rejection ratio ``(A_u − A_random) / (A_oracle − A_random)``.

    ``A_u`` is :func:`rejection_area` of the scores; ``A_oracle`` that of the ideal ordering
    (``uncertainty = −quality``); ``A_random`` its exact expectation under a random ordering,
    which is the mean quality at every rejection rate (lm-polygraph estimates it by
    shuffling; the expectation removes that Monte-Carlo noise). 1 = oracle, 0 = chance.

    Raises:
        InvalidInputError: NaN, length mismatch, non-finite quality.
        InsufficientDataError: all qualities equal (oracle = random, the ratio is undefined).
    """
    u = _uncertainty(uncertainty)
    q = _check_quality(quality, u.size)
    if np.ptp(q) == 0:
        raise InsufficientDataError(
            f"PRR needs answers of different quality, but all {q.size} have quality "
            f"{q[0]:g}; evaluate on a larger or more varied set."
        )
    a_u = rejection_area(u, q, max_rejection)
    a_oracle = rejection_area(-q, q, max_rejection)
    a_random = float(np.mean(q))
    return float((a_u - a_random) / (a_oracle - a_random))


# --- bootstrap intervals ---------------------------------------------------------------

IntervalMetric = Literal["auroc", "auprc", "auprc_incorrect", "prr"]
INTERVAL_METRICS: tuple[IntervalMetric, ...] = ("auroc", "auprc", "auprc_incorrect", "prr")
# Upper bound on elements per [B, n] chunk of resamples (keeps temporaries near 200 MB).
_BOOT_CHUNK_ELEMENTS = 2_000_000


def _paired(
    uncertainty: ArrayLike, correct: ArrayLike, nan_policy: str
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Validated ``(uncertainty [m], correct [m])``; under ``"omit"`` the pairs with a NaN
    score are dropped first (as ``evaluate_dataset(nan_policy="omit")`` does)."""
    check_nan_policy(nan_policy)
    if nan_policy == "omit":
        try:
            arr = np.asarray(uncertainty, dtype=np.float64)
        except (TypeError, ValueError):
            arr = None  # _uncertainty below raises the typed error
        if arr is not None and arr.ndim == 1:
            y = check_labels(correct, arr.size)
            keep = ~np.isnan(arr)
            return _uncertainty(arr[keep]), y[keep]
    u = _uncertainty(uncertainty)
    return u, check_labels(correct, u.size)


def _resample_indices(
    y: NDArray[np.int64], uniforms: NDArray[np.float64], stratified: bool
) -> NDArray[np.intp]:
    """Resample indices ``[b, n]`` into ``y [n]`` from ``uniforms [b, n]`` in ``[0, 1)``.

    Stratified: columns ``:n_c`` draw from the correct answers, the rest from the incorrect
    ones, so every row keeps the original ``n_c`` / ``n − n_c``. Otherwise every column draws
    from all ``n``.
    """
    n = y.size
    if not stratified:
        return np.minimum((uniforms * n).astype(np.intp), n - 1)
    idx = np.empty(uniforms.shape, dtype=np.intp)
    pos_c, pos_i = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    n_c = pos_c.size
    for cols, pos in ((slice(0, n_c), pos_c), (slice(n_c, n), pos_i)):
        draw = (uniforms[:, cols] * pos.size).astype(np.intp)
        idx[:, cols] = pos[np.minimum(draw, pos.size - 1)]
    return idx


def _metrics_from_counts(
    c: NDArray[np.float64], i: NDArray[np.float64], metrics: Sequence[IntervalMetric]
) -> dict[str, NDArray[np.float64]]:
    """The metrics of ``b`` resamples given as counts per tie block: ``c [b, K]`` correct and
    ``i [b, K]`` incorrect answers drawn with a score in block ``k``, the ``K`` blocks (distinct
    scores) in ascending uncertainty. Returns ``metric → [b]``, NaN for a resample with a
    single class.

    A resample only repeats observed scores, so its tie structure is the blocks' and no row
    needs sorting. Ties count as in :func:`auroc` (half credit), :func:`auprc` (one threshold
    per distinct score) and :func:`prr` (tie-averaged rejection curve, ``max_rejection = 1``).
    """
    big_c, big_i = np.cumsum(c, axis=1), np.cumsum(i, axis=1)  # [b, K] answers in blocks ≤ k
    big_n = big_c + big_i
    c_before, n_before = big_c - c, big_n - (c + i)  # [b, K] answers in blocks < k
    n_c, n_i = big_c[:, -1], big_i[:, -1]  # [b]
    n = round(float(big_n[0, -1]))
    valid = (n_c > 0) & (n_i > 0)
    safe_c, safe_i = np.where(valid, n_c, 1.0), np.where(valid, n_i, 1.0)
    out: dict[str, NDArray[np.float64]] = {}
    for metric in metrics:
        if metric == "auroc":  # incorrect above correct, ties one half
            value = (i * (c_before + c / 2.0)).sum(axis=1) / (safe_c * safe_i)
        elif metric == "auprc":  # positive = correct; thresholds walk up the uncertainty
            value = (c * big_c / np.maximum(big_n, 1.0)).sum(axis=1) / safe_c
        elif metric == "auprc_incorrect":  # positive = incorrect; walk down from the top
            inc_from = n_i[:, None] - (big_i - i)  # incorrect in blocks ≥ k
            value = (i * inc_from / np.maximum(n - n_before, 1.0)).sum(axis=1) / safe_i
        elif metric == "prr":
            # Σ over kept sizes j in block k of the tie-averaged mean quality
            # (C_<k + (j − N_<k)·c_k/m_k)/j = C_<k·ΔH + c_k − N_<k·(c_k/m_k)·ΔH, ΔH = Σ 1/j.
            harmonic = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, n + 1))])
            d_h = harmonic[big_n.astype(np.intp)] - harmonic[n_before.astype(np.intp)]
            share = c / np.maximum(c + i, 1.0)
            a_u = ((c_before - n_before * share) * d_h + c).sum(axis=1) / n
            a_random = n_c / n
            a_oracle = (n_c + n_c * (harmonic[n] - harmonic[n_c.astype(np.intp)])) / n
            value = (a_u - a_random) / np.where(valid, a_oracle - a_random, 1.0)
        else:
            raise InvalidInputError(
                f"metric must be one of {list(INTERVAL_METRICS)}, got {metric!r}."
            )
        out[metric] = np.where(valid, value, np.nan)
    return out


def bootstrap_draws(
    uncertainty: ArrayLike,
    correct: ArrayLike,
    metrics: Sequence[IntervalMetric] = ("auroc",),
    *,
    n_boot: int = 2000,
    seed: int | np.random.Generator = 0,
    stratified: bool = True,
    nan_policy: Literal["raise", "omit"] = "raise",
) -> dict[str, NDArray[np.float64]]:
    """The bootstrap distribution of ranking metrics: ``metric → [n_boot]`` values, NaN for a
    resample with a single class (possible only with ``stratified=False``).

    Each resample draws ``n`` (score, label) pairs with replacement, with ``stratified``
    the correct and the incorrect answers separately (why: docs/results.md, 'Ranking metrics
    and their intervals'). ``"prr"`` takes correctness as quality over the whole curve.
    Resample ``r`` is a function of row ``r`` of ``seed``'s uniform stream only (the result
    does not depend on chunking).

    Raises:
        InvalidInputError: NaN scores under ``"raise"``, bad labels, ``n_boot < 1``, unknown
            metric.
        InsufficientDataError: empty input or only one class.
    """
    u, y = _paired(uncertainty, correct, nan_policy)
    _both_classes(y, "a bootstrap interval")
    if int(n_boot) < 1:
        raise InvalidInputError(f"n_boot must be at least 1, got {n_boot}.")
    bad = [m for m in metrics if m not in INTERVAL_METRICS]
    if bad or not metrics:
        raise InvalidInputError(f"metrics must be among {list(INTERVAL_METRICS)}, got {bad}.")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    n = u.size
    # Tie block (distinct score, ascending) of every answer; key = 2·block + label.
    order = np.argsort(u, kind="stable")
    u_sorted = u[order]
    block_of = np.empty(n, dtype=np.intp)
    block_of[order] = np.concatenate([[0], np.cumsum(u_sorted[1:] != u_sorted[:-1])])
    n_blocks = int(block_of.max()) + 1
    key = 2 * block_of + y  # [n]
    step = max(1, _BOOT_CHUNK_ELEMENTS // n)
    parts: list[dict[str, NDArray[np.float64]]] = []
    for done in range(0, int(n_boot), step):
        b = min(step, int(n_boot) - done)
        idx = _resample_indices(y, rng.random((b, n)), stratified)  # [b, n]
        flat = key[idx] + (2 * n_blocks) * np.arange(b)[:, None]
        counts = np.bincount(flat.ravel(), minlength=b * 2 * n_blocks).astype(np.float64)
        counts = counts.reshape(b, n_blocks, 2)  # [b, K, (incorrect, correct)]
        parts.append(_metrics_from_counts(counts[..., 1], counts[..., 0], metrics))
    return {m: np.concatenate([p[m] for p in parts]) for m in metrics}


def percentile_interval(draws: ArrayLike, confidence: float = 0.95) -> tuple[float, float]:
    """``(low, high)``: the ``(1−confidence)/2`` and ``(1+confidence)/2`` quantiles of the
    bootstrap ``draws [B]`` (NaN draws, i.e. skipped resamples, left out).

    Raises:
        InvalidInputError: ``confidence`` not in (0, 1).
        InsufficientDataError: no finite draw.
    """
    if not 0.0 < confidence < 1.0:
        raise InvalidInputError(f"confidence must be in (0, 1), got {confidence}.")
    d = np.asarray(draws, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size == 0:
        raise InsufficientDataError("no bootstrap resample had both classes; no interval.")
    lo, hi = np.quantile(d, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
    return float(lo), float(hi)


def bootstrap_intervals(
    uncertainty: ArrayLike,
    correct: ArrayLike,
    metrics: Sequence[IntervalMetric] = INTERVAL_METRICS,
    *,
    n_boot: int = 2000,
    confidence: float = 0.95,
    seed: int | np.random.Generator = 0,
    stratified: bool = True,
    nan_policy: Literal["raise", "omit"] = "raise",
) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap intervals ``metric → (low, high)`` of several ranking metrics from
    the same ``n_boot`` resamples; arguments and errors as :func:`bootstrap_draws` and
    :func:`percentile_interval`."""
    if not 0.0 < confidence < 1.0:
        raise InvalidInputError(f"confidence must be in (0, 1), got {confidence}.")
    draws = bootstrap_draws(
        uncertainty,
        correct,
        metrics,
        n_boot=n_boot,
        seed=seed,
        stratified=stratified,
        nan_policy=nan_policy,
    )
    return {m: percentile_interval(d, confidence) for m, d in draws.items()}
