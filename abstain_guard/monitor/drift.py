"""Anytime-valid tests that a deployed guard's guarantee still holds (numpy; the history
of scores in a ``sortedcontainers.SortedList``).

Each is a nonnegative (super)martingale starting at 1 under its null, so by Ville's
inequality an alarm when it first reaches ``1/a`` is false with probability at most ``a``:

* :class:`ConformalTestMartingale` — exchangeability of the live scores with the calibration
  scores: smoothed conformal p-values among all earlier scores, bet on by Vovk's Simple
  Jumper (Vovk, "Testing randomness online", Statistical Science 36(4), 2021);
* :class:`ParticipationEProcess` — the live answered rate against the Pólya urn that
  exchangeability predicts from the calibration set's rank k;
* :class:`RiskEProcess` — feedback: the error rate among answered questions against ε
  (testing by betting: Waudby-Smith & Ramdas, JRSS-B 2024).

The arguments (why the p-values rank among the growing history, why the urn and not a
confidence interval, why the rule's rank and not a count at τ) and why not MAPIE's
implementation: docs/guarantees.md, "Monitoring the guarantee in production".
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sortedcontainers import SortedList

from abstain_guard.errors import InvalidInputError

#: The constant bets mixed by the participation and risk e-processes, as fractions of the
#: largest bet that cannot lose everything.
BET_FRACTIONS = (0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7)

#: Vovk's Simple Jumper experts: betting functions ``1 + e (p − 1/2)``.
JUMPER_EXPERTS = (-1.0, 0.0, 1.0)


def _bisect(history: Sequence[float], score: float) -> tuple[int, int]:
    """``(#{h < score}, #{h <= score})`` in a sorted ``history``: O(log N) (a SortedList
    bisects its own index; generic bisection would index it O(log N) times)."""
    if isinstance(history, SortedList):
        return int(history.bisect_left(score)), int(history.bisect_right(score))
    return bisect.bisect_left(history, score), bisect.bisect_right(history, score)


def smoothed_p_value(score: float, history: Sequence[float], u: float) -> float:
    """The smoothed conformal p-value of ``score`` among ``history`` (sorted ascending: a
    list or a :class:`sortedcontainers.SortedList`).

    ``p = (#{h > score} + u · (#{h = score} + 1)) / (N + 1)`` with N = len(history) and
    ``u`` uniform on [0, 1) (MAPIE's ``OnlineMartingaleTest.compute_p_value`` formula).
    Small p: the score is larger (more uncertain) than the history. O(log N).
    """
    n = len(history)
    lo, hi = _bisect(history, score)
    return float(((n - hi) + u * ((hi - lo) + 1)) / (n + 1.0))


def censored_p_value(threshold: float, history: Sequence[float], u: float) -> float:
    """The smoothed conformal p-value of a score known only to exceed ``threshold`` (a
    stopped step-gated run's partial statistic): :func:`smoothed_p_value` on the censored
    sequence, every score above ``threshold`` replaced by one common value, ``p = u ·
    (#{h > threshold} + 1) / (N + 1)``. Why it stays valid: docs/agents.md, "The drift
    monitor and stopped runs". O(log N).
    """
    n = len(history)
    _, at_or_below = _bisect(history, threshold)
    return float(u * ((n - at_or_below) + 1) / (n + 1.0))


def jumper_update(capital: NDArray[np.float64], p: float, jump: float) -> NDArray[np.float64]:
    """One step of Vovk's Simple Jumper: the experts' capitals ``[3]`` after p-value ``p``.

    Each expert first passes ``jump`` of its capital to a common pot shared equally (so the
    mixture can switch to the expert that bets on the current shift), then multiplies it by
    ``1 + e (p − 1/2)``, e in (−1, 0, 1). The sum of capitals is the martingale.
    """
    total = float(capital.sum())
    mixed = (1.0 - jump) * capital + (jump / len(JUMPER_EXPERTS)) * total
    return mixed * (1.0 + np.asarray(JUMPER_EXPERTS) * (p - 0.5))


class ConformalTestMartingale:
    """Exchangeability of live scores with the calibration scores (see the module docstring).

    Args:
        reference: calibration scores ``[n]`` (any order: only their multiset matters).
        jump: the Simple Jumper's switching rate J in (0, 1).
        rng: draws the smoothing uniforms.

    Attributes:
        history: every score so far, calibration then live, sorted (a
            :class:`sortedcontainers.SortedList`: O(log N) to rank and to insert); it grows
            by one float per live score (docs/guarantees.md, "Memory").
        value: the martingale's current value (1 before any live score).
        peak: its running maximum (what the alarm compares with 1/a).
        seen: live scores so far.
    """

    def __init__(
        self, reference: ArrayLike, jump: float = 0.01, rng: np.random.Generator | None = None
    ) -> None:
        if not 0.0 < jump < 1.0:
            raise InvalidInputError(f"jump must lie in (0, 1), got {jump!r}.")
        ref = np.asarray(reference, dtype=float).reshape(-1)
        self.history = SortedList(ref.tolist())
        self.jump = float(jump)
        self.rng = rng if rng is not None else np.random.default_rng()
        self.capital = np.full(len(JUMPER_EXPERTS), 1.0 / len(JUMPER_EXPERTS))
        self.value = 1.0
        self.peak = 1.0
        self.seen = 0

    def update(self, score: float, above: float | None = None) -> float:
        """Add one live score; return its p-value (the martingale moves to ``value``).

        ``above``: the score is censored, known only to exceed this threshold (a stopped
        step-gated run's partial statistic): its p-value is :func:`censored_p_value`.
        """
        u = float(self.rng.uniform())
        if above is not None:
            p = censored_p_value(above, self.history, u)
        else:
            p = smoothed_p_value(score, self.history, u)
        self.capital = jumper_update(self.capital, p, self.jump)
        self.value = float(self.capital.sum())
        self.peak = max(self.peak, self.value)
        self.history.add(float(score))
        self.seen += 1
        return p


class ParticipationEProcess:
    """The live answered rate against the Pólya-urn predictions of exchangeability.

    Args:
        reference: calibration scores ``[n]``.
        threshold: τ; a live score is "answered" when it ranks below the k-th calibration
            score (ties broken by uniform marks; k = n+1 for τ = +inf, 0 for τ = −inf).
        rng: draws the tie-breaking marks.
        fractions: the mixed constant bets (fractions of the largest safe bet), each used
            upwards (more answered than predicted) and downwards.
        rank: k when the rule fixes it before seeing the scores (participation mode:
            ⌈(1−α)(n+1)⌉; the urn is then exact, ties included); None: k = #{reference <= τ}.

    Attributes:
        k, n: the urn's start (k answered of n+1 slots).
        answered, seen: live indicators so far.
        value, peak: the mixture's current value and running maximum.
    """

    def __init__(
        self,
        reference: ArrayLike,
        threshold: float,
        rng: np.random.Generator | None = None,
        fractions: Sequence[float] = BET_FRACTIONS,
        rank: int | None = None,
    ) -> None:
        ref = np.asarray(reference, dtype=float).reshape(-1)
        self.rng = rng if rng is not None else np.random.default_rng()
        marks = self.rng.uniform(size=ref.size)
        self._pairs = sorted(zip(ref.tolist(), marks.tolist(), strict=True))
        self.n = int(ref.size)
        self.k = _urn_start(ref, threshold, rank)
        f = np.asarray(fractions, dtype=float)
        self._fractions = np.concatenate([f, -f])
        self._wealth = np.full(self._fractions.size, 1.0 / self._fractions.size)
        self.answered = 0
        self.seen = 0
        self.value = 1.0
        self.peak = 1.0

    @property
    def predicted(self) -> float:
        """The urn's probability that the next live score is answered."""
        return (self.k + self.answered) / (self.n + 1 + self.seen)

    def indicator(self, score: float) -> bool:
        """Whether ``score`` (with a fresh tie-breaking mark) ranks below the k-th
        calibration score."""
        below = bisect.bisect_left(self._pairs, (float(score), float(self.rng.uniform())))
        return below < self.k

    def update(self, score: float) -> bool:
        """Add one live score; return its (tie-broken) answered indicator."""
        a = self.indicator(score)
        q = self.predicted
        if 0.0 < q < 1.0:
            # factor 1 + λ(A − q): f > 0 bets on more answers than predicted with λ = f/q,
            # f < 0 on fewer with λ = f/(1−q); the worst factor is 1 − |f| > 0.
            scale = np.where(self._fractions > 0, 1.0 / q, 1.0 / (1.0 - q))
            self._wealth = self._wealth * (1.0 + self._fractions * scale * (float(a) - q))
        self.answered += int(a)
        self.seen += 1
        self.value = float(self._wealth.sum())
        self.peak = max(self.peak, self.value)
        return a


def _urn_start(ref: NDArray[np.float64], threshold: float, rank: int | None) -> int:
    """k, the urn's answered slots of n+1, for calibration scores ``ref`` ``[n]``: n+1 for
    τ = +inf and 0 for τ = −inf (the urn then never bets), else ``rank`` when the rule fixed
    it (clipped to [0, n+1]), else #{ref <= τ}."""
    if threshold == math.inf:
        return int(ref.size) + 1
    if threshold == -math.inf:
        return 0
    if rank is not None:
        return min(max(int(rank), 0), int(ref.size) + 1)
    return int(np.sum(ref <= threshold))


class RiskEProcess:
    """Feedback on answered questions against ``H0: error rate <= epsilon``.

    Args:
        epsilon: ε in (0, 1), the promised error rate among answered questions.
        fractions: the mixed constant bets λ = f/ε.

    Attributes:
        errors, seen: feedback so far.
        value, peak: the mixture's current value and running maximum.
    """

    def __init__(self, epsilon: float, fractions: Sequence[float] = BET_FRACTIONS) -> None:
        if not 0.0 < epsilon < 1.0:
            raise InvalidInputError(f"epsilon must lie in (0, 1), got {epsilon!r}.")
        self.epsilon = float(epsilon)
        self._lambdas = np.asarray(fractions, dtype=float) / self.epsilon
        self._wealth = np.full(self._lambdas.size, 1.0 / self._lambdas.size)
        self.errors = 0
        self.seen = 0
        self.value = 1.0
        self.peak = 1.0

    def update(self, error: bool) -> float:
        """Add one answered question's feedback (True: it was wrong); return the value."""
        x = 1.0 if error else 0.0
        self._wealth = self._wealth * (1.0 + self._lambdas * (x - self.epsilon))
        self.errors += int(error)
        self.seen += 1
        self.value = float(self._wealth.sum())
        self.peak = max(self.peak, self.value)
        return self.value
