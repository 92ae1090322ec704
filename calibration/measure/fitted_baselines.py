"""The baselines ``evaluate`` fits on the artifact's reference and train answers (issue 37):
the hidden-state probes, likelihood + probe, the type-only floor and ``geometry_plus``;
never on calibration or test. Also what they read: each answer's question type and the
reference answers' hidden-state summaries."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from abstain_guard.contract.metadata import HIDDEN, QUESTION_GROUP
from abstain_guard.errors import AbstainGuardError
from abstain_guard.scorers import build_scorer

from ..building.answering.answer_rows import STATES_NS, AnswerRow
from ..building.answering.online_geometry import reference_hidden
from ..building.questions.datasets import QAItem

logger = logging.getLogger("abstain_guard.calibration")

__all__ = ["cost", "fitted_baseline_scores", "reference_metadata", "with_groups"]


def with_groups(metadata: Sequence[dict[str, Any]], items: Sequence[QAItem]) -> list[Any]:
    """Copies of ``metadata`` with each question's type (``question_group``)."""
    return [{**m, QUESTION_GROUP: it.group} for m, it in zip(metadata, items, strict=True)]


def reference_metadata(answer: AnswerRow, store: Any) -> dict[str, Any]:
    """A reference answer's metadata for the fitted baselines: its likelihood metadata and
    the probe layers' summaries (from its row, or from its cached states)."""
    meta = dict(answer.get("metadata") or {})
    hidden = answer.get("hidden")
    if hidden is None:
        hidden = reference_hidden(answer, store.get_arrays(STATES_NS, answer["key"]))
    if hidden is not None:
        meta["geometry"] = {**(meta.get("geometry") or {}), HIDDEN: hidden}
    return meta


def cost(t0: float, n: int) -> dict[str, float]:
    """Seconds per answer of scoring ``n`` answers since ``t0`` (the answers' metadata
    already in memory: the scorer's own cost, not generation's)."""
    return {"seconds_per_answer": (time.perf_counter() - t0) / max(n, 1)}


def fitted_baseline_scores(held: Any, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Scores of the baselines fitted on the artifact's reference and train answers (the
    splits its geometry scorer was fitted on; never calibration). A baseline that cannot be
    fitted (answers without hidden states, too few of a class) is left out with a warning."""
    if held.train_metadata is None or held.train_correct is None:
        logger.warning("no train answers: %s need the artifact's own splits", list(names))
        return {}
    ref_correct = [] if held.reference_correct is None else held.reference_correct.tolist()
    ref = list(zip(held.reference_metadata or [], ref_correct, strict=True))
    train = list(zip(held.train_metadata, held.train_correct.tolist(), strict=True))
    out: dict[str, np.ndarray] = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            scorer = build_scorer(name).fit(  # type: ignore[attr-defined]
                ref, train, reference_means=held.reference_means
            )
            t1 = time.perf_counter()
            out[name] = np.asarray(scorer.score_many(held.metadata), dtype=np.float64)
        except AbstainGuardError as exc:  # no hidden states, too few of a class, no means
            logger.warning("baseline %s left out: %s", name, exc)
            continue
        held.costs[name] = {**cost(t1, len(held.metadata)), "fit_seconds": t1 - t0}
        state = scorer.get_state()
        held.costs[name]["state_bytes"] = int(
            sum(a.nbytes for a in state.arrays.values()) + len(json.dumps(state.params))
        )
        logger.info(
            "%s fitted on %d reference + %d train answers in %.1f s",
            name,
            len(ref),
            len(train),
            time.perf_counter() - t0,
        )
    return out
