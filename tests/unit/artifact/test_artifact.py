"""GuardArtifact: round trip, integrity (flipped byte, truncation, missing file), schema,
fingerprint mismatch, and that loading never unpickles anything."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.errors import (
    ArtifactError,
    ArtifactIntegrityError,
    ArtifactMismatchError,
    ArtifactNotFoundError,
    ArtifactSchemaError,
    InvalidInputError,
)
from abstain_guard.scorers import PerplexityScorer, Scorer, ScorerState, register_scorer


class TableScorer(Scorer):
    """A scorer with fitted arrays and a raw file, to exercise every artifact part."""

    kind: ClassVar[str] = "test_table_scorer"

    def __init__(self, weights: np.ndarray, blob: bytes, scale: float = 1.0) -> None:
        self.weights = weights
        self.blob = blob
        self.scale = scale

    def score(self, response: Any) -> float:
        return float(self.weights.sum() * self.scale)

    def get_state(self) -> ScorerState:
        return ScorerState(
            kind=self.kind,
            params={"scale": self.scale},
            arrays={"weights": self.weights},
            files={"calibrator.ubj": self.blob},
        )

    @classmethod
    def from_state(cls, state: ScorerState) -> Scorer:
        return cls(state.arrays["weights"], state.files["calibrator.ubj"], state.params["scale"])


register_scorer(TableScorer)


@pytest.fixture
def calibration() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    scores = rng.uniform(1.0, 3.0, size=120)
    correct = rng.uniform(size=120) > (scores - 1.0) / 2.0
    return scores, correct


@pytest.fixture
def saved(tmp_path: Path, calibration: tuple[np.ndarray, np.ndarray]) -> Path:
    scores, correct = calibration
    scorer = TableScorer(np.arange(6, dtype=np.float32).reshape(2, 3), b"\x00UBJ-model\xff", 2.5)
    artifact = GuardArtifact.from_calibration(
        scorer=scorer,
        calibration=CalibrationSet(scores, correct),
        model_fingerprint="smollm2-135m:abc123",
        metadata={"judge": "lexical", "splits": {"calibration": 120}},
    )
    return artifact.save(tmp_path / "guard")


def _resign(root: Path, mutate: Any) -> None:
    """Rewrite the manifest after `mutate(manifest)`, with valid checksums (a forger)."""
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.pop("manifest_sha256")
    mutate(manifest)
    canon = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["manifest_sha256"] = hashlib.sha256(canon).hexdigest()
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_round_trip(saved: Path, calibration: tuple[np.ndarray, np.ndarray]) -> None:
    scores, correct = calibration
    files = sorted(p.name for p in saved.iterdir())
    assert files == [
        "calibration.npz",
        "calibrator.ubj",
        "manifest.json",
        "scorer.json",
        "scorer.npz",
    ]
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["scorer"]["kind"] == "test_table_scorer"
    assert set(manifest["checksums"]) == set(files) - {"manifest.json"}
    loaded = GuardArtifact.load(saved, expected_fingerprint="smollm2-135m:abc123")
    np.testing.assert_array_equal(loaded.scores, scores)
    np.testing.assert_array_equal(loaded.correct, correct)
    assert loaded.correct.dtype == bool
    assert loaded.model_fingerprint == "smollm2-135m:abc123"
    assert loaded.metadata == {"judge": "lexical", "splits": {"calibration": 120}}
    assert isinstance(loaded.scorer, TableScorer)
    assert loaded.scorer.blob == b"\x00UBJ-model\xff" and loaded.scorer.scale == 2.5
    np.testing.assert_array_equal(loaded.scorer.weights, np.arange(6).reshape(2, 3))
    assert loaded.scorer.weights.dtype == np.float32
    assert loaded.path == saved


def test_new_target_rethresholds_from_stored_scores(saved: Path) -> None:
    loaded = GuardArtifact.load(saved)
    r80 = loaded.decision_rule(GuardConfig(participation=0.8))
    r50 = loaded.decision_rule(GuardConfig(participation=0.5))
    assert r50.threshold < r80.threshold
    assert r80.threshold == np.sort(loaded.scores)[int(np.ceil(0.8 * 121)) - 1]
    assert r80.guarantee.participation_interval == pytest.approx([0.8, 0.8 + 1 / 121])
    assert 0 < r80.guarantee.conditional_correctness_bound < 1
    risk = loaded.decision_rule(GuardConfig(mode="risk", risk_target=0.3))
    assert risk.mode == "risk" and risk.target == 0.3
    assert risk.guarantee.certified_bound <= 0.3 or not risk.guarantee.feasible


def test_perplexity_artifact_round_trip(tmp_path: Path, calibration: tuple) -> None:
    scores, correct = calibration
    art = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(scores, correct)
    )
    loaded = GuardArtifact.load(art.save(tmp_path / "p"))
    assert isinstance(loaded.scorer, PerplexityScorer) and loaded.model_fingerprint is None
    cfg = GuardConfig()
    assert loaded.decision_rule(cfg) == art.decision_rule(cfg)


@pytest.mark.parametrize("name", ["calibration.npz", "calibrator.ubj", "scorer.json", "scorer.npz"])
def test_flipped_byte_is_detected(saved: Path, name: str) -> None:
    path = saved / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match=name):
        GuardArtifact.load(saved)


def test_truncated_file_is_detected(saved: Path) -> None:
    path = saved / "calibration.npz"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ArtifactIntegrityError):
        GuardArtifact.load(saved)


def test_edited_manifest_is_detected(saved: Path) -> None:
    text = (saved / "manifest.json").read_text()
    (saved / "manifest.json").write_text(text.replace("smollm2-135m:abc123", "other-model:abc123"))
    with pytest.raises(ArtifactIntegrityError, match="manifest"):
        GuardArtifact.load(saved)
    (saved / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(ArtifactIntegrityError, match="not valid JSON"):
        GuardArtifact.load(saved)


def test_missing_file_and_directory(saved: Path, tmp_path: Path) -> None:
    (saved / "calibrator.ubj").unlink()
    with pytest.raises(ArtifactNotFoundError, match=r"calibrator\.ubj"):
        GuardArtifact.load(saved)
    with pytest.raises(ArtifactNotFoundError):
        GuardArtifact.load(tmp_path / "nowhere")
    (saved / "manifest.json").unlink()
    with pytest.raises(ArtifactNotFoundError, match=r"manifest\.json"):
        GuardArtifact.load(saved)


def test_wrong_fingerprint(saved: Path) -> None:
    with pytest.raises(ArtifactMismatchError, match="calibrate again"):
        GuardArtifact.load(saved, expected_fingerprint="gemma-3-270m:zzz")
    art = GuardArtifact.load(saved)
    art.check_fingerprint(None)  # unknown model identity: nothing to compare
    with pytest.raises(ArtifactMismatchError):
        art.check_fingerprint("gemma-3-270m:zzz")


def test_unsupported_schema_version(saved: Path) -> None:
    _resign(saved, lambda m: m.update(schema_version=99))
    with pytest.raises(ArtifactSchemaError, match="schema version 99"):
        GuardArtifact.load(saved)


def test_pickled_arrays_are_refused(saved: Path) -> None:
    # a forger writes an object array (pickle) and fixes every checksum: still refused
    buf = io.BytesIO()
    np.savez(buf, scores=np.array([object()], dtype=object), correct=np.array([True]))
    data = buf.getvalue()
    (saved / "calibration.npz").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    _resign(saved, lambda m: m["checksums"].update({"calibration.npz": digest}))
    with pytest.raises(ArtifactSchemaError, match="pickle"):
        GuardArtifact.load(saved)


def test_unknown_scorer_kind(saved: Path) -> None:
    state = json.loads((saved / "scorer.json").read_text())
    state["kind"] = "no_such_scorer"
    data = json.dumps(state).encode()
    (saved / "scorer.json").write_bytes(data)

    def mutate(m: dict) -> None:
        m["checksums"]["scorer.json"] = hashlib.sha256(data).hexdigest()
        m["scorer"]["kind"] = "no_such_scorer"

    _resign(saved, mutate)
    with pytest.raises(ArtifactSchemaError, match="no_such_scorer"):
        GuardArtifact.load(saved)


def test_save_refuses_to_clobber(saved: Path, tmp_path: Path, calibration: tuple) -> None:
    art = GuardArtifact.load(saved)
    with pytest.raises(ArtifactError, match="overwrite=True"):
        art.save(saved)
    art.save(saved, overwrite=True)
    GuardArtifact.load(saved)
    other = tmp_path / "not_an_artifact"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="not an artifact"):
        art.save(other, overwrite=True)
    assert (other / "notes.txt").read_text() == "keep me"


def test_invalid_inputs(calibration: tuple, tmp_path: Path) -> None:
    scores, correct = calibration
    with pytest.raises(InvalidInputError, match="same length"):
        GuardArtifact.from_calibration(
            scorer=PerplexityScorer(), calibration=CalibrationSet(scores, correct[:-1])
        )
    with pytest.raises(InvalidInputError, match="NaN"):
        GuardArtifact.from_calibration(
            scorer=PerplexityScorer(), calibration=CalibrationSet([1.0, float("nan")], [1, 0])
        )
    with pytest.raises(InvalidInputError, match="JSON"):
        GuardArtifact.from_calibration(
            scorer=PerplexityScorer(),
            calibration=CalibrationSet(scores, correct),
            metadata={"x": object()},
        )
    bad = TableScorer(np.array([object()], dtype=object), b"")
    art = GuardArtifact.from_calibration(scorer=bad, calibration=CalibrationSet(scores, correct))
    with pytest.raises(InvalidInputError, match="pickle"):
        art.save(tmp_path / "never-written")
    assert not (tmp_path / "never-written").exists()


def test_config_scorer_must_match(saved: Path) -> None:
    art = GuardArtifact.load(saved)
    with pytest.raises(ArtifactMismatchError, match="geometry"):
        art.decision_rule(GuardConfig(scorer="geometry"))
    assert art.decision_rule(GuardConfig(scorer="test_table_scorer")).mode == "participation"
