"""The vLLM backend's pure parts, without an engine: what each backend serves, the config's
``backend: vllm``, preflight, the engine's read-out of a capture, the deployment check of a
response's engine record, the probes' backend and the chat model's payload and identity."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage

from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.backends import (
    VLLM_CHAT_MODEL,
    backend_of_model,
    check_backend_serves,
    scorer_needs,
)
from abstain_guard.backends.vllm_chat import VLLMChatModel
from abstain_guard.backends.vllm_engine import VLLM_PYTHON_ENV, engine_python
from abstain_guard.backends.vllm_payload import payload_key, request_token
from abstain_guard.calibration.building.preflight import check_api_model
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.contract.chat_model_specs import ChatModelSpec, chat_model_identity
from abstain_guard.contract.deployment import (
    DeploymentRecord,
    api_response_mismatches,
    backend_mismatches,
)
from abstain_guard.contract.metadata import ResponseMetadata
from abstain_guard.errors import (
    BackendCapabilityError,
    BackendError,
    ConfigError,
    InvalidInputError,
    ScoringError,
)
from abstain_guard.scorers import ScorerState, build_scorer
from abstain_guard.scorers._registry import scorer_from_state

API_SPEC = {"class_path": "langchain_openai:ChatOpenAI", "kwargs": {"model": "gpt-4o-mini"}}
ENGINE = {
    "name": "vllm",
    "vllm_version": "0.32.0",
    "model_sha256": "a" * 64,
    "dtype": "float32",
    "layers": [15, 24],
}

# ---- what each backend serves --------------------------------------------------------


def test_scorer_needs_per_family_and_kind() -> None:
    assert scorer_needs("probe_mid") == {"hidden"}
    assert scorer_needs("perplexity") == {"logprobs"}
    assert scorer_needs("mean_token_entropy") == {"entropy"}
    assert scorer_needs("likelihood_probe") == {"hidden", "logprobs", "entropy"}
    assert scorer_needs("geometry") == {"geometry"}


@pytest.mark.parametrize(
    "kind", ["probe_mid", "likelihood_probe", "perplexity", "mean_token_entropy"]
)
def test_vllm_serves_probe_and_likelihood_scorers(kind: str) -> None:
    check_backend_serves(kind, "vllm")
    check_backend_serves(kind, "exact")


def test_geometry_on_vllm_names_the_exact_backend() -> None:
    with pytest.raises(ConfigError) as info:
        check_backend_serves("geometry", "vllm", "my-model")
    message = str(info.value)
    assert "reads geometry" in message and "the vllm backend (my-model)" in message
    assert "runs on the exact backend" in message and "backend: exact" in message


def test_the_api_backend_serves_likelihoods_only() -> None:
    check_backend_serves("perplexity", "api")
    with pytest.raises(ConfigError, match="runs on the exact or vllm backend"):
        check_backend_serves("probe_mid", "api")


def test_backend_of_model() -> None:
    assert backend_of_model(VLLMChatModel) == "vllm"
    assert backend_of_model(ChatModelSpec(**API_SPEC).resolve_class()) == "api"
    assert backend_of_model(None) == "api"


# ---- the calibration config and preflight --------------------------------------------


def test_backend_vllm_serves_the_model_through_vllm_chat_model() -> None:
    config = CalibrationConfig(backend="vllm", scorer="probe_mid")
    assert isinstance(config.model, ChatModelSpec)
    assert (
        config.model.class_path
        == VLLM_CHAT_MODEL
        == "abstain_guard.backends.vllm_chat:VLLMChatModel"
    )
    assert config.model.kwargs == {"model": "default"}
    gguf = CalibrationConfig(backend="vllm", scorer="probe_mid", model="/m", gguf_file="q.gguf")
    assert isinstance(gguf.model, ChatModelSpec)
    assert gguf.model.kwargs == {"model": "/m", "gguf_file": "q.gguf"}
    assert gguf.gguf_file is None
    check_api_model(gguf, build=False)  # the GGUF file moved into the chat model's kwargs


def test_backend_vllm_with_an_api_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="backend: vllm takes model as 'default'"):
        CalibrationConfig(backend="vllm", scorer="probe_mid", model=API_SPEC)


def test_a_spec_naming_vllm_chat_model_is_the_vllm_backend() -> None:
    spec = {"class_path": VLLM_CHAT_MODEL, "kwargs": {"model": "default", "dtype": "bfloat16"}}
    config = CalibrationConfig(scorer="probe_mid", model=spec)
    assert config.backend == "vllm"
    again = CalibrationConfig(backend="vllm", scorer="probe_mid", model=spec)
    assert isinstance(again.model, ChatModelSpec) and again.model.kwargs["dtype"] == "bfloat16"
    default = CalibrationConfig()
    assert (default.backend, default.model) == ("exact", "default")


def test_preflight_checks_the_scorer_against_the_backend() -> None:
    with pytest.raises(ConfigError, match="runs on the exact backend"):
        check_api_model(CalibrationConfig(backend="vllm", scorer="geometry"), build=False)
    check_api_model(CalibrationConfig(backend="vllm", scorer="probe_mid"), build=False)
    with pytest.raises(ConfigError, match="api backend"):
        check_api_model(CalibrationConfig(model=API_SPEC, scorer="probe_mid"), build=False)
    check_api_model(CalibrationConfig(model=API_SPEC, scorer="perplexity"), build=False)


# ---- the client side imports neither vLLM nor torch -----------------------------------


def test_the_client_and_launcher_modules_import_without_vllm() -> None:
    code = (
        "import sys\n"
        "for name in ('vllm', 'fastapi', 'uvicorn'):\n"
        "    sys.modules[name] = None\n"
        "import abstain_guard.backends.vllm_engine as m\n"
        "import abstain_guard.backends.vllm_chat\n"
        "import abstain_guard.backends.vllm_payload\n"
        "cmd = m.serve_command('py', 'M', 8000, vllm_args=['--tensor-parallel-size', '2'])\n"
        "assert '--kv-transfer-config' in cmd and cmd[-2:] == ['--tensor-parallel-size', '2']\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("args", "ranks"),
    [([], 1), (["--tensor-parallel-size", "4"], 4), (["-tp", "2"], 2), (["-tp=8"], 8)],
)
def test_the_launcher_keeps_stock_vllms_core_reservation_per_rank(args: list, ranks: int) -> None:
    # vLLM's CPU backend reserves one more core per rank when a KV connector is configured;
    # the guard's moves no KV, so its server keeps stock vLLM's one core per rank
    from abstain_guard.backends.vllm_engine import _ranks

    assert _ranks(["--model", "M", *args]) == ranks


def test_a_command_with_its_own_connector_flag_keeps_it() -> None:
    from abstain_guard.backends.vllm_engine import serve_command

    own = ["--kv-transfer-config", '{"kv_connector": "MultiConnector"}']
    cmd = serve_command("py", "M", 8000, vllm_args=own)
    assert cmd.count("--kv-transfer-config") == 1 and cmd[-2:] == own


# ---- the deployment check ------------------------------------------------------------


def _record(backend: str | None = "vllm") -> DeploymentRecord:
    decoding: dict[str, Any] = {"temperature": 0.0, "decode_path": dict(ENGINE)}
    if backend is not None:
        decoding["backend"] = backend
    return DeploymentRecord(decoding=decoding)


def test_a_response_from_the_calibrated_engine_matches() -> None:
    meta = {"backend": {**ENGINE, "pid": 123}}
    assert backend_mismatches(_record(), meta) == []
    assert api_response_mismatches(_record(), meta) == []


@pytest.mark.parametrize(("key", "value"), [("vllm_version", "0.33.0"), ("layers", [14, 24])])
def test_another_engine_is_one_problem_naming_the_key(key: str, value: Any) -> None:
    meta = {"backend": {**ENGINE, key: value}}
    for check in (backend_mismatches, api_response_mismatches):
        (problem,) = check(_record(), meta)
        assert f"{key} {value!r}" in problem and repr(ENGINE[key]) in problem


def test_an_artifact_without_a_verified_model_identity_is_refused() -> None:
    """Calibrated where the served model's identity was unknown (None, or not recorded):
    every response is refused, even one whose record says None too."""
    unrecorded = {k: v for k, v in ENGINE.items() if k != "model_sha256"}
    for calibrated in ({**ENGINE, "model_sha256": None}, unrecorded):
        record = DeploymentRecord(decoding={"backend": "vllm", "decode_path": calibrated})
        for got in (ENGINE, {**ENGINE, "model_sha256": None}):
            (problem,) = backend_mismatches(record, {"backend": got})
            assert "no verified identity of the served model" in problem


def test_a_response_without_an_engine_record_is_refused() -> None:
    (problem,) = backend_mismatches(_record(), {"logprobs": {"content": []}})
    assert "not generated on the vLLM backend" in problem
    assert backend_mismatches(_record(None), {}) == []
    assert backend_mismatches(_record(None), {"backend": {"name": "other"}}) == []


# ---- metadata and probes -------------------------------------------------------------


def test_a_vllm_response_has_no_geometry() -> None:
    hidden = {"layers": [1, 2], "mean": [[0.0]] * 2, "last": [[0.0]] * 2}
    meta = ResponseMetadata.of({"backend": {"name": "vllm"}, "geometry": {"hidden": hidden}})
    assert meta.backend_name() == "vllm"
    with pytest.raises(BackendCapabilityError, match="vllm backend") as info:
        meta.geometry()
    assert isinstance(info.value, ScoringError)
    assert ResponseMetadata.of({"geometry": {"hidden": hidden}}).backend_name() == "exact"


def _split(seed: int, n: int, backend: str | None) -> list[tuple[dict[str, Any], bool]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        correct = bool(rng.random() < 0.5)
        mean = rng.normal(size=(2, 6))
        mean[0, 0] += 1.5 if correct else -1.5
        meta: dict[str, Any] = {
            "geometry": {"hidden": {"layers": [1, 2], "mean": mean.tolist(), "last": mean.tolist()}}
        }
        if backend is not None:
            meta["backend"] = {"name": backend}
        out.append((meta, correct))
    return out


def test_a_probe_fitted_on_vllm_keeps_and_checks_its_backend() -> None:
    probe: Any = build_scorer("probe_mid").fit(_split(1, 40, "vllm"), _split(2, 40, "vllm"))
    assert probe.backend_ == "vllm"
    test = [r for r, _ in _split(3, 10, "vllm")]
    scores = probe.score_many(test)
    state = probe.get_state()
    assert state.params["backend"] == "vllm"
    params = json.loads(json.dumps(state.params))
    loaded: Any = scorer_from_state(ScorerState(state.kind, params, dict(state.arrays)))
    assert loaded.backend_ == "vllm"
    assert np.array_equal(loaded.score_many(test), scores)
    exact = [r for r, _ in _split(3, 2, None)]
    with pytest.raises(ScoringError, match="exact backend but probe_mid was fitted"):
        probe.score(exact[0])
    params.pop("backend")
    older: Any = scorer_from_state(ScorerState(state.kind, params, dict(state.arrays)))
    assert older.backend_ == "exact"
    assert np.isfinite(older.score_many(exact)).all()
    with pytest.raises(ScoringError, match="vllm backend"):
        older.score(test[0])


def test_a_probe_is_not_fitted_on_mixed_backends() -> None:
    with pytest.raises(ScoringError, match=r"several backends \(\['exact', 'vllm'\]\)"):
        build_scorer("probe_mid").fit(_split(1, 40, "vllm"), _split(2, 40, None))  # type: ignore[attr-defined]


# ---- the chat model ------------------------------------------------------------------


def test_engine_python_needs_an_existing_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BackendError, match="/nonexistent/python"):
        engine_python("/nonexistent/python")
    assert engine_python(sys.executable) == sys.executable
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/nonexistent/env-python")
    with pytest.raises(BackendError, match="env-python"):
        engine_python()
    monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)
    assert engine_python() == sys.executable


def test_engine_python_without_vllm_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert importlib.util.find_spec("vllm") is None  # this venv has no vLLM
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    with pytest.raises(BackendError, match=VLLM_PYTHON_ENV):
        engine_python()


def test_payload_maps_roles_and_budget() -> None:
    model = VLLMChatModel()
    messages = [SystemMessage("s"), HumanMessage("q"), AIMessage("a"), HumanMessage("q2")]
    payload, setup = model._payload(messages, {})
    assert setup is None and "prompt" not in payload  # no tools: vLLM renders the chat
    # the capture is asked for with the token of the payload key (never the key itself)
    token = request_token(payload_key(generate=True))
    assert payload["kv_transfer_params"] == {"abstain_guard": {"token": token}}
    assert payload["return_token_ids"] and payload["temperature"] == 0.0
    assert payload["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"},
    ]
    assert (payload["max_tokens"], payload["top_logprobs"]) == (24, 5)
    assert model._payload(messages, {"max_tokens": 7})[0]["max_tokens"] == 7
    assert VLLMChatModel(max_tokens=9)._payload(messages, {})[0]["max_tokens"] == 9
    with pytest.raises(InvalidInputError, match="text messages only"):
        model._payload([HumanMessage(content=[{"type": "text", "text": "q"}])], {})
    with pytest.raises(InvalidInputError, match="'chat' message"):
        model._payload([ChatMessage(role="x", content="q")], {})


def test_a_model_reading_only_the_hidden_rows_asks_for_no_logprobs_and_no_entropy() -> None:
    """A probe's guard asks the server for its hidden rows only: no ``logprobs`` (the
    sampler's log-softmax, top-k and rank on every step) and ``entropy: false`` (the
    connector's full-vocabulary entropy); one reading entropy asks for it alone."""
    token = request_token(payload_key(generate=True))
    messages = [HumanMessage("q")]
    probe = VLLMChatModel(reads=frozenset({"hidden"}))._payload(messages, {})[0]
    assert probe["kv_transfer_params"] == {"abstain_guard": {"token": token, "entropy": False}}
    assert "logprobs" not in probe and "top_logprobs" not in probe
    entropy = VLLMChatModel(reads=frozenset({"entropy"}))._payload(messages, {})[0]
    assert entropy["kv_transfer_params"] == {"abstain_guard": {"token": token}}
    assert "logprobs" not in entropy
    both = VLLMChatModel(reads=frozenset({"hidden", "logprobs", "entropy"}))
    assert both._payload(messages, {})[0]["top_logprobs"] == 5


def test_the_guard_chain_asks_the_server_for_what_its_scorer_reads() -> None:
    """``load_guard_chain`` builds the calibrated vLLM model asking for its scorer's reads
    (a probe: hidden rows only); a model already limited, a scorer declaring nothing
    (``reads`` None) and a chat model without the option are left as they are."""
    from abstain_guard.guard.chains import asking_for
    from abstain_guard.scorers import HiddenStateProbe

    probe = asking_for(VLLMChatModel(max_tokens=7), HiddenStateProbe.reads)
    assert probe.reads == frozenset({"hidden"}) and probe.max_tokens == 7
    limited = VLLMChatModel(reads=frozenset({"entropy"}))
    assert asking_for(limited, frozenset({"hidden"})) is limited
    every = VLLMChatModel()
    assert asking_for(every, None) is every
    other = SimpleNamespace(reads=None)
    assert asking_for(other, frozenset({"hidden"})) is other


def test_identity_leaves_out_transport_options() -> None:
    model = VLLMChatModel(
        engine_url="http://x",
        python="/p",
        memory_fraction=0.3,
        api_key="k",
        vllm_args=["-x"],
        reads=frozenset({"hidden"}),
    )
    identity = chat_model_identity(model)
    assert identity["class"] == VLLM_CHAT_MODEL
    transport = {"engine_url", "python", "memory_fraction", "api_key", "vllm_args", "reads"}
    assert not transport & set(identity["settings"])
    assert chat_model_identity(VLLMChatModel(dtype="bfloat16"))["settings"] == {"dtype": "bfloat16"}


def test_a_decision_on_a_batch_variant_engine_states_the_bound() -> None:
    """Every decision of a guard calibrated on vLLM (CPU: not batch-invariant) says by how
    much a live score may differ from calibration's (the recorded ``live_bound``)."""
    import numpy as np
    from langchain_core.messages import AIMessage

    from abstain_guard import GuardArtifact, GuardConfig
    from abstain_guard.contract.deployment import DeploymentRecord
    from abstain_guard.guard.policy import AbstentionPolicy
    from abstain_guard.scorers import PerplexityScorer

    record = DeploymentRecord(decoding={"temperature": 0.0, "live_bound": 1e-4})
    art = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(np.linspace(1.0, 3.0, 50), np.arange(50) % 3 != 0),
        metadata={"deployment": record.to_json()},
    )
    policy = AbstentionPolicy(art, GuardConfig(participation=0.8, on_mismatch="warn"))
    message = AIMessage(
        content="Paris",
        response_metadata={"logprobs": {"content": [{"token": "Paris", "logprob": -0.1}]}},
    )
    _, decision = policy.decide(message)
    assert decision.guarantee.batch_variance["bound"] == 1e-4
    plain = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(art.scores, art.correct)
    )
    _, decision = AbstentionPolicy(plain, GuardConfig(participation=0.8)).decide(message)
    assert decision.guarantee.batch_variance is None


def test_requests_to_a_server_share_one_connection_and_tls_context() -> None:
    # httpx.post per request built a new client, TLS context and TCP connection each time:
    # half of the guard client's CPU at 8 in flight (docs/vllm.md); now one pool per process
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    peers: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def do_GET(self) -> None:  # /v1/models: the served name
            self._reply(b'{"data": [{"id": "m"}]}')

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self._reply(b'{"ok": true}')

        def _reply(self, body: bytes) -> None:
            peers.append(self.client_address[1])
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        model = VLLMChatModel(engine_url=url)
        for _ in range(3):
            reply = model._post(url + "/v1/chat/completions", {"model": "m", "messages": []})
            assert reply == {"ok": True}
    finally:
        server.shutdown()
    assert len(peers) >= 3 and len(set(peers)) == 1, peers  # one connection, kept alive
