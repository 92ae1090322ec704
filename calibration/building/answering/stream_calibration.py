"""Calibrating for certified streaming: every calibration answer scored at each chunk end of
the config's chunk rule (:mod:`abstain_guard.contract.streaming`).

Each answer of ``n`` tokens is replayed behind the same prompt (one sequence per forward
pass, as :func:`.answers.replay_as_deployed` replays whole answers) and its metadata read
off that pass cut after each interior chunk end ``t < n`` (``replay_batch(cuts=...)``): the
metadata the live stream's prefix carries, since every feature at a position reads only the
tokens before it (equal up to the last bits of float32: the live decode steps and one
forward pass reduce in other orders, as for whole answers). The
scorer scores each cut; the answer's statistic is the maximum over its cuts and the whole
answer (what the guard stops on), its first-chunk score the first cut's (``inf`` when it has
none). Artifact building only; the live side is :mod:`abstain_guard.guard.stream_gate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from abstain_guard.contract.deployment import StreamingRecord
from abstain_guard.contract.streaming import ChunkRule, first_release_statistic, stream_statistic

from ..questions.datasets import QAItem
from ..run.calibration_config import CalibrationConfig
from .answer_rows import AnswerRows
from .answers import generated_pairs


class StreamScores:
    """The calibration answers' stream statistics ``[n]``, first-chunk scores ``[n]``,
    prefix scores (one list per answer) and the :class:`StreamingRecord` to store."""

    def __init__(
        self,
        statistic: np.ndarray,
        first: np.ndarray,
        prefix_scores: list[list[float]],
        record: StreamingRecord,
    ) -> None:
        self.statistic = statistic
        self.first = first
        self.prefix_scores = prefix_scores
        self.record = record


def answer_decoder(tokenizer: Any) -> Any:
    """The text of generated ids as the chunk rules read it (special tokens skipped): the
    chat model's own ``_answer_text``."""

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    return decode


def stream_scores(
    model: Any,
    scorer: Any,
    pairs: Sequence[tuple[Any, list[int]]],
    whole_scores: Sequence[float] | np.ndarray,
    rule: ChunkRule | str,
    progress: bool = False,
) -> StreamScores:
    """Score every interior chunk end of each ``(messages, token ids)`` pair (the
    calibration answers, ``whole_scores`` their whole-answer scores) with ``model`` (the
    scorer's prepared model) and ``scorer``."""
    rule = ChunkRule.parse(rule)
    decode = answer_decoder(model.tokenizer)
    ends = [rule.interior_ends(ids, decode) for _, ids in pairs]
    flat: list[float] = []
    if any(ends):  # one forward pass per answer, its cuts read off it
        results = model.replay_batch(pairs, batch_size=1, progress=progress, cuts=ends)
        metas = [cut for r in results for cut in r.cuts]
        flat = [float(x) for x in scorer.score_many(metas)]
    prefix_scores, at = [], 0
    for e in ends:
        prefix_scores.append(flat[at : at + len(e)])
        at += len(e)
    statistic = np.array(
        [stream_statistic(p, s) for p, s in zip(prefix_scores, whole_scores, strict=True)]
    )
    first = np.array([first_release_statistic(p) for p in prefix_scores])
    counts = np.array([len(e) for e in ends])
    record = StreamingRecord(
        chunk_rule=str(rule),
        chunks={
            "answers": len(ends),
            "with_interior_chunk_end": int((counts > 0).sum()),
            "mean_interior_chunk_ends": float(counts.mean()) if counts.size else 0.0,
            "max_interior_chunk_ends": int(counts.max()) if counts.size else 0,
        },
    )
    return StreamScores(statistic, first, prefix_scores, record)


def calibration_stream_scores(
    run: Any,
    scorer: Any,
    items: Sequence[QAItem],
    answers: AnswerRows,
    whole_scores: Sequence[float] | np.ndarray,
) -> StreamScores:
    """:func:`stream_scores` of the calibration split's answers: ``run`` is the pipeline's
    run (its model, prepared by ``scorer``, its config's ``chunk_rule`` and ``progress``)."""
    config: CalibrationConfig = run.config
    assert config.chunk_rule is not None
    return stream_scores(
        scorer.prepare(run.model),
        scorer,
        generated_pairs(items, answers, config),
        whole_scores,
        config.chunk_rule,
        run.progress,
    )
