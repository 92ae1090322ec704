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

__all__ = ["ENV_PREFIX", "PROCESS_ENV", "RULE", "GuardConfig", "read_config_file"]

ENV_PREFIX = "ABSTAIN_GUARD_"

#: ``ABSTAIN_GUARD_*`` variables that set up the process, not the guard's config (the local
#: model's engines, CPU kernels and converted GGUF copies,
#: :mod:`abstain_guard.adapters.engine.threads`,
#: :mod:`abstain_guard.adapters.engine.kernel_env` and
#: :mod:`abstain_guard.adapters.model.gguf_cache`; the vLLM environment's interpreter,
#: :mod:`abstain_guard.backends.vllm_chat`): ``from_env`` leaves them alone.
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
    """The guard's target and behaviour.

    Attributes:
        mode: ``"participation"`` (the paper: answer a fraction 1−α of questions) or
            ``"risk"`` (answer as many as possible while the error rate among answered is
            ≤ ``risk_target`` with probability ≥ 1−``delta``).
        participation: 1−α, the target fraction of answered questions (participation mode).
        risk_target: ε, the largest acceptable error rate among answered questions
            (required in risk mode).
        delta: δ, the allowed probability that the risk certificate is wrong (risk mode).
        action_risk_target: ε_a, for a step-gated agent artifact (risk mode): also certify
            that the probability of a run executing a wrong tool call (stopped runs
            included) is <= ε_a; τ is then the largest threshold passing both tests, each at
            δ/2, so both hold together with probability >= 1−δ
            (:mod:`abstain_guard.guarantee.action_risk`, docs/guarantees.md). Needs an artifact from
            ``calibrate --agent`` on rows with expected tool calls.
        partial_release_target: ρ, for an artifact calibrated with a chunk rule (certified
            streaming, risk mode): also certify that the probability of a stream showing
            text and then being stopped is <= ρ; τ is the largest threshold passing both,
            each at δ/2 (:mod:`abstain_guard.guarantee.partial_release`, docs/guarantees.md).
            Without it the decision still reports the certified partial-release rate at τ.
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
        group_by: per-group guarantees (``docs/guarantees.md``, "Per-group guarantees"):
            ``None`` (default: one pooled rule), the name of the input's group key (read
            from a mapping input, else from the run's ``metadata``; ``serve`` reads the
            request's ``metadata``), or a function of the input returning the group name.
            The artifact must record each calibration answer's group.
        group_targets: a per-group target overriding ``participation`` (participation mode)
            or ``risk_target`` (risk mode) for the groups it names.
        group_delta: how δ is shared in risk mode: ``"per_group"`` (each group's certificate
            holds with probability ≥ 1−δ) or ``"union"`` (δ/G per group: all G groups'
            certificates hold together with probability ≥ 1−δ).
        group_fallback: a calibration group too small for its target (participation: a
            finite threshold needs more answers; risk: no threshold certifies its ε):
            ``"raise"`` (default: InsufficientDataError naming the groups), ``"pooled"``
            (the pooled rule, with a warning in every decision: no per-group guarantee) or
            ``"abstain"`` (abstain on every question of the group).
        unknown_group: a question whose group is missing or was not in calibration:
            ``"abstain"`` (default, fail closed) or ``"pooled"`` (the pooled rule, with a
            warning in the decision).
        on_abstain: where an agent run goes when the guard stops it
            (:class:`~abstain_guard.guard.middleware.AbstentionMiddleware` only): ``"end"``
            (default: the run ends with the abstention message), ``"interrupt"`` (a human
            reviews the pending tool calls or answer with the score and τ — approve, edit or
            reject — through LangGraph's ``interrupt``; needs a checkpointer) or
            ``"fallback"`` (the middleware's ``fallback`` model or agent does the rest of the
            run). Runs continued by a human or a fallback are outside the certificate.
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
                ``ignore``, by its full name, or one of :data:`PROCESS_ENV`).
        """
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
