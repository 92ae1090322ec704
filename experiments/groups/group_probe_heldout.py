"""Pooled vs per-group rule on the shipped guard's own held-out test split, live.

The shipped guard (``abstain_guard/default_guard``) was calibrated on 960 probe questions and
kept 240 others as its test split (``test_ids``), never used for fitting or thresholds. This
script answers those 240 questions with the deployed chain (``load_guard_chain``: the embedded
model, the calibrated prompt, budget and decoding) under ``GuardConfig(group_by="relation")``,
the relation passed in the run metadata; each answer is judged with the artifact's judge
(lexical). For the same answer and score it records the per-group decision (the guard's) and
the pooled one (score ≤ the pooled threshold), and prints per relation: answered / questions
and wrong / answered with 95 % Wilson intervals (``abstain_guard.guarantee.groups.group_rates``).

Run (loads the model; 492 s on 2 cores; the last run is
experiments/groups/group_probe_heldout.json)::

    flock /tmp/heavy.lock .venv/bin/python experiments/groups/group_probe_heldout.py \
        > experiments/groups/group_probe_heldout.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from abstain_guard import GuardArtifact, GuardConfig, default_artifact_path
from abstain_guard.calibration.building.judges.registry import make_judge
from abstain_guard.calibration.building.questions.items import load_items
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.measure.group_report import groups_markdown
from abstain_guard.guarantee.groups import group_rates
from abstain_guard.guard.chains import load_guard_chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--participation", type=float, default=0.8)
    parser.add_argument("--limit", type=int, default=None, help="first N test questions")
    args = parser.parse_args()
    t0 = time.time()
    path = default_artifact_path()
    art = GuardArtifact.load(path)
    cal_config = CalibrationConfig(**art.metadata["config"])
    items, _ = load_items(str(art.metadata["data"]), cal_config)
    by_id = {it.id: it for it in items}
    test = [by_id[i] for i in art.metadata["test_ids"]][: args.limit]
    config = GuardConfig(participation=args.participation, group_by="relation")
    chain, guard, _ = load_guard_chain(path, config)
    pooled_threshold = guard.policy.rule.threshold
    judge = make_judge(art.metadata["config"]["judge"])
    groups, grouped, pooled, correct, rows = [], [], [], [], []
    for it in test:
        msg = chain.invoke({"question": it.question}, {"metadata": {"relation": it.group}})
        d = msg.response_metadata["abstention"]
        text = (
            msg.response_metadata["withheld_response"]["content"] if d["abstained"] else msg.content
        )
        verdict = judge.judge(it.question, it.answers, str(text)).correct
        if verdict is None:  # no verdict (as calibration, excluded)
            continue
        ok = bool(verdict)
        score = d["score"]
        groups.append(str(it.group))
        grouped.append(not d["abstained"])
        pooled.append(score is not None and score <= pooled_threshold)
        correct.append(ok)
        rows.append({"id": it.id, "group": it.group, "score": score, "correct": ok})
    table = {
        "caption": "the shipped guard's held-out test split, answered live",
        "pooled": group_rates(groups, pooled, correct),
        "per_group": group_rates(groups, grouped, correct),
    }
    result = {
        "command": "python experiments/groups/group_probe_heldout.py",
        "participation": args.participation,
        "pooled_threshold": pooled_threshold,
        "n": len(test),
        "accuracy": float(np.mean(correct)),
        "seconds": round(time.time() - t0, 1),
        "table": table,
        "answers": rows,
    }
    json.dump(result, sys.stdout, indent=1, default=float)
    print()
    print(groups_markdown({f"participation {args.participation:g}": table}), file=sys.stderr)


if __name__ == "__main__":
    main()
