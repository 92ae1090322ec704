"""Multi-turn calibration data: the row format and its checks, the prompt that puts the
earlier turns before the question (single questions byte-identical to before), the split by
conversation, and the deployment record that refuses earlier turns an artifact was not
calibrated on."""

from __future__ import annotations

import csv
import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from abstain_guard.calibration.building.answering.answers import deployment_record
from abstain_guard.calibration.building.questions.conversations import (
    conversation_units,
    parse_history,
)
from abstain_guard.calibration.building.questions.dataset_files import load_dataset
from abstain_guard.calibration.building.questions.datasets import QAItem, split_items
from abstain_guard.calibration.building.questions.items import load_items, question_key
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.building.run.store import content_key
from abstain_guard.contract.deployment import (
    DeploymentRecord,
    PromptRecord,
    generation_mismatches,
    sha256_text,
)
from abstain_guard.contract.prompts import build_messages, messages_to_json, question_prompt
from abstain_guard.errors import DatasetError, InvalidInputError

TURNS = [
    {"role": "user", "content": "Tell me about Peru."},
    {"role": "assistant", "content": "Peru is a country in South America."},
]


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --- the data format ------------------------------------------------------------------------


def test_jsonl_rows_carry_history_and_conversation(tmp_path: Path) -> None:
    f = _jsonl(
        tmp_path / "conv.jsonl",
        [
            {"question": "Tell me about Peru.", "answer": "Lima", "conversation_id": "c1"},
            {
                "question": "What is its capital?",
                "answer": "Lima",
                "history": TURNS,
                "conversation_id": "c1",
            },
            {"question": "Largest planet?", "answer": "Jupiter", "history": []},
            {"question": "Its moon?", "answer": "Io", "conversation_id": 7},
        ],
    )
    items, report = load_dataset(f)
    assert report.skipped == []
    assert items[0].history == () and items[0].conversation == "c1"
    assert items[1].history == (
        ("user", "Tell me about Peru."),
        ("assistant", "Peru is a country in South America."),
    )
    assert items[1].conversation == "c1"
    assert items[2].history == () and items[2].conversation is None
    assert items[3].conversation == "7"


def test_csv_history_is_a_json_string(tmp_path: Path) -> None:
    f = tmp_path / "conv.csv"
    with f.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["question", "answer", "history", "conversation_id"])
        writer.writerow(["What is its capital?", "Lima", json.dumps(TURNS), "c1"])
        writer.writerow(["Largest planet?", "Jupiter", "", ""])
    items, report = load_dataset(f)
    assert report.skipped == []
    assert items[0].history[1] == ("assistant", "Peru is a country in South America.")
    assert items[0].conversation == "c1"
    assert items[1].history == () and items[1].conversation is None


BAD_HISTORIES = [
    ({"role": "user", "content": "x"}, "not a list"),
    ([{"role": "bot", "content": "x"}], "use 'user' or 'assistant'"),
    ([{"role": "system", "content": "Be brief."}], "system prompt is the calibration's"),
    ([{"role": "tool", "content": "42"}], "calibrate --agent"),
    ([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}], "tool result"),
    ([{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}], "no content"),
    ([{"role": "user", "content": 3}], "as content"),
    (["hello"], "not an object"),
    ([{"content": "x"}], "has no role"),
    ([{"role": "assistant", "content": "Hi!"}], "alternate"),
    (
        [
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "c"},
        ],
        "alternate",
    ),
    ([{"role": "user", "content": "a"}], "ends with a user turn"),
    ("[{not json", "not valid JSON"),
]


@pytest.mark.parametrize(("history", "says"), BAD_HISTORIES)
def test_a_bad_history_is_a_bad_row_with_its_line(
    tmp_path: Path, history: object, says: str
) -> None:
    f = _jsonl(
        tmp_path / "bad.jsonl",
        [
            {"question": "Largest planet?", "answer": "Jupiter"},
            {"question": "What is its capital?", "answer": "Lima", "history": history},
        ],
    )
    items, report = load_dataset(f, log_skipped=False)
    assert len(items) == 1
    (skipped,) = report.skipped
    assert skipped.line == 2 and says in skipped.reason and "'history'" in skipped.reason
    with pytest.raises(DatasetError) as info:  # calibrate: every bad row, file:line, the fix
        load_items(str(f), CalibrationConfig())
    assert f"{f}:2:" in str(info.value) and says in str(info.value)
    assert "--skip-bad-rows" in str(info.value)


def test_a_bad_conversation_id_is_a_bad_row(tmp_path: Path) -> None:
    f = _jsonl(
        tmp_path / "bad.jsonl",
        [
            {"question": "Q1?", "answer": "a", "conversation_id": True},
            {"question": "Q2?", "answer": "b", "conversation_id": {"id": 1}},
            {"question": "Q3?", "answer": "c"},
        ],
    )
    items, report = load_dataset(f, log_skipped=False)
    assert [it.question for it in items] == ["Q3?"]
    assert [s.line for s in report.skipped] == [1, 2]
    assert all("conversation_id" in s.reason and "string" in s.reason for s in report.skipped)


def test_items_validate_their_history() -> None:
    item = QAItem("i", "Its capital?", ("Lima",), history=[["user", "Peru?"], ["assistant", "A"]])  # type: ignore[arg-type]
    assert item.history == (("user", "Peru?"), ("assistant", "A"))
    with pytest.raises(InvalidInputError, match="ends with a user turn"):
        QAItem("i", "Q?", ("a",), history=(("user", "x"),))
    with pytest.raises(InvalidInputError, match="use 'user' or 'assistant'"):
        QAItem("i", "Q?", ("a",), history=(("human", "x"), ("ai", "y")))
    assert parse_history(None) == () and parse_history("") == () and parse_history([]) == ()


def test_one_follow_up_after_different_turns_is_not_a_duplicate(tmp_path: Path) -> None:
    other = [{"role": "user", "content": "Tell me about Chile."}, TURNS[1]]
    rows = [
        {"question": "What is its capital?", "answer": "Lima", "history": TURNS},
        {"question": "What is its capital?", "answer": "Santiago", "history": other},
        {"question": "What is its capital?", "answer": "Lima", "history": TURNS},
        {"question": "Largest planet?", "answer": "Jupiter"},
    ]
    items, _ = load_dataset(_jsonl(tmp_path / "d.jsonl", rows))
    assert question_key(items[0]) != question_key(items[1])
    assert question_key(items[0]) == question_key(items[2])
    assert len(question_key(items[3])) == 2  # a single question's key is as before
    with pytest.raises(DatasetError, match="duplicate question"):
        load_items(str(tmp_path / "d.jsonl"), CalibrationConfig())


# --- the prompt -----------------------------------------------------------------------------

#: Cache keys of single questions before conversations existed (``content_key("gen", "fp",
#: messages_to_json(build_messages(item, system_prompt)), params)``, computed with the code
#: of the commit before this feature): the shipped artifact's cached answers depend on them.
GOLDEN_KEYS = {
    ("a", None): "a7126da3aec2330fd4b511f54dfbac2d169a1b06ebad90bd5278e814483cc6e3",
    ("a", "Be {brief}."): "3aa943197de69c73e7329e38cf23af13990bb1bdbacb25e754d67505fa4a2c55",
    ("b", None): "f555c651f089139511d54d9fc289299244c06b28e891ea909f7a53a1849a4bb0",
    ("b", "Be {brief}."): "e6aba16d51bd4a2964a527c4b5f79f1d64a3b720b126e593cf9f6cbabbb323b1",
    ("c", None): "7c40bead14a66f179ee088f1bbc5e8124d06b0fd71666a2e9ba85ddc43d968f0",
    ("c", "Be {brief}."): "82724b57b6acd69b075011bf84d06296f13ff13038560a1f9ecf68a4274f8748",
}
SINGLE = {
    "a": QAItem("a", "What is the capital of Peru?", ("Lima",)),
    "b": QAItem(
        "b", "Which is a fruit?", ("A", "apple"), kind="choice", choices=("apple", "stone")
    ),
    "c": QAItem("c", "What is 2+{x}?", ("4",), kind="numeric"),
}


@pytest.mark.parametrize(("item_id", "system_prompt"), list(GOLDEN_KEYS))
def test_single_questions_keep_their_messages_and_cache_keys(
    item_id: str, system_prompt: str | None
) -> None:
    item = SINGLE[item_id]
    messages = build_messages(item, system_prompt)
    assert [type(m) for m in messages] == [SystemMessage, HumanMessage]
    as_json = messages_to_json(messages)
    key = content_key("gen", "fp", as_json, {"max_new_tokens": 24, "alone": True})
    assert key == GOLDEN_KEYS[(item_id, system_prompt)]
    deployed = question_prompt(system_prompt, item.kind).invoke({"question": item.prompt_text()})
    assert messages_to_json(deployed.to_messages()) == as_json


def test_history_goes_between_the_system_prompt_and_the_question() -> None:
    item = QAItem("h", "What is its capital?", ("Lima",), history=parse_history(TURNS))
    messages = build_messages(item)
    assert [type(m) for m in messages] == [SystemMessage, HumanMessage, AIMessage, HumanMessage]
    assert [m.content for m in messages[1:]] == [t["content"] for t in TURNS] + [item.question]
    single = QAItem("s", "What is its capital?", ("Lima",))
    key = messages_to_json(build_messages(item))
    assert key != messages_to_json(build_messages(single))  # cached apart
    history = messages[1:3]
    deployed = question_prompt().invoke({"question": item.question, "history": history})
    assert messages_to_json(deployed.to_messages()) == key  # the guard's chain, same prompt


# --- the split ------------------------------------------------------------------------------

#: sha256 of the built-in probe set's seed-0 split (ids per part) before conversations:
#: items without a conversation must split exactly as before.
PROBE_SPLIT_SHA256 = "b6100c37ca7e8988"


def test_rows_without_conversations_split_exactly_as_before() -> None:
    parts = split_items(builtin_probe_set(seed=0), seed=0)
    ids = {k: [it.id for it in v] for k, v in parts.items()}
    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    assert digest[:16] == PROBE_SPLIT_SHA256


def _conversations(n: int, turns: int, seed_groups: int = 0) -> list[QAItem]:
    items = []
    for c in range(n):
        history: tuple[tuple[str, str], ...] = ()
        for t in range(turns):
            items.append(
                QAItem(
                    f"c{c}t{t}",
                    f"question {t} of {c}?",
                    ("a",),
                    history=history,
                    conversation=f"c{c}",
                    group=f"g{c % seed_groups}" if seed_groups else None,
                )
            )
            history = (*history, ("user", f"question {t} of {c}?"), ("assistant", "a"))
    return items


def test_a_conversation_never_straddles_two_splits() -> None:
    items = _conversations(200, 3) + [QAItem(f"s{i}", f"single {i}?", ("a",)) for i in range(100)]
    parts = split_items(items, seed=5)
    assert sorted(it.id for p in parts.values() for it in p) == sorted(it.id for it in items)
    where = {it.conversation: name for name, p in parts.items() for it in p if it.conversation}
    for name, part in parts.items():
        for it in part:
            if it.conversation is not None:
                assert where[it.conversation] == name
    sizes = {k: len(v) for k, v in parts.items()}
    for name, share in (("reference", 0.5), ("train", 0.3), ("calibration", 0.1), ("test", 0.1)):
        assert abs(sizes[name] - share * len(items)) <= 3, sizes
    by_conv = [it for it in parts["reference"] if it.conversation == "c0"]
    if by_conv:  # rows of one conversation keep their input order
        assert [it.id for it in by_conv] == sorted(it.id for it in by_conv)
    assert split_items(items, seed=5) == parts and split_items(items, seed=6) != parts


def test_conversations_are_stratified_by_group() -> None:
    parts = split_items(_conversations(300, 2, seed_groups=3), seed=0)
    for name, share in (("reference", 0.5), ("train", 0.3), ("calibration", 0.1)):
        convs = Counter(it.group for it in parts[name] if it.id.endswith("t0"))
        for g in ("g0", "g1", "g2"):
            assert abs(convs[g] - share * 100) <= 2, (name, convs)


def test_conversation_units() -> None:
    assert conversation_units([None, "a", None, "a", "b"]) == [[0], [1, 3], [2], [4]]


# --- the deployment record ------------------------------------------------------------------

SYSTEM = "Answer with only the answer."


def _record(conversations: bool) -> DeploymentRecord:
    return DeploymentRecord(
        chat_template_sha256="t",
        prompts={"open": PromptRecord(system_prompt=SYSTEM, max_new_tokens=24)},
        conversations=conversations,
    )


def _generation(history_messages: int | None) -> dict[str, object]:
    record: dict[str, object] = {
        "max_new_tokens": 24,
        "system_prompt_sha256": sha256_text(SYSTEM),
        "chat_template_sha256": "t",
    }
    if history_messages is not None:
        record["history_messages"] = history_messages
    return record


def test_earlier_messages_are_refused_unless_calibrated_on_conversations() -> None:
    (problem,) = generation_mismatches(_record(False), _generation(2))
    assert "calibrated on single questions" in problem and "carries 2 earlier messages" in problem
    assert "calibrate on conversations" in problem and "history" in problem
    assert generation_mismatches(_record(True), _generation(2)) == []
    assert generation_mismatches(_record(False), _generation(0)) == []
    assert generation_mismatches(_record(False), _generation(None)) == []  # not recorded
    assert generation_mismatches(_record(True), _generation(0)) == []


def test_the_record_says_whether_calibration_had_conversations() -> None:
    class Model:
        fingerprint = "fp"

    config = CalibrationConfig()
    with_history = [*SINGLE.values(), *_conversations(1, 2)]
    assert deployment_record(Model(), config, list(SINGLE.values())).conversations is False
    assert deployment_record(Model(), config, with_history).conversations is True
    old = {k: v for k, v in _record(False).to_json().items() if k != "conversations"}
    assert DeploymentRecord.from_metadata({"deployment": old}) == _record(False)


def test_the_generation_record_counts_earlier_messages() -> None:
    pytest.importorskip("torch")
    from abstain_guard.adapters.engine.encoding import chat_dicts
    from abstain_guard.adapters.engine.generation import generation_record

    opts = {"max_new_tokens": 24, "temperature": 0.0, "top_p": 1.0, "top_k": None, "stop": []}
    call = AIMessage(content="", tool_calls=[{"name": "f", "args": {}, "id": "1"}])
    result = ToolMessage(content="42", tool_call_id="1")
    cases = [
        ([HumanMessage("Q?")], 0),
        ([SystemMessage(SYSTEM), HumanMessage("Q?")], 0),
        ([SystemMessage(SYSTEM), HumanMessage("Q?"), call, result], 0),  # an agent's own steps
        (build_messages(QAItem("h", "Q?", ("a",), history=parse_history(TURNS))), 2),
        ([HumanMessage("A?"), call, result, AIMessage("a"), HumanMessage("Q?")], 4),
    ]
    for messages, earlier in cases:
        record = generation_record(chat_dicts(messages), opts, None)
        assert record["history_messages"] == earlier, messages
