"""Generating the answers calibration judges and scores, and replaying them as deployed.

:func:`generate_answers` produces a greedy answer per question (batched, cached per item in the
run store, with fixed chunk boundaries so a resumed run feeds the model exactly what an
uninterrupted one would); :func:`replay_as_deployed` replays the generated token ids one
sequence at a time to read the per-token signals the deployed guard computes live;
:func:`deployment_record` records the generation settings the deployed guard must use.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from abstain_guard.contract.chat_model_specs import ChatModelRecord, ChatModelSpec
from abstain_guard.contract.deployment import DeploymentRecord, PromptRecord, StreamingRecord
from abstain_guard.contract.kernels import bit_deciding
from abstain_guard.contract.metadata import HIDDEN
from abstain_guard.contract.prompts import (
    RENDERING,
    build_messages,
    max_new_tokens_for,
    messages_to_json,
    system_prompt_for,
)
from abstain_guard.errors import CalibrationError

from ..questions.datasets import QAItem
from ..run.calibration_config import CalibrationConfig
from ..run.store import RunStore, content_key
from .answer_rows import (
    LIKELIHOOD_METADATA,
    STATES_NS,
    AnswerRow,
    AnswerRows,
    Capture,
    GenerationOptions,
    keyed_rows,
    means_digest,
    plan_chunks,
)


def _gen_params(config: CalibrationConfig, item: QAItem) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens_for(item.kind, config.max_new_tokens)}


#: Chunks in flight at once per engine of a model that shares decode steps (one per engine
#: otherwise): the next chunk's questions wait in the model's scheduler and take the places
#: of the rows that finish, so decode steps stay full to the end of a chunk and prompt passes
#: interleave with them (every answer is bitwise its solo answer on that path, whatever the
#: engine, so the answers do not change). Chunks are still stored whole and in order, so a
#: resumed run loses at most the chunks in flight.
PIPELINED_CHUNKS = 2

#: Rows each engine decodes per step while calibrating (the deployed model's default is
#: 8): per-row decode cost falls with more rows, and a row's numbers do not depend on the
#: rows beside it.
CALIBRATION_ROWS_PER_STEP = 16


def chunks_in_flight(shared_steps: bool, rows_per_step: int, chunk: int, engines: int) -> int:
    """Chunks of ``chunk`` questions generated at once: :data:`PIPELINED_CHUNKS` per
    ``chunk`` rows of each engine's decode step when steps are shared (so every engine's
    steps stay full and its queue holds the next questions), else one per engine."""
    if not shared_steps:
        return max(1, engines)
    return PIPELINED_CHUNKS * -(-max(rows_per_step, chunk) // chunk) * max(1, engines)


def decode_path_of(model: Any) -> dict[str, Any] | None:
    """The decode path ``model`` generates on, as its decoding settings record it (None for
    models that record none, e.g. API chat models)."""
    settings = getattr(model, "decoding_settings", None)
    path = settings().get("decode_path") if callable(settings) else None
    return dict(path) if isinstance(path, dict) else None


def numerics_key(model: Any) -> dict[str, Any]:
    """The model's dtype (when it is not float32) and the kernel facts that decide the last
    bits (:func:`abstain_guard.contract.kernels.bit_deciding`) for the generation cache key: the
    fingerprint leaves both out, and answers generated in another dtype or on other kernels
    than the run's must not be reused (their scores differ)."""
    settings = getattr(model, "decoding_settings", None)
    record = settings() if callable(settings) else {}
    dtype = record.get("dtype")
    key: dict[str, Any] = {} if dtype in (None, "float32") else {"dtype": str(dtype)}
    kernels = bit_deciding(record.get("kernels"))
    return {**key, "kernels": kernels} if kernels else key


def _generation_keys(
    model: Any,
    items: Sequence[QAItem],
    config: CalibrationConfig,
    fingerprint: str,
    alone: bool,
) -> dict[str, str]:
    """Each item's generation cache key: the model's fingerprint, the messages, the budget,
    whether it was generated alone, the decode path and the numerics that decide its bits."""
    path = decode_path_of(model)
    mode: dict[str, Any] = {"decode_path": path} if path else {}
    mode.update(numerics_key(model))
    return {
        it.id: content_key(
            "gen",
            fingerprint,
            messages_to_json(build_messages(it, config.system_prompt)),
            {**_gen_params(config, it), "alone": alone, **mode},
        )
        for it in items
    }


def _generate_pipelined(
    model: Any,
    todo: list[tuple[int, list[QAItem]]],
    config: CalibrationConfig,
    options: GenerationOptions,
    size: int,
    store_chunk: Callable[[int, list[QAItem], list[ChunkAnswer]], None],
) -> None:
    """Generate the chunks ``todo`` here, :func:`chunks_in_flight` at a time, storing each
    (in order) as it finishes."""
    geometry = options.capture == "geometry"
    runner = model.with_reference(options.reference) if geometry else model
    digest = means_digest(options.reference) if geometry else None
    path = decode_path_of(model)
    engines = getattr(runner, "engine_workers", None)
    window = chunks_in_flight(
        path is not None and path.get("steps") == "shared",
        int(getattr(runner, "max_batch_size", size) or size),
        size,
        int(engines()) if callable(engines) else 1,
    )
    pool = ThreadPoolExecutor(max_workers=window, thread_name_prefix="chunk")
    running: deque[tuple[int, list[QAItem], Future[list[ChunkAnswer]]]] = deque()
    try:
        for index, chunk in todo:
            job = pool.submit(generate_chunk, runner, chunk, config, options.capture, digest)
            running.append((index, chunk, job))
            if len(running) >= window:
                first, items_, job = running.popleft()
                store_chunk(first, items_, job.result())
        while running:
            first, items_, job = running.popleft()
            store_chunk(first, items_, job.result())
    finally:  # on an error or a kill, the chunk already running finishes, unstored
        pool.shutdown(wait=True, cancel_futures=True)


def generate_answers(
    model: Any,
    items: Sequence[QAItem],
    store: RunStore,
    config: CalibrationConfig,
    *,
    fingerprint: str,
    options: GenerationOptions | None = None,
) -> AnswerRows:
    """Greedy answers for ``items``, batched, cached per item in ``store``:
    ``{item.id: {"text", "finish_reason", "metadata", "key"}}``, ``metadata`` holding the
    generated token ids (EOS only when the model produced it), OpenAI-style logprobs,
    entropies and generation settings, ``key`` the answer's cache key.

    Chunk boundaries are fixed by the order of ``items`` (not by what is already cached), so
    a resumed run feeds the model exactly the batches an uninterrupted run would.
    ``options.batch_size=1`` generates each question as its own call, as the deployed guard
    does (cached apart; on a ``batch_decode`` model ``config.batch_size`` calls at a time
    share decode steps, each bitwise its solo answer). Answers of different decode paths are
    cached apart (their last bits differ).

    ``options.capture`` (:data:`Capture`): ``"states"`` stores the geometry and per-token
    states as arrays (namespace :data:`STATES_NS`, before the answer's row); ``"geometry"``
    installs ``options.reference``, so ``metadata["geometry"]`` holds Ω, Θ and Φ and the row
    records the means' digest. An answer already cached is never generated again, whatever
    it captured. ``options.executor`` (:class:`~.executors.RayExecutor`) generates the chunks
    not yet cached and hands each back to be stored here, as a local run stores it.
    """
    options = options or GenerationOptions()
    if isinstance(config.model, ChatModelSpec):  # an API model: asked as deployed, no capture
        from .api_generation import generate_api_answers

        return generate_api_answers(
            model, items, store, config, fingerprint=fingerprint, options=options
        )
    size = config.batch_size if options.batch_size is None else options.batch_size
    alone = size == 1
    path = decode_path_of(model)
    if alone and path is not None and path.get("steps") == "shared":
        # the scheduler gives each call of a batch bitwise its solo answer: one model batch
        # per chunk
        size = config.batch_size
    keys = _generation_keys(model, items, config, fingerprint, alone)
    done = store.get_many("generation", list(keys.values()))
    bar = tqdm(total=len(items), desc="generating", disable=not options.progress, unit="q")
    bar.update(sum(1 for it in items if keys[it.id] in done))
    todo = [
        (index, chunk)
        for index, chunk in plan_chunks(items, size)
        if not all(keys[it.id] in done for it in chunk)
    ]

    def store_chunk(index: int, chunk: list[QAItem], outputs: list[ChunkAnswer]) -> None:
        fresh = {}
        for it, (row, arrays) in zip(chunk, outputs, strict=True):
            if arrays is not None:
                store.put_arrays(STATES_NS, keys[it.id], arrays)
            fresh[keys[it.id]] = row
        store.put_many("generation", fresh)
        done.update(fresh)
        bar.update(len(chunk))
        if options.on_chunk is not None:
            options.on_chunk(index)

    if options.executor is not None and todo:
        options.executor.generate(
            todo, capture=options.capture, reference=options.reference, on_done=store_chunk
        )
    elif todo:
        _generate_pipelined(model, todo, config, options, size, store_chunk)
    bar.close()
    return keyed_rows(items, done, keys)


#: One generated answer: its cache row, and with ``capture="states"`` its arrays (Ω, Θ
#: ``[N, 2L-1]``, ``post_attn``, ``post_mlp`` ``[N, L, D]``), else None.
ChunkAnswer = tuple[AnswerRow, "dict[str, np.ndarray] | None"]


def generate_chunk(
    runner: Any,
    chunk: Sequence[QAItem],
    config: CalibrationConfig,
    capture: Capture,
    digest: str | None,
) -> list[ChunkAnswer]:
    """Generate one chunk of questions (all of one kind) with ``runner`` (the model, with
    the reference means installed for ``capture="geometry"``; ``digest`` their
    :func:`means_digest`): one batched call, or ``invoke`` for a single question. Pure: it
    writes nothing, so a remote worker can run it and send the rows back
    (:mod:`.executors`)."""
    convs = [build_messages(it, config.system_prompt) for it in chunk]
    outputs = _generate_chunk(runner, convs, _gen_params(config, chunk[0]), capture)
    return [
        (
            _answer_row(msg, capture, digest),
            None if states is None else _state_arrays(msg, states),
        )
        for msg, states in outputs
    ]


def _generate_chunk(
    model: Any, convs: list[Any], params: dict[str, Any], capture: Capture
) -> list[tuple[Any, Any]]:
    """``(message, states or None)`` per conversation: one batched call, or ``invoke`` for a
    single question (as the deployed guard calls the model)."""
    if capture == "states":
        return list(model.generate_with_states(convs, **params))
    runner = model.bind(**params, capture_geometry=capture == "geometry")
    outputs = runner.batch(convs) if len(convs) > 1 else [runner.invoke(convs[0])]
    return [(msg, None) for msg in outputs]


def _answer_row(msg: Any, capture: Capture, digest: str | None) -> AnswerRow:
    """The cached row of one answer: text, finish reason, the likelihood metadata and, with
    ``capture="geometry"``, the geometry and the digest of the means its Φ used."""
    meta = msg.response_metadata
    row: AnswerRow = {
        "text": str(msg.content),
        "finish_reason": meta.get("finish_reason"),
        "metadata": {k: meta[k] for k in LIKELIHOOD_METADATA if k in meta},
    }
    if capture == "geometry" and meta.get("geometry") is not None:
        row["metadata"]["geometry"] = meta["geometry"]
        row["reference"] = digest
    elif capture == "states" and (meta.get("geometry") or {}).get(HIDDEN) is not None:
        # a reference answer keeps its geometry as arrays; the probe layers' summaries
        # (a few vectors) go into the row, where the probe scorers read them
        row["hidden"] = meta["geometry"][HIDDEN]
    return row


def _state_arrays(msg: Any, states: Any) -> dict[str, np.ndarray]:
    """What a reference answer keeps for fitting the means: Ω, Θ (float64, as in its
    metadata) and the per-token states ``[N, L, D]`` (as captured)."""
    geometry = msg.response_metadata["geometry"]
    return {
        "omega": np.asarray(geometry["omega"], dtype=np.float64),
        "theta": np.asarray(geometry["theta"], dtype=np.float64),
        "post_attn": np.asarray(states.post_attn),
        "post_mlp": np.asarray(states.post_mlp),
    }


def generated_pairs(
    items: Sequence[QAItem], answers: AnswerRows, config: CalibrationConfig
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
    answers: AnswerRows,
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
    model: Any,
    config: CalibrationConfig,
    items: Sequence[QAItem],
    streaming: StreamingRecord | None = None,
) -> DeploymentRecord:
    """What the deployed guard must run to be exchangeable with this calibration: the model
    fingerprint, chat template, decoding, and per question kind the system prompt, token
    budget and user-message rendering; whether any question carried earlier turns
    (``conversations``); for an API chat model its spec (no secrets), class and
    settings; calibrated for certified streaming, its ``streaming`` record."""
    settings = getattr(model, "decoding_settings", None)
    fingerprint = getattr(model, "fingerprint", None)
    api = None
    if isinstance(config.model, ChatModelSpec):
        api = ChatModelRecord.of(config.model, model)
        fingerprint = api.fingerprint
    return DeploymentRecord(
        chat_model=api,
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
        conversations=any(it.history for it in items),
        streaming=streaming,
    )
