"""Starting stock vLLM's OpenAI server with the guard's connector, and the servers this
process started.

:class:`~abstain_guard.backends.vllm_chat.VLLMChatModel` starts a server this way when no
``engine_url`` is given (:func:`started_server`: one per settings in this process, shared by
every model object, stopped at exit); by hand (in vLLM's environment) it is::

    python -m abstain_guard.backends.vllm_engine -- --model DIR --port 8000 [vllm serve flags]

which is ``vllm serve DIR --port 8000 ...`` (vLLM's own server, ``vllm.entrypoints.openai.
api_server``, every flag parsed by vLLM) with the connector flag of
:func:`~.vllm_payload.connector_flag` added when the command line has no
``--kv-transfer-config`` of its own. ``--exit-with-parent`` (before ``--``) stops the server
when the process that started it exits. Teams that run ``vllm serve`` themselves need none
of this: add the connector flag to their command (docs/vllm.md).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: The interpreter of vLLM's environment (``make install`` builds ``.venv-vllm``).
VLLM_PYTHON_ENV = "ABSTAIN_GUARD_VLLM_PYTHON"


def engine_python(python: str | None = None) -> str:
    """The interpreter that runs the engine: ``python``, else ``$ABSTAIN_GUARD_VLLM_PYTHON``,
    else this interpreter when it can import vLLM.

    Raises:
        BackendError: none is set and vLLM is not importable here.
    """
    from abstain_guard.errors import BackendError

    chosen = python or os.environ.get(VLLM_PYTHON_ENV)
    if chosen:
        if not Path(chosen).exists():
            raise BackendError(
                f"The vLLM interpreter {chosen!r} does not exist; point {VLLM_PYTHON_ENV} (or "
                "python=) at the python of an environment with `pip install "
                "'abstain-guard[vllm]'` (make install builds .venv-vllm)."
            )
        return chosen
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise BackendError(
        "vLLM is not installed in this environment and no vLLM interpreter is named. vLLM "
        "pins its own transformers range, so it runs in an environment of its own: create "
        "one with `pip install 'abstain-guard[vllm]'` (make install builds .venv-vllm) and "
        f"set {VLLM_PYTHON_ENV} to its python, or pass engine_url= of a running engine."
    )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """One vLLM OpenAI server process started from here (``cmd`` serves on
    ``127.0.0.1:port``), in a session of its own, its output in a temporary log."""

    def __init__(self, cmd: Sequence[str], port: int, env: Mapping[str, str] | None = None):
        fd, log_path = tempfile.mkstemp(prefix="abstain_guard_vllm_", suffix=".log")
        self.log = Path(log_path)
        self.process = subprocess.Popen(
            list(cmd),
            stdout=fd,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
        os.close(fd)
        self.url = f"http://127.0.0.1:{int(port)}"

    def wait(self, timeout: float) -> None:
        """Return once the server lists its models.

        Raises:
            BackendError: it exited, or did not answer within ``timeout`` s (then it is
                stopped); the message ends with its log's last lines.
        """
        import httpx

        from abstain_guard.errors import BackendError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BackendError(
                    f"The vLLM server exited with code {self.process.returncode} while "
                    f"starting; its log ends:\n{self.tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        self.close(keep_log=True)
        raise BackendError(
            f"The vLLM server did not answer within {timeout:.0f} s; its log ends:\n{self.tail()}"
        )

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def close(self, keep_log: bool = False) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after 20 s)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
        if not keep_log:
            with contextlib.suppress(OSError):
                self.log.unlink()


def guarded_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a guarded server started here: the payload secret (the caller's,
    else one generated for this process's servers), this package importable, and a vector
    ATen capability under the foreign-kernel mode's scalar pin (vLLM compiles with inductor,
    whose C++ code needs one: "at::vec has not been declared"; the engine keeps the portable
    ``avx2``, its bound to calibration measured, not bitwise)."""
    from .vllm_payload import PAYLOAD_KEY_ENV, payload_key

    env = dict(os.environ if base is None else base)
    if env.get("ATEN_CPU_CAPABILITY") == "default":
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    env[PAYLOAD_KEY_ENV] = payload_key(generate=True).decode("utf-8")
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


_SERVERS: dict[Hashable, ServerProcess] = {}
_SERVERS_LOCK = threading.Lock()
#: One lock per server key: a server that takes minutes to start (vLLM compiles) blocks
#: only the callers that wait for it.
_STARTING: dict[Hashable, threading.Lock] = {}


def started_server(key: Hashable, start: Callable[[], ServerProcess], timeout: float) -> str:
    """The URL of this process's server for ``key``, started with ``start`` (and waited for)
    when there is none or it exited."""
    with _SERVERS_LOCK:  # held only to find this key's lock: other servers start alongside
        lock = _STARTING.setdefault(key, threading.Lock())
    with lock:
        found = _SERVERS.get(key)
        if found is None or found.process.poll() is not None:
            found = _SERVERS[key] = start()  # stop_servers() reaches a server still starting
            found.wait(timeout)
    return found.url


def stop_servers() -> None:
    """Stop every server this process started (also run at exit)."""
    with _SERVERS_LOCK:
        for server in _SERVERS.values():
            server.close()
        _SERVERS.clear()


atexit.register(stop_servers)


def serve_command(
    python: str,
    folder: Path | str,
    port: int,
    *,
    dtype: str = "float32",
    max_model_len: int = 2048,
    memory_fraction: float = 0.15,
    layers: Sequence[int] | None = None,
    vllm_args: Sequence[str] = (),
) -> list[str]:
    """The command that starts a server on ``127.0.0.1:port`` (flags in ``vllm_args`` win
    over the defaults written here: vLLM's parser keeps the last occurrence)."""
    from .vllm_payload import connector_flag

    cmd = [python, "-m", __name__, "--exit-with-parent", "--"]
    cmd += ["--model", str(folder), "--host", "127.0.0.1", "--port", str(int(port))]
    cmd += ["--dtype", dtype, "--max-model-len", str(int(max_model_len)), "--seed", "0"]
    cmd += ["--gpu-memory-utilization", str(float(memory_fraction))]
    if not any(a.startswith("--kv-transfer-config") for a in vllm_args):
        cmd += connector_flag(layers)
    return cmd + [str(a) for a in vllm_args]


def _exit_with_parent(parent: int) -> None:
    """End this server when ``parent`` is gone: a server started by a guard process that
    was killed must not keep its memory. Kills its own process group only when it leads
    one (started with a new session, as VLLMChatModel starts it); run by hand inside a
    shell's group, it ends itself alone."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        if os.getpgid(0) == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def main(argv: Sequence[str] | None = None) -> int:
    from .vllm_payload import connector_flag

    args = list(sys.argv[1:] if argv is None else argv)
    ours, _, theirs = _split(args)
    if "--exit-with-parent" in ours:
        _exit_with_parent(os.getppid())
    if not any(a.startswith("--kv-transfer-config") for a in theirs):
        theirs += connector_flag(None)
    # On the CPU, vLLM reserves one more core per rank when any KV connector is configured
    # (for NIXL's transfers); the guard's connector moves no KV, so the server keeps stock
    # vLLM's reservation (one core per rank) unless the caller set its own.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(_ranks(theirs)))
    sys.argv = ["vllm serve", *theirs]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)
    return 0


def _ranks(args: Sequence[str]) -> int:
    """The tensor-parallel size a ``vllm serve`` command line asks for (1 if none)."""
    for k, arg in enumerate(args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if arg == flag and k + 1 < len(args):
                return max(1, int(args[k + 1]))
            if arg.startswith(flag + "="):
                return max(1, int(arg.split("=", 1)[1]))
    return 1


def _split(args: list[str]) -> tuple[list[str], str, list[str]]:
    if "--" in args:
        k = args.index("--")
        return args[:k], "--", args[k + 1 :]
    return [], "", args


if __name__ == "__main__":
    raise SystemExit(main())
