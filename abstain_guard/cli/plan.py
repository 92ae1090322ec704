"""``abstain-guard plan``: how many calibration answers to label for a risk target, before
anyone labels (simulated: :mod:`abstain_guard.guarantee.planning`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from abstain_guard.guarantee.planning import (
    DEFAULT_PLAN_SIZES,
    LabelPlan,
    PlanScenario,
    label_plan,
)

from .checks import artifacts_exist

__all__ = ["add_parser"]


def _scenario_and_stored(args: argparse.Namespace) -> tuple[PlanScenario, Any]:
    if args.artifact is None:
        scenario = PlanScenario(args.risk_target, args.delta, args.accuracy, args.auroc)
        return scenario, None
    from abstain_guard.artifact.guard_artifact import GuardArtifact

    artifacts_exist([args.artifact])
    artifact = GuardArtifact.load(args.artifact)
    accuracy = float(artifact.correct.mean())
    scenario = PlanScenario(args.risk_target, args.delta, accuracy, source=str(args.artifact))
    return scenario, (artifact.scores, artifact.correct)


def _print_plan(plan: LabelPlan, participation: float | None) -> None:
    s = plan.scenario
    scorer = f"AUROC {s.auroc:g} (binormal)" if s.auroc is not None else f"scores of {s.source}"
    print(
        f"risk_target {s.risk_target:g}, delta {s.delta:g}; accuracy {s.accuracy:.1%}, {scorer}; "
        f"{plan.draws} simulated calibration sets a size (seed {plan.seed})"
    )
    print("certified participation of the calibration set:")
    print("      n   median      10%      90%   certifies anything")
    for r in plan.rows:
        print(f"{r.n:7d} {r.median:8.1%} {r.low:8.1%} {r.high:8.1%} {r.certified:20.0%}")
    if plan.limit is not None:
        print(f"as n grows: {plan.limit:.1%} (the population's share at risk = risk_target)")
    if participation is not None:
        n = plan.n_for(participation)
        print(
            f"for a median participation of {participation:.0%}: "
            + (f"n = {n}" if n is not None else "none of these sizes; try larger --sizes")
        )


def _plan(args: argparse.Namespace) -> int:
    scenario, stored = _scenario_and_stored(args)
    plan = label_plan(scenario, args.sizes, args.draws, args.seed, stored=stored)
    if args.json:
        out = plan.to_dict()
        if args.participation is not None:
            out["n_for_participation"] = plan.n_for(args.participation)
        print(json.dumps(out, indent=2))
    else:
        _print_plan(plan, args.participation)
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to the subparsers ``sub``; returns its parser."""
    plan = sub.add_parser(
        "plan",
        help="how many calibration answers certify a risk target (simulated, before labelling)",
        description=(
            "Simulate the participation that n labelled calibration answers certify at "
            "risk_target / delta, from the accuracy you expect and the scorer's AUROC "
            "(binormal scores), or by resampling an existing artifact's calibration."
        ),
    )
    plan.add_argument("--risk-target", type=float, required=True, help="ε, e.g. 0.35")
    plan.add_argument("--delta", type=float, default=0.1, help="δ (0.1)")
    plan.add_argument("--accuracy", type=float, default=0.5, help="expected share right (0.5)")
    quality = plan.add_mutually_exclusive_group(required=True)
    quality.add_argument("--auroc", type=float, help="the scorer's AUROC, e.g. 0.75")
    quality.add_argument("--artifact", help="resample this artifact's scores and labels")
    plan.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=list(DEFAULT_PLAN_SIZES),
        help="calibration sizes to simulate",
    )
    plan.add_argument("--participation", type=float, help="report the n reaching this median")
    plan.add_argument("--draws", type=int, default=200, help="simulated sets a size (200)")
    plan.add_argument("--seed", type=int, default=0, help="the simulation's seed (0)")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(func=_plan)
    return plan
