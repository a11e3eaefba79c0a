"""GPU check of the Triton kernels: agreement with the reference, decode speed and bandwidth.

    python bench/kernels_gpu.py [--heads 32 --kv-heads 8 --head-dim 128 --iters 50]

On a CUDA device: checks write_kv, the varlen kernel and the decode kernel against the torch
reference, then times paged decode attention (bfloat16) at batch 64 x context 4,096 and batch
256 x context 1,024 and reports achieved bandwidth (K/V bytes read / time) next to a measured
device-to-device copy and to SDPA over the same K/V laid out contiguously.
Goals: >= 70% of copy bandwidth, paged >= 1.0x contiguous SDPA. Exits 0 with a message without CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from pagegate.kernels import AttentionOps, paged_attention, write_kv  # noqa: E402

SHAPES = [(64, 4096), (256, 1024)]  # (batch, context)
BLOCK_SIZE = 16


def cuda_time(fn: Callable[[], object], iters: int) -> float:
    """Median seconds per call, from CUDA events around each call after a warmup."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def paged_inputs(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, lens: torch.Tensor | None = None,
                 q_lens: torch.Tensor | None = None, seed: int = 0) -> dict:
    """Random bfloat16 K/V in shuffled pages; decode queries unless q_lens says otherwise."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.full((batch,), context) if lens is None else lens
    q_lens = torch.ones(batch, dtype=torch.long) if q_lens is None else q_lens
    pages = -(-lens // BLOCK_SIZE)
    num_blocks = int(pages.sum()) + 16
    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(num_blocks, device="cuda", generator=gen)
    block_tables = torch.full((batch, int(pages.max())), -1, dtype=torch.int32, device="cuda")
    taken = 0
    for b, n in enumerate(pages.tolist()):
        block_tables[b, :n] = order[taken:taken + n].int()
        taken += n
    query = torch.randn(int(q_lens.sum()), heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                seq_lens=lens.to("cuda", torch.int32),
                query_start_loc=F.pad(q_lens.cumsum(0), (1, 0)).to("cuda", torch.int32),
                scale=head_dim ** -0.5)


def check_correctness(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Triton against the reference on a mixed batch, a decode batch and a write; prints each."""
    ok = True
    lens = torch.tensor([1, 16, 17, 300, 1000, 2048, 77, 4096])
    cases = {"decode": paged_inputs(8, 0, heads, kv_heads, head_dim, lens),
             "mixed": paged_inputs(8, 0, heads, kv_heads, head_dim, lens, torch.tensor([1, 16, 5, 300, 1, 64, 77, 1]))}
    for name, inputs in cases.items():
        for window in (None, 256):
            got = paged_attention(**inputs, sliding_window=window, backend="triton").float()
            want = paged_attention(**inputs, sliding_window=window, backend="reference").float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            ok &= err <= 2e-2
            print(f"  {name:6s} window={window}: max relative error {err:.2e} {'ok' if err <= 2e-2 else 'FAIL'}")
    inputs = cases["mixed"]
    key = torch.randn(50, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(inputs["k_cache"].shape[0] * BLOCK_SIZE, device="cuda")[:50]
    slots[::7] = -1
    caches = [inputs["k_cache"].clone() for _ in range(4)]
    write_kv(key, key, caches[0], caches[1], slots, backend="triton")
    write_kv(key, key, caches[2], caches[3], slots, backend="reference")
    same = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    print(f"  write_kv: {'ok' if same else 'FAIL'}")
    return ok and same


def copy_time(num_bytes: int, iters: int) -> float:
    """Median seconds of one device-to-device copy of num_bytes (the bandwidth yardstick)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return cuda_time(lambda: dst.copy_(src), iters)


def bench_decode(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, iters: int) -> None:
    """Time Triton paged decode, a copy of the same bytes, and SDPA on contiguous K/V; print one row."""
    inputs = paged_inputs(batch, context, heads, kv_heads, head_dim)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2  # K and V, bfloat16
    ops = AttentionOps("cuda", "triton")  # chosen once, as a model does
    paged = cuda_time(lambda: ops.paged_attention(**inputs), iters)
    copy = copy_time(kv_bytes, iters)
    pages = inputs["block_tables"].long()
    k, v = (cache[pages].flatten(1, 2).transpose(1, 2).contiguous() for cache in (inputs["k_cache"], inputs["v_cache"]))
    q = inputs["query"][:, :, None]
    sdpa = cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, scale=inputs["scale"],
                                                            enable_gqa=heads != kv_heads), iters)
    paged_bw, copy_bw = kv_bytes / paged, 2 * kv_bytes / copy  # a copy reads and writes every byte
    print(f"  batch {batch:4d} x context {context:5d}: paged {paged * 1e6:8.1f} us  {paged_bw / 1e9:7.1f} GB/s "
          f"({paged_bw / copy_bw:5.1%} of copy {copy_bw / 1e9:.0f} GB/s)   SDPA contiguous {sdpa * 1e6:8.1f} us "
          f"-> paged speed {sdpa / paged:.2f}x SDPA")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device here; nothing to check (the CPU tests cover the kernels "
              "under TRITON_INTERPRET=1).")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, {args.heads} heads / {args.kv_heads} KV heads, "
          f"head_dim {args.head_dim}, bfloat16, {BLOCK_SIZE}-token pages")
    print("correctness (Triton vs reference):")
    ok = check_correctness(args.heads, args.kv_heads, args.head_dim)
    print("decode attention:")
    for batch, context in SHAPES:
        bench_decode(batch, context, args.heads, args.kv_heads, args.head_dim, args.iters)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
