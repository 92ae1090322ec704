"""Generating the answers calibration judges and scores, and replaying them as deployed.

:func:`generate_answers` produces a greedy answer per question (batched, cached per item in the
run store, with fixed chunk boundaries so a resumed run feeds the model exactly what an
uninterrupted one would); :func:`replay_as_deployed` replays the generated token ids one
sequence at a time to read the per-token signals the deployed guard computes live;
:func:`deployment_record` records the generation settings the deployed guard must use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from abstain_guard.calibration.build.config import CalibrationConfig
from abstain_guard.calibration.build.datasets import QAItem
from abstain_guard.calibration.build.store import RunStore, content_key
from abstain_guard.deployment import DeploymentRecord, PromptRecord
from abstain_guard.errors import CalibrationError
from abstain_guard.prompts import (
    RENDERING,
    build_messages,
    max_new_tokens_for,
    messages_to_json,
    system_prompt_for,
)

__all__ = [
    "HELD_OUT",
    "LIKELIHOOD_METADATA",
    "deployment_record",
    "generate_answers",
    "generated_pairs",
    "replay_as_deployed",
]

#: The response-metadata keys an answer's cache entry keeps (what the scorers read).
LIKELIHOOD_METADATA = (
    "prompt_token_ids",
    "token_ids",
    "tokens",
    "logprobs",
    "entropy",
    "generation",
)


def _gen_params(config: CalibrationConfig, item: QAItem) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens_for(item.kind, config.max_new_tokens)}


#: Splits whose answers are scored for the guarantee (calibration) or measured (test): they
#: are generated one question per call, exactly as the deployed guard generates, and scored
#: by replaying their generated token ids one sequence at a time (no padding), so their
#: scores equal what the guard computes live. Reference and train answers only fit the
#: scorer and are generated in batches.
HELD_OUT = ("calibration", "test")


def generate_answers(
    model: Any,
    items: Sequence[QAItem],
    store: RunStore,
    config: CalibrationConfig,
    *,
    fingerprint: str,
    progress: bool = True,
    on_chunk: Callable[[int], None] | None = None,
    batch_size: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Greedy answers for ``items``, batched, cached per item in ``store``.

    Chunk boundaries are fixed by the order of ``items`` (not by what is already cached), so
    a resumed run feeds the model exactly the batches an uninterrupted run would. Returns
    ``{item.id: {"text", "finish_reason", "metadata"}}`` where ``metadata`` holds the
    generation's token ids (what calibration replays: the exact tokens, EOS only when the
    model produced it), OpenAI-style logprobs, entropies and generation settings (geometry
    is not captured while generating). ``batch_size`` overrides ``config.batch_size``;
    ``1`` generates each question alone, as the deployed guard does (cached apart from
    batched answers).
    """
    size = config.batch_size if batch_size is None else batch_size
    keys = {
        it.id: content_key(
            "gen",
            fingerprint,
            messages_to_json(build_messages(it, config.system_prompt)),
            {**_gen_params(config, it), "alone": size == 1},
        )
        for it in items
    }
    done = store.get_many("generation", list(keys.values()))
    by_kind: dict[str, list[QAItem]] = {}
    for it in items:
        by_kind.setdefault(it.kind, []).append(it)
    bar = tqdm(total=len(items), desc="generating", disable=not progress, unit="q")
    bar.update(sum(1 for it in items if keys[it.id] in done))
    chunk_index = 0
    for kind_items in by_kind.values():
        for start in range(0, len(kind_items), size):
            chunk = kind_items[start : start + size]
            chunk_index += 1
            if all(keys[it.id] in done for it in chunk):
                continue
            runner = model.bind(**_gen_params(config, chunk[0]), capture_geometry=False)
            convs = [build_messages(it, config.system_prompt) for it in chunk]
            outputs = runner.batch(convs) if size > 1 else [runner.invoke(convs[0])]
            fresh = {
                keys[it.id]: {
                    "text": str(msg.content),
                    "finish_reason": msg.response_metadata.get("finish_reason"),
                    "metadata": {
                        k: msg.response_metadata[k]
                        for k in LIKELIHOOD_METADATA
                        if k in msg.response_metadata
                    },
                }
                for it, msg in zip(chunk, outputs, strict=True)
            }
            store.put_many("generation", fresh)
            done.update(fresh)
            bar.update(len(chunk))
            if on_chunk is not None:
                on_chunk(chunk_index)
    bar.close()
    return {it.id: done[keys[it.id]] for it in items}


def generated_pairs(
    items: Sequence[QAItem], answers: dict[str, dict[str, Any]], config: CalibrationConfig
) -> list[tuple[Any, list[int]]]:
    """``(messages, generated token ids)`` per item: what replay must score — the exact ids
    the model produced (EOS only when it produced one), never re-tokenized text."""
    out = []
    for it in items:
        ids = (answers[it.id].get("metadata") or {}).get("token_ids")
        if ids is None:
            raise CalibrationError(
                f"The cached answer to {it.id!r} has no generated token ids (a cache written "
                "by an older version). Delete the run cache directory and run again."
            )
        out.append((build_messages(it, config.system_prompt), [int(t) for t in ids]))
    return out


def replay_as_deployed(
    model: Any,
    items: Sequence[QAItem],
    answers: dict[str, dict[str, Any]],
    config: CalibrationConfig,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Response metadata of ``items``' answers as the deployed guard computes it live.

    One sequence per forward pass (padding changes the floating-point sums, and a guard
    scores one response at a time), replaying the generated token ids behind the same
    prompt token ids the model generated from.

    Raises:
        CalibrationError: the prompt encodes differently than when the answer was
            generated (the tokenizer or chat template changed).
    """
    results = model.replay_batch(
        generated_pairs(items, answers, config), batch_size=1, progress=progress
    )
    metas = [r.metadata for r in results]
    for it, meta in zip(items, metas, strict=True):
        cached = (answers[it.id].get("metadata") or {}).get("prompt_token_ids")
        if cached is not None and list(cached) != list(meta["prompt_token_ids"]):
            raise CalibrationError(
                f"The prompt of {it.id!r} encodes differently than when its answer was "
                "generated (the tokenizer or chat template changed). Delete the run cache "
                "and run again."
            )
    return metas


def deployment_record(
    model: Any, config: CalibrationConfig, items: Sequence[QAItem]
) -> DeploymentRecord:
    """What the deployed guard must run to be exchangeable with this calibration: the model
    fingerprint, chat template, decoding, and per question kind the system prompt, token
    budget and user-message rendering."""
    settings = getattr(model, "decoding_settings", None)
    fingerprint = getattr(model, "fingerprint", None)
    return DeploymentRecord(
        model_fingerprint=None if fingerprint is None else str(fingerprint),
        chat_template_sha256=getattr(model, "chat_template_sha256", None),
        decoding=settings() if callable(settings) else {},
        prompts={
            kind: PromptRecord(
                system_prompt=system_prompt_for(kind, config.system_prompt),
                max_new_tokens=max_new_tokens_for(kind, config.max_new_tokens),
                rendering=RENDERING[kind],
            )
            for kind in sorted({it.kind for it in items})
        },
    )
