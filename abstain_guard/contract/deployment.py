"""What the guard must run exactly as it was calibrated, and the checks that it does.

The guarantee needs live scores exchangeable with the calibration scores: same model,
prompt, token budget and decoding. Calibration records them as a :class:`DeploymentRecord`
(``metadata["deployment"]``); each response's ``response_metadata["generation"]``, every chat
model's fingerprint, an agent call's prompt and tools, and an API model's class, settings and
answer length are checked against it. A mismatch is an
:class:`~abstain_guard.errors.ArtifactMismatchError` unless ``on_mismatch="warn"`` records it
in the decision (docs/guarantees.md, "What the guard checks at run time").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from abstain_guard.contract.chat_model_specs import ChatModelRecord, identity_mismatches
from abstain_guard.contract.streaming import ChunkRule
from abstain_guard.errors import ArtifactSchemaError
from abstain_guard.guarantee.agent_steps import Gating, Labelling

DECODING_KEYS = ("temperature", "top_p", "top_k", "stop", "batch_decode", "decode_path")
"""Decoding settings that must equal the calibrated ones (``decode_path``: the engine's path,
:mod:`abstain_guard.adapters.engine.threads`; two paths differ in the last bits)."""

NUMERICS_KEYS = ("dtype", "device_type")
"""How the model's numbers were computed: the weights' dtype (another one is refused,
:func:`dtype_mismatches`) and the device type (recorded only)."""


def sha256_text(text: str | None) -> str | None:
    """Hex SHA-256 of ``text`` (UTF-8); None for None."""
    if text is None:
        return None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tools_sha256(tools: Sequence[Mapping[str, Any]] | None) -> str | None:
    """Order-independent hash of tool schemas (OpenAI function format); None when no tools."""
    if not tools:
        return None
    canon = sorted(json.dumps(t, sort_keys=True, default=str) for t in tools)
    return hashlib.sha256("\n".join(canon).encode("utf-8")).hexdigest()


class PromptRecord(BaseModel):
    """How one kind of question was put to the model at calibration: the system message
    (None: none), the token budget and how the user message was built (human-readable)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    system_prompt: str | None
    max_new_tokens: int = Field(gt=0)
    rendering: str = "{question}"

    @property
    def system_prompt_sha256(self) -> str | None:
        return sha256_text(self.system_prompt)


class AgentRecord(BaseModel):
    """How an agent was run at calibration (``abstain-guard calibrate --agent``): its
    factory, system prompt, step limit, tool-call format and prompted tool block, the
    ``tool_choice`` of each call by position, the tool steps before calibration's final
    answers (a histogram), the gating and labelling, and what the runs looked like (each
    field: docs/agents.md, "What the artifact records")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factory: str
    system_prompt: str | None = None
    step_limit: int = Field(gt=0)
    tool_call_format: str | None = None
    tool_prompt_sha256: str | None = None
    final_tool_choice: str | None = None
    call_tool_choices: dict[str, list[str | None]] = Field(default_factory=dict)
    tool_steps: dict[str, int] = Field(default_factory=dict)
    gating: Gating = "final_answer"
    labelling: Labelling = "final_answer"
    conversations: bool = False
    runs: dict[str, Any] = Field(default_factory=dict)


class StreamingRecord(BaseModel):
    """How an artifact calibrated for certified streaming decides: its ``chunk_rule`` and
    the statistic its scores are; ``chunks``: what the calibration answers' chunks were."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_rule: str
    statistic: Literal["max_prefix_score"] = "max_prefix_score"
    chunks: dict[str, Any] = Field(default_factory=dict)

    @field_validator("chunk_rule")
    @classmethod
    def _rule(cls, value: str) -> str:
        return str(ChunkRule.parse(value))


class DeploymentRecord(BaseModel):
    """The generation settings an artifact was calibrated with (``metadata["deployment"]``):
    model fingerprint, chat-template hash, decoding (:data:`DECODING_KEYS`,
    :data:`NUMERICS_KEYS`, kernel facts), one :class:`PromptRecord` per question kind, the
    tools offered, the API chat model (None: local), the agent, whether calibration had
    conversations, and the chunk rule of certified streaming (None: whole answers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_fingerprint: str | None = None
    chat_template_sha256: str | None = None
    decoding: dict[str, Any] = Field(default_factory=dict)
    prompts: dict[str, PromptRecord] = Field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    chat_model: ChatModelRecord | None = None
    agent: AgentRecord | None = None
    conversations: bool = False
    streaming: StreamingRecord | None = None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> DeploymentRecord | None:
        """The record stored in artifact metadata, or None.

        Raises:
            ArtifactSchemaError: the stored record is malformed.
        """
        raw = metadata.get("deployment")
        if raw is None:
            return None
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ArtifactSchemaError(
                f"The artifact's deployment record is malformed: {exc}. Re-run calibrate."
            ) from exc

    @property
    def calibrated_on_conversations(self) -> bool:
        """Whether calibration had rows with earlier turns (an agent's included)."""
        return self.conversations or (self.agent is not None and self.agent.conversations)

    @property
    def tools_sha256(self) -> str | None:
        return tools_sha256(self.tools)

    def kind(self, name: str | None = None) -> tuple[str, PromptRecord]:
        """The prompt record of question kind ``name`` (or of the only kind).

        Raises:
            ArtifactSchemaError: no such kind, or several kinds and no name given.
        """
        if name is None:
            if len(self.prompts) != 1:
                raise ArtifactSchemaError(
                    f"This artifact was calibrated on several question kinds "
                    f"{sorted(self.prompts)}; say which one to run."
                )
            name = next(iter(self.prompts))
        if name not in self.prompts:
            raise ArtifactSchemaError(
                f"This artifact has no question kind {name!r}; it has {sorted(self.prompts)}."
            )
        return name, self.prompts[name]

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def generation_mismatches(
    record: DeploymentRecord, generation: Mapping[str, Any] | None
) -> list[str]:
    """Why a response's recorded settings (``response_metadata["generation"]``; None: not
    recorded, so not verifiable) differ from the calibrated ones (empty: they match)."""
    if generation is None:
        return [
            "the response carries no generation settings (response_metadata['generation']), so "
            "its prompt, token budget and decoding cannot be checked against the calibration"
        ]
    problems: list[str] = []
    sys_hash = generation.get("system_prompt_sha256")
    matches = [k for k, p in record.prompts.items() if p.system_prompt_sha256 == sys_hash]
    if not matches:
        known = {k: p.system_prompt for k, p in record.prompts.items()}
        problems.append(
            "the system prompt differs from every calibrated one "
            f"({known}); prompt the model exactly as at calibration"
        )
    else:
        budgets = {record.prompts[k].max_new_tokens for k in matches}
        if generation.get("max_new_tokens") not in budgets:
            problems.append(
                f"max_new_tokens={generation.get('max_new_tokens')} but calibration used "
                f"{sorted(budgets)}; a different budget changes the scores"
            )
    for key in DECODING_KEYS:
        if key in record.decoding and _norm(generation.get(key)) != _norm(record.decoding[key]):
            if key == "decode_path":
                problems.append(decode_path_problem(generation.get(key), record.decoding[key]))
                continue
            problems.append(
                f"{key}={generation.get(key)!r} but calibration used {record.decoding[key]!r}"
            )
    problems.extend(dtype_mismatches(record, generation))
    template = generation.get("chat_template_sha256")
    if template != record.chat_template_sha256:
        problems.append("the tokenizer's chat template differs from the calibrated one")
    return (
        problems + conversation_mismatches(record, generation) + tool_mismatches(record, generation)
    )


def decode_path_problem(got: Any, calibrated: Any) -> str:
    """Why a response decoded on path ``got`` is refused by a guard calibrated on path
    ``calibrated``."""
    return (
        f"decode_path={got!r} but calibration used {calibrated!r}: the response was decoded "
        f"with {_describe_path(got)}, the guard was calibrated with {_describe_path(calibrated)}; "
        "the two differ in the last bits of every score. Load the model with the calibrated "
        "batch_decode and prefix_cache on the same library version (a guard sets the "
        "calibrated attention-parts rule itself), or calibrate again on this path"
    )


def _describe_path(record: Any) -> str:
    if not isinstance(record, Mapping):
        return "an unrecorded decode path" if record is None else repr(record)
    prompt = (
        f"prompt passes split after the shared prefix ({record['prefix']})"
        if record.get("prefix")
        else "each prompt in one pass"
    )
    parts = record.get("parts")
    if isinstance(parts, Mapping):
        prompt += (
            f", attention parts kept within {parts.get('cache_budget_bytes')} bytes and dense "
            f"up to {parts.get('dense_max_sources')} sources"
        )
    if record.get("steps") == "shared":
        return (
            f"{prompt}, shared decode steps on {record.get('threads')} BLAS thread(s), padded "
            f"to {record.get('min_rows')} rows"
        )
    if record.get("steps") == "alone":
        return f"{prompt}, each row decoded alone on {record.get('threads')} BLAS thread(s)"
    return repr(record)


def dtype_mismatches(record: DeploymentRecord, generation: Mapping[str, Any]) -> list[str]:
    """A response generated with the weights in another dtype than at calibration (its
    scores differ by far more than the last bits); nothing to check without a recorded one."""
    calibrated = record.decoding.get("dtype")
    if calibrated is None:
        return []
    got = generation.get("dtype")
    if got == calibrated:
        return []
    return [
        f"dtype={got!r} but calibration used {calibrated!r}: the response was generated with "
        f"the model in {got or 'an unrecorded dtype'} and the guard was calibrated on "
        f"{calibrated}; load the model with dtype=torch.{calibrated} (as at calibration) or "
        f"calibrate again in {got or 'the dtype you deploy'}"
    ]


def conversation_mismatches(record: DeploymentRecord, generation: Mapping[str, Any]) -> list[str]:
    """Why a response's prompt is not of a calibrated shape: it carried earlier messages
    (``history_messages``) but the artifact was calibrated on single questions."""
    earlier = generation.get("history_messages")
    if not earlier or record.calibrated_on_conversations:
        return []
    return [conversation_refusal(int(earlier))]


def conversation_refusal(earlier: int) -> str:
    """The refusal of a prompt with ``earlier`` messages before its question by an artifact
    calibrated on single questions, saying how to calibrate on conversations."""
    return (
        f"this artifact was calibrated on single questions; this request carries {earlier} "
        f"earlier message{'s' if earlier != 1 else ''} before its question: calibrate on "
        "conversations (data rows with a 'history' list of earlier user/assistant turns and "
        f"a 'conversation_id'; see docs/agents.md (conversations)), or send one question at a time"
    )


def tool_mismatches(record: DeploymentRecord, generation: Mapping[str, Any]) -> list[str]:
    """Why the tools a response was generated with differ from the calibrated ones: the
    schemas offered (by hash), and for an agent the tool-call format and prompted block."""
    problems: list[str] = []
    offered = generation.get("tools_sha256")
    if offered != record.tools_sha256:
        calibrated = [schema_name(t) for t in record.tools or []]
        problems.append(
            "the response was generated with other tools than calibration offered "
            f"(calibrated: {calibrated or 'no tools'}); bind the calibrated tools"
            if offered is not None
            else f"the response was generated without tools but calibration offered {calibrated}"
        )
    agent = record.agent
    if agent is not None and offered is not None:
        fmt = generation.get("tool_call_format")
        if agent.tool_call_format is not None and fmt != agent.tool_call_format:
            problems.append(
                f"tool_call_format={fmt!r} but calibration used {agent.tool_call_format!r}"
            )
        if generation.get("tool_prompt_sha256") != agent.tool_prompt_sha256:
            problems.append("the tool block in the system prompt differs from the calibrated one")
    return problems


def schema_name(schema: Mapping[str, Any]) -> str:
    """The tool name of an OpenAI-format schema."""
    return str((schema.get("function") or {}).get("name", schema.get("name", "?")))


def _norm(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    if value == []:
        return None
    return value


def api_response_mismatches(record: DeploymentRecord, metadata: Mapping[str, Any]) -> list[str]:
    """What can be checked of an API chat model's response: its engine, and no more tokens
    than the calibrated budget (the rest: :data:`API_UNVERIFIED`)."""
    problems = backend_mismatches(record, metadata)
    budgets = [p.max_new_tokens for p in record.prompts.values()]
    logprobs = metadata.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    n = len(content) if isinstance(content, list) else None
    if n is None or not budgets or n <= max(budgets):
        return problems
    return [
        *problems,
        f"the response has {n} tokens but calibration's budget was {max(budgets)}; call the "
        "model with the recorded max_tokens (load_guard_chain binds it)",
    ]


def backend_mismatches(record: DeploymentRecord, metadata: Mapping[str, Any]) -> list[str]:
    """Where the vLLM engine that generated a response (its ``backend`` record) differs from
    the one calibration ran on (``decoding["decode_path"]``)."""
    if record.decoding.get("backend") != "vllm":
        return []
    path = record.decoding.get("decode_path")
    calibrated = path if isinstance(path, Mapping) else {}
    got = metadata.get("backend")
    if not isinstance(got, Mapping):
        return [
            "the response was not generated on the vLLM backend the artifact was calibrated "
            "on; generate with VLLMChatModel (load_guard_chain builds it)"
        ]
    if not calibrated.get("model_sha256"):  # None == None would pass any weights
        return [
            "the artifact records no verified identity of the served model (model_sha256): "
            "a server with any weights of the same shape would pass; recalibrate on a server "
            "whose connector verifies it"
        ]
    differ = sorted(k for k in calibrated if got.get(k) != calibrated[k])
    if not differ:
        return []
    pairs = ", ".join(f"{k} {got.get(k)!r} (calibrated {calibrated[k]!r})" for k in differ)
    return [f"the vLLM engine differs from calibration's: {pairs}; recalibrate on this engine"]


API_UNVERIFIED = (
    "the system prompt and token budget of each call to the API chat model: its responses "
    "record no generation settings, so only the model's class and settings and each "
    "answer's length are checked; send every question through load_guard_chain's chain "
    "(the recorded prompt, max_tokens bound)"
)
"""What a guard around an API chat model cannot verify (``guarantee["unverified"]``)."""


def model_mismatches(
    artifact_fingerprint: str | None,
    models: Sequence[Any],
    chat_model: ChatModelRecord | None = None,
) -> list[str]:
    """Why chat models inside a guarded runnable (fallbacks too) differ from the calibrated
    model: another fingerprint, none (unverifiable), or for an API model another class or
    settings than ``chat_model``'s."""
    if artifact_fingerprint is None:
        return []
    problems: list[str] = []
    for model in models:
        fp = getattr(model, "fingerprint", None)
        if callable(fp):
            fp = fp()
        name = type(model).__name__
        if fp is None and chat_model is not None:
            problems.extend(identity_mismatches(chat_model, model))
        elif fp is None:
            problems.append(
                f"chat model {name} has no fingerprint, so it cannot be verified to be the "
                f"calibrated model {artifact_fingerprint!r}"
            )
        elif str(fp) != artifact_fingerprint:
            problems.append(
                f"chat model {name} is {str(fp)!r}, but this artifact was calibrated for "
                f"{artifact_fingerprint!r}"
            )
    return problems


def tool_steps_problem(record: DeploymentRecord, tool_steps: int) -> str | None:
    """Why a final answer after ``tool_steps`` tool results is outside the range (min..max,
    not the histogram's members) of calibration's final answers; None: inside, or nothing
    recorded."""
    seen = record.agent.tool_steps if record.agent is not None else {}
    counts = [int(k) for k in seen]
    if not counts or min(counts) <= tool_steps <= max(counts):
        return None
    return (
        f"this final answer came after {tool_steps} tool step(s), outside the range of "
        f"calibration's final answers (between {min(counts)} and {max(counts)} tool steps: "
        f"{dict(seen)} runs by tool steps); calibrate on questions that take as many steps, "
        "or force the agent's tool use as calibrated"
    )
