"""Calibration without replay: the geometry scorer's inputs captured while generating (the
reference split with its states, its means fitted streaming, then the other splits with Φ
online; docs/architecture.md, 'A calibration run', steps 3–6). Answers generated without
that capture (by a likelihood-scorer run, or with other means) are replayed: reference
answers with states, train answers batched, held-out answers one sequence per pass.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from abstain_guard.adapters import ReferenceMeans, TokenStates
from abstain_guard.contract.metadata import HIDDEN, hidden_summary, probe_layers
from abstain_guard.errors import CalibrationError
from abstain_guard.scorers import with_capture

from ..judges.judging import VerdictLike, Verdicts, check_two_classes, is_correct, labels
from ..questions.datasets import QAItem
from ..run.calibration_config import CalibrationConfig
from ..run.store import RunStore
from .answer_rows import STATES_NS, AnswerRow, AnswerRows, means_digest
from .answers import generated_pairs, replay_as_deployed

logger = logging.getLogger("abstain_guard.calibration")


def captures_geometry(scorer: Any) -> bool:
    """Whether ``scorer`` is fitted on means computed outside it (``fit(...,
    reference_means=...)``), so calibration can capture its inputs while generating."""
    fit = getattr(scorer, "fit", None)
    if fit is None:
        return False
    try:
        return "reference_means" in inspect.signature(fit).parameters
    except (TypeError, ValueError):
        return False


def scoring_model(model: Any, scorer: Any) -> Any:
    """The model that generates (and replays) the train and held-out answers of ``scorer``:
    ``model`` in the scorer's capture mode (``scorer.capture``; ``"fast"`` for
    ``geometry_fast``), which is the mode the deployed guard runs (``scorer.prepare``), so
    the stored calibration scores are the live ones. The reference split keeps ``model``
    (full capture, with states); a fast scorer reads the ω_dir columns of its Ω."""
    return with_capture(model, getattr(scorer, "capture", None))


def ensure_reference_arrays(
    model: Any,
    items: Sequence[QAItem],
    answers: AnswerRows,
    store: RunStore,
    config: CalibrationConfig,
    progress: bool = False,
) -> int:
    """Make sure every reference answer has its arrays (Ω, Θ, states) in ``store``: those
    generated without capture here are replayed with states, ``config.replay_batch_size``
    per forward pass, and their arrays cached. Returns how many were replayed."""
    have = store.has_arrays(STATES_NS, [answers[it.id]["key"] for it in items])
    missing = [it for it in items if answers[it.id]["key"] not in have]
    size = config.replay_batch_size
    starts = range(0, len(missing), size)
    for start in tqdm(starts, desc="replay (reference)", disable=not progress or not missing):
        chunk = missing[start : start + size]
        results = model.replay_batch(
            generated_pairs(chunk, answers, config), batch_size=size, return_states=True
        )
        for it, res in zip(chunk, results, strict=True):
            geometry = res.metadata.get("geometry") or {}
            if res.states is None or not geometry.get("omega"):
                raise CalibrationError(
                    f"The replay of the reference answer {it.id!r} returned no geometry or "
                    "states (an empty answer?). Delete the run cache and run again."
                )
            store.put_arrays(
                STATES_NS,
                answers[it.id]["key"],
                {
                    "omega": np.asarray(geometry["omega"], dtype=np.float64),
                    "theta": np.asarray(geometry["theta"], dtype=np.float64),
                    "post_attn": res.states.post_attn,
                    "post_mlp": res.states.post_mlp,
                },
            )
    return len(missing)


def _arrays(store: RunStore, answer: AnswerRow, item_id: str) -> dict[str, np.ndarray]:
    arrays = store.get_arrays(STATES_NS, answer["key"])
    if arrays is None:
        raise CalibrationError(
            f"The captured states of the reference answer {item_id!r} are missing from the "
            "run cache (deleted during the run?). Run again: they are recomputed."
        )
    return arrays


def fit_reference_means(
    items: Sequence[QAItem],
    answers: AnswerRows,
    judgments: Mapping[str, VerdictLike],
    store: RunStore,
) -> ReferenceMeans:
    """Means of the states of correct (in) and incorrect (out) reference answers, read from
    the run cache one answer at a time (``ReferenceMeans.from_states`` sums as it goes)."""

    def states(correct: bool) -> Iterator[TokenStates]:
        for it in items:
            if bool(is_correct(judgments[it.id])) is correct:
                arrays = _arrays(store, answers[it.id], it.id)
                yield TokenStates(arrays["post_attn"], arrays["post_mlp"])

    return ReferenceMeans.from_states(states(True), states(False))


def reference_responses(
    items: Sequence[QAItem],
    answers: AnswerRows,
    store: RunStore,
    means: ReferenceMeans,
) -> list[dict[str, Any]]:
    """Each reference answer's metadata as the scorer's fit reads it: Ω, Θ as captured and
    Φ^in/Φ^out computed from its states and ``means`` in float64 — exactly what the scorer
    computes from a ``ReplayResult`` with states. States are dropped answer by answer."""
    out = []
    for it in items:
        arrays = _arrays(store, answers[it.id], it.id)
        phi_in, phi_out = means.phi(
            TokenStates(
                np.asarray(arrays["post_attn"], dtype=np.float64),
                np.asarray(arrays["post_mlp"], dtype=np.float64),
            )
        )
        geometry = {
            "num_layers": means.num_layers,
            "omega": arrays["omega"],
            "theta": arrays["theta"],
            "phi_in": phi_in,
            "phi_out": phi_out,
            HIDDEN: reference_hidden(answers[it.id], arrays),
        }
        out.append({**answers[it.id]["metadata"], "geometry": geometry})
    return out


def reference_hidden(
    answer: AnswerRow, arrays: Mapping[str, np.ndarray] | None
) -> dict[str, Any] | None:
    """A reference answer's probe-layer summaries (``geometry["hidden"]``): from its row,
    or computed from its cached states (a cache written before the row kept them)."""
    if answer.get("hidden") is not None:
        return answer["hidden"]
    if arrays is None or "post_mlp" not in arrays:
        return None
    post_mlp = np.asarray(arrays["post_mlp"])
    layers = probe_layers(post_mlp.shape[1])
    return hidden_summary(post_mlp[:, list(layers)], layers)


def _has_phi(answer: AnswerRow, digest: str) -> bool:
    """Whether a cached answer's geometry carries Φ computed with the means of ``digest``."""
    geometry = (answer.get("metadata") or {}).get("geometry")
    return (
        answer.get("reference") == digest
        and isinstance(geometry, dict)
        and geometry.get("phi_in") is not None
    )


def answers_with_phi(
    model: Any,
    items: Sequence[QAItem],
    answers: AnswerRows,
    config: CalibrationConfig,
    means: ReferenceMeans,
    *,
    batch_size: int,
    progress: bool = False,
) -> tuple[list[dict[str, Any]], int]:
    """Metadata of ``items``' answers with Φ for ``means``, and how many were replayed.

    The geometry captured while generating is used when its Φ was computed with these
    means; the other answers are replayed with the means installed, ``batch_size``
    sequences per forward pass (``1`` for held-out answers: one sequence per pass, as the
    guard scores; see :func:`replay_as_deployed`).
    """
    digest = means_digest(means)
    stale = [it for it in items if not _has_phi(answers[it.id], digest)]
    replayed: dict[str, dict[str, Any]] = {}
    if stale:
        scoring = model.with_reference(means)
        if batch_size == 1:
            metas = replay_as_deployed(scoring, stale, answers, config, progress)
        else:
            pairs = generated_pairs(stale, answers, config)
            results = scoring.replay_batch(pairs, batch_size=batch_size, progress=progress)
            metas = [r.metadata for r in results]
        replayed = {it.id: meta for it, meta in zip(stale, metas, strict=True)}
    return [replayed.get(it.id) or answers[it.id]["metadata"] for it in items], len(stale)


def fit_captured(
    scorer: Any,
    model: Any,
    labeled: dict[str, list[QAItem]],
    answers: AnswerRows,
    judgments: Verdicts,
    config: CalibrationConfig,
    means: Any,
    store: RunStore,
    *,
    progress: bool = True,
) -> tuple[Any, np.ndarray]:
    """Fit ``scorer`` on inputs captured while generating and score the calibration split.

    Reference answers: Φ from their cached states and ``means``; train and calibration
    answers: the geometry captured with ``means`` installed (answers generated otherwise are
    replayed: train batched, calibration one sequence per pass). The calibration scores are
    then what the deployed guard computes while generating.
    """
    check_two_classes(labeled, judgments, config)

    def split_labels(name: str) -> list[bool]:
        return labels(labeled[name], judgments)

    reference = reference_responses(labeled["reference"], answers, store, means)
    train, n_train = answers_with_phi(
        model,
        labeled["train"],
        answers,
        config,
        means,
        batch_size=config.replay_batch_size,
        progress=progress,
    )
    scorer.fit(
        list(zip(reference, split_labels("reference"), strict=True)),
        list(zip(train, split_labels("train"), strict=True)),
        reference_means=means,
    )
    del reference, train
    cal, n_cal = answers_with_phi(
        model, labeled["calibration"], answers, config, means, batch_size=1, progress=progress
    )
    if n_train or n_cal:
        logger.info("replayed %d train and %d calibration answers (no capture)", n_train, n_cal)
    return scorer, np.asarray(scorer.score_many(cal), dtype=np.float64)
