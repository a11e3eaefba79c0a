"""The engine requests the gateway starts and drives: one per prompt of a generation (their outputs merged into one
stream) and one per input of an embedding. Counted (pending, admitted, not yet in the engine's inbox), each one's
tenant remembered for the dashboard, and all ended at once when the server stops."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from pagegate.engine.outputs import RequestOutput
from pagegate.engine.pin import Pin
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.gateway.acquired import AcquiredModel
from pagegate.gateway.errors import ServiceUnavailable
from pagegate.gateway.key_config import KeyShares
from pagegate.gateway.lanes import ONLINE, Lane
from pagegate.gateway.prepare import PreparedRequest
from pagegate.gateway.prompt_cache import scoped
from pagegate.gateway.request_timing import TimingRecorder, sampling_attributes
from pagegate.gateway.settings import GatewayConfig
from pagegate.gateway.streaming import OutputMerger

logger = logging.getLogger("pagegate.gateway")

MAX_STREAM_PACE_S = 0.2  # however many streams, one still gets a chunk at least this often


class EngineRequests:
    """Starts generations and embeddings on the engine each request acquired and keeps count of them.

    `check_acquired`: a 503 that says why unless a request's acquired model still serves (EngineHost's);
    `running_engines`: every engine whose core runs, whatever the server's state, for unpins."""

    def __init__(self, config: GatewayConfig, timings: TimingRecorder, check_acquired: Callable[[AcquiredModel], None],
                 running_engines: Callable[[], list[EngineClient]]) -> None:
        self.config = config
        self.timings = timings
        self._check_acquired = check_acquired
        self._running_engines = running_engines
        self._pending = 0  # admitted engine requests without a first output yet
        self._unsubmitted = 0  # admitted sequences whose streams have not reached the engine's inbox yet
        self._active: set[OutputMerger] = set()
        self._streamed: set[OutputMerger] = set()  # the active ones sent as streams: they share the chunk rate
        self._embeddings: set[asyncio.Future[None]] = set()  # admitted embedding requests: end_all's way to end them
        # engine request id -> the identity of the API key that sent it: the dashboard names a request only
        # to viewers with the same key
        self.request_tenants: dict[str, str] = {}
        self.key_shares = KeyShares(config.api_key_config)  # each key's name, weight and quota of pages

    # -- counts ----------------------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return self._pending

    @property
    def num_active(self) -> int:
        """Generations the gateway is driving."""
        return len(self._active)

    @property
    def num_admitted(self) -> int:
        return len(self._active) + len(self._embeddings)

    @property
    def num_unsubmitted(self) -> int:
        """Admitted sequences not yet in the engine's inbox: the engine's queue does not count them yet."""
        return self._unsubmitted

    def stream_pace(self) -> float:
        """Seconds between two chunks of one stream: the chunk-rate budget shared by the streamed generations (a
        whole answer, a batch line's included, sends no chunks)."""
        rate = self.config.stream_chunk_rate
        return min(len(self._streamed) / rate, MAX_STREAM_PACE_S) if rate > 0 else 0.0

    # -- what an engine request carries ----------------------------------------------------------
    def cache_tenant(self, prepared: PreparedRequest) -> str | None:
        """The key identity that roots the request's prefix chain under --prefix-cache-scope key, else None.

        NOTE: rooted per key, one key's prefix pages are never another's hits, so `cached_tokens` tells a key
        nothing about what other keys sent; the tenant is its own field of the root (core/chain_root.py), so no
        client-chosen salt can stand for it."""
        return prepared.tenant if self.config.prefix_cache_scope == "key" else None

    def pin_for(self, key: str) -> Pin:
        """What keeps a stored response's conversation in the KV cache for a while (its pages pinned)."""
        return Pin(key, self.config.responses_pin_ttl_s)

    @staticmethod
    def pins_of(prepared: PreparedRequest) -> tuple[Pin, ...]:
        """The request's pins as the engine takes them: the prompt caching it asked for, its keys scoped to the
        sending API key (in the order of `cache_pins`: the engine reports their tokens in it), then a stored
        response's."""
        cache = (scoped(pin, prepared.tenant, prepared.model, prepared.cache_salt) for pin in prepared.cache_pins)
        return (*cache, *((prepared.pin,) if prepared.pin is not None else ()))

    def unpin(self, key: str) -> None:
        """Let the engine release what `pin_for(key)` pinned (the response left the store or was continued)."""
        for engine in self._running_engines():
            engine.unpin(key)

    # -- start -----------------------------------------------------------------------------------
    def generate(self, acquired: AcquiredModel, prepared: PreparedRequest, request_id: str,
                 trace_context: Mapping[str, str] | None = None) -> tuple[OutputMerger, list[str]]:
        """Start one engine request per prompt on the acquired engine (admitted just before); the merger yields
        their newest outputs. `trace_context`: the client's W3C trace headers, parents of the requests' spans (with
        --otlp-traces-endpoint)."""
        engine = acquired.engine
        lora_name = prepared.model if prepared.model in acquired.model.adapters else None  # a request naming an adapter
        started = time.monotonic()
        unique = uuid.uuid4().hex[:8]  # a client may send the same x-request-id twice at once
        ids = [f"{request_id}-{i}-{unique}" for i in range(len(prepared.prompts))]
        tenant, key = self.cache_tenant(prepared), self.key_shares.of(prepared.tenant)
        streams = [engine.generate(p.token_ids, prepared.params, rid, priority=prepared.priority,
                                   cache_salt=prepared.cache_salt, pins=self.pins_of(prepared), lora_name=lora_name,
                                   tenant=tenant, lane=prepared.lane, key=key, images=p.images)  # pins: one prompt only
                   for p, rid in zip(prepared.prompts, ids, strict=True)]
        waiting = set(range(len(ids)))
        self._pending += len(ids)
        if prepared.tenant is not None:
            self.request_tenants.update(dict.fromkeys(ids, prepared.tenant))

        def on_first(index: int) -> None:
            if index in waiting:
                waiting.discard(index)
                self._pending -= 1

        def on_close(merger: OutputMerger, unfinished: set[int]) -> None:
            self._active.discard(merger)
            self._streamed.discard(merger)
            for rid in ids:
                self.request_tenants.pop(rid, None)
            for index in list(waiting):
                on_first(index)
            for index in unfinished:
                self._abort(engine, ids[index])

        def on_finished(index: int, output: RequestOutput, generated: int) -> None:
            try:  # runs in the request's pump: its timing or its spans must never fail the answer
                attributes = sampling_attributes(prepared.params) if self.timings.tracer is not None else None
                self.timings.finished(output, generated, started, prepared.model, prepared.tenant, attributes,
                                      trace_context)
            except Exception:
                logger.exception("request %s: recording its timing failed", output.request_id)

        merger = OutputMerger(streams, on_first, on_close, on_finished)
        self._active.add(merger)
        if prepared.stream:
            self._streamed.add(merger)
        # The merger's pump tasks put the requests in the engine's inbox on their first step; callbacks run
        # in the order they are scheduled, so this one runs right after those steps.
        seqs = len(ids) * prepared.params.n
        self._unsubmitted += seqs
        asyncio.get_running_loop().call_soon(self._submitted, seqs)
        return merger, ids

    async def embed(self, acquired: AcquiredModel, inputs: list[list[int]], request_id: str, priority: int = 0,
                    model: str | None = None, tenant: str | None = None, lane: Lane = ONLINE) -> list[bytes]:
        """Embed every input at once (one engine request each) on the acquired engine (admitted just before); if
        one fails, the caller goes or `end_all` ends it, the others are aborted. A `model` naming a LoRA adapter
        embeds with it; `tenant`: the identity of the key that sent it."""
        self._check_acquired(acquired)  # its caller awaits it in a task: the server may have begun stopping since
        engine = acquired.engine
        lora_name = model if model in acquired.model.adapters else None
        unique = uuid.uuid4().hex[:8]
        key = self.key_shares.of(tenant)
        tasks = [asyncio.ensure_future(engine.embed(ids, f"{request_id}-{i}-{unique}", priority=priority,
                                                    lora_name=lora_name, lane=lane, key=key))
                 for i, ids in enumerate(inputs)]
        gathered = asyncio.gather(*tasks)
        stopped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._embeddings.add(stopped)
        try:
            waited: set[asyncio.Future[Any]] = {gathered, stopped}
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
            if stopped.done():
                stopped.result()  # end_all's error
            return list(gathered.result())
        finally:
            self._embeddings.discard(stopped)
            for task in tasks:
                task.cancel()
            if gathered.done() and not gathered.cancelled():
                gathered.exception()  # read, so that an error after end_all's is never logged as unretrieved

    # -- end -------------------------------------------------------------------------------------
    def end_all(self, message: str) -> None:
        """End every running generation and embedding with a 503 `message`; their engine requests are aborted,
        which frees their pages."""
        for merger in list(self._active):
            merger.stop(ServiceUnavailable(message, code="shutting_down"))
        for stopped in list(self._embeddings):
            if not stopped.done():
                stopped.set_exception(ServiceUnavailable(message, code="shutting_down"))

    def _submitted(self, seqs: int) -> None:
        self._unsubmitted -= seqs

    def _abort(self, engine: EngineClient, request_id: str) -> None:
        try:
            engine.abort(request_id)
        except Exception as exc:  # the request may already be gone; never fail a cleanup over it
            logger.debug("abort %s: %s", request_id, exc)
