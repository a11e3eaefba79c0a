"""The KV tiers through `pagegate serve` and the OpenAI SDK: a long shared prefix after a restart (disk tier), after
other traffic pushed it out of the pool (host-memory tier), and a workload with no reuse (what the tiers cost),
beside llama-server's `--cache-ram` on the same file and requests.

    python -m bench.kv_tiers [--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--rounds 3] [--prefix 1500]

Each request is the prefix plus 16 new tokens, one output token, streamed: its TTFT is the prefill left after
whatever cache answers. A round runs every case on fresh servers (a fresh disk directory); sides and tiers on/off alternate:
- cold: the prefix's first request; restart: the first request after a clean restart on the same --kv-cache-dir;
- pushed out: the prefix seen twice, then three other prompts of the same length that need the whole pool, then
  the prefix again: served from host memory (tiers on), recomputed (tiers off), and llama-server --cache-ram;
- no reuse: 12 prompts of 512 new tokens x 16 output tokens, 4 at a time, tiers on against off (output tok/s).
Figures are medians over rounds. Writes docs/kv-tiers.md and docs/bench-kv-tiers.png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import openai

from bench.peers import llamacpp
from bench.peers.served import gguf_vocab_size, start_llama_server
from bench.plots import add_png_argument, figure, save_figure, wanted
from pagegate.testing.launcher import ServerProcess

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
KV_MEMORY = "160MiB"  # the pool: about two 1,500-token prefixes of SmolLM2 in its float32 pages
TIERS = ["--kv-offload-memory", "1GiB", "--kv-cache-disk", "4GiB"]
SUFFIX, NO_REUSE, NO_REUSE_LEN, NO_REUSE_GEN = 16, 12, 512, 16


def ttft(base_url: str, prompt: list[int]) -> float:
    """Seconds to the first token of one streamed completion."""
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        model = client.models.list().data[0].id
        started = time.perf_counter()
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].text is not None:
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without a token")


async def _no_reuse(base_url: str, prompts: list[list[int]]) -> float:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        gate = asyncio.Semaphore(4)

        async def one(prompt: list[int]) -> None:
            async with gate:
                await client.completions.create(model=model, prompt=prompt, max_tokens=NO_REUSE_GEN, temperature=0,
                                                extra_body={"ignore_eos": True})

        started = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return len(prompts) * NO_REUSE_GEN / (time.perf_counter() - started)


class Prompts:
    """The round's token ids: one prefix, fresh suffixes, and pushing-out prompts as long as the prefix."""

    def __init__(self, vocab: int, prefix_len: int, seed: int) -> None:
        self.rng, self.vocab = np.random.default_rng(seed), vocab
        self.prefix = self.fresh(prefix_len)
        self.others = [self.fresh(prefix_len + SUFFIX) for _ in range(3)]
        self.no_reuse = [self.fresh(NO_REUSE_LEN) for _ in range(NO_REUSE)]

    def fresh(self, n: int) -> list[int]:
        return self.rng.integers(10, self.vocab, n).tolist()

    def with_prefix(self) -> list[int]:
        return self.prefix + self.fresh(SUFFIX)


def pushed_out(base_url: str, prompts: Prompts) -> dict[str, float]:
    """TTFTs of the prefix: cold, its second request, and after the pushing-out prompts."""
    cold = ttft(base_url, prompts.with_prefix())
    second = ttft(base_url, prompts.with_prefix())
    for other in prompts.others:
        ttft(base_url, other)
    return {"cold": cold, "second": second, "pushed_out": ttft(base_url, prompts.with_prefix())}


def pagegate_round(model: Path, prompts: Prompts, prefix_len: int, tiers_first: bool) -> dict[str, float]:
    """Every pagegate case on fresh servers: tiers off, tiers on, then on again after a clean restart (the tiers-off
    server goes first or last, so the no-reuse pair alternates across rounds)."""
    base = ["--model", str(model), "--kv-cache-memory", KV_MEMORY, "--max-model-len",
            str(max(prefix_len, NO_REUSE_LEN) + SUFFIX + 64), "--disable-uvicorn-access-log", "--disable-dashboard",
            "--grpc-port", "0"]
    figures: dict[str, float] = {}

    def measure(side: str, args: list[str]) -> None:
        with ServerProcess(args) as server:
            figures.update({f"{side}_{k}": v for k, v in pushed_out(server.base_url + "/v1", prompts).items()})
            figures[f"{side}_no_reuse_tok_s"] = asyncio.run(_no_reuse(server.base_url + "/v1", prompts.no_reuse))

    if not tiers_first:
        measure("off", base)
    with tempfile.TemporaryDirectory(prefix="pagegate-kv-") as directory:
        tiers = [*base, *TIERS, "--kv-cache-dir", directory]
        measure("on", tiers)
        with ServerProcess(tiers) as restarted:  # the first one stopped cleanly: its pages are on disk
            figures["on_restart"] = ttft(restarted.base_url + "/v1", prompts.with_prefix())
    if tiers_first:
        measure("off", base)
    return figures


def llama_server_round(model: Path, prompts: Prompts, prefix_len: int, no_repack: bool) -> dict[str, float]:
    process, served = start_llama_server(model, 2, 1, no_repack, context=prefix_len + 64,
                                         extra=("--cache-ram", "1024"))
    try:
        return {f"llama_{k}": v for k, v in pushed_out(served.base_url, prompts).items()}
    finally:
        process.terminate()
        process.wait(30)


def table(figures: dict[str, float], model: Path, prefix_len: int, rounds: int) -> str:
    f = figures
    ms = {k: 1000 * v for k, v in f.items() if k.startswith(("on_", "off_", "llama_"))}
    return "\n".join([
        f"`pagegate serve` on {model.name}, a {prefix_len}-token prefix + {SUFFIX} new tokens, TTFT through the "
        f"OpenAI SDK, median of {rounds} rounds (pool {KV_MEMORY}; tiers: `{' '.join(TIERS)} --kv-cache-dir DIR`).",
        "",
        "| case | TTFT ms | vs recomputing | goal |",
        "|---|---|---|---|",
        f"| cold (first request) | {ms['on_cold']:.0f} | 1 | |",
        f"| after a restart: disk tier | {ms['on_restart']:.0f} | {f['on_restart'] / f['on_cold']:.2f}× cold | ≤ 0.15× |",
        f"| pushed out of the pool: host-memory tier | {ms['on_pushed_out']:.0f} | "
        f"{f['on_pushed_out'] / f['off_pushed_out']:.2f}× | ≤ 0.3× |",
        f"| pushed out, tiers off (recomputed) | {ms['off_pushed_out']:.0f} | 1 | |",
        f"| llama-server --cache-ram 1024: cold / pushed out | {ms['llama_cold']:.0f} / {ms['llama_pushed_out']:.0f} | "
        f"{f['llama_pushed_out'] / f['llama_cold']:.2f}× its cold | |",
        "",
        f"No reuse ({NO_REUSE} prompts of {NO_REUSE_LEN} new tokens x {NO_REUSE_GEN} output, 4 at a time): "
        f"{f['on_no_reuse_tok_s']:.1f} tok/s with tiers on, {f['off_no_reuse_tok_s']:.1f} off "
        f"(median of the rounds' ratios {f['no_reuse_ratio']:.3f}×; goal ≥ 0.97×).",
    ]) + "\n"


def plot(figures: dict[str, float], path: Path) -> None:
    cases = [("cold", "on_cold"), ("restart\n(disk)", "on_restart"), ("pushed out\n(host)", "on_pushed_out"),
             ("pushed out\n(recomputed)", "off_pushed_out"), ("llama-server\ncold", "llama_cold"),
             ("llama-server\npushed out", "llama_pushed_out")]
    fig, ax = figure(width=6.4, height=3.0)
    ax.bar([c for c, _ in cases], [1000 * figures[k] for _, k in cases],
           color=["#8d99ae", "#2a9d8f", "#2a9d8f", "#8d99ae", "#e9c46a", "#e9c46a"])
    ax.set_ylabel("TTFT ms")
    ax.set_title("a long shared prefix: time to first token per case")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix", type=int, default=1500)
    add_png_argument(parser, "kv-tiers")
    args = parser.parse_args()
    llamacpp.build()
    no_repack = llamacpp.repack_crashes()
    vocab = gguf_vocab_size(args.model)
    rows = []
    for index in range(args.rounds):
        prompts = Prompts(vocab, args.prefix, seed=index)
        row: dict[str, float] = {}
        for side in ("pagegate", "llama-server") if index % 2 == 0 else ("llama-server", "pagegate"):
            row |= (pagegate_round(args.model, prompts, args.prefix, tiers_first=index % 2 == 1) if side == "pagegate"
                    else llama_server_round(args.model, prompts, args.prefix, no_repack))
        row["no_reuse_ratio"] = row["on_no_reuse_tok_s"] / row["off_no_reuse_tok_s"]
        print(f"round {index + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
        rows.append(row)
    figures = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    text = table(figures, args.model, args.prefix, args.rounds)
    print(text)
    Path("docs/kv-tiers.md").write_text(f"Made by `python -m bench.kv_tiers --rounds {args.rounds}`.\n\n" + text)
    if wanted(args.png):
        plot(figures, args.png)


if __name__ == "__main__":
    main()
