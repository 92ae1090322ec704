"""Full capture's attention-parts rule (:class:`PartsRule`): which exact strategy "auto"
picks (kept ``u`` within a memory budget, else dense up to a number of sources, sparse
beyond) changes the last bits, so it is part of the decode path; a guard deploys a local
model under the rule its artifact recorded, and an artifact recorded before the rule was
(no ``parts`` in its decode path) gets the legacy rule it was calibrated with.

Tiny random-weight model, content-hash judge (see ``test_pipeline_resume``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pipeline_fakes import ITEMS, HashJudge, _config, _judges
from langchain_core.messages import HumanMessage, SystemMessage
from tiny_models import tiny_chat_model

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.adapters.capture import source_parts
from abstain_guard.adapters.capture.parts_rule import UNRECORDED_PARTS, PartsRule
from abstain_guard.adapters.capture.session import default_parts
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.contract.deployment import DeploymentRecord, decode_path_problem
from abstain_guard.errors import ArtifactMismatchError
from abstain_guard.guard.chains import load_guard_chain

#: about 60 prompt positions of the tiny model's character tokenizer (context 96)
LONG = [SystemMessage("Rivers: A on 1, B on 2."), HumanMessage("Which river?")]


def _count_sparse(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = source_parts.sparse_numerators

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(source_parts, "sparse_numerators", counted)
    monkeypatch.setattr("abstain_guard.adapters.capture.session.sparse_numerators", counted)
    return calls


def test_the_rule_picks_the_strategy_and_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the budget, decode steps go sparse past ``dense_max_sources`` and dense below;
    both exact (close), and each response records the rule it was captured under."""
    calls = _count_sparse(monkeypatch)
    dense_rule, sparse_rule = PartsRule(0, 1 << 20), PartsRule(0, 0)
    dense = tiny_chat_model("llama", max_new_tokens=6, capture_parts=dense_rule).invoke(LONG)
    assert calls == []
    sparse = tiny_chat_model("llama", max_new_tokens=6, capture_parts=sparse_rule).invoke(LONG)
    assert calls  # every decode step over the budget went sparse
    assert dense.response_metadata["token_ids"] == sparse.response_metadata["token_ids"]
    gd, gs = dense.response_metadata["geometry"], sparse.response_metadata["geometry"]
    np.testing.assert_allclose(gd["omega"], gs["omega"], atol=1e-4)
    paths = [m.response_metadata["generation"]["decode_path"] for m in (dense, sparse)]
    assert [p["parts"] for p in paths] == [dense_rule.record(), sparse_rule.record()]
    message = decode_path_problem(paths[1], paths[0])
    assert "dense up to 0 sources" in message and f"dense up to {1 << 20} sources" in message


def test_the_legacy_rule_records_as_paths_did_before() -> None:
    model = tiny_chat_model("llama", max_new_tokens=4)
    assert model.decode_path()["parts"] == default_parts().record() != UNRECORDED_PARTS.record()
    legacy = model.with_capture_parts(None)  # a path recorded without parts
    assert legacy.capture_parts == UNRECORDED_PARTS and legacy.hf_model is model.hf_model
    assert "parts" not in legacy.decode_path()
    assert "parts" not in legacy.invoke("Hi").response_metadata["generation"]["decode_path"]
    assert model.with_capture_parts(default_parts().record()) is model  # nothing to change


@pytest.fixture(scope="module")
def legacy_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An artifact as an earlier version wrote it: calibrated under the legacy rule, its
    decode path without ``parts``."""
    tmp = tmp_path_factory.mktemp("legacy_parts")
    calibrate(
        ITEMS,
        tmp / "guard",
        config=_config(tmp, "guard", scorer="geometry").model_copy(
            update={"scorer_params": {"covariance": "oas"}}
        ),
        model=tiny_chat_model("llama", seed=0, capture_parts=UNRECORDED_PARTS),
        judges=_judges(tmp, "guard", HashJudge()),
        progress=False,
    )
    return tmp / "guard"


def test_a_guard_deploys_a_model_under_its_artifacts_rule(legacy_artifact: Path) -> None:
    art = GuardArtifact.load(legacy_artifact)
    record = DeploymentRecord.from_metadata(art.metadata)
    assert record is not None and "parts" not in record.decoding["decode_path"]
    model = tiny_chat_model("llama", seed=0)  # today's default rule
    chain, guard, _ = load_guard_chain(art, GuardConfig(participation=0.5), model=model)
    by_id = {it.id: it for it in ITEMS}
    cal = [by_id[i] for i in art.metadata["calibration_ids"]]
    replies = [chain.invoke({"question": it.question}) for it in cal[:4]]
    live = [r.response_metadata["abstention"]["score"] for r in replies]
    np.testing.assert_array_equal(np.asarray(live), art.scores[:4])
    # the model itself, not adopted, decodes on another path: the guard's check refuses it
    policy = guard.policy
    raw = model.invoke(
        [SystemMessage(record.prompts["open"].system_prompt), HumanMessage(cal[0].question)]
    )
    with pytest.raises(ArtifactMismatchError, match="dense up to 192 sources"):
        policy.decide(raw)
