"""The one place a validated request becomes engine inputs: prompts as token ids, SamplingParams, priority.

A second front end (gRPC) calls `prepare_completion(body_dict, model)` / `prepare_chat(...)` exactly as
the HTTP routes do, so validation, tokenization and limits stay identical across doors. Both doors run
them through `off_loop`: parsing and tokenizing a large request must never stall the event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pagegate.engine.errors import InvalidParamError
from pagegate.engine.limits import check_context, check_token_ids
from pagegate.engine.media.limits import ImageLimits
from pagegate.engine.media.placement import PlacedImage, place_images, template_parts
from pagegate.engine.media.processing import ImageProcessing
from pagegate.engine.pin import Pin
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.structured import StructuredOutputsParams
from pagegate.gateway.answer import THINK_CLOSE
from pagegate.gateway.chat_images import chat_images
from pagegate.gateway.errors import BadRequest, NotFound
from pagegate.gateway.lanes import ONLINE, Lane
from pagegate.gateway.prompt_cache import key_pin
from pagegate.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    Tool,
    parse_request,
)
from pagegate.gateway.tool_formats import TOOL_FORMATS, ToolFormat
from pagegate.gateway.tools import (
    CallParsing,
    call_grammar,
    check_tool_sizes,
    named_call_grammar,
    offered_tools,
    parameters_schema,
    template_messages,
)

T = TypeVar("T")
PREPARE_THREADS = 4  # worker threads for request preparation, shared by every door: a flood queues, never spawns
RENDER_THREADS = 2  # worker threads that build and encode large answers (scored prompts), apart from preparation


class TokenizerLike(Protocol):
    """What the gateway uses of a tokenizer (pagegate.engine.loading.tokenizer.Tokenizer fits)."""

    eos_token_ids: list[int]
    special_tokens: dict[str, str | None]
    chat_template: str | None

    @property
    def vocab_size(self) -> int: ...
    @property
    def max_chars_per_token(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    @property
    def chat_template_takes_tools(self) -> bool: ...
    @property
    def chat_template_variables(self) -> frozenset[str]: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str: ...
    def encode_chat(self, text: str) -> list[int]: ...
    def token_text(self, token_id: int) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass(frozen=True)
class ModelContext:
    """What request preparation needs to know about the served model."""

    names: tuple[str, ...]
    tokenizer: TokenizerLike | None
    max_model_len: int
    vocab_size: int
    default_sampling: dict[str, Any] = field(default_factory=dict)  # the folder's generation_config.json
    compile_grammar: Callable[[StructuredOutputsParams], None] | None = None  # None: no tokenizer, no grammars
    reasoning_parser: str | None = None  # splits <think> blocks off chat answers (--reasoning-parser)
    tool_call_parser: str = "hermes"  # the format the model writes tool calls in (--tool-call-parser)
    max_scoring_tokens: int | None = None  # --max-scoring-tokens: the bound of check_scoring (None: none)
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters served by name -> path (the host's)
    processing: ImageProcessing | None = None  # a vision-language model's image preprocessing (None: text only)
    image_limits: ImageLimits = field(default_factory=ImageLimits)  # what an image part may be (--limit-mm-per-prompt)

    @property
    def call_format(self) -> ToolFormat:
        return TOOL_FORMATS[self.tool_call_parser]

    @property
    def name(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The served name a request addresses (a LoRA adapter's too); unknown names are a 404 like OpenAI's."""
        if requested is None or requested in self.names or requested in self.adapters:
            return requested or self.name
        raise NotFound(f"The model `{requested}` does not exist.", param="model", code="model_not_found")

    def require_tokenizer(self, param: str) -> TokenizerLike:
        if self.tokenizer is None:
            raise BadRequest("This model has no tokenizer: send token ids, not text.", param=param)
        return self.tokenizer

    def check_text_fits(self, text: str, param: str) -> None:
        """Before tokenizing: a text longer than max_model_len tokens could ever cover is a 400 at once."""
        per_token = self.tokenizer.max_chars_per_token if self.tokenizer is not None else None
        if per_token is None or len(text) <= per_token * self.max_model_len:
            return
        raise BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                         f"{param} text is {len(text)} characters long, more than {self.max_model_len} tokens of "
                         f"at most {per_token} characters each can hold. Please shorten it.",
                         param=param, code="context_length_exceeded")


@dataclass
class EnginePrompt:
    token_ids: list[int]
    text: str | None  # the prompt as text, for echo (decoded lazily when given as ids)
    images: list[PlacedImage] = field(default_factory=list)  # the images its image tokens hold, in order


@dataclass
class PreparedRequest:
    """Everything the engine needs for one API request (one engine request per prompt)."""

    request: CompletionRequest | ChatCompletionRequest
    model: str
    prompts: list[EnginePrompt]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    tool_calls: CallParsing | None = None  # chat with tools offered: read calls from the output
    reasoning: str | None = None  # the reasoning parser that splits <think> blocks off the answer (chat)
    pin: Pin | None = None  # a stored response keeps its conversation's pages in the prefix cache
    # prompt caching the client asked for (prompt_cache.py): its keys are scoped to the tenant when it is sent
    cache_pins: list[Pin] = field(default_factory=list)
    tenant: str | None = None  # the identity of the API key that sent it (None without --api-key)
    lane: Lane = ONLINE  # BATCH: a batch line, run below every online request (lanes.py)
    scoring_size: int = 0  # entries of scored prompt in the answer (check_scoring); 0: it scores no prompt

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def include_usage(self) -> bool:
        options = self.request.stream_options
        return bool(options and options.include_usage)


async def off_loop(work: Callable[..., T], *args: Any) -> T:
    """Run `work(*args)` (validate, render the chat template, tokenize) in the shared preparation threads.

    `tokenizers` releases the GIL for most of an encode; the part it holds grows with the text, which
    `check_text_fits` bounds before tokenizing (bench/health_latency.py measures the loop meanwhile)."""
    return await _in_thread(_workers(), work, *args)


async def render_off_loop(work: Callable[..., T], *args: Any) -> T:
    """Run `work(*args)` (build and encode a large answer) in the render threads, so the event loop keeps
    answering meanwhile and the preparation threads keep preparing."""
    return await _in_thread(_render_workers(), work, *args)


async def _in_thread(pool: ThreadPoolExecutor, work: Callable[..., T], *args: Any) -> T:
    call = functools.partial(contextvars.copy_context().run, work, *args)  # log lines keep the request id
    return await asyncio.get_running_loop().run_in_executor(pool, call)


@functools.cache
def _workers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="pagegate-prepare")


@functools.cache
def _render_workers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="pagegate-render")


def prepare_completion(body: dict[str, Any] | CompletionRequest, model: ModelContext) -> PreparedRequest:
    request = body if isinstance(body, CompletionRequest) else parse_request(CompletionRequest, body)
    name = model.resolve(request.model)
    max_tokens = 1 if request.echo_only else request.max_tokens  # the engine samples one token, not returned
    prompts = []
    for item in _prompt_items(request.prompt):  # fail on the first prompt too long, before tokenizing the rest
        prompt = _completion_prompt(item, model)
        check_context(len(prompt.token_ids), max_tokens, model.max_model_len, "prompt")
        if prompt.text is None:  # sent as token ids: each must be in the vocabulary
            check_token_ids(prompt.token_ids, model.vocab_size, "prompt")
        prompts.append(prompt)
    scored = [k for k in (request.prompt_logprobs, request.logprobs if request.echo else None) if k is not None]
    # each choice carries its prompt's scores (prompt_logprobs, and the echoed prompt's logprobs)
    size = check_scoring(sum(len(p.token_ids) for p in prompts), scored, request.n,
                         "prompt_logprobs" if request.prompt_logprobs is not None else "logprobs",
                         model.max_scoring_tokens)
    params = sampling_params(request, model, max_tokens, request.logprobs, max(scored) if scored else None)
    params.structured_outputs = structured_outputs(request, model)
    return PreparedRequest(request, name, prompts, params, request.priority, request.cache_salt, scoring_size=size)


def prepare_chat(body: dict[str, Any] | ChatCompletionRequest, model: ModelContext) -> PreparedRequest:
    request = body if isinstance(body, ChatCompletionRequest) else parse_request(ChatCompletionRequest, body)
    name = model.resolve(request.model)
    check_tool_sizes(request.tools or [])
    offered = offered_tools(request)
    prompt = chat_prompt(request.messages, model, request.add_generation_prompt, tools=offered,
                         variables=template_variables(request, model), continue_final=request.continue_final_message)
    limit = request.completion_limit
    check_context(len(prompt.token_ids), limit, model.max_model_len, "messages")
    scored = [] if request.prompt_logprobs is None else [request.prompt_logprobs]  # once per answer, not per choice
    size = check_scoring(len(prompt.token_ids), scored, 1, "prompt_logprobs", model.max_scoring_tokens)
    check_tool_schemas(request.tools or [], model)  # compiling is the slow part: only once the cheap checks pass
    top = (request.top_logprobs or 0) if request.logprobs else None
    params = sampling_params(request, model, limit, top, request.prompt_logprobs)
    params.structured_outputs = structured_outputs(request, model, _tool_constraint(request, offered))
    if params.structured_outputs is not None and model.reasoning_parser is not None:
        params.grammar_after_token = reasoning_end(prompt, model)
    if offered and model.call_format.keeps_special_tokens:
        params.skip_special_tokens = False  # the call marker is a special token
    cache_pins = [key_pin(request.prompt_cache_key, len(prompt.token_ids), request.prompt_cache_retention)
                  ] if request.prompt_cache_key is not None else []
    return PreparedRequest(request, name, [prompt], params, request.priority, request.cache_salt,
                           CallParsing.of(request, offered, model.call_format), model.reasoning_parser,
                           scoring_size=size, cache_pins=cache_pins)


def check_scoring(num_prompt_tokens: int, alternatives: list[int], copies: int, param: str,
                  limit: int | None) -> int:
    """The size of the scored prompt an answer carries, in entries (a prompt token with k alternatives is 1 + k,
    once per kind of score asked for and per copy of the prompt's scores); a 400 past `limit`.

    NOTE: scoring is cheap for the engine (prefill only) but not for the answer: every entry is a JSON object
    of ~80 bytes, several hundred bytes of Python objects while it is built. Unbounded, 200 prompts x 2,000
    tokens with 20 alternatives made a 638 MB body and 4 GB of gateway memory. So the bound counts what the
    answer holds, not the tokens the engine computes. Its default (1,000,000: an answer of ~80 MB) leaves
    lm-eval's loglikelihood batches (echo + logprobs 1: 2 entries a token; 64 prompts of 2,048 tokens are
    262,144) and a 100,000-token document with 5 alternatives room."""
    size = num_prompt_tokens * sum(1 + k for k in alternatives) * copies
    if limit is None or size <= limit:
        return size
    per_token = " + ".join(f"(1 + {k})" for k in alternatives)
    choices = f" x {copies} choices" if copies > 1 else ""
    raise BadRequest(f"This request asks for {size:,} scored prompt entries ({num_prompt_tokens:,} prompt tokens x "
                     f"{per_token} alternatives{choices}), more than the {limit:,} this server answers in one request "
                     "(--max-scoring-tokens). Score fewer or shorter prompts per request, or ask for fewer "
                     "alternatives.", param=param, code="scoring_too_large")


def check_tool_schemas(tools: list[Tool], model: ModelContext) -> None:
    """Each function's parameter schema compiles, or the request is a 400 naming it (and quoting why)."""
    for index, tool in enumerate(tools):
        param = f"tools.{index}.function.parameters"
        if model.compile_grammar is None:
            raise BadRequest("This model has no tokenizer, so it cannot take tools.", param=param)
        try:
            model.compile_grammar(StructuredOutputsParams(json=parameters_schema(tool)))
        except InvalidParamError as error:
            raise BadRequest(str(error), param=param, code="invalid_value") from None


def _tool_constraint(request: ChatCompletionRequest, offered: list[Tool]) -> Constraint:
    """tool_choice required: the output is calls (one with parallel_tool_calls false); named: its arguments."""
    if request.tool_choice_mode == "named":
        return "tool_choice", functools.partial(named_call_grammar, offered[0])
    if request.tool_choice_mode != "required":
        return "tool_choice", None
    return "tool_choice", functools.partial(call_grammar, offered, request.parallel_tool_calls is not False)


def _prompt_items(prompt: Any) -> list[str | list[int]]:
    """Split OpenAI's four prompt shapes into a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _completion_prompt(item: str | list[int], model: ModelContext) -> EnginePrompt:
    if isinstance(item, str):
        tokenizer = model.require_tokenizer("prompt")
        model.check_text_fits(item, "prompt")
        token_ids = tokenizer.encode(item, add_special_tokens=True)
        if not token_ids:
            raise BadRequest("The prompt is empty after tokenization.", param="prompt")
        return EnginePrompt(token_ids, item)
    return EnginePrompt(list(item), None)


def chat_prompt(messages: list[ChatMessage], model: ModelContext, add_generation_prompt: bool = True, *,
                tools: list[Tool] | None = None, variables: dict[str, Any] | None = None,
                continue_final: bool = False) -> EnginePrompt:
    """Render messages (and the tools offered, and the template `variables`) with the model's chat template and
    tokenize without doubling the BOS token. `continue_final`: the text ends where the last message's does, so
    the model goes on writing it."""
    tokenizer = model.require_tokenizer("messages")
    native = tokenizer.chat_template_takes_tools
    images = chat_images(messages, model.processing is not None, model.image_limits)
    image_token = model.processing.image_token if model.processing is not None else ""
    dicts = template_messages(messages, tools or [], native, model.call_format, image_token)
    if model.processing is not None:
        dicts = template_parts(dicts, image_token)
    extra = dict(variables or {})
    if native and tools:
        extra["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
    try:
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, **extra)
    except Exception as exc:  # a template may reject a conversation (roles out of order, ...)
        raise BadRequest(f"The chat template rejected these messages: {exc}", param="messages") from None
    if continue_final:
        text = _cut_after_final(text, messages[-1].text())
    model.check_text_fits(text, "messages")  # the rendered text: a template may trim what it was given
    if model.processing is None:
        return EnginePrompt(tokenizer.encode_chat(text), text)
    written, placed = place_images(text, images, model.processing, "messages")
    return EnginePrompt(tokenizer.encode_chat(written), text, placed)


def reasoning_end(prompt: EnginePrompt, model: ModelContext) -> int | None:
    """The token after which a constraint applies: the model reasons freely first, then answers to the grammar.
    None (the grammar from the first token) when the prompt closes the block itself (thinking switched off)
    or `</think>` is not one token."""
    tokenizer = model.require_tokenizer("messages")
    if (prompt.text or "").rstrip().endswith(THINK_CLOSE):
        return None
    close = tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
    return close[0] if len(close) == 1 else None


def template_variables(request: ChatCompletionRequest, model: ModelContext) -> dict[str, Any]:
    """chat_template_kwargs, and reasoning_effort as the template understands it."""
    variables = dict(request.chat_template_kwargs or {})
    effort = request.reasoning_effort
    reads = model.tokenizer.chat_template_variables if model.tokenizer is not None else frozenset()
    if effort is not None and "reasoning_effort" in reads:
        variables.setdefault("reasoning_effort", effort)
    elif effort in ("none", "minimal") and "enable_thinking" in reads:
        # NOTE: Qwen3-style templates only switch thinking on or off; the lowest efforts switch it off.
        variables.setdefault("enable_thinking", False)
    return variables


def _cut_after_final(text: str, final: str) -> str:
    """The rendered chat up to the end of the last message's text (the template's end-of-turn cut off)."""
    end = text.rfind(final) if final else -1
    if end < 0:
        raise BadRequest("The chat template does not write the final message as given, so it cannot be "
                         "continued.", param="continue_final_message")
    return text[:end + len(final)]


def sampling_params(
    request: SamplingFields, model: ModelContext, max_tokens: int | None, logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """OpenAI fields -> SamplingParams; out-of-range combinations surface as InvalidParamError (400)."""
    stop_token_ids = request.stop_token_ids or []
    check_token_ids(stop_token_ids, model.vocab_size, "stop_token_ids")
    fields: dict[str, Any] = {
        "n": request.n,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
    }
    given = {key: value for key, value in fields.items() if value is not None}
    given = {**{k: v for k, v in model.default_sampling.items() if k in fields}, **given}
    return SamplingParams(
        **given,
        seed=request.seed,
        logit_bias=_logit_bias(request.logit_bias, model.vocab_size),
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=_stop_list(request.stop),
        stop_token_ids=stop_token_ids,
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


Constraint = tuple[str, Callable[[], StructuredOutputsParams] | None]  # (param, maker of the params when asked)


def structured_outputs(request: SamplingFields, model: ModelContext,
                       *more: Constraint) -> StructuredOutputsParams | None:
    """The request's output constraint, compiled here (the engine then copies it from the cache); an
    invalid one, or two ways of asking at once, is a 400 naming the field. `more`: constraints of other
    fields (tool_choice)."""
    asked = [(param, value) for param, value in [*_constraints(request), *more] if value is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise BadRequest(f"Give only one output constraint, not {' and '.join(p for p, _ in asked)}.",
                         param=asked[1][0])
    param, make = asked[0]
    if model.compile_grammar is None:
        raise BadRequest("This model has no tokenizer, so it cannot constrain its output.", param=param)
    try:
        structured = make()
        model.compile_grammar(structured)
    except InvalidParamError as error:
        raise BadRequest(str(error), param=param, code="invalid_value") from None
    return structured


def _constraints(request: SamplingFields) -> list[Constraint]:
    """Each way a request may ask for structured output, with a maker of its params when it does."""
    fmt, vllm = request.response_format, request.structured_outputs
    client = StructuredOutputsParams.from_request  # a client's source: size and depth checked before compiling
    from_format = None
    if fmt is not None and fmt.type == "json_object":
        from_format = functools.partial(client, json_object=True)
    elif fmt is not None and fmt.json_schema is not None:  # type json_schema; no schema: any JSON value
        from_format = functools.partial(client, json=fmt.json_schema.schema_ or {})
    from_vllm = None
    if vllm is not None:
        from_vllm = functools.partial(client, json=vllm.json_, regex=vllm.regex, choice=vllm.choice,
                                      grammar=vllm.grammar, json_object=bool(vllm.json_object))
    r, make = request, functools.partial
    return [("response_format", from_format), ("structured_outputs", from_vllm),
            ("guided_json", None if r.guided_json is None else make(client, json=r.guided_json)),
            ("guided_regex", None if r.guided_regex is None else make(client, regex=r.guided_regex)),
            ("guided_choice", None if r.guided_choice is None else make(client, choice=r.guided_choice)),
            ("guided_grammar", None if r.guided_grammar is None else make(client, grammar=r.guided_grammar))]


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if any(not s for s in stops):
        raise InvalidParamError("stop strings must not be empty", "stop")
    return stops


def _logit_bias(bias: dict[str | int, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    result: dict[int, float] = {}
    for key, value in bias.items():
        token_id = int(key) if isinstance(key, int) or key.lstrip("-").isdigit() else None
        if token_id is None or not 0 <= token_id < vocab_size:
            raise BadRequest(f"logit_bias key {key!r} is not a token id in [0, {vocab_size}).", param="logit_bias")
        result[token_id] = float(value)
    return result
