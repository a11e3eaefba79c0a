"""Response shapes, as pydantic models: the source of /openapi.json and of the tests' shape checks.

The routes build plain dicts for speed; these models describe exactly those dicts (OpenAI's shapes).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry, keyed by token id: the prompt token's and the top alternatives'."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # one per prompt token; the first is null


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the answer is only tool calls
    tool_calls: list[ToolCall]  # empty when the answer made none
    reasoning_content: str | None = None  # the <think> block, with a reasoning parser


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed piece of a call: the first has id, type and name; arguments add up over the pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    state: Literal["loaded", "loading", "sleeping", "unloaded", "failed"] | None = None  # several models: each's
    reason: str | None = None  # why it failed


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    sep_token: str | None
    cls_token: str | None
    mask_token: str | None
    eos_token_ids: list[int]
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class HealthResponse(BaseModel):
    status: str
    reason: str | None = None
    grade: Any = None


class VersionResponse(BaseModel):
    version: str


# -- several models and LoRA adapters at run time (routes_models) ---------------------------------------
# NOTE: these handlers read their one or two fields from the body themselves (there is no parse_request on
# them) and ignore any other field, so the body models below describe what is read and are not strict.

ServedModelState = Literal["loaded", "loading", "sleeping", "unloaded", "failed"]


class ModelNameBody(BaseModel):
    """POST /models/load and /models/unload (llama.cpp's router): the model, here or as `?model=NAME`."""

    model: str


class DefaultModelNameBody(BaseModel):
    """POST /sleep and /wake_up (vLLM's): the model, here or as `?model=NAME`; none names the default model."""

    model: str | None = None


class ModelStateResponse(BaseModel):
    """The model's state once the load, unload, sleep or wake is done."""

    success: Literal[True]
    model: str
    state: ServedModelState
    reason: str | None  # why it failed (None unless it did)


class IsSleepingResponse(BaseModel):
    model: str
    is_sleeping: bool


class LoadLoRAAdapterBody(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve the PEFT adapter in the folder `lora_path` as `lora_name`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterBody(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1)


# -- Anthropic's Messages API (/v1/messages/...) -----------------------------------------------------------

class AnthropicErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, overloaded_error, ...
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error of the Messages API's routes, in Anthropic's shape (errors.anthropic_error_body)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageTokenCount(BaseModel):
    """POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages would render it."""

    input_tokens: int
