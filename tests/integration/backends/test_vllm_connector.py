"""The vLLM connector against vLLM's own code, in vLLM's environment and without a server
(one interpreter, ~20 s): every runner method the capture wraps is found and wrapped in the
installed vLLM, a missing one is an error, a version outside the range is refused by name,
the worker's stop rule is vLLM's ``check_stop`` on every stop condition, the connector's role
leaves preemption and the hybrid KV-cache manager alone, its metadata composes inside vLLM's
MultiConnector, and a hub model whose identity cannot be verified is refused."""

from __future__ import annotations

import os
import subprocess

import pytest

from abstain_guard.backends.vllm_engine import VLLM_PYTHON_ENV

pytestmark = [pytest.mark.vllm]

SCRIPT = r"""
import itertools, sys
import vllm
from vllm.sampling_params import RepetitionDetectionParams, SamplingParams
from vllm.v1.core.sched.utils import check_stop
from vllm.v1.request import Request
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorWorkerMetadata,
)
from vllm.v1.outputs import KVConnectorOutput
from types import SimpleNamespace

import abstain_guard.backends.vllm_connector as c
import abstain_guard.backends.vllm_plugin as p
from abstain_guard.backends.vllm_payload import CONNECTOR_NAME
from abstain_guard.backends.vllm_support import UnsupportedServing

# every wrapped method of the installed vLLM's V1 runners is found and wrapped
p.register()
import vllm.v1.worker.gpu_model_runner as g
import vllm.v1.worker.cpu_model_runner as cpu
for cls in (g.GPUModelRunner, cpu.CPUModelRunner):
    for name in p._WRAPPED:
        assert getattr(getattr(cls, name), "_abstain_guard", False), (cls, name)
assert p.RUNNER.patch_errors == [], p.RUNNER.patch_errors
p.check_worker_ready()

# a runner without one of them is an error, not a silent skip
class Runner:
    def load_model(self):
        pass
p._patch_runner_class(Runner)
assert "has no execute_model, sample_tokens, _dummy_sampler_run" in p.RUNNER.patch_errors[-1]
try:
    p.check_worker_ready()
    raise SystemExit("a runner without the wrapped methods was accepted")
except UnsupportedServing as exc:
    assert "Runner has no execute_model" in str(exc)
p.RUNNER.patch_errors.clear()

# a vLLM outside the range: register() leaves it unpatched, the connector refuses by name
real = vllm.__version__
vllm.__version__ = "0.31.9"
try:
    p.register()
    p.check_worker_ready()
    raise SystemExit("vLLM 0.31.9 was accepted")
except UnsupportedServing as exc:
    assert "vLLM 0.31.9" in str(exc) and ">= 0.32.0, < 0.33" in str(exc), exc
vllm.__version__ = real

# the worker's stop rule is vLLM's on every stop condition (each prefix of each answer)
cases = {
    "eos": SamplingParams(max_tokens=9),
    "stop_token_ids": SamplingParams(max_tokens=9, stop_token_ids=[7]),
    "max_tokens": SamplingParams(max_tokens=3),
    "min_tokens": SamplingParams(max_tokens=9, min_tokens=4, stop_token_ids=[7]),
    "ignore_eos": SamplingParams(max_tokens=6, ignore_eos=True),
    "repetition": SamplingParams(
        max_tokens=12,
        repetition_detection=RepetitionDetectionParams(max_pattern_size=2, min_count=3),
    ),
}
answers = [[5, 6, 7, 8, 2, 9], [4, 2, 4, 2, 4, 2, 9, 9], [5, 5, 5, 5], [1, 3, 7, 7, 2]]
max_len = 10
checked = 0
for (name, params), answer in itertools.product(cases.items(), answers):
    params.update_from_generation_config({}, eos_token_id=2)
    stop = p._vllm_stop(max_len)
    for prompt_len in (2, 5):
        req = Request("r", list(range(prompt_len)), params, None)
        for k, token in enumerate(answer):
            req.append_output_token_ids(token)
            want = check_stop(req, max_len)
            got = stop(params, prompt_len, answer[: k + 1])
            assert got == want, (name, answer[: k + 1], prompt_len, got, want)
            checked += 1
            if want:
                break
assert checked > 100

# the role: no KV is handed off, so a preempted request's in-flight token is kept; HMA stays on
assert c.AbstainGuardConnector.requires_kv_delivery.fget(None) is False
assert supports_hma(c.AbstainGuardConnector)

# inside a MultiConnector the worker's captures land in this connector's child metadata
ours = p.GuardWorkerMetadata()
output = SimpleNamespace(kv_connector_output=KVConnectorOutput(
    kv_connector_worker_meta=MultiKVConnectorWorkerMetadata(metadata=(None, ours))))
p._attach(output, {"r": {"num_tokens": 1}})
assert ours.captures == {"r": {"num_tokens": 1}}
alone = SimpleNamespace(kv_connector_output=KVConnectorOutput())
p._attach(alone, {"s": {}})
assert alone.kv_connector_output.kv_connector_worker_meta.captures == {"s": {}}
multi = SimpleNamespace(kv_transfer_config=SimpleNamespace(
    kv_connector="MultiConnector",
    kv_connector_extra_config={"connectors": [
        {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
        {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_producer",
         "kv_connector_extra_config": {"layers": [1]}},
    ]}),
    model_config=SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=4)))
assert p._is_ours(multi) and p.tap_layers(multi) == [1]

# a served model whose identity cannot be verified (a hub id not in the cache) stops the
# server: the scheduler's connector builds its engine record at start-up
import tempfile
from abstain_guard.backends.vllm_identity import IdentityUnverifiable
hub = SimpleNamespace(
    model_config=SimpleNamespace(
        model="org/not-downloaded", revision=None, tokenizer="org/not-downloaded",
        tokenizer_revision=None),
    parallel_config=None, compilation_config=None,
    load_config=SimpleNamespace(load_format="auto", download_dir=tempfile.mkdtemp()))
try:
    c.engine_record(hub)
    raise SystemExit("an unverifiable identity was recorded")
except IdentityUnverifiable as exc:
    assert "'org/not-downloaded'" in str(exc) and "cannot be verified" in str(exc), exc
print("ok", checked)
"""


def test_the_connector_against_the_installed_vllm() -> None:
    python = os.environ.get(VLLM_PYTHON_ENV)
    if not python:
        pytest.skip(f"{VLLM_PYTHON_ENV} is not set (make test sets it to .venv-vllm)")
    done = subprocess.run(
        [python, "-c", SCRIPT], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip().startswith("ok")
