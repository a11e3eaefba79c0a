"""A Scheduler driven by hand, without a model: sequences of chosen lanes and keys, steps that 'sample' a token for
every sequence whose tokens are all computed, and views of who waits, runs, is swapped and holds pages."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pagegate.config import CacheConfig, SchedulerConfig
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.scheduler import ScheduledBatch, Scheduler
from pagegate.engine.sequence import Request, SeqStatus, Sequence
from pagegate.engine.tenants import BATCH, ONLINE, KeyShare, Lane

BLOCK = 4  # tokens a page: small, so a few tokens cross pages


def scheduler(num_blocks: int, *, swap_blocks: int = 0, budget: int = 512, max_num_seqs: int = 64,
              headroom: float = 0.0, policy: str = "fcfs", batch_step_tokens: int | None = None,
              prefix_caching: bool = False, slice_tokens: int = 16) -> Scheduler:
    """No prefix caching (every page is a sequence's own) and no watermark unless asked: page counts are exact;
    batch-lane steps as large as the budget unless asked."""
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching, watermark=0.0,
                        batch_headroom=headroom)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, scheduling_policy=policy,
                             preemption_mode="swap" if swap_blocks else "recompute",
                             batch_step_tokens=batch_step_tokens or budget, key_slice_tokens=slice_tokens)
    return Scheduler(config, cache, num_blocks, swap_blocks, max_model_len=1024)


@dataclass
class Driver:
    """Adds sequences and steps the scheduler; `now` moves a millisecond a step (arrivals keep their order)."""

    sched: Scheduler
    now: float = 0.0
    ids: itertools.count = field(default_factory=itertools.count)
    finished: list[Sequence] = field(default_factory=list)

    def add(self, prompt_len: int, lane: Lane = ONLINE, key: KeyShare | None = None, max_tokens: int = 4,
            priority: int = 0, tokens: list[int] | None = None) -> Sequence:
        """A sequence of `prompt_len` ones, or of `tokens`."""
        number = next(self.ids)
        prompt = list(tokens) if tokens is not None else [1] * prompt_len
        request = Request(f"r{number}", None, prompt, SamplingParams(max_tokens=max_tokens),
                          priority=priority, arrival_time=self.now, lane=lane, key=key)
        request.order = number
        seq = Sequence(request, 0, list(request.prompt_token_ids), len(prompt))
        request.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def step(self) -> ScheduledBatch:
        self.now += 0.001
        batch = self.sched.schedule(self.now)
        for seq in batch.seqs:
            if seq.num_computed == len(seq.token_ids):  # its last token computed: it samples the next
                seq.token_ids.append(2)
                if len(seq.output_token_ids) >= seq.request.params.max_tokens:
                    seq.status = SeqStatus.FINISHED
                    self.sched.free(seq)
                    self.finished.append(seq)
        self.finished += batch.failed
        return batch

    def pages(self, seq: Sequence) -> int:
        """Device pages `seq` holds (0 waiting or swapped)."""
        return self.sched.tables.num_blocks(seq.handle) if seq in self.sched.running else 0

    def key_pages(self, name: str) -> int:
        return sum(self.pages(s) for s in self.sched.running if s.request.key is not None and s.request.key.name == name)


def running(sched: Scheduler, lane: Lane) -> list[Sequence]:
    return [seq for seq in sched.running if seq.request.lane == lane]


def waiting(sched: Scheduler, lane: Lane) -> list[Sequence]:
    return [seq for seq in [*sched.waiting, *sched.swapped] if seq.request.lane == lane]


__all__ = ["BATCH", "BLOCK", "ONLINE", "Driver", "KeyShare", "running", "scheduler", "waiting"]
