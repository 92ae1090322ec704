"""The drift monitor and step-gated agent runs (issue 46): a run stopped at step t has only a
partial running maximum, a lower bound on the whole-run statistic its calibration references
are, so the exchangeability test ranks it only as "above τ" (censored); and where a stopped
run went (a review a human rejected is not handed off)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard import GuardArtifact
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.guarantee.decision import Decision
from abstain_guard.monitor.drift import ConformalTestMartingale, censored_p_value
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.scorers import PerplexityScorer


def _artifact() -> GuardArtifact:
    rng = np.random.default_rng(3)
    scores = rng.uniform(1.0, 3.0, size=400)
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(scores, rng.uniform(size=400) < 0.7)
    )


def _stopped(threshold: float, score: float, **extra: Any) -> Decision:
    """A step-gated decision that stopped a run at its second call (partial statistic)."""
    fields: dict[str, Any] = {"action": "end", **extra}
    return Decision(
        abstained=True,
        score=score,
        threshold=threshold,
        gating="steps",
        step=1,
        step_score=score,
        run_statistic=score,
        **fields,
    )


def test_a_censored_p_value_is_uniform_below_the_share_of_scores_above_tau() -> None:
    history = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    # 4 scores above τ = 5: the stopped run ties with them, p = u·(4 + 1)/(9 + 1)
    assert censored_p_value(5.0, history, 0.0) == 0.0
    assert censored_p_value(5.0, history, 0.5) == 0.25
    assert censored_p_value(5.0, history, 0.999) < 0.5
    test = ConformalTestMartingale(history, rng=np.random.default_rng(0))
    u = float(np.random.default_rng(0).uniform())
    assert test.update(5.2, above=5.0) == censored_p_value(5.0, history, u)
    assert len(test.history) == 10 and test.seen == 1


def test_the_monitor_ranks_a_stopped_runs_partial_statistic_only_as_above_tau(
    tmp_path: Path,
) -> None:
    art = _artifact()
    log = tmp_path / "monitor.jsonl"
    monitor = GuardMonitor(seed=1, log_path=log).fit_artifact(art)
    tau = monitor.rule_.threshold
    n = art.scores.size
    p_values, bounds = [], []
    for i in range(200):
        above = int(np.sum(np.asarray(monitor.scopes_[None].exchangeability.history) > tau))
        size = n + i
        monitor.observe(_stopped(tau, tau + 1e-9), run_id=f"r{i}")
        record = monitor.records_[f"r{i}"]
        assert record.censored is True
        p_values.append(record.p_value)
        bounds.append((above + 1) / (size + 1))
    # the partial statistic just over τ would rank at the top of the scores above τ
    # (p ≈ its share); censored, p is uniform on [0, share): spread over the whole range
    assert all(p < b for p, b in zip(p_values, bounds, strict=True))
    assert min(p / b for p, b in zip(p_values, bounds, strict=True)) < 0.05
    assert 0.4 < float(np.mean(np.divide(p_values, bounds))) < 0.6
    # a final-answer-gated abstention is a whole answer's score: ranked as it is
    final = monitor.observe(_stopped(tau, tau + 1e-9).replace(gating=None), run_id="final")
    assert monitor.records_[final].censored is False
    # a restart replays the log to the same p-values (the censoring is logged)
    resumed = GuardMonitor(seed=1, log_path=log).fit_artifact(art)
    assert resumed.records_["r7"].p_value == monitor.records_["r7"].p_value


def test_a_rejected_review_is_not_counted_as_handed_off() -> None:
    monitor = GuardMonitor().fit_artifact(_artifact())
    tau = monitor.rule_.threshold
    monitor.observe(_stopped(tau, tau + 0.5, action="interrupt", review="rejected"))
    monitor.observe(_stopped(tau, tau + 0.5, action="interrupt", review="approved"))
    monitor.observe(_stopped(tau, tau + 0.5, action="fallback"))
    state = monitor.state()
    assert state["decisions"] == 3
    assert state["handed_off"] == {"interrupt": 1, "fallback": 1}
