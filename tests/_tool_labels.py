"""Whether a run's actions were right, from its executed calls alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from abstain_guard.calibration.building.judges.tool_calls import judge_tool_calls
from abstain_guard.calibration.building.questions.tool_labels import ExpectedCall


def run_tool_label(
    calls: Sequence[Mapping[str, Any]],
    expected: Sequence[ExpectedCall | Mapping[str, Any]],
    ordered: bool = False,
    *,
    schemas: Sequence[Mapping[str, Any]] | None = None,
) -> bool | None:
    """Every executed call correct and every expected call made (the rule ``run_judgment``
    applies to a run's calls); None without expected calls."""
    if not expected:
        return None
    verdicts = judge_tool_calls(calls, expected, ordered=ordered, schemas=schemas)
    matched = {v.expected_index for v in verdicts if v.correct}
    return all(v.correct for v in verdicts) and len(matched) == len(expected)
