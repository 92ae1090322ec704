"""Rule-based judges (lexical, numeric, choice) and the judge factory on curated cases."""

from __future__ import annotations

import pytest

from abstain_guard.calibration.building.judges import (
    JUDGE_NAMES,
    ChoiceJudge,
    Judgment,
    LexicalJudge,
    NumericJudge,
    make_judge,
)
from abstain_guard.calibration.building.judges.lexical import extract_final_number
from abstain_guard.calibration.building.questions.answer_text import normalize_answer, token_f1
from abstain_guard.errors import DatasetError, JudgeError


def test_normalize_answer() -> None:
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    # only a leading article goes; articles inside an answer stay ("Vitamin A" is not "Vitamin")
    assert normalize_answer("An apple, a day.") == "apple a day"
    assert normalize_answer("Vitamin A") == "vitamin a"
    assert normalize_answer("Brasília") == "brasilia"
    assert normalize_answer("“Lima”") == "lima"
    assert normalize_answer("Theater") == "theater"  # articles only as whole words


@pytest.mark.parametrize(
    ("gold", "prediction", "expected"),
    [
        (["Lima"], "The capital of Peru is Lima.", True),
        (["Lima"], "lima", True),
        (["Lima"], "Limassol", False),  # whole tokens only
        (["United States dollar", "US dollar", "dollar"], "It is the U.S. Dollar.", True),
        (["The Beatles"], "beatles", True),  # article and case
        (["Brasília"], "Brasilia", True),  # accents
        (["Mount Everest"], "Everest", False),  # the alias must be contained, not vice versa
        (["14 December 1972 UTC", "December 1972"], "It was in December, 1972.", True),
        (["Paris"], "I don't know.", False),
        (["1,000"], "about 1000 people", True),
    ],
)
def test_lexical_containment(gold: list[str], prediction: str, expected: bool) -> None:
    j = LexicalJudge().judge("q?", gold, prediction)
    assert j.correct is expected
    assert j.score == float(expected)
    assert j.rationale


def test_lexical_exact_and_f1() -> None:
    exact = LexicalJudge(mode="exact")
    assert exact.judge("q", ["The Beatles"], "beatles!").correct is True
    assert exact.judge("q", ["Beatles"], "the beatles band").correct is False
    f1 = LexicalJudge(mode="f1", f1_threshold=0.5)
    j = f1.judge("q", ["Barack Obama"], "President Obama")
    assert j.correct is True and j.score == pytest.approx(0.5)
    assert f1.judge("q", ["Barack Obama"], "George Bush").correct is False
    assert token_f1("a b c", "a b c") == 1.0
    assert token_f1("", "x") == 0.0
    assert LexicalJudge().identity != LexicalJudge(mode="exact").identity
    assert LexicalJudge(mode="f1", f1_threshold=0.6).identity != f1.identity
    with pytest.raises(JudgeError):
        LexicalJudge(mode="fuzzy")  # type: ignore[arg-type]


def test_lexical_gold_that_normalises_to_nothing() -> None:
    j = LexicalJudge()
    # formerly a raw substring test ("The" in "It is The." → correct): now a data set error
    with pytest.raises(DatasetError, match="The"):
        j.judge("q", ["The"], "It is The.")
    assert j.judge("q", ["The", "Lima"], "the").correct is False  # "The" is ignored: Lima exists


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("The answer is 42.", 42.0),
        ("She pays $1,234.00 in total.", 1234.0),
        ("so 5 - 8 = -3", -3.0),
        ("First 3 apples, then 7 pears: 10", 10.0),
        ("The answer is 18. Because 9 * 2 = 18 and 4 more", 18.0),
        ("He sold 2,500,000 units #### 2500000", 2500000.0),
        ("0.5 of it", 0.5),
        ("\\boxed{70000} done in 3 steps", 70000.0),
        ("no numbers here", None),
    ],
)
def test_extract_final_number(text: str, value: float | None) -> None:
    assert extract_final_number(text) == value


def test_numeric_judge() -> None:
    j = NumericJudge()
    assert j.judge("q", ["70000"], "So he made a profit of $70,000.").correct is True
    assert j.judge("q", ["18"], "The answer is 18.").correct is True
    assert j.judge("q", ["-3"], "The result is -3").correct is True
    assert j.judge("q", ["3"], "The result is -3").correct is False
    assert j.judge("q", ["18"], "I am not sure.").correct is False
    assert j.judge("q", ["2.5"], "2.50").correct is True
    assert j.judge("q", ["x\n#### 1,319"], "1319").correct is True  # raw GSM8K gold
    with pytest.raises(JudgeError):
        j.judge("q", ["many"], "3")


CHOICES = ("bank", "library", "department store", "mall", "shopping mall")
GOLD = ("B", "library")


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("B", True),
        ("(B)", True),
        ("B.", True),
        ("The answer is B", True),
        ("The answer is (B).", True),
        ("b) library", True),
        ("B: library", True),
        ("library", True),
        ("You would find it in a library.", True),
        ("A", False),
        ("A bank", False),  # option text "bank" (the "A" is an article)
        ("The answer is A", False),
        ("The answer is a library.", True),  # "a" is the article, not option A
        ("I think it is B", True),  # "I" is the pronoun
        ("I would pick D", False),
        ("shopping mall", False),  # "mall" is part of "shopping mall": one option named
        ("bank or library", False),  # hedging between options
        ("I don't know", False),
        ("F", False),  # not an option: nothing picked
    ],
)
def test_choice_judge_with_choices(prediction: str, expected: bool) -> None:
    j = ChoiceJudge().judge("Where are books?", GOLD, prediction, choices=CHOICES)
    assert j.correct is expected, j.rationale


def test_choice_judge_with_duplicate_option_texts() -> None:
    # CommonsenseQA has items whose options repeat a text ("bar", "bar")
    choices = ("supermarket", "pantry", "motherboard", "bar", "bar")
    j = ChoiceJudge()
    assert j.judge("q", ("D", "bar"), "bar", choices=choices).correct is True
    assert j.judge("q", ("A", "supermarket"), "bar", choices=choices).correct is False


def test_choice_judge_without_choices_uses_letter_and_gold_text() -> None:
    j = ChoiceJudge()
    assert j.judge("q", GOLD, "The answer is B").correct is True
    assert j.judge("q", GOLD, "(C)").correct is False
    assert j.judge("q", GOLD, "in the library").correct is True
    assert j.judge("q", ["B"], "library").correct is False
    assert j.judge("q", ["library"], "The answer is library").correct is True
    assert j.judge("q", GOLD, "I think it is B").correct is True
    assert j.judge("q", GOLD, "The options are hard; library").correct is True
    # only a gold text, and a letter answer without options: undecidable
    assert j.judge("q", ["library"], "B").correct is None
    # gold text only, options known: the letter is mapped through the options
    assert j.judge("q", ["library"], "B", choices=CHOICES).correct is True


def test_judge_many_keeps_order_and_accepts_choice_quadruples() -> None:
    inputs = [
        ("q1", ["Lima"], "Lima"),
        ("q2", ["Paris"], "Rome"),
        ("q3", ("B", "library"), "B", CHOICES),
    ]
    out = make_judge("lexical").judge_many(inputs[:2], progress=False)
    assert [j.correct for j in out] == [True, False]
    out = ChoiceJudge().judge_many([inputs[2], inputs[2]], progress=False)
    assert [j.correct for j in out] == [True, True]
    with pytest.raises(JudgeError):
        LexicalJudge().judge_many([("q", ["a"])], progress=False)  # type: ignore[list-item]


def test_make_judge_names_and_errors() -> None:
    assert isinstance(make_judge("lexical"), LexicalJudge)
    assert make_judge({"name": "lexical", "mode": "f1"}).identity.startswith("lexical(mode='f1'")
    assert isinstance(make_judge("numeric"), NumericJudge)
    assert isinstance(make_judge("Choice"), ChoiceJudge)
    judge = NumericJudge(rel_tol=0.01)
    assert make_judge(judge) is judge
    with pytest.raises(JudgeError) as err:
        make_judge("bleurt")
    for name in JUDGE_NAMES:
        assert name in str(err.value)
    with pytest.raises(JudgeError, match="no parameter"):
        make_judge({"name": "lexical", "treshold": 0.5})
    with pytest.raises(JudgeError, match="needs a 'name'"):
        make_judge({"mode": "f1"})
    with pytest.raises(JudgeError, match="available"):
        make_judge({"name": "llm", "model": "gpt"})
    with pytest.raises(JudgeError, match="two stage-2"):
        make_judge("paper")


def test_judgment_json_round_trip() -> None:
    for j in (Judgment(True, 1.0, "x"), Judgment(None, None, "api down"), Judgment(False, 0.2, "")):
        assert Judgment.from_json(j.to_json()) == j
