"""The human review: drawn by the tool, written without the judge's verdict, read back into
the artifact (refusing any other sample), the review-size simulation, an LLM judge named by
configuration alone, and question-only rows."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration.building.judges.llm import LLMJudge
from abstain_guard.calibration.building.judges.registry import make_judge
from abstain_guard.calibration.building.questions.dataset_files import Fields, load_dataset
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.review import (
    REVIEW_COLUMNS,
    ReviewDraw,
    apply_review,
    draw_review,
    read_review_file,
    recommended_size,
    review_path,
    review_seed,
    review_size_table,
    start_review,
    write_review_file,
)
from abstain_guard.cli.commands import main
from abstain_guard.errors import InvalidInputError, JudgeError
from abstain_guard.scorers import PerplexityScorer

N = 600


def _calibrated(tmp_path: Path, scope: float | None = 1.0) -> tuple[Path, np.ndarray, list[QAItem]]:
    """An artifact with a drawn review, its review file, and the truth of every answer."""
    rng = np.random.default_rng(0)
    s = rng.random(N)
    right = rng.random(N) >= 0.05 + 0.75 * s
    judge_right = right | (rng.random(N) < 0.3)  # a lenient judge
    items = [QAItem(id=f"q{i}", question=f"Question {i}?", answers=(f"a{i}",)) for i in range(N)]
    metadata: dict = {"calibration_ids": [it.id for it in items], "judge": {"open": "lexical"}}
    out = tmp_path / "guard"
    config = type("C", (), {"review_scope": scope, "risk_target": 0.35})()
    draw = start_review(out, metadata, 200, (s, judge_right), config)
    assert draw is not None
    GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(s, judge_right), metadata=metadata
    ).save(out)
    answers = {it.id: {"text": f"answer {it.id}"} for it in items}
    write_review_file(review_path(out), draw, items, answers)
    return out, right, items


def _fill(path: Path, right: np.ndarray, *, drop: int = 0, extra: str | None = None) -> None:
    rows = list(csv.DictReader(path.open()))
    for r in rows:
        r["correct"] = "yes" if right[int(r["id"][1:])] else "no"
    rows = rows[drop:]
    if extra is not None:
        rows.append({**rows[0], "id": extra})
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=REVIEW_COLUMNS)
        w.writeheader()
        w.writerows(rows)


def test_the_draw_is_uniform_seeded_by_the_ids_and_recorded() -> None:
    ids = [f"q{i}" for i in range(100)]
    judge = np.ones(100, bool)
    a = draw_review(ids, 30, scores=np.zeros(100), judge_correct=judge, scope=1.0)
    b = draw_review(ids, 30, scores=np.zeros(100), judge_correct=judge, scope=1.0)
    assert a == b and len(set(a.ids)) == 30 and a.seed == review_seed(ids)
    assert review_seed(ids[::-1]) != a.seed  # another calibration set, another draw
    # uniform: every answer is drawn about equally often over many calibration sets
    counts = np.zeros(100)
    for k in range(400):
        named = [f"{k}-{i}" for i in range(100)]
        for i in draw_review(named, 10, scores=np.zeros(100), judge_correct=judge, scope=1.0).ids:
            counts[int(i.split("-")[1])] += 1
    assert counts.min() > 15 and counts.max() < 65  # expected 40 each
    scores = np.arange(100.0)
    scoped = draw_review(ids, 20, scores=scores, judge_correct=judge, scope=0.3)
    assert scoped.eligible == 30 and all(int(i[1:]) < 30 for i in scoped.ids)
    with pytest.raises(InvalidInputError, match="between 1 and 30"):
        draw_review(ids, 31, scores=scores, judge_correct=judge, scope=0.3)


def test_a_planned_draw_reads_a_planning_share_and_reviews_below_its_cutoff() -> None:
    """The scope comes from the planning answers' judge labels (where their error rate
    crosses ε, times 1.25); the planning answers are never drawn."""
    n = 2000
    ids = [f"q{i}" for i in range(n)]
    scores = np.arange(n, dtype=float)
    judge = scores < 400  # judge error 0 on the 400 most confident, 1 above
    draw = draw_review(ids, 100, scores=scores, judge_correct=judge, risk_target=0.5)
    planning = {int(i[1:]) for i in draw.planning_ids}
    assert len(planning) == 300 and not planning & {int(i[1:]) for i in draw.ids}
    # the planning answers' error rate stays <= 0.5 up to about rank 800 of 2000
    assert draw.score_cutoff is not None and 850 < draw.score_cutoff < 1200
    assert all(scores[int(i[1:])] <= draw.score_cutoff for i in draw.ids)
    human = draw.human_codes(ids, scores)
    assert (human == -3).sum() == 300 and (human == -2).sum() > 0


def test_review_file_hides_the_judge_and_is_read_back_into_the_artifact(tmp_path: Path) -> None:
    out, right, _ = _calibrated(tmp_path)
    path = review_path(out)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(REVIEW_COLUMNS) and len(rows) == 200
    assert all(r["correct"] == "" for r in rows)  # the judge's verdict is not shown
    manifest = json.loads((out / "manifest.json").read_text())
    review = manifest["metadata"]["review"]
    assert review["seed"] == review_seed([f"q{i}" for i in range(N)])
    assert review["size"] == 200 and review["status"] == "drawn"
    assert review["judge"] == {"open": "lexical"} and len(review["judge_sha256"]) == 64
    assert review["ids"] == [r["id"] for r in rows]
    _fill(path, right)
    artifact = apply_review(out, path)
    assert artifact.human is not None and int((artifact.human >= 0).sum()) == 200
    loaded = GuardArtifact.load(out)
    assert loaded.metadata["review"]["status"] == "reviewed"
    assert np.array_equal(loaded.human, artifact.human)
    g = loaded.decision_rule(
        GuardConfig(mode="risk", risk_target=0.35, on_infeasible="abstain_all")
    ).guarantee
    assert g.labels == "human" and "certified on human labels (m = 200" in g.statement


def test_a_review_of_other_answers_is_refused(tmp_path: Path) -> None:
    out, right, _ = _calibrated(tmp_path)
    path = review_path(out)
    draw = ReviewDraw.from_json(GuardArtifact.load(out).metadata["review"])
    _fill(path, right, drop=1)
    with pytest.raises(InvalidInputError, match="lacks 1 of the 200"):
        read_review_file(path, draw)
    _fill(path, right, extra="q9999")
    with pytest.raises(InvalidInputError, match="was not drawn"):
        read_review_file(path, draw)
    rows = list(csv.DictReader(path.open()))
    rows[3]["correct"] = "maybe"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=REVIEW_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    with pytest.raises(InvalidInputError, match="write yes or no"):
        read_review_file(path, draw)
    assert GuardArtifact.load(out).human is None  # nothing was written


def test_a_scoped_review_certifies_only_inside_its_scope(tmp_path: Path) -> None:
    out, right, _ = _calibrated(tmp_path, scope=0.5)
    _fill(review_path(out), right)
    artifact = apply_review(out, review_path(out))
    assert artifact.human is not None and int((artifact.human == -2).sum()) == N // 2
    rule = artifact.decision_rule(
        GuardConfig(mode="risk", risk_target=0.45, on_infeasible="abstain_all")
    )
    # rank 301 is the last rank with only in-scope answers below it
    assert rule.threshold <= np.sort(artifact.scores)[N // 2]
    assert "among the 300 calibration answers below the review's score cutoff" in (
        rule.guarantee.statement
    )


def test_the_review_cli_prints_the_judge_quality(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, right, _ = _calibrated(tmp_path)
    _fill(review_path(out), right)
    assert main(["review", "--artifact", str(out), "--labels", str(review_path(out))]) == 0
    text = capsys.readouterr().out
    assert "read 200 reviewed answers" in text and "lenient rate" in text
    assert main(["review", "--artifact", str(tmp_path / "none"), "--labels", "x.csv"]) == 2


def _rewrite(out: Path, **changes: object) -> None:
    """Change the artifact's recorded draw or judge, as a second draw or a re-judge would."""
    art = GuardArtifact.load(out)
    metadata = dict(art.metadata)
    review = dict(metadata["review"])
    for key, value in changes.items():
        if key == "judge":
            metadata["judge"] = value
        else:
            review[key] = value
    metadata["review"] = review
    art.replace(metadata=metadata).save(out, overwrite=True)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"seed": 12345}, "seed is not the one derived"),
        ({"judge": {"open": "llm:another"}}, "judge is not the one"),
        ({"judge_sha256": "0" * 64}, "judge's labels changed"),
    ],
)
def test_review_refuses_a_draw_whose_seed_or_judge_changed(
    tmp_path: Path, change: dict, why: str
) -> None:
    out, right, _ = _calibrated(tmp_path)
    _fill(review_path(out), right)
    _rewrite(out, **change)
    with pytest.raises(InvalidInputError, match=why):
        apply_review(out, review_path(out))
    assert GuardArtifact.load(out).human is None


def test_review_refuses_a_second_draw(tmp_path: Path) -> None:
    """Other drawn ids under the ids' own seed: not the tool's draw."""
    out, right, _ = _calibrated(tmp_path)
    art = GuardArtifact.load(out)
    ids = list(art.metadata["review"]["ids"])
    other = [f"q{i}" for i in range(N) if f"q{i}" not in set(ids)][:1]
    _rewrite(out, ids=other + ids[1:])
    path = review_path(out)
    rows = list(csv.DictReader(path.open()))
    rows[0]["id"] = other[0]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=REVIEW_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    _fill(path, right)
    with pytest.raises(InvalidInputError, match="not the one its seed makes"):
        apply_review(out, path)


def test_a_planned_review_is_read_back_and_certifies_on_the_others(tmp_path: Path) -> None:
    out, right, _ = _calibrated(tmp_path, scope=None)
    _fill(review_path(out), right)
    artifact = apply_review(out, review_path(out))
    assert artifact.human is not None and int((artifact.human == -3).sum()) == 90
    res = artifact.decision_rule(
        GuardConfig(mode="risk", risk_target=0.45, on_infeasible="abstain_all")
    ).guarantee
    assert res.reviewed == 200 and res.n == N - 90


def test_review_size_grows_with_m_and_recommends_one(tmp_path: Path) -> None:
    out, _, _ = _calibrated(tmp_path)
    art = GuardArtifact.load(out)
    rows = review_size_table(
        (art.scores, art.correct), (0.35, 0.1), 0.02, sizes=(20, 300), draws=12, seed=1
    )
    assert [r.m for r in rows] == [20, 300]
    assert rows[0].median_participation <= rows[1].median_participation
    assert rows[1].certifiable > 0 and recommended_size(rows) in (20, 300)
    scoped = review_size_table(
        (art.scores, art.correct), (0.35, 0.1), 0.02, sizes=(100, 400), draws=4, scope=0.5
    )
    assert [r.m for r in scoped] == [100]  # 400 cannot be drawn among 300


def test_the_review_size_cli_recommends_a_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _, _ = _calibrated(tmp_path)
    argv = ["review-size", "--artifact", str(out), "--judge-error", "0.02", "--draws", "3"]
    assert main([*argv, "--sizes", "20", "300", "--risk-target", "0.45"]) == 0
    text = capsys.readouterr().out
    assert "planned scope" in text and "recommended: calibrate --review " in text


def test_an_llm_judge_by_configuration_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test")
    judge = make_judge(
        {
            "name": "llm",
            "base_url": "http://127.0.0.1:9/v1",
            "model": "Qwen/Qwen3-8B",
            "api_key_env": "MY_JUDGE_KEY",
        }
    )
    assert isinstance(judge, LLMJudge)
    chat = judge.chat_model
    assert type(chat).__name__ == "ChatOpenAI"
    assert str(chat.openai_api_base).rstrip("/") == "http://127.0.0.1:9/v1"  # type: ignore[attr-defined]
    assert chat.model_name == "Qwen/Qwen3-8B"  # type: ignore[attr-defined]
    assert chat.openai_api_key.get_secret_value() == "sk-test"  # type: ignore[attr-defined]
    spec = make_judge(
        {
            "name": "llm",
            "model": {
                "class_path": "langchain_core.language_models.fake_chat_models:FakeListChatModel",
                "kwargs": {"responses": ['{"correct": false, "rationale": "no"}']},
            },
        }
    )
    verdict = spec.judge("What is the capital of Peru?", (), "Quito")  # no reference
    assert verdict.correct is False
    with pytest.raises(JudgeError, match="the server serves"):
        make_judge({"name": "llm", "base_url": "http://127.0.0.1:9/v1"})


def test_question_only_rows_load_for_an_llm_judge(tmp_path: Path) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "Capital of Peru?"}\n{"question": "2+2?", "answer": "4"}\n')
    items, report = load_dataset(data, Fields(answers_optional=True))
    assert [it.answers for it in items] == [(), ("4",)] and not report.skipped
    items, report = load_dataset(data)
    assert len(items) == 1 and "missing answer" in report.skipped[0].reason
