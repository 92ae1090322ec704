"""``abstain-guard review-size``: how many answers to review for a target, and where, before
anyone labels (simulated on the artifact's scores and judge labels with the certificate on
the truth the reviewed artifact will use)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from abstain_guard.errors import ConfigError

from .checks import artifacts_exist

__all__ = ["add_parser"]


def _review_size(args: argparse.Namespace) -> int:
    from abstain_guard.artifact.guard_artifact import GuardArtifact
    from abstain_guard.calibration.building.review import recommended_size, review_size_table

    artifacts_exist([args.artifact])
    if not 0.0 <= args.judge_error < 0.5:
        raise ConfigError(f"--judge-error must be in [0, 0.5), got {args.judge_error}.")
    artifact = GuardArtifact.load(args.artifact)
    rows = review_size_table(
        (artifact.scores, artifact.correct),
        (args.risk_target, args.delta),
        args.judge_error,
        sizes=args.sizes,
        draws=args.draws,
        lenient_share=args.lenient_share,
        scope=args.scope,
    )
    best = recommended_size(rows)
    if args.json:
        print(json.dumps({"rows": [r.to_json() for r in rows], "recommended": best}, indent=2))
        return 0
    where = "planned scope" if args.scope is None else f"the {args.scope:.0%} lowest scores"
    print(
        f"n = {artifact.n} calibration answers; a judge wrong on {args.judge_error:.1%} of them "
        f"({args.lenient_share:.0%} of its errors lenient, more often on uncertain answers); "
        f"risk_target {args.risk_target:g}, delta {args.delta:g}; review drawn in the {where} "
        f"as calibrate draws it; {args.draws} simulated draws"
    )
    print("   m   certifiable   median participation")
    for r in rows:
        print(f"{r.m:5d}   {r.certifiable:10.0%}   {r.median_participation:19.3f}")
    print(
        f"recommended: calibrate --review {best}"
        + ("" if args.scope is None else f" --review-scope {args.scope:g}")
        if best is not None
        else "no size certifies risk_target here: raise it, or label more answers"
    )
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``review-size`` to the subparsers ``sub``; returns its parser."""
    size = sub.add_parser(
        "review-size", help="how many answers to review for a target (simulated, no labels)"
    )
    size.add_argument("--artifact", required=True, help="artifact (its scores and judge labels)")
    size.add_argument(
        "--judge-error",
        type=float,
        required=True,
        help="the judge's rough error rate (share of answers it labels wrongly), e.g. 0.02",
    )
    size.add_argument("--lenient-share", type=float, default=0.5, help="share of lenient errors")
    size.add_argument("--risk-target", type=float, default=0.35, help="ε (0.35)")
    size.add_argument("--delta", type=float, default=0.1, help="δ (0.1)")
    size.add_argument(
        "--sizes", type=int, nargs="+", default=[50, 100, 200, 400, 800], help="review sizes"
    )
    size.add_argument("--draws", type=int, default=100, help="simulated draws per size (100)")
    size.add_argument(
        "--scope", type=float, help="as calibrate --review-scope (default: the planned scope)"
    )
    size.add_argument("--json", action="store_true", help="print JSON")
    size.set_defaults(func=_review_size)
    return size
