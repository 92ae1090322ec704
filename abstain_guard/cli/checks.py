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


__all__ = [
    "all_at_once",
    "artifacts_exist",
    "cache_dir",
    "check_out",
    "guard_config",
    "not_agent_artifacts",
    "positive",
    "significance_level",
]
