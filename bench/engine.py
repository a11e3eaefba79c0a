"""Engine benchmarks.

    python -m bench.engine throughput [--requests 256]   # LLM.generate vs transformers static batches of 32
    python -m bench.engine throughput --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --requests 128
    python -m bench.engine step                          # scheduler + batch builder CPU time, 256 decoding seqs

Each writes docs/bench-engine-<command>.png (`--png PATH`, `--png ''` for none).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pagegate import LLM, SamplingParams
from pagegate.config import CacheConfig, SchedulerConfig
from pagegate.core import BatchBuilder
from pagegate.engine.loading.gguf_file import is_gguf
from pagegate.engine.loading.loader import DEFAULT_MODEL, peak_rss_mib
from pagegate.engine.scheduler import Scheduler
from pagegate.engine.sequence import Request, Sequence

from .plots import COLOURS, add_png_argument, figure, labelled_bars, save_figure, wanted


def workload(num: int, vocab: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
             seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs, both lengths uniform in their inclusive ranges."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(10, vocab, int(rng.integers(prompt_lens[0], prompt_lens[1] + 1))).tolist(),
             int(rng.integers(output_lens[0], output_lens[1] + 1))) for _ in range(num)]


def run_pagegate(model: str | None, requests, **llm_kwargs) -> tuple[float, float]:
    """(load seconds, generation seconds) of LLM.generate over every request at once; prints preemptions."""
    start = time.perf_counter()
    llm = LLM(model, **llm_kwargs)
    loaded = time.perf_counter() - start
    llm.generate([p for p, _ in requests[:4]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    llm.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    print(f"pagegate: {llm.stats().num_blocks} KV pages, {llm.stats().preemptions} preemptions")
    return loaded, elapsed


def load_transformers(model: str | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model is None:
        return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    path = Path(model)
    if is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_transformers(model: str | None, requests, batch_size: int = 32) -> tuple[float, float]:
    """(load seconds, generation seconds) of `generate` in static, left-padded batches."""
    start = time.perf_counter()
    hf_model = load_transformers(model)
    loaded = time.perf_counter() - start
    start = time.perf_counter()
    for i in tqdm(range(0, len(requests), batch_size), desc="transformers batches", leave=False):
        batch = requests[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)  # a static batch runs until its longest request is done
        with torch.inference_mode():
            hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                              min_new_tokens=longest, pad_token_id=0)
    return loaded, time.perf_counter() - start


def throughput(args) -> None:
    torch.set_num_threads(2)
    if args.model is None:
        requests = workload(args.requests, 2048, (20, 400), (20, 300))
    else:  # the real-model workload
        requests = workload(args.requests, 49152 if is_gguf(Path(args.model)) else 32000, (64, 512), (64, 256))
    tokens = sum(n for _, n in requests)
    our_load, ours = run_pagegate(args.model, requests, max_num_seqs=256, kv_cache_memory=args.kv_cache_memory,
                                  max_num_batched_tokens=args.max_num_batched_tokens)
    our_rss = peak_rss_mib()
    their_load, theirs = run_transformers(args.model, requests)
    print(f"model {args.model or 'pagegate-default'}: {len(requests)} requests, {tokens} output tokens")
    print(f"pagegate LLM.generate:           {ours:7.1f} s  {tokens / ours:8.1f} output tokens/s  "
          f"(load {our_load:.1f} s, peak RSS {our_rss:.0f} MiB)")
    print(f"transformers, static batches 32: {theirs:7.1f} s  {tokens / theirs:8.1f} output tokens/s  "
          f"(load {their_load:.1f} s, peak RSS of both {peak_rss_mib():.0f} MiB)")
    print(f"speed-up: {theirs / ours:.2f}x (goal >= 5x)")
    if wanted(args.png):
        fig, ax = figure(width=4.5, height=3)
        labelled_bars(ax, ["pagegate\nLLM.generate", "transformers\nstatic batches of 32"],
                      [tokens / ours, tokens / theirs], color=[COLOURS["pagegate"], COLOURS["seed"]])
        ax.set(title=f"{Path(args.model).name if args.model else 'default model'}: {len(requests)} requests, "
                     f"speed-up {theirs / ours:.1f}x", ylabel="output tokens / s")
        save_figure(fig, args.png)


def step(args) -> None:
    """CPU time of Scheduler.schedule() + BatchBuilder.build() with 256 running decoding sequences."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096),
                          CacheConfig(enable_prefix_caching=True), 256 * 40, 0, 2048)
    builder = BatchBuilder(scheduler.tables, 256, 4096)
    rng = np.random.default_rng(0)
    for i in range(256):
        request = Request(str(i), None, rng.integers(0, 2048, 200).tolist(), SamplingParams(max_tokens=400))
        seq = Sequence(request, 0, list(request.prompt_token_ids), 200)
        request.seqs.append(seq)
        scheduler.add(seq)
    scheduler.schedule()  # prefill everyone (reserves 200 tokens each)
    samples = []
    for _ in range(args.steps):
        for seq in scheduler.running:
            seq.token_ids.append(int(rng.integers(0, 2048)))  # what the sampler would have produced
        start = time.perf_counter_ns()
        batch = scheduler.schedule()
        builder.build([s.handle for s in batch.seqs], batch.num_tokens)
        samples.append(time.perf_counter_ns() - start)
    assert len(batch.seqs) == 256 and set(batch.num_tokens) == {1}
    print(f"scheduler + batch builder, 256 decoding sequences: median {statistics.median(samples) / 1e3:.0f} us "
          f"per step over {args.steps} steps (goal <= 1000 us)")
    if wanted(args.png):
        fig, ax = figure(width=5, height=2.8)
        us = np.asarray(samples) / 1e3
        ax.hist(us, bins=np.geomspace(us.min(), max(us.max(), 1000) * 1.05, 50), color=COLOURS["pagegate"])
        ax.axvline(statistics.median(samples) / 1e3, color="black", lw=1, label="median")
        ax.axvline(1000, color="#e76f51", lw=1.5, label="goal (1 ms)")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter("")
        ticks = [t for t in (50, 100, 200, 500, 1000, 2000, 5000) if us.min() / 2 < t < us.max() * 2 or t == 1000]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set(title="scheduler + batch builder, 256 decoding sequences", xlabel="us per step (log)", ylabel="steps")
        ax.legend()
        save_figure(fig, args.png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--requests", type=int, default=256)
    t.add_argument("--model", default=None, help="a HF folder or GGUF file (default: the embedded model)")
    t.add_argument("--kv-cache-memory", default="1GiB", help="pagegate's KV pool (transformers has no limit)")
    t.add_argument("--max-num-batched-tokens", type=int, default=2048)
    add_png_argument(t, "engine-throughput")
    s = sub.add_parser("step")
    s.add_argument("--steps", type=int, default=200)
    add_png_argument(s, "engine-step")
    args = parser.parse_args()
    {"throughput": throughput, "step": step}[args.command](args)


if __name__ == "__main__":
    main()
