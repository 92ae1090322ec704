"""Per-group rules in simulation: a finite population with groups, made continuous on one
position axis, its calibration draws, and each group's *true* participation and error rate
among answered at the thresholds ``group_rules`` (the code the guard runs) chooses.

Used by ``tests/unit/guarantee/test_groups.py`` and ``experiments/groups/group_guarantees.py``.
The population's N pairs (score, correct), sorted by score with ties broken at random once,
occupy the unit intervals [i, i+1) of a position axis; a draw picks an atom uniformly (so
groups come in their population proportions) and a uniform position inside it. A group's true
participation at threshold t is its mass below t over its size, its true risk the errors
among that mass.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from abstain_guard import GuardConfig
from abstain_guard.guarantee.groups import group_rules


@dataclass(frozen=True)
class GroupPopulation:
    """A finite population with groups, made continuous on one position axis.

    Attributes:
        name: short name.
        errors: ``[N]`` 1 where atom i (sorted by score) is a wrong answer.
        group_index: ``[N]`` the group of atom i (an index into ``names``).
        names: the group names.
    """

    name: str
    errors: NDArray[np.int64]
    group_index: NDArray[np.int64]
    names: tuple[str, ...]

    @property
    def size(self) -> int:
        return int(self.errors.size)

    def _cum(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """``[G, N+1]`` group atoms and group errors among the first i atoms."""
        onehot = (self.group_index[None, :] == np.arange(len(self.names))[:, None]).astype(float)
        zero = np.zeros((len(self.names), 1))
        cnt = np.concatenate([zero, np.cumsum(onehot, axis=1)], axis=1)
        err = np.concatenate([zero, np.cumsum(onehot * self.errors[None, :], axis=1)], axis=1)
        return cnt, err

    def rates(self, k: int, t: float, cum: tuple[NDArray, NDArray]) -> tuple[float, float]:
        """Group k's true ``(participation, risk among answered)`` at threshold position t."""
        cnt, err = cum
        total = cnt[k, -1]
        if t <= 0:
            return 0.0, 0.0
        if t >= self.size:
            return 1.0, float(err[k, -1] / total)
        i = math.floor(t)
        own = float(self.group_index[i] == k) * (t - i)
        mass = cnt[k, i] + own
        wrong = err[k, i] + own * self.errors[i]
        return float(mass / total), float(wrong / mass) if mass > 0 else 0.0

    def draw(
        self, rng: np.random.Generator, n: int
    ) -> tuple[NDArray[np.float64], NDArray[np.bool_], NDArray[np.str_]]:
        """One calibration set of n: positions ``[n]``, correct ``[n]``, groups ``[n]``."""
        atoms = rng.integers(0, self.size, size=n)
        names = np.array(self.names)
        return atoms + rng.random(n), self.errors[atoms] == 0, names[self.group_index[atoms]]


def from_pairs(
    name: str, scores: NDArray, correct: NDArray, groups: NDArray, seed: int
) -> GroupPopulation:
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(scores.size), scores))
    names = tuple(sorted(set(np.asarray(groups).tolist())))
    index = np.array([names.index(g) for g in np.asarray(groups)[order]])
    errors = (~np.asarray(correct, dtype=bool)[order]).astype(np.int64)
    return GroupPopulation(name, errors, index, names)


#: The synthetic groups: (name, share, score offset, P(wrong) at u = 0, slope in u).
SYNTHETIC_GROUPS = (
    ("easy", 0.4, 0.0, 0.05, 0.4),
    ("medium", 0.3, 0.3, 0.2, 0.5),
    ("hard", 0.2, 0.5, 0.5, 0.4),
    ("rare", 0.1, 0.2, 0.1, 0.6),
)


def synthetic_population(seed: int, size: int = 20_000) -> GroupPopulation:
    """Four groups: score = offset + u, u ~ U(0, 1), P(wrong | u) = level + slope·u."""
    rng = np.random.default_rng(seed)
    shares = np.array([g[1] for g in SYNTHETIC_GROUPS])
    k = rng.choice(len(SYNTHETIC_GROUPS), size=size, p=shares)
    u = rng.random(size)
    offset = np.array([g[2] for g in SYNTHETIC_GROUPS])[k]
    p_wrong = (
        np.array([g[3] for g in SYNTHETIC_GROUPS])[k]
        + np.array([g[4] for g in SYNTHETIC_GROUPS])[k] * u
    )
    correct = rng.random(size) >= p_wrong
    names = np.array([g[0] for g in SYNTHETIC_GROUPS])[k]
    return from_pairs("synthetic", offset + u, correct, names, seed + 1)


def _position(threshold: float, size: int) -> float:
    return float(np.clip(threshold, 0.0, float(size)))


def simulate_cell(
    pop: GroupPopulation, n: int, config: GuardConfig, reps: int, seed: int
) -> dict[str, Any]:
    """``reps`` calibration sets of n thresholded by ``config`` (per group and pooled)."""
    rng = np.random.default_rng(seed)
    cum = pop._cum()
    G = len(pop.names)
    part = np.full((reps, G), np.nan)
    upper = np.full((reps, G), np.nan)
    risk = np.zeros((reps, G))
    pooled_part = np.zeros((reps, G))
    pooled_risk = np.zeros((reps, G))
    own = np.zeros((reps, G), dtype=bool)
    for r in range(reps):
        pos, correct, groups = pop.draw(rng, n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rules = group_rules(pos, correct, groups, config)
        t_pooled = _position(rules.pooled.threshold, pop.size)
        for k, name in enumerate(pop.names):
            pooled_part[r, k], pooled_risk[r, k] = pop.rates(k, t_pooled, cum)
            if rules.kinds.get(name) != "group":
                continue  # absent from the draw, or too small: abstains (valid in risk mode)
            own[r, k] = True
            rule = rules.rules[name]
            part[r, k], risk[r, k] = pop.rates(k, _position(rule.threshold, pop.size), cum)
            if config.mode == "participation":
                interval = rule.guarantee.participation_interval
                assert interval is not None  # participation mode states its interval
                upper[r, k] = interval[1]
    out: dict[str, Any] = {
        "population": pop.name,
        "n": n,
        "mode": config.mode,
        "reps": reps,
        "groups": {},
    }
    if config.mode == "participation":
        target = config.participation
        out["participation"] = target
        for k, name in enumerate(pop.names):
            m = own[:, k]
            vals = part[m, k]
            se = float(vals.std(ddof=1) / math.sqrt(vals.size)) if vals.size > 1 else math.nan
            mean, up = float(vals.mean()), float(upper[m, k].mean())
            out["groups"][name] = {
                "own_rule_runs": int(m.sum()),
                "mean_participation": mean,
                "se": se,
                "band": [target, up],
                "valid": bool(mean >= target - 3 * se and mean <= up + 3 * se),
                "pooled_mean_participation": float(pooled_part[:, k].mean()),
            }
        out["valid"] = all(g["valid"] for g in out["groups"].values())
        return out

    eps, delta = float(config.risk_target or 0.0), config.delta
    delta_g = delta / G if config.group_delta == "union" else delta
    se_g = math.sqrt(delta_g * (1 - delta_g) / reps)
    out.update(risk_target=eps, delta=delta, group_delta=config.group_delta, delta_g=delta_g)
    violated = (risk > eps) & own
    for k, name in enumerate(pop.names):
        v = float(violated[:, k].mean())
        out["groups"][name] = {
            "violation": v,
            "limit": delta_g + 3 * se_g,
            "valid": bool(v <= delta_g + 3 * se_g),
            "certified_runs": int(own[:, k].sum()),
            "mean_participation": float(np.nan_to_num(part[:, k], nan=0.0).mean()),
            "pooled_violation": float(np.mean((pooled_risk[:, k] > eps) & (pooled_part[:, k] > 0))),
            "pooled_mean_participation": float(pooled_part[:, k].mean()),
        }
    any_v = float(violated.any(axis=1).mean())
    out["any_group_violation"] = any_v
    out["valid"] = all(g["valid"] for g in out["groups"].values())
    if config.group_delta == "union":
        limit = delta + 3 * math.sqrt(delta * (1 - delta) / reps)
        out["any_group_limit"] = limit
        out["valid"] = out["valid"] and any_v <= limit
    return out
