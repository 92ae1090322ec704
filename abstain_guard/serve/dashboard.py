"""``GET /dashboard``: the drift monitor's page (participation and score drift over time,
decisions by reason; :func:`abstain_guard.monitor.report.render_page`, the page
``abstain-guard monitor report`` writes from a log), drawn from the server's monitor, or
with replicas the deployment's monitor actor (its ``dashboard`` method). Open as
``/metrics`` is: it shows counts and statistics, never a question or an answer."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import HTMLResponse

from abstain_guard.errors import MonitorUnavailableError
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.report import live_series, render_page
from abstain_guard.serve.schemas import RequestRefused

__all__ = ["dashboard", "dashboard_page"]


def dashboard_page(monitor: GuardMonitor) -> str:
    """The dashboard of a running ``monitor`` (the page reloads itself). Its replay takes
    about 1 s per 100,000 decisions kept: callers on an event loop run it in a thread."""
    return render_page(live_series(monitor), live=True)


async def dashboard(request: Request) -> HTMLResponse:
    """The page (the app renders a refusal: 404 without a guard, 503 while the monitor
    actor does not answer)."""
    link = request.app.state.served.link
    if getattr(link, "monitor", None) is not None:
        return HTMLResponse(await asyncio.to_thread(dashboard_page, link.monitor))
    if not link.monitored:
        raise RequestRefused("This server runs no guard (--no-guard): there is no monitor to "
                             "show.", status=404, kind="not_found_error")  # fmt: skip
    try:
        return HTMLResponse(await link.call("dashboard"))
    except MonitorUnavailableError as exc:
        raise RequestRefused(f"The drift monitor did not answer: {exc}.", status=503,
                             kind="server_error", code="monitor_unavailable") from exc  # fmt: skip
