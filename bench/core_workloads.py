"""The core's benchmark workloads (W1-W4, batch builder), each for pagegate and the seed baseline.

Each `run_*` function does the whole workload once and returns the number of operations it
timed (pairs, pages, shared pages or steps), so callers report time per operation.
"""

from __future__ import annotations

import numpy as np

from pagegate.core import BatchBuilder, BlockPool, BlockTables
from pagegate.testing.seed_allocator import BlockAllocator as SeedAllocator

BLOCK_SIZE = 16


def w1_pagegate(n: int = 100_000) -> int:
    pool = BlockPool(1024, BLOCK_SIZE, enable_prefix_caching=False)
    allocate, free = pool.allocate, pool.free
    for _ in range(n):
        free(allocate(1))
    return n


def w1_seed(n: int = 100_000) -> int:
    alloc = SeedAllocator(1024)
    for _ in range(n):
        alloc.allocate(0, 1)
        alloc.free(0)
    return n


def w2_pagegate(n: int = 10_000) -> int:
    pool = BlockPool(1024, BLOCK_SIZE, enable_prefix_caching=False)
    allocate, free = pool.allocate, pool.free
    for _ in range(n):
        free(allocate(64))
    return n * 64


def w2_seed(n: int = 10_000, allocator: type = SeedAllocator) -> int:
    """Also W2 through the seed's API for any allocator class with it (`allocator`)."""
    alloc = allocator(1024)
    for _ in range(n):
        alloc.allocate(0, 64)
        alloc.free(0)
    return n * 64


class ServingTrace:
    """W3: 256 live sequences, one token per step; finished ones are replaced by new prompts.

    New prompts start with one of 8 shared 128-token system prompts, so prefix hits happen.
    """

    def __init__(self, steps: int = 2000, live: int = 256, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.steps, self.live = steps, live
        self.system = rng.integers(0, 32000, (8, 128), dtype=np.int32)
        n = live * 8 + steps  # more than enough requests
        self.prompt_len = rng.integers(50, 1001, n)
        self.final_len = np.maximum(rng.integers(100, 2001, n), self.prompt_len + 1)
        self.system_of = rng.integers(0, 8, n)
        self.tokens = rng.integers(0, 32000, (n, 2001), dtype=np.int32)
        self.tokens[:, :128] = self.system[self.system_of]
        self.step_tokens = rng.integers(0, 32000, (steps, live), dtype=np.int32)  # sampled tokens


def w3_pagegate(trace: ServingTrace) -> int:
    """Prefix caching on: prompts match cached pages, every page that fills is hashed and cached."""
    pool = BlockPool(16_384, BLOCK_SIZE, enable_prefix_caching=True)
    tables = BlockTables(pool, trace.live, 2001 // BLOCK_SIZE + 1)
    finishing: list[list[int]] = [[] for _ in range(trace.steps + 2001)]  # step -> handles
    pages, next_request = 0, 0

    def admit(step: int) -> None:
        nonlocal pages, next_request
        r, next_request = next_request, next_request + 1
        prompt = trace.tokens[r, :trace.prompt_len[r]]
        hit, num_hit = pool.match_prefix(prompt[:-1])
        handle = tables.add_sequence(hit, num_hit)
        pages += len(hit) + tables.append(handle, prompt[num_hit:])
        finishing[step + trace.final_len[r] - trace.prompt_len[r]].append(handle)

    for _ in range(trace.live):
        admit(0)
    handles = np.arange(trace.live, dtype=np.int32)
    for step in range(trace.steps):
        before = pool.num_free_blocks
        tables.append_many(handles, trace.step_tokens[step])
        pages += before - pool.num_free_blocks
        for handle in finishing[step + 1]:
            tables.free_sequence(handle)
            admit(step + 1)  # takes the freed handle back
    return pages


def w3_seed(trace: ServingTrace) -> int:
    alloc = SeedAllocator(16_384)
    pages, next_request = 0, 0
    live: dict[int, list[int]] = {}  # seq -> [request, length]

    def admit() -> None:
        nonlocal pages, next_request
        r, next_request = next_request, next_request + 1
        n = -(-int(trace.prompt_len[r]) // BLOCK_SIZE)
        alloc.allocate(r, n)
        pages += n
        live[r] = [r, int(trace.prompt_len[r])]

    for _ in range(trace.live):
        admit()
    for _ in range(trace.steps):
        for seq, entry in list(live.items()):
            if entry[1] % BLOCK_SIZE == 0:
                alloc.allocate(seq, 1)
                pages += 1
            entry[1] += 1
            if entry[1] >= trace.final_len[entry[0]]:
                alloc.free(seq)
                del live[seq]
                admit()
    return pages


class SeedApiTrace:
    """W3 through the seed's API: ServingTrace's requests as the calls a scheduler makes each step.

    Worked out once, so that a replay spends its time in the allocator: sequences whose last page
    is full get one page, finished ones are freed, and as many new ones are admitted (try_allocate,
    share the full pages of their system prompt from one of 8 holder sequences, allocate the rest).
    Sequence ids are request numbers; the holders are -1..-8. `pages` counts the pages allocated.
    """

    NUM_BLOCKS = 16_384

    def __init__(self, trace: ServingTrace) -> None:
        Admit = tuple[int, int, int, int]  # seq, holder, shared pages, fresh pages
        self.steps: list[tuple[list[int], list[int], list[Admit]]] = []
        self.pages = 8 * 8
        live: dict[int, int] = {}  # seq -> tokens
        requests = iter(range(len(trace.prompt_len)))

        def admit() -> Admit:
            r = next(requests)
            prompt = int(trace.prompt_len[r])
            shared = min(prompt, 128) // BLOCK_SIZE
            fresh = -(-prompt // BLOCK_SIZE) - shared
            live[r] = prompt
            self.pages += fresh
            return r, -1 - int(trace.system_of[r]), shared, fresh

        self.steps.append(([], [], [admit() for _ in range(trace.live)]))
        for _ in range(trace.steps):
            grow = [seq for seq, tokens in live.items() if tokens % BLOCK_SIZE == 0]
            for seq in live:
                live[seq] += 1
            done = [seq for seq, tokens in live.items() if tokens >= trace.final_len[seq]]
            for seq in done:
                del live[seq]
            self.steps.append((grow, done, [admit() for _ in done]))
            self.pages += len(grow)


def w3_seed_api(trace: SeedApiTrace, allocator: type = SeedAllocator) -> int:
    alloc = allocator(SeedApiTrace.NUM_BLOCKS)
    allocate, free, share, fits = alloc.allocate, alloc.free, alloc.share_blocks, alloc.try_allocate
    for system in range(8):
        allocate(-1 - system, 8)  # the system prompts' pages, held for the whole trace
    for grow, done, admits in trace.steps:
        for seq in grow:
            allocate(seq, 1)
        for seq in done:
            free(seq)
        for seq, holder, shared, fresh in admits:
            if not fits(fresh):
                raise RuntimeError("the trace does not fit the pool")
            share(holder, seq, shared)
            allocate(seq, fresh)
    return trace.pages


def w4_pagegate(rounds: int = 200) -> int:
    pool = BlockPool(2048, BLOCK_SIZE, enable_prefix_caching=False)
    tables = BlockTables(pool, 17, 64)
    for _ in range(rounds):
        src = tables.add_sequence()
        tables.grow(src, 64 * BLOCK_SIZE)
        children = [tables.fork(src) for _ in range(16)]
        for seq in [src, *children]:
            tables.free_sequence(seq)
    return rounds * 16 * 64


def w4_seed(rounds: int = 200) -> int:
    alloc = SeedAllocator(2048)
    for _ in range(rounds):
        alloc.allocate(0, 64)
        for dst in range(1, 17):
            alloc.share_blocks(0, dst, 64)
        for seq in range(17):
            alloc.free(seq)
    return rounds * 16 * 64


def builder_setup(num_seqs: int = 256, pages: int = 128) -> tuple:
    pool = BlockPool(num_seqs * pages + num_seqs, BLOCK_SIZE, enable_prefix_caching=False)
    tables = BlockTables(pool, num_seqs, pages + 1)
    handles = np.array([tables.add_sequence() for _ in range(num_seqs)], dtype=np.int32)
    for h in handles:
        tables.grow(int(h), pages * BLOCK_SIZE - 1)
    tables.grow_many(handles, 1)
    builder = BatchBuilder(tables, num_seqs, num_seqs)
    return builder, handles, np.ones(num_seqs, dtype=np.int32)


def builder_steps(setup: tuple, steps: int = 1000) -> int:
    builder, handles, ones = setup
    for _ in range(steps):
        builder.build(handles, ones)
    return steps
