"""Paged decode attention (torch reference) against SDPA over the same KV laid out contiguously.

    python bench/bench_kernels.py              # side by side in one process: medians and the ratio
    pytest bench/bench_kernels.py --benchmark-enable --benchmark-only   # pytest-benchmark, group decode-attention

Default shape (issue #3): batch 32, context 1,024, 8 heads, head_dim 64, float32, 16-token pages
in a shuffled (non-contiguous) page pool. Goal: paged >= 0.7x the speed of contiguous SDPA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from pagegate.kernels import paged_attention  # noqa: E402


@dataclass
class DecodeCase:
    """One decode step's inputs, paged and contiguous."""

    paged: Callable[[], torch.Tensor]
    sdpa: Callable[[], torch.Tensor]


def make_decode_case(batch: int = 32, context: int = 1024, heads: int = 8, kv_heads: int = 8, head_dim: int = 64,
                     dtype: torch.dtype = torch.float32, block_size: int = 16, seed: int = 0) -> DecodeCase:
    """Random K/V in shuffled pages of a pool, plus the same K/V as contiguous [B, Hkv, L, D]."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-context // block_size)
    num_blocks = batch * pages_per_seq + 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: batch * pages_per_seq].view(batch, -1).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    k_contig, v_contig = (cache[block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
                          for cache in (k_cache, v_cache))
    scale = head_dim ** -0.5

    def paged() -> torch.Tensor:
        return paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                               backend="reference")

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(query[:, :, None], k_contig, v_contig, scale=scale,
                                              enable_gqa=heads != kv_heads)

    return DecodeCase(paged, sdpa)


def time_side_by_side(case: DecodeCase, repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds of each, measured alternately so machine noise hits both alike, and the
    median of the per-repeat speed ratios (sdpa time / paged time)."""
    for _ in range(warmup):
        case.paged(), case.sdpa()
    paged, sdpa = [], []
    for _ in range(repeats):
        for fn, times in ((case.paged, paged), (case.sdpa, sdpa)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return {"paged": statistics.median(paged), "sdpa": statistics.median(sdpa),
            "ratio": statistics.median(s / p for s, p in zip(sdpa, paged, strict=True))}


@pytest.fixture(scope="module")
def decode_case() -> DecodeCase:
    case = make_decode_case()
    torch.testing.assert_close(case.paged(), case.sdpa()[:, :, 0], rtol=1e-4, atol=1e-5)
    return case


@pytest.mark.benchmark(group="decode-attention")
def test_paged_decode_reference(benchmark, decode_case):
    benchmark(decode_case.paged)


@pytest.mark.benchmark(group="decode-attention")
def test_contiguous_sdpa(benchmark, decode_case):
    benchmark(decode_case.sdpa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="independent rounds, each with its own medians")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    case = make_decode_case(args.batch, args.context, args.heads, args.kv_heads, args.head_dim,
                            getattr(torch, args.dtype))
    expected = case.sdpa()[:, :, 0].float()
    torch.testing.assert_close(case.paged().float(), expected, rtol=1e-4 if args.dtype == "float32" else 2e-2,
                               atol=1e-5 if args.dtype == "float32" else 2e-2)
    print(f"decode attention, batch {args.batch} x context {args.context}, {args.heads} heads "
          f"({args.kv_heads} KV), head_dim {args.head_dim}, {args.dtype}, {torch.get_num_threads()} threads")
    for round_ in range(args.rounds):
        result = time_side_by_side(case, args.repeats)
        print(f"round {round_ + 1}: paged reference {result['paged'] * 1e3:7.2f} ms   contiguous SDPA "
              f"{result['sdpa'] * 1e3:7.2f} ms   paged speed = {result['ratio']:.2f}x SDPA")


if __name__ == "__main__":
    main()
