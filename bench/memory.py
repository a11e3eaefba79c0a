"""Memory-policy benchmarks on the embedded model.

    python -m bench.memory capacity   # peak sequences held by a page budget: paged vs max-length preallocation
    python -m bench.memory shared     # 32 requests sharing a 1,024-token system prompt, caching on vs off
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagegate import LLM, SamplingParams
from pagegate.core.simulator import compare, seed_trace

BLOCK = 16


def run_and_watch(llm: LLM, prompts: list, params: list) -> dict:
    """Step the engine to completion, sampling page use after every step."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    peak_running = peak_used = 0
    waste = []
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        used = engine.scheduler.pool.num_used_blocks
        peak_used = max(peak_used, used)
        peak_running = max(peak_running, len(running))
        if running:
            held = sum(s.num_computed for s in running)
            waste.append((used * BLOCK - held) / len(running))
    return {"seconds": time.perf_counter() - start, "peak_running": peak_running, "peak_used_blocks": peak_used,
            "waste_tokens_per_seq": float(np.median(waste)) if waste else 0.0}


def capacity(args) -> None:
    sim = compare(seed_trace(20_000, seed=0))
    print(f"simulator (seed scenario, 20 GiB, 16 KiB/token): contiguous holds {sim['contiguous']['peak_concurrent']}"
          f" sequences, paged {sim['paged']['peak_concurrent']}: {sim['capacity_ratio']:.2f}x; waste per paged "
          f"sequence {sim['paged']['waste_per_seq_tokens']:.1f} tokens")
    rng = np.random.default_rng(0)
    pages, max_len = args.pages, 2048
    total = np.clip(rng.exponential(512, args.requests), 32, max_len).astype(int)
    prompt = np.maximum(8, (total * 0.5).astype(int))
    prompts = [rng.integers(10, 2048, n).tolist() for n in prompt]
    params = [SamplingParams(temperature=0, max_tokens=int(t - p), ignore_eos=True) for t, p in zip(total, prompt, strict=True)]
    llm = LLM(None, num_kv_blocks=pages, max_model_len=max_len, max_num_seqs=512, max_num_batched_tokens=4096,
              enable_prefix_caching=False)
    watched = run_and_watch(llm, prompts, params)
    contiguous = pages * BLOCK // max_len
    print(f"engine ({pages} pages = {pages * BLOCK} tokens, max {max_len}, mean actual {total.mean():.0f}): "
          f"contiguous preallocation holds {contiguous} sequences, pagegate held {watched['peak_running']}: "
          f"{watched['peak_running'] / contiguous:.2f}x; median waste {watched['waste_tokens_per_seq']:.1f} tokens "
          f"per sequence (one page = {BLOCK})")


def shared(args) -> None:
    rng = np.random.default_rng(1)
    system = rng.integers(10, 2048, 1024).tolist()
    prompts = [system + rng.integers(10, 2048, 16).tolist() for _ in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 32
    results = {}
    for caching in (False, True):
        llm = LLM(None, num_kv_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048,
                  enable_prefix_caching=caching)
        results[caching] = run_and_watch(llm, prompts, params)
    off, on = results[False], results[True]
    system_pages = 1024 // BLOCK
    print(f"system prompt pages: unshared {32 * system_pages}, shared {system_pages} "
          f"(1/32); peak pages in use {off['peak_used_blocks']} -> "
          f"{on['peak_used_blocks']}")
    print(f"end to end: {off['seconds']:.2f} s without prefix caching, {on['seconds']:.2f} s with: "
          f"{off['seconds'] / on['seconds']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("capacity")
    c.add_argument("--pages", type=int, default=2048)
    c.add_argument("--requests", type=int, default=200)
    sub.add_parser("shared")
    args = parser.parse_args()
    {"capacity": capacity, "shared": shared}[args.command](args)


if __name__ == "__main__":
    main()
