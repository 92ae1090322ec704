"""P(True) (Kadavath et al.; lm-polygraph ``PTrue``): the model judges its own answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import ConfigError
from abstain_guard.scorers._model_access import (
    ModelScorer,
    prompt_and_answer_ids,
    question_from_prompt,
)

PTRUE_PROMPT = (
    "Question: {q}\n Possible answer:{a}\n "
    "Is the possible answer:\n (A) True\n (B) False\n The possible answer is:"
)
"""lm-polygraph's P(True) prompt (``PromptCalculator``)."""


class PTrueScorer(ModelScorer):
    """P(True): ``−log p("True")`` as the next token after lm-polygraph's prompt
    :data:`PTRUE_PROMPT` with the question and the model's answer, sent as one user turn
    through the model's chat template (``chat_template=False``: raw text, as lm-polygraph
    for base models)."""

    kind = "p_true"

    def __init__(self, model: Any, chat_template: bool = True, batch_size: int = 16) -> None:
        super().__init__(model)
        self.chat_template = bool(chat_template)
        self.batch_size = int(batch_size)
        ids = self.model.tokenizer("True", add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ConfigError(f"'True' is not a single token for this tokenizer ({ids}).")
        self.true_id = int(ids[0])

    def _config(self) -> dict[str, Any]:
        return {"chat_template": self.chat_template, "batch_size": self.batch_size}

    def _prompt_ids(self, response: ResponseLike) -> list[int]:
        tok = self.model.tokenizer
        prompt, answer = prompt_and_answer_ids(response)
        q = question_from_prompt(tok, prompt)
        a = str(tok.decode(answer, skip_special_tokens=True)).strip()
        content = PTRUE_PROMPT.format(q=q, a=a)
        if self.chat_template:
            text = tok.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            return list(tok(str(text), add_special_tokens=False)["input_ids"])
        return list(tok(content)["input_ids"])

    def score(self, response: ResponseLike) -> float:
        return float(self.score_many([response])[0])

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        if not responses:
            return np.zeros(0)
        seqs = [self._prompt_ids(r) for r in responses]
        logp = self._forward_last_logits(seqs, self.batch_size)
        return -logp[:, self.true_id]
