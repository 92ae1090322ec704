"""What the model-based scorers share: a base class holding the chat model, the prompt and
answer ids of a response, the question inside a chat-templated prompt, and right-padded
batches for one forward pass. torch is imported where a forward pass runs: these scorers
are built with a local chat model, which brings it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from abstain_guard.contract.metadata import ResponseLike, ResponseMetadata
from abstain_guard.errors import ConfigError
from abstain_guard.scorers._base import Scorer, ScorerState


def prompt_and_answer_ids(response: ResponseLike) -> tuple[list[int], list[int]]:
    """``(prompt_token_ids, token_ids)`` of a message produced by the GeometryChatModel.

    Raises:
        ScoringError: the response lacks them (an API model's message, say).
    """
    meta = ResponseMetadata.of(response)
    return meta.prompt_token_ids(), meta.token_ids()


_SENTINEL_SYS = "\u2063SYS\u2063"
_SENTINEL_USER = "\u2063USR\u2063"


def question_from_prompt(tokenizer: Any, prompt_ids: Sequence[int]) -> str:
    """The last user turn of a chat-templated prompt.

    The tokenizer's own chat template is rendered around sentinels to learn the text that
    opens and closes a user turn; the decoded prompt is cut at the last such turn. Falls
    back to the whole prompt decoded without special tokens when that fails.
    """
    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    try:
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "system", "content": _SENTINEL_SYS},
                {"role": "user", "content": _SENTINEL_USER},
            ],
            tokenize=False,
            add_generation_prompt=False,
        )
        before_user, after_user = str(rendered).split(_SENTINEL_USER)
        opener = before_user.split(_SENTINEL_SYS)[-1]
        closer = after_user
        start = text.rfind(opener)
        if opener and closer and start >= 0:
            body = text[start + len(opener) :]
            end = body.find(closer.strip() or closer)
            if end >= 0:
                return body[:end].strip()
    except Exception:  # any template quirk → fallback below
        pass
    return str(tokenizer.decode(list(prompt_ids), skip_special_tokens=True)).strip()


def right_padded(sequences: Sequence[Sequence[int]]) -> tuple[Any, Any, Any]:
    """Right-padded ``input_ids`` / ``attention_mask`` ``[n, max_len]`` and the index of each
    sequence's last token ``[n]`` (torch tensors)."""
    import torch

    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s))
        mask[i, : len(s)] = 1
    return ids, mask, torch.tensor([len(s) - 1 for s in sequences])


class ModelScorer(Scorer):
    """Shared plumbing: holds the model, stores config-only state, needs ``model=`` to load."""

    family: ClassVar[str] = "model"
    reads: ClassVar[frozenset[str]] = frozenset({"model"})

    def __init__(self, model: Any) -> None:
        if model is None or not hasattr(model, "hf_model"):
            raise ConfigError(
                f"{type(self).__name__} needs the GeometryChatModel (with hf_model and "
                "tokenizer) that produced the responses: pass model=load_default_model()."
            )
        self.model = model

    def _config(self) -> dict[str, Any]:
        return {}

    def get_state(self) -> ScorerState:
        """Configuration only (these scorers are not fitted)."""
        return ScorerState(kind=self.kind, params=self._config())

    @classmethod
    def from_state(cls, state: ScorerState, model: Any = None, **kwargs: Any) -> Scorer:
        """Rebuild from configuration; the model (and any auxiliary model) must be given."""
        cls._require_model(state, model)
        return cls(model, **{**state.params, **kwargs})

    @classmethod
    def _require_model(cls, state: ScorerState, model: Any) -> None:
        if model is None:
            raise ConfigError(
                f"Loading a {state.kind!r} scorer needs the chat model: "
                f"{cls.__name__}.from_state(state, model=...)."
            )

    def _forward_last_logits(self, sequences: list[list[int]], batch_size: int = 16) -> np.ndarray:
        """Next-token log-probabilities after each sequence ``[n, V]`` (right-padded)."""
        import torch

        hf = self.model.hf_model
        rows = []
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start : start + batch_size]
            ids, mask, last = right_padded(chunk)
            with torch.no_grad():
                logits = hf(input_ids=ids, attention_mask=mask).logits
            rows.append(torch.log_softmax(logits[torch.arange(len(chunk)), last].float(), -1))
        return torch.cat(rows).double().numpy()
