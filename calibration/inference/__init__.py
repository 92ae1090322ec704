"""Scorers that run when the guard answers.

The guard loads them from an artifact through the scorer registry
(:mod:`abstain_guard.scoring`); the likelihood scorers, which need no model, live in core
(:mod:`abstain_guard.likelihood`). One module per family:

* :mod:`.geometry` — the paper's geometry scorer; its inputs are read by :mod:`.features`
  and its Gaussians / XGBoost model live in :mod:`.calibrator`;
* :mod:`.geometry_fast` — the same scorer on the features fast capture produces (ω_dir,
  Θ, Φ; no ω_prop), deployed with ``capture="fast"`` (``geometry_fast``);
* :mod:`.geometry_plus` — the same inputs with the token likelihood, summarised per
  response and judged by a logistic model fitted on train (``geometry_plus``);
* :mod:`.calibrated` — the same XGBoost calibration on any one-dimensional score;
* :mod:`.p_true`, :mod:`.attention` — scorers that run the model once per answer
  (sharing :mod:`.model_access`);
* :mod:`.sampling` — SAR, semantic entropy, EigenScore over K sampled answers;
* :mod:`.aux_models` — the sentence-similarity and NLI models they use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from abstain_guard.lazy import lazy_attributes

if TYPE_CHECKING:
    from abstain_guard.calibration.inference.attention import AttentionScoreScorer, attention_score
    from abstain_guard.calibration.inference.calibrated import CalibratedScorer
    from abstain_guard.calibration.inference.calibrator import fit_gaussian, response_uncertainty
    from abstain_guard.calibration.inference.features import FAMILIES, TokenBlock, token_block
    from abstain_guard.calibration.inference.geometry import GeometryScorer
    from abstain_guard.calibration.inference.geometry_fast import GeometryFastScorer
    from abstain_guard.calibration.inference.geometry_plus import GeometryPlusScorer
    from abstain_guard.calibration.inference.model_access import question_from_prompt
    from abstain_guard.calibration.inference.p_true import PTRUE_PROMPT, PTrueScorer
    from abstain_guard.calibration.inference.sampling import (
        EigenScoreScorer,
        SampleSource,
        SARScorer,
        SemanticEntropyScorer,
        eigenscore,
        greedy_semantic_classes,
        sar,
        semantic_entropy,
        token_sar,
    )

__all__ = [
    "FAMILIES",
    "PTRUE_PROMPT",
    "AttentionScoreScorer",
    "CalibratedScorer",
    "EigenScoreScorer",
    "GeometryFastScorer",
    "GeometryPlusScorer",
    "GeometryScorer",
    "PTrueScorer",
    "SARScorer",
    "SampleSource",
    "SemanticEntropyScorer",
    "TokenBlock",
    "attention_score",
    "eigenscore",
    "fit_gaussian",
    "greedy_semantic_classes",
    "question_from_prompt",
    "response_uncertainty",
    "sar",
    "semantic_entropy",
    "token_block",
    "token_sar",
]

# Lazy: these modules import torch, transformers and xgboost. The guard imports one scorer
# module through the registry, and building/ uses aux_models; neither should load every family.
_HOME = {
    "AttentionScoreScorer": "abstain_guard.calibration.inference.attention",
    "attention_score": "abstain_guard.calibration.inference.attention",
    "CalibratedScorer": "abstain_guard.calibration.inference.calibrated",
    "fit_gaussian": "abstain_guard.calibration.inference.calibrator",
    "response_uncertainty": "abstain_guard.calibration.inference.calibrator",
    "FAMILIES": "abstain_guard.calibration.inference.features",
    "TokenBlock": "abstain_guard.calibration.inference.features",
    "token_block": "abstain_guard.calibration.inference.features",
    "GeometryScorer": "abstain_guard.calibration.inference.geometry",
    "GeometryFastScorer": "abstain_guard.calibration.inference.geometry_fast",
    "GeometryPlusScorer": "abstain_guard.calibration.inference.geometry_plus",
    "question_from_prompt": "abstain_guard.calibration.inference.model_access",
    "PTRUE_PROMPT": "abstain_guard.calibration.inference.p_true",
    "PTrueScorer": "abstain_guard.calibration.inference.p_true",
    "EigenScoreScorer": "abstain_guard.calibration.inference.sampling",
    "SampleSource": "abstain_guard.calibration.inference.sampling",
    "SARScorer": "abstain_guard.calibration.inference.sampling",
    "SemanticEntropyScorer": "abstain_guard.calibration.inference.sampling",
    "eigenscore": "abstain_guard.calibration.inference.sampling",
    "greedy_semantic_classes": "abstain_guard.calibration.inference.sampling",
    "sar": "abstain_guard.calibration.inference.sampling",
    "semantic_entropy": "abstain_guard.calibration.inference.sampling",
    "token_sar": "abstain_guard.calibration.inference.sampling",
}


__getattr__ = lazy_attributes(__name__, _HOME)
