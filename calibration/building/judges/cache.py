"""On-disk cache of judgments (SQLite), so a re-run never asks a judge twice.

:class:`JudgmentCache` stores one row per (judge identity, content key), the content key being
the sha256 of the question, the gold answers and the prediction (and the options, for choice
questions). :class:`CachedJudge` wraps any judge: cached verdicts are returned without calling
it, and each new verdict is committed as soon as it arrives, so a run killed mid-way keeps
everything judged so far. Judgments that could not be made (``correct is None``) are not
cached by default, so a later run retries them. Storage is a
:class:`~abstain_guard.calibration.building.run.store.RunStore`, with its crash safety and
integrity checks (docs/architecture.md, 'Run cache').
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from abstain_guard.errors import CacheError, JudgmentCacheError

from ..run.store import LayeredStore, RunStore, content_key
from .base import Judge, JudgeInput, Judgment, unpack_input


def judgment_key(
    question: str, gold_answers: Sequence[str], prediction: str, choices: Sequence[str] = ()
) -> str:
    """The cache key of one judged answer: :func:`~abstain_guard.calibration.building.run.store.
    content_key` of ``(question, gold answers, prediction)``, the options appended only when
    there are some (so keys of open questions do not change with an empty option list)."""
    options = (list(choices),) if choices else ()
    return content_key(question, list(gold_answers), prediction, *options)


@contextlib.contextmanager
def _typed() -> Iterator[None]:
    """Store errors as JudgmentCacheError (a CacheError that is also a JudgeError)."""
    try:
        yield
    except JudgmentCacheError:
        raise
    except CacheError as exc:
        raise JudgmentCacheError(str(exc)) from exc


class JudgmentCache:
    """Judgments keyed by ``(judge identity, content key)`` in a SQLite
    :class:`~abstain_guard.calibration.building.run.store.RunStore` (one namespace per judge
    identity).

    ``read_from``: read-only stores (the calibration run's judgments under ``evaluate``)
    whose verdicts are reused when this file has none; new verdicts go to ``path`` only.

    Raises:
        JudgmentCacheError: (a CacheError and a JudgeError) the file is not SQLite, is damaged
            or truncated (at open), or a verdict read from it was edited (at read).
    """

    def __init__(
        self, path: str | Path, *, timeout: float = 30.0, read_from: Sequence[RunStore] = ()
    ) -> None:
        self.path = Path(path)
        with _typed():
            self._store = (
                LayeredStore(self.path, read_from=read_from, timeout=timeout)
                if read_from
                else RunStore(self.path, timeout=timeout)
            )

    def get_many(self, judge: str, keys: Sequence[str]) -> dict[str, Judgment]:
        """The cached judgments among ``keys`` for the judge identity ``judge``."""
        with _typed():
            found = self._store.get_many(judge, list(dict.fromkeys(keys)))
        return {key: self._judgment(judge, key, value) for key, value in found.items()}

    def _judgment(self, judge: str, key: str, value: Any) -> Judgment:
        try:
            return Judgment.from_json(value)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise JudgmentCacheError(
                f"The judgment cache {self.path} holds a malformed verdict for {judge}/{key} "
                f"({exc}). To start a fresh cache, delete it: {self.path}."
            ) from exc

    def get(self, judge: str, key: str) -> Judgment | None:
        """One cached judgment, or None."""
        return self.get_many(judge, [key]).get(key)

    def put(self, judge: str, key: str, judgment: Judgment) -> None:
        """Store (or replace) one judgment, committed at once."""
        self.put_many(judge, {key: judgment})

    def put_many(self, judge: str, items: Mapping[str, Judgment]) -> None:
        """Store several judgments in one transaction."""
        with _typed():
            self._store.put_many(judge, {key: j.to_json() for key, j in items.items()})

    def __len__(self) -> int:
        return self._store.count()

    @property
    def reused(self) -> int:
        """How many verdicts were read from the ``read_from`` stores so far."""
        return sum(getattr(self._store, "reused", {}).values())

    def count(self, judge: str) -> int:
        """How many judgments are cached for one judge identity."""
        return self._store.count(judge)

    def close(self) -> None:
        """Close this thread's connection."""
        self._store.close()

    def __enter__(self) -> JudgmentCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CachedJudge(Judge):
    """Any judge behind a :class:`JudgmentCache`: cached verdicts are reused, new ones stored
    as they arrive. The identity is the wrapped judge's, so the cache is shared by every
    wrapper of an equal judge.

    Attributes:
        hits: verdicts served from the cache so far.
        misses: verdicts the wrapped judge had to make so far.
    """

    def __init__(self, judge: Judge, cache: JudgmentCache):
        self.inner = judge
        self.cache = cache
        self.hits = 0
        self.misses = 0
        self._count_lock = threading.Lock()

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def identity(self) -> str:
        return self.inner.identity

    def _store(self, key: str, judgment: Judgment) -> None:
        if judgment.correct is not None:  # a failure is asked again next run
            self.cache.put(self.identity, key, judgment)

    def judge(
        self,
        question: str,
        gold_answers: Sequence[str],
        prediction: str,
        *,
        choices: Sequence[str] = (),
    ) -> Judgment:
        key = judgment_key(question, gold_answers, prediction, choices)
        found = self.cache.get(self.identity, key)
        if found is not None:
            with self._count_lock:
                self.hits += 1
            return found
        result = self.inner.judge(question, gold_answers, prediction, choices=choices)
        with self._count_lock:
            self.misses += 1
        self._store(key, result)
        return result

    def iter_judge_many(
        self, inputs: Sequence[JudgeInput], *, max_concurrency: int = 4
    ) -> Iterator[tuple[int, Judgment]]:
        """Cached verdicts first, then the wrapped judge's ``iter_judge_many`` over the distinct
        misses (duplicates in ``inputs`` are judged once); each new verdict is stored at once."""
        unpacked = [unpack_input(t) for t in inputs]
        keys = [judgment_key(q, g, p, c) for q, g, p, c in unpacked]
        cached = self.cache.get_many(self.identity, keys)
        first_of: dict[str, int] = {}
        positions: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            if key in cached:
                with self._count_lock:
                    self.hits += 1
                yield i, cached[key]
            else:
                first_of.setdefault(key, i)
                positions.setdefault(key, []).append(i)
        todo_keys = list(first_of)
        if not todo_keys:
            return
        todo = [unpacked[first_of[k]] for k in todo_keys]
        for k, judgment in self.inner.iter_judge_many(todo, max_concurrency=max_concurrency):
            key = todo_keys[k]
            self._store(key, judgment)
            with self._count_lock:
                self.misses += 1
            for i in positions[key]:
                yield i, judgment
