"""``calibrate`` on an API chat model, end to end and without fakes: ``langchain_openai``'s
``ChatOpenAI`` against ``abstain-guard serve --no-guard`` (the embedded model behind the
OpenAI endpoint on a free loopback port, logprobs on), a perplexity guard calibrated on it,
then deployed around the same ``ChatOpenAI``: its live scores are the stored ones."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pipeline_fakes import api_model_config, chat_openai_kwargs, completions_served

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.calibration.building.judges.lexical import LexicalJudge
from abstain_guard.calibration.building.judges.registry import make_judge
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.building.review import review_seed
from abstain_guard.cli.commands import main
from abstain_guard.errors import ArtifactMismatchError, LogprobsMissingError
from abstain_guard.guard.chains import load_guard_chain
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.runner import ServerThread

pytestmark = [pytest.mark.model, pytest.mark.slow]

openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")

SECRET = "sk-calibration-key-never-written"
#: 24 questions split 1:1:4:1: 13 calibration answers, each asked again live.
ITEMS = [it for it in builtin_probe_set(relations=("capital", "currency"))][:24]


@pytest.fixture(scope="module")
def server(default_model: Any) -> Any:
    with ServerThread(ModelService(default_model, model_name="smollm2", max_tokens=64)) as srv:
        yield srv


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One calibration cache for the module's runs on the same questions and settings: the
    model answers each question once (the judge and review differ, which the cache keys
    apart)."""
    return tmp_path_factory.mktemp("answers")


def test_the_raw_model_answers_with_logprobs_and_no_decision(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2",
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    choice = raw.parse().choices[0]
    assert choice.message.content
    assert 1 <= len(choice.logprobs.content) <= 8
    assert all(t.logprob <= 0.0 and len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert "abstention" not in (choice.model_extra or {})
    assert not any(h.startswith("x-abstain-guard") for h in raw.headers)
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=65
        )
    with pytest.raises(openai.BadRequestError, match="role 'tool'"):
        client.chat.completions.create(
            model="smollm2",
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "tool", "content": "x", "tool_call_id": "1"},
            ],
        )


def test_a_guard_calibrated_on_the_api_model_scores_live_as_stored(
    server: ServerThread, tmp_path: Path, answers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = api_model_config(server.base_url, answers, api_key=SECRET)
    summary = calibrate(ITEMS, tmp_path / "guard", config=cfg, progress=False)
    art = GuardArtifact.load(tmp_path / "guard")
    n = summary.split_sizes["calibration"]
    assert n >= 12 and art.scores.shape == (n,)
    record = art.metadata["deployment"]
    assert record["chat_model"]["spec"]["kwargs"] == chat_openai_kwargs(
        server.base_url
    )  # no api_key
    assert record["chat_model"]["settings"]["logprobs"] is True  # asked for
    assert art.model_fingerprint == record["model_fingerprint"]
    assert art.model_fingerprint.startswith("chat_model:")
    written = [*Path(tmp_path / "guard").rglob("*"), *Path(answers / "run.cache").rglob("*")]
    assert not [p for p in written if p.is_file() and SECRET.encode() in p.read_bytes()]

    # deployed around the same ChatOpenAI (built by the user, another key): live = stored
    chat = langchain_openai.ChatOpenAI(
        **chat_openai_kwargs(server.base_url), api_key="deploy-key", logprobs=True
    )
    chain, guard, _ = load_guard_chain(art, GuardConfig(participation=0.5), model=chat)
    by_id = {it.id: it for it in ITEMS}
    cal = [by_id[i] for i in art.metadata["calibration_ids"]]
    # asked at once, as a served model is (LangChain's batch: one thread per question)
    replies = chain.batch([{"question": it.prompt_text()} for it in cal])
    decisions = [r.response_metadata["abstention"] for r in replies]
    live = np.array([d["score"] for d in decisions])
    assert np.array_equal(live, art.scores)
    threshold = guard.threshold
    assert all(d["abstained"] == (d["score"] > threshold) for d in decisions)
    assert any(d["abstained"] for d in decisions) and not all(d["abstained"] for d in decisions)
    assert decisions[0]["guarantee"]["warnings"] == []
    assert "system prompt" in decisions[0]["guarantee"]["unverified"][0]

    # rebuilt from the recorded spec alone (the key from the environment)
    monkeypatch.setenv("OPENAI_API_KEY", "from-the-environment")
    rebuilt, _, _ = load_guard_chain(tmp_path / "guard", GuardConfig(participation=0.5))
    again = rebuilt.invoke({"question": cal[0].prompt_text()})
    assert again.response_metadata["abstention"]["score"] == art.scores[0]

    # another setting than calibrated is refused before any request
    hotter = langchain_openai.ChatOpenAI(
        **chat_openai_kwargs(server.base_url), api_key="k", logprobs=True, temperature=0.7
    )
    with pytest.raises(ArtifactMismatchError, match=r"temperature=0\.7 \(calibrated: None\)"):
        load_guard_chain(art, GuardConfig(participation=0.5), model=hotter)

    # a second run on the same cache sends nothing and writes the same scores
    before = completions_served(server.base_url)
    calibrate(ITEMS, tmp_path / "again", config=cfg, progress=False)
    assert completions_served(server.base_url) == before
    assert np.array_equal(GuardArtifact.load(tmp_path / "again").scores, art.scores)


def test_an_api_model_without_logprobs_is_a_typed_error_naming_the_question(
    server: ServerThread, tmp_path: Path
) -> None:
    cfg = api_model_config(server.base_url, tmp_path, api_key="k", logprobs=False)
    with pytest.raises(LogprobsMissingError, match="logprobs: true") as info:
        calibrate(ITEMS, tmp_path / "guard", config=cfg, progress=False)
    assert re.search(r"question '[^']+' \(", str(info.value))
    assert not (tmp_path / "guard").exists()


def test_questions_only_judged_by_an_llm_judge_at_a_url_then_reviewed(
    server: ServerThread, tmp_path: Path, answers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file of questions without answers, judged by an LLM judge named in the config only,
    a review drawn by calibrate, filled by "people" (the probe set's gold, checked
    lexically), read back by ``abstain-guard review``: the decisions say they are certified
    on human labels."""
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": it.question}) + "\n" for it in ITEMS))
    # the embedded model is no judge (docs/results.md): through the URL it answers the
    # question instead of giving a verdict, which is "no judgment", never a guess
    at_url = make_judge(
        {"name": "llm", "base_url": server.base_url, "model": "smollm2", "structured": False}
    )
    asked = completions_served(server.base_url)
    verdict = at_url.judge(ITEMS[0].question, (), "Lima")  # type: ignore[attr-defined]
    assert completions_served(server.base_url) > asked and verdict.correct in (None, True, False)
    # the team's judge, named in the config alone (here a scripted LangChain chat model in
    # place of a capable judge, which this offline machine does not have)
    replies = ['{"correct": true}', '{"correct": false}', '{"correct": false}']
    judge = {
        "name": "llm",
        "model": {
            "class_path": "langchain_core.language_models.fake_chat_models:FakeListChatModel",
            "kwargs": {"responses": replies},
        },
    }
    cfg = api_model_config(server.base_url, answers, api_key="k").model_copy(
        update={"judge": judge, "review_size": 6, "review_scope": 1.0, "delta": 0.2}
    )
    calibrate(data, tmp_path / "guard", config=cfg, progress=False)
    review = tmp_path / "guard.review.csv"
    rows = list(csv.DictReader(review.open()))
    assert len(rows) == 6 and all(r["reference"] == "" and r["correct"] == "" for r in rows)
    gold = {it.question: it.answers for it in ITEMS}
    lexical = LexicalJudge()
    for r in rows:  # the people's verdicts
        ok = lexical.judge(r["question"], gold[r["question"]], r["answer"]).correct
        r["correct"] = "yes" if ok else "no"
    with review.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    argv = ["review", "--artifact", str(tmp_path / "guard"), "--labels", str(review)]
    assert main([*argv, "--risk-target", "0.9", "--delta", "0.2"]) == 0
    assert "read 6 reviewed answers" in capsys.readouterr().out
    art = GuardArtifact.load(tmp_path / "guard")
    assert art.metadata["review"]["seed"] == review_seed(art.metadata["calibration_ids"])
    assert art.metadata["judge"]["open"].startswith("llm")
    rule = art.decision_rule(
        GuardConfig(mode="risk", risk_target=0.9, delta=0.2, on_infeasible="abstain_all")
    )
    assert "certified on human labels (m = 6" in rule.guarantee.statement
    assert rule.guarantee.judge_quality["m"] == 6
