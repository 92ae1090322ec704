"""The calibrated guard chain as deployed: :func:`load_guard_chain` builds ``prompt | guard``
from an artifact's deployment record (the system prompt, token budget and decoding
calibration used); :func:`load_chat_model` loads the chat model an artifact names.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.contract.chat_model_specs import ChatModelSpec, bind_budget
from abstain_guard.contract.deployment import DeploymentRecord, backend_mismatches
from abstain_guard.contract.prompts import MAX_NEW_TOKENS, question_prompt
from abstain_guard.errors import ArtifactMismatchError, CalibrationError
from abstain_guard.guard.runnable import AbstentionGuard


def load_chat_model(
    model: str | ChatModelSpec = "default",
    *,
    gguf_file: str | None = None,
    max_new_tokens: int | None = None,
    batch_decode: bool = True,
    prefix_cache: bool = True,
    device: str = "cpu",
    dtype: str = "float32",
) -> Any:
    """The chat model ``model`` names: ``"default"`` (the embedded SmolLM2), a local Hugging
    Face folder (with ``gguf_file`` inside it), or a :class:`ChatModelSpec` (an API model,
    asking for logprobs). The budget (default: open questions'), decode mode, prefix path and
    the local model's ``device`` and ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``)
    must be calibration's: they change the scores."""
    if isinstance(model, ChatModelSpec):
        return model.build()
    # The adapters import torch and transformers; core must import without them.
    import torch

    from abstain_guard.adapters import GeometryChatModel, load_default_model

    options: dict[str, Any] = {
        "max_new_tokens": max_new_tokens or MAX_NEW_TOKENS["open"],
        "batch_decode": batch_decode,
        "prefix_cache": prefix_cache,
        "device": device,
        "dtype": getattr(torch, dtype),
    }
    if model == "default":
        return load_default_model(**options)
    return GeometryChatModel.from_pretrained(model, gguf_file=gguf_file, **options)


def calibrated_on_prefix(decoding: Any) -> bool:
    """Whether the calibration's decoding record (``DeploymentRecord.decoding``) is on the
    prefix path (``decode_path["prefix"]``)."""
    path = decoding.get("decode_path") if isinstance(decoding, dict) else None
    return bool(isinstance(path, dict) and path.get("prefix"))


def load_guard_chain(
    artifact_path: str | Path | Any,
    guard_config: Any = None,
    *,
    model: Any = None,
    kind: str | None = None,
) -> tuple[Any, Any, Any]:
    """``(chain, guard, artifact)`` for an artifact (a directory or a loaded one): ``chain``
    is ``prompt | guard``, taking ``{"question": ...}`` and running the recorded system
    prompt, budget and decoding of question kind ``kind`` (default: the only one; a
    ``"choice"`` question lists its lettered options). Without ``model`` the calibrated model
    is loaded, an API model built from its recorded spec (its key from the environment),
    asking its server only for what the artifact's scorer reads (:func:`asking_for`)."""
    artifact = (
        artifact_path
        if isinstance(artifact_path, GuardArtifact)
        else GuardArtifact.load(artifact_path)
    )
    record = DeploymentRecord.from_metadata(artifact.metadata)
    if record is None:
        raise CalibrationError(
            f"The artifact {artifact_path} has no deployment record, so the prompt and token "
            "budget it was calibrated with are unknown. Re-run calibrate to rebuild it."
        )
    kind_name, prompt = record.kind(kind)
    if model is None:
        model = asking_for(calibrated_chat_model(artifact), type(artifact.scorer).reads)
    config = guard_config or GuardConfig()
    _check_engine(record, model, config)
    if record.chat_model is None:
        runnable = model.bind(max_new_tokens=prompt.max_new_tokens)
    else:
        runnable = bind_budget(model, prompt.max_new_tokens)
    guard = AbstentionGuard(runnable, artifact=artifact, config=config)
    return question_prompt(prompt.system_prompt, kind_name) | guard, guard, artifact


def asking_for(model: Any, reads: frozenset[str] | None) -> Any:
    """``model``, asking its server only for the response fields ``reads`` names when it
    can (a chat model with a ``reads`` option left at None, such as
    :class:`~abstain_guard.backends.vllm_chat.VLLMChatModel`); ``reads`` None: unchanged."""
    fields = getattr(type(model), "model_fields", {})
    if reads is None or "reads" not in fields or model.reads is not None:
        return model
    return model.model_copy(update={"reads": frozenset(reads)})


def calibrated_chat_model(artifact: GuardArtifact, device: str | None = None) -> Any:
    """The chat model ``artifact`` was calibrated on, as calibrated: an API model built from
    its recorded spec (its key from the environment), a local one loaded with the recorded
    budget, decode path and dtype, on ``device`` (None: the recorded one)."""
    record = DeploymentRecord.from_metadata(artifact.metadata)
    if record is not None and record.chat_model is not None:
        return record.chat_model.spec.build()
    decoding = record.decoding if record is not None else {}
    settings = artifact.metadata.get("config", {})
    return load_chat_model(
        settings.get("model", "default"),
        gguf_file=settings.get("gguf_file"),
        max_new_tokens=settings.get("max_new_tokens"),
        batch_decode=bool(decoding.get("batch_decode", False)),
        prefix_cache=calibrated_on_prefix(decoding),
        device=device or settings.get("device", "cpu"),
        dtype=settings.get("dtype", "float32"),
    )


def _check_engine(record: DeploymentRecord, model: Any, config: GuardConfig) -> None:
    """A guard calibrated on vLLM checks the server it will answer from before any answer
    (its engine record: vLLM version, served weights' sha256, dtype, layers, ...), not only
    each response: a server with other weights is refused here, or warned about with
    ``on_mismatch="warn"`` (each response is still checked, and fails closed)."""
    engine_record = getattr(model, "engine_record", None)
    if record.decoding.get("backend") != "vllm" or not callable(engine_record):
        return
    problems = backend_mismatches(record, {"backend": engine_record()})
    if not problems:
        return
    if config.on_mismatch == "raise":
        raise ArtifactMismatchError("; ".join(problems))
    warnings.warn("; ".join(problems), stacklevel=3)
