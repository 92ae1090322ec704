"""API chat models as calibration targets: the spec that names one, its identity and how it
is called as calibrated.

A :class:`ChatModelSpec` names any LangChain chat model (an ``init_chat_model`` name or a
``"module:Class"`` path, with kwargs) and never stores secrets (:func:`is_secret`): keys come
from the environment. A built model's identity (:func:`chat_model_identity`: its class and
every non-default setting, without secrets and transport options) hashes to the fingerprint
calibration caches under and the guard compares with. It is called with the calibrated
budget bound (:func:`bind_budget`). Imports neither LangChain's providers nor torch.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator

from abstain_guard.errors import ConfigError

API_FINGERPRINT_PREFIX = "chat_model:"
"""Fingerprints of API chat models start with this (local models' are weight hashes)."""

_SECRET = re.compile(
    r"(^|_)(api_?key|key|keys|token|secret|password|passwd|credentials?|auth\w*|headers?)$",
    re.IGNORECASE,
)

#: Settings that change how a call travels, not what the model answers (left out of the
#: identity): timeouts, retries, clients, callbacks, tracing tags, rate limits, proxies.
TRANSPORT = frozenset(
    {
        "name",
        "cache",
        "verbose",
        "callbacks",
        "callback_manager",
        "tags",
        "metadata",
        "custom_get_token_ids",
        "rate_limiter",
        "disable_streaming",
        "profile",
        "client",
        "async_client",
        "root_client",
        "root_async_client",
        "timeout",
        "request_timeout",
        "max_retries",
        "stream_chunk_timeout",
        "http_client",
        "http_async_client",
        "http_socket_options",
        "default_query",
        "include_response_headers",
        # the vLLM backend's process options (abstain_guard.backends.vllm_chat): where the
        # server runs and what it reserves, not what it answers (its engine record says)
        "engine_url",
        "api_key",
        "served_model",
        "vllm_args",
        "python",
        "memory_fraction",
        "startup_timeout",
    }
)


def is_secret(name: str) -> bool:
    """Whether a kwarg or field named ``name`` may hold a secret (``api_key``,
    ``openai_api_key``, ``access_token``, ``default_headers``, ...); never stored."""
    return bool(_SECRET.search(name))


def _transport(name: str) -> bool:
    return name in TRANSPORT or "proxy" in name


def public_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the ones that may hold secrets (what is written anywhere)."""
    return {k: v for k, v in kwargs.items() if not is_secret(str(k))}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


class ChatModelSpec(BaseModel):
    """A LangChain chat model named by configuration (``model:`` of a calibration config):
    exactly one of ``chat_model`` and ``class_path``, plus constructor ``kwargs`` (secret ones
    build the model but are never serialized)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chat_model: str | None = Field(
        None, description='an init_chat_model name, e.g. "openai:gpt-4o-mini"'
    )
    class_path: str | None = Field(
        None, description='a "module:Class" path, e.g. "langchain_openai:ChatOpenAI"'
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="constructor kwargs")

    @model_validator(mode="after")
    def _one_name(self) -> ChatModelSpec:
        if (self.chat_model is None) == (self.class_path is None):
            raise ValueError(
                "name the chat model with exactly one of chat_model (an init_chat_model "
                "name, e.g. 'openai:gpt-4o-mini') and class_path (e.g. "
                "'langchain_openai:ChatOpenAI')"
            )
        if self.class_path is not None and not re.fullmatch(
            r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.class_path
        ):
            raise ValueError(
                f"class_path {self.class_path!r} is not 'module:Class' "
                "(e.g. 'langchain_openai:ChatOpenAI')"
            )
        bad = sorted(k for k, v in public_kwargs(self.kwargs).items() if not _jsonable(v))
        if bad:
            raise ValueError(f"kwargs {bad} are not plain JSON values (numbers, text, lists)")
        return self

    @field_serializer("kwargs")
    def _without_secrets(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return public_kwargs(kwargs)

    @property
    def label(self) -> str:
        return str(self.chat_model or self.class_path)

    def resolve_class(self) -> Any:
        """The class ``class_path`` names (None for an ``init_chat_model`` name).

        Raises:
            ConfigError: the module cannot be imported or the name is not a chat model class.
        """
        if self.class_path is None:
            return None
        module_name, _, attr = self.class_path.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"model.class_path {self.class_path!r} cannot be imported ({exc}); install "
                "the package that provides it (e.g. pip install langchain-openai) or fix the "
                "path."
            ) from exc
        from langchain_core.language_models import BaseChatModel

        if not (isinstance(cls, type) and issubclass(cls, BaseChatModel)):
            raise ConfigError(
                f"model.class_path {self.class_path!r} is not a LangChain chat model class "
                "(a BaseChatModel subclass)."
            )
        return cls

    def _construct(self, kwargs: dict[str, Any]) -> Any:
        cls = self.resolve_class()
        if cls is not None:
            return cls(**kwargs)
        try:
            from langchain.chat_models import init_chat_model
        except ImportError as exc:
            raise ConfigError(
                f"model.chat_model {self.chat_model!r} needs langchain's init_chat_model "
                "(pip install langchain); or name the class with class_path."
            ) from exc
        return init_chat_model(self.chat_model, **kwargs)

    def _with_key(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with ``api_key_env`` (the name of an environment variable, what is
        stored) replaced by the key it holds, read now; an OpenAI-compatible server named by
        ``base_url`` alone gets the placeholder key servers without keys accept.

        Raises:
            ConfigError: the variable ``api_key_env`` names is not set.
        """
        env = kwargs.pop("api_key_env", None)
        if env is not None:
            key = os.environ.get(str(env))
            if not key:
                raise ConfigError(
                    f"The chat model {self.label} reads its API key from the environment "
                    f"variable {env} (api_key_env), which is not set."
                )
            kwargs["api_key"] = key
        elif (
            self.class_path == "langchain_openai:ChatOpenAI"
            and "base_url" in kwargs
            and "api_key" not in kwargs
            and not os.environ.get("OPENAI_API_KEY")
        ):
            kwargs["api_key"] = "EMPTY"
        return kwargs

    def build(self) -> Any:
        """The chat model, asking for logprobs: when its class has a ``logprobs`` option and
        the kwargs leave it unset, it is built with ``logprobs=True``.

        Raises:
            ConfigError: the class cannot be imported or refuses the kwargs (missing API
                key, unknown option, ...).
        """
        kwargs = self._with_key(dict(self.kwargs))
        try:
            model = self._construct(kwargs)
            asks = "logprobs" not in kwargs and "logprobs" in type(model).model_fields
            if asks and not getattr(model, "logprobs", None):
                model = self._construct({**kwargs, "logprobs": True})
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"The chat model {self.label} could not be built from kwargs "
                f"{sorted(kwargs)} ({type(exc).__name__}: {exc}). Fix model.kwargs (API keys "
                "belong in the environment, e.g. OPENAI_API_KEY)."
            ) from exc
        return model


class ChatModelRecord(BaseModel):
    """The API chat model an artifact was calibrated on (deployment record ``chat_model``):
    its spec without secrets, class and identity settings (:func:`chat_model_identity`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: ChatModelSpec
    class_path: str
    settings: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, spec: ChatModelSpec, model: Any) -> ChatModelRecord:
        identity = chat_model_identity(model)
        return cls(spec=spec, class_path=identity["class"], settings=identity["settings"])

    @property
    def fingerprint(self) -> str:
        return _fingerprint(self.class_path, self.settings)


def class_path(model: Any) -> str:
    cls = type(model)
    return f"{cls.__module__}:{cls.__qualname__}"


def _default(field: Any) -> Any:
    """A field's static default, or a marker when it has none (required / factory)."""
    from pydantic_core import PydanticUndefined

    return _NO_DEFAULT if field.default is PydanticUndefined else field.default


_NO_DEFAULT = object()


def _setting(value: Any) -> Any:
    """A field value as it enters the identity (pydantic values dumped), or _NO_DEFAULT
    when it cannot (objects, secrets)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if type(value).__name__ in ("SecretStr", "SecretBytes"):
        return _NO_DEFAULT
    if isinstance(value, float) and not math.isfinite(value):
        return _NO_DEFAULT
    return value if _jsonable(value) else _NO_DEFAULT


def chat_model_identity(model: Any) -> dict[str, Any]:
    """``{"class": "module:Class", "settings": {...}}``: every field of ``model`` that is not
    a secret or a transport option, holds a plain JSON value and differs from the class's
    static default (fields with computed defaults are kept when set to something)."""
    fields = getattr(type(model), "model_fields", {})
    settings: dict[str, Any] = {}
    for name, field in fields.items():
        alias = field.alias or name
        if is_secret(name) or is_secret(alias) or _transport(name) or _transport(alias):
            continue
        value = _setting(getattr(model, name, None))
        if value is _NO_DEFAULT:
            continue
        default = _default(field)
        if default is _NO_DEFAULT:
            if value in (None, {}, []):
                continue
        elif _setting(default) == value:
            continue
        settings[name] = value
    return {"class": class_path(model), "settings": settings}


def _fingerprint(path: str, settings: Mapping[str, Any]) -> str:
    digest = hashlib.sha256(_canonical({"class": path, "settings": dict(settings)}).encode())
    return API_FINGERPRINT_PREFIX + digest.hexdigest()


def chat_model_fingerprint(model: Any) -> str:
    """``"chat_model:<sha256>"`` of :func:`chat_model_identity` (calibration's cache key and
    the artifact's model fingerprint for an API model)."""
    identity = chat_model_identity(model)
    return _fingerprint(identity["class"], identity["settings"])


def identity_mismatches(record: ChatModelRecord, model: Any) -> list[str]:
    """Why ``model`` is not the API chat model ``record`` was calibrated on (empty: it is):
    another class, or settings that differ (each named, calibrated vs deployed)."""
    identity = chat_model_identity(model)
    if identity["class"] != record.class_path:
        return [
            f"chat model {identity['class']} is not the calibrated {record.class_path} "
            f"({record.spec.label})"
        ]
    live, calibrated = identity["settings"], record.settings
    diffs = [
        f"{k}={live.get(k)!r} (calibrated: {calibrated.get(k)!r})"
        for k in sorted(set(live) | set(calibrated))
        if _canonical(live.get(k)) != _canonical(calibrated.get(k))
    ]
    if not diffs:
        return []
    return [
        f"chat model {record.spec.label} is set up otherwise than at calibration: "
        + ", ".join(diffs)
    ]


def bind_budget(model: Any, max_tokens: int) -> Any:
    """``model`` called as calibration called it: ``max_tokens`` bound (the budget)."""
    return model.bind(max_tokens=int(max_tokens))
