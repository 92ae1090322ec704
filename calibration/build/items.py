"""Which questions a calibration run uses, checked before any model is loaded: loading them
from the built-in probe set, a named public set, a file or a list; dropping or refusing
questions no judge could grade; and the split sizes the targets need."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from pathlib import Path

from abstain_guard import conformal
from abstain_guard.calibration.build.config import CalibrationConfig
from abstain_guard.calibration.build.dataset_files import load_dataset
from abstain_guard.calibration.build.datasets import QAItem
from abstain_guard.calibration.build.judges.text import alias_tokens
from abstain_guard.calibration.build.named_datasets import NAMED_DATASETS, load_named_dataset
from abstain_guard.calibration.build.probe import PROBE_RELATIONS_V1, builtin_probe_set
from abstain_guard.conformal import ConformalWarning
from abstain_guard.errors import DatasetError, InsufficientDataError
from abstain_guard.frontier import perfect_scorer_certifies

__all__ = [
    "BUILTIN_V1",
    "check_split_sizes",
    "load_items",
    "min_calibration_size",
    "named_spec",
    "split_unjudgeable",
]

logger = logging.getLogger("abstain_guard.calibration")

BUILTIN_V1 = "builtin-v1"
"""The built-in probe set as first released (six relations, 1,077 questions): artifacts
calibrated on ``"builtin"`` before it grew are evaluated on it."""


def min_calibration_size(participation: float) -> int:
    """Smallest calibration split with a finite threshold at this participation target."""
    return conformal.min_calibration_size(1.0 - participation)


def named_spec(data: str) -> tuple[str, str] | None:
    """``("sciq", "/data/sciq")`` for ``"sciq=/data/sciq"`` when the name is a known format."""
    name, sep, root = data.partition("=")
    if sep and name in NAMED_DATASETS:
        return name, root
    return None


def load_items(
    data: str | Path | Sequence[QAItem], config: CalibrationConfig
) -> tuple[list[QAItem], int]:
    """Questions from ``"builtin"`` (``"builtin-v1"``: the first release's 1,077),
    ``"<name>=<path>"`` (a named reader such as ``sciq=/data/sciq``), a JSONL/CSV file, or a
    list; returns (items, skipped row count)."""
    if not isinstance(data, (str, Path)):
        items = list(data)
        skipped = 0
    elif str(data) == "builtin":
        items = builtin_probe_set(seed=config.seed)
        skipped = 0
    elif str(data) == BUILTIN_V1:
        items = builtin_probe_set(relations=PROBE_RELATIONS_V1, seed=config.seed)
        skipped = 0
    elif named_spec(str(data)) is not None:
        name, root = named_spec(str(data))  # type: ignore[misc]
        items, report = load_named_dataset(name, root)
        items, bad = split_unjudgeable(items)
        if bad:  # public data sets carry a few broken golds (NQ-open dev: "---", ")")
            logger.warning(
                "%s: skipped %d questions whose gold answers are empty or only articles (%s)",
                data,
                len(bad),
                ", ".join(bad[:10]),
            )
        skipped = len(report.skipped) + len(bad)
    else:
        path = Path(data)
        if not path.exists():
            raise DatasetError(
                f"Data file {path} does not exist. Pass a JSONL/CSV file with 'question' and "
                "'answer' fields, or --data builtin for the built-in probe set."
            )
        items, report = load_dataset(
            path,
            question=config.question,
            answers=config.answers,
            choices=config.choices,
            kind=config.kind,
            group_by=config.group_by,
        )
        skipped = len(report.skipped)
    _, bad = split_unjudgeable(items)
    if bad:
        raise DatasetError(
            f"{len(bad)} questions in {data} have gold answers that are empty or only articles "
            f"('the', 'a'), so no answer could ever be judged correct: {', '.join(bad[:10])}. "
            "Give them real gold answers or remove them."
        )
    if config.limit is not None:
        items = items[: config.limit]
    if not items:
        raise DatasetError(f"No usable questions in {data}.")
    return items, skipped


def split_unjudgeable(items: Sequence[QAItem]) -> tuple[list[QAItem], list[str]]:
    """``(judgeable items, locations of the others)``: an open question whose gold aliases
    are all empty or only articles can never be judged correct (``source:line`` or id)."""
    good, bad = [], []
    for it in items:
        if it.kind == "open" and not any(alias_tokens(a) is not None for a in it.answers):
            bad.append(f"{it.source}:{it.line}" if it.line else it.id)
        else:
            good.append(it)
    return good, bad


def check_split_sizes(splits: dict[str, list[QAItem]], config: CalibrationConfig) -> None:
    """Fail before loading any model when a split is too small for the participation
    target; warn when the calibration split cannot certify ``config.risk_target`` even with
    a perfect scorer."""
    need = min_calibration_size(config.participation)
    n_cal = len(splits["calibration"])
    total = sum(len(v) for v in splits.values())
    ratios = ":".join(str(r) for r in config.ratios)
    if n_cal < need:
        raise InsufficientDataError(
            f"The calibration split has {n_cal} questions ({total} in all, split {ratios}), "
            f"but participation {config.participation} needs at least {need} for a finite "
            f"threshold. Use more questions, a larger calibration ratio, or lower the "
            "participation target."
        )
    eps = config.risk_target
    if eps is not None and not perfect_scorer_certifies(n_cal, eps, config.delta):
        note = (
            f"The calibration split has {n_cal} questions ({total} in all, split {ratios}): "
            f"too few to certify risk_target={eps:g} at delta={config.delta:g} even if every "
            "answer but one were right and the scorer ranked them perfectly. Use more "
            "questions or a larger calibration ratio, or aim for a larger risk target."
        )
        logger.warning(note)
        warnings.warn(note, ConformalWarning, stacklevel=3)
    for name in ("reference", "train"):
        if len(splits[name]) < 4:
            raise InsufficientDataError(
                f"The {name} split has only {len(splits[name])} questions; the scorer needs "
                "correct and incorrect answers in it. Use more questions."
            )
