"""Supervised hidden-state probes (SAPLMA-style): a logistic regression on the residual
stream of one or two layers, the strongest closed-book baseline in the literature
(PARALLAX, arXiv 2605.17028).

Input: ``response_metadata["geometry"]["hidden"]`` — the decoder-layer outputs e^l at a
middle layer (``L // 2``) and an upper layer (``4L // 5``)
(:func:`abstain_guard.metadata.probe_layers`), at the position that predicts the last
generated token (``"last"``) or averaged over the positions that predict each generated
token (``"mean"``). The chat model records them while generating and replay records the
same, so the live guard reads exactly what calibration stored.

Fitting: the answers of the reference *and* train splits (the splits the geometry scorer is
fitted on; never calibration), features standardised, L2 strength chosen by 5-fold stratified
cross-validation (AUROC) on those answers only. Score: the predicted probability that the
answer is wrong (higher = more uncertain).

Kinds: ``probe_mid``, ``probe_upper``, ``probe_concat`` (both layers side by side) read the
mean over generated tokens; ``probe_mid_last``, ``probe_upper_last``, ``probe_concat_last``
the last position.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from scipy.special import expit

from abstain_guard.errors import (
    ArtifactSchemaError,
    InvalidInputError,
    NotFittedError,
    ScoringError,
)
from abstain_guard.metadata import ResponseLike, ResponseMetadata
from abstain_guard.runnables import map_chat_models
from abstain_guard.scorers._base import Scorer, ScorerState
from abstain_guard.scorers._features import CaptureMode, with_capture
from abstain_guard.scorers._linear_probe import (
    PROBE_CS,
    LinearProbe,
    check_cs,
    fit_linear_probe,
)

__all__ = [
    "PROBE_KINDS",
    "HiddenStateProbe",
    "ProbeConcat",
    "ProbeConcatLast",
    "ProbeMid",
    "ProbeMidLast",
    "ProbeScorerBase",
    "ProbeUpper",
    "ProbeUpperLast",
    "hidden_features",
    "labeled_responses",
]

Layer = Literal["mid", "upper", "concat"]
Summary = Literal["mean", "last"]

PROBE_KINDS: dict[str, tuple[Layer, Summary]] = {
    "probe_mid": ("mid", "mean"),
    "probe_upper": ("upper", "mean"),
    "probe_concat": ("concat", "mean"),
    "probe_mid_last": ("mid", "last"),
    "probe_upper_last": ("upper", "last"),
    "probe_concat_last": ("concat", "last"),
}
"""Each probe kind's layer choice and token summary."""


def hidden_features(response: ResponseLike, layer: Layer, summary: Summary) -> np.ndarray:
    """One response's probe input: ``[D]`` (one layer) or ``[2D]`` (``concat``).

    Raises:
        ScoringError: the response has no hidden-state summary (see
            :meth:`ResponseMetadata.hidden`).
    """
    meta = getattr(response, "metadata", response)  # a ReplayResult, a message, a dict
    _, arr = ResponseMetadata.of(meta).hidden(summary)
    if arr.shape[0] < 2:
        raise ScoringError(
            f"The response's hidden-state summary has {arr.shape[0]} layers; expected the "
            "middle and the upper probe layers."
        )
    if layer == "mid":
        return arr[0]
    if layer == "upper":
        return arr[1]
    return np.concatenate([arr[0], arr[1]])


def labeled_responses(
    reference: Sequence[tuple[Any, bool]], train: Sequence[tuple[Any, bool]]
) -> tuple[list[Any], np.ndarray]:
    """The reference and train answers pooled, with their labels."""
    pairs = [*reference, *train]
    return [r for r, _ in pairs], np.asarray([bool(c) for _, c in pairs], dtype=bool)


class ProbeScorerBase(Scorer):
    """What the probe scorers share: the CV grid, the unfitted check, the width check and
    scoring one response as a batch of one (so it gets bitwise its score in a batch).

    Args:
        cs: inverse L2 strengths; cross-validation on the fitting answers picks one.
        cv_folds: stratified folds of that cross-validation.
        random_state: seed of the folds.
    """

    #: the fitted attribute whose absence means "not fitted"
    fitted_attr: ClassVar[str] = "probe_"
    #: the capture mode the deployed guard generates in (:meth:`prepare`) and calibration
    #: generates its scored answers in: fast capture records the residual stream and the
    #: log-probabilities bitwise as full capture does (the same attention kernels; capture
    #: only reads them: ``tests/test_probe_capture.py``) at far lower cost
    capture: ClassVar[CaptureMode] = "fast"
    #: the feature width the probe was fitted on (set by ``fit`` / ``from_state``)
    width_: int

    def __init__(
        self, cs: Sequence[float] = PROBE_CS, cv_folds: int = 5, random_state: int = 0
    ) -> None:
        self.cs = check_cs(cs, cv_folds)
        self.cv_folds = int(cv_folds)
        self.random_state = int(random_state)

    def _check_fitted(self) -> None:
        if not hasattr(self, self.fitted_attr):
            raise NotFittedError(
                f"{type(self).__name__} is not fitted: call fit(reference, train) or load it "
                "from an artifact first."
            )

    def _check_width(self, width: int) -> None:
        if width != self.width_:
            raise ScoringError(
                f"The response's hidden states have width {width} but {self.kind} was "
                f"fitted on {self.width_}; use the artifact calibrated for this model."
            )

    def score(self, response: ResponseLike) -> float:
        """Predicted probability that ``response`` is wrong."""
        return float(self.score_many([response])[0])

    def prepare(self, runnable: Any) -> Any:
        """Every GeometryChatModel inside ``runnable`` switched to :attr:`capture` (fast):
        the same features as full capture, bitwise, without the per-source attention
        decomposition the probe never reads."""
        self._check_fitted()
        return map_chat_models(runnable, lambda model: with_capture(model, self.capture))


class HiddenStateProbe(ProbeScorerBase):
    """Logistic probe on the residual stream (a kind of :data:`PROBE_KINDS`).

    Args:
        cs: inverse L2 strengths; cross-validation on the fitting answers picks one.
        cv_folds: stratified folds of that cross-validation.
        random_state: seed of the folds.

    Fitted attributes: ``probe_`` (:class:`~._linear_probe.LinearProbe`), ``width_`` (the
    feature count), ``fit_info_``.
    """

    kind: ClassVar[str] = "probe_concat"
    layer: ClassVar[Layer] = "concat"
    summary: ClassVar[Summary] = "mean"

    def features(self, responses: Sequence[Any]) -> np.ndarray:
        """``[n, F]`` probe inputs."""
        rows = [hidden_features(r, self.layer, self.summary) for r in responses]
        if not rows:
            return np.zeros((0, 0), dtype=np.float64)
        return np.stack(rows).astype(np.float64)

    def fit(
        self,
        reference: Sequence[tuple[Any, bool]],
        train: Sequence[tuple[Any, bool]],
        *,
        reference_means: Any = None,
    ) -> HiddenStateProbe:
        """Fit on the reference and train answers (``(response, correct)`` pairs; a response
        is a message, its metadata, or a ``ReplayResult``). ``reference_means`` is accepted
        (``calibrate`` passes the geometry means it fitted) and not used.

        Raises:
            InsufficientDataError: fewer than ``cv_folds`` answers of a class.
            ScoringError: an answer without hidden-state summaries.
        """
        del reference_means
        responses, y = labeled_responses(reference, train)
        x = self.features(responses)
        self.probe_ = fit_linear_probe(
            x, y, self.cs, self.cv_folds, self.random_state, f"The {self.kind} scorer"
        )
        self.width_ = int(x.shape[1])
        self.fit_info_ = {
            "responses": [int(y.sum()), int((~y).sum())],
            "C": self.probe_.C,
            "cv_auroc_by_C": self.probe_.cv_auroc,
        }
        return self

    def scores_of(self, x: np.ndarray) -> np.ndarray:
        """P(wrong) ``[n]`` of probe inputs ``x [n, F]``."""
        self._check_fitted()
        if x.shape[0] == 0:
            return np.zeros(0, dtype=np.float64)
        self._check_width(int(x.shape[1]))
        return np.asarray(expit(-self.probe_.logits(x)), dtype=np.float64)

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        """Scores ``[n]``."""
        self._check_fitted()
        return self.scores_of(self.features(responses))

    def get_state(self) -> ScorerState:
        """JSON params and the standardisation / coefficient arrays."""
        self._check_fitted()
        params: dict[str, Any] = {
            "cs": list(self.cs),
            "cv_folds": self.cv_folds,
            "random_state": self.random_state,
            "layer": self.layer,
            "summary": self.summary,
            "width": self.width_,
            "fit_info": self.fit_info_,
            **self.probe_.params(),
        }
        json.dumps(params)
        return ScorerState(kind=self.kind, params=params, arrays=self.probe_.arrays("probe."))

    @classmethod
    def from_state(cls, state: ScorerState) -> HiddenStateProbe:
        """Rebuild a fitted probe from :meth:`get_state` output."""
        p = dict(state.params)
        if (p.get("layer"), p.get("summary")) != (cls.layer, cls.summary):
            raise ArtifactSchemaError(
                f"The {state.kind} state reads layer={p.get('layer')!r}, "
                f"summary={p.get('summary')!r}; {cls.kind} reads {cls.layer!r}, {cls.summary!r}."
            )
        try:
            scorer = cls(cs=p["cs"], cv_folds=p["cv_folds"], random_state=p["random_state"])
            scorer.width_ = int(p["width"])
        except (KeyError, InvalidInputError) as exc:
            raise ArtifactSchemaError(f"The {state.kind} state is malformed ({exc}).") from exc
        scorer.probe_ = LinearProbe.from_parts(p, state.arrays, "probe.")
        scorer.fit_info_ = dict(p.get("fit_info", {}))
        if scorer.probe_.coef.shape != (scorer.width_,):
            raise ArtifactSchemaError(f"The {state.kind} coefficients do not match its width.")
        return scorer


class ProbeMid(HiddenStateProbe):
    """Middle layer (``L // 2``), mean over generated tokens."""

    kind: ClassVar[str] = "probe_mid"
    layer: ClassVar[Layer] = "mid"
    summary: ClassVar[Summary] = "mean"


class ProbeUpper(HiddenStateProbe):
    """Upper layer (``4L // 5``), mean over generated tokens."""

    kind: ClassVar[str] = "probe_upper"
    layer: ClassVar[Layer] = "upper"
    summary: ClassVar[Summary] = "mean"


class ProbeConcat(HiddenStateProbe):
    """Both layers side by side, mean over generated tokens."""

    kind: ClassVar[str] = "probe_concat"
    layer: ClassVar[Layer] = "concat"
    summary: ClassVar[Summary] = "mean"


class ProbeMidLast(HiddenStateProbe):
    """Middle layer at the position predicting the last generated token."""

    kind: ClassVar[str] = "probe_mid_last"
    layer: ClassVar[Layer] = "mid"
    summary: ClassVar[Summary] = "last"


class ProbeUpperLast(HiddenStateProbe):
    """Upper layer at the position predicting the last generated token."""

    kind: ClassVar[str] = "probe_upper_last"
    layer: ClassVar[Layer] = "upper"
    summary: ClassVar[Summary] = "last"


class ProbeConcatLast(HiddenStateProbe):
    """Both layers at the position predicting the last generated token."""

    kind: ClassVar[str] = "probe_concat_last"
    layer: ClassVar[Layer] = "concat"
    summary: ClassVar[Summary] = "last"
