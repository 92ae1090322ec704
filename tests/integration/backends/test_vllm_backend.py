"""The vLLM backend on stock vLLM (vLLM's CPU build, its OpenAI server with default
settings — compiled graphs — plus the guard's connector flag and ``--tensor-parallel-size
1``, the embedded model): a probe guard calibrated on vLLM, its decode path and scorer
recorded, live = stored under 8 concurrent callers, a server with other weights refused, the
served model's identity the digest of its files and an artifact without one refused, a
response from the project's engine refused; a request without the payload key's token gets
no activations, a forged, altered or moved payload is refused; (an eager server of its own,
with a KV cache too small for its batch) guarded requests preempted and recomputed are
answered with their captures; a server asked for speculative decoding stops, naming the
flag; and a hub model whose files are not on disk stops the server (offline, empty cache)
before it serves.

The server runs in vLLM's own environment (``make install`` builds ``.venv-vllm``;
``make test`` sets ``ABSTAIN_GUARD_VLLM_PYTHON``); one compiled server for the module, 56
questions calibrated on it, 8 asked again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from abstain_guard import AbstentionGuard
from abstain_guard.backends.vllm_chat import LIVE_BOUND, VLLMChatModel, stop_engines
from abstain_guard.backends.vllm_engine import (
    VLLM_PYTHON_ENV,
    ServerProcess,
    engine_python,
    free_port,
    guarded_env,
    serve_command,
)
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.measure.deployment_check import live_check
from abstain_guard.config import GuardConfig
from abstain_guard.errors import ArtifactMismatchError, BackendError, ConfigError
from abstain_guard.guard.chains import load_guard_chain

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: The server's engine flags, parsed by vLLM: tensor parallelism accepted (one rank here).
TP = {"vllm_args": ["--tensor-parallel-size", "1"]}

# LIVE_BOUND: the largest live-vs-stored score move accepted under concurrency. vLLM's CPU
# backend is not batch-invariant: a response batched with others gets other last bits in its
# residual stream than it got at calibration (measured here: 1.4e-6 at most, 40 questions, 8
# at once; tokens identical). The bound is two orders above that; the artifact records it.


# ---- servers of their own, each stopped when its test ends (before the module's starts) --


@contextlib.contextmanager
def _own_server(
    model: str | Path, flags: list[str], env: dict[str, str] | None = None, max_len: int = 512
) -> Iterator[ServerProcess]:
    """Stock ``vllm serve`` on ``model`` with the guard's connector, a ``max_len`` context
    and ``flags``, started outside this process's shared servers and stopped on leaving."""
    if not os.environ.get(VLLM_PYTHON_ENV):
        pytest.skip(f"{VLLM_PYTHON_ENV} is not set (make test sets it to .venv-vllm)")
    port = free_port()
    cmd = serve_command(engine_python(), model, port, max_model_len=max_len, vllm_args=flags)
    server = ServerProcess(cmd, port, env if env is not None else guarded_env())
    try:
        yield server
    finally:
        server.close()


def test_guarded_requests_preempted_under_memory_pressure_keep_their_captures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KV cache of 12 blocks of 32 tokens for 8 requests of 70 tokens each (a 38-token
    prompt fills two blocks, the 27th answer token needs a third): vLLM preempts running
    requests and recomputes them; every answer still carries its capture, equal to
    the same question's capture asked alone (tokens identical, hidden states within the
    CPU backend's batch variance). The server runs eager: preemption is the scheduler's and
    the capture's per-step bookkeeping, the same compiled or not (the module's server runs
    the compiled tap), and an eager server starts without compiling the model. The guard
    attaches to it by URL, the server's secret set in both environments."""
    import httpx

    from abstain_guard.adapters.model.vllm_folder import vllm_model_folder
    from abstain_guard.backends.vllm_payload import PAYLOAD_KEY_ENV, payload_key

    monkeypatch.setenv(PAYLOAD_KEY_ENV, payload_key(generate=True).decode("utf-8"))

    flags = ["--block-size", "32", "--num-gpu-blocks-override", "12", "--enforce-eager"]
    with _own_server(vllm_model_folder("default"), [*TP["vllm_args"], *flags], max_len=256) as s:
        s.wait(600)
        model = VLLMChatModel(engine_url=s.url, max_tokens=32)
        countries = ("France", "Peru", "Chile", "Kenya", "Japan", "Spain", "Italy", "Egypt")
        questions = [[("human", f"Tell me about the capital of {c}.")] for c in countries]
        together = model.batch(questions, config={"max_concurrency": 8})
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
        alone = [model.invoke(question) for question in questions]
    preempted = sum(  # the counter (its "_created" gauge beside it is a timestamp)
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("vllm:num_preemptions_total{")
    )
    assert preempted > 0, "the server preempted nothing: the test needs a smaller KV cache"
    for message, single in zip(together, alone, strict=True):
        meta, solo = message.response_metadata, single.response_metadata
        assert meta["token_ids"] == solo["token_ids"]
        assert len(meta["entropy"]) == len(meta["token_ids"])
        np.testing.assert_allclose(
            meta["geometry"]["hidden"]["mean"], solo["geometry"]["hidden"]["mean"], atol=1e-3
        )


def _log_of_a_server_that_exits(
    model: str | Path, flags: list[str], env: dict[str, str] | None = None
) -> str:
    """Start stock ``vllm serve`` on ``model`` with the guard's connector and ``flags``
    (eager, a short context), assert it exits without ever answering, and return its log."""
    with _own_server(model, ["--enforce-eager", *flags], env) as server:
        with pytest.raises(BackendError, match="exited"):
            server.wait(600)
        return server.log.read_text(errors="replace")


def test_a_mode_the_capture_cannot_serve_stops_the_server_by_name() -> None:
    """Stock vLLM with the guard's connector and speculative decoding: the server does not
    start, and its error names the flag (the plugin's check once the weights have loaded,
    before vLLM compiles the model)."""
    from abstain_guard.adapters.model.vllm_folder import vllm_model_folder

    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    log = _log_of_a_server_that_exits(vllm_model_folder("default"), ["--speculative-config", spec])
    assert "the guard's capture cannot serve speculative decoding (--speculative-config)" in log


def test_a_hub_model_whose_files_are_not_on_disk_stops_the_server_before_it_serves(
    tmp_path: Path,
) -> None:
    """Stock ``vllm serve org/name`` with the guard's connector, offline, on an empty Hugging
    Face cache: the server exits at start-up (before any model loads) and never answers,
    its log naming the model and the missing snapshot. Offline, vLLM resolves a hub id in
    its argument parsing — to the cached snapshot folder, whose files the connector digests,
    or refused when there is none — so no guarded server serves a hub id without files to
    verify it by."""
    env = guarded_env()
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
        env.pop(name, None)
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    log = _log_of_a_server_that_exits("org/not-downloaded", [], env)
    assert "kv_connector='AbstainGuardConnector'" in log  # the guarded command line
    assert "'model': 'org/not-downloaded'" in log
    assert "Cannot find an appropriate cached snapshot folder" in log
    assert "Loading weights" not in log and "Starting vLLM server" not in log


# ---- the module's server: a probe guard calibrated on it, and what it serves ----------


@pytest.fixture(scope="module")
def vllm_guard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not os.environ.get(VLLM_PYTHON_ENV):
        pytest.skip(f"{VLLM_PYTHON_ENV} is not set (make test sets it to .venv-vllm)")
    out = tmp_path_factory.mktemp("vllm") / "guard"
    config = CalibrationConfig(
        backend="vllm",
        scorer="probe_mid",
        limit=56,
        cache_dir=str(out) + ".cache",
        **TP,
    )
    try:
        calibrate("builtin", out, config=config, progress=False)
        yield out
    finally:
        stop_engines()


def test_a_probe_guard_calibrated_on_vllm_records_its_engine(vllm_guard: Path) -> None:
    from abstain_guard import GuardArtifact

    artifact = GuardArtifact.load(vllm_guard)
    deployment = artifact.metadata["deployment"]
    path = deployment["decoding"]["decode_path"]
    assert deployment["decoding"]["backend"] == "vllm"
    # CPU: not batch-invariant; the bound is the move measured on this server at 8 and 32
    # in flight (the calibration answers asked again), ten times over, at least 1e-6
    measured = deployment["decoding"]["live_bound_measured"]
    assert set(measured["levels"]) == {"8", "32"}
    assert all(v["n"] >= 4 and v["tokens_differ"] == 0 for v in measured["levels"].values())
    bound = deployment["decoding"]["live_bound"]
    assert bound == max(10 * measured["max_abs_diff"], 1e-6) and bound < LIVE_BOUND
    assert path["name"] == "vllm" and path["vllm_version"]
    assert path["layers"] == [15, 24] and path["dtype"] == "float32"
    assert path["capture_path"] == "compiled_tap_kv_connector"
    assert path["enforce_eager"] is False and path["compilation_mode"] != "NONE"
    assert path["tensor_parallel_size"] == 1
    assert len(path["model_sha256"]) == 64 and path["lora"] is None
    assert deployment["chat_model"]["class_path"].endswith("VLLMChatModel")
    assert artifact.scorer.backend_ == "vllm"
    assert np.isfinite(artifact.scores).all() and len(artifact.scores) >= 4


def test_live_equals_stored_under_eight_concurrent_callers(
    vllm_guard: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    seen = {"now": 0, "most": 0}
    lock = threading.Lock()
    generate = VLLMChatModel._generate

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        try:
            return generate(self, *args, **kwargs)
        finally:
            with lock:
                seen["now"] -= 1

    monkeypatch.setattr(VLLMChatModel, "_generate", counted)
    result = live_check(vllm_guard, limit=8, progress=False, concurrency=8)
    assert seen["most"] > 1  # the calls were in flight together (live_check passes it on)
    summary = result["summary"]
    assert summary["n"] == 8 and summary["unscorable"] == 0
    assert summary["same_tokens"] == 1.0
    from abstain_guard import GuardArtifact

    bound = GuardArtifact.load(vllm_guard).metadata["deployment"]["decoding"]["live_bound"]
    assert summary["abs_score_diff_max"] <= bound  # the recorded, measured bound
    rows = result["rows"]
    flips = [r for r in rows if r["stored_answers"] == r["abstained"]]
    gap = [abs(r["stored_score"] - result["threshold"]) for r in flips]
    assert all(g <= bound for g in gap)  # a decision moves only at the threshold


def test_a_response_from_the_exact_engine_is_refused(vllm_guard: Path, default_model) -> None:
    calibrated_for = "but this artifact was calibrated for 'chat_model:"
    with pytest.raises(ArtifactMismatchError, match=calibrated_for):
        load_guard_chain(vllm_guard, model=default_model)
    guard = AbstentionGuard.from_artifact(
        vllm_guard, default_model, config=GuardConfig(on_mismatch="warn")
    )
    message = guard.invoke("What is the capital of France?")
    decision = message.response_metadata["abstention"]
    assert decision["abstained"]  # fails closed: the probe reads vLLM's hidden states only
    assert "vllm backend" in str(decision).lower()


def test_a_server_with_other_weights_is_refused_before_any_answer(vllm_guard: Path) -> None:
    """The artifact records the served checkpoint's sha256; a server whose weights differ
    (here: the artifact says calibration served other weights of the same shape) is refused
    when the chain is built, and each of its responses is refused."""
    from abstain_guard import GuardArtifact

    other = GuardArtifact.load(vllm_guard)
    other.metadata["deployment"]["decoding"]["decode_path"]["model_sha256"] = "0" * 64
    with pytest.raises(ArtifactMismatchError, match="model_sha256"):
        load_guard_chain(other)
    with pytest.warns(UserWarning, match="model_sha256"):
        _, guard, _ = load_guard_chain(other, GuardConfig(on_mismatch="warn"))
    # each response is checked too: an attached server (its weights unknown up front) is
    # refused on its first answer
    strict = AbstentionGuard(guard.runnable, artifact=other)
    with pytest.raises(ArtifactMismatchError, match="model_sha256"):
        strict.invoke("What is the capital of France?")


def test_the_served_identity_is_verified_and_an_unverified_one_refused(vllm_guard: Path) -> None:
    """The server's record names the served model by the sha256 of its files (weights,
    config, tokenizer, chat template: the digest this process computes from the same folder);
    an artifact that recorded no verified identity (None, or none at all, as a hub model's
    was recorded before identities were verified) is refused against this real server, whose
    answers would otherwise pass whatever weights it serves."""
    from abstain_guard import GuardArtifact
    from abstain_guard.adapters.model.vllm_folder import vllm_model_folder
    from abstain_guard.backends.vllm_identity import model_identity

    _, record = VLLMChatModel(**TP).engine()
    assert record["model_sha256"] == model_identity(vllm_model_folder("default"))
    for unverified in (None, "missing"):
        other = GuardArtifact.load(vllm_guard)
        path = other.metadata["deployment"]["decoding"]["decode_path"]
        if unverified is None:
            path["model_sha256"] = None
        else:
            del path["model_sha256"]
        with pytest.raises(ArtifactMismatchError, match="no verified identity"):
            load_guard_chain(other)


def test_evaluate_reads_calibrations_answers_and_generates_nothing(
    vllm_guard: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``abstain-guard evaluate`` right after ``calibrate`` on vLLM: the AUROC table from the
    calibration cache's answers (not one answer generated), and a baseline vLLM cannot
    score refused by name before anything runs."""
    from abstain_guard.cli import main

    def no_generation(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("evaluate generated an answer")

    monkeypatch.setattr(VLLMChatModel, "_generate", no_generation)
    monkeypatch.setattr(VLLMChatModel, "_agenerate", no_generation)
    out = tmp_path / "report"
    args = ["evaluate", "--artifact", str(vllm_guard), "--out", str(out), "--quiet"]
    assert main([*args, "--baselines", "perplexity,mean_token_entropy", "--resplits", "5"]) == 0
    printed = capsys.readouterr().out
    assert "probe_mid" in printed and "perplexity" in printed and "auroc" in printed.lower()
    again = ["evaluate", "--artifact", str(vllm_guard), "--out", str(tmp_path / "again")]
    assert main([*again, "--quiet", "--baselines", "p_true"]) == 2
    error = capsys.readouterr().err
    assert "p_true" in error and "vllm backend" in error and not (tmp_path / "again").exists()


def test_geometry_is_refused_on_vllm_before_any_model_loads() -> None:
    from abstain_guard.calibration.building.preflight import check_api_model

    with pytest.raises(ConfigError, match="exact"):
        check_api_model(CalibrationConfig(backend="vllm", scorer="geometry"), build=False)


def test_the_engine_batches_concurrent_callers() -> None:
    if not os.environ.get(VLLM_PYTHON_ENV):
        pytest.skip(f"{VLLM_PYTHON_ENV} is not set (make test sets it to .venv-vllm)")
    model = VLLMChatModel(max_tokens=8, **TP)
    questions = [[("human", f"What is the capital of {c}?")] for c in ("France", "Peru")] * 4
    alone = model.invoke(questions[0])
    together = model.batch(questions, config={"max_concurrency": 8})
    assert together[0].response_metadata["token_ids"] == alone.response_metadata["token_ids"]
    assert all(
        len(m.response_metadata["entropy"]) == len(m.response_metadata["token_ids"])
        for m in together
    )
    hidden = together[0].response_metadata["geometry"]["hidden"]
    assert np.asarray(hidden["mean"]).shape == (2, 576)


def test_served_on_vllm_through_the_openai_client_eight_at_once(vllm_guard: Path) -> None:
    openai = pytest.importorskip("openai")
    from abstain_guard.serve.runner import ServerThread
    from abstain_guard.serve.service import GuardService

    service = GuardService.from_artifact(vllm_guard, GuardConfig(participation=0.8))
    questions = [f"What is the capital of {c}?" for c in ("France", "Peru", "Chile", "Kenya")]
    with ServerThread(service) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)

        def ask(question: str) -> Any:
            return client.chat.completions.create(
                model="abstain-guard", messages=[{"role": "user", "content": question}]
            )

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, questions * 2))
    assert len(answers) == 8
    for reply in answers:
        assert reply.choices[0].message.content
        decision = reply.choices[0].model_extra["abstention"]  # every reply carries it
        assert isinstance(decision["abstained"], bool) and decision["scorer"] == "probe_mid"
    # the same question asked twice at once is answered the same way
    assert answers[0].choices[0].message.content == answers[4].choices[0].message.content


def test_a_tool_call_on_vllm_is_the_exact_engines_call(
    vllm_guard: Path, default_model_with
) -> None:
    """Tools bound: the prompt is rendered and the reply read by the project's tool code, so
    vLLM makes the call the exact engine makes from the same tokens (forced, then the turn
    after the tool result)."""
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool

    @tool
    def capital_of(country: str) -> str:
        """Look up the capital city of a country."""
        return "Paris"

    question = [("human", "What is the capital of France? Use the tool.")]
    on_vllm = VLLMChatModel(max_tokens=64, **TP).bind_tools([capital_of], tool_choice="capital_of")
    exact = default_model_with(max_new_tokens=64).bind_tools([capital_of], tool_choice="capital_of")
    got, want = on_vllm.invoke(question), exact.invoke(question)
    assert got.tool_calls == want.tool_calls and got.tool_calls[0]["name"] == "capital_of"
    assert got.response_metadata["prompt_token_ids"] == want.response_metadata["prompt_token_ids"]
    # the server stops on EOS or the budget (the marker is five tokens, no stop token): its
    # tokens begin with the exact engine's, which stopped at the marker
    exact_ids = want.response_metadata["token_ids"]
    assert got.response_metadata["token_ids"][: len(exact_ids)] == exact_ids
    follow = [*question, want, ToolMessage("Paris", tool_call_id=want.tool_calls[0]["id"])]
    again = VLLMChatModel(max_tokens=24, **TP).bind_tools([capital_of]).invoke(follow)
    reference = default_model_with(max_new_tokens=24).bind_tools([capital_of]).invoke(follow)
    assert (
        again.response_metadata["prompt_token_ids"]
        == reference.response_metadata["prompt_token_ids"]
    )
    assert again.content == reference.content


def _raw(url: str, token: str | None, question: str = "What is the capital of Peru?") -> dict:
    import httpx

    from abstain_guard.backends.vllm_payload import PAYLOAD_KEY

    body: dict[str, Any] = {
        "model": VLLMChatModel(**TP)._served_name(url),
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0.0,
        "return_token_ids": True,
        "kv_transfer_params": {PAYLOAD_KEY: {} if token is None else {"token": token}},
    }
    return dict(httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json())


def test_a_request_without_the_key_gets_no_activations(vllm_guard: Path) -> None:
    from abstain_guard.backends.vllm_payload import PAYLOAD_KEY

    url, _ = VLLMChatModel(**TP).engine()
    for token in (None, "0" * 64):
        payload = _raw(url, token)["kv_transfer_params"][PAYLOAD_KEY]
        assert "token of the server" in payload["error"]
        assert not {"last", "mean", "entropy"} & set(payload)


def test_a_forged_altered_or_moved_payload_is_refused(vllm_guard: Path) -> None:
    from abstain_guard.backends.vllm_payload import PAYLOAD_KEY, payload_key, request_token

    model = VLLMChatModel(**TP)
    url, _ = model.engine()
    token = request_token(payload_key(generate=True))
    good = _raw(url, token)
    other = _raw(url, token, "What is the capital of Kenya?")
    model._capture(url, good)  # the server's own payload passes
    payload = good["kv_transfer_params"][PAYLOAD_KEY]
    forged = {k: v for k, v in payload.items() if k != "signature"}
    altered = {**payload, "mean": other["kv_transfer_params"][PAYLOAD_KEY]["mean"]}
    for bad, match in ((forged, "unsigned"), (altered, "valid signature")):
        with pytest.raises(BackendError, match=match):
            model._capture(url, {**good, "kv_transfer_params": {PAYLOAD_KEY: bad}})
    moved = {**other, "kv_transfer_params": good["kv_transfer_params"]}
    assert other["choices"][0]["token_ids"] != good["choices"][0]["token_ids"]
    with pytest.raises(BackendError, match=r"other tokens|covers"):
        model._capture(url, moved)
