"""The gateway's only contact with the engines: load them off the event loop, report their state and health, count
the API requests in flight for a drain, and end everything on shutdown (pagegate.gateway.shutdown). It composes
the two other jobs: `admission` (may this request start now?) and `engine_requests` (start generations and
embeddings, count them). With several models (--model repeated, --models-dir) each is a slot
(pagegate.gateway.model_slots) loaded on its first request, unloaded least recently used first under --models-max,
put to sleep when idle, and failed alone when its core dies; with one, the server is what it always was: the model
loads at start and the server stops if its engine dies."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import Any

from pagegate.config import EngineConfig
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.observe.stats import EngineStats
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.engine.serving.replicas import start_cores, sum_stats
from pagegate.gateway.admission import Admission, serves_embeddings, serves_generations
from pagegate.gateway.engine_requests import EngineRequests
from pagegate.gateway.errors import APIError, NotFound, ServiceUnavailable
from pagegate.gateway.model_slots import FAILED as MODEL_FAILED
from pagegate.gateway.model_slots import (
    LOADED,
    LOADING,
    SLEEPING,
    UNLOADED,
    ModelSlot,
    page_budget,
    with_kv_bytes,
)
from pagegate.gateway.prepare import ModelContext
from pagegate.gateway.request_timing import TimingRecorder
from pagegate.gateway.settings import GatewayConfig
from pagegate.gateway.tools import served_tool_format
from pagegate.gateway.tracing import RequestTracer, start_tracing

logger = logging.getLogger("pagegate.gateway")

READY, DRAINING, FAILED, STOPPING = "ready", "draining", "failed", "stopping"  # and LOADING, a model's too
ROOM_TIMEOUT_S = 60.0  # how long a model to load waits for a loaded one to become idle under --models-max
IDLE_CHECK_S = 1.0  # how often idle models are looked for (--sleep-idle-seconds)

# The slots an API request being served has addressed (EngineHost.serving sets it): a slot with any is never unloaded
_HELD: contextvars.ContextVar[list[ModelSlot] | None] = contextvars.ContextVar("pagegate_held_models", default=None)


class ModelBusy(APIError):
    """An unload or sleep asked of a model that is serving requests."""

    status_code = 409
    default_code = "model_busy"


class EngineHost:
    """The engines' lifecycle (load, warm-up, sleep, unload, drain, stop), the server's state and health;
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
        self._changed = asyncio.Event()  # a model became idle or finished loading (a load waiting for room)
        self._load_task: asyncio.Task | None = None
        self._sleeper: asyncio.Task | None = None
        self.timings = TimingRecorder(start_tracer(config.otlp_traces_endpoint))
        self.several = bool(config.models)
        # LoRA adapters served by name -> path (--lora-modules, then run-time loads); ModelContext shares this dict
        self.adapters: dict[str, str] = dict(engine_config.lora.modules) if engine_config.lora else {}
        self.slots = model_slots(engine_config, config)
        self.budget = page_budget(engine_config, config.models_max or len(self.slots),
                                  self.slots) if self.several else None
        self.loop: asyncio.AbstractEventLoop | None = None
        # NOTE: the parts reach the engines through two callables (a model's engine only while serving, or every
        # running one), never through the host: what each may touch is named, and neither imports this module.
        self.engine_requests = EngineRequests(config, self.timings, self.require_engine, self.running_engines)
        self.admission = Admission(engine_config, config, self.require_engine, self.engine_requests)

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

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._load_task = self.loop.create_task(self._start())

    async def _start(self) -> None:
        """Load the default model; with several, the others load on their first request."""
        slot = self.slots[0]
        await self._load(slot)
        if slot.state == MODEL_FAILED and not self.several:
            self.state, self.reason = FAILED, slot.reason
            if self._on_fatal is not None:
                self._on_fatal()
            return
        if self.state == LOADING:
            self.state, self.reason = READY, "serving"
            logger.info(serving_line(self))
            if self.several and self.config.sleep_idle_s > 0:
                self._sleeper = asyncio.get_running_loop().create_task(self._sleep_idle_models())

    async def _load(self, slot: ModelSlot) -> None:
        """Start the model's core(s) and warm them up; on failure the model is FAILED, with the reason."""
        slot.state, slot.reason = LOADING, "loading"
        started = time.perf_counter()
        try:
            kv_bytes, cores = await self._grant(slot), self.config.data_parallel_size
            config = with_kv_bytes(slot.engine_config, kv_bytes // cores if kv_bytes is not None else None)
            elastic = self.budget.elastic(slot, kv_bytes, cores) if self.budget and kv_bytes is not None else None
            slot.engine = engine = await start_cores(config, cores, self.config.engine_step_timeout_s, elastic)
            slot.loads += 1
            engine.on_dead = lambda: self._engine_died(slot, engine)
            slot.model = self._model_context(slot, engine)
            await self._warm_up(slot, engine)
        except Exception as exc:
            if isinstance(exc, ModelLoadError):  # the user's file or flags: the message says it all
                logger.error("cannot serve %s: %s", slot.name if self.several else "this model", exc)
            else:
                logger.exception("the engine of %s failed to start", slot.name)
            slot.state, slot.reason = MODEL_FAILED, f"the engine failed to start: {type(exc).__name__}: {exc}"
            if self.several:  # a one-model server keeps it for stop(); a slot is retried with a fresh one
                await self._drop_engine(slot)
            return
        if slot.state == LOADING:
            slot.state, slot.reason = LOADED, "serving"
            if self.several:
                logger.info("model %s loaded in %.1f s (%s)", slot.name, time.perf_counter() - started,
                            self._pages_of(slot))

    async def _warm_up(self, slot: ModelSlot, engine: EngineClient) -> None:
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
            slot.embedding_size = len(await engine.embed(prompt, f"warm-up-embed-{time.time_ns()}")) // 4
            logger.info("warm-up: a %d-dimensional embedding took %.0f ms", slot.embedding_size,
                        (time.perf_counter() - started) * 1000)

    def _model_context(self, slot: ModelSlot, engine: EngineClient) -> ModelContext:
        names = slot.names or (engine.model_name,)
        tokenizer = engine.tokenizer
        vocab = tokenizer.vocab_size if tokenizer is not None else engine.vocab_size
        if tokenizer is not None and self.config.chat_template is not None:
            tokenizer.chat_template = self.config.chat_template  # this process's copy: the engine never renders
        return ModelContext(names, tokenizer, engine.max_model_len, vocab, dict(engine.default_sampling),
                            engine.compile_grammar if tokenizer is not None else None,
                            reasoning_parser=self.config.reasoning_parser,
                            tool_call_parser=served_tool_format(
                                self.config.tool_call_parser, tokenizer.chat_template if tokenizer else None),
                            max_scoring_tokens=self.config.max_scoring_tokens, adapters=self.adapters)

    def _engine_died(self, slot: ModelSlot, engine: EngineClient) -> None:
        """An engine core (or one of its tensor-parallel workers) died. A one-model server exits non-zero (a
        supervisor restarts it) rather than serve 503s for ever; with several, that model alone is FAILED (its
        requests got the engine's error) and is loaded again on its next request."""
        if not self.several:
            logger.error("the engine died: the server stops")
            if self._on_fatal is not None:
                self._on_fatal()
            return
        if slot.engine is not engine:  # an engine already dropped (unloaded, replaced)
            return
        logger.error("the engine of %s died: it is marked failed and loads again on its next request", slot.name)
        slot.state, slot.reason = MODEL_FAILED, "its engine core died"
        if self.loop is not None:
            self.loop.create_task(self._drop_engine(slot))

    async def _drop_engine(self, slot: ModelSlot) -> None:
        """Forget the model's engine and end its processes (its pages and weights go with them)."""
        engine, slot.engine, slot.model = slot.engine, None, None
        if engine is not None:
            await engine.shutdown()
        slot.release_budget()  # once its cores are gone: none of them changes its entry again
        self._changed.set()

    # -- several models: load on demand, room under --models-max, unload, sleep ------------------
    async def acquire(self, requested: str | None) -> tuple[EngineClient, ModelContext]:
        """The engine and model a request names (None: the default one), loaded or woken first if need be (the
        request waits; others go on); the model counts the request as in flight until it is served. A 404
        `model_not_found` for a name no model has. A one-model server: `require_engine`, as always."""
        if not self.several:
            return self.require_engine()
        self.check_serving()
        slot = self.slot_for(requested)
        held = _HELD.get()
        if held is not None and slot not in held:
            held.append(slot)
            slot.in_flight += 1
        slot.used()
        await self.ensure_loaded(slot)
        return self.require_engine(slot.name)

    async def ensure_loaded(self, slot: ModelSlot) -> None:
        """Load or wake the model unless it is loaded; a 503 that says why when it cannot be."""
        if slot.loading is None and slot.state != LOADED:
            slot.loading = asyncio.get_running_loop().create_task(self._bring_up(slot))
        if slot.loading is not None:
            await asyncio.shield(slot.loading)
        if slot.state != LOADED:
            raise ServiceUnavailable(f"The model `{slot.name}` is not available: {slot.reason}.",
                                     code="model_unavailable", headers={"Retry-After": str(self.config.retry_after_s)})

    async def _bring_up(self, slot: ModelSlot) -> None:
        try:
            if slot.state == SLEEPING and slot.engine is not None:
                await self._wake(slot)
            else:
                if slot.engine is not None:  # a failed model's core, if it still runs
                    await self._drop_engine(slot)
                await self._make_room(slot)
                await self._load(slot)
        except Exception as exc:
            if slot.state == SLEEPING:  # it could not wake now (no room in the budget): it sleeps on
                slot.reason = f"it could not wake: {exc}"
            else:
                slot.state, slot.reason = MODEL_FAILED, f"{type(exc).__name__}: {exc}"
        finally:
            slot.loading = None
            self._changed.set()

    async def _make_room(self, slot: ModelSlot) -> None:
        """Under --models-max, unload the least recently used idle model until this one fits; wait (at most
        ROOM_TIMEOUT_S) while every loaded one is serving.

        NOTE: a model serving requests is never unloaded, not even the least recently used: its requests would
        fail. A sleeping model holds its weights, so it counts as loaded (llama.cpp's router counts the same)."""
        limit = self.config.models_max
        deadline = time.monotonic() + ROOM_TIMEOUT_S
        while limit:
            others = [s for s in self.slots if s is not slot and (s.holds_memory or s.loading is not None)]
            if len(others) < limit:
                return
            idle = [s for s in others if s.idle and s.holds_memory]
            if idle:
                await self._unload(min(idle, key=lambda s: s.last_used))
                continue
            await self._wait_for_change(deadline, f"--models-max {limit}: every loaded model")

    async def _wait_for_change(self, deadline: float, who: str) -> None:
        """Until a model becomes idle or finishes loading (or a second passes); a RuntimeError past `deadline`."""
        self._changed.clear()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"{who} has been serving requests for {ROOM_TIMEOUT_S:g} s")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), min(remaining, IDLE_CHECK_S))

    # -- the page budget (model_slots' NOTE) -----------------------------------------------------
    async def _grant(self, slot: ModelSlot) -> int | None:
        """The bytes of pages a model loading or waking starts with, reserved for it in the ledger: its floor, idle
        models shrunk to their floors first while less is free (waiting while they serve); its cores grow it from
        there by demand. None: no shared budget."""
        budget = self.budget
        if budget is None:
            return None
        slot.release_budget()
        deadline, tried = time.monotonic() + ROOM_TIMEOUT_S, set()
        while not (granted := budget.ledger.take(slot.entry, budget.floor, budget.floor)):
            donors = [s for s in self._donors(slot) if s.name not in tried]
            if donors:
                donor = max(donors, key=lambda s: s.kv_bytes)
                tried.add(donor.name)
                await self._resize(donor, budget.floor)
                continue
            await self._wait_for_change(deadline, "the page budget: every model holding pages")
        return granted

    def _donors(self, slot: ModelSlot) -> list[ModelSlot]:
        """The other loaded, idle models that hold pages beyond their floors."""
        assert self.budget is not None
        return [s for s in self.slots if s is not slot and s.state == LOADED and s.idle and s.engine is not None
                and not s.resizing and self.budget.spare(s)]

    async def _resize(self, slot: ModelSlot, kv_bytes: int) -> None:
        """An idle model's pool to `kv_bytes`, in place (its core moves its limit and its ledger entry, keeping its
        prefix cache below the limit). While it resizes, a model is not taken from again."""
        if slot.engine is None or kv_bytes == slot.kv_bytes or slot.resizing:
            return
        slot.resizing = True
        try:
            pages = await slot.engine.resize(kv_bytes)
        except Exception as exc:
            logger.warning("resizing the pages of %s failed (it keeps its pool): %s", slot.name, exc)
            return
        finally:
            slot.resizing = False
        logger.info("%s: %d KV pages now (%.0f MiB of the budget)", slot.name, pages, slot.kv_bytes / 2**20)

    async def _unload(self, slot: ModelSlot) -> None:
        logger.info("unloading %s (%s)", slot.name, "least recently used" if self.config.models_max else "asked")
        slot.state, slot.reason = UNLOADED, "unloaded"
        await self._drop_engine(slot)

    async def load_model(self, name: str | None) -> ModelSlot:
        """POST /models/load: load (or wake) a model now."""
        self.check_serving()
        slot = self.slot_for(name)
        slot.used()
        await self.ensure_loaded(slot)
        return slot

    async def _idle_slot(self, name: str | None, what: str) -> ModelSlot:
        """The named model once any load of it has settled; a 409 (ModelBusy) while it serves requests."""
        slot = self.slot_for(name)
        if slot.loading is not None:
            await asyncio.shield(slot.loading)
        self._check_idle(slot, what)
        return slot

    async def unload_model(self, name: str | None) -> ModelSlot:
        """POST /models/unload: free a model's core now (a 409 while it serves requests)."""
        slot = await self._idle_slot(name, "unloaded")
        if slot.holds_memory:
            await self._unload(slot)
        return slot

    async def sleep_model(self, name: str | None) -> ModelSlot:
        """/sleep: free the model's KV pages, keep its weights (its prefix cache is lost unless KV tiers keep it)."""
        slot = await self._idle_slot(name, "put to sleep")
        if slot.state == LOADED and slot.engine is not None:
            # NOTE: asleep before the core is told: a request arriving meanwhile wakes it, and the core takes the
            # wake after the sleep and the request after the wake (one socket, frames in order).
            slot.state, slot.reason = SLEEPING, "asleep: its KV pages are freed, its weights kept"
            try:
                await slot.engine.sleep()
            except Exception:
                if slot.state == SLEEPING and slot.loading is None:
                    slot.state, slot.reason = LOADED, "serving"
                raise
            slot.release_budget()  # its cores gave their pages back; what rounding left goes too
            logger.info("%s sleeps", slot.name)
        return slot

    async def _wake(self, slot: ModelSlot) -> None:
        assert slot.engine is not None
        try:
            await slot.engine.wake_up(await self._grant(slot))  # fresh pages: its floor, then as its demand grows
        except BaseException:
            slot.release_budget()  # it sleeps on, holding nothing
            raise
        slot.state, slot.reason = LOADED, "serving"
        logger.info("%s woke up (%s)", slot.name, self._pages_of(slot))

    def _check_idle(self, slot: ModelSlot, what: str) -> None:
        if slot.in_flight:
            raise ModelBusy(f"The model `{slot.name}` is serving {slot.in_flight} request(s): it cannot be {what} "
                            "now. Retry when they are done.", param="model")

    async def _sleep_idle_models(self) -> None:
        """--sleep-idle-seconds: a loaded model with no request for that long sleeps."""
        while True:
            await asyncio.sleep(min(IDLE_CHECK_S, self.config.sleep_idle_s))
            now = time.monotonic()
            for slot in self.slots:
                if slot.state == LOADED and slot.idle and now - slot.last_used >= self.config.sleep_idle_s:
                    try:
                        await self.sleep_model(slot.name)
                    except Exception:
                        logger.exception("putting %s to sleep failed", slot.name)

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
                self._changed.set()
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
        if self._sleeper is not None:
            self._sleeper.cancel()
        if self._load_task is not None and not self._load_task.done():
            await asyncio.shield(self._load_task)  # a starting core still owns a process and pages
        loading = [slot.loading for slot in self.slots if slot.loading is not None]
        await asyncio.gather(*loading, return_exceptions=True)
        if self.budget is not None:  # no core opens the ledger any more; those running keep their mapping
            self.budget.ledger.unlink()
        engines = [slot.engine for slot in self.slots if slot.engine is not None]
        if not engines:
            return
        await asyncio.gather(*(engine.shutdown() for engine in engines))
        self.timings.shutdown()
        stats = self.stats()
        level = logging.WARNING if stats is not None and stats.used_blocks else logging.INFO
        logger.log(level, "engine stopped: %s", self.pages_summary())  # final counts: the loop is gone

    # -- state -----------------------------------------------------------------------------------
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

    def model_cards(self) -> list[dict[str, Any]]:
        """The /v1/models entries (REST and gRPC list the same): a one-model server's names once it serves;
        with several, every model and its state (loaded, loading, sleeping, unloaded, failed)."""
        if not self.several:
            _, model = self.require_engine()
            return [self.model_card(name) for name in (*model.names, *self.adapters)]
        self.check_serving()
        return [self.model_card(slot.name) for slot in self.slots]

    def model_card(self, name: str) -> dict[str, Any]:
        """One /v1/models entry; a LoRA adapter's names its base model as `parent` and its path as `root`."""
        if name in self.adapters and not self.several:
            slot = self.slots[0]
            return {"id": name, "object": "model", "created": self.started_at, "owned_by": "pagegate",
                    "root": self.adapters[name], "parent": slot.model.name if slot.model else None,
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

    def require_engine(self, name: str | None = None) -> tuple[EngineClient, ModelContext]:
        """The running engine of the model `name` (None: the default) and its model, or a 503 that says why not."""
        self.check_serving()
        slot = self.slot_for(name)
        if slot.state != LOADED or slot.engine is None or slot.model is None:
            if not self.several:
                raise ServiceUnavailable(f"The server is not ready: {self.reason}.", code=self.state)
            raise ServiceUnavailable(f"The model `{slot.name}` is {slot.state}: {slot.reason}.",
                                     code="model_unavailable", headers={"Retry-After": str(self.config.retry_after_s)})
        if not slot.engine.is_running:
            raise ServiceUnavailable("The engine is not running.", code="engine_dead")
        return slot.engine, slot.model

    def running_engines(self) -> list[EngineClient]:
        """Every engine whose core runs (unpins go to all: a stored response's pages are where it ran)."""
        return [slot.engine for slot in self.slots if slot.engine is not None and slot.engine.is_running]

    def health(self) -> tuple[int, dict[str, Any]]:
        """`in_flight`: API requests being served (what a drain waits for); `admitted`: those of them whose
        generation or embedding has started."""
        counts = {"in_flight": self.num_in_flight, "admitted": self.engine_requests.num_admitted}
        if self.state == DRAINING:
            return 503, {"status": self.state, "reason": self.reason, **counts}
        if self.several and self.state == READY:
            return self._models_health(counts)
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
        if self.several:
            return "; ".join(f"{slot.name}: {self._pages_of(slot)}" for slot in self.slots if slot.engine)
        return self._pages_of(self.slots[0])

    def _pages_of(self, slot: ModelSlot) -> str:
        engine = slot.engine
        stats = engine.stats() if engine is not None else None
        if engine is None or stats is None:
            return "KV pages unknown"
        block = self.engine_config.cache.block_size
        return (f"{stats.num_blocks} pages x {block} tokens = {stats.num_blocks * block} tokens of KV "
                f"({engine.kv_pages}), {stats.used_blocks} in use")

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


def model_slots(engine_config: EngineConfig, config: GatewayConfig) -> list[ModelSlot]:
    """One slot per served model; a one-model server's single slot is named as --served-model-name says (or,
    once loaded, by its engine)."""
    if not config.models:
        return [ModelSlot(tuple(config.served_model_names), engine_config)]
    return [ModelSlot((served.name,), replace(engine_config, model=served.path, served_model_name=served.name))
            for served in config.models]


def start_tracer(endpoint: str | None) -> RequestTracer | None:
    """The request tracer with --otlp-traces-endpoint; without it, OpenTelemetry is never imported."""
    return start_tracing(endpoint) if endpoint else None


def serving_line(host: EngineHost) -> str:
    cfg, model = host.config, host.model
    where = f"http://{cfg.host}:{cfg.port}/v1"
    name = model.name if model else "?"
    limit = model.max_model_len if model else "?"
    return f"pagegate serving {name} at {where} (max_model_len {limit}; {host.pages_summary()})"
