"""`pagegate serve --kv-cache-dtype`: the pages' format in the start-up line and /metrics, answers through the
OpenAI SDK equal to the offline engine on the same format, and an unknown format refused at start."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai

from pagegate import LLM, SamplingParams
from pagegate.testing.launcher import ServerProcess
from tests.gateway.server_args import server_args

PROMPT = "In the beginning God created the heaven and the earth."


def test_int8_pages_are_served_counted_and_announced() -> None:
    server = ServerProcess(server_args("--kv-cache-dtype", "int8", "--kv-cache-memory", "16MiB")).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        served = client.completions.create(model="pagegate-default", prompt=PROMPT, max_tokens=12, temperature=0)
        metrics = httpx.get(server.base_url + "/metrics").text
    finally:
        server.stop()
    # the embedded model: 4 layers, 2 KV heads of 64 -> 2 * 4 * 2 * 66 bytes a token
    assert "int8 pages, 1,056 bytes a token" in server.log()
    assert 'pagegate:kv_cache_bytes_per_token{kv_cache_dtype="int8",model_name="pagegate-default"} 1056.0' in metrics
    offline = LLM(dtype="float32", device="cpu", kv_cache_dtype="int8", kv_cache_memory="16MiB")
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert served.choices[0].text == expected[0].outputs[0].text


def test_an_unknown_format_is_refused_with_the_choices() -> None:
    result = subprocess.run([sys.executable, "-m", "pagegate", "serve", *server_args("--kv-cache-dtype", "q4_0")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "invalid choice: 'q4_0'" in result.stderr and "fp8_e4m3" in result.stderr
