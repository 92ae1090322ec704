"""The certificate on the truth under imperfect judges: validity by simulation and
power on the shipped guard's real answers. Prints one JSON object (and writes it to
``--out``).

**Validity.** A population with known truth: scores U ~ Uniform(0, 1), each answer wrong with
probability 0.05 + 0.75·U, so the true error rate among answered at threshold τ is
0.05 + 0.375·τ exactly. n = 1,000 calibration answers, a review of m = 200 drawn uniformly
(and, for the scoped variant, among the 50 % lowest scores), ε = 0.3, δ = 0.1, ``--draws``
(default 1,000) draws per judge. Judges, each a rule from the truth and the score:

* ``symmetric_5pct``: every label flipped with probability 0.05;
* ``lenient_30pct``: 30 % of wrong answers called right;
* ``uncertain_10pct``: flips with probability proportional to U (10 % on average): real
  judges err on hard answers;
* ``adversarial_confident``: every wrong answer with U < 0.45 called right — lenient exactly
  where the guard answers, the worst case for a judge-only certificate.

For each: how often the true error among answered exceeds ε (with its 95 % Clopper-Pearson
Monte Carlo interval) and the mean true participation, for (a) the judge-only certificate
(today's), (b) human-only Learn-then-Test on the m reviewed answers, (c) the combined
certificate (:mod:`abstain_guard.guarantee.truth`), (c') the combined one with the review
drawn among the 50 % lowest scores.

**Power on real answers.** The shipped guard's 1,345 calibration answers (geometry scores),
with their lexical-gold labels as the truth. Judges: a simulated judge of a stated quality
(wrong on 1 % of the answers, half of its errors lenient, more often on uncertain answers:
:func:`calibration.building.review.simulated_truth`) and the embedded model's own judge
simulated from its confusion measured against the lexical gold in docs/results.md
(SmolLM2-135M few-shot: calls 66 of 79 wrong answers right and 4 of 21 right ones wrong; no
verdicts of it exist for these 1,345 answers). m = 100, 200, 400, ε = 0.35, δ = 0.1,
``--power-draws`` (default 200) draws: mean certified participation (share of the 1,345
answered at the certified threshold; 0 when nothing is certified) for (b) and (c), each
uniform and scoped to the 50 % lowest scores, the share of draws that certify anything, and
the share of draws in which (c) certifies strictly more than (b) on the same review.

**Where the judge pays** (``large_n``): the validity population with n = 1,000 and 5,000
answers, m = 200 reviewed, a judge wrong on 1 %: human-only against combined,
``--large-n-draws`` (default 100) draws.

Run (about 15 minutes on one core)::

    .venv/bin/python experiments/judges/judge_robust.py --out experiments/judges/judge_robust.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from abstain_guard import GuardArtifact
from abstain_guard.calibration.building.review import simulated_truth
from abstain_guard.guarantee import conformal

EPS_VALID, DELTA = 0.3, 0.1
EPS_POWER = 0.35
N, M = 1000, 200
SCOPE = 0.5

Judge = Callable[[np.random.Generator, np.ndarray, np.ndarray], np.ndarray]


def _flip(rng: np.random.Generator, right: np.ndarray, p: np.ndarray | float) -> np.ndarray:
    return np.where(rng.random(right.size) < p, ~right, right)


JUDGES: dict[str, Judge] = {
    "symmetric_5pct": lambda rng, s, right: _flip(rng, right, 0.05),
    "lenient_30pct": lambda rng, s, right: right | (rng.random(s.size) < 0.3),
    "uncertain_10pct": lambda rng, s, right: _flip(rng, right, 0.2 * s),
    "adversarial_confident": lambda rng, s, right: right | (s < 0.45),
}


def _true_risk(threshold: float) -> float:
    t = min(max(threshold, 0.0), 1.0)
    return 0.05 + 0.375 * t if t > 0 else 0.0


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        return fn()


def _certify(
    s: np.ndarray, judge_right: np.ndarray, eps: float, human: np.ndarray | None = None
) -> Any:
    """The risk-mode certificate on the judge's labels (with ``human``: on the truth)."""
    return _quiet(lambda: conformal.risk_threshold(s, judge_right, eps, DELTA, human=human))


def _review(
    rng: np.random.Generator, s: np.ndarray, right: np.ndarray, m: int, scope: float
) -> np.ndarray:
    """Human labels: m answers drawn uniformly among the ``scope`` lowest scores."""
    cutoff = np.sort(s)[max(1, math.ceil(scope * s.size - 1e-9)) - 1]
    eligible = np.flatnonzero(s <= cutoff)
    human = np.where(s <= cutoff, -1, -2).astype(np.int8)
    picked = rng.choice(eligible, m, replace=False)
    human[picked] = right[picked]
    return human


def _human_only(s: np.ndarray, human: np.ndarray, eps: float) -> float:
    """Threshold of Learn-then-Test on the reviewed answers alone (-inf: none)."""
    keep = human >= 0
    y = human[keep].astype(bool)
    if y.all() or not y.any():
        return -math.inf
    return float(_quiet(lambda: conformal.risk_threshold(s[keep], y, eps, DELTA)).threshold)


def _interval(k: int, n: int) -> list[float]:
    ci = stats.binomtest(k, n).proportion_ci(method="exact")
    return [float(ci.low), float(ci.high)]


def validity(draws: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for name, judge in JUDGES.items():
        thresholds: dict[str, list[float]] = {k: [] for k in ("judge", "human", "comb", "scope")}
        for _ in range(draws):
            s = rng.random(N)
            right = rng.random(N) >= 0.05 + 0.75 * s
            jr = judge(rng, s, right)
            uniform = _review(rng, s, right, M, 1.0)
            scoped = _review(rng, s, right, M, SCOPE)
            thresholds["judge"].append(_certify(s, jr, EPS_VALID).threshold)
            thresholds["human"].append(_human_only(s, uniform, EPS_VALID))
            for key, h in (("comb", uniform), ("scope", scoped)):
                thresholds[key].append(_certify(s, jr, EPS_VALID, h).threshold)
        row = {}
        for key, ts in thresholds.items():
            over = sum(math.isfinite(t) and _true_risk(t) > EPS_VALID for t in ts)
            part = [min(max(t, 0.0), 1.0) if math.isfinite(t) else 0.0 for t in ts]
            row[key] = {
                "violation_rate": over / draws,
                "violation_ci95": _interval(over, draws),
                "mean_true_participation": float(np.mean(part)),
                "certified_any": float(np.mean([math.isfinite(t) for t in ts])),
            }
        out[name] = row
    return out


def large_n(draws: int, seed: int) -> dict[str, Any]:
    """Where the judge's labels pay: the validity population with n = 1,000 and 5,000
    calibration answers, m = 200 reviewed, a judge wrong on 1 % (symmetric): mean true
    participation of human-only Learn-then-Test and of the combined certificate."""
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for n in (1000, 5000):
        got: dict[str, list[float]] = {"human": [], "comb": []}
        for _ in range(draws):
            s = rng.random(n)
            right = rng.random(n) >= 0.05 + 0.75 * s
            jr = _flip(rng, right, 0.01)
            h = _review(rng, s, right, M, 1.0)
            for key, t in (
                ("human", _human_only(s, h, EPS_VALID)),
                ("comb", _certify(s, jr, EPS_VALID, h).threshold),
            ):
                got[key].append(min(max(t, 0.0), 1.0) if math.isfinite(t) else 0.0)
        out[f"n={n}"] = {
            k: {
                "mean_true_participation": float(np.mean(v)),
                "mean_se": float(np.std(v, ddof=1) / math.sqrt(draws)),
            }
            for k, v in got.items()
        }
        out[f"n={n}"]["combined_beats_human_only"] = float(
            np.mean(np.asarray(got["comb"]) > np.asarray(got["human"]))
        )
    return out


def _embedded_judge(rng: np.random.Generator, s: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The embedded model's judge, simulated from its measured confusion (66/79, 4/21)."""
    calls_right = np.where(right, rng.random(s.size) >= 4 / 21, rng.random(s.size) < 66 / 79)
    return np.asarray(calls_right)


def power(artifact: GuardArtifact, draws: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    s, truth = artifact.scores, artifact.correct.astype(bool)
    judges: dict[str, Judge] = {
        "stated_quality_1pct": lambda r, sc, t: simulated_truth(r, sc, t, 0.01, 0.5),
        "embedded_model_measured": _embedded_judge,
    }
    only = _quiet(lambda: conformal.risk_threshold(s, truth, EPS_POWER, DELTA))
    out: dict[str, Any] = {
        "n": int(s.size),
        "truth": "lexical gold labels of the shipped guard's calibration answers",
        "correct": int(truth.sum()),
        "incorrect": int((~truth).sum()),
        "gold_only_participation": only.participation,
    }

    def share(t: float) -> float:
        return float((s <= t).mean()) if math.isfinite(t) else 0.0

    for name, judge in judges.items():
        rows = {}
        for m in (100, 200, 400):
            got: dict[str, list[float]] = {"human": [], "comb": [], "human_scope": [], "scope": []}
            judge_only: list[float] = []
            for _ in range(draws):
                jr = judge(rng, s, truth)
                judge_only.append(share(_certify(s, jr, EPS_POWER).threshold))
                for suffix, scope in (("", 1.0), ("_scope", SCOPE)):
                    h = _review(rng, s, truth, m, scope)
                    got["human" + suffix].append(share(_human_only(s, h, EPS_POWER)))
                    res = _certify(s, jr, EPS_POWER, h)
                    got["comb" if not suffix else "scope"].append(share(res.threshold))
            row: dict[str, Any] = {
                k: {
                    "mean_participation": float(np.mean(v)),
                    "mean_se": float(np.std(v, ddof=1) / math.sqrt(draws)),
                    "certified_any": float(np.mean(np.asarray(v) > 0)),
                }
                for k, v in got.items()
            }
            row["combined_beats_human_only"] = float(
                np.mean(np.asarray(got["comb"]) > np.asarray(got["human"]))
            )
            row["scoped_combined_beats_scoped_human_only"] = float(
                np.mean(np.asarray(got["scope"]) > np.asarray(got["human_scope"]))
            )
            row["judge_only_mean_participation"] = float(np.mean(judge_only))
            rows[f"m={m}"] = row
        out[name] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--power-draws", type=int, default=200)
    parser.add_argument("--large-n-draws", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--artifact", default="abstain_guard/default_guard")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    t0 = time.perf_counter()
    result = {
        "machine": {"processor": platform.processor(), "python": platform.python_version()},
        "settings": {
            "validity": {"n": N, "m": M, "eps": EPS_VALID, "delta": DELTA, "draws": args.draws},
            "power": {"eps": EPS_POWER, "delta": DELTA, "draws": args.power_draws},
            "scope": SCOPE,
        },
        "validity": validity(args.draws, args.seed),
        "power": power(GuardArtifact.load(args.artifact), args.power_draws, args.seed + 1),
        "large_n": large_n(args.large_n_draws, args.seed + 2),
    }
    result["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
