"""An engine core's elastic pool: pages allocated for the server's whole budget, a limit of them usable, moved by
demand through the ledger the cores of a several-model server share (page_ledger.py).

NOTE: grown by demand, given back when idle. After a step whose admission or running sequences lacked pages, the
core takes more from the ledger, in chunks of at least a sixteenth of its capacity (one page at a time would pay a
lock and a preemption per page), as much as is free; a core with no request for REBALANCE_IDLE_S shrinks to its
floor and gives the rest back, so a model whose traffic moved on leaves its pages to the busy one within seconds,
while its prefix cache below the floor stays. Shrinking never takes a page in use (pins and LoRA pages above the
floor keep the limit above them) and gives the tail's memory back to the OS, so the budget is the memory used.

NOTE: shared fairly when contested. While another model was refused pages in the last CONTEST_S, a pool neither
grows past its fair share (an equal part of the budget among the models that want pages) nor keeps free pages above
it: after each step it gives back those above its highest page in use, so the rest follow as its sequences free
them (a long sequence holding a high page holds the pages below it until it ends: pages are not moved). Uncontested,
a busy model may hold everything the others do not.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Protocol

from pagegate.config import EngineConfig
from pagegate.engine.kv_sizing import check_fits
from pagegate.engine.loading.loader import resolve_device
from pagegate.engine.memory.page_ledger import ElasticSpec, PageLedger
from pagegate.engine.runner import ModelRunner

log = logging.getLogger("pagegate.engine_core")  # the engine-core process (not the page core, pagegate.core)

REBALANCE_IDLE_S = 2.0  # a core with no request this long shrinks to its floor
GROW_CHUNK = 16  # a pool grows by at least 1/GROW_CHUNK of its capacity at a time
RETRY_S = 0.05  # after the ledger had nothing to give, a pool asks again no sooner than this
CONTEST_S = 1.0  # another model refused pages this recently contests the budget (a pool keeps to its fair share)


def elastic_config(config: EngineConfig, spec: ElasticSpec) -> EngineConfig:
    """The config a core of an elastic pool starts with: pages for the whole budget on CPU (memory is committed as
    they are used, and given back on a shrink); on a GPU, where memory is not, the pages of its start share, within
    which its limit moves."""
    on_cpu = resolve_device(config.device).type == "cpu"
    kv_bytes = spec.capacity_bytes if on_cpu else spec.start_bytes
    return replace(config, cache=replace(config.cache, kv_cache_memory=str(kv_bytes), num_kv_blocks=None))


class LimitedPool(Protocol):
    """What the policy moves: the pages of a pool (pool.KVPool) usable now, and what its scheduler lacked."""

    @property
    def limit(self) -> int: ...
    def move_limit(self, pages: int, refresh: bool = True) -> int: ...
    def take_pages_short(self) -> int: ...


class ElasticPages:
    """The limit of one core's pool and the bytes its model's ledger entry holds for it; the pool carries out the
    moves (`move_limit`), this decides them."""

    def __init__(self, pool: LimitedPool, runner: ModelRunner, spec: ElasticSpec) -> None:
        self.pool, self.spec = pool, spec
        self.ledger = PageLedger.attach(spec.ledger_fd)
        self.capacity = runner.num_blocks
        self.page_bytes = runner.kv_cache.page_bytes
        block_size = runner.config.cache.block_size
        self.floor = max(spec.floor_bytes // self.page_bytes, -(-runner.max_model_len // block_size))
        check_fits(self.capacity, block_size, runner.max_model_len, self.page_bytes)
        self.last_busy = time.monotonic()
        self.refused_at = 0.0  # when the ledger last had nothing to give

    @property
    def limit(self) -> int:
        return self.pool.limit

    def adopt(self, kv_bytes: int) -> int:
        """A fresh pool (at load or wake, built limited to the floor) takes the `kv_bytes` reserved for it: its
        limit, the rest back."""
        self.last_busy = time.monotonic()
        pages = min(kv_bytes // self.page_bytes, self.capacity)
        if pages < self.floor:  # one sequence of max_model_len must fit: the rest of the floor from the ledger
            missing = (self.floor - pages) * self.page_bytes
            if not self.ledger.take(self.spec.entry, missing, missing):
                raise ValueError(f"the shared KV budget has no room for this model's floor of {self.floor} pages "
                                 "(one sequence of max_model_len): give more --kv-cache-memory or a smaller "
                                 "--max-model-len")
            kv_bytes += missing
        reached = self.pool.move_limit(pages if pages >= self.floor else self.floor)
        self.ledger.give(self.spec.entry, kv_bytes - reached * self.page_bytes)
        return reached

    def grow_now(self, pages: int) -> int:
        """The scheduler lacks `pages` now (before it preempts or leaves a request waiting): grow by a chunk at
        least, unless the ledger refused a moment ago; the pages added.

        NOTE: grown inside the step, not after it: a running sequence preempted for want of a page recomputes its
        whole prompt later, which costs more than the lock a grow takes."""
        now = time.monotonic()
        if now - self.refused_at < RETRY_S:
            return 0
        before = self.limit
        added = self.grow(max(pages, self.capacity // GROW_CHUNK), refresh=False) - before
        if not added:
            self.refused_at = now
        return added

    def after_step(self, busy: bool) -> None:
        """Contested, keep to the fair share; grow when the step lacked pages; shrink to the floor once idle a
        while."""
        now = time.monotonic()
        self._yield_to_others()
        if busy:
            self.last_busy = now
            short = self.pool.take_pages_short()
            if short:
                self.grow(max(short, self.capacity // GROW_CHUNK))
        elif now - self.last_busy >= REBALANCE_IDLE_S and self.limit > self.floor:
            self.shrink(self.floor)

    def fair_limit(self) -> int | None:
        """The pages this pool may hold while other models want pages (None: nobody else does): its part of their
        fair share, never below its floor."""
        share = self.ledger.fair_share(self.spec.entry, CONTEST_S)
        if share is None:
            return None
        return max(share * self.spec.capacity_bytes // self.ledger.total // self.page_bytes, self.floor)

    def _yield_to_others(self) -> None:
        """Contested: what it holds above its fair share back, down to its highest page in use (the pages above
        that now, the rest as its sequences free them)."""
        fair = self.fair_limit()
        if fair is not None and self.limit > fair:
            self.shrink(fair)

    def grow(self, pages: int, refresh: bool = True) -> int:
        """Up to `pages` more from the ledger (what is free, within the capacity and, contested, its fair share);
        the limit. `refresh`: the engine's stats too (not from inside a step: the step refreshes them)."""
        wanted = min(pages, self.capacity - self.limit)
        fair = self.fair_limit()
        if fair is not None and wanted > fair - self.limit:
            wanted = fair - self.limit
            self.ledger.want(self.spec.entry)  # held to its share, it wants more: the others keep to theirs too
        if wanted <= 0:
            return self.limit
        taken = self.ledger.take(self.spec.entry, wanted * self.page_bytes, self.page_bytes)
        granted = taken // self.page_bytes
        self.ledger.give(self.spec.entry, taken - granted * self.page_bytes)  # a part of a page: back
        if granted:
            log.info("KV pool grows to %d pages (+%d from the shared budget)",
                     self.pool.move_limit(self.limit + granted, refresh), granted)
        return self.limit

    def shrink(self, pages: int) -> int:
        """Down to `pages` (not below the floor, nor below a page in use), the rest back to the ledger; the limit."""
        old = self.limit
        reached = self.pool.move_limit(max(pages, self.floor))
        if reached < old:
            self.ledger.give(self.spec.entry, (old - reached) * self.page_bytes)
            log.info("KV pool shrinks to %d pages (%d back to the shared budget)", reached, old - reached)
        return reached

    def resize(self, kv_bytes: int) -> int:
        """The gateway's resize of an idle core, in place (its prefix cache below the new limit kept); the limit."""
        pages = kv_bytes // self.page_bytes
        return self.grow(pages - self.limit) if pages > self.limit else self.shrink(pages)

    def slept(self) -> None:
        """Its pages are freed: everything it held goes back."""
        self.ledger.give(self.spec.entry, self.limit * self.page_bytes)

    def give_back(self, kv_bytes: int) -> int:
        """Bytes reserved for a wake it did not need (it was awake) back to the ledger; the limit."""
        self.ledger.give(self.spec.entry, kv_bytes)
        return self.limit
