"""Action risk of a step-gated agent: the probability that a wrong tool call is executed.

A run's *action statistic* A is its running maximum at its first call with a wrong tool call
(``+inf`` when it made none, :func:`action_statistic`); under the step guard at τ it executes
a wrong call exactly when A ≤ τ, so the action risk R_a(τ) = P(A ≤ τ) is certified with an
exact binomial fixed sequence from τ = −∞ upward: every τ below the certificate's *ceiling*
(:func:`action_risk_certificate`). With a run-level target too, τ is the largest threshold
that passes both, each at δ/2 (:func:`joint_risk_threshold`). The argument, what it covers
and the simulation: docs/guarantees.md ("Actions: the probability that a wrong tool call
runs"). Pure numpy; shapes ``[n]`` are calibration runs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from abstain_guard.errors import (
    ActionRiskUnavailableError,
    InvalidInputError,
    UncertifiableTargetError,
)
from abstain_guard.guarantee import conformal, risk_control
from abstain_guard.guarantee.agent_steps import running_statistic

ACTION_DELTA_SHARE = 0.5
"""The share of δ the action certificate gets when both targets are set (the run-level
certificate gets the rest): both hold together with probability ≥ 1−δ."""

ACTION_RISK_GRID: tuple[float, ...] = tuple(round(0.01 * k, 2) for k in range(1, 100))
"""The ε_a values :func:`certified_action_risk` tests (0.01, 0.02, …, 0.99), each at
δ / 99."""


def action_statistic(step_scores: Sequence[float], wrong_calls: Sequence[int | bool]) -> float:
    """A run's action statistic A: the running maximum of its step scores at its first model
    call with a wrong tool call (``wrong_calls[t]``: how many of call t's tool calls are
    wrong, or whether any is); ``inf`` when it made none. Its action loss at τ is A ≤ τ.

    Raises:
        ValueError: the two sequences differ in length, or a step score is NaN.
    """
    if len(step_scores) != len(wrong_calls):
        raise ValueError(
            f"{len(step_scores)} step scores but {len(wrong_calls)} calls' verdicts; one per "
            "model call of the run"
        )
    value: float | None = None
    for score, wrong in zip(step_scores, wrong_calls, strict=True):
        value = running_statistic(value, float(score))
        if wrong:
            return value
    return math.inf


def check_action_statistics(values: ArrayLike, n: int | None = None) -> NDArray[np.float64]:
    """``values`` as a read-only float64 ``[n]`` array of action statistics: finite, or
    ``+inf`` for runs without a wrong tool call.

    Raises:
        InvalidInputError: not one-dimensional, another length than ``n``, NaN or ``-inf``.
    """
    try:
        a = np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"action statistics must be numbers: {exc}") from exc
    if a.ndim != 1:
        raise InvalidInputError(f"action statistics must be one-dimensional, got {a.shape}.")
    if n is not None and a.size != n:
        raise InvalidInputError(
            f"{a.size} action statistics for {n} calibration runs; one per run is needed."
        )
    if np.isnan(a).any() or (a == -np.inf).any():
        raise InvalidInputError(
            "action statistics must be finite, or +inf for a run without a wrong tool call."
        )
    a.setflags(write=False)
    return a


def require_action_statistics(values: ArrayLike | None) -> NDArray[np.float64]:
    """``values`` checked (:func:`check_action_statistics`).

    Raises:
        ActionRiskUnavailableError: ``values`` is None (an artifact without them).
    """
    if values is None:
        raise ActionRiskUnavailableError(
            "action_risk_target is set but this artifact stores no action statistics (each "
            "calibration run's score at its first wrong tool call): it was calibrated before "
            "action risk existed, or is not a step-gated agent calibrated on rows with "
            "expected_tool_calls. Recalibrate with `abstain-guard calibrate --agent ...` "
            "(agent_gating: steps, rows with expected_tool_calls), or drop action_risk_target."
        )
    return check_action_statistics(values)


def action_losses(values: ArrayLike, threshold: float) -> NDArray[np.bool_]:
    """Each run's action loss at ``threshold``: whether a wrong tool call of it runs (A ≤ τ)."""
    return np.asarray(check_action_statistics(values) <= threshold)


@dataclass(frozen=True)
class ActionRiskCertificate:
    """R_a(τ) ≤ ε_a for every τ < ``ceiling`` (``-inf``: only τ = −∞, where no tool runs),
    with probability ≥ 1 − ``level`` over the ``n`` calibration runs; ``max_count`` q is the
    most runs with an executed wrong call at which the test still rejects (−1: none)."""

    action_risk_target: float
    level: float
    n: int
    max_count: int
    ceiling: float

    @property
    def feasible(self) -> bool:
        """Whether some finite threshold is certified."""
        return self.ceiling > -math.inf

    def certifies(self, threshold: float) -> bool:
        """Whether the action risk at ``threshold`` is certified (``-inf`` always is)."""
        return threshold == -math.inf or threshold < self.ceiling

    def summary(self, values: ArrayLike, threshold: float) -> dict[str, Any]:
        """The JSON block of a decision's guarantee at ``threshold`` (``values``: the
        calibration runs' action statistics)."""
        losses = action_losses(values, threshold)
        return {
            "action_risk_target": self.action_risk_target,
            "level": self.level,
            "n": self.n,
            "max_count": self.max_count,
            "ceiling": _json_float(self.ceiling),
            "certified": self.certifies(threshold),
            "calibration_runs_with_wrong_call_executed": int(losses.sum()),
            "calibration_action_risk": float(losses.mean()) if losses.size else 0.0,
            "p_value": float(
                risk_control.binomial_p_values(int(losses.sum()), self.n, self.action_risk_target)
            ),
        }


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _check_unit(value: float, name: str) -> float:
    return conformal._check_unit_interval(value, name, "Give a probability such as 0.1.")


def action_risk_certificate(
    values: ArrayLike, action_risk_target: float, level: float
) -> ActionRiskCertificate:
    """Certify P(a wrong tool call is executed) ≤ ε_a in (0, 1) at ``level`` from the runs'
    action statistics ``[n]``: the ceiling below which every threshold is certified.

    Raises:
        InvalidInputError: ε_a or level outside (0, 1), malformed statistics, no runs.
    """
    eps = _check_unit(action_risk_target, "action_risk_target")
    lvl = _check_unit(level, "the action-risk level (delta)")
    a = np.sort(check_action_statistics(values))
    n = int(a.size)
    if n == 0:
        raise InvalidInputError("no calibration runs: the action risk cannot be certified.")
    counts = np.arange(n + 1)
    passing = np.flatnonzero(risk_control.binomial_p_values(counts, n, eps) <= lvl)
    q = int(passing[-1]) if passing.size else -1  # p grows with the count
    if q < 0:
        ceiling = -math.inf
    elif q >= n:
        ceiling = math.inf
    else:
        ceiling = float(a[q])  # the (q+1)-th smallest: τ below it counts at most q runs
    return ActionRiskCertificate(eps, lvl, n, q, ceiling)


def certified_action_risk(
    values: ArrayLike,
    threshold: float,
    delta: float,
    grid: Sequence[float] = ACTION_RISK_GRID,
) -> float | None:
    """The smallest ε_a of ``grid`` certified at ``threshold``, each grid value tested at
    δ/|grid| (Bonferroni: the reading keeps δ); None when none is."""
    dlt = _check_unit(delta, "delta")
    level = dlt / len(grid)
    for eps in sorted(grid):
        if action_risk_certificate(values, eps, level).certifies(threshold):
            return float(eps)
    return None


def joint_risk_threshold(
    scores: ArrayLike,
    correct: ArrayLike,
    values: ArrayLike,
    risk_target: float,
    action_risk_target: float,
    delta: float,
    method: str = risk_control.DEFAULT_RISK_METHOD,
    human: ArrayLike | None = None,
) -> tuple[conformal.RiskThreshold, ActionRiskCertificate]:
    """The largest threshold certifying both the run-level error among accepted runs ≤ ε
    and the action risk ≤ ε_a, together with probability ≥ 1−δ (δ split
    :data:`ACTION_DELTA_SHARE`): the run-level result (infeasible when no threshold passes
    both) and the action certificate. ``human``: the run-level error on the truth
    (:mod:`.truth`)."""
    dlt = _check_unit(delta, "delta")
    a = check_action_statistics(values)  # every calibration run, labeled or not
    action = action_risk_certificate(a, action_risk_target, dlt * ACTION_DELTA_SHARE)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always", conformal.ConformalWarning)
        res = conformal.risk_threshold(
            scores,
            correct,
            risk_target,
            dlt * (1.0 - ACTION_DELTA_SHARE),
            method,
            ceiling=action.ceiling,
            human=human,
        )
    return res, action


def uncertifiable_joint(
    res: conformal.RiskThreshold, action: ActionRiskCertificate, delta: float
) -> UncertifiableTargetError:
    """The error for a pair of targets no threshold certifies together."""
    why = (
        f"the action-risk test cannot pass with {action.n} calibration runs at "
        f"action_risk_target={action.action_risk_target:g}"
        if not action.feasible
        else f"the thresholds that keep the action risk <= {action.action_risk_target:g} "
        f"(below {action.ceiling:.6g}) certify no run-level error <= {res.risk_target:g}"
    )
    return UncertifiableTargetError(
        f"risk_target={res.risk_target:g} and action_risk_target="
        f"{action.action_risk_target:g} cannot be certified together at delta={delta:g} "
        f"(each at {res.delta:.3g}) from these {res.n} calibration runs: {why}. Raise a "
        "target or delta, calibrate on more runs, or set on_infeasible='abstain_all'."
    )


def action_guarantee(
    action: ActionRiskCertificate, values: ArrayLike, res: conformal.RiskThreshold
) -> dict[str, Any]:
    """The certificate's ``action_risk`` block at the jointly chosen threshold
    (:func:`joint_risk_threshold`'s results; ``values``: the calibration runs' statistics)."""
    joint = res.delta + action.level
    block = action.summary(values, res.threshold)
    block["statement"] = (
        f"with probability >= {1 - joint:g} over the calibration runs, together with the "
        "run-level statement: the probability that a run executes a wrong tool call under "
        "the step guard (every run, stopped ones included: a stopped run's earlier tool "
        f"calls ran) is <= {action.action_risk_target:g}; each certificate at "
        f"{action.level:.3g} (union bound)"
    )
    block["run_level_level"] = res.delta
    return block
