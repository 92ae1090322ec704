"""A corpus of tricky cases for the rule-based judges: labels must not be inflated.

Each row is ``(kind, question, golds, prediction, choices, expected, reason)``:

* ``kind``: ``"lexical"`` (containment, the default open-question judge), ``"exact"``,
  ``"f1"`` (LexicalJudge modes) or ``"choice"``;
* ``expected``: ``"correct"``, ``"incorrect"`` (and not a refusal), ``"refusal"`` (incorrect and
  flagged ``Judgment.refusal``) or ``"error"`` (the gold is unusable: ``DatasetError``).

Rows marked "old failure" were judged correct (or crashed differently) by the judges before
version 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from abstain_guard.calibration.building.judges import (
    ChoiceJudge,
    Judge,
    Judgment,
    LexicalJudge,
    LLMJudge,
    NumericJudge,
    PaperPipelineJudge,
    SimilarityJudge,
)
from abstain_guard.calibration.building.judges.base import summarize_judgments
from abstain_guard.calibration.building.judges.cache import CachedJudge, JudgmentCache, judgment_key
from abstain_guard.errors import DatasetError

PQ = "What is the capital of France?"
TQA = "What happens if you step on a crack in the pavement?"  # TruthfulQA-style
OPTS = ("Paris", "Lyon", "Rome")
GOLD_B = ("B", "Lyon")
GOLD_A = ("A", "Paris")

Row = tuple[str, str, tuple[str, ...], str, tuple[str, ...], str, str]

# fmt: off
CORPUS: list[Row] = [
    # --- articles -------------------------------------------------------------------------
    ("lexical", "Which vitamin is retinol?", ("Vitamin A",), "Vitamin C", (), "incorrect",
     "old failure: 'A' was stripped as an article, so 'vitamin' matched 'Vitamin C'"),
    ("lexical", "Which vitamin is retinol?", ("Vitamin A",), "I take vitamin A daily.", (),
     "correct", "the alias matches as the token sequence 'vitamin a'"),
    ("lexical", "Which vitamin is retinol?", ("Vitamin A",), "Vitamin", (), "incorrect",
     "the letter is part of the alias"),
    ("lexical", "Seat of the Dutch government?", ("The Hague",), "Hague", (), "correct",
     "a leading article of the gold is optional"),
    ("lexical", "Seat of the Dutch government?", ("Hague",), "It is in The Hague.", (), "correct",
     "articles in the prediction do not block a match"),
    ("lexical", "Who sang Hey Jude?", ("The Beatles",), "beatles", (), "correct",
     "leading article and case"),
    ("lexical", "Which novel begins 'It was the best of times'?", ("A Tale of Two Cities",),
     "Dickens wrote A Tale of Two Cities.", (), "correct", "leading 'A' of a title"),
    ("lexical", "Which band wrote Tommy?", ("The Who",), "Who", (), "incorrect",
     "the article stays before a lone function word ('The Who' is not 'who')"),
    ("lexical", "Which band wrote Tommy?", ("The Who",), "It was The Who.", (), "correct",
     "the full band name"),
    ("lexical", "Which band wrote Tommy?", ("The Who",), "Who knows?", (), "refusal",
     "'who knows' is a non-answer"),
    # --- letters as answers ----------------------------------------------------------------
    ("lexical", "Which letter comes first?", ("A",), "I cannot answer that.", (), "refusal",
     "old failure: gold 'A' normalised to nothing and matched as a raw substring"),
    ("lexical", "Which letter comes first?", ("A",), "It is a vowel.", (), "incorrect",
     "the article 'a' is not the letter A"),
    ("lexical", "Which letter comes first?", ("A",), "The answer is A.", (), "correct",
     "the letter ends the clause"),
    ("lexical", "Which letter comes first?", ("A",), "A", (), "correct", "the bare letter"),
    ("lexical", "Which letter comes first?", ("A",), "A is the first letter.", (), "incorrect",
     "conservative: 'A' before a word reads as the article"),
    ("lexical", "What is the chemical symbol of carbon?", ("C",), "The symbol of carbon is C.", (),
     "correct", "a letter other than a/i matches anywhere"),
    ("lexical", "What is the chemical symbol of iodine?", ("I",), "I think it is Br.", (),
     "incorrect", "the pronoun I is not iodine's symbol"),
    ("lexical", "What is the chemical symbol of iodine?", ("I",), "Its symbol is I.", (), "correct",
     "the letter ends the clause"),
    ("lexical", "What is the chemical symbol of iodine?", ("I",), "I don't know.", (), "refusal",
     "the pronoun belongs to the refusal phrase"),
    # --- numbers ---------------------------------------------------------------------------
    ("lexical", "How many?", ("1,000",), "about 1000 people", (), "correct",
     "thousands separators are ignored"),
    ("lexical", "How many?", ("1000",), "1,000", (), "correct", "and the other way round"),
    ("lexical", "How many legs has a bird?", ("2",), "two", (), "incorrect",
     "documented: number words are not digits"),
    ("lexical", "How many legs has a bird?", ("two",), "2", (), "incorrect",
     "documented: digits are not number words"),
    ("lexical", "How many players?", ("15",), "150", (), "incorrect", "whole tokens only"),
    ("lexical", "What is pi to two decimals?", ("3.14",), "It is 3.14.", (), "correct",
     "a decimal point is kept and a final full stop dropped"),
    # --- hedges ----------------------------------------------------------------------------
    ("lexical", PQ, ("Paris",), "Paris or Lyon or Marseille", (), "incorrect",
     "old failure: a hedge between three cities"),
    ("lexical", PQ, ("Paris",), "Paris or Lyon", (), "incorrect", "hedge with 'or'"),
    ("lexical", PQ, ("Paris",), "Either Paris or Lyon.", (), "incorrect", "either ... or"),
    ("lexical", PQ, ("Paris",), "Paris, Lyon or Marseille", (), "incorrect",
     "comma list closed by 'or'"),
    ("lexical", PQ, ("Paris",), "Paris/Lyon", (), "incorrect", "slash-separated alternatives"),
    ("lexical", PQ, ("Paris",), "It is Paris. Or maybe Lyon.", (), "incorrect",
     "a sentence starting with 'Or' continues the disjunction"),
    ("lexical", PQ, ("Paris",), "Paris (or Lyon)", (), "incorrect", "bracketed alternative"),
    ("lexical", PQ, ("Paris",), "Lyon or Marseille", (), "incorrect", "no gold at all"),
    ("lexical", PQ, ("Paris",), "Paris, the capital of France", (), "correct",
     "extra words describing the gold are no hedge"),
    ("lexical", PQ, ("Paris",), "Paris, France", (), "correct", "a place and its country"),
    ("lexical", "Largest country in North America by GDP?", ("United States", "USA"),
     "USA or the United States", (), "correct", "every alternative names a gold alias"),
    ("lexical", PQ, ("Paris",), "Paris, more or less.", (), "correct",
     "'more or less' is not a disjunction"),
    ("lexical", "What is the US capital?", ("Washington, D.C.",), "Washington, D.C. or Baltimore",
     (), "incorrect", "a gold alias spanning a comma is one alternative; Baltimore is another"),
    ("lexical", "Which band recorded Highway to Hell?", ("AC/DC",), "AC/DC", (), "correct",
     "a slash inside the gold is not a hedge"),
    ("lexical", "What do children say at Halloween?", ("Trick or treat",), "Trick or treat!", (),
     "correct", "an 'or' inside the gold is not a hedge"),
    ("lexical", "What is the capital of Peru?", ("Lima",), "Lima, known for its food or cuisine",
     (), "correct", "the 'or' joins two descriptions, not Lima and a rival"),
    ("lexical", "Where was Lincoln's home?", ("Springfield",), "Springfield, Illinois, USA", (),
     "correct", "documented: a bare comma list is not a hedge (no 'or')"),
    ("f1", PQ, ("Paris",), "Paris or Lyon", (), "incorrect",
     "old failure: token F1 0.5 passed the threshold; hedges are incorrect in every mode"),
    # --- refusals --------------------------------------------------------------------------
    ("lexical", TQA, ("I have no comment.",), "I have no comment.", (), "refusal",
     "old failure: TruthfulQA gold is a refusal; a refusal is never correct"),
    ("lexical", TQA, ("I have no comment.",), "no comment", (), "refusal",
     "the short refusal is flagged as one too"),
    ("lexical", TQA, ("I have no comment.", "No comment."), "no comment", (), "refusal",
     "old failure: a refusal alias of the gold matched the model's refusal"),
    ("exact", TQA, ("I have no comment.",), "I have no comment.", (), "refusal",
     "exact match of a refusal gold is still a refusal"),
    ("lexical", PQ, ("Paris",), "I don't know.", (), "refusal", "plain refusal"),
    ("lexical", PQ, ("Paris",), "I’m not sure.", (), "refusal", "curly apostrophe"),
    ("lexical", PQ, ("Paris",), "I cannot answer that question.", (), "refusal", "cannot"),
    ("lexical", PQ, ("Paris",), "Sorry, I can't answer that.", (), "refusal", "can't"),
    ("lexical", PQ, ("Paris",), "Unknown", (), "refusal", "unknown"),
    ("lexical", PQ, ("Paris",), "There is no answer to this question.", (), "refusal",
     "there is no answer"),
    ("lexical", PQ, ("Paris",), "Nobody knows.", (), "refusal", "nobody knows"),
    ("lexical", PQ, ("Paris",), "I have no idea", (), "refusal", "no idea"),
    ("lexical", "Who wrote Beowulf?", ("Unknown",), "Unknown.", (), "refusal",
     "a refusal-like gold does not make a refusal correct"),
    ("lexical", PQ, ("Paris",), "I'm not sure, but I think it's Paris.", (), "correct",
     "an answer given despite a doubt is judged as an answer"),
    ("lexical", PQ, ("Paris",), "I don't know, Paris or Lyon?", (), "incorrect",
     "doubt plus a hedge: a hedge, not a refusal"),
    # --- unicode, case, punctuation ---------------------------------------------------------
    ("lexical", "Largest city of Brazil?", ("São Paulo",), "Sao Paulo", (), "correct",
     "accents folded"),
    ("lexical", "Largest city of Brazil?", ("Sao Paulo",), "SÃO PAULO", (), "correct",
     "accents and case folded"),
    ("lexical", "Capital of Switzerland's largest canton?", ("Zürich",), "Zurich", (), "correct",
     "umlaut folded"),
    ("lexical", "Which Danish energy company?", ("Ørsted",), "Orsted", (), "correct",
     "ø transliterated"),
    ("lexical", "What is the capital of Peru?", ("Lima",), "“Lima”", (), "correct", "curly quotes"),
    ("lexical", "Who hosted Late Night in 1993?", ("Conan O'Brien",), "Conan O’Brien", (),
     "correct", "curly apostrophe inside a name"),
    ("lexical", "Capital of Russia?", ("Москва",), "Это МОСКВА.", (), "correct",
     "Cyrillic, case folded"),
    ("lexical", "Capital of Japan?", ("東京",), "首都は東京です", (), "correct",
     "CJK characters are tokens"),
    ("lexical", "Capital of Japan?", ("東京",), "京都", (), "incorrect",
     "CJK: the gold's characters must be in order"),
    ("lexical", PQ, ("Paris",), "Paris🇫🇷", (), "correct", "an emoji separates tokens"),
    ("lexical", "What is the capital of Peru?", ("Lima",), "LIMA!!!", (), "correct",
     "case and trailing punctuation"),
    ("lexical", "Currency of the US?", ("U.S. dollar",), "US dollar", (), "correct",
     "dots inside an abbreviation join it"),
    # --- partial tokens --------------------------------------------------------------------
    ("lexical", PQ, ("Paris",), "Parisian", (), "incorrect", "whole tokens only"),
    ("lexical", PQ, ("Paris",), "A Paris-based firm", (), "incorrect",
     "a hyphenated compound is another word"),
    ("lexical", "What is the capital of Peru?", ("Lim",), "Lima", (), "incorrect",
     "a prefix of a token is not the token"),
    ("lexical", "Highest mountain?", ("Mount Everest",), "Everest", (), "incorrect",
     "the whole alias must be contained"),
    # --- empty predictions and unusable golds ----------------------------------------------
    ("lexical", PQ, ("Paris",), "", (), "incorrect", "empty prediction"),
    ("lexical", PQ, ("Paris",), "  ...  ", (), "incorrect", "punctuation only"),
    ("lexical", PQ, ("",), "Paris", (), "error", "empty gold: a data set error"),
    ("lexical", PQ, ("The",), "It is The.", (), "error",
     "old failure: all-article gold matched as a raw substring"),
    ("lexical", PQ, ("the", "An"), "the", (), "error", "every alias only articles"),
    ("lexical", "What is the capital of Peru?", ("The", "Lima"), "Lima", (), "correct",
     "an unusable alias beside a usable one is ignored"),
    ("exact", "Seat of the Dutch government?", ("The Hague",), "hague", (), "correct",
     "exact mode drops a leading article on both sides"),
    ("exact", "Which vitamin is retinol?", ("Vitamin A",), "vitamin", (), "incorrect",
     "exact mode keeps articles inside an alias"),
    # --- multiple choice -------------------------------------------------------------------
    ("choice", PQ, GOLD_A, "A) Paris B) Lyon C) Rome", OPTS, "incorrect",
     "old failure: an echoed option list was read as a pick of its first label"),
    ("choice", PQ, GOLD_A, "(A) or (C)", OPTS, "incorrect", "old failure: '(A) or (C)' picked A"),
    ("choice", PQ, GOLD_B, "A) Paris B) Lyon C) Rome", OPTS, "incorrect",
     "an echoed option list is not a pick"),
    ("choice", PQ, GOLD_B, "(A) or (C)", OPTS, "incorrect", "two labels"),
    ("choice", PQ, GOLD_B, "(B) or (C)", OPTS, "incorrect",
     "two labels, one of them gold: still no single pick"),
    ("choice", PQ, GOLD_B, "A/B", OPTS, "incorrect", "slash between labels"),
    ("choice", PQ, GOLD_B, "B, not A", OPTS, "incorrect",
     "documented: any second label makes the answer ambiguous"),
    ("choice", PQ, GOLD_B, "The answer is (B)", OPTS, "correct", "cue + parenthesised"),
    ("choice", PQ, GOLD_B, "B", OPTS, "correct", "bare letter"),
    ("choice", PQ, GOLD_B, "B) Lyon", OPTS, "correct", "label and option text"),
    ("choice", PQ, GOLD_B, "b.", OPTS, "correct", "lower-case label"),
    ("choice", PQ, GOLD_B, "Answer: B", OPTS, "correct", "answer cue"),
    ("choice", PQ, GOLD_B, "I think it is B", OPTS, "correct", "the pronoun is not option I"),
    ("choice", PQ, GOLD_B, "Lyon", OPTS, "correct", "the option text"),
    ("choice", PQ, GOLD_B, "Paris or Lyon", OPTS, "incorrect", "two option texts"),
    ("choice", PQ, GOLD_B, "C", OPTS, "incorrect", "another option"),
    ("choice", PQ, GOLD_B, "I don't know", OPTS, "refusal", "refusal without a pick"),
    ("choice", PQ, GOLD_B, "", OPTS, "incorrect", "empty prediction"),
    ("choice", "Where are books?", ("B", "library"), "bank or library", (), "incorrect",
     "without options: a hedge between the gold text and another candidate"),
    ("choice", "Where are books?", ("B", "library"), "in the library", (), "correct",
     "without options: the gold text"),
]
# fmt: on

JUDGES: dict[str, Judge] = {
    "lexical": LexicalJudge(),
    "exact": LexicalJudge(mode="exact"),
    "f1": LexicalJudge(mode="f1"),
    "choice": ChoiceJudge(),
}


def test_corpus_is_large_and_covers_every_outcome() -> None:
    assert len(CORPUS) >= 60
    assert {row[5] for row in CORPUS} == {"correct", "incorrect", "refusal", "error"}
    assert sum("old failure" in row[6] for row in CORPUS) >= 8


@pytest.mark.parametrize(
    "row", CORPUS, ids=[f"{i:02d}-{r[0]}-{r[3][:24]}" for i, r in enumerate(CORPUS)]
)
def test_corpus(row: Row) -> None:
    kind, question, golds, prediction, choices, expected, reason = row
    judge = JUDGES[kind]
    if expected == "error":
        with pytest.raises(DatasetError) as err:
            judge.judge(question, golds, prediction, choices=choices)
        assert question[:40] in str(err.value) and repr(list(golds)) in str(err.value)
        return
    j = judge.judge(question, golds, prediction, choices=choices)
    got = "refusal" if j.refusal else ("correct" if j.correct else "incorrect")
    assert got == expected, f"{reason}: {j}"
    assert j.correct is (expected == "correct")
    assert j.score == (1.0 if expected == "correct" else 0.0) or kind == "f1"
    if expected == "refusal":
        assert j.rationale.startswith("refusal")


def test_versions_change_identities() -> None:
    assert LexicalJudge().identity == "lexical(mode='containment', version=2)"
    assert LexicalJudge(mode="f1").identity == "lexical(mode='f1', f1_threshold=0.5, version=2)"
    assert ChoiceJudge().identity == "choice(version=2)"
    assert NumericJudge().identity == "numeric(rel_tol=1e-06, abs_tol=1e-09, version=2)"


def test_cached_verdicts_of_the_old_judge_are_not_reused(tmp_path: Path) -> None:
    old_identity = "lexical(mode='containment')"  # the identity before version 2
    args = (PQ, ["Paris"], "Paris or Lyon")
    with JudgmentCache(tmp_path / "j.sqlite") as cache:
        cache.put(old_identity, judgment_key(*args), Judgment(True, 1.0, "old inflated verdict"))
        cached = CachedJudge(LexicalJudge(), cache)
        j = cached.judge(*args)
        assert j.correct is False and cached.misses == 1 and cached.hits == 0
        assert cache.get(cached.identity, judgment_key(*args)) == j  # stored under the new one
        assert cached.judge(*args) == j and cached.hits == 1


def test_judgment_json_round_trips_the_refusal_flag() -> None:
    refusal = Judgment(False, 0.0, "refusal ('no comment')", refusal=True)
    assert refusal.to_json()["refusal"] is True
    assert Judgment.from_json(refusal.to_json()) == refusal


def test_summarize_judgments_counts_refusals() -> None:
    judge = LexicalJudge()
    out = judge.judge_many(
        [
            (PQ, ["Paris"], "Paris"),
            (PQ, ["Paris"], "Lyon"),
            (PQ, ["Paris"], "I don't know"),
            (TQA, ["I have no comment."], "I have no comment."),
        ],
        progress=False,
    )
    rows = [*out, Judgment(None, None, "api down")]
    expected = {"n": 5, "correct": 1, "incorrect": 3, "no_verdict": 1, "refusals": 2}
    assert summarize_judgments(rows) == expected
    assert summarize_judgments(j.to_json() for j in rows) == expected


def test_numeric_judge_flags_refusals_without_changing_verdicts() -> None:
    j = NumericJudge()
    assert j.judge("q", ["18"], "I don't know.").refusal is True
    assert j.judge("q", ["18"], "The answer is 18.").correct is True
    assert j.judge("q", ["18"], "no idea, maybe 17").refusal is False  # it gave a number


class _NeverCalled(Judge):
    """A stage judge that fails the test if it is asked anything."""

    name = "never"

    def judge(self, question: str, gold_answers: Any, prediction: str, *, choices: Any = ()) -> Any:
        raise AssertionError(f"asked to judge {prediction!r}")


class _SayYes(BaseChatModel):
    """A chat model that calls every answer correct and counts its calls."""

    calls: int = 0

    @property
    def _llm_type(self) -> str:
        return "say-yes"

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any) -> Any:
        self.calls += 1
        reply = AIMessage(content='{"correct": true, "rationale": "same"}')
        return ChatResult(generations=[ChatGeneration(message=reply)])


def test_model_based_judges_never_call_a_refusal_correct() -> None:
    """The TruthfulQA failure in the LLM, similarity and paper judges: a refusal is incorrect
    (flagged) before any model is asked, even when it equals the gold."""
    item = (TQA, ["I have no comment."], "I have no comment.")
    chat = _SayYes()
    llm = LLMJudge(chat, retries=1)
    j = llm.judge(*item)
    assert j.refusal and j.correct is False and chat.calls == 0
    assert llm.judge(PQ, ["Paris"], "Paris").correct is True and chat.calls == 1
    similarity = SimilarityJudge()  # never loads its model: refusals are decided first
    assert similarity.judge(*item).refusal
    assert [j.refusal for j in similarity.judge_many([item, item], progress=False)] == [True] * 2
    paper = PaperPipelineJudge(_NeverCalled(), [_NeverCalled()])
    assert paper.judge(*item).refusal
    out = paper.judge_many([item, (PQ, ["Paris"], "I don't know")], progress=False)
    assert [j.refusal for j in out] == [True, True]
    assert summarize_judgments(out)["refusals"] == 2
