"""``eigenscore``: log-determinant of K sampled answers' middle-layer embeddings (LLM-Check /
INSIDE; lm-polygraph ``EigenScore``): the pure formula :func:`eigenscore` and
:class:`EigenScoreScorer`."""

from __future__ import annotations

from typing import Any

import numpy as np

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import InvalidInputError
from abstain_guard.scorers._model_access import prompt_and_answer_ids
from abstain_guard.scorers._sampling import SampleSource, SamplingScorer


def eigenscore(embeddings: np.ndarray, alpha: float = 1e-3) -> float:
    """EigenScore: ``mean(log eig(Z J_d Zᵀ + αI))`` for sample embeddings ``Z`` ``[K, D]``
    (``J_d = I − 11ᵀ/D`` centres each embedding over its features; eigenvalues ≤ 0 are
    replaced by 1e-10 as in lm-polygraph)."""
    z = np.asarray(embeddings, dtype=np.float64)
    if z.ndim != 2 or z.shape[0] == 0:
        raise InvalidInputError("embeddings must be [K, D] with K ≥ 1.")
    zc = z - z.mean(axis=1, keepdims=True)  # Z J_d without forming the D×D matrix
    cov = zc @ zc.T + alpha * np.eye(z.shape[0])
    eig = np.linalg.eigvalsh(cov)
    return float(np.mean(np.log(np.where(eig > 0, eig, 1e-10))))


class EigenScoreScorer(SamplingScorer):
    """EigenScore (LLM-Check / INSIDE; lm-polygraph ``EigenScore``): middle-layer
    (``L//2``) embedding of the last token of each of K samples, ``α = 1e-3``."""

    kind = "eigenscore"

    def __init__(
        self,
        model: Any,
        samples: SampleSource | None = None,
        num_samples: int = 10,
        alpha: float = 1e-3,
    ) -> None:
        super().__init__(model, samples, num_samples)
        self.alpha = float(alpha)

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "alpha": self.alpha}

    def score(self, response: ResponseLike) -> float:
        prompt, _ = prompt_and_answer_ids(response)
        return eigenscore(self.samples.middle_layer_embeddings(prompt), self.alpha)
