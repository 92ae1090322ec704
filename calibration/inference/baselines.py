"""Standard uncertainty baselines (lm-polygraph definitions) and calibrated baselines.

Every scorer here returns **higher = more uncertain** and scores any message our
``GeometryChatModel`` produced: the prompt is rebuilt from
``response_metadata["prompt_token_ids"]`` and the answer from ``token_ids``. The three
likelihood baselines (perplexity, maximum sequence probability, mean token entropy) read
metadata only and live in :mod:`abstain_guard.likelihood`; this module adds

* :class:`PTrueScorer` — P(True), the model judges its own answer;
* :class:`SARScorer` — shifting attention to relevance over K sampled answers;
* :class:`SemanticEntropyScorer` — K samples clustered by bidirectional equivalence;
* :class:`EigenScoreScorer` — log-determinant of the middle-layer sample embeddings;
* :class:`AttentionScoreScorer` — LLM-Check's attention log-determinant;
* :class:`CalibratedScorer` — the paper's XGBoost calibration on any 1-D score.

The pure formulas (``token_sar``, ``sar``, ``semantic_entropy``, ``eigenscore``,
``attention_score``, ``greedy_semantic_classes``) are separate functions. Sampled answers
come from a shared :class:`SampleSource` so SAR, semantic entropy and EigenScore scored on
the same responses reuse one set of K samples per prompt. See ``docs/baselines.md`` for
every definition and each deviation from lm-polygraph.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import logsumexp

from abstain_guard.calibration.inference.aux_models import (
    ChatModelEquivalence,
    EquivalenceJudge,
    NLIEquivalence,
    SentenceSimilarity,
)
from abstain_guard.calibration.inference.geometry import (
    DEFAULT_XGB_PARAMS,
    booster_from_bytes,
    booster_to_bytes,
    fit_xgb_calibrator,
)
from abstain_guard.errors import (
    ArtifactSchemaError,
    ConfigError,
    InvalidInputError,
    NotFittedError,
    ScoringError,
)
from abstain_guard.scoring import (
    ResponseLike,
    Scorer,
    ScorerState,
    register_scorer,
    response_metadata_of,
    scorer_from_state,
)

__all__ = [
    "PTRUE_PROMPT",
    "AttentionScoreScorer",
    "CalibratedScorer",
    "EigenScoreScorer",
    "PTrueScorer",
    "SARScorer",
    "Sample",
    "SampleSource",
    "SemanticEntropyScorer",
    "attention_score",
    "eigenscore",
    "greedy_semantic_classes",
    "make_baselines",
    "question_from_prompt",
    "sar",
    "score_many",
    "semantic_entropy",
    "token_sar",
]

PTRUE_PROMPT = (
    "Question: {q}\n Possible answer:{a}\n "
    "Is the possible answer:\n (A) True\n (B) False\n The possible answer is:"
)
"""lm-polygraph's P(True) prompt (``PromptCalculator``)."""


# --------------------------------------------------------------------------------------
# pure formulas
# --------------------------------------------------------------------------------------


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


def attention_score(diagonals: np.ndarray, eps: float = 1e-12) -> float:
    """LLM-Check attention score: ``−(1/H) Σ_h Σ_i log(A_h[i, i] + eps)`` from the attention
    diagonals ``[H, T]`` of one layer."""
    d = np.asarray(diagonals, dtype=np.float64)
    if d.ndim != 2 or d.size == 0:
        raise InvalidInputError("diagonals must be [heads, tokens], non-empty.")
    return float(-np.mean(np.sum(np.log(d + eps), axis=1)))


# --------------------------------------------------------------------------------------
# reading responses and prompts
# --------------------------------------------------------------------------------------


def _prompt_and_answer_ids(response: ResponseLike) -> tuple[list[int], list[int]]:
    meta = response_metadata_of(getattr(response, "metadata", response))
    prompt = meta.get("prompt_token_ids")
    answer = meta.get("token_ids")
    if prompt is None or answer is None:
        raise ScoringError(
            "The response lacks prompt_token_ids/token_ids in response_metadata; this "
            "baseline needs a message produced by the GeometryChatModel."
        )
    return [int(t) for t in prompt], [int(t) for t in answer]


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


def _eos_ids(model: Any) -> set[int]:
    hf = model.hf_model
    ids: set[int] = set()
    for src in (getattr(hf, "generation_config", None), hf.config):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if model.tokenizer.eos_token_id is not None:
        ids.add(int(model.tokenizer.eos_token_id))
    return ids


# --------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------


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

        hf = self.model.hf_model
        tok = self.model.tokenizer
        eos = _eos_ids(self.model)
        pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
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
        import torch

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


# --------------------------------------------------------------------------------------
# model-based scorers
# --------------------------------------------------------------------------------------


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


class _ModelScorer(Scorer):
    """Shared plumbing: holds the model, stores config-only state, needs ``model=`` to load."""

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
        if model is None:
            raise ConfigError(
                f"Loading a {state.kind!r} scorer needs the chat model: "
                f"{cls.__name__}.from_state(state, model=...)."
            )
        return cls(model, **{**state.params, **kwargs})

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


class PTrueScorer(_ModelScorer):
    """P(True): ``−log p("True")`` as the next token after lm-polygraph's prompt
    :data:`PTRUE_PROMPT` with the question and the model's answer, sent as one user turn
    through the model's chat template (``chat_template=False``: raw text, as lm-polygraph
    for base models)."""

    kind: ClassVar[str] = "p_true"

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
        prompt, answer = _prompt_and_answer_ids(response)
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


class _SamplingScorer(_ModelScorer):
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
        if model is None:
            raise ConfigError(
                f"Loading a {state.kind!r} scorer needs the chat model: "
                f"{cls.__name__}.from_state(state, model=...)."
            )
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
        prompt, _ = _prompt_and_answer_ids(response)
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
        judge: an :class:`EquivalenceJudge` instance, or ``"chat"`` to let the chat model
            judge equivalence (:class:`ChatModelEquivalence`).
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
        elif isinstance(judge, str):
            raise ConfigError(f"Unknown judge {judge!r}; use 'chat' or an EquivalenceJudge.")
        elif judge is not None:
            self.judge = judge
        elif nli_model_path is not None:
            self.judge = NLIEquivalence(nli_model_path)
        else:
            raise ConfigError(
                "SemanticEntropyScorer needs an equivalence judge: pass nli_model_path=<local "
                "NLI model dir>, judge='chat' (the chat model judges), or "
                "judge=SimilarityEquivalence(SentenceSimilarity(), threshold)."
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
        prompt, _ = _prompt_and_answer_ids(response)
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
        prompt, _ = _prompt_and_answer_ids(response)
        return eigenscore(self.samples.middle_layer_embeddings(prompt), self.alpha)


class AttentionScoreScorer(_ModelScorer):
    """LLM-Check attention score (lm-polygraph ``AttentionScore``): one eager-attention
    forward over prompt + answer (EOS included when generated), layer ``L//2``,
    ``−(1/H) Σ_h Σ_i log(A_h[i, i] + 1e-12)`` over the whole sequence.

    The model's attention implementation is switched to ``eager`` for the forward and
    restored afterwards (do not score concurrently with generation on the same model).
    """

    kind: ClassVar[str] = "attention_score"

    def __init__(self, model: Any, layer: int | None = None) -> None:
        super().__init__(model)
        self.layer = layer

    def _config(self) -> dict[str, Any]:
        return {"layer": self.layer}

    def diagonals(self, response: ResponseLike) -> np.ndarray:
        """Attention diagonals ``[H, T]`` of the scored layer."""
        import torch

        hf = self.model.hf_model
        prompt, answer = _prompt_and_answer_ids(response)
        layer = self.layer if self.layer is not None else int(hf.config.num_hidden_layers // 2)
        ids = torch.tensor([prompt + answer], dtype=torch.long)
        previous = hf.config._attn_implementation
        hf.config._attn_implementation = "eager"
        try:
            with torch.no_grad():
                out = hf(input_ids=ids, output_attentions=True)
        finally:
            hf.config._attn_implementation = previous
        attn = out.attentions[layer][0]
        return attn.diagonal(dim1=-2, dim2=-1).float().numpy().astype(np.float64)

    def score(self, response: ResponseLike) -> float:
        return attention_score(self.diagonals(response))


# --------------------------------------------------------------------------------------
# calibrated baselines (paper appendix)
# --------------------------------------------------------------------------------------


class CalibratedScorer(Scorer):
    """The paper's XGBoost calibration applied to a 1-D baseline score.

    ``fit`` trains ``binary:logistic`` XGBoost on ``[base.score(r)]`` → correctness of
    ``r`` (early stopping on a stratified hold-out of ``validation_fraction``); ``score``
    returns ``1 − p̂(correct)`` (higher = more uncertain).

    Args:
        base: any scorer (its score is the single feature).
    """

    kind: ClassVar[str] = "calibrated"

    def __init__(
        self,
        base: Scorer,
        xgb_params: Mapping[str, Any] | None = None,
        num_boost_round: int = 500,
        early_stopping_rounds: int = 30,
        validation_fraction: float = 0.2,
        random_state: int = 0,
    ) -> None:
        if not isinstance(base, Scorer):
            raise InvalidInputError("base must be a Scorer.")
        self.base = base
        self.xgb_params = dict(xgb_params or {})
        self.num_boost_round = int(num_boost_round)
        self.early_stopping_rounds = int(early_stopping_rounds)
        self.validation_fraction = float(validation_fraction)
        self.random_state = int(random_state)

    @property
    def name(self) -> str:
        return f"calibrated_{self.base.name}"

    def fit(self, train: Sequence[tuple[ResponseLike, bool]]) -> CalibratedScorer:
        """Score ``train`` responses with the base scorer and fit the calibrator."""
        pairs = list(train)
        scores = self.base.score_many([r for r, _ in pairs])
        return self.fit_scores(scores, [c for _, c in pairs])

    def fit_scores(self, scores: ArrayLike, correct: ArrayLike) -> CalibratedScorer:
        """Fit on precomputed base scores ``[n]`` and labels ``[n]``."""
        x = np.asarray(scores, dtype=np.float64).reshape(-1, 1)
        y = np.asarray(correct, dtype=np.float64)
        if x.shape[0] != y.shape[0]:
            raise InvalidInputError("scores and correct must have the same length.")
        if not np.all(np.isfinite(x)):
            raise InvalidInputError("Base scores contain NaN or inf; drop those responses.")
        self.booster_, self.fit_info_ = fit_xgb_calibrator(
            x,
            y,
            np.arange(x.shape[0]),
            params={**DEFAULT_XGB_PARAMS, **self.xgb_params},
            num_boost_round=self.num_boost_round,
            early_stopping_rounds=self.early_stopping_rounds,
            validation_fraction=self.validation_fraction,
            random_state=self.random_state,
        )
        return self

    def _check_fitted(self) -> None:
        if not hasattr(self, "booster_"):
            raise NotFittedError("CalibratedScorer is not fitted: call fit(train) first.")

    def calibrate(self, scores: ArrayLike) -> np.ndarray:
        """``1 − p̂(correct)`` for precomputed base scores ``[n]``."""
        self._check_fitted()
        x = np.asarray(scores, dtype=np.float64).reshape(-1, 1)
        if not np.all(np.isfinite(x)):
            raise ScoringError("A base score is NaN or inf; it cannot be calibrated.")
        return 1.0 - np.asarray(self.booster_.inplace_predict(x), dtype=np.float64)

    def score(self, response: ResponseLike) -> float:
        return float(self.calibrate([self.base.score(response)])[0])

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        return self.calibrate(self.base.score_many(responses))

    def prepare(self, runnable: Any) -> Any:
        return self.base.prepare(runnable)

    def get_state(self) -> ScorerState:
        """Own params + the base state nested under ``base.`` prefixes."""
        self._check_fitted()
        base = self.base.get_state()
        return ScorerState(
            kind=self.kind,
            params={
                "xgb_params": self.xgb_params,
                "num_boost_round": self.num_boost_round,
                "early_stopping_rounds": self.early_stopping_rounds,
                "validation_fraction": self.validation_fraction,
                "random_state": self.random_state,
                "fit_info": self.fit_info_,
                "base": {"kind": base.kind, "params": base.params},
            },
            arrays={f"base.{k}": v for k, v in base.arrays.items()},
            files={
                "calibrator.ubj": booster_to_bytes(self.booster_),
                **{f"base.{k}": v for k, v in base.files.items()},
            },
        )

    @classmethod
    def from_state(cls, state: ScorerState, base: Scorer | None = None) -> CalibratedScorer:
        """Rebuild; ``base`` may be given (needed when the base scorer needs a model)."""
        p = state.params
        try:
            if base is None:
                base_state = ScorerState(
                    kind=p["base"]["kind"],
                    params=dict(p["base"]["params"]),
                    arrays={k[5:]: v for k, v in state.arrays.items() if k.startswith("base.")},
                    files={k[5:]: v for k, v in state.files.items() if k.startswith("base.")},
                )
                base = scorer_from_state(base_state)
            scorer = cls(
                base,
                xgb_params=p.get("xgb_params"),
                num_boost_round=p.get("num_boost_round", 500),
                early_stopping_rounds=p.get("early_stopping_rounds", 30),
                validation_fraction=p.get("validation_fraction", 0.2),
                random_state=p.get("random_state", 0),
            )
            scorer.fit_info_ = dict(p.get("fit_info", {}))
            scorer.booster_ = booster_from_bytes(state.files["calibrator.ubj"])
        except KeyError as exc:
            raise ArtifactSchemaError(
                f"Calibrated scorer state is missing {exc}; the artifact is incomplete."
            ) from exc
        return scorer


# --------------------------------------------------------------------------------------
# many scorers at once
# --------------------------------------------------------------------------------------


def make_baselines(
    model: Any,
    num_samples: int = 10,
    similarity: SentenceSimilarity | str | None = None,
    judge: EquivalenceJudge | str | None = None,
    nli_model_path: str | None = None,
    max_new_tokens: int = 64,
    seed: int = 0,
) -> dict[str, Scorer]:
    """Every baseline, sharing one :class:`SampleSource` (and one similarity model).

    Semantic entropy is included only when ``judge`` or ``nli_model_path`` is given.
    """
    from abstain_guard.likelihood import (
        MaxSequenceProbabilityScorer,
        MeanTokenEntropyScorer,
        PerplexityScorer,
    )

    source = SampleSource(model, num_samples=num_samples, max_new_tokens=max_new_tokens, seed=seed)
    sim = (
        similarity if isinstance(similarity, SentenceSimilarity) else SentenceSimilarity(similarity)
    )
    scorers: dict[str, Scorer] = {
        "perplexity": PerplexityScorer(),
        "max_sequence_probability": MaxSequenceProbabilityScorer(),
        "mean_token_entropy": MeanTokenEntropyScorer(),
        "p_true": PTrueScorer(model),
        "sar": SARScorer(model, similarity=sim, samples=source),
        "eigenscore": EigenScoreScorer(model, samples=source),
        "attention_score": AttentionScoreScorer(model),
    }
    if judge is not None or nli_model_path is not None:
        scorers["semantic_entropy"] = SemanticEntropyScorer(
            model, judge=judge, nli_model_path=nli_model_path, samples=source
        )
    return scorers


def score_many(
    scorers: Mapping[str, Scorer],
    responses: Sequence[ResponseLike],
    progress: bool = False,
) -> dict[str, np.ndarray]:
    """Score ``responses`` with every scorer: ``{name: [n] scores}``.

    Scorers that share a :class:`SampleSource` reuse its samples, so K samples are drawn
    once per prompt; each scorer's own ``score_many`` batches what it can.
    """
    out: dict[str, np.ndarray] = {}
    for name, scorer in scorers.items():
        if progress and not isinstance(scorer, PTrueScorer | CalibratedScorer):
            from tqdm.auto import tqdm

            out[name] = np.asarray(
                [scorer.score(r) for r in tqdm(responses, desc=name, leave=False)],
                dtype=np.float64,
            )
        else:
            out[name] = np.asarray(scorer.score_many(responses), dtype=np.float64)
    return out


for _cls in (PTrueScorer, SARScorer, SemanticEntropyScorer, EigenScoreScorer, AttentionScoreScorer):
    register_scorer(_cls.kind, _cls)
