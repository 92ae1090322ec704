"""Generation with capture: one request per prompt to the model's scheduler
(:mod:`.scheduler`), the rows' capture steps stacked per answer and turned into ``AIMessage``
objects with the metadata of :mod:`.response_metadata`. A :class:`GenerationCall` holds the
loaded model and the call's options (:func:`call_options`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from langchain_core.messages import AIMessage
from langchain_core.messages.ai import UsageMetadata

from abstain_guard.contract.deployment import sha256_text
from abstain_guard.errors import ContextLengthError, InvalidInputError

from ..capture.features import StepFeatures
from ..capture.types import ReferenceMeans, TokenStates
from ..model.loading import LoadedModel
from ..tools.calls import NO_TOOLS_RECORD, ToolSetup
from .batching import GenerationRequest, RowResult, RowSnapshot
from .response_metadata import geometry_json, token_metadata
from .scheduler import scheduler_for

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


#: Called with each token id as the scheduler chooses it (in its worker thread).
TokenCallback = Callable[[int], None]
SnapshotCallback = Callable[[RowSnapshot], None]


@dataclass
class Generated:
    """One generated answer, cut after its first EOS.

    ``logits [N, V]`` (float32, CPU) predicted ``token_ids [N]``; ``geometry`` holds
    ``[N, 2L-1]`` arrays (None when capture was off); ``states`` the per-token states
    ``[N, L, D]`` (only with ``keep_states``).
    """

    token_ids: list[int]
    logits: torch.Tensor
    finish_reason: str
    geometry: StepFeatures | None
    states: TokenStates | None = None
    #: the decode path the engine took (:meth:`.threads.DecodePath.record`)
    decode_path: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_row(cls, result: RowResult, keep_states: bool = False) -> Generated:
        """The answer of one scheduler row."""
        n = len(result.token_ids)
        steps = result.steps
        return cls(
            token_ids=result.token_ids,
            logits=result.logits,
            finish_reason=result.finish_reason,
            geometry=stack_steps(steps, n) if steps else None,
            states=stack_states(steps, n) if steps and keep_states else None,
            decode_path=dict(result.decode_path),
        )


def _one_each(values: Sequence[Any] | None, n: int, what: str) -> list[Any]:
    """``values`` as a list of one per prompt (None: ``n`` Nones)."""
    if values is None:
        return [None] * n
    if len(values) != n:
        raise InvalidInputError(f"{len(values)} {what} for {n} prompts; give one per prompt")
    return list(values)


@dataclass(frozen=True)
class GenerationCall:
    """One call's generation on ``loaded``: its ``opts`` (:func:`call_options`, plus the
    model's ``capture``, ``parts`` and the tools' ``end_markers``), the ``reference`` means
    for Φ, the scheduler's ``limits`` (``max_batch``, ``max_queue``, ``batch_decode`` of
    :func:`.scheduler.scheduler_for`) and ``keep_states`` (the per-token states, which
    calibration fits reference means on).

    Each prompt is one request to the model's scheduler, batched with whatever else is
    running; every answer is bitwise the one the prompt gets alone (see :mod:`.batching`).
    Greedy when ``opts["temperature"]`` is 0, else seeded sampling.
    """

    loaded: LoadedModel
    opts: Mapping[str, Any]
    reference: ReferenceMeans | None = None
    limits: Mapping[str, Any] = field(default_factory=dict)
    keep_states: bool = False

    def requests(
        self,
        prompts: Sequence[Sequence[int]],
        max_new: int,
        prefixes: Sequence[int | None] | None = None,
        on_tokens: Sequence[TokenCallback | None] | None = None,
        on_snapshots: Sequence[SnapshotCallback | None] | None = None,
    ) -> list[GenerationRequest]:
        """One request per prompt, each with its own token budget (``max_new`` capped by the
        context window for that prompt). ``prefixes[i]``: where prompt ``i`` splits on the
        prefix path (:mod:`.prefix`; None: the prompt in one pass). ``on_tokens[i]`` is
        called in the scheduler's thread with each token id of prompt ``i`` as it is chosen
        (streaming), ``on_snapshots[i]`` with a :class:`.batching.RowSnapshot` of row ``i``
        after each token (certified streaming)."""
        n, opts = len(prompts), self.opts
        per_prompt = zip(
            prompts,
            _one_each(prefixes, n, "prefix splits"),
            _one_each(on_tokens, n, "token callbacks"),
            _one_each(on_snapshots, n, "snapshot callbacks"),
            strict=True,
        )
        return [
            GenerationRequest(
                prompt=list(p),
                max_new=new_token_budget([p], max_new, self.loaded.spec.context_length),
                temperature=float(opts["temperature"]),
                top_p=float(opts["top_p"]),
                top_k=opts["top_k"],
                seed=opts["seed"],
                stop=[*cut_markers(opts), *opts.get("end_markers", ())],
                capture=bool(opts["capture_geometry"]) or self.keep_states,
                capture_mode=str(opts.get("capture", "full")),
                reference=self.reference,
                keep_states=self.keep_states,
                on_token=on_token,
                on_snapshot=on_snapshot,
                prefix=split,
                parts=opts.get("parts"),
            )
            for p, split, on_token, on_snapshot in per_prompt
        ]

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Future[RowResult]]:
        """Queue ``requests`` (:meth:`requests`) on the model's scheduler (:mod:`.scheduler`);
        raises SchedulerFullError when its queue cannot take them."""
        return scheduler_for(self.loaded, **dict(self.limits)).submit(requests)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generated]:
        """Generate ``requests`` and wait for the answers."""
        return [Generated.of_row(f.result(), self.keep_states) for f in self.submit(requests)]

    async def agenerate(self, requests: Sequence[GenerationRequest]) -> list[Generated]:
        """:meth:`generate` for asyncio callers (awaits the scheduler's futures)."""
        futures = self.submit(requests)
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        return [Generated.of_row(r, self.keep_states) for r in results]


def stack_steps(steps: list[StepFeatures], n: int) -> StepFeatures:
    """Features of a batch-1 row's first ``n`` generation steps (one row each): ``[n, 2L-1]``
    arrays from ``n`` blocks of ``[1, 1, 2L-1]``."""
    use = steps[:n]

    def cat(name: str) -> np.ndarray | None:
        vals = [getattr(s, name) for s in use]
        return None if vals[0] is None else np.concatenate([v[0] for v in vals], axis=0)

    return StepFeatures.of_rows(cat, use[0].capture)


def stack_states(steps: list[StepFeatures], n: int) -> TokenStates | None:
    """States ``[n, L, D]`` of a batch-1 row's first ``n`` steps (None when the session kept
    none)."""
    use = steps[:n]
    if not use or use[0].post_attn is None or use[0].post_mlp is None:
        return None
    return TokenStates(
        post_attn=np.concatenate([s.post_attn[0] for s in use], axis=0),  # type: ignore[index]
        post_mlp=np.concatenate([s.post_mlp[0] for s in use], axis=0),  # type: ignore[index]
    )


def cut_markers(opts: Mapping[str, Any]) -> list[str]:
    """Where an answer is cut (and its generation stops): the call's stop strings, then the
    turn markers of a model without a chat template (:attr:`.encoding.PlainTemplate.turn_markers`;
    the generation record states ``stop`` alone, the template's hash covers the markers)."""
    return [*opts["stop"], *opts.get("turn_markers", ())]


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
    for s in cut_markers(opts):
        pos = text.find(s)
        if pos >= 0:
            text = text[:pos]
            finish = "stop"
    if any(m in text for m in opts.get("end_markers", ())):
        finish = "stop"  # a complete call in the prompted format: kept, not cut
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
    dicts: list[dict[str, Any]],
    opts: Mapping[str, Any],
    chat_template_sha256: str | None,
    batch_decode: bool = False,
    tools: ToolSetup | None = None,
    decode_path: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings of one call (``metadata["generation"]``), for the guard's
    exchangeability check (:func:`abstain_guard.contract.deployment.generation_mismatches`);
    ``batch_decode``: the decode mode asked for; ``decode_path``: the path the engine took
    (:meth:`.threads.DecodePath.record`; it changes the last bits).

    ``dicts`` are the conversation without the prompted tool block, so
    ``system_prompt_sha256`` hashes the user's system prompt only. The tool keys
    (``tools_sha256``, ``tool_choice``, ``tool_call_format``, ``tool_prompt_sha256``, see
    :meth:`..tools.calls.ToolSetup.record`) are None without ``tools``. ``history_messages``: the
    non-system messages before the last user message (earlier turns, tool-call turns
    included; 0 for a single question)."""
    system = "\n".join(d["content"] for d in dicts if d["role"] == "system") or None
    users = [i for i, d in enumerate(dicts) if d["role"] == "user"]
    earlier = sum(1 for d in dicts[: users[-1] if users else 0] if d["role"] != "system")
    return {
        "max_new_tokens": int(opts["max_new_tokens"]),
        "temperature": float(opts["temperature"]),
        "top_p": float(opts["top_p"]),
        "top_k": opts["top_k"],
        "stop": list(opts["stop"]),
        "batch_decode": bool(batch_decode),
        "decode_path": dict(decode_path) if decode_path is not None else None,
        "system_prompt_sha256": sha256_text(system),
        "chat_template_sha256": chat_template_sha256,
        "history_messages": earlier,
        **(tools.record() if tools is not None else NO_TOOLS_RECORD),
    }
