"""Bodies in and out: JSON or msgpack, chosen by Content-Type / Accept, with limits on bytes and containers."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import msgpack
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pagegate.gateway.errors import APIError, BadRequest, ClientClosed, PayloadTooLarge, anthropic_error_body

logger = logging.getLogger("pagegate.gateway")

JSON = "application/json"
MSGPACK = "application/msgpack"
MSGPACK_ALIASES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
EVENT_STREAM = "text/event-stream"

# Maps/objects and arrays one request body may hold. An empty msgpack map is 1 byte (a JSON `{},` 3) and an
# empty dict 64 bytes, so a 16 MiB body of them would decode to a gigabyte (in JSON 400 MB) and hold the event
# loop for seconds; under this cap containers cost tens of MB at most. Real requests (messages and content parts,
# tool schemas, batches of token-id prompts) hold a few thousand.
MAX_BODY_CONTAINERS = 1 << 17
SCAN_CHUNK = 1 << 20  # bytes of JSON scanned at a time for containers (bounds the scan's memory)


def is_msgpack(media_type: str | None) -> bool:
    return media_type is not None and any(alias in media_type.lower() for alias in MSGPACK_ALIASES)


def wants_msgpack(request: Request) -> bool:
    """An `Accept: application/msgpack` request gets msgpack answers (errors included)."""
    return is_msgpack(request.headers.get("accept"))


def dumps_json(obj: Any) -> bytes:
    """The one JSON writer of responses and stream chunks.

    JSON has no NaN or Infinity: a non-finite float raises ValueError here (a 500, or an error chunk in a
    stream) instead of going out as text strict parsers reject. None should arrive: the renderer maps
    -inf logprobs to a finite floor and sampling parameters that would produce NaN are refused.
    """
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def dumps_msgpack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def dumps_in_pieces(obj: Any, *, msgpack_body: bool) -> bytes:
    """The same bytes as dumps_json / dumps_msgpack, written a piece at a time: for a large answer built in a worker
    thread (scored prompts), so the event loop's thread gets the GIL between pieces.

    NOTE: both encoders are C code that holds the GIL for a whole call: one call on a 600 MB answer stalled the
    event loop (/health) for seconds even from another thread. Here each list of objects is written an element at
    a time and each object holding a list a member at a time; what is left (a prompt position's alternatives, a
    list of floats) is small enough to encode in one call."""
    pieces: list[bytes] = []
    if msgpack_body:
        packer = msgpack.Packer(use_bin_type=True)
        _pieces(obj, pieces.append, packer.pack, packer.pack_array_header, packer.pack_map_header)
    else:
        _pieces(obj, pieces.append, dumps_json, None, None)
    return b"".join(pieces)


def _pieces(obj: Any, out: Callable[[bytes], Any], dumps: Callable[[Any], bytes],
            array_header: Callable[[int], bytes] | None, map_header: Callable[[int], bytes] | None) -> None:
    json_out = array_header is None
    if isinstance(obj, list) and any(isinstance(item, (list, dict)) for item in obj[:4]):
        out(b"[" if json_out else array_header(len(obj)))  # type: ignore[misc]
        for i, item in enumerate(obj):
            if i and json_out:
                out(b",")
            _pieces(item, out, dumps, array_header, map_header)
        out(b"]" if json_out else b"")
    elif (isinstance(obj, dict) and any(isinstance(value, list) for value in obj.values())
          and all(isinstance(key, str) for key in obj)):
        out(b"{" if json_out else map_header(len(obj)))  # type: ignore[misc]
        for i, (key, value) in enumerate(obj.items()):
            out(((b"," if i else b"") + dumps(key) + b":") if json_out else dumps(key))
            _pieces(value, out, dumps, array_header, map_header)
        out(b"}" if json_out else b"")
    else:
        out(dumps(obj))


def render(obj: Any, *, msgpack_body: bool, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    if msgpack_body:
        return Response(dumps_msgpack(obj), status_code, headers, media_type=MSGPACK)
    return Response(dumps_json(obj), status_code, headers, media_type=JSON)


def render_in_pieces(obj: Any, *, msgpack_body: bool) -> Response:
    """`render` of a large answer, encoded by dumps_in_pieces (call it off the event loop)."""
    return Response(dumps_in_pieces(obj, msgpack_body=msgpack_body), 200, media_type=MSGPACK if msgpack_body else JSON)


def render_error(error: APIError, *, msgpack_body: bool, anthropic: bool = False) -> Response:
    """OpenAI's error shape, or Anthropic's (on the Messages API's routes)."""
    body = anthropic_error_body(error) if anthropic else error.body()
    return render(body, msgpack_body=msgpack_body and not anthropic, status_code=error.status_code,
                  headers=error.headers)


async def read_body(request: Request, limit: int) -> Any:
    """Decode a request body: msgpack when Content-Type says so, JSON otherwise (curl -d sends a form
    type); 413 past `limit` bytes or MAX_BODY_CONTAINERS maps and arrays."""
    raw = await _read_limited(request, limit)
    if is_msgpack(request.headers.get("content-type")):
        return _loads_msgpack(raw)
    return _loads_json(raw)


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:  # the client's choice, not a server error: one line, no traceback
        logger.info("%s %s: the client left after sending %d body bytes", request.method, request.url.path, size)
        raise ClientClosed("The client closed the connection before sending the whole body.") from None
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body ({size} bytes or more) exceeds the limit of {limit} bytes.")


def _too_many_containers() -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body holds more than {MAX_BODY_CONTAINERS} objects and arrays.",
                           code="too_many_containers")


def _loads_json(raw: bytes) -> Any:
    if not raw:
        raise BadRequest("The request body is empty: send a JSON object.")
    if has_more_json_containers(raw, MAX_BODY_CONTAINERS):  # counted before decoding
        raise _too_many_containers()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None


def has_more_json_containers(raw: bytes, limit: int) -> bool:
    """Whether a JSON text holds more than `limit` objects and arrays (`{` and `[` outside strings), told
    without decoding it: a count of bytes, then, only when that is over, a scan in numpy chunks."""
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return False
    encoding = json.detect_encoding(raw)
    if not encoding.startswith("utf-8"):  # in UTF-8 a quote or bracket byte is always that character
        raw = raw.decode(encoding, errors="replace").encode()
    if b"\\" in raw:  # without escaped backslashes, then escaped quotes, every quote opens or closes a string
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    import numpy as np  # here, not at start-up: only a body past the count comes this far

    text = np.frombuffer(raw, dtype=np.uint8)
    containers, quotes_before = 0, 0
    for start in range(0, len(text), SCAN_CHUNK):
        chunk = text[start:start + SCAN_CHUNK]
        quotes = np.cumsum(chunk == ord('"'), dtype=np.uint8)  # wraps at 256: only the parity matters
        quotes += quotes_before
        outside_strings = (quotes & 1) == 0
        containers += int(np.count_nonzero(((chunk == ord("{")) | (chunk == ord("["))) & outside_strings))
        if containers > limit:
            return True
        quotes_before = int(quotes[-1])
    return False


class _TooManyContainers(Exception):
    pass


class _ContainerBudget:
    """msgpack's list_hook and object_hook: counts maps and arrays as each is built and stops the decoder
    past `limit` (the few still open around it aside, no more are ever built)."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _TooManyContainers
        return container


def _loads_msgpack(raw: bytes) -> Any:
    if not raw:
        raise BadRequest("The request body is empty: send a msgpack map.")
    budget = _ContainerBudget(MAX_BODY_CONTAINERS)
    try:
        # Invalid UTF-8 in a str becomes surrogate escapes, so validation can name the field it is in.
        return msgpack.unpackb(raw, raw=False, strict_map_key=False, unicode_errors="surrogateescape",
                               list_hook=budget, object_hook=budget)
    except _TooManyContainers:
        raise _too_many_containers() from None
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise BadRequest(f"The request body is not valid msgpack: {exc}", code="invalid_msgpack") from None
