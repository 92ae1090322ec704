"""The certificate on the truth (abstain_guard.guarantee.truth) where it breaks and where users are.

Validity: least-favourable populations (continuous scores U ~ Uniform(0, 1), the true risk
among answered R(λ) known in closed form), n ∈ {1000, 2000, 5000}, m ∈ {100, 200, 400},
10,000 draws each: the family-wise error (a certified threshold with R > ε) of each arm and
of the certificate, with exact 95 % Clopper-Pearson intervals, and which arm certified.

- ``flat``: every answer wrong with probability ε + 0.002 (every certificate is wrong); a
  judge with no false alarm that misses 4 % of the answers, all among the lowest 20 % scores.
- ``flat_strict``: ``flat`` with a strict judge on top (10 % of the right answers called
  wrong), where the judge arm's joint test spends its level on the judged wrong.
- ``confident_band``: the 6 % most confident answers wrong with probability 0.6, the others
  with 0.1 + 0.5·u; the judge calls right every wrong answer of the band (the misses, ≈ 3.6 %
  of all answers, inside it).
- ``scoped``: wrong with probability 0.05 + 0.75·u (R crosses ε = 0.3 at u ≈ 0.667); the
  review drawn among the 80 % lowest scores, so ε is crossed inside the scope; the judge
  misses 4 % of the answers among the lowest 20 %.

Power: paired draws (the same answers, labels and review) of the combined certificate and
human-only Learn-then-Test on the reviewed answers at δ and at (1 − w)δ, over n, m and four
judges on the linear population (wrong with probability 0.05 + 0.75·u): perfect, 2 % misses
at random, lenient on confident wrong answers (every wrong answer with u < 0.3 called right),
strict (10 % of right answers called wrong). Reported: mean true participation of each, the
paired difference with its 95 % normal interval, P(combined < human-only at δ), the mean
shortfall where it is, and P(combined < human-only at (1 − w)δ) (0 by construction).

Low accuracy: 2,089 answers, 6.6 % right (P(right | u) = 0.85·exp(−u/0.078)), a perfect
judge, m = 200 drawn as ``calibrate --review 200`` draws (planned scope), ε ∈ {0.75, 0.5}:
the certified participation against the judge-only certificate and human-only LTT on the same
review.

Shipped guard: abstain_guard/default_guard's calibration answers (their labels as the
truth, a judge wrong on 1 % of them as review-size simulates it), ε = 0.35, δ = 0.1, m ∈ {100,
200, 400}: human-only LTT on a uniform review, the combined certificate on it, and the
combined certificate on the planned review.

    OMP_NUM_THREADS=1 nice .venv/bin/python bench/power/truth_certificate.py \\
        --out bench/power/truth_certificate.json --jobs 2

The confseq cross-check needs confseq, whose sdist builds only by hand here (its build
requirements pin a pybind11 older than Python 3.11): ``apt-get install libboost-dev``, then
``.venv/bin/pip install pybind11 scikit-build cmake ninja multiprocess`` and ``.venv/bin/pip
install --no-build-isolation --no-deps confseq``; without it the JSON says it was not run.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.calibration.building.review import simulated_review, simulated_truth
from abstain_guard.guarantee import conformal, judge_test, risk_control, truth

EPS, DELTA = 0.3, 0.1
SIZES = (1000, 2000, 5000)
REVIEWS = (100, 200, 400)
METHOD = risk_control.DEFAULT_RISK_METHOD
ROOT = Path(__file__).resolve().parents[2]

Population = Callable[[np.random.Generator, int, int], dict[str, np.ndarray]]


def _review(rng: np.random.Generator, wrong: np.ndarray, m: int, reach: int) -> np.ndarray:
    """Human labels ``[B, n]`` (1 wrong, 0 right, -1 unreviewed, -2 out of scope) of a
    uniform review of m among the ``reach`` lowest scores."""
    b, n = wrong.shape
    y = np.full((b, n), -1, dtype=np.int64)
    y[:, reach:] = truth.OUT_OF_SCOPE
    pick = np.argsort(rng.random((b, reach)), axis=1)[:, :m]
    np.put_along_axis(y, pick, np.take_along_axis(wrong, pick, axis=1).astype(np.int64), 1)
    return y


def _linear_risk(u: np.ndarray, a: float = 0.05, b: float = 0.75) -> np.ndarray:
    """R(λ) for P(wrong | u) = a + b·u, U uniform: a + b·λ/2."""
    return a + b * np.asarray(u) / 2.0


def flat(rng: np.random.Generator, b: int, n: int) -> dict[str, np.ndarray]:
    s = np.sort(rng.random((b, n)), axis=1)
    p = EPS + 0.002
    wrong = rng.random((b, n)) < p
    missed = wrong & (s < 0.2) & (rng.random((b, n)) < 0.04 / 0.2 / p)
    return {"s": s, "wrong": wrong, "judge": ~wrong | missed, "risk": np.full((b, n), p)}


def confident_band(rng: np.random.Generator, b: int, n: int) -> dict[str, np.ndarray]:
    s = np.sort(rng.random((b, n)), axis=1)
    band = s < 0.06
    wrong = rng.random((b, n)) < np.where(band, 0.6, 0.1 + 0.5 * s)
    low = np.minimum(s, 0.06)
    mass = 0.6 * low + np.where(s > 0.06, 0.1 * (s - 0.06) + 0.25 * (s**2 - 0.06**2), 0.0)
    return {"s": s, "wrong": wrong, "judge": ~wrong | band, "risk": mass / np.maximum(s, 1e-12)}


def scoped(rng: np.random.Generator, b: int, n: int) -> dict[str, np.ndarray]:
    s = np.sort(rng.random((b, n)), axis=1)
    wrong = rng.random((b, n)) < 0.05 + 0.75 * s
    missed = wrong & (s < 0.2) & (rng.random((b, n)) < 0.04 / 0.2 / 0.125)
    return {"s": s, "wrong": wrong, "judge": ~wrong | missed, "risk": _linear_risk(s)}


def flat_strict(rng: np.random.Generator, b: int, n: int) -> dict[str, np.ndarray]:
    pop = flat(rng, b, n)
    alarm = ~pop["wrong"] & (rng.random((b, n)) < 0.1)
    return {**pop, "judge": pop["judge"] & ~alarm}


VALIDITY: dict[str, tuple[Population, float, float]] = {
    "flat": (flat, EPS, 1.0),
    "flat_strict": (flat_strict, EPS, 1.0),
    "confident_band": (confident_band, EPS, 1.0),
    "scoped": (scoped, EPS, 0.8),
}
"""name: (population, the ε it is tested at, review scope)."""


def _arms(pop: dict[str, np.ndarray], m: int, scope: float, eps: float, rng: np.random.Generator):
    n = pop["s"].shape[1]
    reach = math.ceil(scope * n)
    y = _review(rng, pop["wrong"], m, reach)
    plan = truth.plan_truth(METHOD, eps, DELTA, n, m, reach)
    judge_errors = (~pop["judge"]).astype(np.int64)
    return truth.arm_ranks(plan, pop["s"], judge_errors, y, eps), plan, y


def _true_risk(pop: dict[str, np.ndarray], rank: np.ndarray) -> np.ndarray:
    """R at each draw's certified threshold (0 where nothing is certified)."""
    at = np.take_along_axis(pop["risk"], np.maximum(rank - 1, 0)[:, None], axis=1)[:, 0]
    return np.where(rank > 0, at, 0.0)


def _rate(k: int, total: int) -> dict[str, Any]:
    ci = stats.binomtest(k, total).proportion_ci(method="exact")
    return {"rate": k / total, "ci95": [float(ci.low), float(ci.high)]}


def validity_cell(name: str, n: int, m: int, draws: int, chunk: int, seed: int) -> dict[str, Any]:
    """One population and (n, m): the family-wise error of each arm and in total."""
    population, eps, scope = VALIDITY[name]
    rng = np.random.default_rng(seed)
    counts = {"human": 0, "judge": 0, "total": 0, "by_human": 0, "by_judge": 0}
    part = []
    for start in range(0, draws, chunk):
        pop = population(rng, min(chunk, draws - start), n)
        arms, plan, _ = _arms(pop, m, scope, eps, rng)
        for key, rank in (("human", arms.human), ("judge", arms.judge), ("total", arms.rank)):
            counts[key] += int((_true_risk(pop, rank) > eps).sum())
        counts["by_human"] += int(((arms.human >= arms.judge) & (arms.rank > 0)).sum())
        counts["by_judge"] += int((arms.judge > arms.human).sum())
        part.append(arms.rank / n)
    out: dict[str, Any] = {"n": n, "m": m, "share_w": plan.share, "eps": eps, "scope": scope}
    levels = {"human": (1 - plan.share) * DELTA, "judge": plan.share * DELTA, "total": DELTA}
    for key in ("human", "judge", "total"):
        out[f"fwer_{key}"] = {**_rate(counts[key], draws), "level": levels[key]}
    out["certified_by"] = {k: counts[f"by_{k}"] / draws for k in ("human", "judge")}
    out["mean_participation"] = float(np.concatenate(part).mean())
    return out


JUDGES: dict[str, Callable[[np.random.Generator, np.ndarray, np.ndarray], np.ndarray]] = {
    "perfect": lambda rng, s, wrong: ~wrong,
    "misses_2pct": lambda rng, s, wrong: ~wrong | (rng.random(s.shape) < 0.02),
    "lenient_on_confident_wrong": lambda rng, s, wrong: ~wrong | (s < 0.3),
    "strict_10pct": lambda rng, s, wrong: ~wrong & ~(rng.random(s.shape) < 0.1),
}
"""Judge labels (True = called right) from the truth and the scores."""


def _human_only(pop: dict[str, np.ndarray], y: np.ndarray, m: int, level: float, eps: float):
    """Human-only LTT on the reviewed answers at ``level``: rank among all n."""
    plan = truth.TruthPlan(risk_control.plan_tests(METHOD, eps, level, m), None, 0.0)
    return truth.arm_ranks(plan, pop["s"], np.zeros_like(y), y, eps).human


def _mean_ci(x: np.ndarray) -> dict[str, float]:
    se = float(x.std(ddof=1) / math.sqrt(x.size))
    return {
        "mean": float(x.mean()),
        "ci95": [float(x.mean() - 1.96 * se), float(x.mean() + 1.96 * se)],
    }


def _at(s: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """True participation at each draw's certified rank: its score (U uniform)."""
    at = np.take_along_axis(s, np.maximum(rank - 1, 0)[:, None], axis=1)[:, 0]
    return np.where(rank > 0, at, 0.0)


def _power_chunk(judge: str, n: int, m: int, eps: float, b: int, rng: np.random.Generator):
    s = np.sort(rng.random((b, n)), axis=1)
    wrong = rng.random((b, n)) < 0.05 + 0.75 * s
    pop = {"s": s, "wrong": wrong, "judge": JUDGES[judge](rng, s, wrong)}
    arms, plan, y = _arms(pop, m, 1.0, eps, rng)
    at_delta = _at(s, _human_only(pop, y, m, DELTA, eps))
    parts = (_at(s, arms.rank), at_delta, _at(s, arms.human), arms.judge > arms.human)
    return parts, plan.share


def power_cell(judge: str, n: int, m: int, draws: int, eps: float, seed: int) -> dict[str, Any]:
    """Paired draws of the combined certificate and human-only LTT on one judge and (n, m)."""
    rng = np.random.default_rng(seed)
    chunks = [
        _power_chunk(judge, n, m, eps, min(250, draws - k), rng) for k in range(0, draws, 250)
    ]
    combined, at_delta, at_share, by_judge = (
        np.concatenate(x) for x in zip(*(c[0] for c in chunks), strict=True)
    )
    short = combined < at_delta - 1e-12
    return {
        "judge": judge,
        "n": n,
        "m": m,
        "eps": eps,
        "share_w": chunks[0][1],
        "combined": _mean_ci(combined),
        "human_only_delta": _mean_ci(at_delta),
        "human_only_share": _mean_ci(at_share),
        "difference_vs_delta": _mean_ci(combined - at_delta),
        "ratio_vs_delta": float(combined.mean() / at_delta.mean()) if at_delta.mean() else None,
        "p_combined_below_human_delta": float(short.mean()),
        "mean_shortfall": float((at_delta - combined)[short].mean()) if short.any() else 0.0,
        "p_combined_below_human_share": float((combined < at_share - 1e-12).mean()),
        "certified_by_judge": float(by_judge.mean()),
    }


def _certify(
    s: np.ndarray, correct: np.ndarray | None, eps: float, human: np.ndarray | None = None
) -> float:
    """The participation (share of all n scores at or below the threshold) the library
    certifies at (ε, δ), on all answers, or with human-only LTT on the reviewed ones when
    ``correct`` is None; 0 when nothing is."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        if correct is None:
            assert human is not None
            rev = human >= 0
            res = conformal.risk_threshold(s[rev], human[rev].astype(bool), eps, DELTA)
        else:
            res = conformal.risk_threshold(s, correct, eps, DELTA, human=human)
    return float((s <= res.threshold).mean()) if res.feasible else 0.0


def low_accuracy(draws: int, seed: int) -> list[dict[str, Any]]:
    """The default review workflow on a 6.6 %-right population with a perfect judge."""
    rng = np.random.default_rng(seed)
    rows = []
    for eps in (0.75, 0.5):
        got: dict[str, list[float]] = {"judge_only": [], "human_only": [], "combined": []}
        for _ in range(draws):
            s = rng.random(2089)
            right = rng.random(2089) < 0.85 * np.exp(-s / 0.078)
            human = simulated_review(rng, (s, right), right, 200, None, eps)
            got["judge_only"].append(_certify(s, right, eps))
            got["human_only"].append(_certify(s, None, eps, human))
            got["combined"].append(_certify(s, right, eps, human))
        means = {k: _mean_ci(np.asarray(v)) for k, v in got.items()}
        ratio = means["combined"]["mean"] / max(means["judge_only"]["mean"], 1e-12)
        rows.append({"eps": eps, "n": 2089, "m": 200, **means, "ratio_to_judge_only": ratio})
    return rows


def shipped(draws: int, seed: int) -> list[dict[str, Any]]:
    """Human-only vs combined on the shipped guard's answers, uniform and planned reviews."""
    art = GuardArtifact.load(ROOT / "abstain_guard" / "default_guard")
    s, gold = np.asarray(art.scores), np.asarray(art.correct, bool)
    rng = np.random.default_rng(seed)
    eps = 0.35
    rows = []
    for m in REVIEWS:
        got: dict[str, list[float]] = {"human_only": [], "combined": [], "combined_planned": []}
        for _ in range(draws):
            judge = simulated_truth(rng, s, gold, 0.01, 0.5)  # the judge's labels; gold: truth
            uniform = simulated_review(rng, (s, judge), gold, m, 1.0, eps)
            planned = simulated_review(rng, (s, judge), gold, m, None, eps)
            got["human_only"].append(_certify(s, None, eps, uniform))
            got["combined"].append(_certify(s, judge, eps, uniform))
            got["combined_planned"].append(_certify(s, judge, eps, planned))
        rows.append({"m": m, "eps": eps, **{k: _mean_ci(np.asarray(v)) for k, v in got.items()}})
    return rows


def cross_checks(draws: int, seed: int) -> dict[str, Any]:
    """scipy's exact tail as ground truth of the library's; ppi-python's prediction-powered
    interval (a CLT, not finite-sample) as a negative control: the one-sided 95 % upper bound
    on the error rate of t = 1000 answers from h = 30 reviewed ones, with a judge that misses
    3 % of them (all truly wrong answers it calls right), against the library's exact
    M⁺ + G⁺ at the same level."""
    import ppi_py

    rng = np.random.default_rng(seed)
    k, big = rng.integers(0, 60, 20000), rng.integers(1, 400, 20000)
    succ, drawn = rng.integers(0, 400, 20000) % (big + 1), rng.integers(0, 400, 20000) % (big + 1)
    gap = np.abs(
        judge_test.hypergeom_cdf(k, big, succ, drawn) - stats.hypergeom.cdf(k, big, succ, drawn)
    )
    t, h, alpha = 1000, 30, 0.05
    covered = {"ppi": 0, "exact": 0}
    for _ in range(draws):
        wrong = rng.random(t) < 0.3
        judge_wrong = wrong & ~(wrong & (rng.random(t) < 0.1))  # misses ≈ 3 % of all
        pick = rng.choice(t, h, replace=False)
        rest = np.setdiff1d(np.arange(t), pick)
        upper = ppi_py.ppi_mean_ci(
            wrong[pick].astype(float),
            judge_wrong[pick].astype(float),
            judge_wrong[rest].astype(float),
            alpha=2 * alpha,
        )[1]
        covered["ppi"] += int(wrong.mean() <= float(np.ravel(upper)[0]))
        y = np.full(t + 1, -1, dtype=np.int64)
        y[pick] = wrong[pick]
        j = np.append(judge_wrong.astype(np.int64), 0)
        z = truth.judge_errors_bound(
            j, y, t + 1, alpha / (judge_test.MISS_SHARE + judge_test.WRONG_SHARE)
        )
        covered["exact"] += int(wrong.sum() <= z)
    return {
        "scipy_max_abs_difference": float(gap.max()),
        "negative_control": {
            "t": t,
            "h": h,
            "level": alpha,
            "draws": draws,
            "coverage": {k: _rate(v, draws) for k, v in covered.items()},
        },
        "confseq": confseq_check(200, seed + 1),
    }


def confseq_check(draws: int, seed: int) -> dict[str, Any] | str:
    """confseq's betting confidence interval for sampling without replacement (valid by
    Ville's inequality, reading the sample's order) against the exact hypergeometric bound
    M⁺ on the misses among t0 = 1,000 judged-right answers from h reviewed ones, both one-sided
    at 0.05 (confseq two-sided at 0.1): mean upper bounds, how often confseq's is tighter,
    and the coverage of each."""
    try:
        if not hasattr(np, "float_"):
            setattr(np, "float_", np.float64)  # noqa: B010 — confseq 0.0.11 reads NumPy 1's alias
        from confseq.betting import betting_ci
    except ImportError as e:
        return f"not installed ({e}): see the module docstring"
    rng = np.random.default_rng(seed)
    t0, gamma, rows = 1000, 0.05, []
    for h in (30, 100):
        for misses in (10, 30, 100):
            x = np.zeros(t0)
            x[:misses] = 1.0
            bounds = np.empty((draws, 2))
            for i in range(draws):
                sample = x[rng.choice(t0, h, replace=False)]
                bounds[i, 0] = t0 * float(betting_ci(sample, alpha=2 * gamma, N=t0)[1])
                bounds[i, 1] = float(judge_test.error_upper_bound(int(sample.sum()), h, t0, gamma))
            rows.append(
                {
                    "t0": t0,
                    "h": h,
                    "misses": misses,
                    "level": gamma,
                    "draws": draws,
                    "mean_upper": {"confseq": bounds[:, 0].mean(), "exact": bounds[:, 1].mean()},
                    "p_confseq_tighter": float((bounds[:, 0] < bounds[:, 1]).mean()),
                    "coverage": {
                        "confseq": _rate(int((bounds[:, 0] >= misses).sum()), draws),
                        "exact": _rate(int((bounds[:, 1] >= misses).sum()), draws),
                    },
                }
            )
    return {"confseq": "0.0.11", "cells": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    ap.add_argument("--draws", type=int, default=10_000, help="validity draws a cell")
    ap.add_argument("--power-draws", type=int, default=1000)
    ap.add_argument("--workflow-draws", type=int, default=200)
    ap.add_argument("--chunk", type=int, default=500)
    ap.add_argument("--jobs", type=int, default=1, help="cells run in parallel (same results)")
    args = ap.parse_args()
    result: dict[str, Any] = {
        "delta": DELTA,
        "method": METHOD,
        "command": (
            "OMP_NUM_THREADS=1 nice .venv/bin/python bench/power/truth_certificate.py --out "
            f"bench/power/truth_certificate.json --draws {args.draws} --power-draws "
            f"{args.power_draws} --workflow-draws {args.workflow_draws} --jobs {args.jobs}"
        ),
    }
    cells = [(name, n, m) for name in VALIDITY for n in SIZES for m in REVIEWS]
    power = [(j, n, m, eps) for j in JUDGES for n in SIZES for m in REVIEWS for eps in (0.3, 0.4)]
    with ProcessPoolExecutor(args.jobs) as pool:
        validity = [
            pool.submit(validity_cell, *cell, args.draws, args.chunk, seed)
            for seed, cell in enumerate(cells, start=1)
        ]
        runs = [
            pool.submit(power_cell, j, n, m, args.power_draws, eps, seed)
            for seed, (j, n, m, eps) in enumerate(power, start=len(cells) + 1)
        ]
        result["validity"], result["power"] = [], []
        for cell, got in zip(cells, validity, strict=True):
            result["validity"].append({"population": cell[0], **got.result()})
            print(json.dumps(result["validity"][-1]), flush=True)
        for got in runs:
            result["power"].append(got.result())
            print(json.dumps(result["power"][-1]), flush=True)
    seed = len(cells) + len(power)
    result["low_accuracy"] = low_accuracy(args.workflow_draws, seed + 1)
    print(json.dumps(result["low_accuracy"]), flush=True)
    result["shipped_guard"] = shipped(args.workflow_draws, seed + 2)
    print(json.dumps(result["shipped_guard"]), flush=True)
    result["cross_checks"] = cross_checks(2000, seed + 3)
    print(json.dumps(result["cross_checks"]), flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
