"""The human review of a random sample of calibration answers: drawn by the tool, written
for people, read back into the artifact (:mod:`abstain_guard.guarantee.truth` then certifies
the true error rate).

1. ``abstain-guard calibrate ... --review 200`` draws 200 of the calibration answers
   uniformly at random (``numpy.random.default_rng(seed).choice``, without replacement; the
   seed is recorded, a fresh one from the OS when none is given) and writes them to
   ``<out>.review.csv``: ``id, question, reference, answer, correct``. The artifact records
   the seed, the size and which answers were drawn (``metadata["review"]``).
2. People fill ``correct`` (yes / no; also true / false, 1 / 0, correct / wrong) for every
   row, in a spreadsheet or an editor. **The judge's verdict is not in the file**: a reviewer
   who sees it tends to agree with it, and then the review repeats the judge's errors
   instead of measuring them. The reference answers are shown when the data has them (the
   people decide; a reference may itself be wrong).
3. ``abstain-guard review --artifact A --labels A.review.csv`` reads the file back: the same
   drawn ids, every row filled, nothing else; the verdicts go into the artifact
   (``review.npz``), with the file's sha256. The sample is the tool's draw, never the
   reviewer's choice: a file with other, fewer or more answers is refused.

How many to review (:func:`review_size_table`, ``abstain-guard review-size``): before anyone
labels, simulate the certificate on the truth (:mod:`abstain_guard.guarantee.truth`) on an
artifact's own calibration scores and judge labels, for a rough judge error rate and several
review sizes.

The truth is unknown before the review, so each draw makes one that is consistent with the
stated judge quality: a share ``judge_error`` of the calibration answers have the judge's
label flipped, ``lenient_share`` of the flips on answers the judge called right (a lenient
judge: they are truly wrong) and the rest on answers it called wrong, each flip more likely
where the score is high (``where="uncertain"``: real judges err on hard answers; "uniform"
also offered). Then a review of m answers is drawn uniformly and the certificate computed as
the artifact would. The table says, per m, how often the target was certifiable and the
median participation it certified; ``abstain-guard review-size`` prints it.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import math
import secrets
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee import conformal

from .questions.datasets import QAItem

logger = logging.getLogger("abstain_guard.calibration")

__all__ = [
    "REVIEW_COLUMNS",
    "ReviewDraw",
    "ReviewSizeRow",
    "apply_review",
    "draw_review",
    "read_review_file",
    "review_path",
    "review_size_table",
    "simulated_truth",
    "start_review",
    "write_review_file",
]

#: The columns of a review file, in order.
REVIEW_COLUMNS = ("id", "question", "reference", "answer", "correct")

_YES = {"yes", "y", "true", "1", "correct", "right"}
_NO = {"no", "n", "false", "0", "wrong", "incorrect"}


@dataclass(frozen=True)
class ReviewDraw:
    """A uniformly random sample of the calibration answers with a score at most
    ``score_cutoff`` (None: of all of them): ``ids`` in draw order; ``eligible`` answers
    could be drawn, of ``population``."""

    seed: int
    size: int
    population: int
    ids: tuple[str, ...]
    scope: float = 1.0
    eligible: int = 0
    score_cutoff: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The draw as the artifact records it."""
        return {
            "seed": self.seed,
            "size": self.size,
            "population": self.population,
            "ids": list(self.ids),
            "scope": self.scope,
            "eligible": self.eligible,
            "score_cutoff": self.score_cutoff,
            "sampling": "uniform without replacement among the answers with score <= "
            "score_cutoff (all when null), numpy default_rng(seed).choice",
        }

    @classmethod
    def from_json(cls, block: Mapping[str, Any]) -> ReviewDraw:
        cutoff = block.get("score_cutoff")
        return cls(
            int(block["seed"]),
            int(block["size"]),
            int(block["population"]),
            tuple(block["ids"]),
            float(block.get("scope", 1.0)),
            int(block.get("eligible", block["population"])),
            None if cutoff is None else float(cutoff),
        )

    def eligible_mask(self, scores: np.ndarray) -> np.ndarray:
        """Which calibration answers the draw could reach."""
        s = np.asarray(scores, dtype=np.float64)
        return np.ones(s.size, bool) if self.score_cutoff is None else s <= self.score_cutoff


def draw_review(
    calibration_ids: Sequence[str],
    size: int,
    seed: int | None = None,
    *,
    scores: Sequence[float] | np.ndarray | None = None,
    scope: float = 1.0,
) -> ReviewDraw:
    """Draw ``size`` of ``calibration_ids`` uniformly at random without replacement; with
    ``scope`` < 1, only among the answers whose score is at most the ⌈scope·n⌉-th smallest
    (the ones the guard may answer: a review there certifies more for the same effort; the
    choice uses the scores alone, never a label).

    Raises:
        InvalidInputError: ``size`` is not between 1 and the number of eligible answers, or
            ``scope`` outside (0, 1] or without scores.
    """
    n = len(calibration_ids)
    if not 0.0 < scope <= 1.0:
        raise InvalidInputError(f"review scope must be in (0, 1], got {scope}.")
    cutoff = None
    eligible = np.arange(n)
    if scope < 1.0:
        if scores is None or len(scores) != n:
            raise InvalidInputError("a review scope below 1 needs every calibration score.")
        s = np.asarray(scores, dtype=np.float64)
        cutoff = float(np.sort(s)[max(1, math.ceil(scope * n - 1e-9)) - 1])
        eligible = np.flatnonzero(s <= cutoff)
    if not 1 <= size <= eligible.size:
        raise InvalidInputError(
            f"a review of {size} answers cannot be drawn from {eligible.size} eligible "
            f"calibration answers; give a size between 1 and {eligible.size}."
        )
    seed = secrets.randbits(63) if seed is None else int(seed)
    picked = np.random.default_rng(seed).choice(eligible, size=size, replace=False)
    ids = tuple(calibration_ids[int(i)] for i in picked)
    return ReviewDraw(seed, size, n, ids, float(scope), int(eligible.size), cutoff)


def review_path(out: str | Path) -> Path:
    """Where the review file of the artifact at ``out`` is written: ``<out>.review.csv``."""
    out = Path(out)
    return out.with_name(out.name + ".review.csv")


def start_review(
    out: str | Path,
    metadata: dict[str, Any],
    size: int,
    seed: int | None,
    scores: np.ndarray,
    config: Any,
) -> ReviewDraw | None:
    """Draw the review of a calibration run (``size`` 0: none) from its
    ``metadata["calibration_ids"]`` (and ``scores``, with ``config.review_scope``) and record
    it in ``metadata["review"]`` (status ``"drawn"``, the file it will be written to)."""
    if not size:
        return None
    scope = float(getattr(config, "review_scope", 1.0))
    draw = draw_review(metadata["calibration_ids"], size, seed, scores=scores, scope=scope)
    metadata["review"] = {
        **draw.to_json(),
        "status": "drawn",
        "file": str(review_path(out).resolve()),
    }
    return draw


def write_review_file(
    path: str | Path,
    draw: ReviewDraw,
    items: Sequence[QAItem],
    answers: Mapping[str, Mapping[str, Any]],
) -> Path:
    """Write the drawn answers for review (columns :data:`REVIEW_COLUMNS`, ``correct``
    empty), in draw order; the judge's verdict is left out (module docstring).
    ``answers``: each item's answer row (its ``"text"``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    by_id = {it.id: it for it in items}
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(REVIEW_COLUMNS)
        for item_id in draw.ids:
            item = by_id[item_id]
            text = str(answers[item_id].get("text", ""))
            writer.writerow([item_id, item.prompt_text(), " | ".join(item.answers), text, ""])
    logger.info(
        "Drew %d of %d calibration answers for review (seed %d): fill 'correct' in %s, then "
        "run abstain-guard review --artifact <the artifact> --labels %s",
        draw.size,
        draw.population,
        draw.seed,
        path,
        path,
    )
    return path


def _verdict(value: str, row: int, item_id: str) -> bool:
    v = value.strip().lower()
    if v in _YES:
        return True
    if v in _NO:
        return False
    raise InvalidInputError(
        f"review file row {row} (id {item_id!r}): 'correct' is {value!r}; write yes or no "
        "(true/false, 1/0 and correct/wrong are read too)."
    )


def read_review_file(path: str | Path, draw: ReviewDraw) -> dict[str, bool]:
    """The people's verdicts ``{id: correct}`` from a filled review file.

    Raises:
        InvalidInputError: a missing column, a row without a verdict, an unreadable verdict,
            an id that was not drawn, a drawn id missing, or an id twice — each named with
            its row.
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"no review file at {path}.")
    drawn = set(draw.ids)
    out: dict[str, bool] = {}
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = {"id", "correct"} - set(reader.fieldnames or ())
        if missing:
            raise InvalidInputError(
                f"{path} has no column(s) {sorted(missing)}; it must keep the columns "
                f"{', '.join(REVIEW_COLUMNS)} that the tool wrote."
            )
        for row, rec in enumerate(reader, start=2):
            item_id = (rec.get("id") or "").strip()
            if item_id not in drawn:
                raise InvalidInputError(
                    f"{path} row {row}: id {item_id!r} was not drawn for review. The sample is "
                    "the tool's draw: review exactly the rows it wrote, add none."
                )
            if item_id in out:
                raise InvalidInputError(f"{path} row {row}: id {item_id!r} appears twice.")
            if not (rec.get("correct") or "").strip():
                raise InvalidInputError(
                    f"{path} row {row} (id {item_id!r}) has no verdict: fill 'correct' with "
                    "yes or no for every row (an answer you cannot judge is still a draw of "
                    "the sample; skipping it would bias the review)."
                )
            out[item_id] = _verdict(rec["correct"], row, item_id)
    absent = [i for i in draw.ids if i not in out]
    if absent:
        raise InvalidInputError(
            f"{path} lacks {len(absent)} of the {draw.size} drawn answers (e.g. "
            f"{absent[:3]}); review every row the tool wrote."
        )
    return out


def _draw_of(artifact: GuardArtifact) -> ReviewDraw:
    block = artifact.metadata.get("review")
    if not isinstance(block, Mapping) or "ids" not in block:
        raise InvalidInputError(
            "this artifact has no review draw: calibrate with --review N (or review_size in "
            "the config) to draw the sample the people review."
        )
    return ReviewDraw.from_json(block)


def apply_review(artifact_path: str | Path, labels: str | Path) -> GuardArtifact:
    """Read the filled review file ``labels`` into the artifact at ``artifact_path`` (saved
    in place, atomically) and return it.

    Raises:
        InvalidInputError: no draw in the artifact, or a bad review file
            (:func:`read_review_file`).
    """
    artifact = GuardArtifact.load(artifact_path)
    draw = _draw_of(artifact)
    verdicts = read_review_file(labels, draw)
    ids = artifact.metadata.get("calibration_ids") or []
    if len(ids) != artifact.n:
        raise InvalidInputError(
            "the artifact does not record which question each calibration answer is "
            "(metadata calibration_ids); calibrate again to review it."
        )
    human = np.where(draw.eligible_mask(artifact.scores), -1, -2).astype(np.int8)
    position = {item_id: i for i, item_id in enumerate(ids)}
    for item_id, ok in verdicts.items():
        human[position[item_id]] = int(ok)
    metadata = dict(artifact.metadata)
    metadata["review"] = {
        **dict(metadata["review"]),
        "status": "reviewed",
        "labels_file": str(Path(labels).resolve()),
        "labels_sha256": hashlib.sha256(Path(labels).read_bytes()).hexdigest(),
    }
    reviewed = artifact.replace(metadata=metadata, human=human)
    reviewed.save(artifact_path, overwrite=True)
    return reviewed


# --- how many to review (before anyone labels) -----------------------------------------


@dataclass(frozen=True)
class ReviewSizeRow:
    """One review size's result over the simulated draws."""

    m: int
    certifiable: float
    median_participation: float
    draws: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def simulated_truth(
    rng: np.random.Generator,
    scores: ArrayLike,
    judge_correct: ArrayLike,
    judge_error: float,
    lenient_share: float = 0.5,
    where: Literal["uncertain", "uniform"] = "uncertain",
) -> np.ndarray:
    """A truth consistent with a judge that errs on ``judge_error`` of the answers (module
    docstring): bool ``[n]``, True = truly correct."""
    s = np.asarray(scores, dtype=np.float64)
    j = np.asarray(judge_correct).astype(bool)
    n = s.size
    flips = round(judge_error * n)
    weight = np.argsort(np.argsort(s)) + 1.0 if where == "uncertain" else np.ones(n)
    truth = j.copy()
    for pool, count in (
        (np.flatnonzero(j), round(flips * lenient_share)),
        (np.flatnonzero(~j), flips - round(flips * lenient_share)),
    ):
        count = min(count, pool.size)
        if count:
            w = weight[pool] / weight[pool].sum()
            truth[rng.choice(pool, count, replace=False, p=w)] ^= True
    return truth


def review_size_table(
    scores: ArrayLike,
    judge_correct: ArrayLike,
    risk_target: float,
    delta: float,
    judge_error: float,
    sizes: Sequence[int] = (50, 100, 200, 400, 800),
    *,
    draws: int = 100,
    lenient_share: float = 0.5,
    seed: int = 0,
    scope: float = 1.0,
) -> list[ReviewSizeRow]:
    """For each review size m (those up to n), the share of simulated draws in which
    ``risk_target`` is certifiable on the truth at ``delta`` and the median certified
    participation (module docstring). ``scope``: the review drawn among that share of the
    answers with the lowest scores (``calibrate --review-scope``)."""
    s = np.asarray(scores, dtype=np.float64)
    j = np.asarray(judge_correct).astype(bool)
    rng = np.random.default_rng(seed)
    cutoff = np.sort(s)[max(1, math.ceil(scope * s.size - 1e-9)) - 1]
    eligible = np.flatnonzero(s <= cutoff)
    rows = []
    for m in sorted(x for x in set(sizes) if 0 < x <= eligible.size):
        parts = []
        for _ in range(draws):
            truth = simulated_truth(rng, s, j, judge_error, lenient_share)
            human = np.where(s <= cutoff, -1, -2).astype(np.int8)
            picked = rng.choice(eligible, m, replace=False)
            human[picked] = truth[picked]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", conformal.ConformalWarning)
                res = conformal.risk_threshold(s, j, risk_target, delta, human=human)
            parts.append(res.participation if res.feasible else 0.0)
        arr = np.asarray(parts)
        rows.append(ReviewSizeRow(m, float((arr > 0).mean()), float(np.median(arr)), draws))
    return rows
