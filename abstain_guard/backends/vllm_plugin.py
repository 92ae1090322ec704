"""The guard's vLLM plugin: what runs inside vLLM's model runner for the connector of
:mod:`.vllm_connector`.

vLLM loads :func:`register` in every process (entry point ``vllm.general_plugins``): it
checks vLLM's version against :data:`~.vllm_support.SUPPORTED_VLLM` and arms a post-import
hook that wraps the V1 model runner's ``load_model``, ``execute_model``, ``sample_tokens`` and
``_dummy_sampler_run`` (a method missing from vLLM is an error when the connector is
configured, not a silent skip). The wrappers do nothing unless the engine's
``kv_transfer_config`` names the connector (alone, or as a MultiConnector child).

After the weights load and *before* vLLM compiles the model, :func:`~.vllm_capture.install_tap`
hooks the probe layers; per step :class:`~.vllm_capture.RunnerCapture` copies the rows of the
requests that asked to pinned host memory and sums them where vLLM reads the step's output;
vLLM's own stop rule (``check_stop``) says which requests finished, and their payloads go to
the scheduler in the step's :class:`GuardWorkerMetadata`. Tensor parallelism: the residual
stream is the same on every rank after the all-reduce; TP rank 0 captures it.
"""

from __future__ import annotations

import functools
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
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from abstain_guard.contract.metadata import probe_layers

from .vllm_capture import HostCapture, RunnerCapture, install_tap
from .vllm_payload import CONNECTOR_NAME
from .vllm_support import (
    UnsupportedServing,
    check_modes,
    check_version,
    stop_view,
    version_problem,
)

log = logging.getLogger(__name__)

#: How the residual stream is read (recorded in the engine record and the artifact).
CAPTURE_PATH = "compiled_tap_kv_connector"
#: Longest answer whose token entropies are kept (longer: entropy None, hidden still exact).
MAX_ENTROPY_TOKENS = 8192
_RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner")
#: The V1 runner's methods the capture wraps (each must exist in the vLLM served).
_WRAPPED = ("load_model", "execute_model", "sample_tokens", "_dummy_sampler_run")


@dataclass
class RunnerState:
    """What this process's plugin did: the capture of its TP-rank-0 runner, whether a runner
    installed the tap (every rank does), and why a runner class could not be patched (raised
    when the connector is configured)."""

    capture: RunnerCapture | None = None
    installed: bool = False
    patch_errors: list[str] = field(default_factory=list)


RUNNER = RunnerState()


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


# ---- scheduler <-> worker messages ----------------------------------------------------


@dataclass
class GuardConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step: the requests that asked for a capture, each with
    whether it asked for its entropies."""

    wanted: dict[str, bool] = field(default_factory=dict)


@dataclass
class GuardWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: the captures of requests finished in the step."""

    captures: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, GuardWorkerMetadata):
            self.captures.update(other.captures)
        return self


def worker_meta_in(meta: Any) -> GuardWorkerMetadata | None:
    """This connector's worker metadata in a step's (alone, or a MultiConnector child)."""
    if isinstance(meta, GuardWorkerMetadata):
        return meta
    for child in getattr(meta, "metadata", None) or ():
        if isinstance(child, GuardWorkerMetadata):
            return child
    return None


def _attach(output: Any, captures: dict[str, dict[str, Any]]) -> None:
    """Put ``captures`` in the step output's connector metadata (built on the engine thread
    by the connector's ``build_connector_worker_meta``)."""
    if not captures:
        return
    connector_output = getattr(output, "kv_connector_output", None)
    ours = worker_meta_in(getattr(connector_output, "kv_connector_worker_meta", None))
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


def _wrappers(own: Mapping[str, Any]) -> dict[str, Any]:
    """The wrapped runner methods (``own``: the class's own definitions)."""

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = own["load_model"](self, *args, **kwargs)
        if _is_ours(self.vllm_config) and not getattr(self, "_abstain_guard_installed", False):
            self._abstain_guard = RUNNER.capture = _install(self)
            RUNNER.installed = True
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
        RUNNER.patch_errors.append(
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


def check_worker_ready() -> None:
    """The runner module imported (and so patched) here, every wrapped method found."""
    import vllm

    check_version(str(vllm.__version__))
    register()
    importlib.import_module(_RUNNER_MODULES[0])
    if RUNNER.patch_errors:
        raise UnsupportedServing(f"abstain_guard: {'; '.join(RUNNER.patch_errors)}.")
