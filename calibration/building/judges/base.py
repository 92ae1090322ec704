"""The judge interface: :class:`Judgment` (one verdict), :class:`Judge` (the base class every
judge derives from) and :func:`summarize_judgments` (counts for a run's summary).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from langchain_core.runnables import Runnable, RunnableLambda
from tqdm.auto import tqdm

from abstain_guard.errors import JudgeError

#: ``(question, gold_answers, prediction)`` or, for choice questions,
#: ``(question, gold_answers, prediction, choices)``.
JudgeInput = Union[  # noqa: UP007 (a runtime alias: `|` on generic aliases needs 3.10+ anyway)
    tuple[str, Sequence[str], str],
    tuple[str, Sequence[str], str, Sequence[str]],
]


@dataclass(frozen=True)
class Judgment:
    """One verdict.

    Attributes:
        correct: True/False, or None when no judgment could be made (excluded and counted).
        score: the judge's graded score when it has one (F1, cosine similarity, 1/0).
        rationale: a short human-readable reason (which alias matched, the LLM's reason, the
            error that prevented a judgment); starts with ``"refusal"`` for a refusal.
        refusal: the answer declined to answer ("I don't know", "no comment"); such answers
            are always incorrect and are counted separately (:func:`summarize_judgments`).
            Set by the rule-based judges; False where a judge does not tell.
    """

    correct: bool | None
    score: float | None
    rationale: str
    refusal: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict; inverse of :meth:`from_json`."""
        return {
            "correct": self.correct,
            "score": self.score,
            "rationale": self.rationale,
            "refusal": self.refusal,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Judgment:
        """Rebuild a judgment from :meth:`to_json` output."""
        score = d["score"]
        return cls(
            correct=None if d["correct"] is None else bool(d["correct"]),
            score=None if score is None else float(score),
            rationale=str(d["rationale"]),
            refusal=bool(d["refusal"]),
        )


def summarize_judgments(judgments: Iterable[Judgment | Mapping[str, Any]]) -> dict[str, int]:
    """Counts for a run summary: ``n``, ``correct``, ``incorrect``, ``no_verdict`` (excluded
    items) and ``refusals`` (incorrect answers that declined to answer; part of
    ``incorrect``). Accepts :class:`Judgment` objects or their :meth:`Judgment.to_json` dicts.
    """
    counts = {"n": 0, "correct": 0, "incorrect": 0, "no_verdict": 0, "refusals": 0}
    for j in judgments:
        item = j if isinstance(j, Judgment) else Judgment.from_json(j)
        counts["n"] += 1
        if item.correct is None:
            counts["no_verdict"] += 1
        elif item.correct:
            counts["correct"] += 1
        else:
            counts["incorrect"] += 1
        counts["refusals"] += int(item.refusal)
    return counts


def unpack_input(item: JudgeInput) -> tuple[str, tuple[str, ...], str, tuple[str, ...]]:
    if len(item) == 3:
        q, gold, pred = item  # type: ignore[misc]
        choices: Sequence[str] = ()
    elif len(item) == 4:
        q, gold, pred, choices = item  # type: ignore[misc]
    else:
        raise JudgeError(
            f"a judge input is (question, gold_answers, prediction[, choices]), got {len(item)} "
            "values"
        )
    if isinstance(gold, str):
        gold = (gold,)
    return str(q), tuple(str(g) for g in gold), str(pred), tuple(str(c) for c in choices)


def _fmt_params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in params.items())


class Judge(ABC):
    """Base class of correctness judges.

    Subclasses set :attr:`name`, implement :meth:`judge` and :meth:`params`; LLM-backed judges
    set :attr:`concurrent` so :meth:`judge_many` runs them through LangChain's
    ``batch_as_completed`` with ``max_concurrency``.
    """

    name: ClassVar[str] = "judge"
    concurrent: ClassVar[bool] = False

    def params(self) -> dict[str, Any]:
        """The parameters that change verdicts (part of :attr:`identity`)."""
        return {}

    @property
    def identity(self) -> str:
        """Name + parameters + model identity, e.g. ``"lexical(mode='containment', …)"``.
        Two judges with the same identity give the same verdicts; the cache is keyed by it."""
        return f"{self.name}({_fmt_params(self.params())})"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.identity}>"

    @abstractmethod
    def judge(
        self,
        question: str,
        gold_answers: Sequence[str],
        prediction: str,
        *,
        choices: Sequence[str] = (),
    ) -> Judgment:
        """Judge one answer. ``choices`` (option texts, lettered A.. in order) only matters for
        multiple-choice questions; judges that do not need it ignore it."""

    def iter_judge_many(
        self, inputs: Sequence[JudgeInput], *, max_concurrency: int = 4
    ) -> Iterator[tuple[int, Judgment]]:
        """Yield ``(index, judgment)`` as each judgment is ready (not necessarily in order).

        Concurrent judges run through ``RunnableLambda(...).batch_as_completed`` with
        ``max_concurrency``; the others run in order in this thread.
        """
        unpacked = [unpack_input(t) for t in inputs]
        if not self.concurrent or max_concurrency <= 1 or len(unpacked) <= 1:
            for i, (q, g, p, c) in enumerate(unpacked):
                yield i, self.judge(q, g, p, choices=c)
            return

        def one(t: tuple[str, tuple[str, ...], str, tuple[str, ...]]) -> Judgment:
            return self.judge(t[0], t[1], t[2], choices=t[3])

        runner: Runnable[Any, Judgment] = RunnableLambda(one)
        for i, result in runner.batch_as_completed(
            unpacked, config={"max_concurrency": max_concurrency}
        ):
            yield i, result

    def judge_many(
        self, inputs: Sequence[JudgeInput], max_concurrency: int = 4, progress: bool = True
    ) -> list[Judgment]:
        """Judge many answers (in input order), with a progress bar when ``progress``."""
        out: list[Judgment | None] = [None] * len(inputs)
        with tqdm(
            total=len(inputs), desc=f"judging ({self.name})", disable=not progress, unit="ans"
        ) as bar:
            for i, j in self.iter_judge_many(inputs, max_concurrency=max_concurrency):
                out[i] = j
                bar.update(1)
        missing = [i for i, j in enumerate(out) if j is None]
        if missing:
            raise JudgeError(f"{self.identity} returned no judgment for inputs {missing[:5]}")
        return [j for j in out if j is not None]
