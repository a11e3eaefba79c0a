"""The app before its engine is up, in process: a TestClient not entered, so the lifespan never runs and no engine
starts, but with the state the lifespan would yield, as a server gives every request while the model loads."""

from __future__ import annotations

from starlette.testclient import TestClient

from pagegate.config import EngineConfig
from pagegate.gateway.app import build_app, build_state
from pagegate.gateway.gateway_state import GatewayState
from pagegate.gateway.settings import GatewayConfig


def unstarted_client(config: GatewayConfig, engine_config: EngineConfig | None = None) -> TestClient:
    """`client.app_state` holds the GatewayState its requests see."""
    state: GatewayState = build_state(engine_config or EngineConfig(), config)
    client = TestClient(build_app(state))
    client.app_state.update(state)
    return client

