"""The msgpack wire format of pagegate (docs/msgpack.md), shared by the sync and async clients."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgpack

from pagegate.clients.errors import ProtocolError, error_from_chunk, error_from_response

MSGPACK = "application/msgpack"
END_MARKER_KEY = "done"  # a stream ends with the map {"done": true}


def api_root(base_url: str) -> str:
    """'http://h:p', 'http://h:p/' and 'http://h:p/v1' all name the same server."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def headers(api_key: str | None) -> dict[str, str]:
    result = {"Content-Type": MSGPACK, "Accept": MSGPACK}
    if api_key:
        result["Authorization"] = f"Bearer {api_key}"
    return result


def request_body(fields: dict[str, Any], params: dict[str, Any], stream: bool) -> bytes:
    """Pack a request map; parameters left as None are not sent (the server's defaults apply)."""
    body = {key: value for key, value in {**fields, **params}.items() if value is not None}
    if stream:
        body["stream"] = True
    return msgpack.packb(body, use_bin_type=True)


def decode_response(status_code: int, content: bytes, retry_after: str | None) -> Any:
    """The decoded answer, or the typed error for a non-2xx status."""
    try:
        body = msgpack.unpackb(content, raw=False, strict_map_key=False) if content else None
    except Exception as exc:  # msgpack raises several types for bad bytes
        if status_code >= 400:
            body = content[:200].decode("utf-8", "replace")
        else:
            raise ProtocolError(f"the answer is not msgpack: {exc}", status_code=status_code) from None
    if status_code >= 400:
        raise error_from_response(status_code, body, retry_after)
    return body


class ChunkReader:
    """Feeds raw bytes of a msgpack stream and yields its chunk maps until the end marker."""

    def __init__(self) -> None:
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        self.ended = False

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        self._unpacker.feed(data)
        for item in self._unpacker:
            if self.ended:
                raise ProtocolError("data after the end marker of a msgpack stream")
            if not isinstance(item, dict):
                raise ProtocolError(f"a msgpack stream carries maps, got {type(item).__name__}")
            if "error" in item:
                raise error_from_chunk(item)
            if item.get(END_MARKER_KEY) is True:
                self.ended = True
                continue
            yield item

    def finish(self) -> None:
        if not self.ended:
            raise ProtocolError("the msgpack stream ended without its end marker (connection cut?)")


def read_chunks(pieces: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    reader = ChunkReader()
    for piece in pieces:
        yield from reader.feed(piece)
    reader.finish()
