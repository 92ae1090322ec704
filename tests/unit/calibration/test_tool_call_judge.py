"""The tool-call judge on tricky cases, and the expected calls of calibration rows (QAItem
fields, data files, splitting, hashing)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from _tool_labels import run_tool_label

from abstain_guard.calibration.building.judges.tool_calls import (
    CallVerdict,
    judge_tool_calls,
    normalize_arg_string,
)
from abstain_guard.calibration.building.questions.dataset_files import load_dataset
from abstain_guard.calibration.building.questions.datasets import QAItem, split_items
from abstain_guard.calibration.building.questions.items import items_digest
from abstain_guard.calibration.building.questions.tool_labels import (
    ExpectedCall,
    parse_expected_calls,
)
from abstain_guard.errors import InvalidInputError


def _tool(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": name,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


SCHEMAS = [
    _tool("country_facts", {"country": {"type": "string"}}, ["country"]),
    _tool("city_facts", {"city": {"type": "string"}}, ["city"]),
    _tool(
        "book_room",
        {
            "guests": {"type": "integer"},
            "nights": {"type": "number", "default": 1},
            "city": {"type": "string"},
        },
        ["guests", "city"],
    ),
    _tool("set_code", {"code": {"type": "string"}}, ["code"]),
]
PERU = [ExpectedCall.of("country_facts", {"country": "Peru"})]


def call(name: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "id": "c1"}


# (case, executed call, expected calls, schemas?, correct)
CASES: list[tuple[str, dict[str, Any], list[ExpectedCall], bool, bool]] = [
    ("exact", call("country_facts", country="Peru"), PERU, True, True),
    ("case", call("country_facts", country="PERU"), PERU, True, True),
    ("accents", call("country_facts", country="Perú"), PERU, True, True),
    ("extra whitespace", call("country_facts", country="  Peru \t"), PERU, True, True),
    (
        "trailing space vs full stop",
        call("country_facts", country="Peru "),
        [ExpectedCall.of("country_facts", {"country": "Peru."})],
        True,
        True,
    ),
    (
        "inner whitespace collapsed",
        call("city_facts", city="São   Paulo"),
        [ExpectedCall.of("city_facts", {"city": "Sao Paulo"})],
        True,
        True,
    ),
    (
        "unicode NFKC (full-width letters)",
        call("country_facts", country="Ｐｅｒｕ"),
        PERU,
        True,
        True,
    ),
    (
        "unicode casefold ß = ss",
        call("city_facts", city="Gießen"),
        [ExpectedCall.of("city_facts", {"city": "GIESSEN"})],
        True,
        True,
    ),
    ("a different name is wrong", call("country_facts", country="Pepón"), PERU, True, False),
    ("a prefix is wrong", call("country_facts", country="Per"), PERU, True, False),
    ("wrong tool, right args", call("city_facts", country="Peru"), PERU, True, False),
    ("wrong tool, right args, no schema", call("city_facts", country="Peru"), PERU, False, False),
    (
        "extra arg the small model writes",
        call("country_facts", country="Peru", type="string"),
        PERU,
        True,
        False,
    ),
    (
        "extra arg without a schema",
        call("country_facts", country="Peru", type="string"),
        PERU,
        False,
        False,
    ),
    ("missing required arg", call("country_facts"), PERU, True, False),
    (
        "'3' vs 3 on an integer field",
        call("book_room", guests=3, city="Lima"),
        [ExpectedCall.of("book_room", {"guests": "3", "city": "Lima"})],
        True,
        True,
    ),
    (
        "3 vs 3.0 on a number field",
        call("book_room", guests=2, city="Lima", nights=3),
        [ExpectedCall.of("book_room", {"guests": 2, "city": "Lima", "nights": 3.0})],
        True,
        True,
    ),
    (
        "3 vs 4",
        call("book_room", guests=3, city="Lima"),
        [ExpectedCall.of("book_room", {"guests": 4, "city": "Lima"})],
        True,
        False,
    ),
    (
        "a string for an integer field fails validation",
        call("book_room", guests="3", city="Lima"),
        [ExpectedCall.of("book_room", {"guests": 3, "city": "Lima"})],
        True,
        False,
    ),
    (
        "'3' vs 3 without a schema",
        call("book_room", guests="3", city="Lima"),
        [ExpectedCall.of("book_room", {"guests": 3, "city": "Lima"})],
        False,
        True,
    ),
    (
        "a string field stays a string: '3.0' != '3'",
        call("set_code", code="3.0"),
        [ExpectedCall.of("set_code", {"code": "3"})],
        True,
        False,
    ),
    (
        "leading zeros are not a numeral",
        call("set_code", code="03"),
        [ExpectedCall.of("set_code", {"code": 3})],
        False,
        False,
    ),
    (
        "missing optional arg = its default",
        call("book_room", guests=2, city="Lima"),
        [ExpectedCall.of("book_room", {"guests": 2, "city": "Lima", "nights": 1})],
        True,
        True,
    ),
    (
        "optional arg other than its default",
        call("book_room", guests=2, city="Lima", nights=2),
        [ExpectedCall.of("book_room", {"guests": 2, "city": "Lima"})],
        True,
        False,
    ),
    (
        "true is not 1",
        call("set_code", code=True),
        [ExpectedCall.of("set_code", {"code": 1})],
        False,
        False,
    ),
]


@pytest.mark.parametrize(
    ("case", "executed", "expected", "with_schema", "correct"), CASES, ids=[c[0] for c in CASES]
)
def test_tricky_cases(
    case: str,
    executed: dict[str, Any],
    expected: list[ExpectedCall],
    with_schema: bool,
    correct: bool,
) -> None:
    (verdict,) = judge_tool_calls([executed], expected, schemas=SCHEMAS if with_schema else None)
    assert verdict.correct is correct, verdict.reason
    assert verdict.expected_index == (0 if correct else None)
    assert verdict.reason


def test_reasons_say_what_was_wrong() -> None:
    (wrong_tool,) = judge_tool_calls([call("city_facts", city="Peru")], PERU, schemas=SCHEMAS)
    assert "wrong tool 'city_facts'" in wrong_tool.reason and "country_facts" in wrong_tool.reason
    (invalid,) = judge_tool_calls(
        [call("country_facts", country="Peru", type="string")], PERU, schemas=SCHEMAS
    )
    assert "invalid call" in invalid.reason and "'type' was unexpected" in invalid.reason
    (value,) = judge_tool_calls([call("country_facts", country="Pepón")], PERU)
    assert "'Pepón' != expected 'Peru'" in value.reason


def test_repeated_correct_call_is_wrong_the_second_time() -> None:
    verdicts = judge_tool_calls([call("country_facts", country="Peru")] * 2, PERU, schemas=SCHEMAS)
    assert [v.correct for v in verdicts] == [True, False]
    assert "repeats expected call 0" in verdicts[1].reason
    assert run_tool_label([call("country_facts", country="Peru")] * 2, PERU) is False


def test_two_equal_expected_calls_take_two_calls() -> None:
    twice = PERU * 2
    assert run_tool_label([call("country_facts", country="Peru")] * 2, twice) is True
    assert run_tool_label([call("country_facts", country="Peru")], twice) is False


TWO = [
    ExpectedCall.of("country_facts", {"country": "Peru"}),
    ExpectedCall.of("city_facts", {"city": "Osaka"}),
]


def test_unordered_vs_ordered() -> None:
    swapped = [call("city_facts", city="Osaka"), call("country_facts", country="Peru")]
    unordered = judge_tool_calls(swapped, TWO)
    assert [(v.correct, v.expected_index) for v in unordered] == [(True, 1), (True, 0)]
    assert run_tool_label(swapped, TWO) is True
    ordered = judge_tool_calls(swapped, TWO, ordered=True)
    assert [v.correct for v in ordered] == [False, False]
    assert run_tool_label(swapped, TWO, True) is False
    in_order = list(reversed(swapped))
    assert run_tool_label(in_order, TWO, True) is True
    extra = judge_tool_calls([*in_order, call("city_facts", city="Lima")], TWO, ordered=True)
    assert [v.correct for v in extra] == [True, True, False]
    assert "no expected call at its position" in extra[2].reason


def test_missing_call_makes_the_run_wrong_but_no_call_wrong() -> None:
    calls = [call("country_facts", country="Peru")]
    assert [v.correct for v in judge_tool_calls(calls, TWO)] == [True]
    assert run_tool_label(calls, TWO) is False
    assert run_tool_label([], TWO) is False


def test_no_expected_calls_means_no_tool_label() -> None:
    assert run_tool_label([call("country_facts", country="Peru")], []) is None
    assert run_tool_label([], ()) is None
    verdicts = judge_tool_calls([call("country_facts", country="Peru")], [])
    assert verdicts == [
        CallVerdict(False, "no expected call left for 'country_facts' (a repeat or an extra call)")
    ]


def test_calls_as_a_cached_run_stores_them_and_as_mappings() -> None:
    stored = {"name": "country_facts", "args": {"country": "peru"}, "id": "call_0"}
    expected = [{"name": "country_facts", "args": {"country": "Peru"}}]
    assert run_tool_label([stored], expected, schemas=SCHEMAS) is True


def test_bad_shapes_raise() -> None:
    with pytest.raises(InvalidInputError, match="executed call 0"):
        judge_tool_calls([{"args": {}}], PERU)
    with pytest.raises(InvalidInputError, match="expected call 0"):
        judge_tool_calls([], [{"args": {}}])  # type: ignore[list-item]
    (not_object,) = judge_tool_calls([{"name": "country_facts", "args": "Peru"}], PERU)
    assert not not_object.correct and "not an object" in not_object.reason


def test_normalize_arg_string() -> None:
    assert normalize_arg_string("  Perú. ") == "peru"
    assert normalize_arg_string("Côte  d'Ivoire!") == "cote d'ivoire"
    assert normalize_arg_string("U.S.") == "u.s"
    assert normalize_arg_string("...") == ""


def test_nested_values() -> None:
    schema = [
        _tool(
            "search",
            {"filters": {"type": "object", "properties": {"max": {"type": "number"}}}},
            ["filters"],
        )
    ]
    want = [ExpectedCall.of("search", {"filters": {"max": "10", "tags": ["A", "b"]}})]
    got = call("search", filters={"max": 10.0, "tags": ["a", "B "]})
    assert run_tool_label([got], want, schemas=schema) is True
    assert run_tool_label([got], want) is True
    got_other = call("search", filters={"max": 10.0, "tags": ["b", "a"]})
    assert run_tool_label([got_other], want) is False  # lists keep their order


# --- the expected calls of a row ------------------------------------------------------------


def test_expected_call_is_hashable_and_round_trips() -> None:
    c = ExpectedCall.of("f", {"b": [1, {"x": "y"}], "a": None})
    assert c == ExpectedCall.of("f", {"a": None, "b": [1, {"x": "y"}]})
    assert hash(c) == hash(ExpectedCall.of("f", {"a": None, "b": [1, {"x": "y"}]}))
    assert c.to_json() == {"name": "f", "args": {"a": None, "b": [1, {"x": "y"}]}}
    item = QAItem("q1", "What is the capital of Peru?", ("Lima",), expected_tool_calls=(c,))
    assert hash(item) == hash(pickle.loads(pickle.dumps(item)))
    assert pickle.loads(pickle.dumps(item)) == item


def test_qaitem_rejects_bad_calls() -> None:
    with pytest.raises(InvalidInputError, match=r"'q1'.*expected tool call 1"):
        QAItem("q1", "q?", ("a",), expected_tool_calls=({"name": "f"},))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=r"'q1'.*without expected_tool_calls"):
        QAItem("q1", "q?", ("a",), tool_calls_ordered=True)


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def test_jsonl_rows_carry_expected_calls(tmp_path: Path) -> None:
    rows = [
        {
            "question": "What is the capital of Peru?",
            "answer": "Lima",
            "expected_tool_calls": [{"name": "country_facts", "args": {"country": "Peru"}}],
        },
        {
            "question": "Book two nights in Lima, then check Osaka.",
            "answer": "done",
            "expected_tool_calls": [
                {"name": "book_room", "args": {"guests": 2, "city": "Lima"}},
                {"name": "city_facts", "args": {"city": "Osaka"}},
            ],
            "tool_calls_ordered": True,
        },
        {"question": "Who wrote Hamlet?", "answer": "Shakespeare"},
    ]
    items, report = load_dataset(_write(tmp_path / "d.jsonl", rows))
    assert not report.skipped
    assert items[0].expected_tool_calls == (PERU[0],) and not items[0].tool_calls_ordered
    assert [c.name for c in items[1].expected_tool_calls] == ["book_room", "city_facts"]
    assert items[1].tool_calls_ordered is True
    assert items[2].expected_tool_calls == () and items[2].tool_calls_ordered is False
    # kept through splitting, and part of the content hash only where present
    split = split_items(items, seed=0, ratios=(1, 1, 1, 0))
    assert {it.id: it for part in split.values() for it in part} == {it.id: it for it in items}
    plain = QAItem(items[2].id, items[2].question, items[2].answers, source=items[2].source)
    assert items_digest([items[2]]) == items_digest([plain])
    without = QAItem(items[0].id, items[0].question, items[0].answers)
    assert items_digest([items[0]]) != items_digest([without])


def test_csv_rows_carry_expected_calls(tmp_path: Path) -> None:
    calls = json.dumps([{"name": "country_facts", "args": {"country": "Peru"}}]).replace('"', '""')
    (tmp_path / "d.csv").write_text(
        "question,answer,expected_tool_calls,tool_calls_ordered\n"
        f'What is the capital of Peru?,Lima,"{calls}",TRUE\n'
        "Who wrote Hamlet?,Shakespeare,,\n",
        encoding="utf-8",
    )
    items, report = load_dataset(tmp_path / "d.csv")
    assert not report.skipped
    assert items[0].expected_tool_calls == (PERU[0],) and items[0].tool_calls_ordered is True
    assert items[1].expected_tool_calls == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"name": "f"}, "not a list of calls"),
        (["f"], "expected tool call 1 is a JSON str"),
        ([{"args": {}}], "expected tool call 1 has no tool name"),
        ([{"name": "f", "args": ["Peru"]}], "has a JSON list as 'args'"),
        ([{"name": "f", "arguments": {}}], "unknown keys \\['arguments'\\]"),
        ("[{", "not valid JSON"),
    ],
)
def test_bad_expected_calls_name_the_row(tmp_path: Path, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_expected_calls(value)
    rows = [
        {"question": "q1?", "answer": "a"},
        {"question": "q2?", "answer": "a", "expected_tool_calls": value},
    ]
    items, report = load_dataset(_write(tmp_path / "d.jsonl", rows), log_skipped=False)
    assert len(items) == 1
    (skipped,) = report.skipped
    assert skipped.line == 2 and message.replace("\\", "") in skipped.reason


def test_ordered_without_calls_is_a_bad_row(tmp_path: Path) -> None:
    rows = [
        {"question": "q1?", "answer": "a"},
        {"question": "q2?", "answer": "a", "tool_calls_ordered": "yes"},
        {"question": "q3?", "answer": "a", "tool_calls_ordered": True},
    ]
    _, report = load_dataset(_write(tmp_path / "d.jsonl", rows), log_skipped=False)
    assert [s.line for s in report.skipped] == [2, 3]
    assert "write true or false" in report.skipped[0].reason
    assert "no expected_tool_calls" in report.skipped[1].reason
