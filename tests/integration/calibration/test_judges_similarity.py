"""The similarity judge: its logic with a stand-in encoder, and the embedded MiniLM (slow)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from abstain_guard.calibration.building.judges import SimilarityJudge, make_judge


class FakeEncoder:
    """Embeds each text as a fixed unit vector from a table; counts encode calls."""

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table = table
        self.calls: list[list[str]] = []

    def encode(self, texts, **kwargs):
        self.calls.append(list(texts))
        v = np.array([self.table[t] for t in texts], dtype=float)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


class FakeCrossEncoder:
    def __init__(self, scores: dict[tuple[str, str], float]) -> None:
        self.scores = scores

    def predict(self, pairs, **kwargs):
        return np.array([self.scores[tuple(p)] for p in pairs])


TABLE = {
    "Lima": [1.0, 0.0, 0.0],
    "It is Lima": [0.9, 0.1, 0.0],
    "Cusco": [0.0, 1.0, 0.0],
    "Ciudad de los Reyes": [0.7, 0.0, 0.7],
}


def _judge(threshold: float = 0.8) -> tuple[SimilarityJudge, FakeEncoder]:
    enc = FakeEncoder(TABLE)
    return SimilarityJudge(threshold=threshold, encoder=enc), enc


def test_similarity_max_over_aliases_and_threshold() -> None:
    judge, _ = _judge()
    j = judge.judge("q", ["Cusco", "Lima"], "It is Lima")
    assert j.correct is True and j.score == pytest.approx(0.9 / np.hypot(0.9, 0.1))
    assert judge.judge("q", ["Lima"], "Cusco").correct is False
    assert judge.judge("q", ["Lima"], "  ").correct is False
    assert judge.judge("q", ["Lima"], "Ciudad de los Reyes").score == pytest.approx(np.sqrt(0.5))
    strict, _ = _judge(threshold=0.999)
    assert strict.judge("q", ["Lima"], "It is Lima").correct is False


def test_similarity_judge_many_is_batched() -> None:
    judge, enc = _judge()
    inputs = [("q", ["Lima"], "It is Lima"), ("q", ["Lima"], "Cusco"), ("q", ["Lima"], "")] * 5
    out = judge.judge_many(inputs, progress=False)
    assert [j.correct for j in out[:3]] == [True, False, False]
    assert len(enc.calls) == 1 and sorted(enc.calls[0]) == ["Cusco", "It is Lima", "Lima"]


def test_cross_encoder_path(tmp_path: Path) -> None:
    judge = SimilarityJudge(
        cross_encoder_path=tmp_path,
        threshold=0.5,
        encoder=FakeCrossEncoder({("a", "x"): 0.2, ("a", "y"): 0.7}),
    )
    j = judge.judge("q", ["x", "y"], "a")
    assert j.correct is True and j.score == pytest.approx(0.7)
    assert "cross-encoder" in judge.identity


def test_identity_and_factory_do_not_load() -> None:
    judge = make_judge({"name": "similarity", "threshold": 0.7})
    assert isinstance(judge, SimilarityJudge) and judge._model is None
    assert judge.identity == "similarity(model='all-MiniLM-L6-v2', threshold=0.7, version=2)"
    assert SimilarityJudge().threshold == 0.8


@pytest.mark.slow
def test_embedded_minilm_on_curated_cases() -> None:
    # calibration.inference loads every scorer (torch): only this slow test needs it.
    from abstain_guard.scorers import default_similarity_model_path

    if not (default_similarity_model_path() / "model.safetensors").is_file():
        pytest.skip("the embedded all-MiniLM-L6-v2 package is not installed")
    judge = SimilarityJudge()
    cases = [
        ("Capital of France?", ["The capital of France is Paris."], "Paris is France's capital."),
        (
            "Capital of France?",
            ["The capital of France is Paris."],
            "The capital of France is Lyon.",
        ),
        (
            "Who wrote Hamlet?",
            ["William Shakespeare wrote Hamlet."],
            "Hamlet was written by Shakespeare.",
        ),
        ("Who wrote Hamlet?", ["William Shakespeare wrote Hamlet."], "I like bananas."),
    ]
    out = judge.judge_many(cases, progress=False)
    assert out[0].correct is True and out[2].correct is True
    assert out[3].correct is False and out[3].score is not None and out[3].score < 0.3
    assert out[0].score > out[1].score  # type: ignore[operator]
