"""Markdown tables of the paired scorer comparison from ``abstain-guard evaluate`` results,
and the audited JSON behind every cell (the README's power table).

    python bench/power/paired_tables.py runs/power_report_*/results.json \
        --json bench/power/paired_tables.json > bench/power/paired_tables.md

Per data set: every scorer's AUROC and AUPRC (95 % class-stratified bootstrap intervals),
mean within-type AUROC, the paired difference (artifact's scorer − scorer) overall and
within type, the selective risk (error among the 10/20/30 % most confident; AURC) and, on
the calibration split only, the smallest certified ε at δ = 0.1 and the participation
certified at ε = 0.35. Numbers are read from ``results.json`` (``paired`` entry).

Every difference carries its two-sided paired DeLong p-value (computed by ``evaluate``,
:func:`calibration.measure.paired.delong_difference`; within type, the per-type DeLong
variances added); the intervals are paired-bootstrap percentiles. The Holm adjustment is redone
here across **every results.json given**: every set × every scorer, overall and within type —
the family the narrative draws from — and each comparison gets its Holm-adjusted p-value and
verdict (``reference better``, ``baseline better``, ``not significant after Holm at family-wise
0.05``). ``--json`` writes, per set, the numbers every cell shows (raw and as printed), the
p-values, Holm-adjusted p-values and verdicts, and the path and sha256 of each source
results.json: the committed, auditable evidence. A results.json without paired p-values is
refused.

``--also experiments/probe_mlp/probe_mlp.json`` (repeatable) adds comparisons made on the same
held-out answers outside these tables — ``experiments/probe_mlp/probe_mlp.py``'s MLP − logistic
probe per feature set — to the same Holm family, and lists them with their adjusted p-values
and verdicts (``also`` in the JSON).

    python bench/power/paired_tables.py runs/power_report_*/results.json \
        --also experiments/probe_mlp/probe_mlp.json \
        --json bench/power/paired_tables.json > bench/power/paired_tables.md
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from abstain_guard.calibration.measure.paired import COMPARISONS, FAMILY_ALPHA, adjust_family


def _ci(v: Any) -> str:
    return "" if not v else f" [{v[0]:.2f}, {v[1]:.2f}]"


def _diff(point: Any, ci: Any) -> str:
    if point is None:
        return "–"
    mark = "" if not ci or ci[0] <= 0 <= ci[1] else " *"
    return f"{point:+.3f}{_ci(ci).replace(' [', ' [')}{mark}"


def _holm(p: dict[str, Any], comp: str) -> str:
    """``0.012 (reference better)``: a comparison's Holm-adjusted p-value and verdict."""
    adj = p.get(f"{comp}_holm_p")
    if adj is None:
        return "–"
    short = {"reference better": "ref. better", "baseline better": "baseline better"}
    return f"{adj:.3g} ({short.get(p[f'{comp}_verdict'], 'n.s.')})"


def table_header(ref: str) -> list[str]:
    """The column names of a per-set table (the keys of each row's ``cells`` in the JSON)."""
    return [
        "scorer",
        "AUROC",
        "AUPRC (correct)",
        "within-type AUROC",
        f"{ref} − scorer",
        f"within-type {ref} − scorer",
        "Holm p: overall / within",
        "error @10/20/30 %",
        "AURC",
        "smallest ε (δ=0.1)",
        "participation at ε=0.35",
    ]


def table_rows(entry: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    """Per scorer (by AUROC, best first): the cell strings of its row, keyed by column name."""
    paired = entry["paired"]
    header = table_header(paired["reference"])
    main = entry["scorers"]
    rows = []
    order = sorted(paired["scorers"].items(), key=lambda kv: -kv[1]["auroc"])
    for name, p in order:
        m = main.get(name, {})
        sel = p["selective"]["error_at"]
        cert = p.get("certified", {})
        eps = cert.get("smallest_risk_target")
        within = p.get("within_auroc")
        cells = [
            name,
            f"{p['auroc']:.3f}{_ci(p.get('auroc_ci'))}",
            f"{m.get('auprc', float('nan')):.3f}{_ci(m.get('auprc_ci'))}",
            f"{within:.3f}{_ci(p.get('within_auroc_ci'))}" if within is not None else "–",
            _diff(p.get("auroc_diff"), p.get("auroc_diff_ci")),
            _diff(p.get("within_diff"), p.get("within_diff_ci")),
            f"{_holm(p, 'auroc_diff')} / {_holm(p, 'within_diff')}",
            f"{sel['0.1']:.2f} / {sel['0.2']:.2f} / {sel['0.3']:.2f}",
            f"{p['selective']['aurc']:.3f}",
            "–" if eps is None else f"{eps:.2f}",
            f"{cert.get('participation_at_target', float('nan')):.3f}",
        ]
        rows.append((name, dict(zip(header, cells, strict=True))))
    return rows


def table(entry: dict[str, Any]) -> str:
    paired = entry["paired"]
    ref = paired["reference"]
    header = table_header(ref)
    lines = [
        f"### {entry['name']} — {paired['n_correct']} correct / {paired['n_incorrect']} "
        f"incorrect held-out answers; reference scorer `{ref}`",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    for _, cells in table_rows(entry):
        lines.append("| " + " | ".join(cells[h] for h in header) + " |")
    cert_n = next((p["certified"] for p in paired["scorers"].values() if "certified" in p), None)
    certified = (
        f"Certified numbers on the calibration split only ({cert_n['n']} answers, "
        f"{cert_n['n_correct']} correct). "
        if cert_n
        else ""
    )
    family = paired.get("family", {})
    lines += [
        "",
        certified + "`*`: the paired 95 % interval excludes 0 (unadjusted). Holm p: the "
        f"{family.get('test', 'paired DeLong')} p-value Holm-adjusted over the "
        f"{family.get('size', 0)} comparisons of the family (every set and scorer given, and "
        f"any `--also`), with its verdict at family-wise {FAMILY_ALPHA:g}. "
        f"Within-type over {paired['n_groups_used']} types with both classes.",
    ]
    return "\n".join(lines)


PROBES = (
    "probe_mid",
    "probe_upper",
    "probe_concat",
    "probe_mid_last",
    "probe_upper_last",
    "probe_concat_last",
)


HEADLINE_COLUMNS: tuple[str, ...] = (
    "set",
    "geometry",
    "best probe",
    "geometry − probe (paired)",
    "within type: geometry − probe",
    "Holm p: overall / within",
    "type floor",
    "perplexity",
    "participation at ε = 0.35: geometry / geometry_plus / probe",
    "held-out correct / incorrect",
)
HEADLINE_HEADER = (
    "| " + " | ".join(HEADLINE_COLUMNS) + " |\n|---|" + "---:|" * (len(HEADLINE_COLUMNS) - 1)
)


def best_probe(entry: dict[str, Any]) -> str | None:
    """The probe scorer with the highest AUROC on ``entry``'s held-out answers."""
    sc = entry["paired"]["scorers"]
    probes = [n for n in PROBES if n in sc]
    return max(probes, key=lambda n: sc[n]["auroc"]) if probes else None


def headline_cells(entry: dict[str, Any]) -> dict[str, str]:
    """One README row's cell strings, keyed by :data:`HEADLINE_COLUMNS`: the reference scorer
    against the best probe (by AUROC), the paired intervals overall and within type with their
    Holm-adjusted p-values, the type floor, perplexity, the participation each certifies at
    ε = 0.35 (δ = 0.1, calibration split) and the counts behind them."""
    paired = entry["paired"]
    sc = paired["scorers"]
    ref = paired["reference"]
    best = best_probe(entry)

    def cell(name: str | None) -> str:
        if name is None or name not in sc:
            return "–"
        return f"{sc[name]['auroc']:.2f}{_ci(sc[name].get('auroc_ci'))}"

    def part(name: str | None) -> str:
        cert = sc.get(name or "", {}).get("certified")
        return "–" if not cert else f"{cert['participation_at_target']:.2f}"

    b = sc.get(best or "", {})
    diff = "–" if best is None else _diff(b.get("auroc_diff"), b.get("auroc_diff_ci"))
    within = "–" if best is None else _diff(b.get("within_diff"), b.get("within_diff_ci"))
    cells = (
        entry["name"],
        cell(ref),
        f"{cell(best)} (`{best}`)",
        diff,
        within,
        f"{_holm(b, 'auroc_diff')} / {_holm(b, 'within_diff')}",
        cell("type_floor"),
        cell("perplexity"),
        f"{part(ref)} / {part('geometry_plus')} / {part(best)}",
        f"{paired['n_correct']} / {paired['n_incorrect']}",
    )
    return dict(zip(HEADLINE_COLUMNS, cells, strict=True))


def headline(entry: dict[str, Any]) -> str:
    """One README row (:func:`headline_cells`) as markdown."""
    cells = headline_cells(entry)
    return "| " + " | ".join(cells[c] for c in HEADLINE_COLUMNS) + " |"


def costs(entry: dict[str, Any]) -> str:
    """Scoring cost per scorer (metadata in memory) and fitted state size."""
    lines = [
        f"Scoring cost on {entry['name']} (seconds per answer, the answer's metadata already "
        "in memory; fit seconds and state size of the fitted baselines):",
        "",
        "| scorer | s/answer | fit s | state |",
        "|---|---:|---:|---:|",
    ]
    for name, c in sorted(entry.get("costs", {}).items()):
        fit = c.get("fit_seconds")
        size = c.get("state_bytes")
        lines.append(
            f"| {name} | {c['seconds_per_answer'] * 1e3:.2f} ms | "
            f"{'–' if fit is None else f'{fit:.1f}'} | "
            f"{'–' if size is None else f'{size / 1024:.0f} KiB'} |"
        )
    return "\n".join(lines)


_SCORER_NUMBERS = (
    "auroc",
    "auroc_ci",
    "within_auroc",
    "within_auroc_ci",
    *(f"{c}{suffix}" for c in COMPARISONS for suffix in ("", "_ci", "_p", "_holm_p", "_verdict")),
)


def _read(path: Path, sources: list[dict[str, str]]) -> Any:
    """``path``'s JSON; its path and sha256 are appended to ``sources``."""
    raw = path.read_bytes()
    sources.append({"path": str(path), "sha256": hashlib.sha256(raw).hexdigest()})
    return json.loads(raw)


def load_also(paths: list[Path], sources: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The paired reports of ``experiments/probe_mlp/probe_mlp.py`` results, one per feature set
    (copies, each tagged ``label``, ``source`` and ``artifact``), to join the Holm family."""
    reports = []
    for path in paths:
        doc = _read(path, sources)
        features = doc.get("features", {})
        missing = [k for k, f in features.items() if "paired" not in f]
        if not features or missing:
            raise SystemExit(
                f"{path}: no paired report for {missing or 'any feature set'}; rerun "
                "experiments/probe_mlp/probe_mlp.py (it stores one per feature set)"
            )
        for kind, f in features.items():
            rep = copy.deepcopy(f["paired"])
            rep.update(
                label=f"{doc.get('data', '?')} {kind}: mlp − logistic",
                source=str(path),
                artifact=doc.get("artifact"),
            )
            reports.append(rep)
    return reports


def load_entries(
    paths: list[Path], also: list[Path] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[dict[str, Any]]]:
    """The data-set entries of every results.json (each tagged with its ``source`` path), Holm-
    adjusted as one family across all of them and the ``also`` reports (:func:`load_also`;
    :func:`adjust_family`, on copies: the files are not changed), ``[{"path", "sha256"}]`` of
    the files read, and the adjusted ``also`` reports."""
    entries: list[dict[str, Any]] = []
    sources: list[dict[str, str]] = []
    for path in paths:
        doc = _read(path, sources)
        for e in doc["datasets"].values():
            entry = copy.deepcopy(e)
            entry["source"] = str(path)
            entries.append(entry)
            scorers = entry["paired"]["scorers"].values()
            if any("auroc_diff" in p and "auroc_diff_p" not in p for p in scorers):
                raise SystemExit(f"{path} ({entry['name']}): no paired p-values")
    extra = load_also(list(also or []), sources)
    adjust_family([e["paired"] for e in entries] + extra)
    return entries, sources, extra


def _also_winner(rep: dict[str, Any], name: str) -> str | None:
    """The scorer an ``--also`` comparison's verdict names better (None: not significant)."""
    said = {"reference better": rep["reference"], "baseline better": name}
    return said.get(rep["scorers"][name].get("auroc_diff_verdict", ""))


def also_evidence(rep: dict[str, Any]) -> dict[str, Any]:
    """One ``--also`` comparison set: the reference, counts and per compared scorer its
    difference, interval, p-value, Holm-adjusted p-value and verdict."""
    keys = ("auroc", "auroc_ci", *(f"auroc_diff{x}" for x in ("", "_ci", "_p", "_holm_p")))
    return {
        "source": rep["source"],
        "artifact": rep["artifact"],
        "reference": rep["reference"],
        "reference_auroc": rep["scorers"][rep["reference"]]["auroc"],
        "n_correct": rep["n_correct"],
        "n_incorrect": rep["n_incorrect"],
        "compared": {
            name: {
                **{k: e.get(k) for k in keys},
                "verdict": e.get("auroc_diff_verdict"),
                "better": _also_winner(rep, name),
            }
            for name, e in rep["scorers"].items()
            if name != rep["reference"]
        },
    }


def also_table(extra: list[dict[str, Any]]) -> str:
    """The ``--also`` comparisons, Holm-adjusted in the same family, as markdown."""
    if not extra:
        return ""
    lines = [
        "Comparisons on the same held-out answers outside the tables above, in the same "
        "Holm family:",
        "",
        "| comparison | difference (paired) | Holm p | held-out correct / incorrect |",
        "|---|---:|---:|---:|",
    ]
    for rep in extra:
        for name, e in rep["scorers"].items():
            if name == rep["reference"]:
                continue
            adj = e.get("auroc_diff_holm_p")
            winner = _also_winner(rep, name)
            holm = "–" if adj is None else f"{adj:.3g} ({f'{winner} better' if winner else 'n.s.'})"
            lines.append(
                f"| {rep['label']} | {_diff(e.get('auroc_diff'), e.get('auroc_diff_ci'))} | "
                f"{holm} | {rep['n_correct']} / {rep['n_incorrect']} |"
            )
    return "\n".join(lines)


def set_evidence(entry: dict[str, Any]) -> dict[str, Any]:
    """One set's audited numbers: per scorer the raw values behind its table row (``None``
    where absent), the selective and certified numbers, and the row's cells as printed."""
    paired = entry["paired"]
    main = entry["scorers"]
    rows = dict(table_rows(entry))
    scorers: dict[str, Any] = {}
    for name, p in paired["scorers"].items():
        m = main.get(name, {})
        scorers[name] = {
            **{k: p.get(k) for k in _SCORER_NUMBERS},
            "auprc": m.get("auprc"),
            "auprc_ci": m.get("auprc_ci"),
            "selective": p["selective"],
            "certified": p.get("certified"),
            "cells": rows[name],
        }
    return {
        "source": entry["source"],
        "reference": paired["reference"],
        "n_correct": paired["n_correct"],
        "n_incorrect": paired["n_incorrect"],
        "n_groups_used": paired["n_groups_used"],
        "n_boot": paired.get("n_boot"),
        "method": paired.get("method"),
        "p_value": paired.get("p_value"),
        "columns": table_header(paired["reference"]),
        "headline": headline_cells(entry),
        "best_probe": best_probe(entry),
        "scorers": scorers,
        "costs": entry.get("costs", {}),
    }


def evidence(
    paths: list[Path], also: list[Path] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """The JSON document ``--json`` writes, and the (adjusted) entries and ``also`` reports the
    markdown is made from."""
    entries, sources, extra = load_entries(paths, also)
    family = dict(entries[0]["paired"]["family"]) if entries else {}
    if extra:
        family["members"] += "; and " + ", ".join(r["label"] for r in extra)
    argv = [str(p) for p in paths] + [a for p in also or [] for a in ("--also", str(p))]
    doc = {
        "generated_by": "bench/power/paired_tables.py " + " ".join(argv),
        "sources": sources,
        "family": family,
        "headline_columns": list(HEADLINE_COLUMNS),
        "sets": {e["name"]: set_evidence(e) for e in entries},
        "also": {r["label"]: also_evidence(r) for r in extra},
    }
    return doc, entries, extra


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float (NaN: e.g. no within-type AUROC) as ``None``, so
    the JSON is strict (no ``NaN`` tokens)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def markdown(entries: list[dict[str, Any]], extra: list[dict[str, Any]] | None = None) -> str:
    """The headline table, then per set its full table and its cost table, then the ``--also``
    comparisons."""
    parts = [HEADLINE_HEADER, *(headline(e) for e in entries), ""]
    for entry in entries:
        parts += [table(entry), "", costs(entry), ""]
    if extra:
        parts += [also_table(extra), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument(
        "--json", type=Path, default=None, help="write the audited evidence here as JSON"
    )
    parser.add_argument(
        "--also",
        type=Path,
        action="append",
        default=[],
        help="a probe_mlp.py result whose comparisons join the Holm family (repeatable)",
    )
    args = parser.parse_args(argv)
    doc, entries, extra = evidence(args.results, args.also)
    print(markdown(entries, extra))
    if args.json is not None:
        text = json.dumps(_strict(doc), indent=1, allow_nan=False)
        args.json.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
