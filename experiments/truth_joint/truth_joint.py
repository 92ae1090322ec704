"""An exact joint bound on misses and true errors among the judged wrong, for the truth
certificate's judge arm, beside the library's split bound.

At rank k the t = k − 1 answers below it split into t0 judged right (M misses among them)
and t1 judged wrong (G true errors among them); the true error count is E = M + G. Given
every label and score, and given h0 / h1 (how many of the reviewed answers fell among the
judged right / wrong), the reviewed answers among the t0 are a uniform sample of h0 of them
and those among the t1 a uniform sample of h1, independently, so the misses seen u and the
true errors seen g are independent hypergeometrics: u ~ HG(t0, M, h0), g ~ HG(t1, G, h1).

The library bounds M (at 0.8 of the test's level) and G (at 0.05) apart and adds the bounds, so
a strict judge (many false alarms, G well below t1) pays for G at a twentieth of the level and
every judge pays for both bounds at once. This arm keeps a bound of the same shape as its
statistic, T(u, g) = M⁺(u) + G⁺(g), at the levels ``--orders`` names (``ORDERS``), and
calibrates it exactly: p(M, G) = P(T(u', g') ≤ T(u, g) | M, G), a sum over both hypergeometric
laws. The rank is rejected at level a when every feasible (M, G) with M + G > c has p(M, G) ≤
0.85·a, c being the largest count with P(Binomial(t, ε) ≤ c) ≤ 0.15·a: under "R(U_(k)) > ε" a
rejection needs E ≤ c (at most 0.15·a, E being Binomial(t, R) given the scores) or the true (M,
G) outside the confidence set (at most 0.85·a). p falls in M and in G, so the largest p over M
+ G > c lies on the feasible boundary M = max(u, c + 1 − G), one value a G; (M, G) whose
marginal tail alone is at most 0.85·a are skipped.

With ``--orders library`` the statistic is the library's own bound (0.8·a, 0.05·a). Where the
library rejects (M⁺ + G⁺ ≤ c), every (M, G) with M + G > c then has p(M, G) ≤ P(M⁺(u') < M) +
P(G⁺(g') < G) ≤ 0.85·a, so this test rejects too: on the same ranks it certifies at least
what the library's arm does, for every judge (checked by enumeration in test_truth_joint.py;
on the grid below a draw can end up to one grid step under the library's every-rank chain).
``--orders test`` (0.68·a, 0.0425·a; the first runs) is as valid, without that proof.

The plan is truth_difference's: the library's judge-arm chains (truth._judge_plan) on every
⌈n/500⌉-th rank, level w·δ with the library's w; the human arm is the library's at
(1 − w)·δ. Measured on paired draws of truth_difference's power population and judges (n =
5000, ε = 0.3), and on its three least-favourable validity populations plus
:func:`flat_strict` (1,000 draws a cell), each JSON beside its command:

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python experiments/truth_joint/truth_joint.py \\
        --orders test --draws 100 --parts power --reviews 100,200 --eps 0.3 \\
        --judges strict_10pct,lenient_on_confident_wrong \\
        --out experiments/truth_joint/truth_joint_power.json
    ... --draws 100 --parts power --reviews 100,200 --judges perfect --eps 0.3 \\
        --out experiments/truth_joint/truth_joint_power_perfect.json
    ... --parts validity --populations flat,confident_band,scoped \\
        --out experiments/truth_joint/truth_joint_validity.json
    ... --parts validity --populations flat_strict \\
        --out experiments/truth_joint/truth_joint_validity_strict.json
    ... --orders library --draws 100 --parts power --reviews 100 --eps 0.3 \\
        --judges perfect,strict_10pct --out experiments/truth_joint/truth_joint_power_library.json
    ... --orders library --draws 100 --parts power --reviews 200 --eps 0.3 \\
        --judges lenient_on_confident_wrong,strict_10pct \\
        --out experiments/truth_joint/truth_joint_power_library_m200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.special import gammaln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "truth_difference"))
import truth_difference as td

from abstain_guard.guarantee import truth

JOINT_SHARE = truth.MISS_SHARE + truth.WRONG_SHARE
"""Share of a test's level spent on the joint bound (the library's two shares together); the
rest is the binomial step, as in the library."""
ORDERS = {
    "test": (truth.MISS_SHARE, truth.WRONG_SHARE),
    "library": (truth.MISS_SHARE / JOINT_SHARE, truth.WRONG_SHARE / JOINT_SHARE),
}
"""The statistic's two bounds' levels, as multiples of the joint test's level 0.85·a:
``test`` puts 0.8 and 0.05 of it on them (0.68·a, 0.0425·a); ``library`` the library's own
0.8·a and 0.05·a, the statistic whose test rejects wherever the library's does."""
OUT = Path(__file__).with_suffix(".json")
Arr = NDArray[Any]


def hypergeom_pmf(lf: Arr, total: int, marked: Arr, h: int) -> Arr:
    """P(X = x) for x = 0..h, X ~ HG(total, K, h), for each K in ``marked``: [len(K), h + 1]."""
    x = np.arange(h + 1)[None, :]
    k = marked[:, None]
    ok = (x <= k) & (h - x <= total - k)
    a = np.where(ok, k - x, 0)
    b = np.where(ok, total - k - (h - x), 0)
    logp = (
        lf[k]
        - lf[np.where(ok, x, 0)]
        - lf[a]
        + lf[total - k]
        - lf[np.where(ok, h - x, 0)]
        - lf[b]
        - (lf[total] - lf[h] - lf[total - h])
    )
    with np.errstate(over="ignore"):
        return np.where(ok, np.exp(np.where(ok, logp, 0.0)), 0.0)


def ordering(
    t0: int, t1: int, h0: int, h1: int, orders: tuple[float, float], level: float
) -> tuple[Arr, Arr]:
    """The statistic T(u', g') = A[u'] + B[g'] (both nondecreasing): the sum of the two exact
    upper bounds at the ordering levels ``orders·level`` (A = M⁺(u'), B = G⁺(g'), t1 when
    g' = h1)."""
    u, g = np.arange(h0 + 1), np.arange(h1 + 1)
    a = truth.error_upper_bound(u, h0, t0, orders[0] * level).astype(float) if h0 else u * 0.0
    b = np.full(h1 + 1, float(t1))
    if h1:
        b[:-1] = truth.error_upper_bound(g[:-1], h1, t1, orders[1] * level)
    return a, b


def joint_rejects(
    lf: Arr, counts: tuple[int, ...], c: int, beta: float, orders: tuple[float, float]
) -> bool:
    """True when every feasible (M, G) with M + G > c has p(M, G) ≤ beta, p(M, G) =
    P(T(u', g') ≤ T(u, g) | M, G); ``counts`` = (t0, t1, h0, h1, u, g)."""
    t0, t1, h0, h1, u, g = counts
    if c < 0:
        return False
    a, b = ordering(t0, t1, h0, h1, orders, beta)
    obs = a[u] + b[g] + 1e-9
    # p(M, G) ≤ P(B[g'] ≤ obs − A[0] | G) and ≤ P(A[u'] ≤ obs − B[0] | M): the (M, G) where
    # either marginal tail is at most beta are excluded without the sum
    g_top = _marginal_top(int(np.searchsorted(b, obs - a[0], side="right")) - 1, h1, t1, beta)
    m_top = _marginal_top(int(np.searchsorted(a, obs - b[0], side="right")) - 1, h0, t0, beta)
    m_hi, g_hi = min(t0 - h0 + u, m_top), min(t1 - h1 + g, g_top)
    gs = np.arange(g, g_hi + 1)
    ms = np.maximum(u, c + 1 - gs)
    keep = ms <= m_hi
    if not keep.any():
        return True  # every truth with more than c errors is infeasible or excluded
    gs, ms = gs[keep], ms[keep]
    pg = hypergeom_pmf(lf, t1, gs, h1)  # [nG, h1 + 1] over g'
    cu = np.cumsum(hypergeom_pmf(lf, t0, ms, h0), axis=1)  # [nG, h0 + 1] cdf over u'
    kmax = np.searchsorted(a, obs - b, side="right") - 1  # largest u' with A[u'] ≤ obs − B[g']
    below = np.where(kmax < 0, 0.0, cu[:, np.clip(kmax, 0, h0)])
    p = (pg * below).sum(axis=1)
    return bool(p.max() <= beta)


def _marginal_top(k: int, h: int, total: int, beta: float) -> int:
    """The largest count K with P(HG(total, K, h) ≤ k) ≥ beta (-1: none, k < 0)."""
    if k < 0:
        return -1
    return int(truth.error_upper_bound(k, h, total, beta)) if h else total


def joint_arm(
    jw: Arr,
    y: Arr,
    eps: float,
    level: float,
    shape: tuple[int, int, int],
    orders: tuple[float, float] = ORDERS["test"],
) -> Arr:
    """The joint arm's certified rank per draw at ``level`` (0: none); ``shape`` = (n, m,
    reach). Each chain from its start tests grid ranks in order and stops at its first
    failure."""
    if level <= 0:
        return np.zeros(y.shape[0], np.int64)
    n, m, reach = shape
    grid, starts, each = td.grid_plan(eps, level, n, m, reach)
    t = (grid - 1).astype(np.int64)
    crit = truth._largest_rejected(t, eps, (1 - JOINT_SHARE) * each)
    lf = gammaln(np.arange(n + 2) + 1.0)
    c = truth._counts(jw, y)
    test = (lf, t, crit, JOINT_SHARE * each, orders)
    return np.array([_row_rank(c, b, grid, starts, test) for b in range(y.shape[0])])


def _row_rank(c: Any, b: int, grid: Arr, starts: Arr, test: tuple[Any, ...]) -> int:
    """One draw's largest grid rank any chain reaches (the walk of :func:`joint_arm`)."""
    lf, t, crit, beta, orders = test
    cache: dict[int, bool] = {}
    best = 0
    for st in starts:
        i = int(np.searchsorted(grid, st))
        while i < grid.size:
            if i not in cache:
                k = int(t[i])
                t1 = int(c.t1[b, k])
                counts = (k - t1, t1, int(c.h0[b, k]), int(c.h1[b, k]), int(c.u[b, k]))
                counts += (int(c.g[b, k]),)
                inside = k > 0 and not bool(c.outside[b, k])
                cache[i] = inside and joint_rejects(lf, counts, int(crit[i]), beta, orders)
            if not cache[i]:
                break
            best = max(best, int(grid[i]))
            i += 1
    return best


def power_cell(
    judge: str, cell: tuple[int, int, float], draws: int, seed: int, orders: tuple[float, float]
) -> dict[str, Any]:
    n, m, eps = cell
    rng = np.random.default_rng(seed)
    got: dict[str, list[Arr]] = {}
    for _ in range(draws // 100):
        s, jw, y, _ = td.power_draws(judge, n, m, 100, rng)
        plan = truth.plan_truth(td.METHOD, eps, td.DELTA, n, m)
        arms = truth.arm_ranks(plan, s, jw, y, eps)
        r = joint_arm(jw, y, eps, plan.share * td.DELTA, (n, m, n), orders)
        rows = {
            "library": td.at(s, arms.rank),
            "joint": td.at(s, np.maximum(arms.human, r)),
            "joint_arm_alone": td.at(s, r),
            "human_delta": td.at(s, td.human_only(s, y, m, td.DELTA, eps)),
        }
        for k, v in rows.items():
            got.setdefault(k, []).append(v)
    out: dict[str, Any] = {"judge": judge, "n": n, "m": m, "eps": eps, "draws": draws}
    out["share_w"] = truth.plan_truth(td.METHOD, eps, td.DELTA, n, m).share
    x = {k: np.concatenate(v) for k, v in got.items()}
    base = x["human_delta"].mean()
    for k, v in x.items():
        out[k] = {**td.mean_ci(v), "ratio_vs_human_delta": float(v.mean() / base)}
        if k in ("library", "joint"):
            out[k]["paired_diff_vs_human_delta"] = td.mean_ci(v - x["human_delta"])
            out[k]["p_below_human_delta"] = float((v < x["human_delta"]).mean())
    out["joint_minus_library"] = td.mean_ci(x["joint"] - x["library"])
    out["joint_below_library"] = int((x["joint"] < x["library"]).sum())
    return out


def flat_strict(rng: np.random.Generator, b: int, n: int, eps: float) -> tuple[Arr, ...]:
    """truth_difference's flat population (risk ε + 0.002 everywhere, 4 % misses at the lowest
    scores) with a strict judge on top: 10 % of the right answers called wrong, so the arm
    leans on the bound of the true errors among the judged wrong that this test recalibrates."""
    s, wrong, judge, risk = td.flat(rng, b, n, eps)
    return s, wrong, judge & ~(~wrong & (rng.random((b, n)) < 0.1)), risk


VALIDITY = {**td.VALIDITY, "flat_strict": (flat_strict, 1.0)}
"""truth_difference's least-favourable populations and :func:`flat_strict`."""


def validity_cell(
    name: str, size: tuple[int, int], draws: int, seed: int, orders: tuple[float, float]
) -> dict[str, Any]:
    (n, m), eps = size, 0.3
    gen, scope = VALIDITY[name]
    rng = np.random.default_rng(seed)
    reach = math.ceil(scope * n)
    plan = truth.plan_truth(td.METHOD, eps, td.DELTA, n, m, reach)
    bad = {"joint_arm": 0, "human_arm": 0, "total": 0, "by_joint_arm": 0}
    for _ in range(draws // 100):
        s, wrong, judge, risk = gen(rng, 100, n, eps)
        y = td.review(rng, wrong, m, reach)
        jw = (~judge).astype(np.int64)
        human = truth.arm_ranks(truth.TruthPlan(plan.human, None, plan.share), s, jw, y, eps)
        r = joint_arm(jw, y, eps, plan.share * td.DELTA, (n, m, reach), orders)
        for k, rank in (("joint_arm", r), ("human_arm", human.human)):
            bad[k] += int((td.at(risk, rank) > eps).sum())
        bad["total"] += int((td.at(risk, np.maximum(r, human.human)) > eps).sum())
        bad["by_joint_arm"] += int((r > human.human).sum())
    lv = {
        "joint_arm": plan.share * td.DELTA,
        "human_arm": (1 - plan.share) * td.DELTA,
        "total": td.DELTA,
    }
    out: dict[str, Any] = {"population": name, "n": n, "m": m, "eps": eps, "scope": scope}
    out.update({"draws": draws, "share_w": plan.share})
    out.update({f"fwer_{k}": td.cp(bad[k], draws, lv[k]) for k in lv})
    out["certified_by_joint_arm"] = bad["by_joint_arm"] / draws
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--validity-draws", type=int, default=1000)
    ap.add_argument("--parts", default="power,validity")
    ap.add_argument("--reviews", default="100,200,400", help="the power part's m values")
    ap.add_argument("--judges", default=",".join(td.JUDGES), help="the power part's judges")
    ap.add_argument("--eps", default="0.3,0.4", help="the power part's targets")
    ap.add_argument("--populations", default=",".join(VALIDITY), help="the validity part's")
    ap.add_argument("--orders", choices=sorted(ORDERS), default="test")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    res: dict[str, Any] = {"delta": td.DELTA, "method": td.METHOD, "joint_share": JOINT_SHARE}
    res["orders"] = {"name": args.orders, "levels_of_the_joint_level": ORDERS[args.orders]}
    res["command"] = (
        "OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python experiments/truth_joint/truth_joint.py "
        f"--draws {args.draws} --validity-draws {args.validity_draws} --parts {args.parts} "
        f"--reviews {args.reviews} --judges {args.judges} --eps {args.eps} "
        f"--populations {args.populations} --orders {args.orders} --out {args.out}"
    )
    seed = 500
    for part in args.parts.split(","):
        res[part] = []
        cells = (
            [(j, 5000, m, e) for j in td.JUDGES for m in (100, 200, 400) for e in (0.3, 0.4)]
            if part == "power"
            else [(v, n, m, 0.3) for v in VALIDITY for n, m in ((5000, 200), (2000, 100))]
        )
        for name, n, m, eps in cells:
            seed += 1
            chosen = (str(m), name, str(eps)) in itertools.product(
                args.reviews.split(","), args.judges.split(","), args.eps.split(",")
            )
            if not chosen if part == "power" else name not in args.populations.split(","):
                continue
            if part == "power":
                cell = power_cell(name, (n, m, eps), args.draws, seed, ORDERS[args.orders])
            else:
                cell = validity_cell(name, (n, m), args.validity_draws, seed, ORDERS[args.orders])
            res[part].append(cell)
            print(json.dumps(cell), flush=True)
            args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
