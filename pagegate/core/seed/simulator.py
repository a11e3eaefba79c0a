"""Fragmentation simulator: contiguous max-length allocation against the paged pool.

Replays a request trace step by step (one decode token per running sequence per step) against
(a) first-fit allocation of max-length contiguous regions in a real address space and
(b) the real `BlockPool` / `BlockTables`. All sizes are in bytes; each allocator admits
first-come-first-served and reports time-averaged utilisation, internal waste (reserved but
unused), external waste (free while the head of the queue could not be placed) and the peak
number of sequences held at once.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from pagegate.core.block_pool import BlockPool
from pagegate.core.block_tables import BlockTables

GIB = 1024**3


@dataclass
class Trace:
    """Per request: arrival step, prompt tokens, actual output tokens, max tokens reserved."""

    arrival: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    max_len: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival)


def seed_trace(num_requests: int = 10_000, max_len: int = 2048, mean_actual: int = 512,
               arrivals_per_step: float = 50.0, seed: int = 0) -> Trace:
    """The seed's scenario: requests reserve `max_len` tokens and use ~`mean_actual` of them."""
    rng = np.random.default_rng(seed)
    total = np.clip(rng.exponential(mean_actual, num_requests), 16, max_len).astype(np.int64)
    prompt = np.maximum(1, (total * rng.uniform(0.2, 0.8, num_requests)).astype(np.int64))
    prompt = np.minimum(prompt, total - 1)
    arrival = np.floor(np.cumsum(rng.exponential(1.0 / arrivals_per_step, num_requests))).astype(np.int64)
    return Trace(arrival, prompt, total - prompt, np.full(num_requests, max_len, dtype=np.int64))


@dataclass
class SimResult:
    allocator: str
    completed: int
    steps: int
    peak_concurrent: int
    mean_concurrent: float
    utilization: float  # bytes holding real tokens / total bytes, averaged over steps
    internal_waste_bytes: float  # reserved but unused, averaged over steps
    external_waste_bytes: float  # free while a request waited, averaged over steps
    waste_per_seq_tokens: float  # internal waste per running sequence, in tokens
    preemptions: int = 0


class _Accumulator:
    def __init__(self) -> None:
        self.steps = 0
        self.used = self.internal = self.external = self.concurrent = 0.0
        self.peak = 0

    def add(self, used: int, reserved: int, free_blocked: int, running: int) -> None:
        self.steps += 1
        self.used += used
        self.internal += reserved - used
        self.external += free_blocked
        self.concurrent += running
        self.peak = max(self.peak, running)

    def result(self, name: str, total: int, bytes_per_token: int, completed: int, preemptions: int = 0):
        s = max(self.steps, 1)
        waste_tokens = self.internal / bytes_per_token / max(self.concurrent, 1)
        return SimResult(name, completed, self.steps, self.peak, self.concurrent / s, self.used / s / total,
                         self.internal / s, self.external / s, waste_tokens, preemptions)


def simulate_contiguous(trace: Trace, total_bytes: int, bytes_per_token: int) -> SimResult:
    """First-fit over a real address space (in token slots) with sorted, coalesced free holes."""
    holes = [(0, total_bytes // bytes_per_token)]
    queue: deque[int] = deque()
    acc = _Accumulator()
    req, start = np.empty(0, np.int64), np.empty(0, np.int64)  # running requests, their offsets
    admit_step = np.zeros(len(trace), np.int64)
    step, nxt, done = 0, 0, 0
    while done < len(trace):
        nxt = _arrive(trace, queue, nxt, step)
        admitted = []
        while queue:
            need = int(trace.max_len[queue[0]])
            hole = next((i for i, (_, size) in enumerate(holes) if size >= need), None)
            if hole is None:
                break
            offset, size = holes[hole]
            holes[hole:hole + 1] = [(offset + need, size - need)] if size > need else []
            admitted.append((queue.popleft(), offset))
            admit_step[admitted[-1][0]] = step
        if admitted:
            req = np.concatenate([req, [r for r, _ in admitted]])
            start = np.concatenate([start, [o for _, o in admitted]])
        generated = step - admit_step[req]
        used = int((trace.prompt_len[req] + generated).sum()) * bytes_per_token
        reserved = int(trace.max_len[req].sum()) * bytes_per_token
        free = sum(size for _, size in holes) * bytes_per_token if queue else 0
        acc.add(used, reserved, free, len(req))
        finished = generated + 1 >= trace.output_len[req]
        for r, offset in zip(req[finished], start[finished], strict=True):
            _release_hole(holes, int(offset), int(trace.max_len[r]))
        done += int(finished.sum())
        req, start = req[~finished], start[~finished]
        step += 1
    return acc.result("contiguous", total_bytes, bytes_per_token, done)


def _arrive(trace: Trace, queue: deque, nxt: int, step: int) -> int:
    while nxt < len(trace) and trace.arrival[nxt] <= step:
        queue.append(nxt)
        nxt += 1
    return nxt


def _release_hole(holes: list, start: int, size: int) -> None:
    i = bisect.bisect_left(holes, (start, 0))
    holes.insert(i, (start, size))
    if i + 1 < len(holes) and holes[i][0] + holes[i][1] == holes[i + 1][0]:
        holes[i:i + 2] = [(holes[i][0], holes[i][1] + holes[i + 1][1])]
    if i > 0 and holes[i - 1][0] + holes[i - 1][1] == holes[i][0]:
        holes[i - 1:i + 1] = [(holes[i - 1][0], holes[i - 1][1] + holes[i][1])]


def simulate_paged(trace: Trace, total_bytes: int, bytes_per_token: int, block_size: int = 16,
                   max_seqs: int = 65_536) -> SimResult:
    """The real page pool: the prompt's pages at admission, one more each time the last fills.

    When a running sequence cannot grow, the latest admitted one is preempted (recompute).
    """
    num_blocks = total_bytes // (bytes_per_token * block_size)
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
    tables = BlockTables(pool, min(max_seqs, len(trace)), int(trace.max_len.max()) // block_size + 2)
    request_of = np.zeros(tables.max_seqs, np.int64)  # handle -> request
    generated = np.zeros(tables.max_seqs, np.int64)  # handle -> tokens generated so far
    queue: deque[int] = deque()
    acc, handles = _Accumulator(), np.empty(0, np.int32)  # handles in admission order
    step, nxt, done, preemptions = 0, 0, 0, 0
    while done < len(trace):
        nxt = _arrive(trace, queue, nxt, step)
        new = []
        while queue and tables.num_sequences < tables.max_seqs:
            prompt = int(trace.prompt_len[queue[0]])
            if -(-prompt // block_size) > pool.num_free_blocks:
                break
            handle = tables.add_sequence()
            tables.grow(handle, prompt)
            request_of[handle], generated[handle] = queue.popleft(), 0
            new.append(handle)
        handles = np.concatenate([handles, np.asarray(new, np.int32)])
        grown = tables.grow_many(handles, 1)
        while grown < len(handles):  # out of pages: preempt the latest admitted, retry the rest
            victim = int(handles[-1])
            queue.appendleft(int(request_of[victim]))
            tables.free_sequence(victim)
            preemptions += 1
            handles = handles[:-1]
            grown += tables.grow_many(handles[grown:], 1)
        reqs = request_of[handles]
        tokens = int((trace.prompt_len[reqs] + generated[handles]).sum())
        acc.add(tokens * bytes_per_token, pool.num_used_blocks * block_size * bytes_per_token,
                pool.num_free_blocks * block_size * bytes_per_token if queue else 0, len(handles))
        generated[handles] += 1
        finished = generated[handles] >= trace.output_len[reqs]
        for handle in handles[finished]:
            tables.free_sequence(int(handle))
        done += int(finished.sum())
        handles = handles[~finished]
        step += 1
    return acc.result("paged", total_bytes, bytes_per_token, done, preemptions)


def compare(trace: Trace, total_bytes: int = 20 * GIB, bytes_per_token: int = 16 * 1024,
            block_size: int = 16) -> dict:
    cont = simulate_contiguous(trace, total_bytes, bytes_per_token)
    paged = simulate_paged(trace, total_bytes, bytes_per_token, block_size)
    return {"contiguous": asdict(cont), "paged": asdict(paged),
            "capacity_ratio": paged.peak_concurrent / max(cont.peak_concurrent, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagegate simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--mean-actual", type=int, default=512)
    parser.add_argument("--arrivals-per-step", type=float, default=50.0)
    parser.add_argument("--memory-gib", type=float, default=20.0)
    parser.add_argument("--kv-kib-per-token", type=float, default=16.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = parser.parse_args(argv)
    trace = seed_trace(args.requests, args.max_len, args.mean_actual, args.arrivals_per_step, args.seed)
    result = compare(trace, int(args.memory_gib * GIB), int(args.kv_kib_per_token * 1024), args.block_size)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for name in ("contiguous", "paged"):
        r = result[name]
        print(f"{name:>10}: utilisation {r['utilization']:6.1%}  internal waste "
              f"{r['internal_waste_bytes'] / GIB:6.2f} GiB  external waste {r['external_waste_bytes'] / GIB:6.2f} GiB"
              f"  peak seqs {r['peak_concurrent']:5d}  waste/seq {r['waste_per_seq_tokens']:7.1f} tokens")
    print(f"capacity: paged holds {result['capacity_ratio']:.2f}x the sequences of contiguous allocation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
