"""The KV tiers through `pagegate serve` and the OpenAI SDK: cached_tokens counts pages from the tiers, /metrics counts
them per tier, a SIGKILLed server's disk directory never serves a wrong page, and two servers share a directory."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from pagegate.testing.launcher import ServerProcess, descendants, wait_gone
from tests.gateway.conftest import metric_value
from tests.gateway.server_args import server_args

PROMPT = np.random.default_rng(0).integers(10, 2000, 100).tolist()
OTHERS = [np.random.default_rng(seed).integers(10, 2000, 200).tolist() for seed in range(1, 4)]


def tiers_args(directory: Path, *extra: str) -> list[str]:
    return server_args("--num-kv-blocks", "24", "--max-model-len", "256", "--kv-offload-memory", "4MiB",
                       "--kv-cache-dir", str(directory), "--kv-offload-min-reuse", "1", *extra)


def complete(server: ServerProcess, prompt: list[int]) -> tuple[str, int]:
    """(the greedy text, usage's cached prompt tokens)."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=6,
                                       temperature=0)
    details = answer.usage.prompt_tokens_details if answer.usage else None
    return answer.choices[0].text, (details.cached_tokens or 0) if details else 0


def test_tier_hits_count_as_cached_tokens_and_in_metrics(tmp_path: Path) -> None:
    with ServerProcess(tiers_args(tmp_path)) as server:
        cold, cached = complete(server, PROMPT)
        assert cached == 0
        for other in OTHERS:  # the pool's 24 pages: PROMPT's pages leave it
            complete(server, other)
        warm, cached = complete(server, PROMPT)
        assert warm == cold and cached == 96
        metrics = httpx.get(server.base_url + "/metrics").text
        assert (metric_value(metrics, "pagegate:kv_tier_hits_total") or 0) >= 6
        assert (metric_value(metrics, "pagegate:kv_tier_pages") or 0) > 0


def test_a_killed_server_leaves_nothing_served_wrongly(tmp_path: Path) -> None:
    """SIGKILL while pages are being written: a restart serves each prompt exactly as a cold server does."""
    with ServerProcess(server_args("--num-kv-blocks", "24", "--max-model-len", "256")) as plain:
        expected = [complete(plain, p)[0] for p in [PROMPT, *OTHERS]]
    server = ServerProcess(tiers_args(tmp_path, "--kv-offload-memory", "64KiB")).start()  # host tier tiny: disk
    try:
        for prompt in [PROMPT, *OTHERS, PROMPT]:
            complete(server, prompt)
    finally:
        assert server.process is not None
        family = [server.process.pid, *descendants(server.process.pid)]
        for pid in family:
            os.kill(pid, signal.SIGKILL)
        assert wait_gone(family) == []
    with ServerProcess(tiers_args(tmp_path)) as restarted:
        assert [complete(restarted, p)[0] for p in [PROMPT, *OTHERS]] == expected


def test_two_servers_on_one_directory_take_their_own_slots(tmp_path: Path) -> None:
    with ServerProcess(tiers_args(tmp_path)) as first, ServerProcess(tiers_args(tmp_path)) as second:
        assert complete(first, PROMPT)[0] == complete(second, PROMPT)[0]
        slots = sorted(p.name for p in tmp_path.glob("*/*") if p.is_dir())
        assert slots == ["0", "1"]


def test_bad_tier_flags_are_usage_errors() -> None:
    from pagegate.gateway.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--kv-offload-memory", "4GiB"]).kv_offload_memory == "4GiB"
    for flags in (["--kv-offload-memory", "4QB"], ["--kv-cache-disk", "lots"], ["--kv-offload-min-reuse", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *flags])


def test_a_sleeping_model_keeps_its_prefixes_in_host_memory(tmp_path: Path) -> None:
    """Sleep frees the pool; with a host tier its cached pages go there first, so the woken model hits them."""
    from pagegate.engine.loading.loader import DEFAULT_MODEL

    args = server_args("--model", str(DEFAULT_MODEL), "--model", str(DEFAULT_MODEL), "--served-model-name", "a", "b",
                       "--num-kv-blocks", "24", "--max-model-len", "256", "--kv-offload-memory", "4MiB")
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)

        def complete_a() -> tuple[str, int]:
            answer = client.completions.create(model="a", prompt=PROMPT, max_tokens=6, temperature=0)
            details = answer.usage.prompt_tokens_details if answer.usage else None
            return answer.choices[0].text, (details.cached_tokens or 0) if details else 0

        cold, _ = complete_a()
        slept = httpx.post(server.base_url + "/sleep", params={"model": "a"})
        assert slept.status_code == 200, slept.text
        assert complete_a() == (cold, 96)  # woken by the request: its prefix from host memory
