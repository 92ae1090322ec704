"""Per-group guarantees in simulation, and pooled vs per-group rules on the probe set.

Part 1 — validity. Calibration sets are drawn from known populations with groups; each is
thresholded by ``abstain_guard.guarantee.groups.group_rules`` (the code the guard runs), and each
group's *true* participation and error rate among answered at its threshold are computed
on the population. Reported per group:

* participation mode (1−α): the mean true participation of the group's own rule over the
  draws, with its Monte-Carlo s.e., against the band ``[1−α, mean of 1−α+1/(n_g+1))``;
  valid when ``mean ≥ 1−α − 3 s.e.`` and ``mean ≤ upper + 3 s.e.`` (the guarantee is an
  expectation over the calibration draw, conditional on the group);
* risk mode (ε, δ): the violation rate P(true error among the group's answered > ε), valid
  when ``≤ δ_g + 3 s.e.`` (s.e. = sqrt(δ_g(1−δ_g)/reps)); with ``group_delta="union"``
  (δ_g = δ/G) also the rate at which *any* group violates, valid when ``≤ δ + 3 s.e.``;
* beside each, the pooled rule's true participation and violation rate in that group.

Populations. ``probe``: the shipped guard's 960 calibration answers (score, correct, and the
relation read from ``calibration_ids``, ``probe:<relation>:<key>``), sorted by score with
ties broken at random once, atom i covering [i, i+1) of one position axis (as
``experiments/risk_control/risk_control.py``); a draw picks an atom uniformly (so groups come in
their population proportions) and a uniform position inside it. A group's true participation at
threshold t is its mass below t over its size, its true risk the errors among that mass.
``synthetic``: 20 000 draws of four groups on shifted score scales, P(wrong | u) linear in u
with group-specific levels (see :func:`synthetic_population`).

Part 2 — the probe set, per relation: 5-fold cross-fitting on the shipped guard's 960 stored
calibration answers (no model run): each fold is decided by the pooled and by the per-group
rule calibrated on the other four folds; per relation, answered / questions and wrong /
answered with 95 % Wilson intervals (``abstain_guard.guarantee.groups.group_rates``).

Run (212 s on 2 cores; the output of the last run is experiments/groups/group_guarantees.json)::

    flock /tmp/heavy.lock .venv/bin/python experiments/groups/group_guarantees.py > \
        experiments/groups/group_guarantees.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard import GuardArtifact, GuardConfig, default_artifact_path
from abstain_guard.calibration.measure.group_report import cross_fitted_groups, groups_markdown

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from group_simulation import GroupPopulation, from_pairs, simulate_cell, synthetic_population


def probe_population(seed: int) -> GroupPopulation:
    """The shipped guard's calibration answers, grouped by relation."""
    art = GuardArtifact.load(default_artifact_path())
    groups = np.array([i.split(":")[1] for i in art.metadata["calibration_ids"]])
    return from_pairs("probe", np.asarray(art.scores), np.asarray(art.correct), groups, seed)


def probe_table(config: GuardConfig, seed: int = 0) -> dict[str, Any]:
    """Pooled vs per-group rule per relation on the shipped guard's stored answers, each
    answer decided by rules calibrated on the other four folds (what ``evaluate`` reports)."""
    art = GuardArtifact.load(default_artifact_path())
    groups = np.array([i.split(":")[1] for i in art.metadata["calibration_ids"]])
    return cross_fitted_groups(art.scores, art.correct, groups, config, folds=5, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # each draw's fallback groups would log
    t0 = time.time()
    pops = [probe_population(args.seed), synthetic_population(args.seed + 10)]
    cells = []
    base = {"group_by": "relation", "group_fallback": "abstain", "on_infeasible": "abstain_all"}
    configs = [GuardConfig(participation=0.8, **base)]  # type: ignore[arg-type]
    for eps in (0.2, 0.35, 0.5):
        for sharing in ("per_group", "union"):
            configs.append(
                GuardConfig(mode="risk", risk_target=eps, delta=0.1, group_delta=sharing, **base)  # type: ignore[arg-type]
            )
    for p, pop in enumerate(pops):
        for n in (500, 1000):
            for c, cfg in enumerate(configs):
                seed = args.seed + 1000 * p + 100 * c + n
                cell = simulate_cell(pop, n, cfg, args.reps, seed)
                cells.append(cell)
                print(
                    f"{pop.name} n={n} {cfg.mode} {cfg.target:g} {cfg.group_delta}: "
                    f"valid={cell['valid']} ({time.time() - t0:.0f} s)",
                    file=sys.stderr,
                )
    probe = {
        "participation 0.8": probe_table(GuardConfig(participation=0.8)),
        "risk 0.35 at delta 0.1": probe_table(
            GuardConfig(mode="risk", risk_target=0.35, delta=0.1)
        ),
    }
    result = {
        "command": "flock /tmp/heavy.lock .venv/bin/python experiments/groups/group_guarantees.py",
        "reps": args.reps,
        "seconds": round(time.time() - t0, 1),
        "all_valid": all(c["valid"] for c in cells),
        "cells": cells,
        "probe_cross_fitted": probe,
    }
    json.dump(result, sys.stdout, indent=1, default=float)
    print()
    print(groups_markdown(probe), file=sys.stderr)


if __name__ == "__main__":
    main()
