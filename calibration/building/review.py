"""The human review of a random sample of calibration answers: drawn by the tool, written
for people, read back into the artifact (:mod:`abstain_guard.guarantee.truth` then certifies
the true error rate).

1. ``abstain-guard calibrate ... --review 200`` draws 200 of the calibration answers
   uniformly at random without replacement, seeded by the calibration ids
   (:func:`review_seed`: the same calibration set always gets the same draw), and writes
   them to ``<out>.review.csv``: ``id, question, reference, answer, correct``. By default the
   draw is *planned*: a seeded :data:`PLAN_SHARE` of the answers is read (scores and judge
   labels) to place the scope where the threshold will be (:func:`planned_cutoff`), and left
   out of the review and the certificate; ``--review-scope s`` draws among the ⌈s·n⌉ lowest
   scores instead. The artifact records the draw, the judge and a fingerprint of its labels
   (``metadata["review"]``).
2. People fill ``correct`` (yes / no; also true / false, 1 / 0, correct / wrong) for every
   row, in a spreadsheet or an editor. **The judge's verdict is not in the file**: a reviewer
   who sees it tends to agree with it, and then the review repeats the judge's errors
   instead of measuring them. The reference answers are shown when the data has them (the
   people decide; a reference may itself be wrong).
3. ``abstain-guard review --artifact A --labels A.review.csv`` reads the file back: the same
   drawn ids, every row filled, nothing else; the verdicts go into the artifact
   (``review.npz``), with the file's sha256. The sample is the tool's draw, never the
   reviewer's choice: a file with other, fewer or more answers is refused, and so is a draw
   whose seed, judge or judge labels are not the artifact's (:func:`apply_review`).

How many to review (:func:`review_size_table`, ``abstain-guard review-size``): before anyone
labels, simulate the certificate on the truth on an artifact's own calibration scores and
judge labels, for a rough judge error rate and several review sizes, each drawn as
``calibrate`` would (planned scope by default). Each draw makes a truth consistent with the
stated judge quality (:func:`simulated_truth`): a share ``judge_error`` of the answers have the
judge's label flipped, ``lenient_share`` of the flips on answers the judge called right, each
flip more likely where the score is high. The table says, per m, how often the target was
certifiable and the median participation; :func:`recommended_size` picks the smallest m
within 95 % of the best median.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import logging
import math
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

#: The columns of a review file, in order.
REVIEW_COLUMNS = ("id", "question", "reference", "answer", "correct")

_YES = {"yes", "y", "true", "1", "correct", "right"}
_NO = {"no", "n", "false", "0", "wrong", "incorrect"}


PLAN_SHARE = 0.15
"""Share of the calibration answers a planned review reads (their scores and judge labels)
to place its scope; they take part in neither arm of the certificate."""

_SCOPE_MARGIN = 1.25
"""A planned scope reaches this many times the share at which the planning answers' judge
error rate last stays within ε (and holds at least this many times m answers); chosen on
bench/power/truth_certificate.py's low-accuracy and shipped-guard populations (1, 1.25, 1.5
compared) before any review."""


def review_seed(calibration_ids: Sequence[str]) -> int:
    """The review's seed, derived from the calibration answers' ids (sha256): the same
    calibration set always gets the same draw, so no second draw can replace it."""
    digest = hashlib.sha256("\n".join(calibration_ids).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def labels_sha256(judge_correct: ArrayLike) -> str:
    """The fingerprint of the judge's labels the draw was made with."""
    return hashlib.sha256(np.asarray(judge_correct, dtype=bool).tobytes()).hexdigest()


@dataclass(frozen=True)
class ReviewDraw:
    """A uniformly random sample (``ids``, in draw order) of the ``eligible`` calibration
    answers of ``population``: those with a score at most ``score_cutoff`` (None: all), the
    ``planning_ids`` excluded; ``scope`` the share the user gave (None: planned from the
    planning answers at ``risk_target``); ``judge`` / ``judge_sha256`` the judge and its
    labels at the draw."""

    seed: int
    size: int
    population: int
    ids: tuple[str, ...]
    scope: float | None
    eligible: int
    score_cutoff: float | None
    planning_ids: tuple[str, ...] = ()
    risk_target: float | None = None
    judge: Any = None
    judge_sha256: str = ""

    def to_json(self) -> dict[str, Any]:
        """The draw as the artifact records it."""
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}
        out["sampling"] = (
            "uniform without replacement among the answers with score <= score_cutoff (all "
            "when null) outside planning_ids, numpy default_rng(seed), seed = sha256 of the "
            "calibration ids"
        )
        return out

    @classmethod
    def from_json(cls, block: Mapping[str, Any]) -> ReviewDraw:
        cutoff, scope = block.get("score_cutoff"), block.get("scope")
        return cls(
            int(block["seed"]),
            int(block["size"]),
            int(block["population"]),
            tuple(block["ids"]),
            None if scope is None else float(scope),
            int(block.get("eligible", block["population"])),
            None if cutoff is None else float(cutoff),
            tuple(block.get("planning_ids", ())),
            block.get("risk_target"),
            block.get("judge"),
            str(block.get("judge_sha256", "")),
        )

    def human_codes(self, ids: Sequence[str], scores: ArrayLike) -> np.ndarray:
        """int8 ``[n]`` before any verdict: -1 eligible, -2 out of scope, -3 planning."""
        s = np.asarray(scores, dtype=np.float64)
        out = np.where(s <= (math.inf if self.score_cutoff is None else self.score_cutoff), -1, -2)
        planning = set(self.planning_ids)
        out[[i for i, x in enumerate(ids) if x in planning]] = -3
        return out.astype(np.int8)


def planned_cutoff(scores: np.ndarray, judge_correct: np.ndarray, risk_target: float) -> float:
    """The score cutoff a planned review draws below, from the planning answers' scores and
    judge labels ``[p]``: :data:`_SCOPE_MARGIN` times the share at which their judge error
    rate among the most confident last stays within ε (+inf: the whole set)."""
    order = np.argsort(scores, kind="stable")
    rate = np.cumsum(~judge_correct[order]) / np.arange(1, scores.size + 1)
    within = np.flatnonzero(rate <= risk_target)
    if within.size == 0:
        return math.inf
    reach = math.ceil(_SCOPE_MARGIN * (int(within[-1]) + 1))
    return math.inf if reach >= scores.size else float(scores[order][reach - 1])


def draw_review(
    calibration_ids: Sequence[str],
    size: int,
    *,
    scores: Sequence[float] | np.ndarray,
    judge_correct: ArrayLike,
    scope: float | None = None,
    risk_target: float | None = None,
) -> ReviewDraw:
    """Draw ``size`` of the calibration answers uniformly at random without replacement,
    seeded by :func:`review_seed`. ``scope``: only among the ⌈scope·n⌉ lowest scores (scores
    alone); None: planned — :data:`PLAN_SHARE` of the answers (seeded) are read for
    :func:`planned_cutoff` at ``risk_target`` and left out of the review and the certificate,
    and the draw is among the others below that cutoff (at least
    :data:`_SCOPE_MARGIN`·size of them).

    Raises:
        InvalidInputError: ``size`` is not between 1 and the number of eligible answers, or
            ``scope`` outside (0, 1].
    """
    n = len(calibration_ids)
    s = np.asarray(scores, dtype=np.float64)
    j = np.asarray(judge_correct, dtype=bool)
    if scope is not None and not 0.0 < scope <= 1.0:
        raise InvalidInputError(f"review scope must be in (0, 1], got {scope}.")
    seed = review_seed(calibration_ids)
    rng = np.random.default_rng(seed)
    planning = np.zeros(n, bool)
    if scope is None and risk_target is not None:
        planning[rng.permutation(n)[: math.ceil(PLAN_SHARE * n)]] = True
        rest = np.sort(s[~planning])
        floor = rest[min(rest.size, math.ceil(_SCOPE_MARGIN * size)) - 1] if rest.size else 0.0
        cutoff = max(planned_cutoff(s[planning], j[planning], risk_target), floor)
    else:
        cutoff = float(np.sort(s)[max(1, math.ceil((scope or 1.0) * n - 1e-9)) - 1])
    cutoff_or_none = None if cutoff >= s.max() else float(cutoff)
    eligible = np.flatnonzero((s <= cutoff) & ~planning)
    if not 1 <= size <= eligible.size:
        raise InvalidInputError(
            f"a review of {size} answers cannot be drawn from {eligible.size} eligible "
            f"calibration answers; give a size between 1 and {eligible.size}."
        )
    picked = rng.choice(eligible, size=size, replace=False)
    return ReviewDraw(
        seed,
        size,
        n,
        tuple(calibration_ids[int(i)] for i in picked),
        scope,
        int(eligible.size),
        cutoff_or_none,
        tuple(calibration_ids[int(i)] for i in np.flatnonzero(planning)),
        risk_target if scope is None else None,
        judge_sha256=labels_sha256(j),
    )


def review_path(out: str | Path) -> Path:
    """Where the review file of the artifact at ``out`` is written: ``<out>.review.csv``."""
    out = Path(out)
    return out.with_name(out.name + ".review.csv")


def start_review(
    out: str | Path,
    metadata: dict[str, Any],
    size: int,
    calibration: tuple[np.ndarray, np.ndarray],
    config: Any,
) -> ReviewDraw | None:
    """Draw the review of a calibration run (``size`` 0: none) from its
    ``metadata["calibration_ids"]`` and ``calibration`` (scores, judge labels), with
    ``config.review_scope`` (None: planned at ``config.risk_target``), and record it in
    ``metadata["review"]`` (status ``"drawn"``, the judge, the file it will be written to)."""
    if not size:
        return None
    draw = draw_review(
        metadata["calibration_ids"],
        size,
        scores=calibration[0],
        judge_correct=calibration[1],
        scope=getattr(config, "review_scope", None),
        risk_target=getattr(config, "risk_target", None),
    )
    draw = dataclasses.replace(draw, judge=metadata.get("judge"))
    metadata["review"] = {
        **draw.to_json(),
        "status": "drawn",
        "file": str(review_path(out).resolve()),
    }
    return draw


def _check_bound(draw: ReviewDraw, artifact: GuardArtifact, ids: Sequence[str]) -> None:
    """Refuse verdicts for a draw that is not the one this calibration and judge make: a seed
    other than the ids' own, other drawn ids, another judge or other judge labels."""
    why = None
    if draw.seed != review_seed(ids):
        why = "its seed is not the one derived from the calibration ids"
    elif draw.judge != artifact.metadata.get("judge"):
        why = "the artifact's judge is not the one the draw was made with"
    elif draw.judge_sha256 != labels_sha256(artifact.correct):
        why = "the judge's labels changed since the draw"
    else:
        again = draw_review(
            ids,
            draw.size,
            scores=artifact.scores,
            judge_correct=artifact.correct,
            scope=draw.scope,
            risk_target=draw.risk_target,
        )
        if again.ids != draw.ids or again.planning_ids != draw.planning_ids:
            why = "the recorded draw is not the one its seed makes"
    if why is not None:
        raise InvalidInputError(
            f"this review cannot certify the artifact: {why}. The sample is fixed by the "
            "calibration set and its judge; calibrate again (with --review N) to draw it anew."
        )


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
        InvalidInputError: no draw in the artifact, a draw this calibration and judge would
            not make (:func:`_check_bound`), or a bad review file (:func:`read_review_file`).
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
    _check_bound(draw, artifact, ids)
    human = draw.human_codes(ids, artifact.scores)
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


def simulated_review(
    rng: np.random.Generator,
    calibration: tuple[np.ndarray, np.ndarray],
    truth: np.ndarray,
    m: int,
    scope: float | None,
    risk_target: float,
) -> np.ndarray:
    """The human labels ``[n]`` a review of m would give, drawn as :func:`draw_review` draws
    (a random planning share and its planned cutoff when ``scope`` is None) from the
    calibration's ``(scores, judge labels)`` and a ``truth`` (True correct)."""
    ids = [str(i) for i in rng.permutation(truth.size)]  # a fresh seed, through the ids
    draw = draw_review(
        ids,
        m,
        scores=calibration[0],
        judge_correct=calibration[1],
        scope=scope,
        risk_target=risk_target,
    )
    human = draw.human_codes(ids, calibration[0])
    position = {item: i for i, item in enumerate(ids)}
    picked = np.array([position[i] for i in draw.ids])
    human[picked] = truth[picked]
    return human


def review_size_table(
    calibration: tuple[ArrayLike, ArrayLike],
    target: tuple[float, float],
    judge_error: float,
    sizes: Sequence[int] = (50, 100, 200, 400, 800),
    *,
    draws: int = 100,
    lenient_share: float = 0.5,
    seed: int = 0,
    scope: float | None = None,
) -> list[ReviewSizeRow]:
    """For each review size m, the share of simulated draws in which ε is certifiable on the
    truth at δ (``target``) and the median certified participation (module docstring), from
    the calibration's ``(scores, judge labels)``; ``scope`` as ``calibrate --review-scope``
    (None: planned). Sizes no draw can hold are left out."""
    s = np.asarray(calibration[0], dtype=np.float64)
    j = np.asarray(calibration[1]).astype(bool)
    rng = np.random.default_rng(seed)
    rows = []
    for m in sorted(set(sizes)):
        parts = []
        for _ in range(draws):
            truth = simulated_truth(rng, s, j, judge_error, lenient_share)
            try:
                human = simulated_review(rng, (s, j), truth, m, scope, target[0])
            except InvalidInputError:  # more than the eligible answers
                break
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", conformal.ConformalWarning)
                res = conformal.risk_threshold(s, j, target[0], target[1], human=human)
            parts.append(res.participation if res.feasible else 0.0)
        if len(parts) == draws:
            arr = np.asarray(parts)
            rows.append(ReviewSizeRow(m, float((arr > 0).mean()), float(np.median(arr)), draws))
    return rows


def recommended_size(rows: Sequence[ReviewSizeRow], within: float = 0.95) -> int | None:
    """The smallest simulated m whose median participation is within ``within`` of the
    best one (None: no size certifies anything)."""
    best = max((r.median_participation for r in rows), default=0.0)
    if best <= 0.0:
        return None
    return min(r.m for r in rows if r.median_participation >= within * best)
