"""Run labels of agent runs (``calibration.building.run_labels``) follow docs/agents.md and
the rule on executed calls alone (``tests/_tool_labels.py``): a run is right only when its
answer is right, every executed tool call is right and every expected call was made."""

from __future__ import annotations

from typing import Any

from _tool_labels import run_tool_label

from abstain_guard.calibration.building.judges.base import Judgment
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.questions.tool_labels import ExpectedCall
from abstain_guard.calibration.building.run_labels import (
    call_verdicts,
    run_judgment,
    step_labels,
)

PERU = ExpectedCall.of("country_facts", {"country": "Peru"})
RIGHT = Judgment(True, 1.0, "matches 'Lima'")


def _item(*expected: ExpectedCall) -> QAItem:
    return QAItem(
        id="q1",
        question="What is the capital of Peru?",
        answers=("Lima",),
        expected_tool_calls=tuple(expected),
    )


def _row(*calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A cached run that ends with a final answer: one AI message per tool-calling model call
    (``calls``), then the answer."""
    messages: list[dict[str, Any]] = [{"role": "human", "content": "What is the capital?"}]
    for step in calls:
        messages.append({"role": "ai", "content": "", "tool_calls": step})
        messages.append({"role": "tool", "content": "Capital: Lima."})
    messages.append({"role": "ai", "content": "Lima.", "tool_calls": []})
    return {"agent": {"reason": "final_answer", "messages": messages}}


def test_a_run_that_skips_the_expected_call_and_answers_right_is_wrong() -> None:
    item, row = _item(PERU), _row()
    calls = call_verdicts(item, row, None)
    assert calls is not None and calls == [[]] and calls.missing == 1
    run = run_judgment(RIGHT, row, calls)
    assert run.correct is False
    assert "1 expected call not made" in run.rationale
    # the same verdict as the documented run-level rule
    assert run_tool_label([], item.expected_tool_calls) is False
    # the final answer itself keeps its judgment as its fitting label
    assert step_labels(row, run, RIGHT, calls) == [True]


def test_a_run_with_the_expected_call_and_a_right_answer_is_right() -> None:
    item = _item(PERU)
    row = _row([{"name": "country_facts", "args": {"country": "Perú"}}])
    calls = call_verdicts(item, row, None)
    assert calls is not None and calls == [[True], []] and calls.missing == 0
    run = run_judgment(RIGHT, row, calls)
    assert run.correct is True
    assert run_tool_label([{"name": "country_facts", "args": {"country": "Peru"}}], [PERU])


def test_one_of_two_expected_calls_made_is_wrong_and_a_wrong_call_is_wrong() -> None:
    lima = ExpectedCall.of("city_facts", {"city": "Lima"})
    item = _item(PERU, lima)
    half = _row([{"name": "country_facts", "args": {"country": "Peru"}}])
    calls = call_verdicts(item, half, None)
    assert calls is not None and calls.missing == 1
    assert run_judgment(RIGHT, half, calls).correct is False
    wrong = _row([{"name": "country_facts", "args": {"country": "Lima"}}])
    calls = call_verdicts(_item(PERU), wrong, None)
    assert calls is not None and calls == [[False], []] and calls.missing == 1
    assert run_judgment(RIGHT, wrong, calls).correct is False


def test_rows_without_expected_calls_are_labelled_by_the_answer() -> None:
    row = _row()
    assert call_verdicts(_item(), row, None) is None
    assert run_judgment(RIGHT, row, None).correct is True
