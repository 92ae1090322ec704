"""The scorer registry: the one list of scorers.

Artifacts store a scorer's ``kind``; the guard, ``calibrate``, ``evaluate``, the CLI and the
docs read :func:`scorer_names` / :func:`scorer_spec`; :func:`build_scorer` is the one way to
build a scorer by name and :func:`scorer_from_state` rebuilds a stored one. Each built-in
kind points at its own module in :mod:`abstain_guard.scorers` by a ``"module:Class"`` string,
imported on first use, so that the scorers needing torch or xgboost are loaded only when an
artifact or a config names them. The kinds are stored in artifacts: never rename one.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from abstain_guard.errors import ArtifactSchemaError, ConfigError
from abstain_guard.scorers._base import Scorer, ScorerState

__all__ = [
    "ScorerInput",
    "ScorerSpec",
    "build_scorer",
    "register_scorer",
    "scorer_class",
    "scorer_from_state",
    "scorer_names",
    "scorer_spec",
]


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
        family: ``"likelihood"``, ``"geometry"``, ``"probe"`` (hidden-state probes),
            ``"floor"`` (``type_floor``), ``"model"`` (P(True), attention score),
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


_HOME = "abstain_guard.scorers"

_REGISTRY: dict[str, ScorerSpec] = {
    spec.kind: spec
    for spec in (
        ScorerSpec(
            "perplexity",
            f"{_HOME}.perplexity:PerplexityScorer",
            "likelihood",
            summary="exp(-mean token log-probability) (paper Eq. 1)",
        ),
        ScorerSpec(
            "max_sequence_probability",
            f"{_HOME}.max_sequence_probability:MaxSequenceProbabilityScorer",
            "likelihood",
            summary="-sum of token log-probabilities",
        ),
        ScorerSpec(
            "mean_token_entropy",
            f"{_HOME}.mean_token_entropy:MeanTokenEntropyScorer",
            "likelihood",
            summary="mean full-vocabulary token entropy",
        ),
        ScorerSpec(
            "geometry",
            f"{_HOME}.geometry:GeometryScorer",
            "geometry",
            fitted=True,
            summary="hidden-state geometry -> Mahalanobis -> XGBoost -> perplexity (paper 4.5)",
        ),
        ScorerSpec(
            "geometry_fast",
            f"{_HOME}.geometry_fast:GeometryFastScorer",
            "geometry",
            fitted=True,
            summary="geometry on fast-capture features (omega_dir, theta, phi; no omega_prop); "
            "deployed with capture='fast'",
        ),
        ScorerSpec(
            "geometry_plus",
            f"{_HOME}.geometry_plus:GeometryPlusScorer",
            "geometry",
            fitted=True,
            summary="geometry distances + likelihood summarised per response -> logistic "
            "model -> P(wrong)",
        ),
        ScorerSpec(
            "probe_mid",
            f"{_HOME}.probe:ProbeMid",
            "probe",
            fitted=True,
            summary="SAPLMA-style logistic probe: residual stream, middle layer (L//2), "
            "mean over generated tokens",
        ),
        ScorerSpec(
            "probe_upper",
            f"{_HOME}.probe:ProbeUpper",
            "probe",
            fitted=True,
            summary="SAPLMA-style logistic probe: residual stream, upper layer (4L//5), "
            "mean over generated tokens",
        ),
        ScorerSpec(
            "probe_concat",
            f"{_HOME}.probe:ProbeConcat",
            "probe",
            fitted=True,
            summary="SAPLMA-style logistic probe: residual stream, middle + upper layers, "
            "mean over generated tokens",
        ),
        ScorerSpec(
            "probe_mid_last",
            f"{_HOME}.probe:ProbeMidLast",
            "probe",
            fitted=True,
            summary="SAPLMA-style logistic probe: residual stream, middle layer (L//2), "
            "last generated position",
        ),
        ScorerSpec(
            "probe_upper_last",
            f"{_HOME}.probe:ProbeUpperLast",
            "probe",
            fitted=True,
            summary="SAPLMA-style logistic probe: residual stream, upper layer (4L//5), "
            "last generated position",
        ),
        ScorerSpec(
            "probe_concat_last",
            f"{_HOME}.probe:ProbeConcatLast",
            "probe",
            fitted=True,
            summary="SAPLMA-style logistic probe: residual stream, middle + upper layers, "
            "last generated position",
        ),
        ScorerSpec(
            "likelihood_probe",
            f"{_HOME}.likelihood_probe:LikelihoodProbeScorer",
            "probe",
            fitted=True,
            summary="probe_concat's out-of-fold logit + likelihood summary -> logistic model",
        ),
        ScorerSpec(
            "type_floor",
            f"{_HOME}.type_floor:TypeFloorScorer",
            "floor",
            fitted=True,
            summary="1 - train accuracy of the question's type (a measuring floor, not a guard)",
        ),
        ScorerSpec(
            "calibrated",
            f"{_HOME}.calibrated:CalibratedScorer",
            "calibrated",
            fitted=True,
            summary="XGBoost calibration of any one-dimensional score (paper appendix)",
        ),
        ScorerSpec(
            "p_true",
            f"{_HOME}.p_true:PTrueScorer",
            "model",
            reads="model",
            summary="-log p('True') when the model judges its own answer",
        ),
        ScorerSpec(
            "attention_score",
            f"{_HOME}.attention_score:AttentionScoreScorer",
            "model",
            reads="model",
            summary="LLM-Check attention log-determinant at layer L//2",
        ),
        ScorerSpec(
            "eigenscore",
            f"{_HOME}.eigenscore:EigenScoreScorer",
            "sampling",
            reads="samples",
            summary="log-determinant of K sampled answers' middle-layer embeddings",
        ),
        ScorerSpec(
            "sar",
            f"{_HOME}.sar:SARScorer",
            "sampling",
            reads="samples",
            summary="shifting attention to relevance over K sampled answers",
        ),
        ScorerSpec(
            "semantic_entropy",
            f"{_HOME}.semantic_entropy:SemanticEntropyScorer",
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
            "Register custom scorers with abstain_guard.scorers.register_scorer before loading."
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
