"""The scorer protocol: how an uncertainty score is computed and stored.

A scorer maps one chat-model response to a float, **higher = more uncertain**. Its fitted
state (if any) is a :class:`ScorerState`: JSON parameters, numpy arrays and raw files
(for example an XGBoost UBJ model), which :class:`~abstain_guard.artifact.GuardArtifact`
writes without pickle.

The registry here is the one list of scorers: artifacts store a scorer's ``kind``, and the
guard, ``calibrate``, ``evaluate``, the CLI and the docs read :func:`scorer_names` /
:func:`scorer_spec`; :func:`build_scorer` is the one way to build a scorer by name.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import numpy as np

from abstain_guard.errors import ArtifactSchemaError, ConfigError
from abstain_guard.metadata import ResponseLike

JSONValue = Any


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


ScorerInput = Literal["metadata", "model", "samples"]
"""What a scorer reads: the response metadata only, the chat model too (a forward pass per
response), or K sampled answers per prompt as well."""


@dataclass(frozen=True)
class ScorerSpec:
    """One registered scorer.

    Attributes:
        kind: registry name, stored in artifacts (``ScorerState.kind``).
        target: the class, or ``"module:Class"`` imported on first use (scorers that need
            torch or xgboost live in the optional ``local`` extra, so core must not import
            them eagerly).
        family: ``"likelihood"``, ``"geometry"``, ``"model"`` (P(True), attention score),
            ``"sampling"`` (SAR, semantic entropy, EigenScore), ``"calibrated"`` or
            ``"custom"``.
        reads: what :func:`build_scorer` must pass (see :data:`ScorerInput`).
        fitted: ``True`` when the scorer is fitted on reference/train answers before the
            conformal step (``calibrate`` generates those splits for it).
        summary: one line for the CLI and docs.
    """

    kind: str
    target: str | type[Scorer]
    family: str
    reads: ScorerInput = "metadata"
    fitted: bool = False
    summary: str = ""


_LIKELIHOOD = "abstain_guard.likelihood"
_INFERENCE = "abstain_guard.calibration.inference"

_REGISTRY: dict[str, ScorerSpec] = {
    spec.kind: spec
    for spec in (
        ScorerSpec(
            "perplexity",
            f"{_LIKELIHOOD}:PerplexityScorer",
            "likelihood",
            summary="exp(-mean token log-probability) (paper Eq. 1)",
        ),
        ScorerSpec(
            "max_sequence_probability",
            f"{_LIKELIHOOD}:MaxSequenceProbabilityScorer",
            "likelihood",
            summary="-sum of token log-probabilities",
        ),
        ScorerSpec(
            "mean_token_entropy",
            f"{_LIKELIHOOD}:MeanTokenEntropyScorer",
            "likelihood",
            summary="mean full-vocabulary token entropy",
        ),
        ScorerSpec(
            "geometry",
            f"{_INFERENCE}.geometry:GeometryScorer",
            "geometry",
            fitted=True,
            summary="hidden-state geometry -> Mahalanobis -> XGBoost -> perplexity (paper 4.5)",
        ),
        ScorerSpec(
            "geometry_fast",
            f"{_INFERENCE}.geometry_fast:GeometryFastScorer",
            "geometry",
            fitted=True,
            summary="geometry on fast-capture features (omega_dir, theta, phi; no omega_prop); "
            "deployed with capture='fast'",
        ),
        ScorerSpec(
            "geometry_plus",
            f"{_INFERENCE}.geometry_plus:GeometryPlusScorer",
            "geometry",
            fitted=True,
            summary="geometry distances + likelihood summarised per response -> logistic "
            "model -> P(wrong)",
        ),
        ScorerSpec(
            "calibrated",
            f"{_INFERENCE}.calibrated:CalibratedScorer",
            "calibrated",
            fitted=True,
            summary="XGBoost calibration of any one-dimensional score (paper appendix)",
        ),
        ScorerSpec(
            "p_true",
            f"{_INFERENCE}.p_true:PTrueScorer",
            "model",
            reads="model",
            summary="-log p('True') when the model judges its own answer",
        ),
        ScorerSpec(
            "attention_score",
            f"{_INFERENCE}.attention:AttentionScoreScorer",
            "model",
            reads="model",
            summary="LLM-Check attention log-determinant at layer L//2",
        ),
        ScorerSpec(
            "eigenscore",
            f"{_INFERENCE}.sampling:EigenScoreScorer",
            "sampling",
            reads="samples",
            summary="log-determinant of K sampled answers' middle-layer embeddings",
        ),
        ScorerSpec(
            "sar",
            f"{_INFERENCE}.sampling:SARScorer",
            "sampling",
            reads="samples",
            summary="shifting attention to relevance over K sampled answers",
        ),
        ScorerSpec(
            "semantic_entropy",
            f"{_INFERENCE}.sampling:SemanticEntropyScorer",
            "sampling",
            reads="samples",
            summary="entropy over meaning classes of K sampled answers",
        ),
    )
}


def register_scorer(
    kind: str,
    cls: type[Scorer] | str,
    *,
    family: str = "custom",
    reads: ScorerInput = "metadata",
    fitted: bool = False,
    summary: str = "",
) -> None:
    """Register a scorer class (or ``"module:Class"`` path) under ``kind`` so artifacts
    that store it can be loaded."""
    _REGISTRY[kind] = ScorerSpec(kind, cls, family, reads, fitted, summary)


def scorer_spec(kind: str) -> ScorerSpec:
    """The registry entry of ``kind``.

    Raises:
        ArtifactSchemaError: if ``kind`` is not registered.
    """
    spec = _REGISTRY.get(kind)
    if spec is None:
        raise ArtifactSchemaError(
            f"Unknown scorer kind {kind!r}; known kinds: {sorted(_REGISTRY)}. "
            "Register custom scorers with abstain_guard.scoring.register_scorer before loading."
        )
    return spec


def scorer_names(
    *, family: str | Sequence[str] | None = None, fitted: bool | None = None
) -> tuple[str, ...]:
    """Registered kinds in registry order, optionally only some families / fitted ones."""
    families = (family,) if isinstance(family, str) else family
    return tuple(
        s.kind
        for s in _REGISTRY.values()
        if (families is None or s.family in families) and (fitted is None or s.fitted == fitted)
    )


def scorer_class(kind: str) -> type[Scorer]:
    """Resolve a registered scorer kind to its class.

    Raises:
        ArtifactSchemaError: if ``kind`` is not registered or its module cannot be imported.
    """
    spec = scorer_spec(kind)
    target = spec.target
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # pragma: no cover - depends on installed extras
            raise ArtifactSchemaError(
                f"Scorer {kind!r} needs {module_name}, which could not be imported ({exc}). "
                "Install the local extra: pip install 'abstain-guard[local]'."
            ) from exc
        resolved: type[Scorer] = getattr(module, attr)
        _REGISTRY[kind] = replace(spec, target=resolved)
        return resolved
    return target


def build_scorer(kind: str, *, model: Any = None, samples: Any = None, **params: Any) -> Scorer:
    """A new, unfitted scorer of ``kind``: the one way to build a scorer by name.

    Args:
        kind: a registered kind (:func:`scorer_names`).
        model: the chat model, for scorers that read it (``reads`` ``"model"``/``"samples"``).
        samples: a shared ``SampleSource`` for sampling scorers (built from ``model`` when
            not given); scorers sharing one draw K samples once per prompt.
        **params: constructor parameters of the scorer.

    Raises:
        ConfigError: ``kind`` needs the chat model and none was given.
    """
    spec = scorer_spec(kind)
    cls = scorer_class(kind)
    if spec.reads == "metadata":
        return cls(**params)
    if model is None:
        raise ConfigError(
            f"Scorer {kind!r} reads the chat model ({spec.summary}); pass model=... "
            "(the GeometryChatModel that produced the responses)."
        )
    if spec.reads == "samples":
        return cls(model, samples=samples, **params)  # type: ignore[call-arg]
    return cls(model, **params)  # type: ignore[call-arg]


def scorer_from_state(state: ScorerState) -> Scorer:
    """Rebuild any registered scorer from its stored state."""
    return scorer_class(state.kind).from_state(state)
