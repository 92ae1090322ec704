"""``semantic_entropy``: entropy over meaning classes of K sampled answers (Kuhn et al.;
lm-polygraph ``SemanticEntropy``), its pure formulas :func:`greedy_semantic_classes` and
:func:`semantic_entropy`, and :class:`SemanticEntropyScorer`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy.special import logsumexp

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import ConfigError, InvalidInputError
from abstain_guard.scorers._aux_models import (
    ChatModelEquivalence,
    EquivalenceJudge,
    NLIEquivalence,
    SentenceSimilarity,
    SimilarityEquivalence,
)
from abstain_guard.scorers._model_access import prompt_and_answer_ids, question_from_prompt
from abstain_guard.scorers._sampling import Sample, SampleSource, SamplingScorer

SIMILARITY_THRESHOLD = 0.8
"""Cosine similarity at which ``judge="similarity"`` calls two sampled answers equivalent."""


def greedy_semantic_classes(
    texts: Sequence[str], equivalent: Callable[[str, str], bool]
) -> list[int]:
    """Greedy clustering (Kuhn et al.; lm-polygraph): each text joins the first class whose
    first member it is equivalent to, else opens a new class. Returns a class id per text."""
    representatives: list[str] = []
    classes: list[int] = []
    for text in texts:
        for cid, rep in enumerate(representatives):
            if equivalent(rep, text):
                classes.append(cid)
                break
        else:
            representatives.append(text)
            classes.append(len(representatives) - 1)
    return classes


def semantic_entropy(sequence_logprobs: np.ndarray, classes: Sequence[int]) -> float:
    """lm-polygraph's semantic entropy: ``−(1/K) Σ_k log P(C(s_k))`` where
    ``log P(C) = logsumexp`` of its members' sequence log-probabilities (unnormalised)."""
    lp = np.asarray(sequence_logprobs, dtype=np.float64)
    cls = np.asarray(classes, dtype=np.int64)
    if lp.ndim != 1 or lp.size == 0 or cls.shape != lp.shape:
        raise InvalidInputError("sequence_logprobs and classes must be non-empty, same length.")
    class_lp = {int(c): float(logsumexp(lp[cls == c])) for c in np.unique(cls)}
    return float(-np.mean([class_lp[int(c)] for c in cls]))


class SemanticEntropyScorer(SamplingScorer):
    """Semantic entropy (Kuhn et al.; lm-polygraph ``SemanticEntropy``) over K samples.

    Args:
        model: the chat model.
        judge: an :class:`EquivalenceJudge` instance, ``"chat"`` to let the chat model
            judge equivalence (:class:`ChatModelEquivalence`), or ``"similarity"`` for the
            shipped sentence-similarity model at :data:`SIMILARITY_THRESHOLD` (offline).
        nli_model_path: local NLI model (bidirectional entailment); used when ``judge`` is
            not given.
        samples: a shared :class:`SampleSource`.

    Raises:
        ConfigError: when neither ``judge`` nor ``nli_model_path`` is given.
    """

    kind = "semantic_entropy"

    def __init__(
        self,
        model: Any,
        judge: EquivalenceJudge | str | None = None,
        nli_model_path: str | None = None,
        samples: SampleSource | None = None,
        num_samples: int = 10,
    ) -> None:
        super().__init__(model, samples, num_samples)
        self.nli_model_path = nli_model_path
        self.judge_name = judge if isinstance(judge, str) else None
        if judge == "chat":
            self.judge: EquivalenceJudge = ChatModelEquivalence(model)
        elif judge == "similarity":
            self.judge = SimilarityEquivalence(SentenceSimilarity(), SIMILARITY_THRESHOLD)
        elif isinstance(judge, str):
            raise ConfigError(
                f"Unknown judge {judge!r}; use 'chat', 'similarity' or an EquivalenceJudge."
            )
        elif judge is not None:
            self.judge = judge
        elif nli_model_path is not None:
            self.judge = NLIEquivalence(nli_model_path)
        else:
            raise ConfigError(
                "SemanticEntropyScorer needs an equivalence judge: pass nli_model_path=<local "
                "NLI model dir>, judge='chat' (the chat model judges), judge='similarity' (the "
                "shipped sentence-similarity model, offline), or an EquivalenceJudge."
            )

    def _config(self) -> dict[str, Any]:
        cfg = super()._config()
        if self.judge_name is not None:
            cfg["judge"] = self.judge_name
        if self.nli_model_path is not None:
            cfg["nli_model_path"] = self.nli_model_path
        return cfg

    def classes(self, response: ResponseLike) -> tuple[list[Sample], list[int]]:
        """The non-empty samples of the response's prompt and their semantic class ids."""
        prompt, _ = prompt_and_answer_ids(response)
        question = question_from_prompt(self.model.tokenizer, prompt)
        samples = self._nonempty_samples(prompt)
        cache: dict[tuple[str, str], bool] = {}

        def eq(a: str, b: str) -> bool:
            if (a, b) not in cache:
                cache[(a, b)] = cache[(b, a)] = self.judge.equivalent(question, a, b)
            return cache[(a, b)]

        return samples, greedy_semantic_classes([s.text for s in samples], eq)

    def score(self, response: ResponseLike) -> float:
        samples, cls = self.classes(response)
        return semantic_entropy(np.asarray([s.logprobs.sum() for s in samples]), cls)
