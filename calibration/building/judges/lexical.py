"""Rule-based judges: :class:`LexicalJudge` (open questions), :class:`NumericJudge` (math) and
:class:`ChoiceJudge` (multiple choice); their rules: docs/configuration.md, 'The rule-based
judges'. Text analysis lives in :mod:`..questions.answer_text`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from abstain_guard.errors import DatasetError, JudgeError

from ..questions.answer_text import (
    alias_tokens,
    answer_tokens,
    contains_tokens,
    hedge_alternatives,
    mentions_alias,
    normalize_answer,
    refusal_phrase,
    token_f1,
    without_refusals,
)
from .base import Judge, Judgment

Alias = tuple[str, list[str]]


def usable_aliases(question: str, gold_answers: Sequence[str]) -> list[Alias]:
    """``(alias, tokens)`` for every usable gold alias (:func:`.answer_text.alias_tokens`).

    Raises:
        DatasetError: no alias is usable (none given, or all empty or only articles).
    """
    out = [(g, t) for g in gold_answers if (t := alias_tokens(g)) is not None]
    if not out:
        raise DatasetError(
            f"the gold answer(s) {list(gold_answers)!r} of the question {question[:200]!r} are "
            "empty or only articles ('the', 'an'), so no answer could ever match them; fix the "
            "data set (give the question a real gold answer) or drop the question"
        )
    return out


def refusal_of(prediction: str, gold_answers: Sequence[str]) -> str | None:
    """The refusal phrase of a prediction that refuses and names no gold alias outside the
    phrase, else None (TruthfulQA's gold ``"I have no comment."`` is itself a refusal: it is
    never named outside the refusal phrase). Unusable aliases are ignored, nothing raises:
    judges that do not match text (LLM judges) use it to flag their refusals."""
    return _refusal([t for g in gold_answers if (t := alias_tokens(g)) is not None], prediction)


def refusal_verdict(gold_answers: Sequence[str], prediction: str) -> Judgment | None:
    """The refusal verdict (incorrect, flagged) when the prediction refuses and names no gold
    alias outside the refusal phrase (:func:`refusal_of`), else None. Every judge applies it
    first, so a refusal is incorrect and counted whichever judge decides."""
    phrase = refusal_of(prediction, gold_answers)
    return None if phrase is None else Judgment(False, 0.0, f"refusal ({phrase!r})", refusal=True)


def _refusal(aliases: Sequence[Sequence[str]], prediction: str) -> str | None:
    phrase = refusal_phrase(prediction)
    if phrase is None:
        return None
    rest = without_refusals(prediction)
    return None if any(mentions_alias(rest, a) for a in aliases) else phrase


class LexicalJudge(Judge):
    """Normalised whole-token matching against every gold alias, by ``mode``:
    ``"containment"`` (a gold alias occurs in the prediction), ``"exact"`` or ``"f1"`` (the
    best token F1 is at least ``f1_threshold``). Empty predictions, refusals and hedges are
    incorrect in every mode. A question whose aliases are all empty or only articles raises
    :class:`~abstain_guard.errors.DatasetError`.
    """

    name = "lexical"
    #: Bumped whenever verdicts change, so cached judgments of an older judge are not reused.
    version: ClassVar[int] = 2

    def __init__(
        self,
        mode: Literal["containment", "exact", "f1"] = "containment",
        f1_threshold: float = 0.5,
    ) -> None:
        if mode not in ("containment", "exact", "f1"):
            raise JudgeError(
                f"LexicalJudge mode must be 'containment', 'exact' or 'f1', got {mode!r}"
            )
        if not 0.0 <= f1_threshold <= 1.0:
            raise JudgeError(f"f1_threshold must be in [0, 1], got {f1_threshold}")
        self.mode = mode
        self.f1_threshold = f1_threshold

    def params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"mode": self.mode}
        if self.mode == "f1":
            p["f1_threshold"] = self.f1_threshold
        p["version"] = self.version
        return p

    def judge(
        self,
        question: str,
        gold_answers: Sequence[str],
        prediction: str,
        *,
        choices: Sequence[str] = (),
    ) -> Judgment:
        aliases = usable_aliases(question, gold_answers)
        tokens = [t for _, t in aliases]
        if not answer_tokens(prediction):
            return Judgment(False, 0.0, "empty prediction")
        refused = _refusal(tokens, prediction)
        if refused is not None:
            return Judgment(False, 0.0, f"refusal ({refused!r})", refusal=True)
        hedge = hedge_alternatives(prediction, tokens)
        if hedge:
            shown = " | ".join(hedge)[:160]
            return Judgment(False, 0.0, f"hedge: {len(hedge)} alternatives ({shown})")
        if self.mode == "f1":
            best, alias = max((token_f1(prediction, g), g) for g, _ in aliases)
            ok = best >= self.f1_threshold
            return Judgment(ok, best, f"best token F1 {best:.2f} with {alias!r}")
        pred_tokens = answer_tokens(prediction)
        verb = "equals" if self.mode == "exact" else "contains"
        for g, t in aliases:
            hit = pred_tokens == t if self.mode == "exact" else mentions_alias(prediction, t)
            if hit:
                return Judgment(True, 1.0, f"prediction {verb} gold alias {g!r}")
        return Judgment(False, 0.0, f"prediction {verb} none of {len(aliases)} gold aliases")


# --- numeric ------------------------------------------------------------------------------

_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-−]?)\s?\$?\s?(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
)
_ANSWER_CUE = re.compile(r"(?:####|answer\s*(?:is|:|=)|boxed\{)", re.I)


def extract_final_number(text: str) -> float | None:
    """The answer's final number: the first number after the last ``####`` / ``answer is`` /
    ``\\boxed{`` cue, else the last number in the text. Handles thousands commas, ``$``,
    negative signs and a trailing full stop (``"The answer is $1,234.00."`` → 1234.0)."""
    cues = list(_ANSWER_CUE.finditer(text))
    if cues:
        m = _NUMBER.search(text, cues[-1].end())
        if m:
            return _to_float(m)
    matches = list(_NUMBER.finditer(text))
    return _to_float(matches[-1]) if matches else None


def _to_float(m: re.Match[str]) -> float:
    value = float(m.group("num").replace(",", ""))
    return -value if m.group("sign") else value


class NumericJudge(Judge):
    """The prediction's final number (:func:`extract_final_number`) against the gold number(s),
    equal within ``rel_tol`` (relative) or ``abs_tol``. An answer without a number that
    refuses ("I don't know") is marked ``refusal``."""

    name = "numeric"
    version: ClassVar[int] = 2

    def __init__(self, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> None:
        self.rel_tol = rel_tol
        self.abs_tol = abs_tol

    def params(self) -> dict[str, Any]:
        return {"rel_tol": self.rel_tol, "abs_tol": self.abs_tol, "version": self.version}

    def judge(
        self,
        question: str,
        gold_answers: Sequence[str],
        prediction: str,
        *,
        choices: Sequence[str] = (),
    ) -> Judgment:
        golds = [v for v in (extract_final_number(g) for g in gold_answers) if v is not None]
        if not golds:
            raise JudgeError(
                f"no gold number in {list(gold_answers)[:3]} for {question[:60]!r}; "
                "NumericJudge needs numeric gold answers"
            )
        got = extract_final_number(prediction)
        if got is None:
            phrase = refusal_phrase(prediction)
            if phrase is not None:
                return Judgment(False, 0.0, f"refusal ({phrase!r})", refusal=True)
            return Judgment(False, 0.0, "no number in the prediction")
        for g in golds:
            if math.isclose(got, g, rel_tol=self.rel_tol, abs_tol=self.abs_tol):
                return Judgment(True, 1.0, f"final number {got:g} equals gold {g:g}")
        return Judgment(False, 0.0, f"final number {got:g} differs from gold {golds[0]:g}")


# --- multiple choice ----------------------------------------------------------------------

_LETTER_ONLY = re.compile(r"^\W*\(?([A-Za-z])\)?\W*$")
_LETTER_CUE = re.compile(
    r"\b(?:answer|option|choice)\b\s*(?:is|would be|:|=)?\s*\(?([A-Za-z])\)?(?![\w'])", re.I
)
_LETTER_LEAD = re.compile(r"^\W*\(?([A-Za-z])\s*[).:](?!\w)")
_LETTER_PAREN = re.compile(r"\(([A-Za-z])\)|(?<![\w])([A-Z])\)")
#: A capital letter standing alone, not inside an abbreviation ("U.S.").
_LETTER_LONE = re.compile(r"(?<![\w'.])([A-Z])(?![\w']|\.\w)")
#: "A" as the article: before a lower-case word other than a conjunction ("A bank", not "A or C").
_ARTICLE_A = re.compile(r"A\s+(?!(?:or|and|nor|vs)\b)[a-z]")


def _gold_choice(gold: Sequence[str], choices: Sequence[str]) -> tuple[int | None, list[str]]:
    """(gold option index or None, gold option texts) from letter and/or text aliases."""
    index: int | None = None
    texts: list[str] = []
    for g in gold:
        s = g.strip()
        if re.fullmatch(r"\(?[A-Za-z]\)?", s):
            if index is None:
                index = ord(s.strip("()").upper()) - ord("A")
        else:
            texts.append(s)
    if index is None and choices:
        norm = [normalize_answer(c) for c in choices]
        for t in texts:
            if normalize_answer(t) in norm:
                index = norm.index(normalize_answer(t))
                break
    if index is not None and choices and 0 <= index < len(choices):
        texts = [choices[index], *[t for t in texts if t != choices[index]]]
    return index, texts


def _letter_mentions(prediction: str, n_options: int | None) -> dict[int, str]:
    """Every option the prediction names by its letter: ``{index: which rule found it}``.

    Rules: a bare letter (``"b."``); an ``answer is X`` / ``Answer: X`` / ``option X`` cue (a
    lower-case letter followed by a word is an article or pronoun: ``"answer is a bank"``); a
    leading label (``"B) Paris"``); a parenthesised label (``"(C)"``, ``"C)"``); a lone capital
    letter, except the pronoun ``I`` and the article ``A`` before a word.
    """
    found: dict[int, str] = {}

    def add(letter: str, how: str) -> None:
        i = ord(letter.upper()) - ord("A")
        if 0 <= i < 26 and (n_options is None or i < n_options):
            found.setdefault(i, how)

    text = prediction.strip()
    m = _LETTER_ONLY.match(text)
    if m:
        add(m.group(1), "a bare letter")
        return found
    for m in _LETTER_CUE.finditer(text):
        if m.group(1).isupper() or not re.match(r"\)?\s+[A-Za-z]", text[m.end(1) :]):
            add(m.group(1), "an 'answer is X' cue")
    m = _LETTER_LEAD.match(text)
    if m:
        add(m.group(1), "a leading option label")
    for m in _LETTER_PAREN.finditer(text):
        add(m.group(1) or m.group(2), "a parenthesised label")
    for m in _LETTER_LONE.finditer(text):
        letter = m.group(1)
        if letter != "I" and not (letter == "A" and _ARTICLE_A.match(text, m.start())):
            add(letter, "a lone option letter")
    return found


def _letters(indices: Sequence[int], sep: str = ", ") -> str:
    return sep.join(chr(ord("A") + i) for i in indices)


class ChoiceJudge(Judge):
    """Multiple choice: which option did the prediction pick, and is it the gold one? The gold
    is an option letter (``"B"``) and/or the option text (``QAItem.answers`` of a choice item
    holds both); the options come through ``choices`` (or the 4th element of a
    :meth:`judge_many` input), and with them an answer may name an option by its text.
    """

    name = "choice"
    version: ClassVar[int] = 2

    def params(self) -> dict[str, Any]:
        return {"version": self.version}

    def judge(
        self,
        question: str,
        gold_answers: Sequence[str],
        prediction: str,
        *,
        choices: Sequence[str] = (),
    ) -> Judgment:
        gold_index, gold_texts = _gold_choice(gold_answers, choices)
        if gold_index is None and not gold_texts:
            raise JudgeError(f"no gold option in {list(gold_answers)} for {question[:60]!r}")
        if not answer_tokens(prediction):
            return Judgment(False, 0.0, "empty prediction")
        phrase = refusal_phrase(prediction)
        text = without_refusals(prediction) if phrase else prediction
        found = _letter_mentions(text, len(choices) if choices else None)
        if len(found) > 1:
            return Judgment(False, 0.0, f"named several option labels ({_letters(sorted(found))})")
        if found:
            [(picked, how)] = found.items()
            if gold_index is None:
                if not choices:
                    return Judgment(
                        None, None, "the prediction names a letter but the gold has none"
                    )
                ok = normalize_answer(choices[picked]) in map(normalize_answer, gold_texts)
            else:
                ok = picked == gold_index
            return Judgment(ok, float(ok), f"picked option {_letters([picked])} ({how})")
        verdict = (
            _by_option_text(text, gold_index, gold_texts, choices)
            if choices
            else _by_gold_text(text, gold_texts)
        )
        if verdict is not None:
            return verdict
        if phrase:
            return Judgment(False, 0.0, f"refusal ({phrase!r})", refusal=True)
        if choices:
            return Judgment(False, 0.0, "named no option")
        return Judgment(False, 0.0, "named neither the gold letter nor the gold option text")


def _by_option_text(
    text: str, gold_index: int | None, gold_texts: Sequence[str], choices: Sequence[str]
) -> Judgment | None:
    """The verdict from the option texts the prediction names; None when it names none."""
    options = {i: t for i, c in enumerate(choices) if (t := alias_tokens(c)) is not None}
    named = [i for i, t in options.items() if mentions_alias(text, t)]
    # drop options whose text is part of a longer named option ("mall" in "shopping mall");
    # options with the same text (data sets have duplicates) stay together
    named = [
        i
        for i in named
        if not any(
            options[i] != options[j] and contains_tokens(options[j], options[i]) for j in named
        )
    ]
    if not named:
        return None
    if len({tuple(options[i]) for i in named}) > 1:
        return Judgment(False, 0.0, f"named several options ({_letters(named)})")
    if gold_index is not None:
        ok = gold_index in named
    else:
        ok = normalize_answer(choices[named[0]]) in {normalize_answer(t) for t in gold_texts}
    return Judgment(ok, float(ok), f"named option {_letters(named, '/')} by its text")


def _by_gold_text(text: str, gold_texts: Sequence[str]) -> Judgment | None:
    """Without options: the gold option text named (and no hedge); None when it is not."""
    aliases = [(t, a) for t in gold_texts if (a := alias_tokens(t)) is not None]
    hedge = hedge_alternatives(text, [a for _, a in aliases])
    if hedge:
        return Judgment(False, 0.0, f"hedge: {len(hedge)} alternatives ({' | '.join(hedge)})")
    for t, a in aliases:
        if mentions_alias(text, a):
            return Judgment(True, 1.0, f"contains the gold option text {t!r}")
    return None
