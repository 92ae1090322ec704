"""``abstain-guard demo``: the shipped default guard on held-out questions, with a report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from abstain_guard.config import GuardConfig
from abstain_guard.default import DEFAULT_ARTIFACT_DIR

from .checks import (
    add_model_options,
    all_at_once,
    artifact_model,
    check_out,
    guard_config,
    positive,
)


def _demo(args: argparse.Namespace) -> int:
    from abstain_guard.calibration.measure.demo import run_demo

    all_at_once(
        lambda: check_out(args.out),
        lambda: positive(args.questions, "--questions"),
        lambda: guard_config(None),
        lambda: GuardConfig.from_dict(
            {"mode": "risk", "risk_target": args.risk_target, "delta": args.delta}
        ),
        lambda: artifact_model(args.artifact, args),
    )
    return run_demo(
        Path(args.artifact),
        out=Path(args.out),
        **({} if args.questions is None else {"n_questions": args.questions}),
        guard_config=guard_config(None),
        risk_target=args.risk_target,
        delta=args.delta,
    )


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``demo`` to the subparsers ``sub``; returns its parser."""
    demo = sub.add_parser("demo", help="the shipped default guard on held-out questions")
    demo.add_argument("--artifact", default=str(DEFAULT_ARTIFACT_DIR), help="artifact directory")
    demo.add_argument("--out", default="demo_report", help="where to write the report")
    add_model_options(
        demo, local=False, what="default: the artifact's; given, it must be the artifact's"
    )
    demo.add_argument(
        "--questions",
        type=int,
        default=None,
        help="how many held-out questions to ask (default 96, about a minute on two cores)",
    )
    demo.add_argument(
        "--risk-target",
        type=float,
        default=0.35,
        help="ε of the risk mode the demo leads with (at most this share of answers wrong)",
    )
    demo.add_argument("--delta", type=float, default=0.1, help="δ of the risk mode")
    demo.set_defaults(func=_demo)
    return demo
