"""The similarity judge: an answer is correct when it means the same as a gold alias, by
sentence-embedding cosine (or a cross-encoder's score) above a threshold. No chat model is
called; the model loads lazily, from local paths only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from abstain_guard.errors import JudgeError

from .base import Judge, JudgeInput, Judgment, unpack_input
from .lexical import refusal_verdict

DEFAULT_SIMILARITY_NAME = "all-MiniLM-L6-v2"


class SimilarityJudge(Judge):
    """Semantic similarity between the prediction and each gold alias; correct when the best
    score reaches ``threshold`` (0.8 as in the paper).

    With a bi-encoder (``model_path``, default the embedded all-MiniLM-L6-v2) the score is the
    cosine similarity of normalised sentence embeddings; with ``cross_encoder_path`` a
    sentence-transformers ``CrossEncoder`` scores each (prediction, gold) pair instead (its
    default activation maps single-logit models to [0, 1]). Models load lazily on first use,
    from local paths only (``HF_HUB_OFFLINE=1``).

    ``encoder`` is an already loaded model to use instead of loading one: anything with a
    sentence-transformers ``encode`` (a ``SentenceTransformer``), or with a ``CrossEncoder``'s
    ``predict`` when ``cross_encoder_path`` is given. The :attr:`identity` still names
    ``model_path`` / ``cross_encoder_path``, so pass the paths it was loaded from.
    """

    name = "similarity"
    #: Bumped whenever verdicts change, so cached judgments of an older judge are not reused.
    version: ClassVar[int] = 2

    def __init__(
        self,
        model_path: str | Path | None = None,
        threshold: float = 0.8,
        *,
        cross_encoder_path: str | Path | None = None,
        batch_size: int = 64,
        device: str = "cpu",
        encoder: Any = None,
    ) -> None:
        if not -1.0 <= threshold <= 1.0:
            raise JudgeError(f"similarity threshold must be in [-1, 1], got {threshold}")
        self.model_path = None if model_path is None else Path(model_path)
        self.cross_encoder_path = None if cross_encoder_path is None else Path(cross_encoder_path)
        for p in (self.model_path, self.cross_encoder_path):
            if p is not None and not p.exists():
                raise JudgeError(f"similarity model path {p} does not exist; pass a local folder")
        self.threshold = threshold
        self.batch_size = batch_size
        self.device = device
        self._model: Any = encoder
        self._lock = threading.Lock()

    def params(self) -> dict[str, Any]:
        if self.cross_encoder_path is not None:
            model = f"cross-encoder:{self.cross_encoder_path}"
        elif self.model_path is None:
            model = DEFAULT_SIMILARITY_NAME
        else:
            model = str(self.model_path)
        return {"model": model, "threshold": self.threshold, "version": self.version}

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                self._model = self._open_model()
            return self._model

    def _open_model(self) -> Any:
        # sentence_transformers imports torch, and calibration.inference loads every scorer:
        # both only when a model is actually needed.
        from sentence_transformers import CrossEncoder, SentenceTransformer

        from abstain_guard.scorers import default_similarity_model_path

        if self.cross_encoder_path is not None:
            return CrossEncoder(
                str(self.cross_encoder_path), device=self.device, local_files_only=True
            )
        path = self.model_path or default_similarity_model_path()
        return SentenceTransformer(str(path), device=self.device, local_files_only=True)

    def scores(self, pairs: Sequence[tuple[str, Sequence[str]]]) -> list[float]:
        """Best similarity of each ``(prediction, gold aliases)`` pair, batched. ``[len(pairs)]``"""
        model = self._load()
        if self.cross_encoder_path is not None:
            flat = [(p, g) for p, golds in pairs for g in golds]
            raw = model.predict(flat, batch_size=self.batch_size, show_progress_bar=False)
            values = [float(v) for v in raw]
            out, k = [], 0
            for _, golds in pairs:
                out.append(max(values[k : k + len(golds)]))
                k += len(golds)
            return out
        texts = sorted({t for p, golds in pairs for t in (p, *golds)})
        index = {t: i for i, t in enumerate(texts)}
        emb = model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return [max(float(emb[index[p]] @ emb[index[g]]) for g in golds) for p, golds in pairs]

    def _verdict(self, score: float, n_golds: int) -> Judgment:
        ok = score >= self.threshold
        rel = ">=" if ok else "<"
        return Judgment(
            ok,
            score,
            f"best similarity {score:.3f} {rel} {self.threshold} over {n_golds} gold answers",
        )

    def judge(
        self,
        question: str,
        gold_answers: Sequence[str],
        prediction: str,
        *,
        choices: Sequence[str] = (),
    ) -> Judgment:
        golds = [g for g in gold_answers if g.strip()]
        if not golds:
            raise JudgeError(f"no gold answers for {question[:60]!r}")
        if not prediction.strip():
            return Judgment(False, 0.0, "empty prediction")
        refused = refusal_verdict(golds, prediction)
        if refused is not None:
            return refused
        return self._verdict(self.scores([(prediction, golds)])[0], len(golds))

    def iter_judge_many(
        self, inputs: Sequence[JudgeInput], *, max_concurrency: int = 4
    ) -> Iterator[tuple[int, Judgment]]:
        """Batched: every distinct text is embedded once, in chunks of 256 inputs."""
        unpacked = [unpack_input(t) for t in inputs]
        chunk = 256
        for start in range(0, len(unpacked), chunk):
            part = unpacked[start : start + chunk]
            todo = [
                (i, p, [g for g in gold if g.strip()])
                for i, (_, gold, p, _c) in enumerate(part, start)
            ]
            for i, _p, golds in todo:
                if not golds:
                    raise JudgeError(f"no gold answers for input {i}")
            refusals = {i: r for i, p, g in todo if p.strip() and (r := refusal_verdict(g, p))}
            scorable = [(i, p, g) for i, p, g in todo if p.strip() and i not in refusals]
            values = self.scores([(p, g) for _, p, g in scorable]) if scorable else []
            by_index = {i: v for (i, _, _), v in zip(scorable, values, strict=True)}
            for i, _p, golds in todo:
                if i in by_index:
                    yield i, self._verdict(by_index[i], len(golds))
                else:
                    yield i, refusals.get(i) or Judgment(False, 0.0, "empty prediction")
