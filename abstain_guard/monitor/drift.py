"""Anytime-valid tests that a deployed guard's guarantee still holds (numpy; the history
of scores in a ``sortedcontainers.SortedList``).

Three sequential tests, each a nonnegative (super)martingale with initial value 1 under its
null hypothesis, so by Ville's inequality ``P(sup_t M_t >= 1/a) <= a``: an alarm raised
when ``M_t`` first reaches ``1/a`` is false with probability at most ``a``, however long
the monitor runs and however often it is looked at (no fixed-sample test repeated as data
arrive, which would inflate false alarms).

* :class:`ConformalTestMartingale` — exchangeability of the live scores with the
  calibration scores. Smoothed conformal p-values of each live score among *all earlier
  scores* (calibration, then the live ones before it) are independent and uniform when the
  whole sequence is exchangeable (Vovk, Gammerman & Shafer, *Algorithmic Learning in a
  Random World*, 2005 / 2nd ed. 2022, on testing exchangeability online); the Simple Jumper
  betting martingale turns them into a test martingale (Vovk, "Testing randomness online",
  Statistical Science 36(4), 2021; Vovk et al., "Retrain or not retrain: conformal test
  martingales for change-point detection", COPA 2021). The p-values must use the growing
  history: ranks among the fixed calibration set alone are dependent through it (given the
  calibration set they are not uniform), so a product of bets on them is not a test
  martingale, and a bettor that learns their law would alarm on exchangeable traffic.
* :class:`ParticipationEProcess` — the answered rate against the guaranteed band. With τ the
  k-th smallest of n calibration scores, exchangeability makes the live answered indicators
  a Pólya urn: ``P(answered_t | past) = (k + a_{t-1}) / (n + t)`` (a: answered so far),
  whose first value ``k/(n+1)`` is the guaranteed band ``[1−α, 1−α+1/(n+1))``. The
  calibration-conditional participation is Beta(k, n+1−k), much wider than the band for a
  few hundred calibration answers, so comparing a live rate's confidence interval with the
  band would alarm on exchangeable traffic; betting against the urn's predictions does not.
  Ties with calibration scores are broken by a uniform mark per score (fixed for the
  calibration scores), which makes the order strict; the urn is then exact when k is fixed
  before the data are seen (participation mode: k = ⌈(1−α)(n+1)⌉, passed as ``rank``).
  Counting k = #{calibration <= τ} instead makes k depend on the calibration scores where
  they tie at τ, and the urn's frequencies are off (``tests/test_monitor_math.py`` measures
  it). In risk mode k is chosen from the calibration labels and scores, so the urn is an
  approximation there.
* :class:`RiskEProcess` — feedback: is the error rate among answered questions above ε?
  Under ``H0: E[error_i | past] <= ε`` every bet ``1 + λ(error_i − ε)`` with
  ``0 <= λ <= 1/ε`` has conditional mean ≤ 1, so their product is a test supermartingale
  (testing by betting: Shafer, JRSS-A 2021; Waudby-Smith & Ramdas, JRSS-B 2024); a uniform
  mixture over a grid of constant bets is one too and is close to the best constant bet in
  hindsight (regret log m).

Why not a library. MAPIE 1.6 (``mapie.exchangeability_testing``) computes the first test
(``OnlineMartingaleTest.compute_p_value`` + ``update_simple_jumper_martingale``) and a risk
monitor (``RiskMonitoring``: a Hoeffding bound on a reference risk, then a conjugate-mixture
empirical-Bernstein confidence sequence from ``confseq``). It is a dev dependency only (it
pulls scikit-learn into a core of numpy, scipy and sortedcontainers), its martingale test
needs a MAPIE estimator and (X, y) to compute conformity scores where we already have scores, keeps
its history as a Python list (O(N) per p-value), and ``RiskMonitoring`` recomputes its bound
over the whole history at every update (O(t) root finds), estimates its threshold from a
reference set where ours is the guaranteed ε, and spends the level four ways (a/2 for the
reference, a/4 one-sided online). The tests in ``tests/test_monitor_math.py`` check our
p-values and martingale against MAPIE's on the same inputs (equal to float precision), and
the risk e-process against ``RiskMonitoring`` (both valid; ours alarms no later on the
shifted streams of the test).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sortedcontainers import SortedList

from abstain_guard.errors import InvalidInputError

__all__ = [
    "BET_FRACTIONS",
    "ConformalTestMartingale",
    "ParticipationEProcess",
    "RiskEProcess",
    "censored_p_value",
    "jumper_update",
    "smoothed_p_value",
]

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
    step-gated agent run stopped at the call whose running maximum crossed τ: its whole-run
    statistic is at least the partial one, so all it says is "above τ").

    It is :func:`smoothed_p_value` on the censored sequence, every score above ``threshold``
    replaced by one common value: ``p = u · (#{h > threshold} + 1) / (N + 1)``. Censoring is
    one monotone map applied to the calibration and the live scores alike, so the p-values
    stay independent and uniform under exchangeability of the whole-run statistics; ranking
    the partial statistic as it is would not (it sits below the whole-run value the
    references hold). Exact for later scores at or under ``threshold``, which rank the same
    in both sequences. O(log N).
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
            :class:`sortedcontainers.SortedList`: O(log N) to rank and to insert). It grows
            by one float per live score, about 40 bytes (``docs/guarantees.md``, measured):
            valid p-values need the rank among *all* earlier scores.
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
