"""Simulate the risk-mode procedures on realistic populations and pick the default.

Risk mode certifies "at most ε of the answered questions are wrong, with probability ≥ 1−δ
over the calibration draw". Each procedure of ``abstain_guard.guarantee.risk_control`` (and MAPIE's
``BinaryClassificationController`` as an outside reference) is run on many calibration
sets drawn from a known population; for each the threshold's *true* error rate among
answered questions and its true participation are computed on the population.

Populations. Each artifact's pooled calibration pairs (score, correct) are the population:
the shipped guard (``abstain_guard/default_guard``) and ``runs/<name>`` for triviaqa, sciq,
commonsenseqa, nq_open and truthfulqa where they exist (missing ones are skipped and
listed). The guarantee is proved for distinct scores, so the population is made continuous:
the N pairs, sorted by score with ties broken at random once, occupy the unit intervals
[i, i+1) of a position axis, and a draw is a uniform position (atom i with probability 1/N,
then uniform inside it). The procedures only read ranks, so they see exactly the resampled
data, without ties. The true risk of a threshold at position t is R(t) = (errors of the
atoms below t, the last one counted by its covered fraction) / t. Two synthetic populations
of 20 000 draws are added: ``synthetic_linear`` (U ~ Uniform(0, 1), P(wrong | U = u) = u,
the repo's simulation tests) and ``synthetic_confident_errors`` (the same with the 5 % most
confident answers wrong half the time, so R is not monotone). A (population, ε) pair is
kept when the population has a threshold with risk ≤ ε at participation ≥ 0.1.

MAPIE 1.x mapping: "answer" = predicted positive = ``predict_proba[:, 1] ≥ λ``, the risk is
``"precision"`` (error rate among answered = 1 − precision) with ``target_level = 1 − ε``,
``confidence_level = 1 − δ``, and the "auto" secondary objective maximises recall (= the
participation). MAPIE tests a grid of thresholds fixed in advance on a probability scale;
the simulation hands it ``predict_proba[:, 1] = 1 − q`` with q the population quantile of
the score and the default grid ``np.linspace(0, 0.99, 100)`` — thresholds at 100 evenly
spaced *true* participation levels, a grid more favourable than any a user could set
without knowing the population. FWER methods ``"bonferroni_holm"`` (MAPIE's default) and
``"fixed_sequence"``; Hoeffding-Bentkus p-values (MAPIE's).

Output: one JSON object on stdout (rows: population × n × ε × δ × method with violation
rate, its Monte-Carlo standard error, mean true participation, fraction of runs that
certify anything; a per-method summary; the chosen default), and a markdown report at
``--out``. The default is the procedure with the highest mean certified participation over
the artifact populations among those whose violation rate is ≤ δ + 3 s.e. (s.e. =
sqrt(δ(1−δ)/reps)) in every cell, synthetic populations included.

Run (about 3 minutes on 2 cores)::

    OMP_NUM_THREADS=1 .venv/bin/python experiments/risk_control/risk_control.py --out \
        experiments/risk_control/risk_control.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from abstain_guard import GuardArtifact, default_artifact_path
from abstain_guard.errors import AbstainGuardError
from abstain_guard.guarantee.risk_control import (
    DEFAULT_RISK_METHOD,
    RISK_METHODS,
    candidate_ranks,
    plan_tests,
    rank_p_values,
    select_rank,
)

RUNS = ("triviaqa", "sciq", "commonsenseqa", "nq_open", "truthfulqa")
MAPIE_METHODS = ("bonferroni_holm", "fixed_sequence")
MIN_ORACLE_PARTICIPATION = 0.1


@dataclass(frozen=True)
class Population:
    """A finite population made continuous: atom i (sorted by score, ties broken at random)
    covers positions [i, i+1).

    Attributes:
        name: short name.
        source: where the pairs come from.
        errors: ``[N]`` 1 where atom i is a wrong answer.
        artifact: True for a real artifact, False for a synthetic population.
    """

    name: str
    source: str
    errors: NDArray[np.int64]
    artifact: bool

    @property
    def size(self) -> int:
        return int(self.errors.size)

    @property
    def cum_errors(self) -> NDArray[np.int64]:
        """``[N+1]`` errors among the first i atoms."""
        return np.concatenate(([0], np.cumsum(self.errors)))

    def risk(self, position: NDArray[np.float64]) -> NDArray[np.float64]:
        """True error rate among answered at threshold positions ``[...]`` (0 at 0)."""
        i = np.clip(np.floor(position).astype(np.int64), 0, self.size - 1)
        mass = self.cum_errors[i] + (position - i) * self.errors[i]
        return np.where(position > 0, mass / np.maximum(position, 1e-300), 0.0)

    def oracle_participation(self, eps: float) -> float:
        """Largest participation whose true risk is ≤ ε: an atom end t = i+1 with
        C_{i+1} ≤ ε(i+1), or inside a wrong atom i that starts with R ≤ ε, where R reaches ε
        at the fraction (ε i − C_i)/(1 − ε)."""
        c = self.cum_errors.astype(np.float64)
        start = np.arange(self.size, dtype=np.float64)
        ends = np.flatnonzero(c[1:] <= eps * (start + 1)) + 1.0
        inside = (self.errors == 1) & (c[:-1] <= eps * start)
        frac = np.clip((eps * start - c[:-1]) / (1.0 - eps), 0.0, 1.0)
        best = max(ends.max(initial=0.0), (start + frac)[inside].max(initial=0.0))
        return float(best) / self.size

    def draw(
        self, rng: np.random.Generator, reps: int, n: int
    ) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
        """``reps`` calibration sets of n: sorted positions ``[reps, n]`` and their errors."""
        atoms = rng.integers(0, self.size, size=(reps, n))
        positions = np.sort(atoms + rng.random((reps, n)), axis=1)
        return positions, self.errors[np.floor(positions).astype(np.int64)]


def _from_pairs(
    name: str, source: str, scores: NDArray, correct: NDArray, seed: int, artifact: bool
) -> Population:
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(scores.size), scores))
    errors = (~np.asarray(correct, dtype=bool)[order]).astype(np.int64)
    return Population(name, source, errors, artifact)


def load_populations(runs_dir: Path, seed: int) -> tuple[list[Population], dict[str, str]]:
    """The shipped artifact, the ``runs/`` artifacts that exist, two synthetic populations;
    and ``{name: why skipped}``."""
    pops: list[Population] = []
    skipped: dict[str, str] = {}
    sources = [("shipped", Path(default_artifact_path()))] + [(r, runs_dir / r) for r in RUNS]
    for k, (name, path) in enumerate(sources):
        try:
            art = GuardArtifact.load(path)
        except (AbstainGuardError, OSError) as exc:
            skipped[name] = f"not loaded from {path}: {type(exc).__name__}"
            continue
        pops.append(
            _from_pairs(
                name,
                os.path.relpath(path),
                np.asarray(art.scores),
                np.asarray(art.correct),
                seed + k,
                artifact=True,
            )
        )
    rng = np.random.default_rng(seed + 100)
    u = rng.random(20_000)
    pops.append(
        _from_pairs(
            "synthetic_linear",
            "U ~ U(0,1), P(wrong | u) = u",
            u,
            rng.random(u.size) >= u,
            seed + 101,
            artifact=False,
        )
    )
    r = np.where(u < 0.05, 0.5, 0.8 * u)
    pops.append(
        _from_pairs(
            "synthetic_confident_errors",
            "U ~ U(0,1), P(wrong | u) = 0.5 if u < 0.05 else 0.8 u",
            u,
            rng.random(u.size) >= r,
            seed + 102,
            artifact=False,
        )
    )
    return pops, skipped


def _mapie_runs(
    pop: Population, positions: NDArray, errors: NDArray, eps: float, delta: float, method: str
) -> tuple[NDArray, NDArray]:
    """MAPIE's controller on each calibration set: true risk and participation ``[reps]``."""
    from mapie.risk_control import BinaryClassificationController

    size = float(pop.size)

    def predict_proba(x: NDArray) -> NDArray:
        q = np.asarray(x, dtype=np.float64)[:, 0] / size
        return np.column_stack([q, 1.0 - q])

    risk = np.zeros(len(positions))
    part = np.zeros(len(positions))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for b, (x, e) in enumerate(zip(positions, errors, strict=True)):
            ctl = BinaryClassificationController(
                predict_function=predict_proba,
                risk="precision",
                target_level=1.0 - eps,
                confidence_level=1.0 - delta,
                fwer_method=method,  # type: ignore[arg-type]
            )
            ctl.calibrate(x[:, None], 1 - e)
            if ctl.best_predict_param is not None:
                t = size * (1.0 - float(ctl.best_predict_param))  # type: ignore[arg-type]
                risk[b] = float(pop.risk(np.asarray(t)))
                part[b] = t / size
    return risk, part


def _cell(method: str, risk: NDArray, part: NDArray, eps: float, delta: float) -> dict[str, Any]:
    reps = risk.size
    v = float(np.mean(risk > eps))
    return {
        "method": method,
        "reps": reps,
        "violation": v,
        "violation_se": math.sqrt(v * (1 - v) / reps),
        "excess_se": (v - delta) / math.sqrt(delta * (1 - delta) / reps),
        "participation": float(part.mean()),
        "certified": float(np.mean(part > 0)),
    }


def simulate(
    pops: list[Population],
    sizes: list[int],
    targets: list[float],
    deltas: list[float],
    reps: int,
    mapie_reps: int,
    seed: int,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every (population, n, ε, δ, method) cell, and per method the largest fraction of
    calibration sets (over populations, n, and δ or ε) whose certified rank drops when ε or
    δ grows. The same calibration sets serve every ε and δ of a (population, n)."""
    rows: list[dict[str, Any]] = []
    drops: dict[str, float] = {}
    for k, pop in enumerate(pops):
        kept = [
            e for e in sorted(targets) if pop.oracle_participation(e) >= MIN_ORACLE_PARTICIPATION
        ]
        for n in sizes if kept else ():
            positions, errors = pop.draw(np.random.default_rng([seed, k, n]), reps, n)
            candidate = candidate_ranks(positions)
            certified: dict[str, NDArray[np.int64]] = {}  # method -> [ε, δ, reps]
            for i, eps in enumerate(kept):
                p_values = rank_p_values(errors, eps)
                for j, delta in enumerate(deltas):
                    base = {
                        "population": pop.name,
                        "n": n,
                        "eps": eps,
                        "delta": delta,
                        "oracle_participation": pop.oracle_participation(eps),
                    }
                    for method in RISK_METHODS:
                        plan = plan_tests(method, eps, delta, n)
                        rank, _ = select_rank(plan, p_values, candidate)
                        store = certified.setdefault(
                            method, np.zeros((len(kept), len(deltas), reps), dtype=np.int64)
                        )
                        store[i, j] = rank
                        chosen = np.take_along_axis(positions, np.maximum(rank, 1)[:, None] - 1, 1)
                        t = np.where(rank > 0, chosen[:, 0], 0.0)
                        rows.append(base | _cell(method, pop.risk(t), t / pop.size, eps, delta))
                    for method in MAPIE_METHODS if mapie_reps > 0 else ():
                        risk, part = _mapie_runs(
                            pop, positions[:mapie_reps], errors[:mapie_reps], eps, delta, method
                        )
                        rows.append(base | _cell(f"mapie_{method}", risk, part, eps, delta))
            order = np.argsort(deltas)
            for method, ranks in certified.items():
                by_eps = (np.diff(ranks, axis=0) < 0).any(axis=0).mean(axis=-1)  # [δ]
                by_delta = (np.diff(ranks[:, order], axis=1) < 0).any(axis=1).mean(axis=-1)
                worst = max(by_eps.max(initial=0.0), by_delta.max(initial=0.0))
                drops[method] = max(drops.get(method, 0.0), float(worst))
    return rows, drops


def summarise(
    rows: list[dict[str, Any]], pops: list[Population], drops: dict[str, float]
) -> dict[str, Any]:
    """Per method: validity everywhere, worst excess, mean participation, monotonicity; the
    chosen one (valid everywhere, then the highest mean participation on the artifacts)."""
    real = {p.name for p in pops if p.artifact}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out: dict[str, Any] = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        out[m] = {
            "valid_everywhere": all(r["excess_se"] <= 3.0 for r in mine),
            "worst_excess_se": max(r["excess_se"] for r in mine),
            "max_violation_minus_delta": max(r["violation"] - r["delta"] for r in mine),
            "mean_participation_artifacts": float(
                np.mean([r["participation"] for r in mine if r["population"] in real] or [0.0])
            ),
            "mean_participation_all": float(np.mean([r["participation"] for r in mine])),
            "monotone_drop_fraction": drops.get(m),
        }
    valid = [m for m in RISK_METHODS if m in out and out[m]["valid_everywhere"]]
    chosen = max(valid, key=lambda m: out[m]["mean_participation_artifacts"]) if valid else None
    return {"methods": out, "chosen": chosen, "current_default": DEFAULT_RISK_METHOD}


def _drop(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.3f}"


def _fmt(r: dict[str, Any]) -> str:
    return f"{r['violation']:.3f}±{r['violation_se']:.3f} · {r['participation']:.3f}"


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any], meta: dict[str, Any]) -> str:
    """The report: summary per method, then one table per population."""
    methods = list(summary["methods"])
    lines = [
        "# Risk-mode procedures: simulation",
        "",
        f"Command: `{meta['command']}` ({meta['seconds']:.0f} s). Cell: violation rate ± "
        "Monte-Carlo s.e. · mean true participation. "
        f"{meta['reps']} calibration sets per cell (MAPIE: {meta['mapie_reps']}).",
        "",
        "| method | valid everywhere | worst (violation − δ) | mean participation, artifacts "
        "| mean participation, all | drops when ε or δ grows |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for m in methods:
        s = summary["methods"][m]
        lines.append(
            f"| `{m}` | {'yes' if s['valid_everywhere'] else 'no'} | "
            f"{s['max_violation_minus_delta']:+.3f} | {s['mean_participation_artifacts']:.3f} | "
            f"{s['mean_participation_all']:.3f} | {_drop(s['monotone_drop_fraction'])} |"
        )
    lines += ["", f"Chosen: `{summary['chosen']}`.", ""]
    if meta["skipped"]:
        lines += ["Skipped: " + "; ".join(f"{k} ({v})" for k, v in meta["skipped"].items()), ""]
    if meta["no_targets"]:
        lines += [
            "No ε with true participation ≥ 0.1 (not simulated): " + ", ".join(meta["no_targets"]),
            "",
        ]
    for pop in dict.fromkeys(r["population"] for r in rows):
        lines += [
            f"## {pop}",
            "",
            "| n | ε | δ | oracle | " + " | ".join(f"`{m}`" for m in methods) + " |",
            "|---:|---:|---:|---:|" + "---|" * len(methods),
        ]
        cells: dict[tuple[int, float, float], dict[str, dict[str, Any]]] = {}
        for r in rows:
            if r["population"] == pop:
                cells.setdefault((r["n"], r["eps"], r["delta"]), {})[r["method"]] = r
        for (n, eps, delta), by in sorted(cells.items()):
            oracle = next(iter(by.values()))["oracle_participation"]
            lines.append(
                f"| {n} | {eps:g} | {delta:g} | {oracle:.2f} | "
                + " | ".join(_fmt(by[m]) if m in by else "" for m in methods)
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--targets", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5])
    parser.add_argument("--deltas", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument(
        "--mapie-reps",
        type=int,
        default=200,
        help="calibration sets per cell for MAPIE (slow); 0 skips MAPIE",
    )
    parser.add_argument("--seed", type=int, default=20260512)
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    args = parser.parse_args()

    t0 = time.perf_counter()
    pops, skipped = load_populations(args.runs, args.seed)
    rows, drops = simulate(
        pops, args.sizes, args.targets, args.deltas, args.reps, args.mapie_reps, args.seed
    )
    simulated = {r["population"] for r in rows}
    no_targets = [p.name for p in pops if p.name not in simulated]
    summary = summarise(rows, pops, drops)
    meta = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python experiments/risk_control/risk_control.py "
        + " ".join(sys.argv[1:]),
        "seconds": time.perf_counter() - t0,
        "reps": args.reps,
        "mapie_reps": args.mapie_reps,
        "skipped": skipped,
        "no_targets": no_targets,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    populations = {
        p.name: {
            "source": p.source,
            "size": p.size,
            "accuracy": 1 - float(p.errors.mean()),
            "oracle_participation": {f"{e:g}": p.oracle_participation(e) for e in args.targets},
        }
        for p in pops
    }
    if args.out is not None:
        args.out.write_text(markdown(rows, summary, meta), encoding="utf-8")
    print(json.dumps({"meta": meta, "populations": populations, "summary": summary, "rows": rows}))


if __name__ == "__main__":
    main()
