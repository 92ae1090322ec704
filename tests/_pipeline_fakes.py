"""A deterministic judge, questions and a calibration config for pipeline tests on tiny models."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from abstain_guard.calibration.building.judges import Judge, Judgment
from abstain_guard.calibration.building.judges.cache import CachedJudge, JudgmentCache
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig


class HashJudge(Judge):
    """Correct iff the first byte of sha256(prediction) is even; counts its calls."""

    name = "hash"

    def __init__(self, fail_after: int | None = None) -> None:
        self.calls = 0
        self.fail_after = fail_after

    def judge(
        self, question: str, gold_answers: Sequence[str], prediction: str, *, choices=()
    ) -> Judgment:
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("simulated kill while judging")
        self.calls += 1
        ok = hashlib.sha256(prediction.encode()).digest()[0] % 2 == 0
        return Judgment(correct=ok, score=float(ok), rationale="hash parity")


ITEMS = [
    QAItem(id=f"q{i}", question=f"What is item {i}?", answers=(f"a{i}",), group=f"g{i % 2}")
    for i in range(60)
]


def _config(tmp: Path, name: str, scorer: str = "perplexity") -> CalibrationConfig:
    return CalibrationConfig(
        scorer=scorer,
        batch_size=8,
        max_new_tokens=6,
        system_prompt="Answer.",  # the tiny model's context is 96 characters
        cache_dir=str(tmp / f"{name}.cache"),
        participation=0.5,
    )


def _judges(tmp: Path, name: str, judge: Judge) -> dict[str, Any]:
    cached = CachedJudge(judge, JudgmentCache(tmp / f"{name}.cache" / "judgments.sqlite"))
    return {"open": cached, "choice": cached, "numeric": cached}


def _artifact_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "manifest.json"}


def hash_judges(cfg: Any, path: Path, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """A stand-in for ``build_judges(cfg, <cache>/judgments.sqlite, ...)``: the hash judge
    for every kind, cached there (a random-weight or tiny model answers nothing right, so a
    lexical judge would give one class)."""
    cached = CachedJudge(HashJudge(), JudgmentCache(path))
    return {"open": cached, "choice": cached, "numeric": cached}
