"""Fair pages per API key: a light key's latency beside a heavy key's flood (issue 60, goal 4).

    python -m bench.fair_keys [--heavy 64] [--light 2] [--window 40] [--rounds 2] [--max-tokens 32]

One server (SmolLM2 Q4_1) with `--api-key-config` naming two keys of equal weight, driven by the official `openai`
SDK. Each round runs two phases of `--window` seconds:

- **alone**: the light key's `--light` users, each sending streamed chat requests one after another;
- **beside**: the same, and the heavy key's `--heavy` users doing the same at once.

Goals: the light key's TTFT p50 beside the flood within 1.5x of alone; the heavy key still takes the rest of the
machine (its output tok/s beside the light key, against the server's output tok/s with the heavy key alone, is
printed: `--heavy-alone` adds that phase). Medians over rounds; bench/results/fair_keys.json keeps every round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.served_bench import RESULTS, serve_args, served_parser  # noqa: E402
from pagegate.testing.launcher import ServerProcess  # noqa: E402

KEYS = {"light": "sk-light-0123456789", "heavy": "sk-heavy-0123456789"}


@dataclass
class Lane:
    """One key's requests in one phase."""

    ttft: list[float] = field(default_factory=list)
    tokens: int = 0

    def p50(self) -> float:
        return statistics.median(self.ttft) if self.ttft else 0.0


async def user(client: openai.AsyncOpenAI, model: str, lane: Lane, index: int, args: argparse.Namespace,
               started: float) -> None:
    """Requests one after another until the window ends (one still running then is not counted)."""
    while time.perf_counter() - started < args.window:
        sent, first, tokens = time.perf_counter(), None, 0
        stream = await client.chat.completions.create(
            model=model, stream=True, max_tokens=args.max_tokens, temperature=0.7, seed=index,
            messages=[{"role": "user", "content": f"Tell me a short story about robot number {index}."}],
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
            if chunk.usage is not None:  # a chunk may carry several tokens under load (--stream-chunk-rate)
                tokens = chunk.usage.completion_tokens
        if time.perf_counter() - started > args.window:
            return
        if first is not None:
            lane.ttft.append(first - sent)
        lane.tokens += tokens
        index += 1000


async def phase(base_url: str, model: str, users: dict[str, int], args: argparse.Namespace) -> dict[str, Lane]:
    lanes = {name: Lane() for name in users}
    clients = {name: openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEYS[name], max_retries=0, timeout=600)
               for name in users}
    started = time.perf_counter()
    await asyncio.gather(*(user(clients[name], model, lanes[name], i, args, started)
                           for name, count in users.items() for i in range(count)))
    for client in clients.values():
        await client.close()
    return lanes


async def bench(base_url: str, args: argparse.Namespace) -> list[dict[str, dict[str, Lane]]]:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEYS["light"]) as client:
        model = (await client.models.list()).data[0].id
    phases = {"alone": {"light": args.light}, "beside": {"light": args.light, "heavy": args.heavy}}
    if args.heavy_alone:
        phases["heavy alone"] = {"heavy": args.heavy}
    rounds = []
    for _ in range(args.rounds):
        measured = {}
        for name, users in phases.items():
            measured[name] = await phase(base_url, model, users, args)
            print(f"{name:>11}: " + ", ".join(
                f"{key} {len(lane.ttft)} requests, TTFT p50 {lane.p50() * 1000:.0f} ms, "
                f"{lane.tokens / args.window:.1f} tok/s" for key, lane in measured[name].items()), flush=True)
        rounds.append(measured)
    return rounds


def report(rounds: list[dict[str, dict[str, Lane]]], args: argparse.Namespace) -> dict[str, float]:
    def median(phase_name: str, key: str, of) -> float:
        return statistics.median(of(r[phase_name][key]) for r in rounds)
    figures = {"light_ttft_p50_alone": median("alone", "light", Lane.p50),
               "light_ttft_p50_beside": median("beside", "light", Lane.p50),
               "heavy_tok_s_beside": median("beside", "heavy", lambda lane: lane.tokens / args.window)}
    if args.heavy_alone:
        figures["heavy_tok_s_alone"] = median("heavy alone", "heavy", lambda lane: lane.tokens / args.window)
    ratio = figures["light_ttft_p50_beside"] / figures["light_ttft_p50_alone"]
    print(f"\nmedians of {len(rounds)} rounds:")
    print(f"light key TTFT p50 {figures['light_ttft_p50_alone'] * 1000:.0f} ms alone, "
          f"{figures['light_ttft_p50_beside'] * 1000:.0f} ms beside {args.heavy} heavy streams: {ratio:.2f}x "
          f"{'✓' if ratio <= 1.5 else '✗'} (goal ≤ 1.5x)")
    heavy = f"heavy key {figures['heavy_tok_s_beside']:.1f} tok/s beside the light key"
    if args.heavy_alone:
        heavy += (f", {figures['heavy_tok_s_alone']:.1f} alone: "
                  f"{figures['heavy_tok_s_beside'] / figures['heavy_tok_s_alone']:.2f}x")
    print(heavy)
    return figures


def main() -> None:
    parser = served_parser(__doc__)
    parser.add_argument("--heavy", type=int, default=64)
    parser.add_argument("--light", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--window", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--heavy-alone", action="store_true", help="also a phase of the heavy key alone")
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".json") as config:
        json.dump([{"name": name, "key": key, "weight": 1} for name, key in KEYS.items()], config)
        config.flush()
        flags = ("--api-key-config", config.name, "--max-num-seqs", str(args.heavy + args.light))
        with ServerProcess(serve_args(args, *flags)) as server:
            rounds = asyncio.run(bench(server.base_url, args))
    figures = report(rounds, args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fair_keys.json").write_text(json.dumps(
        {"args": vars(args), "figures": figures,
         "rounds": [{p: {k: asdict(lane) for k, lane in lanes.items()} for p, lanes in r.items()} for r in rounds]},
        indent=1))


if __name__ == "__main__":
    main()
