"""Structured outputs on llguidance: what a request's text must match, compiled once per grammar and
tokenizer; each sequence then holds its own matcher (grammar_masks.py turns them into logit masks).

A compiled grammar is a prototype matcher in an LRU cache; each sequence gets a deep copy (microseconds).
The gateway compiles in its preparation threads, so the engine loop only ever copies from the cache.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from pagegate.engine.params import InvalidParamError
from pagegate.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

CACHE_SIZE = 256  # compiled grammars kept per tokenizer
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

    def grammar_text(self) -> str:
        """The llguidance grammar (the compiled-grammar cache key)."""
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
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.grammar))


class GrammarCompiler:
    """Compiled grammars of one tokenizer, cached by grammar text; safe to use from any thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer, self._vocab_size, self._cache_size = tokenizer, vocab_size, cache_size
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; an invalid grammar is an InvalidParamError."""
        try:
            key = params.grammar_text()
        except (ValueError, TypeError, GbnfToLarkError) as error:  # a malformed schema, or GBNF that does not convert
            raise InvalidParamError(f"Invalid structured output: {error}", PARAM) from error
        with self._lock:
            prototype = self._cache.get(key)
            if prototype is not None:
                self._cache.move_to_end(key)
                return prototype.deep_copy()
            tokenizer = self._llg_tokenizer()
        prototype = llguidance.LLMatcher(tokenizer, key, log_level=0)  # releases the GIL while it compiles
        if prototype.is_error():
            raise InvalidParamError(f"Invalid structured output: {prototype.get_error()}", PARAM)
        with self._lock:
            self._cache[key] = prototype
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return prototype.deep_copy()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:  # under the lock; ~20 ms for 2k tokens, ~0.3 s for 50k
            tokenizer = self._tokenizer
            self._ll_tokenizer = llguidance.LLTokenizer(
                tokenizer.backend_json(), n_vocab=max(self._vocab_size, tokenizer.vocab_size),
                eos_token=self._eos_token_ids)
        return self._ll_tokenizer
