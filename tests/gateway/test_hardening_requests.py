"""Issue 22 through the API: n > 1 forks cannot end the engine loop, per-request lists and priorities are
bounded, logprob bytes are the tokens' own, and --prefix-cache-scope key keeps each key's prefix cache
its own."""

from __future__ import annotations

import openai
import pytest

from pagegate.testing.launcher import ServerProcess
from tests.gateway.server_args import server_args

PROMPT = "In the beginning"
MAX_NUM_SEQS = 32  # the shared server's (conftest)


def assert_400(error: pytest.ExceptionInfo, param: str) -> None:
    assert error.value.status_code == 400, error.value
    assert error.value.body["param"] == param, error.value.body


def test_prompts_forking_past_the_block_table_slots_all_finish(client: openai.OpenAI, model: str, http) -> None:
    """17 prompts x n = 16 = 272 sequences against 256 slots: admitted one parent each, their forks raised
    inside Engine.step and the server exited 1."""
    result = client.completions.create(model=model, prompt=["Hi"] * 17, n=16, max_tokens=2, temperature=1.0)
    assert len(result.choices) == 272 and {c.index for c in result.choices} == set(range(272))
    assert http.get("/health").status_code == 200


def test_more_choices_than_max_num_seqs_is_a_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt=PROMPT, n=MAX_NUM_SEQS + 1, max_tokens=2, stream=True)
    assert_400(error, "n")


@pytest.mark.parametrize(("extra", "param"), [
    ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"logit_bias": {str(t): 1.0 for t in range(301)}}, "logit_bias"),
    ({"priority": 1}, "priority"),  # this server schedules fcfs
    ({"priority": -(2**31)}, "priority"),
])
def test_unbounded_lists_and_priorities_are_400s(client: openai.OpenAI, model: str, extra: dict, param: str) -> None:
    body = dict(extra)
    bias = body.pop("logit_bias", None)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, logit_bias=bias, extra_body=body)
    assert_400(error, param)


def test_the_largest_lists_allowed_still_run(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=4,
                                       logit_bias={str(t): -1.0 for t in range(300)},
                                       extra_body={"stop_token_ids": list(range(1000, 1256))})
    assert len(result.choices) == 4


MULTIBYTE = "é😀世"


def test_chat_logprob_bytes_rebuild_the_answer(client: openai.OpenAI, model: str) -> None:
    """A token holding part of a UTF-8 character reported U+FFFD's bytes: joined, the bytes were not the answer."""
    result = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say it"}],
                                            logprobs=True, top_logprobs=2, max_tokens=20,
                                            extra_body={"guided_choice": [MULTIBYTE]})
    choice = result.choices[0]
    assert choice.message.content == MULTIBYTE
    entries = choice.logprobs.content
    assert bytes(b for entry in entries for b in entry.bytes) == MULTIBYTE.encode()
    partial = [entry for entry in entries if entry.token.startswith("bytes:")]
    assert partial and all("\ufffd" not in entry.token for entry in entries)
    for entry in partial:
        assert entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes)


def test_completion_logprob_tokens_show_partial_characters_as_bytes(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, logprobs=2,
                                       extra_body={"guided_choice": [MULTIBYTE]})
    choice = result.choices[0]
    assert choice.text == MULTIBYTE
    tokens = choice.logprobs.tokens
    assert any(token.startswith("bytes:") for token in tokens)
    assert not any("\ufffd" in token for token in tokens + [k for top in choice.logprobs.top_logprobs for k in top])


# ---- a second server: two keys, each its own prefix cache, priorities honoured ------------------------

KEYS = ("key-of-alice", "key-of-bob")
SYSTEM = "You are a careful assistant for a private company. " * 8  # several full pages


@pytest.fixture(scope="module")
def tenant_server():
    args = server_args("--num-kv-blocks", "256", "--max-num-seqs", "8", "--prefix-cache-scope", "key",
                       "--scheduling-policy", "priority", "--api-key", KEYS[0], "--api-key", KEYS[1])
    process = ServerProcess(args).start()
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def tenant(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def cached_tokens(client: openai.OpenAI, prompt: str, **extra: object) -> int:
    result = client.completions.create(model="pagegate-default", prompt=prompt, max_tokens=1, extra_body=extra)
    return result.usage.prompt_tokens_details.cached_tokens


def test_one_key_learns_nothing_of_another_keys_prefixes(tenant_server: ServerProcess) -> None:
    alice, bob = (tenant(tenant_server, key) for key in KEYS)
    assert cached_tokens(alice, SYSTEM + "first question") == 0
    assert cached_tokens(alice, SYSTEM + "second question") > 0  # her own prefix is cached
    assert cached_tokens(bob, SYSTEM + "third question") == 0  # shared scope would say > 0 here
    assert cached_tokens(bob, SYSTEM + "fourth question", cache_salt="x") == 0
    assert cached_tokens(bob, SYSTEM + "fifth question") > 0


def test_priority_is_honoured_within_its_range(tenant_server: ServerProcess) -> None:
    alice = tenant(tenant_server, KEYS[0])
    result = alice.completions.create(model="pagegate-default", prompt=PROMPT, max_tokens=1,
                                      extra_body={"priority": -100})
    assert result.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as error:
        alice.completions.create(model="pagegate-default", prompt=PROMPT, max_tokens=1, extra_body={"priority": 101})
    assert_400(error, "priority")


def test_prefix_cache_scope_key_needs_keys() -> None:
    from pagegate.gateway.cli import build_parser, configs_from_args

    with pytest.raises(SystemExit, match="needs --api-key"):
        configs_from_args(build_parser().parse_args(["--prefix-cache-scope", "key"]))
