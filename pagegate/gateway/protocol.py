"""Request models of the OpenAI-compatible API (pydantic v2) and the one function that validates a dict.

Every front end (HTTP JSON, msgpack, a later gRPC door) hands a plain dict to `parse_request`;
the errors come back as `APIError`s that already carry the OpenAI `param`. Text anywhere in a body
must be encodable as UTF-8 and numbers must be finite, or the request is a 400 naming the field.
Integer fields take integral floats (5.0), as JSON Schema does; the schema of /openapi.json comes from
these models, cross-field rules included where JSON Schema can state them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pagegate.engine.sampling.params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    PRIORITY_RANGE,
    REPETITION_PENALTY_RANGE,
)
from pagegate.engine.sampling.structured import MAX_TOOLS
from pagegate.gateway.errors import BadRequest

MAX_N = 128  # choices per request
MAX_LOGPROBS = 20
MAX_STOP = 16
INT64 = 2**63 - 1
INT32 = 2**31 - 1
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = REPETITION_PENALTY_RANGE
MIN_PRIORITY, MAX_PRIORITY = PRIORITY_RANGE


def _integral(value: Any) -> Any:
    """5.0 is the integer 5: JSON has one number type and JavaScript clients send 5.0 for 5.

    Strict mode still rejects what comes back unchanged: 5.5, NaN, booleans and "5".
    """
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# Last in an Annotated, after the bounds: placed before them, pydantic writes "ge"/"le" into the JSON schema.
INTEGRAL = BeforeValidator(_integral)
TokenId = Annotated[int, Field(ge=0), INTEGRAL]
NonEmpty = Field(min_length=1)
PromptValue = str | list[str] | list[int] | list[list[int]]
# The same four shapes as the JSON schema states them: lists not empty, token ids >= 0.
PromptShape = (str | Annotated[list[str], NonEmpty] | Annotated[list[TokenId], NonEmpty]
               | Annotated[list[Annotated[list[TokenId], NonEmpty]], NonEmpty])


def _token_ids(value: Any) -> list[int] | None:
    """`value` as a non-empty list of token ids (ints >= 0, integral floats allowed), else None."""
    if not isinstance(value, list) or not value:
        return None
    ids = [_integral(item) for item in value]
    return ids if all(type(item) is int and item >= 0 for item in ids) else None


def _check_prompt(value: Any) -> PromptValue:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return value
        if (ids := _token_ids(value)) is not None:
            return ids
        lists = [ids for item in value if (ids := _token_ids(item)) is not None]
        if len(lists) == len(value):
            return lists
    raise ValueError("expected a string, a list of strings, a list of token ids (ints >= 0) "
                     "or a list of token-id lists, and not empty")


Prompt = Annotated[PromptValue, PlainValidator(_check_prompt, json_schema_input_type=PromptShape)]
TOKEN_ID_TEXT = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() also takes "²", which int() refuses
# JSON keys are strings, msgpack keys may be ints: either way a token id (the vocabulary is checked later).
LogitBias = Annotated[dict[str | Annotated[int, INTEGRAL], Annotated[float, Field(ge=-100, le=100)]],
                      Field(max_length=MAX_LOGIT_BIAS,
                            json_schema_extra={"propertyNames": {"pattern": f"^{TOKEN_ID_TEXT.pattern}$"}})]

# sampling_params() refuses an empty stop string; the schema says so where the type cannot.
StopText = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]


def _needs_true(field: str, flag: str) -> dict[str, Any]:
    """JSON Schema for a cross-field rule the validators enforce: `field` given (not null) needs `flag` true."""
    return {"if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
            "then": {"required": [flag], "properties": {flag: {"const": True}}}}


STREAM_OPTIONS_NEED_STREAM = _needs_true("stream_options", "stream")
TOOL_CHOICE_NEEDS_TOOLS: dict[str, Any] = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"type": "null"}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array"}}}}


class StrictModel(BaseModel):
    # allow_inf_nan: Python's json reads NaN/Infinity literals and msgpack carries them; no knob takes them.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    # OpenAI fields this server recognises but does not implement; `parse_request` names them in a 400.
    unsupported: ClassVar[frozenset[str]] = frozenset()


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON value
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(json_schema_extra={"if": {"properties": {"type": {"const": "json_schema"}}},
                                                 "then": {"required": ["json_schema"]}})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputs(StrictModel):
    """vLLM's structured_outputs: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = None
    choice: Annotated[list[StopText], NonEmpty] | None = None
    grammar: str | None = Field(None, description="A Lark grammar (llguidance's dialect) or GBNF.")
    json_object: bool | None = None


class SamplingFields(StrictModel):
    """The sampling knobs both completions and chat share (OpenAI's, then vLLM-style extras)."""

    model: str | None = Field(None, description="A served model name; omitted: the default model.")
    n: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] = 1
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: LogitBias | None = None
    seed: Annotated[int, Field(ge=-INT64 - 1, le=INT64), INTEGRAL] | None = None
    user: str | None = None
    # extras beyond OpenAI (vLLM names)
    top_k: Annotated[int, Field(ge=-1, le=INT32), INTEGRAL] | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = Field(
        None, description="Score the prompt: each prompt token's logprob and this many top alternatives "
                          "(not with stream).")
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT32, description="At most max_tokens."), INTEGRAL] = 0
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY,
                                   description="Lower runs first; only with --scheduling-policy priority."),
                        INTEGRAL] = 0
    cache_salt: str | None = Field(None, min_length=1)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[StopText], NonEmpty] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, bias: dict[str | int, float] | None) -> dict[str | int, float] | None:
        for key in bias or ():
            if not (key >= 0 if isinstance(key, int) else TOKEN_ID_TEXT.fullmatch(key)):
                raise ValueError(f"the keys are token ids (ints >= 0, as decimal strings in JSON), not {key!r}")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM]})
    unsupported: ClassVar[frozenset[str]] = frozenset({"suffix"})

    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0, le=INT32, description="0 only with echo: the prompt is scored, "
                                                                 "nothing generated."), INTEGRAL] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    # JSON Schema cannot compare two fields, so only the description carries this rule; the server checks it.
    best_of: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] | None = Field(
        None, description="Only equal to `n` (the default 1) is accepted: every sampled choice is returned.")

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo: true (the prompt is returned, nothing is generated)")
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: only the prompt (and its logprobs) comes back."""
        return self.echo and self.max_tokens == 0


class EmbeddingRequest(StrictModel):
    """POST /v1/embeddings."""

    input: Prompt
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    user: str | None = None
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY), INTEGRAL] = 0


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: str  # a data: URL (base64), or http(s) from a host --allowed-media-domains names
    detail: Literal["auto", "low", "high"] | None = None  # read, not used: the model's processor sets the tiling


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageURL


def by_type(**tags: str) -> Discriminator:
    """Chooses a union's member by the `type` field: the tag of each type value, a model's name, so an error's
    location names the part by its fields only (`_is_field` drops capitalized tags)."""
    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    return Discriminator(tag)


ContentPart = Annotated[Annotated[TextPart, Tag("TextPart")] | Annotated[ImagePart, Tag("ImagePart")],
                        by_type(text="TextPart", image_url="ImagePart")]


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of the arguments object; omitted: the function takes none.")
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _describes_an_object(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None and schema.get("type", "object") != "object":
            raise ValueError("the arguments are a JSON object, so the schema's type must be 'object'")
        return schema


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(StrictModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(StrictModel):
    """A call an earlier assistant turn made, as the API returned it."""

    id: str
    type: Literal["function"]
    function: FunctionCall


# JSON Schema forms of ChatMessage's cross-field rules (the validator below enforces them).
_GIVEN: dict[str, Any] = {"not": {"type": "null"}}
MESSAGE_RULES: list[Any] = [
    {"if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
     "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": _GIVEN}}},
    {"if": {"required": ["tool_call_id"], "properties": {"tool_call_id": _GIVEN}},
     "then": {"properties": {"role": {"const": "tool"}}}},
    {"if": {"required": ["tool_calls"], "properties": {"tool_calls": _GIVEN}},
     "then": {"properties": {"role": {"const": "assistant"}}}},
    {"if": {"not": {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}},
     "then": {"required": ["content"], "properties": {"content": _GIVEN}}},
]


class ChatMessage(StrictModel):
    """One turn. Content may be left out only by an assistant turn that made tool calls.

    The role-dependent fields come before content, so each check sees the fields it depends on and a
    400 names the field at fault."""

    model_config = ConfigDict(json_schema_extra={"allOf": MESSAGE_RULES})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: str | None = Field(None, validate_default=True)  # tool turns: the call this is the result of
    name: str | None = None
    reasoning_content: str | None = None  # an assistant turn's thinking, as chat answers give it back
    content: str | list[ContentPart] | None = Field(None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _calls_of_the_assistant(cls, calls: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if calls is not None and info.data.get("role", "assistant") != "assistant":
            raise ValueError("tool_calls are only for assistant messages")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _id_of_a_tool_result(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role == "tool" and call_id is None:
            raise PydanticCustomError("missing", "a tool message needs the tool_call_id of the call it answers")
        if call_id is not None and role not in ("tool", None):
            raise ValueError("tool_call_id is only for tool messages")
        return call_id

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value: Any, info: ValidationInfo) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and info.data.get("role") != "user":
                raise ValueError("image_url parts are only for user messages")
            if kind not in ("text", "image_url"):
                raise ValueError(f"content parts of type {kind!r} are not supported; only 'text' and 'image_url'")
        return value

    @field_validator("content")
    @classmethod
    def _content_unless_calls(cls, content: str | list[ContentPart] | None,
                              info: ValidationInfo) -> str | list[ContentPart] | None:
        if content is None and not info.data.get("tool_calls") and "tool_calls" in info.data:
            raise PydanticCustomError("missing", "content is required, except in an assistant message with tool_calls")
        return content

    def text(self, image_token: str = "") -> str:
        """The text parts, joined; each image part as `image_token` (a vision model's placeholder)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextPart) else image_token for part in self.content)

    def image_urls(self) -> list[tuple[int, ImageURL]]:
        """(part index, image) of each image part, in order."""
        parts = self.content if isinstance(self.content, list) else []
        return [(i, part.image_url) for i, part in enumerate(parts) if isinstance(part, ImagePart)]


TEMPLATE_RESERVED = frozenset({"messages", "tools", "add_generation_prompt"})  # variables the server passes


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(json_schema_extra={
        "allOf": [STREAM_OPTIONS_NEED_STREAM, _needs_true("top_logprobs", "logprobs"), TOOL_CHOICE_NEEDS_TOOLS]})
    unsupported: ClassVar[frozenset[str]] = frozenset(
        {"functions", "function_call", "audio", "modalities", "prediction",
         "web_search_options", "store", "metadata", "service_tier"}
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1, le=INT32), INTEGRAL] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32), INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = Field(
        None, description="Needs tools; a named function must be one of them. Unset: auto with tools, else none.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per answer.")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="Passed to the chat template; one that only reads enable_thinking gets false for none "
                          "and minimal.")
    # vLLM's template extras
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="More variables for the chat template (e.g. Qwen3's enable_thinking).")
    add_generation_prompt: bool = True
    prompt_cache_key: str | None = Field(
        None, min_length=1, max_length=1024,
        description="Pin the prompt's KV pages under this key (for this API key) so later prompts with its prefix "
                    "find them cached.")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="How long a prompt_cache_key's pages stay pinned: 24h, else 5 minutes (each hit "
                          "renews it; pins give way to requests that need the pages).")
    continue_final_message: bool = Field(
        False, description="Go on writing the last (assistant) message instead of starting a new one; needs "
                           "add_generation_prompt false.")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or ()) & TEMPLATE_RESERVED)
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here: the server sets them")
        return kwargs

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("each function name may appear only once")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        tools: list[Tool] | None = info.data.get("tools")
        if choice is None or "tools" not in info.data:  # absent, or tools themselves were invalid
            return choice
        if not tools:
            raise ValueError("tool_choice is only allowed when tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"the function {choice.function.name!r} is not among the tools")
        return choice

    @property
    def tool_choice_mode(self) -> str:
        """One of none, auto, required, named; unset is OpenAI's default: auto with tools, else none."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @model_validator(mode="after")
    def _check_chat_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(StrictModel):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}},
    ]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(StrictModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


RequestT = TypeVar("RequestT", bound=StrictModel)


def parse_request(model_cls: type[RequestT], body: Any) -> RequestT:
    """Validate a decoded body (JSON or msgpack) into `model_cls`, or raise a 400 naming the param."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON (or msgpack) object.")
    check_text(body)
    for key in sorted(model_cls.unsupported & body.keys()):
        if body[key] is not None:
            raise BadRequest(f"`{key}` is not supported by this server.", param=key, code="unsupported_parameter")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise _bad_request(exc) from None


def _bad_request(exc: ValidationError) -> BadRequest:
    errors = exc.errors(include_url=False)
    first = _fields(errors[0]["loc"])
    # a union reports every member's failure: the member that got furthest into the value says what is wrong
    error = max((e for e in errors if _fields(e["loc"])[:len(first)] == first), key=lambda e: len(_fields(e["loc"])))
    param = ".".join(str(part) for part in _fields(error["loc"])) or None
    kind = error["type"]
    if kind == "missing":
        return BadRequest(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":  # a msgpack key need not be a string
        name = param or _short(error["loc"][-1])
        return BadRequest(f"Unrecognized request argument supplied: {name}", param=param, code="unknown_parameter")
    message = str(error["msg"]).removeprefix("Value error, ")
    if param:
        message = f"Invalid value for '{param}': {message}"
        if "input" in error and not kind.startswith("value_error"):
            message += f" (got {_short(error['input'])})"
    return BadRequest(message, param=param or None, code="invalid_value")


def _fields(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(part for part in loc if _is_field(part))


def _is_field(part: Any) -> bool:
    """Keep field names and list indexes of an error location, drop pydantic's union-member tags (a type's
    name, or a model class's: NamedToolChoice is no field a client sends; every API field is lower case)."""
    return isinstance(part, int) or (isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS
                                     and not part[0].isupper())


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_text(body: dict) -> None:
    """400 for the first string (value or key, at any depth) that UTF-8 cannot encode.

    JSON's "\\ud800" escape decodes to a lone surrogate, and msgpack's invalid UTF-8 arrives as
    surrogate escapes (see codec); tokenizers and the response writer would fail on either later.
    Iterative, so a deeply nested body cannot exhaust the Python stack.
    """
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), body)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if (bad := _unencodable_at(value)) is not None:
                raise _bad_text(path, value, bad)
        elif isinstance(value, dict):
            for key in value:
                if isinstance(key, str) and (bad := _unencodable_at(key)) is not None:
                    raise _bad_text(path, key, bad, key=True)
            pending.extend(((*path, key), item) for key, item in reversed(value.items())
                           if _may_hold_text(item))
        elif isinstance(value, list):
            pending.extend(((*path, index), value[index]) for index in reversed(range(len(value)))
                           if _may_hold_text(value[index]))


def _may_hold_text(value: Any) -> bool:
    return isinstance(value, (str, dict, list))


def _unencodable_at(text: str) -> int | None:
    """The index of the first character UTF-8 cannot encode (a surrogate), or None."""
    if text.isascii():
        return None
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _bad_text(path: tuple[str | int, ...], text: str, index: int, *, key: bool = False) -> BadRequest:
    param = ".".join(str(part) for part in path) or None
    where = ("a key of " if key else "") + (f"'{param}'" if param else "the body")
    message = (f"Invalid value for {where}: the text is not valid UTF-8 "
               f"(character {index} is U+{ord(text[index]):04X}, a lone surrogate or an undecodable byte).")
    return BadRequest(message, param=param, code="invalid_value")
