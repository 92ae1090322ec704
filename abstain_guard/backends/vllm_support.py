"""What the guard's vLLM connector serves: the vLLM versions and the engine modes.

No vLLM import (the checks read a ``VllmConfig``-shaped object), so the unit tests drive them
without an engine. The connector (:mod:`.vllm_connector`) runs :func:`check_version` in
``register()`` and again when it is built, and :func:`check_modes` when it is built, in the
scheduler's process and in every worker: a server that asks for something the capture cannot
serve does not start, and its error names what to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packaging.version import InvalidVersion, Version

#: The vLLM releases whose model runner, scheduler and connector API the capture was read
#: against (lowest included, highest excluded).
SUPPORTED_VLLM = ("0.32.0", "0.33")


class UnsupportedServing(RuntimeError):
    """The server runs a vLLM version or an engine mode the capture cannot serve."""


def version_problem(version: str) -> str | None:
    """Why vLLM ``version`` is not served (None: it is)."""
    low, high = SUPPORTED_VLLM
    try:
        parsed = Version(str(version))
    except InvalidVersion:
        return f"vLLM reports the version {version!r}, which is not a version number"
    if Version(low) <= Version(parsed.base_version) < Version(high):
        return None
    return (
        f"vLLM {version} is outside the range the guard's capture supports "
        f"(>= {low}, < {high}); install a vLLM in that range (pip install 'vllm>={low},<{high}') "
        "or an abstain-guard release that supports this vLLM"
    )


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedServing` naming ``version`` and the supported range."""
    problem = version_problem(version)
    if problem is not None:
        raise UnsupportedServing(f"abstain_guard: {problem}.")


def _modes(config: Any) -> list[str]:
    """Each mode of ``config`` (a ``VllmConfig``) the capture cannot serve, by its flag."""
    parallel = config.parallel_config
    found = []
    if getattr(config, "speculative_config", None) is not None:
        found.append(
            "speculative decoding (--speculative-config): the capture reads one row per "
            "request per step"
        )
    if int(getattr(parallel, "pipeline_parallel_size", 1)) != 1:
        found.append(
            "pipeline parallelism (--pipeline-parallel-size): the probe layer lives on one "
            "stage; use tensor parallelism"
        )
    if int(getattr(parallel, "prefill_context_parallel_size", 1)) != 1:
        found.append(
            "prefill context parallelism (--prefill-context-parallel-size): a prompt's rows "
            "are split across ranks"
        )
    if getattr(parallel, "enable_dbo", False) or int(getattr(parallel, "ubatch_size", 0)) > 1:
        found.append(
            "micro-batching (--enable-dbo / --ubatch-size): each micro-batch would write its "
            "rows at offset 0 of the tap"
        )
    model = getattr(config, "model_config", None)
    if model is not None and getattr(model, "runner_type", "generate") != "generate":
        found.append(f"a {model.runner_type} model (--runner): the capture reads generation")
    return found


def check_modes(config: Any) -> None:
    """Raise :class:`UnsupportedServing` naming every mode of ``config`` (a ``VllmConfig``)
    the capture cannot serve. LoRA is served: the adapter of each response is recorded in its
    payload. Per request, ``n > 1`` and beam search are refused by the client (a response
    with more than one choice, or whose tokens are not the capture's, is refused)."""
    found = _modes(config)
    if found:
        raise UnsupportedServing(
            "abstain_guard: the guard's capture cannot serve "
            + "; ".join(found)
            + ". Start the server without it, or without the guard's connector."
        )


class _StopView:
    """The fields of a scheduler ``Request`` that vLLM's stop rule reads, on the worker."""

    pooling_params = None

    def __init__(self, params: Any, prompt_len: int, output: list[int]) -> None:
        self.sampling_params = params
        self.output_token_ids = output
        self.num_output_tokens = len(output)
        self.num_tokens = int(prompt_len) + len(output)
        self.max_tokens = params.max_tokens
        self.status: Any = None
        self.stop_reason: Any = None


def stop_view(params: Any, prompt_len: int, output: list[int]) -> _StopView:
    """A request as vLLM's ``check_stop(request, max_model_len)`` reads it: its sampling
    parameters, prompt length and output tokens so far (the worker calls vLLM's own rule
    on it, so every stop condition vLLM has — EOS, stop token ids, ``max_tokens``, the
    context length, ``min_tokens``, repetition detection — is the scheduler's)."""
    return _StopView(params, prompt_len, list(output))


def lora_record(lora_request: Any, digests: Mapping[str, str | None]) -> dict[str, Any] | None:
    """What a response records of the LoRA adapter that computed it (None: the base model):
    its name, id and the identity of its folder (``digests``: path -> identity, None where it
    could not be verified: the client refuses such a response)."""
    if lora_request is None:
        return None
    path = str(getattr(lora_request, "lora_path", "") or "")
    return {
        "name": str(getattr(lora_request, "lora_name", "")),
        "id": int(getattr(lora_request, "lora_int_id", 0)),
        "sha256": digests.get(path),
    }
