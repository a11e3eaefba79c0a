"""Driving engine requests: merge several requests' outputs, coalesce stale ones, frame them for the wire.

Engine outputs come as deltas; when the writer is slower than the engine, one pump task per engine request
appends each new delta to the one still waiting (RequestOutput.add), and the writer sends one chunk for however
many tokens arrived meanwhile. That keeps 64 streams cheap for the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pagegate.engine.outputs import RequestOutput
from pagegate.gateway.codec import dumps_in_pieces, dumps_json, dumps_msgpack
from pagegate.gateway.errors import APIError
from pagegate.gateway.prepare import render_off_loop
from pagegate.gateway.render import Renderer

logger = logging.getLogger("pagegate.gateway")

SSE_DONE = b"data: [DONE]\n\n"
MSGPACK_END = {"done": True}  # the last map of a msgpack stream (docs/msgpack.md)


class OutputMerger:
    """Pumps N engine output iterators into slots of pending deltas; `batches()` yields {index: what is new}."""

    def __init__(
        self,
        streams: Sequence[AsyncIterator[RequestOutput]],
        on_first: Callable[[int], None],
        on_close: Callable[[OutputMerger, set[int]], None],
        on_finished: Callable[[int, RequestOutput, int], None] | None = None,
    ) -> None:
        self._pending: dict[int, RequestOutput] = {}  # per request: its deltas since the last batch, joined
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self._ended: set[int] = set()
        self._finished: set[int] = set()
        self._on_first = on_first
        self._on_close = on_close
        self._on_finished = on_finished  # each request's last delta and its token count, once (request_timing.py)
        self._closed = False
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        first = True
        generated = 0
        try:
            async for delta in stream:
                if first:
                    first = False
                    self._on_first(index)
                generated += delta.num_generated_tokens
                if delta.finished:
                    self._finished.add(index)
                    if self._on_finished is not None:
                        self._on_finished(index, delta, generated)
                pending = self._pending.get(index)
                if pending is None:
                    self._pending[index] = delta
                else:
                    pending.add(delta)
                self._wake.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: B036 - handed to the writer, which reports it to the client
            self._error = self._error or exc
        finally:
            if first:
                self._on_first(index)
            self._ended.add(index)
            self._wake.set()

    async def batches(self, pace: Callable[[], float] | None = None) -> AsyncIterator[dict[int, RequestOutput]]:
        """Deltas as they come; with `pace`, batches are at least pace() seconds apart (the first and a finishing
        one excepted), so a busy server sends several tokens per chunk."""
        loop = asyncio.get_running_loop()
        last_yield: float | None = None
        while True:
            if self._error is not None:
                raise self._error
            if self._pending:
                delay = self._pacing_delay(pace, last_yield, loop.time())
                if delay > 0:
                    await asyncio.sleep(delay)  # the pumps keep collecting meanwhile
                    continue
                batch, self._pending = self._pending, {}
                last_yield = loop.time()
                yield batch
                continue
            if len(self._ended) == len(self._tasks):
                return
            self._wake.clear()
            await self._wake.wait()

    def _pacing_delay(self, pace: Callable[[], float] | None, last_yield: float | None, now: float) -> float:
        if pace is None or last_yield is None or any(out.finished for out in self._pending.values()):
            return 0.0
        return last_yield + pace() - now

    @property
    def all_finished(self) -> bool:
        """Every engine request has delivered its final output (and it has been handed out)."""
        return len(self._finished) == len(self._tasks) and not self._pending

    def stop(self, error: BaseException) -> None:
        """End this generation early (server shutting down); the writer raises `error`."""
        self._error = self._error or error
        self._wake.set()

    def close(self) -> None:
        """Cancel the pumps; every request that did not finish is aborted. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        unfinished = set(range(len(self._tasks))) - self._finished
        self._on_close(self, unfinished)


async def collect(merger: OutputMerger) -> dict[int, RequestOutput]:
    """Run a non-streamed generation to the end: the whole output of every engine request, its deltas joined."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for batch in merger.batches():
            for index, delta in batch.items():
                if index in finals:
                    finals[index].add(delta)
                else:
                    finals[index] = delta
    finally:
        merger.close()
    return finals


def sse_frame(obj: Any, encode: Callable[[Any], bytes] = dumps_json) -> bytes:
    return b"data: " + encode(obj) + b"\n\n"


def sse_event_frame(obj: Any, encode: Callable[[Any], bytes] = dumps_json) -> bytes:
    """A frame that names its event (Responses and Anthropic streams): `event: <obj["type"]>` then the data."""
    return b"event: " + str(obj.get("type", "error")).encode() + b"\n" + sse_frame(obj, encode)


def framer(msgpack_frames: bool, named_events: bool, in_pieces: bool = False) -> Callable[[Any], bytes]:
    """How a stream's chunks become bytes; `in_pieces`: encoded by dumps_in_pieces (large chunks, off the loop)."""
    if msgpack_frames:
        return functools.partial(dumps_in_pieces, msgpack_body=True) if in_pieces else dumps_msgpack
    encode = functools.partial(dumps_in_pieces, msgpack_body=False) if in_pieces else dumps_json
    return functools.partial(sse_event_frame if named_events else sse_frame, encode=encode)


async def _frames(renderer: Renderer, batch: dict[int, RequestOutput], frame: Callable[[Any], bytes]) -> bytes:
    """The frames of one batch of outputs; a scored prompt's (echo + logprobs) are built in a render thread."""
    def build() -> bytes:
        return b"".join(frame(c) for index, out in batch.items() for c in renderer.update(index, out))

    return await render_off_loop(build) if renderer.prepared.scoring_size else build()


async def stream_body(
    merger: OutputMerger,
    renderer: Renderer,
    error_body: Callable[[BaseException], dict],
    msgpack_frames: bool = False,
    pace: Callable[[], float] | None = None,
) -> AsyncIterator[bytes]:
    """The bytes of one streamed response: chunks, the usage chunk if asked, an in-band error, the end.

    Every write is a syscall, so frames travel together where they can: the opening chunk with the first
    tokens, the last tokens with the usage chunk and the end marker.
    """
    frame = framer(msgpack_frames, renderer.named_events, bool(renderer.prepared.scoring_size))
    pending = b"".join(frame(chunk) for chunk in renderer.opening_chunks())
    try:
        async for batch in merger.batches(pace):
            pending += await _frames(renderer, batch, frame)
            if merger.all_finished:
                break
            if pending:
                yield pending
                pending = b""
        if renderer.prepared.include_usage:
            pending += frame(renderer.usage_chunk())
    except Exception as exc:  # the status line is gone: the error travels as a chunk
        if not isinstance(exc, APIError):
            logger.warning("stream %s ended by %s: %s", renderer.request_id, type(exc).__name__, exc)
        pending += frame(renderer.error_chunk(error_body(exc)))
    finally:
        merger.close()
    if not msgpack_frames and renderer.named_events:
        yield pending  # these streams end with their own last event, not [DONE]
        return
    yield pending + (dumps_msgpack(MSGPACK_END) if msgpack_frames else SSE_DONE)
