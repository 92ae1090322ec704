"""Sampling baselines over K answers sampled per prompt (lm-polygraph definitions): SAR,
semantic entropy and EigenScore, their pure formulas, and the :class:`SampleSource` that
lets scorers scored on the same responses share one set of K samples per prompt."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from scipy.special import logsumexp

from abstain_guard.adapters import eos_token_ids
from abstain_guard.adapters.loading import pad_token_id
from abstain_guard.calibration.inference.aux_models import (
    ChatModelEquivalence,
    EquivalenceJudge,
    NLIEquivalence,
    SentenceSimilarity,
    SimilarityEquivalence,
)
from abstain_guard.calibration.inference.model_access import (
    ModelScorer,
    prompt_and_answer_ids,
    question_from_prompt,
    right_padded,
)
from abstain_guard.errors import ConfigError, InvalidInputError, ScoringError
from abstain_guard.metadata import ResponseLike
from abstain_guard.scoring import Scorer, ScorerState

__all__ = [
    "SIMILARITY_THRESHOLD",
    "EigenScoreScorer",
    "SARScorer",
    "Sample",
    "SampleSource",
    "SemanticEntropyScorer",
    "eigenscore",
    "greedy_semantic_classes",
    "sar",
    "semantic_entropy",
    "token_sar",
]

SIMILARITY_THRESHOLD = 0.8
"""Cosine similarity at which ``judge="similarity"`` calls two sampled answers equivalent."""


def token_sar(logprobs: np.ndarray, token_similarity: np.ndarray) -> float:
    """tokenSAR of one answer: ``Σ_t −log p_t · R_t / Σ_j R_j`` with ``R_t = 1 − sim_t``.

    Args:
        logprobs: ``[n]`` token log-probabilities.
        token_similarity: ``[n]`` similarity of the answer with and without token ``t``.

    When every ``R_t`` is 0 (removing any token changes nothing) the weights are uniform,
    i.e. tokenSAR is the mean negative log-likelihood (lm-polygraph would divide by zero).
    """
    lp = np.asarray(logprobs, dtype=np.float64)
    r = 1.0 - np.asarray(token_similarity, dtype=np.float64)
    if lp.shape != r.shape or lp.size == 0:
        raise InvalidInputError("logprobs and token_similarity must be non-empty, same shape.")
    total = r.sum()
    weights = r / total if total > 0 else np.full(r.shape, 1.0 / r.size)
    return float(np.sum(-lp * weights))


def sar(token_sars: np.ndarray, sentence_similarity: np.ndarray, t: float = 1e-3) -> float:
    """SAR over K samples: ``mean_k −log(p̃_k + (1/t) Σ_{j≠k} sim(s_k, s_j) p̃_j)`` with
    ``p̃_k = exp(−tokenSAR_k)``.

    Args:
        token_sars: ``[K]``; sentence_similarity: ``[K, K]``; t: temperature (0.001).
    """
    ts = np.asarray(token_sars, dtype=np.float64)
    sim = np.asarray(sentence_similarity, dtype=np.float64)
    if ts.ndim != 1 or ts.size == 0 or sim.shape != (ts.size, ts.size):
        raise InvalidInputError("token_sars must be [K] and sentence_similarity [K, K], K ≥ 1.")
    p = np.exp(-ts)
    off = sim * (1.0 - np.eye(ts.size))
    relevance = (off * p[None, :]).sum(axis=1) / t
    return float(np.mean(-np.log(relevance + p)))


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


def eigenscore(embeddings: np.ndarray, alpha: float = 1e-3) -> float:
    """EigenScore: ``mean(log eig(Z J_d Zᵀ + αI))`` for sample embeddings ``Z`` ``[K, D]``
    (``J_d = I − 11ᵀ/D`` centres each embedding over its features; eigenvalues ≤ 0 are
    replaced by 1e-10 as in lm-polygraph)."""
    z = np.asarray(embeddings, dtype=np.float64)
    if z.ndim != 2 or z.shape[0] == 0:
        raise InvalidInputError("embeddings must be [K, D] with K ≥ 1.")
    zc = z - z.mean(axis=1, keepdims=True)  # Z J_d without forming the D×D matrix
    cov = zc @ zc.T + alpha * np.eye(z.shape[0])
    eig = np.linalg.eigvalsh(cov)
    return float(np.mean(np.log(np.where(eig > 0, eig, 1e-10))))


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


class _SamplingScorer(ModelScorer):
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


class SARScorer(_SamplingScorer):
    """SAR (Duan et al.; lm-polygraph ``SAR``): token relevance from a sentence-similarity
    model, sentence relevance across K samples, ``t = 0.001``.

    Args:
        model: the chat model.
        similarity: a :class:`SentenceSimilarity`, a local model path, or ``None`` for the
            shipped all-MiniLM-L6-v2 (cosine clipped to [0, 1]).
        samples: a shared :class:`SampleSource` (default: a new one with ``num_samples``).
        t: SAR temperature.
    """

    kind: ClassVar[str] = "sar"

    def __init__(
        self,
        model: Any,
        similarity: SentenceSimilarity | str | None = None,
        samples: SampleSource | None = None,
        num_samples: int = 10,
        t: float = 1e-3,
    ) -> None:
        super().__init__(model, samples, num_samples)
        self.similarity = (
            similarity
            if isinstance(similarity, SentenceSimilarity)
            else SentenceSimilarity(similarity)
        )
        self.t = float(t)

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "t": self.t, "similarity": str(self.similarity.path)}

    def _sim(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        return np.clip(self.similarity.pairs(pairs), 0.0, 1.0)

    def _token_similarity(self, question: str, ids: list[int]) -> np.ndarray:
        tok = self.model.tokenizer
        if len(ids) <= 1:
            return np.full(len(ids), 0.5)
        full = f"{question} {tok.decode(ids, skip_special_tokens=True)}"
        pairs = [
            (full, f"{question} {tok.decode(ids[:i] + ids[i + 1 :], skip_special_tokens=True)}")
            for i in range(len(ids))
        ]
        sims = self._sim(pairs)
        special = set(getattr(tok, "all_special_ids", []) or [])
        sims[[i for i, t in enumerate(ids) if t in special]] = 1.0
        return sims

    def score(self, response: ResponseLike) -> float:
        prompt, _ = prompt_and_answer_ids(response)
        question = question_from_prompt(self.model.tokenizer, prompt)
        samples = self._nonempty_samples(prompt)
        token_sars = np.asarray(
            [
                token_sar(
                    s.logprobs[: len(s.content_ids)],
                    self._token_similarity(question, s.content_ids),
                )
                for s in samples
            ]
        )
        texts = [s.text for s in samples]
        sim = np.clip(self.similarity.matrix(texts), 0.0, 1.0)
        return sar(token_sars, sim, self.t)


class SemanticEntropyScorer(_SamplingScorer):
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

    kind: ClassVar[str] = "semantic_entropy"

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


class EigenScoreScorer(_SamplingScorer):
    """EigenScore (LLM-Check / INSIDE; lm-polygraph ``EigenScore``): middle-layer
    (``L//2``) embedding of the last token of each of K samples, ``α = 1e-3``."""

    kind: ClassVar[str] = "eigenscore"

    def __init__(
        self,
        model: Any,
        samples: SampleSource | None = None,
        num_samples: int = 10,
        alpha: float = 1e-3,
    ) -> None:
        super().__init__(model, samples, num_samples)
        self.alpha = float(alpha)

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "alpha": self.alpha}

    def score(self, response: ResponseLike) -> float:
        prompt, _ = prompt_and_answer_ids(response)
        return eigenscore(self.samples.middle_layer_embeddings(prompt), self.alpha)
