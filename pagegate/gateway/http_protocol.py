"""uvicorn's h11 protocol with limits: 431 past --max-header-size, 408 past --request-timeout, a close for a
connection idle past --idle-connection-timeout before its first byte, and past --max-connections for the one
idle the longest (or the newcomer, when none is idle)."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import struct
import sys
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagegate.gateway.codec import dumps_json
from pagegate.gateway.errors import error_body
from pagegate.gateway.settings import GatewayConfig

logger = logging.getLogger("pagegate.gateway")

LINGER_S = 2.0  # after a 431, how long to drop what the client still sends before closing
REFUSAL_WARNING_EVERY_S = 10.0  # at most one log line per this long while connections are refused
FILE_HEADROOM = 128  # file descriptors the process needs besides its connections (model, engine, gRPC, logs)
DEFAULT_BACKLOG = 2048  # uvicorn's listen backlog, kept when the file limit allows
MIN_BACKLOG = 64
# scope["extensions"][CONNECTION_EXTENSION]["abort"](): reset the request's connection now, for a response stuck
# in a write to a client that does not read (a dashboard viewer): close() would wait for the client for ever.
CONNECTION_EXTENSION = "pagegate.connection"


class HeadLimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that answers 431 to a request head (request line + headers) over
    config.h11_max_incomplete_event_size bytes.

    h11 measures a head only while it is incomplete, and uvicorn answers that with a 400; a head that came
    whole in one read is measured by _HeadLimitedConnection. After the 431 the connection drops what the
    client still sends, for LINGER_S at most, so that the client reads the answer instead of a reset.

    Every connection is a file descriptor: past `max_connections` open, a new one takes the place of the one
    idle the longest (or is closed as soon as it is accepted when none is idle), so silent sockets can neither
    exhaust `ulimit -n` nor lock everyone out; and a connection that sends nothing is closed after uvicorn's
    keep-alive timeout (--idle-connection-timeout).
    """

    conn: _HeadLimitedConnection
    read_timeout_s = GatewayConfig.request_read_timeout_s  # see with_limits
    max_connections = GatewayConfig.max_connections
    last_refusal_warning = float("-inf")  # loop time of the last "connection refused" log line

    @classmethod
    def with_limits(cls, read_timeout_s: float, max_connections: int) -> type[HeadLimitedH11Protocol]:
        """The class uvicorn instantiates (it passes no arguments of ours), with this server's limits."""
        return type(cls.__name__, (cls,), {"read_timeout_s": read_timeout_s, "max_connections": max_connections})

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.conn = _HeadLimitedConnection(config.h11_max_incomplete_event_size or GatewayConfig.max_header_bytes)
        self.discarding = False
        self.read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # counts it in self.connections (the server's open connections)
        if len(self.connections) > self.max_connections and not self._evict_longest_idle():
            self._warn_refused()
            transport.close()
            return
        # uvicorn arms this timer only after a response; a socket that never sends a byte would stay open.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _evict_longest_idle(self) -> bool:
        """Make room by closing the connection idle the longest (none sent a byte of a request since it opened
        or since its last response); False when every other connection is busy with a request.

        NOTE: so a client holding --max-connections silent sockets cannot lock others out: each newcomer pushes
        one of them out. Only connections with a request in flight keep their place, and other limits bound
        those (--request-timeout, the dashboard's viewer cap, the queue)."""
        idle = [c for c in self.connections
                if c is not self and isinstance(c, HeadLimitedH11Protocol) and c.timeout_keep_alive_task is not None]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.timeout_keep_alive_task.when() if c.timeout_keep_alive_task else 0.0)
        oldest.timeout_keep_alive_handler()
        return True

    def _warn_refused(self) -> None:
        now = self.loop.time()
        if now - type(self).last_refusal_warning >= REFUSAL_WARNING_EVERY_S:
            type(self).last_refusal_warning = now
            logger.warning("%d HTTP connections are open (--max-connections): closing new ones", self.max_connections)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not None and self.cycle is not cycle:  # a new request: its app task has not run yet
            self.cycle.scope.setdefault("extensions", {})[CONNECTION_EXTENSION] = {"abort": self.reset}

    def reset(self) -> None:
        """Close the connection with a TCP reset: a plain close would first wait, in the kernel, for a client
        that does not read to take what is still queued for it."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.discarding:
            return
        if self.read_deadline is None and self.read_timeout_s > 0:  # the first bytes of a request
            self.read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._cancel_read_deadline()  # the whole request is in (or the connection is over)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_deadline()
        super().connection_lost(exc)

    def _cancel_read_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _read_timed_out(self) -> None:
        """The request (head or body) did not arrive in time: 408 if no answer has begun, then close."""
        self.read_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            message = f"The request was not received within {self.read_timeout_s:g} seconds."
            body = dumps_json(error_body(message, "invalid_request_error", None, "request_timeout"))
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()  # a waiting route then sees the client gone (a 499, logged at info)

    def send_400_response(self, msg: str) -> None:
        if not self.conn.head_too_large:
            super().send_400_response(msg)
            return
        message = f"The request line and headers exceed the limit of {self.conn.max_head_bytes} bytes."
        body = dumps_json(error_body(message, "invalid_request_error", None, "request_header_fields_too_large"))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=431, headers=headers, reason=b"Request Header Fields Too Large"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.discarding = True
        if self.transport.can_write_eof():  # the client sees the answer end; its own close then ends ours
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def listen_backlog(max_connections: int, file_limit: int | None = None) -> int:
    """The listen backlog for a file limit (default: this process's `ulimit -n`); a warning when it is low.

    asyncio accepts up to `backlog` waiting connections in one go before any of them is counted (and closed
    past max_connections), so a burst must fit in the files that max_connections and FILE_HEADROOM leave:
    past the limit accept() fails and asyncio stops accepting for a second.
    """
    if file_limit is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        file_limit = sys.maxsize if soft == resource.RLIM_INFINITY else soft
    spare = file_limit - max_connections - FILE_HEADROOM
    if spare < MIN_BACKLOG:
        logger.warning("the open-file limit (ulimit -n) is %d, too low for --max-connections %d: accepting may fail "
                       "with 'Too many open files'; raise it (ulimit -n 65536) or lower --max-connections",
                       file_limit, max_connections)
    return max(MIN_BACKLOG, min(DEFAULT_BACKLOG, spare))


class _HeadLimitedConnection(h11.Connection):
    """h11's server side that also refuses a complete head over the limit, and says which error it raised."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.head_too_large = False

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.head_too_large = exc.error_status_hint == 431
            raise
        if isinstance(event, h11.Request) and _head_size(event) > self.max_head_bytes:
            self.head_too_large = True
            raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        return event


def _head_size(request: h11.Request) -> int:
    """The request line and headers as sent, give or take optional whitespace."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()) + 2
