"""Recalibration from feedback (calibration/building/recalibrate.py): after a drift alarm,
an artifact rebuilt from live decisions restores participation inside the band on later
traffic (participation mode: τ from every scored decision, no labels needed); in risk mode
labels selected by their score are refused; pooling is refused where it would break the
guarantee; groups are kept and the old provenance moves under ``recalibrated_from``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from _core_fakes import logprob_metadata
from langchain_core.messages import AIMessage
from scipy import stats

import abstain_guard
from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration.building.recalibrate import (
    CHECK_LEVEL,
    recalibrate,
    selection_check,
)
from abstain_guard.calibration.measure.held_out import artifact_splits
from abstain_guard.cli import main
from abstain_guard.errors import (
    DatasetError,
    InsufficientDataError,
    InvalidInputError,
    MonitorLogError,
)
from abstain_guard.guard.policy import AbstentionPolicy
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.log import MonitorRecord, read_log
from abstain_guard.scorers import PerplexityScorer

CONFIG = GuardConfig(participation=0.8)
RISK = GuardConfig(mode="risk", risk_target=0.3, delta=0.1)
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
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(scores, correct),
        model_fingerprint="m-1",
    )
    return art.save(tmp_path / "old")


def _serve(
    policy: AbstentionPolicy, monitor: GuardMonitor, scores, correct, label=None, groups=None
) -> None:
    """Decide each answer with the real policy (in its ``groups``, if given), record it,
    label it (all, or where ``label(i, decision)``)."""
    for i, (s, c) in enumerate(zip(scores, correct, strict=True)):
        group = None if groups is None else groups[i]
        _, decision = policy.decide(_message(float(s)), group=group)
        rid = monitor.observe(decision)
        if label is None or label(i, decision):
            monitor.record_feedback(rid, bool(c))


def _logged(old_artifact: Path, config: GuardConfig, tmp_path: Path, name: str = "monitor"):
    """A guard on ``old_artifact`` under ``config`` and its monitor, logging to a file."""
    old = GuardArtifact.load(old_artifact)
    log = tmp_path / f"{name}.jsonl"
    monitor = GuardMonitor(seed=0, log_path=log).fit_artifact(old, config)
    return AbstentionPolicy(old, config), monitor, log


def _split(policy: AbstentionPolicy, n_answered: int, n_withheld: int, seed: int):
    """Scores of ``n_answered`` answered then ``n_withheld`` withheld decisions under
    ``policy``'s threshold, and their labels."""
    rng = np.random.default_rng(seed)
    tau = policy.rule.threshold
    scores = np.concatenate(
        [rng.uniform(1.0, tau, n_answered), rng.uniform(tau + 1e-6, 3.0, n_withheld)]
    )
    return scores, rng.uniform(size=scores.size) < 1.0 - (scores - 1.0) / 2.0


def test_recalibration_after_alarm_restores_participation(old_artifact: Path, tmp_path: Path):
    """The loop of docs/guarantees.md ("Recalibration from feedback"), whose numbers are
    this test's ``measured:`` line (``pytest -s``)."""
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
    assert source["mode"] == "participation" and source["labels"] == "monitor feedback"
    assert new.metadata["recalibrated_from"]["artifact"] == str(Path(old_artifact).resolve())
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
    answered = int(np.sum(later <= new_policy.rule.threshold))
    wilson = stats.binomtest(answered, later.size).proportion_ci(method="wilson")
    alarms = ", ".join(f"{a.test} after {a.at}" for a in monitor.alarms)
    print(f"\nmeasured: alarms {alarms}; later {later.size} questions: old guard answers "
          f"{old_rate:.3f}, recalibrated {answered}/{later.size} = {answered / later.size:.3f} "
          f"(Wilson 95 % [{wilson.low:.3f}, {wilson.high:.3f}]), its monitor alarms: "
          f"{state['alarm']}")  # fmt: skip
    assert old_rate < 0.45
    assert BAND[0] - 0.07 <= state["answered_rate"] <= BAND[1] + 0.07
    assert not state["alarm"]


def _band_log(path: Path, header: dict, tau: float, rng: np.random.Generator) -> None:
    """A monitor log of 100 decisions before the shift and 400 after, a random half of them
    labeled, as the guard with threshold ``tau`` logs them (the events of
    :func:`~abstain_guard.monitor.log.write_events`, written directly: 400 logs)."""
    before, before_correct = _population(rng, 100, shifted=False)
    after, after_correct = _population(rng, 400, shifted=True)
    scores = np.concatenate([before, after])
    correct = np.concatenate([before_correct, after_correct])
    labeled = rng.uniform(size=scores.size) < 0.5
    lines = [json.dumps({"event": "start", **header})]
    for i, (s, c, lab) in enumerate(zip(scores.tolist(), correct, labeled, strict=True)):
        lines.append(json.dumps({"event": "decision", "index": i + 1, "run_id": f"r{i}",
                                 "time": "t", "score": s, "abstained": s > tau,
                                 "threshold": tau}))  # fmt: skip
        if lab:
            lines.append(json.dumps({"event": "feedback", "run_id": f"r{i}", "correct": bool(c)}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.slow
def test_recalibrated_participation_is_in_the_band_on_average(
    old_artifact: Path, tmp_path: Path
) -> None:
    """The band is a guarantee over calibration draws (docs/guarantees.md quotes this
    test's ``measured:`` line): over 400 runs of ``recalibrate``
    (``last=400``) on fresh logs of the shifted population, half of them labeled, the mean
    participation of the new artifact on the shifted population (exact, from the Beta CDF)
    lies in [1−α, 1−α+1/(n+1)) up to 3 Monte-Carlo standard errors."""
    _, monitor, log = _logged(old_artifact, CONFIG, tmp_path)
    header, _ = read_log(monitor.write_log(log))
    tau = float(header["rule"]["threshold"])
    rng = np.random.default_rng(4)
    rates = []
    for i in range(400):
        _band_log(log, header, tau, rng)
        summary = recalibrate(old_artifact, log, tmp_path / f"new{i}", last=400)
        new = GuardArtifact.load(summary.out)
        assert new.n == 400 and summary.mode == "participation"
        rule = new.decision_rule(CONFIG)
        rates.append(stats.beta.cdf((rule.threshold - 1.0) / 2.0, 4.0, 2.0))
    se = np.std(rates) / math.sqrt(len(rates))
    band = f"[{BAND[0]:.4f}, {BAND[1]:.4f})"
    print(f"\nmeasured: mean participation over {len(rates)} recalibrations "
          f"{np.mean(rates):.4f} ± {se:.4f} (s.e.), band {band}")  # fmt: skip
    assert BAND[0] - 3 * se <= np.mean(rates) <= BAND[1] + 3 * se


def test_participation_takes_every_scored_decision(old_artifact: Path, tmp_path: Path):
    """Participation mode: labels on answered questions only (a selected sample) do not
    matter, τ comes from every scored decision of the window; the unlabeled ones are
    stored as incorrect and counted."""
    policy, monitor, log = _logged(old_artifact, CONFIG, tmp_path)
    scores, correct = _population(np.random.default_rng(7), 300, shifted=True)
    _serve(policy, monitor, scores, correct, label=lambda i, d: not d.abstained)
    summary = recalibrate(old_artifact, log, tmp_path / "new")
    new = GuardArtifact.load(tmp_path / "new")
    logged = monitor.records()
    answered = [r for r in logged if not r.abstained]
    assert new.scores.tolist() == [r.score for r in logged]  # all 300, labeled or not
    assert (summary.mode, summary.n_live, summary.n_labeled) == (
        "participation",
        300,
        len(answered),
    )
    assert new.correct.tolist() == [r.correct is True for r in logged]
    source = new.metadata["calibration_source"]
    assert source["feedback"]["unlabeled_stored_as_incorrect"] == 300 - len(answered)
    assert source["selection_check"] is None
    assert "stored as incorrect" in summary.to_text()
    assert np.mean(scores <= new.decision_rule(CONFIG).threshold) >= 0.8


def test_participation_needs_no_labels(old_artifact: Path, tmp_path: Path) -> None:
    policy, monitor, log = _logged(old_artifact, CONFIG, tmp_path)
    scores, correct = _population(np.random.default_rng(10), 200, shifted=True)
    _serve(policy, monitor, scores, correct, label=lambda i, d: False)
    summary = recalibrate(old_artifact, log, tmp_path / "new", last=150)
    assert (summary.n_live, summary.n_labeled, summary.accuracy) == (150, 0, None)
    live = [r.score for r in monitor.records()][-150:]
    assert GuardArtifact.load(tmp_path / "new").scores.tolist() == live


@pytest.mark.parametrize(("n_answered", "n_withheld", "n_labeled"), [(80, 20, 20), (40, 10, 10)])
def test_risk_labels_with_no_withheld_one_are_refused(
    old_artifact: Path, tmp_path: Path, n_answered: int, n_withheld: int, n_labeled: int
) -> None:
    """Issue 34's windows: 100 decisions, 80 answered, 20 of them labeled, none of the 20
    withheld labeled (Fisher p = 0.0105, which the old check let through); and 50
    decisions (p = 0.18). The mode is the logged rule's (risk)."""
    policy, monitor, log = _logged(old_artifact, RISK, tmp_path)
    scores, correct = _split(policy, n_answered, n_withheld, seed=11)
    _serve(policy, monitor, scores, correct, label=lambda i, d: i < n_labeled)
    assert sum(not r.abstained for r in monitor.records()) == n_answered
    with pytest.raises(InsufficientDataError, match=rf"none of the {n_withheld} withheld"):
        recalibrate(old_artifact, log, tmp_path / "new")


def test_risk_labels_that_depend_on_the_score_are_refused(old_artifact: Path, tmp_path: Path):
    """Half of the answered and half of the withheld decisions labeled — the same rate, so
    answered-vs-withheld tests see nothing — but the lower-score half of each: the rank
    test of labeled vs unlabeled scores refuses it."""
    policy, monitor, log = _logged(old_artifact, RISK, tmp_path)
    scores, correct = _split(policy, 240, 60, seed=12)
    low = np.zeros(scores.size, dtype=bool)
    for part in (np.arange(240), np.arange(240, 300)):
        low[part[np.argsort(scores[part])[: part.size // 2]]] = True
    _serve(policy, monitor, scores, correct, label=lambda i, d: bool(low[i]))
    with pytest.raises(InsufficientDataError, match=r"Mann-Whitney p = .* < 0\.01"):
        recalibrate(old_artifact, log, tmp_path / "new")


def test_risk_random_labels_are_accepted(old_artifact: Path, tmp_path: Path) -> None:
    """A random 40 % of all decisions labeled, withheld ones included: accepted; the new
    set is the labeled decisions and the check's level is recorded."""
    policy, monitor, log = _logged(old_artifact, RISK, tmp_path)
    scores, correct = _split(policy, 240, 60, seed=13)
    chosen = np.random.default_rng(14).uniform(size=scores.size) < 0.4
    _serve(policy, monitor, scores, correct, label=lambda i, d: bool(chosen[i]))
    summary = recalibrate(old_artifact, log, tmp_path / "new", check_level=0.05)
    check = summary.source["selection_check"]
    assert summary.mode == "risk" and summary.n_live == summary.n_labeled == int(chosen.sum())
    assert check["passed"] and check["level"] == 0.05 and check["labeled_abstained"] > 0
    kept = [r.score for r, c in zip(monitor.records(), chosen, strict=True) if c]
    assert GuardArtifact.load(tmp_path / "new").scores.tolist() == kept
    with pytest.raises(InvalidInputError, match="check_level"):
        recalibrate(old_artifact, log, tmp_path / "other", check_level=1.5)


def test_selection_check_refuses_random_labels_at_its_level() -> None:
    """Under score-blind labeling the selection check refuses about ``CHECK_LEVEL`` of
    windows (at most, up to 3 Monte-Carlo standard errors), over 1000 windows of 200."""
    rng = np.random.default_rng(15)
    refused = 0
    for _ in range(1000):
        scores = rng.uniform(size=200)
        labeled = rng.uniform(size=200) < 0.3
        records = [
            MonitorRecord(index=i, run_id=str(i), time="t", score=float(s), abstained=s > 0.8,
                          threshold=0.8, correct=True if lab else None)
            for i, (s, lab) in enumerate(zip(scores, labeled, strict=True))
        ]  # fmt: skip
        refused += not selection_check(records)["passed"]
    se = math.sqrt(CHECK_LEVEL * (1 - CHECK_LEVEL) / 1000)
    assert refused / 1000 <= CHECK_LEVEL + 3 * se


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
    """Risk mode (asked for explicitly on a participation log)."""
    policy, monitor, log = _logged(old_artifact, CONFIG, tmp_path)
    scores, correct = _population(np.random.default_rng(7), 300, shifted=True)
    _serve(policy, monitor, scores, correct, label=lambda i, d: not d.abstained)
    with pytest.raises(InsufficientDataError, match="not a score-blind sample"):
        recalibrate(old_artifact, log, tmp_path / "new", mode="risk")


GROUPED = GuardConfig(participation=0.8, group_by="relation")


def test_groups_are_kept_for_a_group_by_deployment(tmp_path: Path) -> None:
    """A ``group_by`` deployment runs on the recalibrated artifact: each decision's group is
    kept; decisions without a group (unknown to the guard) are left out and counted."""
    rng = np.random.default_rng(16)
    scores, correct = _population(rng, 300, shifted=False)
    old = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(
            scores, correct, groups=rng.choice(["capital", "currency"], size=300)
        ),
        model_fingerprint="m-1",
    ).save(tmp_path / "old")
    policy, monitor, log = _logged(old, GROUPED, tmp_path)
    live, live_correct = _population(rng, 210, shifted=True)
    groups = [None if i % 21 == 0 else str(rng.choice(["capital", "currency"])) for i in range(210)]
    _serve(policy, monitor, live, live_correct, groups=groups)
    recalibrate(old, log, tmp_path / "new")
    new = GuardArtifact.load(tmp_path / "new")
    grouped = [r for r in monitor.records() if r.group is not None]
    assert new.groups is not None and new.groups.tolist() == [r.group for r in grouped]
    assert new.scores.tolist() == [r.score for r in grouped]
    assert new.metadata["calibration_source"]["groups"] == {
        "kept": True,
        "left_out_without_group": 10,
    }
    _, decision = AbstentionPolicy(new, GROUPED).decide(_message(1.5), group="currency")
    assert decision.group == "currency" and decision.group_rule == "group"


def test_old_provenance_moves_under_recalibrated_from(tmp_path: Path) -> None:
    """The labels now come from feedback: the old data, judge, split and calibration config
    leave the top level for ``recalibrated_from``; the deployment record and the
    model-loading settings stay (they still say how the deployed answers are produced)."""
    scores, correct = _population(np.random.default_rng(17), 300, shifted=False)
    shipped = json.loads((Path(abstain_guard.__file__).parent / "default_guard/manifest.json")
                         .read_text())  # fmt: skip
    metadata = {
        "deployment": shipped["metadata"]["deployment"],
        "data": "builtin",
        "judge": {"open": "lexical(mode='containment', version=2)"},
        "config": {"model": "my-model", "gguf_file": "q4.gguf", "judge": "lexical", "limit": 9},
        "calibration_ids": ["q1", "q2"],
        "accuracy": {"calibration": 0.7},
    }
    old = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(scores, correct),
        model_fingerprint="m-1",
        metadata=metadata,
    ).save(tmp_path / "old")
    no_generation_record = GuardConfig(participation=0.8, on_mismatch="warn")
    policy, monitor, log = _logged(old, no_generation_record, tmp_path)
    live, live_correct = _population(np.random.default_rng(18), 120, shifted=True)
    _serve(policy, monitor, live, live_correct, label=lambda i, d: i % 2 == 0)
    recalibrate(old, log, tmp_path / "new", last=100)
    new = GuardArtifact.load(tmp_path / "new")
    assert set(new.metadata) == {"deployment", "config", "calibration_source", "recalibrated_from"}
    assert new.metadata["deployment"] == metadata["deployment"]
    assert new.metadata["config"] == {"model": "my-model", "gguf_file": "q4.gguf"}
    before = new.metadata["recalibrated_from"]
    assert before["metadata"] == metadata and before["artifact"] == str(old)
    assert before["n_calibration"] == 300 and before["model_fingerprint"] == "m-1"
    source = new.metadata["calibration_source"]
    assert source["labels"] == "monitor feedback"
    feedback = source["feedback"]
    assert (feedback["decisions"], feedback["last"], feedback["window"]) == (120, 100, 100)
    assert (feedback["used"], feedback["labeled"]) == (100, 50)


def test_log_of_another_artifact_is_refused(old_artifact: Path, tmp_path: Path) -> None:
    scores, correct = _population(np.random.default_rng(8), 100, shifted=False)
    other = GuardArtifact(PerplexityScorer(), CalibrationSet(scores, correct))
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
    assert rc == 0 and "120 live decisions, 120 labeled" in capsys.readouterr().out
    assert GuardArtifact.load(out).n == 120
    rc = main(["recalibrate", "--artifact", str(old_artifact), "--feedback", str(log),
               "--out", str(out), "--pool"])  # fmt: skip
    assert rc == 2 and "drop --pool" in capsys.readouterr().err


def test_cli_recalibrate_takes_mode_and_check_level(
    old_artifact: Path, tmp_path: Path, capsys
) -> None:
    """``--mode`` overrides the logged rule's mode and ``--check-level`` sets the level of the
    selection check (issue 45, item 4); an out-of-range level is one ``error:`` line."""
    policy, monitor, log = _logged(old_artifact, CONFIG, tmp_path)  # a participation log
    scores, correct = _split(policy, 240, 60, seed=13)
    chosen = np.random.default_rng(14).uniform(size=scores.size) < 0.4
    _serve(policy, monitor, scores, correct, label=lambda i, d: bool(chosen[i]))
    out = tmp_path / "new"
    rc = main(["recalibrate", "--artifact", str(old_artifact), "--feedback", str(log),
               "--out", str(out), "--mode", "risk", "--check-level", "0.05"])  # fmt: skip
    assert rc == 0 and "(risk mode)" in capsys.readouterr().out
    source = GuardArtifact.load(out).metadata["calibration_source"]
    assert source["mode"] == "risk" and source["selection_check"]["level"] == 0.05
    assert GuardArtifact.load(out).n == int(chosen.sum())  # the labeled decisions only
    rc = main(["recalibrate", "--artifact", str(old_artifact), "--feedback", str(log),
               "--out", str(tmp_path / "other"), "--check-level", "1.5"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "--check-level" in err and "1.5" in err
    assert not (tmp_path / "other").exists()
    with pytest.raises(SystemExit):
        main(["recalibrate", "--artifact", str(old_artifact), "--feedback", str(log),
              "--out", str(tmp_path / "other"), "--mode", "answer_all"])  # fmt: skip
    assert "invalid choice: 'answer_all'" in capsys.readouterr().err


def test_evaluate_live_on_a_recalibrated_artifact_names_the_original(
    old_artifact: Path, tmp_path: Path, capsys
) -> None:
    """``evaluate --live`` refuses a recalibrated artifact (no held-out questions) with the
    command to run: on the artifact first calibrated on held-out questions, even two
    recalibrations back, and says so when that artifact is no longer where it was."""
    policy, monitor, log = _logged(old_artifact, CONFIG, tmp_path, "first")
    _serve(policy, monitor, *_population(np.random.default_rng(20), 150, shifted=True))
    recalibrate(old_artifact, log, tmp_path / "new")
    policy, monitor, log = _logged(tmp_path / "new", CONFIG, tmp_path, "second")
    _serve(policy, monitor, *_population(np.random.default_rng(21), 150, shifted=True))
    recalibrate(tmp_path / "new", log, tmp_path / "newer")

    def refusal() -> str:
        rc = main(["evaluate", "--live", "--artifact", str(tmp_path / "newer"),
                   "--out", str(tmp_path / "live")])  # fmt: skip
        err = capsys.readouterr().err
        assert rc == 2 and "recalibrated from live feedback" in err
        assert not (tmp_path / "live").exists()
        return err

    err = refusal()
    assert f"evaluate --live --artifact {old_artifact}`" in err
    assert "recalibrated 2 times" in err and "with its monitor" in err
    old_artifact.rename(tmp_path / "moved")
    sha = GuardArtifact.load(tmp_path / "new").metadata["recalibrated_from"]["calibration_sha256"]
    err = refusal()
    assert f"no artifact at {old_artifact} now" in err and sha in err


def test_a_relative_artifact_path_is_recorded_absolute(
    old_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``recalibrate runs/old-guard ...`` from some folder: the provenance names the old
    artifact wherever the new one is read from later (it recorded the path as given)."""
    policy, monitor, log = _logged(old_artifact, CONFIG, tmp_path)
    scores, correct = _population(np.random.default_rng(5), 120, shifted=True)
    _serve(policy, monitor, scores, correct)
    monkeypatch.chdir(Path(old_artifact).parent)
    recalibrate(Path(old_artifact).name, log, tmp_path / "new", last=100)
    recorded = GuardArtifact.load(tmp_path / "new").metadata["recalibrated_from"]["artifact"]
    assert Path(recorded).is_absolute() and recorded == str(Path(old_artifact).resolve())


def test_evaluate_of_a_recalibrated_artifact_without_data_is_refused(
    old_artifact: Path, tmp_path: Path
) -> None:
    """Without ``--live``/``--data`` a recalibrated artifact has no held-out questions: the
    evaluation is refused with what to pass, never run on the built-in set instead (it did:
    the data fell back to "builtin")."""
    policy, monitor, log = _logged(old_artifact, CONFIG, tmp_path)
    _serve(policy, monitor, *_population(np.random.default_rng(22), 150, shifted=True))
    recalibrate(old_artifact, log, tmp_path / "new")
    with pytest.raises(DatasetError, match=r"recalibrated from live decisions.*--data FILE"):
        artifact_splits(GuardArtifact.load(tmp_path / "new"))
