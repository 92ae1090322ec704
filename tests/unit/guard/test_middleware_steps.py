"""Step gating in a real LangChain v1 agent (``create_agent``) with a scripted model: every
model call decided on the run's running maximum, a stopped call's tools never run, and
where a stopped run goes (end, a human through ``interrupt``, a fallback model or agent)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _core_fakes import QueueChatModel
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from abstain_guard import AbstentionMiddleware, GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.contract.deployment import AgentRecord, DeploymentRecord, PromptRecord
from abstain_guard.errors import ArtifactMismatchError, ConfigError
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.scorers import PerplexityScorer

CONFIDENT = [-0.01, -0.02]  # perplexity ~1.02: under τ
UNSURE = [-2.0, -2.5]  # perplexity ~9.5: over τ
LOOKUPS: list[str] = []


@tool
def capital_lookup(country: str) -> str:
    """Look up the capital of a country."""
    LOOKUPS.append(country)
    return {"Peru": "Lima", "Chad": "N'Djamena"}.get(country, "unknown")


def _artifact(**agent: Any) -> GuardArtifact:
    rng = np.random.default_rng(0)
    scores = rng.uniform(1.0, 3.0, size=300)
    correct = rng.uniform(size=300) > (scores - 1.0) / 2.0
    record = DeploymentRecord(
        model_fingerprint="m-1",
        prompts={"open": PromptRecord(system_prompt=None, max_new_tokens=48)},
        tools=[convert_to_openai_tool(capital_lookup)],
        agent=AgentRecord(
            **{"factory": "tests:agent", "step_limit": 12, "gating": "steps", **agent}
        ),
    )
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(scores, correct),
        model_fingerprint="m-1",
        metadata={"deployment": record.to_json()},
    )


def _call(country: str, n: int = 1) -> dict[str, Any]:
    return {"name": "capital_lookup", "args": {"country": country}, "id": f"call-{n}"}


def _run(queue: list[Any], mw: AbstentionMiddleware, **kw: Any) -> tuple[dict[str, Any], Any]:
    LOOKUPS.clear()
    model = QueueChatModel(queue=queue, fingerprint="m-1")
    agent = create_agent(model, tools=[capital_lookup], middleware=[mw], **kw)
    return agent, model


def _warn(**cfg: Any) -> GuardConfig:
    # the scripted model records no generation settings: those checks warn, not refuse
    return GuardConfig(on_mismatch="warn", **cfg)


def test_an_unsure_tool_call_is_stopped_before_its_tool_runs() -> None:
    mw = AbstentionMiddleware(_artifact(), config=_warn())
    agent, model = _run([("", UNSURE, [_call("Pepón")]), ("Lima.", CONFIDENT, [])], mw)
    messages = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})["messages"]
    assert LOOKUPS == []  # the tool never ran
    assert model.calls == 1
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert final.content == "I don't know."
    decision = final.response_metadata["abstention"]
    assert decision["step"] == 0 and decision["gating"] == "steps"
    assert decision["step_score"] == decision["run_statistic"] > decision["threshold"]
    assert decision["tool_calls"] == ["capital_lookup"] and decision["action"] == "end"
    withheld = final.response_metadata["withheld_response"]
    assert withheld["tool_calls"][0]["args"] == {"country": "Pepón"}


def test_every_call_is_decided_on_the_running_maximum() -> None:
    mw = AbstentionMiddleware(_artifact(), config=_warn(participation=0.8))
    tau = mw.policy.rule.threshold
    middling = [-0.6, -0.7]  # perplexity ~1.9: under τ, above the confident answer's
    assert np.exp(0.65) < tau
    agent, _ = _run([("", middling, [_call("Peru")]), ("Lima.", CONFIDENT, [])], mw)
    messages = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})["messages"]
    assert LOOKUPS == ["Peru"]
    step0 = messages[1].response_metadata["abstention"]
    assert messages[1].tool_calls and step0["abstained"] is False and step0["step"] == 0
    assert isinstance(messages[2], ToolMessage)
    final = messages[-1].response_metadata["abstention"]
    assert final["step"] == 1 and final["step_score"] < step0["step_score"]
    assert final["run_statistic"] == pytest.approx(step0["step_score"])  # max, not the last
    assert final["abstained"] is False and final["tool_steps"] == 1


def test_a_final_answer_after_a_tool_step_count_calibration_never_saw_is_refused() -> None:
    # final-answer gating: refused (on_mismatch="raise") before the answer is decided
    art = _artifact(tool_steps={"1": 40}, gating="final_answer")
    agent, _ = _run([("Lima.", CONFIDENT, [])], AbstentionMiddleware(art))
    with pytest.raises(ArtifactMismatchError, match="after 0 tool step"):
        agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})
    agent, _ = _run([("Lima.", CONFIDENT, [])], AbstentionMiddleware(art, config=_warn()))
    final = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})["messages"][-1]
    notes = final.response_metadata["abstention"]["guarantee"]["warnings"]
    assert any("after 0 tool step" in n for n in notes)


def test_a_call_with_another_tool_choice_than_calibrated_is_refused() -> None:
    art = _artifact(call_tool_choices={"0": ["capital_lookup"], "1": [None]})
    agent, _ = _run([("Lima.", CONFIDENT, [])], AbstentionMiddleware(art, config=_warn()))
    final = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})["messages"][-1]
    notes = final.response_metadata["abstention"]["guarantee"]["warnings"]
    assert any("model call 1 of the run has tool_choice='auto'" in n for n in notes)


def _interrupting() -> tuple[Any, Any, AbstentionMiddleware]:
    mw = AbstentionMiddleware(_artifact(), config=_warn(on_abstain="interrupt"))
    agent, model = _run(
        [("", UNSURE, [_call("Pepón")]), ("Lima.", CONFIDENT, [])],
        mw,
        checkpointer=InMemorySaver(),
    )
    return agent, model, mw


def test_interrupt_shows_the_pending_call_with_its_score_and_an_approval_runs_it() -> None:
    agent, _, _ = _interrupting()
    config = {"configurable": {"thread_id": "t-approve"}}
    first = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]}, config=config)
    [pending] = first["__interrupt__"]
    request = pending.value
    assert LOOKUPS == []
    assert request["action_requests"][0]["name"] == "capital_lookup"
    assert request["action_requests"][0]["args"] == {"country": "Pepón"}
    assert "> τ" in request["action_requests"][0]["description"]
    assert request["abstention"]["step_score"] > request["abstention"]["threshold"]
    done = agent.invoke(Command(resume={"decisions": [{"type": "approve"}]}), config=config)
    assert LOOKUPS == ["Pepón"]  # the human approved the call as written
    approved = done["messages"][1].response_metadata["abstention"]
    assert approved["action"] == "approved" and approved["certified"] is False
    final = done["messages"][-1].response_metadata["abstention"]
    assert final["certified"] is False and final["continued_by"] == "approved"


def test_interrupt_edit_runs_the_edited_call_and_reject_ends_the_run() -> None:
    agent, _, _ = _interrupting()
    config = {"configurable": {"thread_id": "t-edit"}}
    agent.invoke({"messages": [HumanMessage("Capital of Peru?")]}, config=config)
    edit = {
        "type": "edit",
        "edited_action": {"name": "capital_lookup", "args": {"country": "Peru"}},
    }
    done = agent.invoke(Command(resume={"decisions": [edit]}), config=config)
    assert LOOKUPS == ["Peru"]
    assert done["messages"][2].content == "Lima"

    agent, model, _ = _interrupting()
    config = {"configurable": {"thread_id": "t-reject"}}
    agent.invoke({"messages": [HumanMessage("Capital of Peru?")]}, config=config)
    done = agent.invoke(Command(resume={"decisions": [{"type": "reject"}]}), config=config)
    assert LOOKUPS == [] and model.calls == 1
    assert done["messages"][-1].content == "I don't know."
    assert done["messages"][-1].response_metadata["abstention"]["review"] == "rejected"


def test_a_fallback_model_does_the_rest_of_a_stopped_run_and_the_monitor_counts_it() -> None:
    art = _artifact()
    fallback = QueueChatModel(
        queue=[("", UNSURE, [_call("Peru", 2)]), ("The capital is Lima.", UNSURE, [])]
    )
    monitor = GuardMonitor()
    mw = AbstentionMiddleware(
        art, config=_warn(on_abstain="fallback"), fallback=fallback, monitor=monitor
    )
    agent, model = _run([("", UNSURE, [_call("Pepón")])], mw)
    messages = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})["messages"]
    assert LOOKUPS == ["Peru"]  # the fallback's call ran (ungated), the stopped one did not
    assert model.calls == 1 and fallback.calls == 2
    assert messages[-1].content == "The capital is Lima."
    assert all("Pepón" not in str(m.tool_calls) for m in messages if isinstance(m, AIMessage))
    state = monitor.state()
    assert state["decisions"] == 1 and state["handed_off"] == {"interrupt": 0, "fallback": 1}


def test_a_fallback_agent_answers_from_the_messages_before_the_stopped_call() -> None:
    helper = create_agent(
        QueueChatModel(queue=[("Lima, from the fallback agent.", CONFIDENT, [])]),
        tools=[capital_lookup],
    )
    mw = AbstentionMiddleware(_artifact(), config=_warn(on_abstain="fallback"), fallback=helper)
    agent, _ = _run([("", UNSURE, [_call("Pepón")])], mw)
    messages = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})["messages"]
    assert LOOKUPS == []
    assert [type(m).__name__ for m in messages] == ["HumanMessage", "AIMessage"]
    assert messages[-1].content == "Lima, from the fallback agent."


def test_fallback_without_a_fallback_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="needs a fallback"):
        AbstentionMiddleware(_artifact(), config=GuardConfig(on_abstain="fallback"))


def test_the_trace_records_the_step_the_score_tau_and_the_action() -> None:
    from langchain_core.callbacks import BaseCallbackHandler

    from abstain_guard.guarantee.decision import Decision
    from abstain_guard.guard.tracing import otel_attributes

    events: list[Any] = []

    class Events(BaseCallbackHandler):
        def on_custom_event(self, name: str, data: Any, **kw: Any) -> None:
            events.append(data)

    mw = AbstentionMiddleware(_artifact(), config=_warn())
    agent, _ = _run([("", UNSURE, [_call("Pepón")])], mw)
    agent.invoke({"messages": [HumanMessage("Capital of Peru?")]}, config={"callbacks": [Events()]})
    (decision,) = events
    assert decision["step"] == 0 and decision["action"] == "end" and decision["abstained"]
    attrs = otel_attributes(Decision.from_dict(decision))
    assert attrs["abstain_guard.step"] == 0 and attrs["abstain_guard.action"] == "end"
    assert attrs["abstain_guard.step_score"] > attrs["abstain_guard.threshold"]
    assert attrs["abstain_guard.certified"] is True


# --- issue 46: the fallback per turn, continued runs marked, the tool-step check -----------


class _Events:
    """The decisions a run traced (``record_decision``'s custom callback events)."""

    def __init__(self) -> None:
        from langchain_core.callbacks import BaseCallbackHandler

        seen: list[dict[str, Any]] = []

        class Handler(BaseCallbackHandler):
            def on_custom_event(self, name: str, data: Any, **kw: Any) -> None:
                seen.append(dict(data))

        self.decisions = seen
        self.handler = Handler()


def _fallback_mw(**kw: Any) -> tuple[AbstentionMiddleware, QueueChatModel]:
    fallback = QueueChatModel(
        queue=[("", UNSURE, [_call("Peru", 2)]), ("The capital is Lima.", UNSURE, [])]
    )
    mw = AbstentionMiddleware(
        _artifact(), config=_warn(on_abstain="fallback"), fallback=fallback, **kw
    )
    return mw, fallback


def test_abstention_fallback_in_the_input_does_not_switch_the_guard_off() -> None:
    mw = AbstentionMiddleware(_artifact(), config=_warn())
    agent, model = _run([("", UNSURE, [_call("Pepón")]), ("Lima.", CONFIDENT, [])], mw)
    out = agent.invoke(
        {"messages": [HumanMessage("Capital of Peru?")], "abstention_fallback": True}
    )
    assert LOOKUPS == [] and model.calls == 1  # decided and stopped, the tool never ran
    assert out["messages"][-1].response_metadata["abstention"]["abstained"] is True
    assert "abstention_fallback" not in out  # private: neither read from input nor returned

    mw, fallback = _fallback_mw()
    agent, model = _run([("", UNSURE, [_call("Pepón")])], mw)
    agent.invoke({"messages": [HumanMessage("Capital of Peru?")], "abstention_fallback": True})
    assert model.calls == 1  # the agent's own model made the first call, and it was gated
    assert "Pepón" not in LOOKUPS and fallback.calls == 2


def test_a_checkpointed_thread_is_gated_again_after_a_fallback_took_a_turn_over() -> None:
    monitor = GuardMonitor()
    mw, fallback = _fallback_mw(monitor=monitor)
    agent, model = _run([("", UNSURE, [_call("Pepón")])], mw, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t-fallback"}}
    first = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]}, config=config)
    assert first["messages"][-1].content == "The capital is Lima."
    assert model.calls == 1 and fallback.calls == 2
    second = agent.invoke({"messages": [HumanMessage("Capital of Chad?")]}, config=config)
    assert model.calls == 2  # the next question went to the agent's model and was gated
    assert fallback.calls == 3  # ... which was stopped again and handed to the fallback
    assert LOOKUPS.count("Pepón") == 0
    turn = second["messages"][len(first["messages"]) :]
    assert turn[-1].response_metadata["abstention"]["continued_by"] == "fallback"
    state = monitor.state()
    assert state["decisions"] == 2 and state["handed_off"] == {"interrupt": 0, "fallback": 2}


def test_a_fallback_models_messages_and_decisions_are_marked_uncertified() -> None:
    events = _Events()
    mw, _ = _fallback_mw()
    agent, _ = _run([("", UNSURE, [_call("Pepón")])], mw)
    out = agent.invoke(
        {"messages": [HumanMessage("Capital of Peru?")]}, config={"callbacks": [events.handler]}
    )
    made = [m for m in out["messages"] if isinstance(m, AIMessage)]
    assert len(made) == 2  # the fallback's call and answer (the stopped call was removed)
    for m in made:
        info = m.response_metadata["abstention"]
        assert info["certified"] is False and info["continued_by"] == "fallback"
        assert info["stopped"]["run_statistic"] > info["threshold"]
    stop, *rest = events.decisions
    assert stop["abstained"] is True and stop["action"] == "fallback"
    assert len(rest) == 2
    for decision in (stop, *rest):
        assert decision["certified"] is False and decision["continued_by"] == "fallback"


def test_a_fallback_agents_messages_are_marked_uncertified() -> None:
    helper = create_agent(
        QueueChatModel(queue=[("Lima, from the fallback agent.", CONFIDENT, [])]),
        tools=[capital_lookup],
    )
    mw = AbstentionMiddleware(_artifact(), config=_warn(on_abstain="fallback"), fallback=helper)
    agent, _ = _run([("", UNSURE, [_call("Pepón")])], mw)
    final = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})["messages"][-1]
    info = final.response_metadata["abstention"]
    assert info["certified"] is False and info["continued_by"] == "fallback"


def test_a_reviewed_run_is_traced_uncertified_and_a_rejection_is_not_handed_off() -> None:
    edit = {
        "type": "edit",
        "edited_action": {"name": "capital_lookup", "args": {"country": "Peru"}},
    }
    for decision_type, review in (("approve", "approved"), (edit, "edited")):
        events, monitor = _Events(), GuardMonitor()
        mw = AbstentionMiddleware(
            _artifact(), config=_warn(on_abstain="interrupt"), monitor=monitor
        )
        agent, _ = _run(
            [("", UNSURE, [_call("Pepón")]), ("Lima.", CONFIDENT, [])],
            mw,
            checkpointer=InMemorySaver(),
        )
        config = {"configurable": {"thread_id": f"t-{review}"}, "callbacks": [events.handler]}
        agent.invoke({"messages": [HumanMessage("Capital of Peru?")]}, config=config)
        answer = decision_type if isinstance(decision_type, dict) else {"type": decision_type}
        done = agent.invoke(Command(resume={"decisions": [answer]}), config=config)
        assert len(events.decisions) == 2  # the reviewed step and the final answer
        for decision in events.decisions:
            assert decision["certified"] is False and decision["continued_by"] == review
        for m in done["messages"][1:]:
            if isinstance(m, AIMessage):
                info = m.response_metadata["abstention"]
                assert info["certified"] is False and info["continued_by"] == review
        assert monitor.state()["handed_off"] == {"interrupt": 1, "fallback": 0}

    monitor = GuardMonitor()
    mw = AbstentionMiddleware(_artifact(), config=_warn(on_abstain="interrupt"), monitor=monitor)
    agent, _ = _run([("", UNSURE, [_call("Pepón")])], mw, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t-rejected"}}
    agent.invoke({"messages": [HumanMessage("Capital of Peru?")]}, config=config)
    done = agent.invoke(Command(resume={"decisions": [{"type": "reject"}]}), config=config)
    assert done["messages"][-1].response_metadata["abstention"]["certified"] is True
    state = monitor.state()
    assert state["decisions"] == 1 and state["handed_off"] == {"interrupt": 0, "fallback": 0}


def test_under_step_gating_an_uncalibrated_tool_step_count_is_a_warning_not_a_refusal() -> None:
    # on_mismatch="raise" (the default): the tools already ran; refusing now would remove a run
    # that the certificate (calibrated on whole runs, gated on the running maximum) accepts
    mw = AbstentionMiddleware(_artifact(tool_steps={"2": 40, "3": 5}))
    assert mw.config.on_mismatch == "raise"
    (warning,) = mw.check_tool_steps(1)
    assert warning.startswith("agent run: this final answer came after 1 tool step(s)")
    assert "between 2 and 3" in warning
    assert mw.check_tool_steps(2) == mw.check_tool_steps(3) == []
    # the same count with final-answer gating (nothing ran on the guard's word) is refused
    final_only = AbstentionMiddleware(_artifact(tool_steps={"2": 40}, gating="final_answer"))
    with pytest.raises(ArtifactMismatchError, match="after 1 tool step"):
        final_only.check_tool_steps(1)

    agent, _ = _run(
        [("", CONFIDENT, [_call("Peru")]), ("Lima.", CONFIDENT, [])],
        AbstentionMiddleware(_artifact(tool_steps={"2": 40, "3": 5}), config=_warn()),
    )
    final = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})["messages"][-1]
    decision = final.response_metadata["abstention"]
    assert final.content == "Lima." and decision["abstained"] is False
    (warning,) = [n for n in decision["guarantee"]["warnings"] if "tool step" in n]
    assert "after 1 tool step(s)" in warning


def test_the_tool_step_check_compares_with_the_range_calibration_saw() -> None:
    # calibration's final answers came after 0 or 2 tool steps: 1 lies inside that range
    agent, _ = _run(
        [("", CONFIDENT, [_call("Peru")]), ("Lima.", CONFIDENT, [])],
        AbstentionMiddleware(_artifact(tool_steps={"0": 30, "2": 10}), config=_warn()),
    )
    final = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})["messages"][-1]
    decision = final.response_metadata["abstention"]
    assert decision["abstained"] is False
    assert not any("tool step" in n for n in decision["guarantee"].get("warnings", []))
