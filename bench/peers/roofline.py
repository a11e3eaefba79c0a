"""The machine's own limit on single-stream decode: a token reads every weight once, so
tokens/s <= read bandwidth / weight bytes read per token.

    python -m bench.peers.roofline [--threads 2] [MODEL.gguf ...]

The bandwidth is a `threads`-thread read of a buffer far larger than the caches (torch's sum over 1 GiB, best of
a few); the bytes per token are the GGUF's tensors, less the embedding table when a separate output matrix
exists (then a token reads one embedding row, not the table).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

BUFFER_BYTES = 1 << 30


def read_bandwidth_gbs(threads: int, repeats: int = 5) -> float:
    """GB/s of `threads` threads summing a 1 GiB float32 buffer (the best of `repeats`)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(BUFFER_BYTES // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return BUFFER_BYTES / best / 1e9
    finally:
        torch.set_num_threads(previous)


def weight_bytes_per_token(gguf: Path) -> int:
    """Bytes of weights one decode step reads: every tensor, the embedding table only when it is the output too."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def roofline_tok_s(gguf: Path, bandwidth_gbs: float) -> float:
    return bandwidth_gbs * 1e9 / weight_bytes_per_token(gguf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    bandwidth = read_bandwidth_gbs(args.threads)
    print(f"read bandwidth, {args.threads} threads: {bandwidth:.1f} GB/s")
    for model in args.models:
        print(f"{model.name}: {weight_bytes_per_token(model) / 1e6:.1f} MB a token -> at most "
              f"{roofline_tok_s(model, bandwidth):.0f} tok/s")


if __name__ == "__main__":
    main()
