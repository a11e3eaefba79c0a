"""What the dashboard costs the engine (issue 16), in one process.

    python -m bench.dashboard                                   # embedded model on CPU
    python -m bench.dashboard --rounds 3 --requests 32 --max-tokens 192 --device cuda

1. The C copy: fill_page_states over 262,144 pages (free, cached, used and shared ones mixed), and the
   run-length encoding of a key frame and of a delta frame: median microseconds.
2. The engine loop with a dashboard feed open against without: an Engine stepped on this process's main thread
   by an asyncio task (as the engine-core process steps it on its own main thread), the real DashboardFeed
   asking it for 10 snapshots a second (taken between two steps, and put into their wire form, as the core
   does) and its FrameEncoder turning each into the SSE frame /dashboard/api/feed sends, once for all viewers.
   Everything the feed does runs between two steps on the engine's thread here (in the server, reading the
   snapshot back and encoding it happen in the gateway process), so the figures bound its cost from above.
   Reported: the median step, the wall time per step from the first step to the last (snapshots run between
   steps, so this is the figure that counts) and its ratio with and without (the goal: at most 1.02), and the
   time the snapshots and the encoding took (the core's part plus the gateway's) as a share of the run: on a
   noisy machine the ratio swings by more than 2% from round to round, the accounted share does not. Rounds
   alternate, off then on. Run at two pool sizes: 16,384 pages of 16 tokens (1 GiB of KV, the CPU default) and
   262,144 pages of one token. Writes docs/bench-dashboard.png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagegate.config import CacheConfig, EngineConfig, SchedulerConfig
from pagegate.core import BlockPool
from pagegate.core.page_map import fill_page_states, max_encoded_size, rle_encode
from pagegate.engine.engine import Engine
from pagegate.engine.observe.stats import EngineStats
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.pool_snapshot import PoolSnapshot, take_snapshot
from pagegate.engine.sampling.params import SamplingParams
from pagegate.gateway.dashboard.feed import DashboardFeed, Viewer
from pagegate.gateway.dashboard.frames import EVERY_ID
from pagegate.gateway.engine_host import READY
from pagegate.gateway.engine_requests import EngineRequests
from pagegate.gateway.request_timing import TimingRecorder
from pagegate.gateway.settings import GatewayConfig

PAGES = 262_144
PROMPT = "In the beginning God created the heaven and the earth. And the earth was without form, and void."


def median_us(fn: Callable[[], object], repeat: int = 300) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def copy_costs() -> dict[str, float]:
    """Microseconds to copy and encode a 262,144-page pool, a quarter of it in use."""
    pool = BlockPool(PAGES, 16)
    used = pool.allocate(PAGES // 4)
    pool.incref(used[:PAGES // 32])  # shared by two
    for i, page in enumerate(pool.allocate(PAGES // 16)):  # prefix pages, then freed: cached and evictable
        pool.cache_block(int(page), i, np.full(16, i, dtype=np.int32))
    pool.free(np.arange(PAGES // 4, PAGES // 4 + PAGES // 16, dtype=np.int32))
    states, previous = np.empty(PAGES, dtype=np.uint8), np.empty(PAGES, dtype=np.uint8)
    out = np.empty(max_encoded_size(PAGES), dtype=np.uint8)
    fill_page_states(pool, previous)
    pool.free(used[:1000])  # the next frame: a thousand pages came back
    fill_page_states(pool, states)
    return {"fill_page_states": median_us(lambda: fill_page_states(pool, states)),
            "rle key frame": median_us(lambda: rle_encode(states, None, out)),
            "rle delta frame": median_us(lambda: rle_encode(states, previous, out)),
            "key frame bytes": float(rle_encode(states, None, out)),
            "delta frame bytes": float(rle_encode(states, previous, out))}


class _Host:
    """What DashboardFeed reads of an EngineHost."""

    def __init__(self, engine: MainThreadEngine) -> None:
        self.engine, self.state, self.model, self.draining = engine, READY, None, False
        self.config = GatewayConfig()
        self.engine_requests = EngineRequests(self.config, TimingRecorder(), lambda acquired: None, lambda: [engine])

    def engine_for_viewers(self) -> MainThreadEngine:
        return self.engine

    def models_line(self) -> None:
        return None  # one model

    def stats(self) -> object:
        return self.engine.stats()


@dataclass
class Round:
    steps: list[float] = field(default_factory=list)  # seconds of each Engine.step
    first: float = 0.0
    last: float = 0.0
    frames: int = 0
    frame_bytes: int = 0
    viewer_s: float = 0.0  # how long the feed was open
    snapshot_s: float = 0.0  # the core's part: take_snapshot and its wire form
    encode_s: float = 0.0  # the gateway's part: reading a snapshot back, turning it into SSE frames

    @property
    def wall_per_step(self) -> float:
        return (self.last - self.first) / len(self.steps)


class MainThreadEngine:
    """An Engine stepped by a task on this thread's event loop, as the core process steps one on its main thread;
    between two steps the event loop runs: new requests, the feed's snapshots, its encoding and its viewers."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config)
        self.round = Round()  # where the steps and the snapshots are timed
        self._finished: dict[str, asyncio.Future[None]] = {}
        self._work = asyncio.Event()

    async def drive(self) -> None:
        """Step while there is work, then wait for more; until cancelled."""
        while True:
            if not self.engine.has_unfinished():
                self._work.clear()
                await self._work.wait()
            for output in self._timed_step():
                if output.finished:
                    self._finished.pop(output.request_id).set_result(None)
            await asyncio.sleep(0)  # the event loop's turn, between two steps

    def _timed_step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        outputs = self.engine.step()
        ended = time.perf_counter()
        r = self.round
        r.first = r.first or started
        r.last = ended
        r.steps.append(ended - started)
        return outputs

    async def complete(self, prompt: str, params: SamplingParams, request_id: str) -> None:
        """Run one request to its end."""
        finished = self._finished[request_id] = asyncio.get_running_loop().create_future()
        self.engine.add_request(request_id, prompt, params)
        self._work.set()
        await finished

    async def pool_snapshot(self) -> PoolSnapshot:
        """Taken at once: this runs between two steps. Timed as the core's part (the snapshot and its wire
        form) and the gateway's (reading it back)."""
        started = time.perf_counter()
        wire = take_snapshot(self.engine).to_wire()
        taken = time.perf_counter()
        snapshot = PoolSnapshot.from_wire(wire)
        self.round.snapshot_s += taken - started
        self.round.encode_s += time.perf_counter() - taken
        return snapshot

    def stats(self) -> EngineStats:
        return self.engine.stats()


async def workload(engine: MainThreadEngine, requests: int, max_tokens: int, tag: str) -> None:
    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, n=2 if i % 4 == 0 else 1)

    await asyncio.gather(*(engine.complete(PROMPT, params(i), f"{tag}-{i}") for i in range(requests)))


async def viewer(feed: DashboardFeed, result: Round, stop: asyncio.Event) -> None:
    """One viewer of the real feed, until `stop`; the feed's encoder is timed."""
    encode = feed.encoder.encode

    def timed_encode(*args: Any) -> dict[Any, bytes]:
        started_encoding = time.perf_counter()
        frames = encode(*args)
        result.encode_s += time.perf_counter() - started_encoding
        return frames

    feed.encoder.encode = timed_encode  # type: ignore[method-assign,assignment]
    started, watcher = time.perf_counter(), feed.join(EVERY_ID)
    leaving = asyncio.create_task(_leave_on(stop, feed, watcher))
    async for frame in watcher.frames():
        if frame.startswith(b"event: frame"):
            result.frame_bytes += len(frame)
            result.frames += 1
    await leaving
    result.viewer_s = time.perf_counter() - started


async def _leave_on(stop: asyncio.Event, feed: DashboardFeed, watcher: Viewer) -> None:
    await stop.wait()
    feed.leave(watcher)  # its frames() ends


async def measure(engine: MainThreadEngine, dashboard: bool, requests: int, max_tokens: int, tag: str) -> Round:
    result = engine.round = Round()
    stop = asyncio.Event()
    watcher = None
    if dashboard:
        feed = DashboardFeed(_Host(engine))  # type: ignore[arg-type]  # duck-typed EngineHost
        watcher = asyncio.create_task(viewer(feed, result, stop))
    await workload(engine, requests, max_tokens, tag)
    stop.set()
    if watcher is not None:
        await watcher
    return result


@dataclass
class Comparison:
    label: str
    closed: list[Round]
    open: list[Round]

    def wall(self, dashboard: bool) -> float:
        return statistics.median(r.wall_per_step for r in (self.open if dashboard else self.closed))

    def step(self, dashboard: bool) -> float:
        return statistics.median(s for r in (self.open if dashboard else self.closed) for s in r.steps)

    @property
    def frames(self) -> int:
        return sum(r.frames for r in self.open)

    def per_frame_us(self, name: str) -> float:
        return sum(getattr(r, name) for r in self.open) / max(self.frames, 1) * 1e6

    @property
    def accounted(self) -> float:
        """The snapshots' time (the core's part and the gateway's), as a share of the open runs' wall time."""
        busy = sum(r.snapshot_s + r.encode_s for r in self.open)
        return busy / sum(r.viewer_s for r in self.open)


def engine_rounds(label: str, cache: CacheConfig, args: argparse.Namespace) -> Comparison:
    config = EngineConfig(dtype="float32", device=args.device, cache=cache,
                          scheduler=SchedulerConfig(max_num_seqs=args.requests * 2))
    engine = MainThreadEngine(config)
    rounds: dict[bool, list[Round]] = {False: [], True: []}

    async def alternate() -> None:
        driver = asyncio.create_task(engine.drive())
        try:
            await workload(engine, 4, 8, "warm")
            for i in range(args.rounds):
                for dashboard in (False, True):
                    rounds[dashboard].append(await measure(engine, dashboard, args.requests, args.max_tokens,
                                                           f"r{i}{dashboard}"))
        finally:
            driver.cancel()

    try:
        asyncio.run(alternate())
    finally:
        engine.engine.close()
    return Comparison(label, rounds[False], rounds[True])


def report(comparisons: list[Comparison], args: argparse.Namespace) -> None:
    print(f"\nengine loop, {args.requests} requests x {args.max_tokens} tokens (a quarter with n=2), "
          f"{args.rounds} alternating rounds each; medians")
    print("| pool | median step ms closed / open | wall per step ms closed / open | open / closed | "
          "frames/s | bytes/frame | snapshot us (core's part) | read back + encode us (gateway's part) | accounted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in comparisons:
        seconds = sum(r.viewer_s for r in c.open)
        print(f"| {c.label} | {c.step(False) * 1e3:.2f} / {c.step(True) * 1e3:.2f} | "
              f"{c.wall(False) * 1e3:.2f} / {c.wall(True) * 1e3:.2f} | {c.wall(True) / c.wall(False):.3f} | "
              f"{c.frames / seconds:.1f} | {sum(r.frame_bytes for r in c.open) / max(c.frames, 1):.0f} | "
              f"{c.per_frame_us('snapshot_s'):.0f} | {c.per_frame_us('encode_s'):.0f} | {c.accounted:.2%} |")


def plot(copy: dict[str, float], comparisons: list[Comparison], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    top = 0.0
    for i, c in enumerate(comparisons):
        for dashboard, colour in ((False, "#8d99ae"), (True, "#2a9d8f")):
            walls = [r.wall_per_step * 1e3 for r in (c.open if dashboard else c.closed)]
            x = i * 3 + (1 if dashboard else 0)
            left.scatter([x] * len(walls), walls, color=colour, s=18, zorder=3,
                         label=("dashboard open" if dashboard else "closed") if i == 0 else None)
            left.hlines(statistics.median(walls), x - 0.3, x + 0.3, color=colour, lw=2)
            top = max(top, *walls)
    left.set_xticks([i * 3 + 0.5 for i in range(len(comparisons))],
                    [f"{c.label}\nopen / closed {c.wall(True) / c.wall(False):.3f}\naccounted {c.accounted:.2%}"
                     for c in comparisons], fontsize=8)
    left.set_xlim(-1, len(comparisons) * 3 - 1)
    left.set_ylim(0, top * 1.1)
    left.set_ylabel("wall ms per engine step", fontsize=9)
    left.set_title("engine loop, one dot a round (rounds alternate)", fontsize=9)
    left.legend(fontsize=8, loc="lower center")
    names = ["fill_page_states, 262,144 pages", "RLE delta, 262,144 pages (gateway)"] + [
        f"whole snapshot, {c.label.split(' x')[0]}" for c in comparisons]
    values = [copy["fill_page_states"], copy["rle delta frame"]] + [c.per_frame_us("snapshot_s") for c in comparisons]
    right.barh(names, values, color="#2a9d8f")
    right.set_xlabel("microseconds per frame", fontsize=9)
    right.tick_params(labelsize=8)
    right.set_title("per frame, the core's part unless noted", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--png", type=Path, default=Path("docs/bench-dashboard.png"))
    parser.add_argument("--skip-engine", action="store_true", help="only the copy and encoding costs")
    args = parser.parse_args()
    copy = copy_costs()
    print(f"page-state copy and encoding, {PAGES:,} pages (median us; sizes in bytes):")
    for name, value in copy.items():
        print(f"  {name:<18} {value:10.1f}")
    if args.skip_engine:
        return
    comparisons = [engine_rounds("16,384 pages x 16 tokens", CacheConfig(num_kv_blocks=16_384, block_size=16), args),
                   engine_rounds(f"{PAGES:,} pages x 1 token", CacheConfig(num_kv_blocks=PAGES, block_size=1), args)]
    report(comparisons, args)
    plot(copy, comparisons, args.png)


if __name__ == "__main__":
    main()
