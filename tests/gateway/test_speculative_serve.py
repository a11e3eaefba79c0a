"""`pagegate serve --speculative-config`: the served answer is the plain server's, the counters move, and a bad
config is refused at start."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagegate.gateway.cli import build_parser
from pagegate.testing.launcher import ServerProcess
from tests.gateway.conftest import SERVER_ARGS, metric_value

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPT = "the page pool, the block table, the page pool, the block table, the page pool, the block"


def test_a_speculating_server_answers_as_the_plain_one(client: openai.OpenAI, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    plain = client.completions.create(**body).choices[0].text
    with ServerProcess([*SERVER_ARGS, "--speculative-config", json.dumps(NGRAM)]) as server:
        guessing = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        assert guessing.completions.create(**body).choices[0].text == plain
        streamed = "".join(c.choices[0].text for c in guessing.completions.create(**body, stream=True) if c.choices)
        assert streamed == plain
        metrics = httpx.get(server.base_url + "/metrics").text
    drafted = metric_value(metrics, "vllm:spec_decode_num_draft_tokens_total")
    kept = metric_value(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafted and kept and 0 < kept <= drafted
    assert metric_value(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == kept


@pytest.mark.parametrize("config", ['{"method": "eagle"}', '{"num_speculative_tokens": 0}', "not json",
                                    '{"method": "draft_model"}'])
def test_a_bad_config_is_refused_at_start(config: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", config])
