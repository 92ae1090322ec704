"""The one model-name grammar (``--model`` and ``model:``): every form, every error."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.contract.chat_model_specs import ChatModelSpec
from abstain_guard.contract.model_names import (
    OPENAI_COMPATIBLE,
    ModelName,
    check_model_name,
    model_name_mismatch,
    parse_model_name,
    recorded_model_name,
    served_models,
)
from abstain_guard.errors import (
    BackendError,
    ConfigError,
    MissingExtraError,
    ModelNameError,
    ModelNotFoundError,
)


def test_default() -> None:
    name = parse_model_name("default")
    assert name == ModelName("default") and name.kind == "default" and name.label == "default"


def test_folder_with_and_without_gguf_file() -> None:
    assert parse_model_name("models/llama") == ModelName("models/llama")
    assert parse_model_name("models/llama").kind == "folder"
    name = parse_model_name(" models/llama ", gguf_file="q4.gguf")
    assert name == ModelName("models/llama", gguf_file="q4.gguf") and name.kind == "gguf"


def test_gguf_path_is_its_folder_and_file() -> None:
    name = parse_model_name("/opt/m/gemma-3-270m-q4_k_m.GGUF")
    assert name == ModelName("/opt/m", gguf_file="gemma-3-270m-q4_k_m.GGUF")
    assert name.kind == "gguf" and name.label == "/opt/m/gemma-3-270m-q4_k_m.GGUF"


def test_server_url_with_served_model_and_key_variable() -> None:
    name = parse_model_name(
        "http://localhost:8000/v1/", served_model="Qwen/Qwen3-8B", api_key_env="VLLM_KEY"
    )
    assert name.kind == "server" and name.base_url == "http://localhost:8000/v1"
    assert name.model == ChatModelSpec(
        class_path=OPENAI_COMPATIBLE,
        kwargs={
            "base_url": "http://localhost:8000/v1",
            "model": "Qwen/Qwen3-8B",
            "api_key_env": "VLLM_KEY",
        },
    )
    assert name.label == "http://localhost:8000/v1 (Qwen/Qwen3-8B)"
    bare = parse_model_name("HTTPS://gateway.example.com/api/v1")
    assert bare.base_url == "https://gateway.example.com/api/v1"
    assert "model" not in bare.model.kwargs  # type: ignore[union-attr]


def test_langchain_name() -> None:
    name = parse_model_name("openai:gpt-4o-mini")
    assert name.kind == "langchain" and name.model == ChatModelSpec(chat_model="openai:gpt-4o-mini")
    keyed = parse_model_name("anthropic:claude-3-5-haiku-latest", api_key_env="MY_KEY")
    assert keyed.model.kwargs == {"api_key_env": "MY_KEY"}  # type: ignore[union-attr]


def test_a_class_path_spec_is_its_own_kind() -> None:
    spec = ChatModelSpec(class_path="langchain_openai:ChatOpenAI", kwargs={"model": "x"})
    assert ModelName(spec).kind == "class" and ModelName(spec).base_url is None


@pytest.mark.parametrize(
    ("text", "options", "says"),
    [
        ("", {}, "is empty"),
        ("   ", {}, "is empty"),
        ("default", {"gguf_file": "x.gguf"}, "--gguf-file 'x.gguf' applies to a folder"),
        ("m/x.gguf", {"gguf_file": "y.gguf"}, "the .gguf path names the file"),
        ("models/llama", {"served_model": "m"}, "--served-model 'm' applies to a server"),
        ("default", {"api_key_env": "K"}, "--api-key-env 'K' applies to a local model"),
        ("openai:gpt-4o", {"gguf_file": "x.gguf"}, "applies to a LangChain chat model"),
        ("http://h:8000/v1", {"gguf_file": "x.gguf"}, "applies to an OpenAI-compatible"),
        ("http://h:8000/v1", {"api_key_env": "sk-123 456"}, "not an environment variable"),
        ("http:///v1", {}, "not a server's base URL"),
        ("http://h:8000/v1?x=1", {}, "not a server's base URL"),
        ("http://h:8000/v1/chat/completions", {}, "drop it: http://h:8000/v1"),
        ("http://h:8000/v1/models", {}, "names the endpoint /models"),
    ],
)
def test_malformed_names(text: str, options: dict[str, Any], says: str) -> None:
    with pytest.raises(ModelNameError, match=None) as info:
        parse_model_name(text, **options)
    assert says in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_config_reads_model_by_the_same_grammar(tmp_path: Path) -> None:
    gguf = CalibrationConfig(model=str(tmp_path / "m.gguf"), device="cuda:1", dtype="bfloat16")
    assert (gguf.model, gguf.gguf_file) == (str(tmp_path), "m.gguf")
    assert (gguf.device, gguf.dtype) == ("cuda:1", "bfloat16")
    server = CalibrationConfig(model="http://h:9000/v1", served_model="m", api_key_env="K")
    assert (
        server.model
        == parse_model_name("http://h:9000/v1", served_model="m", api_key_env="K").model
    )
    assert CalibrationConfig(model="openai:gpt-4o-mini").model == ChatModelSpec(
        chat_model="openai:gpt-4o-mini"
    )
    stored = CalibrationConfig(**server.model_dump(mode="json"))  # an artifact's config
    assert stored.model == server.model
    with pytest.raises(ConfigError, match="--served-model 'm' applies to a server"):
        CalibrationConfig(model="default", served_model="m")
    with pytest.raises(ConfigError, match="device"):
        CalibrationConfig(device="gpu")
    with pytest.raises(ConfigError, match="dtype"):
        CalibrationConfig(dtype="int8")


def test_check_folder_and_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    assert check_model_name(ModelName(str(tmp_path))) == ModelName(str(tmp_path))
    assert check_model_name(parse_model_name(str(tmp_path / "a.gguf"))).gguf_file == "a.gguf"
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        check_model_name(parse_model_name(str(tmp_path / "missing")))
    with pytest.raises(ModelNotFoundError, match=r"'b.gguf' is not in .*found \['a.gguf'\]"):
        check_model_name(parse_model_name(str(tmp_path / "b.gguf")))
    assert check_model_name(ModelName("default")) == ModelName("default")


def test_check_langchain_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_model_name(parse_model_name("openai:gpt-4o-mini")).kind == "langchain"
    with pytest.raises(ModelNameError, match=r"provider 'nosuch'.*it knows .*anthropic"):
        check_model_name(parse_model_name("nosuch:model"))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "langchain_anthropic" else real(name, *a),
    )
    with pytest.raises(MissingExtraError, match="pip install langchain-anthropic"):
        check_model_name(parse_model_name("anthropic:claude-3-5-haiku-latest"))


class _Models(BaseHTTPRequestHandler):
    served: ClassVar[list[str]] = []
    key: ClassVar[str | None] = None

    def do_GET(self) -> None:
        if self.key is not None and self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"object": "list", "data": [{"id": m} for m in self.served]})
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Models]]]:
    handler = type("Handler", (_Models,), {"served": ["only-model"], "key": None})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_server_served_model_asked_when_not_named(
    server: tuple[str, type[_Models]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, handler = server
    assert served_models(url) == ["only-model"]
    checked = check_model_name(parse_model_name(url))
    assert checked.model.kwargs["model"] == "only-model"  # type: ignore[union-attr]
    assert check_model_name(parse_model_name(url, served_model="only-model")) == parse_model_name(
        url, served_model="only-model"
    )
    with pytest.raises(ModelNotFoundError, match=r"does not serve 'other'.*\['only-model'\]"):
        check_model_name(parse_model_name(url, served_model="other"))
    handler.served = ["a", "b"]
    with pytest.raises(ModelNameError, match=r"serves 2 models \['a', 'b'\]; name one"):
        check_model_name(parse_model_name(url))
    handler.key = "s3cret"
    with pytest.raises(ModelNameError, match=r"KEY_VAR .* is not set"):
        check_model_name(parse_model_name(url, api_key_env="KEY_VAR"))
    with pytest.raises(BackendError, match="HTTP 401"):
        check_model_name(parse_model_name(url, served_model="a"))
    monkeypatch.setenv("KEY_VAR", "s3cret")
    keyed = check_model_name(parse_model_name(url, served_model="a", api_key_env="KEY_VAR"))
    assert "s3cret" not in keyed.model.model_dump_json()  # type: ignore[union-attr]


def test_server_that_does_not_answer() -> None:
    with pytest.raises(BackendError, match="does not answer GET /models"):
        check_model_name(parse_model_name("http://127.0.0.1:9/v1", served_model="m"))


def test_key_variable_builds_the_server_model(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_model_name("http://h:1/v1", served_model="m", api_key_env="KEY_VAR").model
    assert isinstance(spec, ChatModelSpec)
    with pytest.raises(ConfigError, match=r"KEY_VAR .* which is not set"):
        spec.build()
    monkeypatch.setenv("KEY_VAR", "s3cret")
    built = spec.build()
    assert built.openai_api_key.get_secret_value() == "s3cret"
    assert "s3cret" not in spec.model_dump_json()
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    keyless = parse_model_name("http://h:1/v1", served_model="m").model
    assert keyless.build().openai_api_key.get_secret_value() == "EMPTY"  # type: ignore[union-attr]


def test_recorded_name_and_mismatch(tmp_path: Path) -> None:
    cfg = CalibrationConfig(model=str(tmp_path / "m.gguf")).model_dump(mode="json")
    recorded = recorded_model_name(cfg)
    assert recorded == ModelName(str(tmp_path), "m.gguf")
    assert model_name_mismatch(recorded, parse_model_name(str(tmp_path / "n.gguf")))
    assert model_name_mismatch(recorded, parse_model_name(f"{tmp_path}/x/../m.gguf")) is None
    problem = model_name_mismatch(recorded, parse_model_name("default"))
    assert (
        problem is not None and f"({tmp_path}/m.gguf)" in problem and "--model default" in problem
    )
    server = parse_model_name("http://h:1/v1", served_model="m", api_key_env="A")
    assert model_name_mismatch(server, parse_model_name("http://h:1/v1", served_model="m")) is None
    assert model_name_mismatch(server, parse_model_name("http://h:1/v1", served_model="n"))
    assert recorded_model_name({}) == ModelName("default")
