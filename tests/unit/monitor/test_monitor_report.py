"""The monitor's time series (abstain_guard/monitor/report.py): replayed from a monitor log,
they end where the monitor's own state is (participation, each scope's drift e-value and
peak, the alarms), count decisions by reason, agree with a running monitor's, and the page
embeds them with nothing loaded from elsewhere."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from _core_fakes import logprob_metadata
from langchain_core.messages import AIMessage

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.guarantee.decision import Decision
from abstain_guard.guard.policy import AbstentionPolicy
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.log import read_log
from abstain_guard.monitor.report import live_series, monitor_series, render_page
from abstain_guard.scorers import PerplexityScorer

CONFIG = GuardConfig(participation=0.8)
GROUPED = GuardConfig(participation=0.8, group_by="group")


def _scores(rng: np.random.Generator, size: int, a: float = 2.0, b: float = 5.0) -> np.ndarray:
    return 1.0 + 2.0 * rng.beta(a, b, size=size)


def _artifact(groups: tuple[str, str] | None = None) -> GuardArtifact:
    rng = np.random.default_rng(0)
    scores = np.concatenate([_scores(rng, 200), _scores(rng, 200, 5.0, 2.0)])
    named = None if groups is None else np.repeat(groups, 200)
    calibration = CalibrationSet(scores, rng.uniform(size=400) < 0.7, groups=named)
    return GuardArtifact.from_calibration(scorer=PerplexityScorer(), calibration=calibration)


def _decide(policy: AbstentionPolicy, score: float, group: str | None = None) -> Decision:
    message = AIMessage(content="x", response_metadata=logprob_metadata(["x"], [-math.log(score)]))
    return policy.decide(message, group=group)[1]


def _shifted_log(path: Path, config: GuardConfig = CONFIG, **options: object) -> GuardMonitor:
    """Exchangeable traffic, then a shift to high scores (both tests alarm), and decisions
    whose scoring failed (abstained, no score)."""
    grouped = config.group_by is not None
    artifact = _artifact(("a", "b") if grouped else None)
    policy = AbstentionPolicy(artifact, config)
    monitor = GuardMonitor(seed=1, log_path=path, **options).fit_artifact(artifact, config)  # type: ignore[arg-type]
    rng = np.random.default_rng(1)
    calm = rng.permutation(np.concatenate([_scores(rng, 75), _scores(rng, 75, 5.0, 2.0)]))
    for i, score in enumerate(np.concatenate([calm, _scores(rng, 250, 6.0, 1.5)])):
        monitor.observe(_decide(policy, float(score), ("a", "b")[i % 2] if grouped else None))
    for _ in range(5):
        monitor.observe(Decision(abstained=True, score=None, reason="scoring failed"))
    return monitor


def test_the_series_of_a_log_end_where_the_monitor_is(tmp_path: Path) -> None:
    monitor = _shifted_log(tmp_path / "live.jsonl")
    state = monitor.state()
    series = monitor_series(*read_log(tmp_path / "live.jsonl"))
    assert series.decisions == state["decisions"] == 405 and series.at[-1] == 405
    assert series.answered == state["answered"]
    assert series.participation[-1] == state["answered_rate"]
    assert series.target == 0.8 and series.complete
    exchangeability = state["tests"]["exchangeability"]
    assert series.e_value == {"all": exchangeability["e_value"]}  # replayed exactly
    assert max(series.drift["all"]) == exchangeability["peak"] >= series.threshold
    assert series.threshold == exchangeability["threshold"] == 200.0
    assert [(a["test"], a["at"]) for a in series.alarms] == [
        (a["test"], a["at"]) for a in state["alarms"]
    ]
    assert {a["test"] for a in series.alarms} == {"exchangeability", "participation"}
    assert series.reasons == {
        "answered · score": state["answered"],
        "abstained · score": state["scored"] - state["answered"],
        "abstained · unscored": state["unscored"],
    }
    assert state["unscored"] == 5
    assert series.source["calibration_sha256"] == state["source"]["calibration_sha256"]
    assert live_series(monitor) == series  # the running monitor draws the same


def test_points_bin_the_decisions_and_keep_each_bins_largest_drift(tmp_path: Path) -> None:
    monitor = _shifted_log(tmp_path / "live.jsonl")
    header, records = read_log(tmp_path / "live.jsonl")
    full = monitor_series(header, records, points=1000)
    series = monitor_series(header, records, points=10, window=50)
    assert len(series.at) == 10 and series.at[-1] == 405 and series.at[0] == 40
    assert series.participation == [full.participation[e - 1] for e in series.at]
    answered = np.cumsum([not r.abstained for r in records])
    assert series.recent[-1] == (answered[-1] - answered[-51]) / 50
    starts = [0, *series.at[:-1]]
    assert series.drift["all"] == [
        max(full.drift["all"][s:e]) for s, e in zip(starts, series.at, strict=True)
    ]
    assert max(series.drift["all"]) == monitor.state()["tests"]["exchangeability"]["peak"]
    assert series.e_value == full.e_value


def test_each_group_has_its_own_drift_series(tmp_path: Path) -> None:
    monitor = _shifted_log(tmp_path / "live.jsonl", GROUPED)
    state = monitor.state()
    series = monitor_series(*read_log(tmp_path / "live.jsonl"))
    assert set(series.drift) == {"a", "b"}
    for group in ("a", "b"):
        assert (
            series.e_value[group] == state["groups"][group]["tests"]["exchangeability"]["e_value"]
        )
    assert series.reasons["abstained · unscored"] == 5


def test_a_history_not_from_decision_1_draws_no_drift(tmp_path: Path) -> None:
    monitor = _shifted_log(tmp_path / "live.jsonl", max_records=100)
    series = live_series(monitor)  # the last 100 kept
    assert series.decisions == 100 and series.at[0] == 306 and series.at[-1] == 405
    assert not series.complete and series.drift == {} and series.e_value == {}
    snapshot = monitor.write_log(tmp_path / "snapshot.jsonl")
    assert monitor_series(*read_log(snapshot)).drift == {}


def test_the_page_embeds_the_series_and_loads_nothing(tmp_path: Path) -> None:
    hostile = "</script><img src=x onerror=alert(1)>"  # a group name from the calibration set
    artifact = _artifact((hostile, "b"))
    monitor = GuardMonitor(seed=0).fit_artifact(artifact, GROUPED)
    policy = AbstentionPolicy(artifact, GROUPED)
    for score in (1.2, 1.3, 2.9):
        monitor.observe(_decide(policy, score, hostile))
    series = live_series(monitor)
    assert list(series.drift) == [hostile]
    page = render_page(series)
    assert "</script><img" not in page and re.search(r"<\w+[^>]*\s(src|href)\s*=", page) is None
    embedded = re.search(r'<script id="series" type="application/json">(.*?)</script>', page, re.S)
    assert embedded is not None
    data = json.loads(embedded.group(1))
    assert data["live"] is False and data["participation"] == series.participation
    assert data["reasons"] == series.reasons and data["e_value"] == series.e_value
    assert '"live": true' in render_page(series, live=True)


def test_an_empty_log_has_empty_series(tmp_path: Path) -> None:
    artifact = _artifact()
    GuardMonitor(seed=0, log_path=tmp_path / "live.jsonl").fit_artifact(artifact, CONFIG)
    series = monitor_series(*read_log(tmp_path / "live.jsonl"))
    assert (series.decisions, series.at, series.drift, series.reasons) == (0, [], {}, {})
    assert series.complete and series.alarms == [] and series.participation == []
