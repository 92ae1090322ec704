"""The risk-mode procedures (abstain_guard.guarantee.risk_control): their label-free plans, the
selection on hand-made p-values, the hand-made case the original procedure gets wrong, and a
small version of experiments/risk_control/risk_control.py's simulation on the shipped artifact's
answers."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from abstain_guard import GuardArtifact, GuardConfig, default_artifact_path
from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee import conformal
from abstain_guard.guarantee.decision import decision_rule
from abstain_guard.guarantee.risk_control import (
    DEFAULT_RISK_METHOD,
    RISK_METHODS,
    RiskPlan,
    candidate_ranks,
    chain_tested,
    grid_ranks,
    min_rank,
    multistart_starts,
    plan_tests,
    rank_p_values,
    select_rank,
    tolerant_rank,
)


def _risk(scores: np.ndarray, correct: np.ndarray, eps: float, delta: float, method: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        return conformal.risk_threshold(scores, correct, eps, delta, method=method)


# --- plans: fixed before any label is read ------------------------------------------------


def test_plans_follow_their_definitions() -> None:
    assert plan_tests("fixed_sequence", 0.2, 0.1, 500) == RiskPlan(
        "fixed_sequence", "chains", (12,), 0.1
    )
    assert min_rank(0.2, 0.1) == 12  # 0.8^11 = 0.086 <= 0.1 < 0.8^10
    # the late start tolerates an error rate of eps/2 below it
    k = tolerant_rank(0.2, 0.1, 500)
    assert k > min_rank(0.2, 0.1)
    assert stats.binom.cdf(math.ceil(0.1 * (k - 1)), k - 1, 0.2) <= 0.1
    assert all(stats.binom.cdf(math.ceil(0.1 * (j - 1)), j - 1, 0.2) > 0.1 for j in range(2, k))
    assert plan_tests("fixed_sequence_late", 0.2, 0.1, 500).ranks == (k,)
    # multi-start: ceil(0.3 n), then divided by 4 while >= 12, all at delta / s
    assert multistart_starts(1000) == (19, 75, 300)
    assert multistart_starts(107) == (33,)
    plan = plan_tests("fixed_sequence_multistart", 0.2, 0.1, 1000)
    assert plan.ranks == (max(19, min_rank(0.2, 0.1 / 3)), 75, 300)
    assert plan.level == pytest.approx(0.1 / 3)
    # grids: participation 5 %, 10 %, ..., 100 %
    assert grid_ranks(100) == tuple(range(5, 101, 5))
    for method in ("bonferroni", "holm"):
        plan = plan_tests(method, 0.3, 0.1, 100)
        assert plan.ranks == tuple(range(5, 101, 5)) and plan.level == pytest.approx(0.005)


def test_multistart_moves_starts_up_to_the_first_rank_that_can_reject() -> None:
    # 30 answers at eps = 0.1: one start, ceil(9) moved up to min_rank(0.1, 0.1) = 23
    plan = plan_tests("fixed_sequence_multistart", 0.1, 0.1, 30)
    assert plan.ranks == (23,) and plan.level == 0.1
    # 200 answers: starts 15 and 60 at 0.05 each; at eps = 0.016 both move up to 187
    assert multistart_starts(200) == (15, 60)
    assert min_rank(0.016, 0.05) == 187
    assert plan_tests("fixed_sequence_multistart", 0.016, 0.1, 200).ranks == (187,)
    assert plan_tests("fixed_sequence_multistart", 0.01, 0.1, 200).ranks == ()  # needs 300


def test_unknown_method_names_the_known_ones() -> None:
    with pytest.raises(InvalidInputError, match="fixed_sequence_multistart"):
        plan_tests("bonferoni", 0.2, 0.1, 100)
    with pytest.raises(InvalidInputError, match="Unknown risk-control method"):
        conformal.risk_threshold([0.0, 1.0], [1, 0], 0.2, 0.1, method="nope")


# --- selection on hand-made p-values --------------------------------------------------------


def _chain_by_hand(p: np.ndarray, start: int, level: float) -> int:
    best = 0
    for k in range(start, p.size + 1):
        if p[k - 1] > level:
            break
        best = k
    return best


def _holm_by_hand(p: np.ndarray, ranks: tuple[int, ...], delta: float) -> int:
    active = list(ranks)
    best = 0
    while active:
        k = min(active, key=lambda r: p[r - 1])
        if p[k - 1] > delta / len(active):
            break
        best = max(best, k)
        active.remove(k)
    return best


def test_chain_stops_at_the_first_non_rejection() -> None:
    p = np.array([1.0, 0.5, 0.04, 0.01, 0.2, 0.001, 0.001])
    candidate = np.ones(7, dtype=bool)
    one = RiskPlan("x", "chains", (3,), 0.05)
    assert int(select_rank(one, p, candidate)[0]) == 4  # 3, 4 rejected; 5 stops it
    two = RiskPlan("x", "chains", (3, 6), 0.05)
    rank, level = select_rank(two, p, candidate)
    assert int(rank) == 7 and float(level) == 0.05
    # a non-candidate (inside a tie group) is skipped, not failed
    tied = candidate.copy()
    tied[4] = False
    assert int(select_rank(one, p, tied)[0]) == 7


def test_a_chain_with_a_stride_tests_every_stride_th_rank_from_its_start() -> None:
    """Ranks 3, 6, 9 (a grid rank inside a tie group moves up to the group's end): the
    chain jumps over failures between them and stops at the first failure it tests."""
    p = np.array([1.0, 1.0, 0.01, 0.9, 0.9, 0.01, 0.9, 0.01, 0.2, 0.01])
    candidate = np.ones(10, dtype=bool)
    tested = chain_tested(candidate, 3, 3)
    assert np.flatnonzero(tested).tolist() == [2, 5, 8]
    plan = RiskPlan("x", "chains", (3,), 0.05, stride=3)
    assert int(select_rank(plan, p, candidate)[0]) == 6  # 3, 6 rejected; 9 stops it
    tied = candidate.copy()
    tied[5] = False  # rank 6 ends no tie group: rank 7 is tested in its place
    assert np.flatnonzero(chain_tested(tied, 3, 3)).tolist() == [2, 6, 8]
    assert int(select_rank(plan, p, tied)[0]) == 3
    assert np.array_equal(chain_tested(candidate, 3), candidate & (np.arange(1, 11) >= 3))


def test_bonferroni_and_holm_on_a_grid() -> None:
    p = np.array([1.0, 0.02, 0.003, 0.03, 0.001, 0.5])
    candidate = np.ones(6, dtype=bool)
    grid = (2, 3, 4, 5)
    bonf = RiskPlan("bonferroni", "bonferroni", grid, 0.1 / 4)
    holm = RiskPlan("holm", "holm", grid, 0.1 / 4)
    assert int(select_rank(bonf, p, candidate)[0]) == 5  # 0.02, 0.003, 0.001 <= 0.025
    rank, level = select_rank(holm, p, candidate)
    # Holm: 0.001 <= 0.025, 0.003 <= 0.033, 0.02 <= 0.05, 0.03 <= 0.1: all four
    assert int(rank) == 5 and float(level) == pytest.approx(0.025)
    assert _holm_by_hand(p, grid, 0.1) == 5


def test_batched_selection_matches_the_definitions() -> None:
    rng = np.random.default_rng(3)
    p = rng.uniform(size=(200, 60)) ** 3
    candidate = np.ones_like(p, dtype=bool)
    grid = grid_ranks(60)
    bonf, _ = select_rank(RiskPlan("b", "bonferroni", grid, 0.1 / len(grid)), p, candidate)
    holm, _ = select_rank(RiskPlan("h", "holm", grid, 0.1 / len(grid)), p, candidate)
    chains, _ = select_rank(RiskPlan("c", "chains", (5, 20), 0.05), p, candidate)
    for b in range(p.shape[0]):
        rejected = [k for k in grid if p[b, k - 1] <= 0.1 / len(grid)]
        assert bonf[b] == max(rejected, default=0)
        assert holm[b] == _holm_by_hand(p[b], grid, 0.1)
        by_hand = max(_chain_by_hand(p[b], 5, 0.05), _chain_by_hand(p[b], 20, 0.05))
        assert chains[b] == by_hand
    assert np.all(holm >= bonf)


def test_rank_p_values_count_the_errors_below() -> None:
    errors = np.array([0, 1, 0, 0, 1])
    p = rank_p_values(errors, 0.3)
    assert p[0] == 1.0
    below = [0, 0, 1, 1, 1]
    for k in range(2, 6):
        assert p[k - 1] == pytest.approx(stats.binom.cdf(below[k - 1], k - 1, 0.3))
    assert list(candidate_ranks(np.array([1.0, 2.0, 2.0, 3.0]))) == [True, False, True, True]


# --- the case the original procedure gets wrong -------------------------------------------


def _one_early_error(n: int = 80) -> tuple[np.ndarray, np.ndarray]:
    """The 2nd most confident answer is wrong; the next 38 are right; the rest are wrong."""
    scores = np.arange(float(n))
    correct = np.ones(n, dtype=bool)
    correct[1] = False
    correct[40:] = False
    return scores, correct


def test_one_wrong_among_the_most_confident_kills_only_the_original_chain() -> None:
    scores, correct = _one_early_error()
    eps, delta = 0.5, 0.1
    old = _risk(scores, correct, eps, delta, "fixed_sequence")
    # rank 5 is the first test that can reject (0.5^4 <= 0.1), and 1 error in 4 fails it
    assert old.min_rank == 5 and not old.feasible
    new = _risk(scores, correct, eps, delta, DEFAULT_RISK_METHOD)
    assert new.feasible and new.rank >= 40
    assert new.empirical_risk <= eps and new.certified_bound <= eps
    errors_below = int((~correct)[: new.rank - 1].sum())
    assert new.p_value == pytest.approx(stats.binom.cdf(errors_below, new.rank - 1, eps))
    assert new.p_value <= new.level <= delta
    for method in ("fixed_sequence_late", "bonferroni", "holm"):
        other = _risk(scores, correct, eps, delta, method)
        assert other.feasible and other.empirical_risk <= eps, method


def test_the_guard_records_the_method_name() -> None:
    scores, correct = _one_early_error()
    rule = decision_rule(scores, correct, GuardConfig(mode="risk", risk_target=0.5, delta=0.1))
    assert rule.guarantee.method == DEFAULT_RISK_METHOD
    assert rule.guarantee.feasible and math.isfinite(rule.threshold)


FIRST_RELEASE = Path(__file__).resolve().parents[2] / "data" / "first_release_calibration.json"
"""The first shipped guard's 107 calibration answers: the 2nd most confident one is wrong,
which stops the original fixed-sequence test (a realistic population, kept as a fixture)."""


def _first_release() -> tuple[np.ndarray, np.ndarray]:
    data = json.loads(FIRST_RELEASE.read_text(encoding="utf-8"))
    return np.asarray(data["scores"], dtype=np.float64), np.asarray(data["correct"], dtype=bool)


def test_first_release_is_certified_where_the_original_procedure_was_not() -> None:
    scores, correct = _first_release()
    old = _risk(scores, correct, 0.5, 0.1, "fixed_sequence")
    new = _risk(scores, correct, 0.5, 0.1, DEFAULT_RISK_METHOD)
    assert new.feasible and new.participation > old.participation
    assert new.certified_bound <= 0.5


# --- a small version of the simulation ------------------------------------------------------

REPS = 1000


def _population(scores: np.ndarray, correct: np.ndarray, seed: int) -> np.ndarray:
    """Errors of the population's atoms in score order (ties broken at random); atom i
    covers positions [i, i+1), which makes the population continuous."""
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(scores.size), scores))
    return (~np.asarray(correct, dtype=bool)[order]).astype(np.int64)


def _true_risk(errors: np.ndarray, t: np.ndarray) -> np.ndarray:
    cum = np.concatenate(([0], np.cumsum(errors)))
    i = np.clip(np.floor(t).astype(np.int64), 0, errors.size - 1)
    mass = cum[i] + (t - i) * errors[i]
    return np.where(t > 0, mass / np.maximum(t, 1e-300), 0.0)


def _simulate(errors: np.ndarray, n: int, eps: float, deltas: tuple[float, ...], seed: int):
    """Violation rate and mean true participation of every method, per delta."""
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.integers(0, errors.size, (REPS, n)) + rng.random((REPS, n)), axis=1)
    p_values = rank_p_values(errors[np.floor(positions).astype(np.int64)], eps)
    candidate = candidate_ranks(positions)
    out = {}
    for delta in deltas:
        for method in RISK_METHODS:
            rank, _ = select_rank(plan_tests(method, eps, delta, n), p_values, candidate)
            chosen = np.take_along_axis(positions, np.maximum(rank, 1)[:, None] - 1, axis=1)
            t = np.where(rank > 0, chosen[:, 0], 0.0)
            violation = float(np.mean(_true_risk(errors, t) > eps))
            out[method, delta] = (violation, float(np.mean(t / errors.size)))
    return out


@pytest.mark.parametrize(("n", "eps"), [(100, 0.5), (300, 0.4), (300, 0.5)])
def test_violation_rate_on_the_first_release_answers(n: int, eps: float) -> None:
    scores, correct = _first_release()
    errors = _population(scores, correct, seed=n)
    deltas = (0.05, 0.1, 0.2)
    results = _simulate(errors, n, eps, deltas, seed=int(100 * eps) + n)
    for delta in deltas:
        violation, participation = results[DEFAULT_RISK_METHOD, delta]
        assert violation <= delta + 3 * math.sqrt(delta * (1 - delta) / REPS), (delta, violation)
        # and not vacuous: more than the original procedure, which the early error stops
        assert participation > results["fixed_sequence", delta][1]
        assert participation > 0.1


@pytest.mark.parametrize("eps", [0.35, 0.5])
def test_violation_rate_on_the_shipped_answers(eps: float) -> None:
    art = GuardArtifact.load(default_artifact_path())
    errors = _population(np.asarray(art.scores), np.asarray(art.correct), seed=3)
    results = _simulate(errors, 300, eps, (0.1,), seed=int(100 * eps))
    violation, _ = results[DEFAULT_RISK_METHOD, 0.1]
    assert violation <= 0.1 + 3 * math.sqrt(0.1 * 0.9 / REPS), violation


def test_violation_rate_on_a_monotone_synthetic_population() -> None:
    rng = np.random.default_rng(5)
    u = rng.random(20_000)
    errors = _population(u, rng.random(u.size) >= u, seed=6)  # R(u) = u / 2
    violation, participation = _simulate(errors, 300, 0.2, (0.1,), seed=8)[DEFAULT_RISK_METHOD, 0.1]
    assert violation <= 0.1 + 3 * math.sqrt(0.1 * 0.9 / REPS)
    assert participation > 0.25 * 0.4  # the oracle answers 40 %
