"""The scorer protocol: how an uncertainty score is computed and stored.

A scorer maps one chat-model response to a float, **higher = more uncertain**. Its fitted
state (if any) is a :class:`ScorerState`: JSON parameters, numpy arrays and raw files
(for example an XGBoost UBJ model), which :class:`~abstain_guard.GuardArtifact`
writes without pickle. Every scorer class subclasses :class:`Scorer` and lives in
:mod:`abstain_guard.scorers`, one file per method; it declares what the registry needs to know
about it (:attr:`Scorer.kind`, :attr:`~Scorer.family`, :attr:`~Scorer.reads`,
:attr:`~Scorer.presets`).

A scorer module imports only numpy, scipy and the core package at import time: what fitting,
XGBoost or a forward pass needs is imported where it is used (:func:`optional_module`), so
that every stored scorer that scores with arrays alone loads and scores in the core install.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import MissingExtraError

EXTRAS: dict[str, str] = {
    "torch": "local",
    "transformers": "local",
    "sentence_transformers": "local",
    "sklearn": "calibration",
    "xgboost": "calibration",
}
"""The package extra that installs each optional top-level module a scorer imports."""


def optional_module(name: str, what: str) -> ModuleType:
    """``import name`` (``"xgboost"``, ``"sklearn.linear_model"``), needed for ``what``.

    Raises:
        MissingExtraError: it is not installed; the message names the extra to install.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        extra = EXTRAS.get(name.partition(".")[0], "local")
        raise MissingExtraError(
            f"{what} needs {name}, which could not be imported ({exc}). Install it with "
            f"pip install 'abstain-guard[{extra}]'."
        ) from exc


REPLAYED = frozenset({"logprobs", "entropy", "geometry", "hidden", "model"})
"""What a local model's teacher-forced replay of a given answer computes (its log-probabilities,
entropies, geometry and hidden states; ``"model"``: the scorers that run the model themselves
on the prompt and answer ids the replay records, such as P(True) or the attention score)."""


def given_answer_route(reads: frozenset[str] | None) -> str | None:
    """How a scorer reading ``reads`` scores an answer it did not generate (pure).

    ``"replay"``: the local model re-reads the answer in one teacher-forced pass
    (:data:`REPLAYED`); ``"samples"``: the answer takes the primary sample's place beside
    fresh samples (black-box scorers); None: it cannot (an undeclared custom scorer).
    """
    if reads is None or not reads:
        return None
    if reads <= REPLAYED:
        return "replay"
    if reads == frozenset({"samples"}):
        return "samples"
    return None


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
    params: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)


class Scorer(ABC):
    """Base class of every uncertainty scorer (higher score = more uncertain).

    What a scorer class declares (the registry reads these, nothing else keeps them):

    * ``kind`` — its registry name, stored in artifacts (never rename one);
    * ``family`` — ``"likelihood"``, ``"geometry"``, ``"probe"`` (hidden-state probes),
      ``"calibrated"``, ``"model"`` (one forward pass per answer), ``"sampling"`` (K sampled
      answers), ``"blackbox"`` (K answers sampled from any chat model, text only) or
      ``"custom"``;
    * ``reads`` — the response fields it reads (what a backend must write:
      :data:`abstain_guard.backends.BACKEND_FIELDS`); ``"model"`` means it is built with the
      chat model (a ``"sampling"`` scorer with a shared sample source too); ``None``: not
      declared (a custom scorer, built from its parameters alone, served by the exact engine);
      what it reads also says whether it can score an answer it did not generate
      (:meth:`answer_route`);
    * ``presets`` — further kinds it is stored under, each with its constructor parameters
      (one class, several named variants).

    A scorer with a ``fit`` method is fitted on the reference and train answers before the
    conformal step.
    """

    kind: str
    family: ClassVar[str] = "custom"
    reads: ClassVar[frozenset[str] | None] = None
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

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

    def answer_route(self) -> str | None:
        """How this scorer scores an answer it did not generate (``AbstentionGuard.check``):
        :func:`given_answer_route` of what its class reads; None: it cannot (a scorer that
        cannot for a reason of its own raises ``GivenAnswerError`` saying it)."""
        return given_answer_route(type(self).reads)

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
