"""Question-answer items for calibration and the seeded split.

* :class:`QAItem` — one question with its gold answer aliases (immutable, validated).
* :func:`split_items` — the seeded reference/train/calibration/test split (5:3:1:1 by default),
  stratified by :attr:`QAItem.group` when items have one.

Readers: :func:`~abstain_guard.calibration.building.dataset_files.load_dataset` (JSON Lines or
CSV/TSV with a field mapping) and
:func:`~abstain_guard.calibration.building.named_datasets.load_named_dataset` (the public
evaluation sets in their published formats).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from abstain_guard.errors import InvalidInputError

__all__ = [
    "KINDS",
    "SPLIT_NAMES",
    "Kind",
    "QAItem",
    "choice_letter",
    "split_items",
]

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
        answers: gold answer aliases; any of them counts as correct. For ``kind="choice"`` the
            first alias is the gold option letter and the second the gold option text; for
            ``kind="numeric"`` the gold number as a plain string (``"70000"``).
        kind: ``"open"``, ``"choice"`` or ``"numeric"`` — which judge fits.
        choices: for ``kind="choice"`` the option texts, lettered ``A, B, …`` in order.
        group: the question type (the probe set's relation, or a ``group_by`` field).
        popularity: a popularity proxy (e.g. log10 population of the country asked about).
        source: where the item came from (file path or ``"builtin"``).
        line: the 1-based line of the row in ``source`` (the first line of a CSV record).
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

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidInputError(f"QAItem.kind must be one of {KINDS}, got {self.kind!r}")
        if not self.question.strip():
            raise InvalidInputError(f"QAItem {self.id!r} has an empty question")
        if not self.answers or not any(a.strip() for a in self.answers):
            raise InvalidInputError(f"QAItem {self.id!r} has no gold answer")
        if self.kind == "choice" and not self.choices:
            raise InvalidInputError(f"QAItem {self.id!r} is a choice question without choices")

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
    rng = np.random.default_rng(seed)
    groups: dict[str | None, list[int]] = {}
    for i, it in enumerate(items):
        groups.setdefault(it.group, []).append(i)
    position = np.empty(n, dtype=float)
    for key in sorted(groups, key=lambda g: (g is not None, g or "")):
        idx = np.asarray(groups[key])
        order = rng.permutation(len(idx))
        offset = rng.random()
        position[idx[order]] = (np.arange(len(idx)) + offset) / len(idx)
    tiebreak = rng.random(n)
    ordered = np.lexsort((tiebreak, position))
    bounds = np.rint(np.cumsum(r) / r.sum() * n).astype(int)
    bounds[-1] = n
    starts = np.concatenate([[0], bounds[:-1]])
    return {
        name: [items[i] for i in ordered[s:e]]
        for name, s, e in zip(SPLIT_NAMES, starts, bounds, strict=True)
    }
