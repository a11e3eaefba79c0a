"""The dashboard without a browser: frames (key, then XOR deltas), the history, its routes, auth and flag."""

from __future__ import annotations

import base64
import json

import msgspec
import numpy as np
import pytest
from starlette.testclient import TestClient

from pagegate.core.page_map import rle_decode
from pagegate.engine.observe.stats import EngineStats
from pagegate.engine.pool_snapshot import PoolSnapshot
from pagegate.gateway.cli import build_parser, configs_from_args
from pagegate.gateway.dashboard.frames import EVERY_ID, MAX_LISTED, FrameEncoder, shown_id
from pagegate.gateway.dashboard.history import History
from pagegate.gateway.settings import GatewayConfig
from tests.gateway.unstarted import unstarted_client

STATS = EngineStats(running=2, waiting=1, swapped=0, num_blocks=6, free_blocks=3, used_blocks=3, cached_blocks=1,
                    shared_blocks=1, kv_cache_usage=0.5, cpu_blocks=2, cpu_used_blocks=0, preemptions=0,
                    swap_outs=0, swap_out_blocks=0, swap_in_blocks=0, prefix_cache_queries=10,
                    prefix_cache_hits=4, max_num_seqs=8, pinned_blocks=0, spec_drafts=3, spec_draft_tokens=8,
                    spec_accepted_tokens=6, spec_accepted_per_position=(3, 2, 1), host_tier_pages=5,
                    host_tier_capacity=40, disk_tier_pages=0, disk_tier_capacity=0, tier_hit_pages=3, lora_blocks=0,
                    lora_loads=0, requests=2,
                    prompt_tokens=10, generation_tokens=0)


def snapshot(device: list[int], seq_pages: dict | None = None, stats: EngineStats = STATS) -> PoolSnapshot:
    queues = seq_pages or {"running": [("a", np.array([0, 1], np.int32)), ("a", np.array([0, 2], np.int32))],
                           "waiting": [("b", np.zeros(0, np.int32))], "swapped": []}
    return PoolSnapshot(1.0, np.array(device, np.uint8), np.zeros(2, np.uint8), stats, "OK", "fine", queues)


def decode(text: str, states: np.ndarray, delta: bool) -> np.ndarray:
    rle_decode(base64.b64decode(text), states, delta)
    return states


def frame_of(encoder: FrameEncoder, snap: PoolSnapshot, history: History, key: bool = False,
             audience: str | None = EVERY_ID, tenants: dict[str, str] | None = None) -> dict:
    """One viewer's frame of this snapshot, parsed from its SSE bytes."""
    event = encoder.encode(snap, history, "m", {(audience, key)}, tenants or {})[audience, key]
    assert event.startswith(b"event: frame\ndata: {") and event.endswith(b"}\n\n") and b"\n" not in event[19:-2]
    return json.loads(event[len(b"event: frame\ndata: "):])


def test_first_frame_is_whole_and_later_ones_are_xor_deltas() -> None:
    encoder, history = FrameEncoder(), History()
    first = frame_of(encoder, snapshot([2, 1, 1, 0x80, 0, 0]), history)  # no frame before: a key frame anyway
    assert first["key"] and first["total_pages"] == 6 and first["used_pages"] == 3 and first["prefix_hit_rate"] == 0.4
    assert first["spec_acceptance_rate"] == 0.75
    states = decode(first["pages"], np.zeros(6, np.uint8), delta=False)
    assert states.tolist() == [2, 1, 1, 0x80, 0, 0]
    assert first["queues"]["running"] == {"count": 1, "requests": [["a", 2, 3]]}  # page 0 counted once
    assert first["queues"]["waiting"] == {"count": 1, "requests": [["b", 1, 0]]}
    second = frame_of(encoder, snapshot([0, 0, 0, 0x80, 0, 0]), history)
    assert not second["key"] and "queues" not in second  # the same queues are not sent again
    assert decode(second["pages"], states, delta=True).tolist() == [0, 0, 0, 0x80, 0, 0]
    assert len(base64.b64decode(second["pages"])) < len(base64.b64decode(first["pages"]))
    third = frame_of(encoder, snapshot([0] * 6), history, key=True)  # a viewer that just joined
    assert third["key"] and "queues" in third and "history" in third


def test_one_snapshot_is_encoded_once_per_audience_and_kind() -> None:
    encoder, history = FrameEncoder(), History()
    encoder.encode(snapshot([1] * 6), history, "m", {(EVERY_ID, True)}, {})
    frames = encoder.encode(snapshot([0] * 6), history, "m", {(EVERY_ID, True), (EVERY_ID, False)}, {})
    assert encoder.frames_encoded == 3 and set(frames) == {(EVERY_ID, True), (EVERY_ID, False)}
    assert json.loads(frames[EVERY_ID, True][19:])["key"] and not json.loads(frames[EVERY_ID, False][19:])["key"]


def test_other_keys_requests_are_listed_without_their_ids() -> None:
    encoder, tenants = FrameEncoder(), {"a": "tenant-1", "b": "tenant-2"}
    mine = frame_of(encoder, snapshot([2, 1, 1, 0, 0, 0]), History(), True, "tenant-1", tenants)
    assert mine["queues"]["running"]["requests"] == [["a", 2, 3]]
    assert mine["queues"]["waiting"]["requests"] == [[None, 1, 0]]  # b's: counted, not named
    assert shown_id("a", EVERY_ID, tenants) == "a" and shown_id("c", "tenant-1", tenants) is None


def test_long_queues_are_cut_and_counted() -> None:
    many = {"running": [(f"r{i}", np.array([i], np.int32)) for i in range(MAX_LISTED + 5)], "waiting": [],
            "swapped": []}
    frame = frame_of(FrameEncoder(), snapshot([1] * 6, many), History())
    assert frame["queues"]["running"]["count"] == MAX_LISTED + 5
    assert len(frame["queues"]["running"]["requests"]) == MAX_LISTED


def test_history_points_are_per_interval_and_sent_once() -> None:
    history, encoder = History(max_points=3), FrameEncoder()
    history.sample(STATS, 0.0)
    assert history.count == 0  # the first sample is the baseline
    def at(t: int) -> EngineStats:
        return msgspec.structs.replace(STATS, prefix_cache_queries=10 + 10 * t, prefix_cache_hits=4 + 5 * t, preemptions=t,
                       swap_outs=2 * t)

    for t in range(1, 6):
        history.sample(at(t), float(t))
    assert [p.as_list() for p in history.points] == [[t, 0.5, 0.5, 1, 2] for t in (3.0, 4.0, 5.0)]
    assert history.since(4) == [history.points[-1]] and history.since(5) == []
    assert len(frame_of(encoder, snapshot([0] * 6), history)["history"]) == 3  # a key frame: all of it
    assert "history" not in frame_of(encoder, snapshot([0] * 6), history)
    history.sample(at(5), 6.0)
    assert frame_of(encoder, snapshot([0] * 6), history)["history"][0][2] is None  # no prompts: no hit rate


@pytest.fixture
def app() -> TestClient:
    return unstarted_client(GatewayConfig(api_keys=["secret"]))  # no lifespan: no engine


def test_page_and_files_are_served_from_the_package(app: TestClient) -> None:
    page = app.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'data-auth-required="true"' in page.text
    for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "text/css")):
        response = app.get(f"/dashboard/static/{name}")
        assert response.status_code == 200 and kind in response.headers["content-type"]
    for name in ("dashboard.js", "dashboard.css"):  # nothing to fetch from elsewhere
        assert "http" not in app.get(f"/dashboard/static/{name}").text
    assert "http" not in page.text
    assert app.get("/dashboard/static/nothing.js").status_code == 404


def test_data_needs_the_key_as_header_or_query(app: TestClient) -> None:
    for path in ("/dashboard/api/feed", "/dashboard/api/page?id=0", "/dashboard/api/pages?request=x"):
        assert app.get(path).status_code == 401
        assert app.get(path + "&api_key=nope" if "?" in path else path + "?api_key=nope").status_code == 401
    # past auth, the engine is not loaded (no lifespan here): 503, not 401
    assert app.get("/dashboard/api/page?id=0", headers={"Authorization": "Bearer secret"}).status_code == 503
    assert app.get("/dashboard/api/page?id=0&api_key=secret").status_code == 503
    assert app.get("/v1/models?api_key=secret").status_code == 401  # the query key is for the dashboard only


def test_disable_dashboard() -> None:
    assert configs_from_args(build_parser().parse_args([]))[1].enable_dashboard
    config = configs_from_args(build_parser().parse_args(["--disable-dashboard"]))[1]
    assert not config.enable_dashboard
    app = unstarted_client(config)
    assert [app.get(p).status_code for p in ("/dashboard", "/dashboard/api/feed", "/dashboard/static/dashboard.js")] \
        == [404, 404, 404]
