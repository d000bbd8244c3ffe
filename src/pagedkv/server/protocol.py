"""OpenAI-compatible request and response bodies (pydantic), plus vLLM's extra fields.

Requests validate their own types and ranges, so a bad field becomes a 400 naming it before
the engine sees anything. Every field is either honoured or refused: an unknown field is a
400 (`extra="forbid"`), and a known field the server cannot honour (`suffix`, `best_of`
other than 1 or n) is a 400 that names it. Only `user`, `metadata`, `store`,
`service_tier`, a message's `name` and the `strict` flags (schemas are always enforced) are
accepted and ignored: they ask nothing more of generation.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedkv.engine.sampling_params import SEED_MAX, SEED_MIN

# OpenAI caps `logprobs` (completions) and `top_logprobs` (chat) at 20.
MAX_LOGPROBS = 20
# A salt is kept in the prefix index's key of every cached first block.
MAX_CACHE_SALT_CHARS = 256


def random_id(prefix: str) -> str:
    """A fresh request id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def short(value: Any) -> str:
    """A value for an error message: scalars shown (strings cut), containers only sized."""
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"an object with {len(value)} keys"
    return repr(value)


class RequestModel(BaseModel):
    """A request body: unknown fields are refused and types are strict (no "5" for 5)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class StreamOptions(RequestModel):
    include_usage: bool = False


def _finite(**kwargs: Any) -> Any:
    return Field(allow_inf_nan=False, **kwargs)


class JsonSchemaFormat(RequestModel):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field({}, alias="schema")
    strict: bool | None = Field(None, description="Ignored: the schema is always enforced.")


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                f'response_format: expected json_schema exactly with type "json_schema", '
                f"got type {self.type!r} and json_schema {'set' if self.json_schema else 'unset'}"
            )
        return self


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model: str | None = Field(None, description="The served model's name; 404 for any other.")
    n: int = Field(1, ge=1, le=128)
    temperature: float = _finite(default=1.0, ge=0.0, description="0 is greedy.")
    top_p: float = _finite(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 keeps every token; 0 is refused.")
    min_p: float = _finite(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="64-bit seed.")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = Field(
        None,
        description="Token id (as a string) -> bias in [-100, 100] added to its logit "
        "before sampling; logprobs stay those of the unbiased logits.",
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="Requests share cached prompt prefixes only with requests of the same "
        "salt (vLLM's field); with --prefix-cache-isolation per-key, within the API key's own "
        "partition of the cache.",
    )
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Only 0 is supported.")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Only 0 is supported.")
    user: str | None = Field(None, description="Ignored.")
    metadata: dict[str, Any] | None = Field(None, description="Ignored.")
    store: bool | None = Field(None, description="Ignored.")
    service_tier: str | None = Field(None, description="Ignored.")
    response_format: ResponseFormat | None = Field(
        None, description="Constrains the output: JSON object, or JSON under a schema."
    )
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's constraint: exactly one of json (a schema), regex, choice (a list "
        "of strings), grammar (EBNF).",
    )

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # Values are checked by `SamplingParams`, as `stop` is.
        for token in bias or {}:
            if not token.isdigit():
                raise ValueError(f"expected token ids as keys, got {short(token)}")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: expected only with stream: true, got stream: false")
        return self


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a prompt as text, token ids, or a batch of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(
        16,
        ge=0,
        description="New tokens per choice; 0 only with echo: true (the prompt alone comes "
        "back). Prompt tokens + max_tokens must not exceed the model's context (400).",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Top logprobs per token; with echo: true the prompt's tokens get them too "
        "(the first prompt token's entry is null).",
    )
    echo: bool = Field(False, description="Return the prompt before the completion.")
    suffix: None = Field(None, description="Not supported: any value but null is refused (400).")
    best_of: int | None = Field(
        None, ge=1, description="Only 1 or n is supported (the n samples are returned as they are)."
    )

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("expected a non-empty prompt, got []")
        if any(isinstance(p, list) and not p for p in prompt):
            raise ValueError("expected non-empty token-id prompts, got []")
        return prompt  # the engine checks the token ids against the vocabulary

    @model_validator(mode="after")
    def _cross_field_rules(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: expected >= 1 (0 only with echo: true), got 0")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise ValueError(
                f"best_of: expected 1 or n ({self.n}): other values are not supported, "
                f"got {self.best_of}"
            )
        return self


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(None, description="Ignored.")
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's earlier calls.")
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")

    def text(self) -> str:
        """The content as plain text (OpenAI's list-of-parts form joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"content: expected text parts, got type {short(part.get('type'))}"
                )
        return "".join(part["text"] for part in self.content)


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema.")
    strict: bool | None = Field(None, description="Ignored: constrained calls always follow it.")


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Default: what the context leaves after the prompt. Prompt tokens + "
        "max_tokens must not exceed the model's context (400).",
    )
    max_completion_tokens: int | None = Field(None, ge=1, description="Takes max_tokens' place.")
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Needs logprobs: true."
    )
    tools: list[ChatTool] | None = Field(
        None, description="Functions the model may call; rendered through the chat template."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description='Default "auto" with tools. A named function or "required" constrain the '
        "output to the functions' schemas; \"auto\" parses the model's own tool-call format.",
    )
    parallel_tool_calls: bool | None = Field(
        None, description='false: "required" makes exactly one call.'
    )

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(
                f"top_logprobs: expected only with logprobs: true, got top_logprobs "
                f"{self.top_logprobs} with logprobs: false"
            )
        return self


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One piece of a streamed tool call: its first has the id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedkv"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
