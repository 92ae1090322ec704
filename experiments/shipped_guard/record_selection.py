"""Record in an existing artifact how its scorer was chosen, and re-certify it at δ/K.

    python experiments/shipped_guard/record_selection.py --artifact abstain_guard/default_guard \
        --config configs/default_guard.yaml --data "..." --choice "..." [--audit looks.jsonl]

For an artifact whose scorer was chosen among K candidates on its own calibration answers
before the library recorded selections (the shipped default guard: `probe_mid` among 13).
No model runs: Bonferroni needs only the chosen scorer's stored calibration scores
and labels (:func:`abstain_guard.guarantee.selection.record_choice`). The candidates, the risk
target and δ come from the calibration config (``candidates``, ``risk_target``, ``delta``), the same
keys with which ``calibrate`` writes the block itself. The artifact is rewritten through
:meth:`GuardArtifact.save` (atomic, checksums recomputed), reloaded and checked, and the
certificate it now carries is printed as JSON.

``--audit``: a JSON-lines file of looks at the same calibration answers made outside the
library (one :class:`~abstain_guard.guarantee.ledger.LedgerEntry` per line, ``by: "audit"``,
with its evidence), appended to the artifact's selection ledger: K then counts them too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.config import GuardConfig
from abstain_guard.guarantee.frontier import FRONTIER_DELTAS, smallest_certifiable_risk
from abstain_guard.guarantee.ledger import parse_ledger
from abstain_guard.guarantee.selection import record_choice


def record(
    artifact_dir: Path,
    config: CalibrationConfig,
    data: str,
    choice: str,
    audit: Path | None = None,
) -> dict[str, Any]:
    """Write the selection block into ``artifact_dir`` (and ``audit``'s looks into its ledger)
    and return what the reloaded guard certifies (participation at the config's risk target,
    smallest ε per δ, both at δ/K)."""
    art = GuardArtifact.load(artifact_dir)
    if not config.candidates or config.risk_target is None:
        raise SystemExit("the config must name candidates and a risk_target")
    selection = record_choice(
        art.scorer.kind,
        art.scores,
        art.correct,
        config.candidates,
        config.risk_target,
        config.delta,
        data=data,
        choice=choice,
    )
    metadata = {**art.metadata, "selection": selection.to_json()}
    updated = art.replace(metadata=metadata)
    updated.save(artifact_dir, overwrite=True)
    loaded = GuardArtifact.load(artifact_dir)
    if audit is not None:
        loaded.record_looks(parse_ledger(audit.read_text(encoding="utf-8"), str(audit)))
        loaded = GuardArtifact.load(artifact_dir)
    assert loaded.selection is not None and loaded.selection.candidates == selection.candidates
    rule = loaded.decision_rule(
        GuardConfig(mode="risk", risk_target=config.risk_target, delta=config.delta)
    )
    k = loaded.n_candidates
    return {
        "selection": selection.to_json(),
        "n_candidates": k,
        "ledger": [e.name for e in loaded.ledger],
        "risk_target": config.risk_target,
        "delta": config.delta,
        "certified_participation": rule.guarantee.calibration_participation,
        "threshold": rule.threshold,
        "statement": rule.guarantee.statement,
        "smallest_risk_target": {
            f"{d:g}": smallest_certifiable_risk(loaded.scores, loaded.correct, d / k)
            for d in FRONTIER_DELTAS
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, type=Path)
    parser.add_argument("--config", required=True, help="calibration config with candidates")
    parser.add_argument("--data", required=True, help="which answers the candidates were on")
    parser.add_argument("--choice", required=True, help="how the scorer was chosen")
    parser.add_argument("--audit", type=Path, help="JSON lines: looks made outside the library")
    args = parser.parse_args(argv)
    config = CalibrationConfig.from_file(args.config)
    result = record(args.artifact, config, args.data, args.choice, args.audit)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
