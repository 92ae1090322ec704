"""Generation with capture: one left-padded ``hf_model.generate`` call with a
:class:`~abstain_guard.adapters.capture.CaptureSession` attached, cut at EOS, turned into
``AIMessage`` objects with the metadata of :mod:`.response_metadata`.

The functions here take the :class:`~abstain_guard.adapters.loading.LoadedModel` and the
call's options (a dict with the keys of :data:`GENERATION_OPTIONS` plus ``stop``, built by
:func:`call_options`); :class:`~abstain_guard.adapters.chat_model.GeometryChatModel` wires
them to LangChain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from langchain_core.messages import AIMessage
from langchain_core.messages.ai import UsageMetadata

from abstain_guard.deployment import sha256_text
from abstain_guard.errors import ContextLengthError, InvalidInputError

from .attention import capture_mode
from .capture import CaptureSession, StepFeatures
from .encoding import left_padded
from .loading import LoadedModel, eos_token_ids, pad_token_id
from .response_metadata import geometry_json, token_metadata
from .types import ReferenceMeans

#: Options a call may override (``invoke(..., temperature=0.7)``); ``stop`` comes apart.
GENERATION_OPTIONS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "capture_geometry",
        "top_logprobs",
    }
)


def validate_options(
    *,
    max_new_tokens: Any,
    temperature: Any,
    top_p: Any,
    top_k: Any,
    top_logprobs: Any,
) -> None:
    """Raise InvalidInputError naming the first generation option out of range."""
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool):
        raise InvalidInputError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens <= 0:
        raise InvalidInputError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        raise InvalidInputError(f"temperature must be a finite number, got {temperature!r}")
    if temperature < 0:
        raise InvalidInputError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise InvalidInputError(f"top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise InvalidInputError(f"top_k must be None or a non-negative integer, got {top_k!r}")
    if not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise InvalidInputError(
            f"top_logprobs must be a non-negative integer, got {top_logprobs!r}"
        )


def call_options(
    defaults: Mapping[str, Any],
    default_stop: list[str] | None,
    stop: list[str] | None,
    overrides: Mapping[str, Any],
) -> dict[str, Any]:
    """The options of one call: ``overrides`` over ``defaults`` (the model's fields), checked,
    plus ``stop`` (the call's, else ``default_stop``)."""
    unknown = set(overrides) - GENERATION_OPTIONS
    if unknown:
        raise InvalidInputError(
            f"unknown generation options {sorted(unknown)}; allowed: {sorted(GENERATION_OPTIONS)}"
        )
    opts: dict[str, Any] = {k: overrides.get(k, defaults[k]) for k in GENERATION_OPTIONS}
    validate_options(**{k: opts[k] for k in opts if k not in ("seed", "capture_geometry")})
    stops = list(stop if stop is not None else (default_stop or []))
    if any(not isinstance(s, str) or not s for s in stops):
        raise InvalidInputError("stop sequences must be non-empty strings")
    opts["stop"] = stops
    return opts


def new_token_budget(prompts: Sequence[Sequence[int]], max_new: int, context_length: int) -> int:
    """``max_new`` capped so the longest prompt plus its answer fits the context window
    (``context_length`` 0: unknown, no cap). Raises ContextLengthError for a prompt that
    fills the window already."""
    for p in prompts:
        if context_length and len(p) >= context_length:
            raise ContextLengthError(
                f"the prompt has {len(p)} tokens; the model's context window is "
                f"{context_length}. Shorten the prompt."
            )
    if context_length:
        max_new = min(max_new, context_length - max(len(p) for p in prompts))
    return max_new


@dataclass
class Generated:
    """One generated answer, cut after its first EOS.

    ``logits [N, V]`` (float32, CPU) predicted ``token_ids [N]``; ``geometry`` holds
    ``[N, 2L-1]`` arrays (None when capture was off).
    """

    token_ids: list[int]
    logits: torch.Tensor
    finish_reason: str
    geometry: StepFeatures | None


def generate_tokens(
    loaded: LoadedModel,
    prompts: list[list[int]],
    max_new: int,
    opts: Mapping[str, Any],
    reference: ReferenceMeans | None,
) -> list[Generated]:
    """Generate for all ``prompts`` in one left-padded ``generate`` call (greedy when
    ``opts["temperature"]`` is 0, else seeded sampling), capturing geometry when
    ``opts["capture_geometry"]``. Holds ``loaded.lock`` while the model runs."""
    hf = loaded.hf_model
    tokenizer = loaded.tokenizer
    device = next(hf.parameters()).device
    b = len(prompts)
    s0 = max(len(p) for p in prompts)
    pad = pad_token_id(hf, tokenizer)
    ids, mask = left_padded(prompts, pad)
    eos = eos_token_ids(hf, tokenizer)
    gen_kw = _generate_kwargs(opts, max_new, pad, eos, tokenizer)
    capture = bool(opts["capture_geometry"])
    with loaded.lock:
        session = (
            CaptureSession(loaded.spec, batch_size=b, max_len=s0 + max_new, reference=reference)
            if capture
            else None
        )
        seed = opts["seed"]
        rng = torch.random.fork_rng(devices=[]) if seed is not None else nullcontext()
        with rng, torch.inference_mode(), capture_mode(hf, session):
            if seed is not None:
                torch.manual_seed(int(seed))
            out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **gen_kw)
    new = out.sequences[:, s0:].cpu()
    logits = torch.stack(list(out.logits), dim=1).float().cpu()  # [B, n, V]
    steps = session.steps if session is not None else []
    results = []
    for i in range(b):
        row = [int(t) for t in new[i]]
        n, finish = _cut_at_eos(row, eos)
        results.append(
            Generated(
                token_ids=row[:n],
                logits=logits[i, :n],
                finish_reason=finish,
                geometry=stack_steps(steps, i, n) if steps else None,
            )
        )
    return results


def _generate_kwargs(
    opts: Mapping[str, Any], max_new: int, pad: int, eos: list[int], tokenizer: Any
) -> dict[str, Any]:
    """Keyword arguments of ``hf_model.generate`` for the call's options."""
    temperature = float(opts["temperature"])
    gen_kw: dict[str, Any] = {
        "max_new_tokens": max_new,
        "do_sample": temperature > 0,
        "return_dict_in_generate": True,
        "output_logits": True,
        "pad_token_id": pad,
        "eos_token_id": eos or None,
    }
    if temperature > 0:
        gen_kw.update(
            temperature=temperature, top_p=float(opts["top_p"]), top_k=int(opts["top_k"] or 0)
        )
    else:
        gen_kw.update(temperature=None, top_p=None, top_k=None)
    if opts["stop"]:
        gen_kw.update(stop_strings=list(opts["stop"]), tokenizer=tokenizer)
    return gen_kw


def _cut_at_eos(row: list[int], eos: list[int]) -> tuple[int, str]:
    """Length of ``row`` up to and including its first EOS, and the finish reason."""
    for k, t in enumerate(row):
        if t in eos:
            return k + 1, "stop"
    return len(row), "length"


def stack_steps(steps: list[StepFeatures], i: int, n: int) -> StepFeatures:
    """Features of batch item ``i`` for its first ``n`` generation steps (one row each):
    ``[n, 2L-1]`` arrays from ``n`` blocks of ``[B, 1, 2L-1]``."""
    use = steps[:n]

    def cat(attr: str) -> np.ndarray | None:
        vals = [getattr(s, attr) for s in use]
        if not vals or vals[0] is None:
            return None
        return np.concatenate([v[i] for v in vals], axis=0)

    omega = cat("omega")
    theta = cat("theta")
    assert omega is not None and theta is not None
    return StepFeatures(omega, theta, cat("phi_in"), cat("phi_out"), None, None)


def to_message(
    tokenizer: Any,
    model_name: str,
    num_layers: int,
    prompt: list[int],
    gen: Generated,
    opts: Mapping[str, Any],
) -> AIMessage:
    """The ``AIMessage`` of one answer: text (cut at the first stop string), metadata and
    usage. The metadata keeps every generated token, also those after a stop string."""
    ids = gen.token_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    finish = gen.finish_reason
    for s in opts["stop"]:
        pos = text.find(s)
        if pos >= 0:
            text = text[:pos]
            finish = "stop"
    meta = token_metadata(
        tokenizer, model_name, prompt, ids, gen.logits, finish, int(opts["top_logprobs"])
    )
    geo = gen.geometry
    meta["geometry"] = geometry_json(num_layers, geo) if geo is not None else None
    usage = UsageMetadata(
        input_tokens=len(prompt), output_tokens=len(ids), total_tokens=len(prompt) + len(ids)
    )
    return AIMessage(content=text, response_metadata=meta, usage_metadata=usage)


def generation_record(
    dicts: list[dict[str, str]], opts: Mapping[str, Any], chat_template_sha256: str | None
) -> dict[str, Any]:
    """The settings of one call (``metadata["generation"]``), for the guard's
    exchangeability check (:func:`abstain_guard.deployment.generation_mismatches`)."""
    system = "\n".join(d["content"] for d in dicts if d["role"] == "system") or None
    return {
        "max_new_tokens": int(opts["max_new_tokens"]),
        "temperature": float(opts["temperature"]),
        "top_p": float(opts["top_p"]),
        "top_k": opts["top_k"],
        "stop": list(opts["stop"]),
        "system_prompt_sha256": sha256_text(system),
        "chat_template_sha256": chat_template_sha256,
    }


__all__ = [
    "GENERATION_OPTIONS",
    "Generated",
    "call_options",
    "generate_tokens",
    "generation_record",
    "new_token_budget",
    "stack_steps",
    "to_message",
    "validate_options",
]
