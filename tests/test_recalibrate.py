"""Recalibration from feedback (calibration/building/recalibrate.py): after a drift alarm,
an artifact rebuilt from labeled live decisions restores participation inside the band on
later traffic; pooling and selected labels are refused where they would break it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from _core_fakes import logprob_metadata
from langchain_core.messages import AIMessage

from abstain_guard import AbstentionPolicy, GuardArtifact, GuardConfig, PerplexityScorer
from abstain_guard.calibration.building.recalibrate import recalibrate
from abstain_guard.cli import main
from abstain_guard.errors import InsufficientDataError, MonitorLogError
from abstain_guard.monitor import GuardMonitor

CONFIG = GuardConfig(participation=0.8)
BAND = (0.8, 0.8 + 1 / 401)  # n = 400 live calibration answers


def _population(
    rng: np.random.Generator, size: int, shifted: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Perplexities in [1, 3]: calibration traffic Beta(2, 5), shifted traffic Beta(4, 2)
    (less certain answers); P(correct) = 1 − (s − 1)/2."""
    a, b = (4.0, 2.0) if shifted else (2.0, 5.0)
    scores = 1.0 + 2.0 * rng.beta(a, b, size=size)
    return scores, rng.uniform(size=size) < 1.0 - (scores - 1.0) / 2.0


def _message(score: float) -> AIMessage:
    """A one-token answer whose perplexity is ``score``."""
    return AIMessage(content="x", response_metadata=logprob_metadata(["x"], [-math.log(score)]))


@pytest.fixture
def old_artifact(tmp_path: Path) -> Path:
    scores, correct = _population(np.random.default_rng(0), 300, shifted=False)
    art = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), scores=scores, correct=correct, model_fingerprint="m-1"
    )
    return art.save(tmp_path / "old")


def _serve(policy: AbstentionPolicy, monitor: GuardMonitor, scores, correct, label=None) -> None:
    """Decide each answer with the real policy, record it, label it (all, or ``label``)."""
    for i, (s, c) in enumerate(zip(scores, correct, strict=True)):
        _, decision = policy.decide(_message(float(s)))
        rid = monitor.observe(decision)
        if label is None or label(i, decision):
            monitor.record_feedback(rid, bool(c))


def test_recalibration_after_alarm_restores_participation(old_artifact: Path, tmp_path: Path):
    rng = np.random.default_rng(1)
    old = GuardArtifact.load(old_artifact)
    policy = AbstentionPolicy(old, CONFIG)
    log = tmp_path / "monitor.jsonl"
    monitor = GuardMonitor(false_alarm=0.01, seed=2, log_path=log).fit_artifact(old, CONFIG)
    shifted, shifted_correct = _population(rng, 700, shifted=True)
    _serve(policy, monitor, shifted, shifted_correct)  # every decision labeled: score-blind
    (alarm, *_) = monitor.alarms
    assert alarm.at <= 100, alarm  # the shift is caught within the first 100 questions

    summary = recalibrate(old_artifact, log, tmp_path / "new", last=400)
    new = GuardArtifact.load(tmp_path / "new")
    assert (summary.n_live, new.n) == (400, 400)
    source = new.metadata["calibration_source"]
    assert source["kind"] == "live_feedback" and not source["pooled"]
    assert source["recalibrated_from"]["artifact"] == str(old_artifact)
    assert len(source["feedback"]["run_ids"]) == 400
    assert new.scorer.kind == old.scorer.kind and new.model_fingerprint == "m-1"
    live = [r.score for r in monitor.records()][-400:]
    assert new.scores.tolist() == live  # the stored live scores: no model run

    # later traffic of the new distribution: the old guard answers far too little, the
    # recalibrated one about 1 − α (its calibration-conditional rate has sd ≈ 0.02 at n = 400)
    later, later_correct = _population(rng, 3000, shifted=True)
    old_rate = np.mean(later <= policy.rule.threshold)
    new_policy = AbstentionPolicy(new, CONFIG)
    new_monitor = GuardMonitor(false_alarm=0.01, seed=3).fit_artifact(new, CONFIG)
    _serve(new_policy, new_monitor, later, later_correct, label=lambda i, d: False)
    state = new_monitor.state()
    assert old_rate < 0.45
    assert BAND[0] - 0.07 <= state["answered_rate"] <= BAND[1] + 0.07
    assert not state["alarm"]


def test_recalibrated_participation_is_in_the_band_on_average() -> None:
    """The band is a guarantee over calibration draws: over 400 recalibrations on fresh
    live samples, the mean participation on the shifted population (exact, from the Beta
    CDF) lies in [1−α, 1−α+1/(n+1)) up to 3 Monte-Carlo standard errors."""
    from scipy import stats

    rng = np.random.default_rng(4)
    rates = []
    for _ in range(400):
        scores, correct = _population(rng, 400, shifted=True)
        rule = GuardArtifact(PerplexityScorer(), scores, correct).decision_rule(CONFIG)
        rates.append(stats.beta.cdf((rule.threshold - 1.0) / 2.0, 4.0, 2.0))
    se = np.std(rates) / math.sqrt(len(rates))
    assert BAND[0] - 3 * se <= np.mean(rates) <= BAND[1] + 3 * se


def test_pooling_after_an_alarm_is_refused(old_artifact: Path, tmp_path: Path) -> None:
    old = GuardArtifact.load(old_artifact)
    log = tmp_path / "monitor.jsonl"
    monitor = GuardMonitor(seed=0, log_path=log).fit_artifact(old, CONFIG)
    scores, correct = _population(np.random.default_rng(5), 300, shifted=True)
    _serve(AbstentionPolicy(old, CONFIG), monitor, scores, correct)
    with pytest.raises(InsufficientDataError, match=r"exchangeable.*drop --pool"):
        recalibrate(old_artifact, log, tmp_path / "pooled", pool=True)


def test_pooling_without_shift_keeps_the_old_set(old_artifact: Path, tmp_path: Path) -> None:
    old = GuardArtifact.load(old_artifact)
    log = tmp_path / "monitor.jsonl"
    monitor = GuardMonitor(seed=0, log_path=log).fit_artifact(old, CONFIG)
    scores, correct = _population(np.random.default_rng(6), 200, shifted=False)
    _serve(AbstentionPolicy(old, CONFIG), monitor, scores, correct)
    assert not monitor.alarms
    summary = recalibrate(old_artifact, log, tmp_path / "pooled", pool=True)
    pooled = GuardArtifact.load(tmp_path / "pooled")
    assert (summary.n_old, pooled.n) == (300, 500)
    assert pooled.scores[:300].tolist() == old.scores.tolist()
    source = pooled.metadata["calibration_source"]
    assert source["kind"] == "live_feedback+calibration"
    assert source["pool_check"]["passed"] and source["pool_check"]["ks_p_value"] >= 0.01


def test_labels_on_answered_questions_only_are_refused(old_artifact: Path, tmp_path: Path):
    old = GuardArtifact.load(old_artifact)
    log = tmp_path / "monitor.jsonl"
    monitor = GuardMonitor(seed=0, log_path=log).fit_artifact(old, CONFIG)
    scores, correct = _population(np.random.default_rng(7), 300, shifted=True)
    _serve(
        AbstentionPolicy(old, CONFIG), monitor, scores, correct,
        label=lambda i, d: not d["abstained"],
    )  # fmt: skip
    with pytest.raises(InsufficientDataError, match="not a score-blind sample"):
        recalibrate(old_artifact, log, tmp_path / "new")


def test_log_of_another_artifact_is_refused(old_artifact: Path, tmp_path: Path) -> None:
    scores, correct = _population(np.random.default_rng(8), 100, shifted=False)
    other = GuardArtifact(PerplexityScorer(), scores, correct)
    log = tmp_path / "other.jsonl"
    monitor = GuardMonitor(seed=0, log_path=log).fit_artifact(other, CONFIG)
    _serve(AbstentionPolicy(other, CONFIG), monitor, scores[:50], correct[:50])
    with pytest.raises(MonitorLogError, match="another calibration set"):
        recalibrate(old_artifact, log, tmp_path / "new")


def test_cli_recalibrate(old_artifact: Path, tmp_path: Path, capsys) -> None:
    old = GuardArtifact.load(old_artifact)
    monitor = GuardMonitor(seed=0).fit_artifact(old, CONFIG)
    scores, correct = _population(np.random.default_rng(9), 120, shifted=True)
    _serve(AbstentionPolicy(old, CONFIG), monitor, scores, correct)
    log = monitor.write_log(tmp_path / "written.jsonl")
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert events[0] == "start" and "alarm" in events
    out = tmp_path / "new"
    rc = main(["recalibrate", "--artifact", str(old_artifact), "--feedback", str(log),
               "--out", str(out)])  # fmt: skip
    assert rc == 0 and "120 labeled live decisions" in capsys.readouterr().out
    assert GuardArtifact.load(out).n == 120
    rc = main(["recalibrate", "--artifact", str(old_artifact), "--feedback", str(log),
               "--out", str(out), "--pool"])  # fmt: skip
    assert rc == 2 and "drop --pool" in capsys.readouterr().err
