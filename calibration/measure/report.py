"""Render evaluation results (:func:`abstain_guard.calibration.measure.evaluation.build_results`) as
``results.json`` (every number), PNG plots (matplotlib, Agg backend) and ``report.md``.

Plots per data set, after the paper:

* ``<data set>_conditional_correctness.png`` — mean conditional correctness against the
  participation target ``1−α`` for every scorer, with the paper's bound (Figures 2 and 7);
* ``<data set>_participation.png`` — mean empirical participation minus its target, with the
  guaranteed band ``[0, 1/(n_cal+1))`` and ±2 Monte-Carlo standard errors;
* ``<data set>_hypothesis.png`` — ``Ω⊙Θ`` and ``Φ^in−Φ^out`` per interleaved layer index for
  correct vs incorrect answers, and their layer averages per response (Figure 8);
* ``<data set>_importance.png`` — permutation importance of Ω, Θ, Φ^in, Φ^out (Figure 9).

Numbers are shown with their bootstrap interval, ``0.87 [0.82, 0.91]``, and the count of
correct / incorrect answers behind them; a value is bold only where it is the best of its
column *and* its interval lies above chance. ``headline.md`` holds the AUROC table and the
data sets where the first scorer (the artifact's) does not win, ready to paste into a README.
Results files written before intervals were recorded still render, without intervals and
without bold.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard.errors import InvalidInputError

__all__ = [
    "COUNTS_ROW",
    "METRIC_LABELS",
    "Cell",
    "above_chance",
    "calibrated_table_markdown",
    "format_cell",
    "guarantee_table_markdown",
    "headline_markdown",
    "interval_note",
    "jsonable",
    "results_table_markdown",
    "shortfalls",
    "write_report",
]

IMPORTANCE_ORDER: tuple[str, ...] = ("omega", "theta", "phi_in", "phi_out")

METRIC_LABELS: dict[str, str] = {
    "auroc": "AUROC (incorrect answers ranked more uncertain; 0.5 = chance)",
    "auprc": "AUPRC (positive = correct answer, ranked by confidence; chance = accuracy)",
    "auprc_incorrect": "AUPRC (positive = incorrect answer, ranked by uncertainty)",
    "prr": "PRR (prediction-rejection ratio; 1 = oracle, 0 = chance)",
    "within_group_auroc": "Within-type AUROC (mean over question types with both classes)",
}
# Chance level of a metric; AUPRC's is the class rate of the scorer's answers (see _chance).
CHANCE_LEVEL: dict[str, float] = {"auroc": 0.5, "within_group_auroc": 0.5, "prr": 0.0}
CHANCE_TEXT: dict[str, str] = {
    "auroc": "chance (0.5)",
    "within_group_auroc": "chance (0.5)",
    "prr": "chance (0)",
    "auprc": "chance (the accuracy)",
    "auprc_incorrect": "chance (the error rate)",
}
COUNTS_ROW = "held-out answers (correct / incorrect)"


def jsonable(obj: Any) -> Any:
    """``obj`` with numpy types turned into Python ones and NaN/±inf into ``None`` (strict
    JSON has no NaN), recursively."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if math.isfinite(f) else None
    return obj


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "dataset"


def _check_results(results: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(results, Mapping) or not isinstance(results.get("datasets"), Mapping):
        raise InvalidInputError(
            "results must be the dict from evaluation.build_results() / evaluate_scores(), "
            "with a 'datasets' mapping."
        )
    return results["datasets"]


def _value(entry: Mapping[str, Any] | None, metric: str) -> float | None:
    if entry is None:
        return None
    v = entry.get(metric)
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _scorer_order(datasets: Mapping[str, Any], key: str = "scorers") -> list[str]:
    order: list[str] = []
    for entry in datasets.values():
        for s in entry.get(key) or {}:
            if s not in order:
                order.append(s)
    return order


@dataclass(frozen=True)
class Cell:
    """One table cell: a metric ``value``, its interval ``ci`` ``(low, high)`` (``None`` in
    results files written before intervals), the metric's ``chance`` level for these answers,
    and ``counts`` ``(correct, incorrect)`` of the answers behind it (``None`` if unknown)."""

    value: float
    ci: tuple[float, float] | None = None
    chance: float | None = None
    counts: tuple[int, int] | None = None


def _interval(entry: Mapping[str, Any], key: str) -> tuple[float, float] | None:
    v = entry.get(key)
    if not isinstance(v, (list, tuple)) or len(v) != 2 or any(x is None for x in v):
        return None
    lo, hi = float(v[0]), float(v[1])
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None


def _counts(entry: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(correct, incorrect)`` of an entry; older files only have ``n`` and ``accuracy``."""
    if entry.get("n_correct") is not None and entry.get("n_incorrect") is not None:
        return int(entry["n_correct"]), int(entry["n_incorrect"])
    n, acc = entry.get("n"), _value(entry, "accuracy")
    if n is None or acc is None:
        return None
    if entry.get("n_correct") is not None:
        return int(entry["n_correct"]), int(n) - int(entry["n_correct"])
    c = round(int(n) * acc)
    return c, int(n) - c


def _chance(metric: str, entry: Mapping[str, Any]) -> float | None:
    if metric in CHANCE_LEVEL:
        return CHANCE_LEVEL[metric]
    acc = _value(entry, "accuracy")
    if acc is None:
        return None
    return acc if metric == "auprc" else 1.0 - acc


def _cell(entry: Mapping[str, Any] | None, metric: str) -> Cell | None:
    """The cell of a scorer entry (or, for ``within_group_auroc``, a within-group entry)."""
    key = "mean_auroc" if metric == "within_group_auroc" else metric
    v = _value(entry, key)
    if entry is None or v is None:
        return None
    return Cell(v, _interval(entry, f"{key}_ci"), _chance(metric, entry), _counts(entry))


MIN_CLASS_COUNT = 5
"""Fewer correct (or incorrect) answers than this and no value is bolded: a stratified
bootstrap keeps the class counts fixed, so with one correct answer it only resamples the
incorrect ones and its interval looks narrow while the ranking rests on one answer."""


def too_few(cell: Cell) -> bool:
    """Fewer than :data:`MIN_CLASS_COUNT` correct or incorrect answers behind the cell."""
    return cell.counts is not None and min(cell.counts) < MIN_CLASS_COUNT


def above_chance(cell: Cell, digits: int | None = None) -> bool:
    """Whether the cell's interval lies wholly above its chance level (no interval: False),
    with at least :data:`MIN_CLASS_COUNT` answers of each class behind it; with ``digits``,
    as shown (no win on an interval that reads ``[0.50, …]``).

    An interval wholly *below* chance also excludes chance, but it means a backwards ranking;
    it is not a win and is not bolded."""
    if too_few(cell) or cell.ci is None or cell.chance is None:
        return False
    low = cell.ci[0] if digits is None else round(cell.ci[0], digits)
    return low > cell.chance


def format_cell(cell: Cell, digits: int = 2, bold: bool = False) -> str:
    """``0.87 [0.82, 0.91]`` (``**0.87** [0.82, 0.91]`` when bold); ``0.87`` without an
    interval."""
    text = f"{cell.value:.{digits}f}"
    if bold:
        text = f"**{text}**"
    if cell.ci is not None:
        text += f" [{cell.ci[0]:.{digits}f}, {cell.ci[1]:.{digits}f}]"
    return text


def _metric_grid(
    datasets: Mapping[str, Any], metric: str, key: str = "scorers"
) -> tuple[list[str], list[str], dict[tuple[str, str], Cell | None]]:
    names = list(datasets)
    scorers = _scorer_order(datasets, key)
    grid: dict[tuple[str, str], Cell | None] = {}
    for d in names:
        entry = datasets[d]
        for s in scorers:
            if metric == "within_group_auroc":
                grid[s, d] = _cell((entry.get("within_group") or {}).get(s), metric)
            else:
                grid[s, d] = _cell((entry.get(key) or {}).get(s), metric)
    return names, scorers, grid


def _column_counts(
    entry: Mapping[str, Any], cells: Sequence[Cell | None]
) -> tuple[int, int] | None:
    """The counts of a column: those of its cells when they all agree, else the data set's;
    ``None`` for a column without values."""
    if all(c is None for c in cells):
        return None
    known = {c.counts for c in cells if c is not None and c.counts is not None}
    if len(known) == 1:
        return known.pop()
    return _counts(entry)


def results_table_markdown(
    results: Mapping[str, Any], metric: str = "auroc", digits: int = 2, calibrated: bool = False
) -> str:
    """The paper's Table-1 layout as Markdown: rows are scorers, columns data sets, cells
    ``value [low, high]`` (the bootstrap interval, when the results carry one), ``–`` where a
    scorer was not evaluated on a data set, and a last row with the correct / incorrect answers
    behind each column (a cell evaluated on other answers, e.g. NaN scores omitted, shows its
    own counts in parentheses).

    The best value of a column (at the shown precision) is bold only when its interval lies
    wholly above chance (:func:`above_chance`); a column whose best interval includes chance
    has no bold, and values without an interval are never bold.

    Args:
        results: the results document.
        metric: ``"auroc"``, ``"auprc"``, ``"auprc_incorrect"``, ``"prr"`` or
            ``"within_group_auroc"``.
        digits: decimals shown.
        calibrated: tabulate ``calibrated_scorers`` instead of ``scorers``.
    """
    if metric not in METRIC_LABELS:
        raise InvalidInputError(f"metric must be one of {sorted(METRIC_LABELS)}, got {metric!r}.")
    datasets = _check_results(results)
    key = "calibrated_scorers" if calibrated else "scorers"
    names, scorers, grid = _metric_grid(datasets, metric, key)
    best: dict[str, float | None] = {}
    col_counts: dict[str, tuple[int, int] | None] = {}
    for d in names:
        vals = [round(c.value, digits) for s in scorers if (c := grid[s, d]) is not None]
        best[d] = max(vals) if vals else None
        col_counts[d] = _column_counts(datasets[d], [grid[s, d] for s in scorers])
    lines = [
        "| Scorer | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for s in scorers:
        cells = []
        for d in names:
            c = grid[s, d]
            if c is None:
                cells.append("–")
                continue
            bold = round(c.value, digits) == best[d] and above_chance(c, digits)
            text = format_cell(c, digits, bold)
            if c.counts is not None and col_counts[d] is not None and c.counts != col_counts[d]:
                text += f" ({c.counts[0]} / {c.counts[1]})"
            cells.append(text)
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    counts = [f"{k[0]} / {k[1]}" if (k := col_counts[d]) else "–" for d in names]
    lines.append(f"| {COUNTS_ROW} | " + " | ".join(counts) + " |")
    return "\n".join(lines) + "\n"


def interval_note(results: Mapping[str, Any], metric: str = "auroc") -> str:
    """One paragraph under a table: what the brackets are, when a value is bold, and which
    data sets have no intervals (older results files)."""
    datasets = _check_results(results)
    settings = {
        (b.get("confidence"), b.get("n_boot"))
        for e in datasets.values()
        if isinstance(b := e.get("bootstrap"), Mapping)
    }
    old = [d for d, e in datasets.items() if not e.get("bootstrap")]
    if not settings:
        return (
            "No intervals: these results were written before intervals were recorded, so "
            "values are shown without them and none is bold.\n"
        )
    if len(settings) == 1:
        conf, n_boot = settings.pop()
        pct = f"{100 * float(conf):g} %" if conf is not None else "?"
        what = (
            f"In brackets: {pct} percentile bootstrap interval ({n_boot} resamples of the "
            "answers, correct and incorrect resampled separately)."
        )
    else:
        what = "In brackets: percentile bootstrap interval (settings per data set in results.json)."
    text = (
        f"{what} **Bold**: the best value of its column, only where its interval lies wholly "
        f"above {CHANCE_TEXT.get(metric, 'chance')} and at least {MIN_CLASS_COUNT} correct and "
        f"{MIN_CLASS_COUNT} incorrect answers are behind it. Intervals are per score: two "
        "overlapping intervals do not settle which of the two scores ranks better."
    )
    if old:
        text += (
            " No intervals for "
            + ", ".join(old)
            + " (results written before intervals were recorded); those values are never bold."
        )
    return text + "\n"


def shortfalls(results: Mapping[str, Any], ours: str | None = None, digits: int = 2) -> list[str]:
    """Where scorer ``ours`` (default: the first scorer, the artifact's in ``evaluate``) does
    not win on AUROC (and within-type AUROC where present), one Markdown bullet per finding:
    another scorer's value is higher (at the shown precision), its interval includes or lies
    below chance, no scorer in a column lies above chance, or it was not evaluated."""
    datasets = _check_results(results)
    lines: list[str] = []
    metrics = ["auroc"]
    if any(e.get("within_group") for e in datasets.values()):
        metrics.append("within_group_auroc")
    for metric in metrics:
        names, scorers, grid = _metric_grid(datasets, metric)
        if not scorers:
            continue
        me = ours if ours is not None else scorers[0]
        label = "" if metric == "auroc" else " (within type)"
        for d in names:
            if metric == "within_group_auroc" and not datasets[d].get("within_group"):
                continue
            mine = grid.get((me, d))
            column = [c for s in scorers if (c := grid[s, d]) is not None]
            few = next((c.counts for c in column if too_few(c)), None)
            if few is not None:
                lines.append(
                    f"- {d}{label}: only {few[0]} correct / {few[1]} incorrect answers held out: "
                    "too few to rank scores (no value is bold, whatever its interval)."
                )
                continue
            if (
                column
                and not any(above_chance(c, digits) for c in column)
                and all(c.ci for c in column)
            ):
                lines.append(f"- {d}{label}: no score's interval lies above chance.")
            if mine is None:
                lines.append(f"- {d}{label}: {me} not evaluated.")
                continue
            better = [
                f"{s} {format_cell(c, digits)}"
                for s in scorers
                if s != me
                and (c := grid[s, d]) is not None
                and round(c.value, digits) > round(mine.value, digits)
            ]
            if better:
                lines.append(
                    f"- {d}{label}: {', '.join(better)} above {me} {format_cell(mine, digits)}."
                )
            if mine.chance is None or above_chance(mine, digits):
                continue
            if mine.ci is not None:
                where = "lies below" if mine.ci[1] < mine.chance else "includes"
                lines.append(
                    f"- {d}{label}: {me}'s interval {format_cell(mine, digits)} {where} chance."
                )
            elif mine.value <= mine.chance:
                lines.append(
                    f"- {d}{label}: {me} {format_cell(mine, digits)} is at or below chance "
                    "(no interval recorded)."
                )
    return lines


def headline_markdown(results: Mapping[str, Any], ours: str | None = None, digits: int = 2) -> str:
    """The headline: the AUROC table (:func:`results_table_markdown`), its
    :func:`interval_note` and the list of :func:`shortfalls` — the block ``write_report``
    puts at the top of ``report.md`` and into ``headline.md``."""
    datasets = _check_results(results)
    scorers = _scorer_order(datasets)
    me = ours if ours is not None else (scorers[0] if scorers else "")
    lost = shortfalls(results, ours, digits)
    parts = [results_table_markdown(results, "auroc", digits), interval_note(results, "auroc")]
    if lost:
        parts.append(f"Where {me} does not win:\n\n" + "\n".join(lost) + "\n")
    elif scorers:
        parts.append(
            f"{me} has the highest AUROC on every data set, with its interval above chance.\n"
        )
    return "\n".join(parts)


def calibrated_table_markdown(
    results: Mapping[str, Any], metric: str = "auroc", digits: int = 2
) -> str:
    """Calibrated baselines (the paper's appendix tables): the calibrated scorer's value (with
    its interval when recorded) and ↑ / ↓ / – against the raw scorer of the same name
    (point estimates compared at the shown precision)."""
    datasets = _check_results(results)
    names, scorers, grid = _metric_grid(datasets, metric, "calibrated_scorers")
    _, _, raw = _metric_grid(datasets, metric, "scorers")
    lines = ["| Scorer (calibrated) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for s in scorers:
        cells = []
        for d in names:
            c = grid[s, d]
            if c is None:
                cells.append("–")
                continue
            r = raw.get((s, d))
            arrow = ""
            if r is not None:
                dv, dr = round(c.value, digits), round(r.value, digits)
                arrow = " ↑" if dv > dr else (" ↓" if dv < dr else " –")
            cells.append(f"{format_cell(c, digits)}{arrow}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def guarantee_table_markdown(results: Mapping[str, Any]) -> str:
    """One row per (data set, scorer): does the mean empirical participation lie in the
    guaranteed band, and is the mean conditional correctness at or above the paper's bound,
    at every participation level? Levels that fail are listed."""
    datasets = _check_results(results)
    lines = [
        "| Data set | Scorer | n_cal / n_test | participation in band | (within 3 MC s.e.) "
        "| correctness ≥ paper bound | (within 3 MC s.e.) "
        "| resplits with correctness ≥ own bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d, entry in datasets.items():
        for key in ("scorers", "calibrated_scorers"):
            for s, sc in (entry.get(key) or {}).items():
                part = sc.get("participation") or {}
                if not part:
                    continue
                rs = sc.get("resplit") or {}
                out_band = [lv for lv, v in part.items() if not v.get("participation_in_band")]
                out_3se = [
                    lv for lv, v in part.items() if not v.get("participation_in_band_within_3se")
                ]
                below = [lv for lv, v in part.items() if not v.get("correctness_at_or_above_bound")]
                below_3se = [
                    lv
                    for lv, v in part.items()
                    if not v.get("correctness_at_or_above_bound_within_3se")
                ]
                fr = [
                    f
                    for v in part.values()
                    if (f := v.get("fraction_resplits_at_or_above_bound")) is not None
                    and math.isfinite(float(f))
                ]
                frac = f"{min(fr):.2f}–{max(fr):.2f}" if fr else "–"

                def verdict(failed: list[str]) -> str:
                    return "all levels" if not failed else "fails at " + ", ".join(failed)

                label = s if key == "scorers" else f"{s} (calibrated)"
                lines.append(
                    f"| {d} | {label} | {rs.get('n_calibration', '?')} / {rs.get('n_test', '?')} "
                    f"| {verdict(out_band)} | {verdict(out_3se)} | {verdict(below)} "
                    f"| {verdict(below_3se)} | {frac} |"
                )
    return "\n".join(lines) + "\n"


def _levels_table(sc: Mapping[str, Any]) -> str:
    lines = [
        "| 1−α | band | empirical participation (± sd) | conditional correctness (± sd) "
        "| paper bound | resplits ≥ bound | none answered |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for lv, v in (sc.get("participation") or {}).items():
        lo, hi = v["band"]

        def f(x: Any, d: int = 3) -> str:
            return "–" if x is None or not math.isfinite(float(x)) else f"{float(x):.{d}f}"

        lines.append(
            f"| {lv} | [{lo:.3f}, {hi:.3f}) | {f(v['empirical_participation'], 4)} "
            f"± {f(v['empirical_participation_sd'])} | {f(v['conditional_correctness'])} "
            f"± {f(v['conditional_correctness_sd'])} | {f(v['paper_bound'])} "
            f"| {f(v['fraction_resplits_at_or_above_bound'], 2)} "
            f"| {v['n_resplits_none_answered']} |"
        )
    return "\n".join(lines) + "\n"


# --- plots -----------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _simulated(entry: Mapping[str, Any]) -> dict[str, Any]:
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


def _plot_conditional_correctness(name: str, entry: Mapping[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (s, sc) in enumerate(_simulated(entry).items()):
        color = colors[i % len(colors)]
        x, cc = _level_arrays(sc, "conditional_correctness")
        _, bound = _level_arrays(sc, "paper_bound")
        ax.plot(x, cc, "o-", color=color, label=s, lw=1.6, ms=4)
        ax.plot(x, bound, "--", color=color, lw=1.0, alpha=0.7)
    if entry.get("accuracy") is not None:
        ax.axhline(float(entry["accuracy"]), color="grey", lw=0.8, ls=":", label="accuracy c/n")
    ax.set_xlabel("participation target 1−α")
    ax.set_ylabel("conditional correctness (test half)")
    first: Mapping[str, Any] = next(iter(_simulated(entry).values()), {})
    rs = first.get("resplit") or {}
    ax.set_title(
        f"{name}: correctness among answered questions\n"
        f"mean of {rs.get('n_resplits', '?')} resplits; dashed = paper's bound (Eq. 9)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    _save(fig, path, dpi=120)


def _plot_participation(name: str, entry: Mapping[str, Any], path: Path) -> None:
    plt = _pyplot()
    scorers = _simulated(entry)
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


def _plot_hypothesis(name: str, hyp: Mapping[str, Any], path: Path) -> None:
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


def _plot_importance(name: str, imp: Mapping[str, Any], path: Path) -> None:
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


# --- the report ------------------------------------------------------------------------


def _hypothesis_rows(datasets: Mapping[str, Any]) -> list[str]:
    rows = []
    for d, entry in datasets.items():
        hyp = entry.get("hypothesis")
        if not hyp:
            continue
        for key, label in (
            ("knowledge_interaction", "H1: Ω⊙Θ larger when correct"),
            ("relative_angular_distance", "H2: Φ^in−Φ^out smaller when correct"),
        ):
            h = hyp.get(key)
            if not h:
                rows.append(
                    f"| {d} | {label} | – | – | – | – | no Φ (reference means not fitted) |"
                )
                continue
            agg = h["aggregate"]
            rows.append(
                f"| {d} | {label} | {agg['mean_correct']:.4g} | {agg['mean_incorrect']:.4g} "
                f"| {agg['mann_whitney_p']:.3g} "
                f"| {h['n_layers_significant_expected_direction']}/{h['n_layer_indices']} "
                f"| {'yes' if h['supported'] else 'no'} |"
            )
    return rows


def write_report(
    results: Mapping[str, Any],
    out_dir: str | Path,
    title: str = "abstain-guard evaluation",
    commands: Sequence[str] | None = None,
) -> Path:
    """Write ``results.json``, the PNG plots, ``report.md`` (which embeds them) and
    ``headline.md`` (:func:`headline_markdown`, the same block as the top of ``report.md``)
    into ``out_dir`` (created if needed); return the path of ``report.md``.

    Args:
        results: the results document (:func:`evaluation.build_results`).
        out_dir: output directory.
        title: the report's heading.
        commands: shell commands that produced the results, listed in the report.
    """
    datasets = _check_results(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(jsonable(results), indent=2, allow_nan=False) + "\n", encoding="utf-8"
    )

    md: list[str] = [f"# {title}", ""]
    meta = results.get("metadata") or {}
    if meta:
        for k, v in meta.items():
            md.append(f"- **{k}**: {v}")
        md.append("")
    if commands:
        md += ["Commands:", "", "```", *commands, "```", ""]
    md += [
        "Every number below is in `results.json`. Uncertainty scores: higher = more uncertain.",
        "",
    ]
    headline = headline_markdown(results)
    (out / "headline.md").write_text(headline, encoding="utf-8")
    md += [f"## {METRIC_LABELS['auroc']}", "", headline]
    for metric in ("auprc", "prr"):
        md += [
            f"## {METRIC_LABELS[metric]}",
            "",
            results_table_markdown(results, metric),
            interval_note(results, metric),
        ]
    if any(e.get("within_group") for e in datasets.values()):
        md += [
            f"## {METRIC_LABELS['within_group_auroc']}",
            "",
            "A score can look strong only because it recognises which *kinds* of question the "
            "model usually gets wrong; within-type AUROC shows whether it knows which *answers* "
            "are wrong.",
            "",
            results_table_markdown(results, "within_group_auroc"),
            interval_note(results, "within_group_auroc"),
        ]
    if any(e.get("calibrated_scorers") for e in datasets.values()):
        md += ["## Calibrated baselines", ""]
        for metric in ("auroc", "auprc"):
            md += [
                f"### {METRIC_LABELS[metric]}",
                "",
                "Arrows compare with the same scorer uncalibrated.",
                "",
                calibrated_table_markdown(results, metric),
            ]
    md += [
        "## Conformal abstention: do the guarantees hold?",
        "",
        "Mean over random calibration/test resplits. The participation guarantee is "
        "P(answered) ∈ [1−α, 1−α+1/(n_cal+1)); the paper's bound (Eq. 9) is computed on each "
        "calibration half.",
        "",
        guarantee_table_markdown(results),
    ]
    hyp_rows = _hypothesis_rows(datasets)
    if hyp_rows:
        md += [
            "## Hypothesis checks (paper Figure 8)",
            "",
            "| Data set | Hypothesis | mean (correct) | mean (incorrect) | Mann–Whitney p "
            "| layers significant in expected direction (BH q<0.05) | supported |",
            "|---|---|---:|---:|---:|---:|---|",
            *hyp_rows,
            "",
        ]
    with_imp = {d: e["importance"] for d, e in datasets.items() if e.get("importance")}
    if len(with_imp) > 1:
        fams = [f for f in IMPORTANCE_ORDER if all(f in imp for imp in with_imp.values())]
        avg = {
            f: {
                f"{m}_drop_{k}": float(
                    np.mean([float(imp[f][f"{m}_drop_mean"]) for imp in with_imp.values()])
                    if k == "mean"
                    else np.std(
                        [float(imp[f][f"{m}_drop_mean"]) for imp in with_imp.values()], ddof=1
                    )
                )
                for m in ("auroc", "auprc")
                for k in ("mean", "sd")
            }
            for f in fams
        }
        if avg:
            _plot_importance(f"mean over {len(with_imp)} data sets", avg, out / "importance.png")
            md += [
                "## Permutation importance, averaged over data sets (paper Figure 9)",
                "",
                "Bars: mean over data sets of each data set's mean drop; error bars: sd across "
                "data sets.",
                "",
                "![permutation importance averaged over data sets](importance.png)",
                "",
            ]

    for d, entry in datasets.items():
        slug = _slug(d)
        md += [
            f"## Data set: {d}",
            "",
            f"{entry.get('n', '?')} responses, {entry.get('n_correct', '?')} correct "
            f"(accuracy {float(entry.get('accuracy', float('nan'))):.3f})"
            + (f", {entry['n_groups']} question types" if entry.get("n_groups") else "")
            + ".",
            "",
        ]
        if _simulated(entry):
            cc_png = f"{slug}_conditional_correctness.png"
            part_png = f"{slug}_participation.png"
            _plot_conditional_correctness(d, entry, out / cc_png)
            _plot_participation(d, entry, out / part_png)
            md += [
                f"![{d}: conditional correctness vs participation]({cc_png})",
                "",
                f"![{d}: empirical participation vs target]({part_png})",
                "",
            ]
        for s, sc in (entry.get("scorers") or {}).items():
            if "error" in sc:
                md += [f"### {d} / {s}", "", f"Not evaluated: {sc['error']}", ""]
            elif sc.get("participation"):
                md += [f"### {d} / {s}", "", _levels_table(sc)]
        if entry.get("hypothesis"):
            png = f"{slug}_hypothesis.png"
            _plot_hypothesis(d, entry["hypothesis"], out / png)
            md += [f"![{d}: hypothesis checks]({png})", ""]
        if entry.get("importance"):
            png = f"{slug}_importance.png"
            _plot_importance(d, entry["importance"], out / png)
            md += [
                f"![{d}: permutation importance]({png})",
                "",
                "| Signal | AUROC drop | AUPRC drop |",
                "|---|---:|---:|",
            ]
            for fam, v in entry["importance"].items():
                md.append(
                    f"| {fam} | {float(v['auroc_drop_mean']):.4f} "
                    f"± {float(v['auroc_drop_sd']):.4f} "
                    f"| {float(v['auprc_drop_mean']):.4f} ± {float(v['auprc_drop_sd']):.4f} |"
                )
            md.append("")
    path = out / "report.md"
    path.write_text("\n".join(md), encoding="utf-8")
    return path
