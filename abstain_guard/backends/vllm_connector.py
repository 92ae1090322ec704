"""The guard inside stock ``vllm serve``: a KV connector (and the vLLM plugin it needs) that
returns, with each OpenAI response, what the probe and likelihood scorers read.

Turned on by configuration, on the team's own ``vllm serve`` command and flags, in an
environment where ``abstain-guard[vllm]`` is installed::

    vllm serve MODEL --tensor-parallel-size 4 ... \\
        --kv-transfer-config '{"kv_connector": "AbstainGuardConnector",
                               "kv_connector_module_path": "abstain_guard.backends.vllm_connector",
                               "kv_role": "kv_both"}'

(:func:`~.vllm_payload.connector_flag` writes that flag.) A request that carries
``"kv_transfer_params": {"abstain_guard": {}}`` gets ``kv_transfer_params.abstain_guard``
in its response: the probe layers' last row and mean over the answer, the answer's token
entropies and the server's engine record (vLLM version, dtype, device, parallelism, compile
and CUDA-graph modes, the served weights' digest). Other requests are served as before.

How (docs/vllm.md, "Inside stock vLLM"):

- vLLM loads :func:`register` in every process (entry point ``vllm.general_plugins``); it
  only arms a post-import hook: when vLLM's model runner module is imported, its
  ``load_model``, ``execute_model`` and ``sample_tokens`` are wrapped. The wrappers do
  nothing unless the engine's ``kv_transfer_config`` names this connector.
- After the weights load and *before* vLLM compiles the model, :func:`~.vllm_capture.install_tap`
  hooks the probe layers: the residual stream is copied inside the compiled graph (and the
  CUDA graph) into a static buffer. The tap's layers enter vLLM's compile-cache key
  (``additional_config``), so a graph compiled without them is never reused.
- Per step, beside the sampler, :class:`~.vllm_capture.RequestCapture` accumulates on the
  device; when a request's last token is sampled (the scheduler's stop rule, replayed on the
  worker), its summary is copied to the host once and sent to the scheduler in the step's
  ``KVConnectorWorkerMetadata``; the connector's ``request_finished`` puts it in the
  request's ``kv_transfer_params``, which vLLM returns in the OpenAI response.
- Tensor parallelism: the residual stream is the same on every rank after the all-reduce;
  rank 0 captures it. Pipeline parallelism and speculative decoding are refused at start-up.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from abstain_guard.contract.metadata import probe_layers

from .vllm_capture import RequestCapture, finishes, install_tap, step_from_runner
from .vllm_mailbox import CaptureMailbox
from .vllm_payload import CONNECTOR_NAME, PAYLOAD_KEY, connector_flag, weights_digest

__all__ = [
    "CAPTURE_PATH",
    "CONNECTOR_NAME",
    "AbstainGuardConnector",
    "connector_flag",
    "register",
    "weights_digest",
]

#: How the residual stream is read (recorded in the engine record and the artifact).
CAPTURE_PATH = "compiled_tap_kv_connector"
#: Longest answer whose token entropies are kept (longer: entropy None, hidden still exact).
MAX_ENTROPY_TOKENS = 8192
_RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner")


def _is_ours(vllm_config: Any) -> bool:
    cfg = getattr(vllm_config, "kv_transfer_config", None)
    return cfg is not None and getattr(cfg, "kv_connector", None) == CONNECTOR_NAME


def tap_layers(vllm_config: Any) -> list[int]:
    """The decoder layers the tap reads: ``kv_connector_extra_config.layers``, else the
    probe layers of the model's depth."""
    extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
    num = int(vllm_config.model_config.hf_config.num_hidden_layers)
    layers = [int(x) for x in (extra.get("layers") or probe_layers(num))]
    bad = [x for x in layers if not 0 <= x < num]
    if bad:
        raise ValueError(f"abstain_guard: layers {bad} are outside the model's {num} layers")
    return sorted(set(layers))


def engine_record(vllm_config: Any) -> dict[str, Any]:
    """What computed a response (checked by the guard against its calibration)."""
    import vllm

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    compilation = vllm_config.compilation_config
    return {
        "name": "vllm",
        "vllm_version": str(vllm.__version__),
        "model": str(model_config.model),
        "weights_sha256": weights_digest(model_config.model),
        "quantization": model_config.quantization,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "device": str(vllm_config.device_config.device_type),
        "layers": tap_layers(vllm_config),
        "capture_path": CAPTURE_PATH,
        "enforce_eager": bool(model_config.enforce_eager),
        "compilation_mode": str(getattr(compilation.mode, "name", compilation.mode)),
        "cudagraph_mode": str(getattr(compilation.cudagraph_mode, "name", None)),
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
        "prefix_caching": bool(vllm_config.cache_config.enable_prefix_caching),
        "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1",
    }


# ---- scheduler <-> worker messages ----------------------------------------------------


@dataclass
class GuardConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step: the requests that asked for a capture."""

    wanted: list[str] = field(default_factory=list)


@dataclass
class GuardWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: the captures of requests finished in the step."""

    captures: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, GuardWorkerMetadata):
            self.captures.update(other.captures)
        return self


# ---- the worker side: installed on the model runner -----------------------------------


class _RunnerCapture:
    """What one model runner holds: the tap, the accumulator, this step's metadata."""

    def __init__(self, runner: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        config = runner.vllm_config
        if config.speculative_config is not None:
            raise ValueError(
                "abstain_guard: the capture reads one row per request per step; run without "
                "speculative decoding (--speculative-config)."
            )
        if config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError(
                "abstain_guard: pipeline parallelism is not supported (the probe layer lives "
                "on one stage); use tensor parallelism."
            )
        model = runner.get_model()
        self.runner = runner
        self.layers = tap_layers(config)
        hf = config.model_config.hf_config
        hidden = int(hf.hidden_size)
        # Recorded in vLLM's compile-cache key: a graph compiled without this tap (or with
        # other layers) is never loaded in its place.
        extra = (
            dict(config.additional_config or {})
            if isinstance(config.additional_config, dict)
            else {}
        )
        extra["abstain_guard_tap"] = {"layers": self.layers, "path": CAPTURE_PATH}
        config.additional_config = extra
        self.taps = install_tap(
            model.model.layers,
            self.layers,
            int(runner.max_num_tokens),
            hidden,
            config.model_config.dtype,
            runner.device,
        )
        self.rank0 = get_tensor_model_parallel_rank() == 0
        self.capture = RequestCapture(
            self.layers,
            hidden,
            int(runner.max_num_reqs),
            min(MAX_ENTROPY_TOKENS, int(config.model_config.max_model_len)),
            runner.device,
        )
        self.max_model_len = int(config.model_config.max_model_len)
        self.wanted: set[str] = set()
        self.meta: GuardWorkerMetadata | None = None
        self.armed = False
        if self.rank0:
            compute_logits = model.compute_logits

            def logits_and_capture(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
                logits = compute_logits(hidden_states, *args, **kwargs)
                if self.armed and logits is not None:
                    self.armed = False
                    self.on_logits(logits)
                return logits

            model.compute_logits = logits_and_capture

    def on_logits(self, logits: Any) -> None:
        step_from_runner(self.capture, self.taps, self.runner, logits)

    def on_sampled(self, output: Any) -> None:
        """Find the requests whose last token this step sampled; send their captures."""
        if not self.rank0 or output is None:
            return
        req_ids = getattr(output, "req_ids", None) or []
        sampled = getattr(output, "sampled_token_ids", None) or []
        done: list[str] = []
        for k, req in enumerate(req_ids):
            tokens = sampled[k] if k < len(sampled) else []
            if not len(tokens):
                continue
            total = self.capture.sampled(req, len(tokens))
            state = self.runner.requests.get(req)
            if state is not None and finishes(
                state.sampling_params,
                int(tokens[-1]),
                total,
                int(state.num_prompt_tokens),
                self.max_model_len,
            ):
                done.append(req)
        if not done:
            return
        wanted = [r for r in done if r in self.wanted]
        for req in done:
            self.wanted.discard(req)
            if req not in wanted:
                self.capture.release(req)
        if not wanted:
            return
        captures = self.capture.read_out(wanted)
        connector_output = getattr(output, "kv_connector_output", None)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, GuardWorkerMetadata):
            meta.captures.update(captures)
        elif connector_output is not None and meta is None:
            connector_output.kv_connector_worker_meta = GuardWorkerMetadata(captures)


def _patch_runner_class(cls: Any) -> None:
    """Wrap the runner methods ``cls`` itself defines (a subclass that inherits one keeps
    the base class's wrapper: wrapping it again would run the capture twice)."""
    if cls.__dict__.get("_abstain_guard_patched"):
        return
    own = cls.__dict__

    def patched_load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = own_load_model(self, *args, **kwargs)
        if _is_ours(self.vllm_config) and getattr(self, "_abstain_guard", None) is None:
            self._abstain_guard = _RunnerCapture(self)
            global _ACTIVE
            _ACTIVE = self._abstain_guard
        return result

    def patched_execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = getattr(self, "_abstain_guard", None)
        if state is not None:
            state.armed = True
        try:
            return own_execute_model(self, *args, **kwargs)
        finally:
            if state is not None:
                state.armed = False

    def patched_sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = own_sample_tokens(self, *args, **kwargs)
        state = getattr(self, "_abstain_guard", None)
        if state is None or out is None:
            return out
        if hasattr(out, "get_output"):  # async scheduling: token ids reach the host later
            get_output = out.get_output

            def get_output_and_capture() -> Any:
                result = get_output()
                state.on_sampled(result)
                return result

            out.get_output = get_output_and_capture
        else:
            state.on_sampled(out)
        return out

    own_load_model = own.get("load_model")
    own_execute_model = own.get("execute_model")
    own_sample_tokens = own.get("sample_tokens")
    if own_load_model is not None:
        cls.load_model = patched_load_model
    if own_execute_model is not None:
        cls.execute_model = patched_execute_model
    if own_sample_tokens is not None:
        cls.sample_tokens = patched_sample_tokens
    cls._abstain_guard_patched = True


_ACTIVE: _RunnerCapture | None = None


def _patch_module(module: Any) -> None:
    for name in ("GPUModelRunner", "CPUModelRunner"):
        cls = getattr(module, name, None)
        if cls is not None:
            _patch_runner_class(cls)


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches vLLM's model runner classes as their modules are imported (the plugin runs
    in every vLLM process; importing the runner there would cost seconds)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _RUNNER_MODULES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        inner = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return inner.create_module(spec)

            def exec_module(self, module: Any) -> None:
                inner.exec_module(module)
                _patch_module(module)

        spec.loader = _Loader()
        return spec


def _prefer_v1_runner() -> None:
    """A server with this connector runs vLLM's V1 model runner (the one the capture wraps;
    on GPUs with Triton vLLM 0.32 would pick its V2 runner). Other servers are untouched;
    an explicit ``VLLM_USE_V2_MODEL_RUNNER=1`` with the connector fails at start-up instead."""
    from vllm.config import VllmConfig

    prop = VllmConfig.__dict__.get("use_v2_model_runner")
    if not isinstance(prop, property) or getattr(prop.fget, "_abstain_guard", False):
        return
    choose = prop.fget
    assert choose is not None

    def use_v2_model_runner(self: Any) -> bool:
        if _is_ours(self):
            if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("1", "true"):
                raise ValueError(
                    "abstain_guard: the capture runs on vLLM's V1 model runner; unset "
                    "VLLM_USE_V2_MODEL_RUNNER (or set it to 0) with the guard's connector."
                )
            return False
        return bool(choose(self))

    use_v2_model_runner._abstain_guard = True  # type: ignore[attr-defined]
    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)  # type: ignore[method-assign]


def register() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``): arm the runner patches.
    Inert unless the engine's ``kv_transfer_config`` names :data:`CONNECTOR_NAME`."""
    for name in _RUNNER_MODULES:
        if name in sys.modules:
            _patch_module(sys.modules[name])
    _prefer_v1_runner()
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


# ---- the connector ----------------------------------------------------------------------


class AbstainGuardConnector(KVConnectorBase_V1):
    """vLLM KV connector that moves no KV: it carries each requested capture from the worker
    to the request's ``kv_transfer_params`` (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        register()  # the runner is already patched when the plugin loaded; harmless again
        record = engine_record(vllm_config) if role == KVConnectorRole.SCHEDULER else {}
        self._mailbox = CaptureMailbox(record)

    # worker side: nothing moves through the KV cache
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if _ACTIVE is not None and isinstance(connector_metadata, GuardConnectorMetadata):
            _ACTIVE.wanted.update(connector_metadata.wanted)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return GuardWorkerMetadata() if _ACTIVE is not None and _ACTIVE.rank0 else None

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def on_new_request(self, request: Any) -> None:
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, Mapping) and PAYLOAD_KEY in params:
            self._mailbox.want(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return GuardConnectorMetadata(wanted=self._mailbox.take_new())

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, GuardWorkerMetadata):
            self._mailbox.arrive(meta.captures)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # filled in place when the step's worker output arrives (:mod:`.vllm_mailbox`)
        payload = self._mailbox.finished(request.request_id)
        return False, None if payload is None else {PAYLOAD_KEY: payload}
