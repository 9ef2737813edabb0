"""Request and response bodies of the OpenAI-compatible API (pydantic models only).

Requests accept unknown fields (`extra="allow"`): clients send vendor extras freely and a server
that rejects them breaks those clients; the serving layer logs what it ignores. Field names follow
OpenAI, plus the vLLM extras (`top_k`, `min_p`, `ignore_eos`, `repetition_penalty`, ...).
Known fields are checked as OpenAI checks them: booleans must be JSON booleans (not "yes"),
numbers finite, roles known, seeds in [0, 2^63); every string must be valid Unicode (a lone
surrogate such as "\ud800" cannot be tokenized)."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

SEED_MAX = (1 << 63) - 1


def invalid_unicode(value: Any, path: str = "") -> tuple[str, str] | None:
    """(where, what) of the first string in `value` (JSON data) that holds a lone surrogate."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, f"invalid Unicode: lone surrogate U+{ord(value[e.start]):04X} at character {e.start}"
    elif isinstance(value, dict):
        for k, v in value.items():
            found = invalid_unicode(k, path) or invalid_unicode(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = invalid_unicode(v, f"{path}.{i}")
            if found:
                return found
    return None


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Many clients send every field, unset ones as null ("n": null, "stream": null). Every
        # field's default here is what null means, so a null is simply dropped.
        if isinstance(data, dict):
            bad = invalid_unicode(data)
            if bad:
                raise PydanticCustomError("invalid_unicode", "{where}: {what}", {"where": bad[0], "what": bad[1]})
            return {k: v for k, v in data.items() if v is not None}
        return data

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


# ---------------------------------------------------------------------------------------------
# errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------
# shared request fields


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False   # vLLM extra: usage on every chunk


class SamplingFields(OpenAIBaseModel):
    """Fields common to chat and completions. None means "use the server default"."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)            # 0 or -1 = off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: StrictBool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


# ---------------------------------------------------------------------------------------------
# chat


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # agents: an assistant turn that called tools, and the tool's answer (role "tool")
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None       # accepted on input; templates drop past reasoning


# ---------------------------------------------------------------------------------------------
# tools, tool calls and structured output (chat only)


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = no arguments
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str                             # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------------------------------
# completions


class CompletionRequest(SamplingFields):
    # One prompt: text or token ids (a one-element list of either is accepted too).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None
    add_special_tokens: StrictBool = True


class CompletionLogprobs(BaseModel):
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
    usage: Usage | None = None


# ---------------------------------------------------------------------------------------------
# models, tokenize


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ninfer"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    kv_dtype: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    """Either `prompt` (completions style) or `messages` (chat style, chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
