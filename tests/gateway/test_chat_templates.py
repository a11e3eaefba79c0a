"""Chat templates driven from the request, and <think> reasoning split off answers, on a served Qwen3-style
model (a tiny random one with Qwen3's chat template, which reads enable_thinking) through the OpenAI SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagegate.gateway.answer import split_answer
from pagegate.testing.launcher import ServerProcess

from ..engine.conftest import hf
from ..engine.family_models import save_family

QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str, Path]]:
    saved = save_family(tmp_path_factory.mktemp("qwen3-templates"), "qwen3")
    args = [str(saved.path), "--device", "cpu", "--grpc-port", "0", "--max-model-len", "256", "--kv-cache-memory",
            "32MiB", "--disable-uvicorn-access-log", "--reasoning-parser", "deepseek_r1"]
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, client.models.list().data[0].id, saved.path


def hf_prompt_length(folder: Path, messages: list[dict], **kwargs: object) -> int:
    ids = hf().AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=True, **kwargs)
    return len(ids if isinstance(ids, list) else ids["input_ids"])


def prompt_tokens(client: openai.OpenAI, model: str, **request: object) -> int:
    reply = client.chat.completions.create(model=model, max_tokens=1, temperature=0, **request)
    return reply.usage.prompt_tokens


def test_chat_template_kwargs_reach_the_template(qwen3: tuple[openai.OpenAI, str, Path]) -> None:
    client, model, folder = qwen3
    off = prompt_tokens(client, model, messages=QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off == hf_prompt_length(folder, QUESTION, add_generation_prompt=True, enable_thinking=False)
    assert off > prompt_tokens(client, model, messages=QUESTION)  # the closed empty <think> block


def test_reasoning_effort_none_switches_thinking_off(qwen3: tuple[openai.OpenAI, str, Path]) -> None:
    client, model, folder = qwen3
    assert prompt_tokens(client, model, messages=QUESTION, reasoning_effort="none") == hf_prompt_length(
        folder, QUESTION, add_generation_prompt=True, enable_thinking=False)
    assert prompt_tokens(client, model, messages=QUESTION, reasoning_effort="high") == hf_prompt_length(
        folder, QUESTION, add_generation_prompt=True)


def test_continue_final_message(qwen3: tuple[openai.OpenAI, str, Path]) -> None:
    client, model, folder = qwen3
    messages = [*QUESTION, {"role": "assistant", "content": "The capital is"}]
    tokens = prompt_tokens(client, model, messages=messages,
                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert tokens == hf_prompt_length(folder, messages, continue_final_message=True)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                       extra_body={"continue_final_message": True})  # with add_generation_prompt
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"messages": []}})


def test_reasoning_is_split_off_the_answer(qwen3: tuple[openai.OpenAI, str, Path]) -> None:
    """The same tokens through /v1/completions give the raw text; chat splits it as the parser says, streamed
    the same as whole."""
    client, model, _ = qwen3
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    tokens = httpx.post(root + "/tokenize", json={"model": model, "messages": QUESTION}).json()["tokens"]
    raw = client.completions.create(model=model, prompt=tokens, max_tokens=24, temperature=0).choices[0].text
    expected = split_answer(raw, None, "deepseek_r1")
    message = whole.choices[0].message
    assert message.reasoning_content == expected.reasoning and message.content == expected.content
    thought, content = "", ""
    for chunk in client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0,
                                                stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        thought += getattr(delta, "reasoning_content", None) or ""
        content += (delta.content or "") if delta is not None else ""
    assert (thought, content) == (expected.reasoning or "", expected.content or "")
