"""The certificate on the truth (abstain_guard.guarantee.truth): the judge arm's parts
checked against direct computation, the combined certificate never below the human-only one,
its validity by simulation under judges that err where it hurts, and the judge's measured
quality (exact enumeration and the least-favourable simulation: test_truth_validity.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import cohen_kappa_score

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.artifact.files import load_npz
from abstain_guard.errors import InvalidInputError, UncertifiableTargetError
from abstain_guard.guarantee import conformal, judge_quality, judge_test, risk_control, truth
from abstain_guard.guarantee.frontier import smallest_certifiable_risk
from abstain_guard.scorers import PerplexityScorer


def test_the_hypergeometric_tail_is_scipys() -> None:
    rng = np.random.default_rng(7)
    total = rng.integers(1, 90, 4000)
    successes = rng.integers(0, 91, 4000) % (total + 1)
    draws = rng.integers(0, 91, 4000) % (total + 1)
    k = rng.integers(-1, 40, 4000)
    got = judge_test.hypergeom_cdf(k, total, successes, draws)
    assert np.allclose(got, stats.hypergeom.cdf(k, total, successes, draws), atol=1e-12)


def test_the_misses_bound_is_the_largest_count_the_hypergeometric_tail_allows() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        t0 = int(rng.integers(0, 60))
        h = int(rng.integers(0, t0 + 1))
        u = int(rng.integers(0, h + 1))
        a = float(rng.uniform(0.001, 0.3))
        got = int(judge_test.error_upper_bound(u, h, t0, a))
        allowed = [m for m in range(u, t0 - (h - u) + 1) if stats.hypergeom.cdf(u, t0, m, h) >= a]
        assert got == max(allowed, default=0)  # t0 = 0: no answer judged right


def test_the_misses_bound_covers_the_true_count_at_its_level() -> None:
    """P(M > bound) <= a when the reviewed answers are a uniformly random subset."""
    rng = np.random.default_rng(1)
    t0, h, m_true, a = 300, 40, 21, 0.05
    population = np.zeros(t0, dtype=int)
    population[:m_true] = 1
    fails = 0
    for _ in range(4000):
        sample = rng.choice(t0, h, replace=False)
        u = int(population[sample].sum())
        fails += int(judge_test.error_upper_bound(u, h, t0, a)) < m_true
    assert fails / 4000 <= a + 3 * np.sqrt(a * (1 - a) / 4000)


def _draw(rng: np.random.Generator, n: int, m: int, judge: str) -> tuple[np.ndarray, ...]:
    """Scores, true correctness, judge correctness and a review of m answers."""
    s = rng.random(n)
    wrong = rng.random(n) < 0.05 + 0.75 * s  # the error rate grows with the score
    # "lenient" calls 40 % of wrong answers right; the other one every wrong answer where the
    # scorer is confident
    lenient = rng.random(n) < 0.4 if judge == "lenient" else s <= 0.5
    judge_wrong = wrong & ~lenient
    human = np.full(n, truth.NOT_REVIEWED, dtype=np.int8)
    picked = rng.choice(n, m, replace=False)
    human[picked] = (~wrong[picked]).astype(np.int8)
    return s, ~wrong, ~judge_wrong, human


def _true_risk(threshold: float) -> float:
    """The population error rate among answered at ``threshold`` (scores uniform)."""
    t = min(max(threshold, 0.0), 1.0)
    return 0.05 + 0.75 * t / 2 if t > 0 else 0.0


@pytest.mark.parametrize("judge", ["lenient", "confident_lenient"])
def test_the_combined_certificate_holds_where_the_judge_only_one_fails(judge: str) -> None:
    """A judge that calls wrong answers right: the judge-only certificate's true risk
    exceeds ε in most draws; the combined one within δ (plus Monte Carlo error)."""
    rng = np.random.default_rng(2)
    eps, delta, draws = 0.3, 0.1, 150
    over_judge = over_truth = certified = 0
    for _ in range(draws):
        s, _, judge_right, human = _draw(rng, 600, 150, judge)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", conformal.ConformalWarning)
            only = conformal.risk_threshold(s, judge_right, eps, delta)
            res = conformal.risk_threshold(s, judge_right, eps, delta, human=human)
        over_judge += _true_risk(only.threshold) > eps
        over_truth += res.feasible and _true_risk(res.threshold) > eps
        certified += res.feasible
        assert res.reviewed == 150
    assert over_judge / draws > 0.5
    assert over_truth / draws <= delta + 3 * np.sqrt(delta * (1 - delta) / draws)
    assert certified >= draws // 10  # it still answers: not valid by abstaining alone


def test_with_a_perfect_judge_and_n_many_times_m_the_judge_arm_certifies() -> None:
    rng = np.random.default_rng(3)
    n, m = 6000, 240
    s = rng.random(n)
    right = rng.random(n) >= 0.05 + 0.75 * s
    human = np.full(n, -1, dtype=np.int8)
    picked = rng.choice(n, m, replace=False)
    human[picked] = right[picked]
    only = conformal.risk_threshold(s, right, 0.35, 0.1)
    both = conformal.risk_threshold(s, right, 0.35, 0.1, human=human)
    alone = conformal.risk_threshold(s[picked], right[picked], 0.35, 0.1)
    assert both.arm == "judge" and 0.8 * only.rank <= both.rank <= only.rank
    assert both.participation > np.mean(s <= alone.threshold)  # above human-only at δ
    assert both.certified_bound <= 0.35 and both.reviewed == m


def _rank_counts(j: np.ndarray, y: np.ndarray, rank: int) -> judge_test.RankCounts:
    """The counts below ``rank`` of sorted judge errors and truth (1 wrong, -1 unreviewed)."""
    j, y = j[: rank - 1], y[: rank - 1]
    rev = y >= 0
    t1 = int(j.sum())
    h0, h1 = int((rev & (j == 0)).sum()), int((rev & (j == 1)).sum())
    u, g = int(((y == 1) & (j == 0)).sum()), int(((y == 1) & (j == 1)).sum())
    return judge_test.RankCounts(rank - 1 - t1, t1, h0, h1, u, g)


@pytest.mark.parametrize(
    ("method", "eps", "m"), [("fixed_sequence_multistart", 0.3, 100), ("holm", 0.4, 120)]
)
def test_the_joint_test_carries_a_strict_judges_arm_past_the_split_test(
    method: str, eps: float, m: int
) -> None:
    """A judge calling 10 % of the right answers wrong: the split test bounds their true
    errors at a twentieth of the level; the joint one lets the level go there. The arm
    certifies at least the split test's rank on every draw, more on most (Holm: the joint
    test lowers a grid rank's p-value to a level only where it rejects there and at every
    level above), and reports the smallest error count its test excludes above
    (E⁺ ≤ M⁺ + G⁺)."""
    rng = np.random.default_rng(5)
    n, draws = 3000, 6
    s = np.sort(rng.random((draws, n)), axis=1)
    wrong = rng.random((draws, n)) < 0.05 + 0.75 * s
    j = (wrong | (rng.random((draws, n)) < 0.1)).astype(np.int64)
    y = np.full((draws, n), -1, dtype=np.int64)
    pick = np.argsort(rng.random((draws, n)), axis=1)[:, :m]
    np.put_along_axis(y, pick, np.take_along_axis(wrong, pick, axis=1).astype(np.int64), 1)
    plan = truth.plan_truth(method, eps, 0.1, n, m)
    assert plan.judge is not None
    assert plan.judge.stride == (n // truth.JUDGE_CHAIN_RANKS if plan.judge.kind == "chains" else 1)
    arms = truth.arm_ranks(plan, s, j, y, eps)
    p = truth.judge_p_values(j, y, eps, truth.plan_levels(plan.judge))
    split, _ = risk_control.select_rank(plan.judge, p, risk_control.candidate_ranks(s))
    assert (arms.judge >= split).all() and (arms.judge > split).sum() >= draws // 2
    for b in np.flatnonzero(arms.judge > 0):
        rank, level = int(arms.judge[b]), float(arms.judge_level[b])
        z = truth.judge_errors_bound(j[b], y[b], rank, level)
        counts = _rank_counts(j[b], y[b], rank)
        assert judge_test.joint_rejects(counts, z, level)
        assert not judge_test.joint_rejects(counts, z - 1, level)
        split_z = int(judge_test.error_upper_bound(counts.u, counts.h0, counts.t0, 0.8 * level))
        split_z += int(judge_test.error_upper_bound(counts.g, counts.h1, counts.t1, 0.05 * level))
        assert z <= split_z


def test_the_combined_threshold_is_never_below_human_only_at_its_share() -> None:
    """λ* >= the human-only threshold at (1 − w)δ on the same reviewed answers, draw by
    draw, for every n/m (w = 0 below n/m = 10: exactly the human-only certificate)."""
    rng = np.random.default_rng(8)
    for n, m in ((400, 100), (1500, 100), (3000, 120)):
        w = truth.judge_share("fixed_sequence_multistart", 0.35, 0.1, n, m)
        assert (w == 0.0) == (n / m < 10)
        for _ in range(8):
            s, _, judge_right, human = _draw(rng, n, m, "lenient")
            picked = human >= 0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", conformal.ConformalWarning)
                both = conformal.risk_threshold(s, judge_right, 0.35, 0.1, human=human)
                alone = conformal.risk_threshold(
                    s[picked], human[picked].astype(bool), 0.35, (1 - w) * 0.1
                )
            assert both.threshold >= alone.threshold
            if w == 0.0:
                assert both.threshold == alone.threshold


def test_the_plan_reads_n_m_and_the_target_only() -> None:
    plan = truth.plan_truth("fixed_sequence_multistart", 0.3, 0.1, 5000, 200)
    assert plan.share == truth.judge_share("fixed_sequence_multistart", 0.3, 0.1, 5000, 200)
    assert plan.human == risk_control.plan_tests(
        "fixed_sequence_multistart", 0.3, (1 - plan.share) * 0.1, 200
    )
    assert plan.judge is not None and plan.judge.first_rank >= 40 * 5000 / 200
    assert plan.judge.level == pytest.approx(plan.share * 0.1 / len(plan.judge.ranks))
    assert truth.plan_truth("holm", 0.3, 0.1, 500, 100).judge is None


@pytest.mark.parametrize("eps", [0.1, 0.3, 0.35, 0.4, 0.5, 0.75])
def test_the_share_keeps_the_human_plans_first_tests(eps: float) -> None:
    """w = 0 below n/m = 10; from 10 to 25 the human plan starts with the same tests (ranks
    and critical counts) as at δ, and at n/m = 25 and above with those at δ/2, w in [1/2,
    0.7]; one step past w they change (w is the end of their plateau)."""
    delta, method = 0.1, "fixed_sequence_multistart"

    def first(level: float, m: int) -> list[tuple[int, int]]:
        plan = risk_control.plan_tests(method, eps, level, m)
        crit = [
            max((e for e in range(k) if stats.binom.cdf(e, k - 1, eps) <= plan.level), default=-1)
            for k in plan.ranks
        ]
        return list(zip(plan.ranks, crit, strict=True))

    for m in (40, 100, 200, 400):
        assert truth.judge_share(method, eps, delta, 9 * m, m) == 0.0
        w = truth.judge_share(method, eps, delta, 15 * m, m)
        assert 0.0 < w <= 0.1 + 0.4 * np.log(1.5) / np.log(2.5)
        assert first((1 - w) * delta, m) == first(delta, m)
        w = truth.judge_share(method, eps, delta, 30 * m, m)
        assert 0.5 <= w <= truth.SHARE_CAP
        assert first((1 - w) * delta, m) == first(delta / 2, m)
        if w < truth.SHARE_CAP:
            assert first((1 - w - 1e-6) * delta, m) != first(delta / 2, m)


def test_p_values_are_the_smallest_rejecting_level_of_the_plan() -> None:
    rng = np.random.default_rng(4)
    s, _, judge_right, human = _draw(rng, 400, 120, "lenient")
    order = np.lexsort((judge_right.astype(np.int8), s))
    j = (~judge_right[order]).astype(int)
    y = np.where(human[order] == -1, -1, 1 - human[order])
    plan = risk_control.plan_tests("holm", 0.35, 0.1, 400)
    levels = truth.plan_levels(plan)
    p = truth.judge_p_values(j, y, 0.35, levels)
    for a in levels:
        assert np.array_equal(p <= a, truth.judge_rejections(j, y, 0.35, a))
    assert set(np.unique(p)) <= set(levels) | {1.0}


def test_bad_human_labels_are_refused_with_what_to_give() -> None:
    with pytest.raises(InvalidInputError, match="one entry per calibration answer"):
        truth.check_human_labels([1, 0], 3)
    with pytest.raises(InvalidInputError, match=r"-1 \(not reviewed\)"):
        truth.check_human_labels([1, 2, -1], 3)
    with pytest.raises(InvalidInputError, match="no reviewed answer"):
        truth.check_human_labels([-1, -1, -1], 3)


def test_judge_quality_matches_sklearn_and_exact_intervals() -> None:
    rng = np.random.default_rng(5)
    y = rng.random(500) < 0.6
    j = np.where(rng.random(500) < 0.1, ~y, y)
    human = np.full(800, -1, dtype=np.int8)
    judge = rng.random(800) < 0.5
    idx = rng.choice(800, 500, replace=False)
    human[idx] = y
    judge[idx] = j
    q = judge_quality.judge_quality(judge, human, resamples=200)
    assert q.m == 500 and q.agreement == pytest.approx(float((j == y).mean()))
    assert q.kappa == pytest.approx(cohen_kappa_score(j, y))
    assert q.kappa_ci[0] < q.kappa < q.kappa_ci[1]
    lenient = int(((~y) & j).sum())
    assert q.lenient_rate == pytest.approx(lenient / int((~y).sum()))
    ci = stats.binomtest(lenient, int((~y).sum())).proportion_ci(method="exact")
    assert q.lenient_ci == pytest.approx((ci.low, ci.high))
    assert truth.labels_statement(500).startswith("certified on human labels (m = 500")
    assert "not on the truth" in truth.labels_statement(0, "lexical")


def test_the_artifact_keeps_the_review_and_its_decisions_say_on_whose_labels(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(6)
    s, _, judge_right, human = _draw(rng, 800, 200, "lenient")
    cfg = GuardConfig(mode="risk", risk_target=0.35, delta=0.1, on_infeasible="abstain_all")
    art = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(s, judge_right, human=human)
    )
    root = art.save(tmp_path / "reviewed")
    assert set(load_npz((root / "review.npz").read_bytes(), "review.npz")) == {"human"}
    loaded = GuardArtifact.load(root)
    assert loaded.human is not None and np.array_equal(loaded.human, human)
    g = loaded.decision_rule(cfg).guarantee
    assert g.labels == "human" and g.reviewed == 200
    assert "true error rate" in g.statement
    assert "certified on human labels (m = 200" in g.statement
    q = g.judge_quality
    assert q["m"] == 200 and 0.2 < q["lenient_rate"] < 0.6  # the judge misses 40 %
    assert len(q["lenient_ci"]) == 2
    plain = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(s, judge_right)
    )
    p = plain.decision_rule(cfg).guarantee
    assert p.labels == "judge" and p.reviewed == 0 and p.judge_quality is None
    assert "not on the truth" in p.statement
    # a lenient judge: the judge-only rule answers more than the truth allows
    assert plain.decision_rule(cfg).threshold > loaded.decision_rule(cfg).threshold
    with pytest.raises(InvalidInputError, match="no reviewed answer"):
        GuardArtifact.from_calibration(
            scorer=PerplexityScorer(),
            calibration=CalibrationSet(s, judge_right, human=np.full(800, -1)),
        )


def test_the_refusal_names_the_smallest_target_the_review_certifies() -> None:
    """The "smallest risk_target" of a refused target is the one the certificate on the
    truth certifies, not the judge-only one."""
    rng = np.random.default_rng(9)
    s, _, judge_right, human = _draw(rng, 800, 200, "lenient")
    cfg = GuardConfig(mode="risk", risk_target=0.06, delta=0.1)
    art = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(s, judge_right, human=human)
    )
    with pytest.raises(UncertifiableTargetError) as info:
        art.decision_rule(cfg)
    on_truth = smallest_certifiable_risk(s, judge_right, 0.1, human)
    assert info.value.smallest_risk_target == on_truth
    assert on_truth is not None and on_truth != smallest_certifiable_risk(s, judge_right, 0.1)
