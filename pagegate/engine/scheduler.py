"""Continuous batching over the page pool: who runs this step, with how many tokens, on which pages.

Each step spends a token budget lane by lane (online, then batch: tenants.py): in a lane, running sequences first
(most urgent first), then swapped ones coming back, then new ones. A sequence computes its uncomputed tokens (a
prefill chunk, or the one token of a decode); the core reserves their slots and caches each page as it fills. When a
running sequence cannot get a page, the least urgent, latest arrived running sequence not yet scheduled this step is
preempted: swapped to the CPU pool or freed to be recomputed. Batch-lane sequences sort after every online one, so
they are preempted first; an online sequence that cannot be admitted or come back preempts them too. Among waiting
sequences of one lane and priority, the API key furthest below its weighted share of pages goes first, and a key's
quota caps the pages its running sequences hold (key_pages.py).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagegate.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagegate.core import BlockPool, BlockTables
from pagegate.engine.autotune import RunningCap
from pagegate.engine.key_pages import KeyPages, key_name, quota_of
from pagegate.engine.key_slices import KeySlices
from pagegate.engine.lora.pages import AdapterPages, AdapterStore
from pagegate.engine.observe.stats import SchedulerStats
from pagegate.engine.observe.timeline import RECOMPUTE, SWAP
from pagegate.engine.pin import Pin
from pagegate.engine.pins import PrefixPins
from pagegate.engine.prefix_tiers import WAIT, Found, PrefixTiers, TierLoad
from pagegate.engine.sequence import NO_PAGES, SeqStatus, Sequence
from pagegate.engine.speculation import Proposer, SpeculationStats, Speculator
from pagegate.engine.tenants import BATCH, LANE_RANK, LANES, ONLINE, Lane

if TYPE_CHECKING:
    from pagegate.core.block_pool import EvictedPages
    from pagegate.engine.kv_tiers import TierStack

log = logging.getLogger(__name__)

_NO_PAIRS = np.zeros((0, 2), dtype=np.int32)
# NOTE: embedding requests (prefill-only, pooled: pooling.py) run in slices, alone too: a step holds at most a slice
# of their tokens, sized so that a step holding one takes about POOLING_SLICE_S (halved or doubled at most per slice,
# within [POOLING_SLICE_MIN, the token budget]), since a generation that arrives waits for the slice in flight. While
# generations wait or run, embeddings take at most POOLING_SHARE of the engine's time: a step holding a slice that took
# t seconds is followed by t * (1 - share) / share seconds of steps without embedding work (a generation may be
# admitted past waiting embeddings), unless nothing else can run. Time, not tokens: a slice and a decode step differ in
# cost by two to three orders of magnitude, model by model and machine by machine. The old rule (an eighth of every
# step's tokens) put a 256-token chunk into each decode step of a short completion, a prefill's cost in every one,
# after a whole 2,048-token step in flight. bench/embed_starvation.py (48 x 2,000
# tokens, then a 16-token completion; medians of 3 on a loaded 2-core CPU): its latency over alone went from 14.2x to
# 0.4x on the embedded model, 53.1x to 1.8x on SmolLM2 Q4_1 (issue 64). A quarter second: the wait a completion of a
# few tenths of a second alone can take; where tokens are cheap a slice is the whole budget and costs nothing.
POOLING_SHARE = 0.5
POOLING_SLICE_S = 0.25
POOLING_SLICE_MIN = 64  # tokens: fewer would pay a step's fixed cost for too little work
POOLING_WINDOW_MAX_S = 5.0  # the longest run of generation-only steps one slice earns
NEAR_SCAN = 64  # waiting sequences looked up in the prefix cache each step for _nearly_cached
DISK_WAIT_S = 0.005  # a step with nothing to run waits this long at most for a prompt's pages from disk


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    swap_out: list[np.ndarray] = field(default_factory=list)  # (device, cpu) page pairs
    swap_in: list[np.ndarray] = field(default_factory=list)  # (cpu, device) page pairs
    copies: np.ndarray = field(default_factory=lambda: _NO_PAIRS)  # copy-on-write (src, dst)
    evicted: EvictedPages | None = None  # cached pages allocation took back this step (KV tiers on)
    tier_loads: list[TierLoad] = field(default_factory=list)  # pages coming back from the tiers
    preempted: int = 0
    # of them, those that made way by rule, not for a pool too small: batch-lane sequences preempted for online ones,
    # and sequences of a key at its quota (they neither shrink the running cap nor hold an online lane back)
    yielded: int = 0
    failed: list[Sequence] = field(default_factory=list)  # alone need more pages than the pool has

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def pairs(self, name: str) -> np.ndarray:
        chunks = getattr(self, name)
        return np.concatenate(chunks) if chunks else _NO_PAIRS

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int, num_cpu_blocks: int,
                 max_model_len: int, speculative: SpeculativeConfig | None = None,
                 proposer: Proposer | None = None, tiers: TierStack | None = None,
                 lora: AdapterStore | None = None, limit: int | None = None,
                 grow_pool: Callable[[int], int] | None = None) -> None:
        self.config = config
        self.speculator = Speculator(speculative, max_model_len, proposer) if speculative is not None else None
        self.block_size = cache.block_size
        self.cache = cache
        self.prefix_caching = cache.enable_prefix_caching
        self.pool = BlockPool(num_blocks, cache.block_size, cache.enable_prefix_caching, limit=limit)
        # NOTE: an elastic pool (limit: pages usable of num_blocks) hands out pages above its first limit lowest
        # first; it is opened to its capacity while the parts below size their per-page arrays from it, then limited.
        self.pool.set_limit(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks, cache.block_size, False) if num_cpu_blocks else None
        self.tables = BlockTables(self.pool, *config.table_shape(max_model_len, cache.block_size), self.cpu_pool)
        self.tiers = PrefixTiers(tiers, self.pool) if tiers is not None and self.prefix_caching else None
        self.adapters = AdapterPages(self.pool, lora) if lora is not None else None  # LoRA weights' pages
        self.watermark_blocks = int(cache.watermark * num_blocks)
        self.batch_headroom_blocks = self._batch_headroom(num_blocks)
        mode = config.preemption_mode or ("swap" if num_cpu_blocks else "recompute")
        if mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {mode!r}")
        self.swap_enabled = mode == "swap" and self.cpu_pool is not None
        self.cap = RunningCap(config.max_num_seqs, config.preemption_window_s)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.pooling: set[Sequence] = set()  # the embedding sequences in the queues above
        self.key_pages = KeyPages()  # pages per API key, current through each step
        self.slices = KeySlices(config.key_slice_tokens)  # short steps for keys over their share (key_slices.py)
        self._now = 0.0  # the step being scheduled's
        self._pooling_left = 0  # tokens embedding sequences may still take in the step being scheduled
        self._slice_began: float | None = None  # `now` of the last step if it held embedding tokens
        self._slice_seqs: list[Sequence] = []  # and the embedding sequences it held
        self._slice = 4 * POOLING_SLICE_MIN  # tokens of the next slice (POOLING_SLICE_S)
        self._generations_until = 0.0  # before this, steps hold no embedding work while generations wait or run
        # False for an engine that serves embeddings alone (an encoder): its embeddings take whole steps, since no
        # generation can come to wait behind a slice
        self.generates = True
        # False when every step runs the same arithmetic for a token whatever else it holds (the native step): then a
        # cold prompt need not stop at its hit's end (_hit_end)
        self.cuts_at_hits = True
        self.whole_images = False  # the model reads an image's tokens bidirectionally: a chunk never ends inside one
        self._near: set[Sequence] = set()  # this step's nearly cached waiting sequences
        self._others_left = 0  # tokens other prompts may still take in a step with nearly cached ones
        self._owed_last = False  # the last step held only prompts of owed keys (_fill_owed)
        self.num_preemptions = self.num_swap_outs = self.num_swapped_out_blocks = self.num_swapped_in_blocks = 0
        self.prefix_queries = self.prefix_hits = 0
        self.pages_short = 0  # pages admission or a running sequence lacked since take_pages_short (elastic pools)
        # an elastic pool's grower: asked for pages before a pin, an adapter or a running sequence is given up
        self.grow_pool = grow_pool
        if not 0.0 <= cache.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be within [0, 1], got {cache.max_pinned_fraction}")
        self.pins = PrefixPins(self.pool, int(cache.max_pinned_fraction * num_blocks))
        if limit is not None:
            self.set_limit(limit)

    # ---- queues ------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        if seq.pools:
            self.pooling.add(seq)

    def free(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from its queue and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
            self.key_pages.add(seq, -self.tables.num_blocks(seq.handle))
        for queue in (self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.pooling.discard(seq)
        self.slices.leave(seq, self._now)
        if self.tiers is not None:
            self.tiers.forget(seq)
        if seq.handle != NO_PAGES:
            seq.request.timeline.held(self.tables.num_blocks(seq.handle))
            self.tables.free_sequence(seq.handle)
            self._release_adapter(seq)
            seq.handle = NO_PAGES
        if self.speculator is not None:
            self.speculator.release(seq)

    def take_pins(self, seq: Sequence, now: float) -> None:
        """After a token of `seq`: take its request's pins of prompt prefixes once the prompt is computed (its first
        token), those of all it wrote once it finished (before `free`), on its first choice's pages; each pin's
        tokens go back with the request's outputs."""
        request = seq.request
        if seq.index != 0 or not request.pins:
            return
        prefixes, finished = len(seq.output_token_ids) == 1, seq.finish_reason is not None
        for i, pin in enumerate(request.pins):
            if prefixes if pin.num_tokens is not None else finished:
                request.pinned_tokens[i] = self.pin(seq, pin, now)

    def pin(self, seq: Sequence, pin: Pin, now: float) -> int:
        """Hold pages of `seq` under `pin.key` (before `free`): the leading run of its cached full pages, up to
        `pin.num_tokens` tokens (None: all it computed). The tokens those pages hold; 0 when nothing was pinned."""
        if seq.handle == NO_PAGES or self.tables.is_swapped(seq.handle):
            return 0
        tokens = self.tables.num_committed(seq.handle)
        if pin.num_tokens is not None:
            tokens = min(tokens, pin.num_tokens)
        pages = self.tables.block_ids(seq.handle)[:tokens // self.block_size]
        hashes = []
        for page in pages:
            page_hash = self.pool.block_hash(int(page))
            if page_hash is None:
                break  # a hit ends at the first page that is not cached: nothing after it can be found
            hashes.append(page_hash)
        if not self.pins.hold(pin.key, pages[:len(hashes)], now, pin.ttl_s, key_name(seq)):
            return 0
        if self.tiers is not None:  # pinned pages spill down the tiers when the pin goes, seen once or not
            self.tiers.tiers.gate.vouch(hashes)
        return len(hashes) * self.block_size

    def unpin(self, key: str) -> bool:
        return self.pins.release(key)

    def pinned_by_key(self) -> dict[str, int]:
        """Pages the pins of each named API key hold (pagegate:key_kv_blocks_pinned)."""
        return self.pins.pages_by_owner()

    def _free_up(self, needed: int, pins: bool = True) -> bool:
        """Release pins, least recently used first (unless not `pins`: batch work leaves them, they hold online
        conversations and prefixes),
        then idle LoRA adapters' pages, least recently used first, until `needed` pages are free; whether they are."""
        if self.pool.num_free_blocks < needed and self.grow_pool is not None:
            self.grow_pool(needed - self.pool.num_free_blocks)
        while self.pool.num_free_blocks < needed:
            if not (pins and self.pins.release_oldest()) and (self.adapters is None or not self.adapters.evict_idle()):
                return False
        return True

    def _acquire_adapter(self, seq: Sequence) -> bool:
        """The pages of the adapter `seq` runs with (a sequence holding KV pages holds its adapter's too)."""
        name = seq.request.lora_name
        return name is None or self.adapters is not None and self.adapters.acquire(name, self._free_up)

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.request.lora_name is not None and self.adapters is not None:
            self.adapters.release(seq.request.lora_name)

    def unload_adapter(self, name: str) -> None:
        """Give back a LoRA adapter's pages before it is forgotten; refused while requests use it (running or not)."""
        if any(seq.request.lora_name == name for seq in self.waiting):
            raise ValueError(f"LoRA adapter {name!r} has requests waiting to run with it")
        if self.adapters is not None:
            self.adapters.unload(name)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every page of the running `parent` (n > 1 after the prompt)."""
        child.handle = self.tables.fork(parent.handle)
        if child.request.lora_name is not None and self.adapters is not None:
            self.adapters.hold(child.request.lora_name)
        child.num_computed = parent.num_computed
        child.status = SeqStatus.RUNNING
        self.running.append(child)
        self.key_pages.add(child, self.tables.num_blocks(child.handle))

    def set_limit(self, num_blocks: int) -> int:
        """An elastic pool's limit moved (BlockPool.set_limit): the watermark and the pins' budget follow it, and a
        pool that grew takes as many sequences again as it is allowed (the cap tuned on the smaller pool no longer
        says what fits). The limit reached: a shrink stops above the highest page in use."""
        grew = num_blocks > self.pool.num_blocks
        reached = self.pool.set_limit(num_blocks)
        self.watermark_blocks = int(self.cache.watermark * reached)
        self.batch_headroom_blocks = self._batch_headroom(reached)
        self.pins.max_blocks = int(self.cache.max_pinned_fraction * reached)
        if grew:
            self.cap.reset()
        return reached

    def _batch_headroom(self, num_blocks: int) -> int:
        """Free pages batch-lane admission leaves beyond the watermark (CacheConfig.batch_headroom).

        NOTE: an online prompt that arrives is admitted at once, preempting batch work if it must; the headroom is
        there so that it need not: its first chunk (at most one step's token budget) finds free pages, and no batch
        sequence loses its work to it. A fraction of the pool bounds it, so a small pool still runs batch work."""
        step_pages = -(-self.config.step_tokens // self.block_size)
        return min(step_pages, int(self.cache.batch_headroom * num_blocks))

    def take_pages_short(self) -> int:
        """The pages admission and running sequences lacked since the last call (what an elastic pool grows by)."""
        short, self.pages_short = self.pages_short, 0
        return short

    def pages_by_key(self) -> dict[str, int]:
        """Device pages the running sequences of each named API key hold (pagegate:key_kv_blocks_used)."""
        counted = KeyPages()
        counted.recount(self.running, self.tables)
        return counted.held

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences not yet admitted, a request's n choices each (they fork after its prefill)."""
        return sum(seats(seq) for seq in list(self.waiting))  # one C-level copy: safe against appends

    @property
    def num_occupied_seats(self) -> int:
        """Running slots held by running and swapped sequences, the choices an unforked prompt will fork
        into included (they appear in one step, when its prefill ends)."""
        return sum(seats(seq) for seq in [*self.running, *self.swapped])

    @property
    def free_slots(self) -> int:
        """Running slots open now under the running cap (swapped sequences have theirs reserved)."""
        return max(0, self.cap.value - self.num_occupied_seats)

    # ---- one step ----------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> ScheduledBatch:
        now = time.monotonic() if now is None else now
        batch = ScheduledBatch()
        self.pins.expire(now)
        self.running.sort(key=lambda s: s.sort_key)
        self.key_pages.recount(self.running, self.tables)  # kept current through the step from here
        self._now = now
        self.slices.begin(self.running, self.waiting, self.key_pages, now)
        if not self._fill_owed(batch, now):
            if self.speculator is not None:
                self.speculator.propose(self.running)
            pooling = self._pooling_budget(now)
            self._fill(batch, pooling, now)
            if not batch.seqs and not batch.preempted and pooling == 0 and self.pooling:
                self._fill(batch, self._slice_tokens(), now)  # nothing else could run: the engine does not idle
        self._slice_seqs = [seq for seq in batch.seqs if seq.pools]
        self._slice_began = now if self._slice_seqs else None
        batch.copies = self.tables.take_cow_pairs()
        if self.tiers is not None:
            batch.evicted = self.pool.take_evicted()
            if not batch.seqs:
                self.tiers.wait_for_disk(DISK_WAIT_S)
        self.cap.update(now, len(self.running), batch.preempted - batch.yielded,
                        self.pool.num_used_blocks / self.pool.num_blocks, len(self.waiting) + len(self.swapped))
        return batch

    def _fill(self, batch: ScheduledBatch, pooling: int, now: float) -> None:
        """Add to `batch`, lane by lane, the lane's running sequences' next tokens, then its swapped ones coming
        back, then its new ones, within the step's token budget and, for embedding sequences, `pooling` tokens.

        NOTE: the batch lane is filled only in a step without online tokens (so it never slows an online step), at
        most batch_step_tokens of it (so an online request that arrives waits for one short step), and from the pages
        online sequences leave: while an online sequence waits for them, no batch sequence comes back or is admitted.
        Its running sequences are not scheduled yet while the online lane fills, so an online sequence short of
        pages may preempt them (the tail of the running list, and _yield_batch) before it touches another online
        one."""
        budget = self.config.step_tokens - batch.num_batched_tokens
        self._pooling_left = pooling
        self._near = self._nearly_cached(budget)
        self._others_left = budget // 4  # other prompts' tokens in a step with nearly cached ones
        placed = True
        for lane in LANES:
            if lane == BATCH:
                if batch.num_batched_tokens:
                    break  # NOTE: batch tokens would slow an online step; its sequences keep their pages and wait
                budget = min(budget, self.config.batch_step_tokens)
            budget, placed = self._fill_lane(lane, batch, budget, now, may_add=placed)
            self._lanes_in_order(lane)

    def _fill_owed(self, batch: ScheduledBatch, now: float) -> bool:
        """A step of owed prompts alone: whether `batch` is one. Owed are the waiting online prompts of API keys that
        hold under OWED_FRACTION of their weighted share of the running sequences' pages, where two or more keys are
        at work; never two such steps in a row.

        NOTE: fair admission (_admission_order) puts a light key's prompt first, but in a step beside every running
        decode of a heavy key: with 64 of them that step is several times its prompt's own, and its first token
        waits for it. Alone, the prompt's step is its own length; the running decodes lose one short step, and
        the next step is an ordinary one, so they never wait for two."""
        owed = [] if self._owed_last else self._owed_prompts()
        self._owed_last = False
        if not owed:
            return False
        self._near, self._pooling_left = set(), 0
        self._admit(ONLINE, batch, self.config.step_tokens, now, among=owed)
        self._lanes_in_order(ONLINE)
        self._owed_last = bool(batch.seqs)
        return self._owed_last

    def _owed_prompts(self) -> list[Sequence]:
        """The waiting online generation prompts of keys owed a step (_fill_owed; KeySlices.owed)."""
        owed = self.slices.owed
        return [seq for seq in self.waiting if owed and seq.request.lane == ONLINE and not seq.pools
                and key_name(seq) in owed]

    def _lanes_in_order(self, lane: Lane) -> None:
        """The running sequences `lane` just added (at the end) moved ahead of the lanes' below, whose turn is next:
        their tail is what their growth preempts."""
        appended = bool(self.running) and self.running[-1].request.lane == lane
        if appended and lane != LANES[-1] and any(seq.request.lane != lane for seq in self.running):
            self.running.sort(key=lambda s: s.sort_key)

    def _fill_lane(self, lane: Lane, batch: ScheduledBatch, budget: int, now: float,
                   may_add: bool) -> tuple[int, bool]:
        """One lane's part of the step: its running sequences grow, and when `may_add` (the lanes above placed all
        they could) its swapped ones come back and new ones start. The budget left, and whether the lane placed all
        it could (False: something of it waits for pages, the budget or a seat, or it lost a sequence to a pool too
        small), so that the lanes below add nothing while it waits."""
        budget, grown = self._grow(lane, batch, budget, now)
        # a preemption for want of pages stops the lane's comebacks and admissions this step (they would be next);
        # a batch sequence that made way for an online one stops only the batch lane's
        pressed = batch.preempted > (batch.yielded if lane == ONLINE else 0)
        if not (may_add and grown) or pressed:
            return budget, False
        budget, back = self._swap_in(lane, batch, budget, now)
        if not back:
            return budget, False
        return self._admit(lane, batch, budget, now)

    def _grow(self, lane: Lane, batch: ScheduledBatch, budget: int, now: float) -> tuple[int, bool]:
        """The next tokens of the lane's running sequences, most urgent first; False when one of them had to be
        preempted for want of pages (everything after it already was)."""
        rank = LANE_RANK[lane]
        i = next((j for j, seq in enumerate(self.running) if LANE_RANK[seq.request.lane] >= rank), len(self.running))
        while i < len(self.running) and budget > 0 and self.running[i].request.lane == lane:
            seq = self.running[i]
            if seq.decodes:  # decodes go in runs, one core call per run
                added = self._append_decodes(i, budget, batch)
                i, budget = i + added, budget - added
                if added:
                    continue
            n = self._chunk(seq, seq.num_computed, self._allowance(seq, budget))
            if n == 0:  # an embedding whose slice is spent or not due, or a prompt beside near hits: the next run
                i += 1
                continue
            if not self._within_quota(seq, n, batch, now):
                continue  # seq itself went (its key's least urgent): the next one is at i now
            if not self._make_room(seq, n, batch, now):
                return budget, False  # seq itself was preempted: everything after it already was
            self._reserve(seq, n)
            n += self._reserve_draft(seq, budget - n)
            self._add(batch, seq, n)
            budget -= n
            i += 1
        return budget, True

    def _pooling_budget(self, now: float) -> int:
        """The tokens embedding sequences may take this step (POOLING_SHARE): a slice, or none while generations
        have the engine for the share of time the last slice earned them."""
        if self._slice_began is not None and any(seq in self.pooling for seq in self._slice_seqs):
            # the last step held a slice and the engine was busy since (its embeddings are not all done): it took
            # until now
            took = min(now - self._slice_began, POOLING_WINDOW_MAX_S)
            self._generations_until = now + took * (1 - POOLING_SHARE) / POOLING_SHARE
            factor = min(2.0, max(0.5, POOLING_SLICE_S / took)) if took > 0 else 2.0
            self._slice = max(POOLING_SLICE_MIN, int(self._slice * factor))
        self._slice_began = None
        if 0 < len(self.pooling) < self.num_unfinished and now < self._generations_until:
            return 0
        return self._slice_tokens()

    def _slice_tokens(self) -> int:
        budget = self.config.step_tokens
        self._slice = min(self._slice, budget)
        return self._slice if self.generates else budget

    def _allowance(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` may compute this step: the budget left, for an embedding also its share's rest, and for a
        prompt beside nearly cached ones what is left of the others' quarter (_nearly_cached), and for a sequence of a
        key over its share beside a light key what is left of their slice (key_slices.py)."""
        budget = self.slices.allowance(seq, budget)
        budget = min(budget, self._pooling_left) if seq.pools else budget
        if self._near and seq not in self._near and seq.num_uncomputed > 1:
            budget = min(budget, max(self._others_left, 0))  # a decode's guesses may have taken it below 0
        return budget

    def _chunk(self, seq: Sequence, start: int, allowance: int) -> int:
        """Tokens `seq` computes this step from position `start`: what is left, within the allowance, stopping at
        the end of the prefix hit an identical prompt would get."""
        n = min(len(seq.token_ids) - start, allowance)
        cut = self._hit_end(seq)
        n = cut - start if start < cut < start + n else n
        return _whole_images(seq, start, n, allowance) if self.whole_images else n

    def _hit_end(self, seq: Sequence) -> int:
        """Where a prefix hit of `seq`'s prompt ends: the last whole page before its last token (0: none).

        NOTE: a cold prompt is computed in two steps, up to this boundary and then the rest, so that a later identical
        prompt, whose hit ends here, computes its rest in the same step shape over the same pages: bit for bit what
        the cold run computed. In one step, the rest's rows would go through other arithmetic (a GEMM's blocking
        depends on its row count; the native step takes the few rows a hit leaves), and though the difference is
        float rounding, Q8-rounded activations in the decode steps after it amplify it: on SmolLM2 Q4_1, 954-token
        prompts, greedy answers on the cached prefix parted from the cold run's in 3 of 6 (4 of 6 with the rest on
        the torch forward alone, runner.py), none with this cut. The cost is one more small step per prompt longer
        than a page, paid only where a token's arithmetic depends on its step (cuts_at_hits: the torch forward; the
        native step's never does)."""
        if not self.prefix_caching or not self.cuts_at_hits:
            return 0
        return (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.add(seq, n)
        self.slices.took(seq, n)
        if seq.pools:
            self._pooling_left -= n
        if self._near and seq not in self._near:
            self._others_left -= n

    def _reserve(self, seq: Sequence, n: int) -> None:
        before = self.tables.num_blocks(seq.handle)
        self.tables.append(seq.handle, seq.keys(seq.num_computed, seq.num_computed + n))
        seq.num_computed += n
        self.key_pages.add(seq, self.tables.num_blocks(seq.handle) - before)

    def _append_decodes(self, start: int, budget: int, batch: ScheduledBatch) -> int:
        """Reserve the one token of each decode in running[start:] (up to the first non-decode, the end of its lane,
        or one whose new page its key's quota has no room for) that fits without preempting; returns how many were
        added."""
        run, lane = [], self.running[start].request.lane
        taking: dict[str | None, int] = {}  # new pages the run takes so far, per key with a quota
        for seq in self.running[start:start + budget]:
            if not seq.decodes or seq.request.lane != lane or not self.slices.allows(seq):
                break
            if seq.num_computed % self.block_size == 0 and quota_of(seq) is not None:  # the core takes a fresh page
                name = key_name(seq)
                taking[name] = taking.get(name, 0) + 1
                if self.key_pages.over_quota(seq, taking[name]):
                    break
            run.append(seq)
        added = self.tables.append_many([s.handle for s in run], [s.token_ids[-1] for s in run])
        for seq in run[:added]:
            if seq.num_computed % self.block_size == 0:
                self.key_pages.add(seq, 1)
            seq.num_computed += 1
            batch.add(seq, 1)
            self.slices.took(seq, 1)
        return added

    def _reserve_draft(self, seq: Sequence, budget: int) -> int:
        """Uncommitted slots for the tokens guessed for `seq`: as many as the budget allows and the free pages do
        without taking one that another running sequence's next token may need (a guess never preempts)."""
        draft = seq.draft[:max(budget, 0)]
        spare = self.pool.num_free_blocks - self.watermark_blocks - len(self.running)
        room = self.key_pages.room(seq)
        spare = spare if room is None else min(spare, room)
        while draft and self.tables.pages_needed(seq.handle, len(draft)) > spare:
            draft.pop()
        if draft:
            before = self.tables.num_blocks(seq.handle)
            self.tables.grow(seq.handle, len(draft))
            self.key_pages.add(seq, self.tables.num_blocks(seq.handle) - before)
        seq.draft = draft
        return len(draft)

    def keep_guess(self, seq: Sequence, position: int, token: int) -> bool:
        """The token sampled at `position` of a drafted sequence: when it is the guess there, the guess's KV
        (computed this step) is the sequence's and the next position's sample counts too."""
        if position >= len(seq.draft) or seq.draft[position] != token:
            return False
        self.tables.commit(seq.handle, [token])
        seq.num_computed += 1
        seq.draft_kept += 1
        return True

    def settle_drafts(self, seqs: list[Sequence]) -> None:
        """After sampling: the slots of rejected guesses go back, and the speculator learns what was kept."""
        for seq in seqs:
            if not seq.draft or self.speculator is None:
                continue
            if seq.handle != NO_PAGES:
                self.tables.truncate(seq.handle, seq.num_computed)
            self.speculator.settle(seq, seq.draft_kept)
            seq.draft_kept = 0

    def _make_room(self, seq: Sequence, n: int, batch: ScheduledBatch, now: float) -> bool:
        """Preempt from the tail until seq's next n tokens fit; False when seq itself had to go."""
        while not self._free_up(self.tables.pages_needed(seq.handle, n), pins=seq.request.lane == ONLINE):
            # NOTE: the victim is the tail of the running list (sorted by sort_key): the batch lane's least urgent,
            # most recently arrived sequence while there is one, which has the least work to lose and the longest to
            # wait anyway. A batch sequence never reaches an online one: they all sort before it.
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self._fail(seq, batch, f"the sequence needs more KV pages than the pool's {self.pool.num_blocks} "
                                       f"to hold {len(seq.token_ids) + 1} tokens")
                return False
            self._preempt(self.running.pop(), batch, now, yielded=victim.request.lane != seq.request.lane)
            if victim is seq:
                return False
        return True

    def _fail(self, seq: Sequence, batch: ScheduledBatch, error: str) -> None:
        seq.request.error = error
        self.free(seq)
        batch.failed.append(seq)

    def _within_quota(self, seq: Sequence, n: int, batch: ScheduledBatch, now: float) -> bool:
        """Preempt the least urgent running sequences of seq's key until its next n tokens fit under the key's quota;
        False when seq itself had to go (the key's least urgent, or alone more than its quota: failed)."""
        new_pages = self._new_pages(seq, n)
        while self.key_pages.over_quota(seq, new_pages):
            name = key_name(seq)
            victim = next(s for s in reversed(self.running) if key_name(s) == name)
            if victim is seq and sum(key_name(s) == name for s in self.running) == 1:
                self._fail(seq, batch, f"the sequence needs more KV pages than its API key's quota of "
                                       f"{quota_of(seq)} (max_kv_blocks) to hold {seq.num_computed + n} tokens")
                return False
            self.running.remove(victim)  # after seq in the running list (or seq): not scheduled this step
            self._preempt(victim, batch, now, yielded=True)
            if victim is seq:
                return False
        return True

    def _new_pages(self, seq: Sequence, n: int) -> int:
        """Pages seq's block table grows by for its next n tokens."""
        return -(-(seq.num_computed + n) // self.block_size) - self.tables.num_blocks(seq.handle)

    def _yield_batch(self, fits: Callable[[], bool], batch: ScheduledBatch, now: float,
                     key: str | None = None, of_key: bool = False) -> bool:
        """For an online sequence: preempt running batch-lane sequences (of key `key` alone when `of_key`), least
        urgent first, until `fits()`; whether it does. They are not scheduled yet: the batch lane fills last."""
        while not fits():
            victim = next((s for s in reversed(self.running)
                           if s.request.lane == BATCH and (not of_key or key_name(s) == key)), None)
            if victim is None:
                return False
            self.running.remove(victim)
            self._preempt(victim, batch, now, yielded=True)
        return True

    def _make_way(self, seq: Sequence, fits: Callable[[], bool], batch: ScheduledBatch, now: float) -> bool:
        """Whether `fits()`: for an online sequence, after running batch-lane sequences made way."""
        return fits() or seq.request.lane == ONLINE and self._yield_batch(fits, batch, now)

    def _pages_for(self, seq: Sequence, needed: int, batch: ScheduledBatch, now: float) -> bool:
        """Whether `needed` pages are free for `seq` to come back or be admitted: after pins and idle adapters, and
        for an online sequence after running batch-lane sequences made way."""
        if self._free_up(needed, pins=seq.request.lane == ONLINE):
            return True
        return self._make_way(seq, lambda: self.pool.num_free_blocks >= needed, batch, now)

    def _preempt(self, victim: Sequence, batch: ScheduledBatch, now: float, yielded: bool = False) -> None:
        victim.draft = []  # not scheduled this step: its guesses took no slots
        batch.preempted += 1
        batch.yielded += yielded
        self.num_preemptions += 1
        pages = self.tables.num_blocks(victim.handle)
        self.key_pages.add(victim, -pages)
        self.pages_short += pages
        if self._should_swap(victim, now):
            victim.request.timeline.preempted(SWAP, now, pages, victim.index)
            pairs = self.tables.swap_out(victim.handle)
            batch.swap_out.append(pairs)
            self.num_swap_outs += 1
            self.num_swapped_out_blocks += len(pairs)
            victim.status = SeqStatus.SWAPPED
            self.swapped.append(victim)
            return
        victim.request.timeline.preempted(RECOMPUTE, now, pages, victim.index)
        self.tables.free_sequence(victim.handle)
        self._release_adapter(victim)
        victim.handle, victim.num_computed, victim.status = NO_PAGES, 0, SeqStatus.WAITING
        self.waiting.append(victim)  # NOTE: it keeps its arrival time, so it is first in line again

    def _should_swap(self, victim: Sequence, now: float) -> bool:
        if not self.swap_enabled or victim.recompute_only:
            return False
        if victim.last_swap_in >= 0 and now - victim.last_swap_in < self.config.swap_bounce_s:
            victim.recompute_only = True  # the adaptive swap threshold: it keeps bouncing
            log.info("request %s bounced (swapped out %.2fs after coming back): recompute it from now on",
                     victim.request.request_id, now - victim.last_swap_in)
            return False
        return self.cpu_pool is not None and self.cpu_pool.num_free_blocks >= self.tables.num_blocks(victim.handle)

    def _swap_in(self, lane: Lane, batch: ScheduledBatch, budget: int, now: float) -> tuple[int, bool]:
        """Bring the lane's swapped sequences back, most urgent first; the budget left, and whether all came back
        that their keys' quotas let come back."""
        for seq in sorted((s for s in self.swapped if s.request.lane == lane), key=lambda s: s.sort_key):
            pages = self.tables.num_blocks(seq.handle)
            if self.key_pages.over_quota(seq, pages):
                continue  # back once its key's pages go down; the others need not wait for it
            holds = pages + self._new_pages(seq, 1)  # its pages and room for its next token
            if holds > self.pool.num_blocks:  # preempted from a pool it filled (batch work, for an online request)
                self._fail(seq, batch, f"the sequence needs more KV pages than the pool's {self.pool.num_blocks} "
                                       f"to hold {seq.num_computed + 1} tokens")
                continue
            need = holds + self._pages_left_free(seq)
            seated = self._make_way(seq, lambda: len(self.running) < self.cap.value, batch, now)
            if not seated or not self._pages_for(seq, need, batch, now):
                return budget, False
            pairs = self.tables.swap_in(seq.handle)
            self.key_pages.add(seq, pages)
            batch.swap_in.append(pairs)
            self.num_swapped_in_blocks += len(pairs)
            self.swapped.remove(seq)
            seq.status, seq.last_swap_in = SeqStatus.RUNNING, now
            seq.request.timeline.resumed(seq.index, now)
            self.running.append(seq)
            n = self._chunk(seq, seq.num_computed, self._allowance(seq, budget))
            fits = self.tables.pages_needed(seq.handle, n) <= self.pool.num_free_blocks
            if n and fits and not self.key_pages.over_quota(seq, self._new_pages(seq, n)):
                self._reserve(seq, n)
                self._add(batch, seq, n)
                budget -= n
        return budget, True

    def _pages_left_free(self, seq: Sequence) -> int:
        """The free pages `seq` must leave to be admitted or to come back: the watermark, and for batch work the
        headroom of an online prompt to come. Nothing holds back a first sequence."""
        if not self.running:
            return 0
        return self.watermark_blocks + (self.batch_headroom_blocks if seq.request.lane == BATCH else 0)

    def _admit(self, lane: Lane, batch: ScheduledBatch, budget: int, now: float,
               among: list[Sequence] | None = None) -> tuple[int, bool]:
        """Admit the lane's waiting sequences (those `among` them, when given) in _admission_order; the budget left,
        and whether none of them waits for pages, the budget or a seat (those that wait for their key's quota or
        their prefix from disk do not hold the line)."""
        waiting = [seq for seq in (self.waiting if among is None else among) if seq.request.lane == lane]
        if not waiting:
            return budget, True  # the seat count walks the running sequences: not every decode step
        occupied = self._occupied_seats(lane)
        pending_forks = self.num_occupied_seats - len(self.running) - len(self.swapped)
        for seq in self._admission_order(waiting, now):
            allowance = self._allowance(seq, budget)
            if allowance <= 0 < budget:
                continue  # an embedding whose slice is spent or not due: generations behind it may pass
            wanted = seats(seq)
            # NOTE: an n > 1 prompt is admitted only when all n choices fit, under the running cap and in the
            # block tables' slots, since it forks into them at once; one that fits nothing waits for an empty
            # engine (the gateway refuses n > max_num_seqs, which could never run).
            over_cap = occupied + wanted > self.cap.value and occupied > 0
            if over_cap and lane == ONLINE and self._seat_online(wanted, batch, now):
                occupied, over_cap = self._occupied_seats(ONLINE), False
            no_slots = self.tables.num_sequences + pending_forks + wanted > self.tables.max_seqs
            if budget <= 0 or over_cap or no_slots:
                return budget, False  # head of line waits: later ones must not overtake it forever
            n = self._try_admit(seq, allowance, now, batch)
            if n is WAIT:
                continue  # its prefix is being read from disk, or its key is at its quota: the next need not wait
            if n == 0:
                return budget, False
            self._add(batch, seq, n)
            budget -= n
            occupied += wanted
            pending_forks += wanted - 1
        return budget, True

    def _seat_online(self, wanted: int, batch: ScheduledBatch, now: float) -> bool:
        """Whether an online sequence of `wanted` seats fits under the running cap once running batch work made
        way."""
        return self._yield_batch(lambda: self._occupied_seats(ONLINE) + wanted <= self.cap.value, batch, now)

    def _occupied_seats(self, lane: Lane) -> int:
        """Running slots taken, as `lane` sees them: the running sequences', and the swapped ones' of its lane or
        above (a batch sequence swapped out keeps its seat from other batch work, not from online requests)."""
        rank = LANE_RANK[lane]
        return (sum(seats(seq) for seq in self.running)
                + sum(seats(seq) for seq in self.swapped if LANE_RANK[seq.request.lane] <= rank))

    def _admission_order(self, waiting: list[Sequence], now: float) -> Iterator[Sequence]:
        """`waiting` (one lane's), most urgent first: by priority level, each gaining `aging_rate` levels per second
        waited; within a level, the API key furthest below its weighted share of pages first (weighed again after
        each admission), then by arrival.

        NOTE: weighted fair queuing on pages, not on requests: a key's place is the pages its running sequences hold
        over its weight, so a key with many or long requests waits behind keys holding less, and each admission
        moves its key back by the pages it takes. Aging still outranks it across levels, so nothing starves; under
        fcfs every request has one level and arrival only breaks ties between keys."""
        for seq in waiting:
            waited = now - seq.request.arrival_time
            seq.request.effective_priority = seq.request.priority - self.config.aging_rate * waited
        ordered = sorted(waiting, key=lambda s: s.sort_key)
        for _, level in itertools.groupby(ordered, key=self._level):
            queues: dict[str | None, deque[Sequence]] = {}
            for seq in level:
                if seq in self._near:
                    yield seq  # nearly cached: first in its level (_nearly_cached)
                else:
                    queues.setdefault(key_name(seq), deque()).append(seq)
            while queues:
                name = min(queues, key=lambda k: (self.key_pages.share(queues[k][0]), queues[k][0].sort_key))
                queue = queues[name]
                yield queue.popleft()
                if not queue:
                    del queues[name]

    def _nearly_cached(self, budget: int) -> set[Sequence]:
        """The waiting online prompts (the first NEAR_SCAN) whose every page but a few tokens' (at most a quarter of
        the budget) the pool holds now.

        NOTE: such a prompt (an agent's next turn after its breakpoint, a chat resent with one more message) costs
        a few tokens of compute, and waiting behind long prompts' chunks would cost it many steps: it is admitted
        first in its priority level, and the other prompts' chunks in its step take at most a quarter of the budget
        together (_allowance), so that the step it waits for is short. Shortest work first (SGLang's longest-prefix-
        match policy orders its queue so); the long prompts it passes still get a quarter of each step."""
        if not self.prefix_caching:
            return set()
        near = set()
        for seq in itertools.islice((seq for seq in self.waiting if seq.request.lane == ONLINE), NEAR_SCAN):
            if seq.pools or seq.request.prompt_logprobs is not None:
                continue
            tokens = seq.keys(0, len(seq.token_ids) - 1)
            cached = self.pool.cached_prefix_tokens(tokens, seq.request.root_hash)
            if cached and len(seq.token_ids) - cached <= budget // 4:
                near.add(seq)
        return near

    def _level(self, seq: Sequence) -> tuple[int, int]:
        """A waiting sequence's lane and priority level (aged, under the priority policy: whole levels gained)."""
        request = seq.request
        if self.config.scheduling_policy != "priority":
            return LANE_RANK[request.lane], request.priority
        return LANE_RANK[request.lane], math.ceil(request.effective_priority)

    def _try_admit(self, seq: Sequence, budget: int, now: float, batch: ScheduledBatch) -> int | None:
        """Give a waiting sequence its prefix-cache hits (from the pool, then the tiers) and first chunk; 0 when
        it does not fit, WAIT while its prefix is read from disk or its key is at its quota."""
        request = seq.request
        if not self._fits_quota(seq, batch, now):
            return WAIT
        limit = len(seq.token_ids) - 1
        if request.prompt_logprobs is not None and request.scoring_prompt:  # a hit has no logits to score
            limit = min(limit, len(request.prompt_logprobs) - 1)
        # an embedding request takes no hits: mean pooling needs every position's hidden state (pooling.py)
        tokens = seq.keys(0, limit) if not seq.pools else []
        try:
            if not self._acquire_adapter(seq):
                return 0
        except Exception as error:  # NOTE: an adapter that cannot be loaded fails its request, never the engine
            log.exception("request %s: its LoRA adapter could not be loaded", request.request_id)
            self._fail(seq, batch, f"its LoRA adapter {request.lora_name!r} could not be loaded: {error}")
            return WAIT  # the ones behind it are admitted as if it had never waited
        hits, num_hit = self.pool.match_prefix(tokens, request.root_hash)
        found = None
        if self.tiers is not None and tokens:
            found = self.tiers.find(seq, tokens, request.root_hash, len(hits))
            if found is WAIT:
                self.pool.free(hits)
                self._release_adapter(seq)
                return WAIT
            num_hit += len(found.keys) * self.block_size
        n = self._chunk(seq, num_hit, budget)
        if n == 0:  # an image it computes whole does not fit the budget left: a later step
            self.pool.free(hits)
            self._release_adapter(seq)
            return 0
        need = -(-(num_hit + n) // self.block_size) - len(hits)
        reserve = self._pages_left_free(seq)
        if not self._pages_for(seq, need + reserve, batch, now):
            self.pages_short += need + reserve - self.pool.num_free_blocks
            self.pool.free(hits)
            self._release_adapter(seq)
            return 0
        if found is not None and found.keys:
            hits, num_hit = self._stage(seq, found, hits, num_hit, batch)
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += num_hit
        self.pins.refresh(hits, key_name(seq), now)
        seq.handle = self.tables.add_sequence(hits, num_hit, request.root_hash)
        seq.num_computed = num_hit
        self.key_pages.add(seq, self.tables.num_blocks(seq.handle))
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            request.num_cached_tokens = num_hit
            request.timeline.prefix_hit_pages = len(hits)
        else:  # a recomputed sequence comes back
            request.timeline.resumed(seq.index, now)
        self._reserve(seq, n)
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return n

    def _fits_quota(self, seq: Sequence, batch: ScheduledBatch, now: float) -> bool:
        """Whether all of `seq`'s tokens fit in its key's quota beside what the key's running sequences hold, an online
        sequence's after the key's own batch work made way. One that never could fails.

        NOTE: the whole of its tokens, not its first chunk: admitted on a chunk, it would preempt its key's other
        sequences (or itself) on the next one."""
        quota = quota_of(seq)
        if quota is None:
            return True
        pages = -(-len(seq.token_ids) // self.block_size)
        if pages > quota:
            self._fail(seq, batch, f"the request needs {pages} KV pages for its {len(seq.token_ids)} tokens, more "
                                   f"than its API key's quota of {quota} (max_kv_blocks)")
            return False
        if not self.key_pages.over_quota(seq, pages):
            return True
        return seq.request.lane == ONLINE and self._yield_batch(
            lambda: not self.key_pages.over_quota(seq, pages), batch, now, key_name(seq), of_key=True)

    def _stage(self, seq: Sequence, found: Found, hits: np.ndarray, num_hit: int,
               batch: ScheduledBatch) -> tuple[np.ndarray, int]:
        """The tier pages after the pool's hits become pool pages (filled before the forward)."""
        assert self.tiers is not None
        staged, load = self.tiers.stage(found)
        if load is not None:
            batch.tier_loads.append(load)
        self.tiers.forget(seq)
        num_hit -= (len(found.keys) - len(staged)) * self.block_size  # pages the pool would not cache: computed
        return np.concatenate([hits, staged]), num_hit

    # ---- introspection -----------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        pool = self.pool.stats()
        cpu = self.cpu_pool
        spec = self.speculator.stats if self.speculator is not None else SpeculationStats()
        return SchedulerStats(
            running=len(self.running), waiting=len(self.waiting), swapped=len(self.swapped),
            num_blocks=pool.total, free_blocks=pool.free, used_blocks=pool.used,
            cached_blocks=pool.cached_evictable, shared_blocks=pool.shared, kv_cache_usage=pool.utilization,
            cpu_blocks=cpu.num_blocks if cpu else 0, cpu_used_blocks=cpu.num_used_blocks if cpu else 0,
            preemptions=self.num_preemptions, swap_outs=self.num_swap_outs,
            swap_out_blocks=self.num_swapped_out_blocks, swap_in_blocks=self.num_swapped_in_blocks,
            prefix_cache_queries=self.prefix_queries, prefix_cache_hits=self.prefix_hits,
            max_num_seqs=self.cap.value, pinned_blocks=self.pins.num_blocks, spec_drafts=spec.num_drafts,
            spec_draft_tokens=spec.num_draft_tokens, spec_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            lora_blocks=self.adapters.num_pages if self.adapters else 0,
            lora_loads=self.adapters.loads if self.adapters else 0, **self._tier_stats())

    def _tier_stats(self) -> dict[str, int]:
        if self.tiers is None:
            return dict.fromkeys(("host_tier_pages", "host_tier_capacity", "disk_tier_pages", "disk_tier_capacity",
                                  "tier_hit_pages"), 0)
        tiers = self.tiers.tiers
        stats = tiers.stats()
        host, disk = stats.host, stats.disk
        return {"host_tier_pages": host.pages if host else 0,
                "host_tier_capacity": tiers.host.num_pages if tiers.host else 0,
                "disk_tier_pages": disk.pages if disk else 0,
                "disk_tier_capacity": tiers.disk.capacity_pages if tiers.disk else 0,
                "tier_hit_pages": (host.hits if host else 0) + (disk.hits if disk else 0)}


def _whole_images(seq: Sequence, start: int, n: int, allowance: int) -> int:
    """`n`, so that the chunk from `start` does not end inside an image (its tokens see each other): back to the
    image's first token, or, where the chunk starts inside it, on to its end if the allowance holds that, else 0
    (the image waits for a step with room for it; the engine's step budget holds any one image)."""
    end = start + n
    for image in seq.request.images:
        if image.start < end < image.end:
            if image.start > start:
                return image.start - start
            return image.end - start if image.end - start <= allowance else 0
    return n


def seats(seq: Sequence) -> int:
    """Running slots a sequence stands for: n for a prompt of n > 1 choices not yet forked, else one."""
    n = seq.request.params.n
    return n if n > 1 and not seq.request.forked else 1
