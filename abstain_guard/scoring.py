"""The scorer protocol: how an uncertainty score is computed and stored.

A scorer maps one chat-model response to a float, **higher = more uncertain**. Its fitted
state (if any) is a :class:`ScorerState`: JSON parameters, numpy arrays and raw files
(for example an XGBoost UBJ model), which :class:`~abstain_guard.artifact.GuardArtifact`
writes without pickle. Scorers are looked up by ``kind`` when an artifact is loaded.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from abstain_guard.errors import ArtifactSchemaError, InvalidInputError

JSONValue = Any

ResponseLike = Any
"""An ``AIMessage`` (or any object with ``response_metadata``) or a metadata mapping."""


def response_metadata_of(response: ResponseLike) -> Mapping[str, Any]:
    """Return the ``response_metadata`` mapping of a message, or the mapping itself.

    Raises:
        InvalidInputError: if ``response`` is neither a message nor a mapping.
    """
    if isinstance(response, Mapping):
        return response
    meta = getattr(response, "response_metadata", None)
    if isinstance(meta, Mapping):
        return meta
    raise InvalidInputError(
        f"Expected an AIMessage (or a response_metadata dict), got {type(response).__name__}. "
        "Pass the message returned by the chat model."
    )


@dataclass
class ScorerState:
    """Serializable state of a scorer.

    Attributes:
        kind: registry name of the scorer class (``"perplexity"``, ``"geometry"``, ...).
        params: JSON-serializable constructor parameters and scalar fitted values.
        arrays: named numpy arrays (saved to ``.npz`` with ``allow_pickle=False``).
        files: named raw files (for example ``{"calibrator.ubj": b"..."}``).
    """

    kind: str
    params: dict[str, JSONValue] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)


class Scorer(ABC):
    """Base class of every uncertainty scorer (higher score = more uncertain)."""

    kind: ClassVar[str]

    @property
    def name(self) -> str:
        """Human-readable name used in traces and reports (defaults to ``kind``)."""
        return self.kind

    @abstractmethod
    def score(self, response: ResponseLike) -> float:
        """Uncertainty of one response. Raises :class:`~abstain_guard.errors.ScoringError`
        when the response lacks what the scorer reads; never returns NaN."""

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        """Scores of several responses, shape ``[n]``."""
        return np.asarray([self.score(r) for r in responses], dtype=np.float64)

    def prepare(self, runnable: Any) -> Any:
        """Return the runnable the guard should run so that its output can be scored.

        The default returns ``runnable`` unchanged. Scorers that need the model to compute
        extra signals (the geometry scorer installs its reference directions) override it.
        """
        return runnable

    @abstractmethod
    def get_state(self) -> ScorerState:
        """The state to store in an artifact."""

    @classmethod
    @abstractmethod
    def from_state(cls, state: ScorerState) -> Scorer:
        """Rebuild a scorer from :meth:`get_state`'s output."""


_REGISTRY: dict[str, str | type[Scorer]] = {
    "perplexity": "abstain_guard.likelihood:PerplexityScorer",
    "max_sequence_probability": "abstain_guard.likelihood:MaxSequenceProbabilityScorer",
    "mean_token_entropy": "abstain_guard.likelihood:MeanTokenEntropyScorer",
    "geometry": "abstain_guard.calibration.inference.geometry:GeometryScorer",
    "calibrated": "abstain_guard.calibration.inference.baselines:CalibratedScorer",
    # model-based baselines: from_state needs the chat model (``from_state(state, model=...)``)
    "p_true": "abstain_guard.calibration.inference.baselines:PTrueScorer",
    "attention_score": "abstain_guard.calibration.inference.baselines:AttentionScoreScorer",
    "eigenscore": "abstain_guard.calibration.inference.baselines:EigenScoreScorer",
    "sar": "abstain_guard.calibration.inference.baselines:SARScorer",
    "semantic_entropy": "abstain_guard.calibration.inference.baselines:SemanticEntropyScorer",
}


def register_scorer(kind: str, cls: type[Scorer] | str) -> None:
    """Register a scorer class (or ``"module:Class"`` path) under ``kind``."""
    _REGISTRY[kind] = cls


def scorer_class(kind: str) -> type[Scorer]:
    """Resolve a registered scorer kind to its class.

    Raises:
        ArtifactSchemaError: if ``kind`` is not registered.
    """
    target = _REGISTRY.get(kind)
    if target is None:
        raise ArtifactSchemaError(
            f"Unknown scorer kind {kind!r}; known kinds: {sorted(_REGISTRY)}. "
            "Register custom scorers with abstain_guard.scoring.register_scorer before loading."
        )
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # pragma: no cover - depends on installed extras
            raise ArtifactSchemaError(
                f"Scorer {kind!r} needs {module_name}, which could not be imported ({exc}). "
                "Install the local extra: pip install 'abstain-guard[local]'."
            ) from exc
        resolved = getattr(module, attr)
        _REGISTRY[kind] = resolved
        return resolved  # type: ignore[no-any-return]
    return target


def scorer_from_state(state: ScorerState) -> Scorer:
    """Rebuild any registered scorer from its stored state."""
    return scorer_class(state.kind).from_state(state)
