"""/v1/completions through the official OpenAI SDK against a real server."""

from __future__ import annotations

import openai
import pytest

from pagegate.gateway.schemas import CompletionResponse

PROMPT = "The quick brown fox"


def test_completion_shape_and_usage(client: openai.OpenAI, model: str, http) -> None:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert result.object == "text_completion" and result.id.startswith("cmpl-") and result.model == model
    [choice] = result.choices
    assert choice.index == 0 and isinstance(choice.text, str) and choice.finish_reason in ("stop", "length")
    assert result.usage.prompt_tokens > 0 and 0 < result.usage.completion_tokens <= 8
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    raw = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}).json()
    CompletionResponse.model_validate(raw)  # exactly the documented shape


def test_default_max_tokens_is_16(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(model=model, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 16 and result.choices[0].finish_reason == "length"


def test_stream_matches_non_stream_and_reports_usage(client: openai.OpenAI, model: str) -> None:
    args = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_has_no_usage_chunk(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, stream=True))
    assert chunks and all(c.choices for c in chunks)


def test_n_choices(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=3, seed=1,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 18
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert sorted(streamed) == [0, 1, 2]


def test_prompt_shapes(client: openai.OpenAI, model: str, http) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=model, prompt=[PROMPT, "Hello"], max_tokens=3, n=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    many_ids = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert many_ids.choices[0].text == by_text.choices[0].text[: len(many_ids.choices[0].text)]


def test_echo(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, echo=True, temperature=0)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert result.choices[0].text == PROMPT + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, echo=True, temperature=0, stream=True))
    assert streamed == result.choices[0].text


def test_logprobs(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, logprobs=3,
                                       extra_body={"ignore_eos": True})
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(0 < len(top) <= 4 for top in lp.top_logprobs)  # 3 alternatives + the sampled token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, logprobs=2, stream=True, extra_body={"ignore_eos": True})
        if c.choices and c.choices[0].logprobs]
    assert sum(len(s.tokens) for s in streamed) == 5


def test_logprobs_up_to_20(client: openai.OpenAI, model: str) -> None:
    # Completions key the alternatives by token text, so tokens sharing a text (byte pieces) merge;
    # chat lists them, so exactly 20 come back.
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logprobs=20)
    assert all(0 < len(top) <= 21 for top in result.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=2, logprobs=True, top_logprobs=20)
    assert all(len(entry.top_logprobs) == 20 for entry in chat.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logprobs=21)
    assert caught.value.body["param"] == "logprobs"


def test_stop_strings(client: openai.OpenAI, model: str) -> None:
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 2]
    assert stop.strip(), f"degenerate text {free!r}"
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == cut.choices[0].text


def test_seed_reproducible(client: openai.OpenAI, model: str) -> None:
    args = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    first = client.completions.create(**args, seed=1234).choices[0].text
    again = client.completions.create(**args, seed=1234).choices[0].text
    other = [client.completions.create(**args, seed=s).choices[0].text for s in (1, 2, 3)]
    assert first == again
    assert any(text != first for text in other)


def test_sampling_extras_accepted(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, presence_penalty=0.5, frequency_penalty=0.5,
        logit_bias={"5": -100}, user="tester", top_p=0.9,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "priority": 0,
                    "cache_salt": "tenant-a", "stop_token_ids": [3]})
    assert result.usage.completion_tokens >= 2


def test_min_tokens_and_ignore_eos(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=20,
                                       extra_body={"ignore_eos": True, "min_tokens": 20})
    assert result.usage.completion_tokens == 20
