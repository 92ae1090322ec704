"""Partial release of a certified stream: the probability that a stream shows text and is
then stopped, ``R_p(τ) = P(F <= τ < M)`` (``F`` the first chunk's score, ``+inf`` without an
interior chunk end; ``M`` the stream statistic, :mod:`abstain_guard.contract.streaming`).

Not monotone in τ, so it is bounded uniformly in τ with two one-sided DKW bands at δ/2 each:
``R_p(τ) <= R̂_p(τ) + 2c`` (:func:`dkw_margin`), valid at a τ chosen on the same data. With a
target ρ the thresholds below the *ceiling* where the bound exceeds ρ are certified
(:func:`partial_release_certificate`), beside the error certificate at δ/2 each.
docs/guarantees.md ("While it streams: chunk by chunk"). Pure numpy; ``[n]``: calibration
answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from abstain_guard.errors import InvalidInputError


def check_stream_statistics(
    first: ArrayLike, statistic: ArrayLike
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``(F, M)`` as float arrays ``[n]``; F may be ``+inf``, neither NaN, and F <= M
    wherever F is finite.

    Raises:
        InvalidInputError: shapes differ, NaN, or a first-chunk score above its statistic.
    """
    f = np.asarray(first, dtype=np.float64).reshape(-1)
    m = np.asarray(statistic, dtype=np.float64).reshape(-1)
    if f.shape != m.shape or f.size == 0:
        raise InvalidInputError(
            f"first-chunk scores {f.shape} and stream statistics {m.shape} must be two "
            "non-empty arrays of the same length (one per calibration answer)"
        )
    if np.isnan(f).any() or np.isnan(m).any() or not np.isfinite(m).all():
        raise InvalidInputError("stream statistics must be finite and first-chunk scores not NaN")
    bad = np.isfinite(f) & (f > m)
    if bad.any():
        raise InvalidInputError(
            f"{int(bad.sum())} first-chunk scores exceed their stream statistic (the maximum "
            "over the answer's chunks): the two arrays do not belong together"
        )
    return f, m


def partial_release_rate(first: ArrayLike, statistic: ArrayLike, threshold: float) -> float:
    """``R̂_p(τ)``: the share of answers with ``F <= τ < M``."""
    f, m = check_stream_statistics(first, statistic)
    return float(np.mean((f <= threshold) & (m > threshold)))


def dkw_margin(n: int, delta: float) -> float:
    """``c = sqrt(ln(2/δ) / (2n))``: each one-sided DKW band at δ/2."""
    if n < 1 or not 0.0 < delta < 1.0:
        raise InvalidInputError(f"need n >= 1 and 0 < delta < 1, got n={n}, delta={delta}")
    return math.sqrt(math.log(2.0 / delta) / (2.0 * n))


def certified_partial_release(
    first: ArrayLike, statistic: ArrayLike, threshold: float, delta: float
) -> float:
    """The bound on ``R_p(threshold)`` that holds, with probability ≥ 1−δ, for every
    threshold at once: ``min(1, R̂_p + 2c)``."""
    f, _ = check_stream_statistics(first, statistic)
    rate = partial_release_rate(first, statistic, threshold)
    return min(1.0, rate + 2.0 * dkw_margin(f.size, delta))


@dataclass(frozen=True)
class PartialReleaseCertificate:
    """The thresholds certified to keep ``R_p <= target`` at ``level``: those below
    ``ceiling`` (``-inf``: none, ``feasible`` False)."""

    target: float
    level: float
    n: int
    margin: float
    ceiling: float

    @property
    def feasible(self) -> bool:
        return self.ceiling > -math.inf


def partial_release_certificate(
    first: ArrayLike, statistic: ArrayLike, target: float, level: float
) -> PartialReleaseCertificate:
    """The ceiling for ``R_p <= target`` at ``level``: the lowest calibration value where
    ``R̂_p + 2c`` exceeds the target."""
    f, m = check_stream_statistics(first, statistic)
    if not 0.0 < target < 1.0:
        raise InvalidInputError(f"partial_release_target must be in (0, 1), got {target}")
    c = dkw_margin(f.size, level)
    allowed = target - 2.0 * c
    if allowed < 0.0:
        return PartialReleaseCertificate(target, level, f.size, c, -math.inf)
    f = np.minimum(f, m)  # an answer without interior chunk: F = M (never partial)
    values = np.unique(np.concatenate([f, m]))
    f_sorted, m_sorted = np.sort(f), np.sort(m)
    below_f = np.searchsorted(f_sorted, values, side="right")
    below_m = np.searchsorted(m_sorted, values, side="right")
    rates = (below_f - below_m) / f.size  # R̂_p at each value (right-continuous steps)
    over = np.flatnonzero(rates > allowed)
    ceiling = float(values[over[0]]) if over.size else math.inf
    return PartialReleaseCertificate(target, level, f.size, c, ceiling)


def partial_release_guarantee(
    first: ArrayLike,
    statistic: ArrayLike,
    threshold: float,
    level: float,
    certificate: PartialReleaseCertificate | None,
    other_level: float,
) -> dict[str, Any]:
    """The certificate's ``partial_release`` block at ``threshold``: the calibration
    rate, the bound certified at ``level`` (uniform in τ) and, with a ``certificate``, its
    target and ceiling; ``other_level``: the error statement's δ (the union bound)."""
    f, m = check_stream_statistics(first, statistic)
    rate = partial_release_rate(f, m, threshold)
    bound = certified_partial_release(f, m, threshold, level)
    block: dict[str, Any] = {
        "calibration_rate": rate,
        "certified_bound": bound,
        "level": level,
        "n": int(f.size),
        "dkw_margin": dkw_margin(f.size, level),
        "streams_with_chunks": int(np.isfinite(f).sum()),
    }
    together = level + other_level
    if certificate is not None:
        block.update(target=certificate.target, ceiling=certificate.ceiling)
        block["statement"] = (
            f"with probability >= {1 - together:g} over the calibration answers, together "
            "with the error statement: the probability that a stream shows text and is then "
            f"stopped is <= {certificate.target:g} (certified bound {bound:.4g} at this "
            f"threshold); each statement at its own share of delta (union bound)"
        )
    else:
        block["statement"] = (
            f"with probability >= {1 - level:g} over the calibration answers: the "
            f"probability that a stream shows text and is then stopped is <= {bound:.4g} "
            "(a bound uniform in the threshold, so valid at this one; together with the "
            f"error statement with probability >= {1 - together:g})"
        )
    return block
