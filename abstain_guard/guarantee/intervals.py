"""Binomial confidence intervals the guarantee's reports share: the Wilson score interval
of a rate (a group's participation and error rates, the monitor's answered and error rates,
the benches)."""

from __future__ import annotations

import math
from statistics import NormalDist


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float] | None:
    """The two-sided Wilson score interval of ``k`` successes in ``n`` trials at
    ``confidence`` (None when ``n == 0``), as scipy's ``binomtest(k, n).proportion_ci(
    method="wilson")`` computes it, without a test object per call."""
    if n <= 0:
        return None
    z = NormalDist().inv_cdf(0.5 + 0.5 * confidence)
    p = k / n
    denom = 2.0 * (n + z * z)
    centre = (2.0 * n * p + z * z) / denom
    delta = z / denom * math.sqrt(4.0 * n * p * (1.0 - p) + z * z)
    lo = 0.0 if k == 0 else centre - delta
    hi = 1.0 if k == n else centre + delta
    return float(lo), float(hi)
