"""Prompt caching a client asks for, against a real server with a small pool: Anthropic's cache_control breakpoints
(usage through the official `anthropic` SDK: cache writes, reads, their TTL split, the total) and OpenAI's
prompt_cache_key pin their prefixes, which outlive traffic that evicts everything else, per API key."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from pagegate.testing.launcher import ServerProcess
from tests.gateway.conftest import metric_value
from tests.gateway.server_args import server_args

KEY, OTHER_KEY = "sk-cache-a", "sk-cache-b"
NUM_BLOCKS, BLOCK_SIZE = 32, 16
VERSES = ["In the beginning God created the heaven and the earth. ", "And God said, Let there be light. ",
          "And the evening and the morning were the first day. ", "And God saw the light, that it was good. ",
          "Blessed are the meek: for they shall inherit the earth. "]
GREEDY: dict = {"extra_body": {"temperature": 0}}
HELLO = [{"role": "user", "content": "Say hello."}]


def text(seed: int, verses: int = 6) -> str:
    """A system prompt of its own (about 75 tokens a seed's worth of verses)."""
    return f"Chapter {seed}. " + "".join(VERSES[(seed + i) % len(VERSES)] for i in range(verses))


def cached_system(body: str, ttl: str = "5m") -> list[dict]:
    return [{"type": "text", "text": body, "cache_control": {"type": "ephemeral", "ttl": ttl}}]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    args = server_args("--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len", "512", "--max-pinned-fraction", "0.5",
                       "--api-key", KEY, "--api-key", OTHER_KEY, "--prefix-cache-scope", "key", embedded=True)
    with ServerProcess(args) as process:
        yield process


@pytest.fixture(scope="module")
def model(server: ServerProcess) -> str:
    reply = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    return reply.json()["data"][0]["id"]


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def prompt_tokens(claude: anthropic.Anthropic, model: str, **request: object) -> int:
    return claude.messages.count_tokens(model=model, **request).input_tokens


def total(usage: anthropic.types.Usage) -> int:
    return usage.input_tokens + (usage.cache_creation_input_tokens or 0) + (usage.cache_read_input_tokens or 0)


def test_a_breakpoint_writes_its_prefix_once_and_the_same_call_reads_it(claude: anthropic.Anthropic,
                                                                         model: str) -> None:
    request = {"system": cached_system(text(1)), "messages": HELLO}
    prompt = prompt_tokens(claude, model, **request)
    first = claude.messages.create(model=model, max_tokens=2, **request, **GREEDY).usage
    written = first.cache_creation_input_tokens or 0
    assert written > 0 and written % BLOCK_SIZE == 0 and first.cache_read_input_tokens == 0
    assert first.cache_creation is not None and first.cache_creation.ephemeral_5m_input_tokens == written
    assert total(first) == prompt
    with claude.messages.stream(model=model, max_tokens=2, **request, **GREEDY) as stream:
        again = stream.get_final_message().usage
    assert again.cache_creation_input_tokens == 0 and (again.cache_read_input_tokens or 0) >= written
    assert total(again) == prompt


def test_one_hour_breakpoints_are_counted_apart(claude: anthropic.Anthropic, model: str) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": text(2, 3), "cache_control": {
        "type": "ephemeral"}}, {"type": "text", "text": "Say hello."}]}]
    request = {"system": cached_system(text(3), "1h"), "messages": messages}
    usage = claude.messages.create(model=model, max_tokens=2, **request, **GREEDY).usage
    assert usage.cache_creation is not None
    hour, five = usage.cache_creation.ephemeral_1h_input_tokens, usage.cache_creation.ephemeral_5m_input_tokens
    assert hour > 0 and five > 0 and usage.cache_creation_input_tokens == hour + five
    assert total(usage) == prompt_tokens(claude, model, **request)


def test_pinned_prefixes_outlive_traffic_that_fills_the_pool(server: ServerProcess, claude: anthropic.Anthropic,
                                                              oai: openai.OpenAI, model: str) -> None:
    """A breakpoint's and a prompt_cache_key's prefixes stay; a prefix without either is evicted."""
    pinned = claude.messages.create(model=model, max_tokens=2, system=cached_system(text(4)), messages=HELLO,
                                    **GREEDY).usage.cache_creation_input_tokens or 0
    keyed = [{"role": "user", "content": text(5)}]
    oai.chat.completions.create(model=model, max_tokens=2, messages=keyed, prompt_cache_key="session-5",
                                prompt_cache_retention="24h", temperature=0)
    loose = claude.messages.create(model=model, max_tokens=2, system=text(6), messages=HELLO, **GREEDY).usage
    assert loose.cache_creation_input_tokens == 0  # no breakpoint: nothing pinned
    held = metric_value(httpx.get(server.base_url + "/metrics").text, "pagegate:kv_blocks_pinned")
    assert held is not None and held > 0
    filler = list(range(100, 100 + (NUM_BLOCKS - int(held) - 1) * BLOCK_SIZE - 4))  # every page no pin holds
    oai.completions.create(model=model, prompt=filler, max_tokens=2, temperature=0)

    again = claude.messages.create(model=model, max_tokens=2, system=cached_system(text(4)), messages=HELLO,
                                   **GREEDY).usage
    assert (again.cache_read_input_tokens or 0) >= pinned > 0 and again.cache_creation_input_tokens == 0
    chat = oai.chat.completions.create(model=model, max_tokens=2, messages=keyed, temperature=0,
                                       prompt_cache_key="session-5").usage
    assert chat is not None and chat.prompt_tokens_details is not None
    assert chat.prompt_tokens_details.cached_tokens == (chat.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    evicted = claude.messages.create(model=model, max_tokens=2, system=text(6), messages=HELLO, **GREEDY).usage
    assert (evicted.cache_read_input_tokens or 0) <= BLOCK_SIZE < (again.cache_read_input_tokens or 0)


def test_a_pin_is_its_api_keys_alone(server: ServerProcess, claude: anthropic.Anthropic, model: str) -> None:
    """The same breakpoint sent with another key writes that key's own pages (--prefix-cache-scope key) under a pin
    of its own, and each key's pinned pages are counted apart."""
    request = {"system": cached_system(text(7)), "messages": HELLO}
    ours = claude.messages.create(model=model, max_tokens=2, **request, **GREEDY).usage
    other = anthropic.Anthropic(base_url=server.base_url, api_key=OTHER_KEY, max_retries=0, timeout=60)
    theirs = other.messages.create(model=model, max_tokens=2, **request, **GREEDY).usage
    assert theirs.cache_read_input_tokens == 0 and theirs.cache_creation_input_tokens == ours.cache_creation_input_tokens
    shown = [line for line in httpx.get(server.base_url + "/metrics").text.splitlines()
             if line.startswith("pagegate:key_kv_blocks_pinned{") and not line.endswith(" 0.0")]
    assert len(shown) == 2 and KEY not in "".join(shown), shown
