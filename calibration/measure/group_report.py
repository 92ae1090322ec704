"""``evaluate``'s per-group table: what the pooled rule and the per-group rule do to each
group of held-out questions (participation, and error among answered), with Wilson
intervals, each answer decided by rules calibrated on the other folds (how: docs/results.md,
'Per-group tables').
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard.config import GuardConfig
from abstain_guard.errors import InsufficientDataError
from abstain_guard.guarantee.decision import decision_rule
from abstain_guard.guarantee.groups import group_rates, group_rules

logger = logging.getLogger("abstain_guard.calibration")


def cross_fitted_groups(
    scores: ArrayLike,
    correct: ArrayLike,
    groups: ArrayLike,
    config: GuardConfig,
    folds: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """Pooled vs per-group rule, per group of ``groups [n]``, each of the ``scores [n]`` /
    ``correct [n]`` answers decided by rules calibrated on the other ``folds − 1`` folds at
    ``config``'s target (its ``group_by`` is set here): ``{"pooled": group_rates,
    "per_group": group_rates, "rule_kinds": {group: [kind per fold]}, "folds", "seed",
    "target", "mode"}`` (:func:`abstain_guard.guarantee.groups.group_rates`).
    """
    s = np.asarray(scores, dtype=np.float64)
    j = np.asarray(correct).astype(bool)
    g = np.asarray(groups).astype(str)
    cfg = config.model_copy(
        update={
            "group_by": config.group_by or "group",
            "group_fallback": "abstain",
            "on_infeasible": "abstain_all",
        }
    )
    fold = np.random.default_rng(seed).permutation(s.size) % folds
    pooled = np.zeros(s.size, dtype=bool)
    grouped = np.zeros(s.size, dtype=bool)
    kinds: dict[str, list[str]] = {}
    for f in range(folds):
        cal, test = fold != f, fold == f
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pooled_rule = decision_rule(s[cal], j[cal], cfg)
            rules = group_rules(s[cal], j[cal], g[cal], cfg, pooled=pooled_rule)
        pooled[test] = s[test] <= pooled_rule.threshold
        for i in np.flatnonzero(test):
            grouped[i] = rules.rule_for(str(g[i]))[0].answers(float(s[i]))
        for name, kind in rules.kinds.items():
            kinds.setdefault(name, []).append(kind)
    return {
        "mode": cfg.mode,
        "target": cfg.target,
        "delta": cfg.delta if cfg.mode == "risk" else None,
        "folds": folds,
        "seed": seed,
        "pooled": group_rates(g, pooled, j),
        "per_group": group_rates(g, grouped, j),
        "rule_kinds": kinds,
    }


def group_tables(
    scores: ArrayLike,
    correct: ArrayLike,
    groups: ArrayLike,
    participation: float,
    risk_target: float | None = None,
    delta: float = 0.1,
    seed: int = 0,
) -> dict[str, Any]:
    """The per-group tables ``evaluate`` reports: participation ``1−α`` and, when given,
    risk ``ε`` at ``δ`` (answers with a non-finite score or no group are left out)."""
    s = np.asarray(scores, dtype=np.float64)
    g = np.asarray(groups, dtype=object)
    keep = np.isfinite(s) & np.array([x is not None for x in g.tolist()], dtype=bool)
    args = (s[keep], np.asarray(correct)[keep], g[keep].astype(str))
    out: dict[str, Any] = {}
    configs = {f"participation {participation:g}": GuardConfig(participation=participation)}
    if risk_target is not None:
        configs[f"risk {risk_target:g} at delta {delta:g}"] = GuardConfig(
            mode="risk", risk_target=risk_target, delta=delta
        )
    for name, cfg in configs.items():
        try:
            out[name] = cross_fitted_groups(*args, cfg, seed=seed)
        except InsufficientDataError as exc:  # e.g. one class only in a fold
            logger.warning("per-group table %s skipped: %s", name, exc)
    return out


def _rate(rates: Mapping[str, Any], key: str, count: str, total: str) -> str:
    value = rates.get(key)
    if value is None:
        return "–"
    ci = rates.get(f"{key}_wilson95")
    interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
    return f"{value:.2f}{interval} ({rates[count]}/{rates[total]})"


def groups_markdown(tables: Mapping[str, Any]) -> str:
    """One Markdown table per target: per group, the pooled and the per-group rule's
    participation and error among answered, with 95 % Wilson intervals and counts."""
    md: list[str] = []
    for name, table in tables.items():
        caption = table.get("caption") or (
            f"{table['folds']}-fold cross-fitted; rule kinds per fold in `results.json`"
        )
        md += [
            f"**{name}** ({caption})",
            "",
            "| group | n | accuracy | answered, pooled rule | answered, group rule "
            "| error among answered, pooled | error among answered, group |",
            "|---|---:|---:|---|---|---|---|",
        ]
        rows = [*table["pooled"]["groups"], "all"]
        for g in rows:
            p = table["pooled"]["all"] if g == "all" else table["pooled"]["groups"][g]
            q = table["per_group"]["all"] if g == "all" else table["per_group"]["groups"][g]
            acc = p["accuracy"]
            md.append(
                f"| {'**all**' if g == 'all' else g} | {p['n']} | "
                f"{acc:.2f} | "
                f"{_rate(p, 'participation', 'answered', 'n')} | "
                f"{_rate(q, 'participation', 'answered', 'n')} | "
                f"{_rate(p, 'error_answered', 'wrong_answered', 'answered')} | "
                f"{_rate(q, 'error_answered', 'wrong_answered', 'answered')} |"
                if acc is not None and not math.isnan(acc)
                else f"| {g} | 0 | – | – | – | – | – |"
            )
        md.append("")
    return "\n".join(md)
