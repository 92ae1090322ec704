"""Replay: teacher-forced features of existing answers, one forward pass per batch.

Each (prompt, response) pair is left-padded into one batch; a
:class:`~abstain_guard.adapters.capture.session.CaptureSession` without a value cache computes
the features of the N rows that predict the response tokens. Replaying the exact generated
ids of an answer reproduces its generation metadata (docs/method.md, "Generation and
replay").
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
from ..capture.features import StepFeatures
from ..capture.parts_rule import PartsRule
from ..capture.session import CaptureSession, default_parts
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
    prefix: int | None = None,
) -> ReplayItem:
    """A :class:`ReplayItem`; a text response gets the first EOS id appended (a finished
    answer); ``prefix``: the prompt's split on the prefix path. Raises ContextLengthError
    when it does not fit."""
    eos = eos_token_ids(loaded.hf_model, loaded.tokenizer)
    ctx = loaded.spec.context_length
    if from_text and eos:
        response = [*response, eos[0]]
    if ctx and len(prompt) + len(response) > ctx:
        raise ContextLengthError(
            f"prompt ({len(prompt)}) + response ({len(response)}) tokens exceed the "
            f"context window of {ctx}"
        )
    return ReplayItem(prompt, response, "text" if from_text else "token_ids", prefix or 0)


@dataclass(frozen=True)
class ReplaySettings:
    """A chat model's settings a replay computes with: ``model_name`` (in the metadata), the
    ``reference`` means for Φ, whether geometry is captured, in which ``capture`` mode and
    under which attention-parts rule ``parts`` (None: the library's default, as the model
    generated), and the ``top_logprobs`` alternatives per token."""

    model_name: str
    reference: ReferenceMeans | None = None
    capture_geometry: bool = True
    top_logprobs: int = 5
    capture: str = "full"
    parts: PartsRule | None = None


def replay_items(
    loaded: LoadedModel,
    items: Sequence[ReplayItem],
    settings: ReplaySettings,
    batch_size: int = 16,
    return_states: bool = False,
    progress: bool = False,
) -> list[ReplayResult]:
    """Replay ``items``, ``batch_size`` left-padded sequences per forward pass (a tqdm bar
    over the batches with ``progress``).

    The batches run side by side in one thread per engine of the model
    (:func:`~.threads.engine_workers`: one per CPU), each forward on one BLAS thread and
    holding ``loaded.lock`` shared, so a batch's numbers are the ones it gets alone; in the
    calling thread, one after the other, when that thread holds the lock alone."""
    if batch_size <= 0:
        raise InvalidInputError(f"batch_size must be positive, got {batch_size}")
    spans = _chunk_spans(items, batch_size)

    def run(span: tuple[int, int]) -> list[ReplayResult]:
        return _replay_chunk(loaded, items[span[0] : span[1]], settings, return_states)

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


def _forward_padded(
    loaded: LoadedModel, seqs: list[list[int]], session: CaptureSession | None, n: int
) -> torch.Tensor:
    """One left-padded pass over ``seqs`` with explicit position ids (so RoPE / absolute
    positions match generation); the logits of the last ``n + 1`` positions."""
    hf = loaded.hf_model
    device = next(hf.parameters()).device
    s = max(len(x) for x in seqs)
    ids, mask = left_padded(seqs, pad_token_id(hf, loaded.tokenizer))
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    if session is not None:
        session.set_rows(slice(s - 1 - n, s - 1))
    with torch.inference_mode(), capture_mode(hf, session), blas_threads(DECODE_THREADS):
        out = hf(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            use_cache=False,
            logits_to_keep=n + 1,
        )
    return out.logits  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Pass:
    """One forward over a chunk of items: the logits ``[B, n_max, V]`` of the ``n_max``
    positions (longest response) before the last one, which predict response tokens (a
    response of ``n`` tokens takes the last ``n`` of them), and their features (None
    without capture)."""

    loaded: LoadedModel
    settings: ReplaySettings
    logits: torch.Tensor
    step: StepFeatures | None
    n_max: int

    def metadata(self, item: ReplayItem, i: int, t: int, finish: str) -> dict[str, Any]:
        """The metadata of item ``i``'s response cut after ``t`` tokens, from the rows that
        predict them: each row reads only the tokens before it, so it is the cut's own."""
        start = self.n_max - len(item.response)
        settings, tokenizer = self.settings, self.loaded.tokenizer
        meta = token_metadata(
            tokenizer,
            settings.model_name,
            item.prompt,
            item.response[:t],
            self.logits[i, start : start + t],
            finish,
            settings.top_logprobs,
        )
        meta["replay_source"] = item.source
        meta["geometry"] = None
        if self.step is not None and settings.capture_geometry:
            geo = slice_step(self.step, i, start, start + t)
            meta["geometry"] = geometry_json(self.loaded.spec.num_layers, geo)
        return meta

    def states(self, i: int, n: int) -> TokenStates:
        """The per-token states of item ``i``'s ``n`` response tokens."""
        step = self.step
        assert step is not None and step.post_attn is not None and step.post_mlp is not None
        return TokenStates(
            post_attn=step.post_attn[i, self.n_max - n :].copy(),
            post_mlp=step.post_mlp[i, self.n_max - n :].copy(),
        )


def _forward(
    loaded: LoadedModel,
    items: Sequence[ReplayItem],
    settings: ReplaySettings,
    return_states: bool,
    n_max: int,
) -> _Pass:
    """One forward pass over ``items`` (a single item split on the prefix path, or a
    left-padded batch), captured under :class:`ReplaySettings` (full capture under its
    attention-parts rule)."""
    seqs = [it.prompt + it.response for it in items]
    split = items[0].prefix if len(items) == 1 else 0
    with loaded.lock.shared():
        session = None
        if settings.capture_geometry or return_states:
            session = CaptureSession(
                loaded.spec,
                batch_size=len(items),
                max_len=max(len(x) for x in seqs),
                reference=settings.reference,
                keep_states=return_states,
                cache_values=split > 0,
                capture=settings.capture,
                parts=settings.parts or default_parts(),
            )
        if split > 0:
            out_logits = _forward_split(loaded, items[0], session, n_max)
        else:
            out_logits = _forward_padded(loaded, seqs, session, n_max)
    logits = out_logits[:, :-1].float().cpu()  # [B, n_max, V] rows predicting tokens
    step = session.steps[0] if session is not None else None
    return _Pass(loaded, settings, logits, step, n_max)


def _replay_chunk(
    loaded: LoadedModel,
    items: Sequence[ReplayItem],
    settings: ReplaySettings,
    return_states: bool,
) -> list[ReplayResult]:
    """The results of ``items`` from one forward pass (none for empty responses)."""
    n_max = max(len(it.response) for it in items)
    if n_max == 0:
        return [_empty_result(loaded, it, settings) for it in items]
    run = _forward(loaded, items, settings, return_states, n_max)
    eos_ids = eos_token_ids(loaded.hf_model, loaded.tokenizer)
    results = []
    for i, it in enumerate(items):
        n = len(it.response)
        finish = "stop" if it.response and it.response[-1] in eos_ids else "length"
        meta = run.metadata(it, i, n, finish)
        for t in it.cuts:
            if not 1 <= t <= n:
                raise InvalidInputError(f"cut after {t} tokens of a {n}-token response")
        cuts = [run.metadata(it, i, t, "partial") for t in it.cuts]
        states = run.states(i, n) if return_states else None
        results.append(ReplayResult(metadata=meta, states=states, cuts=cuts))
    return results


def _empty_result(loaded: LoadedModel, item: ReplayItem, settings: ReplaySettings) -> ReplayResult:
    """The result of an empty response (no tokens to replay, no forward pass)."""
    meta = token_metadata(
        loaded.tokenizer, settings.model_name, item.prompt, [], torch.zeros((0, 1)), "stop", 0
    )
    num_layers = loaded.spec.num_layers
    geometry = (
        geometry_json(num_layers, None, settings.capture) if settings.capture_geometry else None
    )
    meta["geometry"] = geometry
    return ReplayResult({**meta, "replay_source": item.source}, None)


def slice_step(step: StepFeatures, i: int, a: int, b: int) -> StepFeatures:
    """Rows ``a:b`` of batch item ``i``: ``[b - a, 2L-1]`` arrays from ``[B, R, 2L-1]``."""

    def rows(name: str) -> np.ndarray | None:
        x = getattr(step, name)
        return None if x is None else x[i, a:b]

    return StepFeatures.of_rows(rows, step.capture)


def replay_token_ids(
    model: Any,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 16,
    return_states: bool = False,
    progress: bool = False,
) -> list[ReplayResult]:
    """Replay exact ``(prompt ids, response ids)`` pairs on a ``GeometryChatModel`` with its
    settings (:meth:`~..chat.model.GeometryChatModel.replay_settings`).

    For answers whose prompt cannot be rebuilt from a question alone — an agent's final
    answer, written after tool schemas, tool results or a forced-call prefill — the prompt
    ids the model generated from (``response_metadata["prompt_token_ids"]``) are replayed as
    they are, so the features equal the generation's.
    """
    loaded = model._s
    items = [replay_item(loaded, [int(t) for t in p], [int(t) for t in r], False) for p, r in pairs]
    settings = model.replay_settings()
    return replay_items(loaded, items, settings, batch_size, return_states, progress)
