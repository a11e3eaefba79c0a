"""`--data-parallel-size N`: N engine cores behind one gateway, each its own process, page pool and share of
the CPU cores. A request goes to the core with the longest prefix hit, then the fewest pages in use."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pagegate.config import EngineConfig
from pagegate.engine.errors import EngineStalledError
from pagegate.engine.memory.page_ledger import ElasticSpec
from pagegate.engine.observe.metrics import HEALTH_GRADES
from pagegate.engine.observe.stats import EngineHealth, EngineStats
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.pin import Pin
from pagegate.engine.pool_snapshot import PoolSnapshot
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.structured import StructuredOutputsParams
from pagegate.engine.serving.core_client import CoreClient
from pagegate.engine.serving.frames import CPUS_ENV
from pagegate.engine.tenants import ONLINE, KeyShare, Lane

if TYPE_CHECKING:
    import numpy as np


class PrefixIndex:
    """Per core, the chained hashes of the full prompt blocks sent there, least recently sent first, at most as
    many as the core has pages: a cheap guess at what each core's prefix cache holds.

    NOTE: a guess made in the gateway, with no round trip: a core may have evicted a block since, and then the
    request only loses its hit, never correctness."""

    def __init__(self, num_cores: int, block_size: int, capacity: int) -> None:
        self.block_size, self.capacity = block_size, capacity
        self.blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_cores)]

    def chain(self, token_ids: Sequence[int], root: tuple[str | None, ...]) -> list[int]:
        """`root`: what keeps chains apart in the cores (the salt, the tenant); a routing guess, so Python's hash."""
        size, parent, chain = self.block_size, hash(root), []
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash((parent, tuple(token_ids[start:start + size])))
            chain.append(parent)
        return chain

    def hits(self, core: int, chain: list[int]) -> int:
        blocks, hit = self.blocks[core], 0
        while hit < len(chain) and chain[hit] in blocks:
            hit += 1
        return hit

    def record(self, core: int, chain: list[int]) -> None:
        blocks = self.blocks[core]
        for block in chain:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


class Replicas:
    """EngineClient over several CoreClients."""

    def __init__(self, cores: list[CoreClient], block_size: int) -> None:
        self.cores = cores
        first = cores[0]
        self.model_name, self.tokenizer, self.max_model_len = first.model_name, first.tokenizer, first.max_model_len
        self.processing = first.processing
        self.vocab_size, self.default_sampling, self.kv_pages = first.vocab_size, first.default_sampling, first.kv_pages
        self.one_path = all(core.one_path for core in cores)
        self.on_dead: Callable[[], None] | None = None
        for core in cores:
            core.on_dead = self._core_died
        self.prefixes = PrefixIndex(len(cores), block_size, first.stats().num_blocks)
        self._unstarted_pages = [0] * len(cores)  # prompt pages routed whose prefill has not shown in the counts
        self._owner: dict[str, CoreClient] = {}

    @classmethod
    async def start(cls, config: EngineConfig, size: int, step_timeout_s: float = 0.0,
                    elastic: ElasticSpec | None = None) -> Replicas:
        cpus = sorted(os.sched_getaffinity(0))
        share = max(1, len(cpus) // size)
        cores = []
        for index in range(size):
            mine = cpus[index * share:(index + 1) * share] or cpus[-share:]
            env = {**os.environ, "OMP_NUM_THREADS": str(len(mine)), CPUS_ENV: ",".join(map(str, mine))}
            cores.append(CoreClient(core_config(config, index), index, env, step_timeout_s=step_timeout_s,
                                    elastic=elastic))
        results = await asyncio.gather(*(core.start() for core in cores), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(core.shutdown() for core in cores), return_exceptions=True)
            raise errors[0]
        return cls(cores, config.cache.block_size)

    def _core_died(self) -> None:
        if self.on_dead is not None:
            self.on_dead()

    # ---- routing -----------------------------------------------------------------------------------

    def route(self, token_ids: list[int], root: tuple[str | None, ...]) -> int:
        """The core with the longest prefix hit, then the fewest pages in use (counting prefills on their way),
        among those that step (a core taken for hung is passed over)."""
        chain = self.prefixes.chain(token_ids, root)
        index = max(self._accepting_cores(),
                    key=lambda i: (self.prefixes.hits(i, chain), -self._pages_in_use(i), -i))
        self.prefixes.record(index, chain)
        return index

    def _accepting_cores(self) -> list[int]:
        """The cores that take new work; EngineStalledError (a 503) when none does."""
        accepting = [i for i, core in enumerate(self.cores) if core.accepting]
        if not accepting:
            raise EngineStalledError(f"no engine core is stepping: {self.stalled()}")
        return accepting

    def _pages_in_use(self, index: int) -> int:
        return self.cores[index].stats().used_blocks + self._unstarted_pages[index]

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       pins: tuple[Pin, ...] = (), lora_name: str | None = None,
                       tenant: str | None = None, lane: Lane = ONLINE, key: KeyShare | None = None,
                       images: Sequence[tuple[bytes, np.ndarray]] = ()) -> AsyncGenerator[RequestOutput, None]:
        token_ids = self.cores[0].token_ids(prompt)
        index = self.route(token_ids, (cache_salt, tenant))
        core = self.cores[index]
        pages = -(-len(token_ids) // self.prefixes.block_size)
        self._unstarted_pages[index] += pages
        self._owner[request_id] = core
        try:
            async with aclosing(core.generate(prompt, params, request_id, priority=priority, cache_salt=cache_salt,
                                              pins=pins, token_ids=token_ids, lora_name=lora_name,
                                              tenant=tenant, lane=lane, key=key, images=images)) as outputs:  # leaving early aborts at once, not at GC
                async for output in outputs:
                    if pages:
                        self._unstarted_pages[index] -= pages
                        pages = 0
                    yield output
        finally:
            self._unstarted_pages[index] -= pages
            self._owner.pop(request_id, None)

    async def embed(self, token_ids: list[int], request_id: str, *, priority: int = 0,
                    lora_name: str | None = None, lane: Lane = ONLINE, key: KeyShare | None = None) -> bytes:
        """On the core with the fewest pages in use (embedding requests take no prefix hits)."""
        index = min(self._accepting_cores(), key=lambda i: (self._pages_in_use(i), i))
        self._owner[request_id] = core = self.cores[index]
        try:
            return await core.embed(token_ids, request_id, priority=priority, lora_name=lora_name, lane=lane, key=key)
        finally:
            self._owner.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        core = self._owner.get(request_id)
        if core is not None:
            core.abort(request_id)

    def unpin(self, key: str) -> None:
        for core in self.cores:  # the core that holds it is wherever its request was routed
            core.unpin(key)

    def compile_grammar(self, structured: StructuredOutputsParams) -> None:
        self.cores[0].compile_grammar(structured)

    # ---- counts ------------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return all(core.is_running for core in self.cores)

    @property
    def accepting(self) -> bool:
        return any(core.accepting for core in self.cores)

    def stalled(self) -> str | None:
        reasons = [reason for core in self.cores if (reason := core.stalled()) is not None]
        return "; ".join(reasons) if reasons else None

    def queue_load(self) -> tuple[int, int]:
        loads = [core.queue_load() for core in self.cores]
        return sum(w for w, _ in loads), sum(f for _, f in loads)

    def stats(self) -> EngineStats:
        return sum_stats([core.stats() for core in self.cores])

    def health(self) -> EngineHealth:
        """The worst core's health, with the counts of all."""
        healths = [core.health() for core in self.cores]
        worst = max(healths, key=lambda h: HEALTH_GRADES.index(h.grade) if h.grade in HEALTH_GRADES else 0)
        stats = self.stats()
        return msgspec.structs.replace(worst, kv_cache_usage=stats.kv_cache_usage, waiting=stats.waiting,
                                       running=stats.running, swapped=stats.swapped,
                                       swaps_in_window=sum(h.swaps_in_window for h in healths),
                                       engine_running=self.is_running)

    async def pool_snapshot(self) -> PoolSnapshot:
        """The first core's pool (page ids are per pool, so pools are not merged)."""
        return await self.cores[0].pool_snapshot()

    async def metrics_text(self) -> bytes:
        texts = await asyncio.gather(*(core.metrics_text() for core in self.cores))
        return merge_metrics(texts)

    async def sleep(self) -> None:
        await asyncio.gather(*(core.sleep() for core in self.cores))

    async def wake_up(self, kv_bytes: int | None = None) -> int:
        """`kv_bytes` is the replicas' together: each core gets its part."""
        each = kv_bytes // len(self.cores) if kv_bytes is not None else None
        return sum(await asyncio.gather(*(core.wake_up(each) for core in self.cores)))

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Every core registers it (a request for it may go to any); a failure undoes it where it succeeded."""
        results = await asyncio.gather(*(core.load_lora_adapter(name, path) for core in self.cores),
                                       return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            loaded = [core for core, r in zip(self.cores, results, strict=True) if not isinstance(r, BaseException)]
            await asyncio.gather(*(core.unload_lora_adapter(name) for core in loaded), return_exceptions=True)
            raise failures[0]

    async def unload_lora_adapter(self, name: str) -> None:
        await asyncio.gather(*(core.unload_lora_adapter(name) for core in self.cores))

    async def resize(self, kv_bytes: int) -> int:
        """`kv_bytes` is the replicas' together: each core gets its part."""
        return sum(await asyncio.gather(*(core.resize(kv_bytes // len(self.cores)) for core in self.cores)))

    async def shutdown(self) -> None:
        await asyncio.gather(*(core.shutdown() for core in self.cores))



async def start_cores(config: EngineConfig, data_parallel_size: int = 1, step_timeout_s: float = 0.0,
                      elastic: ElasticSpec | None = None) -> CoreClient | Replicas:
    """The engine-core process(es), started and loaded: one CoreClient, or Replicas over `data_parallel_size`
    cores (each its own process, page pool and share of the CPUs); ModelLoadError when the model cannot load.
    `step_timeout_s` > 0: a core with work that finishes no step in that long is taken for hung. `elastic`: each
    core's elastic pool (several models sharing one page budget)."""
    if data_parallel_size == 1:
        core = CoreClient(config, step_timeout_s=step_timeout_s, elastic=elastic)
        await core.start()
        return core
    return await Replicas.start(config, data_parallel_size, step_timeout_s, elastic)

def core_config(config: EngineConfig, index: int) -> EngineConfig:
    """Core `index`'s config: its own KV-event endpoints (tcp ports + index, ipc paths suffixed)."""
    events = config.kv_events
    if index == 0 or events is None or not events.enable_kv_cache_events:
        return config
    replay = _nth_endpoint(events.replay_endpoint, index) if events.replay_endpoint else None
    return replace(config, kv_events=replace(events, endpoint=_nth_endpoint(events.endpoint, index),
                                             replay_endpoint=replay))


def _nth_endpoint(endpoint: str, index: int) -> str:
    port = re.search(r":(\d+)$", endpoint)
    if endpoint.startswith("tcp://") and port:
        return f"{endpoint[:port.start()]}:{int(port.group(1)) + index}"
    return f"{endpoint}-{index}"


def sum_stats(all_stats: list[EngineStats]) -> EngineStats:
    totals: dict[str, Any] = {name: sum(getattr(s, name) for s in all_stats) for name in EngineStats.__struct_fields__
                    if name != "spec_accepted_per_position"}
    per_position = [tuple(s.spec_accepted_per_position) for s in all_stats]
    totals["spec_accepted_per_position"] = tuple(map(sum, itertools.zip_longest(*per_position, fillvalue=0)))
    totals["kv_cache_usage"] = totals["used_blocks"] / totals["num_blocks"] if totals["num_blocks"] else 0.0
    return EngineStats(**totals)


def merge_metrics(texts: Sequence[bytes], label: str = "engine", values: Sequence[str] | None = None) -> bytes:
    """The cores' expositions as one, each sample labelled `engine="<index>"` (vLLM's label for the same), or
    `label` with the text's value in `values` (several models: `model_name`, kept where a sample has it)."""
    merged: dict[str, Metric] = {}
    for index, text in enumerate(texts):
        value = values[index] if values is not None else str(index)
        for family in text_string_to_metric_families(text.decode()):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                         family.unit))
            into.samples.extend(s if label in s.labels else s._replace(labels={**s.labels, label: value})
                                for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(merged.values())))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics
