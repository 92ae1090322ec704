"""Step gating of agent runs: the statistic a run is judged by, step by step.

Call t of a run gets score ``s_t``; the run's statistic is the running maximum
``S_t = max(s_1, ..., s_t)``, which only grows. The guard stops a run at the first call with
``S_t > τ``, before its tool calls run, so the runs it lets through are exactly those whose
whole-run ``S <= τ`` and calibrating τ on ``S`` certifies the early-stopping guard
(docs/guarantees.md, "In an agent: every step"). Pure functions; ``[T]``: a run's calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

#: How an agent artifact gates: every model call (``"steps"``) or the final answer only.
Gating = Literal["steps", "final_answer"]

#: What made a calibration run wrong: its final answer only, or its final answer and its
#: executed tool calls (rows with ``expected_tool_calls``).
Labelling = Literal["final_answer", "final_answer_and_tool_calls"]


def running_statistic(previous: float | None, step_score: float) -> float:
    """``S_t = max(S_{t-1}, s_t)``; ``previous=None`` at the first call of a run."""
    if math.isnan(step_score):
        raise ValueError("a step score is NaN; the scorer must return a number")
    return step_score if previous is None else max(previous, step_score)


def run_statistic(step_scores: Sequence[float]) -> float:
    """The whole run's statistic ``S = max_t s_t`` of its step scores ``[T]`` (T >= 1).

    Raises:
        ValueError: a run without model calls (nothing was scored), or a NaN score.
    """
    if len(step_scores) == 0:
        raise ValueError("a run without model calls has no statistic")
    value: float | None = None
    for s in step_scores:
        value = running_statistic(value, float(s))
    assert value is not None
    return value


def stopping_step(step_scores: Sequence[float], threshold: float) -> int | None:
    """The index of the first call whose running statistic exceeds ``threshold`` (its tool
    calls and every later call do not run), or None when the run goes through.

    ``stopping_step(s, τ) is None`` exactly when ``run_statistic(s) <= τ``.
    """
    value: float | None = None
    for t, s in enumerate(step_scores):
        value = running_statistic(value, float(s))
        if value > threshold:
            return t
    return None
