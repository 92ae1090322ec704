"""``abstain-guard monitor report``: a monitor log drawn offline as the page ``serve``'s
``/dashboard`` shows (participation and score drift over time, decisions by reason)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _report(args: argparse.Namespace) -> int:
    from abstain_guard.monitor.log import read_log
    from abstain_guard.monitor.report import monitor_series, render_page

    out = Path(args.out)
    series = monitor_series(*read_log(args.log))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_page(series), encoding="utf-8")
    alarms = f", {len(series.alarms)} alarm(s)" if series.alarms else ", no alarm"
    print(f"{out}: {series.decisions} decisions, {series.answered} answered{alarms}")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``monitor`` (its one subcommand, ``report``) to the subparsers ``sub``; returns
    ``report``'s parser (the one that takes options)."""
    mon = sub.add_parser("monitor", help="read a drift monitor's log (serve --monitor-log)")
    report = mon.add_subparsers(dest="monitor_command", required=True).add_parser(
        "report",
        help="draw a monitor log as one HTML page, offline: participation and score drift "
        "over time, decisions by reason (the page serve's /dashboard shows)",
    )
    report.add_argument("--log", required=True, help="the monitor log (JSONL)")
    report.add_argument("--out", required=True, help="the HTML file to write (replaced)")
    report.set_defaults(func=_report)
    return report
