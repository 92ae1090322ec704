"""``abstain-guard recalibrate``: a new artifact from the labeled live decisions of a monitor
log (no model run)."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from abstain_guard.config import GuardConfig

from .checks import all_at_once, artifacts_exist, positive, significance_level


def _recalibrate(args: argparse.Namespace) -> int:
    from abstain_guard.calibration.building.recalibrate import CHECK_LEVEL, recalibrate

    all_at_once(
        lambda: artifacts_exist([args.artifact]),
        lambda: positive(args.last, "--last"),
        lambda: significance_level(args.check_level, "--check-level"),
    )
    summary = recalibrate(
        args.artifact,
        args.feedback,
        args.out,
        pool=args.pool,
        last=args.last,
        overwrite=args.overwrite,
        mode=args.mode,
        check_level=CHECK_LEVEL if args.check_level is None else args.check_level,
    )
    print(summary.to_text())
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``recalibrate`` to the subparsers ``sub``; returns its parser."""
    rec = sub.add_parser(
        "recalibrate",
        help="a new artifact from labeled live decisions in a monitor log (no model run)",
    )
    rec.add_argument("--artifact", required=True, help="the artifact that served the traffic")
    rec.add_argument(
        "--feedback",
        required=True,
        help="monitor log (JSONL, serve --monitor-log or GuardMonitor): decisions + feedback",
    )
    rec.add_argument("--out", required=True, help="artifact directory to write")
    rec.add_argument(
        "--last",
        type=int,
        help="only the most recent N decisions, after a shift (labeled ones in risk mode, "
        "scored ones in participation mode)",
    )
    rec.add_argument(
        "--pool",
        action="store_true",
        help="keep the old calibration set too (only valid when old and live questions are "
        "exchangeable: refused after a drift alarm or when the scores differ)",
    )
    rec.add_argument(
        "--mode",
        choices=get_args(GuardConfig.model_fields["mode"].annotation),
        help="participation: the threshold from every scored decision, labeled or not (no "
        "labels needed); risk: from the labeled decisions only, refused when the labels are "
        "not a score-blind sample (default: the logged rule's mode)",
    )
    rec.add_argument(
        "--check-level",
        type=float,
        help="significance level of the checks that refuse score-selected labels (risk "
        "mode) and --pool across a shift (default 0.01; a larger level refuses more)",
    )
    rec.add_argument("--overwrite", action="store_true", help="replace an artifact at --out")
    rec.set_defaults(func=_recalibrate)
    return rec
