"""Guard an API-style chat model by perplexity from its logprobs (no hidden states).

    python examples/api_model_perplexity.py

Hosted chat models (e.g. ``ChatOpenAI(logprobs=True)``) return OpenAI-style token
logprobs in ``response_metadata["logprobs"]``; :class:`PerplexityScorer` reads only those,
so the guard needs neither torch nor access to the model's weights. To run offline, this
example stands the embedded model in for the API: ``LogprobsOnlyChatModel`` forwards to it
and passes on nothing but the text and the OpenAI-style logprobs.

Calibration is the same as for any model: answer held-out questions the way users will ask
them, judge the answers, and store the scores and labels in an artifact.
"""

from __future__ import annotations

from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig, PerplexityScorer
from abstain_guard.calibration.build.datasets import split_items
from abstain_guard.calibration.build.judges import LexicalJudge
from abstain_guard.calibration.build.probe import builtin_probe_set
from abstain_guard.prompts import build_messages, question_prompt


class LogprobsOnlyChatModel(BaseChatModel):
    """A chat model that exposes what a hosted API would: text + OpenAI-style logprobs."""

    inner: Any

    @property
    def _llm_type(self) -> str:
        return "logprobs-only"

    def _generate(
        self, messages: list[BaseMessage], stop: list[str] | None = None, **kwargs: Any
    ) -> ChatResult:
        full = self.inner.invoke(messages, stop=stop)
        meta = {"logprobs": full.response_metadata["logprobs"], "model_name": "api-model"}
        return ChatResult(
            generations=[
                ChatGeneration(message=AIMessage(content=full.content, response_metadata=meta))
            ]
        )


def calibrate_perplexity(api_model: BaseChatModel, n_questions: int = 120) -> GuardArtifact:
    """Answer calibration questions, judge them lexically, store perplexity scores."""
    items = split_items(builtin_probe_set(relations=("capital", "currency")), seed=0)
    questions = items["calibration"][:n_questions]
    replies = api_model.batch([build_messages(it) for it in questions])
    judge = LexicalJudge()
    scorer = PerplexityScorer()
    scores = [scorer.score(r) for r in replies]
    correct = [
        bool(judge.judge(it.question, list(it.answers), str(r.content)).correct)
        for it, r in zip(questions, replies, strict=True)
    ]
    print(f"calibrated on {len(correct)} answers, {sum(correct)} correct")
    return GuardArtifact.from_calibration(scorer=scorer, scores=scores, correct=correct)


def main(model: Any = None, n_questions: int = 120) -> list[AIMessage]:
    """Calibrate, then ask with a participation target; return the guarded messages.

    Participation mode certifies the answer rate with a few dozen calibration answers; a
    risk target (``mode="risk"``) certifies the error among answered questions but needs
    many more (see docs/guarantees.md).
    """
    if model is None:
        from abstain_guard.adapters import load_default_model

        model = load_default_model(max_new_tokens=24)  # as calibrated
    api_model = LogprobsOnlyChatModel(inner=model.bind(capture_geometry=False))
    artifact = calibrate_perplexity(api_model, n_questions)
    guard = AbstentionGuard(api_model, artifact=artifact, config=GuardConfig(participation=0.5))
    print(f"threshold {guard.threshold:.4g}; guarantee {guard.decision_rule.guarantee}")
    chain = question_prompt() | guard
    out = []
    for question in ["What is the capital of Canada?", "What is the capital of Eswatini?"]:
        msg = chain.invoke({"question": question})
        info = msg.response_metadata["abstention"]
        print(f"{question} -> {msg.content!r} (perplexity {info['score']:.3f})")
        out.append(msg)
    return out


if __name__ == "__main__":
    main()
