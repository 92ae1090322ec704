"""``abstain-guard review``: read people's verdicts on the drawn sample back into the
artifact (:mod:`abstain_guard.calibration.building.review`, docs/guarantees.md, "On the
truth")."""

from __future__ import annotations

import argparse
from typing import Any

from .checks import artifacts_exist

__all__ = ["add_parser"]


def _review(args: argparse.Namespace) -> int:
    from abstain_guard.calibration.building.review import apply_review
    from abstain_guard.config import GuardConfig

    artifacts_exist([args.artifact])
    artifact = apply_review(args.artifact, args.labels)
    assert artifact.human is not None
    reviewed = int((artifact.human >= 0).sum())
    wrong = int((artifact.human == 0).sum())
    print(f"read {reviewed} reviewed answers ({wrong} wrong) into {args.artifact}")
    config = GuardConfig(
        mode="risk", risk_target=args.risk_target, delta=args.delta, on_infeasible="abstain_all"
    )
    g = artifact.decision_rule(config).guarantee
    q = g.judge_quality
    assert q is not None
    print(
        f"judge on the review: agreement {q['agreement']:.3f} "
        f"[{q['agreement_ci'][0]:.3f}, {q['agreement_ci'][1]:.3f}], kappa {q['kappa']:.3f} "
        f"[{q['kappa_ci'][0]:.3f}, {q['kappa_ci'][1]:.3f}]"
    )
    for name in ("lenient", "strict"):
        rate, ci = q[f"{name}_rate"], q[f"{name}_ci"]
        if rate is not None:
            print(f"  {name} rate {rate:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
    print(
        f"risk_target {args.risk_target:g} at delta {args.delta:g}: participation "
        f"{g.calibration_participation:.3f} ({g.statement})"
    )
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``review`` to the subparsers ``sub``; returns its parser."""
    rev = sub.add_parser(
        "review", help="read people's verdicts on the drawn sample back into the artifact"
    )
    rev.add_argument("--artifact", required=True, help="artifact calibrated with --review N")
    rev.add_argument(
        "--labels", required=True, help="the filled review file (<artifact>.review.csv)"
    )
    rev.add_argument("--risk-target", type=float, default=0.35, help="ε to report (0.35)")
    rev.add_argument("--delta", type=float, default=0.1, help="δ to report (0.1)")
    rev.set_defaults(func=_review)
    return rev
