"""Question-answer items for calibration (:class:`QAItem`: one question with its gold answer
aliases, immutable, validated) and their seeded split (:func:`split_items`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from abstain_guard.errors import InvalidInputError

from .conversations import (
    History,
    conversation_units,
    history_problem,
)
from .tool_labels import ExpectedCall

Kind = Literal["open", "choice", "numeric"]
KINDS: tuple[str, ...] = ("open", "choice", "numeric")
SPLIT_NAMES: tuple[str, str, str, str] = ("reference", "train", "calibration", "test")


def choice_letter(index: int) -> str:
    """The option letter for a 0-based option index: 0 → ``"A"``, 1 → ``"B"``, …"""
    if not 0 <= index < 26:
        raise InvalidInputError(f"option index {index} is outside 0..25; at most 26 options")
    return chr(ord("A") + index)


@dataclass(frozen=True)
class QAItem:
    """One question with its gold answers.

    Attributes:
        id: stable identifier (the file's id field, else ``"<file stem>:<line>"``).
        question: the question text (for ``kind="choice"`` without the options; see
            :meth:`prompt_text`).
        answers: gold answer aliases; any of them counts as correct (none: an open question
            only, for a judge that decides without a reference). For ``kind="choice"`` the
            first alias is the gold option letter and the second the gold option text; for
            ``kind="numeric"`` the gold number as a plain string (``"70000"``).
        kind: ``"open"``, ``"choice"`` or ``"numeric"`` — which judge fits.
        choices: for ``kind="choice"`` the option texts, lettered ``A, B, …`` in order.
        group: the question type (the probe set's relation, or a ``group_by`` field).
        popularity: a popularity proxy (e.g. log10 population of the country asked about).
        source: where the item came from (file path or ``"builtin"``).
        line: the 1-based line of the row in ``source`` (the first line of a CSV record).
        history: the earlier turns of the conversation the question ends, as ``(role,
            content)`` pairs (roles ``"user"`` / ``"assistant"``, alternating from the user,
            ending with the assistant's reply); empty for a single question.
        conversation: the conversation the row belongs to (rows sharing it stay in one
            split); None: the row is a conversation of its own.
        expected_tool_calls: the tool calls a right agent run makes (name + arguments,
            :class:`~.tool_labels.ExpectedCall`); empty: the run is labelled by its final
            answer only (docs/agents.md, "Tool-call labels").
        tool_calls_ordered: the i-th executed call must match the i-th expected call
            (default: any order).
    """

    id: str
    question: str
    answers: tuple[str, ...]
    kind: Kind = "open"
    choices: tuple[str, ...] = ()
    group: str | None = None
    popularity: float | None = None
    source: str = ""
    line: int | None = None
    history: History = ()
    conversation: str | None = None
    expected_tool_calls: tuple[ExpectedCall, ...] = ()
    tool_calls_ordered: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidInputError(f"QAItem.kind must be one of {KINDS}, got {self.kind!r}")
        if not self.question.strip():
            raise InvalidInputError(f"QAItem {self.id!r} has an empty question")
        if self.answers and not any(a.strip() for a in self.answers):
            raise InvalidInputError(f"QAItem {self.id!r} has only empty gold answers")
        if not self.answers and self.kind != "open":
            raise InvalidInputError(f"QAItem {self.id!r} ({self.kind}) has no gold answer")
        if self.kind == "choice" and not self.choices:
            raise InvalidInputError(f"QAItem {self.id!r} is a choice question without choices")
        if self.history:
            history = tuple(tuple(turn) for turn in self.history)
            object.__setattr__(self, "history", history)
            problem = history_problem(history)
            if problem is not None:
                raise InvalidInputError(f"QAItem {self.id!r}: {problem}")
        self._check_tool_calls()

    def _check_tool_calls(self) -> None:
        """Store the expected calls as a tuple; raise InvalidInputError naming the item
        unless each is an :class:`ExpectedCall` with a name, and ``tool_calls_ordered``
        comes with calls."""
        calls = tuple(self.expected_tool_calls)
        object.__setattr__(self, "expected_tool_calls", calls)
        for i, call in enumerate(calls, start=1):
            if not isinstance(call, ExpectedCall) or not call.name.strip():
                raise InvalidInputError(
                    f"QAItem {self.id!r}: expected tool call {i} is {call!r}; give each as "
                    'ExpectedCall.of("tool_name", {"argument": value})'
                )
        if not isinstance(self.tool_calls_ordered, bool):
            raise InvalidInputError(
                f"QAItem {self.id!r}: tool_calls_ordered must be True or False, got "
                f"{self.tool_calls_ordered!r}"
            )
        if self.tool_calls_ordered and not calls:
            raise InvalidInputError(
                f"QAItem {self.id!r}: tool_calls_ordered is set without expected_tool_calls; "
                "give the calls or drop the flag"
            )

    def prompt_text(self) -> str:
        """The question as shown to a model: for choice questions followed by lettered options
        (``"A) bank"`` one per line) and an instruction to answer with the letter."""
        if self.kind != "choice":
            return self.question
        options = "\n".join(f"{choice_letter(i)}) {c}" for i, c in enumerate(self.choices))
        return f"{self.question}\n{options}\nAnswer with the letter of the correct option."


# --- splitting ------------------------------------------------------------------------------


def split_items(
    items: Sequence[QAItem], seed: int = 0, ratios: Sequence[float] = (5, 3, 1, 1)
) -> dict[str, list[QAItem]]:
    """Split items into ``reference``, ``train``, ``calibration`` and ``test`` parts.

    Deterministic for a given ``seed`` and input order. Split sizes follow ``ratios`` over the
    whole set (cumulative rounding, so they add up to ``len(items)``). When items carry a
    ``group``, every group is spread evenly over the four parts (stratification): each group's
    items, shuffled, get evenly spaced positions in [0, 1) with a random offset; all items are
    ordered by position and cut at the ratio boundaries.

    Conversations are split, never turns: the rows sharing a :attr:`QAItem.conversation`
    are one unit (stratified by its first row's group) that goes, whole and in input order,
    to the split holding the middle of its rows in the cut order, so a conversation's
    earlier turns can never inform the scorer about a calibration or test row. Rows without
    a conversation are units of one, which gives exactly the item-wise split.

    Raises:
        InvalidInputError: ``ratios`` is not four non-negative numbers with a positive sum.
    """
    r = np.asarray(list(ratios), dtype=float)
    if r.shape != (4,) or np.any(~np.isfinite(r)) or np.any(r < 0) or r.sum() <= 0:
        raise InvalidInputError(
            f"ratios must be four non-negative numbers (reference, train, calibration, test) "
            f"with a positive sum, got {list(ratios)}"
        )
    n = len(items)
    units = conversation_units([it.conversation for it in items])
    ordered = _unit_order(items, units, seed)
    bounds = np.rint(np.cumsum(r) / r.sum() * n).astype(int)
    bounds[-1] = n
    sizes = np.asarray([len(units[u]) for u in ordered], dtype=float)
    middle = np.cumsum(sizes) - sizes / 2
    part = np.searchsorted(bounds, middle, side="right")
    out: dict[str, list[QAItem]] = {name: [] for name in SPLIT_NAMES}
    for u, p in zip(ordered, part, strict=True):
        out[SPLIT_NAMES[int(p)]].extend(items[i] for i in units[u])
    return out


def _unit_order(items: Sequence[QAItem], units: list[list[int]], seed: int) -> np.ndarray:
    """The seeded, group-stratified order in which the units are cut into splits."""
    rng = np.random.default_rng(seed)
    groups: dict[str | None, list[int]] = {}
    for u, rows in enumerate(units):
        groups.setdefault(items[rows[0]].group, []).append(u)
    position = np.empty(len(units), dtype=float)
    for key in sorted(groups, key=lambda g: (g is not None, g or "")):
        idx = np.asarray(groups[key])
        order = rng.permutation(len(idx))
        offset = rng.random()
        position[idx[order]] = (np.arange(len(idx)) + offset) / len(idx)
    tiebreak = rng.random(len(units))
    return np.lexsort((tiebreak, position))
