"""Labels of whole agent runs and of their model calls, for step gating (when a run is wrong
and how each call is labelled for fitting: docs/agents.md, 'Calibrate the agent as
deployed').
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .answering.agents import has_final_answer, step_messages
from .judges.base import Judgment
from .judges.tool_calls import judge_tool_calls
from .questions.datasets import QAItem


class RunCallVerdicts(list[list[bool]]):
    """Per model call of a run, whether each of its (parsed) tool calls is right, shape
    ``[calls][tool calls of that call]`` (a final answer has none), and :attr:`missing`:
    how many of the row's expected calls no executed call made."""

    def __init__(self, steps: Sequence[list[bool]], missing: int) -> None:
        super().__init__(steps)
        self.missing = int(missing)


def call_verdicts(
    item: QAItem, row: Mapping[str, Any], schemas: Sequence[Mapping[str, Any]] | None
) -> RunCallVerdicts | None:
    """The run's tool calls judged against ``item.expected_tool_calls`` with the calibrated
    tool ``schemas`` (:class:`RunCallVerdicts`: per call, and the expected calls not made);
    None when the row has no expected calls."""
    expected = tuple(getattr(item, "expected_tool_calls", ()) or ())
    if not expected:
        return None
    steps = step_messages(row)
    flat = [c for m in steps for c in m.get("tool_calls") or []]
    verdicts = judge_tool_calls(
        flat, expected, ordered=bool(getattr(item, "tool_calls_ordered", False)), schemas=schemas
    )
    out: list[list[bool]] = []
    i = 0
    for m in steps:
        n = len(m.get("tool_calls") or [])
        out.append([bool(v.correct) for v in verdicts[i : i + n]])
        i += n
    made = {v.expected_index for v in verdicts if v.correct}
    return RunCallVerdicts(out, missing=len(expected) - len(made))


def run_judgment(
    answer: Judgment | None, row: Mapping[str, Any], calls: RunCallVerdicts | None
) -> Judgment:
    """The run's verdict from its final answer's judgment (None: no final answer) and its
    tool calls' verdicts (:func:`call_verdicts`): right only when the answer is right, every
    executed call is right and every expected call was made."""
    reason = (row.get("agent") or {}).get("reason")
    wrong_calls = 0 if calls is None else sum(1 for step in calls for ok in step if not ok)
    n_calls = 0 if calls is None else sum(len(step) for step in calls)
    missing = 0 if calls is None else calls.missing
    tools = "" if calls is None else f"; tool calls {n_calls - wrong_calls}/{n_calls} right"
    if missing:
        tools += f"; {missing} expected call{'s' if missing > 1 else ''} not made"
    if not step_messages(row):  # nothing was generated, so nothing a guard could gate
        return Judgment(None, None, f"run: no model call returned ({reason})")
    if not has_final_answer(row) or answer is None:
        return Judgment(False, 0.0, f"run: no final answer ({reason}){tools}")
    if answer.correct is None:
        return Judgment(None, None, f"run: final answer not judged ({answer.rationale}){tools}")
    correct = bool(answer.correct) and wrong_calls == 0 and missing == 0
    said = "right" if answer.correct else "wrong"
    return Judgment(
        correct,
        1.0 if correct else 0.0,
        f"run: final answer {said} ({answer.rationale}){tools}",
        refusal=answer.refusal,
    )


def step_labels(
    row: Mapping[str, Any],
    run: Judgment,
    answer: Judgment | None,
    calls: list[list[bool]] | None,
) -> list[bool]:
    """The fitting label of each model call of a labelled run (module docstring), ``[T]``."""
    steps = step_messages(row)
    labels: list[bool] = []
    for t, m in enumerate(steps):
        if m.get("tool_calls") and calls is not None:
            labels.append(all(calls[t]))
        elif not m.get("tool_calls") and has_final_answer(row) and t == len(steps) - 1:
            labels.append(bool(answer.correct if answer is not None else run.correct))
        else:
            labels.append(bool(run.correct))
    return labels
