"""Calibration answers from an API chat model (a
:class:`~abstain_guard.contract.chat_model_specs.ChatModelSpec` in the config): generated through
the chain the deployed guard runs (a scorer with nothing to fit asks through its own
``prepare``: a black-box scorer's k samples are stored with the answer), scored from their own
metadata, with no replay. Logprobs, caching and what is refused: docs/configuration.md, 'API
chat models'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from abstain_guard.contract.chat_model_specs import ChatModelSpec, bind_budget
from abstain_guard.contract.prompts import (
    build_messages,
    max_new_tokens_for,
    messages_to_json,
    question_prompt,
)
from abstain_guard.errors import CalibrationError, LogprobsMissingError, ScoringError
from abstain_guard.scorers import SamplingPlan, build_scorer, scorer_spec

from ..judges.judging import labels
from ..questions.datasets import QAItem
from ..run.calibration_config import CalibrationConfig
from ..run.store import RunStore, content_key
from .answer_rows import AnswerRow, AnswerRows, GenerationOptions, keyed_rows, plan_chunks

#: What an API answer's cache row keeps of its response metadata (the scorers read these;
#: the vLLM backend also writes token ids, entropies, hidden states and its engine record).
API_METADATA = (
    "logprobs",
    "finish_reason",
    "model_name",
    "prompt_token_ids",
    "token_ids",
    "entropy",
    "geometry",
    "backend",
    "samples",
)

#: What a text-only answer (no logprobs) can carry for a scorer: the samples a black-box
#: scorer draws through it.
TEXT_ONLY_FIELDS = frozenset({"samples"})


def needs_token_logprobs(kind: str) -> bool:
    """Whether scorer ``kind`` needs each answer's token logprobs: it reads a field beyond
    :data:`TEXT_ONLY_FIELDS`, as its class declares (one that declares nothing: it does)."""
    reads = scorer_spec(kind).reads
    return reads is None or not reads <= TEXT_ONLY_FIELDS


def _asking_scorer(config: CalibrationConfig) -> Any:
    """The scorer whose ``prepare`` the questions are asked through (None: a fitted scorer,
    fitted only after its answers, so they are asked as the bare chain)."""
    if scorer_spec(config.scorer).fitted:
        return None
    return build_scorer(config.scorer, **config.scorer_params)


def _sampling(scorer: Any) -> dict[str, Any]:
    """The sampling plan an answer is drawn under, as its cache key records it (``{}``: the
    model's one answer)."""
    plan = getattr(scorer, "plan", None)
    return {"sampling": plan.record()} if isinstance(plan, SamplingPlan) else {}


def _label(config: CalibrationConfig) -> str:
    return config.model.label if isinstance(config.model, ChatModelSpec) else str(config.model)


def api_answer_row(item: QAItem, message: Any, config: CalibrationConfig) -> AnswerRow:
    """The cached row of one answer (text, finish reason, logprobs, samples).

    Raises:
        LogprobsMissingError: the response carries no per-token logprobs and the scorer
            needs them (:func:`needs_token_logprobs`).
    """
    meta: Mapping[str, Any] = getattr(message, "response_metadata", None) or {}
    logprobs = meta.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    text = str(getattr(message, "content", ""))
    missing = not isinstance(content, list) or (not content and bool(text))
    if missing and needs_token_logprobs(config.scorer):
        raise LogprobsMissingError(
            f"The answer to question {item.id!r} ({item.question[:80]!r}) from the API chat "
            f"model {_label(config)} carries no token logprobs "
            "(response_metadata['logprobs']['content']), which the "
            f"{config.scorer} scorer reads. Set the provider's logprobs option in the "
            "config's model.kwargs (logprobs: true for OpenAI-compatible APIs), or use a "
            "provider that returns token logprobs, or a black-box scorer (which reads no "
            "logprobs: discrete_semantic_entropy, eigv, verbalized_confidence, ...)."
        )
    return {
        "text": text,
        "finish_reason": meta.get("finish_reason"),
        "metadata": {k: meta[k] for k in API_METADATA if k in meta},
    }


def generate_api_answers(
    model: Any,
    items: Sequence[QAItem],
    store: RunStore,
    config: CalibrationConfig,
    *,
    fingerprint: str,
    options: GenerationOptions | None = None,
) -> AnswerRows:
    """Answers of ``model`` (an API chat model) to ``items``, as the deployed guard asks
    them: ``{item.id: {"text", "finish_reason", "metadata", "key"}}``.

    ``config.batch_size`` questions are sent at a time (concurrent requests, each its own
    call; a black-box scorer's k samples of a question go out together within it); chunk
    boundaries are fixed by the order of ``items``, and a chunk's answers are stored before
    the next is sent.

    Raises:
        LogprobsMissingError: an answer carries no logprobs and the scorer reads them.
        CalibrationError: a request failed (the answers received so far are kept).
    """
    options = options or GenerationOptions()
    budgets = {it.kind: max_new_tokens_for(it.kind, config.max_new_tokens) for it in items}
    engine = getattr(model, "engine_record", None)  # the vLLM backend: its engine's facts
    scorer = _asking_scorer(config)
    mode = {"engine": engine()} if callable(engine) else {}
    mode.update(_sampling(scorer))
    keys = {
        it.id: content_key(
            "gen",
            fingerprint,
            messages_to_json(build_messages(it, config.system_prompt)),
            {"max_tokens": budgets[it.kind], "api": True, **mode},
        )
        for it in items
    }
    done = store.get_many("generation", list(keys.values()))
    chains = {
        kind: question_prompt(config.system_prompt, kind) | bind_budget(model, budget)
        for kind, budget in budgets.items()
    }
    if scorer is not None:
        chains = {kind: scorer.prepare(chain) for kind, chain in chains.items()}
    bar = tqdm(total=len(items), desc="asking", disable=not options.progress, unit="q")
    bar.update(sum(1 for it in items if keys[it.id] in done))
    size = config.batch_size
    for chunk_index, chunk in plan_chunks(items, size):
        todo = [it for it in chunk if keys[it.id] not in done]
        if not todo:
            continue
        outputs = chains[chunk[0].kind].batch(
            [{"question": it.prompt_text()} for it in todo],
            config={"max_concurrency": size},
            return_exceptions=True,
        )
        fresh, failed = {}, []
        for it, out in zip(todo, outputs, strict=True):
            if isinstance(out, BaseException):
                failed.append((it, out))
            else:
                fresh[keys[it.id]] = api_answer_row(it, out, config)
        store.put_many("generation", fresh)
        done.update(fresh)
        bar.update(len(fresh))
        if failed:
            it, exc = failed[0]
            raise CalibrationError(
                f"The API chat model {_label(config)} failed on {len(failed)} questions, "
                f"the first {it.id!r}: {type(exc).__name__}: {exc}. The answers received "
                "are cached; fix the cause (server, key, rate limit) and run again to "
                "send only the rest."
            ) from exc
        if options.on_chunk is not None:
            options.on_chunk(chunk_index)
    bar.close()
    return keyed_rows(items, done, keys)


def api_labeled(
    items: Sequence[QAItem], answers: AnswerRows, judgments: Mapping[str, Any]
) -> list[tuple[Mapping[str, Any], bool]]:
    """``(cached metadata, correct)`` of ``items``' answers: what a fitted scorer (a probe on
    the vLLM backend) is fitted on, read as the live guard reads a response."""
    correct = labels(items, judgments)
    return [(answers[it.id].get("metadata") or {}, c) for it, c in zip(items, correct, strict=True)]


def score_api_answers(scorer: Any, items: Sequence[QAItem], answers: AnswerRows) -> np.ndarray:
    """``scorer``'s score of each item's cached answer metadata: what the live guard computes
    from the same response (no replay).

    Raises:
        CalibrationError: an answer cannot be scored (names the question).
    """
    scores = []
    for it in items:
        try:
            scores.append(float(scorer.score(answers[it.id].get("metadata") or {})))
        except ScoringError as exc:
            raise CalibrationError(
                f"The answer to {it.id!r} ({it.question[:80]!r}) cannot be scored: {exc}"
            ) from exc
    return np.asarray(scores, dtype=np.float64)


#: Concurrency levels and questions of the live-bound measurement (:func:`measure_live_bound`).
LIVE_BOUND_LEVELS = (8, 32)
LIVE_BOUND_QUESTIONS = 32
#: The stated bound over the largest move measured (the measurement is a sample of moves),
#: and its floor: ten float32 roundings of a score near 1 (an engine that moved nothing on
#: 64 answers may still move the last bit of another).
LIVE_BOUND_MARGIN = 10.0
LIVE_BOUND_FLOOR = 1e-6


def measure_live_bound(
    model: Any,
    scorer: Any,
    items: Sequence[QAItem],
    answers: AnswerRows,
    config: CalibrationConfig,
    *,
    levels: Sequence[int] = LIVE_BOUND_LEVELS,
    limit: int = LIVE_BOUND_QUESTIONS,
) -> dict[str, Any]:
    """How far a live score moves from the stored one when the server batches: the first
    ``limit`` of ``items`` (calibration questions) asked again as the guard asks them, at
    each level of ``levels`` calls in flight, each answer scored and compared with its stored
    answer's score. Returns ``{"levels": {level: {"n", "max_abs_diff", "tokens_differ"}},
    "max_abs_diff", "bound", "margin"}``: ``bound`` is :data:`LIVE_BOUND_MARGIN` times the
    largest move seen, at least :data:`LIVE_BOUND_FLOOR` (what the artifact states as
    ``live_bound``)."""
    sample = list(items[:limit])
    budgets = {it.kind: max_new_tokens_for(it.kind, config.max_new_tokens) for it in sample}
    chains = {
        kind: question_prompt(config.system_prompt, kind) | bind_budget(model, budget)
        for kind, budget in budgets.items()
    }
    stored = {it.id: answers[it.id].get("metadata") or {} for it in sample}
    per_level: dict[str, dict[str, Any]] = {}
    for level in levels:
        diffs, tokens_differ = [], 0
        for kind, chain in chains.items():
            asked = [it for it in sample if it.kind == kind]
            outputs = chain.batch(
                [{"question": it.prompt_text()} for it in asked],
                config={"max_concurrency": int(level)},
            )
            for it, out in zip(asked, outputs, strict=True):
                meta = out.response_metadata
                if list(meta.get("token_ids") or []) != list(stored[it.id].get("token_ids") or []):
                    tokens_differ += 1
                live = float(scorer.score(meta))
                diffs.append(abs(live - float(scorer.score(stored[it.id]))))
        per_level[str(level)] = {
            "n": len(diffs),
            "max_abs_diff": max(diffs, default=0.0),
            "tokens_differ": tokens_differ,
        }
    largest = max((v["max_abs_diff"] for v in per_level.values()), default=0.0)
    return {
        "levels": per_level,
        "max_abs_diff": largest,
        "bound": max(LIVE_BOUND_MARGIN * largest, LIVE_BOUND_FLOOR),
        "margin": LIVE_BOUND_MARGIN,
    }
