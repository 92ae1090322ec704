"""How often the drift monitor alarms on exchangeable traffic, and how fast on real shifts.

Part 1 — false alarms (simulation, no model). Population: the shipped guard's 960
calibration scores (``abstain_guard/default_guard``; discrete, so ties occur) and a
continuous Beta(2, 5) population. Each repetition draws a calibration set of n scores and T
live scores i.i.d. from the population (exchangeable by construction), fits
:class:`~abstain_guard.GuardMonitor` (``false_alarm`` a, participation 0.8) and
feeds the live scores; feedback is drawn as errors with probability exactly ε on answered
questions (the boundary of the risk test's null). Ville's inequality bounds each label-free
test's false alarms by a/2 and their union by a; the risk test's by a. For contrast, the
same streams are checked with a fixed-sample test (a two-sided z-test of the answered count
against 1−α at level a) repeated after every question from the 30th, and once at the end:
the first is what an anytime-valid test avoids, the second shows what ignoring the
calibration draw costs by itself (one calibration set's participation is Beta(k, n+1−k)).

Part 2 — detection delay on real shifts (needs ``runs/drift_scores.json`` from
``experiments/drift/drift_collect.py``, which ran the shipped guard as deployed). Pools of 200 live
scores: ``probe_fresh`` (probe questions calibration never saw: exchangeable, the null),
``sciq``, ``truthfulqa`` (other question types) and ``swapped`` (the probe questions
answered by a noised SmolLM2). Each pool is fed to a monitor fitted on the shipped
artifact in R random orders; the delay is the number of queries until the first alarm of
each test (inf: none within the pool). Feedback is the artifact judge's verdict of each
answered question (every answered question labeled). Participation mode (0.8) with the
feedback test at ε = 0.75 (calibration answers are wrong 64.8 % of the time when answered),
and risk mode (ε = 0.35, δ = 0.1, the demo's target).

Run (about 4 minutes on 2 cores)::

    flock /tmp/heavy.lock .venv/bin/python experiments/drift/drift_monitor.py > \
        experiments/drift/drift_monitor.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.default import DEFAULT_ARTIFACT_DIR
from abstain_guard.guarantee.decision import Decision, decision_rule
from abstain_guard.guarantee.intervals import wilson_interval
from abstain_guard.monitor.guard_monitor import GuardMonitor

PART = GuardConfig(participation=0.8)
#: The risk tolerance the participation-mode monitor tests feedback against: the shipped
#: guard's calibration answers are wrong 64.8 % of the time when answered (769 answered),
#: so an operator who accepts up to 75 % sets risk_target=0.75.
PART_EPS = 0.75
RISK = GuardConfig(mode="risk", risk_target=0.35, delta=0.1)
TESTS = ("exchangeability", "participation", "risk")


def _rate(k: int, n: int) -> dict[str, Any]:
    return {"count": int(k), "n": int(n), "rate": k / n, "wilson95": wilson_interval(k, n)}


def _null_rep(
    population: np.ndarray, n: int, horizon: int, a: float, eps: float, seed: int
) -> dict[str, bool]:
    rng = np.random.default_rng(seed)
    cal = rng.choice(population, size=n, replace=True)
    live = rng.choice(population, size=horizon, replace=True)
    correct = rng.uniform(size=n) < 0.5  # labels are not used by the label-free tests
    rule = decision_rule(cal, correct, PART)
    monitor = GuardMonitor(false_alarm=a, risk_target=eps, seed=seed).fit(cal, rule)
    q = 0.8  # the fixed-sample z-test repeated after every question, at level a
    z_crit = 2.5758293035489004 if a == 0.01 else 1.959963984540054
    naive = False
    answered = 0
    for t, s in enumerate(live, 1):
        abstained = bool(s > rule.threshold)
        rid = monitor.observe(Decision(abstained=abstained, score=float(s)))
        answered += not abstained
        if not abstained:
            monitor.record_feedback(rid, bool(rng.uniform() >= eps))
        if t >= 30 and abs(answered - q * t) / math.sqrt(q * (1 - q) * t) > z_crit:
            naive = True
    fired = {a_.test for a_ in monitor.alarms}
    out = {test: test in fired for test in TESTS}
    out["label_free_any"] = out["exchangeability"] or out["participation"]
    out["naive_repeated_z"] = naive
    # the same z-test once, after the last question: what ignoring the calibration draw
    # alone costs (the participation of one calibration set is Beta(k, n+1-k), not 1−α)
    out["naive_final_z"] = abs(answered - q * horizon) / math.sqrt(q * (1 - q) * horizon) > z_crit
    return out


def false_alarms(reps: int, horizon: int, a: float, eps: float) -> list[dict[str, Any]]:
    shipped = GuardArtifact.load(DEFAULT_ARTIFACT_DIR).scores
    beta = np.random.default_rng(0).beta(2, 5, size=200_000)
    rows = []
    for name, population in (("shipped_scores", shipped), ("beta_2_5", beta)):
        for n in (100, 960):
            start = time.perf_counter()
            results = [_null_rep(population, n, horizon, a, eps, seed) for seed in range(reps)]
            row: dict[str, Any] = {"population": name, "n_calibration": n, "horizon": horizon}
            for key in (*TESTS, "label_free_any", "naive_repeated_z", "naive_final_z"):
                row[key] = _rate(sum(r[key] for r in results), reps)
            row["bounds"] = {"exchangeability": a / 2, "participation": a / 2,
                             "label_free_any": a, "risk": a}  # fmt: skip
            row["seconds"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def _delays(
    art: GuardArtifact,
    rows: list[dict[str, Any]],
    config: GuardConfig,
    reps: int,
    seed: int,
    risk_target: float | None = None,
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    rule = art.decision_rule(config)
    first: dict[str, list[float]] = {t: [] for t in (*TESTS, "any")}
    for r in range(reps):
        order = rng.permutation(len(rows))
        monitor = GuardMonitor(false_alarm=0.01, risk_target=risk_target, seed=seed * 10_000 + r)
        monitor.fit(art.scores, rule)
        at: dict[str, float] = {}
        for t, i in enumerate(order, 1):
            row = rows[i]
            before = len(monitor.alarms)
            abstained = bool(row["score"] > rule.threshold)
            rid = monitor.observe(Decision(abstained=abstained, score=row["score"]))
            if not abstained and row["correct"] is not None:
                monitor.record_feedback(rid, bool(row["correct"]))
            for alarm in monitor.alarms[before:]:
                at.setdefault(alarm.test, t)
        for test in TESTS:
            first[test].append(at.get(test, math.inf))
        first["any"].append(min(at.values(), default=math.inf))
    summary = {}
    for test, values in first.items():
        v = np.asarray(values)
        if test == "risk" and rule.mode != "risk" and risk_target is None:
            continue
        found = v[np.isfinite(v)]
        summary[test] = {
            "detected": _rate(int(found.size), reps),
            "median": float(np.median(v)) if found.size * 2 > reps else None,
            "quartiles": [float(np.quantile(v, 0.25)), float(np.quantile(v, 0.75))]
            if found.size * 4 > 3 * reps
            else None,
        }
    return summary


def real_shifts(path: Path, reps: int, only: str | None = None) -> dict[str, Any]:
    data = json.loads(path.read_text())
    art = GuardArtifact.load(DEFAULT_ARTIFACT_DIR)
    out: dict[str, Any] = {}
    pools: dict[str, dict[str, Any]] = {}
    for name, pool in data["pools"].items():  # "sciq+200" extends "sciq"
        merged = pools.setdefault(name.partition("+")[0], {**pool, "rows": []})
        merged["rows"] = merged["rows"] + pool["rows"]
    for name, pool in pools.items():
        if only is not None and name != only:
            continue
        rows = [r for r in pool["rows"] if r["score"] is not None]
        part_rule = art.decision_rule(PART)
        answered = [r for r in rows if r["score"] <= part_rule.threshold]
        judged = [r for r in rows if r["correct"] is not None]
        out[name] = {
            "questions": len(rows),
            "answered_at_participation_0.8": _rate(len(answered), len(rows)),
            "accuracy_all": _rate(sum(bool(r["correct"]) for r in judged), len(judged)),
            "accuracy_answered": _rate(
                sum(bool(r["correct"]) for r in answered if r["correct"] is not None),
                sum(r["correct"] is not None for r in answered),
            ),
            "mean_score": float(np.mean([r["score"] for r in rows])),
            "participation_mode": _delays(art, rows, PART, reps, seed=1, risk_target=PART_EPS),
            "risk_mode": _delays(art, rows, RISK, reps, seed=2),
        }
        if "noise" in pool:
            out[name]["noise"] = pool["noise"]
        print(name, "done", file=sys.stderr, flush=True)
    cal_rule = art.decision_rule(PART)
    out["calibration"] = {
        "n": art.n,
        "threshold_participation_0.8": cal_rule.threshold,
        "band": cal_rule.guarantee.to_dict()["participation_interval"],
        "mean_score": float(np.mean(art.scores)),
        "risk_mode_0.35": {
            "threshold": art.decision_rule(RISK).threshold,
            "calibration_participation": (
                art.decision_rule(RISK).guarantee.calibration_participation
            ),
        },
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=1000, help="false-alarm repetitions")
    parser.add_argument("--horizon", type=int, default=2000, help="live questions per run")
    parser.add_argument("--false-alarm", type=float, default=0.01)
    parser.add_argument("--epsilon", type=float, default=0.35)
    parser.add_argument("--scores", default="runs/drift_scores.json")
    parser.add_argument("--delay-reps", type=int, default=500)
    parser.add_argument("--skip", choices=("simulation", "real"), default=None)
    parser.add_argument("--only", help="real shifts: this pool only (e.g. sciq)")
    args = parser.parse_args()
    logging.getLogger("abstain_guard").setLevel(logging.ERROR)  # ties, alarms: expected here
    result: dict[str, Any] = {"settings": vars(args)}
    if args.skip != "simulation":
        result["false_alarms"] = false_alarms(
            args.reps, args.horizon, args.false_alarm, args.epsilon
        )
    if args.skip != "real":
        path = Path(args.scores)
        result["real_shifts"] = (
            real_shifts(path, args.delay_reps, args.only) if path.is_file() else f"{path} missing"
        )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
