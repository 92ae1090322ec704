"""``abstain-guard monitor report`` (abstain_guard/cli/monitor.py): a monitor log becomes the
dashboard page with the log's series embedded, offline; a file that is no monitor log is one
``error:`` line."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.cli import main
from abstain_guard.guarantee.decision import Decision
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.log import read_log
from abstain_guard.monitor.report import monitor_series
from abstain_guard.scorers import PerplexityScorer


def _log(path: Path) -> GuardMonitor:
    scores = np.linspace(1.0, 3.0, 60)
    artifact = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(scores, scores < 2.5)
    )
    monitor = GuardMonitor(seed=0, log_path=path).fit_artifact(artifact, GuardConfig())
    tau = monitor.rule_.threshold
    for score in (1.1, 1.5, 2.9, 1.2, 2.95, 1.3):
        monitor.observe(Decision(abstained=score > tau, score=score, threshold=tau))
    monitor.observe(Decision(abstained=True, score=None, reason="scoring failed"))
    return monitor


def test_monitor_report_writes_the_logs_page(tmp_path: Path, capsys) -> None:
    monitor = _log(tmp_path / "live.jsonl")
    out = tmp_path / "pages" / "monitor.html"
    argv = ["monitor", "report", "--log", str(tmp_path / "live.jsonl"), "--out", str(out)]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == f"{out}: 7 decisions, 4 answered, no alarm"
    page = out.read_text(encoding="utf-8")
    embedded = re.search(r'<script id="series" type="application/json">(.*?)</script>', page, re.S)
    assert embedded is not None
    series = monitor_series(*read_log(tmp_path / "live.jsonl"))
    assert json.loads(embedded.group(1)) == {**asdict(series), "live": False}
    assert series.reasons == {"answered · score": 4, "abstained · score": 2,
                              "abstained · unscored": 1}  # fmt: skip
    assert series.participation[-1] == monitor.state()["answered_rate"] == 4 / 7
    assert main(argv) == 0  # a second report replaces the first


def test_monitor_report_refuses_what_is_not_a_monitor_log(tmp_path: Path, capsys) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text('{"question": "Q?"}\n')
    out = tmp_path / "monitor.html"
    assert main(["monitor", "report", "--log", str(other), "--out", str(out)]) == 2
    assert "not a monitor log event" in capsys.readouterr().err and not out.exists()
