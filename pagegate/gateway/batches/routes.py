"""/v1/files and /v1/batches, OpenAI's routes; a server started without --batch-dir answers each with a 404 that
says so."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import BinaryIO

from python_multipart.exceptions import MultipartParseError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive

from pagegate.gateway.auth import request_key_identity
from pagegate.gateway.batches.protocol import (
    BatchCreateRequest,
    ExpiresAfter,
    batch_object,
    deleted_file,
    file_object,
    list_object,
)
from pagegate.gateway.batches.service import Batches
from pagegate.gateway.codec import read_body, render, wants_msgpack
from pagegate.gateway.errors import BadRequest, ClientClosed, NotFound, PayloadTooLarge, client_params
from pagegate.gateway.gateway_state import gateway_state, host_of
from pagegate.gateway.protocol import parse_request

FORM_OVERHEAD = 64 * 1024  # bytes of a multipart body besides the file: boundaries, headers, the other fields
CONTENT_CHUNK = 1 << 20
MAX_FILES_PAGE, MAX_BATCHES_PAGE = 10_000, 100  # OpenAI's bounds on `limit`
MAX_FILENAME = 1024  # characters of a client's file name (metadata only: never a path)


def batches_of(request: Request) -> Batches:
    batches = gateway_state(request)["batches"]
    if batches is None:
        raise NotFound("The Files and Batch APIs are off: this server was started without --batch-dir.",
                       code="batches_disabled")
    return batches


# -- files -----------------------------------------------------------------------------------------
async def upload_file(request: Request) -> Response:
    batches = batches_of(request)
    form = await _read_form(request, await batches.upload_limit() + FORM_OVERHEAD)
    try:
        purpose = _text_field(form, "purpose")
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BadRequest("Missing required parameter: 'file' (a file part of the form).", param="file",
                             code="missing_required_parameter")
        filename = upload.filename or "upload.jsonl"
        if len(filename) > MAX_FILENAME:
            raise BadRequest(f"The file's name is longer than {MAX_FILENAME} characters.", param="file")
        record = await batches.upload(request_key_identity(request.scope), filename, purpose, upload.file,
                                      _expires_after(form))
    finally:
        await form.close()
    return render(file_object(record), msgpack_body=wants_msgpack(request))


async def list_files(request: Request) -> Response:
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be 'asc' or 'desc'.", param="order")
    records, more = await batches_of(request).list_files(request_key_identity(request.scope), query.get("purpose"),
                                                         query.get("after"), _limit(query.get("limit"),
                                                                                    MAX_FILES_PAGE, MAX_FILES_PAGE),
                                                         order == "desc")
    return render(list_object([file_object(record) for record in records], more), msgpack_body=wants_msgpack(request))


async def retrieve_file(request: Request) -> Response:
    record = await batches_of(request).file(request_key_identity(request.scope), request.path_params["file_id"])
    return render(file_object(record), msgpack_body=wants_msgpack(request))


async def delete_file(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    await batches_of(request).delete_file(request_key_identity(request.scope), file_id)
    return render(deleted_file(file_id), msgpack_body=wants_msgpack(request))


async def file_content(request: Request) -> Response:
    record, handle = await batches_of(request).open_file(request_key_identity(request.scope),
                                                         request.path_params["file_id"])
    return StreamingResponse(_read_chunks(handle), media_type="application/octet-stream",
                             headers={"Content-Length": str(record.bytes)})


# -- batches ---------------------------------------------------------------------------------------
async def create_batch(request: Request) -> Response:
    batches = batches_of(request)
    body = await read_body(request, host_of(request).config.max_request_bytes)
    parsed = parse_request(BatchCreateRequest, body)
    record = await batches.create(request_key_identity(request.scope), parsed)
    return render(batch_object(record), msgpack_body=wants_msgpack(request))


async def retrieve_batch(request: Request) -> Response:
    record = await batches_of(request).batch(request_key_identity(request.scope), request.path_params["batch_id"])
    return render(batch_object(record), msgpack_body=wants_msgpack(request))


async def list_batches(request: Request) -> Response:
    query = request.query_params
    records, more = await batches_of(request).list_batches(request_key_identity(request.scope), query.get("after"),
                                                           _limit(query.get("limit"), 20, MAX_BATCHES_PAGE))
    return render(list_object([batch_object(record) for record in records], more),
                  msgpack_body=wants_msgpack(request))


async def cancel_batch(request: Request) -> Response:
    record = await batches_of(request).cancel(request_key_identity(request.scope), request.path_params["batch_id"])
    return render(batch_object(record), msgpack_body=wants_msgpack(request))


# -- helpers ---------------------------------------------------------------------------------------
async def _read_form(request: Request, limit: int) -> FormData:
    """The multipart form, its body bounded by `limit` bytes (a 413 past it, before the rest is read)."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise BadRequest("Upload a file as multipart/form-data, with the fields `file` and `purpose`.")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    bounded = Request(request.scope, _bounded(request.receive, limit))
    try:
        return await bounded.form(max_files=1, max_fields=8)
    except (HTTPException, MultiPartException, MultipartParseError) as exc:
        detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
        raise BadRequest(f"The upload is not valid multipart/form-data: {detail}") from None
    except ClientDisconnect:
        raise ClientClosed("The client closed the connection before sending the whole file.") from None


def _bounded(receive: Receive, limit: int) -> Receive:
    received = 0

    async def bounded_receive() -> Message:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise _too_large(limit)
        return message

    return bounded_receive


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The upload is larger than the {limit} bytes this server takes now: one batch input "
                           f"file holds at most 200 MiB, and all files together at most --batch-max-bytes.",
                           param="file", code="storage_limit_exceeded")


def _text_field(form: FormData, name: str) -> str:
    value = form.get(name)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
    return value


def _expires_after(form: FormData) -> int | None:
    """`expires_after[anchor]` and `expires_after[seconds]` (how the SDK sends `expires_after`): its seconds."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if not isinstance(seconds, str) or not seconds.isdigit():
        raise BadRequest("expires_after[seconds] must be a whole number of seconds.", param="expires_after.seconds")
    with client_params(lambda param: f"expires_after.{param}"):
        return parse_request(ExpiresAfter, {"anchor": anchor, "seconds": int(seconds)}).seconds


def _limit(text: str | None, default: int, most: int) -> int:
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise BadRequest(f"limit must be an integer from 1 to {most}.", param="limit")
    return int(text)


async def _read_chunks(handle: BinaryIO) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(handle.read, CONTENT_CHUNK):
            yield chunk
    finally:
        await asyncio.to_thread(handle.close)
