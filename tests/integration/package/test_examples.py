"""Every example runs offline on the embedded default model (one model per session)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from langchain_core.messages import AIMessage

from abstain_guard import GuardConfig

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

pytestmark = pytest.mark.model


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ABSTAIN = GuardConfig().abstain_message


def _consistent(info: dict) -> None:
    """A decision abstains exactly when its score is above its threshold."""
    assert set(info) >= {"abstained", "score", "threshold", "scorer", "mode", "target"}
    assert info["abstained"] == (info["score"] > info["threshold"])


def test_lcel_chain(default_model) -> None:
    module = _load("lcel_chain")
    answers = module.main(default_model)
    assert len(answers) == len(module.QUESTIONS)
    assert all(isinstance(a, str) and a for a in answers)
    # the chain runs through the guard: at participation 0.5 it withholds some answers
    # (the abstention message) and passes others through
    assert ABSTAIN in answers
    assert any(a != ABSTAIN for a in answers)


def test_risk_target_yaml(default_model) -> None:
    out = _load("risk_target_yaml").main(default_model)
    rule = out["rule"]
    assert rule.mode == "risk"
    # the YAML's 0.3, or the smallest target the shipped calibration set certifies
    assert rule.target == pytest.approx(out["config"].risk_target)
    assert rule.target >= 0.3
    assert rule.guarantee.feasible and rule.threshold > float("-inf")
    for info in out["decisions"].values():
        assert info["mode"] == "risk"
        _consistent(info)


def test_trace_abstentions(default_model) -> None:
    seen = _load("trace_abstentions").main(default_model)
    assert len(seen["callback"]) == 2
    assert len(seen["events"]) == 1
    for d in seen["callback"] + seen["events"]:
        _consistent(d)
    # the handler sees an answer (Germany) and an abstention (Nauru), in either order
    assert sorted(d["abstained"] for d in seen["callback"]) == [False, True]


def test_agent_middleware(default_model) -> None:
    finals = _load("agent_middleware").main(default_model)
    assert len(finals) == 2
    for msg in finals:
        assert isinstance(msg, AIMessage)
        info = msg.response_metadata["abstention"]
        _consistent(info)
        assert (msg.content == ABSTAIN) == info["abstained"]
    # the middleware ends one run with an answer and the other with an abstention
    assert sorted(m.response_metadata["abstention"]["abstained"] for m in finals) == [False, True]


def test_api_model_perplexity(default_model) -> None:
    msgs = _load("api_model_perplexity").main(default_model, n_questions=16)
    assert len(msgs) == 2
    for msg in msgs:
        info = msg.response_metadata["abstention"]
        assert info["scorer"] == "perplexity"
        _consistent(info)
        assert (msg.content == ABSTAIN) == info["abstained"]
        assert "geometry" not in (msg.response_metadata.get("withheld_response") or {}).get(
            "response_metadata", {}
        )
