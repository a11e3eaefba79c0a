"""The gateway's only contact with the engines: route a request to its model's engine (`acquire`), count the API
requests in flight for a drain, report the server's state, health, counts and model cards, and end everything on
shutdown (pagegate.gateway.shutdown). It composes three jobs: `model_lifecycle` (load, warm-up, sleep, wake, unload,
make room, the page budget, a core's death), `admission` (may this request start now?) and `engine_requests` (start
generations and embeddings, count them). With several models (--model repeated, --models-dir) each is a slot
(pagegate.gateway.model_slots) loaded on its first request; with one, the server is what it always was: the model
loads at start (it may sleep and wake by hand) and the server stops if its engine dies."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from pagegate.config import EngineConfig
from pagegate.engine.observe.stats import EngineStats
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.engine.serving.replicas import sum_stats
from pagegate.engine.serving.spare_core import SPARE_CORES, stop_spare_core
from pagegate.gateway.acquired import AcquiredModel
from pagegate.gateway.admission import Admission
from pagegate.gateway.engine_requests import EngineRequests
from pagegate.gateway.errors import NotFound, ServiceUnavailable
from pagegate.gateway.model_lifecycle import ModelLifecycle, describe_pages
from pagegate.gateway.model_slots import FAILED as MODEL_FAILED
from pagegate.gateway.model_slots import LOADED, LOADING, SLEEPING, ModelSlot
from pagegate.gateway.prepare import ModelContext
from pagegate.gateway.request_timing import TimingRecorder
from pagegate.gateway.settings import GatewayConfig
from pagegate.gateway.tracing import RequestTracer, start_tracing

logger = logging.getLogger("pagegate.gateway")

READY, DRAINING, FAILED, STOPPING = "ready", "draining", "failed", "stopping"  # and LOADING, a model's too

# The slots an API request being served has addressed (EngineHost.serving sets it): a slot with any is never unloaded
_HELD: contextvars.ContextVar[list[ModelSlot] | None] = contextvars.ContextVar("pagegate_held_models", default=None)


class EngineHost:
    """The server's state and health, and the door to the engines: `lifecycle` brings the models up and down;
    `admission` and `engine_requests` do the per-request work on the engine of the model a request names."""

    def __init__(self, engine_config: EngineConfig, config: GatewayConfig,
                 on_fatal: Callable[[], None] | None = None) -> None:
        self.engine_config = engine_config
        self.config = config
        self.state = LOADING
        self.reason = "loading the model"
        self.started_at = int(time.time())
        self._on_fatal = on_fatal
        self._in_flight = 0  # API requests being served, REST or gRPC, whatever the route (`serving`)
        self._idle = asyncio.Event()  # set while no API request is being served (a drain waits on it)
        self._idle.set()
        self._load_task: asyncio.Task | None = None
        self.timings = TimingRecorder(start_tracer(config.otlp_traces_endpoint))
        self.several = bool(config.models)
        # LoRA adapters served by name -> path (--lora-modules, then run-time loads); ModelContext shares this dict
        self.adapters: dict[str, str] = dict(engine_config.lora.modules) if engine_config.lora else {}
        self.lifecycle = ModelLifecycle(engine_config, config, self.adapters, on_fatal)
        self.slots = self.lifecycle.slots
        self.loop: asyncio.AbstractEventLoop | None = None
        # NOTE: the parts reach the engines through what a request acquired (checked by `check_acquired` while it
        # is admitted) or through `running_engines`, never through the host: neither imports this module.
        self.engine_requests = EngineRequests(config, self.timings, self.check_acquired, self.running_engines)
        self.admission = Admission(engine_config, config, self.check_acquired, self.engine_requests)

    # -- the default model (the first; the only one of a one-model server) ------------------------
    @property
    def engine(self) -> EngineClient | None:
        return self.slots[0].engine

    @property
    def model(self) -> ModelContext | None:
        return self.slots[0].model

    @property
    def embedding_size(self) -> int | None:
        return self.slots[0].embedding_size

    # -- start -----------------------------------------------------------------------------------
    def start(self, listeners: asyncio.Future[Any] | None = None) -> None:
        """Load the default model; `listeners`: the server's other listeners starting (its gRPC server). The server
        turns ready once both are up; it fails at once where the listeners cannot start."""
        self.loop = asyncio.get_running_loop()
        if listeners is not None:
            listeners.add_done_callback(self._listeners_started)
        self._load_task = self.loop.create_task(self._start(listeners))

    async def _start(self, listeners: asyncio.Future[Any] | None) -> None:
        """Load the default model; with several, the others load on their first request."""
        slot = self.slots[0]
        await self.lifecycle.load(slot)
        await asyncio.to_thread(SPARE_CORES.drop_early)  # the first model's cores started: one not taken waits for none
        if slot.state == MODEL_FAILED and not self.several:
            self._fail(slot.reason)
            return
        if listeners is not None:
            with contextlib.suppress(Exception):  # _listeners_started failed the server
                await listeners
        if self.state == LOADING:
            self.state, self.reason = READY, "serving"
            logger.info(serving_line(self))
            self.lifecycle.start_idle_sleeper()

    # -- a request's model -----------------------------------------------------------------------
    async def acquire(self, requested: str | None) -> AcquiredModel:
        """The model a request names (None: the default one), looked up once, loaded or woken first if need be
        (the request waits; others go on); the model counts the request as in flight until it is served. A 404
        `model_not_found` for a name no model has (with several: one model's requests' names are checked as
        they are prepared)."""
        self.check_serving()
        slot = self.slot_for(requested)
        held = _HELD.get()
        if held is not None and slot not in held:
            held.append(slot)
            slot.in_flight += 1
        slot.used()
        if self.several or slot.state == SLEEPING:  # one model is only ever asleep (if it failed, the server stops)
            await self.lifecycle.ensure_loaded(slot)
            self.check_serving()  # the server may have begun stopping while the model loaded
        return AcquiredModel(slot, *self._running(slot))

    def check_acquired(self, acquired: AcquiredModel) -> None:
        """A 503 that says why unless the acquired model still serves on the engine it was acquired with: the
        server may have begun stopping, or the model's core died, while the request was being prepared."""
        self.check_serving()
        engine, _ = self._running(acquired.slot)
        if engine is not acquired.engine:  # its core died and a new one was started meanwhile
            raise ServiceUnavailable("The engine is not running.", code="engine_dead")

    def slot_for(self, requested: str | None) -> ModelSlot:
        """The model a request names (None: the default); a one-model server's whatever the name (its
        requests' names are checked as they are prepared). A 404 naming the models there are otherwise."""
        if not self.several or requested is None:
            return self.slots[0]
        for slot in self.slots:
            if requested in slot.names:
                return slot
        available = ", ".join(slot.name for slot in self.slots)
        raise NotFound(f"The model `{requested}` does not exist. Available models: {available}.", param="model",
                       code="model_not_found")

    def require_engine(self) -> tuple[EngineClient, ModelContext]:
        """The default model's running engine and its context, or a 503 that says why not."""
        self.check_serving()
        return self._running(self.slots[0])

    def _running(self, slot: ModelSlot) -> tuple[EngineClient, ModelContext]:
        """The model's running engine and its context, or a 503 that says why not."""
        if slot.state != LOADED or slot.engine is None or slot.model is None:
            raise ServiceUnavailable(f"The model `{slot.name}` is {slot.state}: {slot.reason}.",
                                     code="model_unavailable", headers={"Retry-After": str(self.config.retry_after_s)})
        if not slot.engine.is_running:
            raise ServiceUnavailable("The engine is not running.", code="engine_dead")
        return slot.engine, slot.model

    def listed_model(self) -> ModelContext:
        """A one-model server's model as /v1/models lists it: also while it sleeps (its names and limits stand);
        else require_engine's 503."""
        slot = self.slots[0]
        if slot.state == SLEEPING and slot.model is not None:
            self.check_serving()
            return slot.model
        return self.require_engine()[1]

    def running_engines(self) -> list[EngineClient]:
        """Every engine whose core runs (unpins go to all: a stored response's pages are where it ran)."""
        return [slot.engine for slot in self.slots if slot.engine is not None and slot.engine.is_running]

    # -- requests in flight ----------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Take no new request (503 + Retry-After, /health 503) while the running generations go on."""
        if self.state == READY:
            self.state, self.reason = DRAINING, "draining: finishing in-flight requests before shutting down"

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Count one API request as in flight while it is served (the REST middleware and the gRPC door call
        this for every request, whatever its route), and on the models it addressed (`acquire`)."""
        self._in_flight += 1
        self._idle.clear()
        held: list[ModelSlot] = []
        token = _HELD.set(held)
        try:
            yield
        finally:
            _HELD.reset(token)
            for slot in held:
                slot.in_flight -= 1
                slot.used()
            if held:
                self.lifecycle.models_changed()
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
        await self.lifecycle.settle()
        await stop_spare_core()  # no core starts any more: a waiting spare would outlive an in-process app
        engines = [slot.engine for slot in self.slots if slot.engine is not None]
        if not engines:
            return
        await asyncio.gather(*(engine.shutdown() for engine in engines))
        self.timings.shutdown()
        stats = self.stats()
        level = logging.WARNING if stats is not None and stats.used_blocks else logging.INFO
        logger.log(level, "engine stopped: %s", self.pages_summary())  # final counts: the loop is gone

    # -- state -----------------------------------------------------------------------------------
    def model_cards(self, paths: bool = True) -> list[dict[str, Any]]:
        """The /v1/models entries (REST and gRPC list the same): a one-model server's names once it serves (also
        asleep); with several, every model and its state (loaded, loading, sleeping, unloaded, failed). `paths`:
        an adapter's `root` is its path on the server (an admin's view: pagegate.gateway.auth), else its name."""
        if not self.several:
            model = self.listed_model()
            return [self.model_card(name, paths) for name in (*model.names, *self.adapters)]
        self.check_serving()
        return [self.model_card(slot.name, paths) for slot in self.slots]

    def model_card(self, name: str, paths: bool = True) -> dict[str, Any]:
        """One /v1/models entry; a LoRA adapter's names its base model as `parent` and its path as `root`."""
        if name in self.adapters and not self.several:
            slot = self.slots[0]
            return {"id": name, "object": "model", "created": self.started_at, "owned_by": "pagegate",
                    "root": self.adapters[name] if paths else name, "parent": slot.model.name if slot.model else None,
                    "max_model_len": slot.model.max_model_len if slot.model else None}
        slot = self.slot_for(name)
        root = slot.engine_config.model or "pagegate/engine/default_model"
        return {"id": name, "object": "model", "created": self.started_at, "owned_by": "pagegate",
                "root": root, "max_model_len": slot.model.max_model_len if slot.model else None,
                **slot.card_state()}

    def check_serving(self) -> None:
        """A 503 that says why unless the server takes requests (not while loading, draining or stopping)."""
        if self.state == DRAINING:
            # NOTE: Connection: close, so a client's next request opens a connection the load balancer routes
            # elsewhere instead of reusing this one.
            raise ServiceUnavailable("The server is draining before a restart: retry on another replica.",
                                     code="draining", headers={"Retry-After": str(self.config.retry_after_s),
                                                               "Connection": "close"})
        if self.state != READY:
            raise ServiceUnavailable(f"The server is not ready: {self.reason}.", code=self.state)

    def _listeners_started(self, listeners: asyncio.Future[Any]) -> None:
        if listeners.cancelled() or listeners.exception() is None:
            return
        logger.error("cannot serve: %s", listeners.exception())
        self._fail(str(listeners.exception()))

    def _fail(self, reason: str) -> None:
        self.state, self.reason = FAILED, reason
        if self._on_fatal is not None:
            self._on_fatal()

    def health(self) -> tuple[int, dict[str, Any]]:
        """`in_flight`: API requests being served (what a drain waits for); `admitted`: those of them whose
        generation or embedding has started. A one-model server that sleeps is healthy (`sleeping`: true): its
        next request wakes it."""
        counts = {"in_flight": self.num_in_flight, "admitted": self.engine_requests.num_admitted}
        if self.state == DRAINING:
            return 503, {"status": self.state, "reason": self.reason, **counts}
        if self.several and self.state == READY:
            return self._models_health(counts)
        if self.state != READY or self.engine is None:
            return 503, {"status": self.state, "reason": self.reason}
        try:
            report = {**msgspec.structs.asdict(self.engine.health()), "status": "ok",
                      "sleeping": self.slots[0].state == SLEEPING, **counts}
            stalled = self.engine.stalled()
        except Exception as exc:
            return 503, {"status": "dead", "reason": f"engine health failed: {exc}"}
        if not self.engine.is_running:
            return 503, {**report, "status": "dead"}
        if stalled is not None:
            return 503, {**report, "status": "stalled", "reason": stalled}
        return 200, report

    def _models_health(self, counts: dict[str, int]) -> tuple[int, dict[str, Any]]:
        """Several models: 200 while the server takes requests, each model's state; `degraded` while one has
        failed (its requests get errors, the others serve; it loads again on its next request)."""
        models: dict[str, dict[str, Any]] = {}
        for slot in self.slots:
            models[slot.name] = entry = {**slot.card_state(), "in_flight": slot.in_flight, "kv_bytes": slot.kv_bytes}
            if slot.engine is not None and (stalled := slot.engine.stalled()) is not None:
                entry["stalled"] = stalled
        failed = [name for name, entry in models.items() if entry["state"] == MODEL_FAILED or "stalled" in entry]
        return 200, {"status": "degraded" if failed else "ok", "models": models, **counts}

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
        block_size = self.engine_config.cache.block_size
        if self.several:
            return "; ".join(f"{slot.name}: {describe_pages(slot, block_size)}" for slot in self.slots if slot.engine)
        return describe_pages(self.slots[0], block_size)

    def stats(self) -> EngineStats | None:
        """The engines' counts (summed over the loaded models), or None while there is none (loading, failed)."""
        engines = [slot.engine for slot in self.slots if slot.engine is not None]
        if not engines:
            return None
        return engines[0].stats() if len(engines) == 1 else sum_stats([engine.stats() for engine in engines])

    def models_line(self) -> str | None:
        """Several models: each one's state and share of the page budget, for the dashboard (None: one model)."""
        if not self.several:
            return None
        return " · ".join(f"{slot.name} {slot.state}" + (f" {slot.kv_bytes / 2**20:.0f} MiB" if slot.kv_bytes else "")
                          for slot in self.slots)

    def model_stats(self) -> dict[str, EngineStats]:
        """Each loaded model's counts (its share of the page budget: /metrics labels them `model_name`)."""
        return {slot.name: slot.engine.stats() for slot in self.slots if slot.engine is not None
                and slot.state != SLEEPING}  # a sleeping core's pages are freed (its counts are its last ones)


def requested_model(body: Any) -> str | None:
    """The `model` a request body names, to route it before it is parsed (None: none, or not a name)."""
    name = body.get("model") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


def start_tracer(endpoint: str | None) -> RequestTracer | None:
    """The request tracer with --otlp-traces-endpoint; without it, OpenTelemetry is never imported."""
    return start_tracing(endpoint) if endpoint else None


def serving_line(host: EngineHost) -> str:
    cfg, model = host.config, host.model
    where = f"http://{cfg.host}:{cfg.port}/v1"
    name = model.name if model else "?"
    limit = model.max_model_len if model else "?"
    return f"pagegate serving {name} at {where} (max_model_len {limit}; {host.pages_summary()})"
