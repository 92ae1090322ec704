"""Speed of the geometry scorer: fitting on 2,000 responses and scoring one response.

Synthetic geometry with the default model's real shapes (L = 30 layers, D = 576, so token
vectors of 8L − 4 = 236 numbers), 2–10 tokens per response. Hidden states are views into
one random pool (float32) so 2,000 responses fit in memory. Fit = 1,000 reference
responses (means, Φ, Gaussians) + 1,000 training responses (Φ, XGBoost with early
stopping). Scoring times one message as the guard sees it (geometry with Φ already in
``response_metadata``, JSON lists): median wall time (and CPU time, which the other
processes on a shared machine do not inflate) of many repetitions; the budget is 5 ms.
Beside it, in the same run, the perplexity scorer (the likelihood baseline) on the same
message: ``over_perplexity`` is what geometry costs per answer over it.

Usage: ``python bench/speed/scorer_speed.py [--responses 2000] [--tokens 10]``; the result:
``python bench/speed/scorer_speed.py | tail -1 > bench/speed/scorer_speed.json``.
The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from abstain_guard.adapters import ReplayResult, TokenStates
from abstain_guard.scorers import PerplexityScorer
from abstain_guard.scorers.geometry import GeometryScorer

L, D = 30, 576
K = 2 * L - 1


def synthetic(n_responses: int, seed: int) -> list[tuple[ReplayResult, bool]]:
    """Labelled synthetic responses (30 % correct; a weak signal in Ω and Φ)."""
    rng = np.random.default_rng(seed)
    pool = rng.normal(size=(4096, L, D)).astype(np.float32)
    pool[..., 0] += 4.0
    out = []
    for _ in range(n_responses):
        correct = bool(rng.uniform() < 0.3)
        n = int(rng.integers(2, 11))
        a, b = rng.integers(0, pool.shape[0] - n, size=2)
        post_attn, post_mlp = pool[a : a + n], pool[b : b + n]
        if correct:
            post_mlp = post_mlp + np.float32(0.3)
        omega = rng.uniform(0, 1, size=(n, K)) + (0.1 if correct else 0.0)
        theta = rng.uniform(0.1, 1.5, size=(n, K))
        logprob = np.log(rng.uniform(0.05, 1.0, size=n))
        meta = {
            "prompt_token_ids": [1, 2, 3],
            "token_ids": list(range(n)),
            "logprobs": {"content": [{"token": "x", "logprob": float(v)} for v in logprob]},
            "entropy": rng.uniform(0, 3, size=n).tolist(),
            "geometry": {
                "num_layers": L,
                "omega": omega.tolist(),
                "theta": theta.tolist(),
                "phi_in": None,
                "phi_out": None,
            },
        }
        out.append((ReplayResult(meta, TokenStates(post_attn, post_mlp)), correct))
    return out


def message_with_phi(scorer: GeometryScorer, replay: ReplayResult) -> dict:
    """The response_metadata a prepared GeometryChatModel would return."""
    assert replay.states is not None
    phi_in, phi_out = scorer.reference_means_.phi(replay.states)
    meta = json.loads(json.dumps(replay.metadata))
    meta["geometry"]["phi_in"] = phi_in.tolist()
    meta["geometry"]["phi_out"] = phi_out.tolist()
    return meta


def time_scoring(scorer: object, msg: dict, repeats: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of ``repeats`` calls of ``scorer.score(msg)`` after 20 warm-ups."""
    for _ in range(20):
        scorer.score(msg)  # type: ignore[attr-defined]
    times, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        u = scorer.score(msg)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        assert np.isfinite(u)
    return times, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--responses", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=10, help="tokens of the scored response")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()

    data = synthetic(args.responses, seed=0)
    half = args.responses // 2
    ref, train = data[:half], data[half:]
    result: dict[str, object] = {
        "bench": "scorer_speed",
        "machine": platform.processor() or platform.machine(),
        "responses": args.responses,
        "num_layers": L,
        "hidden_size": D,
        "feature_dim": 8 * L - 4,
    }
    for variant in ("paper", "raw"):
        t0, c0 = time.perf_counter(), time.process_time()
        scorer = GeometryScorer(variant=variant).fit(ref, train)  # type: ignore[arg-type]
        fit_s, fit_cpu = time.perf_counter() - t0, time.process_time() - c0

        target = synthetic(1, seed=1)[0][0]
        # a response of exactly --tokens tokens
        n = args.tokens
        st = TokenStates(
            np.repeat(target.states.post_attn[:1], n, 0),  # type: ignore[union-attr]
            np.repeat(target.states.post_mlp[:1], n, 0),  # type: ignore[union-attr]
        )
        meta = dict(target.metadata)
        geo = dict(meta["geometry"])
        geo["omega"] = [geo["omega"][0]] * n
        geo["theta"] = [geo["theta"][0]] * n
        meta["geometry"] = geo
        meta["logprobs"] = {"content": [meta["logprobs"]["content"][0]] * n}
        meta["entropy"] = [meta["entropy"][0]] * n
        msg = message_with_phi(scorer, ReplayResult(meta, st))
        times, cpu = time_scoring(scorer, msg, args.repeats)
        stock, _ = time_scoring(PerplexityScorer(), msg, args.repeats)
        result[variant] = {
            "fit_seconds": round(fit_s, 2),
            "fit_cpu_seconds": round(fit_cpu, 2),
            "train_tokens": scorer.fit_info_["train_tokens"],
            "best_iteration": scorer.fit_info_.get("best_iteration"),
            "score_one_ms_median": round(1e3 * statistics.median(times), 3),
            "score_one_ms_p95": round(1e3 * float(np.percentile(times, 95)), 3),
            "score_one_cpu_ms_median": round(1e3 * statistics.median(cpu), 3),
            "perplexity_one_ms_median": round(1e3 * statistics.median(stock), 3),
            "over_perplexity": round(statistics.median(times) / statistics.median(stock), 1),
            "scored_tokens": n,
        }
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    result["under_5ms"] = all(
        result[v]["score_one_ms_median"] < 5.0  # type: ignore[index]
        for v in ("paper", "raw")
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
