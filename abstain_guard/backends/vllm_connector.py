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
probe layers' last row and mean over the answer, the answer's token entropies (unless it
asked ``"entropy": false``: a scorer that reads none spares the server their cost), the LoRA
adapter and the server's engine record (vLLM version, dtype, device, parallelism, compile and
CUDA-graph modes, the served model's verified identity). Other requests are served as before.

How (docs/vllm.md, "How the hidden states come out"): the plugin of :mod:`.vllm_plugin`
captures inside vLLM's model runner; this connector carries the requests that asked (their
token checked) to the workers in the step's connector metadata, and each finished request's
capture back into its ``kv_transfer_params``, signed (:mod:`.vllm_mailbox`). Refused at
start-up by name: a vLLM outside the supported range, the modes of
:func:`~.vllm_support.check_modes`, an identity that cannot be verified.
"""

from __future__ import annotations

import functools
import hmac
import os
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from .vllm_identity import IdentityUnverifiable, model_identity
from .vllm_mailbox import CaptureMailbox
from .vllm_payload import PAYLOAD_KEY, payload_key, request_token, sign_payload
from .vllm_plugin import (
    CAPTURE_PATH,
    RUNNER,
    GuardConnectorMetadata,
    GuardWorkerMetadata,
    check_worker_ready,
    tap_layers,
    worker_meta_in,
)
from .vllm_support import UnsupportedServing, check_modes, check_version, lora_record


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
            check_worker_ready()

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # worker side: nothing moves through the KV cache
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if not RUNNER.installed:
            raise UnsupportedServing(
                "abstain_guard: the capture is not installed on this model runner (vLLM's "
                "V1 GPU or CPU runner is needed; "
                + ("; ".join(RUNNER.patch_errors) or "the runner's load_model was not wrapped")
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
        capture = RUNNER.capture
        if capture is not None and isinstance(connector_metadata, GuardConnectorMetadata):
            capture.host.want(connector_metadata.wanted)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return GuardWorkerMetadata() if RUNNER.capture is not None else None

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
            self._mailbox.want(request.request_id, entropy=asked.get("entropy", True) is not False)
        else:
            self._mailbox.deny(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return GuardConnectorMetadata(wanted=self._mailbox.take_new())

    def update_connector_output(self, connector_output: Any) -> None:
        meta = worker_meta_in(getattr(connector_output, "kv_connector_worker_meta", None))
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
