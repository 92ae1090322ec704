"""`GuardConfig`: what the guard promises and how it behaves (pydantic v2).

Load it from keyword arguments, a YAML / TOML / JSON file (:meth:`GuardConfig.from_file`),
environment variables ``ABSTAIN_GUARD_*`` (:meth:`GuardConfig.from_env`), or both
(:meth:`GuardConfig.load`: file first, environment on top). Unknown keys are errors.
See ``docs/configuration.md``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from abstain_guard.errors import ConfigError

try:  # Python 3.11+
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ENV_PREFIX = "ABSTAIN_GUARD_"

#: ``ABSTAIN_GUARD_*`` variables that set up the process (the local engines, kernels, GGUF
#: cache, the vLLM interpreter), not the guard's config: ``from_env`` leaves them alone.
PROCESS_ENV = (
    "ABSTAIN_GUARD_ENGINE_WORKERS",
    "ABSTAIN_GUARD_NATIVE_KERNELS",
    "ABSTAIN_GUARD_FOREIGN_KERNELS",
    "ABSTAIN_GUARD_MODEL_CACHE",
    "ABSTAIN_GUARD_VLLM_PYTHON",
)


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
    except (OSError, ValueError, yaml.YAMLError) as exc:  # decode errors are ValueErrors
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


class _ChangesRule:
    """The mark of a :class:`GuardConfig` field that changes the decision rule (τ, its
    certificate or the per-group rules): :meth:`GuardConfig.rule_key` is made of them."""

    def __repr__(self) -> str:
        return "RULE"


#: ``Annotated[<type>, RULE]`` marks a field the rule depends on.
RULE = _ChangesRule()


def _hashable(value: Any) -> Hashable:
    """A field's value as a hashable one (a mapping: its sorted items)."""
    if isinstance(value, Mapping):
        return tuple(sorted(value.items()))
    return value  # type: ignore[no-any-return]


class GuardConfig(BaseModel):
    """The guard's target and behaviour: participation (the paper) or risk mode, their
    targets, and what the guard does on errors, mismatches, infeasible targets, groups and
    stopped agent runs. Each field: docs/configuration.md ("Fields"); the guarantees:
    docs/guarantees.md.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Annotated[Literal["participation", "risk"], RULE] = "participation"
    participation: Annotated[float, RULE] = Field(default=0.8, gt=0.0, lt=1.0)
    risk_target: Annotated[float | None, RULE] = Field(default=None, gt=0.0, lt=1.0)
    delta: Annotated[float, RULE] = Field(default=0.1, gt=0.0, lt=1.0)
    action_risk_target: Annotated[float | None, RULE] = Field(default=None, gt=0.0, lt=1.0)
    partial_release_target: Annotated[float | None, RULE] = Field(default=None, gt=0.0, lt=1.0)
    abstain_message: str = "I don't know."
    on_error: Literal["abstain", "raise"] = "abstain"
    scorer: str | None = None
    on_mismatch: Literal["raise", "warn"] = "raise"
    on_infeasible: Annotated[Literal["raise", "answer_all", "abstain_all"], RULE] = "raise"
    group_by: str | Callable[[Any], Any] | None = None
    group_targets: Annotated[dict[str, float] | None, RULE] = None
    group_delta: Annotated[Literal["per_group", "union"], RULE] = "per_group"
    group_fallback: Annotated[Literal["raise", "pooled", "abstain"], RULE] = "raise"
    unknown_group: Annotated[Literal["abstain", "pooled"], RULE] = "abstain"
    on_abstain: Literal["end", "interrupt", "fallback"] = "end"

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
        if self.action_risk_target is not None and self.mode != "risk":
            raise ValueError(
                "action_risk_target needs mode='risk' with a risk_target (the run-level error "
                "among accepted runs is certified beside the action risk)"
            )
        if self.action_risk_target is not None and self.group_by is not None:
            raise ValueError(
                "action_risk_target is certified for the pooled rule only; drop group_by"
            )
        if self.partial_release_target is not None and (
            self.mode != "risk" or self.action_risk_target is not None or self.group_by
        ):
            raise ValueError(
                "partial_release_target needs mode='risk' with a risk_target, without "
                "action_risk_target or group_by (it is certified beside the pooled error rate "
                "of completed streams)"
            )
        if isinstance(self.group_by, str) and not self.group_by.strip():
            raise ValueError("group_by must name a key of the input (or be a function or None)")
        for group, value in (self.group_targets or {}).items():
            if not 0.0 < float(value) < 1.0:
                raise ValueError(
                    f"group_targets[{group!r}] = {value!r} must lie strictly between 0 and 1 "
                    "(a participation 1-alpha, or a risk target epsilon in risk mode)"
                )
        if self.group_targets and self.group_by is None:
            raise ValueError("group_targets needs group_by (where each question's group is)")
        return self

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

    @classmethod
    def rule_fields(cls) -> tuple[str, ...]:
        """The fields marked :data:`RULE`, in declaration order."""
        return tuple(n for n, f in cls.model_fields.items() if RULE in f.metadata)

    def rule_key(self) -> tuple[tuple[str, Hashable], ...]:
        """What the rule depends on, hashable: ``(field, value)`` for every field marked
        :data:`RULE`. Every cache of rules keys on it, so two configs share a rule exactly
        when they agree on these fields."""
        return tuple((name, _hashable(getattr(self, name))) for name in self.rule_fields())

    def group_target(self, group: str) -> float:
        """The target of ``group``: its ``group_targets`` entry, else :attr:`target`."""
        return float((self.group_targets or {}).get(group, self.target))

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
        cls, environ: Mapping[str, str] | None = None, ignore: tuple[str, ...] = ()
    ) -> dict[str, str]:
        """The ``{field: raw string}`` pairs given by ``ABSTAIN_GUARD_<FIELD>`` variables.

        Raises:
            ConfigError: for an ``ABSTAIN_GUARD_*`` variable that names no field (unless
                listed in ``ignore``, by its full name, or one of :data:`PROCESS_ENV`).
        """
        prefix = ENV_PREFIX
        env = os.environ if environ is None else environ
        fields = sorted(cls.model_fields)
        values: dict[str, str] = {}
        for name, raw in env.items():
            if not name.startswith(prefix) or name in ignore or name in PROCESS_ENV:
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
        cls, environ: Mapping[str, str] | None = None, ignore: tuple[str, ...] = ()
    ) -> GuardConfig:
        """Build from ``ABSTAIN_GUARD_<FIELD>`` variables (``ABSTAIN_GUARD_MODE=risk``); fields
        not set keep their defaults, an empty value of an optional one means "unset"."""
        return cls.from_dict(_normalise_env(cls.env_values(environ, ignore)))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        ignore: tuple[str, ...] = (),
    ) -> GuardConfig:
        """File (if given) first, then ``ABSTAIN_GUARD_*`` environment variables on top."""
        base = cls.from_file(path).model_dump(exclude_unset=True) if path is not None else {}
        base.update(_normalise_env(cls.env_values(environ, ignore)))
        return cls.from_dict(base)

    def with_overrides(self, **changes: Any) -> GuardConfig:
        """A copy with some fields changed (validated like a new config)."""
        data = self.model_dump(exclude_unset=True)
        data.update(changes)
        return type(self).from_dict(data)


def _normalise_env(values: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in values.items():
        if key in ("risk_target", "action_risk_target", "scorer", "group_by") and not raw.strip():
            out[key] = None
        elif key == "group_targets":
            out[key] = _json_mapping(raw, key)
        else:
            out[key] = raw
    return out


def _json_mapping(raw: str, key: str) -> Any:
    """An environment variable holding a JSON object (``{"capital": 0.9}``); empty: None."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{ENV_PREFIX}{key.upper()} must be a JSON object such as "
            f"'{{\"capital\": 0.9}}', got {raw!r}: {exc}"
        ) from exc
