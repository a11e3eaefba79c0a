"""Several models behind one server: each served model is a slot with its own engine core (or data-parallel cores),
loaded on demand, unloaded least recently used first under --models-max, put to sleep when idle, and marked failed
alone when its core dies. This module holds what a slot is and how the models and their page budgets are found;
ModelLifecycle (model_lifecycle.py) drives them.

NOTE: one page budget, moved by demand while requests run. --kv-cache-memory (on CPU its default) is the whole
server's, kept in a ledger in shared memory (pagegate.engine.memory.page_ledger) with an entry per model, and the
models' entries never sum past it. Each core's pool is elastic (pagegate.engine.memory.elastic_pages): allocated
for the whole budget on CPU (memory is committed only as pages are used), with a limit of usable pages that grows
from the ledger when its requests lack pages and shrinks back to its floor, giving the rest back, once it has been
idle a couple of seconds. A model that loads or wakes takes its floor; when less is free, idle models are shrunk to
their floors first, in place (a busy one never is: the load waits). The floor is a quarter of an equal share,
`budget / (4 * capacity)` (capacity: --models-max, else the number of models; its core raises it to one sequence of
max_model_len), so an idle model keeps some pages and its hottest prefixes to answer at once, and a busy one can take
the rest: growing in place costs a lock, not a reallocation, so a small floor costs a model little when its traffic
comes back. A sleeping or unloaded model holds nothing.
NOTE (an earlier design): pools were fixed while their cores ran and resized (freed and allocated again, the prefix
cache lost) only between requests, so a model whose burst began on a small pool stayed small through it; and the
running cap tuned on one pool outlived the pool. Elastic pools move the budget within a burst, and a pool that
grows lifts its cap (Scheduler.set_limit).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from pagegate.config import EngineConfig, parse_bytes
from pagegate.engine.memory.page_ledger import ElasticSpec, PageLedger
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.gateway.prepare import ModelContext
from pagegate.gateway.settings import GatewayConfig, ServedModel

logger = logging.getLogger("pagegate.gateway")

LOADED, LOADING, SLEEPING, UNLOADED, FAILED = "loaded", "loading", "sleeping", "unloaded", "failed"
ROOM_TIMEOUT_S = 60.0  # how long a model to load waits for room: an idle model under --models-max, or pages
# NOTE: a model whose load failed is not loaded again by every request (a broken file would cost each one a core's
# start): requests within the backoff get a 503 at once, and the backoff doubles with each failure in a row, up to a
# minute, so a file that is fixed is picked up soon. A load that succeeds, or POST /models/load, forgets it.
LOAD_BACKOFF_S = 1.0
LOAD_BACKOFF_MAX_S = 60.0


class ModelSlot:
    """One served model: its names, its engine config, its state and, while loaded or sleeping, its engine."""

    def __init__(self, names: tuple[str, ...], engine_config: EngineConfig) -> None:
        self.names = names  # empty for a lone model named by its engine (the served name is learnt at load)
        self.engine_config = engine_config
        self.state = UNLOADED
        self.reason = "not loaded yet"
        self.engine: EngineClient | None = None
        self.model: ModelContext | None = None
        self.embedding_size: int | None = None  # the model's embedding size, from the warm-up (if it embeds)
        self.in_flight = 0  # API requests addressed to it being served: it is never unloaded while any are
        self.last_used = 0.0  # time.monotonic() of its last request: the least recently used is unloaded first
        self.loading: asyncio.Task[None] | None = None  # its load or wake, while one runs
        self.loads = 0  # how many times its core was started
        self.ledger: PageLedger | None = None  # the server's page budget, where one is shared (its entry: `entry`)
        self.entry = 0
        self.resizing = False  # its core is resizing its pool (resize_pool)
        self.load_failures = 0  # failed loads in a row (each doubles the backoff)
        self.retry_at = 0.0  # time.monotonic() before which a request does not load it again after a failed load

    @property
    def name(self) -> str:
        if self.names:
            return self.names[0]
        return self.engine.model_name if self.engine is not None else "?"

    @property
    def kv_bytes(self) -> int:
        """Its share of the server's page budget now, as its cores move it (0 while it holds no pages)."""
        return self.ledger.held(self.entry) if self.ledger is not None else 0

    def release_budget(self) -> None:
        """Its cores are gone or asleep: whatever its entry still holds goes back."""
        if self.ledger is not None:
            self.ledger.clear(self.entry)

    @property
    def holds_memory(self) -> bool:
        """Loaded or sleeping: its weights are in memory (it counts against --models-max)."""
        return self.engine is not None

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.loading is None

    def used(self) -> None:
        self.last_used = time.monotonic()

    def load_failed(self, reason: str) -> None:
        """Its load failed: FAILED with the reason, and no load again for a backoff doubled from the last."""
        self.state, self.reason = FAILED, reason
        self.load_failures += 1
        backoff_s = LOAD_BACKOFF_S * 2 ** min(self.load_failures - 1, 16)
        self.retry_at = time.monotonic() + min(backoff_s, LOAD_BACKOFF_MAX_S)

    def forget_failures(self) -> None:
        self.load_failures, self.retry_at = 0, 0.0

    def backoff_left(self) -> float:
        """Seconds until a request may load it again after a failed load (0: now, or it has not failed)."""
        if self.state != FAILED:
            return 0.0
        return max(self.retry_at - time.monotonic(), 0.0)

    def card_state(self) -> dict[str, str | None]:
        """Its /v1/models fields: the state, and why it failed (None unless it did)."""
        return {"state": self.state, "reason": self.reason if self.state == FAILED else None}


def served_slots(engine_config: EngineConfig, config: GatewayConfig) -> list[ModelSlot]:
    """One slot per served model; a one-model server's single slot is named as --served-model-name says (or,
    once loaded, by its engine)."""
    if not config.models:
        return [ModelSlot(tuple(config.served_model_names), engine_config)]
    return [ModelSlot((served.name,), replace(engine_config, model=served.path, served_model_name=served.name))
            for served in config.models]


def discover_models(folder: str) -> list[ServedModel]:
    """--models-dir: every GGUF file and every folder with a config.json in it, named by its file or folder name
    (a GGUF's without its extension), in name order."""
    root = Path(folder)
    if not root.is_dir():
        raise SystemExit(f"--models-dir: {folder} is not a folder")
    found = [ServedModel(entry.stem, str(entry)) for entry in root.iterdir()
             if entry.is_file() and entry.suffix.lower() == ".gguf"]
    found += [ServedModel(entry.name, str(entry)) for entry in root.iterdir()
              if entry.is_dir() and (entry / "config.json").is_file()]
    if not found:
        raise SystemExit(f"--models-dir: {folder} holds no *.gguf file and no folder with a config.json")
    return sorted(found, key=lambda model: model.name)


# Waits until a model becomes idle or finishes loading (deadline, who is waited for); a RuntimeError past the deadline
WaitForChange = Callable[[float, str], Awaitable[None]]


class PageBudget:
    """The server's KV bytes, each model's floor, and the ledger the models' cores move their shares in."""

    def __init__(self, total: int, capacity: int, slots: list[ModelSlot]) -> None:
        self.total = total
        self.floor = total // (4 * max(capacity, 1))
        self.ledger = PageLedger.create(total, len(slots))
        for entry, slot in enumerate(slots):
            slot.ledger, slot.entry = self.ledger, entry

    def free(self) -> int:
        return self.ledger.free()

    def spare(self, slot: ModelSlot) -> int:
        """What a model holds beyond its floor."""
        return max(slot.kv_bytes - self.floor, 0)

    def elastic(self, slot: ModelSlot, start_bytes: int, cores: int) -> ElasticSpec:
        """What each of a model's `cores` is told of its elastic pool, `start_bytes` reserved for them together."""
        return ElasticSpec(self.ledger.fileno(), slot.entry, self.floor // cores, start_bytes // cores, self.total // cores)

    async def grant(self, slot: ModelSlot, slots: list[ModelSlot], wait_for_change: WaitForChange) -> int:
        """The bytes of pages a model loading or waking starts with, reserved for it in the ledger: its floor, idle
        models shrunk to their floors first while less is free (`wait_for_change` while they serve, up to a
        deadline); its cores grow it from there by demand."""
        slot.release_budget()
        deadline, tried = time.monotonic() + ROOM_TIMEOUT_S, set()
        while not (granted := self.ledger.take(slot.entry, self.floor, self.floor)):
            donors = [s for s in self._donors(slot, slots) if s.name not in tried]
            if donors:
                donor = max(donors, key=lambda s: s.kv_bytes)
                tried.add(donor.name)
                await resize_pool(donor, self.floor)
                continue
            await wait_for_change(deadline, "the page budget: every model holding pages")
        return granted

    def _donors(self, slot: ModelSlot, slots: list[ModelSlot]) -> list[ModelSlot]:
        """The other loaded, idle models that hold pages beyond their floors."""
        return [s for s in slots if s is not slot and s.state == LOADED and s.idle and s.engine is not None
                and not s.resizing and self.spare(s)]


async def resize_pool(slot: ModelSlot, kv_bytes: int) -> None:
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


def page_budget(engine_config: EngineConfig, capacity: int, slots: list[ModelSlot]) -> PageBudget | None:
    """The server's page budget, shared by the models; None where each model's pages are given as a count
    (--num-kv-blocks: each model gets that many)."""
    cache = engine_config.cache
    if cache.num_kv_blocks is not None:
        return None
    return PageBudget(parse_bytes(cache.kv_cache_memory or cache.default_cpu_kv_cache_memory), capacity, slots)


def with_kv_bytes(engine_config: EngineConfig, kv_bytes: int | None) -> EngineConfig:
    """The model's EngineConfig with its share of the budget as its --kv-cache-memory (None: as it is)."""
    if kv_bytes is None:
        return engine_config
    return replace(engine_config, cache=replace(engine_config.cache, kv_cache_memory=str(kv_bytes)))
