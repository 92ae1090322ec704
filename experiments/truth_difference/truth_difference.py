"""A difference-based judge arm for the certificate on the truth, beside the library's.

At rank k the true errors of the t = k − 1 answers below it are E = J + D: J the judge's
wrong calls (known on all t) and D = Σ d_i, d_i = wrong_i − judge_wrong_i ∈ {−1, 0, 1} (a
miss +1, a false alarm −1). Given the h reviewed answers below the rank, they are a uniform
sample without replacement of the t, so one upper confidence bound on D bounds E: the arm
rejects "R(U_(k)) > ε" at level a when the betting test of "D ≥ c − J + 1" rejects at 0.85·a,
c being the largest count with P(Binomial(t, ε) ≤ c) ≤ 0.15·a (a union of the two steps).

The D test is a hedged-capital betting test for sampling without replacement (after
Waudby-Smith & Ramdas): the reviewed answers below the rank, in the order of a random key
drawn before any label, bet against the mean of the remaining population under the null,
K_i = Π (1 − λ_j (X_j − m_j)), m_j = (S0 − Σ_{l<j} X_l)/(t − j + 1); a nonnegative
supermartingale under D ≥ S0, so P(max_i K_i ≥ 1/a) ≤ a (Ville). λ_j is predictable: the
fixed-sample plug-in sqrt(2 ln(1/a)/(h σ̂²_j)), capped at c/(1 − m_j), the capital averaged
over c ∈ CAPS (a mixture of four bettors). ``diff_rejections(..., lams)`` also runs the
λ-grid variant d_λ = wrong − λ·judge_wrong (each λ at its share of the level, Bonferroni);
the main run uses λ = 1 only.

The arm's chains are the library's judge-arm chains (truth._judge_plan: the method's
multistart starts, moved up to 40·n/m expected reviewed answers) run on a fixed grid of
ranks (every ⌈n/500⌉-th), its level w·δ with the library's w (truth.judge_share); the human
arm is the library's at (1 − w)·δ, unchanged. Everything the plan reads is (n, m, ε, δ).

Measured, on paired draws (the same answers, judge labels, review and order keys):

- power: the linear population of bench/power/truth_certificate.py (wrong w.p. 0.05 + 0.75u)
  and its four judges, n = 5000 and m ∈ {100, 200, 400}, plus n/m ≤ 10 cells; mean
  participation of today's combined certificate, the difference-arm combined one and
  human-only LTT at δ, with 95 % normal intervals and ratios;
- validity: the flat, confident_band and scoped populations (copied from the bench) at
  (5000, 200) and (2000, 100): the family-wise error of the difference arm against w·δ and of
  its combined certificate against δ, exact Clopper-Pearson intervals;
- the lenient judge: the combined certificate for a grid of fixed w and with both arms at
  δ (2δ in all: with both plans monotone in their level, no split of δ gives more).

The JSON holds two runs on the same power draws: the equal-weight mixture (every part; keys
without a suffix) and the mixture weighted to the boldest bettor (``@high`` keys: the n = 5000,
m ∈ {100, 200} power cells and the validity cells; its validity draws differ from the first
run's, the seeds counting the parts run):

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python \\
        experiments/truth_difference/truth_difference.py
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python \\
        experiments/truth_difference/truth_difference.py --mixture high \\
        --parts power,validity --reviews 100,200
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import stats

from abstain_guard.guarantee import judge_test, risk_control, truth

DELTA = 0.1
METHOD = risk_control.DEFAULT_RISK_METHOD
D_SHARE = 0.85
"""Share of a test's level spent on the betting bound of D; the rest is the binomial step."""
CAPS = (0.5, 0.75, 0.9, 0.97)
"""The mixture's betting-fraction caps: component c bets λ_j = min(plug-in, c/(hi − m_j)); the
capital is the components' weighted average (a supermartingale too: at most −ln(weight) lost
against the component alone)."""
MIXTURES = {"equal": (0.25, 0.25, 0.25, 0.25), "high": (0.1, 0.1, 0.2, 0.6)}
"""The components' weights (fixed before any draw); ``--mixture`` picks one."""
WEIGHTS = {"now": MIXTURES["equal"]}
GRID = 500
"""The arm tests every ⌈n/GRID⌉-th rank."""
OUT = Path(__file__).with_suffix(".json")

Arr = NDArray[Any]


def review(rng: np.random.Generator, wrong: Arr, m: int, reach: int) -> Arr:
    """Human labels [B, n] (1 wrong, 0 right, -1 unreviewed, -2 out of scope) of a uniform
    review of m among the ``reach`` lowest scores (the bench's draw)."""
    b, n = wrong.shape
    y = np.full((b, n), -1, dtype=np.int64)
    y[:, reach:] = truth.OUT_OF_SCOPE
    pick = np.argsort(rng.random((b, reach)), axis=1)[:, :m]
    np.put_along_axis(y, pick, np.take_along_axis(wrong, pick, axis=1).astype(np.int64), 1)
    return y


def grid_plan(eps: float, level: float, n: int, m: int, reach: int) -> tuple[Arr, Arr, float]:
    """(grid ranks, chain starts on the grid, level of each chain) of the arm, from
    (n, m, ε, level) only: the library's judge-arm plan, its starts moved up to the grid."""
    plan = truth._judge_plan(METHOD, eps, level, (n, reach), m)
    step = math.ceil(n / GRID)
    grid = np.arange(step, n + 1, step)
    starts = np.unique([grid[np.searchsorted(grid, k)] for k in plan.ranks if k <= grid[-1]])
    return grid, starts, plan.level


def _log_capital(x: Arr, inc: Arr, s0: Arr, pop: Arr, a: float, bounds: tuple[float, float]):
    """Max over the sample of the log capital of the betting test of "total ≥ s0" on a
    population of ``pop`` values in ``bounds``; x, inc [B, R, m] (the sample in key order,
    inc: inside the rank's population); +inf where the null is impossible."""
    hi = bounds[1]
    xi = x * inc
    s_prev = np.cumsum(xi, axis=-1) - xi
    n_prev = np.cumsum(inc, axis=-1) - inc
    q_prev = np.cumsum(xi * xi, axis=-1) - xi * xi
    h = inc.sum(axis=-1, keepdims=True)
    remaining = np.maximum(pop[..., None] - n_prev, 1)
    mean = (s0[..., None] - s_prev) / remaining
    var = (0.25 + q_prev - s_prev**2 / (n_prev + 1)) / (n_prev + 1)
    lam = np.sqrt(2 * math.log(1 / a) / (np.maximum(h, 1) * np.maximum(var, 1e-4)))
    impossible = inc & (mean > hi)
    logs = []
    for cap in CAPS:
        bet = np.minimum(lam, cap / np.maximum(hi - mean, 1e-12))
        factor = np.where(inc & ~impossible, 1 - bet * (x - mean), 1.0)
        logs.append(np.cumsum(np.log(np.maximum(factor, 1e-300)), axis=-1))
    logw = np.log(np.asarray(WEIGHTS["now"]))[:, None, None, None]
    mix = np.logaddexp.reduce(np.stack(logs) + logw, axis=0)
    logk = mix.max(axis=-1)
    dead = impossible.any(axis=-1) | (s0 > hi * pop)
    return np.where(dead, np.inf, logk)


def diff_rejections(jw: Arr, y: Arr, key: Arr, grid: Arr, eps: float, a: float, lams=(1.0,)):
    """[B, R] bool: the difference test at every grid rank, level a (split D_SHARE / rest;
    the D level split evenly over ``lams``)."""
    b = y.shape[0]
    rev = y >= 0
    m = int(rev[0].sum())
    pos = np.sort(np.argsort(~rev, axis=1, kind="stable")[:, :m], axis=1)
    order = np.argsort(np.take_along_axis(key, pos, axis=1), axis=1)
    p = np.take_along_axis(pos, order, axis=1)  # reviewed positions, in key order
    yv = np.take_along_axis(y, p, axis=1).astype(float)
    jv = np.take_along_axis(jw, p, axis=1).astype(float)
    t = grid - 1
    inc = p[:, None, :] < t[None, :, None]
    jcount = np.concatenate([np.zeros((b, 1)), np.cumsum(jw, axis=1)], axis=1)[:, t]
    crit = judge_test.largest_rejected(t.astype(np.int64), eps, (1 - D_SHARE) * a)
    outside = (np.cumsum(y == truth.OUT_OF_SCOPE, axis=1) > 0)[:, np.maximum(t - 1, 0)]
    ad = D_SHARE * a / len(lams)
    pop = np.broadcast_to(t.astype(float), (b, t.size))
    ok = np.zeros((b, t.size), bool)
    for lam in lams:
        x = np.broadcast_to((yv - lam * jv)[:, None, :], inc.shape)
        s0 = crit[None, :] + 1 - lam * jcount
        logk = _log_capital(x, inc, s0, pop, ad, (-lam, 1.0))
        ok |= logk >= math.log(1 / ad)
    return ok & (crit[None, :] >= 0) & ~outside & (t[None, :] > 0)


def chain_ranks(ok: Arr, grid: Arr, starts: Arr) -> Arr:
    """The largest grid rank any fixed-sequence chain from ``starts`` reaches, [B]."""
    best = np.zeros(ok.shape[0], np.int64)
    for st in starts:
        tested = grid >= st
        fails = tested[None, :] & ~ok
        first = np.where(fails.any(axis=1), fails.argmax(axis=1), grid.size)
        idx = np.arange(grid.size)
        passed = tested[None, :] & (idx[None, :] < first[:, None])
        best = np.maximum(best, np.where(passed, grid[None, :], 0).max(axis=1))
    return best


def diff_arm(jw, y, key, eps, level, n, m, reach, lams=(1.0,), chunk=25) -> Arr:
    """The difference arm's certified rank per draw at ``level`` (0: none)."""
    if level <= 0:
        return np.zeros(y.shape[0], np.int64)
    grid, starts, each = grid_plan(eps, level, n, m, reach)
    out = []
    for i in range(0, y.shape[0], chunk):
        sl = slice(i, i + chunk)
        ok = diff_rejections(jw[sl], y[sl], key[sl], grid, eps, each, lams)
        out.append(chain_ranks(ok, grid, starts))
    return np.concatenate(out)


def human_only(s: Arr, y: Arr, m: int, level: float, eps: float) -> Arr:
    plan = truth.TruthPlan(risk_control.plan_tests(METHOD, eps, level, m), None, 0.0)
    return truth.arm_ranks(plan, s, np.zeros_like(y), y, eps).human


def at(s: Arr, rank: Arr) -> Arr:
    """Participation at each draw's certified rank (its score; U uniform)."""
    v = np.take_along_axis(s, np.maximum(rank - 1, 0)[:, None], axis=1)[:, 0]
    return np.where(rank > 0, v, 0.0)


def mean_ci(x: Arr) -> dict[str, Any]:
    se = float(x.std(ddof=1) / math.sqrt(x.size))
    return {"mean": float(x.mean()), "ci95": [x.mean() - 1.96 * se, x.mean() + 1.96 * se]}


JUDGES = {
    "perfect": lambda rng, s, wrong: ~wrong,
    "misses_2pct": lambda rng, s, wrong: ~wrong | (rng.random(s.shape) < 0.02),
    "lenient_on_confident_wrong": lambda rng, s, wrong: ~wrong | (s < 0.3),
    "strict_10pct": lambda rng, s, wrong: ~wrong & ~(rng.random(s.shape) < 0.1),
}
"""The bench's judges (True = called right)."""


def power_draws(judge: str, n: int, m: int, b: int, rng: np.random.Generator):
    s = np.sort(rng.random((b, n)), axis=1)
    wrong = rng.random((b, n)) < 0.05 + 0.75 * s
    jw = (~JUDGES[judge](rng, s, wrong)).astype(np.int64)
    y = review(rng, wrong, m, n)
    key = rng.random((b, n))  # the sample's order, drawn before any label is read
    return s, jw, y, key


def power_chunk(judge, n, m, eps, b, rng, lams_variants) -> dict[str, Arr]:
    s, jw, y, key = power_draws(judge, n, m, b, rng)
    plan = truth.plan_truth(METHOD, eps, DELTA, n, m)
    arms = truth.arm_ranks(plan, s, jw, y, eps)
    out = {"library": at(s, arms.rank), "human_delta": at(s, human_only(s, y, m, DELTA, eps))}
    for name, lams in lams_variants.items():
        r = diff_arm(jw, y, key, eps, plan.share * DELTA, n, m, n, lams)
        out[name] = at(s, np.maximum(arms.human, r))
        out[name + "_arm_alone"] = at(s, r)
    return out


def power_cell(judge, n, m, eps, draws, seed, lams_variants) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    parts = [power_chunk(judge, n, m, eps, 100, rng, lams_variants) for _ in range(draws // 100)]
    got = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    base = got["human_delta"].mean()
    cell: dict[str, Any] = {"judge": judge, "n": n, "m": m, "eps": eps, "draws": draws}
    cell["share_w"] = truth.plan_truth(METHOD, eps, DELTA, n, m).share
    for k, v in got.items():
        cell[k] = {**mean_ci(v), "ratio_vs_human_delta": float(v.mean() / base) if base else None}
        if k != "human_delta" and not k.endswith("alone"):
            cell[k]["paired_diff_vs_human_delta"] = mean_ci(v - got["human_delta"])
    return cell


def flat(rng, b, n, eps):
    s = np.sort(rng.random((b, n)), axis=1)
    p = eps + 0.002
    wrong = rng.random((b, n)) < p
    missed = wrong & (s < 0.2) & (rng.random((b, n)) < 0.04 / 0.2 / p)
    return s, wrong, ~wrong | missed, np.full((b, n), p)


def confident_band(rng, b, n, eps):
    s = np.sort(rng.random((b, n)), axis=1)
    band = s < 0.06
    wrong = rng.random((b, n)) < np.where(band, 0.6, 0.1 + 0.5 * s)
    low = np.minimum(s, 0.06)
    mass = 0.6 * low + np.where(s > 0.06, 0.1 * (s - 0.06) + 0.25 * (s**2 - 0.06**2), 0.0)
    return s, wrong, ~wrong | band, mass / np.maximum(s, 1e-12)


def scoped(rng, b, n, eps):
    s = np.sort(rng.random((b, n)), axis=1)
    wrong = rng.random((b, n)) < 0.05 + 0.75 * s
    missed = wrong & (s < 0.2) & (rng.random((b, n)) < 0.04 / 0.2 / 0.125)
    return s, wrong, ~wrong | missed, 0.05 + 0.75 * s / 2.0


VALIDITY = {"flat": (flat, 1.0), "confident_band": (confident_band, 1.0), "scoped": (scoped, 0.8)}
"""The bench's least-favourable populations (copied): name: (generator, review scope)."""


def cp(k: int, total: int, level: float) -> dict[str, Any]:
    ci = stats.binomtest(k, total).proportion_ci(method="exact")
    return {"errors": k, "rate": k / total, "ci95": [ci.low, ci.high], "level": level}


def validity_cell(name: str, n: int, m: int, draws: int, seed: int, eps: float = 0.3):
    gen, scope = VALIDITY[name]
    rng = np.random.default_rng(seed)
    reach = math.ceil(scope * n)
    plan = truth.plan_truth(METHOD, eps, DELTA, n, m, reach)
    bad = {"diff_arm": 0, "human_arm": 0, "total": 0, "by_diff_arm": 0}
    for _ in range(draws // 100):
        s, wrong, judge, risk = gen(rng, 100, n, eps)
        y = review(rng, wrong, m, reach)
        key = rng.random((100, n))
        jw = (~judge).astype(np.int64)
        human = truth.arm_ranks(truth.TruthPlan(plan.human, None, plan.share), s, jw, y, eps)
        r = diff_arm(jw, y, key, eps, plan.share * DELTA, n, m, reach)
        for k, rank in (("diff_arm", r), ("human_arm", human.human)):
            bad[k] += int((at(risk, rank) > eps).sum())
        bad["total"] += int((at(risk, np.maximum(r, human.human)) > eps).sum())
        bad["by_diff_arm"] += int((r > human.human).sum())
    lv = {"diff_arm": plan.share * DELTA, "human_arm": (1 - plan.share) * DELTA, "total": DELTA}
    out = {"population": name, "n": n, "m": m, "eps": eps, "scope": scope, "draws": draws}
    out["share_w"] = plan.share
    out.update({f"fwer_{k}": cp(bad[k], draws, lv[k]) for k in lv})
    out["certified_by_diff_arm"] = bad["by_diff_arm"] / draws
    return out


def share_sweep(judge, n, m, eps, draws, seed, shares) -> dict[str, Any]:
    """Combined = max(human arm at (1 − w)δ, difference arm at wδ) for fixed w's, and both at
    δ (2δ in all), on paired draws; ratio to human-only at δ."""
    rng = np.random.default_rng(seed)
    got: dict[str, list[Arr]] = {}
    for _ in range(draws // 100):
        s, jw, y, key = power_draws(judge, n, m, 100, rng)
        rows = {"human_delta": at(s, human_only(s, y, m, DELTA, eps))}
        for w in shares:
            h = human_only(s, y, m, (1 - w) * DELTA, eps) if w < 1 else np.zeros(100, np.int64)
            r = diff_arm(jw, y, key, eps, w * DELTA, n, m, n)
            rows[f"w={w:.3f}"] = at(s, np.maximum(h, r))
        r = diff_arm(jw, y, key, eps, DELTA, n, m, n)
        rows["both_at_delta"] = at(s, np.maximum(human_only(s, y, m, DELTA, eps), r))
        rows["diff_arm_alone_at_delta"] = at(s, r)
        for k, v in rows.items():
            got.setdefault(k, []).append(v)
    base = np.concatenate(got["human_delta"]).mean()
    out: dict[str, Any] = {"judge": judge, "n": n, "m": m, "eps": eps, "draws": draws}
    for k, v in got.items():
        x = np.concatenate(v)
        out[k] = {**mean_ci(x), "ratio_vs_human_delta": float(x.mean() / base)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=500)
    ap.add_argument("--validity-draws", type=int, default=2000)
    ap.add_argument("--parts", default="power,small,validity,sweep")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--mixture", choices=sorted(MIXTURES), default="equal")
    ap.add_argument("--reviews", default="100,200,400", help="the power part's m values")
    args = ap.parse_args()
    parts = args.parts.split(",")
    WEIGHTS["now"] = MIXTURES[args.mixture]
    tag = "" if args.mixture == "equal" else f"@{args.mixture}"
    res: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    res.update(
        {
            "delta": DELTA,
            "method": METHOD,
            "d_share": D_SHARE,
            "caps": CAPS,
            "mixtures": MIXTURES,
            "grid": GRID,
        }
    )
    variants = {"difference": (1.0,)}
    seed = 100
    if "power" in parts:
        res["power" + tag] = []
        for judge in JUDGES:
            for m in (100, 200, 400):
                for eps in (0.3, 0.4):
                    seed += 1
                    if str(m) not in args.reviews.split(","):
                        continue
                    cell = power_cell(judge, 5000, m, eps, args.draws, seed, variants)
                    res["power" + tag].append(cell)
                    print(json.dumps(cell), flush=True)
                    args.out.write_text(json.dumps(res, indent=1) + "\n")
    if "small" in parts:
        res["power_small" + tag] = []
        for judge in JUDGES:
            for n, m in ((1000, 200), (2000, 200), (2000, 400)):
                for eps in (0.3, 0.4):
                    seed += 1
                    cell = power_cell(judge, n, m, eps, args.draws, 1000 + seed, variants)
                    res["power_small" + tag].append(cell)
                    print(json.dumps(cell), flush=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    if "validity" in parts:
        res["validity" + tag] = []
        for name in VALIDITY:
            for n, m in ((5000, 200), (2000, 100)):
                seed += 1
                cell = validity_cell(name, n, m, args.validity_draws, 2000 + seed)
                res["validity" + tag].append(cell)
                print(json.dumps(cell), flush=True)
                args.out.write_text(json.dumps(res, indent=1) + "\n")
    if "sweep" in parts:
        res["lenient_share_sweep" + tag] = []
        for m in (100, 200):
            seed += 1
            cell = share_sweep(
                "lenient_on_confident_wrong",
                5000,
                m,
                0.3,
                args.draws,
                3000 + seed,
                (0.068, 0.25, 0.5, truth.judge_share(METHOD, 0.3, DELTA, 5000, m), 0.9),
            )
            res["lenient_share_sweep" + tag].append(cell)
            print(json.dumps(cell), flush=True)
    res.setdefault("commands", {})[args.mixture] = (
        "OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python "
        f"experiments/truth_difference/truth_difference.py --mixture {args.mixture} "
        f"--parts {args.parts} --reviews {args.reviews} --draws {args.draws} "
        f"--validity-draws {args.validity_draws}"
    )
    args.out.write_text(json.dumps(res, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
