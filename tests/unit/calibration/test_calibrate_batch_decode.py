"""Calibrating on a model loaded with ``batch_decode`` (the default): held-out questions share
decode steps through the scheduler, every answer is bitwise the one its own call gives, the
decode path the engine took is recorded in every answer and in the artifact, and the guard
refuses responses decoded on another path, naming both.

Tiny random-weight model, content-hash judge (see ``test_pipeline_resume``).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pipeline_fakes import ITEMS, HashJudge, _config, _judges
from tiny_models import tiny_chat_model

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.adapters.capture.session import default_parts
from abstain_guard.adapters.engine.scheduler import scheduler_for
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.errors import ArtifactMismatchError
from abstain_guard.guard.chains import load_guard_chain


def _generation_rows(cache: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(cache / "run.sqlite") as conn:
        return [
            json.loads(v)
            for (v,) in conn.execute("SELECT value FROM kv WHERE ns = ?", ("generation",))
        ]


@pytest.fixture(scope="module")
def batched_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    tmp = tmp_path_factory.mktemp("batch_decode")
    model = tiny_chat_model("llama", seed=0, batch_decode=True)
    calibrate(
        ITEMS,
        tmp / "guard",
        config=_config(tmp, "guard", scorer="geometry").model_copy(
            update={"scorer_params": {"covariance": "oas"}}
        ),
        model=model,
        judges=_judges(tmp, "guard", HashJudge()),
        progress=False,
    )
    return tmp, model


def test_held_out_answers_shared_decode_steps(batched_run: tuple[Path, Any]) -> None:
    _, model = batched_run
    # the held-out questions went to the scheduler together, not one call at a time
    assert scheduler_for(model._s).widest_step > 1


def test_the_decode_mode_is_recorded_and_keys_the_cache(batched_run: tuple[Path, Any]) -> None:
    tmp, _ = batched_run
    art = GuardArtifact.load(tmp / "guard")
    record = DeploymentRecord.from_metadata(art.metadata)
    assert record is not None and record.decoding["batch_decode"] is True
    shared = {"steps": "shared", "threads": 1, "min_rows": 4, "prefix": "system_turn"}
    shared["parts"] = default_parts().record()  # the attention-parts rule (test_parts_rule)
    assert record.decoding["decode_path"] == shared
    rows = _generation_rows(tmp / "guard.cache")
    assert rows and all(r["metadata"]["generation"]["batch_decode"] is True for r in rows)
    assert all(r["metadata"]["generation"]["decode_path"] == shared for r in rows)


def test_live_scores_equal_stored_in_the_same_mode(batched_run: tuple[Path, Any]) -> None:
    """Each calibration answer, asked alone through the deployed chain, scores bitwise as
    stored: the shared decode steps changed nothing."""
    tmp, model = batched_run
    art = GuardArtifact.load(tmp / "guard")
    chain, _, _ = load_guard_chain(tmp / "guard", GuardConfig(participation=0.5), model=model)
    by_id = {it.id: it for it in ITEMS}
    live = [
        chain.invoke({"question": by_id[i].question}).response_metadata["abstention"]["score"]
        for i in art.metadata["calibration_ids"]
    ]
    np.testing.assert_array_equal(np.asarray(live), art.scores)


def test_the_other_decode_path_is_refused(batched_run: tuple[Path, Any]) -> None:
    """A response decoded on another path (each row alone) is an ArtifactMismatchError that
    names the response's path and the calibrated one."""
    tmp, _ = batched_run
    rows_alone = tiny_chat_model("llama", seed=0, batch_decode=False)  # same weights
    chain, _, _ = load_guard_chain(tmp / "guard", GuardConfig(participation=0.5), model=rows_alone)
    with pytest.raises(ArtifactMismatchError) as err:
        chain.invoke({"question": ITEMS[0].question})
    message = str(err.value)
    assert "decode_path={'steps': 'alone'" in message
    assert "each row decoded alone on 1 BLAS thread(s)" in message
    assert "shared decode steps on 1 BLAS thread(s), padded to 4 rows" in message


def test_rows_alone_calibration_keys_apart_from_batch_decode(
    batched_run: tuple[Path, Any], tmp_path: Path
) -> None:
    """The same questions on a rows-alone model are generated again (cached apart), and the
    artifact records batch_decode False."""
    tmp, _ = batched_run
    cfg = _config(tmp, "guard", scorer="perplexity")  # the same run cache
    calibrate(
        ITEMS,
        tmp_path / "alone",
        config=cfg,
        model=tiny_chat_model("llama", seed=0, batch_decode=False),
        judges=_judges(tmp, "guard", HashJudge()),
        progress=False,
    )
    record = DeploymentRecord.from_metadata(GuardArtifact.load(tmp_path / "alone").metadata)
    assert record is not None and record.decoding["batch_decode"] is False
    assert record.decoding["decode_path"] == {
        "steps": "alone",
        "threads": 1,
        "min_rows": 1,
        "prefix": "system_turn",
        "parts": default_parts().record(),
    }
    modes = [
        r["metadata"]["generation"]["batch_decode"] for r in _generation_rows(tmp / "guard.cache")
    ]
    assert modes.count(False) == len(ITEMS) and modes.count(True) == len(ITEMS)
