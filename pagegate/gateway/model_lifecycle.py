"""The models' lifecycle behind the gateway: start a model's core(s) and warm them up; put it to sleep and wake it;
unload it (by hand, or the least recently used idle one to make room under --models-max); grant and resize its share
of the page budget (model_slots' NOTE); put idle models to sleep (--sleep-idle-seconds); fail a model alone when its
core dies, and back off from loading one whose load failed. EngineHost (engine_host.py) is the gateway's facade over
it: a request reaches its model through `EngineHost.acquire`, which calls `ensure_loaded` here.

A one-model server uses part of it: its model loads at start and may sleep and wake (/sleep, /wake_up); the server
stops if its engine dies. Its pool is fixed (no page budget is shared: `budget` is None), so a wake gets the pages it
had."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import time
from collections.abc import Callable

from pagegate.config import EngineConfig
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.media.limits import ImageLimits
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.engine.serving.replicas import start_cores
from pagegate.gateway.admission import serves_embeddings, serves_generations
from pagegate.gateway.errors import APIError, ServiceUnavailable
from pagegate.gateway.model_slots import (
    FAILED,
    LOADED,
    LOADING,
    ROOM_TIMEOUT_S,
    SLEEPING,
    UNLOADED,
    ModelSlot,
    page_budget,
    served_slots,
    with_kv_bytes,
)
from pagegate.gateway.prepare import ModelContext
from pagegate.gateway.settings import GatewayConfig
from pagegate.gateway.tools import served_tool_format

CHAT_TEMPLATES = "pagegate.engine.loading.chat_template"  # jinja2's sandbox: imported as the first model loads

logger = logging.getLogger("pagegate.gateway")

IDLE_CHECK_S = 1.0  # how often idle models are looked for (--sleep-idle-seconds)
# A prompt's step and a decode step: a decode may take paths of its own (CUDA graphs, Triton's decode kernel, compiled
# at their first use); a prompt's step alone where every step runs one path (the native decoder's; Ready.one_path).
WARM_UP_TOKENS = 2


class ModelBusy(APIError):
    """An unload or sleep asked of a model that is serving requests."""

    status_code = 409
    default_code = "model_busy"


class ModelNotLoaded(APIError):
    """A sleep or unload asked of a model that is not loaded (its load failed, or it was never loaded)."""

    status_code = 409
    default_code = "model_not_loaded"


class ModelLifecycle:
    """Every served model's slot, and what brings each up and down. With several models (--model repeated,
    --models-dir) they share one page budget; `on_fatal` ends a one-model server whose engine died."""

    def __init__(self, engine_config: EngineConfig, config: GatewayConfig, adapters: dict[str, str],
                 on_fatal: Callable[[], None] | None = None) -> None:
        self.engine_config = engine_config
        self.config = config
        self.several = bool(config.models)
        self.adapters = adapters  # LoRA adapters by name (EngineHost's dict: each model's ModelContext shares it)
        self.slots = served_slots(engine_config, config)
        self.budget = page_budget(engine_config, config.models_max or len(self.slots),
                                  self.slots) if self.several else None
        self._on_fatal = on_fatal
        self._changed = asyncio.Event()  # a model became idle or finished loading (a load waiting for room)
        self._sleeper: asyncio.Task[None] | None = None
        self._drops: set[asyncio.Task[None]] = set()  # dead engines being ended (a reference keeps each task alive)

    def models_changed(self) -> None:
        """A model became idle (its requests were served): a load waiting for room looks again."""
        self._changed.set()

    # -- load ------------------------------------------------------------------------------------
    async def load(self, slot: ModelSlot) -> None:
        """Start the model's core(s) and warm them up; on failure the model is FAILED, with the reason, and the
        next load waits out a backoff (ModelSlot.load_failed)."""
        slot.state, slot.reason = LOADING, "loading"
        started = time.perf_counter()
        try:
            await self._start_engine(slot)
        except Exception as exc:
            if isinstance(exc, ModelLoadError):  # the user's file or flags: the message says it all
                logger.error("cannot serve %s: %s", slot.name if self.several else "this model", exc)
            else:
                logger.exception("the engine of %s failed to start", slot.name)
            slot.load_failed(f"the engine failed to start: {type(exc).__name__}: {exc}")
            if self.several:  # a one-model server keeps it for stop(); a slot is retried with a fresh one
                await self._drop_engine(slot)
            return
        if slot.state == LOADING:
            slot.state, slot.reason = LOADED, "serving"
            slot.forget_failures()
            if self.several:
                logger.info("model %s loaded in %.1f s (%s)", slot.name, time.perf_counter() - started,
                            describe_pages(slot, self.engine_config.cache.block_size))

    async def _start_engine(self, slot: ModelSlot) -> None:
        """The model's cores on its granted share of the budget, its ModelContext, one warm-up request."""
        kv_bytes, cores = await self._grant(slot), self.config.data_parallel_size
        config = with_kv_bytes(slot.engine_config, kv_bytes // cores if kv_bytes is not None else None)
        elastic = self.budget.elastic(slot, kv_bytes, cores) if self.budget and kv_bytes is not None else None
        # the chat renderer's imports (jinja2) on a thread while this waits for the cores, which the warm-up needs
        renderer = asyncio.create_task(asyncio.to_thread(importlib.import_module, CHAT_TEMPLATES))
        try:
            slot.engine = engine = await start_cores(config, cores, self.config.engine_step_timeout_s, elastic)
        finally:
            await renderer
        slot.loads += 1
        engine.on_dead = lambda: self._engine_died(slot, engine)
        slot.model = self._model_context(slot, engine)
        await self._warm_up(slot, engine)

    async def _warm_up(self, slot: ModelSlot, engine: EngineClient) -> None:
        """A short generation and an embedding (where the server embeds) through the whole path, side by side in the
        core's steps, and meanwhile a chat rendered on a thread (the template compiled), so the first client does
        not pay for lazy set-up."""
        tokenizer = engine.tokenizer
        prompt = tokenizer.encode("Hello") if tokenizer is not None else [0]
        jobs = [asyncio.to_thread(_render_once, slot.model)]
        if serves_generations(self.engine_config):
            jobs.append(_warm_up_generation(engine, prompt))
        if serves_embeddings(self.engine_config):
            jobs.append(_warm_up_embedding(slot, engine, prompt))
        await asyncio.gather(*jobs)

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
                            max_scoring_tokens=self.config.max_scoring_tokens, adapters=self.adapters,
                            processing=engine.processing, image_limits=ImageLimits(
                                max_images=self.config.max_images_per_prompt,
                                allowed_domains=frozenset(d.lower() for d in self.config.allowed_media_domains)))

    # -- a core's end ----------------------------------------------------------------------------
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
        slot.state, slot.reason = FAILED, "its engine core died"
        drop = asyncio.get_running_loop().create_task(self._drop_engine(slot))
        self._drops.add(drop)
        drop.add_done_callback(self._drops.discard)

    async def _drop_engine(self, slot: ModelSlot) -> None:
        """Forget the model's engine and end its processes (its pages and weights go with them)."""
        engine, slot.engine, slot.model = slot.engine, None, None
        if engine is not None:
            await engine.shutdown()
        slot.release_budget()  # once its cores are gone: none of them changes its entry again
        self._changed.set()

    async def _unload(self, slot: ModelSlot) -> None:
        logger.info("unloading %s (%s)", slot.name, "least recently used" if self.config.models_max else "asked")
        slot.state, slot.reason = UNLOADED, "unloaded"
        await self._drop_engine(slot)

    # -- on demand: load or wake for a request ---------------------------------------------------
    async def ensure_loaded(self, slot: ModelSlot) -> None:
        """Load or wake the model unless it is loaded; a 503 that says why when it cannot be, at once while a
        failed load's backoff runs (the request does not load it again)."""
        if slot.loading is None and slot.state != LOADED:
            if slot.backoff_left() > 0:
                raise self._unavailable(slot)
            slot.loading = asyncio.get_running_loop().create_task(self._bring_up(slot))
        if slot.loading is not None:
            await asyncio.shield(slot.loading)
        if slot.state != LOADED:
            raise self._unavailable(slot)

    def _unavailable(self, slot: ModelSlot) -> ServiceUnavailable:
        """The 503 for a model that is not loaded; after a failed load, its Retry-After is the backoff left."""
        backoff_s = math.ceil(slot.backoff_left())
        retry = f" It is loaded again in {backoff_s} s, or at once by POST /models/load." if backoff_s else ""
        return ServiceUnavailable(f"The model `{slot.name}` is not available: {slot.reason}.{retry}",
                                  code="model_unavailable",
                                  headers={"Retry-After": str(backoff_s or self.config.retry_after_s)})

    async def _bring_up(self, slot: ModelSlot) -> None:
        try:
            if slot.state == SLEEPING and slot.engine is not None:
                await self._wake(slot)
            else:
                if slot.engine is not None:  # a failed model's core, if it still runs
                    await self._drop_engine(slot)
                await self._make_room(slot)
                await self.load(slot)
        except Exception as exc:
            if slot.state == SLEEPING:  # it could not wake now (no room in the budget): it sleeps on
                slot.reason = f"it could not wake: {exc}"
            else:
                slot.state, slot.reason = FAILED, f"{type(exc).__name__}: {exc}"
        finally:
            slot.loading = None
            self._changed.set()

    async def _wake(self, slot: ModelSlot) -> None:
        assert slot.engine is not None
        try:
            await slot.engine.wake_up(await self._grant(slot))  # fresh pages: its floor, then as its demand grows
        except BaseException:
            slot.release_budget()  # it sleeps on, holding nothing
            raise
        slot.state, slot.reason = LOADED, "serving"
        logger.info("%s woke up (%s)", slot.name, describe_pages(slot, self.engine_config.cache.block_size))

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

    async def _grant(self, slot: ModelSlot) -> int | None:
        """The bytes of pages a model loading or waking starts with (PageBudget.grant); None: no shared budget
        (one model, or --num-kv-blocks), its pool is the size its flags give."""
        if self.budget is None:
            return None
        return await self.budget.grant(slot, self.slots, self._wait_for_change)

    # -- by hand: /models/load, /models/unload, /sleep, /wake_up ---------------------------------
    async def load_model(self, slot: ModelSlot) -> None:
        """POST /models/load (and /wake_up): load or wake the model now; a failed load is retried at once (its
        backoff forgotten)."""
        slot.used()
        if slot.loading is None:
            slot.forget_failures()
        await self.ensure_loaded(slot)

    async def unload_model(self, slot: ModelSlot) -> None:
        """POST /models/unload: free a model's core now (a 409 while it serves requests, or when its load failed);
        a model already unloaded stays so."""
        await self._settled_idle(slot, "unloaded")
        if slot.state == FAILED:
            raise self._not_loaded(slot, "unloaded")
        if slot.holds_memory:
            await self._unload(slot)

    async def sleep_model(self, slot: ModelSlot) -> None:
        """/sleep: free the model's KV pages, keep its weights (its prefix cache is lost unless KV tiers keep it)."""
        await self._settled_idle(slot, "put to sleep")
        if slot.state not in (LOADED, SLEEPING):
            raise self._not_loaded(slot, "put to sleep")
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

    async def _settled_idle(self, slot: ModelSlot, what: str) -> None:
        """Once any load of the model has settled: a 409 (ModelBusy) while it serves requests."""
        if slot.loading is not None:
            await asyncio.shield(slot.loading)
        if slot.in_flight:
            raise ModelBusy(f"The model `{slot.name}` is serving {slot.in_flight} request(s): it cannot be {what} "
                            "now. Retry when they are done.", param="model")

    @staticmethod
    def _not_loaded(slot: ModelSlot, what: str) -> ModelNotLoaded:
        """The 409 for a sleep or an unload of a model that is not loaded.

        NOTE: a 409, not a 200 that reports the state: the model is not in the state the call asks for, and a client
        reading only the status would believe it was (a failed model stays failed: an unload does not forget its
        failure, which its next load or POST /models/load retries)."""
        return ModelNotLoaded(f"The model `{slot.name}` is not loaded ({slot.state}: {slot.reason}): it cannot be "
                              f"{what}.", param="model")

    # -- idle models sleep (--sleep-idle-seconds) ------------------------------------------------
    def start_idle_sleeper(self) -> None:
        """With several models and --sleep-idle-seconds, look for idle models to put to sleep from now on."""
        if self.several and self.config.sleep_idle_s > 0:
            self._sleeper = asyncio.get_running_loop().create_task(self._sleep_idle_models())

    async def _sleep_idle_models(self) -> None:
        """A loaded model with no request for --sleep-idle-seconds sleeps."""
        while True:
            await asyncio.sleep(min(IDLE_CHECK_S, self.config.sleep_idle_s))
            now = time.monotonic()
            for slot in self.slots:
                if slot.state == LOADED and slot.idle and now - slot.last_used >= self.config.sleep_idle_s:
                    try:
                        await self.sleep_model(slot)
                    except Exception:
                        logger.exception("putting %s to sleep failed", slot.name)

    async def settle(self) -> None:
        """The server stops: no model sleeps any more, and the loads under way finish (a starting core owns a
        process and pages). The ledger has no name to remove: it goes with the last process that holds it."""
        if self._sleeper is not None:
            self._sleeper.cancel()
        loading = [slot.loading for slot in self.slots if slot.loading is not None]
        await asyncio.gather(*loading, return_exceptions=True)


def describe_pages(slot: ModelSlot, block_size: int) -> str:
    """The model's KV pages for a log line: how many, of how many tokens, in use."""
    engine = slot.engine
    stats = engine.stats() if engine is not None else None
    if engine is None or stats is None:
        return "KV pages unknown"
    return (f"{stats.num_blocks} pages x {block_size} tokens = {stats.num_blocks * block_size} tokens of KV "
            f"({engine.kv_pages}), {stats.used_blocks} in use")


async def _warm_up_generation(engine: EngineClient, prompt: list[int]) -> None:
    """A prompt's step and, unless every step runs one path, a decode step (WARM_UP_TOKENS)."""
    started, tokens = time.perf_counter(), 1 if engine.one_path else WARM_UP_TOKENS
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate(prompt, params, f"warm-up-{time.time_ns()}"):
        pass
    logger.info("warm-up: a %d-token generation took %.0f ms", tokens, (time.perf_counter() - started) * 1000)


async def _warm_up_embedding(slot: ModelSlot, engine: EngineClient, prompt: list[int]) -> None:
    started = time.perf_counter()
    slot.embedding_size = len(await engine.embed(prompt, f"warm-up-embed-{time.time_ns()}")) // 4
    logger.info("warm-up: a %d-dimensional embedding took %.0f ms", slot.embedding_size,
                (time.perf_counter() - started) * 1000)


def _render_once(model: ModelContext | None) -> None:
    """A chat through the served template (compiled and parsed once, then cached); a template that cannot render
    fails the requests that use it, with its own error, not the load."""
    tokenizer = model.tokenizer if model is not None else None
    if tokenizer is None or not tokenizer.chat_template:
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
        tokenizer.chat_template_variables  # noqa: B018 - parsed and cached
    except Exception:  # noqa: BLE001 - see above
        logger.debug("warm-up: the chat template did not render", exc_info=True)
