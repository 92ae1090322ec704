"""``abstain-guard evaluate``: AUROC/AUPRC/PRR, resplit simulation and a report on held-out
questions; ``--live``, the deployment check (the guard chain as deployed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from abstain_guard.default import DEFAULT_ARTIFACT_DIR
from abstain_guard.scorers import scorer_names

from .checks import (
    add_model_options,
    all_at_once,
    artifact_model,
    artifacts_exist,
    cache_dir,
    check_out,
    guard_config,
    not_agent_artifacts,
    positive,
)


def _evaluate(args: argparse.Namespace) -> int:
    if args.live:
        return _evaluate_live(args)
    from abstain_guard.calibration.measure.baselines import parse_baselines
    from abstain_guard.calibration.measure.evaluate import EvaluateOptions, evaluate
    from abstain_guard.calibration.measure.held_out import HeldOutSource

    artifacts = args.artifact or [DEFAULT_ARTIFACT_DIR]
    all_at_once(
        lambda: check_out(args.out),
        lambda: cache_dir(args.cache_dir),
        lambda: positive(args.limit, "--limit"),
        lambda: positive(args.resplits, "--resplits"),
        lambda: parse_baselines(args.baselines),
        lambda: artifacts_exist(artifacts),
    )
    not_agent_artifacts(artifacts)
    for artifact in artifacts:
        artifact_model(artifact, args)
    results = evaluate(
        artifacts,
        out=args.out,
        source=HeldOutSource(data=args.data, group_by=args.group_by, limit=args.limit),
        options=EvaluateOptions(
            baselines=args.baselines,
            n_resplits=args.resplits,
            cache_dir=cache_dir(args.cache_dir),
            reuse_calibration_cache=not args.no_reuse_calibration_cache,
        ),
        progress=not args.quiet,
    )
    print(json.dumps(results.get("headline", {}), indent=2))
    _print_datasets(results.get("datasets", {}))
    print(f"report written to {Path(args.out) / 'report.md'}")
    return 0


def _print_datasets(datasets: dict[str, Any]) -> None:
    """Each data set's selection ledger (when evaluating wrote it) and certifiable targets."""
    from abstain_guard.calibration.measure.tables import frontier_markdown

    for name, entry in datasets.items():
        ledger = entry.get("ledger") or {}
        if ledger.get("written"):
            print(
                f"\n{name}: {len(ledger['names'])} scorers read the calibration answers; the "
                f"selection ledger ({ledger['path']}) now counts K = {ledger['n_candidates']}: "
                "every target of this artifact is certified at delta/K from now on"
            )
        if entry.get("frontier"):
            print(f"\n{name}: certifiable risk targets (certified calibration participation)")
            print(frontier_markdown(entry["frontier"]))


def _evaluate_live(args: argparse.Namespace) -> int:
    from abstain_guard.calibration.measure.deployment_check import live_check

    artifacts = args.artifact or [DEFAULT_ARTIFACT_DIR]
    all_at_once(
        lambda: check_out(args.out),
        lambda: cache_dir(args.cache_dir),
        lambda: positive(args.limit, "--limit"),
        lambda: guard_config(args.config),
        lambda: artifacts_exist(artifacts),
    )
    config = guard_config(args.config)
    for artifact in artifacts:
        artifact_model(artifact, args)
    for artifact in artifacts:
        result = live_check(
            artifact,
            guard_config=config,
            out=args.out,
            limit=args.limit,
            progress=not args.quiet,
            split=args.split,
            cache_dir=cache_dir(args.cache_dir),
            reuse_calibration_cache=not args.no_reuse_calibration_cache,
            concurrency=args.concurrency,
        )
        print(json.dumps({"artifact": str(artifact), **result["summary"]}, indent=2))
    print(f"per-question rows written to {Path(args.out) / 'live.json'}")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``evaluate`` to the subparsers ``sub``; returns its parser."""
    ev = sub.add_parser("evaluate", help="AUROC/AUPRC/PRR, resplit simulation, report")
    ev.add_argument(
        "--artifact",
        action="append",
        help="artifact directory (repeat for several data sets; default: the shipped guard)",
    )
    ev.add_argument("--data", help="another labeled file (judged with the artifact's judge)")
    add_model_options(
        ev, local=False, what="default: the artifact's; given, it must be the artifact's"
    )
    ev.add_argument("--out", required=True, help="report directory")
    ev.add_argument("--group-by", help="field of --data holding the question type")
    ev.add_argument(
        "--baselines",
        default="likelihood",
        help="'likelihood' (fast), 'probes' (likelihood, the hidden-state probes, "
        "likelihood_probe and type_floor: fitted on the artifact's reference + train "
        "answers), 'all' (also model and sampling baselines), 'blackbox' (every black-box "
        "statistic, from a black-box artifact's own samples), 'none', or a comma list of: "
        + ", ".join(
            scorer_names(family=("likelihood", "probe", "floor", "model", "sampling", "blackbox"))
        ),
    )
    ev.add_argument("--resplits", type=int, default=1000, help="random resplits")
    ev.add_argument(
        "--limit", type=int, help="use only the first N questions of --data (or of --live)"
    )
    _add_live_options(ev)
    ev.add_argument(
        "--cache-dir",
        help="where answers and verdicts are cached, read and written; only this cache is "
        "used (default: '<out>/cache', over the calibration run's cache read-only)",
    )
    ev.add_argument(
        "--no-reuse-calibration-cache",
        action="store_true",
        help="do not read the answers and verdicts of the artifact's calibration cache (by "
        "default they are reused read-only, so evaluating right after calibrating generates "
        "nothing calibration generated; new entries go under --out only)",
    )
    ev.add_argument("--quiet", action="store_true", help="no progress bars")
    ev.set_defaults(func=_evaluate)
    return ev


def _add_live_options(ev: argparse.ArgumentParser) -> None:
    """``--live`` and the options of the deployment check."""
    ev.add_argument(
        "--live",
        action="store_true",
        help="deployment check: run the guard chain as deployed on the artifact's held-out "
        "questions; live vs stored score, live participation vs the guaranteed band",
    )
    ev.add_argument("--config", help="guard config for --live (YAML/TOML/JSON)")
    ev.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="--live: guarded calls in flight at once (a vLLM-backed guard is checked under "
        "the batching it is served with; default 1)",
    )
    ev.add_argument(
        "--split",
        choices=["held_out", "calibration", "test"],
        default="held_out",
        help="--live: which of the artifact's held-out questions to run (test: never used for "
        "the threshold, an out-of-sample check of the realized error)",
    )
