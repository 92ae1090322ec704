"""truth_joint.py's rank test, by exact enumeration on small populations: the joint p-value is
valid (``P(p(M, G) ≤ β) ≤ β`` for the true counts), a rejection excludes every truth with more
than c errors, and the test rejects wherever the library's split bound does.

    .venv/bin/pytest -p no:cacheprovider -q experiments
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
from scipy.special import gammaln
from scipy.stats import hypergeom

sys.path.insert(0, str(Path(__file__).resolve().parent))

import truth_joint as tj

from abstain_guard.guarantee import truth

LF = gammaln(np.arange(64) + 1.0)


def _p_value(counts: tuple[int, ...], truth_counts: tuple[int, int], beta: float) -> float:
    """p(M, G) summed term by term with scipy's hypergeometric law."""
    t0, t1, h0, h1, u, g = counts
    a, b = tj.ordering(t0, t1, h0, h1, tj.ORDERS["test"], beta)
    m, big_g = truth_counts
    return sum(
        hypergeom.pmf(x, t0, m, h0) * hypergeom.pmf(z, t1, big_g, h1)
        for x, z in itertools.product(range(h0 + 1), range(h1 + 1))
        if a[x] + b[z] <= a[u] + b[g] + 1e-9
    )


def _configs(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        t0, t1 = (int(x) for x in rng.integers(1, 9, 2))
        h0, h1 = int(rng.integers(0, t0 + 1)), int(rng.integers(0, t1 + 1))
        m, big_g = int(rng.integers(0, t0 + 1)), int(rng.integers(0, t1 + 1))
        yield (t0, t1, h0, h1), (m, big_g), float(rng.choice([0.02, 0.1, 0.3]))


def _outcomes(shape: tuple[int, int, int, int], truth_counts: tuple[int, int]):
    """Every (u, g) the truth can give, with its probability."""
    t0, t1, h0, h1 = shape
    m, big_g = truth_counts
    for u, g in itertools.product(range(h0 + 1), range(h1 + 1)):
        w = hypergeom.pmf(u, t0, m, h0) * hypergeom.pmf(g, t1, big_g, h1)
        if w > 0:
            yield (*shape, u, g), w


def test_the_joint_p_value_is_valid_and_a_rejection_excludes_the_truth() -> None:
    for shape, truth_counts, beta in _configs(0, 150):
        size = 0.0
        for counts, w in _outcomes(shape, truth_counts):
            p = _p_value(counts, truth_counts, beta)
            size += w * (p <= beta)
            c = sum(truth_counts) - 1  # the truth has more than c errors
            if tj.joint_rejects(LF, counts, c, beta, tj.ORDERS["test"]):
                assert p <= beta + 1e-12, (counts, truth_counts, beta)
        assert size <= beta + 1e-12, (shape, truth_counts, beta, size)


def test_the_joint_test_rejects_wherever_the_split_bound_does() -> None:
    rejected = 0
    for shape, truth_counts, beta in _configs(1, 150):
        level = beta / tj.JOINT_SHARE
        for counts, _ in _outcomes(shape, truth_counts):
            t0, t1, h0, h1, u, g = counts
            misses = int(truth.error_upper_bound(u, h0, t0, truth.MISS_SHARE * level))
            wrong = int(truth.error_upper_bound(g, h1, t1, truth.WRONG_SHARE * level))
            wrong = t1 if g == h1 else wrong
            for c in range(t0 + t1 + 1):
                if misses + wrong <= c:
                    rejected += 1
                    assert tj.joint_rejects(LF, counts, c, beta, tj.ORDERS["library"]), (
                        counts,
                        c,
                        beta,
                    )
    assert rejected > 100
