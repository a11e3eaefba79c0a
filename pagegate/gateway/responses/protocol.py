"""Request models of POST /v1/responses (OpenAI's Responses API), validated like the chat request.

Input is a string or a list of items: messages (with or without `type`), earlier `function_call`s and their
`function_call_output`s, and `reasoning` items a client hands back.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, Tag, model_validator

from pagegate.engine.sampling.structured import MAX_TOOLS
from pagegate.gateway.protocol import FUNCTION_NAME, INT32, INTEGRAL, StrictModel, by_type


class InputText(StrictModel):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # output_text handed back
    logprobs: list[Any] | None = None


class InputImage(StrictModel):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)  # a data: URL, or http(s) from a host --allowed-media-domains names
    detail: Literal["auto", "low", "high"] | None = None  # read, not used: the model's processor sets the tiling


InputPart = Annotated[Annotated[InputText, Tag("InputText")] | Annotated[InputImage, Tag("InputImage")],
                      by_type(input_text="InputText", output_text="InputText", text="InputText",
                              input_image="InputImage")]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, InputText))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """Its content as a chat message's: text, or text and image_url parts in order when it holds images."""
        if isinstance(self.content, str) or not any(isinstance(part, InputImage) for part in self.content):
            return self.text()
        return [{"type": "image_url", "image_url": {"url": part.image_url}} if isinstance(part, InputImage)
                else {"type": "text", "text": part.text} for part in self.content]


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _message_by_default(item: Any) -> Any:
    """An item with a role and no type is a message (the SDK's EasyInputMessage)."""
    if isinstance(item, dict) and "type" not in item and "role" in item:
        return {"type": "message", **item}
    return item


ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})
InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type"), BeforeValidator(_message_by_default)]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# OpenAI's bounds on a request's metadata: its keys, and the characters of a key and of a value.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def _bounded_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValueError(f"too many properties: at most {MAX_METADATA_KEYS}, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"a key is {len(key)} characters long, at most {MAX_METADATA_KEY_CHARS}: {key[:32]!r}...")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"the value of {key!r} is {len(value)} characters long, at most "
                             f"{MAX_METADATA_VALUE_CHARS}")
    return metadata


Metadata = Annotated[dict[str, str], AfterValidator(_bounded_metadata)]


class ResponsesRequest(StrictModel):
    """POST /v1/responses."""

    unsupported: ClassVar[frozenset[str]] = frozenset({"background", "conversation", "prompt", "max_tool_calls"})

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32), INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: Metadata | None = None
    user: str | None = None
    include: list[str] | None = None  # nothing extra to include: accepted and ignored
    truncation: Literal["disabled", "auto"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: str | None = None  # as on chat completions: the prompt's pages pinned under it
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=0), INTEGRAL] | None = None  # logprobs: not yet on this API
    stream_options: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat completions

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, FunctionChoice) and self.tool_choice.name not in {
                tool.name for tool in self.tools or ()}:
            raise ValueError(f"the function {self.tool_choice.name!r} is not among the tools")
        return self
