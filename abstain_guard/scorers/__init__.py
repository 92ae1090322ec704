"""Every uncertainty scorer the guard runs on a live answer, one file per method.

A scorer maps one chat-model response to a float, **higher = more uncertain**
(:class:`Scorer`); artifacts store its ``kind`` and the registry (:func:`build_scorer`,
:func:`scorer_from_state`, :func:`scorer_names`) resolves the kind to its class here.

* likelihood, reading only logprobs (no torch): :mod:`.perplexity`,
  :mod:`.max_sequence_probability`, :mod:`.mean_token_entropy`;
* hidden-state probes: :mod:`.probe` (one class, six presets), :mod:`.likelihood_probe`;
* hidden-state geometry (the paper's method): :mod:`.geometry` (``geometry`` and, on the
  features fast capture produces, ``geometry_fast``), :mod:`.geometry_plus` (with the
  likelihood, judged per response);
* :mod:`.calibrated` — the paper's XGBoost calibration of any one-dimensional score;
* one forward pass per answer: :mod:`.p_true`, :mod:`.attention_score`;
* K sampled answers per prompt: :mod:`.sar`, :mod:`.semantic_entropy`, :mod:`.eigenscore`.
* black-box, text only, on any LangChain chat model: :mod:`.blackbox` (semantic sets and the
  spectral scores of K sampled answers), :mod:`.verbalized_confidence`.

Shared helpers live in private modules (``_base``, ``_registry``, ``_features``, ...); their
public names are exported here.

``import abstain_guard.scorers`` loads neither torch, transformers, scikit-learn nor xgboost:
a scorer module imports them where it fits, runs XGBoost or runs the model, so every stored
linear probe and likelihood scorer loads and scores with numpy and scipy alone.

May import: ``abstain_guard.adapters`` (inside the functions that run the model),
``abstain_guard.contract``, ``abstain_guard.errors``.

Example::

    from abstain_guard.scorers import build_scorer
    scorer = build_scorer("perplexity")
    scorer.score(ai_message)  # exp(-mean token log-probability)
"""

from __future__ import annotations

from abstain_guard.scorers._aux_models import (
    ChatModelEquivalence,
    NLIEquivalence,
    SentenceSimilarity,
    SimilarityEquivalence,
    default_similarity_model_path,
)
from abstain_guard.scorers._base import Scorer, ScorerState
from abstain_guard.scorers._blackbox_sampling import (
    SamplingPlan,
    SimilarityModel,
)
from abstain_guard.scorers._calibrator import Gaussian, fit_gaussian, response_uncertainty
from abstain_guard.scorers._features import (
    ReferenceInputs,
    TokenBlock,
    family_slices,
    feature_width,
    layers_of_width,
    reference_inputs,
    token_block,
    with_capture,
)
from abstain_guard.scorers._model_access import ModelScorer, question_from_prompt
from abstain_guard.scorers._registry import (
    build_scorer,
    register_scorer,
    require_answer_route,
    scorer_class,
    scorer_from_state,
    scorer_names,
    scorer_spec,
)
from abstain_guard.scorers._sampling import SampleSource
from abstain_guard.scorers.attention_score import AttentionScoreScorer
from abstain_guard.scorers.blackbox import BlackBoxScorer
from abstain_guard.scorers.calibrated import CalibratedScorer
from abstain_guard.scorers.eigenscore import EigenScoreScorer
from abstain_guard.scorers.geometry import GeometryScorer
from abstain_guard.scorers.geometry_plus import GeometryPlusScorer
from abstain_guard.scorers.likelihood_probe import LikelihoodProbeScorer
from abstain_guard.scorers.max_sequence_probability import MaxSequenceProbabilityScorer
from abstain_guard.scorers.mean_token_entropy import MeanTokenEntropyScorer
from abstain_guard.scorers.p_true import PTrueScorer
from abstain_guard.scorers.perplexity import PerplexityScorer
from abstain_guard.scorers.probe import HiddenStateProbe
from abstain_guard.scorers.sar import SARScorer
from abstain_guard.scorers.semantic_entropy import SemanticEntropyScorer
from abstain_guard.scorers.verbalized_confidence import VerbalizedConfidenceScorer

__all__ = [
    "AttentionScoreScorer",
    "BlackBoxScorer",
    "CalibratedScorer",
    "ChatModelEquivalence",
    "EigenScoreScorer",
    "Gaussian",
    "GeometryPlusScorer",
    "GeometryScorer",
    "HiddenStateProbe",
    "LikelihoodProbeScorer",
    "MaxSequenceProbabilityScorer",
    "MeanTokenEntropyScorer",
    "ModelScorer",
    "NLIEquivalence",
    "PTrueScorer",
    "PerplexityScorer",
    "ReferenceInputs",
    "SARScorer",
    "SampleSource",
    "SamplingPlan",
    "Scorer",
    "ScorerState",
    "SemanticEntropyScorer",
    "SentenceSimilarity",
    "SimilarityEquivalence",
    "SimilarityModel",
    "TokenBlock",
    "VerbalizedConfidenceScorer",
    "build_scorer",
    "default_similarity_model_path",
    "family_slices",
    "feature_width",
    "fit_gaussian",
    "layers_of_width",
    "question_from_prompt",
    "reference_inputs",
    "register_scorer",
    "require_answer_route",
    "response_uncertainty",
    "scorer_class",
    "scorer_from_state",
    "scorer_names",
    "scorer_spec",
    "token_block",
    "with_capture",
]
