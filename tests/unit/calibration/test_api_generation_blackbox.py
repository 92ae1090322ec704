"""Calibration answers for a black-box scorer from a chat model that returns text only: asked
through the scorer's own ``prepare`` (k samples per question, stored with the answer under
the plan they follow), accepted without logprobs because the scorer's class reads only the
samples; a logprob scorer on the same model is still refused. The config, the evaluate
baselines and the stripped endpoint's body rewriting, with no model loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _text_only_server import strip_logprobs
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import Field

from abstain_guard.calibration.building.answering.api_generation import (
    API_METADATA,
    generate_api_answers,
    needs_token_logprobs,
)
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.building.run.calibration_config import (
    BLACKBOX_SCORERS,
    CalibrationConfig,
)
from abstain_guard.calibration.building.run.store import RunStore
from abstain_guard.calibration.measure.baselines import (
    BLACKBOX_BASELINES,
    baseline_params,
    parse_baselines,
)
from abstain_guard.errors import ConfigError, LogprobsMissingError
from abstain_guard.scorers import BlackBoxScorer, build_scorer

ITEMS = list(builtin_probe_set(relations=("capital",)))[:5]
SPEC = {"class_path": "langchain_openai:ChatOpenAI", "kwargs": {"model": "m", "base_url": "u"}}


class TextOnly(BaseChatModel):
    """Answers ``answers`` in turn, with no logprobs; logs each call's temperature."""

    temperature: float = 0.0
    answers: list[str] = Field(default_factory=lambda: ["Paris", "Lyon", "Paris"])
    calls: list[float] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "text-only"

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        self.calls.append(self.temperature)
        text = self.answers[(len(self.calls) - 1) % len(self.answers)]
        msg = AIMessage(content=text, response_metadata={"finish_reason": "stop"})
        return ChatResult(generations=[ChatGeneration(message=msg)])


def _config(scorer: str, **params: Any) -> CalibrationConfig:
    return CalibrationConfig(model=SPEC, scorer=scorer, scorer_params=params, batch_size=2)


def test_which_scorers_take_text_only_answers_is_their_declaration() -> None:
    assert {k for k in BLACKBOX_SCORERS if not needs_token_logprobs(k)} == set(BLACKBOX_SCORERS)
    assert needs_token_logprobs("perplexity") and needs_token_logprobs("probe_mid")
    assert "samples" in API_METADATA


def test_a_blackbox_scorer_asks_k_samples_and_stores_them(tmp_path: Path) -> None:
    model = TextOnly()
    store = RunStore(tmp_path / "run.sqlite")
    cfg = _config("num_semantic_sets", num_samples=3, temperature=0.9)
    rows = generate_api_answers(model, ITEMS, store, cfg, fingerprint="fp")
    assert model.calls == [0.9] * (3 * len(ITEMS))  # k samples per question, at the plan's T
    for it in ITEMS:
        meta = rows[it.id]["metadata"]
        block = meta["samples"]
        assert "logprobs" not in meta and len(block["texts"]) == 3
        assert block["plan"]["num_samples"] == 3 and block["plan"]["temperature"] == 0.9
        assert rows[it.id]["text"] == block["texts"][block["primary_index"]]
    # asked again: read from the cache; another plan is other answers
    generate_api_answers(model, ITEMS, store, cfg, fingerprint="fp")
    assert len(model.calls) == 3 * len(ITEMS)
    other = _config("num_semantic_sets", num_samples=4, temperature=0.9)
    again = generate_api_answers(model, ITEMS, store, other, fingerprint="fp")
    assert len(model.calls) == 7 * len(ITEMS)
    assert all(len(again[it.id]["metadata"]["samples"]["texts"]) == 4 for it in ITEMS)


def test_a_logprob_scorer_still_refuses_text_only_answers(tmp_path: Path) -> None:
    with pytest.raises(LogprobsMissingError, match="black-box scorer"):
        generate_api_answers(
            TextOnly(),
            ITEMS,
            RunStore(tmp_path / "r.sqlite"),
            _config("perplexity"),
            fingerprint="f",
        )


def test_the_config_takes_blackbox_scorers_on_chat_models_only() -> None:
    for kind in BLACKBOX_SCORERS:
        assert _config(kind).scorer == kind
    with pytest.raises(ConfigError, match="samples a LangChain chat model"):
        CalibrationConfig(scorer="eigv")  # the embedded model
    with pytest.raises(ConfigError, match="name the scorer"):
        CalibrationConfig(
            model=SPEC, scorer="auto", candidates=("eigv", "perplexity"), risk_target=0.3
        )


def test_blackbox_baselines_score_the_artifacts_own_samples() -> None:
    assert parse_baselines("blackbox") == list(BLACKBOX_BASELINES)
    assert not set(BLACKBOX_BASELINES) & set(parse_baselines("all"))
    assert parse_baselines("perplexity,eigv") == ["perplexity", "eigv"]
    own = BlackBoxScorer("eigv", num_samples=4, temperature=0.5, primary="first")
    params = baseline_params("degree", own)
    assert params["num_samples"] == 4 and params["temperature"] == 0.5
    assert params["similarity"] is own.similarity
    degree = build_scorer("degree", **params)
    assert degree.plan.record() == own.plan.record()  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="draws none"):
        baseline_params("degree", build_scorer("perplexity"))
    assert baseline_params("semantic_entropy", own) == {"judge": "similarity"}


def test_the_stripped_endpoint_drops_logprobs_from_json_and_events() -> None:
    body = {"choices": [{"message": {"content": "Paris"}, "logprobs": {"content": [1]}}]}
    assert json.loads(strip_logprobs(json.dumps(body).encode()))["choices"][0]["logprobs"] is None
    events = f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
    stripped = strip_logprobs(events).decode().split("\n")
    assert json.loads(stripped[0].removeprefix("data: "))["choices"][0]["logprobs"] is None
    assert stripped[2] == "data: [DONE]"


def test_calibrate_takes_and_lists_the_blackbox_kinds() -> None:
    from abstain_guard.cli.calibrate import config_overrides
    from abstain_guard.cli.commands import build_parser

    parser = build_parser()
    args = parser.parse_args(["calibrate", "--data", "d", "--out", "o", "--scorer", "eigv"])
    given = {k: v for k, v in config_overrides(args).items() if v is not None}
    assert CalibrationConfig(model=SPEC, **given).scorer == "eigv"
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    text = " ".join(sub.choices["calibrate"].format_help().split())
    assert all(kind in text for kind in BLACKBOX_SCORERS)
    evaluate_help = " ".join(sub.choices["evaluate"].format_help().split())
    assert "'blackbox'" in evaluate_help
