"""The calibration steps of ``calibrate --agent``: run the agent as deployed, judge its final
answers, fit the scorer on replays of the reference and train runs, score the calibration
split as the middleware will (docs/agents.md, 'Calibrate the agent as deployed').
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from abstain_guard.contract.chat_model_specs import ChatModelRecord, ChatModelSpec
from abstain_guard.contract.deployment import (
    AgentRecord,
    DeploymentRecord,
    PromptRecord,
    sha256_text,
)
from abstain_guard.errors import CalibrationError
from abstain_guard.guarantee.action_risk import action_statistic
from abstain_guard.guarantee.agent_steps import run_statistic

from .answering.agents import (
    has_final_answer,
    load_agent_factory,
    offered_once,
    run_agents,
    runs_summary,
    step_messages,
)
from .answering.answer_rows import HELD_OUT, AnswerRow, AnswerRows, means_digest
from .judges.base import Judgment
from .judges.judging import Verdicts, check_two_classes, labeled_items, labels
from .questions.datasets import QAItem
from .run.calibration_config import FIT_SCORERS, CalibrationConfig
from .run.store import RunStore
from .run_labels import call_verdicts, run_judgment, step_labels


class AgentCalibrationRun(Protocol):
    """What agent calibration uses of the pipeline's run (``pipeline._Run`` is one): the
    model and its fingerprint, the run cache, the executor (a
    :class:`~.answering.executors.RayExecutor` or None), the progress switch, and the judging step
    with the verdicts it collects."""

    model: Any
    store: RunStore
    fingerprint: str
    progress: bool
    executor: Any
    judgments: Verdicts

    def judge(self, items: Sequence[QAItem], answers: AnswerRows) -> None:
        """Judge ``items``' answers; the verdicts go to :attr:`judgments`."""
        ...


def _no_answer_judgment(row: AnswerRow) -> Judgment:
    reason = (row.get("agent") or {}).get("reason")
    return Judgment(
        correct=None,
        score=None,
        rationale=f"agent run without a final answer ({reason})",
        refusal=False,
    )


def _judge_runs(
    run: AgentCalibrationRun,
    items: Sequence[QAItem],
    rows: AnswerRows,
    config: CalibrationConfig,
    schemas: Sequence[Mapping[str, Any]] | None,
    step_fit: dict[str, list[bool]],
) -> None:
    """Judge the final answers (``run.judge``). Final-answer gating: a run without one gets
    no verdict. Step gating: every run gets its run verdict (:func:`.run_labels.run_judgment`:
    no final answer or a wrong executed tool call is wrong), and ``step_fit`` each run's
    per-call fitting labels."""
    answered = [it for it in items if has_final_answer(rows[it.id])]
    run.judge(answered, rows)
    for it in items:
        row = rows[it.id]
        answer = run.judgments.get(it.id) if has_final_answer(row) else None
        if config.agent_gating != "steps":
            if answer is None:
                run.judgments[it.id] = _no_answer_judgment(row)
            continue
        calls = call_verdicts(it, row, schemas)
        verdict = run_judgment(answer, row, calls)
        run.judgments[it.id] = verdict
        if verdict.correct is not None:
            step_fit[it.id] = step_labels(row, verdict, answer, calls)


def _token_ids(meta: Mapping[str, Any], what: str) -> tuple[Any, Any]:
    """``(prompt ids, generated ids)`` of one model call's metadata."""
    if meta.get("prompt_token_ids") is None or meta.get("token_ids") is None:
        raise CalibrationError(
            f"{what} carries no prompt/response token ids; the agent's model must be a "
            "GeometryChatModel (or an API model with a likelihood scorer)."
        )
    return meta["prompt_token_ids"], meta["token_ids"]


def _step_pairs(items: Sequence[QAItem], rows: AnswerRows) -> list[Any]:
    """The (prompt ids, generated ids) of every model call of ``items``' runs, in order."""
    return [
        _token_ids(step.get("metadata") or {}, f"Model call {t + 1} of the run for {it.id!r}")
        for it in items
        for t, step in enumerate(step_messages(rows[it.id]))
    ]


def _id_pairs(items: Sequence[QAItem], rows: AnswerRows) -> list[Any]:
    """The (prompt ids, generated ids) of ``items``' final answers."""
    return [
        _token_ids(rows[it.id].get("metadata") or {}, f"The final answer to {it.id!r}")
        for it in items
    ]


def run_step_scores(scorer: Any, row: Mapping[str, Any]) -> list[float]:
    """The scorer's score of each model call of a cached run, ``[T]`` (what the middleware
    computes live on each call of the deployed run)."""
    steps = step_messages(row)
    if not steps:
        raise CalibrationError("an agent run without model calls has no step to score")
    return [float(x) for x in scorer.score_many([m.get("metadata") or {} for m in steps])]


def calibration_action_statistics(
    items: Sequence[QAItem],
    rows: AnswerRows,
    step_scores: Sequence[Sequence[float]],
    schemas: Sequence[Mapping[str, Any]] | None,
) -> np.ndarray | None:
    """Each calibration run's action statistic (:func:`abstain_guard.guarantee.action_risk.
    action_statistic`: the running maximum of ``step_scores`` at its first model call with a
    wrong tool call, ``inf`` when none), ``[n]``; None when a row has no expected calls (its
    wrong calls cannot be told, so no action risk can be certified)."""
    out = []
    for it, steps in zip(items, step_scores, strict=True):
        calls = call_verdicts(it, rows[it.id], schemas)
        if calls is None:
            return None
        out.append(action_statistic(steps, [sum(not ok for ok in step) for step in calls]))
    return np.asarray(out, dtype=np.float64)


def calibrate_agent_splits(
    run: AgentCalibrationRun,
    splits: dict[str, list[QAItem]],
    scorer: Any,
    config: CalibrationConfig,
) -> tuple[AnswerRows, Any, np.ndarray, np.ndarray | None]:
    """Run, judge, fit and score (the module's steps). Returns the cached rows per question
    id, the fitted scorer, the calibration split's scores (its labeled items in order) and
    the action statistics of every run of the split, labeled or not (step gating on rows
    with expected calls, else None: :func:`calibration_action_statistics`)."""
    assert config.agent is not None
    fit_items = [*splits["reference"], *splits["train"]]
    rows = _run_agents(run, config, fit_items, run.model, "plain", desc="agent runs (fit)")
    schemas = offered_once(list(rows.values()))["tools"]
    step_fit: dict[str, list[bool]] = {}
    _judge_runs(run, fit_items, rows, config, schemas, step_fit)
    labeled = {n: labeled_items(splits[n], run.judgments) for n in ("reference", "train")}
    check_two_classes(labeled, run.judgments, config)
    if config.scorer in FIT_SCORERS:
        _fit_on_replay(run, scorer, config, labeled, rows, step_fit)
    prepared = scorer.prepare(run.model) if run.executor is None else None
    reference = getattr(scorer, "reference_means_", None)
    held = [it for name in HELD_OUT for it in splits[name]]
    deployed = [
        "as deployed",
        getattr(scorer, "capture", None),
        None if reference is None else means_digest(reference),
    ]
    rows.update(
        _run_agents(
            run, config, held, prepared, *deployed, desc="agent runs (held out)", scorer=scorer
        )
    )
    _judge_runs(run, held, rows, config, schemas, step_fit)
    calibration = labeled_items(splits["calibration"], run.judgments)
    if config.agent_gating != "steps":
        scores = list(scorer.score_many([rows[it.id]["metadata"] for it in calibration]))
        return rows, scorer, np.asarray(scores, dtype=np.float64), None
    scores = [run_statistic(run_step_scores(scorer, rows[it.id])) for it in calibration]
    # the action statistic needs the tool-call verdicts only: every run of the split, also
    # those whose final answer the judge could not label (leaving them out would select the
    # runs the action certificate is computed on by the judge's success)
    every = list(splits["calibration"])
    every_steps = [run_step_scores(scorer, rows[it.id]) for it in every]
    actions = calibration_action_statistics(every, rows, every_steps, schemas)
    return rows, scorer, np.asarray(scores, dtype=np.float64), actions


def _run_agents(
    run: AgentCalibrationRun,
    config: CalibrationConfig,
    items: Sequence[QAItem],
    model: Any,
    *key: Any,
    desc: str,
    scorer: Any = None,
) -> AnswerRows:
    """:func:`run_agents` of ``items`` with the agent built around ``model`` (on the
    executor's replicas when the run has one), cached under the run's fingerprint, the
    factory and ``key``."""
    assert config.agent is not None
    factory = load_agent_factory(config.agent)
    return run_agents(
        factory(model) if run.executor is None else None,
        items,
        run.store,
        key_parts=[run.fingerprint, config.agent, *key],
        step_limit=config.agent_step_limit,
        concurrency=config.batch_size,
        progress=run.progress,
        desc=desc,
        executor=run.executor,
        factory=config.agent,
        scorer=scorer,
    )


def _fit_on_replay(
    run: AgentCalibrationRun,
    scorer: Any,
    config: CalibrationConfig,
    labeled: Mapping[str, Sequence[QAItem]],
    rows: AnswerRows,
    step_fit: Mapping[str, list[bool]],
) -> None:
    """Fit ``scorer`` on the replayed states of the reference and train runs: of their final
    answers, or with step gating of every model call (labelled by ``step_fit``)."""
    from abstain_guard.adapters.engine.replay import replay_token_ids

    steps = config.agent_gating == "steps"
    fitted = []
    for name in ("reference", "train"):
        pairs = (_step_pairs if steps else _id_pairs)(labeled[name], rows)
        if run.executor is None:
            states = replay_token_ids(
                run.model,
                pairs,
                batch_size=config.replay_batch_size,
                return_states=True,
                progress=run.progress,
            )
        else:
            states = run.executor.replay_token_ids(
                pairs, batch_size=config.replay_batch_size, return_states=True
            )
        if steps:
            fit_labels = [ok for it in labeled[name] for ok in step_fit[it.id]]
        else:
            fit_labels = labels(labeled[name], run.judgments)
        fitted.append(list(zip(states, fit_labels, strict=True)))
    scorer.fit(*fitted)


def agent_deployment_record(
    model: Any,
    config: CalibrationConfig,
    items: Sequence[QAItem],
    rows: Sequence[Mapping[str, Any]],
) -> DeploymentRecord:
    """The deployment record of an agent calibration: the model, decoding and chat template
    as for a chain; the system prompt, tools and budget the agent's model calls carried; and
    the :class:`AgentRecord` (factory, step limit, tool-call format, what the runs did)."""
    offered = offered_once(rows)
    generation = next(
        (
            (row.get("metadata") or {}).get("generation") or {}
            for row in rows
            if has_final_answer(row)
        ),
        {},
    )
    api = None
    if isinstance(config.model, ChatModelSpec):  # an API chat model: its class and settings
        api = ChatModelRecord.of(config.model, model)
        budget: Any = getattr(model, "max_tokens", None) or config.max_new_tokens
        if not budget:
            raise CalibrationError(
                "an agent on an API chat model needs its token budget in the model's own "
                "settings: add max_tokens to the model's kwargs (or max_new_tokens to the "
                "config), so that the deployed agent's model can be checked against it"
            )
    else:
        budget = generation.get("max_new_tokens") or getattr(model, "max_new_tokens", None)
    if not any(has_final_answer(row) for row in rows):
        raise CalibrationError("no agent run ended with a final answer; nothing to calibrate")
    settings = getattr(model, "decoding_settings", None)
    system = offered["system_prompt"]
    summary = runs_summary(rows)
    agent = AgentRecord(
        factory=str(config.agent),
        system_prompt=system,
        step_limit=config.agent_step_limit,
        tool_call_format=generation.get("tool_call_format"),
        tool_prompt_sha256=generation.get("tool_prompt_sha256"),
        final_tool_choice=offered["final_tool_choice"],
        call_tool_choices=offered["call_tool_choices"],
        tool_steps=summary["tool_steps_before_final_answer"],
        gating=config.agent_gating,
        labelling=(
            "final_answer_and_tool_calls"
            if config.agent_gating == "steps"
            and any(getattr(it, "expected_tool_calls", ()) for it in items)
            else "final_answer"
        ),
        conversations=any(getattr(it, "history", ()) for it in items),
        runs=summary,
    )
    if generation and generation.get("system_prompt_sha256") != sha256_text(system):
        raise CalibrationError(
            "the final answers' recorded system prompt is not the one the agent's calls "
            "carried; the agent changes its prompt between calls"
        )
    fingerprint = api.fingerprint if api is not None else getattr(model, "fingerprint", None)
    return DeploymentRecord(
        chat_model=api,
        model_fingerprint=None if fingerprint is None else str(fingerprint),
        chat_template_sha256=getattr(model, "chat_template_sha256", None),
        decoding=settings() if callable(settings) else {},
        prompts={
            kind: PromptRecord(
                system_prompt=system,
                max_new_tokens=int(budget),
                rendering="agent input: {question}",
            )
            for kind in sorted({it.kind for it in items})
        },
        tools=offered["tools"],
        agent=agent,
        conversations=agent.conversations,
    )
