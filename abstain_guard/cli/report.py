"""``abstain-guard report``: merge ``results.json`` files of ``evaluate`` into one report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from abstain_guard.errors import ResultsFileError

from .checks import all_at_once, check_out


def _read_results(path: str) -> dict[str, Any]:
    """A ``results.json`` written by ``abstain-guard evaluate``."""
    hint = "pass the results.json files that abstain-guard evaluate wrote into its --out"
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ResultsFileError(f"--results {path} does not exist; {hint}.") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsFileError(f"--results {path} cannot be read ({exc}); {hint}.") from exc
    except json.JSONDecodeError as exc:
        raise ResultsFileError(
            f"--results {path} is not one JSON document ({exc.msg} at line {exc.lineno}, "
            f"column {exc.colno}; a JSONL file?); {hint}."
        ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("datasets"), dict):
        raise ResultsFileError(f"--results {path} has no 'datasets' mapping; {hint}.")
    return doc


def _report(args: argparse.Namespace) -> int:
    from abstain_guard.calibration.measure.report import write_report
    from abstain_guard.calibration.measure.results import build_results

    docs: dict[str, dict[str, Any]] = {}

    def read(path: str) -> None:
        docs[path] = _read_results(path)

    all_at_once(
        lambda: check_out(args.out),
        *[(lambda p=p: read(p)) for p in args.results],
    )
    entries, metadata = [], {}
    for path, doc in docs.items():
        entries.extend(doc["datasets"].values())
        metadata[str(path)] = doc.get("metadata", {})
    report = write_report(build_results(entries, {"merged_from": metadata}), args.out)
    print(f"report written to {report}")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``report`` to the subparsers ``sub``; returns its parser."""
    rep = sub.add_parser("report", help="merge evaluate results.json files into one report")
    rep.add_argument("--results", nargs="+", required=True, help="results.json files")
    rep.add_argument("--out", required=True, help="report directory")
    rep.set_defaults(func=_report)
    return rep
