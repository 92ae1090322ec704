"""``abstain-guard`` command line: calibrate, ask, evaluate, report, demo, serve,
recalibrate (``serve`` lives in :mod:`.serve`, the shared checks in :mod:`.checks`).

Heavy imports (torch, transformers, xgboost) happen inside the commands, so ``--help`` and
configuration errors are instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from abstain_guard.config import GuardConfig
from abstain_guard.default import DEFAULT_ARTIFACT_DIR
from abstain_guard.errors import (
    AbstainGuardError,
    ResultsFileError,
)
from abstain_guard.scorers import scorer_names

from .checks import (
    all_at_once,
    artifacts_exist,
    guard_config,
    not_agent_artifacts,
    positive,
    significance_level,
)
from .review import add_review_parsers
from .serve import add_serve_parser

__all__ = ["build_parser", "main", "run"]


def _check_out(out: str | Path) -> Path:
    """A report directory: absent or a directory, under a writable one (only it is written)."""
    from abstain_guard.calibration.building.preflight import check_writable_location

    path = Path(out)
    check_writable_location(path, "--out")
    return path


def _cache_dir(args: argparse.Namespace) -> Path | None:
    """Where evaluate/--live keep answers and verdicts: ``--cache-dir`` if given (checked),
    else None: ``<out>/cache``, over the calibration run's cache read-only unless
    ``--no-reuse-calibration-cache`` (nothing is ever written where an artifact points)."""
    if args.cache_dir:
        from abstain_guard.calibration.building.preflight import check_writable_location

        check_writable_location(Path(args.cache_dir), "--cache-dir")
        return Path(args.cache_dir)
    return None


def _calibrate(args: argparse.Namespace) -> int:
    from abstain_guard.calibration.building.pipeline import calibrate
    from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig

    overrides = {
        "limit": args.limit,
        "seed": args.seed,
        "scorer": args.scorer,
        "backend": args.backend,
        "candidates": args.candidates,
        "selection_share": args.selection_share,
        "judge": args.judge,
        "cache_dir": args.cache_dir,
        "system_prompt": args.system_prompt,
        "risk_target": args.risk_target,
        "delta": args.delta,
        "skip_bad_rows": True if args.skip_bad_rows else None,
        "executor": args.executor,
        "ray_address": args.address,
        "replicas": args.replicas,
        "gpus_per_replica": args.gpus_per_replica,
        "agent": args.agent,
        "agent_step_limit": args.agent_step_limit,
        "agent_gating": args.agent_gating,
        "max_new_tokens": args.max_new_tokens,
        "chunk_rule": args.chunk_rule,
        "review_size": args.review,
        "review_seed": args.review_seed,
        "review_scope": args.review_scope,
    }
    if args.judge_model or args.judge_base_url:  # an LLM judge by configuration alone
        spec = {"name": "llm", "model": args.judge_model, "base_url": args.judge_base_url}
        overrides["judge"] = {k: v for k, v in spec.items() if v is not None}
    if args.config:
        config = CalibrationConfig.from_file(args.config, **overrides)
    else:
        config = CalibrationConfig(**{k: v for k, v in overrides.items() if v is not None})
    summary = calibrate(args.data, args.out, config=config, progress=not args.quiet)
    print(summary.to_text())
    return 0


def _questions(args: argparse.Namespace) -> list[str]:
    if args.questions:
        return list(args.questions)
    return [line.strip() for line in sys.stdin if line.strip()]


def _ask(args: argparse.Namespace) -> int:
    questions = _questions(args)
    if not questions:
        print("No question given: pass questions as arguments or on stdin.", file=sys.stderr)
        return 2
    from abstain_guard.guard.chains import load_guard_chain

    config = guard_config(args.config)
    chain, _, _ = load_guard_chain(args.artifact, config, kind=args.kind)
    for question in questions:
        msg = chain.invoke({"question": question})
        info = msg.response_metadata["abstention"]
        decision = "ABSTAINED" if info["abstained"] else "ANSWERED"
        print(f"Q: {question}")
        answer = msg.content
        withheld = msg.response_metadata.get("withheld_response") or {}
        if info["abstained"] and withheld.get("content"):
            answer = f"{msg.content}   (withheld: {withheld['content']!r})"
        print(f"A: {answer}")
        score = "unscorable" if info["score"] is None else f"{info['score']:.4g}"
        why = f"  ({info['error']})" if info.get("error") else ""
        print(
            f"   {decision}  score={score}  threshold={info['threshold']:.4g}  "
            f"{info['mode']} target={info['target']}{why}"
        )
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    if args.live:
        return _evaluate_live(args)
    from abstain_guard.calibration.measure.held_out import (
        EvaluateOptions,
        HeldOutSource,
        evaluate,
        parse_baselines,
    )
    from abstain_guard.calibration.measure.tables import frontier_markdown

    all_at_once(
        lambda: _check_out(args.out),
        lambda: _cache_dir(args),
        lambda: positive(args.limit, "--limit"),
        lambda: positive(args.resplits, "--resplits"),
        lambda: parse_baselines(args.baselines),
        lambda: artifacts_exist(args.artifact or [DEFAULT_ARTIFACT_DIR]),
    )
    not_agent_artifacts(args.artifact or [DEFAULT_ARTIFACT_DIR])
    results = evaluate(
        args.artifact or [DEFAULT_ARTIFACT_DIR],
        out=args.out,
        source=HeldOutSource(data=args.data, group_by=args.group_by, limit=args.limit),
        options=EvaluateOptions(
            baselines=args.baselines,
            n_resplits=args.resplits,
            cache_dir=_cache_dir(args),
            reuse_calibration_cache=not args.no_reuse_calibration_cache,
        ),
        progress=not args.quiet,
    )
    print(json.dumps(results.get("headline", {}), indent=2))
    for name, entry in results.get("datasets", {}).items():
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
    print(f"report written to {Path(args.out) / 'report.md'}")
    return 0


def _evaluate_live(args: argparse.Namespace) -> int:
    from abstain_guard.calibration.measure.deployment_check import live_check

    artifacts = args.artifact or [DEFAULT_ARTIFACT_DIR]
    all_at_once(
        lambda: _check_out(args.out),
        lambda: _cache_dir(args),
        lambda: positive(args.limit, "--limit"),
        lambda: guard_config(args.config),
        lambda: artifacts_exist(artifacts),
    )
    config = guard_config(args.config)
    for artifact in artifacts:
        result = live_check(
            artifact,
            guard_config=config,
            out=args.out,
            limit=args.limit,
            progress=not args.quiet,
            split=args.split,
            cache_dir=_cache_dir(args),
            reuse_calibration_cache=not args.no_reuse_calibration_cache,
            concurrency=args.concurrency,
        )
        print(json.dumps({"artifact": str(artifact), **result["summary"]}, indent=2))
    print(f"per-question rows written to {Path(args.out) / 'live.json'}")
    return 0


def _read_results(path: str) -> dict[str, Any]:
    """A ``results.json`` written by ``abstain-guard evaluate``."""
    hint = "pass the results.json files that abstain-guard evaluate wrote into its --out"
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ResultsFileError(f"--results {path} does not exist; {hint}.") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsFileError(f"--results {path} cannot be read ({exc}); {hint}.") from exc
    except json.JSONDecodeError as exc:
        raise ResultsFileError(
            f"--results {path} is not one JSON document ({exc.msg} at line {exc.lineno}, "
            f"column {exc.colno}; a JSONL file?); {hint}."
        ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("datasets"), dict):
        raise ResultsFileError(f"--results {path} has no 'datasets' mapping; {hint}.")
    return doc


def _report(args: argparse.Namespace) -> int:
    from abstain_guard.calibration.measure.report import write_report
    from abstain_guard.calibration.measure.results import build_results

    docs: dict[str, dict[str, Any]] = {}

    def read(path: str) -> None:
        docs[path] = _read_results(path)

    all_at_once(
        lambda: _check_out(args.out),
        *[(lambda p=p: read(p)) for p in args.results],
    )
    entries, metadata = [], {}
    for path, doc in docs.items():
        entries.extend(doc["datasets"].values())
        metadata[str(path)] = doc.get("metadata", {})
    report = write_report(build_results(entries, {"merged_from": metadata}), args.out)
    print(f"report written to {report}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from abstain_guard.calibration.measure.demo import run_demo

    all_at_once(
        lambda: _check_out(args.out),
        lambda: positive(args.questions, "--questions"),
        lambda: guard_config(None),
        lambda: GuardConfig.from_dict(
            {"mode": "risk", "risk_target": args.risk_target, "delta": args.delta}
        ),
    )
    return run_demo(
        Path(args.artifact),
        out=Path(args.out),
        **({} if args.questions is None else {"n_questions": args.questions}),
        guard_config=guard_config(None),
        risk_target=args.risk_target,
        delta=args.delta,
    )


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    parser = argparse.ArgumentParser(
        prog="abstain-guard",
        description="Calibrate, run and evaluate a conformal abstention guard for an LLM.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log decisions")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (also accepted after the command)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    cal = sub.add_parser("calibrate", help="generate, judge, fit the scorer, write an artifact")
    cal.add_argument(
        "--data",
        required=True,
        help="JSONL/CSV questions, or 'builtin' (probe set), 'builtin-lookup' (lookup agent)",
    )
    cal.add_argument("--out", required=True, help="artifact directory to write")
    cal.add_argument("--config", help="calibration config (YAML/TOML/JSON)")
    cal.add_argument("--limit", type=int, help="use only the first N questions")
    cal.add_argument("--seed", type=int, help="split seed")
    cal.add_argument(
        "--scorer",
        help="scorer for the guard (default: geometry, the paper's); one of "
        + ", ".join(scorer_names(family=("likelihood", "geometry", "probe")))
        + ". Every one carries the same guarantee. The shipped guard uses probe_mid: on the "
        "probe set it certified the most participation at risk 0.35 (27.4 %% as shipped, paying "
        "delta/20 for the choice: 13 scorers compared and 7 more looks found by an audit; "
        "geometry 8 %%); "
        "on SciQ and NQ-open no probe differs significantly from geometry (paired DeLong, "
        "Holm over 50 comparisons). "
        "`evaluate --baselines probes` measures "
        "them on your data (docs/results.md, 'Is geometry worth its cost?'). 'auto' chooses "
        "among --candidates",
    )
    cal.add_argument(
        "--backend",
        choices=("exact", "vllm"),
        help="the engine answers are generated on, as the guard will be deployed: 'exact' "
        "(the project's engine, every scorer; default) or 'vllm' (vLLM's batched engine in "
        "its own environment: probe and likelihood scorers; docs/vllm.md)",
    )
    cal.add_argument(
        "--candidates",
        help="comma-separated scorers compared on the calibration answers: with --scorer auto "
        "every one is calibrated on the same answers, certified at delta/K at --risk-target "
        "(needed) and the one certifying the most participation is shipped; with a named "
        "--scorer, the ones it was chosen among. The artifact records a `selection` block and "
        "the guard certifies at delta/K, so delta holds whatever the choice",
    )
    cal.add_argument(
        "--selection-share",
        type=float,
        help="with --scorer auto: choose among --candidates on this share of the calibration "
        "answers (a seeded draw) and certify the chosen scorer at delta on the rest, which no "
        "choice has read (instead of delta/K on all of them)",
    )
    cal.add_argument("--judge", help="judge name (default: lexical)")
    cal.add_argument(
        "--judge-model",
        help="an LLM judge: an init_chat_model name ('openai:gpt-4o-mini'), or with "
        "--judge-base-url the model the server serves; data rows may then lack answers",
    )
    cal.add_argument("--judge-base-url", help="OpenAI-compatible server of the LLM judge")
    cal.add_argument(
        "--review",
        type=int,
        help="draw N calibration answers for people to review (<out>.review.csv); then "
        "abstain-guard review certifies the true error rate",
    )
    cal.add_argument("--review-seed", type=int, help="seed of the review draw")
    cal.add_argument(
        "--review-scope",
        type=float,
        help="draw the review among this share of the answers with the lowest scores (1)",
    )
    cal.add_argument("--cache-dir", help="run cache (default: '<out>.cache')")
    cal.add_argument(
        "--system-prompt",
        help="the system prompt the deployment will run with (recorded in the artifact; the "
        "guard refuses another one)",
    )
    cal.add_argument(
        "--risk-target",
        type=float,
        help="the risk target the deployment will ask for: warns before the model runs when "
        "the calibration split is too small to certify it even with a perfect scorer",
    )
    cal.add_argument("--delta", type=float, help="delta of --risk-target (default 0.1)")
    cal.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="skip malformed rows, non-string answers, duplicate and over-long questions "
        "(counted in the summary) instead of failing with their lines (config: skip_bad_rows)",
    )
    cal.add_argument(
        "--executor",
        choices=("local", "ray"),
        help="generate and judge in this process (default) or on Ray actors, one model "
        "replica each (needs the ray extra; docs/scale-out.md)",
    )
    cal.add_argument(
        "--address",
        help="with --executor ray: the cluster to join ('auto' = the one `ray start` runs "
        "here, 'ray://host:10001'); default: start a local one",
    )
    cal.add_argument("--replicas", type=int, help="with --executor ray: model replicas (1)")
    cal.add_argument(
        "--gpus-per-replica", type=float, help="with --executor ray: GPUs per replica (0)"
    )
    cal.add_argument(
        "--agent",
        help="'package.module:factory': calibrate the LangChain agent factory(model) returns, "
        "run as deployed on every question (tools, system prompt, middleware; no guard)",
    )
    cal.add_argument(
        "--agent-step-limit", type=int, help="LangGraph recursion_limit of each agent run (12)"
    )
    cal.add_argument(
        "--agent-gating",
        choices=["steps", "final_answer"],
        help="what the guard gates in an agent run: every model call, the run stopped before "
        "the tool calls of the first call over the threshold (steps, default), or only the "
        "final answer (tool calls run ungated; a weaker guarantee: docs/guarantees.md)",
    )
    cal.add_argument(
        "--max-new-tokens", type=int, help="token budget of every model call (default: per kind)"
    )
    cal.add_argument(
        "--chunk-rule",
        help="calibrate for certified streaming: score each answer at every chunk end of this "
        "rule ('sentence', 'clause' or 'tokens:K') and calibrate on the maximum, so the guard "
        "releases answers chunk by chunk as they are generated (docs/streaming.md)",
    )
    cal.add_argument("--quiet", action="store_true", help="no progress bars")
    cal.set_defaults(func=_calibrate)

    ask = sub.add_parser("ask", help="answer or abstain for questions")
    ask.add_argument("--artifact", default=str(DEFAULT_ARTIFACT_DIR), help="artifact directory")
    ask.add_argument("--config", help="guard config (YAML/TOML/JSON): mode, target")
    ask.add_argument(
        "--kind",
        choices=["open", "choice", "numeric"],
        help="question kind to prompt as (default: the artifact's only kind); choice "
        "questions must list their lettered options",
    )
    ask.add_argument("questions", nargs="*", help="questions (default: read stdin lines)")
    ask.set_defaults(func=_ask)

    ev = sub.add_parser("evaluate", help="AUROC/AUPRC/PRR, resplit simulation, report")
    ev.add_argument(
        "--artifact",
        action="append",
        help="artifact directory (repeat for several data sets; default: the shipped guard)",
    )
    ev.add_argument("--data", help="another labeled file (judged with the artifact's judge)")
    ev.add_argument("--out", required=True, help="report directory")
    ev.add_argument("--group-by", help="field of --data holding the question type")
    ev.add_argument(
        "--baselines",
        default="likelihood",
        help="'likelihood' (fast), 'probes' (likelihood, the hidden-state probes, "
        "likelihood_probe and type_floor: fitted on the artifact's reference + train "
        "answers), 'all' (also model and sampling baselines), 'none', or a comma list of: "
        + ", ".join(scorer_names(family=("likelihood", "probe", "floor", "model", "sampling"))),
    )
    ev.add_argument("--resplits", type=int, default=1000, help="random resplits")
    ev.add_argument(
        "--limit", type=int, help="use only the first N questions of --data (or of --live)"
    )
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

    rep = sub.add_parser("report", help="merge evaluate results.json files into one report")
    rep.add_argument("--results", nargs="+", required=True, help="results.json files")
    rep.add_argument("--out", required=True, help="report directory")
    rep.set_defaults(func=_report)

    demo = sub.add_parser("demo", help="the shipped default guard on held-out questions")
    demo.add_argument("--artifact", default=str(DEFAULT_ARTIFACT_DIR), help="artifact directory")
    demo.add_argument("--out", default="demo_report", help="where to write the report")
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
    srv = add_serve_parser(sub)
    for sub_parser in (cal, ask, ev, rep, demo, srv, rec, *add_review_parsers(sub)):
        sub_parser.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Run a command; user mistakes raise their typed :class:`AbstainGuardError`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    return int(args.func(args))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``abstain-guard`` script: a user mistake prints one ``error:``
    message and exits with 2 (``--debug``: with its traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except AbstainGuardError as exc:
        if "--debug" in args[: args.index("--") if "--" in args else len(args)]:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
