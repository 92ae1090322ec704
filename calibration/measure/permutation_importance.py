"""Which geometry family the geometry scorer relies on: permutation ablation (paper §5.3)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import InvalidInputError
from abstain_guard.scorers import TokenBlock, family_slices
from abstain_guard.scorers.geometry import GeometryScorer

from . import metrics


@dataclass
class FeatureImportance:
    """Permutation ablation result (paper §5.3).

    Attributes:
        auroc: AUROC of the unpermuted scores; ``auprc`` likewise.
        drops: per family, ``{"auroc_mean", "auroc_sd", "auprc_mean", "auprc_sd"}`` of the
            drop (unpermuted − permuted) over ``n_repeats`` permutations.
    """

    auroc: float
    auprc: float
    drops: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"auroc": self.auroc, "auprc": self.auprc, "drops": self.drops}


def _split(geometry: np.ndarray, blocks: Sequence[TokenBlock]) -> list[TokenBlock]:
    """``blocks`` with their geometry rows replaced by consecutive rows of ``geometry``."""
    out, start = [], 0
    for b in blocks:
        n = b.logprob.shape[0]
        out.append(
            TokenBlock(geometry=geometry[start : start + n], logprob=b.logprob, entropy=b.entropy)
        )
        start += n
    return out


def permutation_importance(
    scorer: GeometryScorer,
    responses: Sequence[ResponseLike],
    labels: Sequence[bool],
    n_repeats: int = 5,
    random_state: int = 0,
) -> FeatureImportance:
    """Permute each of Ω, Θ, Φ^in, Φ^out across all tokens of ``responses`` (the rows of
    that family's columns shuffled together) and report the drop in AUROC/AUPRC (mean and
    sd over ``n_repeats``) of the fitted ``scorer``.

    Raises:
        InvalidInputError: ``responses`` and ``labels`` differ in length.
        NotFittedError: ``scorer`` is not fitted.
    """
    correct = np.asarray(labels, dtype=bool)
    if len(correct) != len(responses):
        raise InvalidInputError("responses and labels must have the same length.")
    blocks = scorer.token_blocks(responses)
    geom = np.concatenate([b.geometry for b in blocks])

    def aurocs(g: np.ndarray) -> tuple[float, float]:
        u = scorer.scores_of(_split(g, blocks))
        return float(metrics.auroc(u, correct)), float(metrics.auprc(u, correct))

    base_auroc, base_auprc = aurocs(geom)
    rng = np.random.default_rng(random_state)
    result = FeatureImportance(auroc=base_auroc, auprc=base_auprc)
    for fam, sl in family_slices(scorer.num_layers_, getattr(scorer, "capture", "full")).items():
        d_roc, d_prc = [], []
        for _ in range(n_repeats):
            g = geom.copy()
            g[:, sl] = geom[rng.permutation(geom.shape[0]), sl]
            a, p = aurocs(g)
            d_roc.append(base_auroc - a)
            d_prc.append(base_auprc - p)
        result.drops[fam] = {
            "auroc_mean": float(np.mean(d_roc)),
            "auroc_sd": float(np.std(d_roc, ddof=1)) if n_repeats > 1 else 0.0,
            "auprc_mean": float(np.mean(d_prc)),
            "auprc_sd": float(np.std(d_prc, ddof=1)) if n_repeats > 1 else 0.0,
        }
    return result
