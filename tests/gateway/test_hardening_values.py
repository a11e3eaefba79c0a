"""Hostile values (issue 12): text UTF-8 cannot encode and extreme sampling numbers get a 400 naming the
field, or the answer the limit means; no response body ever holds NaN or Infinity."""

from __future__ import annotations

import json
import math

import httpx
import msgpack
import pytest

from pagegate.gateway.codec import dumps_json
from pagegate.gateway.render import LOGPROB_FLOOR, finite_logprob

PROMPT = "The quick brown fox"
SURROGATE = "\\ud800"  # the JSON escape; Python's json decodes it to a lone surrogate
JSON_HEADERS = {"Content-Type": "application/json"}


def strict_json(response: httpx.Response) -> dict:
    """The body, parsed the way strict clients (JavaScript, Go) do: NaN and Infinity are not JSON."""
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a response body: {response.text[:300]}")

    return json.loads(response.text, parse_constant=refuse)


def assert_bad(response: httpx.Response, param: str | None) -> dict:
    assert response.status_code == 400, response.text
    error = strict_json(response)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error


def post_raw(http: httpx.Client, path: str, body: str) -> httpx.Response:
    return http.post(path, content=body.encode(), headers=JSON_HEADERS)


MESSAGE = '{"role": "user", "content": "hi"}'


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", f'{{"prompt": "a{SURROGATE}b", "max_tokens": 1}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", "{SURROGATE}"], "max_tokens": 1}}', "prompt.1"),
    ("/v1/completions", f'{{"prompt": "hi", "model": "{SURROGATE}", "max_tokens": 1}}', "model"),
    ("/v1/completions", f'{{"prompt": "hi", "stop": ["x{SURROGATE}"], "max_tokens": 1}}', "stop.0"),
    ("/v1/completions", f'{{"prompt": "hi", "user": "{SURROGATE}", "max_tokens": 1}}', "user"),
    ("/v1/completions", f'{{"prompt": "hi", "logit_bias": {{"{SURROGATE}": 1}}, "max_tokens": 1}}', "logit_bias"),
    ("/v1/completions", f'{{"prompt": "hi", "{SURROGATE}": 1}}', None),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}], "max_tokens": 1}}',
     "messages.0.content"),
    ("/v1/chat/completions",
     f'{{"messages": [{MESSAGE}, {{"role": "user", "content": [{{"type": "text", "text": "{SURROGATE}"}}]}}]}}',
     "messages.1.content.0.text"),
    ("/v1/chat/completions", f'{{"messages": [{MESSAGE}], "model": "{SURROGATE}"}}', "model"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi", "name": "{SURROGATE}"}}]}}',
     "messages.0.name"),
    ("/tokenize", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}', "messages.0.content"),
    ("/tokenize", f'{{"prompt": "hi", "model": "{SURROGATE}"}}', "model"),
    ("/detokenize", f'{{"tokens": [1], "model": "{SURROGATE}"}}', "model"),
])
def test_lone_surrogate_is_a_400_naming_the_field(http: httpx.Client, path: str, body: str,
                                                  param: str | None) -> None:
    error = assert_bad(post_raw(http, path, body), param)
    assert "UTF-8" in error["message"] and "U+D800" in error["message"]


def test_a_surrogate_pair_is_one_valid_character(http: httpx.Client) -> None:
    """The escape pair of an astral character (an emoji) is fine; only lone halves are refused."""
    response = post_raw(http, "/tokenize", '{"prompt": "\\ud83d\\ude00"}')
    assert response.status_code == 200 and strict_json(response)["count"] > 0


def test_invalid_utf8_in_msgpack_names_the_field(http: httpx.Client) -> None:
    # {"prompt": <a str of the bytes ff fe>}: the str type promises UTF-8 and breaks the promise
    body = b"\x82\xa6prompt\xa2\xff\xfe\xaamax_tokens\x01"
    response = http.post("/v1/completions", content=body, headers={"Content-Type": "application/msgpack"})
    assert "UTF-8" in assert_bad(response, "prompt")["message"]
    # a lone surrogate smuggled as its 3-byte (CESU-style) encoding
    body = msgpack.Packer(unicode_errors="surrogatepass").pack({"messages": [{"role": "user", "content": "\ud800"}]})
    response = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/msgpack"})
    assert_bad(response, "messages.0.content")


@pytest.mark.parametrize("field, literal", [
    ("temperature", "NaN"),
    ("top_p", "NaN"),
    ("repetition_penalty", "Infinity"),
    ("presence_penalty", "-Infinity"),
    ("min_p", "NaN"),
])
def test_non_finite_numbers_are_a_400(http: httpx.Client, field: str, literal: str) -> None:
    """Python's json reads NaN/Infinity literals; no sampling knob may take one."""
    assert_bad(post_raw(http, "/v1/completions", f'{{"prompt": "hi", "{field}": {literal}}}'), field)


def test_non_finite_logit_bias_is_a_400(http: httpx.Client) -> None:
    response = post_raw(http, "/v1/completions", '{"prompt": "hi", "logit_bias": {"5": NaN}}')
    assert response.status_code == 400 and strict_json(response)["error"]["param"].startswith("logit_bias")


@pytest.mark.parametrize("penalty", [5e-324, 1e-30, 0.001, 1e3, 1e300])
def test_repetition_penalty_outside_the_safe_range_is_a_400(http: httpx.Client, penalty: float) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "logprobs": 2, "repetition_penalty": penalty}
    error = assert_bad(http.post("/v1/completions", json=body), "repetition_penalty")
    assert "repetition_penalty" in error["message"]


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_repetition_penalty_at_the_bounds_gives_finite_logprobs(http: httpx.Client, penalty: float) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 5, "repetition_penalty": penalty, "seed": 3,
            "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    logprobs = strict_json(response)["choices"][0]["logprobs"]
    values = logprobs["token_logprobs"] + [v for top in logprobs["top_logprobs"] for v in top.values()]
    assert len(logprobs["token_logprobs"]) == 6 and all(math.isfinite(v) for v in values)


def _greedy_tokens(http: httpx.Client, temperature: float, **extra: float) -> list[str]:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": temperature, "logprobs": 0, "ignore_eos": True,
            "seed": 11, **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return strict_json(response)["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 1e-7])
def test_vanishing_temperature_is_greedy(http: httpx.Client, temperature: float) -> None:
    greedy = _greedy_tokens(http, 0.0)
    assert len(greedy) == 8
    assert _greedy_tokens(http, temperature) == greedy


@pytest.mark.parametrize("extra", [{"top_p": 5e-324}, {"min_p": 1.0}, {"top_k": 1}])
def test_filters_at_their_limit_are_greedy(http: httpx.Client, extra: dict) -> None:
    """top_p -> 0 (0 in float32), min_p 1 and top_k 1 each leave only the most likely token."""
    assert _greedy_tokens(http, 1.0, **extra) == _greedy_tokens(http, 0.0)


def test_vanishing_temperature_is_greedy_in_chat(http: httpx.Client) -> None:
    def answer(temperature: float) -> str:
        body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
                "temperature": temperature, "seed": 5}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return strict_json(response)["choices"][0]["message"]["content"]

    assert answer(1e-39) == answer(0.0)


def test_logprob_floor_replaces_minus_infinity() -> None:
    """A token a request masked out has logprob -inf; the API says vLLM's -9999.0 instead."""
    assert finite_logprob(float("-inf")) == LOGPROB_FLOOR == -9999.0
    assert finite_logprob(float("nan")) == LOGPROB_FLOOR
    assert finite_logprob(-0.25) == -0.25


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_the_json_writer_refuses_non_finite_numbers(value: float) -> None:
    with pytest.raises(ValueError):
        dumps_json({"choices": [{"logprobs": {"token_logprobs": [value]}}]})
    assert json.loads(dumps_json({"logprob": -1.5, "text": "é"})) == {"logprob": -1.5, "text": "é"}
