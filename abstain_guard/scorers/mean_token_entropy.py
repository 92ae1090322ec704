"""``mean_token_entropy``: the mean of the per-token full-vocabulary entropies in
``response_metadata["entropy"]`` (written by local chat models). Optionally, and only when
asked for, the entropy of the renormalised ``top_logprobs`` (an approximation).

Empty answers and missing or malformed entries raise
:class:`~abstain_guard.errors.ScoringError`; scores are never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from abstain_guard.contract.metadata import ResponseLike, ResponseMetadata
from abstain_guard.errors import ScoringError
from abstain_guard.scorers._base import Scorer, ScorerState


def _top_logprob_entropy(entry: Any, i: int) -> float:
    tops = entry.get("top_logprobs") if isinstance(entry, Mapping) else None
    if not isinstance(tops, Sequence) or len(tops) == 0:
        raise ScoringError(
            f"Token {i} has no 'top_logprobs'; the entropy fallback needs them "
            "(request top_logprobs from the chat model)."
        )
    lps = []
    for t in tops:
        lp = t.get("logprob") if isinstance(t, Mapping) else None
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ScoringError(f"Token {i} has a malformed top_logprobs entry {t!r:.80}.")
        lps.append(float(lp))
    arr = np.asarray(lps)
    arr = arr - arr.max()
    p = np.exp(arr)
    p /= p.sum()
    nz = p > 0
    return float(-(p[nz] * np.log(p[nz])).sum())


class MeanTokenEntropyScorer(Scorer):
    """Mean over generated tokens of the predictive entropy (lm-polygraph MeanTokenEntropy).

    Reads ``response_metadata["entropy"]`` (a list of per-token full-vocabulary entropies
    in nats, one per generated token, as written by the local chat model).

    Args:
        top_logprobs_fallback: when True and ``entropy`` is absent, use the entropy of the
            renormalised ``top_logprobs`` distribution of each token instead. This is an
            approximation (it ignores the vocabulary outside the top-k) that is *not*
            comparable with full entropies, so calibrate and guard with the same setting.
            Default False (missing entropies raise ScoringError).
    """

    kind = "mean_token_entropy"
    family: ClassVar[str] = "likelihood"
    reads: ClassVar[frozenset[str]] = frozenset({"entropy"})

    def __init__(self, top_logprobs_fallback: bool = False) -> None:
        self.top_logprobs_fallback = bool(top_logprobs_fallback)

    def score(self, response: ResponseLike) -> float:
        meta = ResponseMetadata.of(response)
        values = meta.entropy()
        if values is not None:
            if values.ndim != 1 or values.size == 0:
                raise ScoringError(
                    "response_metadata['entropy'] must be a non-empty list with one entropy "
                    "per generated token (an empty answer cannot be scored)."
                )
            if not np.isfinite(values).all() or (values < -1e-9).any():
                raise ScoringError("response_metadata['entropy'] has NaN/inf/negative values.")
            return float(values.mean())
        if not self.top_logprobs_fallback:
            raise ScoringError(
                "The response has no response_metadata['entropy'] (per-token entropies). Use "
                "a chat model that reports them (GeometryChatModel does), or construct "
                "MeanTokenEntropyScorer(top_logprobs_fallback=True) to approximate them from "
                "top_logprobs."
            )
        content = meta.logprob_entries()
        return float(np.mean([_top_logprob_entropy(e, i) for i, e in enumerate(content)]))

    def get_state(self) -> ScorerState:
        return ScorerState(
            kind=self.kind, params={"top_logprobs_fallback": self.top_logprobs_fallback}
        )

    @classmethod
    def from_state(cls, state: ScorerState) -> Scorer:
        if state.kind != cls.kind:
            raise ScoringError(f"State of kind {state.kind!r} cannot build a {cls.kind!r} scorer.")
        return cls(top_logprobs_fallback=bool(state.params.get("top_logprobs_fallback", False)))

    def __repr__(self) -> str:
        return f"MeanTokenEntropyScorer(top_logprobs_fallback={self.top_logprobs_fallback})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, MeanTokenEntropyScorer)
            and other.top_logprobs_fallback == self.top_logprobs_fallback
        )

    def __hash__(self) -> int:
        return hash((type(self), self.top_logprobs_fallback))
