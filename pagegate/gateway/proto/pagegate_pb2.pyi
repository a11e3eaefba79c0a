from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StringList(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, items: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenIdLists(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, items: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class StreamOptions(_message.Message):
    __slots__ = ("include_usage", "continuous_usage_stats")
    INCLUDE_USAGE_FIELD_NUMBER: _ClassVar[int]
    CONTINUOUS_USAGE_STATS_FIELD_NUMBER: _ClassVar[int]
    include_usage: bool
    continuous_usage_stats: bool
    def __init__(self, include_usage: _Optional[bool] = ..., continuous_usage_stats: _Optional[bool] = ...) -> None: ...

class CompletionRequest(_message.Message):
    __slots__ = ("model", "text", "texts", "token_ids", "token_id_lists", "max_tokens", "echo", "logprobs", "best_of", "response_format", "n", "temperature", "top_p", "stream_options", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens", "priority", "cache_salt", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "include_stop_str_in_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_LISTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_JSON_FIELD_NUMBER: _ClassVar[int]
    GUIDED_REGEX_FIELD_NUMBER: _ClassVar[int]
    GUIDED_CHOICE_FIELD_NUMBER: _ClassVar[int]
    GUIDED_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    texts: StringList
    token_ids: TokenIds
    token_id_lists: TokenIdLists
    max_tokens: int
    echo: bool
    logprobs: int
    best_of: int
    response_format: _struct_pb2.Struct
    n: int
    temperature: float
    top_p: float
    stream_options: StreamOptions
    stop: _containers.RepeatedScalarFieldContainer[str]
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[str, float]
    seed: int
    user: str
    top_k: int
    min_p: float
    repetition_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    priority: int
    cache_salt: str
    structured_outputs: _struct_pb2.Struct
    guided_json: _struct_pb2.Value
    guided_regex: str
    guided_choice: StringList
    guided_grammar: str
    include_stop_str_in_output: bool
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., texts: _Optional[_Union[StringList, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., token_id_lists: _Optional[_Union[TokenIdLists, _Mapping]] = ..., max_tokens: _Optional[int] = ..., echo: _Optional[bool] = ..., logprobs: _Optional[int] = ..., best_of: _Optional[int] = ..., response_format: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[str, float]] = ..., seed: _Optional[int] = ..., user: _Optional[str] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., structured_outputs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., guided_json: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., guided_regex: _Optional[str] = ..., guided_choice: _Optional[_Union[StringList, _Mapping]] = ..., guided_grammar: _Optional[str] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("type", "text")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    type: str
    text: str
    def __init__(self, type: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ContentParts(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, items: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class FunctionCall(_message.Message):
    __slots__ = ("name", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "type", "function")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    function: FunctionCall
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., function: _Optional[_Union[FunctionCall, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "text", "parts", "name", "tool_calls", "tool_call_id", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    text: str
    parts: ContentParts
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., text: _Optional[str] = ..., parts: _Optional[_Union[ContentParts, _Mapping]] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("model", "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls", "n", "temperature", "top_p", "stream_options", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens", "priority", "cache_salt", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "include_stop_str_in_output", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "reasoning_effort", "prompt_cache_key", "prompt_cache_retention")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_JSON_FIELD_NUMBER: _ClassVar[int]
    GUIDED_REGEX_FIELD_NUMBER: _ClassVar[int]
    GUIDED_CHOICE_FIELD_NUMBER: _ClassVar[int]
    GUIDED_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_RETENTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_tokens: int
    max_completion_tokens: int
    logprobs: bool
    top_logprobs: int
    response_format: _struct_pb2.Struct
    tools: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Struct]
    tool_choice: _struct_pb2.Value
    parallel_tool_calls: bool
    n: int
    temperature: float
    top_p: float
    stream_options: StreamOptions
    stop: _containers.RepeatedScalarFieldContainer[str]
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[str, float]
    seed: int
    user: str
    top_k: int
    min_p: float
    repetition_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    priority: int
    cache_salt: str
    structured_outputs: _struct_pb2.Struct
    guided_json: _struct_pb2.Value
    guided_regex: str
    guided_choice: StringList
    guided_grammar: str
    include_stop_str_in_output: bool
    chat_template_kwargs: _struct_pb2.Struct
    add_generation_prompt: bool
    continue_final_message: bool
    reasoning_effort: str
    prompt_cache_key: str
    prompt_cache_retention: str
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., max_completion_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., response_format: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[_struct_pb2.Struct, _Mapping]]] = ..., tool_choice: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[str, float]] = ..., seed: _Optional[int] = ..., user: _Optional[str] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., structured_outputs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., guided_json: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., guided_regex: _Optional[str] = ..., guided_choice: _Optional[_Union[StringList, _Mapping]] = ..., guided_grammar: _Optional[str] = ..., include_stop_str_in_output: _Optional[bool] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., reasoning_effort: _Optional[str] = ..., prompt_cache_key: _Optional[str] = ..., prompt_cache_retention: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PromptTokensDetails(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., prompt_tokens_details: _Optional[_Union[PromptTokensDetails, _Mapping]] = ...) -> None: ...

class CompletionLogprobs(_message.Message):
    __slots__ = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    token_logprobs: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Value]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Value]
    text_offset: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[str]] = ..., token_logprobs: _Optional[_Iterable[_Union[_struct_pb2.Value, _Mapping]]] = ..., top_logprobs: _Optional[_Iterable[_Union[_struct_pb2.Value, _Mapping]]] = ..., text_offset: _Optional[_Iterable[int]] = ...) -> None: ...

class CompletionChoice(_message.Message):
    __slots__ = ("index", "text", "logprobs", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    logprobs: CompletionLogprobs
    finish_reason: str
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Union[CompletionLogprobs, _Mapping]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("id", "object", "created", "model", "choices", "usage")
    ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    object: str
    created: int
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[CompletionChoice]
    usage: Usage
    def __init__(self, id: _Optional[str] = ..., object: _Optional[str] = ..., created: _Optional[int] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[CompletionChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "logprob", "bytes")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ..., bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "bytes", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    bytes: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ..., bytes: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class ChatLogprobs(_message.Message):
    __slots__ = ("content",)
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    content: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, content: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class AssistantMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class ChatChoice(_message.Message):
    __slots__ = ("index", "message", "logprobs", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs
    finish_reason: str
    def __init__(self, index: _Optional[int] = ..., message: _Optional[_Union[AssistantMessage, _Mapping]] = ..., logprobs: _Optional[_Union[ChatLogprobs, _Mapping]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class ChatCompletion(_message.Message):
    __slots__ = ("id", "object", "created", "model", "choices", "usage")
    ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    object: str
    created: int
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[ChatChoice]
    usage: Usage
    def __init__(self, id: _Optional[str] = ..., object: _Optional[str] = ..., created: _Optional[int] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[ChatChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "type", "function")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    type: str
    function: FunctionCall
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., type: _Optional[str] = ..., function: _Optional[_Union[FunctionCall, _Mapping]] = ...) -> None: ...

class ChatDelta(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class ChatChunkChoice(_message.Message):
    __slots__ = ("index", "delta", "logprobs", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs
    finish_reason: str
    def __init__(self, index: _Optional[int] = ..., delta: _Optional[_Union[ChatDelta, _Mapping]] = ..., logprobs: _Optional[_Union[ChatLogprobs, _Mapping]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class ChatCompletionChunk(_message.Message):
    __slots__ = ("id", "object", "created", "model", "choices", "usage")
    ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    object: str
    created: int
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[ChatChunkChoice]
    usage: Usage
    def __init__(self, id: _Optional[str] = ..., object: _Optional[str] = ..., created: _Optional[int] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[ChatChunkChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "object", "created", "owned_by", "root", "max_model_len", "state", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int
    state: str
    reason: str
    def __init__(self, id: _Optional[str] = ..., object: _Optional[str] = ..., created: _Optional[int] = ..., owned_by: _Optional[str] = ..., root: _Optional[str] = ..., max_model_len: _Optional[int] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ModelList(_message.Message):
    __slots__ = ("object", "data")
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    object: str
    data: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, object: _Optional[str] = ..., data: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...
