"""The gateway's only contact with the engine: load it off the event loop, report its state and health, count
the API requests in flight for a drain, and end everything on shutdown (pagegate.gateway.shutdown). It composes
the two other jobs: `admission` (may this request start now?) and `engine_requests` (start generations and
embeddings, count them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

from pagegate.config import EngineConfig
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.observe.stats import EngineStats
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.engine.serving.replicas import start_cores
from pagegate.gateway.admission import Admission, serves_embeddings, serves_generations
from pagegate.gateway.engine_requests import EngineRequests
from pagegate.gateway.errors import ServiceUnavailable
from pagegate.gateway.prepare import ModelContext
from pagegate.gateway.request_timing import TimingRecorder
from pagegate.gateway.settings import GatewayConfig
from pagegate.gateway.tools import served_tool_format
from pagegate.gateway.tracing import RequestTracer, start_tracing

logger = logging.getLogger("pagegate.gateway")

LOADING, READY, DRAINING, FAILED, STOPPING = "loading", "ready", "draining", "failed", "stopping"


class EngineHost:
    """The engine's lifecycle (load, warm-up, drain, stop), the server's state and health; `admission` and
    `engine_requests` do the per-request work on the engine it holds."""

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
        self._in_flight = 0  # API requests being served, REST or gRPC, whatever the route (`serving`)
        self._idle = asyncio.Event()  # set while no API request is being served (a drain waits on it)
        self._idle.set()
        self._load_task: asyncio.Task | None = None
        self.timings = TimingRecorder(start_tracer(config.otlp_traces_endpoint))
        self.embedding_size: int | None = None  # the model's embedding size, from the warm-up (if it embeds)
        self.loop: asyncio.AbstractEventLoop | None = None
        # NOTE: the parts reach the engine through two callables (the engine only while serving, or whatever the
        # state), never through the host: what each may touch is named, and neither imports this module.
        self.engine_requests = EngineRequests(config, self.timings, self.require_engine, lambda: self.engine)
        self.admission = Admission(engine_config, config, self.require_engine, self.engine_requests)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._load_task = self.loop.create_task(self._load())

    async def _load(self) -> None:
        try:
            self.engine = engine = await start_cores(self.engine_config, self.config.data_parallel_size,
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
        if serves_generations(self.engine_config):
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate(prompt, params, f"warm-up-{time.time_ns()}"):
                pass
            logger.info("warm-up: a 4-token generation took %.0f ms", (time.perf_counter() - started) * 1000)
        if serves_embeddings(self.engine_config):
            started = time.perf_counter()
            self.embedding_size = len(await engine.embed(prompt, f"warm-up-embed-{time.time_ns()}")) // 4
            logger.info("warm-up: a %d-dimensional embedding took %.0f ms", self.embedding_size,
                        (time.perf_counter() - started) * 1000)

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
        self.engine_requests.end_all(message)

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
        counts = {"in_flight": self.num_in_flight, "admitted": self.engine_requests.num_admitted}
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
    def num_in_flight(self) -> int:
        return self._in_flight

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

    def stats(self) -> EngineStats | None:
        """The engine's counts, or None while there is no engine (loading, failed)."""
        return self.engine.stats() if self.engine is not None else None


def start_tracer(endpoint: str | None) -> RequestTracer | None:
    """The request tracer with --otlp-traces-endpoint; without it, OpenTelemetry is never imported."""
    return start_tracing(endpoint) if endpoint else None


def serving_line(host: EngineHost) -> str:
    cfg, model = host.config, host.model
    where = f"http://{cfg.host}:{cfg.port}/v1"
    name = model.name if model else "?"
    limit = model.max_model_len if model else "?"
    return f"pagegate serving {name} at {where} (max_model_len {limit}; {host.pages_summary()})"
