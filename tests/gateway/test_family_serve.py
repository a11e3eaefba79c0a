"""`pagegate serve` on a Gemma 3 and a Qwen3 GGUF (tiny random models, converted by llama.cpp's converter)
through the official OpenAI SDK: each family's chat template from the file, its end-of-turn token ending
the answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagegate.testing.launcher import ServerProcess

from ..engine.conftest import hf
from ..engine.family_models import convert, save_family

MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Which city is the capital of France?"}]
END_OF_TURN = {"gemma3": "<end_of_turn>", "qwen3": "<|im_end|>"}


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str, Path]]:
    saved = save_family(tmp_path_factory.mktemp(f"serve-{request.param}"), request.param)
    gguf = convert(saved, tmp_path_factory.mktemp("gguf"), "q8_0")
    args = [str(gguf), "--device", "cpu", "--grpc-port", "0", "--max-model-len", "256", "--kv-cache-memory",
            "64MiB", "--disable-uvicorn-access-log"]
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, request.param, saved.path


def test_chat_prompt_is_the_family_template(served: tuple[openai.OpenAI, str, Path]) -> None:
    client, family, folder = served
    expected = hf().AutoTokenizer.from_pretrained(folder).apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                              tokenize=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=8,
                                           temperature=0)
    assert reply.usage.prompt_tokens == len(expected)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens >= 1


def test_end_of_turn_ends_the_answer(served: tuple[openai.OpenAI, str, Path]) -> None:
    """The file's end-of-turn token is an eos id: made certain by a logit bias, it stops at once."""
    client, family, folder = served
    end = hf().AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(END_OF_TURN[family])
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=8,
                                           temperature=0, logit_bias={str(end): 100})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == ""
    assert reply.usage.completion_tokens == 1


def test_streamed_chat_matches_the_whole_reply(served: tuple[openai.OpenAI, str, Path]) -> None:
    client, family, _ = served
    model = client.models.list().data[0].id
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content


def test_structured_output_holds_on_the_family_vocabulary(served: tuple[openai.OpenAI, str, Path]) -> None:
    """The grammar walks the file's own vocabulary (SentencePiece pieces and byte tokens for Gemma)."""
    client, _, _ = served
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]}},
              "required": ["city"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(reply.choices[0].message.content)["city"] in ("Paris", "Lyon", "Nice")
