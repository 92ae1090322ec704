"""`CalibrationSet`: the arrays calibration measured on its answers, as an artifact stores them.

The scores and labels of the ``n`` calibration answers (``calibration.npz``, with each answer's
group when calibration recorded one) and the optional arrays that live in side files of their
own (:data:`~abstain_guard.artifact.files.SIDE_FILES`). Each array is checked once, here; the
scores, labels and groups are made read-only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard.artifact.files import validate_calibration
from abstain_guard.guarantee.action_risk import check_action_statistics
from abstain_guard.guarantee.groups import check_groups
from abstain_guard.guarantee.partial_release import check_stream_statistics
from abstain_guard.guarantee.truth import check_human_labels

__all__ = ["CalibrationSet"]

_READ_ONLY = ("scores", "correct", "groups")


@dataclass(frozen=True, eq=False)
class CalibrationSet:
    """The calibration answers' arrays (any array-like in, read-only numpy arrays after).

    Attributes:
        scores: calibration scores ``[n]`` (float64, finite).
        correct: calibration labels ``[n]`` (bool; 0/1 accepted).
        groups: each answer's group ``[n]`` (str), for ``GuardConfig(group_by=...)``, or None.
        action_statistic: every calibration run's action statistic ``[n_runs]`` (n_runs ≥ n:
            runs whose final answer was not labeled count too; float64, ``inf`` for a run
            without a wrong tool call), for ``GuardConfig(action_risk_target=...)``
            (:mod:`abstain_guard.guarantee.action_risk`), or None.
        stream_first: each answer's first-chunk score ``[n]`` (``inf``: none) when calibrated
            with a chunk rule (``scores`` are then the stream statistics,
            :mod:`abstain_guard.contract.streaming`), or None.
        human: people's verdicts on a uniformly random sample ``[n]`` (int8: 1 correct,
            0 wrong, -1 not reviewed; risk mode then certifies the true error rate,
            :mod:`abstain_guard.guarantee.truth`), or None.
    """

    scores: np.ndarray
    correct: np.ndarray
    groups: np.ndarray | None = None
    action_statistic: np.ndarray | None = None
    stream_first: np.ndarray | None = None
    human: np.ndarray | None = None

    def __post_init__(self) -> None:
        scores, correct = validate_calibration(self.scores, self.correct)
        n = scores.size
        checked = {
            "scores": scores,
            "correct": correct,
            "groups": _maybe(self.groups, lambda g: check_groups(g, n)),
            "action_statistic": _maybe(self.action_statistic, check_action_statistics),
            "stream_first": _maybe(
                self.stream_first, lambda s: check_stream_statistics(s, scores)[0]
            ),
            "human": _maybe(self.human, lambda h: check_human_labels(h, n)),
        }
        for name, value in checked.items():
            if value is not None and name in _READ_ONLY:
                value.setflags(write=False)
            object.__setattr__(self, name, value)

    @property
    def n(self) -> int:
        """Number of calibration answers."""
        return int(self.scores.size)


def _maybe(value: ArrayLike | None, check: Callable[[ArrayLike], np.ndarray]) -> np.ndarray | None:
    return None if value is None else check(value)
