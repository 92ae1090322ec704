"""Replay: teacher-forced features of existing answers, one forward pass per batch.

Each (prompt, response) pair is left-padded into one batch with explicit position ids (so
RoPE / absolute positions match generation); a :class:`~abstain_guard.adapters.capture.
CaptureSession` without a value cache computes the features of the N rows that predict the
response tokens. Replaying the exact generated ids of an answer reproduces its generation
metadata (tests/test_adapters_exactness.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from abstain_guard.errors import ContextLengthError, InvalidInputError

from ..capture.attention import capture_mode
from ..capture.parts_rule import PartsRule
from ..capture.session import CaptureSession, StepFeatures, default_parts
from ..capture.types import ReferenceMeans, ReplayResult, TokenStates
from ..model.loading import LoadedModel, eos_token_ids, pad_token_id
from .encoding import left_padded
from .prefix import start_from_prefix
from .response_metadata import geometry_json, token_metadata
from .threads import DECODE_THREADS, blas_threads, engine_workers


@dataclass
class ReplayItem:
    """One pair to replay: prompt ids, response ids and where the response came from
    (``"text"``: tokenized text, ``"token_ids"``: exact ids; ``metadata["replay_source"]``)."""

    prompt: list[int]
    response: list[int]
    source: str
    #: where the prompt splits on the prefix path (:mod:`.prefix`); 0: one pass, batched
    prefix: int = 0
    #: numbers of response tokens after which the response's metadata is also wanted
    #: (``ReplayResult.cuts``), each in 1..len(response)
    cuts: tuple[int, ...] = ()


def replay_item(
    loaded: LoadedModel,
    prompt: list[int],
    response: list[int],
    from_text: bool,
    add_eos: bool,
    prefix: int | None = None,
) -> ReplayItem:
    """A :class:`ReplayItem`; a text response gets the first EOS id appended when
    ``add_eos`` (a finished answer); ``prefix``: the prompt's split on the prefix path.
    Raises ContextLengthError when it does not fit."""
    eos = eos_token_ids(loaded.hf_model, loaded.tokenizer)
    ctx = loaded.spec.context_length
    if from_text and add_eos and eos:
        response = [*response, eos[0]]
    if ctx and len(prompt) + len(response) > ctx:
        raise ContextLengthError(
            f"prompt ({len(prompt)}) + response ({len(response)}) tokens exceed the "
            f"context window of {ctx}"
        )
    return ReplayItem(prompt, response, "text" if from_text else "token_ids", prefix or 0)


def replay_items(
    loaded: LoadedModel,
    items: Sequence[ReplayItem],
    *,
    model_name: str,
    reference: ReferenceMeans | None,
    capture_geometry: bool,
    top_logprobs: int,
    batch_size: int = 16,
    return_states: bool = False,
    progress: bool = False,
    capture: str = "full",
    parts: PartsRule | None = None,
) -> list[ReplayResult]:
    """Replay ``items``, ``batch_size`` left-padded sequences per forward pass (a tqdm bar
    over the batches with ``progress``), geometry in ``capture`` mode ("full" or "fast").

    The batches run side by side in one thread per engine of the model
    (:func:`~.threads.engine_workers`: one per CPU), each forward on one BLAS thread and
    holding ``loaded.lock`` shared, so a batch's numbers are the ones it gets alone; in the
    calling thread, one after the other, when that thread holds the lock alone."""
    if batch_size <= 0:
        raise InvalidInputError(f"batch_size must be positive, got {batch_size}")
    spans = _chunk_spans(items, batch_size)

    def run(span: tuple[int, int]) -> list[ReplayResult]:
        return _replay_chunk(
            loaded,
            items[span[0] : span[1]],
            model_name=model_name,
            reference=reference,
            capture_geometry=capture_geometry,
            top_logprobs=top_logprobs,
            return_states=return_states,
            capture=capture,
            parts=parts,
        )

    bar = tqdm(total=len(spans), desc="replay", unit="batch", disable=not progress)
    workers = 1 if loaded.lock._is_owned() else min(engine_workers(loaded.hf_model), len(spans))
    results: list[ReplayResult] = []
    try:
        if workers <= 1:
            for span in spans:
                results.extend(run(span))
                bar.update()
            return results
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="replay") as pool:
            for part in pool.map(run, spans):
                results.extend(part)
                bar.update()
        return results
    finally:
        bar.close()


def _chunk_spans(items: Sequence[ReplayItem], batch_size: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each forward's items: up to ``batch_size`` one-pass items together,
    every item split on the prefix path alone (its pass runs on the prefix's cache)."""
    spans: list[tuple[int, int]] = []
    for i, it in enumerate(items):
        start, end = spans[-1] if spans else (i, i)
        if spans and it.prefix == 0 and items[start].prefix == 0 and end - start < batch_size:
            spans[-1] = (start, i + 1)
        else:
            spans.append((i, i + 1))
    return spans


def _forward_split(
    loaded: LoadedModel, item: ReplayItem, session: CaptureSession | None, n: int
) -> torch.Tensor:
    """The prefix path's replay of one item: the prompt after its split and the response in
    one pass on the prefix's cache (:func:`.prefix.start_from_prefix`); the logits of the
    last ``n + 1`` positions, ``[1, n + 1, V]``."""
    hf = loaded.hf_model
    device = next(hf.parameters()).device
    with torch.inference_mode(), blas_threads(DECODE_THREADS):
        cache, rest = start_from_prefix(loaded, item.prompt, item.prefix, session)
        seq = rest + item.response
        if session is not None:
            session.set_rows(slice(len(seq) - 1 - n, len(seq) - 1))
        with capture_mode(hf, session):
            out = hf(
                input_ids=torch.tensor([seq], dtype=torch.long, device=device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=n + 1,
            )
    return out.logits  # type: ignore[no-any-return]


def _replay_chunk(
    loaded: LoadedModel,
    items: Sequence[ReplayItem],
    *,
    model_name: str,
    reference: ReferenceMeans | None,
    capture_geometry: bool,
    top_logprobs: int,
    return_states: bool,
    capture: str = "full",
    parts: PartsRule | None = None,
) -> list[ReplayResult]:
    """One forward pass over ``items`` (full capture under the attention-parts rule
    ``parts``, default the library's, as the model generated). The rows of interest are the
    ``n_max`` positions (longest response) before the last one, which predict response
    tokens; a response of ``n`` tokens takes the last ``n`` of them."""
    hf = loaded.hf_model
    tokenizer = loaded.tokenizer
    num_layers = loaded.spec.num_layers
    device = next(hf.parameters()).device
    b = len(items)
    seqs = [it.prompt + it.response for it in items]
    s = max(len(x) for x in seqs)
    n_max = max(len(it.response) for it in items)
    if n_max == 0:
        return [
            _empty_result(tokenizer, model_name, num_layers, it, capture_geometry, capture)
            for it in items
        ]
    split = items[0].prefix if b == 1 else 0
    eos_ids = eos_token_ids(hf, tokenizer)
    rule = parts or default_parts()
    with loaded.lock.shared():
        session = (
            CaptureSession(
                loaded.spec,
                batch_size=b,
                max_len=s,
                reference=reference,
                keep_states=return_states,
                cache_values=split > 0,
                capture=capture,
                cache_budget_bytes=rule.cache_budget_bytes,
                dense_max_sources=rule.dense_max_sources,
            )
            if capture_geometry or return_states
            else None
        )
        if split > 0:
            out_logits = _forward_split(loaded, items[0], session, n_max)
        else:
            ids, mask = left_padded(seqs, pad_token_id(hf, tokenizer))
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            if session is not None:
                session.set_rows(slice(s - 1 - n_max, s - 1))
            with torch.inference_mode(), capture_mode(hf, session), blas_threads(DECODE_THREADS):
                out_logits = hf(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    position_ids=pos.to(device),
                    use_cache=False,
                    logits_to_keep=n_max + 1,
                ).logits
    logits = out_logits[:, :-1].float().cpu()  # [B, n_max, V] rows predicting tokens
    step = session.steps[0] if session is not None else None
    results = []
    for i, it in enumerate(items):
        prompt, resp = it.prompt, it.response
        n = len(resp)
        meta = token_metadata(
            tokenizer, model_name, prompt, resp, logits[i, n_max - n :], "stop", top_logprobs
        )
        if not (resp and resp[-1] in eos_ids):
            meta["finish_reason"] = "length"
        meta["replay_source"] = it.source
        states = None
        if step is not None and capture_geometry:
            geo = slice_step(step, i, n_max - n, n_max)
            meta["geometry"] = geometry_json(num_layers, geo)
        else:
            meta["geometry"] = None
        cuts = [
            _cut_metadata(tokenizer, model_name, it, logits[i, n_max - n :], t, top_logprobs)
            for t in it.cuts
        ]
        if step is not None and capture_geometry:
            for t, cut in zip(it.cuts, cuts, strict=True):
                cut["geometry"] = geometry_json(
                    num_layers, slice_step(step, i, n_max - n, n_max - n + t)
                )
        if return_states and step is not None:
            assert step.post_attn is not None and step.post_mlp is not None
            states = TokenStates(
                post_attn=step.post_attn[i, n_max - n :].copy(),
                post_mlp=step.post_mlp[i, n_max - n :].copy(),
            )
        results.append(ReplayResult(metadata=meta, states=states, cuts=cuts))
    return results


def _cut_metadata(
    tokenizer: Any,
    model_name: str,
    item: ReplayItem,
    logits: torch.Tensor,
    t: int,
    top_logprobs: int,
) -> dict[str, Any]:
    """The token metadata of ``item``'s response cut after ``t`` tokens, from the rows of
    its forward pass that predict them (``logits`` ``[n, V]``; geometry added by the
    caller): each row reads only the tokens before it, so it is the cut's own."""
    if not 1 <= t <= len(item.response):
        raise InvalidInputError(f"cut after {t} tokens of a {len(item.response)}-token response")
    meta = token_metadata(
        tokenizer, model_name, item.prompt, item.response[:t], logits[:t], "partial", top_logprobs
    )
    meta["replay_source"] = item.source
    meta["geometry"] = None
    return meta


def _empty_result(
    tokenizer: Any,
    model_name: str,
    num_layers: int,
    item: ReplayItem,
    capture_geometry: bool,
    capture: str,
) -> ReplayResult:
    """The result of an empty response (no tokens to replay, no forward pass)."""
    meta = token_metadata(tokenizer, model_name, item.prompt, [], torch.zeros((0, 1)), "stop", 0)
    meta["geometry"] = geometry_json(num_layers, None, capture) if capture_geometry else None
    return ReplayResult({**meta, "replay_source": item.source}, None)


def slice_step(step: StepFeatures, i: int, a: int, b: int) -> StepFeatures:
    """Rows ``a:b`` of batch item ``i``: ``[b - a, 2L-1]`` arrays from ``[B, R, 2L-1]``."""

    def sl(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else x[i, a:b]

    omega = sl(step.omega)
    theta = sl(step.theta)
    assert omega is not None and theta is not None
    return StepFeatures(
        omega,
        theta,
        sl(step.phi_in),
        sl(step.phi_out),
        None,
        None,
        capture=step.capture,
        hidden=sl(step.hidden),
    )


def replay_token_ids(
    model: Any,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 16,
    return_states: bool = False,
    progress: bool = False,
) -> list[ReplayResult]:
    """Replay exact ``(prompt ids, response ids)`` pairs on a ``GeometryChatModel`` with its
    settings (reference means, capture mode, top logprobs).

    For answers whose prompt cannot be rebuilt from a question alone — an agent's final
    answer, written after tool schemas, tool results or a forced-call prefill — the prompt
    ids the model generated from (``response_metadata["prompt_token_ids"]``) are replayed as
    they are, so the features equal the generation's.
    """
    loaded = model._s
    items = [
        replay_item(loaded, [int(t) for t in p], [int(t) for t in r], False, False)
        for p, r in pairs
    ]
    return replay_items(
        loaded,
        items,
        model_name=model.model_name,
        reference=model.reference,
        capture_geometry=model.capture_geometry,
        top_logprobs=model.top_logprobs,
        batch_size=batch_size,
        return_states=return_states,
        progress=progress,
        capture=model.capture,
        parts=model.capture_parts,
    )


__all__ = ["ReplayItem", "replay_item", "replay_items", "replay_token_ids", "slice_step"]
