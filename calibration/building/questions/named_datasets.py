"""Readers for the public evaluation sets in their published formats: NQ-open, TruthfulQA,
SciQ, GSM8K, CommonsenseQA and the TriviaQA subset (a folder or a file path).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from abstain_guard.errors import DatasetError

from .dataset_files import DatasetReport, Fields, load_dataset
from .datasets import QAItem


@dataclass(frozen=True)
class _NamedFormat:
    files: tuple[str, ...]  # candidate file names inside the folder, first found wins
    fields: Fields
    extra_aliases: str | None = None  # a second alias field (TruthfulQA "Correct Answers")


NAMED_DATASETS: dict[str, _NamedFormat] = {
    "nq_open": _NamedFormat(("NQ-open.dev.jsonl",), Fields()),
    "truthfulqa": _NamedFormat(
        ("TruthfulQA.csv",),
        Fields(question="Question", answers="Best Answer", group_by="Category"),
        extra_aliases="Correct Answers",
    ),
    "sciq": _NamedFormat(("sciq_test.jsonl",), Fields()),
    "gsm8k": _NamedFormat(("test.jsonl",), Fields(kind="numeric")),
    "commonsenseqa": _NamedFormat(
        ("dev_rand_split.jsonl",),
        Fields(
            question="question.stem",
            answers="answerKey",
            choices="question.choices",
            kind="choice",
            id_field="id",
        ),
    ),
    "triviaqa": _NamedFormat(("triviaqa_test.jsonl",), Fields(answers="answers", id_field="id")),
}


def load_named_dataset(
    name: str, root: str | Path, *, limit: int | None = None
) -> tuple[list[QAItem], DatasetReport]:
    """Read one of the public evaluation sets (:data:`NAMED_DATASETS`) in its published format
    from ``root``, the data set's folder or one of its files (the files and fields each name
    reads: docs/configuration.md, 'Configuring calibration').

    Raises:
        DatasetError: unknown name, or no matching file under ``root``.
    """
    key = name.lower().replace("-", "_")
    fmt = NAMED_DATASETS.get(key)
    if fmt is None:
        raise DatasetError(
            f"unknown data set name {name!r}; known names: {', '.join(sorted(NAMED_DATASETS))}"
        )
    r = Path(root)
    if r.is_dir():
        candidates = [r / f for f in fmt.files]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise DatasetError(
                f"{r} has none of {', '.join(fmt.files)} ({name}); pass the folder holding it "
                "or the file itself"
            )
        path = found[0]
    elif r.is_file():
        path = r
    else:
        raise DatasetError(f"{r} does not exist; pass the {name} folder or file")
    items, report = load_dataset(path, replace(fmt.fields, id_prefix=key), limit=limit)
    if fmt.extra_aliases is None:
        return items, report
    extra, _ = load_dataset(
        path,
        Fields(question=fmt.fields.question, answers=fmt.extra_aliases, answer_sep=";"),
        limit=limit,
    )
    by_line = {it.line: it.answers for it in extra}
    merged = []
    for it in items:
        aliases = list(it.answers)
        for a in by_line.get(it.line, ()):
            if a not in aliases:
                aliases.append(a)
        merged.append(replace(it, answers=tuple(aliases)))
    return merged, report
