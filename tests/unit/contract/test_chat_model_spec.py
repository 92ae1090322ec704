"""API chat models in calibration configs, without a model or a server: the spec and its
errors, secrets never written, the identity and fingerprint of a built model, the deployed
model's check, preflight's refusals and the ``serve --no-guard`` flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.cli.commands import run
from abstain_guard.contract.chat_model_specs import (
    ChatModelRecord,
    ChatModelSpec,
    chat_model_fingerprint,
    chat_model_identity,
    identity_mismatches,
    is_secret,
)
from abstain_guard.contract.deployment import (
    DeploymentRecord,
    PromptRecord,
    api_response_mismatches,
)
from abstain_guard.errors import ConfigError

langchain_openai = pytest.importorskip("langchain_openai")

SECRET = "sk-never-written-anywhere"
KWARGS = {"model": "m", "base_url": "http://127.0.0.1:9/v1", "api_key": SECRET}
SPEC = {"class_path": "langchain_openai:ChatOpenAI", "kwargs": KWARGS}


def test_secret_kwargs_are_used_but_never_serialized() -> None:
    cfg = CalibrationConfig(model=SPEC, scorer="perplexity")
    assert isinstance(cfg.model, ChatModelSpec)
    assert cfg.model.kwargs["api_key"] == SECRET  # used to build the model
    dumped = json.dumps(cfg.model_dump(mode="json"))
    assert SECRET not in dumped and '"api_key":' not in dumped
    assert '"base_url": "http://127.0.0.1:9/v1"' in dumped
    assert cfg.model.build().openai_api_key.get_secret_value() == SECRET


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("api_key", True),
        ("openai_api_key", True),
        ("access_token", True),
        ("default_headers", True),
        ("password", True),
        ("max_tokens", False),
        ("top_logprobs", False),
        ("base_url", False),
        ("model", False),
    ],
)
def test_which_kwargs_are_secret(name: str, secret: bool) -> None:
    assert is_secret(name) is secret


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ({"chat_model": "openai:m", "class_path": "a:B"}, "exactly one of"),
        ({"kwargs": {}}, "exactly one of"),
        ({"class_path": "no_colon"}, "not 'module:Class'"),
        ({"chat_model": "openai:m", "kwarg": {}}, "unknown key 'kwarg'"),
    ],
)
def test_a_malformed_spec_says_what_is_wrong(model: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        CalibrationConfig(model={**model, "kwargs": {**model.get("kwargs", {}), "key": SECRET}})


def test_a_config_error_never_quotes_a_secret() -> None:
    with pytest.raises(ConfigError) as info:
        CalibrationConfig(model={"chat_model": "openai:m", "bogus": 1, "kwargs": KWARGS})
    assert SECRET not in str(info.value) and "***" in str(info.value)


def test_the_fingerprint_is_the_class_and_settings_whatever_names_them() -> None:
    by_class = ChatModelSpec(**SPEC).build()
    no_name = {k: v for k, v in KWARGS.items() if k != "model"}
    by_name = ChatModelSpec(chat_model="openai:m", kwargs=no_name).build()
    identity = chat_model_identity(by_class)
    assert identity["class"].endswith(":ChatOpenAI")
    assert identity["settings"] == {
        "model_name": "m",
        "openai_api_base": "http://127.0.0.1:9/v1",
        "logprobs": True,  # asked for when the kwargs leave it unset
    }
    assert chat_model_fingerprint(by_name) == chat_model_fingerprint(by_class)
    other_key = ChatModelSpec(class_path=SPEC["class_path"], kwargs={**KWARGS, "api_key": "x"})
    assert chat_model_fingerprint(other_key.build()) == chat_model_fingerprint(by_class)
    hotter = ChatModelSpec(class_path=SPEC["class_path"], kwargs={**KWARGS, "temperature": 0.5})
    assert chat_model_fingerprint(hotter.build()) != chat_model_fingerprint(by_class)
    transport = ChatModelSpec(class_path=SPEC["class_path"], kwargs={**KWARGS, "timeout": 3})
    assert chat_model_fingerprint(transport.build()) == chat_model_fingerprint(by_class)


def test_the_deployed_model_is_compared_setting_by_setting() -> None:
    spec = ChatModelSpec(**SPEC)
    record = ChatModelRecord.of(spec, spec.build())
    ChatOpenAI = langchain_openai.ChatOpenAI
    same = ChatOpenAI(model="m", base_url=KWARGS["base_url"], api_key="k", logprobs=True)
    assert identity_mismatches(record, same) == []
    no_logprobs = ChatOpenAI(model="m", base_url=KWARGS["base_url"], api_key="k")
    (problem,) = identity_mismatches(record, no_logprobs)
    assert "logprobs=None (calibrated: True)" in problem
    other = ChatOpenAI(model="n", base_url=KWARGS["base_url"], api_key="k", logprobs=True)
    assert "model_name='n' (calibrated: 'm')" in identity_mismatches(record, other)[0]


def test_an_api_answer_longer_than_the_budget_is_a_mismatch() -> None:
    spec = ChatModelSpec(**SPEC)
    record = DeploymentRecord(
        prompts={"open": PromptRecord(system_prompt="S", max_new_tokens=3)},
        chat_model=ChatModelRecord.of(spec, spec.build()),
    )
    entry = {"token": "a", "logprob": -0.1}
    assert api_response_mismatches(record, {"logprobs": {"content": [entry] * 3}}) == []
    (problem,) = api_response_mismatches(record, {"logprobs": {"content": [entry] * 4}})
    assert "4 tokens" in problem and "budget was 3" in problem


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"scorer": "geometry"}, "reads geometry, which the api backend"),
        ({"scorer": "geometry_fast"}, "runs on the exact backend"),
        ({"scorer": "probe_mid"}, "reads hidden, which the api backend"),
        ({"scorer": "mean_token_entropy"}, "top_logprobs_fallback"),
        ({"scorer": "perplexity", "batch_decode": True}, "batch_decode apply to the project's"),
        ({"scorer": "perplexity", "gguf_file": "x.gguf"}, "gguf_file apply to the project's"),
        ({"scorer": "perplexity", "executor": "ray"}, "use --executor local"),
    ],
)
def test_preflight_refuses_what_an_api_model_cannot_do(
    tmp_path: Path, extra: dict, says: str
) -> None:
    cfg = CalibrationConfig(model=SPEC, limit=40, ratios=(1, 1, 4, 1), **extra)
    with pytest.raises(ConfigError, match=says):
        calibrate("builtin", tmp_path / "guard", config=cfg, progress=False)
    assert not (tmp_path / "guard").exists() and not (tmp_path / "guard.cache").exists()


def test_preflight_builds_the_api_model_and_says_why_it_cannot(tmp_path: Path) -> None:
    bad = {"class_path": "langchain_openai:NoSuchModel"}
    cfg = CalibrationConfig(model=bad, scorer="perplexity", limit=40, ratios=(1, 1, 4, 1))
    with pytest.raises(ConfigError, match="cannot be imported"):
        calibrate("builtin", tmp_path / "guard", config=cfg, progress=False)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--max-tokens", "5"], "--max-tokens: only with --no-guard"),
        (["serve", "--no-guard", "--artifact", "x"], "--artifact: not with --no-guard"),
        (["serve", "--no-guard", "--max-tokens", "0"], "--max-tokens must be a positive"),
    ],
)
def test_serve_flags_of_the_two_modes_do_not_mix(argv: list[str], says: str) -> None:
    pytest.importorskip("fastapi")
    with pytest.raises(ConfigError, match=says):
        run(argv)
