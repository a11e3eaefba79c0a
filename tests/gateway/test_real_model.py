"""The official OpenAI SDK against `pagegate serve` on a real instruct model's GGUF file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagegate.testing.launcher import ServerProcess, core_pids

# SmolLM2's first token of most phrasings is a near-tie ("The" / "Le" / "La", <0.1 nats) that Q8 activations or the
# page format flip; this one's margin is 2.4 nats on float32 and int8 pages alike (see tests/engine)
QUESTION = [{"role": "user", "content": "What is the name of the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path) -> Iterator[ServerProcess]:
    args = [str(smollm2_gguf), "--device", "cpu", "--grpc-port", "0", "--max-model-len", "1024",
            "--kv-cache-memory", "256MiB", "--disable-uvicorn-access-log"]
    with ServerProcess(args) as server:
        yield server


@pytest.fixture(scope="module")
def smollm2(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_its_engine_core_serves_without_torch(server: ServerProcess, smollm2: openai.OpenAI,
                                              smollm2_gguf: Path) -> None:
    """The native core (issue 57): a GGUF file on a CPU is served by an engine core that never loaded torch; the
    first test of the module, before a tool call's grammar imports it (sampling/processors.py)."""
    smollm2.chat.completions.create(model=smollm2_gguf.name, messages=QUESTION, max_tokens=4, temperature=0.7, seed=1)
    assert server.process is not None
    [core] = core_pids(server.process.pid)
    maps = Path(f"/proc/{core}/maps").read_text()
    assert "libtorch" not in maps and "cpu_decode" in maps


def test_its_warm_up_is_one_step_where_every_step_runs_one_path(server: ServerProcess) -> None:
    """The native decoder runs a decode as it runs a prompt (Ready.one_path): the warm-up's prompt step is all it
    needs, where a torch core warms a decode step up too (CUDA graphs, Triton kernels compiled at first use)."""
    assert "warm-up: a 1-token generation" in server.log()


def test_model_is_listed_under_the_file_name(smollm2: openai.OpenAI, smollm2_gguf: Path) -> None:
    assert [m.id for m in smollm2.models.list()] == [smollm2_gguf.name]


def test_chat_answers_a_factual_question(smollm2: openai.OpenAI, smollm2_gguf: Path) -> None:
    reply = smollm2.chat.completions.create(model=smollm2_gguf.name, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 20  # the template's default system message is in the prompt


def test_streamed_chat_gives_the_same_answer(smollm2: openai.OpenAI, smollm2_gguf: Path) -> None:
    model = smollm2_gguf.name
    whole = smollm2.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    stream = smollm2.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0,
                                             stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 3 and "".join(pieces) == whole.choices[0].message.content


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city, e.g. Paris"}},
                   "required": ["location"]}}}


def test_required_tool_call_answers_a_weather_question(smollm2: openai.OpenAI, smollm2_gguf: Path) -> None:
    """SmolLM2-135M writes no call by itself (tool_choice auto: it answers in prose, docs/serving.md); required makes it
    call, and it fills in the city from the question. With parallel calls allowed its list opens with that call;
    whether it then closes the list or calls again is a near-tie that a last-bit change in the MLP flips (the vectorized
    SwiGLU of issue 56 made it repeat the call until max_tokens), so either ending is taken, every call parsed."""
    for city in ("Paris", "London"):
        ask = {"model": smollm2_gguf.name, "messages": [{"role": "user", "content": f"What is the weather like in {city}?"}],
               "tools": [WEATHER], "tool_choice": "required", "max_tokens": 60, "temperature": 0}
        choice = smollm2.chat.completions.create(**ask, parallel_tool_calls=False).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and city in json.loads(call.function.arguments)["location"]
        choice = smollm2.chat.completions.create(**ask).choices[0]
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
        first, *_ = choice.message.tool_calls
        assert {call.function.name for call in choice.message.tool_calls} == {"get_weather"}
        assert city in json.loads(first.function.arguments)["location"]


CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
IN_PARIS = [{"role": "user", "content": "What is the weather like in Paris?"}]


def test_a_named_call_writes_only_its_schemas_keys(smollm2: openai.OpenAI, smollm2_gguf: Path) -> None:
    """The schema does not mention additionalProperties, so it is closed for tools (as xgrammar reads it). Open,
    SmolLM2 invented keys in 5 of 6 calls ({"city": "Paris", "country": "France"}), and max_tokens 32 cut two of
    them inside a long invented "description"."""
    for seed in (0, 1):
        result = smollm2.chat.completions.create(
            model=smollm2_gguf.name, messages=IN_PARIS, tools=[CITY], max_tokens=32, temperature=0.7, seed=seed,
            n=3, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        for choice in result.choices:
            [call] = choice.message.tool_calls
            assert choice.finish_reason == "tool_calls" and json.loads(call.function.arguments).keys() == {"city"}


def test_a_streamed_required_call_ends(smollm2: openai.OpenAI, smollm2_gguf: Path) -> None:
    """The SDK's stream helper raises LengthFinishReasonError on a list of calls that runs to max_tokens: the list
    may end at SmolLM2's end of turn after any call (with only `, ` or `]` allowed there, seed 1 wrote calls
    until the limit), and its calls hold no invented keys."""
    for seed in range(4):
        with smollm2.chat.completions.stream(model=smollm2_gguf.name, messages=IN_PARIS, tools=[CITY],
                                             tool_choice="required", max_tokens=100, temperature=0.8,
                                             seed=seed) as stream:
            choice = stream.get_final_completion().choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert all(json.loads(call.function.arguments).keys() == {"city"} for call in choice.message.tool_calls)
