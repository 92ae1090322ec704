"""``perplexity``: the paper's Eq. (1), ``exp(−mean_t log p_t)``, over every generated token in
``response_metadata["logprobs"]["content"]`` — a generated end-of-sequence token included when
the model reports it. (lm-polygraph's ``Perplexity`` is the log of this; the order, and so
every conformal decision, is the same.) Reads only logprobs: no torch needed.
"""

from __future__ import annotations

import math
from typing import ClassVar

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.scorers._likelihood import StatelessScorer, token_logprobs


class PerplexityScorer(StatelessScorer):
    """Perplexity of the generated answer, paper Eq. (1): ``exp(−(1/N) Σ_t log p_t)``.

    Reads only ``response_metadata["logprobs"]["content"][i]["logprob"]``, so it works
    around any chat model that returns OpenAI-style logprobs (no torch needed).
    """

    kind = "perplexity"
    family: ClassVar[str] = "likelihood"
    reads: ClassVar[frozenset[str]] = frozenset({"logprobs"})

    def score(self, response: ResponseLike) -> float:
        lp = token_logprobs(response)
        value = math.exp(min(-float(lp.mean()), 700.0))
        return value
