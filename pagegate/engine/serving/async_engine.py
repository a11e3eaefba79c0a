"""The engine loop in one background thread, and its asyncio face.

The loop thread owns the Engine; other threads talk to it only through `_inbox` (requests in,
aborts) and each request's asyncio queue (outputs back, via `call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import TypeVar

from pagegate.config import EngineConfig
from pagegate.engine.engine import Engine
from pagegate.engine.errors import EngineDeadError, RequestFailedError
from pagegate.engine.observe.stats import EngineHealth, EngineStats
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.pins import Pin
from pagegate.engine.pool_snapshot import PoolSnapshot, take_snapshot
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.structured import StructuredOutputsParams

log = logging.getLogger(__name__)
T = TypeVar("T")

_IDLE_WAIT_S = 0.5


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Blocking: loads the model, sizes the KV cache and starts the loop thread."""
        self.engine = Engine(config)
        self.on_dead: Callable[[], None] | None = None  # called once if the loop or a worker dies
        self.model_name = self.engine.model_name
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.kv_pages = self.engine.kv_pages
        self.vocab_size = self.engine.model_config.vocab_size
        self.default_sampling = self.engine.runner.generation.sampling_overrides()  # generation_config.json
        self.metrics = self.engine.metrics
        self._inbox: queue.Queue = queue.Queue()
        self._inbox_seqs = 0  # sequences of the requests in the inbox (under _lock)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.dead_error: BaseException | None = None
        if self.engine.runner.workers is not None:
            self.engine.runner.workers.on_death = lambda message: self._die(EngineDeadError(message))
        self._thread = threading.Thread(target=self._loop, name="pagegate-engine", daemon=True)
        self._thread.start()

    # ---- the loop thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    for output in self.engine.step():
                        self._deliver(output.request_id, output)
        except BaseException as error:  # the engine is broken: fail everyone, report unhealthy
            log.exception("engine loop crashed")
            self._die(error)
        finally:
            for request_id in list(self.engine.requests):  # free every page before anyone hears back
                self.engine.abort(request_id)
        if self.dead_error is not None:
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, EngineDeadError(f"the engine loop crashed: {self.dead_error!r}"))

    def _die(self, error: BaseException) -> None:
        first = self.dead_error is None
        self.dead_error = self.dead_error or error
        if first and self.on_dead is not None and not self._stopping.is_set():
            self.on_dead()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                with self._lock:
                    self._inbox_seqs -= payload.params.n
                try:
                    self.engine.add(payload)
                except ValueError as error:  # e.g. a request id still in use: that request fails, not the loop
                    self._deliver(payload.request_id, error)
            elif kind == "abort":
                self.engine.abort(payload)
            elif kind == "call":
                fn, future = payload
                _run(fn, future, self.engine)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    # ---- the asyncio side ------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       pin: Pin | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs as they come; leaving the loop early aborts the request."""
        self._check_alive()
        request = self.engine.intake.make_request(request_id, prompt, params, priority, cache_salt, pin)
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
            self._inbox_seqs += params.n
        self._inbox.put(("add", request))
        finished = False
        try:
            self._check_alive()  # the loop may have died since: it would never answer
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error:
                    raise RequestFailedError(item.error)
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Free the request's pages at the start of the next engine step."""
        self._inbox.put(("abort", request_id))

    def unpin(self, key: str) -> None:
        """Release a finished request's pinned pages between two steps (any thread)."""
        self.call_between_steps(lambda engine: engine.unpin(key))

    def _check_alive(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None and not self._stopping.is_set()

    def queue_load(self) -> tuple[int, int]:
        """(sequences waiting to run, running slots free now), counting n choices each: what admission
        control weighs a new request against. Read from any thread."""
        with self._lock:
            inbox = self._inbox_seqs
        return inbox + self.engine.scheduler.num_waiting_seqs, self.engine.scheduler.free_slots

    def compile_grammar(self, structured: StructuredOutputsParams) -> None:
        """Compile and cache a structured-output grammar off the engine thread (InvalidParamError when bad),
        so that the request's own matcher is a cache hit."""
        self.engine.intake.grammar_matcher(structured)

    def call_between_steps(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run fn(engine) on the loop thread before its next step (waking an idle loop); any thread."""
        future: Future[T] = Future()
        self._inbox.put(("call", (fn, future)))
        return future

    async def pool_snapshot(self) -> PoolSnapshot:
        """The pools' page states, queues and counts at one instant between two steps."""
        self._check_alive()
        return await asyncio.wrap_future(self.call_between_steps(take_snapshot))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def health(self) -> EngineHealth:
        return replace(self.engine.health(), engine_running=self.is_running)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; every request is aborted and every page freed."""
        self._stopping.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()


def _run(fn: Callable[[Engine], T], future: Future[T], engine: Engine) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(engine))
    except Exception as error:  # the caller's failure, not the loop's
        future.set_exception(error)
