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


def test_the_gateway_starts_without_importing_torch() -> None:
    """The port opens and /health answers while the engine (and torch) load in a thread."""
    import subprocess
    import sys

    code = "import sys, pagegate.gateway.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


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
