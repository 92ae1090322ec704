"""``serve`` feeds the monitor in admission order (abstain_guard/serve/arrival.py): requests
that finish out of order reach the monitor in the order they were admitted, a request that
fails or gives up its place does not hold the ones after it, and feedback on a decision
still held waits for it. The real app on a scripted chat model, requests released by hand."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from _serve_fakes import ToolScriptModel, artifact

from abstain_guard import GuardConfig
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.serve.app import create_app
from abstain_guard.serve.arrival import ArrivalOrder
from abstain_guard.serve.schemas import RequestRefused
from abstain_guard.serve.service import GuardCall, GuardedAnswer, GuardService

# -- the sequencer alone -----------------------------------------------------------------------


def test_decisions_pass_on_in_admission_order_and_a_failed_request_holds_nothing() -> None:
    fed: list[str] = []
    order = ArrivalOrder(lambda decision, run_id: fed.append(run_id))
    a, b, c, d = (order.admit() for _ in range(4))
    order.finish(d, "d", {"score": 1.0})
    order.finish(c, "c", {"score": 1.0})
    assert fed == [] and order.waiting == 2
    order.finish(a)  # failed or aborted: no decision, its place is given up
    assert fed == []  # b still runs
    order.finish(b, "b", {"score": 1.0})
    assert fed == ["b", "c", "d"] and order.waiting == 0
    order.finish(b, "b-again", {"score": 1.0})  # only the first finish of a ticket counts
    order.finish(99, "never-admitted", {"score": 1.0})
    e = order.admit()
    order.finish(e, "e", {})  # an empty decision (a tool call): nothing to feed
    assert fed == ["b", "c", "d"]


def test_a_feed_that_raises_does_not_stop_the_ones_after_it() -> None:
    fed: list[str] = []

    def feed(decision: Any, run_id: str) -> None:
        if run_id == "bad":
            raise RuntimeError("on_alarm raised")
        fed.append(run_id)

    order = ArrivalOrder(feed)
    first, second = order.admit(), order.admit()
    order.finish(second, "good", {"score": 0.5})
    order.finish(first, "bad", {"score": 0.5})
    assert fed == ["good"]


# -- the app -----------------------------------------------------------------------------------


class Gated:
    """Wraps a service's ``answer``: each question waits for its own release (and may then
    fail), so the test decides the order in which requests complete."""

    def __init__(self, service: GuardService) -> None:
        self.original: Callable[[GuardCall], Awaitable[GuardedAnswer]] = service.answer
        self.entered: dict[str, asyncio.Event] = {}
        self.release: dict[str, asyncio.Event] = {}
        self.fail: dict[str, BaseException] = {}
        service.answer = self.answer  # type: ignore[method-assign]

    def gate(self, question: str) -> None:
        self.entered[question], self.release[question] = asyncio.Event(), asyncio.Event()

    async def answer(self, call: GuardCall) -> GuardedAnswer:
        self.entered[call.question].set()
        await self.release[call.question].wait()
        if call.question in self.fail:
            raise self.fail[call.question]
        return await self.original(call)


def _served() -> tuple[Any, GuardMonitor, GuardService]:
    service = GuardService.from_artifact(
        artifact(), GuardConfig(participation=0.8), model=ToolScriptModel()
    )
    monitor = GuardMonitor(false_alarm=0.01, seed=0).fit_artifact(
        service.guard.artifact, service.guard.config
    )
    return create_app(service, monitor=monitor), monitor, service


async def _ask(client: httpx.AsyncClient, question: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": question}]}
    return await client.post("/v1/chat/completions", json=body)


def test_requests_completing_out_of_order_reach_the_monitor_in_admission_order() -> None:
    app, monitor, service = _served()
    gated = Gated(service)

    async def scenario() -> None:
        for q in ("long", "short"):
            gated.gate(q)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            first = asyncio.create_task(_ask(client, "long"))
            await gated.entered["long"].wait()
            second = asyncio.create_task(_ask(client, "short"))
            await gated.entered["short"].wait()
            gated.release["short"].set()  # the later request completes first
            short = await second
            assert short.status_code == 200, short.text
            assert monitor.records() == []  # held: "long" was admitted before it
            feedback = asyncio.create_task(
                client.post("/v1/feedback", json={"id": short.json()["id"], "correct": True})
            )
            await asyncio.sleep(0.05)
            assert not feedback.done()  # waits for the decision to reach the monitor
            gated.release["long"].set()
            long = await first
            labeled = await feedback
        assert long.status_code == 200 and labeled.status_code == 200, labeled.text
        ids = [r.run_id for r in monitor.records()]
        assert ids == [long.json()["id"], short.json()["id"]]
        assert [r.index for r in monitor.records()] == [1, 2]
        assert monitor.records()[1].correct is True

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "failure",
    [
        RequestRefused("queue full", status=503, kind="server_error"),
        RuntimeError("the model crashed"),
        asyncio.CancelledError(),  # the client went away
    ],
    ids=["refused", "error", "cancelled"],
)
def test_a_request_that_ends_without_a_decision_does_not_hold_later_ones(
    failure: BaseException,
) -> None:
    app, monitor, service = _served()
    gated = Gated(service)
    gated.fail["doomed"] = failure

    async def scenario() -> None:
        for q in ("doomed", "fine"):
            gated.gate(q)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            doomed = asyncio.create_task(_ask(client, "doomed"))
            await gated.entered["doomed"].wait()
            fine = asyncio.create_task(_ask(client, "fine"))
            await gated.entered["fine"].wait()
            gated.release["fine"].set()
            answered = await fine
            assert monitor.records() == []
            gated.release["doomed"].set()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await doomed
        assert [r.run_id for r in monitor.records()] == [answered.json()["id"]]

    asyncio.run(scenario())
