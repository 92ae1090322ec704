"""The guard inside stock ``vllm serve``: a KV connector (and the vLLM plugin it needs) that
returns, with each OpenAI response, what the probe and likelihood scorers read.

Turned on by configuration, on the team's own ``vllm serve`` command and flags, in an
environment where ``abstain-guard[vllm]`` is installed and ``ABSTAIN_GUARD_PAYLOAD_KEY`` is
set (the same secret as the guard's)::

    vllm serve MODEL --tensor-parallel-size 4 ... \\
        --kv-transfer-config '{"kv_connector": "AbstainGuardConnector",
                               "kv_connector_module_path": "abstain_guard.backends.vllm_connector",
                               "kv_role": "kv_producer"}'

(:func:`~.vllm_payload.connector_flag` writes that flag; it may also be one of vLLM's
``MultiConnector`` children, beside LMCache, NIXL or an offloading connector.) A request
that carries ``"kv_transfer_params": {"abstain_guard": {"token": ...}}`` with the token of
the server's key gets ``kv_transfer_params.abstain_guard`` in its response, signed: the
probe layers' last row and mean over the answer, the answer's token entropies, the LoRA
adapter and the server's engine record (vLLM version, dtype, device, parallelism, compile and
CUDA-graph modes, the served model's verified identity). Other requests are served as before.

How (docs/vllm.md, "How the hidden states come out"):

- vLLM loads :func:`register` in every process (entry point ``vllm.general_plugins``): it
  checks vLLM's version against :data:`~.vllm_support.SUPPORTED_VLLM` and arms a post-import
  hook that wraps the V1 model runner's ``load_model``, ``execute_model``, ``sample_tokens``
  and ``_dummy_sampler_run`` (a method missing from vLLM is an error when the connector is
  configured, not a silent skip). The wrappers do nothing unless the engine's
  ``kv_transfer_config`` names this connector.
- After the weights load and *before* vLLM compiles the model, :func:`~.vllm_capture.install_tap`
  hooks the probe layers; per step :class:`~.vllm_capture.RunnerCapture` copies the rows of the
  requests that asked to pinned host memory and sums them where vLLM reads the step's output;
  vLLM's own stop rule (``check_stop``) says which requests finished, and their payloads go to
  the scheduler in the step's ``KVConnectorWorkerMetadata``; the connector's
  ``request_finished`` signs them into the request's ``kv_transfer_params``.
- Tensor parallelism: the residual stream is the same on every rank after the all-reduce;
  TP rank 0 captures it. Refused at start-up by name: :func:`~.vllm_support.check_modes`.
"""

from __future__ import annotations

import functools
import hmac
import importlib
import importlib.abc
import importlib.util
import logging
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
    SupportsHMA,
)

from abstain_guard.contract.metadata import probe_layers

from .vllm_capture import HostCapture, RunnerCapture, install_tap
from .vllm_identity import IdentityUnverifiable, model_identity
from .vllm_mailbox import CaptureMailbox
from .vllm_payload import (
    CONNECTOR_NAME,
    PAYLOAD_KEY,
    connector_flag,
    payload_key,
    request_token,
    sign_payload,
)
from .vllm_support import (
    UnsupportedServing,
    check_modes,
    check_version,
    lora_record,
    stop_view,
    version_problem,
)

__all__ = [
    "CAPTURE_PATH",
    "CONNECTOR_NAME",
    "AbstainGuardConnector",
    "connector_flag",
    "register",
]

log = logging.getLogger(__name__)

#: How the residual stream is read (recorded in the engine record and the artifact).
CAPTURE_PATH = "compiled_tap_kv_connector"
#: Longest answer whose token entropies are kept (longer: entropy None, hidden still exact).
MAX_ENTROPY_TOKENS = 8192
_RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner")
#: The V1 runner's methods the capture wraps (each must exist in the vLLM served).
_WRAPPED = ("load_model", "execute_model", "sample_tokens", "_dummy_sampler_run")
#: Why the runner could not be patched (raised when the connector is configured).
_PATCH_ERRORS: list[str] = []


def _connector_configs(vllm_config: Any) -> list[Any]:
    """The kv-transfer configs of this connector in ``vllm_config``: the config itself, or
    the MultiConnector children that name it."""
    cfg = getattr(vllm_config, "kv_transfer_config", None)
    if cfg is None:
        return []
    if getattr(cfg, "kv_connector", None) == CONNECTOR_NAME:
        return [cfg]
    if getattr(cfg, "kv_connector", None) == "MultiConnector":
        children = (cfg.kv_connector_extra_config or {}).get("connectors") or []
        return [
            c
            for c in children
            if isinstance(c, Mapping) and c.get("kv_connector") == CONNECTOR_NAME
        ]
    return []


def _is_ours(vllm_config: Any) -> bool:
    return bool(_connector_configs(vllm_config))


def tap_layers(vllm_config: Any) -> list[int]:
    """The decoder layers the tap reads: ``kv_connector_extra_config.layers``, else the
    probe layers of the model's depth."""
    found = _connector_configs(vllm_config)
    own = found[0] if found else None
    extra = (
        own.get("kv_connector_extra_config")
        if isinstance(own, Mapping)
        else getattr(own, "kv_connector_extra_config", None)
    ) or {}
    num = int(vllm_config.model_config.hf_config.num_hidden_layers)
    layers = [int(x) for x in (extra.get("layers") or probe_layers(num))]
    bad = [x for x in layers if not 0 <= x < num]
    if bad:
        raise ValueError(f"abstain_guard: layers {bad} are outside the model's {num} layers")
    return sorted(set(layers))


def engine_record(vllm_config: Any) -> dict[str, Any]:
    """What computed a response (checked by the guard against its calibration). The model's
    identity is verified from its files (:func:`~.vllm_identity.model_identity`); one that
    cannot be is refused here, at start-up."""
    import vllm

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    compilation = vllm_config.compilation_config
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    return {
        "name": "vllm",
        "vllm_version": str(vllm.__version__),
        "model": str(model_config.model),
        "model_sha256": model_identity(
            model_config.model,
            revision=model_config.revision,
            tokenizer=model_config.tokenizer,
            tokenizer_revision=model_config.tokenizer_revision,
            dummy_weights=load_format == "dummy",
            cache_dir=getattr(vllm_config.load_config, "download_dir", None),
        ),
        "quantization": model_config.quantization,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "device": str(vllm_config.device_config.device_type),
        "layers": tap_layers(vllm_config),
        "capture_path": CAPTURE_PATH,
        "enforce_eager": bool(model_config.enforce_eager),
        "compilation_mode": str(getattr(compilation.mode, "name", compilation.mode)),
        "cudagraph_mode": str(getattr(compilation.cudagraph_mode, "name", None)),
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
        "async_scheduling": bool(vllm_config.scheduler_config.async_scheduling),
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


def _ours_in(meta: Any) -> GuardWorkerMetadata | None:
    """This connector's worker metadata in a step's (alone, or a MultiConnector child)."""
    if isinstance(meta, GuardWorkerMetadata):
        return meta
    for child in getattr(meta, "metadata", None) or ():
        if isinstance(child, GuardWorkerMetadata):
            return child
    return None


def _attach(output: Any, captures: dict[str, dict[str, Any]]) -> None:
    """Put ``captures`` in the step output's connector metadata (built on the engine thread
    by :meth:`AbstainGuardConnector.build_connector_worker_meta`)."""
    if not captures:
        return
    connector_output = getattr(output, "kv_connector_output", None)
    ours = _ours_in(getattr(connector_output, "kv_connector_worker_meta", None))
    if ours is not None:
        ours.captures.update(captures)
    elif connector_output is not None and connector_output.kv_connector_worker_meta is None:
        connector_output.kv_connector_worker_meta = GuardWorkerMetadata(captures)
    else:  # the responses keep their "no capture" error: refused, never wrong
        log.error("abstain_guard: a step's output has no room for %d captures", len(captures))


# ---- the worker side: installed on the model runner -----------------------------------


def _vllm_stop(max_model_len: int) -> Any:
    from vllm.v1.core.sched.utils import check_stop

    def stop(params: Any, prompt_len: int, output: list[int]) -> bool:
        return bool(check_stop(stop_view(params, prompt_len, output), max_model_len))

    return stop


def _install(runner: Any) -> RunnerCapture | None:
    """The tap and the capture on ``runner`` after its weights loaded (None off TP rank 0)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    config = runner.vllm_config
    check_modes(config)
    model = runner.get_model()
    layers = tap_layers(config)
    # Recorded in vLLM's compile-cache key: a graph compiled without this tap (or with
    # other layers) is never loaded in its place.
    extra = dict(config.additional_config) if isinstance(config.additional_config, dict) else {}
    extra["abstain_guard_tap"] = {"layers": layers, "path": CAPTURE_PATH}
    config.additional_config = extra
    hidden = int(config.model_config.hf_config.hidden_size)
    dtype, rows = config.model_config.dtype, int(runner.max_num_tokens)
    taps = install_tap(model.model.layers, layers, rows, hidden, dtype, runner.device)
    if get_tensor_model_parallel_rank() != 0:
        return None
    max_len = int(config.model_config.max_model_len)
    host = HostCapture(layers, hidden, min(MAX_ENTROPY_TOKENS, max_len), _vllm_stop(max_len))
    capture = RunnerCapture(runner, taps, host, ring=int(config.max_concurrent_batches) + 1)
    compute_logits = model.compute_logits

    def logits_and_capture(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        logits = compute_logits(hidden_states, *args, **kwargs)
        if (runner._abstain_guard_armed or capture.profiling) and logits is not None:
            runner._abstain_guard_armed = False
            capture.on_logits(logits)
        return logits

    model.compute_logits = logits_and_capture
    return capture


_ACTIVE: RunnerCapture | None = None
#: Whether a runner of this process installed the tap (every TP rank does).
_INSTALLED = False


def _wrappers(own: Mapping[str, Any]) -> dict[str, Any]:
    """The wrapped runner methods (``own``: the class's own definitions)."""

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = own["load_model"](self, *args, **kwargs)
        if _is_ours(self.vllm_config) and not getattr(self, "_abstain_guard_installed", False):
            global _ACTIVE, _INSTALLED
            self._abstain_guard = _ACTIVE = _install(self)
            _INSTALLED = True
            self._abstain_guard_armed = False
            self._abstain_guard_installed = True
        return result

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        capture = getattr(self, "_abstain_guard", None)
        if capture is not None:
            capture.begin_step(scheduler_output)
            self._abstain_guard_armed = True
        try:
            return own["execute_model"](self, scheduler_output, *args, **kwargs)
        finally:
            if capture is not None:
                self._abstain_guard_armed = False

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = own["sample_tokens"](self, *args, **kwargs)
        capture = getattr(self, "_abstain_guard", None)
        if capture is None or out is None:
            return out
        step = capture.take_step()
        if hasattr(out, "get_output"):  # async scheduling: token ids reach the host later
            get_output = out.get_output

            def get_output_and_capture() -> Any:
                result = get_output()
                _attach(result, capture.on_output(step, result))
                return result

            out.get_output = get_output_and_capture
        else:
            _attach(out, capture.on_output(step, out))
        return out

    def _dummy_sampler_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        capture = getattr(self, "_abstain_guard", None)
        if capture is not None:
            capture.profiling = True
        try:
            return own["_dummy_sampler_run"](self, *args, **kwargs)
        finally:
            if capture is not None:
                capture.profiling = False

    return {
        "load_model": load_model,
        "execute_model": execute_model,
        "sample_tokens": sample_tokens,
        "_dummy_sampler_run": _dummy_sampler_run,
    }


def _patch_runner_class(cls: Any) -> None:
    """Wrap the runner methods ``cls`` itself defines (a subclass that inherits one keeps the
    base class's wrapper: wrapping it again would run the capture twice); a method of
    :data:`_WRAPPED` that ``cls`` neither defines nor inherits wrapped is recorded as an
    error (raised when the connector is configured)."""
    if cls.__dict__.get("_abstain_guard_patched"):
        return
    own = {name: cls.__dict__[name] for name in _WRAPPED if name in cls.__dict__}
    for name, wrapper in _wrappers(own).items():
        if name in own:
            wrapper._abstain_guard = True  # type: ignore[attr-defined]
            setattr(cls, name, functools.wraps(own[name])(wrapper))
    missing = [n for n in _WRAPPED if not getattr(getattr(cls, n, None), "_abstain_guard", False)]
    if missing:
        _PATCH_ERRORS.append(
            f"vLLM's {cls.__module__}.{cls.__name__} has no {', '.join(missing)}: the capture "
            "was written for another vLLM"
        )
    cls._abstain_guard_patched = True


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
                raise UnsupportedServing(
                    "abstain_guard: the capture runs on vLLM's V1 model runner; unset "
                    "VLLM_USE_V2_MODEL_RUNNER (or set it to 0) with the guard's connector."
                )
            return False
        return bool(choose(self))

    use_v2_model_runner._abstain_guard = True  # type: ignore[attr-defined]
    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)  # type: ignore[method-assign]


def register() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``): check vLLM's version and
    arm the runner patches. A vLLM outside :data:`~.vllm_support.SUPPORTED_VLLM` is left
    unpatched (a stock server in this environment still starts) and the connector, when a
    server names it, refuses to start naming the version and the range."""
    import vllm

    problem = version_problem(str(vllm.__version__))
    if problem is not None:
        log.warning("abstain_guard: %s; the guard's connector will refuse to start.", problem)
        return
    for name in _RUNNER_MODULES:
        if name in sys.modules:
            _patch_module(sys.modules[name])
    _prefer_v1_runner()
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _check_worker_ready() -> None:
    """The runner module imported (and so patched) here, every wrapped method found."""
    import vllm

    check_version(str(vllm.__version__))
    register()
    importlib.import_module(_RUNNER_MODULES[0])
    if _PATCH_ERRORS:
        raise UnsupportedServing(f"abstain_guard: {'; '.join(_PATCH_ERRORS)}.")


# ---- the connector ----------------------------------------------------------------------


class AbstainGuardConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that moves no KV: it carries each requested capture from the worker
    to the request's ``kv_transfer_params`` (see the module docstring).

    Of the KV-connector roles it asks for ``kv_producer`` and says it hands off nothing
    (:attr:`requires_kv_delivery` False), so the scheduler neither defers block frees (a
    consumer's cost under async scheduling) nor drops a preempted request's in-flight token
    (a producer's default); it supports the hybrid KV-cache manager (:class:`SupportsHMA`), so
    vLLM keeps it on for sliding-window and hybrid models.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        check_modes(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            import vllm

            check_version(str(vllm.__version__))
            key = payload_key()
            self._token = request_token(key)
            self._mailbox = CaptureMailbox(
                engine_record(vllm_config), sign=functools.partial(sign_payload, key=key)
            )
            self._lora: dict[str, str | None] = {}
        else:
            _check_worker_ready()

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # worker side: nothing moves through the KV cache
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if not _INSTALLED:
            raise UnsupportedServing(
                "abstain_guard: the capture is not installed on this model runner (vLLM's "
                "V1 GPU or CPU runner is needed; "
                + ("; ".join(_PATCH_ERRORS) or "the runner's load_model was not wrapped")
                + ")."
            )

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
            _ACTIVE.host.want(connector_metadata.wanted)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return GuardWorkerMetadata() if _ACTIVE is not None else None

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def on_new_request(self, request: Any) -> None:
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, Mapping) or PAYLOAD_KEY not in params:
            return
        asked = params[PAYLOAD_KEY]
        token = asked.get("token") if isinstance(asked, Mapping) else None
        if isinstance(token, str) and hmac.compare_digest(token.encode(), self._token.encode()):
            self._mailbox.want(request.request_id)
        else:
            self._mailbox.deny(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return GuardConnectorMetadata(wanted=self._mailbox.take_new())

    def update_connector_output(self, connector_output: Any) -> None:
        meta = _ours_in(getattr(connector_output, "kv_connector_worker_meta", None))
        if meta is not None:
            self._mailbox.arrive(meta.captures)

    def _adapter(self, request: Any) -> dict[str, Any] | None:
        lora = getattr(request, "lora_request", None)
        path = str(getattr(lora, "lora_path", "") or "")
        if lora is not None and path and path not in self._lora:
            try:
                self._lora[path] = model_identity(path)
            except IdentityUnverifiable:  # recorded as None: the client refuses the response
                self._lora[path] = None
        return lora_record(lora, self._lora)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # filled in place when the step's worker output arrives (:mod:`.vllm_mailbox`)
        extra = {"lora": self._adapter(request)}
        payload = self._mailbox.finished(request.request_id, extra)
        return False, None if payload is None else {PAYLOAD_KEY: payload}

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])
