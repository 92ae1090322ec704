"""``--model`` end to end on a tiny random-weight Hugging Face folder: calibrate records the
model (and its device and dtype), evaluate and serve take it from the artifact, and refuse
another model by name before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models
from _pipeline_fakes import ITEMS, hash_judges

from abstain_guard import GuardArtifact
from abstain_guard.calibration.building import pipeline
from abstain_guard.calibration.measure import held_out
from abstain_guard.cli import serve as serve_cli
from abstain_guard.cli.commands import build_parser, run
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.contract.model_names import ModelName, recorded_model_name
from abstain_guard.errors import ArtifactMismatchError, ModelNotFoundError


def save_tiny_folder(folder: Path, seed: int = 0) -> Path:
    """A tiny random-weight Llama and its character tokenizer, saved as a HF folder (with
    room for calibrate's prompt overhead in its context window)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "CONTEXT", 512)
        tiny_models.tiny_hf_model("llama", seed).save_pretrained(folder)
    tiny_models.char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("model_option")
    folder = save_tiny_folder(tmp / "tiny-llama")
    data = tmp / "questions.jsonl"
    rows = [{"id": it.id, "question": it.question, "answer": it.answers[0]} for it in ITEMS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = tmp / "calibration.yaml"
    config.write_text("participation: 0.5\n", encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "build_judges", hash_judges)
        argv = ["calibrate", "--data", str(data), "--out", str(tmp / "guard"), "--quiet"]
        argv += ["--model", str(folder), "--device", "cpu", "--scorer", "perplexity"]
        argv += ["--max-new-tokens", "6", "--system-prompt", "Answer.", "--config"]
        assert run([*argv, str(config)]) == 0
    return tmp, folder, tmp / "guard"


def test_calibrate_records_the_named_model(calibrated: tuple[Path, Path, Path]) -> None:
    _, folder, guard = calibrated
    art = GuardArtifact.load(guard)
    config = art.metadata["config"]
    assert recorded_model_name(config) == ModelName(str(folder))
    assert (config["device"], config["dtype"]) == ("cpu", "float32")
    record = DeploymentRecord.from_metadata(art.metadata)
    assert record is not None and record.decoding["dtype"] == "float32"
    assert record.chat_template_sha256 is not None  # the folder's own chat template


def test_evaluate_takes_the_model_from_the_artifact(
    calibrated: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, folder, guard = calibrated
    monkeypatch.setattr(held_out, "build_judges", hash_judges)
    base = ["evaluate", "--artifact", str(guard), "--baselines", "none", "--quiet"]
    assert run([*base, "--out", str(tmp / "report")]) == 0
    results = json.loads((tmp / "report" / "results.json").read_text())
    assert results["datasets"]
    assert run([*base, "--out", str(tmp / "report2"), "--model", str(folder)]) == 0
    other = save_tiny_folder(tmp / "other-llama", seed=1)
    with pytest.raises(ArtifactMismatchError, match=f"--model {other} is not the model"):
        run([*base, "--out", str(tmp / "report3"), "--model", str(other)])
    assert not (tmp / "report3").exists()  # refused before anything ran
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        run([*base, "--out", str(tmp / "report3"), "--model", str(tmp / "misspelt")])


def test_serve_takes_the_model_from_the_artifact(calibrated: tuple[Path, Path, Path]) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from abstain_guard.serve.app import create_app

    _, folder, guard = calibrated
    for extra in ([], ["--model", str(folder), "--device", "cpu"]):
        args = build_parser().parse_args(["serve", "--artifact", str(guard), *extra])
        service = serve_cli._guard_service(args)
        assert service.chat_model.fingerprint == service.guard.artifact.model_fingerprint
        with TestClient(create_app(service)) as client:
            reply = client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi?"}]}
            )
        assert reply.status_code == 200, reply.text
    args = build_parser().parse_args(["serve", "--artifact", str(guard), "--model", "default"])
    with pytest.raises(ArtifactMismatchError, match=f"--model default is not.*\\({folder}\\)"):
        serve_cli._guard_service(args)
