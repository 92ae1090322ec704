"""``max_sequence_probability``: ``−Σ_t log p_t`` over the generated tokens (lm-polygraph MSP).
Reads only logprobs: no torch needed; a missing or malformed entry raises
:class:`~abstain_guard.errors.ScoringError`."""

from __future__ import annotations

from typing import ClassVar

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.scorers._likelihood import StatelessScorer, token_logprobs


class MaxSequenceProbabilityScorer(StatelessScorer):
    """Negative log-probability of the whole answer: ``−Σ_t log p_t`` (lm-polygraph MSP)."""

    kind = "max_sequence_probability"
    family: ClassVar[str] = "likelihood"
    reads: ClassVar[frozenset[str]] = frozenset({"logprobs"})

    def score(self, response: ResponseLike) -> float:
        lp = token_logprobs(response)
        return float(-lp.sum()) + 0.0  # + 0.0 turns -0.0 into 0.0
