"""Guard an API chat model by perplexity from its logprobs (no hidden states).

    python examples/api_model_perplexity.py     # needs the serve extra and langchain-openai

Hosted chat models (e.g. ``ChatOpenAI``) return OpenAI-style token logprobs in
``response_metadata["logprobs"]``; :class:`PerplexityScorer` reads only those, so the guard
needs neither torch nor the model's weights. ``calibrate`` takes such a model as a spec in its
config -- an ``init_chat_model`` name (``"openai:gpt-4o-mini"``) or a ``module:Class`` path,
with kwargs -- asks it for logprobs through the chain the guard will run, judges the answers
and writes an artifact that records the model (without secrets).

To run offline, the embedded model stands in for the API: ``abstain-guard serve --no-guard``
serves it behind an OpenAI-compatible endpoint on a loopback port (here on a thread), and
``ChatOpenAI`` talks to it as it would to OpenAI. With a real provider, put its key in the
environment and drop ``base_url``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage

from abstain_guard import GuardConfig
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.guard.chains import load_guard_chain
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.runner import ServerThread


def calibrate_on_api(base_url: str, out: Path, n_questions: int = 120) -> None:
    """Calibrate a perplexity guard on ``ChatOpenAI`` at ``base_url``."""
    config = CalibrationConfig(
        model={
            "class_path": "langchain_openai:ChatOpenAI",  # or chat_model: "openai:gpt-4o-mini"
            "kwargs": {"model": "smollm2", "base_url": base_url, "max_retries": 0},
        },
        scorer="perplexity",
        ratios=(1, 1, 4, 1),  # a likelihood scorer is not fitted: most questions calibrate
        participation=0.5,
    )
    questions = builtin_probe_set(relations=("capital", "currency"))[:n_questions]
    summary = calibrate(questions, out, config=config, progress=False)
    print(summary.to_text())


def main(model: Any = None, n_questions: int = 120) -> list[AIMessage]:
    """Serve the model as an API, calibrate on it, then ask two questions through the guard
    rebuilt from the artifact; return the guarded messages.

    Participation mode certifies the answer rate with a few dozen calibration answers; a
    risk target (``mode="risk"``) certifies the error among answered questions but needs
    many more (see docs/guarantees.md).
    """
    if model is None:
        from abstain_guard.adapters import load_default_model

        model = load_default_model(max_new_tokens=24)
    os.environ.setdefault("OPENAI_API_KEY", "unused")  # the stand-in server needs no key
    out = []
    with (
        ServerThread(ModelService(model, model_name="smollm2")) as server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        calibrate_on_api(server.base_url, Path(tmp) / "guard", n_questions)
        # the chat model is rebuilt from the recorded spec (the key from the environment);
        # or pass your own: load_guard_chain(..., model=ChatOpenAI(..., logprobs=True))
        chain, guard, _ = load_guard_chain(Path(tmp) / "guard", GuardConfig(participation=0.5))
        print(f"threshold {guard.threshold:.4g}; guarantee {guard.decision_rule.guarantee}")
        for question in ["What is the capital of Canada?", "What is the capital of Eswatini?"]:
            msg = chain.invoke({"question": question})
            info = msg.response_metadata["abstention"]
            print(f"{question} -> {msg.content!r} (perplexity {info['score']:.3f})")
            out.append(msg)
    return out


if __name__ == "__main__":
    main()
