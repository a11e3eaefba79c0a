"""Random paged batches and a float64 dense-attention oracle shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagegate.kernels import paged_attention

# (context length, query length): decodes ending exactly on / just past a page boundary,
# a whole prefill, a chunked prefill, a prefill after a page-aligned prefix-cache hit
MIXED_BATCH = [(16, 1), (17, 1), (1, 1), (33, 1), (40, 40), (45, 13), (48, 16), (31, 1), (70, 5)]
# Gemma 2's attention soft-cap, and one small enough to flatten most scores of a hot batch
SOFTCAPS = [50.0, 5.0]


@dataclass
class PagedBatch:
    """One varlen batch laid out the way the core's batch builder lays it out."""

    query: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_pages] int32, unused entries -1
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    keys: list[torch.Tensor]  # per sequence, the context [L, Hkv, D] that was written to the cache
    values: list[torch.Tensor]
    scale: float


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position of one sequence."""
    return block_table[positions // block_size].long() * block_size + positions % block_size


def make_batch(shape: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype = torch.float32, block_size: int = 16, seed: int = 0,
               spare_blocks: int = 5, device: str = "cpu") -> PagedBatch:
    """A batch whose contexts sit in shuffled, non-contiguous pages of a NaN-poisoned cache."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-length // block_size) for length, _ in shape]
    num_blocks = sum(pages_per_seq) + spare_blocks
    page_ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(shape), max(pages_per_seq) + 2), -1, dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    keys, values, queries, used = [], [], [], 0
    for b, ((length, q_len), pages) in enumerate(zip(shape, pages_per_seq, strict=True)):
        block_tables[b, :pages] = page_ids[used:used + pages].int()
        used += pages
        slots = slots_of(block_tables[b], torch.arange(length), block_size)
        keys.append(torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype))
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = keys[-1]
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = values[-1]
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
    starts = torch.tensor([0] + [q for _, q in shape]).cumsum(0).int()
    return PagedBatch(torch.cat(queries).to(device), k_cache.to(device), v_cache.to(device), block_tables.to(device),
                      torch.tensor([length for length, _ in shape], dtype=torch.int32, device=device),
                      starts.to(device), keys, values, head_dim ** -0.5)


def heat(batch: PagedBatch, factor: float = 8.0) -> PagedBatch:
    """Scale the batch's attention scores by `factor` (through `scale`), so they reach tens: a
    soft-cap of 50 then bends the largest ones and one of 5 flattens most."""
    batch.scale *= factor
    return batch


def dense_attention(batch: PagedBatch, sliding_window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Plain per-sequence causal attention in float64: the oracle the kernels must match. A softcap
    bends the scaled scores to softcap * tanh(s / softcap) before the mask (Hugging Face's Gemma 2)."""
    outs, starts = [], batch.query_start_loc.tolist()
    for b, (keys, values) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[starts[b]:starts[b + 1]].cpu().double()
        group = q.shape[1] // keys.shape[1]
        k, v = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = len(keys) - len(q) + torch.arange(len(q))[:, None]
        key_pos = torch.arange(len(keys))
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= query_pos - key_pos < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def poisoned_like(tensor: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN, so a row a kernel forgets to write cannot pass."""
    return torch.full_like(tensor, float("nan"))


def run_attention(batch: PagedBatch, backend: str, sliding_window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """paged_attention on `batch` into a poisoned buffer, through the public API."""
    out = poisoned_like(batch.query)
    result = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                             batch.query_start_loc, batch.scale, sliding_window, softcap=softcap, out=out,
                             backend=backend)
    assert result is out
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Compare to the float64 oracle at the tolerance the dtype allows (relative to the output scale)."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    actual = actual.cpu().double()
    assert torch.isfinite(actual).all(), "output has NaN/inf"
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} > {tol} x {scale:.3g}"
