"""Answer text analysis for the rule-based judges: normalisation into whole tokens, gold
alias matching, refusal detection and hedge detection. The normalisation rules:
docs/configuration.md, 'How answers are normalised'.
"""

from __future__ import annotations

import itertools
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

ARTICLES = frozenset({"a", "an", "the"})
#: One-letter English words: as a gold alias (the letter ``"A"``, iodine's ``"I"``) they only
#: match where the prediction ends a clause with them (``"The answer is A."``), never the
#: article or pronoun in ``"It is a vowel"`` / ``"I think ..."``.
_WORD_LETTERS = frozenset({"a", "i"})
#: Never drop a leading article when only one of these remains (``"The Who"``).
_KEEP_AFTER_ARTICLE = frozenset(
    {"who", "what", "which", "where", "when", "why", "how", "it", "is", "are", "was", "of"}
    | {"in", "on", "at", "to", "and", "or", "not", "no", "yes", "one", "end", "same"}
)
_TRANSLIT = str.maketrans(
    {"ø": "o", "Ø": "O", "æ": "ae", "Æ": "AE", "œ": "oe", "Œ": "OE", "ł": "l", "Ł": "L"}
    | {"đ": "d", "Đ": "D", "ı": "i", "þ": "th", "Þ": "TH", "ð": "d", "Ð": "D"}
    | {"\u2019": "'", "\u2018": "'", "\u02bc": "'", "\u00b4": "'", "`": "'"}
)
_HYPHENS = frozenset({"-", "\u2010", "\u2011"})
_CJK = ((0x3040, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF))


def _fold(text: str, *, casefold: bool = True) -> str:
    """NFKD, accents dropped, a few letters transliterated, one apostrophe; case folded
    unless ``casefold=False``."""
    text = unicodedata.normalize("NFKD", text).translate(_TRANSLIT)
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    return text.casefold() if casefold else text


def _is_punct(ch: str) -> bool:
    """Punctuation, and symbols such as emoji and ``°`` (they separate tokens too)."""
    cat = unicodedata.category(ch)
    return ch in string.punctuation or cat.startswith("P") or cat == "So"


def _is_cjk(ch: str) -> bool:
    return any(lo <= ord(ch) <= hi for lo, hi in _CJK)


def _joins(s: str, i: int) -> bool:
    """Whether the punctuation ``s[i]`` joins the characters around it into one token."""
    prev, nxt = s[i - 1 : i], s[i + 1 : i + 2]
    if not (prev.isalnum() and nxt.isalnum()):
        return False
    ch = s[i]
    if ch == ",":  # thousands separator: a digit, then exactly three digits
        return prev.isdigit() and bool(re.match(r"\d{3}(?!\d)", s[i + 1 :]))
    return ch in "'.&" or ch in _HYPHENS


def clauses(text: str) -> list[list[str]]:
    """The normalised tokens of ``text``, grouped by clause (punctuation between words ends a
    clause). No article is dropped here."""
    s = _fold(text)
    out: list[list[str]] = [[]]
    word: list[str] = []

    def flush() -> None:
        if word:
            out[-1].append("".join(word))
            word.clear()

    for i, ch in enumerate(s):
        if ch.isspace():
            flush()
        elif _is_punct(ch):
            if ch == "." and s[i - 1 : i].isdigit() and s[i + 1 : i + 2].isdigit():
                word.append(".")
            elif not _joins(s, i):
                flush()
                if out[-1]:
                    out.append([])
        elif _is_cjk(ch):
            flush()
            out[-1].append(ch)
        else:
            word.append(ch)
    flush()
    return [c for c in out if c]


def _strip_leading_article(tokens: list[str]) -> list[str]:
    if len(tokens) < 2 or tokens[0] not in ARTICLES:
        return tokens
    rest = tokens[1:]
    if len(rest) == 1 and (len(rest[0]) == 1 or rest[0] in _KEEP_AFTER_ARTICLE):
        return tokens
    return rest


def answer_tokens(text: str) -> list[str]:
    """The normalised tokens of an answer or alias, one leading article dropped."""
    return _strip_leading_article([t for c in clauses(text) for t in c])


def normalize_answer(text: str) -> str:
    """The normalised answer as one string: :func:`answer_tokens` joined by spaces
    (``"The Hague"`` → ``"hague"``, ``"Vitamin A"`` → ``"vitamin a"``, ``"São Paulo"`` →
    ``"sao paulo"``)."""
    return " ".join(answer_tokens(text))


def alias_tokens(alias: str) -> list[str] | None:
    """The tokens a gold alias must match, or None when the alias is unusable: empty, only
    punctuation, or only articles (``"The"``, ``"an"``). The letter ``"A"`` is usable."""
    tokens = answer_tokens(alias)
    if not tokens or (all(t in ARTICLES for t in tokens) and "a" not in tokens):
        return None
    return tokens


def contains_tokens(haystack: Sequence[str], needle: Sequence[str]) -> bool:
    n = len(needle)
    if n == 0 or n > len(haystack):
        return False
    return any(list(haystack[i : i + n]) == list(needle) for i in range(len(haystack) - n + 1))


def mentions_alias(text: str, alias: Sequence[str]) -> bool:
    """Whether ``text`` contains the alias tokens as a whole-token sequence. A one-letter-word
    alias (``["a"]``, ``["i"]``) must end a clause (``"The answer is A."``)."""
    cls = clauses(text)
    if len(alias) == 1 and alias[0] in _WORD_LETTERS:
        return any(c[-1] == alias[0] for c in cls)
    return contains_tokens([t for c in cls for t in c], alias)


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 between two answers (over :func:`answer_tokens`)."""
    p, g = answer_tokens(prediction), answer_tokens(gold)
    if not p or not g:
        return float(p == g)
    common = Counter(p) & Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


# --- refusals -------------------------------------------------------------------------------

_DONT = r"do(?:\s+not|n'?t)"
_CANT = r"(?:can(?:not|\s+not|'?t)|could(?:\s+not|n'?t)|(?:am|are)\s+unable\s+to|won'?t)"
_IM = r"i(?:'?m|\s+am)"

#: What counts as a refusal (regular expressions, case-insensitive, over accent-folded text with
#: one kind of apostrophe).
REFUSAL_PATTERNS: tuple[str, ...] = (
    rf"\b(?:i|we)\s+{_DONT}\s+(?:really\s+)?know\b",
    rf"\b{_DONT}\s+know\b",
    r"\bno(?:body|\s*one)\s+(?:really\s+)?knows\b",
    r"^\W*who\s+knows\b",
    r"\b(?:i\s+have\s+)?no\s+idea\b",
    r"\b(?:i\s+have\s+)?no\s+comment\b",
    rf"\b{_IM}\s+(?:not\s+(?:sure|certain)|unsure|uncertain|unable\s+to\s+\w+)\b",
    r"\bnot\s+sure\b",
    rf"\b(?:(?:i|we)\s+)?{_CANT}\s+(?:answer|say|tell|determine|know|provide|help|be\s+sure)\b",
    rf"\b{_CANT}\s+be\s+(?:determined|known|answered)\b",
    r"\b(?:there\s+is\s+|there'?s\s+)?no\s+(?:single\s+|definitive\s+|clear\s+|correct\s+)?answer\b",
    rf"\b(?:i|we)\s+{_DONT}\s+have\s+(?:an?\s+answer|(?:enough\s+|any\s+)?(?:information|access|data|knowledge))\b",
    r"\b(?:is|are|was|were|remains?|still)\s+(?:unknown|not\s+known|unclear)\b",
    r"^\W*(?:it(?:'?s|\s+is)\s+)?(?:unknown|not\s+known|unclear|uncertain)\W*$",
    r"\b(?:i'?d\s+)?(?:rather|prefer)\s+not\s+to\s+(?:say|answer|comment)\b",
    r"\bas\s+an\s+ai\b",
)
_REFUSAL = re.compile("|".join(f"(?:{p})" for p in REFUSAL_PATTERNS), re.I)


def refusal_phrase(text: str) -> str | None:
    """The first refusal phrase in ``text`` (:data:`REFUSAL_PATTERNS`), lower case, or None."""
    m = _REFUSAL.search(_fold(text, casefold=False))
    return m.group(0).strip().lower() if m else None


def without_refusals(text: str) -> str:
    """``text`` (accents folded, case kept) with every refusal phrase replaced by a clause
    break: what the answer says besides refusing (``"I'm not sure, but it's Paris"`` →
    ``" . , but it's Paris"``)."""
    return _REFUSAL.sub(" . ", _fold(text, casefold=False))


# --- hedges ---------------------------------------------------------------------------------

#: "or" that does not join alternatives.
_NOT_DISJUNCTIVE = re.compile(
    r"\b(?:more\s+or\s+less|whether\s+or\s+not|or\s+not|or\s+so|sooner\s+or\s+later"
    r"|(?:one|two)\s+or\s+more|one\s+or\s+(?:an)?other)\b|\band/or\b"
)
#: A sentence ends at . ! ? : ; or a newline followed by a space — unless "or"/"either"
#: follows (``"Paris. Or Lyon."`` is one disjunction).
_SENTENCE_BREAK = re.compile(r"[.!?:;\n]+(?=\s|$)(?!\s*(?:or|either)\b)")
_ALT_SEPARATOR = re.compile(r"(,|/|\bor\b|[()\[\]])")
#: The most tokens a comma-separated alternative may have ("Lyon", "the city of Lyon").
MAX_LIST_ITEM_TOKENS = 3


@dataclass(frozen=True)
class _Piece:
    """A non-empty stretch of a sentence between alternative separators."""

    start: int
    end: int
    link: str  # how it joins the previous piece: "or" (or, /) or "," (comma, bracket)


def _pieces(sentence: str) -> list[_Piece]:
    """The non-empty pieces of a sentence between ``,`` ``/`` ``or`` and brackets."""
    pieces: list[_Piece] = []
    pending: str | None = None
    bounds = [(m.start(), m.end(), m.group(0)) for m in _ALT_SEPARATOR.finditer(sentence)]
    starts = [0, *(end for _, end, _ in bounds)]
    ends = [*(start for start, _, _ in bounds), len(sentence)]
    for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
        if k:
            sep = "or" if bounds[k - 1][2] in ("or", "/") else ","
            pending = "or" if "or" in (pending, sep) else sep
        if answer_tokens(sentence[start:end]):
            pieces.append(_Piece(start, end, pending or ","))
            pending = None
    return pieces


def _runs(sentence: str) -> list[list[_Piece]]:
    pieces = _pieces(sentence)
    runs: list[list[_Piece]] = []
    run, has_or = pieces[:1], False

    def short(p: _Piece) -> bool:
        return len(answer_tokens(sentence[p.start : p.end])) <= MAX_LIST_ITEM_TOKENS

    for prev, piece in itertools.pairwise(pieces):
        if piece.link == "or" or (short(prev) and short(piece)):
            run.append(piece)
            has_or = has_or or piece.link == "or"
            continue
        if has_or:
            runs.append(run)
        run, has_or = [piece], False
    if has_or:
        runs.append(run)
    return runs


def _gold_pieces(
    sentence: str, run: Sequence[_Piece], aliases: Sequence[Sequence[str]]
) -> set[int]:
    """Indices of the run's pieces covered by a minimal stretch of consecutive pieces that
    mentions a gold alias (an alias may span pieces: ``"Washington, D.C."``, ``"AC/DC"``)."""

    def names(i: int, j: int) -> bool:
        text = sentence[run[i].start : run[j].end]
        return any(mentions_alias(text, a) for a in aliases)

    covered: set[int] = set()
    for i in range(len(run)):
        for j in range(i, len(run)):
            if names(i, j):
                if not (j > i and names(i + 1, j)):
                    covered.update(range(i, j + 1))
                break
    return covered


def hedge_alternatives(prediction: str, aliases: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The alternatives of the first disjunction in ``prediction`` in which one alternative
    mentions a gold alias and another mentions none (a hedge), else ``()``.

    ``"Paris or Lyon"``, ``"either Paris or Lyon"``, ``"Paris, Lyon or Nice"``, ``"Paris/Lyon"``
    and ``"Paris. Or maybe Lyon."`` hedge (gold ``"Paris"``); ``"Paris, the capital of
    France"``, ``"Paris or Paris, France"``, ``"more or less Paris"`` and ``"AC/DC"`` (gold
    ``"AC/DC"``) do not. A bare comma list (``"Paris, Lyon, Nice"``) is not recognised: it
    cannot be told from ``"Springfield, Illinois, USA"`` by rule.
    """
    text = _NOT_DISJUNCTIVE.sub(" ", _fold(prediction))
    for sentence in _SENTENCE_BREAK.split(text):
        for run in _runs(sentence):
            covered = _gold_pieces(sentence, run, aliases)
            if covered and len(covered) < len(run):
                return tuple(sentence[p.start : p.end].strip() for p in run)
    return ()
