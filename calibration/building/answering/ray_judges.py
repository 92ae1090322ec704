"""Judging on the Ray replicas (``calibrate --executor ray``): the driver's cached judges
wrap a :class:`RayJudge` whose verdicts are made by ``make_judge(spec)`` on the replicas
(:meth:`~.executors.RayExecutor.judge`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..judges.base import Judge, Judgment
from ..run.calibration_config import CalibrationConfig
from .executors import RayExecutor


class RayJudge(Judge):
    """A judge whose verdicts are made on the Ray replicas (``make_judge(spec)`` there).

    Wrapped by the driver's ``CachedJudge`` as the local judge was (same identity, same
    cache), so only verdicts not yet cached go out.
    """

    def __init__(self, local: Judge, spec: Any, executor: RayExecutor) -> None:
        self.local = local
        self.spec = spec
        self.executor = executor

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.local.name

    @property
    def identity(self) -> str:
        return self.local.identity

    def judge(
        self,
        question: str,
        gold_answers: Sequence[str],
        prediction: str,
        *,
        choices: Sequence[str] = (),
    ) -> Judgment:
        ((_, verdict),) = self.iter_judge_many([(question, gold_answers, prediction, choices)])
        return verdict  # type: ignore[no-any-return]

    def iter_judge_many(
        self, inputs: Sequence[Any], *, max_concurrency: int = 4
    ) -> Iterator[tuple[int, Judgment]]:
        yield from self.executor.judge(self.spec, self.identity, list(inputs))


def judge_specs(config: CalibrationConfig) -> dict[str, Any]:
    """The judge spec per question kind, as :func:`~..judges.judging.build_judges` builds them."""
    name = config.judge if isinstance(config.judge, str) else config.judge.get("name")
    specs: dict[str, Any] = {"open": config.judge, "choice": config.judge, "numeric": config.judge}
    if name not in ("choice", "numeric"):
        specs["choice"], specs["numeric"] = "choice", "numeric"
    return specs


def distribute_judges(
    judges: dict[str, Any], config: CalibrationConfig, executor: RayExecutor
) -> None:
    """Make each cached judge of :func:`~..judges.judging.build_judges` judge on the replicas (in
    place: the wrapped judge becomes a :class:`RayJudge` with the same identity)."""
    for kind, spec in judge_specs(config).items():
        cached = judges.get(kind)
        if cached is not None and hasattr(cached, "inner"):
            cached.inner = RayJudge(cached.inner, spec, executor)
