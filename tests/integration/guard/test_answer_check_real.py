"""The shipped guard checks answers it did not generate: the embedded model's own answers to a
handful of questions, checked by ``AbstentionGuard.check`` (token ids and logged text) and by
``abstain-guard score``, get the guard's own decisions; an answer the model would not have
given is refused. The check replays each answer as calibration scored its answers (one
sequence per pass, split at the shared prefix), the guard scored it from KV-cached decoding:
on the calibration machine's kernels the two agree bit for bit, on others within the
library's stated tolerance (the guard's kernel note says so in both decisions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from abstain_guard import default_artifact_path
from abstain_guard.cli import main
from abstain_guard.contract.kernels import STATED_TOLERANCE
from abstain_guard.errors import ArtifactMismatchError
from abstain_guard.guard import chains
from abstain_guard.guard.policy import decision_of

pytestmark = pytest.mark.model

QUESTIONS = [
    "Who wrote Hamlet?",
    "What is the capital of France?",
    "Who painted the Mona Lisa?",
    "What year did the Berlin Wall fall?",
]


def test_the_shipped_guard_decides_on_its_own_answers_as_it_did(
    default_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chain, guard, artifact = chains.load_guard_chain(default_artifact_path(), model=default_model)
    live = chain.batch([{"question": q} for q in QUESTIONS])
    rows = []
    for question, message in zip(QUESTIONS, live, strict=True):
        x = chain.first.invoke({"question": question})
        own, checked = decision_of(message), guard.check(x, message)
        assert own is not None and checked.model == artifact.model_fingerprint
        assert abs(checked.score - own.score) <= STATED_TOLERANCE
        assert checked.guarantee == own.guarantee
        if abs(own.score - own.threshold) > STATED_TOLERANCE:
            assert checked.abstained == own.abstained
        withheld = message.response_metadata.get("withheld_response") or {}
        meta = withheld.get("response_metadata") or message.response_metadata
        text = withheld.get("content", message.content)
        logged = {"answer": text, "finish_reason": meta["finish_reason"]}
        if default_model.tokenizer.encode(text, add_special_tokens=False) == [
            t for t in meta["token_ids"] if t not in (default_model.tokenizer.eos_token_id,)
        ]:
            assert guard.check(x, logged) == checked  # the logged text replays the same ids
        rows.append(
            {"id": question, "question": question, **logged, "token_ids": meta["token_ids"]}
        )
    with pytest.raises(ArtifactMismatchError, match="greedy choice"):
        guard.check(chain.first.invoke({"question": QUESTIONS[0]}), "Banana bread.")
    data, out = tmp_path / "answers.jsonl", tmp_path / "decisions.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(chains, "load_chat_model", lambda *a, **k: default_model)
    assert main(["score", "--data", str(data), "--out", str(out)]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    for row, line in zip(rows, written, strict=True):
        x = chain.first.invoke({"question": row["question"]})
        assert line == {"id": row["id"], "decision": guard.check(x, row).to_dict()}
