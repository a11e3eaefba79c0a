"""/v1/files and /v1/batches through the OpenAI SDK against a real server: each endpoint's batch answers what its
online route answers, bad lines land in the error file with the counts right, a key reaches only its own files and
batches, uploads are bounded by --batch-max-bytes, deletes free the disk, cancel ends a batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from pagegate.gateway.settings import GatewayConfig
from pagegate.testing.launcher import ServerProcess, cores_stopped
from tests.gateway.batches.conftest import KEY_A, jsonl, requests, run, submit, wait_ended
from tests.gateway.unstarted import unstarted_client

PROMPTS = ["In the beginning", "And the LORD said", "Blessed are"]


def chat_body(model: str, prompt: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0}


def chat_text(body: dict[str, Any]) -> str:
    return body["choices"][0]["message"]["content"]


def response_text(body: dict[str, Any]) -> str:
    return "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])


# endpoint -> (a request body for a prompt, the online call through the SDK, what of the answer must agree)
ENDPOINTS: dict[str, tuple[Callable[[str, str], dict], Callable[[openai.OpenAI], Callable], Callable[[dict], Any]]] = {
    "/v1/chat/completions": (chat_body, lambda client: client.chat.completions.create, chat_text),
    "/v1/completions": (lambda model, prompt: {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0},
                        lambda client: client.completions.create, lambda body: body["choices"][0]["text"]),
    "/v1/responses": (lambda model, prompt: {"model": model, "input": prompt, "max_output_tokens": 4,
                                             "temperature": 0, "store": False},
                      lambda client: client.responses.create, response_text),
    "/v1/embeddings": (lambda model, prompt: {"model": model, "input": prompt, "encoding_format": "float"},
                       lambda client: client.embeddings.create, lambda body: body["data"][0]["embedding"]),
}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_batch_answers_what_the_online_route_answers(client_a: openai.OpenAI, model_name: str,
                                                       endpoint: str) -> None:
    make_body, online, answer_of = ENDPOINTS[endpoint]
    bodies = [make_body(model_name, prompt) for prompt in PROMPTS]
    batch, output, errors = run(client_a, endpoint, requests(endpoint, bodies))
    assert (batch.status, batch.endpoint, errors, batch.error_file_id) == ("completed", endpoint, [], None)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 3, 0)
    assert None not in (batch.in_progress_at, batch.finalizing_at, batch.completed_at)
    assert [line["custom_id"] for line in output] == ["r0", "r1", "r2"]
    for line, body in zip(output, bodies, strict=True):
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
        expected = answer_of(online(client_a)(**body).model_dump())
        if endpoint == "/v1/embeddings":
            np.testing.assert_allclose(answer_of(line["response"]["body"]), expected, rtol=1e-6, atol=1e-7)
        else:
            assert answer_of(line["response"]["body"]) == expected


def test_bad_lines_land_in_the_error_file_and_the_batch_completes(client_a: openai.OpenAI, model_name: str) -> None:
    chat = "/v1/chat/completions"
    refused_body = {**chat_body(model_name, "Hi"), "max_tokens": -1}
    good = requests(chat, [chat_body(model_name, "In the beginning")], "good")[0]
    lines = [good, "{not json", {**good, "custom_id": "wrong-url", "url": "/v1/completions"},
             {key: value for key, value in good.items() if key != "custom_id"}, good,
             {**good, "custom_id": "get", "method": "GET"}, {**good, "custom_id": "refused", "body": refused_body},
             {**good, "custom_id": "streamed", "body": {**good["body"], "stream": True}},
             {**good, "custom_id": "good2"}]
    batch, output, errors = run(client_a, chat, lines)
    assert batch.status == "completed" and batch.errors is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (9, 2, 7)
    assert [line["custom_id"] for line in output] == ["good0", "good2"]
    codes = [(line["custom_id"], line["error"]["code"] if line["error"] else line["response"]["status_code"])
             for line in errors]
    assert codes == [(None, "invalid_json_line"), ("wrong-url", "mismatched_url"), (None, "missing_custom_id"),
                     ("good0", "duplicate_custom_id"), ("get", "invalid_method"), ("refused", 400),
                     ("streamed", "stream_unsupported")]
    with pytest.raises(openai.BadRequestError) as online:  # the route's own refusal, word for word
        client_a.chat.completions.create(**refused_body)
    assert errors[5]["response"]["body"] == {"error": online.value.body}


def test_an_input_that_is_not_jsonl_fails_the_batch(client_a: openai.OpenAI) -> None:
    batch = wait_ended(client_a, submit(client_a, "/v1/completions", ["a,b,c", "1,2,3"]).id)
    assert batch.status == "failed" and batch.failed_at is not None and batch.output_file_id is None
    assert batch.errors is not None and batch.errors.data[0].code == "invalid_file_format"


def test_a_key_reaches_only_its_own_files_and_batches(batch_server: ServerProcess, client_a: openai.OpenAI,
                                                      client_b: openai.OpenAI, model_name: str) -> None:
    chat = "/v1/chat/completions"
    batch, _, _ = run(client_a, chat, requests(chat, [chat_body(model_name, "Hi")]))
    source = batch.input_file_id
    for file_id in (source, batch.output_file_id, "file-" + "0" * 24):
        for call in (client_b.files.retrieve, client_b.files.content, client_b.files.delete):
            with pytest.raises(openai.NotFoundError):
                call(file_id)
    for batch_id in (batch.id, "batch_" + "0" * 24):
        for call in (client_b.batches.retrieve, client_b.batches.cancel):
            with pytest.raises(openai.NotFoundError):
                call(batch_id)
    with pytest.raises(openai.NotFoundError):
        client_b.batches.create(input_file_id=source, endpoint=chat, completion_window="24h")
    assert source not in {file.id for file in client_b.files.list()}
    assert batch.id not in {seen.id for seen in client_b.batches.list()}
    assert source in {file.id for file in client_a.files.list()}
    assert batch.id in {seen.id for seen in client_a.batches.list()}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=batch_server.base_url + "/v1", api_key="wrong", max_retries=0).files.list()


def test_batches_are_listed_newest_first_in_pages(client_b: openai.OpenAI) -> None:
    made = [submit(client_b, "/v1/completions", ["x"]).id for _ in range(3)]
    page = client_b.batches.list(limit=2)
    assert [batch.id for batch in page.data] == made[:0:-1] and page.has_more
    rest = client_b.batches.list(limit=2, after=page.data[-1].id)
    assert [batch.id for batch in rest.data][:1] == [made[0]]


def test_uploads_past_max_bytes_are_refused_and_deleting_frees_the_disk(client_a: openai.OpenAI,
                                                                       batch_dir: Path) -> None:
    big = b"x" * (1200 * 1024)
    first = client_a.files.create(file=("big.jsonl", big), purpose="batch")
    path = batch_dir / "files" / first.id
    assert first.bytes == len(big) and first.filename == "big.jsonl" and path.read_bytes() == big
    with pytest.raises(openai.APIStatusError) as refused:
        client_a.files.create(file=("big2.jsonl", big), purpose="batch")
    assert refused.value.status_code == 413 and "--batch-max-bytes" in refused.value.message
    assert client_a.files.delete(first.id).deleted and not path.exists()
    with pytest.raises(openai.NotFoundError):
        client_a.files.retrieve(first.id)
    second = client_a.files.create(file=("big2.jsonl", big), purpose="batch")  # the room the delete made
    client_a.files.delete(second.id)
    with pytest.raises(openai.BadRequestError) as wrong_purpose:
        client_a.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    assert wrong_purpose.value.body["param"] == "purpose"  # type: ignore[index]


def test_an_upload_of_unknown_length_is_cut_off_past_the_room_left(batch_server: ServerProcess) -> None:
    def body() -> Iterator[bytes]:  # chunked: no Content-Length to refuse it by
        yield (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\n'
               b'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n')
        for _ in range(48):
            yield b"x" * 65536
        yield b"\r\n--b--\r\n"

    answer = httpx.post(batch_server.base_url + "/v1/files", content=body(), timeout=60,
                        headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "multipart/form-data; boundary=b"})
    assert answer.status_code == 413 and answer.json()["error"]["param"] == "file"


def test_a_file_is_named_by_the_server_and_its_content_comes_back(client_a: openai.OpenAI, batch_dir: Path) -> None:
    content = jsonl([{"custom_id": "a"}])
    made = client_a.files.create(file=("../../escape.jsonl", content), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": 3600})
    assert made.filename == "../../escape.jsonl" and made.expires_at == made.created_at + 3600
    assert client_a.files.content(made.id).content == content
    assert (batch_dir / "files" / made.id).read_bytes() == content
    assert not [path for path in batch_dir.parent.parent.rglob("*") if "escape" in path.name]
    client_a.files.delete(made.id)


def test_cancel_ends_a_running_batch_with_what_it_has(batch_server: ServerProcess, client_a: openai.OpenAI,
                                                      model_name: str) -> None:
    chat = "/v1/chat/completions"
    with cores_stopped(batch_server.process.pid):  # nothing finishes meanwhile
        batch = submit(client_a, chat, requests(chat, [chat_body(model_name, f"Hi {i}") for i in range(10)]))
        deadline = time.monotonic() + 30
        while client_a.batches.retrieve(batch.id).status == "validating":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        cancelled = client_a.batches.cancel(batch.id)
        assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at is not None
        ended = wait_ended(client_a, batch.id)
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    assert ended.request_counts.total == 10 and ended.request_counts.completed == 0
    assert ended.output_file_id is None
    with pytest.raises(openai.ConflictError):  # it has ended: nothing to cancel
        client_a.batches.cancel(run(client_a, chat, requests(chat, [chat_body(model_name, "Hi")]))[0].id)


def test_without_batch_dir_the_routes_say_so() -> None:
    client = unstarted_client(GatewayConfig())
    for method, path in (("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/batches"),
                         ("POST", "/v1/batches"), ("GET", "/v1/batches/batch_x"), ("GET", "/v1/files/file-x/content")):
        answer = client.request(method, path, headers={"Authorization": f"Bearer {KEY_A}"})
        assert answer.status_code == 404, (method, path)
        assert answer.json()["error"]["code"] == "batches_disabled" and "--batch-dir" in answer.json()["error"][
            "message"]
