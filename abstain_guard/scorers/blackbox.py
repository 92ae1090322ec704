"""Black-box consistency scorers: how much k answers sampled from any chat model disagree,
with no logprobs or hidden states (:class:`BlackBoxScorer`; the formulas are
:mod:`abstain_guard.scorers._similarity_graph`).

``statistic`` picks the score, each a preset of its own kind:

* ``"discrete_semantic_entropy"`` / ``"num_semantic_sets"``: entropy and number of the answers'
  meaning classes (Farquhar et al., Nature 2024), by bidirectional entailment of a local
  NLI model or cosine similarity at ``equivalence_threshold`` (the default, offline);
* ``"eigv"``, ``"degree"``, ``"eccentricity"``: the spectral scores over the graph of the
  answers' cosine similarities (Lin, Trivedi & Sun, 2023); ``of="answer"`` scores the primary
  answer instead of the question (degree and eccentricity).

The scorer wraps the guarded model (:meth:`BlackBoxScorer.prepare`: a
:class:`~abstain_guard.scorers._blackbox_sampling.SampledChatModel` under its
:class:`~abstain_guard.scorers._blackbox_sampling.SamplingPlan`) and scores the samples
each response carries. Its state records k, the temperature, the primary-answer rule and the
similarity model (name and weights digest); loading it checks the digest, scoring checks the
plan. The score is sampled: a deployment reproduces its distribution, not its bits
(docs/guarantees.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import ConfigError
from abstain_guard.scorers._base import ScorerState
from abstain_guard.scorers._blackbox_sampling import (
    SampledAnswers,
    SampledScorer,
    SamplingPlan,
    SimilarityModel,
    read_samples,
)
from abstain_guard.scorers._similarity_graph import (
    ECCENTRICITY_EIGENVALUE_THRESHOLD,
    affinity,
    cosine_similarities,
    degree_uncertainties,
    degree_uncertainty,
    discrete_semantic_entropy,
    eccentricities,
    eccentricity_uncertainty,
    eigenvalue_uncertainty,
    equivalent_by_threshold,
    number_of_semantic_sets,
    semantic_ids,
)

EQUIVALENCE_THRESHOLD = 0.8
"""Cosine similarity at which two sampled answers fall into one meaning class (embedding
similarity; the semantic-entropy baseline's threshold)."""

SET_STATISTICS = ("discrete_semantic_entropy", "num_semantic_sets")
"""Statistics over meaning classes (equivalence: entailment or a similarity threshold)."""

GRAPH_STATISTICS = ("eigv", "degree", "eccentricity")
"""Statistics over the weighted similarity graph (an embedding model's cosine)."""


def graph_statistic(
    statistic: str,
    similarity: np.ndarray,
    *,
    primary_index: int = 0,
    of: str = "question",
    eigenvalue_threshold: float = ECCENTRICITY_EIGENVALUE_THRESHOLD,
) -> float:
    """A spectral uncertainty of k answers from their similarities (pure).

    Args:
        statistic: one of :data:`GRAPH_STATISTICS`.
        similarity: ``[k, k]`` similarities of the answers.
        primary_index: the answer scored when ``of="answer"``.
        of: ``"question"`` (U of the paper) or ``"answer"`` (the primary answer's
            ``1 - C_Deg`` / ``-C_Ecc``; degree and eccentricity only).
        eigenvalue_threshold: the eccentricity's embedding (eigenvalues below it).
    """
    w = affinity(similarity)
    if of == "answer":
        if statistic == "degree":
            return float(degree_uncertainties(w)[primary_index])
        if statistic == "eccentricity":
            return float(eccentricities(w, eigenvalue_threshold)[primary_index])
        raise ConfigError(f"of='answer' is defined for degree and eccentricity, not {statistic}.")
    if statistic == "eigv":
        return eigenvalue_uncertainty(w)
    if statistic == "degree":
        return degree_uncertainty(w)
    if statistic == "eccentricity":
        return eccentricity_uncertainty(w, eigenvalue_threshold)
    raise ConfigError(f"Unknown graph statistic {statistic!r}; one of {GRAPH_STATISTICS}.")


def _set_statistic(statistic: str, equivalent: np.ndarray) -> float:
    ids = semantic_ids(equivalent)
    if statistic == "discrete_semantic_entropy":
        return discrete_semantic_entropy(ids)
    return float(number_of_semantic_sets(ids))


class BlackBoxScorer(SampledScorer):
    """Disagreement of k answers sampled from any LangChain chat model (no logprobs needed).

    Args:
        statistic: :data:`SET_STATISTICS` or :data:`GRAPH_STATISTICS`.
        num_samples: k (Farquhar et al. and lm-polygraph: 10).
        temperature: the sampling temperature.
        primary: which sample the guard returns: ``"first"`` or ``"medoid"``.
        similarity_model: a local sentence-transformers folder (``similarity_kind=
            "embedding"``) or NLI model folder (``"nli"``, meaning classes only); None: the
            shipped all-MiniLM-L6-v2.
        similarity_kind: ``"embedding"`` or ``"nli"``.
        equivalence_threshold: cosine at which two answers mean the same (embedding).
        eigenvalue_threshold: the eccentricity's spectral embedding.
        of: ``"question"`` or ``"answer"`` (degree and eccentricity of the primary answer).
        max_concurrency: sampling calls in flight per question.

    Raises:
        ConfigError: an unknown statistic, or one the similarity model cannot give.
    """

    kind = "discrete_semantic_entropy"
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        name: {"statistic": name} for name in (*SET_STATISTICS, *GRAPH_STATISTICS)
    }

    def __init__(
        self,
        statistic: str = "discrete_semantic_entropy",
        num_samples: int = 10,
        temperature: float = 1.0,
        primary: str = "first",
        similarity_model: str | None = None,
        similarity_kind: str = "embedding",
        equivalence_threshold: float = EQUIVALENCE_THRESHOLD,
        eigenvalue_threshold: float = ECCENTRICITY_EIGENVALUE_THRESHOLD,
        of: str = "question",
        max_concurrency: int = 8,
        *,
        similarity: SimilarityModel | None = None,
    ) -> None:
        if statistic not in (*SET_STATISTICS, *GRAPH_STATISTICS):
            raise ConfigError(
                f"Unknown black-box statistic {statistic!r}; one of "
                f"{(*SET_STATISTICS, *GRAPH_STATISTICS)}."
            )
        if of not in ("question", "answer") or (
            of == "answer" and statistic not in ("degree", "eccentricity")
        ):
            raise ConfigError(
                f"of must be 'question' (or 'answer' for degree and eccentricity), got {of!r}."
            )
        self.similarity = similarity or SimilarityModel(similarity_kind, similarity_model)
        if self.similarity.kind == "nli" and (statistic in GRAPH_STATISTICS or primary == "medoid"):
            raise ConfigError(
                f"{statistic} with primary={primary!r} needs an embedding model; an NLI model "
                "gives meaning classes only."
            )
        if int(num_samples) < 2:
            raise ConfigError("A black-box consistency score needs num_samples >= 2.")
        self.kind = statistic
        self.statistic = statistic
        self.equivalence_threshold = float(equivalence_threshold)
        self.eigenvalue_threshold = float(eigenvalue_threshold)
        self.of = of
        self.plan = SamplingPlan(
            int(num_samples),
            float(temperature),
            primary,
            self.similarity,
            max_concurrency=int(max_concurrency),
        )

    def score(self, response: ResponseLike) -> float:
        """The statistic of the samples ``response`` carries.

        Raises:
            ScoringError: the response carries no samples.
            SamplingMismatchError: they were drawn under another plan.
        """
        return self.score_samples(read_samples(response, self.plan))

    def score_samples(self, samples: SampledAnswers) -> float:
        """The statistic of stored samples (the texts are embedded or compared here)."""
        if self.statistic in SET_STATISTICS:
            eq = self.similarity.equivalences(
                samples.question, samples.texts, self.equivalence_threshold
            )
            return _set_statistic(self.statistic, eq)
        return self.score_embeddings(
            self.similarity.embeddings(samples.texts), samples.primary_index
        )

    def score_embeddings(self, embeddings: np.ndarray, primary_index: int = 0) -> float:
        """The statistic from stored answer embeddings ``[k, E]`` (numpy only; meaning
        classes by cosine at ``equivalence_threshold``)."""
        similarity = cosine_similarities(embeddings)
        if self.statistic in SET_STATISTICS:
            eq = equivalent_by_threshold(similarity, self.equivalence_threshold)
            return _set_statistic(self.statistic, eq)
        return graph_statistic(
            self.statistic,
            similarity,
            primary_index=primary_index,
            of=self.of,
            eigenvalue_threshold=self.eigenvalue_threshold,
        )

    def get_state(self) -> ScorerState:
        """The statistic's settings, the sampling plan and the similarity model's record."""
        return ScorerState(
            kind=self.kind,
            params={
                "statistic": self.statistic,
                "num_samples": self.plan.num_samples,
                "temperature": self.plan.temperature,
                "primary": self.plan.primary,
                "max_concurrency": self.plan.max_concurrency,
                "equivalence_threshold": self.equivalence_threshold,
                "eigenvalue_threshold": self.eigenvalue_threshold,
                "of": self.of,
                "similarity": self.similarity.record(),
            },
        )
