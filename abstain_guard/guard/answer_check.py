"""Deciding on answers the guard did not generate (``AbstentionGuard.check``,
``abstain-guard score``): which scorers can score one and how, the checks that the answer
could have come from the calibrated deployment, and a logged answer's record
(:class:`LoggedAnswer`, one line of an answers file).

The guarded runnable runs as deployed (its prompt, bound settings and model checks), with its
chat model re-reading the given answer instead of generating one
(:func:`~abstain_guard.contract.given_answer.with_given_answer`): a scorer whose reads a
local model's replay computes (logprobs, entropies, geometry, hidden states, or the model
itself: P(True), attention, its own samples) scores the replay, which is how calibration
scored its own answers (one sequence per pass, the generated token ids behind the same
prompt ids); a black-box scorer scores the answer as its first sample beside k - 1 fresh
ones, which holds in distribution. Under greedy decoding an answer whose tokens are not the
model's greedy choices is refused: calibration scored only answers the model generates.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.contract.deployment import PromptRecord
from abstain_guard.contract.given_answer import (
    GivenAnswer,
    given_answer_mismatches,
    with_given_answer,
)
from abstain_guard.errors import ArtifactMismatchError, InvalidInputError
from abstain_guard.guard.policy import AbstentionPolicy

#: What each route needs of the guarded chat model (named when a model cannot re-read).
_NEEDS = {
    "replay": "reads what a local model computes over the answer ({reads}); only a local model "
    "(GeometryChatModel) replays an answer",
    "samples": "scores the answer beside k - 1 fresh samples of the model it wraps",
}


def given_runnable(prepared: Any, artifact: GuardArtifact, answer: GivenAnswer) -> tuple[Any, str]:
    """``prepared`` (the guard's runnable) with its chat models re-reading ``answer`` for
    ``artifact``'s scorer, and the route (``"replay"`` or ``"samples"``).

    Raises:
        GivenAnswerError: the scorer cannot score a given answer (the message names the
            kinds that can), or a chat model in ``prepared`` cannot re-read one.
    """
    route, scorer = artifact.answer_route(), artifact.scorer
    why = f"the scorer {scorer.name!r} " + _NEEDS[route].format(
        reads=", ".join(sorted(type(scorer).reads or ()))
    )
    return with_given_answer(prepared, answer, why), route


def answer_problems(policy: AbstentionPolicy, output: Any, route: str) -> list[str]:
    """Why an answer re-read on ``route`` could not have come from the calibrated deployment,
    as the policy's mismatches (:meth:`~.policy.AbstentionPolicy.mismatch`: raised, or
    returned as warnings with ``on_mismatch="warn"``); only replayed answers are checked (a
    black-box scorer's first sample is one of a sampled plan, not a greedy answer).

    Raises:
        ArtifactMismatchError: there are problems and the config says raise.
    """
    record = policy.deployment
    if record is None or route != "replay" or not isinstance(output, AIMessage):
        return []
    meta = output.response_metadata or {}
    if "replay_source" not in meta:
        return []
    return policy.mismatch(given_answer_mismatches(record.decoding, meta), "answer")


_ABSENT = object()


@dataclass(frozen=True)
class LoggedAnswer:
    """One logged answer to check (a line of ``abstain-guard score --data``): ``question``,
    ``answer`` and optionally ``id``, ``token_ids``, ``finish_reason``, the recorded
    ``model_fingerprint`` and ``system_prompt`` (``null``: none) it was generated with."""

    id: str
    question: str
    answer: GivenAnswer
    model_fingerprint: str | None = None
    system_prompt: Any = _ABSENT

    @classmethod
    def parse(cls, line: str, number: int) -> LoggedAnswer:
        """The record on line ``number`` (1-based; the default id).

        Raises:
            InvalidInputError: not a JSON object with a string question and answer.
        """
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"line {number} is not JSON ({exc}).") from exc
        if not isinstance(row, Mapping) or not isinstance(row.get("question"), str):
            raise InvalidInputError(f"line {number} is not an object with a string 'question'.")
        if not isinstance(row.get("answer"), str):
            raise InvalidInputError(f"line {number} has no string 'answer'.")
        fingerprint = row.get("model_fingerprint")
        return cls(
            id=str(row.get("id", number)),
            question=row["question"],
            answer=GivenAnswer.of(row),
            model_fingerprint=None if fingerprint is None else str(fingerprint),
            system_prompt=row.get("system_prompt", _ABSENT),
        )

    def check(self, artifact: GuardArtifact, prompt: PromptRecord) -> None:
        """Refuse an answer recorded with another model or system prompt than calibration's.

        Raises:
            ArtifactMismatchError: the recorded fingerprint or system prompt differs.
        """
        problems = []
        expected = artifact.model_fingerprint
        if self.model_fingerprint is not None and self.model_fingerprint != expected:
            problems.append(
                f"it was generated by model {self.model_fingerprint!r}, but the guard was "
                f"calibrated for {expected!r}"
            )
        if self.system_prompt is not _ABSENT and self.system_prompt != prompt.system_prompt:
            problems.append(
                f"it was generated with the system prompt {self.system_prompt!r}, but the "
                f"guard was calibrated with {prompt.system_prompt!r}"
            )
        if problems:
            raise ArtifactMismatchError(
                f"The answer {self.id!r} cannot be checked against this calibration: "
                + "; ".join(problems)
                + "."
            )
