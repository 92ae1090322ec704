"""``calibrate --model <file.gguf> --device cpu --dtype bfloat16`` on the embedded SmolLM2
GGUF: the artifact records the file, device and dtype; evaluate and serve load the model
from the artifact, in bfloat16, and the guard answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _pipeline_fakes import ITEMS, hash_judges

from abstain_guard import GuardArtifact
from abstain_guard.adapters.model.loading import DEFAULT_GGUF, default_model_path
from abstain_guard.calibration.building import pipeline
from abstain_guard.calibration.measure import held_out
from abstain_guard.cli import serve as serve_cli
from abstain_guard.cli.commands import build_parser, run
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.contract.model_names import ModelName, recorded_model_name

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_calibrate_a_gguf_file_in_bfloat16_then_evaluate_and_serve_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = default_model_path() / DEFAULT_GGUF
    data = tmp_path / "questions.jsonl"
    rows = [{"id": it.id, "question": it.question, "answer": it.answers[0]} for it in ITEMS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = tmp_path / "calibration.yaml"
    config.write_text("participation: 0.5\n", encoding="utf-8")
    monkeypatch.setattr(pipeline, "build_judges", hash_judges)
    monkeypatch.setattr(held_out, "build_judges", hash_judges)
    guard = tmp_path / "guard"
    argv = ["calibrate", "--data", str(data), "--out", str(guard), "--config", str(config)]
    argv += ["--model", str(gguf), "--device", "cpu", "--dtype", "bfloat16", "--quiet"]
    assert run([*argv, "--scorer", "perplexity", "--max-new-tokens", "4"]) == 0

    art = GuardArtifact.load(guard)
    config_record = art.metadata["config"]
    assert recorded_model_name(config_record) == ModelName(str(gguf.parent), DEFAULT_GGUF)
    assert (config_record["device"], config_record["dtype"]) == ("cpu", "bfloat16")
    record = DeploymentRecord.from_metadata(art.metadata)
    assert record is not None and record.decoding["dtype"] == "bfloat16"

    report = tmp_path / "report"
    evaluate = ["evaluate", "--artifact", str(guard), "--out", str(report), "--quiet"]
    assert run([*evaluate, "--baselines", "none"]) == 0
    assert json.loads((report / "results.json").read_text())["datasets"]

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from abstain_guard.serve.app import create_app

    service = serve_cli._guard_service(
        build_parser().parse_args(["serve", "--artifact", str(guard)])
    )
    assert str(service.chat_model.hf_model.dtype) == "torch.bfloat16"
    assert service.chat_model.fingerprint == art.model_fingerprint
    with TestClient(create_app(service)) as client:
        reply = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        )
    assert reply.status_code == 200, reply.text
