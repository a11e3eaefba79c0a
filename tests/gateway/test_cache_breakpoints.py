"""Where a cache_control breakpoint ends in the prompt's tokens (measured by rendering the request cut after the marked
block), what a prompt_cache_key pins, how pin keys are scoped to their API key, and Anthropic's split of a prompt into
cache reads, writes and the rest. No server: the embedded model's tokenizer and chat template."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

import pagegate
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.pin import Pin
from pagegate.gateway.messages.cache import breakpoint_pins, breakpoints
from pagegate.gateway.messages.protocol import MessagesRequest
from pagegate.gateway.prepare import ModelContext, prepare_chat
from pagegate.gateway.prompt_cache import cache_writes, prefix_pin, scoped
from pagegate.gateway.responses.routes import parse_responses, prepare_turn

CACHED = {"type": "ephemeral"}
SYSTEM = "In the beginning God created the heaven and the earth."
FIRST, SECOND = "And God said, Let there be light.", "And there was light."


@cache
def model() -> ModelContext:
    tokenizer = Tokenizer.from_folder(Path(pagegate.__file__).parent / "engine" / "default_model")
    return ModelContext(names=("m",), tokenizer=tokenizer, max_model_len=2048, vocab_size=2048,
                        compile_grammar=lambda structured: None)  # tools without a grammar engine


def prefixes(body: dict) -> tuple[list[int], list[Pin]]:
    """The whole prompt's tokens and the breakpoints' pins."""
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, **body})
    prompt = prepare_chat(request.chat_body(), model()).prompts[0].token_ids
    return prompt, breakpoint_pins(request, breakpoints(request), prompt, model())


def text_of(token_ids: list[int]) -> str:
    tokenizer = model().tokenizer
    assert tokenizer is not None
    return tokenizer.decode(token_ids, skip_special_tokens=False)


def test_a_system_breakpoint_ends_after_the_system_text() -> None:
    prompt, (pin,) = prefixes({"system": [{"type": "text", "text": SYSTEM, "cache_control": CACHED}],
                               "messages": [{"role": "user", "content": FIRST}]})
    assert pin.num_tokens is not None and pin.ttl_s == 300.0
    covered = text_of(prompt[:pin.num_tokens])
    assert SYSTEM[:-1] in covered and FIRST not in covered and "And" not in covered


def test_a_block_inside_a_message_ends_its_prefix_before_the_next_block() -> None:
    prompt, (pin,) = prefixes({"system": SYSTEM, "messages": [{"role": "user", "content": [
        {"type": "text", "text": FIRST, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": " " + SECOND}]}]})
    assert pin.num_tokens is not None and pin.ttl_s == 3600.0
    covered = text_of(prompt[:pin.num_tokens])
    assert SYSTEM in covered and FIRST[:-1] in covered and "there was" not in covered


def test_breakpoints_come_in_prompt_order_each_further_than_the_last() -> None:
    weather = {"name": "get_weather", "input_schema": {"type": "object"}, "cache_control": CACHED}
    prompt, pins = prefixes({"tools": [weather],
                             "system": [{"type": "text", "text": SYSTEM, "cache_control": CACHED}],
                             "messages": [{"role": "user", "content": [{"type": "text", "text": FIRST,
                                                                        "cache_control": CACHED}]},
                                          {"role": "assistant", "content": SECOND},
                                          {"role": "user", "content": FIRST}]})
    lengths = [pin.num_tokens or 0 for pin in pins]
    assert len(pins) == 3 and lengths == sorted(lengths) and lengths[-1] < len(prompt)
    assert len({pin.key for pin in pins}) == 3


def test_the_same_prefix_is_the_same_pin_and_keys_are_scoped() -> None:
    tokens = list(range(40))
    assert prefix_pin(tokens, 32, "5m") == prefix_pin(tokens + [7], 32, "5m") != prefix_pin(tokens, 33, "5m")
    pin = Pin("key\0s", 300.0, 32)
    keys = {scoped(pin, tenant, model_name, salt).key for tenant, model_name, salt in [
        ("a", "m", None), ("b", "m", None), (None, "m", None), ("a", "m2", None), ("a", "m", "salt"),
        ("a", "m", ""), ("", "m", None)]}
    assert len(keys) == 7
    assert scoped(Pin("x:y", 1.0), "a", "m", None).key != scoped(Pin("y", 1.0), "a:x", "m", None).key


@given(prompt=st.integers(1, 500), read=st.integers(0, 499), pins=st.lists(
    st.tuples(st.sampled_from([300.0, 3600.0]), st.integers(0, 500)), max_size=4))
def test_reads_writes_and_the_rest_add_up_to_the_prompt(prompt: int, read: int, pins: list) -> None:
    read = min(read, prompt - 1)
    pinned = [min(tokens, prompt) for _, tokens in pins]
    five, hour = cache_writes([Pin("k", ttl, tokens) for ttl, tokens in pins], pinned, read)
    assert five >= 0 and hour >= 0 and prompt - read - five - hour >= 0
    assert read + five + hour == max([read, *pinned])


def test_a_prompt_cache_key_pins_the_whole_prompt_on_both_openai_doors() -> None:
    chat = prepare_chat({"model": "m", "messages": [{"role": "user", "content": FIRST}], "prompt_cache_key": "s",
                         "prompt_cache_retention": "24h"}, model())
    (pin,) = chat.cache_pins
    assert pin == Pin("key\0s", 86400.0, len(chat.prompts[0].token_ids))
    turn = prepare_turn(parse_responses({"model": "m", "input": FIRST, "prompt_cache_key": "s"}), None, model())
    assert turn.prepared.cache_pins == [Pin("key\0s", 300.0, len(turn.prepared.prompts[0].token_ids))]
    assert not prepare_chat({"model": "m", "messages": [{"role": "user", "content": FIRST}]}, model()).cache_pins
