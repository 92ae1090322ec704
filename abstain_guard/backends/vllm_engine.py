"""Starting stock vLLM's OpenAI server with the guard's connector.

:class:`~abstain_guard.backends.vllm_chat.VLLMChatModel` starts a server this way when no
``engine_url`` is given; by hand (in vLLM's environment) it is::

    python -m abstain_guard.backends.vllm_engine -- --model DIR --port 8000 [vllm serve flags]

which is ``vllm serve DIR --port 8000 ...`` (vLLM's own server, ``vllm.entrypoints.openai.
api_server``, every flag parsed by vLLM) with the connector flag of
:func:`~.vllm_payload.connector_flag` added when the command line has no
``--kv-transfer-config`` of its own. ``--exit-with-parent`` (before ``--``) stops the server
when the process that started it exits. Teams that run ``vllm serve`` themselves need none
of this: add the connector flag to their command (docs/vllm.md).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "serve_command"]

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


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
