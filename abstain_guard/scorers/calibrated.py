"""The paper's XGBoost calibration applied to any one-dimensional score (appendix)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import (
    ArtifactSchemaError,
    InvalidInputError,
    NotFittedError,
    ScoringError,
)
from abstain_guard.scorers._base import Scorer, ScorerState
from abstain_guard.scorers._calibrator import (
    XGB_SETTINGS,
    booster_from_bytes,
    booster_to_bytes,
    fit_xgb_calibrator,
    xgb_settings,
)
from abstain_guard.scorers._registry import scorer_from_state


class CalibratedScorer(Scorer):
    """The paper's XGBoost calibration applied to a 1-D baseline score.

    ``fit`` trains ``binary:logistic`` XGBoost on ``[base.score(r)]`` → correctness of
    ``r`` (early stopping on a stratified hold-out of ``validation_fraction``); ``score``
    returns ``1 − p̂(correct)`` (higher = more uncertain).

    Args:
        base: any scorer (its score is the single feature).
    """

    kind = "calibrated"
    family: ClassVar[str] = "calibrated"

    def __init__(
        self,
        base: Scorer,
        xgb_params: Mapping[str, Any] | None = None,
        num_boost_round: int = 500,
        early_stopping_rounds: int = 30,
        validation_fraction: float = 0.2,
        random_state: int = 0,
    ) -> None:
        if not isinstance(base, Scorer):
            raise InvalidInputError("base must be a Scorer.")
        self.base = base
        self.xgb_params = dict(xgb_params or {})
        self.num_boost_round = int(num_boost_round)
        self.early_stopping_rounds = int(early_stopping_rounds)
        self.validation_fraction = float(validation_fraction)
        self.random_state = int(random_state)

    @property
    def name(self) -> str:
        return f"calibrated_{self.base.name}"

    def fit(self, train: Sequence[tuple[ResponseLike, bool]]) -> CalibratedScorer:
        """Score ``train`` responses with the base scorer and fit the calibrator."""
        pairs = list(train)
        scores = self.base.score_many([r for r, _ in pairs])
        return self.fit_scores(scores, [c for _, c in pairs])

    def fit_scores(self, scores: ArrayLike, correct: ArrayLike) -> CalibratedScorer:
        """Fit on precomputed base scores ``[n]`` and labels ``[n]``."""
        x = np.asarray(scores, dtype=np.float64).reshape(-1, 1)
        y = np.asarray(correct, dtype=np.float64)
        if x.shape[0] != y.shape[0]:
            raise InvalidInputError("scores and correct must have the same length.")
        if not np.all(np.isfinite(x)):
            raise InvalidInputError("Base scores contain NaN or inf; drop those responses.")
        self.booster_, self.fit_info_ = fit_xgb_calibrator(
            x, y, np.arange(x.shape[0]), **xgb_settings(self)
        )
        return self

    def _check_fitted(self) -> None:
        if not hasattr(self, "booster_"):
            raise NotFittedError("CalibratedScorer is not fitted: call fit(train) first.")

    def calibrate(self, scores: ArrayLike) -> np.ndarray:
        """``1 − p̂(correct)`` for precomputed base scores ``[n]``."""
        self._check_fitted()
        x = np.asarray(scores, dtype=np.float64).reshape(-1, 1)
        if not np.all(np.isfinite(x)):
            raise ScoringError("A base score is NaN or inf; it cannot be calibrated.")
        return 1.0 - np.asarray(self.booster_.inplace_predict(x), dtype=np.float64)

    def score(self, response: ResponseLike) -> float:
        return float(self.calibrate([self.base.score(response)])[0])

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        return self.calibrate(self.base.score_many(responses))

    def prepare(self, runnable: Any) -> Any:
        return self.base.prepare(runnable)

    def answer_route(self) -> str | None:
        """Its base scorer's: it calibrates the base's score of the same answer."""
        return self.base.answer_route()

    def get_state(self) -> ScorerState:
        """Own params + the base state nested under ``base.`` prefixes."""
        self._check_fitted()
        base = self.base.get_state()
        return ScorerState(
            kind=self.kind,
            params={
                **xgb_settings(self),
                "fit_info": self.fit_info_,
                "base": {"kind": base.kind, "params": base.params},
            },
            arrays={f"base.{k}": v for k, v in base.arrays.items()},
            files={
                "calibrator.ubj": booster_to_bytes(self.booster_),
                **{f"base.{k}": v for k, v in base.files.items()},
            },
        )

    @classmethod
    def from_state(cls, state: ScorerState, base: Scorer | None = None) -> CalibratedScorer:
        """Rebuild; ``base`` may be given (needed when the base scorer needs a model)."""
        p = state.params
        try:
            if base is None:
                base_state = ScorerState(
                    kind=p["base"]["kind"],
                    params=dict(p["base"]["params"]),
                    arrays={k[5:]: v for k, v in state.arrays.items() if k.startswith("base.")},
                    files={k[5:]: v for k, v in state.files.items() if k.startswith("base.")},
                )
                base = scorer_from_state(base_state)
            scorer = cls(base, **{name: p[name] for name in XGB_SETTINGS})
            scorer.fit_info_ = dict(p["fit_info"])
            scorer.booster_ = booster_from_bytes(state.files["calibrator.ubj"])
        except KeyError as exc:
            raise ArtifactSchemaError(
                f"Calibrated scorer state is missing {exc}; the artifact is incomplete."
            ) from exc
        return scorer
