"""`pagegate serve` against `llama-server` on the same GGUF file, through the OpenAI SDK: 1, 16 and 64 streams.

    python -m bench.peers.served [--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--rounds 3]

Both servers get the same threads; llama-server runs with --cont-batching and -np = streams (one server per
stream count), pagegate once with --max-num-seqs 64. Every stream sends 128 random token ids, new ones each
round (so neither server's prompt cache hits), and reads 128 tokens (ignore_eos). Rounds alternate pagegate and
llama-server on the same prompts; each figure is the median over rounds:
output tok/s, TTFT p50/p99, the servers' peak RSS, and pagegate's gateway CPU per output token (from /proc: what
the seam between gateway and engine core costs). Writes the table to docs/peers-served.md. On CPUs with AMX,
llama-server runs with --no-repack (its repacking crashes on Q4_1 there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai

from bench.peers import llamacpp
from bench.serve import process_cpu_s
from pagegate.testing.launcher import ServerProcess, descendants, free_port

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT, GEN = 128, 128
STREAMS = (1, 16, 64)


@dataclass
class Served:
    """A running server: its OpenAI base URL and the pids whose CPU and memory count."""

    base_url: str
    pids: Callable[[], list[int]]
    gateway_pid: int | None = None


def rss_bytes(pids: list[int], field: str = "VmRSS") -> int:
    """The processes' `field` of /proc/PID/status summed (VmRSS: now; VmHWM: each one's peak)."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith(field + ":")), 0)
    return total * 1024


def peak_rss_mib(pids: list[int]) -> float:
    return rss_bytes(pids, "VmHWM") / 2**20


async def one_stream(client: openai.AsyncOpenAI, model: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, chunks read) of one streamed completion."""
    started, first, tokens = time.perf_counter(), None, 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=GEN, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            tokens += 1
    return (first or time.perf_counter()) - started, tokens


async def load(base_url: str, prompts: list[list[int]]) -> dict[str, float]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600,
                                  http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=256))) as client:
        model = (await client.models.list()).data[0].id
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, model, p) for p in prompts))
        duration = time.perf_counter() - started
    ttfts = sorted(t for t, _ in results)
    # a chunk can carry more than one token; ignore_eos makes every stream end at GEN
    return {"tok_s": len(prompts) * GEN / duration, "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
            "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "chunks": sum(n for _, n in results)}


def measure(served: Served, prompts: list[list[int]]) -> dict[str, float]:
    gateway_cpu = process_cpu_s(served.gateway_pid) if served.gateway_pid else None
    figures = asyncio.run(load(served.base_url, prompts))
    if served.gateway_pid and gateway_cpu is not None:
        spent = (process_cpu_s(served.gateway_pid) or 0.0) - gateway_cpu
        figures["gateway_cpu_ms_per_token"] = 1000 * spent / (len(prompts) * GEN)
    figures["rss_mib"] = peak_rss_mib(served.pids())
    return figures


def start_llama_server(model: Path, threads: int, streams: int, no_repack: bool, context: int = PROMPT + GEN + 64,
                       extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Served]:
    """llama-server with `streams` slots of `context` tokens each (`extra`: more of its flags)."""
    port = free_port()
    command = [str(llamacpp.binary("llama-server")), "-m", str(model), "-t", str(threads), "-tb", str(threads),
               "--host", "127.0.0.1", "--port", str(port), "-c", str(streams * context),
               "-np", str(streams), "--cont-batching", "--no-webui", *extra] + (["--no-repack"] if no_repack else [])
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return process, Served(base + "/v1", lambda: [process.pid])
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}: {' '.join(command)}")
        time.sleep(0.5)
    raise RuntimeError("llama-server never became healthy")


def gguf_vocab_size(model: Path) -> int:
    from gguf import GGUFReader

    return len(GGUFReader(str(model)).fields["tokenizer.ggml.tokens"].data)


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def run(model: Path, rounds: int, threads: int, no_repack: bool) -> dict[int, dict[str, dict[str, float]]]:
    rng = np.random.default_rng(0)
    pagegate = ServerProcess(["--model", str(model), "--max-num-seqs", "64", "--max-queue", "-1",
                              "--grpc-port", str(free_port()), "--disable-uvicorn-access-log",
                              "--disable-dashboard"]).start()
    gateway_pid = pagegate.process.pid
    ours = Served(pagegate.base_url + "/v1", lambda: [gateway_pid, *descendants(gateway_pid)], gateway_pid)
    results: dict[int, dict[str, dict[str, float]]] = {}
    try:
        vocab = gguf_vocab_size(model)
        for streams in STREAMS:
            process, theirs = start_llama_server(model, threads, streams, no_repack)
            try:
                sides = {"pagegate": ours, "llama-server": theirs}
                warm_up = [rng.integers(10, vocab, PROMPT).tolist() for _ in range(2)]
                for served in sides.values():  # not counted
                    asyncio.run(load(served.base_url, warm_up))
                samples: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
                for index in range(rounds):
                    prompts = [rng.integers(10, vocab, PROMPT).tolist() for _ in range(streams)]
                    for side, served in sides.items():
                        samples[side].append(measure(served, prompts))
                        row = samples[side][-1]
                        print(f"{streams} streams, round {index + 1}, {side}: {row['tok_s']:.1f} tok/s, TTFT p50 "
                              f"{row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms", flush=True)
                results[streams] = {side: summarize(rows) for side, rows in samples.items()}
            finally:
                process.terminate()
                process.wait(30)
    finally:
        pagegate.stop()
    return results


def table(results: dict[int, dict[str, dict[str, float]]], model: Path, threads: int, rounds: int) -> str:
    lines = [f"`pagegate serve` / `llama-server` on {model.name}, {threads} threads each, OpenAI SDK streams of "
             f"{PROMPT} prompt + {GEN} output tokens, median of {rounds} alternating rounds.", "",
             "| streams | output tok/s (ratio) | TTFT p50 ms | TTFT p99 ms | peak RSS MiB | gateway CPU ms/token |",
             "|---|---|---|---|---|---|"]
    for streams, sides in results.items():
        ours, theirs = sides["pagegate"], sides["llama-server"]
        lines.append(f"| {streams} | {ours['tok_s']:.1f} / {theirs['tok_s']:.1f} ({ours['tok_s'] / theirs['tok_s']:.2f}×)"
                     f" | {ours['ttft_p50_ms']:.0f} / {theirs['ttft_p50_ms']:.0f}"
                     f" | {ours['ttft_p99_ms']:.0f} / {theirs['ttft_p99_ms']:.0f}"
                     f" | {ours['rss_mib']:.0f} / {theirs['rss_mib']:.0f}"
                     f" | {ours.get('gateway_cpu_ms_per_token', float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llamacpp.build()
    no_repack = llamacpp.repack_crashes()
    results = run(args.model, args.rounds, args.threads, no_repack)
    text = table(results, args.model, args.threads, args.rounds)
    print(text)
    note = " llama-server ran with --no-repack (AMX CPU)." if no_repack else ""
    Path("docs/peers-served.md").write_text(f"Made by `python -m bench.peers.served --rounds {args.rounds}`.{note}\n\n"
                                            + text)
    out = Path("bench/results/served.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
