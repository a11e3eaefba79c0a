"""Paged decode attention on CPU: the fused kernel, the torch gather path, and contiguous SDPA.

    python bench/bench_kernels.py              # side by side in one process: medians and ratios
    python bench/bench_kernels.py --mixed      # engine-like batch: 128 contexts of 20..700, 4 heads / 2 KV
    pytest bench/bench_kernels.py --benchmark-enable --benchmark-only   # pytest-benchmark, group decode-attention

"fused" is pagegate.kernels.cpu_paged (what backend "auto" runs on CPU float32); "gather" is the
torch reference (backend "reference"), which copies pages into a dense buffer before SDPA; "sdpa"
is scaled_dot_product_attention over the same K/V laid out contiguously (uniform contexts only).

Default shape (issue #3): batch 32, context 1,024, 8 heads, head_dim 64, float32, 16-token pages
in a shuffled (non-contiguous) page pool. Goal: paged >= 0.7x the speed of contiguous SDPA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from pagegate.kernels import AttentionOps  # noqa: E402
from pagegate.kernels.dispatch import cpu_kernel  # noqa: E402

Case = dict[str, Callable[[], torch.Tensor]]  # name -> one decode step


def make_decode_case(batch: int = 32, context: int | list[int] = 1024, heads: int = 8, kv_heads: int = 8,
                     head_dim: int = 64, dtype: torch.dtype = torch.float32, block_size: int = 16,
                     seed: int = 0) -> Case:
    """One decode step over random K/V in shuffled pages of a pool, as each contender runs it.
    `context` is one length for all sequences, or one per sequence (then there is no SDPA entry)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [context] * batch if isinstance(context, int) else context
    pages_per_seq = -(-max(lens) // block_size)
    num_blocks = batch * pages_per_seq + 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: batch * pages_per_seq].view(batch, -1).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5

    def run(backend: str) -> Callable[[], torch.Tensor]:
        ops = AttentionOps(query.device, backend)  # chosen once, as a model does
        return lambda: ops.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)

    case = {"gather": run("reference")}
    kernel = cpu_kernel()
    if kernel is not None and kernel.supports(query, k_cache, v_cache):
        case["fused"] = run("auto")  # "auto" beats a PAGEGATE_KERNEL_BACKEND left in the shell
    if isinstance(context, int):
        k_contig, v_contig = (cache[block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
                              for cache in (k_cache, v_cache))
        case["sdpa"] = lambda: F.scaled_dot_product_attention(query[:, :, None], k_contig, v_contig, scale=scale,
                                                              enable_gqa=heads != kv_heads)[:, :, 0]
    return case


def time_side_by_side(case: Case, repeats: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of every repeat of each contender, run alternately so machine noise hits all alike."""
    for _ in range(warmup):
        for fn in case.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in case}
    for _ in range(repeats):
        for name, fn in case.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def speed_ratio(times: dict[str, list[float]], name: str, baseline: str) -> float:
    """Median over repeats of baseline time / `name` time: how many times faster `name` runs."""
    return statistics.median(b / t for b, t in zip(times[baseline], times[name], strict=True))


def check_agreement(case: Case, dtype: torch.dtype) -> None:
    """Every contender returns the same attention (to the dtype's tolerance)."""
    results = {name: fn().float() for name, fn in case.items()}
    expected = results.pop("sdpa", None)
    if expected is None:
        expected = results.pop("gather")
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for result in results.values():
        torch.testing.assert_close(result, expected, **tol)


@pytest.fixture(scope="module")
def decode_case() -> Case:
    case = make_decode_case()
    check_agreement(case, torch.float32)
    return case


@pytest.mark.benchmark(group="decode-attention")
def test_paged_decode_reference(benchmark, decode_case):
    benchmark(decode_case["gather"])


@pytest.mark.benchmark(group="decode-attention")
def test_paged_decode_fused(benchmark, decode_case):
    if "fused" not in decode_case:
        pytest.skip("pagegate.kernels.cpu_paged is not built")
    benchmark(decode_case["fused"])


@pytest.mark.benchmark(group="decode-attention")
def test_contiguous_sdpa(benchmark, decode_case):
    benchmark(decode_case["sdpa"])


def report(times: dict[str, list[float]]) -> str:
    """One line: each contender's median in ms, then the speed ratios that matter."""
    parts = [f"{name} {statistics.median(t) * 1e3:7.2f} ms" for name, t in times.items()]
    if "fused" in times:
        parts.append(f"fused = {speed_ratio(times, 'fused', 'gather'):.2f}x gather")
    for name in ("fused", "gather"):
        if name in times and "sdpa" in times:
            parts.append(f"{name} = {speed_ratio(times, name, 'sdpa'):.2f}x SDPA")
    return "   ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=None, help="sequences (default 32; 128 with --mixed)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--mixed", action="store_true",
                        help="contexts uniform in --min-context..--max-context, 4 heads / 2 KV (unless given)")
    parser.add_argument("--min-context", type=int, default=20)
    parser.add_argument("--max-context", type=int, default=700)
    parser.add_argument("--heads", type=int, default=None, help="query heads (default 8; 4 with --mixed)")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8; 2 with --mixed)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="independent rounds, each with its own medians")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch = args.batch or (128 if args.mixed else 32)
    heads = args.heads or (4 if args.mixed else 8)
    kv_heads = args.kv_heads or (2 if args.mixed else 8)
    context: int | list[int] = args.context
    if args.mixed:
        gen = torch.Generator().manual_seed(1)
        context = torch.randint(args.min_context, args.max_context + 1, (batch,), generator=gen).tolist()
    dtype = getattr(torch, args.dtype)
    case = make_decode_case(batch, context, heads, kv_heads, args.head_dim, dtype)
    check_agreement(case, dtype)
    shape = (f"contexts {args.min_context}..{args.max_context}" if args.mixed else f"context {args.context}")
    print(f"decode attention, batch {batch} x {shape}, {heads} heads ({kv_heads} KV), head_dim {args.head_dim}, "
          f"{args.dtype}, {torch.get_num_threads()} threads")
    if "fused" not in case:
        print("(no fused kernel: it takes float32 only, and needs `python setup.py build_ext --inplace`)")
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}: {report(time_side_by_side(case, args.repeats))}")


if __name__ == "__main__":
    main()
