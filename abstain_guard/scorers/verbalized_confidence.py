"""Verbalized confidence: the chat model is asked, after answering, how confident it is
(0-100); the score is ``1 - confidence / 100`` (:class:`VerbalizedConfidenceScorer`; the
parser :func:`parse_verbalized_confidence`). Works on any LangChain chat model: no logprobs.

A reply that states no single confidence (a refusal, a range, another scale) cannot be
scored: :class:`~abstain_guard.errors.ConfidenceParseError` (a ``ScoringError``), so the
guard fails closed and abstains
(or raises, ``on_error="raise"``).
"""

from __future__ import annotations

import re

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import ConfidenceParseError, ConfigError, ScoringError
from abstain_guard.scorers._base import ScorerState
from abstain_guard.scorers._blackbox_sampling import (
    SampledScorer,
    SamplingPlan,
    SimilarityModel,
    read_samples,
)

CONFIDENCE_PROMPT = (
    "How confident are you that your answer above is correct? Reply with only a number "
    "from 0 (certainly wrong) to 100 (certainly correct)."
)
"""What the model is asked about its answer (recorded with the scorer)."""

_SCALE = re.compile(r"\b0\s*(?:-|–|to)\s*100\b", re.IGNORECASE)
_NUMBER = re.compile(
    r"(?<![\w.\-/])(\d+(?:\.\d+)?)(?![\w.]*\d|\w)\s*(%|percent\b|/\s*100\b|out of 100\b)?",
    re.IGNORECASE,
)
_OTHER_SCALE = re.compile(r"^\s*(?:/|out of)\s*(\d+)", re.IGNORECASE)


def parse_verbalized_confidence(reply: str) -> float:
    """The confidence a reply states, in ``[0, 1]``.

    Read: ``"85"``, ``"85%"``, ``"Confidence: 85/100"``, ``"I'd say 85 out of 100"``,
    ``"On a scale of 0 to 100: 85"`` (the scale itself is not a confidence), and a bare
    fraction ``"0.85"`` (a number strictly between 0 and 1 with a decimal point and no
    percent sign). A value stated twice the same way (``"85. Confidence 85%"``) is one value.

    Raises:
        ConfidenceParseError: the reply states no number, several different ones (``"70 or 80"``),
            one above 100, or one on another scale (``"8/10"``).
    """
    text = _SCALE.sub(" ", str(reply))
    values: list[tuple[float, bool]] = []
    for match in _NUMBER.finditer(text):
        rest = text[match.end(1) :]
        other = _OTHER_SCALE.match(rest)
        if other is not None and other.group(1) != "100":
            raise ConfidenceParseError(
                f"The confidence reply {reply!r} uses another scale than 0-100."
            )
        number, unit = match.group(1), match.group(2)
        value = float(number)
        if unit is None and "." in number and 0.0 < value < 1.0:
            value *= 100.0
        values.append((value, unit is not None))
    with_unit = {v for v, has_unit in values if has_unit}
    distinct = with_unit or {v for v, _ in values}
    if len(distinct) != 1:
        what = "no confidence" if not distinct else f"several ({sorted(distinct)})"
        raise ConfidenceParseError(
            f"The confidence reply {reply!r} states {what}; one number from 0 to 100 is needed."
        )
    value = distinct.pop()
    if not 0.0 <= value <= 100.0:
        raise ConfidenceParseError(f"The confidence reply {reply!r} states {value}, outside 0-100.")
    return value / 100.0


class VerbalizedConfidenceScorer(SampledScorer):
    """The model's own stated confidence in its answer, asked after it (any chat model).

    Args:
        num_samples: answers sampled (k; 1: the model's one answer at ``temperature``).
        temperature: the sampling temperature of the answers and of the confidence reply.
        primary: which answer the guard returns and the model is asked about (``"first"``
            or ``"medoid"``, the latter over the similarity model's embeddings).
        prompt: the question asked after the answer.
        similarity_model: a local sentence-transformers folder for the medoid rule (None:
            the shipped all-MiniLM-L6-v2).
        max_concurrency: sampling calls in flight per question.
    """

    kind = "verbalized_confidence"

    def __init__(
        self,
        num_samples: int = 1,
        temperature: float = 0.0,
        primary: str = "first",
        prompt: str = CONFIDENCE_PROMPT,
        similarity_model: str | None = None,
        max_concurrency: int = 8,
        *,
        similarity: SimilarityModel | None = None,
    ) -> None:
        if not str(prompt).strip():
            raise ConfigError("The verbalized-confidence prompt must not be empty.")
        if primary == "medoid" and similarity is None:
            similarity = SimilarityModel("embedding", similarity_model)
        self.plan = SamplingPlan(
            int(num_samples),
            float(temperature),
            primary,
            similarity,
            confidence_prompt=str(prompt),
            max_concurrency=int(max_concurrency),
        )

    def score(self, response: ResponseLike) -> float:
        """``1 - confidence`` of the reply ``response`` records.

        Raises:
            ScoringError: no samples, or a reply stating no single confidence.
            SamplingMismatchError: sampled under another plan.
        """
        reply = read_samples(response, self.plan).confidence_reply
        if reply is None:
            raise ScoringError("The response records no confidence reply.")
        return 1.0 - parse_verbalized_confidence(reply)

    def get_state(self) -> ScorerState:
        """The sampling plan, the prompt and (medoid rule) the similarity model's record."""
        plan = self.plan
        return ScorerState(
            kind=self.kind,
            params={
                "num_samples": plan.num_samples,
                "temperature": plan.temperature,
                "primary": plan.primary,
                "prompt": plan.confidence_prompt,
                "max_concurrency": plan.max_concurrency,
                "similarity": plan.similarity_record(),
            },
        )
