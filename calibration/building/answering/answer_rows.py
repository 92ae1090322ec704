"""One calibration answer as the run cache holds it (:class:`AnswerRow`), and what every way
of generating answers (:mod:`.answers`, :mod:`.api_generation`) shares: the splits generated
as deployed (:data:`HELD_OUT`), the chunks of a run (:func:`plan_chunks`), what an answer's
row keeps and captures, and the digest of the reference means its Φ used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, cast

import numpy as np

from ..questions.datasets import QAItem

#: The response-metadata keys an answer's cache entry keeps (what the scorers read).
LIKELIHOOD_METADATA = (
    "prompt_token_ids",
    "token_ids",
    "tokens",
    "logprobs",
    "entropy",
    "generation",
)


class _AnswerFields(TypedDict):
    text: str
    finish_reason: str | None
    metadata: dict[str, Any]


class AnswerRow(_AnswerFields, total=False):
    """One answer as calibration caches and reads it (a JSON object in the run store, so the
    cache writes and reads this very dict; a TypedDict, not a dataclass, for that reason).

    Attributes:
        metadata: what the scorers read (:data:`LIKELIHOOD_METADATA`, and the geometry when
            it was captured).
        key: the answer's cache key (added when read back, not stored).
        reference: the :func:`means_digest` of the means its Φ was computed with.
        agent: an agent run's record (:func:`~.agents.run_row`).
        hidden: a reference answer's probe-layer summaries (``geometry["hidden"]``; its
            geometry is kept as arrays, not in ``metadata``).
    """

    key: str
    reference: str | None
    agent: dict[str, Any]
    hidden: dict[str, Any]


#: A run's answers, ``{item.id: AnswerRow}``.
AnswerRows = dict[str, AnswerRow]


#: What :func:`.answers.generate_answers` captures while generating: nothing (likelihood scorers),
#: the geometry and per-token states (the reference split of a geometry scorer: its means are
#: fitted on them), or the geometry with Φ computed online from fitted reference means.
Capture = Literal["none", "states", "geometry"]


@dataclass(frozen=True)
class GenerationOptions:
    """How :func:`.answers.generate_answers` generates the answers it does not find cached.

    Attributes:
        batch_size: questions a call (default ``config.batch_size``); ``1`` generates each
            question as its own call would, as the deployed guard does.
        reference: the fitted reference means, for ``capture="geometry"``.
        executor: generates the chunks elsewhere (e.g. :class:`~.executors.RayExecutor`).
        on_chunk: called with each chunk's index once it is stored.
    """

    batch_size: int | None = None
    capture: Capture = "none"
    reference: Any = None
    executor: Any = None
    progress: bool = True
    on_chunk: Callable[[int], None] | None = None


def keyed_rows(
    items: Sequence[QAItem], rows: Mapping[str, Any], keys: Mapping[str, str]
) -> AnswerRows:
    """``{item.id: row}`` for ``items`` from the cache ``rows`` (by key), each row with its
    ``key``."""
    return {it.id: cast(AnswerRow, {**rows[keys[it.id]], "key": keys[it.id]}) for it in items}


#: Run-store namespace of the arrays captured with ``capture="states"`` (``omega``,
#: ``theta`` ``[N, 2L-1]``, ``post_attn``, ``post_mlp`` ``[N, L, D]``), keyed like the answer.
STATES_NS = "states"


def means_digest(means: Any) -> str:
    """sha256 of reference means' arrays (what a cached answer's Φ was computed with)."""
    digest = hashlib.sha256()
    for name, arr in sorted(means.to_arrays().items()):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(arr, dtype=np.float64).tobytes())
    return digest.hexdigest()


#: Splits whose answers are scored for the guarantee (calibration) or measured (test): they
#: are generated as the deployed guard generates -- one question per call, or, on a model
#: loaded with ``batch_decode``, ``batch_size`` questions through its scheduler, each answer
#: bitwise the one its own call gives -- and scored live (or by replaying their generated
#: token ids one sequence at a time, no padding), so their scores equal what the guard
#: computes live. Reference and train answers only fit the scorer and are generated in
#: batches.
HELD_OUT = ("calibration", "test")


def plan_chunks(items: Sequence[QAItem], size: int) -> list[tuple[int, list[QAItem]]]:
    """The chunks a run generates: ``(index, questions)``, at most ``size`` questions of one
    kind each, kinds in order of first appearance, indices from 1. Fixed by the order of
    ``items`` alone, so a resumed run (or a Ray run) has the same chunks as the first."""
    by_kind: dict[str, list[QAItem]] = {}
    for it in items:
        by_kind.setdefault(it.kind, []).append(it)
    chunks = [
        kind_items[start : start + size]
        for kind_items in by_kind.values()
        for start in range(0, len(kind_items), size)
    ]
    return list(enumerate(chunks, start=1))
