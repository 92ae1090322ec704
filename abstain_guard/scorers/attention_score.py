"""LLM-Check's attention score (lm-polygraph ``AttentionScore``): the log-determinant of
one layer's self-attention over prompt + answer."""

from __future__ import annotations

from typing import Any

import numpy as np

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import InvalidInputError
from abstain_guard.scorers._model_access import ModelScorer, prompt_and_answer_ids


def attention_score(diagonals: np.ndarray, eps: float = 1e-12) -> float:
    """LLM-Check attention score: ``−(1/H) Σ_h Σ_i log(A_h[i, i] + eps)`` from the attention
    diagonals ``[H, T]`` of one layer."""
    d = np.asarray(diagonals, dtype=np.float64)
    if d.ndim != 2 or d.size == 0:
        raise InvalidInputError("diagonals must be [heads, tokens], non-empty.")
    return float(-np.mean(np.sum(np.log(d + eps), axis=1)))


class AttentionScoreScorer(ModelScorer):
    """LLM-Check attention score (lm-polygraph ``AttentionScore``): one eager-attention
    forward over prompt + answer (EOS included when generated), layer ``L//2``,
    ``−(1/H) Σ_h Σ_i log(A_h[i, i] + 1e-12)`` over the whole sequence.

    The model's attention implementation is switched to ``eager`` for the forward and
    restored afterwards (do not score concurrently with generation on the same model).
    """

    kind = "attention_score"

    def __init__(self, model: Any, layer: int | None = None) -> None:
        super().__init__(model)
        self.layer = layer

    def _config(self) -> dict[str, Any]:
        return {"layer": self.layer}

    def diagonals(self, response: ResponseLike) -> np.ndarray:
        """Attention diagonals ``[H, T]`` of the scored layer."""
        import torch

        from abstain_guard.adapters.capture.attention import attention_implementation

        hf = self.model.hf_model
        prompt, answer = prompt_and_answer_ids(response)
        layer = self.layer if self.layer is not None else int(hf.config.num_hidden_layers // 2)
        ids = torch.tensor([prompt + answer], dtype=torch.long)
        with torch.no_grad(), attention_implementation(hf, "eager"):
            out = hf(input_ids=ids, output_attentions=True)
        attn = out.attentions[layer][0]
        return attn.diagonal(dim1=-2, dim2=-1).float().numpy().astype(np.float64)

    def score(self, response: ResponseLike) -> float:
        return attention_score(self.diagonals(response))
