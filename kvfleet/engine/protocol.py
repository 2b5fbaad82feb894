"""Wire models of the OpenAI-compatible HTTP API (pydantic), so FastAPI publishes a precise
OpenAPI document and every request is validated before it reaches the engine.

Requests follow the OpenAI API; non-OpenAI sampling parameters (`top_k`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `priority`, `skip_special_tokens`) follow vLLM's names.
kvfleet adds `deadline_seconds`; `return_token_ids` (vLLM's name) adds each choice's generated
token ids, which the router's greedy probes compare token by token. Fields we accept for
compatibility but cannot honour (`n > 1`, `logprobs`, penalties, tools, ...) are rejected with
a 400 naming the field instead of being silently ignored. Unknown fields are rejected too
(`extra="forbid"`), so a typo in a parameter name is an error, not a silently default-valued
request.

Responses add two things to OpenAI's shape:
- `system_fingerprint` carries the model revision (the artifact hash when known);
- every streamed chunk carries `seq`, a per-request sequence number starting at 0 that
  increases by one per event, so a client (or a replay after an idempotent retry) can detect
  gaps and duplicates. The last chunk carries `usage` and the `finish_reason`.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool
from pydantic.alias_generators import to_camel

FinishReason = Literal["stop", "length", "cancelled", "deadline", "error"]

# Generous bounds: they stop absurd values at the door; the real limits (context length,
# KV pool) are checked against the loaded model at admission.
MAX_TOKENS_LIMIT = 1 << 20
MAX_STOP_SEQUENCES = 16
# The model's sampling defaults as JSON (`kvfleet serve --sampling-defaults`).
SAMPLING_DEFAULTS_ENV = "KVFLEET_SAMPLING_DEFAULTS"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """vLLM's stream options. The last chunk always carries `usage` (so `include_usage` is
    always honoured); `continuous_usage_stats` puts the running counts on every chunk, which
    benchmark clients such as guidellm read to time each token."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(default=None, description="Served model name; optional.")
    stream: StrictBool = False  # ("false", a string, is a 400: the router reads it so too)
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] = Field(
        default=-1, description="vLLM: consider only the k most likely tokens; -1 or 0 = all."
    )
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=256
    )
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: Annotated[int, Field(ge=-1000, le=1000)] = Field(
        default=0, description="vLLM: lower values are scheduled first (priority policy)."
    )
    deadline_seconds: Annotated[float, Field(gt=0.0, le=86_400.0)] | None = Field(
        default=None,
        description="kvfleet: end the request with finish_reason 'deadline' this many seconds "
        "after arrival. The X-Kvfleet-Deadline-Seconds header sets the same.",
    )
    n: Annotated[int, Field(ge=1, le=128)] = Field(default=1, description="Only 1 is served.")
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(default=None, max_length=256)
    return_token_ids: bool = Field(
        default=False, description="vLLM: add the generated token ids to each choice (and "
        "each streamed chunk's new ones).")

    def usage_on_every_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


SamplingFieldsT = TypeVar("SamplingFieldsT", bound=SamplingFields)


class SamplingDefaults(BaseModel):
    """The model's own sampling defaults (a ModelArtifact's `spec.samplingDefaults`, which the
    operator passes as `$KVFLEET_SAMPLING_DEFAULTS`): used for every field a request leaves
    unset, as vLLM applies a model's generation_config. Spelled as in the artifact
    (`topK`, `maxTokens`) or as in a request (`top_k`, `max_tokens`)."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None

    def apply(self, body: SamplingFieldsT) -> SamplingFieldsT:
        """`body` with each field it did not set taken from these defaults."""
        unset = {"temperature", "top_p", "top_k"} - body.model_fields_set
        update: dict[str, object] = {k: getattr(self, k) for k in unset
                                     if getattr(self, k) is not None}
        if self.max_tokens is not None and not {"max_tokens", "max_completion_tokens"} & \
                body.model_fields_set:
            update["max_tokens"] = self.max_tokens
        return body.model_copy(update=update) if update else body


class CompletionRequest(SamplingFields):
    # (The example is also the fuzzer's first case: a request it knows to be served.)
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"prompt": "The capital of France is", "max_tokens": 4}]})

    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[int]] = Field(
        description="One prompt: text or token ids (a one-element batch is accepted)."
    )
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Clients attach fields like `name`; tolerated, but only role/content reach the template.
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}]})

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    response_format: dict[str, object] | None = None


# --- responses ------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = Field(
        default=None, description="`cached_tokens`: prompt tokens served from the prefix cache."
    )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    seq: int
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    seq: int
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvfleet"
    root: str
    max_model_len: int
    revision: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthResponse(BaseModel):
    status: Literal["ok", "failed"] = "ok"
    state: str
    reason: str | None = None  # why the engine failed (its watchdog's finding)


class ReadyResponse(BaseModel):
    ready: bool
    state: str
    reason: str | None = None
