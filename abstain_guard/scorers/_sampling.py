"""What the sampling scorers share: K answers sampled per prompt (:class:`SampleSource`,
cached by prompt tokens so that scorers scored on the same responses share one set of K
samples) and the base class of the scorers that read them (lm-polygraph definitions). torch
and the adapters are imported where samples are drawn (a local chat model brings them)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from abstain_guard.errors import ConfigError, InvalidInputError, ScoringError
from abstain_guard.scorers._base import Scorer, ScorerState
from abstain_guard.scorers._model_access import ModelScorer, right_padded


@dataclass
class Sample:
    """One sampled answer.

    Attributes:
        token_ids: generated tokens, a final EOS included when one was generated.
        logprobs: ``[len(token_ids)]`` log-probabilities under the model (raw logits, T=1).
        text: the answer decoded without special tokens.
        content_ids: ``token_ids`` without the final EOS.
    """

    token_ids: list[int]
    logprobs: np.ndarray
    text: str
    content_ids: list[int]


class SampleSource:
    """K sampled answers per prompt, cached by prompt tokens and shared between scorers.

    Samples are drawn in one batched ``generate`` call per prompt (``num_return_sequences
    = K``) from ``model.hf_model`` with the seed ``seed + crc32(prompt)`` so a prompt gets
    the same samples whatever the order of scoring.

    Args:
        model: the GeometryChatModel (uses ``hf_model``, ``tokenizer``).
        num_samples: K (lm-polygraph: 10).
        temperature, top_k, top_p: sampling parameters (lm-polygraph: 1.0, 50, 1.0).
        max_new_tokens: length cap of a sample.
        seed: base seed.
    """

    def __init__(
        self,
        model: Any,
        num_samples: int = 10,
        temperature: float = 1.0,
        top_k: int = 50,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        seed: int = 0,
    ) -> None:
        if num_samples < 2:
            raise InvalidInputError("num_samples must be at least 2.")
        self.model = model
        self.num_samples = int(num_samples)
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.max_new_tokens = int(max_new_tokens)
        self.seed = int(seed)
        self._samples: dict[tuple[int, ...], list[Sample]] = {}
        self._embeddings: dict[tuple[int, ...], np.ndarray] = {}

    def samples(self, prompt_ids: Sequence[int]) -> list[Sample]:
        """The K samples of ``prompt_ids`` (generated once, then cached)."""
        key = tuple(int(t) for t in prompt_ids)
        if key not in self._samples:
            self._samples[key] = self._generate(key)
        return self._samples[key]

    def _generate(self, prompt: tuple[int, ...]) -> list[Sample]:
        import torch

        from abstain_guard.adapters.model.loading import eos_token_ids, pad_token_id

        hf = self.model.hf_model
        tok = self.model.tokenizer
        eos = set(eos_token_ids(hf, tok))
        pad = pad_token_id(hf, tok)
        input_ids = torch.tensor([list(prompt)], dtype=torch.long)
        torch.manual_seed(self.seed + zlib.crc32(np.asarray(prompt, dtype=np.int64).tobytes()))
        with torch.no_grad():
            out = hf.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                max_new_tokens=self.max_new_tokens,
                num_return_sequences=self.num_samples,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=pad,
            )
        seqs = out.sequences[:, len(prompt) :]
        logits = torch.stack(out.logits, dim=1).float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, seqs[..., None])[..., 0]
        result = []
        for k in range(seqs.shape[0]):
            ids = seqs[k].tolist()
            n = len(ids)
            for i, t in enumerate(ids):
                if t in eos:
                    n = i + 1
                    break
            ids = ids[:n]
            content = ids[:-1] if ids and ids[-1] in eos else ids
            result.append(
                Sample(
                    token_ids=ids,
                    logprobs=logp[k, :n].double().numpy(),
                    text=str(tok.decode(content, skip_special_tokens=True)).strip(),
                    content_ids=content,
                )
            )
        return result

    def middle_layer_embeddings(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """``[K', D]`` hidden state after decoder layer ``L//2`` at the last content token
        of each non-empty sample (one padded forward over prompt + sample)."""
        key = tuple(int(t) for t in prompt_ids)
        if key in self._embeddings:
            return self._embeddings[key]
        samples = [s for s in self.samples(key) if s.content_ids]
        if not samples:
            raise ScoringError("Every sampled answer was empty; no embedding to take.")
        import torch

        hf = self.model.hf_model
        layer = int(hf.config.num_hidden_layers // 2)
        seqs = [list(key) + s.content_ids for s in samples]
        ids, mask, last = right_padded(seqs)
        with torch.no_grad():
            out = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden = out.hidden_states[layer]
        emb = hidden[torch.arange(len(seqs)), last].float().numpy().astype(np.float64)
        self._embeddings[key] = emb
        return emb


class SamplingScorer(ModelScorer):
    """What the scorers over K sampled answers share: the sample source and its settings."""

    family: ClassVar[str] = "sampling"

    def __init__(self, model: Any, samples: SampleSource | None, num_samples: int) -> None:
        super().__init__(model)
        if samples is not None and samples.model is not model:
            raise ConfigError("The SampleSource must wrap the same model as the scorer.")
        self.samples = samples or SampleSource(model, num_samples=num_samples)

    def _nonempty_samples(self, prompt: list[int]) -> list[Sample]:
        samples = [s for s in self.samples.samples(prompt) if s.content_ids]
        if not samples:
            raise ScoringError(
                f"All {self.samples.num_samples} sampled answers were empty (EOS only); "
                f"{type(self).__name__} is undefined for this prompt."
            )
        return samples

    def _config(self) -> dict[str, Any]:
        s = self.samples
        return {
            "num_samples": s.num_samples,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "max_new_tokens": s.max_new_tokens,
            "seed": s.seed,
        }

    @classmethod
    def from_state(cls, state: ScorerState, model: Any = None, **kwargs: Any) -> Scorer:
        cls._require_model(state, model)
        p = dict(state.params)
        sample_keys = ("num_samples", "temperature", "top_k", "top_p", "max_new_tokens", "seed")
        source = kwargs.pop("samples", None) or SampleSource(
            model, **{k: p.pop(k) for k in sample_keys if k in p}
        )
        for k in sample_keys:
            p.pop(k, None)
        return cls(model, samples=source, **{**p, **kwargs})
