"""The gateway's only contact with the engine: load it off the event loop, report health, admit
requests under --max-queue, start generations, drain them on shutdown (pagegate.gateway.shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from typing import Any

from pagegate.config import EngineConfig
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.limits import check_choices, check_priority, check_task
from pagegate.engine.observe.stats import EngineStats
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.pins import Pin
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.serving.core_client import CoreClient
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.engine.serving.replicas import Replicas
from pagegate.gateway.errors import EngineStalled, Overloaded, ServiceUnavailable
from pagegate.gateway.prepare import ModelContext, PreparedRequest
from pagegate.gateway.request_timing import TimingRecorder, sampling_attributes
from pagegate.gateway.settings import GatewayConfig
from pagegate.gateway.streaming import OutputMerger
from pagegate.gateway.tools import served_tool_format
from pagegate.gateway.tracing import RequestTracer, start_tracing

logger = logging.getLogger("pagegate.gateway")

LOADING, READY, DRAINING, FAILED, STOPPING = "loading", "ready", "draining", "failed", "stopping"
MAX_STREAM_PACE_S = 0.2  # however many streams, one still gets a chunk at least this often


class EngineHost:
    def __init__(self, engine_config: EngineConfig, config: GatewayConfig,
                 on_fatal: Callable[[], None] | None = None) -> None:
        self.engine_config = engine_config
        self.config = config
        self.state = LOADING
        self.reason = "loading the model"
        self.engine: EngineClient | None = None
        self.model: ModelContext | None = None
        self.started_at = int(time.time())
        self._on_fatal = on_fatal
        self._pending = 0  # admitted engine requests without a first output yet
        self._unsubmitted = 0  # admitted sequences whose streams have not reached the engine's inbox yet
        self.num_rejected = 0
        self._active: set[OutputMerger] = set()
        self._embeddings: set[asyncio.Future[None]] = set()  # admitted embedding requests: end_all's way to end them
        self._in_flight = 0  # API requests being served, REST or gRPC, whatever the route (`serving`)
        self._idle = asyncio.Event()  # set while no API request is being served (a drain waits on it)
        self._idle.set()
        # engine request id -> the identity of the API key that sent it: the dashboard names a request only
        # to viewers with the same key
        self.request_tenants: dict[str, str] = {}
        self._load_task: asyncio.Task | None = None
        self.timings = TimingRecorder(start_tracer(config.otlp_traces_endpoint))
        self.embedding_size: int | None = None  # the model's embedding size, from the warm-up (if it embeds)
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._load_task = self.loop.create_task(self._load())

    async def _load(self) -> None:
        try:
            self.engine = engine = await start_engine(self.engine_config, self.config.data_parallel_size,
                                                      self.config.engine_step_timeout_s)
            engine.on_dead = self._engine_died
            self.model = self._model_context(engine)
            await self._warm_up(engine)
        except Exception as exc:
            if isinstance(exc, ModelLoadError):  # the user's file or flags: the message says it all
                logger.error("cannot serve this model: %s", exc)
            else:
                logger.exception("the engine failed to start")
            self.state, self.reason = FAILED, f"the engine failed to start: {type(exc).__name__}: {exc}"
            if self._on_fatal is not None:
                self._on_fatal()
            return
        if self.state == LOADING:
            self.state, self.reason = READY, "serving"
            logger.info(serving_line(self))

    async def _warm_up(self, engine: EngineClient) -> None:
        """One short generation (and embedding, where the server embeds) through the whole path, so the first
        client does not pay for lazy set-up."""
        started = time.perf_counter()
        tokenizer = engine.tokenizer
        prompt = tokenizer.encode("Hello") if tokenizer is not None else [0]
        if self.generates:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate(prompt, params, f"warm-up-{time.time_ns()}"):
                pass
            logger.info("warm-up: a 4-token generation took %.0f ms", (time.perf_counter() - started) * 1000)
        if self.embeds:
            started = time.perf_counter()
            self.embedding_size = len(await engine.embed(prompt, f"warm-up-embed-{time.time_ns()}")) // 4
            logger.info("warm-up: a %d-dimensional embedding took %.0f ms", self.embedding_size,
                        (time.perf_counter() - started) * 1000)

    @property
    def generates(self) -> bool:
        return self.engine_config.task != "embed"

    @property
    def embeds(self) -> bool:
        """Whether /v1/embeddings is served: an encoder (--task embed), or a decoder's pooled states (--pooling)."""
        return self.engine_config.task == "embed" or self.engine_config.pooling is not None

    def _model_context(self, engine: EngineClient) -> ModelContext:
        names = tuple(self.config.served_model_names) or (engine.model_name,)
        tokenizer = engine.tokenizer
        vocab = tokenizer.vocab_size if tokenizer is not None else engine.vocab_size
        if tokenizer is not None and self.config.chat_template is not None:
            tokenizer.chat_template = self.config.chat_template  # this process's copy: the engine never renders
        return ModelContext(names, tokenizer, engine.max_model_len, vocab, dict(engine.default_sampling),
                            engine.compile_grammar if tokenizer is not None else None,
                            reasoning_parser=self.config.reasoning_parser,
                            tool_call_parser=served_tool_format(
                                self.config.tool_call_parser, tokenizer.chat_template if tokenizer else None),
                            max_scoring_tokens=self.config.max_scoring_tokens)

    def _engine_died(self) -> None:
        """An engine core (or one of its tensor-parallel workers) died. /health already says so; the server
        exits non-zero (a supervisor restarts it) rather than serve 503s for ever."""
        logger.error("the engine died: the server stops")
        if self._on_fatal is not None:
            self._on_fatal()

    def begin_drain(self) -> None:
        """Take no new request (503 + Retry-After, /health 503) while the running generations go on."""
        if self.state == READY:
            self.state, self.reason = DRAINING, "draining: finishing in-flight requests before shutting down"

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Count one API request as in flight while it is served (the REST middleware and the gRPC door call
        this for every request, whatever its route)."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no API request is being served, at most `timeout_s`; whether none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def end_all(self, message: str = "The server is shutting down.") -> None:
        """Stop taking requests and end every running generation with an error (the server is going down);
        their engine requests are aborted, which frees their pages."""
        if self.state == STOPPING:
            return
        self.state, self.reason = STOPPING, "shutting down"
        for merger in list(self._active):
            merger.stop(ServiceUnavailable(message, code="shutting_down"))
        for stopped in list(self._embeddings):
            if not stopped.done():
                stopped.set_exception(ServiceUnavailable(message, code="shutting_down"))

    async def stop(self) -> None:
        self.end_all()
        if self._load_task is not None and not self._load_task.done():
            await asyncio.shield(self._load_task)  # a starting core still owns a process and pages
        if self.engine is not None:
            await self.engine.shutdown()
            self.timings.shutdown()
            stats = self.stats()
            level = logging.WARNING if stats is not None and stats.used_blocks else logging.INFO
            logger.log(level, "engine stopped: %s", self.pages_summary())  # final counts: the loop is gone

    # -- state -----------------------------------------------------------------------------------
    def model_card(self, name: str) -> dict[str, Any]:
        """One /v1/models entry (REST and gRPC list the same)."""
        root = self.engine_config.model or "pagegate/engine/default_model"
        return {"id": name, "object": "model", "created": self.started_at, "owned_by": "pagegate",
                "root": root, "max_model_len": self.model.max_model_len if self.model else None}

    def require_engine(self) -> tuple[EngineClient, ModelContext]:
        """The running engine and its model, or a 503 that says why not."""
        if self.state == DRAINING:
            # NOTE: Connection: close, so a client's next request opens a connection the load balancer routes
            # elsewhere instead of reusing this one.
            raise ServiceUnavailable("The server is draining before a restart: retry on another replica.",
                                     code="draining", headers={"Retry-After": str(self.config.retry_after_s),
                                                               "Connection": "close"})
        if self.state != READY or self.engine is None or self.model is None:
            raise ServiceUnavailable(f"The server is not ready: {self.reason}.", code=self.state)
        if not self.engine.is_running:
            raise ServiceUnavailable("The engine is not running.", code="engine_dead")
        return self.engine, self.model

    def health(self) -> tuple[int, dict[str, Any]]:
        """`in_flight`: API requests being served (what a drain waits for); `admitted`: those of them whose
        generation or embedding has started."""
        counts = {"in_flight": self.num_in_flight, "admitted": self.num_admitted}
        if self.state == DRAINING:
            return 503, {"status": self.state, "reason": self.reason, **counts}
        if self.state != READY or self.engine is None:
            return 503, {"status": self.state, "reason": self.reason}
        try:
            report = {**asdict(self.engine.health()), "status": "ok", **counts}
            stalled = self.engine.stalled()
        except Exception as exc:
            return 503, {"status": "dead", "reason": f"engine health failed: {exc}"}
        if not self.engine.is_running:
            return 503, {**report, "status": "dead"}
        if stalled is not None:
            return 503, {**report, "status": "stalled", "reason": stalled}
        return 200, report

    @property
    def num_pending(self) -> int:
        return self._pending

    @property
    def num_active(self) -> int:
        """Generations the gateway is driving."""
        return len(self._active)

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    @property
    def num_admitted(self) -> int:
        return len(self._active) + len(self._embeddings)

    @property
    def draining(self) -> bool:
        return self.state == DRAINING

    def engine_for_viewers(self) -> EngineClient:
        """The engine, also while draining (the dashboard watches the drain); else require_engine's 503."""
        if self.state == DRAINING and self.engine is not None and self.engine.is_running:
            return self.engine
        return self.require_engine()[0]

    def pages_summary(self) -> str:
        stats = self.stats()
        if stats is None:
            return "KV pages unknown"
        block = self.engine_config.cache.block_size
        kv_pages = self.engine.kv_pages if self.engine is not None else "KV"
        return (f"{stats.num_blocks} pages x {block} tokens = {stats.num_blocks * block} tokens of KV "
                f"({kv_pages}), {stats.used_blocks} in use")

    def stream_pace(self) -> float:
        """Seconds between two chunks of one stream: the chunk-rate budget shared by all generations."""
        rate = self.config.stream_chunk_rate
        return min(len(self._active) / rate, MAX_STREAM_PACE_S) if rate > 0 else 0.0

    def stats(self) -> EngineStats | None:
        """The engine's counts, or None while there is no engine (loading, failed)."""
        return self.engine.stats() if self.engine is not None else None

    # -- requests --------------------------------------------------------------------------------
    def admit(self, prepared: PreparedRequest) -> None:
        """400 if n choices could never run at once; 429 unless the request's sequences (prompts x n) fit
        in the engine's free running slots plus --max-queue waiting ones; callers then start the generation
        at once. A 503 if the server began stopping while the request was being prepared."""
        self.require_engine()
        self._check_runnable(prepared)
        self._check_queue(len(prepared.prompts) * prepared.params.n)
        self._check_stepping()

    def admit_embeddings(self, num_inputs: int, priority: int) -> None:
        """`admit` for an embedding request: 400 where the server does not embed, 429 past --max-queue."""
        self.require_engine()
        check_task(self.generates, self.embeds, embed=True)
        check_priority(priority, self.engine_config.scheduler.scheduling_policy)
        self._check_queue(num_inputs)
        self._check_stepping()

    def _check_stepping(self) -> None:
        """A 503 when no engine core could take the request: each has work it has not stepped on within
        --engine-step-timeout (hung). With several cores, the router passes over the stalled ones."""
        engine, _ = self.require_engine()
        if not engine.accepting:
            raise EngineStalled(f"The engine is not stepping: {engine.stalled()}. Retry later.",
                                headers={"Retry-After": str(self.config.retry_after_s)})

    def _check_queue(self, num_seqs: int) -> None:
        engine, _ = self.require_engine()
        limit = self.config.max_queue
        if limit is None:
            return
        waiting, free = engine.queue_load()
        waiting += self._unsubmitted
        if waiting + num_seqs > limit + free:
            self.num_rejected += 1
            raise Overloaded(f"The server is overloaded: {waiting} sequences are waiting and this request adds "
                             f"{num_seqs} (limit {limit} waiting, {free} free running slots). Retry later.",
                             headers={"Retry-After": str(self.config.retry_after_s)})

    def cache_salt(self, prepared: PreparedRequest) -> str | None:
        """The prefix-cache salt: the client's, under --prefix-cache-scope key also the key's identity.

        NOTE: salted per key, one key's prefix pages are never another's hits, so `cached_tokens` tells a key
        nothing about what other keys sent; the key part is a prefix no client-chosen salt can reproduce."""
        if self.config.prefix_cache_scope != "key" or prepared.tenant is None:
            return prepared.cache_salt
        return f"key:{prepared.tenant}:{prepared.cache_salt or ''}"

    def check_generates(self) -> None:
        """A 400 for a generation sent to an embedding server (--task embed)."""
        check_task(self.generates, self.embeds, embed=False)

    def _check_runnable(self, prepared: PreparedRequest) -> None:
        """The engine's own checks of what the scheduler settings allow, made here before a stream starts
        (InvalidParamError: a 400)."""
        scheduler = self.engine_config.scheduler
        self.check_generates()
        check_priority(prepared.priority, scheduler.scheduling_policy)
        check_choices(prepared.params.n, scheduler.max_num_seqs)

    def pin_for(self, key: str) -> Pin:
        """What keeps a stored response's conversation in the KV cache for a while (its pages pinned)."""
        return Pin(key, self.config.responses_pin_ttl_s)

    def unpin(self, key: str) -> None:
        """Let the engine release what `pin_for(key)` pinned (the response left the store or was continued)."""
        if self.engine is not None and self.engine.is_running:
            self.engine.unpin(key)

    def generate(self, prepared: PreparedRequest, request_id: str,
                 trace_context: Mapping[str, str] | None = None) -> tuple[OutputMerger, list[str]]:
        """Start one engine request per prompt; the merger yields their newest outputs. `trace_context`: the
        client's W3C trace headers, parents of the requests' spans (with --otlp-traces-endpoint)."""
        engine, _ = self.require_engine()
        started = time.monotonic()
        unique = uuid.uuid4().hex[:8]  # a client may send the same x-request-id twice at once
        ids = [f"{request_id}-{i}-{unique}" for i in range(len(prepared.prompts))]
        salt = self.cache_salt(prepared)
        streams = [engine.generate(p.token_ids, prepared.params, rid, priority=prepared.priority, cache_salt=salt,
                                   pin=prepared.pin)  # a pin comes with one prompt only (a stored response)
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
            for rid in ids:
                self.request_tenants.pop(rid, None)
            for index in list(waiting):
                on_first(index)
            for index in unfinished:
                self._abort(ids[index])

        def on_finished(index: int, output: RequestOutput) -> None:
            try:  # runs in the request's pump: its timing or its spans must never fail the answer
                attributes = sampling_attributes(prepared.params) if self.timings.tracer is not None else None
                self.timings.finished(output, started, prepared.model, prepared.tenant, attributes, trace_context)
            except Exception:
                logger.exception("request %s: recording its timing failed", output.request_id)

        merger = OutputMerger(streams, on_first, on_close, on_finished)
        self._active.add(merger)
        # The merger's pump tasks put the requests in the engine's inbox on their first step; callbacks run
        # in the order they are scheduled, so this one runs right after those steps.
        seqs = len(ids) * prepared.params.n
        self._unsubmitted += seqs
        asyncio.get_running_loop().call_soon(self._submitted, seqs)
        return merger, ids

    async def embed(self, inputs: list[list[int]], request_id: str, priority: int = 0) -> list[bytes]:
        """Embed every input at once (one engine request each); if one fails, the caller goes or `end_all` ends
        it, the others are aborted."""
        engine, _ = self.require_engine()
        unique = uuid.uuid4().hex[:8]
        tasks = [asyncio.ensure_future(engine.embed(ids, f"{request_id}-{i}-{unique}", priority=priority))
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

    def _submitted(self, seqs: int) -> None:
        self._unsubmitted -= seqs

    def _abort(self, request_id: str) -> None:
        if self.engine is None:
            return
        try:
            self.engine.abort(request_id)
        except Exception as exc:  # the request may already be gone; never fail a cleanup over it
            logger.debug("abort %s: %s", request_id, exc)


def start_tracer(endpoint: str | None) -> RequestTracer | None:
    """The request tracer with --otlp-traces-endpoint; without it, OpenTelemetry is never imported."""
    return start_tracing(endpoint) if endpoint else None


async def start_engine(config: EngineConfig, data_parallel_size: int = 1,
                       step_timeout_s: float = 0.0) -> EngineClient:
    """The engine cores, each its own process (loading in the background: /health answers meanwhile);
    `step_timeout_s`: --engine-step-timeout (0: a core is never taken for hung)."""
    if data_parallel_size == 1:
        core = CoreClient(config, step_timeout_s=step_timeout_s)
        await core.start()
        return core
    return await Replicas.start(config, data_parallel_size, step_timeout_s)


def serving_line(host: EngineHost) -> str:
    cfg, model = host.config, host.model
    where = f"http://{cfg.host}:{cfg.port}/v1"
    name = model.name if model else "?"
    limit = model.max_model_len if model else "?"
    return f"pagegate serving {name} at {where} (max_model_len {limit}; {host.pages_summary()})"
