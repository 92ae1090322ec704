"""Report writing: files, JSON validity, Markdown tables and embedded plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from abstain_guard.calibration.measure.report import (
    guarantee_table_markdown,
    jsonable,
    write_report,
)
from abstain_guard.calibration.measure.results import (
    MeasureSettings,
    build_results,
    evaluate_dataset,
)
from abstain_guard.calibration.measure.tables import (
    COUNTS_ROW,
    calibrated_table_markdown,
    frontier_markdown,
    headline_markdown,
    results_table_markdown,
    shortfalls,
)
from abstain_guard.cli import main
from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee.frontier import frontier_document


def _geometries(y: np.ndarray, rng: np.random.Generator, num_layers: int = 3) -> list[dict]:
    w = 2 * num_layers - 1
    out = []
    for c in y:
        n_tok = int(rng.integers(1, 4))
        out.append(
            {
                "num_layers": num_layers,
                "omega": (rng.random((n_tok, w)) + 0.2 * c).tolist(),
                "theta": rng.random((n_tok, w)).tolist(),
                "phi_in": (rng.random((n_tok, w)) - 0.2 * c).tolist(),
                "phi_out": rng.random((n_tok, w)).tolist(),
            }
        )
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    rng = np.random.default_rng(0)
    entries = []
    for name, n in (("NQ-open", 120), ("SciQ", 90)):
        y = (rng.random(n) < 0.5).astype(int)
        scores = {
            "geometry": rng.normal(size=n) - 1.2 * y,
            "perplexity": rng.normal(size=n) - 0.5 * y,
        }
        importance = {
            f: {
                "auroc_drop_mean": 0.01 * (i + 1),
                "auroc_drop_sd": 0.005,
                "auprc_drop_mean": 0.02,
                "auprc_drop_sd": 0.004,
            }
            for i, f in enumerate(("omega", "theta", "phi_in", "phi_out"))
        }
        entries.append(
            evaluate_dataset(
                name,
                scores,
                y,
                groups=rng.choice(["capital", "author"], size=n) if name == "NQ-open" else None,
                geometries=_geometries(y, rng) if name == "NQ-open" else None,
                importance=importance,
                calibrated_scores_by_scorer={"perplexity": scores["perplexity"] * 2.0},
                settings=MeasureSettings(n_resplits=60),
            )
        )
    return build_results(entries, {"model": "toy", "n_resplits": 60})


def test_write_report_files_and_links(results: dict, tmp_path: Path) -> None:
    path = write_report(results, tmp_path / "report", commands=["abstain-guard evaluate ..."])
    assert path == tmp_path / "report" / "report.md"
    md = path.read_text(encoding="utf-8")
    pngs = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)
    expected = {
        "NQ-open_conditional_correctness.png",
        "NQ-open_participation.png",
        "NQ-open_hypothesis.png",
        "NQ-open_importance.png",
        "SciQ_importance.png",
        "importance.png",
        "SciQ_conditional_correctness.png",
        "SciQ_participation.png",
    }
    assert set(pngs) == expected
    for png in pngs:
        data = (path.parent / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    # Every number is in results.json, which is strict JSON (NaN/inf become null).
    loaded = json.loads((path.parent / "results.json").read_text(encoding="utf-8"))
    geo = loaded["datasets"]["NQ-open"]["scorers"]["geometry"]
    assert geo["auroc"] == pytest.approx(
        results["datasets"]["NQ-open"]["scorers"]["geometry"]["auroc"]
    )
    assert set(geo["participation"]["0.5"]) >= {
        "empirical_participation",
        "band",
        "conditional_correctness",
        "paper_bound",
    }
    for heading in (
        "AUROC",
        "AUPRC",
        "PRR",
        "Within-type AUROC",
        "Calibrated baselines",
        "Hypothesis checks",
        "do the guarantees hold",
    ):
        assert heading in md
    assert "abstain-guard evaluate ..." in md


def test_results_table_layout_and_bold_best(results: dict) -> None:
    table = results_table_markdown(results, "auroc")
    lines = table.strip().splitlines()
    assert lines[0] == "| Scorer | NQ-open | SciQ |"
    assert lines[2].startswith("| geometry |") and lines[3].startswith("| perplexity |")
    geo = results["datasets"]["NQ-open"]["scorers"]["geometry"]["auroc"]
    ppl = results["datasets"]["NQ-open"]["scorers"]["perplexity"]["auroc"]
    best_row = 2 if round(geo, 2) >= round(ppl, 2) else 3
    assert f"**{max(geo, ppl):.2f}**" in lines[best_row]
    within = results_table_markdown(results, "within_group_auroc")
    assert "–" in within.splitlines()[2]  # SciQ has no groups
    with pytest.raises(InvalidInputError, match="metric"):
        results_table_markdown(results, "accuracy")


def test_calibrated_and_guarantee_tables(results: dict) -> None:
    cal = calibrated_table_markdown(results, "auroc")
    # Doubling a score does not change its ranking: the arrow says "no change".
    assert "| perplexity |" in cal and " –" in cal and "↑" not in cal and "↓" not in cal
    guar = guarantee_table_markdown(results)
    assert "| NQ-open | geometry |" in guar and "perplexity (calibrated)" in guar


def test_report_with_a_failed_scorer(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    y = (rng.random(40) < 0.5).astype(int)
    entry = evaluate_dataset(
        "d",
        {"ok": rng.random(40), "dead": np.full(40, np.nan)},
        y,
        settings=MeasureSettings(n_resplits=10, nan_policy="omit"),
    )
    md = write_report(build_results([entry]), tmp_path).read_text(encoding="utf-8")
    assert "| dead | – |" in md and "Not evaluated:" in md
    assert "| d | ok |" in md and "| d | dead |" not in md


def test_jsonable_and_bad_input(tmp_path: Path) -> None:
    assert jsonable({"a": np.float32(1.5), "b": [np.nan, np.inf], "c": np.int64(3)}) == {
        "a": 1.5,
        "b": [None, None],
        "c": 3,
    }
    with pytest.raises(InvalidInputError, match="datasets"):
        write_report({"scorers": {}}, tmp_path)


# --- intervals, counts, bold rule, old results files -----------------------------------

INTERVAL = re.compile(r"(\*\*)?-?\d\.\d\d(\*\*)? \[-?\d\.\d\d, -?\d\.\d\d\]")


def _sc(auroc: float, ci: list[float] | None, n_correct: int = 10, n_incorrect: int = 30) -> dict:
    entry = {
        "auroc": auroc,
        "n": n_correct + n_incorrect,
        "n_correct": n_correct,
        "n_incorrect": n_incorrect,
        "accuracy": n_correct / (n_correct + n_incorrect),
    }
    if ci is not None:
        entry["auroc_ci"] = ci
    return entry


def _doc(columns: dict[str, dict[str, dict]]) -> dict:
    return {
        "datasets": {
            d: {
                "name": d,
                "n": 40,
                "n_correct": 10,
                "n_incorrect": 30,
                "accuracy": 0.25,
                "bootstrap": {"n_boot": 2000, "confidence": 0.95},
                "scorers": scorers,
            }
            for d, scorers in columns.items()
        }
    }


def _row(table: str, name: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"| {name} |"))


def _cells(table: str, name: str) -> list[str]:
    """The cells of a row, the scorer's name first."""
    return _row(table, name).strip("| ").split(" | ")


def test_bold_only_when_the_interval_lies_above_chance() -> None:
    doc = _doc(
        {
            # best interval includes 0.5: no bold anywhere in the column
            "includes": {"ours": _sc(0.62, [0.45, 0.78]), "other": _sc(0.55, [0.40, 0.70])},
            # best interval above 0.5: bold, and only the number
            "above": {"ours": _sc(0.81, [0.70, 0.90]), "other": _sc(0.60, [0.52, 0.68])},
            # every interval wholly below 0.5 excludes chance but is a backwards ranking
            "below": {"ours": _sc(0.30, [0.20, 0.40]), "other": _sc(0.35, [0.25, 0.45])},
        }
    )
    table = results_table_markdown(doc, "auroc")
    ours, other = _cells(table, "ours"), _cells(table, "other")
    assert ours[1] == "0.62 [0.45, 0.78]" and "**" not in other[1]
    assert ours[2] == "**0.81** [0.70, 0.90]" and other[2] == "0.60 [0.52, 0.68]"
    assert "**" not in ours[3] and "**" not in other[3]
    assert _row(table, COUNTS_ROW) == f"| {COUNTS_ROW} | 10 / 30 | 10 / 30 | 10 / 30 |"
    assert table.strip().splitlines()[-1].startswith(f"| {COUNTS_ROW} |")  # the last row
    lost = shortfalls(doc)
    assert any("includes:" in line and "includes chance" in line for line in lost)
    assert any("below:" in line and "other 0.35 [0.25, 0.45] above ours" in line for line in lost)
    assert any("below:" in line and "lies below chance" in line for line in lost)
    assert any("below: no score's interval lies above chance" in line for line in lost)
    assert not any(line.startswith("- above:") for line in lost)


def test_cells_on_other_answers_show_their_counts() -> None:
    doc = _doc({"d": {"ours": _sc(0.8, [0.7, 0.9]), "few": _sc(0.7, [0.6, 0.8], 9, 28)}})
    table = results_table_markdown(doc, "auroc")
    assert _row(table, "few").endswith("0.70 [0.60, 0.80] (9 / 28) |")
    assert "(" not in _row(table, "ours")


def test_headline_in_report_and_headline_md(results: dict, tmp_path: Path) -> None:
    path = write_report(results, tmp_path)
    md = path.read_text(encoding="utf-8")
    headline = (tmp_path / "headline.md").read_text(encoding="utf-8")
    assert headline == headline_markdown(results) and headline in md
    table = results_table_markdown(results, "auroc")
    assert table in headline
    for s in ("geometry", "perplexity"):
        assert len(INTERVAL.findall(_row(table, s))) == 2
    nq = results["datasets"]["NQ-open"]
    assert f"| {nq['n_correct']} / {nq['n_incorrect']} |" in _row(table, COUNTS_ROW)
    assert "95 % percentile bootstrap interval (2000 resamples" in headline
    # Every ranking table carries intervals, the calibrated ones too.
    for metric in ("auprc", "prr", "within_group_auroc"):
        assert INTERVAL.search(_row(results_table_markdown(results, metric), "geometry"))
    assert INTERVAL.search(calibrated_table_markdown(results, "auroc"))


def _without_intervals(obj):
    """A results document as ``evaluate_dataset`` writes it with ``n_boot=0``."""
    if isinstance(obj, dict):
        return {
            k: _without_intervals(v)
            for k, v in obj.items()
            if not k.endswith("_ci") and k != "bootstrap"
        }
    if isinstance(obj, list):
        return [_without_intervals(v) for v in obj]
    return obj


def test_results_without_intervals_render_beside_others(results: dict, tmp_path: Path) -> None:
    new = json.loads(json.dumps(jsonable(results)))
    old = _without_intervals(new)
    old["datasets"]["NQ-open"]["name"] = "NQ-open (old)"
    old_path, new_path = tmp_path / "old.json", tmp_path / "new.json"
    old_path.write_text(json.dumps({**old, "datasets": {"a": old["datasets"]["NQ-open"]}}))
    new_path.write_text(json.dumps({**new, "datasets": {"b": new["datasets"]["SciQ"]}}))
    # The merged report (abstain-guard report --results old.json new.json).
    assert main(["report", "--results", str(old_path), str(new_path), "--out", str(tmp_path)]) == 0
    headline = (tmp_path / "headline.md").read_text(encoding="utf-8")
    assert headline in (tmp_path / "report.md").read_text(encoding="utf-8")
    geo = _cells(headline, "geometry")
    assert re.fullmatch(r"\d\.\d\d", geo[1])  # old: point estimate only, never bold
    assert INTERVAL.fullmatch(geo[2])  # new: with its interval
    nq = results["datasets"]["NQ-open"]
    assert f"| {nq['n_correct']} / {nq['n'] - nq['n_correct']} |" in _row(headline, COUNTS_ROW)
    assert "No intervals for NQ-open (old)" in headline
    # A document with no intervals at all renders too, without brackets or bold.
    only_old = results_table_markdown(old, "auroc")
    assert "[" not in only_old and "**" not in only_old
    assert "No intervals" in headline_markdown(old)


def test_no_bold_on_a_handful_of_correct_answers() -> None:
    # one correct answer: the stratified interval is narrow, but the ranking rests on it alone
    doc = _doc(
        {
            "one": {
                "ours": _sc(0.94, [0.89, 0.98], 1, 99),
                "other": _sc(0.89, [0.83, 0.95], 1, 99),
            },
            "five": {
                "ours": _sc(0.94, [0.89, 0.98], 5, 95),
                "other": _sc(0.89, [0.83, 0.95], 5, 95),
            },
        }
    )
    table = results_table_markdown(doc, "auroc")
    assert "**" not in _cells(table, "ours")[1]
    assert _cells(table, "ours")[2].startswith("**0.94** [0.89, 0.98]")


def test_no_bold_when_the_shown_interval_touches_chance() -> None:
    doc = _doc({"d": {"ours": _sc(0.67, [0.5012, 0.83]), "other": _sc(0.60, [0.45, 0.75])}})
    cell = _cells(results_table_markdown(doc, "auroc"), "ours")[1]
    assert cell == "0.67 [0.50, 0.83]"


def test_shortfalls_name_too_few_answers_not_chance() -> None:
    doc = _doc({"one": {"ours": _sc(0.94, [0.89, 0.98], 1, 99)}})
    (line,) = shortfalls(doc)
    assert "only 1 correct / 99 incorrect" in line and "chance" not in line


def test_report_shows_the_certifiable_frontier(results: dict, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    scores = rng.uniform(size=300)
    correct = rng.uniform(size=300) < np.where(scores < 0.5, 0.92, 0.3)
    frontier = frontier_document(scores, correct)
    entry = dict(results["datasets"]["SciQ"], frontier=frontier)
    doc = dict(results, datasets={**results["datasets"], "SciQ": entry})
    md = write_report(doc, tmp_path).read_text(encoding="utf-8")
    assert "SciQ: certifiable risk targets" in md
    assert (tmp_path / "SciQ_frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = frontier_markdown(frontier)
    assert table in md
    smallest = frontier["smallest"]["0.1"]
    assert smallest is not None and f"δ = 0.1: {smallest:.2f}" in table
    # a row below the smallest certifiable target shows a dash at δ = 0.1
    below = [e for e in frontier["risk_targets"] if e < smallest]
    if below:
        row = next(line for line in table.splitlines() if line.startswith(f"| {below[-1]:.2f} |"))
        assert row.split("|")[2].strip() == "—"
