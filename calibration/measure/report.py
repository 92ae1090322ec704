"""Write the evaluation report: ``results.json`` (every number), ``report.md`` with the
tables (:mod:`~abstain_guard.calibration.measure.tables`), the guarantee checks and the embedded
plots (:mod:`~abstain_guard.calibration.measure.plots`), and ``headline.md``.

The input is the results document of
:func:`abstain_guard.calibration.measure.results.build_results`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .group_report import groups_markdown
from .hypotheses import IMPORTANCE_FAMILIES
from .plots import (
    plot_conditional_correctness,
    plot_frontier,
    plot_hypothesis,
    plot_importance,
    plot_participation,
    simulated_scorers,
)
from .tables import (
    METRIC_LABELS,
    calibrated_table_markdown,
    check_results,
    frontier_markdown,
    headline_markdown,
    interval_note,
    results_table_markdown,
)


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


def guarantee_table_markdown(results: Mapping[str, Any]) -> str:
    """One row per (data set, scorer): does the mean empirical participation lie in the
    guaranteed band, and is the mean conditional correctness at or above the paper's bound,
    at every participation level? Levels that fail are listed."""
    datasets = check_results(results)
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


def _metric_section(
    results: Mapping[str, Any], metric: str, intro: Sequence[str] = ()
) -> list[str]:
    return [
        f"## {METRIC_LABELS[metric]}",
        "",
        *intro,
        results_table_markdown(results, metric),
        interval_note(results, metric),
    ]


def _metric_sections(results: Mapping[str, Any], datasets: Mapping[str, Any]) -> list[str]:
    """The AUPRC and PRR tables, within-type AUROC and the calibrated baselines where any data
    set has them."""
    md = [*_metric_section(results, "auprc"), *_metric_section(results, "prr")]
    if any(e.get("within_group") for e in datasets.values()):
        md += _metric_section(
            results,
            "within_group_auroc",
            (
                "A score can look strong only because it recognises which *kinds* of question "
                "the model usually gets wrong; within-type AUROC shows whether it knows which "
                "*answers* are wrong.",
                "",
            ),
        )
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
    return md


def _guarantee_sections(results: Mapping[str, Any], datasets: Mapping[str, Any]) -> list[str]:
    """The pooled guarantee table, the per-group tables and the hypothesis checks."""
    md = [
        "## Conformal abstention: do the guarantees hold?",
        "",
        "Mean over random calibration/test resplits. The participation guarantee is "
        "P(answered) ∈ [1−α, 1−α+1/(n_cal+1)); the paper's bound (Eq. 9) is computed on each "
        "calibration half.",
        "",
        guarantee_table_markdown(results),
    ]
    with_groups = {name: e["groups"] for name, e in datasets.items() if e.get("groups")}
    if with_groups:
        md += [
            "## Per-group guarantees",
            "",
            "What the pooled rule and the per-group rule (`GuardConfig(group_by=...)`, "
            "docs/guarantees.md) do to each question type: every held-out answer decided by "
            "rules calibrated on the other folds; 95 % Wilson intervals and counts.",
            "",
        ]
        for name, tables in with_groups.items():
            md += [f"### {name}", "", groups_markdown(tables)]
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
    return md


def _averaged_importance(datasets: Mapping[str, Any], out: Path) -> list[str]:
    """The permutation importance averaged over data sets (plotted), where more than one data
    set has it."""
    with_imp = {d: e["importance"] for d, e in datasets.items() if e.get("importance")}
    if len(with_imp) <= 1:
        return []
    fams = [f for f in IMPORTANCE_FAMILIES if all(f in imp for imp in with_imp.values())]
    avg: dict[str, dict[str, float]] = {}
    for f in fams:
        avg[f] = {}
        for m in ("auroc", "auprc"):
            drops = [float(imp[f][f"{m}_drop_mean"]) for imp in with_imp.values()]
            avg[f][f"{m}_drop_mean"] = float(np.mean(drops))
            avg[f][f"{m}_drop_sd"] = float(np.std(drops, ddof=1))
    if not avg:
        return []
    plot_importance(f"mean over {len(with_imp)} data sets", avg, out / "importance.png")
    return [
        "## Permutation importance, averaged over data sets (paper Figure 9)",
        "",
        "Bars: mean over data sets of each data set's mean drop; error bars: sd across data sets.",
        "",
        "![permutation importance averaged over data sets](importance.png)",
        "",
    ]


def _dataset_plots(d: str, entry: Mapping[str, Any], out: Path) -> list[str]:
    """One data set's simulation plots and its certifiable-risk frontier."""
    slug = _slug(d)
    md: list[str] = []
    if simulated_scorers(entry):
        cc_png = f"{slug}_conditional_correctness.png"
        part_png = f"{slug}_participation.png"
        plot_conditional_correctness(d, entry, out / cc_png)
        plot_participation(d, entry, out / part_png)
        md += [
            f"![{d}: conditional correctness vs participation]({cc_png})",
            "",
            f"![{d}: empirical participation vs target]({part_png})",
            "",
        ]
    if entry.get("frontier"):
        png = f"{slug}_frontier.png"
        plot_frontier(d, entry["frontier"], out / png)
        md += [
            f"### {d}: certifiable risk targets",
            "",
            "Risk mode certifies 'at most ε of the answered questions are wrong, with "
            "probability ≥ 1−δ'. Certified participation on the artifact's calibration "
            "answers:",
            "",
            frontier_markdown(entry["frontier"]),
            f"![{d}: certifiable frontier]({png})",
            "",
        ]
    return md


def _dataset_signals(d: str, entry: Mapping[str, Any], out: Path) -> list[str]:
    """One data set's hypothesis plot and its permutation importance (plot and table)."""
    slug = _slug(d)
    md: list[str] = []
    if entry.get("hypothesis"):
        png = f"{slug}_hypothesis.png"
        plot_hypothesis(d, entry["hypothesis"], out / png)
        md += [f"![{d}: hypothesis checks]({png})", ""]
    if entry.get("importance"):
        png = f"{slug}_importance.png"
        plot_importance(d, entry["importance"], out / png)
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
    return md


def _dataset_section(d: str, entry: Mapping[str, Any], out: Path) -> list[str]:
    """One data set's summary line, plots, per-scorer level tables and signal checks."""
    md = [
        f"## Data set: {d}",
        "",
        f"{entry.get('n', '?')} responses, {entry.get('n_correct', '?')} correct "
        f"(accuracy {float(entry.get('accuracy', float('nan'))):.3f})"
        + (f", {entry['n_groups']} question types" if entry.get("n_groups") else "")
        + ".",
        "",
        *_dataset_plots(d, entry, out),
    ]
    for s, sc in (entry.get("scorers") or {}).items():
        if "error" in sc:
            md += [f"### {d} / {s}", "", f"Not evaluated: {sc['error']}", ""]
        elif sc.get("participation"):
            md += [f"### {d} / {s}", "", _levels_table(sc)]
    return md + _dataset_signals(d, entry, out)


def write_report(
    results: Mapping[str, Any],
    out_dir: str | Path,
    title: str = "abstain-guard evaluation",
    commands: Sequence[str] | None = None,
) -> Path:
    """Write ``results.json``, the PNG plots, ``report.md`` (which embeds them) and
    ``headline.md`` (:func:`headline_markdown`, the same block as the top of ``report.md``)
    into ``out_dir`` (created if needed); return the path of ``report.md``. ``commands``:
    the shell commands that produced the results, listed in the report.
    """
    datasets = check_results(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(jsonable(results), indent=2, allow_nan=False) + "\n", encoding="utf-8"
    )

    md: list[str] = [f"# {title}", ""]
    meta = results.get("metadata") or {}
    if meta:
        md += [*(f"- **{k}**: {v}" for k, v in meta.items()), ""]
    if commands:
        md += ["Commands:", "", "```", *commands, "```", ""]
    md += [
        "Every number below is in `results.json`. Uncertainty scores: higher = more uncertain.",
        "",
    ]
    headline = headline_markdown(results)
    (out / "headline.md").write_text(headline, encoding="utf-8")
    md += [f"## {METRIC_LABELS['auroc']}", "", headline]
    md += _metric_sections(results, datasets)
    md += _guarantee_sections(results, datasets)
    md += _averaged_importance(datasets, out)
    for d, entry in datasets.items():
        md += _dataset_section(d, entry, out)
    path = out / "report.md"
    path.write_text("\n".join(md), encoding="utf-8")
    return path
