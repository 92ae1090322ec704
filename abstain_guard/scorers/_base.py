"""The scorer protocol: how an uncertainty score is computed and stored.

A scorer maps one chat-model response to a float, **higher = more uncertain**. Its fitted
state (if any) is a :class:`ScorerState`: JSON parameters, numpy arrays and raw files
(for example an XGBoost UBJ model), which :class:`~abstain_guard.GuardArtifact`
writes without pickle. Every scorer class subclasses :class:`Scorer` and lives in
:mod:`abstain_guard.scorers`, one file per method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from abstain_guard.contract.metadata import ResponseLike

__all__ = ["JSONValue", "Scorer", "ScorerState"]

JSONValue = Any


@dataclass
class ScorerState:
    """Serializable state of a scorer.

    Attributes:
        kind: registry name of the scorer class (``"perplexity"``, ``"geometry"``, ...).
        params: JSON-serializable constructor parameters and scalar fitted values.
        arrays: named numpy arrays (saved to ``.npz`` with ``allow_pickle=False``).
        files: named raw files (for example ``{"calibrator.ubj": b"..."}``).
    """

    kind: str
    params: dict[str, JSONValue] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)


class Scorer(ABC):
    """Base class of every uncertainty scorer (higher score = more uncertain)."""

    kind: ClassVar[str]

    @property
    def name(self) -> str:
        """Human-readable name used in traces and reports (defaults to ``kind``)."""
        return self.kind

    @abstractmethod
    def score(self, response: ResponseLike) -> float:
        """Uncertainty of one response. Raises :class:`~abstain_guard.errors.ScoringError`
        when the response lacks what the scorer reads; never returns NaN."""

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        """Scores of several responses, shape ``[n]``."""
        return np.asarray([self.score(r) for r in responses], dtype=np.float64)

    def prepare(self, runnable: Any) -> Any:
        """Return the runnable the guard should run so that its output can be scored.

        The default returns ``runnable`` unchanged. Scorers that need the model to compute
        extra signals (the geometry scorer installs its reference directions) override it.
        """
        return runnable

    @abstractmethod
    def get_state(self) -> ScorerState:
        """The state to store in an artifact."""

    @classmethod
    @abstractmethod
    def from_state(cls, state: ScorerState) -> Scorer:
        """Rebuild a scorer from :meth:`get_state`'s output."""
