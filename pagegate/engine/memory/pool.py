"""The engine's KV pool: the runner's pages and the scheduler that hands them out, built here and only here; the
pool's lifecycle (sleep, wake, resize), an elastic pool's limit (elastic_pages.py carries the policy, this the
moves) and the LoRA adapters whose weights take pages of the same pool.

NOTE: a wake builds a fresh scheduler over fresh pages rather than emptying the old one: the pool may come back
another size (a resize), and every per-page array below the scheduler is sized from it. The monitor is rebound to
the fresh pool and its counters go on from where they were.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from pagegate.config import EngineConfig
from pagegate.engine.devices import device_kind
from pagegate.engine.kv_sizing import check_fits
from pagegate.engine.lora.request import LoRARequest
from pagegate.engine.memory.page_ledger import ElasticSpec
from pagegate.engine.observe.monitor import EngineMonitor
from pagegate.engine.runners import make_runner
from pagegate.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from pagegate.engine.encoder_runner import EncoderRunner
    from pagegate.engine.lora.adapter import AdapterWeights
    from pagegate.engine.lora.model import LoRAModel, Registered
    from pagegate.engine.native_runner import NativeRunner
    from pagegate.engine.runner import ModelRunner
    from pagegate.engine.sequence import Sequence

# NOTE: what only the torch runner has (an elastic share, KV tiers, LoRA adapters) is imported where it is used, so a
# native core (native_runner.py) never imports torch through here.


class KVPool:
    """A runner's KV pages and the scheduler over them; `asleep` while the pages are freed (the weights stay)."""

    def __init__(self, config: EngineConfig, runner: NativeRunner | ModelRunner | EncoderRunner,
                 elastic: ElasticSpec | None = None) -> None:
        """`elastic`: this pool's share of a budget several models' cores hold (None, or an encoder's pool: fixed)."""
        self.config, self.runner = config, runner
        self.asleep = False
        self.elastic = None
        if elastic is not None and runner.serves.generate:  # the torch runner's (make_runner)
            from pagegate.engine.memory.elastic_pages import ElasticPages
            self.elastic = ElasticPages(self, cast("ModelRunner", runner), elastic)
        self.scheduler = self._new_scheduler()
        self.monitor = EngineMonitor(runner.model_name, config, self.scheduler.pool, runner.tiers, runner.lora)
        self.monitor.metrics.kv_page_format(runner.kv_format, runner.kv_bytes_per_token)
        if self.elastic is not None:
            self.elastic.adopt(self.elastic.spec.start_bytes)

    @classmethod
    def build(cls, config: EngineConfig, elastic: ElasticSpec | None = None,
              on_worker_death: Callable[[str], None] | None = None) -> KVPool:
        """The runner `config` asks for (for an elastic pool: with pages for the whole budget, elastic_config) and
        its pool; the runner is closed again when the rest fails. `on_worker_death(message)`: a tensor-parallel
        worker died."""
        if elastic is not None:
            from pagegate.engine.memory.elastic_pages import elastic_config
            config = elastic_config(config, elastic)
        config = replace(config, scheduler=config.scheduler.on_device(device_kind(config.device),
                                                                       generates=config.task != "embed"))
        runner = make_runner(config, elastic=elastic is not None)
        try:
            pool = cls(config, runner, elastic)
        except BaseException:
            runner.close(graceful=False)
            raise
        if runner.workers is not None:  # watched once loaded: a worker that dies while loading fails the load
            runner.workers.on_death = on_worker_death
        return pool

    def _new_scheduler(self) -> Scheduler:
        """The one place a scheduler is built: over all the runner's pages, an elastic pool's limited to its floor
        (adapters are read into a fresh pool's pages on demand)."""
        config, runner, elastic = self.config, self.runner, self.elastic
        scheduler = Scheduler(config.scheduler, config.cache, runner.num_blocks, runner.num_cpu_blocks,
                              runner.max_model_len, config.speculative, runner.draft, runner.tiers, runner.lora,
                              elastic.floor if elastic else None, elastic.grow_now if elastic else None)
        scheduler.generates = runner.serves.generate  # an encoder's embeddings run in whole steps
        scheduler.cuts_at_hits = not runner.chunk_invariant
        scheduler.whole_images = runner.vision is not None and runner.vision.bidirectional
        runner.bind(scheduler.tables)
        return scheduler

    def close(self) -> None:
        """End the tensor-parallel workers and the KV-event publisher."""
        self.runner.close(pool=self.scheduler.pool)
        self.monitor.close()

    def refresh_stats(self, now: float | None = None, computed: list[Sequence] | None = None) -> None:
        """Recompute the gauges and the health grade from the scheduler's counts (`computed`: a step's batch)."""
        scheduler = self.scheduler
        self.monitor.refresh(scheduler.stats(), now, computed or [], scheduler.pages_by_key(), scheduler.pinned_by_key())

    # ---- sleep, wake, resize -----------------------------------------------------------------------------

    def sleep(self, busy: bool) -> None:
        """Free the KV pages, keep the weights (vLLM's sleep level 1: on CPU the weights already live in host
        memory, so nothing is offloaded); a RuntimeError while requests run (`busy`).

        NOTE: the pages' contents go with them, unless the KV tiers are on: then every cached page goes down them
        first and a woken pool finds its prefixes (and pinned conversations) there; without tiers it starts cold."""
        if self.asleep:
            return
        if busy:
            raise RuntimeError("the engine has requests running: it cannot sleep")
        events = self.config.kv_events
        runner = self._paged_runner("this engine cannot sleep (an encoder, or KV-cache events are published)",
                                    events is not None and events.enable_kv_cache_events)
        runner.free_kv_cache(self.scheduler.pool)
        if self.elastic is not None:
            self.elastic.slept()
        gc.collect()
        self.asleep = True

    def wake_up(self, kv_bytes: int | None = None) -> int:
        """Fresh KV pages (as many as before, or `kv_bytes` of them) and a fresh scheduler over them; the number of
        pages usable. Awake already, an elastic pool gives back the `kv_bytes` reserved for this wake."""
        if not self.asleep:
            return self.elastic.give_back(kv_bytes or 0) if self.elastic is not None else self.runner.num_blocks
        runner = self._paged_runner("an encoder keeps no KV pages to wake")
        if kv_bytes is not None and self.elastic is None:  # an elastic pool keeps its capacity and adopts kv_bytes
            runner.num_blocks = self.pages_for(kv_bytes)
            self.monitor.metrics.cache_config(self.config.cache.block_size, runner.num_blocks)
        runner.allocate_kv_cache()
        self.scheduler = self._new_scheduler()
        self.monitor.rebind(self.scheduler.pool)
        self.monitor.metrics.rebase(self.scheduler.stats())
        self.refresh_stats()
        self.asleep = False
        if self.elastic is not None:
            return self.elastic.adopt(kv_bytes if kv_bytes is not None else self.elastic.spec.floor_bytes)
        return runner.num_blocks

    def resize(self, kv_bytes: int, busy: bool) -> int:
        """An idle pool to `kv_bytes` of pages, in one call (nothing can come between its sleep and its wake); the
        number of pages. Its prefix cache is lost, as in a sleep; an elastic pool moves its limit in place instead
        (its cached pages below the limit kept)."""
        if self.elastic is not None:
            return self.elastic.resize(kv_bytes)
        self.pages_for(kv_bytes)  # a size that cannot hold one sequence is refused before anything is freed
        self.sleep(busy)
        return self.wake_up(kv_bytes)

    def pages_for(self, kv_bytes: int) -> int:
        """The pages `kv_bytes` hold; ValueError when they cannot hold one sequence of max_model_len."""
        runner, cache = self._paged_runner("an encoder keeps no KV pages"), self.config.cache
        page = runner.block_bytes
        check_fits(kv_bytes // page, cache.block_size, runner.max_model_len, page)
        return kv_bytes // page

    def _paged_runner(self, refusal: str, refused: bool = False) -> NativeRunner | ModelRunner:
        """The runner, when it keeps KV pages (an encoder keeps none) and nothing else refuses; else ValueError."""
        runner = self.runner
        if refused or not runner.serves.generate:
            raise ValueError(refusal)
        return cast("NativeRunner | ModelRunner", runner)

    # ---- an elastic pool's limit ---------------------------------------------------------------------------

    @property
    def limit(self) -> int:
        """The pages usable now (all of them, but in an elastic pool)."""
        return int(self.scheduler.pool.num_blocks)

    def move_limit(self, pages: int, refresh: bool = True) -> int:
        """The usable pages to `pages` (elastic_pages decides); a shrink writes the pages it evicts down the tiers
        (if any) and gives the tail's memory back to the OS. The limit reached: a shrink stops above the highest
        page in use. `refresh`: the stats too (not from inside a step: the step refreshes them)."""
        runner, scheduler, old = self._paged_runner("an encoder keeps no KV pages"), self.scheduler, self.limit
        reached = scheduler.set_limit(pages)
        if reached < old:
            if runner.tiers is not None and scheduler.tiers is not None:
                from pagegate.engine.prefix_tiers import spill
                spill(runner.kv_cache, runner.tiers, scheduler.pool.take_evicted())  # before their bytes are dropped
            cast("ModelRunner", runner).kv_cache.release_pages(reached, old)  # only an elastic pool moves it
        if reached != old:
            self.monitor.metrics.cache_config(self.config.cache.block_size, reached)
            if refresh:
                self.refresh_stats()
        return reached

    def take_pages_short(self) -> int:
        """The pages admission and running sequences lacked since the last call (what an elastic pool grows by)."""
        return self.scheduler.take_pages_short()

    def rebalance(self, busy: bool) -> bool:
        """After a step (or an idle wait): an elastic pool grows when the step lacked pages, shrinks when idle a
        while, keeps to its fair share when contested. Whether its limit moved."""
        if self.elastic is None or self.asleep:
            return False
        before = self.limit
        self.elastic.after_step(busy)
        return self.limit != before

    # ---- LoRA adapters -------------------------------------------------------------------------------------

    @property
    def serves_adapters(self) -> bool:
        return self.runner.lora is not None

    def adapter(self, lora: LoRARequest | str | None) -> Registered | None:
        """The adapter a request asks for: a LoRARequest (registered if new) or a registered adapter's name.
        InvalidParamError when it cannot have it (lora.model.resolve_adapter)."""
        if lora is None:  # the base model: most requests
            return None
        from pagegate.engine.lora.model import resolve_adapter
        return resolve_adapter(self.runner.lora, lora)

    def read_adapter(self, name: str, path: str) -> AdapterWeights:
        """An adapter's weights read and checked; touches nothing of the engine's, so it may run off the engine's
        thread (the core process reads on its loader thread). ValueError naming what does not fit."""
        lora = self._lora()
        return lora.read(name, path, lora.config.lora_dir)

    def load_adapter(self, name: str, path: str, weights: AdapterWeights | None = None) -> int:
        """Register an adapter at run time (its weights in host memory, paged in on first use); its id. `weights`:
        read already by `read_adapter`; None: read here. ValueError when its name or id is another's."""
        lora = self._lora()
        if weights is None:
            weights = self.read_adapter(name, path)
        return lora.install(LoRARequest(name, lora.next_id, path), weights).request.lora_int_id

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter and give back its pages: InvalidParamError (model_not_found) for an unknown one,
        ValueError while requests use it (they are never broken: the caller retries once they are done)."""
        self.adapter(name)
        self.scheduler.unload_adapter(name)
        self._lora().unregister(name)
        self.refresh_stats()

    def _lora(self) -> LoRAModel:
        if self.runner.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora, or "
                             "LLM(enable_lora=True))")
        return self.runner.lora
