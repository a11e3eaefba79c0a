"""Structured outputs on llguidance: what a request's text must match, compiled once per grammar and
tokenizer; each sequence then holds its own matcher (grammar_masks.py turns them into logit masks).

A compiled grammar is a prototype matcher in an LRU cache bounded by (estimated) bytes; each sequence gets a
deep copy (microseconds). The gateway compiles in its preparation threads, so the engine loop only ever copies
from the cache. What a client may have compiled is bounded here, in one place (docs/security.md). llguidance is
imported with the first grammar (~25 ms a process that never sees one does without).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagegate.engine.errors import InvalidParamError
from pagegate.engine.loading.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

# What one request may have compiled. Compile time grows faster than the source (3,000 optional properties,
# 77 KB, take ~0.6 s), so the source is capped; llguidance's own budgets bound what a small source expands to.
MAX_GRAMMAR_BYTES = 64 * 1024  # a schema (as compact JSON), regex, grammar or choice list; one tool's parameters
MAX_TOOLS_BYTES = 128 * 1024  # all tools' parameter schemas together
MAX_TOOLS = 128  # functions per request, as OpenAI
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays in a schema given as an object (llguidance refuses > 128)
# The compiled-grammar cache: an LRU under a byte budget. llguidance reports no sizes, so an entry's is estimated
# from its source (measured: ~30 KB for a tiny grammar, ~30 bytes per source byte for an 80,000-value enum).
CACHE_BYTES = 256 * 1024 * 1024  # per tokenizer
ENTRY_BYTES, BYTES_PER_SOURCE_BYTE = 32 * 1024, 32
# JSON as json.dumps writes it (and OpenAI returns it); a schema's own "x-guidance" options win
JSON_STYLE: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PARAM = "structured_outputs"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured-output choice: exactly one of these is set."""

    json: str | dict[str, Any] | None = None  # a JSON schema
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        given = [self.json is not None, self.regex is not None, self.choice is not None,
                 self.grammar is not None, self.json_object]
        if sum(given) != 1:
            raise InvalidParamError("structured outputs take exactly one of json, regex, choice, grammar "
                                    "or json_object", PARAM)

    @classmethod
    def from_request(cls, **kind: Any) -> StructuredOutputsParams:
        """A client's constraint, refused before anything compiles it when its source is over MAX_GRAMMAR_BYTES
        or its schema nests deeper than MAX_SCHEMA_DEPTH."""
        params = cls(**kind)
        source = next((s for s in (params.json, params.regex, params.choice, params.grammar) if s is not None), None)
        if source is not None:
            check_grammar_size(source, PARAM)
        return params

    def grammar_text(self) -> str:
        """The llguidance grammar (the compiled-grammar cache key)."""
        import llguidance

        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidParamError("choice must be a list of non-empty strings", PARAM)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, self.choice)))
        assert self.grammar is not None
        from llguidance.gbnf_to_lark import any_to_lark

        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.grammar))


class GrammarCompiler:
    """Compiled grammars of one tokenizer, cached by grammar text; safe to use from any thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_bytes: int = CACHE_BYTES) -> None:
        self._tokenizer, self._vocab_size, self.cache_bytes = tokenizer, vocab_size, cache_bytes
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, tuple[llguidance.LLMatcher, int]] = OrderedDict()  # grammar: (matcher, bytes)
        self.cached_bytes = 0  # the estimated size of what the cache holds, at most cache_bytes
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; an invalid grammar is an InvalidParamError."""
        import llguidance

        key = _grammar_text(params)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached[0].deep_copy()
            tokenizer = self._llg_tokenizer()
        # releases the GIL while it compiles; compile_limits() turn a grammar that expands too far into an error
        prototype = llguidance.LLMatcher(tokenizer, key, log_level=0, limits=compile_limits())
        if prototype.is_error():
            raise InvalidParamError(f"Invalid structured output: {prototype.get_error()}", PARAM)
        self._keep(key, prototype)
        return prototype.deep_copy()

    def _keep(self, key: str, prototype: llguidance.LLMatcher) -> None:
        """Cache a compiled grammar, evicting the least recently used until the estimates fit cache_bytes; one
        larger than the whole budget is not cached (each request compiles it again)."""
        size = estimated_bytes(key)
        if size > self.cache_bytes:
            return
        with self._lock:
            if key in self._cache:  # another thread compiled it meanwhile
                return
            self._cache[key] = (prototype, size)
            self.cached_bytes += size
            while self.cached_bytes > self.cache_bytes:
                _, (_, evicted) = self._cache.popitem(last=False)
                self.cached_bytes -= evicted

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:  # under the lock; ~20 ms for 2k tokens, ~0.3 s for 50k
            import llguidance

            tokenizer = self._tokenizer
            self._ll_tokenizer = llguidance.LLTokenizer(
                tokenizer.backend_json(), n_vocab=max(self._vocab_size, tokenizer.vocab_size),
                eos_token=self._eos_token_ids)
        return self._ll_tokenizer


@functools.cache
def compile_limits() -> llguidance.LLParserLimits:
    """What compiling one grammar may take."""
    import llguidance

    return llguidance.LLParserLimits(
        max_grammar_size=100_000,  # symbols (default 500,000); 64 KiB of schema makes ~25,000
        initial_lexer_fuel=500_000)  # lexer build work (default 1,000,000); dense 64 KiB schemas need < 300,000


def estimated_bytes(grammar: str) -> int:
    """What a compiled grammar (and its source, the cache key) is taken to hold in memory."""
    return ENTRY_BYTES + BYTES_PER_SOURCE_BYTE * len(grammar)


def _grammar_text(params: StructuredOutputsParams) -> str:
    try:
        return params.grammar_text()
    except InvalidParamError:
        raise
    except RecursionError:  # json.loads and the GBNF converter recurse into what they read
        raise InvalidParamError("Invalid structured output: it is nested too deeply.", PARAM) from None
    except Exception as error:  # any other failure to convert is the client's too: llguidance's GBNF converter
        raise InvalidParamError(f"Invalid structured output: {error}", PARAM) from error  # raises bare Exceptions


def check_grammar_size(source: str | Sequence[str] | dict[str, Any], param: str,
                       limit: int = MAX_GRAMMAR_BYTES) -> int:
    """The size in UTF-8 bytes of a client's schema (as compact JSON), regex, grammar or choice list; an
    InvalidParamError naming `param` when it is over `limit`, or when a schema nests deeper than MAX_SCHEMA_DEPTH
    (json.dumps, chat templates and llguidance all recurse)."""
    if isinstance(source, str):
        size = len(source.encode(errors="surrogatepass"))
    else:
        if json_depth(source) > MAX_SCHEMA_DEPTH:
            raise InvalidParamError(f"The schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels.",
                                    param)
        try:
            text = json.dumps(source, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as error:  # msgpack may carry bytes, the offline API anything
            raise InvalidParamError(f"The schema is not JSON: {error}", param) from None
        size = len(text.encode(errors="surrogatepass"))
    if size > limit:
        raise InvalidParamError(f"The schema, regex or grammar is {size} bytes long (a schema as compact JSON), "
                                f"more than the {limit} bytes allowed.", param)
    return size


# Where a JSON schema holds subschemas: one, a list of them, or a map of names to them (draft 2020-12 and older)
_ONE_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "contains", "not", "if",
                  "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_KEYS_FROM_ELSEWHERE = ("additionalProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that lists its `properties` and says nothing of others
    takes no others (`additionalProperties: false`), at any depth.

    NOTE: xgrammar (vLLM's default) reads tool schemas this way, and so do we: a model asked for a function's
    arguments invents keys a schema does not forbid (SmolLM2 writes `"description": "The capital of France is
    …"` after the city until max_tokens), and a function takes the keys it names. What stays open: a schema
    that says so, one that names no properties (a free-form object), one whose keys may come from elsewhere
    (`allOf`, `anyOf`, `oneOf`, `$ref` beside `properties`, and the members of such a composition), and one
    that requires a key it does not list (closing it would leave nothing to write).

    NOTE: `response_format` and `structured_outputs` schemas do not come through here: they stay open, as JSON
    Schema says. They describe a document, where keys beyond the listed ones are often wanted and are a client's
    to forbid; OpenAI's strict mode makes its clients write `additionalProperties: false` themselves (the SDK's
    `parse()` does), so a strict client's schema is closed already. A tool's arguments are a function's keyword
    arguments, where a key it does not name is an error in the caller's code.
    """
    return _close(schema, composed=False)


def _close(schema: Any, composed: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    shares_keys = "properties" in schema or schema.get("allOf") is not None
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _close(item, False) for name, item in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            member = shares_keys and key in ("anyOf", "oneOf", "allOf") or key == "allOf"
            closed[key] = [_close(item, member) for item in value]
        elif key in _ONE_SUBSCHEMA:
            closed[key] = _close(value, False)
        else:
            closed[key] = value
    if not composed and _names_all_its_keys(schema):
        closed["additionalProperties"] = False
    return closed


def _names_all_its_keys(schema: dict[str, Any]) -> bool:
    properties, kind = schema.get("properties"), schema.get("type", "object")
    if not isinstance(properties, dict) or any(key in schema for key in _KEYS_FROM_ELSEWHERE):
        return False
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return False
    required = schema.get("required", [])
    return isinstance(required, list) and all(key in properties for key in required)


def json_depth(value: Any) -> int:
    """How deeply dicts and lists nest in `value` (a scalar: 0); iterative, so any depth is safe to measure."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, (list, tuple)):
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in item)
    return deepest
