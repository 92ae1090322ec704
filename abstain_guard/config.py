"""`GuardConfig`: what the guard promises and how it behaves (pydantic v2).

Load it from keyword arguments, a YAML / TOML / JSON file (:meth:`GuardConfig.from_file`),
environment variables ``ABSTAIN_GUARD_*`` (:meth:`GuardConfig.from_env`), or both
(:meth:`GuardConfig.load`: file first, environment on top). Unknown keys are errors.
See ``docs/configuration.md``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from abstain_guard.errors import ConfigError

try:  # Python 3.11+
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["ENV_PREFIX", "GuardConfig", "read_config_file"]

ENV_PREFIX = "ABSTAIN_GUARD_"


def read_config_file(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """Parse a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON (``.json``) file into a
    mapping (an empty file gives ``{}``).

    Raises:
        ConfigError: the file is missing, of another type, unparsable, or not a mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"Config file {str(p)!r} does not exist or is not a file.")
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise ConfigError(
            f"Unsupported config file type {suffix or '(none)'!r} for {str(p)!r}; use "
            ".yaml, .yml, .toml or .json."
        )
    try:
        text = p.read_text(encoding="utf-8")
        if suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"Could not parse config file {str(p)!r}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"Could not parse config file {str(p)!r}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"Config file {str(p)!r} must hold a mapping of keys to values, got "
            f"{type(data).__name__}."
        )
    return data


def _format_validation_error(exc: ValidationError, valid: list[str]) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ())) or "<config>"
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown key {loc!r} (valid keys: {', '.join(valid)})")
        else:
            parts.append(f"{loc}: {err.get('msg')} (got {err.get('input')!r})")
    return "Invalid guard configuration: " + "; ".join(parts) + "."


class GuardConfig(BaseModel):
    """The guard's target and behaviour.

    Attributes:
        mode: ``"participation"`` (the paper: answer a fraction 1−α of questions) or
            ``"risk"`` (answer as many as possible while the error rate among answered is
            ≤ ``risk_target`` with probability ≥ 1−``delta``).
        participation: 1−α, the target fraction of answered questions (participation mode).
        risk_target: ε, the largest acceptable error rate among answered questions
            (required in risk mode).
        delta: δ, the allowed probability that the risk certificate is wrong (risk mode).
        abstain_message: the text of the abstention message.
        on_error: ``"abstain"`` (fail closed: a response that cannot be scored is withheld
            and the reason recorded) or ``"raise"`` (raise GuardError).
        scorer: optional scorer kind the artifact must have (``"geometry"``,
            ``"perplexity"``, ...); a mismatch is an error instead of a silent surprise.
        on_mismatch: what to do when the deployed model, prompt, token budget or decoding
            differ from the artifact's calibration record (or cannot be verified):
            ``"raise"`` (default: ArtifactMismatchError) or ``"warn"`` (go on, and record
            the mismatch in ``guarantee["warnings"]`` and the trace — the guarantee then no
            longer holds as stated).
        on_infeasible: what to do when the calibration set cannot meet the target.
            Participation mode, when ⌈(1−α)(n+1)⌉ > n (too few scores for a finite
            threshold): ``"raise"`` (default: InsufficientDataError naming the smallest n
            that works), ``"answer_all"`` (τ = +∞, no upper bound on participation) or
            ``"abstain_all"`` (τ = −∞). Risk mode, when no threshold certifies
            ``risk_target`` at ``delta``: ``"raise"`` (default: UncertifiableTargetError
            naming the smallest certifiable risk target) or ``"abstain_all"`` (τ = −∞: the
            guard abstains on every question, which trivially keeps the risk).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["participation", "risk"] = "participation"
    participation: float = Field(default=0.8, gt=0.0, lt=1.0)
    risk_target: float | None = Field(default=None, gt=0.0, lt=1.0)
    delta: float = Field(default=0.1, gt=0.0, lt=1.0)
    abstain_message: str = "I don't know."
    on_error: Literal["abstain", "raise"] = "abstain"
    scorer: str | None = None
    on_mismatch: Literal["raise", "warn"] = "raise"
    on_infeasible: Literal["raise", "answer_all", "abstain_all"] = "raise"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(
                _format_validation_error(exc, sorted(type(self).model_fields))
            ) from exc

    @model_validator(mode="after")
    def _check_mode(self) -> GuardConfig:
        if self.mode == "risk" and self.risk_target is None:
            raise ValueError(
                "mode='risk' needs risk_target (the largest acceptable error rate among "
                "answered questions, e.g. 0.2)"
            )
        if self.mode == "risk" and self.on_infeasible == "answer_all":
            raise ValueError(
                "on_infeasible='answer_all' cannot keep a risk target (answering everything "
                "certifies nothing); use 'raise' or 'abstain_all' in risk mode"
            )
        return self

    # --- derived -------------------------------------------------------------------------

    @property
    def alpha(self) -> float:
        """α = 1 − participation."""
        return 1.0 - self.participation

    @property
    def target(self) -> float:
        """The number the mode targets: participation (1−α) or risk_target (ε)."""
        if self.mode == "risk":
            assert self.risk_target is not None
            return self.risk_target
        return self.participation

    # --- loading -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GuardConfig:
        """Build from a mapping; unknown keys raise ConfigError listing the valid ones."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"A guard configuration must be a mapping of keys to values, got "
                f"{type(data).__name__}."
            )
        return cls(**{str(k): v for k, v in data.items()})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> GuardConfig:
        """Load from a ``.yaml``/``.yml``, ``.toml`` or ``.json`` file (a flat mapping).

        A file whose only top-level key is ``guard`` (e.g. a ``[guard]`` TOML table) is
        read from that section.
        """
        data = read_config_file(path)
        if set(data) == {"guard"} and isinstance(data["guard"], Mapping):
            data = data["guard"]
        return cls.from_dict(data)

    @classmethod
    def env_values(
        cls,
        environ: Mapping[str, str] | None = None,
        prefix: str = ENV_PREFIX,
        ignore: tuple[str, ...] = (),
    ) -> dict[str, str]:
        """The ``{field: raw string}`` pairs given by ``PREFIX<FIELD>`` environment variables.

        Raises:
            ConfigError: for a ``PREFIX*`` variable that names no field (unless listed in
                ``ignore``, by its full name).
        """
        env = os.environ if environ is None else environ
        fields = sorted(cls.model_fields)
        values: dict[str, str] = {}
        for name, raw in env.items():
            if not name.startswith(prefix) or name in ignore:
                continue
            key = name[len(prefix) :].lower()
            if key not in cls.model_fields:
                valid = ", ".join(prefix + f.upper() for f in fields)
                raise ConfigError(
                    f"Unknown environment variable {name!r}; valid ones: {valid}. "
                    "Remove or rename it."
                )
            values[key] = raw
        return values

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        prefix: str = ENV_PREFIX,
        ignore: tuple[str, ...] = (),
    ) -> GuardConfig:
        """Build from environment variables ``ABSTAIN_GUARD_<FIELD>`` (e.g.
        ``ABSTAIN_GUARD_MODE=risk``, ``ABSTAIN_GUARD_RISK_TARGET=0.2``); fields not set keep
        their defaults. An empty value for ``RISK_TARGET`` or ``SCORER`` means "unset"."""
        return cls.from_dict(_normalise_env(cls.env_values(environ, prefix, ignore)))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        prefix: str = ENV_PREFIX,
        ignore: tuple[str, ...] = (),
    ) -> GuardConfig:
        """File (if given) first, then ``ABSTAIN_GUARD_*`` environment variables on top."""
        base = cls.from_file(path).model_dump(exclude_unset=True) if path is not None else {}
        base.update(_normalise_env(cls.env_values(environ, prefix, ignore)))
        return cls.from_dict(base)

    def with_overrides(self, **changes: Any) -> GuardConfig:
        """A copy with some fields changed (validated like a new config)."""
        data = self.model_dump(exclude_unset=True)
        data.update(changes)
        return type(self).from_dict(data)


def _normalise_env(values: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in values.items():
        if key in ("risk_target", "scorer") and raw.strip() == "":
            out[key] = None
        else:
            out[key] = raw
    return out
