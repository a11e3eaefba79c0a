"""Engine benchmarks.

    python -m bench.engine throughput [--requests 256]   # LLM.generate vs transformers static batches of 32
    python -m bench.engine step                          # scheduler + batch builder CPU time, 256 decoding seqs
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagegate import LLM, SamplingParams
from pagegate.config import CacheConfig, SchedulerConfig
from pagegate.core import BatchBuilder
from pagegate.engine.engine import DEFAULT_MODEL
from pagegate.engine.scheduler import Scheduler
from pagegate.engine.sequence import Request, Sequence


def workload(num: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length): prompts of 20-400 tokens, outputs of 20-300."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(10, vocab, int(rng.integers(20, 401))).tolist(), int(rng.integers(20, 301)))
            for _ in range(num)]


def run_pagegate(requests, **llm_kwargs) -> float:
    llm = LLM(None, **llm_kwargs)
    llm.generate([p for p, _ in requests[:4]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    llm.generate([p for p, _ in requests], params, use_tqdm=False)
    return time.perf_counter() - start


def run_transformers(requests, batch_size: int = 32) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)  # a static batch runs until its longest request is done
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                           min_new_tokens=longest, pad_token_id=0)
    return time.perf_counter() - start


def throughput(args) -> None:
    torch.set_num_threads(2)
    requests = workload(args.requests, 2048)
    tokens = sum(n for _, n in requests)
    ours = run_pagegate(requests, max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens)
    theirs = run_transformers(requests)
    print(f"{len(requests)} requests, {tokens} output tokens")
    print(f"pagegate LLM.generate:          {ours:7.1f} s  {tokens / ours:8.1f} output tokens/s")
    print(f"transformers, static batches 32: {theirs:7.1f} s  {tokens / theirs:8.1f} output tokens/s")
    print(f"speed-up: {theirs / ours:.2f}x (goal >= 5x)")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--requests", type=int, default=256)
    t.add_argument("--max-num-batched-tokens", type=int, default=2048)
    s = sub.add_parser("step")
    s.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    {"throughput": throughput, "step": step}[args.command](args)


if __name__ == "__main__":
    main()
