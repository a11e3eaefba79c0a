"""Pure pieces of the gateway, no server: validation messages, key comparison."""

from __future__ import annotations

import pytest

from pagegate.gateway.auth import bearer_token, key_matches
from pagegate.gateway.errors import APIError
from pagegate.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_request


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1], [2, 3]]])
def test_prompt_shapes_accepted(prompt) -> None:
    assert parse_request(CompletionRequest, {"prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "Missing required parameter"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    ({"prompt": "x", "bogus": 1}, "bogus", "Unrecognized request argument"),
    ({"prompt": [1, "a"]}, "prompt", "token ids"),
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens", "valid integer"),
])
def test_validation_names_the_param(body, param, words) -> None:
    with pytest.raises(APIError) as caught:
        parse_request(CompletionRequest, body)
    assert caught.value.param == param and words in caught.value.message and caught.value.status_code == 400


def test_chat_content_parts_and_roles() -> None:
    request = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert request.messages[0].text() == "ab"
    with pytest.raises(APIError) as caught:
        parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})
    assert "input_audio" in caught.value.message


def test_keys_and_bearer() -> None:
    assert key_matches("k2", ["k1", "k2"]) and not key_matches("k3", ["k1", "k2"]) and not key_matches("k", [])
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None and bearer_token("Bearer ") is None


# What a gateway's start-up never needs (issue 57: start-up): torch is the engine's; numpy, the page core and the
# image decoders come with a snapshot or an image; jinja2 with the first chat template (the warm-up renders one);
# llguidance with the first grammar; the Responses, Messages, Files and Batch APIs' modules with their first request.
LATER = ("torch", "numpy", "pagegate.core", "PIL", "jinja2", "llguidance", "pagegate.gateway.responses.routes",
         "pagegate.gateway.messages.routes", "pagegate.gateway.batches.routes", "pagegate.gateway.openapi",
         "pagegate.gateway.dashboard.routes", "pagegate.gateway.dashboard.frames")


def test_the_gateway_starts_without_importing_what_only_later_requests_need() -> None:
    import subprocess
    import sys

    code = f"import sys, pagegate.gateway.cli; print([m for m in {LATER!r} if m in sys.modules])"
    found = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"


@pytest.mark.parametrize("body", [
    {"choices": [{"index": 0, "text": "é\u2028", "prompt_logprobs": [None, {"5": {"logprob": -1.5, "rank": 1,
                                                                            "decoded_token": "x"}}],
                  "logprobs": {"tokens": ["a", "b"], "token_logprobs": [None, -0.5],
                               "top_logprobs": [None, {"b": -0.5}], "text_offset": [0, 1]}}],
     "usage": {"prompt_tokens": 2}},
    [], {}, [[]], {"x": []}, [None, [1], {"k": [2]}], "text", 1.5, None, {1: [2]},
])
def test_encoding_in_pieces_gives_the_same_bytes(body: object) -> None:
    """Large scored answers are encoded a piece at a time (codec.dumps_in_pieces): byte for byte what one call gives."""
    from pagegate.gateway.codec import dumps_in_pieces, dumps_json, dumps_msgpack

    assert dumps_in_pieces(body, msgpack_body=False) == dumps_json(body)
    assert dumps_in_pieces(body, msgpack_body=True) == dumps_msgpack(body)
