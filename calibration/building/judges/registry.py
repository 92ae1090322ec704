"""Correctness judges by name: :func:`make_judge` builds any judge from a name or a config
dict, and :data:`JUDGE_NAMES` lists the names (the judges, from cheap to expensive:
docs/configuration.md, 'Judges').
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from langchain_core.language_models import BaseChatModel

from abstain_guard.contract.chat_model_specs import ChatModelSpec
from abstain_guard.errors import ConfigError, JudgeError

from .base import Judge
from .lexical import ChoiceJudge, LexicalJudge, NumericJudge
from .llm import LLMJudge
from .paper import PaperPipelineJudge, StatementRewriter
from .similarity import SimilarityJudge

_PARAMS: dict[str, tuple[str, ...]] = {
    "lexical": ("mode", "f1_threshold"),
    "numeric": ("rel_tol", "abs_tol"),
    "choice": (),
    "similarity": ("model_path", "threshold", "cross_encoder_path", "batch_size", "device"),
    "llm": (
        "model",
        "base_url",
        "api_key_env",
        "prompt",
        "retries",
        "structured",
        "backoff_initial",
        "backoff_max",
    ),
    "paper": ("similarity", "judges", "rewriter", "max_gold_statements"),
}
"""Each judge name and the parameters its spec dict may give."""
JUDGE_NAMES: tuple[str, ...] = tuple(_PARAMS)


def make_judge(
    spec: str | Mapping[str, Any] | Judge,
    *,
    chat_models: Mapping[str, BaseChatModel] | None = None,
) -> Judge:
    """Build a judge from a name or a config dict ``{"name": ..., <its parameters in
    _PARAMS>}`` (the specs: docs/configuration.md, 'Judges'); nothing is loaded here, and a
    :class:`Judge` instance is returned as it is.

    Raises:
        JudgeError: unknown name (the message lists the valid ones), unknown parameter, or a
            chat model that is not among ``chat_models``.
    """
    if isinstance(spec, Judge):
        return spec
    name, params = _name_and_params(spec)
    models = dict(chat_models or {})
    try:
        if name == "lexical":
            return LexicalJudge(**params)
        if name == "numeric":
            return NumericJudge(**params)
        if name == "choice":
            return ChoiceJudge()
        if name == "similarity":
            return SimilarityJudge(**params)
        if name == "llm":
            return _llm_judge(params, models)
        return _paper_judge(params, models)
    except TypeError as exc:
        raise JudgeError(f"bad parameters for judge {name!r}: {exc}") from exc


def _name_and_params(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The judge's name (lower case) and its parameters, checked against :data:`_PARAMS`."""
    if isinstance(spec, str):
        name, params = spec, {}
    elif isinstance(spec, Mapping):
        params = dict(spec)
        name = params.pop("name", params.pop("type", None))
        if not isinstance(name, str):
            raise JudgeError(
                f"a judge spec dict needs a 'name' (one of {', '.join(JUDGE_NAMES)}); got {spec}"
            )
    else:
        raise JudgeError(f"a judge spec is a name or a dict, got {type(spec).__name__}")
    name = name.strip().lower()
    if name not in _PARAMS:
        raise JudgeError(f"unknown judge {name!r}; valid judges: {', '.join(JUDGE_NAMES)}")
    unknown = sorted(set(params) - set(_PARAMS[name]))
    if unknown:
        allowed = ", ".join(_PARAMS[name]) or "none"
        raise JudgeError(f"judge {name!r} has no parameter(s) {unknown}; allowed: {allowed}")
    return name, params


def _llm_judge(params: dict[str, Any], models: Mapping[str, BaseChatModel]) -> LLMJudge:
    """An :class:`LLMJudge` around a chat model given from Python or named by config."""
    key = params.pop("model", None)
    base_url = params.pop("base_url", None)
    key_env = params.pop("api_key_env", None)
    if base_url is not None or isinstance(key, Mapping) or _is_spec_name(key, models):
        return LLMJudge(_judge_model(key, base_url, key_env), **params)
    return LLMJudge(_chat_model(key, models, "llm judge"), **params)


def _paper_judge(
    params: Mapping[str, Any], models: Mapping[str, BaseChatModel]
) -> PaperPipelineJudge:
    """The paper's pipeline: a similarity judge, two stage-2 LLM judges, a rewriter or None."""
    similarity = make_judge(params.get("similarity", "similarity"), chat_models=models)
    judge_specs = params.get("judges")
    if judge_specs is None:
        if len(models) != 2:
            raise JudgeError(
                "the paper judge needs two stage-2 LLM judges: give 'judges': [<model key>, "
                f"<model key>] or exactly two chat models (got {sorted(models) or 'none'})"
            )
        judge_specs = sorted(models)
    if isinstance(judge_specs, (str, Mapping)):
        judge_specs = [judge_specs]
    stage2 = [
        make_judge({"name": "llm", "model": s} if isinstance(s, str) else s, chat_models=models)
        for s in judge_specs
    ]
    rewriter_key = params.get("rewriter")
    rewriter = (
        None
        if rewriter_key is None
        else StatementRewriter(_chat_model(rewriter_key, models, "statement rewriter"))
    )
    return PaperPipelineJudge(
        similarity,
        stage2,
        rewriter,
        max_gold_statements=int(params.get("max_gold_statements", 3)),
    )


def _is_spec_name(key: Any, models: Mapping[str, Any]) -> bool:
    """``"provider:model"`` that is not the key of a chat model given from Python."""
    return isinstance(key, str) and key not in models and ":" in key


def _judge_model(key: Any, base_url: Any, key_env: Any) -> BaseChatModel:
    """The LLM judge's chat model from configuration alone (see :func:`make_judge`); built
    now (a client: nothing is called).

    Raises:
        JudgeError: no model named, or a spec that cannot be built.
    """
    if base_url is not None:
        if not isinstance(key, str) or not key:
            raise JudgeError(
                "an LLM judge at base_url needs 'model': the model name the server serves "
                "(GET <base_url>/models lists them)"
            )
        env = str(key_env or "OPENAI_API_KEY")
        kwargs: dict[str, Any] = {
            "base_url": str(base_url),
            "model": key,
            "api_key": os.environ.get(env) or "EMPTY",
            "temperature": 0.0,
        }
        spec = ChatModelSpec(class_path="langchain_openai:ChatOpenAI", kwargs=kwargs)
    elif isinstance(key, Mapping):
        try:
            spec = ChatModelSpec(**dict(key))
        except (TypeError, ValueError) as exc:
            raise JudgeError(f"the LLM judge's model spec {dict(key)} is not valid: {exc}") from exc
    else:
        spec = ChatModelSpec(chat_model=str(key))
    try:
        return spec.build()  # type: ignore[no-any-return]
    except ConfigError as exc:
        raise JudgeError(f"the LLM judge's model cannot be built: {exc}") from exc


def _chat_model(key: Any, models: Mapping[str, Any], what: str) -> Any:
    if not isinstance(key, str) or key not in models:
        available = ", ".join(sorted(models)) or "none were given (chat_models=)"
        raise JudgeError(
            f"the {what} needs 'model': the key of a chat model; got {key!r}, available: "
            f"{available}"
        )
    return models[key]
