"""Markdown tables of the ranking metrics (the paper's Table 1 layout): every value with its
bootstrap interval, ``0.87 [0.82, 0.91]``, and the count of correct / incorrect answers behind
it; a value is bold only where it is the best of its column *and* its interval lies above
chance. :func:`headline_markdown` is the AUROC table with the data sets where the first scorer
(the artifact's) does not win, ready to paste into a README. Results measured without
intervals (``n_boot=0``) render without them and without bold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from abstain_guard.errors import InvalidInputError

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


def check_results(results: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``datasets`` mapping of a results document (``build_results``)."""
    if not isinstance(results, Mapping) or not isinstance(results.get("datasets"), Mapping):
        raise InvalidInputError(
            "results must be the dict from results.build_results(), with a 'datasets' mapping."
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
    """One table cell: a metric ``value``, its interval ``ci`` ``(low, high)`` (``None``
    without intervals), the metric's ``chance`` level for these answers,
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
    """``(correct, incorrect)`` of an entry (``None`` for an entry without counts)."""
    if entry.get("n_correct") is None or entry.get("n_incorrect") is None:
        return None
    return int(entry["n_correct"]), int(entry["n_incorrect"])


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
    has no bold, and values without an interval are never bold. ``metric`` is a key of
    :data:`METRIC_LABELS`; ``calibrated`` tabulates ``calibrated_scorers`` instead.
    """
    if metric not in METRIC_LABELS:
        raise InvalidInputError(f"metric must be one of {sorted(METRIC_LABELS)}, got {metric!r}.")
    datasets = check_results(results)
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
    data sets have no intervals (measured with ``n_boot=0``)."""
    datasets = check_results(results)
    settings = {
        (b.get("confidence"), b.get("n_boot"))
        for e in datasets.values()
        if isinstance(b := e.get("bootstrap"), Mapping)
    }
    old = [d for d, e in datasets.items() if not e.get("bootstrap")]
    if not settings:
        return "No intervals (measured with n_boot=0): no value is bold.\n"
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
            + " (measured with n_boot=0); those values are never bold."
        )
    return text + "\n"


def shortfalls(results: Mapping[str, Any], ours: str | None = None, digits: int = 2) -> list[str]:
    """Where scorer ``ours`` (default: the first scorer, the artifact's in ``evaluate``) does
    not win on AUROC (and within-type AUROC where present), one Markdown bullet per finding:
    another scorer's value is higher (at the shown precision), its interval includes or lies
    below chance, no scorer in a column lies above chance, or it was not evaluated."""
    datasets = check_results(results)
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
    datasets = check_results(results)
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
    datasets = check_results(results)
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


def frontier_markdown(frontier: Mapping[str, Any]) -> str:
    """The certifiable frontier of one artifact (:func:`abstain_guard.guarantee.frontier.
    frontier_document`): certified calibration participation per risk target ε and δ, and
    the smallest certifiable ε per δ."""
    deltas = list(frontier["participation"])
    lines = [
        "| risk target ε | " + " | ".join(f"δ = {d}" for d in deltas) + " |",
        "|---:|" + "---:|" * len(deltas),
    ]
    for i, eps in enumerate(frontier["risk_targets"]):
        cells = []
        for d in deltas:
            p = float(frontier["participation"][d][i])
            cells.append(f"{p:.2f}" if p > 0 else "—")
        lines.append(f"| {eps:.2f} | " + " | ".join(cells) + " |")
    smallest = [
        f"δ = {d}: " + ("none below 1" if v is None else f"{float(v):.2f}")
        for d, v in frontier["smallest"].items()
    ]
    lines += [
        "",
        f"Smallest certifiable ε ({frontier['n']} calibration answers, "
        f"{frontier.get('method', '')}): " + "; ".join(smallest) + ". A dash: not certified "
        "(the guard refuses that target unless on_infeasible='abstain_all').",
    ]
    k = int(frontier.get("candidates", 1))
    if k > 1:
        lines[-1] += (
            f" The scorer was chosen among {k} candidates on these answers: every δ is "
            f"certified at δ/{k}, so the choice is accounted for."
        )
    return "\n".join(lines) + "\n"
