"""A monitor actor handle in this process, for the serve tests of replicas without Ray.

:class:`LocalActor` wraps a real :class:`~abstain_guard.serve.monitor_actor.DeploymentMonitor`
(or any object) so that ``handle.method.remote(*args)`` runs the method as a task on the
running event loop, as Ray runs an async actor's method: awaiting the result waits for it, and
a call nobody awaits (``release``, ``request_done``, ``decided``) still runs."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any


class _Method:
    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any) -> asyncio.Task[Any]:
        async def run() -> Any:
            result = self.method(*args)
            return await result if inspect.isawaitable(result) else result

        return asyncio.get_running_loop().create_task(run())


class LocalActor:
    """``body``'s methods behind Ray's ``.remote()`` calling convention."""

    def __init__(self, body: Any) -> None:
        self.body = body

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.body, name))


class StalledActor:
    """A monitor actor that never answers (restarting, overloaded): every call hangs."""

    def __getattr__(self, name: str) -> _Method:
        async def hang(*args: Any) -> None:
            await asyncio.Event().wait()

        return _Method(hang)
