"""``sar``: shifting attention to relevance over K sampled answers (Duan et al.; lm-polygraph
``SAR``), its pure formulas :func:`token_sar` and :func:`sar`, and :class:`SARScorer`."""

from __future__ import annotations

from typing import Any

import numpy as np

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import InvalidInputError
from abstain_guard.scorers._aux_models import SentenceSimilarity
from abstain_guard.scorers._model_access import prompt_and_answer_ids, question_from_prompt
from abstain_guard.scorers._sampling import SampleSource, SamplingScorer


def token_sar(logprobs: np.ndarray, token_similarity: np.ndarray) -> float:
    """tokenSAR of one answer: ``Σ_t −log p_t · R_t / Σ_j R_j`` with ``R_t = 1 − sim_t``.

    Args:
        logprobs: ``[n]`` token log-probabilities.
        token_similarity: ``[n]`` similarity of the answer with and without token ``t``.

    When every ``R_t`` is 0 (removing any token changes nothing) the weights are uniform,
    i.e. tokenSAR is the mean negative log-likelihood (lm-polygraph would divide by zero).
    """
    lp = np.asarray(logprobs, dtype=np.float64)
    r = 1.0 - np.asarray(token_similarity, dtype=np.float64)
    if lp.shape != r.shape or lp.size == 0:
        raise InvalidInputError("logprobs and token_similarity must be non-empty, same shape.")
    total = r.sum()
    weights = r / total if total > 0 else np.full(r.shape, 1.0 / r.size)
    return float(np.sum(-lp * weights))


def sar(token_sars: np.ndarray, sentence_similarity: np.ndarray, t: float = 1e-3) -> float:
    """SAR over K samples: ``mean_k −log(p̃_k + (1/t) Σ_{j≠k} sim(s_k, s_j) p̃_j)`` with
    ``p̃_k = exp(−tokenSAR_k)``.

    Args:
        token_sars: ``[K]``; sentence_similarity: ``[K, K]``; t: temperature (0.001).
    """
    ts = np.asarray(token_sars, dtype=np.float64)
    sim = np.asarray(sentence_similarity, dtype=np.float64)
    if ts.ndim != 1 or ts.size == 0 or sim.shape != (ts.size, ts.size):
        raise InvalidInputError("token_sars must be [K] and sentence_similarity [K, K], K ≥ 1.")
    p = np.exp(-ts)
    off = sim * (1.0 - np.eye(ts.size))
    relevance = (off * p[None, :]).sum(axis=1) / t
    return float(np.mean(-np.log(relevance + p)))


class SARScorer(SamplingScorer):
    """SAR (Duan et al.; lm-polygraph ``SAR``): token relevance from a sentence-similarity
    model, sentence relevance across K samples, ``t = 0.001``.

    Args:
        model: the chat model.
        similarity: a :class:`SentenceSimilarity`, a local model path, or ``None`` for the
            shipped all-MiniLM-L6-v2 (cosine clipped to [0, 1]).
        samples: a shared :class:`SampleSource` (default: a new one with ``num_samples``).
        t: SAR temperature.
    """

    kind = "sar"

    def __init__(
        self,
        model: Any,
        similarity: SentenceSimilarity | str | None = None,
        samples: SampleSource | None = None,
        num_samples: int = 10,
        t: float = 1e-3,
    ) -> None:
        super().__init__(model, samples, num_samples)
        self.similarity = (
            similarity
            if isinstance(similarity, SentenceSimilarity)
            else SentenceSimilarity(similarity)
        )
        self.t = float(t)

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "t": self.t, "similarity": str(self.similarity.path)}

    def _sim(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        return np.clip(self.similarity.pairs(pairs), 0.0, 1.0)

    def _token_similarity(self, question: str, ids: list[int]) -> np.ndarray:
        tok = self.model.tokenizer
        if len(ids) <= 1:
            return np.full(len(ids), 0.5)
        full = f"{question} {tok.decode(ids, skip_special_tokens=True)}"
        pairs = [
            (full, f"{question} {tok.decode(ids[:i] + ids[i + 1 :], skip_special_tokens=True)}")
            for i in range(len(ids))
        ]
        sims = self._sim(pairs)
        special = set(getattr(tok, "all_special_ids", []) or [])
        sims[[i for i, t in enumerate(ids) if t in special]] = 1.0
        return sims

    def score(self, response: ResponseLike) -> float:
        prompt, _ = prompt_and_answer_ids(response)
        question = question_from_prompt(self.model.tokenizer, prompt)
        samples = self._nonempty_samples(prompt)
        token_sars = np.asarray(
            [
                token_sar(
                    s.logprobs[: len(s.content_ids)],
                    self._token_similarity(question, s.content_ids),
                )
                for s in samples
            ]
        )
        texts = [s.text for s in samples]
        sim = np.clip(self.similarity.matrix(texts), 0.0, 1.0)
        return sar(token_sars, sim, self.t)
