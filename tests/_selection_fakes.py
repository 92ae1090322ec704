"""A synthetic calibrated artifact and a recorded scorer choice for selection tests."""

from __future__ import annotations

import numpy as np

from abstain_guard import GuardArtifact
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.guarantee.selection import (
    ScorerSelection,
    record_choice,
)
from abstain_guard.scorers import build_scorer


def _artifact(selection: ScorerSelection | None, n: int = 800, seed: int = 4) -> GuardArtifact:
    rng = np.random.default_rng(seed)
    correct = rng.random(n) < 0.6
    scores = np.where(correct, 0.3, 0.7) + rng.normal(0, 0.25, n)
    metadata = {} if selection is None else {"selection": selection.to_json()}
    groups = np.where(np.arange(n) % 2 == 0, "even", "odd")
    return GuardArtifact.from_calibration(
        scorer=build_scorer("perplexity"),
        calibration=CalibrationSet(scores, correct, groups=groups),
        metadata=metadata,
    )


def _recorded(art: GuardArtifact, k: int = 5) -> ScorerSelection:
    names = ["perplexity"] + [f"other{i}" for i in range(k - 1)]
    return record_choice(
        "perplexity", art.scores, art.correct, names, 0.3, 0.1, data="cal", choice="by hand"
    )
