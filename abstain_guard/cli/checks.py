"""Checks the ``abstain-guard`` subcommands share: each raises its typed error, and
:func:`all_at_once` reports several at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.errors import (
    AbstainGuardError,
    ArtifactMismatchError,
    ArtifactNotFoundError,
    ConfigError,
    PreflightError,
)


def guard_config(path: str | None) -> GuardConfig:
    """The guard config: ``--config`` (if given), then ``ABSTAIN_GUARD_*`` variables on top."""
    return GuardConfig.load(path)


def check_out(out: str | Path) -> Path:
    """A report directory: absent or a directory, under a writable one (only it is written)."""
    from abstain_guard.calibration.building.preflight import check_writable_location

    path = Path(out)
    check_writable_location(path, "--out")
    return path


def cache_dir(given: str | None) -> Path | None:
    """Where evaluate/--live keep answers and verdicts: ``--cache-dir`` if given (checked),
    else None: ``<out>/cache``, over the calibration run's cache read-only unless
    ``--no-reuse-calibration-cache`` (nothing is ever written where an artifact points)."""
    if given:
        from abstain_guard.calibration.building.preflight import check_writable_location

        check_writable_location(Path(given), "--cache-dir")
        return Path(given)
    return None


def positive(value: int | None, option: str) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{option} must be a positive integer, got {value}.")


def significance_level(value: float | None, option: str) -> None:
    """``value`` (when given) is a significance level: strictly between 0 and 1."""
    if value is not None and not 0.0 < value < 1.0:
        raise ConfigError(
            f"{option} must be a significance level strictly between 0 and 1 such as 0.01, "
            f"got {value}."
        )


def all_at_once(*checks: Callable[[], Any]) -> None:
    """Run every check; raise its error, or a PreflightError listing several."""
    problems: list[AbstainGuardError] = []
    for check in checks:
        try:
            check()
        except AbstainGuardError as exc:
            problems.append(exc)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise PreflightError(problems)


def artifacts_exist(paths: Sequence[str | Path]) -> None:
    missing = [str(p) for p in paths if not (Path(p) / "manifest.json").is_file()]
    if missing:
        raise ArtifactNotFoundError(
            f"No artifact at {', '.join(missing)} (no manifest.json). Pass --artifact with a "
            "directory written by abstain-guard calibrate."
        )


def not_agent_artifacts(paths: Sequence[str | Path]) -> None:
    """``evaluate`` without ``--live`` answers the questions with the bare model; an artifact
    calibrated on an agent is measured by running the agent (``--live``)."""
    agents = []
    for p in paths:
        manifest = GuardArtifact.read_manifest(p)
        deployment = (manifest.get("metadata") or {}).get("deployment") or {}
        if deployment.get("agent"):
            agents.append(str(p))
    if agents:
        raise ConfigError(
            f"{', '.join(agents)} was calibrated on an agent (calibrate --agent): its scores "
            "are its runs', which evaluate without --live cannot make (it answers each "
            "question with the bare model). Run `abstain-guard evaluate --live` (the agent as "
            "deployed, guarded, on the held-out questions; per-step live vs stored and the "
            "run error among accepted runs), or experiments/agents/agent_steps.py for the lookup "
            "agent."
        )


def add_model_options(parser: Any, *, local: bool, what: str) -> None:
    """``--model`` (the one model-name grammar, :mod:`abstain_guard.contract.model_names`),
    ``--served-model`` and ``--api-key-env``; ``local``: ``--device`` too. ``what``: what
    ``--model`` does for this command."""
    parser.add_argument(
        "--model",
        help=f"{what}: 'default' (embedded SmolLM2), a local Hugging Face folder, a .gguf file, "
        "an OpenAI-compatible server's base URL (http://host:8000/v1) or a LangChain name "
        "(openai:gpt-4o-mini)",
    )
    parser.add_argument(
        "--served-model",
        help="with --model http(s)://...: the model the server serves (default: its only one)",
    )
    parser.add_argument(
        "--api-key-env",
        help="the environment variable holding the API key (recorded by name, never the key)",
    )
    if local:
        parser.add_argument("--device", help="a local model's device: cpu (default), cuda, cuda:1")


def given_model(args: Any) -> Any:
    """The :class:`~abstain_guard.contract.model_names.ModelName` of ``--model``, checked
    (:func:`~abstain_guard.contract.model_names.check_model_name`); None without one."""
    from abstain_guard.contract.model_names import check_model_name, parse_model_name

    if getattr(args, "model", None) is None:
        return None
    name = parse_model_name(
        args.model,
        gguf_file=getattr(args, "gguf_file", None),
        served_model=getattr(args, "served_model", None),
        api_key_env=getattr(args, "api_key_env", None),
    )
    return check_model_name(name)


def artifact_model(artifact: str | Path, args: Any) -> None:
    """``--model`` (when given) names the model ``artifact`` was calibrated on; without it the
    artifact's own is used.

    Raises:
        ArtifactMismatchError: it names another model (both named).
    """
    from abstain_guard.contract.model_names import model_name_mismatch, recorded_model_name

    given = given_model(args)
    if given is None:
        return
    metadata = GuardArtifact.read_manifest(artifact).get("metadata") or {}
    problem = model_name_mismatch(recorded_model_name(metadata.get("config") or {}), given)
    if problem is not None:
        raise ArtifactMismatchError(f"{artifact}: {problem}.")
