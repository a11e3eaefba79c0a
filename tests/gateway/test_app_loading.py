"""The app before its engine is up (no lifespan run): 503s, auth and CORS still answer correctly."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pagegate.gateway.settings import GatewayConfig
from tests.gateway.unstarted import unstarted_client


@pytest.fixture
def loading_app() -> TestClient:
    config = GatewayConfig(api_keys=["secret"], allowed_origins=["http://ui.example"], max_request_bytes=1000)
    return unstarted_client(config)  # the lifespan (engine load) never runs


def test_health_and_api_are_503_while_loading(loading_app: TestClient) -> None:
    health = loading_app.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "loading"
    answer = loading_app.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer secret"})
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "server_error"
    assert loading_app.get("/metrics").status_code == 503


def test_static_routes_work_while_loading(loading_app: TestClient) -> None:
    assert loading_app.get("/version").status_code == 200
    assert "/v1/completions" in loading_app.get("/openapi.json").json()["paths"]


def test_auth_comes_first(loading_app: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic secret"}):
        response = loading_app.post("/v1/chat/completions", json={}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"


def test_cors(loading_app: TestClient) -> None:
    preflight = loading_app.options("/v1/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
    other = loading_app.get("/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
