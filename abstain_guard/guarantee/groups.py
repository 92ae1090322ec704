"""Per-group guarantees: one conformal rule per group of questions (Mondrian calibration).

With ``GuardConfig(group_by=...)`` every calibration group gets its own rule, computed by
:func:`~.decision.decision_rule` on that group's answers alone, so each statement holds
conditionally on the group (δ per group, or δ/G with ``group_delta="union"``). A group
without a rule of its own gets ``group_fallback``, a question of an unknown group
``unknown_group``. The statements, the library comparison and the measurements:
docs/guarantees.md, section 4.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from abstain_guard.config import GuardConfig
from abstain_guard.errors import (
    ArtifactMismatchError,
    GuardError,
    InsufficientDataError,
    InvalidInputError,
    UncertifiableTargetError,
)
from abstain_guard.guarantee.certificate import Certificate
from abstain_guard.guarantee.conformal import min_calibration_size
from abstain_guard.guarantee.decision import DecisionRule, decision_rule
from abstain_guard.guarantee.frontier import smallest_certifiable_risk
from abstain_guard.guarantee.intervals import wilson_interval
from abstain_guard.guarantee.selection import ScorerSelection

logger = logging.getLogger("abstain_guard")


def check_groups(groups: ArrayLike, n: int) -> NDArray[np.str_]:
    """Validated calibration groups ``[n]`` as a fixed-width unicode array.

    Raises:
        InvalidInputError: not one non-empty string per calibration answer.
    """
    arr = np.asarray(groups)
    if arr.ndim != 1 or arr.shape[0] != int(n):
        raise InvalidInputError(
            f"groups must hold one group name per calibration answer: expected shape "
            f"({n},), got {arr.shape}."
        )
    if arr.dtype.kind not in ("U", "O"):
        raise InvalidInputError(
            f"groups must be strings (the group of each calibration answer), got dtype {arr.dtype}."
        )
    bad = [i for i, g in enumerate(arr.tolist()) if not isinstance(g, str) or not g.strip()]
    if bad:
        raise InvalidInputError(
            f"groups must be non-empty strings; entries {bad[:5]} are not. Give every "
            "calibration question a group (the data's group field), or calibrate without one."
        )
    return np.asarray(arr.tolist(), dtype=np.str_)


def resolve_group(
    group_by: str | Callable[[Any], Any],
    input: Any,
    metadata: Mapping[str, Any] | None = None,
) -> str | None:
    """The group of one question: ``group_by(input)`` for a function; for a key, the
    input's value when the input is a mapping holding it, else the run metadata's.

    Returns None when the key is nowhere (the guard then applies ``unknown_group``).
    """
    if callable(group_by):
        value = group_by(input)
    elif isinstance(input, Mapping) and group_by in input:
        value = input[group_by]
    else:
        value = (metadata or {}).get(group_by)
    if value is None:
        return None
    text = str(value)
    return text if text.strip() else None


def group_of(
    config: GuardConfig, input: Any, metadata: Mapping[str, Any] | None = None
) -> str | None:
    """The group of one question under ``config.group_by`` (None without it, or when the
    input has no group); a ``group_by`` that fails gives None (an unknown group) with a
    warning.

    Raises:
        GuardError: the ``group_by`` lookup failed and ``config.on_error == "raise"``.
    """
    if config.group_by is None:
        return None
    try:
        return resolve_group(config.group_by, input, metadata)
    except Exception as exc:
        reason = f"group_by could not find the question's group ({type(exc).__name__}: {exc})"
        if config.on_error == "raise":
            raise GuardError(f"{reason}. Fix group_by, or set on_error='abstain'.") from exc
        logger.warning("abstain_guard: %s; the group is unknown", reason)
        return None


@dataclass(frozen=True)
class GroupRules:
    """The rule in force for every calibration group (its own, or its fallback: ``kinds``
    says ``"group"``, ``"pooled"`` or ``"abstain"``, ``reasons`` why), the pooled rule, the
    group sizes, what an unknown group gets and δ_g (None in participation mode)."""

    pooled: DecisionRule
    rules: Mapping[str, DecisionRule]
    kinds: Mapping[str, str]
    sizes: Mapping[str, int]
    reasons: Mapping[str, str] = field(default_factory=dict)
    unknown_group: str = "abstain"
    delta_per_group: float | None = None

    def rule_for(self, group: str | None) -> tuple[DecisionRule, str]:
        """``(rule, kind)`` for a question of ``group`` (None: the group is unknown)."""
        if group is not None and group in self.rules:
            return self.rules[group], self.kinds[group]
        what = "has no group" if group is None else f"is of group {group!r}, not calibrated"
        note = (
            f"the question {what} (calibrated groups: {sorted(self.rules)}); "
            f"unknown_group={self.unknown_group!r}"
        )
        if self.unknown_group == "pooled":
            return _pooled_fallback(self.pooled, group, note), "pooled"
        return _abstain_rule(self.pooled, group, note), "abstain"

    def summary(self) -> dict[str, Any]:
        """JSON-ready: per group its size, rule kind, threshold and target."""
        return {
            g: {
                "n": self.sizes[g],
                "rule": self.kinds[g],
                "threshold": self.rules[g].threshold,
                "target": self.rules[g].target,
                **({"reason": self.reasons[g]} if g in self.reasons else {}),
            }
            for g in sorted(self.rules)
        }


def _with_group(rule: DecisionRule, group: str | None, **extra: Any) -> DecisionRule:
    guarantee = rule.guarantee.replace(group=group, **extra)
    return DecisionRule(rule.threshold, rule.mode, rule.target, guarantee)


def _pooled_fallback(pooled: DecisionRule, group: str | None, note: str) -> DecisionRule:
    warning = (
        f"{note}: the pooled rule applies, whose guarantee is marginal over all calibration "
        "groups, not for this group"
    )
    return _with_group(
        pooled,
        group,
        scope="pooled",
        warnings=(*pooled.guarantee.warnings, warning),
    )


def _abstain_rule(pooled: DecisionRule, group: str | None, note: str) -> DecisionRule:
    statement = "the guard abstains on every question of this group"
    return DecisionRule(
        -math.inf,
        pooled.mode,
        pooled.target,
        Certificate(
            kind=pooled.mode,
            group=group,
            scope="abstain",
            statement=statement,
            warnings=(f"{note}: {statement}",),
        ),
    )


def _group_config(config: GuardConfig, target: float, delta: float) -> GuardConfig:
    """One group's config: its target and δ_g; an infeasible participation target raises
    (caught: the group falls back), an uncertifiable risk target gives an infeasible rule
    (no frontier search per group)."""
    update: dict[str, Any] = {
        "delta": delta,
        "on_infeasible": "abstain_all" if config.mode == "risk" else "raise",
        "group_by": None,
        "group_targets": None,
    }
    update["risk_target" if config.mode == "risk" else "participation"] = target
    return config.model_copy(update=update)


def group_rules(
    scores: ArrayLike,
    correct: ArrayLike,
    groups: ArrayLike,
    config: GuardConfig,
    pooled: DecisionRule | None = None,
    selection: ScorerSelection | None = None,
    human: ArrayLike | None = None,
) -> GroupRules:
    """Each calibration group's rule for ``config``'s target (Mondrian calibration), from
    scores, labels and groups ``[n]``. ``pooled``: the pooled rule when already computed;
    ``selection`` (every group certifies at its δ / K too) and ``human`` (each group's
    reviewed answers) as for :func:`~.decision.decision_rule`.

    Raises:
        InsufficientDataError: ``group_fallback="raise"`` and some group is too small for a
            finite participation threshold (UncertifiableTargetError in risk mode: no
            threshold certifies its ε), naming every such group.
    """
    s = np.asarray(scores, dtype=np.float64)
    j = np.asarray(correct).astype(bool)
    g = check_groups(groups, s.size)
    h = None if human is None else np.asarray(human)
    if pooled is None:
        pooled = decision_rule(s, j, config, selection=selection, human=h)
    names = sorted(set(g.tolist()))
    delta_g = None
    if config.mode == "risk":
        delta_g = config.delta / len(names) if config.group_delta == "union" else config.delta
    unknown_targets = sorted(set(config.group_targets or {}) - set(names))
    if unknown_targets:
        logger.warning(
            "abstain_guard groups: group_targets names groups absent from calibration: %s",
            unknown_targets,
        )
    rules: dict[str, DecisionRule] = {}
    reasons: dict[str, str] = {}
    sizes = {name: int((g == name).sum()) for name in names}
    for name in names:
        mask = g == name
        cfg = _group_config(config, config.group_target(name), delta_g or config.delta)
        calibration = (s[mask], j[mask], None if h is None else h[mask])
        own = _own_rule(calibration, cfg, config, selection)
        if isinstance(own, str):
            reasons[name] = own
            continue
        extra: dict[str, Any] = {
            "scope": "group",
            "group_n": sizes[name],
            "statement": f"for a question of group {name!r}: {own.guarantee.statement}",
        }
        if delta_g is not None:
            extra.update(delta_sharing=config.group_delta, delta_total=config.delta)
        rules[name] = _with_group(own, name, **extra)
    kinds = dict.fromkeys(rules, "group")
    if reasons and config.group_fallback == "raise":
        raise _too_small(reasons, sizes, config)
    for name, reason in reasons.items():
        note = (
            f"group {name!r} ({sizes[name]} calibration answers) has no rule of its own ({reason})"
        )
        logger.warning("abstain_guard groups: %s; group_fallback=%r", note, config.group_fallback)
        if config.group_fallback == "pooled":
            rules[name], kinds[name] = _pooled_fallback(pooled, name, note), "pooled"
        else:
            rules[name], kinds[name] = _abstain_rule(pooled, name, note), "abstain"
    return GroupRules(pooled, rules, kinds, sizes, reasons, config.unknown_group, delta_g)


def _own_rule(
    calibration: tuple[np.ndarray, np.ndarray, np.ndarray | None],
    cfg: GuardConfig,
    config: GuardConfig,
    selection: ScorerSelection | None,
) -> DecisionRule | str:
    """One group's own rule from its ``(scores, labels, human)`` under its ``cfg``, or why it
    has none (with ``group_fallback="raise"``, what it can certify: a search)."""
    s, j, h = calibration
    try:
        own = decision_rule(s, j, cfg, selection=selection, human=h)
    except InsufficientDataError as exc:
        return _reason(exc, cfg)
    if own.guarantee.feasible is not False:
        return own
    reason = f"no threshold certifies risk_target={cfg.risk_target:g} at delta={cfg.delta:g}"
    if config.group_fallback == "raise":
        level = cfg.delta / (selection.n_candidates if selection is not None else 1)
        smallest = smallest_certifiable_risk(s, j, level, h)
        can = f"{smallest:g}" if smallest is not None else "none below 1"
        reason += f"; the smallest it certifies is {can}"
    return reason


def _reason(exc: InsufficientDataError, cfg: GuardConfig) -> str:
    """Why one group has no rule of its own, in a line."""
    if cfg.mode == "participation":
        need = min_calibration_size(cfg.alpha)
        return f"participation {cfg.participation:g} needs at least {need} calibration answers"
    return str(exc)


def _too_small(
    reasons: Mapping[str, str], sizes: Mapping[str, int], config: GuardConfig
) -> InsufficientDataError:
    listed = "; ".join(f"{g!r} (n={sizes[g]}): {reasons[g]}" for g in sorted(reasons))
    message = (
        f"{len(reasons)} calibration group(s) cannot get a rule of their own for this target: "
        f"{listed}. Calibrate on more questions of these groups, change their targets "
        "(group_targets), or set group_fallback='pooled' (the pooled rule, with a warning) or "
        "'abstain' (abstain on these groups)."
    )
    if config.mode == "risk":
        return UncertifiableTargetError(message)
    return InsufficientDataError(message)


def require_groups(groups: NDArray[np.str_] | None, config: GuardConfig) -> NDArray[np.str_]:
    """The artifact's groups (``config.group_by`` needs them).

    Raises:
        ArtifactMismatchError: the artifact records no calibration groups.
    """
    if groups is None:
        raise ArtifactMismatchError(
            f"The config asks for per-group rules (group_by={config.group_by!r}), but this "
            "artifact records no group for its calibration answers. Calibrate again with "
            "groups (the built-in probe set records its relations; a data file needs "
            "group_by in the calibration config), or drop group_by."
        )
    return groups


# --- reporting --------------------------------------------------------------------------


def group_rates(groups: ArrayLike, answered: ArrayLike, correct: ArrayLike) -> dict[str, Any]:
    """``{"all": rates, "groups": {name: rates}}`` of the test questions' groups, whether
    each was answered and right ``[m]``: questions, answered, participation and the error
    rate among answered, each rate with its 95 % Wilson interval."""
    g = np.asarray(groups).astype(str)
    a = np.asarray(answered).astype(bool)
    c = np.asarray(correct).astype(bool)
    if not (g.shape == a.shape == c.shape) or g.ndim != 1:
        raise InvalidInputError(
            f"groups, answered and correct must be 1-D of one length, got {g.shape}, "
            f"{a.shape}, {c.shape}."
        )
    return {
        "all": _rates(np.ones_like(a), a, c),
        "groups": {name: _rates(g == name, a, c) for name in sorted(set(g.tolist()))},
    }


def _rates(mask: NDArray[np.bool_], a: NDArray[np.bool_], c: NDArray[np.bool_]) -> dict[str, Any]:
    n, k = int(mask.sum()), int((a & mask).sum())
    wrong = int((a & mask & ~c).sum())
    return {
        "n": n,
        "answered": k,
        "participation": k / n if n else None,
        "participation_wilson95": wilson_interval(k, n),
        "wrong_answered": wrong,
        "error_answered": wrong / k if k else None,
        "error_answered_wilson95": wilson_interval(wrong, k),
        "accuracy": float(c[mask].mean()) if n else None,
    }
