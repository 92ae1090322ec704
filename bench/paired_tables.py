"""Markdown tables of issue 37's paired comparison from ``abstain-guard evaluate`` results.

    python bench/paired_tables.py runs/power_report_builtin/results.json [more results.json]

Per data set: every scorer's AUROC and AUPRC (95 % class-stratified bootstrap intervals),
mean within-type AUROC, the paired difference (artifact's scorer − scorer) overall and
within type, the selective risk (error among the 10/20/30 % most confident; AURC) and, on
the calibration split only, the smallest certified ε at δ = 0.1 and the participation
certified at ε = 0.35. Numbers are read from ``results.json`` (``paired`` entry).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _ci(v: Any) -> str:
    return "" if not v else f" [{v[0]:.2f}, {v[1]:.2f}]"


def _diff(point: Any, ci: Any) -> str:
    if point is None:
        return "–"
    mark = "" if not ci or ci[0] <= 0 <= ci[1] else " *"
    return f"{point:+.3f}{_ci(ci).replace(' [', ' [')}{mark}"


def table(entry: dict[str, Any]) -> str:
    paired = entry["paired"]
    ref = paired["reference"]
    main = entry["scorers"]
    lines = [
        f"### {entry['name']} — {paired['n_correct']} correct / {paired['n_incorrect']} "
        f"incorrect held-out answers; reference scorer `{ref}`",
        "",
        f"| scorer | AUROC | AUPRC (correct) | within-type AUROC | {ref} − scorer | "
        f"within-type {ref} − scorer | error @10/20/30 % | AURC | smallest ε (δ=0.1) | "
        "participation at ε=0.35 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = sorted(paired["scorers"].items(), key=lambda kv: -kv[1]["auroc"])
    for name, p in order:
        m = main.get(name, {})
        sel = p["selective"]["error_at"]
        cert = p.get("certified", {})
        eps = cert.get("smallest_risk_target")
        within = p.get("within_auroc")
        lines.append(
            f"| {name} | {p['auroc']:.3f}{_ci(p.get('auroc_ci'))} | "
            f"{m.get('auprc', float('nan')):.3f}{_ci(m.get('auprc_ci'))} | "
            + (f"{within:.3f}{_ci(p.get('within_auroc_ci'))}" if within is not None else "–")
            + f" | {_diff(p.get('auroc_diff'), p.get('auroc_diff_ci'))} | "
            f"{_diff(p.get('within_diff'), p.get('within_diff_ci'))} | "
            f"{sel['0.1']:.2f} / {sel['0.2']:.2f} / {sel['0.3']:.2f} | "
            f"{p['selective']['aurc']:.3f} | {'–' if eps is None else f'{eps:.2f}'} | "
            f"{cert.get('participation_at_target', float('nan')):.3f} |"
        )
    cert_n = next((p["certified"] for p in paired["scorers"].values() if "certified" in p), None)
    if cert_n:
        lines.append("")
        lines.append(
            f"Certified numbers on the calibration split only ({cert_n['n']} answers, "
            f"{cert_n['n_correct']} correct). `*`: the paired 95 % interval excludes 0. "
            f"Within-type over {paired['n_groups_used']} types with both classes."
        )
    return "\n".join(lines)


PROBES = (
    "probe_mid",
    "probe_upper",
    "probe_concat",
    "probe_mid_last",
    "probe_upper_last",
    "probe_concat_last",
)


HEADLINE_HEADER = (
    "| set | geometry | best probe | geometry − probe (paired) | within type: geometry − "
    "probe | type floor | perplexity | participation at ε = 0.35: geometry / geometry_plus / "
    "probe | held-out correct / incorrect |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def headline(entry: dict[str, Any]) -> str:
    """One README row: the reference scorer against the best probe (by AUROC), the paired
    intervals overall and within type, the type floor, perplexity, the participation each
    certifies at ε = 0.35 (δ = 0.1, calibration split) and the counts behind them."""
    paired = entry["paired"]
    sc = paired["scorers"]
    ref = paired["reference"]
    probes = [n for n in PROBES if n in sc]
    best = max(probes, key=lambda n: sc[n]["auroc"]) if probes else None

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
    return (
        f"| {entry['name']} | {cell(ref)} | {cell(best)} (`{best}`) | {diff} | {within} | "
        f"{cell('type_floor')} | {cell('perplexity')} | "
        f"{part(ref)} / {part('geometry_plus')} / {part(best)} | "
        f"{paired['n_correct']} / {paired['n_incorrect']} |"
    )


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args()
    docs = [json.loads(p.read_text(encoding="utf-8")) for p in args.results]
    entries = [
        e
        for doc in docs
        for e in (
            doc["datasets"].values() if isinstance(doc["datasets"], dict) else doc["datasets"]
        )
    ]
    print(HEADLINE_HEADER)
    for entry in entries:
        print(headline(entry))
    print()
    for entry in entries:
        print(table(entry))
        print()
        print(costs(entry))
        print()


if __name__ == "__main__":
    main()
