"""--api-key-config (named, weighted keys with a quota of KV pages) and the batch lane, through the gateway: the file
parses or says what is wrong; a configured key opens the API; its name, never its key, labels
pagegate:key_kv_blocks_used; its quota reaches the scheduler; every generating and embedding route passes the lane
the batch runner set in the scope, and the key's share, to the engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Receive, Scope, Send

from pagegate.config import CacheConfig, EngineConfig
from pagegate.engine.tenants import KeyShare
from pagegate.gateway.app import build_app, build_state
from pagegate.gateway.auth import key_identity
from pagegate.gateway.cli import build_parser, configs_from_args
from pagegate.gateway.key_config import KeyShares, load_key_config, parse_key_config
from pagegate.gateway.lanes import BATCH, LANE_STATE, ONLINE
from pagegate.gateway.settings import ConfiguredKey, GatewayConfig
from pagegate.testing.launcher import wait_for

TEAM_KEY, TINY_KEY, PLAIN_KEY = "team-secret-1234", "tiny-secret-5678", "plain-key"
TEAM = KeyShare("team-a", weight=2.0)
TINY = KeyShare("tiny", max_kv_blocks=1)  # one page: 16 tokens


def test_a_json_list_and_a_toml_table_give_the_same_keys(tmp_path: Path) -> None:
    entries = [{"name": "team-a", "key": TEAM_KEY, "weight": 2}, {"name": "tiny", "key": TINY_KEY, "max_kv_blocks": 1}]
    (tmp_path / "keys.json").write_text(json.dumps(entries))
    (tmp_path / "keys.toml").write_text(f'[[keys]]\nname = "team-a"\nkey = "{TEAM_KEY}"\nweight = 2\n\n'
                                        f'[[keys]]\nname = "tiny"\nkey = "{TINY_KEY}"\nmax_kv_blocks = 1\n')
    expected = [ConfiguredKey(TEAM_KEY, TEAM), ConfiguredKey(TINY_KEY, TINY)]
    assert load_key_config(tmp_path / "keys.json") == expected == load_key_config(tmp_path / "keys.toml")
    assert parse_key_config({"keys": entries}) == expected


@pytest.mark.parametrize(("raw", "says"), [
    ([], "a list of keys"),
    ([{"name": "a"}], "non-empty strings"),
    ([{"name": "a", "key": "k", "colour": "red"}], "unknown field"),
    ([{"name": "a", "key": "k", "weight": 0}], "weight must be above 0"),
    ([{"name": "a", "key": "k", "max_kv_blocks": 2.5}], "whole number"),
    ([{"name": "a", "key": "k"}, {"name": "a", "key": "j"}], "share a name"),
    ([{"name": "a", "key": "k"}, {"name": "b", "key": "k"}], "share a key"),
])
def test_a_bad_key_config_says_what_is_wrong(raw: Any, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_key_config(raw)


def test_a_key_without_an_entry_weighs_one_and_has_no_quota() -> None:
    shares = KeyShares([ConfiguredKey(TEAM_KEY, TEAM)])
    assert shares.of(key_identity(TEAM_KEY)) == TEAM
    assert shares.of(key_identity(PLAIN_KEY)) == KeyShare(key_identity(PLAIN_KEY))
    assert shares.of(None) is None


def test_the_flag_reads_the_file_and_its_keys_open_the_api(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "team-a", "key": TEAM_KEY, "weight": 2}]))
    _, config = configs_from_args(build_parser().parse_args(["--api-key", PLAIN_KEY, "--api-key-config", str(path)]))
    assert config.api_key_config == [ConfiguredKey(TEAM_KEY, TEAM)]
    assert config.client_api_keys == [PLAIN_KEY, TEAM_KEY] and TEAM_KEY in config.every_api_key
    path.write_text("[{}]")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--api-key-config", str(path)])


def in_batch_lane(app: ASGIApp) -> ASGIApp:
    """What the batch runner does to a line's scope: a request with `x-test-lane: batch` runs in the batch lane."""
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (b"x-test-lane", b"batch") in scope["headers"]:
            scope.setdefault("state", {})[LANE_STATE] = BATCH
        await app(scope, receive, send)
    return wrapped


class Recorder:
    """The lane and key of every generation and embedding the gateway starts on the engine."""

    def __init__(self, engine: Any) -> None:
        self.seen: list[tuple[str, KeyShare | None]] = []
        for name in ("generate", "embed"):
            setattr(engine, name, self._recording(getattr(engine, name)))

    def _recording(self, method: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.seen.append((kwargs["lane"], kwargs["key"]))
            return method(*args, **kwargs)
        return recorded


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TestClient, Recorder]]:
    engine_config = EngineConfig(dtype="float32", device="cpu", pooling="mean", cache=CacheConfig(num_kv_blocks=128))
    config = GatewayConfig(grpc_port=0, api_keys=[PLAIN_KEY],
                           api_key_config=[ConfiguredKey(TEAM_KEY, TEAM), ConfiguredKey(TINY_KEY, TINY)])
    state = build_state(engine_config, config)
    host = state["host"]
    with TestClient(in_batch_lane(build_app(state))) as client:
        wait_for(lambda: host.state != "loading", "the model to load", 120)
        assert host.state == "ready", host.reason
        yield client, Recorder(host.engine)


def post(client: TestClient, path: str, body: dict[str, Any], key: str = TEAM_KEY, lane: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}", **({"x-test-lane": lane} if lane else {})}
    return client.post(path, json=body, headers=headers)


def test_a_configured_key_opens_the_api(served: tuple[TestClient, Recorder]) -> None:
    client, _ = served
    for key in (TEAM_KEY, PLAIN_KEY):
        assert post(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}, key).status_code == 200
    assert post(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}, "wrong").status_code == 401


def test_key_pages_are_shown_by_the_keys_name_never_its_key(served: tuple[TestClient, Recorder]) -> None:
    client, _ = served
    assert post(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}).status_code == 200
    text = client.get("/metrics").text
    shown = [line for line in text.splitlines() if line.startswith("pagegate:key_kv_blocks_used{")]
    assert any('key="team-a"' in line for line in shown), shown
    assert TEAM_KEY not in text and TINY_KEY not in text


def test_a_keys_quota_reaches_the_scheduler(served: tuple[TestClient, Recorder]) -> None:
    client, _ = served
    response = post(client, "/v1/completions", {"prompt": [5] * 40, "max_tokens": 2}, TINY_KEY)
    assert response.status_code == 400 and "quota of 1" in response.json()["error"]["message"]


ROUTES = {
    "completions": ("/v1/completions", {"prompt": "Hello", "max_tokens": 1}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    "responses": ("/v1/responses", {"input": "Hello", "max_output_tokens": 1, "store": False}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    "embeddings": ("/v1/embeddings", {"input": "Hello"}),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_route_passes_the_lane_and_the_keys_share_to_the_engine(served: tuple[TestClient, Recorder],
                                                                      route: str) -> None:
    client, recorder = served
    path, body = ROUTES[route]
    model = client.get("/v1/models", headers={"Authorization": f"Bearer {TEAM_KEY}"}).json()["data"][0]["id"]
    for lane in (BATCH, ONLINE):
        recorder.seen.clear()
        response = post(client, path, {**body, "model": model}, lane=lane if lane == BATCH else None)
        assert response.status_code == 200, response.text
        assert recorder.seen == [(lane, TEAM)]
