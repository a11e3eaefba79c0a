"""The admin role: with --api-key and --admin-api-key, only an admin key loads, unloads, sleeps and wakes models and
LoRA adapters (an ordinary key gets a 403 in OpenAI's error shape, as /openapi.json documents it), every key reads
the state, and only an admin sees an adapter's path on the server (REST and gRPC). Without any key the server is
open and its start-up log warns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import schemathesis
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import pagegate
from pagegate.gateway.auth import MANAGEMENT_PATHS
from pagegate.gateway.openapi import openapi_document
from pagegate.gateway.proto import pagegate_pb2 as pb
from pagegate.gateway.proto import pagegate_pb2_grpc as pb_grpc
from pagegate.testing.launcher import ServerProcess, free_port
from tests.gateway.server_args import server_args

USER, ADMIN, ENV_ADMIN = "user-key", "admin-key", "env-admin-key"
DEFAULT_MODEL = str(Path(pagegate.__file__).parent / "engine" / "default_model")
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]
# a body each management route reads (what it would do with it, an admin key does: see the admin test)
BODIES: dict[str, dict[str, Any]] = {"/models/load": {"model": "x"}, "/models/unload": {"model": "x"}, "/sleep": {},
                                     "/wake_up": {}, "/v1/load_lora_adapter": {"lora_name": "b", "lora_path": "/etc"},
                                     "/v1/unload_lora_adapter": {"lora_name": "tiny"}}


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def admin_server(adapter_folder: Path, grpc_port: int) -> Iterator[ServerProcess]:
    args = server_args("--num-kv-blocks", "64", "--max-model-len", "512", "--max-num-seqs", "4", "--api-key", USER,
                       "--admin-api-key", ADMIN, "--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora",
                       "--lora-modules", f"tiny={adapter_folder}", "--grpc-port", str(grpc_port))  # last: it wins
    with ServerProcess(args, env={"PAGEGATE_ADMIN_API_KEY": ENV_ADMIN}) as process:
        yield process


def call(server: ServerProcess, path: str, key: str | None, body: dict[str, Any] | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if path == "/is_sleeping":
        return httpx.get(server.base_url + path, headers=headers, timeout=60)
    return httpx.post(server.base_url + path, json=body if body is not None else BODIES[path], headers=headers,
                      timeout=60)


def sdk(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_an_ordinary_key_may_not_manage_the_server(admin_server: ServerProcess) -> None:
    for path in sorted(MANAGEMENT_PATHS):
        refused = call(admin_server, path, USER)
        assert refused.status_code == 403, (path, refused.text)
        assert refused.json() == {"error": {"message": refused.json()["error"]["message"], "type": "permission_error",
                                            "param": None, "code": "admin_key_required"}}
        assert "admin key" in refused.json()["error"]["message"]
        assert call(admin_server, path, None).status_code == 401  # no key at all: unauthenticated, as before
    with pytest.raises(openai.PermissionDeniedError) as denied:  # the SDK reads it as OpenAI's 403
        sdk(admin_server, USER).post("/load_lora_adapter", cast_to=object, body=BODIES["/v1/load_lora_adapter"])
    assert denied.value.code == "admin_key_required"
    asleep = call(admin_server, "/is_sleeping", USER)  # reading the state stays open to every key
    assert asleep.status_code == 200 and asleep.json()["is_sleeping"] is False  # the refused /sleep did nothing
    assert "tiny" in {card.id for card in sdk(admin_server, USER).models.list().data}  # nor the refused unload


def test_an_admin_key_manages_the_server_and_serves_as_any_key(admin_server: ServerProcess) -> None:
    slept = call(admin_server, "/sleep", ADMIN)
    assert slept.status_code == 200 and slept.json()["state"] == "sleeping", slept.text
    assert call(admin_server, "/is_sleeping", USER).json()["is_sleeping"] is True
    woken = call(admin_server, "/wake_up", ENV_ADMIN)  # $PAGEGATE_ADMIN_API_KEY is an admin key too
    assert woken.status_code == 200 and woken.json()["state"] == "loaded", woken.text
    # past the role check, each route answers as it would on an open server
    assert "serves one model" in call(admin_server, "/models/load", ADMIN).json()["error"]["message"]
    missing = call(admin_server, "/v1/load_lora_adapter", ADMIN, {"lora_name": "b", "lora_path": "/no/such/folder"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    unknown = call(admin_server, "/v1/unload_lora_adapter", ADMIN, {"lora_name": "nobody"})
    assert unknown.status_code == 404
    answer = sdk(admin_server, ADMIN).completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert answer.usage is not None and answer.usage.completion_tokens == 2


def grpc_roots(port: int, key: str) -> dict[str, str]:
    """ListModels over gRPC with `key`: each card's root."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        cards = pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), timeout=30,
                                                             metadata=[("authorization", f"Bearer {key}")])
    return {card.id: card.root for card in cards.data}


def test_only_an_admin_sees_an_adapters_path_on_the_server(admin_server: ServerProcess, adapter_folder: Path,
                                                           grpc_port: int) -> None:
    for key, root in ((USER, "tiny"), (ADMIN, str(adapter_folder))):
        cards = {card.id: card.model_extra or {} for card in sdk(admin_server, key).models.list().data}
        base = next(name for name in cards if name != "tiny")
        assert cards["tiny"]["root"] == root and cards["tiny"]["parent"] == base, key  # the card kept otherwise
        detail = httpx.get(f"{admin_server.base_url}/v1/models/tiny", headers={"Authorization": f"Bearer {key}"})
        assert detail.json()["root"] == root
        assert grpc_roots(grpc_port, key)["tiny"] == root
    assert str(adapter_folder) not in httpx.get(admin_server.base_url + "/v1/models",
                                                headers={"Authorization": f"Bearer {USER}"}).text


def test_the_403_is_documented(admin_server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_dict(openapi_document())
    for path in sorted(MANAGEMENT_PATHS):
        case = schema[path]["POST"].Case(body=BODIES[path], media_type="application/json",
                                         headers={"Authorization": f"Bearer {USER}"})
        response = case.call_and_validate(base_url=admin_server.base_url, checks=CHECKS, timeout=60)
        assert response.status_code == 403, path


def test_the_start_up_log_says_who_may_manage(admin_server: ServerProcess, server: ServerProcess) -> None:
    assert "anyone who reaches this server" not in admin_server.log()
    assert "refused to every key" not in admin_server.log()
    assert "WARNING pagegate.gateway: no --api-key nor --admin-api-key: anyone who reaches this server may use it " \
           "and manage it" in server.log()  # conftest's shared server has no key
