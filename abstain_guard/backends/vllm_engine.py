"""The engine side of the vLLM backend: a vLLM ``AsyncLLM`` that records, per request, what
the probe and likelihood scorers read, behind a small HTTP endpoint.

Runs in vLLM's own environment (``pip install "abstain-guard[vllm]"`` there; vLLM pins a
transformers range of its own), started by :class:`~abstain_guard.backends.vllm_chat.VLLMChatModel`
or by hand::

    python -m abstain_guard.backends.vllm_engine --model DIR --port 8011

**Capture (single pass).** A worker extension (:class:`HiddenStateCapture`, vLLM's
``worker_extension_cls``) hooks the decoder layers the probes read. In every forward pass,
the rows of a batch belong to requests by ``query_start_loc`` (the runner's flattened
layout, ``input_batch.req_ids`` in order); the hook keeps, per request, the residual stream
``e^l = hidden_states + residual`` (vLLM's decoder layers return the two apart and add them
in the next layer's norm) of the request's *last* row, keyed by its position, and a wrapped
``compute_logits`` keeps the full-vocabulary entropy of the distribution sampled there. The
positions that predict the generated tokens are the prompt's last one and every decode
step's input (``P − 1 … P + N − 2``), which are exactly the rows vLLM computes while it
generates: no second pass. Rows of unfinished prefill chunks (positions ``< P − 1``) and an
extra step scheduled after the last token are dropped when the request is read out.
Needs eager execution (``enforce_eager``: hooks do not run inside compiled graphs) and no
speculative decoding (one row per request per step).

**Endpoint.** ``GET /info``: the engine record (vLLM version, model, dtype, device, layers,
capture path, batch invariance); ``POST /generate``: ``{"messages", "max_tokens",
"top_logprobs", "tools"?}`` → the response's ``prompt_token_ids``, ``token_ids``, ``tokens``,
OpenAI-style ``logprobs``, ``entropy`` and ``hidden`` (``{"layers", "last", "mean"}``, the
layout of :func:`abstain_guard.contract.metadata.hidden_summary`), greedy, computed in vLLM's own
batches, and ``engine`` (the ``/info`` record of the engine that computed it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from abstain_guard.contract.metadata import hidden_summary, probe_layers

__all__ = [
    "CAPTURE_PATH",
    "HiddenStateCapture",
    "build_app",
    "main",
    "read_out",
]

#: How the residual stream is read (recorded in the artifact's decode path).
CAPTURE_PATH = "single_pass_layer_hooks"
#: Requests whose captures are kept before the oldest are dropped (a client that never
#: reads its capture out cannot grow the worker without bound).
MAX_PENDING = 4096


class HiddenStateCapture:
    """vLLM worker extension: per-request residual-stream rows and entropies.

    Mixed into vLLM's worker class (``worker_extension_cls``); its methods are called
    with ``collective_rpc``. State: ``_captured[req_id] = {"rows": {layer: {pos: row}},
    "entropy": {pos: float}}``, a row the bytes of ``[D]`` float32.
    """

    def install_capture(self, layers: Sequence[int]) -> dict[str, Any]:
        """Hook decoder layers ``layers`` and the logits; returns the model's shape."""
        import torch

        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        decoder = model.model.layers
        num_layers = len(decoder)
        layers = [int(x) for x in layers]
        bad = [x for x in layers if not 0 <= x < num_layers]
        if bad:
            raise ValueError(f"layers {bad} are outside the model's {num_layers} layers")
        self._captured: dict[str, dict[str, Any]] = {}
        self._step: tuple[list[str], list[int]] | None = None

        def last_rows() -> tuple[list[str], np.ndarray]:
            num_reqs = int(runner.input_batch.num_reqs)
            qsl = runner.query_start_loc.cpu[: num_reqs + 1].numpy()
            return list(runner.input_batch.req_ids[:num_reqs]), qsl[1:] - 1

        def entry(req: str) -> dict[str, Any]:
            got = self._captured.get(req)
            if got is None:
                if len(self._captured) >= MAX_PENDING:
                    self._captured.pop(next(iter(self._captured)))
                got = self._captured[req] = {"rows": {x: {} for x in layers}, "entropy": {}}
            return got

        def hook(layer: int) -> Any:
            def on_output(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
                positions = args[0] if args else kwargs["positions"]
                hs, residual = output if isinstance(output, tuple) else (output, None)
                req_ids, last = last_rows()
                index = torch.as_tensor(last, dtype=torch.long)
                rows = hs.index_select(0, index)
                if residual is not None:
                    rows = rows + residual.index_select(0, index)
                rows_np = rows.float().cpu().numpy()
                pos = positions.index_select(0, index).cpu().tolist()
                if layer == layers[0]:
                    self._step = (req_ids, [int(p) for p in pos])
                for k, req in enumerate(req_ids):
                    entry(req)["rows"][layer][int(pos[k])] = rows_np[k].tobytes()

            return on_output

        for layer in layers:
            decoder[layer].register_forward_hook(hook(layer), with_kwargs=True)

        compute_logits = model.compute_logits

        def logits_with_entropy(*args: Any, **kwargs: Any) -> Any:
            logits = compute_logits(*args, **kwargs)
            step = self._step
            if logits is not None and step is not None:
                logp = torch.log_softmax(logits.float(), dim=-1)
                ent = (-(logp.exp() * logp).nan_to_num(0.0).sum(-1)).cpu().tolist()
                req_ids, pos = step
                for k in range(min(len(req_ids), len(ent))):
                    entry(req_ids[k])["entropy"][pos[k]] = float(ent[k])
            return logits

        model.compute_logits = logits_with_entropy
        hidden = int(getattr(model.config, "hidden_size", 0) or 0)
        return {"num_layers": num_layers, "hidden_size": hidden, "layers": layers}

    def pop_capture(self, request_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The captures of ``request_ids`` (vLLM suffixes the engine's ids:
        ``"<id>-<8 chars>"``), removed from the worker."""
        out: dict[str, dict[str, Any]] = {}
        wanted = set(request_ids)
        for req in list(self._captured):
            base = req.rsplit("-", 1)[0]
            key = req if req in wanted else base if base in wanted else None
            if key is not None:
                out[key] = self._captured.pop(req)
        return out


def _row(raw: Any) -> np.ndarray:
    """One captured row ``[D]`` float32 (the worker sends its bytes: vLLM's RPC encoding
    does not round-trip numpy arrays)."""
    return np.frombuffer(raw, dtype=np.float32) if isinstance(raw, bytes) else np.asarray(raw)


def read_out(
    capture: Mapping[str, Any], prompt_len: int, num_tokens: int, layers: Sequence[int]
) -> tuple[list[float], dict[str, Any] | None]:
    """The entropies ``[N]`` and the hidden summary of one response from its capture: the
    rows at the positions predicting its ``N`` generated tokens, ``P − 1 … P + N − 2``.

    Raises:
        ValueError: a position was not captured (the engine ran a path the hooks do not
            see: compiled graphs, speculative decoding, a preempted request recomputed
            without its rows).
    """
    wanted = range(prompt_len - 1, prompt_len + num_tokens - 1)
    ent_map = capture.get("entropy", {})
    missing = [p for p in wanted if p not in ent_map]
    rows = capture.get("rows", {})
    for layer in layers:
        missing += [p for p in wanted if p not in rows.get(layer, {})]
    if missing:
        raise ValueError(
            f"the capture lacks positions {sorted(set(missing))[:8]} of {len(wanted)}; run the "
            "engine with enforce_eager and without speculative decoding"
        )
    entropy = [float(ent_map[p]) for p in wanted]
    if num_tokens == 0:
        return entropy, None
    states = np.stack(
        [np.stack([_row(rows[layer][p]) for layer in layers]) for p in wanted]
    )  # [N, K, D]
    return entropy, hidden_summary(states, layers)


def _logprob_content(tokenizer: Any, ids: Sequence[int], logprobs: Any) -> list[dict[str, Any]]:
    content = []
    for k, t in enumerate(ids):
        options = logprobs[k] if logprobs is not None and k < len(logprobs) else {}
        chosen = options.get(t)
        text = tokenizer.decode([t])
        tops = sorted(
            (lp for tid, lp in options.items() if lp.rank is not None and lp.rank >= 1),
            key=lambda lp: lp.rank,
        )
        content.append(
            {
                "token": text,
                "token_id": int(t),
                "logprob": float(chosen.logprob) if chosen is not None else float("nan"),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": lp.decoded_token or "", "logprob": float(lp.logprob)} for lp in tops
                ],
            }
        )
    return content


def build_app(args: argparse.Namespace) -> Any:
    """The FastAPI app serving one ``AsyncLLM`` with capture installed."""
    import vllm
    from fastapi import FastAPI, HTTPException
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    state: dict[str, Any] = {}
    app = FastAPI(title="abstain_guard vLLM engine")

    @app.on_event("startup")
    async def start() -> None:
        engine_args = AsyncEngineArgs(
            model=args.model,
            dtype=args.dtype,
            enforce_eager=True,
            seed=0,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.memory_fraction,
            enable_prefix_caching=not args.no_prefix_caching,
            worker_extension_cls=f"{__name__}.HiddenStateCapture",
            load_format=args.load_format,
        )
        engine = AsyncLLM.from_engine_args(engine_args)
        model_config = engine.model_config
        num_layers = int(model_config.hf_config.num_hidden_layers)
        layers = list(args.layers) if args.layers else list(probe_layers(num_layers))
        if args.no_capture:  # plain vLLM: the baseline bench/vllm_backend.py measures against
            layers = []
            hidden = int(getattr(model_config.hf_config, "hidden_size", 0) or 0)
            shape = {"num_layers": num_layers, "hidden_size": hidden}
        else:
            shape = (await engine.collective_rpc("install_capture", args=(layers,)))[0]
        tokenizer = engine.get_tokenizer()
        state.update(engine=engine, tokenizer=tokenizer, layers=layers)
        state["info"] = {
            "backend": "vllm",
            "vllm_version": str(vllm.__version__),
            "model": str(args.model),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "device": str(engine.vllm_config.device_config.device_type),
            "num_layers": int(shape["num_layers"]),
            "hidden_size": int(shape["hidden_size"]),
            "layers": [int(x) for x in layers],
            "capture_path": None if args.no_capture else CAPTURE_PATH,
            "enforce_eager": True,
            "prefix_caching": not args.no_prefix_caching,
            "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1",
            "pid": os.getpid(),
        }

    @app.on_event("shutdown")
    async def stop() -> None:
        engine = state.get("engine")
        if engine is not None:
            engine.shutdown()

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return dict(state["info"])

    @app.post("/generate")
    async def generate(body: dict[str, Any]) -> dict[str, Any]:
        engine, tokenizer, layers = state["engine"], state["tokenizer"], state["layers"]
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HTTPException(400, "messages must be a non-empty list of chat messages")
        max_tokens = int(body.get("max_tokens", 64))
        top = int(body.get("top_logprobs", 0))
        template_kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True}
        if body.get("tools"):
            template_kwargs["tools"] = body["tools"]
        prompt_ids = body.get("prompt_token_ids")
        if prompt_ids is None:
            rendered = tokenizer.apply_chat_template(messages, **template_kwargs)
            prompt_ids = list(rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)
        stop = [str(x) for x in body.get("stop") or []]  # a tool call's end marker, kept
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            logprobs=max(top, 0),
            seed=0,
            stop=stop or None,
            include_stop_str_in_output=bool(stop),
        )
        rid = f"ag-{uuid.uuid4().hex}"
        final = None
        try:
            async for out in engine.generate({"prompt_token_ids": prompt_ids}, params, rid):
                final = out
        finally:
            captured = (
                [] if args.no_capture else await engine.collective_rpc("pop_capture", args=([rid],))
            )
        if final is None or not final.outputs:
            raise HTTPException(500, "the engine returned no output")
        completion = final.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        entropy: list[float] | None = None
        hidden: dict[str, Any] | None = None
        if not args.no_capture:
            capture = next((c[rid] for c in captured if rid in c), None)
            if capture is None:
                raise HTTPException(500, "the engine recorded no hidden states for the request")
            try:
                entropy, hidden = read_out(capture, len(prompt_ids), len(ids), layers)
            except ValueError as exc:
                raise HTTPException(500, f"incomplete capture: {exc}") from exc
        content = _logprob_content(tokenizer, ids, completion.logprobs)
        finish = "length" if completion.finish_reason == "length" else "stop"
        return {
            "text": completion.text,
            "finish_reason": finish,
            "prompt_token_ids": [int(t) for t in prompt_ids],
            "token_ids": ids,
            "tokens": [c["token"] for c in content],
            "logprobs": {"content": content},
            "entropy": entropy,
            "hidden": hidden,
            "engine": dict(state["info"]),  # what computed it: the response's own record
        }

    return app


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m abstain_guard.backends.vllm_engine")
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=0.15,
        help="vLLM's gpu_memory_utilization (on the CPU backend: the share of host memory "
        "reserved for weights and KV cache)",
    )
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--no-capture",
        action="store_true",
        help="plain vLLM (no hooks, no hidden states or entropies): a baseline to measure",
    )
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started the engine exits (how VLLMChatModel starts it)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        help="vLLM's load_format ('dummy': random weights from the config, for benchmarks)",
    )
    return p.parse_args(argv)


def _exit_with_parent(parent: int) -> None:
    """End this engine (and vLLM's processes, in its session) when ``parent`` is gone: an
    engine started by a guard process that was killed must not keep its memory."""
    import signal
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    args = _parse(argv)
    if args.exit_with_parent:
        _exit_with_parent(os.getppid())
    app = build_app(args)
    print(json.dumps({"engine": "starting", "port": args.port}), file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
