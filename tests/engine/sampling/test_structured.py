"""Structured outputs in the engine, with the embedded model: it knows no JSON, so only the grammar can make
its output parse. Every output is sampled at temperature 1 and checked with `jsonschema` or `re`."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from pagegate.engine.errors import InvalidParamError
from pagegate.engine.llm import LLM
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.structured import (
    MAX_GRAMMAR_BYTES,
    MAX_SCHEMA_DEPTH,
    GrammarCompiler,
    StructuredOutputsParams,
    estimated_bytes,
)

SHORT = {"type": "string", "maxLength": 6}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": SHORT}, "required": ["name"], "additionalProperties": False},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "string", "minLength": 3, "maxLength": 5},
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                      "tags": {"type": "array", "items": SHORT, "maxItems": 2}},
     "required": ["age", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"deep": {
        "type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"],
        "additionalProperties": False}}, "required": ["deep"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, SHORT]},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 1,
                                                                          "maximum": 3}},
     "required": ["kind", "n"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                      "ok": {"type": "boolean"}, "note": {"anyOf": [SHORT, {"type": "null"}]}},
     "required": ["id", "ok", "note"], "additionalProperties": False},
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 2},
    {"oneOf": [{"type": "object", "properties": {"cat": SHORT}, "required": ["cat"], "additionalProperties": False},
               {"type": "object", "properties": {"dog": {"type": "integer", "minimum": 0, "maximum": 5}},
                "required": ["dog"], "additionalProperties": False}]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                      "qty": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50}},
     "required": ["code", "qty"], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["up", "down"]}],
     "items": False},
]
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, device="cpu")


def constrained(max_tokens: int = 160, seed: int | None = None, n: int = 1, **structured) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**structured))


def test_json_schemas_validate_at_temperature_one(llm: LLM) -> None:
    assert len(SCHEMAS) >= 20
    cases = [(schema, seed) for schema in SCHEMAS for seed in SEEDS]
    outputs = llm.generate(["Answer:"] * len(cases), [constrained(json=s, seed=seed) for s, seed in cases],
                           use_tqdm=False)
    for (schema, seed), output in zip(cases, outputs, strict=True):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop", (schema, seed, text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_grammars(llm: LLM) -> None:
    choices = ["red apple", "green", 'quote " and \\ backslash']
    params = [constrained(regex=r"[0-9]{3}-[a-z]{2,5}", seed=1), constrained(choice=choices, seed=2),
              constrained(grammar='start: "yes" | "no" | "maybe"', seed=3),
              constrained(grammar='root ::= "ab" [0-9]', seed=4)]  # GBNF is converted to Lark
    texts = [o.outputs[0].text for o in llm.generate(["Go:"] * len(params), params, use_tqdm=False)]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", texts[0])
    assert texts[1] in choices
    assert texts[2] in ("yes", "no", "maybe")
    assert re.fullmatch(r"ab[0-9]", texts[3])


def test_json_object_is_an_object_once_it_closes(llm: LLM) -> None:
    # Any object allows strings of any length, which this model may never close within max_tokens.
    outputs = llm.generate(["{"] * 4, [constrained(json_object=True, seed=s, max_tokens=60) for s in range(4)],
                           use_tqdm=False)
    finished = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(c.text), dict) for c in finished)
    assert all(o.outputs[0].text.startswith("{") for o in outputs)


def test_each_of_n_choices_has_its_own_matcher(llm: LLM) -> None:
    schema = SCHEMAS[10]
    output = llm.generate(["Person:"], constrained(json=schema, seed=7, n=3), use_tqdm=False)[0]
    texts = [c.text for c in output.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # three independent samples, each its own grammar state


def test_logprobs_are_of_the_masked_distribution(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=8, logprobs=5,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
    output = llm.generate(["Year:"], params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.engine.tokenizer
    for logprob in output.logprobs:
        assert all(tokenizer.decode([t]).isdigit() for t in logprob.top if logprob.top[t] > -math.inf)
        assert math.isfinite(logprob.logprob)
    assert re.fullmatch("[0-9]{4}", output.text)


def test_preemption_keeps_outputs_valid(llm: LLM) -> None:
    schema = SCHEMAS[16]
    tight = LLM(None, device="cpu", num_kv_blocks=12, max_num_batched_tokens=32, max_model_len=128)
    outputs = tight.generate(["A long prompt that takes several pages of the tight pool:"] * 6,
                             [constrained(json=schema, seed=s, max_tokens=60) for s in range(6)], use_tqdm=False)
    assert tight.stats().preemptions > 0
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert tight.stats().used_blocks == 0


def test_stop_strings_and_max_tokens_still_apply(llm: LLM) -> None:
    stopped, cut = llm.generate(["x"] * 2, [
        SamplingParams(temperature=1.0, seed=0, max_tokens=50, stop=["-"],
                       structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[0-9]{3}")),
        constrained(json=SCHEMAS[0], max_tokens=3, seed=0)], use_tqdm=False)
    assert re.fullmatch("[0-9]{3}", stopped.outputs[0].text) and stopped.outputs[0].stop_reason == "-"
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 3


@pytest.mark.parametrize("structured, words", [
    (dict(json={"type": "nonsense"}), "nonsense"),
    (dict(json="{not json"), "Invalid structured output"),
    (dict(regex="a(b"), "unclosed group"),
    (dict(grammar="start: ??"), "Invalid structured output"),
    (dict(grammar='root ::= "a'), "Invalid structured output"),  # GBNF that does not convert (was a 500)
    (dict(grammar="\U000630b8"), "Invalid structured output"),
    (dict(choice=[]), "non-empty strings"),
    (dict(grammar="root ::= undefined-rule"), "not found"),  # llguidance's GBNF converter: a bare Exception
    (dict(grammar="root ::= " + "(" * 3000 + '"a"' + ")" * 3000), "nested too deeply"),  # was a RecursionError
    (dict(json="[" * 3000 + "]" * 3000), "nested too deeply"),  # json.loads: RecursionError
])
def test_bad_grammars_are_invalid_params(llm: LLM, structured: dict, words: str) -> None:
    with pytest.raises(InvalidParamError, match=re.escape(words)) as caught:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**structured)), use_tqdm=False)
    assert caught.value.param == "structured_outputs"
    assert llm.stats().used_blocks == 0 and llm.stats().requests == 0


def test_exactly_one_kind() -> None:
    with pytest.raises(InvalidParamError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidParamError, match="exactly one"):
        StructuredOutputsParams()


def test_compiled_grammars_are_cached(llm: LLM) -> None:
    compiler = llm.engine.intake.grammars
    first = compiler.matcher(StructuredOutputsParams(json={"const": "cache-probe"}))
    again = compiler.matcher(StructuredOutputsParams(json='{"const": "cache-probe"}'))
    assert first is not again and not first.is_error() and not again.is_error()
    assert sum(1 for key in compiler._cache if "cache-probe" in key) == 1


def probe(i: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"const": f"byte-probe-{i:03d}"})


def test_the_cache_is_bounded_by_bytes_least_recently_used_first(llm: LLM) -> None:
    engine = llm.engine
    one = estimated_bytes(probe(0).grammar_text())
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids,
                               cache_bytes=3 * one)
    for i in range(8):
        assert not compiler.matcher(probe(i)).is_error()
        assert compiler.cached_bytes <= compiler.cache_bytes
        if i == 5:
            compiler.matcher(probe(3))  # a hit: 3 is now the most recently used
    assert list(compiler._cache) == [probe(i).grammar_text() for i in (3, 6, 7)]
    assert compiler.cached_bytes == 3 * one


def test_a_grammar_larger_than_the_cache_is_compiled_but_not_kept(llm: LLM) -> None:
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids,
                               cache_bytes=estimated_bytes(probe(0).grammar_text()))
    compiler.matcher(probe(0))
    big = StructuredOutputsParams(json={"enum": [f"value-{i:04d}" for i in range(100)]})
    assert estimated_bytes(big.grammar_text()) > compiler.cache_bytes
    matcher = compiler.matcher(big)
    assert not matcher.is_error() and matcher.consume_tokens(engine.tokenizer.encode('"value-0042"', False))
    assert list(compiler._cache) == [probe(0).grammar_text()]


def test_compile_limits_refuse_a_grammar_that_expands_too_far(llm: LLM) -> None:
    enum = {"enum": [f"value-{i:06d}" for i in range(80_000)]}  # 1.2 MB: past compile_limits()' lexer fuel
    with pytest.raises(InvalidParamError, match="too big"):
        llm.engine.intake.grammars.matcher(StructuredOutputsParams(json=enum))


@pytest.mark.parametrize("kind", [
    dict(json={"enum": ["x" * MAX_GRAMMAR_BYTES]}),
    dict(json=json.dumps({"enum": ["x" * MAX_GRAMMAR_BYTES]})),
    dict(regex="x" * (MAX_GRAMMAR_BYTES + 1)),
    dict(grammar=f'start: "{"x" * MAX_GRAMMAR_BYTES}"'),
    dict(choice=["x" * MAX_GRAMMAR_BYTES]),
])
def test_a_clients_constraint_is_capped_in_bytes(kind: dict) -> None:
    with pytest.raises(InvalidParamError, match=f"more than the {MAX_GRAMMAR_BYTES} bytes"):
        StructuredOutputsParams.from_request(**kind)
    StructuredOutputsParams(**kind)  # the offline API compiles what its caller gives it


def test_a_clients_schema_is_capped_in_depth() -> None:
    schema: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        schema = {"type": "array", "items": schema}
    StructuredOutputsParams.from_request(json=schema)
    with pytest.raises(InvalidParamError, match=f"deeper than {MAX_SCHEMA_DEPTH}"):
        StructuredOutputsParams.from_request(json={"type": "array", "items": schema})


def test_the_grammar_waits_for_the_end_of_reasoning(llm: LLM) -> None:
    """With grammar_after_token, the tokens up to and including it are the free greedy ones; after it the
    output follows the grammar (a reasoning model answers to the constraint after its </think>)."""
    free = llm.generate(["Go:"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    end = tokens[3]
    before = tokens[:tokens.index(end) + 1]
    params = SamplingParams(temperature=0, max_tokens=24, grammar_after_token=end,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}"))
    for n in (1, 2):
        params.n = n
        for output in llm.generate(["Go:"], params, use_tqdm=False)[0].outputs:
            assert output.token_ids[:len(before)] == before
            answer = llm.engine.tokenizer.decode(output.token_ids[len(before):])
            assert re.fullmatch(r"[0-9]{3}", answer) and output.finish_reason == "stop"
