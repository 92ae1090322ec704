"""``calibrate --agent`` on an API chat model: ``ChatOpenAI`` against ``abstain-guard serve
--no-guard`` (the embedded model behind the OpenAI endpoint, tools and logprobs on), the
country agent calibrated as deployed with a perplexity scorer, then deployed around the same
``ChatOpenAI`` with ``AbstentionMiddleware``: the live scores are the stored ones."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage

from abstain_guard import AbstentionMiddleware, GuardArtifact, GuardConfig
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.runner import ServerThread

pytestmark = [pytest.mark.model, pytest.mark.slow]

pytest.importorskip("langchain_openai")

ROOT = Path(__file__).resolve().parents[3]
ITEMS = builtin_probe_set(relations=("capital", "currency", "continent"))[:8]


@pytest.fixture(scope="module")
def server(default_model: Any) -> Any:
    with ServerThread(ModelService(default_model, model_name="smollm2", max_tokens=64)) as srv:
        yield srv


@pytest.fixture(scope="module")
def example() -> Any:
    sys.path.insert(0, str(ROOT))
    from examples import country_agent

    return country_agent


def test_an_api_model_agent_calibrates_and_deploys_with_live_equal_to_stored(
    server: Any, example: Any, tmp_path: Path
) -> None:
    spec = {
        "class_path": "langchain_openai:ChatOpenAI",
        "kwargs": {
            "model": "smollm2",
            "base_url": server.base_url,
            "api_key": "unused",
            "max_retries": 0,
            "max_tokens": 32,
        },
    }
    config = CalibrationConfig(
        model=spec,
        agent="examples.country_agent:build_forced_agent",
        agent_step_limit=6,
        scorer="perplexity",
        ratios=(1, 1, 4, 2),
        participation=0.5,
        cache_dir=str(tmp_path / "run.cache"),
    )
    calibrate(ITEMS, tmp_path / "guard", config=config, progress=False)
    art = GuardArtifact.load(tmp_path / "guard")
    record = DeploymentRecord.from_metadata(art.metadata)
    assert record is not None and record.agent is not None and record.chat_model is not None
    assert record.agent.tool_call_format is None  # the provider parses the calls
    assert [t["function"]["name"] for t in record.tools or []] == ["country_facts"]
    assert record.prompts["open"].max_new_tokens == 32
    assert record.agent.runs["tool_calls"]["runs_with_a_call"] >= 1

    chat = config.model.build()  # type: ignore[union-attr]
    guard = AbstentionMiddleware(art, config=GuardConfig(participation=0.5))
    agent = example.build_forced_agent(chat, middleware=[guard])
    by_id = {it.id: it for it in ITEMS}
    stored = dict(zip(art.metadata["calibration_ids"], art.scores.tolist(), strict=True))
    steps = []
    # the runs at once, as a served agent takes them (LangGraph's batch: one thread per run)
    states = agent.batch(
        [{"messages": [HumanMessage(by_id[item_id].prompt_text())]} for item_id in stored]
    )
    for score, state in zip(stored.values(), states, strict=True):
        decision = state["messages"][-1].response_metadata["abstention"]
        assert decision["score"] == pytest.approx(score, abs=1e-6)
        steps.append(decision["tool_steps"])
    assert len(steps) == len(stored)
    # a forced call whose arguments do not validate against the tool's schema is no call
    # (the server does not pass it on), so that run has no tool step, live as in calibration
    assert any(n >= 1 for n in steps), steps
