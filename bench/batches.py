"""Batch lines in the idle capacity: what a batch beside online traffic costs the online users (issue 60, goal 3).

    python -m bench.batches [--lines 2000] [--streams 16] [--window 60] [--rounds 2]

One server (SmolLM2 Q4_1, `--batch-dir` in a temporary folder), driven by the official `openai` SDK. Each round
runs three phases of `--window` seconds, in turn:

- **online**: `--streams` streamed chat requests (`--max-tokens` tokens, ignore_eos) arriving as a Poisson process
  over the window (exponential gaps of mean window / streams, the same draws in every phase). Per request: time to
  first token, and its output rate (its tokens over its time, from sending to the last chunk).
- **batch**: a `--lines`-line batch (`/v1/chat/completions`, the same length of answer) on an otherwise idle
  server; its throughput is the slope of `request_counts.completed` over the window (polled every half second).
- **both**: a fresh batch of the same lines, and the online users beside it.

Goals: online TTFT p99 and output tok/s (the median request's) beside the batch within 10% of alone; the batch beside online traffic at
≥ 70% of its idle throughput. The medians over rounds are printed with their ratios; the PNG
(docs/bench-batches.png) draws both lanes over time in the last round's phases; bench/results/batches.json
keeps every round.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.plots import add_png_argument, figure, save_figure, wanted  # noqa: E402
from bench.served_bench import RESULTS, serve_args, served_parser  # noqa: E402
from pagegate.testing.launcher import ServerProcess  # noqa: E402

TOPICS = ["the sea", "a lighthouse", "winter", "a market", "the moon", "a library", "bread", "a river", "trains",
          "a garden", "mountains", "a clock", "rain", "a violin", "the desert", "bees"]


@dataclass
class Phase:
    """One phase's figures."""

    name: str
    ttft: list[float] = field(default_factory=list)  # seconds, every online request
    rates: list[float] = field(default_factory=list)  # each online request's output tokens over its whole time
    online_tokens: int = 0
    batch_lines: list[tuple[float, int]] = field(default_factory=list)  # (seconds into the phase, completed)
    online_done: list[tuple[float, int]] = field(default_factory=list)  # (seconds into the phase, tokens so far)
    window: float = 0.0

    def ttft_p(self, q: float) -> float:
        return statistics.quantiles(self.ttft, n=100, method="inclusive")[int(q) - 1] if len(self.ttft) > 1 else 0.0

    @property
    def online_tok_s(self) -> float:
        return statistics.median(self.rates) if self.rates else 0.0

    @property
    def batch_lines_s(self) -> float:
        """Lines a second over the window's second half to its end (the first half lets the lane fill)."""
        if len(self.batch_lines) < 2:
            return 0.0
        half = [(t, n) for t, n in self.batch_lines if t >= self.window / 2] or self.batch_lines[-2:]
        (t0, n0), (t1, n1) = half[0], half[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def chat_body(i: int, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]}."}],
            "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "ignore_eos": True}


async def online_stream(client: openai.AsyncOpenAI, model: str, i: int, at: float, args: argparse.Namespace,
                        phase: Phase, started: float) -> None:
    """One streamed request, sent `at` seconds into the phase."""
    await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
    sent = time.perf_counter()
    first, tokens = None, 0
    stream = await client.chat.completions.create(model=model, stream=True, messages=chat_body(i, 0)["messages"],
                                                  max_tokens=args.max_tokens, temperature=0.7, seed=i,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
        if chunk.usage is not None:  # a chunk may carry several tokens: count them from the usage
            tokens = chunk.usage.completion_tokens
    now = time.perf_counter()
    if first is not None:
        phase.ttft.append(first - sent)
        phase.rates.append(tokens / (now - sent))
    phase.online_tokens += tokens
    phase.online_done.append((now - started, phase.online_tokens))


def arrivals(args: argparse.Namespace, seed: int) -> list[float]:
    """`--streams` arrival times: a Poisson process of rate streams / window, cut at the window's end."""
    rng, t, times = random.Random(seed), 0.0, []
    while len(times) < args.streams:
        t += rng.expovariate(args.streams / args.window)
        times.append(min(t, args.window * 0.95))
    return times


async def watch_batch(client: openai.AsyncOpenAI, batch_id: str, phase: Phase, started: float) -> None:
    while (now := time.perf_counter() - started) < phase.window:
        batch = await client.batches.retrieve(batch_id)
        phase.batch_lines.append((now, batch.request_counts.completed if batch.request_counts else 0))
        await asyncio.sleep(0.5)


async def submit_batch(client: openai.AsyncOpenAI, model: str, args: argparse.Namespace, salt: int) -> str:
    lines = [json.dumps({"custom_id": f"line-{salt}-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, **chat_body(i, args.max_tokens)}}) for i in range(args.lines)]
    upload = await client.files.create(file=("lines.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    return batch.id


async def run_phase(client: openai.AsyncOpenAI, model: str, args: argparse.Namespace, name: str,
                    round_no: int) -> Phase:
    phase = Phase(name, window=args.window)
    batch_id = await submit_batch(client, model, args, round_no) if name != "online" else None
    started = time.perf_counter()
    tasks = []
    if batch_id:
        tasks.append(watch_batch(client, batch_id, phase, started))
    if name != "batch":
        tasks += [online_stream(client, model, i, at, args, phase, started)
                  for i, at in enumerate(arrivals(args, round_no))]
    await asyncio.gather(*tasks)
    if batch_id and (await client.batches.retrieve(batch_id)).status not in ENDED:
        await client.batches.cancel(batch_id)
        await wait_cancelled(client, batch_id)
    return phase


ENDED = ("cancelled", "completed", "failed", "expired")  # a batch's statuses once it ends


async def wait_cancelled(client: openai.AsyncOpenAI, batch_id: str) -> None:
    """Until the cancelled batch's lines in flight have ended (the next phase starts on an idle server)."""
    for _ in range(600):
        if (await client.batches.retrieve(batch_id)).status in ENDED:
            return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"batch {batch_id} did not end after its cancel")


async def bench(base_url: str, args: argparse.Namespace) -> list[dict[str, Phase]]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    warm = Phase("warm-up", window=1.0)
    await asyncio.gather(*(online_stream(client, model, i, 0.0, args, warm, time.perf_counter()) for i in range(4)))
    rounds = []
    for r in range(args.rounds):
        phases = {}
        for name in ("online", "batch", "both"):
            phases[name] = await run_phase(client, model, args, name, r)
            print(summary(phases[name]), flush=True)
        rounds.append(phases)
    await client.close()
    return rounds


def summary(phase: Phase) -> str:
    return (f"{phase.name:>6}: online {len(phase.ttft)} requests, TTFT p50 {phase.ttft_p(50) * 1000:.0f} ms "
            f"p99 {phase.ttft_p(99) * 1000:.0f} ms, {phase.online_tok_s:.1f} tok/s; batch {phase.batch_lines_s:.2f} "
            "lines/s")


def report(rounds: list[dict[str, Phase]]) -> dict[str, float]:
    def median(name: str, figure_of) -> float:
        return statistics.median(figure_of(r[name]) for r in rounds)
    figures = {
        "online_ttft_p99_alone": median("online", lambda p: p.ttft_p(99)),
        "online_ttft_p99_beside": median("both", lambda p: p.ttft_p(99)),
        "online_tok_s_alone": median("online", lambda p: p.online_tok_s),
        "online_tok_s_beside": median("both", lambda p: p.online_tok_s),
        "batch_lines_s_idle": median("batch", lambda p: p.batch_lines_s),
        "batch_lines_s_beside": median("both", lambda p: p.batch_lines_s),
    }
    ttft = figures["online_ttft_p99_beside"] / figures["online_ttft_p99_alone"]
    tok = figures["online_tok_s_beside"] / figures["online_tok_s_alone"]
    lane = figures["batch_lines_s_beside"] / figures["batch_lines_s_idle"]
    print(f"\nmedians of {len(rounds)} rounds:")
    print(f"online TTFT p99   {figures['online_ttft_p99_alone'] * 1000:.0f} ms alone, "
          f"{figures['online_ttft_p99_beside'] * 1000:.0f} ms beside the batch: {ttft:.2f}x "
          f"{'✓' if ttft <= 1.10 else '✗'} (goal ≤ 1.10x)")
    print(f"online tok/s      {figures['online_tok_s_alone']:.1f} alone, {figures['online_tok_s_beside']:.1f} beside: "
          f"{tok:.2f}x {'✓' if tok >= 0.90 else '✗'} (goal ≥ 0.90x)")
    print(f"batch lines/s     {figures['batch_lines_s_idle']:.2f} idle, {figures['batch_lines_s_beside']:.2f} beside "
          f"online: {lane:.2f}x {'✓' if lane >= 0.70 else '✗'} (goal ≥ 0.70x)")
    return figures


def draw(phases: dict[str, Phase], path: Path) -> None:
    fig, (left, right) = figure(ncols=2, width=9.0)
    for name, style in (("batch", "--"), ("both", "-")):
        points = phases[name].batch_lines
        left.plot([t for t, _ in points], [n for _, n in points], style,
                  label="on an idle server" if name == "batch" else "beside the online requests")
    left.set(xlabel="seconds", ylabel="batch lines completed", title="batch lane")
    left.legend(fontsize=7)
    for name, style in (("online", "--"), ("both", "-")):
        points = phases[name].online_done
        right.plot([t for t, _ in points], [n for _, n in points], style,
                   label=f"online tokens, {'alone' if name == 'online' else 'beside the batch'}")
    right.set(xlabel="seconds", ylabel="online output tokens", title="online lane")
    right.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = served_parser(__doc__)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--window", type=float, default=60.0, help="seconds a phase runs")
    parser.add_argument("--rounds", type=int, default=2)
    add_png_argument(parser, "batches")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagegate-batches-") as batch_dir:
        with ServerProcess(serve_args(args, "--batch-dir", batch_dir)) as server:
            rounds = asyncio.run(bench(server.base_url, args))
    figures = report(rounds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batches.json").write_text(json.dumps(
        {"args": vars(args) | {"png": str(args.png)}, "figures": figures,
         "rounds": [{name: asdict(p) for name, p in r.items()} for r in rounds]}, indent=1))
    if wanted(args.png):
        draw(rounds[-1], args.png)


if __name__ == "__main__":
    main()
