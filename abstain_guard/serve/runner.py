"""Run the app with uvicorn: in the foreground (``abstain-guard serve``) or on a background
thread (:class:`ServerThread`: tests, notebooks, benchmarks). Shutdown is graceful: admitted
requests finish (up to :data:`GRACEFUL_S` seconds) while new ones get 503.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from types import TracebackType
from typing import Any, TypeVar

import uvicorn

from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.serve.app import create_app
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.service import GuardService


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``);
    ``0.0.0.0`` and every other address listen beyond this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: Seconds the admitted requests have to finish on shutdown.
GRACEFUL_S = 60


def _server(
    service: GuardService | ModelService,
    host: str,
    port: int,
    logs: dict[str, Any],
    **app_options: Any,
) -> uvicorn.Server:
    """uvicorn serving :func:`~abstain_guard.serve.app.create_app`'s app of ``service`` at
    ``host:port`` (``logs``: uvicorn's logging options; ``app_options``: the app's
    ``api_key`` and ``monitor``)."""
    app = create_app(service, loopback=is_loopback(host), **app_options)
    config = uvicorn.Config(
        app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_S, lifespan="on", **logs
    )
    return uvicorn.Server(config)


def serve(
    service: GuardService | ModelService,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    api_key: str | None = None,
    monitor: GuardMonitor | None = None,
) -> None:
    """Serve ``service`` until SIGINT / SIGTERM (blocks); uvicorn's lines at ``log_level``
    go to the logging the process configured (the CLI's: JSON lines,
    :func:`~abstain_guard.serve.telemetry.configure_logging`), without access lines (each
    chat completion logs its decision or refusal); ``api_key`` and ``monitor`` as in
    :func:`~abstain_guard.serve.app.create_app`."""
    logs = {"log_level": log_level, "log_config": None, "access_log": False}
    _server(service, host, port, logs, api_key=api_key, monitor=monitor).run()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_E = TypeVar("_E", bound="Endpoint")


class Endpoint:
    """A server at ``host:port`` that :meth:`start` starts and :meth:`stop` stops, also as a
    context manager (``with``: started on entry, stopped on exit)."""

    host: str
    port: int

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``, what OpenAI clients take as ``base_url`` (a server on
        every address is reached on loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self: _E) -> _E:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _E) -> _E:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class ServerThread(Endpoint):
    """The server on a background thread, on a free loopback port by default::

    with ServerThread(service) as server:
        OpenAI(base_url=server.base_url, api_key="none")...
    """

    def __init__(
        self,
        service: GuardService | ModelService,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        api_key: str | None = None,
        monitor: GuardMonitor | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        logs = {"log_level": "warning"}
        self.server = _server(service, host, self.port, logs, api_key=api_key, monitor=monitor)
        self.thread = threading.Thread(target=self.server.run, name="abstain-guard-serve")

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        """Start serving; returns once the port accepts connections.

        Raises:
            RuntimeError: the server did not start within ``timeout_s``.
        """
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"The server did not start on {self.host}:{self.port} within {timeout_s} "
                    "s (port taken? see the log above)."
                )
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        """Shut down gracefully (admitted requests finish) and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
