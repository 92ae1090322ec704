"""``abstain-guard calibrate``: generate, judge, fit the scorer, write an artifact.

An option named as a
:class:`~abstain_guard.calibration.building.run.calibration_config.CalibrationConfig` field
(or as :data:`RENAMED` maps it to one) sets that field (:func:`config_overrides`); the others
(:data:`OWN_OPTIONS`) are the command's own.
"""

from __future__ import annotations

import argparse
from typing import Any

from abstain_guard.scorers import scorer_names

from .checks import add_model_options

OWN_OPTIONS = frozenset({"data", "out", "config", "judge_model", "judge_base_url", "quiet"})
"""The options of the command itself, not of the calibration config."""

RENAMED = {"address": "ray_address", "review": "review_size"}
"""The options named otherwise than the config field they set."""


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the options set, None where not given (a switch left off is None,
    so a config file's value stands); ``--judge-model`` / ``--judge-base-url`` make the judge
    an LLM judge by configuration alone."""
    from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig

    fields = {RENAMED.get(name, name): value for name, value in vars(args).items()}
    overrides = {
        name: None if value is False else value
        for name, value in fields.items()
        if name in CalibrationConfig.model_fields
    }
    if args.judge_model or args.judge_base_url:
        spec = {"name": "llm", "model": args.judge_model, "base_url": args.judge_base_url}
        overrides["judge"] = {k: v for k, v in spec.items() if v is not None}
    return overrides


def _calibrate(args: argparse.Namespace) -> int:
    from abstain_guard.calibration.building.pipeline import calibrate
    from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
    from abstain_guard.contract.model_names import ModelName, check_model_name

    overrides = config_overrides(args)
    if args.config:
        config = CalibrationConfig.from_file(args.config, **overrides)
    else:
        config = CalibrationConfig(**{k: v for k, v in overrides.items() if v is not None})
    name = ModelName(config.model, config.gguf_file)
    if name.kind in ("server", "langchain"):  # a local one: preflight checks it with the rest
        config = config.model_copy(update={"model": check_model_name(name).model})
    summary = calibrate(args.data, args.out, config=config, progress=not args.quiet)
    print(summary.to_text())
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``calibrate`` to the subparsers ``sub``; returns its parser."""
    cal = sub.add_parser("calibrate", help="generate, judge, fit the scorer, write an artifact")
    _add_data_options(cal)
    _add_scorer_options(cal)
    _add_judge_options(cal)
    _add_run_options(cal)
    _add_ray_options(cal)
    _add_deployed_options(cal)
    cal.add_argument("--quiet", action="store_true", help="no progress bars")
    cal.set_defaults(func=_calibrate)
    return cal


def _add_data_options(cal: argparse.ArgumentParser) -> None:
    """The questions, where the artifact goes, and which of the questions."""
    cal.add_argument(
        "--data",
        required=True,
        help="JSONL/CSV questions, or 'builtin' (probe set), 'builtin-lookup' (lookup agent)",
    )
    cal.add_argument("--out", required=True, help="artifact directory to write")
    cal.add_argument("--config", help="calibration config (YAML/TOML/JSON)")
    cal.add_argument("--limit", type=int, help="use only the first N questions")
    cal.add_argument("--seed", type=int, help="split seed")


def _add_scorer_options(cal: argparse.ArgumentParser) -> None:
    """The model, the scorer and the engine the answers are generated on."""
    add_model_options(cal, local=True, what="the model to calibrate")
    cal.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="a local model's weights' dtype (default float32; recorded, another is refused)",
    )
    cal.add_argument(
        "--scorer",
        help="scorer for the guard (default: geometry, the paper's); one of "
        + ", ".join(scorer_names(family=("likelihood", "geometry", "probe")))
        + "; on a chat model that returns no logprobs, a black-box scorer: "
        + ", ".join(scorer_names(family="blackbox"))
        + " (its sampling plan in scorer_params). Every one carries the same guarantee; "
        "`evaluate --baselines probes` compares them on your data (docs/results.md); 'auto' "
        "chooses among --candidates",
    )
    cal.add_argument(
        "--backend",
        choices=("exact", "vllm"),
        help="the engine answers are generated on, as the guard will be deployed: 'exact' "
        "(the project's engine, every scorer; default) or 'vllm' (vLLM's batched engine in "
        "its own environment: probe and likelihood scorers; docs/vllm.md)",
    )
    cal.add_argument(
        "--engine-url",
        help="with --backend vllm: your running `vllm serve` (http://host:8000), started with "
        "the guard's connector flag, instead of a server started for calibration",
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


def _add_judge_options(cal: argparse.ArgumentParser) -> None:
    """Who labels the answers: the judge, and people's review of a sample."""
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
    cal.add_argument(
        "--review-scope",
        type=float,
        help="draw the review among this share of the answers with the lowest scores "
        "(default: planned from a seeded 15 %% of the answers' scores and judge labels)",
    )


def _add_run_options(cal: argparse.ArgumentParser) -> None:
    """The run: its cache, the deployment's prompt and risk target, bad rows."""
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


def _add_ray_options(cal: argparse.ArgumentParser) -> None:
    """Generation and judging on Ray actors."""
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


def _add_deployed_options(cal: argparse.ArgumentParser) -> None:
    """What each deployed model call is: an agent's run, its budget, its chunks."""
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
