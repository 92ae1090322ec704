"""The report's PNG figures (matplotlib, Agg backend), after the paper:

* ``<data set>_conditional_correctness.png`` — mean conditional correctness against the
  participation target ``1−α`` for every scorer, with the paper's bound (Figures 2 and 7);
* ``<data set>_participation.png`` — mean empirical participation minus its target, with the
  guaranteed band ``[0, 1/(n_cal+1))`` and ±2 Monte-Carlo standard errors;
* ``<data set>_hypothesis.png`` — ``Ω⊙Θ`` and ``Φ^in−Φ^out`` per interleaved layer index for
  correct vs incorrect answers, and their layer averages per response (Figure 8);
* ``<data set>_importance.png`` — permutation importance of Ω, Θ, Φ^in, Φ^out (Figure 9).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    # Lazy: matplotlib is heavy and only needed when a report with plots is written.
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def simulated_scorers(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The data set's scorers that have resplit results (not the ones with an error)."""
    return {s: sc for s, sc in (entry.get("scorers") or {}).items() if sc.get("participation")}


def _level_arrays(sc: Mapping[str, Any], field: str) -> tuple[np.ndarray, np.ndarray]:
    part = sc.get("participation") or {}
    xs = np.array([float(v["target_participation"]) for v in part.values()])
    ys = np.array(
        [np.nan if v.get(field) is None else float(v[field]) for v in part.values()],
        dtype=np.float64,
    )
    return xs, ys


def _save(fig: Any, path: Path, dpi: int = 120) -> None:
    """Lay out, write and close a figure (closing frees matplotlib's memory)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)


def plot_conditional_correctness(name: str, entry: Mapping[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (s, sc) in enumerate(simulated_scorers(entry).items()):
        color = colors[i % len(colors)]
        x, cc = _level_arrays(sc, "conditional_correctness")
        _, bound = _level_arrays(sc, "paper_bound")
        ax.plot(x, cc, "o-", color=color, label=s, lw=1.6, ms=4)
        ax.plot(x, bound, "--", color=color, lw=1.0, alpha=0.7)
    if entry.get("accuracy") is not None:
        ax.axhline(float(entry["accuracy"]), color="grey", lw=0.8, ls=":", label="accuracy c/n")
    ax.set_xlabel("participation target 1−α")
    ax.set_ylabel("conditional correctness (test half)")
    first: Mapping[str, Any] = next(iter(simulated_scorers(entry).values()), {})
    rs = first.get("resplit") or {}
    ax.set_title(
        f"{name}: correctness among answered questions\n"
        f"mean of {rs.get('n_resplits', '?')} resplits; dashed = paper's bound (Eq. 9)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    _save(fig, path, dpi=120)


def plot_participation(name: str, entry: Mapping[str, Any], path: Path) -> None:
    plt = _pyplot()
    scorers = simulated_scorers(entry)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    first: Mapping[str, Any] = next(iter(scorers.values()), {})
    x, _ = _level_arrays(first, "target_participation")
    width = np.array(
        [v["band"][1] - v["band"][0] for v in (first.get("participation") or {}).values()]
    )
    if x.size:
        ax.fill_between(
            x,
            0,
            width,
            color="tab:green",
            alpha=0.2,
            step="mid",
            label="guaranteed band [0, 1/(n_cal+1))",
        )
    n_s = max(1, len(scorers))
    spread = 0.02
    for i, (s, sc) in enumerate(scorers.items()):
        xs, emp = _level_arrays(sc, "empirical_participation")
        _, se = _level_arrays(sc, "empirical_participation_se")
        _, target = _level_arrays(sc, "target_participation")
        offset = (i - (n_s - 1) / 2) * spread / n_s
        ax.errorbar(xs + offset, emp - target, yerr=2 * se, fmt="o", ms=3, capsize=2, label=s)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel("participation target 1−α")
    ax.set_ylabel("mean empirical participation − 1−α")
    ax.set_title(f"{name}: participation vs target (error bars: ±2 Monte-Carlo s.e.)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    _save(fig, path, dpi=120)


def plot_hypothesis(name: str, hyp: Mapping[str, Any], path: Path) -> None:
    plt = _pyplot()
    panels = [("knowledge_interaction", r"$\Omega \odot \Theta$ (knowledge interaction)")]
    if hyp.get("relative_angular_distance"):
        panels.append(
            (
                "relative_angular_distance",
                r"$\Phi^{\mathrm{in}} - \Phi^{\mathrm{out}}$ (relative angular distance)",
            )
        )
    fig, axes = plt.subplots(2, len(panels), figsize=(5.6 * len(panels), 7.0), squeeze=False)
    for j, (key, title) in enumerate(panels):
        h = hyp[key]
        pl = h["per_layer"]
        idx = np.arange(len(pl["mean_correct"]))
        ax = axes[0, j]
        for lab, color in (("correct", "tab:blue"), ("incorrect", "tab:red")):
            m = np.asarray(pl[f"mean_{lab}"], dtype=np.float64)
            e = np.asarray(pl[f"sem_{lab}"], dtype=np.float64)
            ax.plot(idx, m, color=color, label=f"{lab} (n={h[f'n_{lab}']})")
            ax.fill_between(idx, m - e, m + e, color=color, alpha=0.2)
        ax.set_xlabel(r"interleaved layer index (dir$^1$, prop$^1$, …, dir$^L$)")
        ax.set_title(f"{name}: {title}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax2 = axes[1, j]
        agg = h["aggregate"]
        data = [np.asarray(agg["values_correct"]), np.asarray(agg["values_incorrect"])]
        if all(d.size >= 2 for d in data):
            ax2.violinplot(data, showmedians=True)
        else:
            ax2.boxplot(data)
        ax2.set_xticks([1, 2], ["correct", "incorrect"])
        ax2.set_title(
            f"layer-averaged per response; Mann–Whitney p = {agg['mann_whitney_p']:.3g}",
            fontsize=9,
        )
        ax2.grid(alpha=0.3)
    _save(fig, path, dpi=110)


def plot_importance(name: str, imp: Mapping[str, Any], path: Path) -> None:
    plt = _pyplot()
    fams = list(imp)
    x = np.arange(len(fams))
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    w = 0.38
    for k, (metric, color) in enumerate((("auroc", "tab:blue"), ("auprc", "tab:orange"))):
        means = [float(imp[f][f"{metric}_drop_mean"]) for f in fams]
        sds = [float(imp[f][f"{metric}_drop_sd"]) for f in fams]
        ax.bar(
            x + (k - 0.5) * w,
            means,
            w,
            yerr=sds,
            capsize=3,
            color=color,
            label=f"{metric.upper()} drop",
        )
    pretty = {
        "omega": r"$\Omega$",
        "theta": r"$\Theta$",
        "phi_in": r"$\Phi^{\mathrm{in}}$",
        "phi_out": r"$\Phi^{\mathrm{out}}$",
    }
    ax.set_xticks(x, [pretty.get(f, f) for f in fams])
    ax.axhline(0, color="black", lw=0.6)
    ax.set_ylabel("drop when permuted (mean ± sd)")
    ax.set_title(f"{name}: permutation importance of the geometry signals", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    _save(fig, path, dpi=120)


def plot_frontier(name: str, frontier: Mapping[str, Any], path: Path) -> None:
    """Certified calibration participation vs risk target ε, one line per δ."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    eps = np.asarray(frontier["risk_targets"], dtype=np.float64)
    for d, parts in frontier["participation"].items():
        ax.plot(eps, np.asarray(parts, dtype=np.float64), marker="o", ms=3, label=f"δ = {d}")
    ax.set_xlabel("risk target ε (max error among answered)")
    ax.set_ylabel("certified participation")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{name}: certifiable frontier (n = {frontier['n']})")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)
