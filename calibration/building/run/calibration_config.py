"""The settings of a calibration run (``abstain-guard calibrate --config``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from abstain_guard.backends import VLLM_CHAT_MODEL
from abstain_guard.config import read_config_file
from abstain_guard.contract.chat_model_specs import ChatModelSpec, is_secret
from abstain_guard.contract.model_names import parse_model_name
from abstain_guard.contract.streaming import ChunkRule
from abstain_guard.errors import ConfigError, ModelNameError
from abstain_guard.scorers import scorer_names

LIKELIHOOD_SCORERS = scorer_names(family="likelihood")
FIT_SCORERS = scorer_names(family=("geometry", "probe"))
BLACKBOX_SCORERS = scorer_names(family="blackbox")
KNOWN_SCORERS = LIKELIHOOD_SCORERS + FIT_SCORERS + BLACKBOX_SCORERS
"""Scorers ``calibrate`` can build an artifact for: they read the metadata of one answer
(the geometry scorer also reads the reference/train answers it is fitted on; a black-box
scorer reads the k samples drawn with the answer, from any chat model spec)."""

TYPE_FLOOR = "type_floor"
"""``evaluate``'s measuring floor (the question's type only): not a scorer, but a name a named
scorer's candidates may hold, since a look at the calibration answers counts in δ/K."""

AUTO_SCORER = "auto"
"""``scorer: auto``: calibrate every one of ``candidates``, certify each at δ/K and ship the
one certifying the most participation at ``risk_target``
(:mod:`abstain_guard.guarantee.selection`)."""


class CalibrationConfig(BaseModel):
    """Everything ``calibrate`` needs besides the data and the output directory.

    Loaded from YAML/TOML/JSON with :meth:`from_file`; unknown keys are errors.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | ChatModelSpec = Field(
        "default",
        description='"default" (embedded SmolLM2), a local HF folder, or an API chat model '
        "{chat_model: 'openai:gpt-4o-mini' | class_path: 'module:Class', kwargs: {...}} "
        "(likelihood scorers, or black-box scorers when it returns no logprobs; secret "
        "kwargs are never stored)",
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside `model`, if any")
    served_model: str | None = Field(
        None,
        description="model: http(s)://host:port/v1 (an OpenAI-compatible server): the model it "
        "serves (default: the only one its /v1/models lists)",
    )
    api_key_env: str | None = Field(
        None,
        description="the environment variable holding the API key of a server or LangChain "
        "model (recorded by name; the key is never stored)",
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|mps|(cuda|xpu)(:\d+)?)$",
        description="where a local model runs: 'cpu', 'cuda', 'cuda:1', 'mps' (recorded; the "
        "deployed guard loads the model there)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="the local model's weights' dtype (recorded; a deployment in another "
        "dtype is refused)",
    )
    backend: Literal["exact", "vllm"] = Field(
        "exact",
        description="the engine the answers are generated on, as deployed: 'exact' (the "
        "project's engine: every scorer) or 'vllm' (vLLM, batched: probe and likelihood "
        "scorers; `model` is then served by VLLMChatModel, recorded as its chat model; "
        "docs/vllm.md)",
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="backend vllm: more `vllm serve` flags for the server started for "
        "calibration, parsed by vLLM (e.g. ['--tensor-parallel-size', '2']); recorded with "
        "the chat model, so the deployed guard starts the same server",
    )
    engine_url: str | None = Field(
        None,
        description="backend vllm: a running vLLM server (started with the guard's connector "
        "flag, docs/vllm.md) instead of starting one",
    )
    system_prompt: str | None = Field(None, description="overrides the per-kind system prompt")
    max_new_tokens: int | None = Field(None, gt=0, description="None = per question kind")
    batch_size: int = Field(8, gt=0, description="questions generated per batch")
    batch_decode: bool = Field(
        True,
        description="share decode steps between the questions of a batch (GeometryChatModel "
        "batch_decode, the default): each answer still bitwise its solo one on that path; "
        "false decodes every answer alone. The path is recorded and checked at deployment",
    )
    prefix_cache: bool = Field(
        True,
        description="the prefix path (GeometryChatModel prefix_cache, the default): every "
        "prompt pass split after the shared prefix (system prompt, template), the prefix "
        "computed once; false runs each prompt in one pass. The path is recorded and checked "
        "at deployment, and load_guard_chain / serve load the model on the calibrated path",
    )
    replay_batch_size: int = Field(16, gt=0)
    agent: str | None = Field(
        None,
        description="'package.module:factory': factory(model) returns the LangChain agent as "
        "deployed (without the guard); calibrate runs it on every question (docs/agents.md)",
    )
    agent_step_limit: int = Field(
        12, gt=1, description="LangGraph recursion_limit of each agent run (model + tool steps)"
    )
    agent_gating: Literal["steps", "final_answer"] = Field(
        "steps",
        description="what the guard gates in an agent run: 'steps' scores every model call and "
        "stops the run before the tool calls of the first call whose running maximum crosses "
        "the threshold (runs are calibrated whole: docs/guarantees.md); 'final_answer' gates "
        "only final answers (tool calls run ungated; a weaker statement)",
    )
    chunk_rule: str | None = Field(
        None,
        description="calibrate for certified streaming: score every answer at each chunk end "
        "of this rule ('sentence', 'clause' or 'tokens:K') and calibrate on the maximum, so "
        "the guard can release an answer chunk by chunk (docs/streaming.md); None: whole "
        "answers",
    )
    judge: str | dict[str, Any] = Field(
        "lexical",
        description="judge name or spec; an LLM judge by configuration alone: {name: llm, "
        "model: 'openai:gpt-4o-mini'} (an init_chat_model name) or {name: llm, base_url: "
        "'http://host:8000/v1', model: '<served name>'} (any OpenAI-compatible server, vLLM "
        "included). With an LLM judge, rows of a data file may be questions only",
    )
    review_size: int = Field(
        0,
        ge=0,
        description="draw this many calibration answers uniformly at random for people to "
        "review (written to <out>.review.csv; `abstain-guard review` reads the verdicts back): "
        "the certificate is then about the true error rate, not the judge's (0: no review)",
    )
    review_scope: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="draw the review among this share of the calibration answers with the "
        "lowest scores (chosen on scores alone); None: planned where the threshold will be, "
        "from the scores and judge labels of a seeded 15 % of the answers, which then take no "
        "part in the review or the certificate on the truth (the draw's seed comes from the "
        "calibration ids)",
    )
    scorer: str = Field(
        "geometry",
        description="the scorer the guard will use, or 'auto': the one of `candidates` that "
        "certifies the most participation at risk_target, every candidate certified at delta/K",
    )
    candidates: tuple[str, ...] | None = Field(
        None,
        description="the K scorers compared on the calibration answers: with scorer 'auto' "
        "calibrate chooses among them; with a named scorer, the ones it was chosen among "
        "(elsewhere, on this same split). Either way the artifact records a `selection` block "
        "and the guard certifies at delta/K",
    )
    selection_share: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="with scorer 'auto': the share of the calibration answers set aside to "
        "choose the scorer on (a seeded draw); the chosen one then certifies at delta on the "
        "rest, which no choice has read, instead of at delta/K on all of them",
    )
    scorer_params: dict[str, Any] = Field(default_factory=dict)
    question: str = "question"
    answers: str = "answer"
    choices: str | None = None
    kind: Literal["open", "choice", "numeric"] | None = None
    group_by: str | None = None
    ratios: tuple[int, int, int, int] = (5, 3, 1, 1)
    seed: int = Field(0, ge=0, description="split seed (a non-negative integer)")
    limit: int | None = Field(None, gt=0)
    participation: float = Field(0.8, gt=0.0, lt=1.0, description="1-alpha checked for size")
    risk_target: float | None = Field(
        None, gt=0.0, lt=1.0, description="risk target the deployment will ask for (size check)"
    )
    delta: float = Field(0.1, gt=0.0, lt=1.0, description="delta of that risk target")
    cache_dir: str | None = Field(None, description="default: '<out>.cache' beside the output")
    executor: Literal["local", "ray"] = Field(
        "local",
        description="where answers are generated and judged: this process, or Ray actors "
        "(one model replica each; docs/scale-out.md; needs the ray extra)",
    )
    ray_address: str | None = Field(
        None, description='Ray cluster to join ("auto", "ray://host:10001"); None starts one'
    )
    replicas: int = Field(1, gt=0, description="model replicas (Ray actors) with --executor ray")
    gpus_per_replica: float = Field(0.0, ge=0.0, description="GPUs each Ray replica reserves")
    cpus_per_replica: float = Field(1.0, ge=0.0, description="CPUs each Ray replica reserves")
    threads_per_replica: int | None = Field(
        None,
        gt=0,
        description="torch threads of each Ray replica (None: the driver's count, so CPU "
        "answers are bitwise the local run's)",
    )
    skip_bad_rows: bool = Field(
        False,
        description="skip malformed rows, non-string answers and duplicate questions of a data "
        "file (counted and reported) instead of failing with their lines",
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(_format_errors(exc, sorted(type(self).model_fields))) from exc

    @field_validator("model", mode="before")
    @classmethod
    def _chat_model_spec(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        try:
            return ChatModelSpec.model_validate(dict(value))
        except ValidationError as exc:
            problems = [
                f"unknown key {'.'.join(map(str, e['loc']))!r}"
                if e["type"] == "extra_forbidden"
                else str(e["msg"]).removeprefix("Value error, ")
                for e in exc.errors()
            ]
            raise ValueError(
                "an API chat model is {chat_model: <init_chat_model name> | class_path: "
                "<module:Class>, kwargs: {...}}: " + "; ".join(problems)
            ) from None

    @model_validator(mode="before")
    @classmethod
    def _vllm_backend(cls, data: Any) -> Any:
        """``backend: vllm`` with a model name or folder: the model becomes the vLLM
        backend's chat model (a ChatModelSpec, generated and recorded as deployed). A model
        name is read first (:func:`~abstain_guard.contract.model_names.parse_model_name`)."""
        data = _named_model(data)
        if not isinstance(data, Mapping) or data.get("backend") != "vllm":
            return data
        model = data.get("model", "default")
        if isinstance(model, Mapping) and model.get("class_path") == VLLM_CHAT_MODEL:
            return data  # already the vLLM backend's chat model (a stored config)
        if not isinstance(model, str):
            raise ValueError(
                "backend: vllm takes model as 'default' or a local Hugging Face folder; to "
                "name its options, set model: {class_path: "
                f"'{VLLM_CHAT_MODEL}', kwargs: {{...}}}}"
            )
        kwargs: dict[str, Any] = {"model": model}
        if data.get("gguf_file"):
            kwargs["gguf_file"] = data["gguf_file"]
        for key in ("vllm_args", "engine_url"):
            if data.get(key):
                kwargs[key] = data[key]
        rest = {k: v for k, v in data.items() if k not in ("gguf_file", "vllm_args", "engine_url")}
        return {**rest, "model": {"class_path": VLLM_CHAT_MODEL, "kwargs": kwargs}}

    @model_validator(mode="after")
    def _backend_matches_model(self) -> CalibrationConfig:
        vllm = isinstance(self.model, ChatModelSpec) and self.model.class_path == VLLM_CHAT_MODEL
        if vllm and self.backend != "vllm":  # a spec naming the class: the same backend
            object.__setattr__(self, "backend", "vllm")
        return self

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, value: str) -> str:
        if value != AUTO_SCORER and value not in KNOWN_SCORERS:
            raise ValueError(
                f"unknown scorer {value!r}; choose one of {list(KNOWN_SCORERS)} or "
                f"{AUTO_SCORER!r} (with candidates)"
            )
        return value

    @field_validator("candidates", mode="before")
    @classmethod
    def _split_candidates(cls, value: Any) -> Any:
        if isinstance(value, str):  # --candidates a,b,c
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value

    @model_validator(mode="after")
    def _check_selection(self) -> CalibrationConfig:
        if self.selection_share is not None and self.scorer != AUTO_SCORER:
            raise ValueError(
                "selection_share sets answers aside to choose the scorer on: it needs scorer "
                "'auto' with candidates (a scorer named beforehand needs no selection split)"
            )
        if self.candidates is None:
            if self.scorer == AUTO_SCORER:
                raise ValueError(
                    "scorer 'auto' needs candidates, the scorers to choose among "
                    "(e.g. --candidates probe_mid,probe_concat,geometry)"
                )
            return self
        names = list(self.candidates)
        if len(set(names)) != len(names) or len(names) < 2:
            raise ValueError(f"candidates must be at least two distinct scorers, got {names}")
        known = KNOWN_SCORERS if self.scorer == AUTO_SCORER else (*scorer_names(), TYPE_FLOOR)
        unknown = [c for c in names if c not in known]
        if unknown:
            raise ValueError(f"unknown candidates {unknown}; choose among {list(known)}")
        if self.scorer != AUTO_SCORER and self.scorer not in names:
            raise ValueError(f"scorer {self.scorer!r} is not among the candidates {names}")
        if self.risk_target is None:
            raise ValueError(
                "candidates need risk_target: the candidates are certified (and compared) at "
                "that risk target, each at delta/K"
            )
        if self.agent is not None and self.scorer == AUTO_SCORER:
            raise ValueError("scorer 'auto' is not supported with an agent; name the scorer")
        return self

    @model_validator(mode="after")
    def _check_blackbox(self) -> CalibrationConfig:
        names = {self.scorer, *(self.candidates or ())}
        blackbox = sorted(names & set(BLACKBOX_SCORERS))
        if not blackbox:
            return self
        if not isinstance(self.model, ChatModelSpec):
            raise ValueError(
                f"the black-box scorer {blackbox[0]!r} samples a LangChain chat model named "
                "by model: {chat_model: ... | class_path: ..., kwargs: {...}} (an API, a "
                "gateway, an OpenAI-compatible server); the project's engine has logprob and "
                "geometry scorers. To sample it, serve it (abstain-guard serve --no-guard) and "
                "name it with class_path: 'langchain_openai:ChatOpenAI', kwargs: {base_url: ...}"
            )
        if self.agent is not None:
            raise ValueError("black-box scorers calibrate final answers, not an agent's runs")
        if self.selects:
            raise ValueError(
                "scorer 'auto' compares candidates on the same answers; a black-box scorer's "
                "answers are its own samples: name the scorer"
            )
        return self

    @model_validator(mode="after")
    def _check_chunk_rule(self) -> CalibrationConfig:
        if self.chunk_rule is None:
            return self
        object.__setattr__(self, "chunk_rule", str(ChunkRule.parse(self.chunk_rule)))
        where = (
            "an agent"
            if self.agent is not None
            else "a chat model spec (API or vLLM)"
            if isinstance(self.model, ChatModelSpec)
            else "scorer 'auto'"
            if self.selects
            else None
        )
        if where is not None:
            raise ValueError(
                f"chunk_rule is not supported with {where}: certified streaming is calibrated "
                "on final answers of the project's engine with a named scorer"
            )
        return self

    @classmethod
    def of_artifact(cls, metadata: Mapping[str, Any]) -> CalibrationConfig:
        """The config an artifact was calibrated with, from its ``metadata`` (``config``)."""
        return cls(**metadata.get("config", {}))

    @property
    def selects(self) -> bool:
        """Whether calibrate chooses the scorer itself (``scorer: auto``)."""
        return self.scorer == AUTO_SCORER

    def for_candidate(self, name: str) -> CalibrationConfig:
        """This config with ``scorer`` set to candidate ``name`` (what one candidate's
        calibration runs with)."""
        return self.model_copy(update={"scorer": name})

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> CalibrationConfig:
        """Read a YAML, TOML or JSON file; ``overrides`` (non-None) win over the file."""
        data = dict(read_config_file(path))
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc


def _named_model(data: Any) -> Any:
    """``data`` with a ``model`` name read by the one model-name grammar: a .gguf path
    becomes its folder and ``gguf_file``, a server's URL or a LangChain name a chat model
    spec (``served_model`` and ``api_key_env`` in it). Raises ValueError for a name the
    grammar refuses."""
    if not isinstance(data, Mapping) or not isinstance(data.get("model"), str):
        return data
    try:
        name = parse_model_name(
            data["model"],
            gguf_file=data.get("gguf_file"),
            served_model=data.get("served_model"),
            api_key_env=data.get("api_key_env"),
        )
    except ModelNameError as exc:
        raise ValueError(str(exc)) from None
    model = name.model
    named = model.model_dump(mode="json") if isinstance(model, ChatModelSpec) else model
    gguf = {"gguf_file": name.gguf_file} if name.gguf_file else {}
    return {**data, "model": named, **gguf}


def _redacted(value: Any) -> Any:
    """``value`` with secret-looking keys' values hidden (error messages quote inputs)."""
    if isinstance(value, Mapping):
        return {k: "***" if is_secret(str(k)) else _redacted(v) for k, v in value.items()}
    return value


def _format_errors(exc: ValidationError, valid: list[str]) -> str:
    """Every problem of a pydantic error on one line each: what was wrong and what to do."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ())) or "<config>"
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown key {loc!r}; valid keys: {', '.join(valid)}")
        else:
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            parts.append(f"{loc}: {msg} (got {_redacted(err.get('input'))!r})")
    return "Invalid calibration config: " + "; ".join(parts) + "."
