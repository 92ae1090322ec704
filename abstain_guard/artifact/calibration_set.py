"""`CalibrationSet`: the arrays calibration measured on its answers, as an artifact stores
them (``calibration.npz`` and the side files), each checked once; the scores, labels and
groups are read-only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard.guarantee.action_risk import check_action_statistics
from abstain_guard.guarantee.groups import check_groups
from abstain_guard.guarantee.partial_release import check_stream_statistics
from abstain_guard.guarantee.truth import check_human_labels
from abstain_guard.guarantee.validation import check_labels, check_scores

_READ_ONLY = ("scores", "correct", "groups")


@dataclass(frozen=True, eq=False)
class CalibrationSet:
    """The calibration answers' arrays (any array-like in, numpy arrays after).

    Attributes:
        scores, correct: ``[n]`` float64 finite scores and bool labels (0/1 accepted).
        groups: each answer's group ``[n]`` (str), for ``group_by``, or None.
        action_statistic: every calibration run's action statistic ``[n_runs]`` (runs
            without a labeled answer too; ``inf``: no wrong tool call), or None.
        stream_first: each answer's first-chunk score ``[n]`` (``inf``: none) under a chunk
            rule (``scores`` are then the stream statistics), or None.
        human: people's verdicts ``[n]`` (int8: 1, 0, -1 not reviewed, -2 out of scope),
            or None.
    """

    scores: np.ndarray
    correct: np.ndarray
    groups: np.ndarray | None = None
    action_statistic: np.ndarray | None = None
    stream_first: np.ndarray | None = None
    human: np.ndarray | None = None

    def __post_init__(self) -> None:
        scores = check_scores(self.scores)
        correct = check_labels(self.correct, scores.size).astype(bool)
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
        return int(self.scores.size)


def _maybe(value: ArrayLike | None, check: Callable[[ArrayLike], np.ndarray]) -> np.ndarray | None:
    return None if value is None else check(value)
