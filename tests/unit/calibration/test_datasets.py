"""Data-set readers and the split, on small files written by the tests."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from abstain_guard.calibration.building.questions.dataset_files import Fields, load_dataset
from abstain_guard.calibration.building.questions.datasets import QAItem, split_items
from abstain_guard.calibration.building.questions.named_datasets import load_named_dataset
from abstain_guard.errors import DatasetError, InvalidInputError


def _jsonl(path: Path, rows: list[object | str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_string_and_list_answers(tmp_path: Path) -> None:
    f = _jsonl(
        tmp_path / "qa.jsonl",
        [
            {"question": "Capital of Peru?", "answer": "Lima"},
            {"question": "Largest planet?", "answer": ["Jupiter", "planet Jupiter", "Jupiter"]},
        ],
    )
    items, report = load_dataset(f)
    assert [it.answers for it in items] == [("Lima",), ("Jupiter", "planet Jupiter")]
    assert [it.line for it in items] == [1, 2]
    assert items[0].id == "qa:1" and items[0].kind == "open" and items[0].source == str(f)
    assert report.rows == 2 and report.loaded == 2 and report.skipped == []


def test_bad_rows_are_reported_with_line_numbers(tmp_path: Path, caplog) -> None:
    f = _jsonl(
        tmp_path / "qa.jsonl",
        [
            {"question": "ok 1", "answer": "a"},
            {"question": "", "answer": "a"},
            {"answer": "b"},
            "",
            "{not json",
            {"question": "no answer", "answer": []},
            {"question": "ok 2", "answer": "c"},
            [1, 2],
        ],
    )
    with caplog.at_level(logging.WARNING):
        items, report = load_dataset(f)
    assert [it.question for it in items] == ["ok 1", "ok 2"]
    assert [s.line for s in report.skipped] == [2, 3, 5, 6, 8]
    assert "missing question" in report.skipped[0].reason
    assert "invalid JSON" in report.skipped[2].reason
    assert "missing answer" in report.skipped[3].reason
    assert report.rows == 7 and report.loaded == 2  # the blank line is not a row
    assert sum("line 5 skipped" in r.getMessage() for r in caplog.records) == 1


def test_dotted_paths_ids_groups_and_limit(tmp_path: Path) -> None:
    rows = [
        {"id": f"q{i}", "q": {"stem": f"question {i}"}, "gold": {"v": str(i)}, "meta": {"t": "x"}}
        for i in range(5)
    ]
    f = _jsonl(tmp_path / "d.jsonl", rows)
    items, report = load_dataset(
        f, Fields(question="q.stem", answers="gold.v", id_field="id", group_by="meta.t"), limit=3
    )
    assert [it.id for it in items] == ["q0", "q1", "q2"]
    assert all(it.group == "x" for it in items)
    assert report.limited and report.loaded == 3


def test_csv_with_separator_and_multiline_records(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text(
        '\ufeffQuestion,Best,Correct\nQ1?,A1,"a; b; A1"\n"Q2\nspans lines?",A2,c\n,A3,d\nQ4?,,\n',
        encoding="utf-8",
    )
    items, report = load_dataset(f, Fields(question="Question", answers="Correct", answer_sep=";"))
    assert items[0].answers == ("a", "b", "A1")
    assert items[1].question == "Q2 spans lines?" and items[1].line == 3
    assert [(s.line, s.reason.split(" (")[0]) for s in report.skipped] == [
        (5, "missing question"),
        (6, "missing answer"),
    ]


def test_choice_and_numeric_kinds(tmp_path: Path) -> None:
    f = _jsonl(
        tmp_path / "c.jsonl",
        [
            {
                "answerKey": "B",
                "question": {
                    "stem": "Where are books?",
                    "choices": [{"label": "A", "text": "bank"}, {"label": "B", "text": "library"}],
                },
            },
            {"answerKey": 1, "question": {"stem": "Pick", "choices": ["x", "y"]}},
            {"answerKey": "Z", "question": {"stem": "Bad", "choices": ["x", "y"]}},
        ],
    )
    items, report = load_dataset(
        f, Fields(question="question.stem", answers="answerKey", choices="question.choices")
    )
    assert items[0].kind == "choice" and items[0].answers == ("B", "library")
    assert items[0].choices == ("bank", "library")
    assert items[1].answers == ("B", "y")
    assert "A) bank\nB) library" in items[0].prompt_text()
    assert [s.line for s in report.skipped] == [3]

    g = _jsonl(
        tmp_path / "g.jsonl",
        [
            {"question": "2+2?", "answer": "so 2+2=<<2+2=4>>4\n#### 4"},
            {"question": "big?", "answer": "#### 1,234"},
            {"question": "neg?", "answer": "-3.50"},
            {"question": "none?", "answer": "#### many"},
        ],
    )
    items, report = load_dataset(g, Fields(kind="numeric"))
    assert [it.answers for it in items] == [("4",), ("1234",), ("-3.5",)]
    assert [s.line for s in report.skipped] == [4]


def test_missing_file_empty_file_and_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found"):
        load_dataset(tmp_path / "nope.jsonl")
    empty = _jsonl(tmp_path / "e.jsonl", [{"q": "x"}])
    with pytest.raises(DatasetError, match="no usable rows"):
        load_dataset(empty)
    arr = tmp_path / "a.json"
    arr.write_text('[{"question": "x", "answer": "y"}]')
    with pytest.raises(DatasetError, match="JSON Lines"):
        load_dataset(arr)
    txt = tmp_path / "x.txt"
    txt.write_text("x")
    with pytest.raises(DatasetError, match="extension"):
        load_dataset(txt)
    with pytest.raises(InvalidInputError):
        load_dataset(empty, limit=0)


def test_item_validation() -> None:
    assert QAItem("i", "Q?", ()).answers == ()  # a question only (an LLM judge decides)
    with pytest.raises(InvalidInputError, match="only empty gold"):
        QAItem("i", "Q?", ("", " "))
    with pytest.raises(InvalidInputError, match="no gold answer"):
        QAItem("i", "Q?", (), kind="numeric")
    with pytest.raises(InvalidInputError):
        QAItem("i", "Q?", ("a",), kind="choice")


def _write_named(tmp_path: Path) -> dict[str, Path]:
    d: dict[str, Path] = {}
    d["nq_open"] = tmp_path / "nq"
    d["nq_open"].mkdir()
    _jsonl(d["nq_open"] / "NQ-open.dev.jsonl", [{"question": "who", "answer": ["A", "B"]}])
    d["sciq"] = tmp_path / "sciq"
    d["sciq"].mkdir()
    _jsonl(d["sciq"] / "sciq_test.jsonl", [{"question": "what", "answer": "x"}])
    d["gsm8k"] = tmp_path / "gsm"
    d["gsm8k"].mkdir()
    _jsonl(d["gsm8k"] / "test.jsonl", [{"question": "n", "answer": "x\n#### 70,000"}])
    d["triviaqa"] = tmp_path / "tq"
    d["triviaqa"].mkdir()
    _jsonl(
        d["triviaqa"] / "triviaqa_test.jsonl",
        [{"id": "qw_1", "question": "q", "answers": ["Gagarin", "gagarin"]}],
    )
    d["commonsenseqa"] = tmp_path / "cqa"
    d["commonsenseqa"].mkdir()
    _jsonl(
        d["commonsenseqa"] / "dev_rand_split.jsonl",
        [
            {
                "answerKey": "A",
                "id": "abc",
                "question": {"stem": "s", "choices": [{"label": "A", "text": "t"}]},
            }
        ],
    )
    d["truthfulqa"] = tmp_path / "tqa"
    d["truthfulqa"].mkdir()
    (d["truthfulqa"] / "TruthfulQA.csv").write_text(
        "Type,Category,Question,Best Answer,Correct Answers\n"
        'A,Myths,Why?,Best,"Other; Best; Third"\n'
        "A,Myths,No best?,,Only\n",
        encoding="utf-8",
    )
    return d


def test_named_readers(tmp_path: Path) -> None:
    d = _write_named(tmp_path)
    got = {name: load_named_dataset(name, path) for name, path in d.items()}
    assert got["nq_open"][0][0].answers == ("A", "B")
    assert got["nq_open"][0][0].id == "nq_open:1"
    assert got["sciq"][0][0].answers == ("x",)
    assert got["gsm8k"][0][0].answers == ("70000",) and got["gsm8k"][0][0].kind == "numeric"
    assert got["triviaqa"][0][0].id == "qw_1"
    cqa = got["commonsenseqa"][0][0]
    assert cqa.kind == "choice" and cqa.answers == ("A", "t") and cqa.id == "abc"
    tqa_items, tqa_report = got["truthfulqa"]
    assert tqa_items[0].answers == ("Best", "Other", "Third")
    assert tqa_items[0].group == "Myths"
    assert [s.line for s in tqa_report.skipped] == [3]
    # a file path works as well as the folder
    items, _ = load_named_dataset("sciq", d["sciq"] / "sciq_test.jsonl")
    assert len(items) == 1


def test_named_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="known names"):
        load_named_dataset("squad", tmp_path)
    with pytest.raises(DatasetError, match=r"NQ-open\.dev\.jsonl"):
        load_named_dataset("nq_open", tmp_path)
    with pytest.raises(DatasetError, match="does not exist"):
        load_named_dataset("nq_open", tmp_path / "missing")


def _items(n: int, groups: int | None = None) -> list[QAItem]:
    return [
        QAItem(f"i{i}", f"q{i}", ("a",), group=None if groups is None else f"g{i % groups}")
        for i in range(n)
    ]


def test_split_sizes_deterministic_and_disjoint() -> None:
    items = _items(1000)
    a = split_items(items, seed=3)
    b = split_items(items, seed=3)
    c = split_items(items, seed=4)
    assert {k: len(v) for k, v in a.items()} == {
        "reference": 500,
        "train": 300,
        "calibration": 100,
        "test": 100,
    }
    assert a == b and a != c
    ids = [it.id for part in a.values() for it in part]
    assert sorted(ids) == sorted(it.id for it in items)
    small = split_items(_items(7))
    assert sum(len(v) for v in small.values()) == 7


def test_split_is_stratified_by_group() -> None:
    items = _items(300, groups=3) + [QAItem("rare0", "r", ("a",), group="rare")] * 1
    parts = split_items(items, seed=0)
    for part, size in (("reference", 150), ("train", 90), ("calibration", 30), ("test", 30)):
        counts = Counter(it.group for it in parts[part])
        for g in ("g0", "g1", "g2"):
            assert abs(counts[g] - size / 3) <= 1.5, (part, counts)


def test_split_rejects_bad_ratios() -> None:
    with pytest.raises(InvalidInputError):
        split_items(_items(4), ratios=(1, 1, 1))
    with pytest.raises(InvalidInputError):
        split_items(_items(4), ratios=(1, -1, 1, 1))
