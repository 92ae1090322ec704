"""Per-group (Mondrian) rules: thresholds against crepes, fallbacks, unknown groups, the
artifact's groups, and the guard deciding by the question's group."""

from __future__ import annotations

import asyncio
import logging
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from _core_fakes import ScriptedChatModel
from group_simulation import simulate_cell, synthetic_population
from langchain_core.messages import AIMessage
from langchain_core.prompts import ChatPromptTemplate

from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.errors import (
    ArtifactMismatchError,
    ConfigError,
    GuardError,
    InsufficientDataError,
    InvalidInputError,
    UncertifiableTargetError,
)
from abstain_guard.guarantee.conformal import participation_threshold, risk_threshold
from abstain_guard.guarantee.groups import check_groups, group_rates, group_rules, resolve_group
from abstain_guard.scorers import PerplexityScorer


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three groups on different score scales and accuracies: 'a' (n=300), 'b' (200), 'c' (7)."""
    rng = np.random.default_rng(seed)
    sizes = {"a": 300, "b": 200, "c": 7}
    offsets = {"a": 0.0, "b": 0.6, "c": 0.3}
    scores, correct, groups = [], [], []
    for name, n in sizes.items():
        u = rng.random(n)
        scores.append(offsets[name] + u)
        correct.append(rng.random(n) >= 0.1 + 0.6 * u)
        groups += [name] * n
    return np.concatenate(scores), np.concatenate(correct), np.array(groups)


def _cfg(**kw: object) -> GuardConfig:
    return GuardConfig(group_by="tenant", **kw)  # type: ignore[arg-type]


# --- the math: each group's rule is the single-group rule on its answers ------------------


@pytest.mark.parametrize("participation", [0.5, 0.8, 0.9])
def test_group_thresholds_are_the_single_group_thresholds(participation: float) -> None:
    s, j, g = _data()
    rules = group_rules(s, j, g, _cfg(participation=participation, group_fallback="pooled"))
    for name in ("a", "b"):
        own = participation_threshold(s[g == name], 1 - participation)
        assert rules.kinds[name] == "group" and rules.rules[name].threshold == own.threshold
        assert rules.rules[name].guarantee.participation_interval == pytest.approx(
            [participation, participation + 1 / ((g == name).sum() + 1)]
        )
    assert rules.pooled.threshold == participation_threshold(s, 1 - participation).threshold


def test_group_thresholds_match_crepes_mondrian() -> None:
    """crepes' Mondrian conformal regressor on residuals = our scores, predicting 0: the
    upper end of each bin's interval is that bin's conformal threshold; a bin too small for
    the confidence gets +inf (ours: no rule of its own, the fallback)."""
    crepes = pytest.importorskip("crepes")
    rng = np.random.default_rng(3)
    for trial in range(80):
        sizes = rng.integers(2, 60, size=4)
        names = np.array([f"g{k}" for k in range(4)])
        groups = np.repeat(names, sizes)
        scores = rng.gamma(2.0, 1.0, size=groups.size) + 1e-3
        correct = rng.random(groups.size) < 0.5
        correct[:2] = [True, False]
        alpha = float(rng.choice([0.1, 0.2, 0.25, 0.3]))
        # crepes floors α(n+1) without a tolerance for float noise; compare off the integers
        if any(abs(alpha * (n + 1) - round(alpha * (n + 1))) < 1e-6 for n in sizes):
            continue
        cr = crepes.ConformalRegressor().fit(residuals=scores, bins=groups)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            upper = cr.predict_int(np.zeros(names.size), bins=names, confidence=1 - alpha)[:, 1]
        rules = group_rules(
            scores, correct, groups, _cfg(participation=1 - alpha, group_fallback="pooled")
        )
        for name, theirs in zip(names, upper, strict=True):
            if math.isinf(theirs):
                assert rules.kinds[name] == "pooled", (trial, name)
            else:
                assert rules.kinds[name] == "group"
                assert rules.rules[name].threshold == pytest.approx(theirs, rel=0, abs=0)


@pytest.mark.parametrize("sharing", ["per_group", "union"])
def test_risk_rules_use_the_shared_delta(sharing: str) -> None:
    s, j, g = _data(1)
    cfg = _cfg(
        mode="risk", risk_target=0.3, delta=0.1, group_delta=sharing, group_fallback="abstain"
    )
    rules = group_rules(s, j, g, cfg)
    level = 0.1 if sharing == "per_group" else 0.1 / 3
    assert rules.delta_per_group == pytest.approx(level)
    for name in ("a", "b"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            own = risk_threshold(s[g == name], j[g == name], 0.3, level)
        rule = rules.rules[name]
        if own.feasible:
            assert rules.kinds[name] == "group" and rule.threshold == own.threshold
            assert rule.guarantee.delta == pytest.approx(level)
            assert rule.guarantee.statement.startswith(f"for a question of group {name!r}")
        else:
            assert rules.kinds[name] == "abstain" and rule.threshold == -math.inf


def test_group_targets_override_the_target() -> None:
    s, j, g = _data()
    rules = group_rules(s, j, g, _cfg(participation=0.8, group_targets={"a": 0.5}))
    assert rules.rules["a"].target == 0.5
    assert rules.rules["a"].threshold == participation_threshold(s[g == "a"], 0.5).threshold
    assert rules.rules["b"].target == 0.8


# --- fallbacks and unknown groups -----------------------------------------------------------


def test_small_group_raises_by_default_naming_it() -> None:
    s, j, g = _data()  # group 'c' has 7 answers; participation 0.9 needs 9
    with pytest.raises(InsufficientDataError, match=r"'c' \(n=7\).*needs at least 9"):
        group_rules(s, j, g, _cfg(participation=0.9))
    with pytest.raises(UncertifiableTargetError, match=r"'c'.*smallest it certifies"):
        group_rules(s, j, g, _cfg(mode="risk", risk_target=0.35))


def test_small_group_fallbacks(caplog: pytest.LogCaptureFixture) -> None:
    s, j, g = _data()
    with caplog.at_level(logging.WARNING, logger="abstain_guard"):
        pooled = group_rules(s, j, g, _cfg(participation=0.9, group_fallback="pooled"))
    assert "'c'" in caplog.text
    rule, kind = pooled.rule_for("c")
    assert kind == "pooled" and rule.threshold == pooled.pooled.threshold
    assert rule.guarantee.scope == "pooled"
    assert any("not for this group" in w for w in rule.guarantee.warnings)
    assert "needs at least 9" in pooled.reasons["c"]

    abstain = group_rules(s, j, g, _cfg(participation=0.9, group_fallback="abstain"))
    rule, kind = abstain.rule_for("c")
    assert kind == "abstain" and rule.threshold == -math.inf and not rule.answers(-1e300)
    assert abstain.summary()["c"]["rule"] == "abstain"


def test_unknown_group_abstains_by_default_or_takes_the_pooled_rule() -> None:
    s, j, g = _data()
    rules = group_rules(s, j, g, _cfg(group_fallback="pooled"))
    for group in (None, "zzz"):
        rule, kind = rules.rule_for(group)
        assert kind == "abstain" and rule.threshold == -math.inf
    pooled = group_rules(s, j, g, _cfg(group_fallback="pooled", unknown_group="pooled"))
    rule, kind = pooled.rule_for("zzz")
    assert kind == "pooled" and rule.threshold == pooled.pooled.threshold
    assert "'zzz', not calibrated" in rule.guarantee.warnings[-1]


def test_resolve_group_and_check_groups() -> None:
    assert resolve_group("tenant", {"tenant": "a", "question": "q"}) == "a"
    assert resolve_group("tenant", "a question", {"tenant": "b"}) == "b"
    assert resolve_group("tenant", {"question": "q"}, {"tenant": 7}) == "7"
    assert resolve_group("tenant", "q", {}) is None
    assert resolve_group("tenant", {"tenant": " "}) is None
    assert resolve_group(lambda x: x["kind"], {"kind": "c"}) == "c"
    assert check_groups(["a", "b"], 2).dtype.kind == "U"
    for bad in (["a"], ["a", ""], [1, 2], [["a"], ["b"]]):
        with pytest.raises(InvalidInputError):
            check_groups(bad, 2)


def test_config_group_settings() -> None:
    with pytest.raises(ConfigError, match="group_targets needs group_by"):
        GuardConfig(group_targets={"a": 0.9})
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        GuardConfig(group_by="t", group_targets={"a": 1.5})
    with pytest.raises(ConfigError, match="group_fallback"):
        GuardConfig(group_by="t", group_fallback="ignore")
    env = GuardConfig.from_env(
        {"ABSTAIN_GUARD_GROUP_BY": "tenant", "ABSTAIN_GUARD_GROUP_TARGETS": '{"a": 0.7}'}
    )
    assert (
        env.group_by == "tenant" and env.group_target("a") == 0.7 and env.group_target("b") == 0.8
    )
    with pytest.raises(ConfigError, match="JSON object"):
        GuardConfig.from_env({"ABSTAIN_GUARD_GROUP_TARGETS": "a=0.7"})


def test_group_rates_with_wilson_intervals() -> None:
    rates = group_rates(["a", "a", "a", "b"], [True, True, False, False], [True, False, True, True])
    a = rates["groups"]["a"]
    assert (a["n"], a["answered"], a["wrong_answered"]) == (3, 2, 1)
    assert a["participation"] == pytest.approx(2 / 3) and a["error_answered"] == 0.5
    lo, hi = a["participation_wilson95"]
    assert lo < 2 / 3 < hi
    b = rates["groups"]["b"]
    assert b["error_answered"] is None and b["error_answered_wilson95"] is None
    assert rates["all"]["n"] == 4 and rates["all"]["answered"] == 2


# --- the artifact keeps the groups ---------------------------------------------------------


def _artifact(groups: np.ndarray | None) -> GuardArtifact:
    rng = np.random.default_rng(0)
    n = 400
    g = np.where(np.arange(n) < 200, "a", "b")
    # perplexities: group a in [1, 1.5], group b in [5, 9]
    scores = np.where(g == "a", 1.0 + 0.5 * rng.random(n), 5.0 + 4.0 * rng.random(n))
    correct = rng.random(n) < 0.6
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(scores, correct, groups=g if groups is None else groups),
        model_fingerprint="m-1",
    )


def test_artifact_round_trip_keeps_groups(tmp_path: Path) -> None:
    art = _artifact(None)
    path = art.save(tmp_path / "guard")
    loaded = GuardArtifact.load(path)
    assert loaded.groups is not None and list(loaded.groups) == list(art.groups)  # type: ignore[arg-type]
    assert GuardArtifact.read_manifest(path)["groups"] == {"a": 200, "b": 200}
    cfg = _cfg(participation=0.8)
    assert loaded.group_rules(cfg).summary() == art.group_rules(cfg).summary()
    assert loaded.group_rules(cfg) is loaded.group_rules(cfg)  # cached per config

    plain = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(art.scores, art.correct)
    )
    path2 = plain.save(tmp_path / "plain")
    assert GuardArtifact.load(path2).groups is None
    assert "groups" not in GuardArtifact.read_manifest(path2)
    with pytest.raises(ArtifactMismatchError, match="records no group"):
        GuardArtifact.load(path2).group_rules(cfg)


# --- the guard decides by the question's group ----------------------------------------------

SCRIPT = {"easy": ("Paris", [-0.01]), "hard": ("Lima is it", [-2.0, -1.5, -2.5])}


def _decision(msg: AIMessage) -> dict[str, object]:
    return msg.response_metadata["abstention"]


def test_guard_applies_the_group_rule() -> None:
    model = ScriptedChatModel(script=SCRIPT, fingerprint="m-1")
    guard = AbstentionGuard(model, artifact=_artifact(None), config=_cfg(participation=0.8))
    # "hard" has perplexity e^2 = 7.39: inside group b's band, far outside group a's
    b = guard.invoke("hard", config={"metadata": {"tenant": "b"}})
    d = _decision(b)
    assert b.content == "Lima is it" and d["group"] == "b" and d["group_rule"] == "group"
    assert 5.0 < d["threshold"] < 9.0  # type: ignore[operator]
    assert d["guarantee"]["group"] == "b"  # type: ignore[index]
    a = guard.invoke("hard", config={"metadata": {"tenant": "a"}})
    assert a.content == "I don't know." and _decision(a)["group"] == "a"

    chain = ChatPromptTemplate.from_messages([("human", "{question}")]) | guard
    out = chain.invoke({"question": "hard"}, config={"metadata": {"tenant": "b"}})
    assert out.content == "Lima is it"  # the run metadata reaches the guard inside a chain

    unknown = guard.invoke("easy")  # no group anywhere: unknown_group="abstain"
    d = _decision(unknown)
    assert unknown.content == "I don't know." and d["group"] is None
    assert d["group_rule"] == "abstain" and d["reason"] == "group without a rule: abstain"
    assert d["score"] == pytest.approx(math.exp(0.01))  # still scored


def test_guard_group_function_and_its_failure() -> None:
    model = ScriptedChatModel(script=SCRIPT, fingerprint="m-1")
    art = _artifact(None)
    by_text = AbstentionGuard(
        model, artifact=art, config=GuardConfig(group_by=lambda q: "b" if q == "hard" else "a")
    )
    assert by_text.invoke("hard").content == "Lima is it"

    def broken(_: object) -> str:
        raise KeyError("tenant")

    closed = AbstentionGuard(model, artifact=art, config=GuardConfig(group_by=broken))
    assert _decision(closed.invoke("easy"))["group_rule"] == "abstain"
    raising = AbstentionGuard(
        model, artifact=art, config=GuardConfig(group_by=broken, on_error="raise")
    )
    with pytest.raises(GuardError, match="group_by could not find"):
        raising.invoke("easy")


def test_guard_async_uses_the_group() -> None:
    model = ScriptedChatModel(script=SCRIPT, fingerprint="m-1")
    guard = AbstentionGuard(model, artifact=_artifact(None), config=_cfg())
    out = asyncio.run(guard.ainvoke("hard", config={"metadata": {"tenant": "b"}}))
    assert out.content == "Lima is it" and _decision(out)["group_rule"] == "group"


def test_guard_without_group_by_is_unchanged() -> None:
    model = ScriptedChatModel(script=SCRIPT, fingerprint="m-1")
    guard = AbstentionGuard(model, artifact=_artifact(None), config=GuardConfig())
    d = _decision(guard.invoke("easy", config={"metadata": {"tenant": "b"}}))
    assert "group" not in d and "group_rule" not in d


# --- validity in simulation (experiments/groups/group_guarantees.py with fewer draws) --------


@pytest.mark.parametrize(
    "config",
    [
        {"participation": 0.8},
        {"mode": "risk", "risk_target": 0.35, "delta": 0.1},
        {"mode": "risk", "risk_target": 0.35, "delta": 0.1, "group_delta": "union"},
    ],
    ids=["participation", "risk-per-group", "risk-union"],
)
def test_group_rules_are_valid_in_simulation(config: dict[str, object]) -> None:
    pop = synthetic_population(seed=5, size=5000)
    cfg = GuardConfig(group_by="g", group_fallback="abstain", on_infeasible="abstain_all", **config)  # type: ignore[arg-type]
    logging.disable(logging.WARNING)
    try:
        cell = simulate_cell(pop, n=600, config=cfg, reps=150, seed=11)
    finally:
        logging.disable(logging.NOTSET)
    assert cell["valid"], cell
    if cfg.mode == "risk":
        # the pooled rule breaks the target on the hard groups: what group rules are for
        assert cell["groups"]["hard"]["pooled_violation"] > 0.9
        assert cell["groups"]["easy"]["certified_runs"] > 100
    else:
        hard = cell["groups"]["hard"]
        assert hard["pooled_mean_participation"] < 0.7 < hard["mean_participation"]


# --- calibrate records the groups --------------------------------------------------------------


def test_calibrate_records_each_calibration_answers_group(tmp_path: Path) -> None:
    from _pipeline_fakes import ITEMS, HashJudge, _config, _judges
    from tiny_models import tiny_chat_model

    from abstain_guard.calibration.building.pipeline import calibrate, calibration_groups

    calibrate(
        ITEMS,
        tmp_path / "guard",
        config=_config(tmp_path, "guard"),
        model=tiny_chat_model("llama", seed=0),
        judges=_judges(tmp_path, "guard", HashJudge()),
        progress=False,
    )
    art = GuardArtifact.load(tmp_path / "guard")
    by_id = {it.id: it.group for it in ITEMS}
    assert art.groups is not None
    assert list(art.groups) == [by_id[i] for i in art.metadata["calibration_ids"]]
    rules = art.group_rules(GuardConfig(group_by="g", participation=0.5, group_fallback="pooled"))
    assert set(rules.rules) == {"g0", "g1"}

    assert calibration_groups(ITEMS[:3]) == ["g0", "g1", "g0"]
    plain = [it.__class__(id=it.id, question=it.question, answers=it.answers) for it in ITEMS[:3]]
    assert calibration_groups(plain) is None
    assert calibration_groups([*plain[:1], *ITEMS[1:3]]) is None  # partial: not stored


def test_evaluate_report_shows_pooled_and_group_rules_per_group(tmp_path: Path) -> None:
    from _results import evaluate_scores

    from abstain_guard.calibration.measure.group_report import group_tables
    from abstain_guard.calibration.measure.report import write_report
    from abstain_guard.calibration.measure.results import MeasureSettings

    s, j, g = _data()
    results = evaluate_scores(
        {"perplexity": s}, j, name="toy", settings=MeasureSettings(n_resplits=20, n_boot=0)
    )
    tables = group_tables(s, j, [*g[:-1], None], participation=0.8, risk_target=0.35)
    assert set(tables) == {"participation 0.8", "risk 0.35 at delta 0.1"}
    part = tables["participation 0.8"]
    assert part["per_group"]["all"]["n"] == s.size - 1  # the answer without a group is left out
    # group b's scores sit above group a's: pooled answers a more often than its target
    assert part["pooled"]["groups"]["a"]["participation"] > 0.9
    assert abs(part["per_group"]["groups"]["a"]["participation"] - 0.8) < 0.06
    results["datasets"]["toy"]["groups"] = tables
    report = write_report(results, tmp_path).read_text()
    assert "## Per-group guarantees" in report and "| a | 300 |" in report


# --- serve: the group comes from the request's metadata -----------------------------------------


def test_serve_takes_the_group_from_the_request_metadata() -> None:
    pytest.importorskip("fastapi")
    import httpx
    from _serve_fakes import artifact as serve_artifact

    from abstain_guard.serve.runner import ServerThread
    from abstain_guard.serve.service import GuardService

    base = serve_artifact()  # "Lima" has perplexity 1.05
    g = np.where(np.arange(120) < 60, "a", "b")
    scores = np.concatenate([base.scores, np.linspace(0.5, 1.0, 60)])  # b: 1.05 is too high
    correct = np.concatenate([base.correct, base.correct])
    art = GuardArtifact(
        base.scorer,
        CalibrationSet(scores, correct, groups=g),
        model_fingerprint="m-1",
        metadata=base.metadata,
    )
    service = GuardService(
        *_chain_and_guard(art, GuardConfig(group_by="relation", participation=0.8))
    )
    with ServerThread(service) as server:

        def ask(**extra: object) -> str:
            body = {"messages": [{"role": "user", "content": "Capital of Peru?"}], **extra}
            reply = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30)
            assert reply.status_code == 200, reply.text
            return str(reply.json()["choices"][0]["message"]["content"])

        assert ask(metadata={"relation": "a"}) == "Lima"
        assert ask(metadata={"relation": "b"}) == "I don't know."
        assert ask() == "I don't know."  # no group: unknown_group="abstain"
        health = httpx.get(f"{server.base_url.removesuffix('/v1')}/readyz", timeout=30).json()
        assert health["group_by"] == "relation" and set(health["groups"]) == {"a", "b"}


def _chain_and_guard(art: GuardArtifact, config: GuardConfig) -> tuple[object, ...]:
    from _serve_fakes import ToolScriptModel

    from abstain_guard.contract.deployment import DeploymentRecord
    from abstain_guard.guard.chains import load_guard_chain

    chain, guard, loaded = load_guard_chain(art, config, model=ToolScriptModel())
    record = DeploymentRecord.from_metadata(loaded.metadata)
    return chain, guard, record


# --- the agent middleware: the group from the run metadata or a state function ----------


def test_middleware_applies_the_group_rule() -> None:
    pytest.importorskip("langchain.agents")
    from _core_fakes import QueueChatModel
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage

    from abstain_guard import AbstentionMiddleware

    art = _artifact(None)  # group a: perplexities 1-1.5, group b: 5-9
    unsure = [-2.0, -2.0]  # perplexity e^2 = 7.39

    def run(metadata: dict[str, str] | None, **cfg: object) -> dict[str, object]:
        model = QueueChatModel(queue=[("Quito.", unsure, [])], fingerprint="m-1")
        mw = AbstentionMiddleware(art, config=GuardConfig(**cfg))  # type: ignore[arg-type]
        agent = create_agent(model, tools=[], middleware=[mw])
        config = {"metadata": metadata} if metadata else None
        result = agent.invoke({"messages": [HumanMessage("Capital of Peru?")]}, config=config)
        return result["messages"][-1].response_metadata["abstention"]  # type: ignore[no-any-return]

    b = run({"tenant": "b"}, group_by="tenant")
    assert b["abstained"] is False and b["group"] == "b" and b["group_rule"] == "group"
    a = run({"tenant": "a"}, group_by="tenant")
    assert a["abstained"] is True and a["group"] == "a"
    state_fn = run(None, group_by=lambda state: "b" if state.get("messages") else None)
    assert state_fn["abstained"] is False and state_fn["group"] == "b"
    unknown = run(None, group_by="tenant")
    assert unknown["abstained"] is True and unknown["group_rule"] == "abstain"


def test_the_shipped_guard_records_its_relations() -> None:
    """README's per-group example runs on the shipped guard: its artifact must keep the
    relation of each calibration answer (``calibrate`` records it; ``probe:<relation>:<key>``
    ids say which)."""
    from abstain_guard import default_artifact_path

    art = GuardArtifact.load(default_artifact_path())
    assert art.groups is not None, "re-save the shipped guard with its groups (docs/guarantees.md)"
    relations = [i.split(":")[1] for i in art.metadata["calibration_ids"]]
    assert list(art.groups) == relations
    rules = art.group_rules(GuardConfig(group_by="relation", group_targets={"capital": 0.9}))
    assert len(rules.rules) == 10 and set(rules.kinds.values()) == {"group"}
