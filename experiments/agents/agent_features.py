"""Do an agent run's tool record sharpen the uncertainty score? (before adding them as features)

Reads an artifact built by ``calibrate --agent`` and its run cache, and on the calibration
split (the answers behind the threshold; never used to fit anything) reports AUROC — wrong
answers ranked as more uncertain — with a class-stratified 95 % bootstrap interval and the
counts behind it, for:

* the artifact's score;
* ``trouble``: 1 when the run wrote a malformed call or a tool returned an error, else 0;
* ``tool_calls``: the number of parsed tool calls in the run;
* the score with ``trouble`` added as a tie-breaking override (``score + trouble``: every
  troubled run ranked above every clean one, the score ordering the rest).

    python experiments/agents/agent_features.py runs/country_agent

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard import GuardArtifact
from abstain_guard.calibration.building.answering.agents import (
    AGENT_NS,
    _message_json,
    agent_inputs,
)
from abstain_guard.calibration.building.answering.answer_rows import means_digest
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.run.store import content_key
from abstain_guard.calibration.measure.held_out import artifact_items
from abstain_guard.calibration.measure.metrics import auroc, bootstrap_intervals


def _runs_by_key(cache: Path) -> dict[str, dict[str, Any]]:
    """Cached agent runs by their cache key (a content hash of the model, the factory, what
    the model carried, the step limit and the input messages; rebuilt below)."""
    with sqlite3.connect(cache / "run.sqlite") as conn:
        rows = conn.execute("SELECT key, value FROM kv WHERE ns = ?", (AGENT_NS,)).fetchall()
    return {key: json.loads(value) for key, value in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--cache-dir", help="default: the artifact's recorded cache")
    args = parser.parse_args()

    art = GuardArtifact.load(args.artifact)
    meta = art.metadata
    cache = Path(args.cache_dir or meta["cache_dir"])
    runs = _runs_by_key(cache)
    _, held, _ = artifact_items(art)
    by_id: dict[str, QAItem] = {it.id: it for it in held}
    cfg = meta["config"]
    record = meta["deployment"]["agent"]
    scorer = art.scorer
    reference = getattr(scorer, "reference_means_", None)
    rows = []
    for i, qid in enumerate(meta["calibration_ids"]):
        it = by_id[qid]
        key = content_key(
            "agent",
            art.model_fingerprint,
            cfg["agent"],
            "as deployed",
            getattr(scorer, "capture", None),
            None if reference is None else means_digest(reference),
            record["step_limit"],
            [_message_json(m) for m in agent_inputs(it)],
        )
        run = runs[key]["agent"]
        rows.append(
            {
                "score": float(art.scores[i]),
                "correct": bool(art.correct[i]),
                "trouble": int(run["invalid_tool_calls"] > 0 or run["tool_errors"] > 0),
                "tool_calls": int(run["tool_calls"]),
            }
        )
    correct = np.array([r["correct"] for r in rows], dtype=int)
    columns = {
        "score": np.array([r["score"] for r in rows]),
        "trouble": np.array([r["trouble"] for r in rows], dtype=float),
        "tool_calls": np.array([r["tool_calls"] for r in rows], dtype=float),
    }
    columns["score + trouble"] = columns["score"] + columns["trouble"] * (
        1.0 + float(np.ptp(columns["score"]))
    )
    out: dict[str, Any] = {
        "artifact": args.artifact,
        "n": len(rows),
        "correct": int(correct.sum()),
        "incorrect": int(len(rows) - correct.sum()),
        "runs_with_trouble": int(columns["trouble"].sum()),
        "error_rate_with_trouble": float(1 - correct[columns["trouble"] > 0].mean())
        if columns["trouble"].any()
        else None,
        "auroc": {},
    }
    for name, values in columns.items():
        value = auroc(values, correct)
        low, high = bootstrap_intervals(values, correct, ("auroc",))["auroc"]
        out["auroc"][name] = [round(float(value), 3), [round(low, 3), round(high, 3)]]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
