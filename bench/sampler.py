"""The sampler's two paths on the same logits: the C sampler (kernels/cpu_sample.h, rows no processor touches) and
torch's (penalties, bias, grammar, CUDA), per call of a batch of rows over a 128k vocabulary (a Llama 3 tokenizer's).

    python -m bench.sampler [--rounds 5] [--vocab 128256]

Rounds alternate the two paths; each figure is the median over rounds of the mean of 5 calls."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.sampler import Sampler, SamplingRow

CASES = [
    (16, {"temperature": 0}),
    (16, {"temperature": 0, "logprobs": 5}),
    (16, {"temperature": 0.8, "top_p": 0.95}),
    (64, {"temperature": 0.7, "top_p": 0.9, "top_k": 40}),
]


def seconds_per_call(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], calls: int = 5) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        sampler(logits, rows)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    print("| rows | parameters | C (ms) | torch (ms) | torch / C |\n|---|---|---|---|---|")
    for count, params in CASES:
        logits = torch.randn(count, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
        rows = [SamplingRow(SamplingParams(**params), [1], []) for _ in range(count)]
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for native in (True, False):
                sampler = Sampler([2])
                sampler.native = native
                times[native].append(seconds_per_call(sampler, logits, rows))
        c, t = (statistics.median(times[native]) * 1e3 for native in (True, False))
        print(f"| {count} | {params} | {c:.2f} | {t:.2f} | {t / c:.1f}x |")


if __name__ == "__main__":
    main()
