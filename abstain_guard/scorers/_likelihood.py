"""What the likelihood scorers share: token log-probabilities from the response metadata
and the base of scorers without fitted state (no torch needed)."""

from __future__ import annotations

import numpy as np

from abstain_guard.contract.metadata import ResponseLike, ResponseMetadata
from abstain_guard.errors import ScoringError
from abstain_guard.scorers._base import Scorer, ScorerState


def token_logprobs(response: ResponseLike) -> np.ndarray:
    """Per-token log-probabilities of the generated tokens, shape ``[N]`` (N ≥ 1).

    Raises:
        ScoringError: when logprobs are missing, empty, or not finite numbers.
    """
    return ResponseMetadata.of(response).logprobs()


class StatelessScorer(Scorer):
    """Scorers without fitted state: the artifact stores only the kind and parameters."""

    def get_state(self) -> ScorerState:
        return ScorerState(kind=self.kind, params={})

    @classmethod
    def from_state(cls, state: ScorerState) -> Scorer:
        if state.kind != cls.kind:
            raise ScoringError(f"State of kind {state.kind!r} cannot build a {cls.kind!r} scorer.")
        return cls()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))
