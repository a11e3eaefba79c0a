"""Two pagegate servers on this machine, 8 long shared system prompts x many users, routed (a) round-robin and
(b) by the servers' KV-cache events (bench/kv_router.py). Reports the prefix-cache hit rate (cached tokens
over the reusable system-prompt tokens), TTFT p50/p99 and output throughput.

    python -m bench.fleet                      # 160 requests per routing, 8 at a time

Each server's pool holds about 5 of the 8 system prompts: round-robin makes both servers cycle through all 8
(evicting), routing by prefix gives each server its own 4 to keep. Writes docs/bench-fleet.png (`--png PATH`,
`--png ''` for none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.kv_router import KVRouter
from bench.plots import COLOURS, add_png_argument, figure, labelled_bars, save_figure, wanted
from pagegate.testing.launcher import ServerProcess, free_port

BLOCK = 16
SYSTEM_TOKENS = 512  # 32 pages each


def server_args(events_port: int, pages: int) -> list[str]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}",
              "topic": "kv"}
    return ["--device", "cpu", "--grpc-port", "0", "--num-kv-blocks", str(pages), "--max-model-len", "1024",
            "--disable-uvicorn-access-log", "--log-level", "warning", "--kv-events-config", json.dumps(events)]


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
    """(TTFT seconds, cached tokens, output tokens) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, usage = time.perf_counter(), None, {}
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"]:
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return ttft or 0.0, usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]


async def run(urls: list[str], prompts: list[list[int]], route: Callable[[list[int]], int], release: Callable[[int], None],
              concurrency: int, max_tokens: int, label: str = "requests") -> dict[str, float]:
    semaphore = asyncio.Semaphore(concurrency)
    results: list[tuple[float, int, int]] = []
    progress = tqdm(total=len(prompts), desc=label, leave=False)

    async def send(client: httpx.AsyncClient, prompt: list[int]) -> None:
        async with semaphore:
            server = route(prompt)
            try:
                results.append(await one_request(client, urls[server], prompt, max_tokens))
            finally:
                release(server)
                progress.update()

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(send(client, p) for p in prompts))
    elapsed = time.perf_counter() - start
    progress.close()
    ttfts = sorted(r[0] for r in results)
    reusable = (len(prompts) - len({tuple(p[:SYSTEM_TOKENS]) for p in prompts})) * (SYSTEM_TOKENS // BLOCK) * BLOCK
    return {"hit_rate": sum(r[1] for r in results) / reusable, "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "tok_s": sum(r[2] for r in results) / elapsed}


def workload(requests: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 2000) for _ in range(SYSTEM_TOKENS)] for _ in range(8)]
    return [rng.choice(systems) + [rng.randrange(3, 2000) for _ in range(rng.randrange(8, 48))]
            for _ in range(requests)]


def measure(routing: str, args: argparse.Namespace) -> dict[str, float]:
    ports = [free_port(), free_port()]
    router = KVRouter(ports, b"kv")
    servers = [ServerProcess(server_args(port, args.pages)).start() for port in ports]
    turn = iter(range(10**9))

    def route(prompt: list[int]) -> int:
        server = router.choose(prompt) if routing == "kv-events" else next(turn) % 2
        router.in_flight[server] += 1
        return server

    def release(server: int) -> None:
        router.in_flight[server] -= 1

    try:
        return asyncio.run(run([s.base_url for s in servers], workload(args.requests), route, release,
                               args.concurrency, args.max_tokens, routing))
    finally:
        for server in servers:
            server.stop()
        router.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--pages", type=int, default=176, help="KV pages per server (~5 system prompts)")
    add_png_argument(parser, "fleet")
    args = parser.parse_args()
    rows = {routing: measure(routing, args) for routing in ("round-robin", "kv-events")}
    print(f"2 servers x {args.pages} pages, {args.requests} requests ({args.concurrency} at a time), "
          f"8 system prompts of {SYSTEM_TOKENS} tokens; hits are over the reusable prefix tokens (every "
          "request's system prompt but the first of each)")
    print(f"{'routing':>12} {'prefix hits':>12} {'TTFT p50':>9} {'TTFT p99':>9} {'output tok/s':>12}")
    for name, row in rows.items():
        print(f"{name:>12} {row['hit_rate']:11.0%} {row['ttft_p50'] * 1e3:7.0f}ms {row['ttft_p99'] * 1e3:7.0f}ms "
              f"{row['tok_s']:12.1f}")
    if wanted(args.png):
        plot(rows, args, args.png)


def plot(rows: dict[str, dict[str, float]], args: argparse.Namespace, path: Path) -> None:
    fig, (hits, ttft, rate) = figure(3, width=8, height=2.6)
    names, colours = list(rows), [COLOURS["seed"], COLOURS["pagegate"]]
    labelled_bars(hits, names, [rows[n]["hit_rate"] * 100 for n in names], "{:.0f}%", color=colours)
    hits.set(title="prefix-cache hits (% of reusable)")
    for offset, key, alpha in ((-0.2, "ttft_p50", 1.0), (0.2, "ttft_p99", 0.5)):
        bars = ttft.bar([i + offset for i in range(len(names))], [rows[n][key] * 1e3 for n in names], 0.4,
                        color=colours, alpha=alpha)
        ttft.bar_label(bars, labels=[key[-3:]] * len(names), fontsize=7)
    ttft.set_xticks(range(len(names)), names)
    ttft.set_ylim(0, max(rows[n]["ttft_p99"] for n in names) * 1e3 * 1.15)
    ttft.set(title="TTFT, ms (p50, p99)")
    labelled_bars(rate, names, [rows[n]["tok_s"] for n in names], "{:.1f}", color=colours)
    rate.set(title="output tokens / s")
    fig.suptitle(f"2 servers x {args.pages} pages, {args.requests} requests, 8 shared system prompts", fontsize=9)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
