"""A deterministic judge, questions and a calibration config for pipeline tests on tiny models,
and the calibration config of ``ChatOpenAI`` against the embedded model behind an
OpenAI-compatible server (``abstain-guard serve --no-guard`` or a text-only one)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

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


def chat_openai_kwargs(base_url: str, **extra: Any) -> dict[str, Any]:
    """``ChatOpenAI``'s keyword arguments for the embedded model served at ``base_url``."""
    return {"model": "smollm2", "base_url": base_url, "max_retries": 0, **extra}


def api_model_config(
    base_url: str,
    tmp: Path,
    scorer: str = "perplexity",
    scorer_params: dict[str, Any] | None = None,
    **kwargs: Any,
) -> CalibrationConfig:
    """Calibrating ``ChatOpenAI`` at ``base_url`` (``kwargs`` added to its own) on the
    24-question sets of the API tests: split 1:1:4:1, twelve new tokens, cached in
    ``tmp/run.cache``."""
    return CalibrationConfig(
        model={
            "class_path": "langchain_openai:ChatOpenAI",
            "kwargs": chat_openai_kwargs(base_url, **kwargs),
        },
        scorer=scorer,
        scorer_params=scorer_params or {},
        max_new_tokens=12,
        batch_size=8,
        ratios=(1, 1, 4, 1),
        participation=0.5,
        cache_dir=str(tmp / "run.cache"),
    )


def completions_served(base_url: str) -> float:
    """How many chat completions the server at ``base_url`` answered (its metrics)."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics").text
    found = re.search(
        r'abstain_guard_requests_total\{path="/v1/chat/completions",status="200"\} (\S+)', text
    )
    return float(found.group(1)) if found else 0.0
