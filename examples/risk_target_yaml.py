"""Set a risk target from a YAML config and see the certified bound.

    python examples/risk_target_yaml.py

``guard.yaml`` asks for at most 30 % wrong answers among the answered ones, with
probability 1 - delta = 90 % over the calibration draw (Learn-then-Test). Changing the
target re-thresholds from the scores stored in the artifact: no model run is needed.

A target the calibration set cannot certify is refused with
:class:`~abstain_guard.errors.UncertifiableTargetError`, which names the smallest target it
can certify (``abstain-guard evaluate`` prints the whole frontier); this example then falls
back to that one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from abstain_guard import AbstentionGuard, GuardConfig, default_artifact_path
from abstain_guard.contract.prompts import question_prompt
from abstain_guard.errors import UncertifiableTargetError

CONFIG = Path(__file__).with_name("guard.yaml")


def main(model: Any = None) -> dict[str, Any]:
    """Build the guard from ``guard.yaml``, ask two questions, return the decision info."""
    if model is None:
        from abstain_guard.adapters import load_default_model

        model = load_default_model(max_new_tokens=24)  # as calibrated
    config = GuardConfig.from_file(CONFIG)
    try:
        guard = AbstentionGuard.from_artifact(default_artifact_path(), model, config=config)
    except UncertifiableTargetError as exc:
        print(f"refused: {exc}")
        if exc.smallest_risk_target is None:
            raise
        config = config.model_copy(update={"risk_target": exc.smallest_risk_target})
        guard = AbstentionGuard.from_artifact(default_artifact_path(), model, config=config)
    rule = guard.decision_rule
    print(f"mode={rule.mode} target={rule.target} threshold={rule.threshold:.4g}")
    print(f"guarantee: {rule.guarantee}")
    chain = question_prompt() | guard
    infos = {}
    for question in ["What is the capital of Italy?", "What is the capital of Tuvalu?"]:
        msg = chain.invoke({"question": question})
        info = msg.response_metadata["abstention"]
        infos[question] = info
        print(
            f"{question} -> {msg.content!r} (score {info['score']:.3f}, "
            f"{'abstained' if info['abstained'] else 'answered'})"
        )
    return {"rule": rule, "config": config, "decisions": infos}


if __name__ == "__main__":
    main()
