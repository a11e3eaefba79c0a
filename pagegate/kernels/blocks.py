"""Whole-page moves, shared by both backends: copy-on-write copies and device<->CPU swaps."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagegate.kernels.kv_format import as_bytes

IndexLike = torch.Tensor | np.ndarray | Sequence[int]


def _index(indices: IndexLike, device: torch.device) -> torch.Tensor:
    """Page ids as an int64 tensor on `device` (what index_select / index_copy_ want)."""
    return torch.as_tensor(indices).to(device=device, dtype=torch.long).reshape(-1)


def copy_blocks(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                src: IndexLike, dst: IndexLike) -> None:
    """Copy pages src[i] -> dst[i] in every layer's K and V cache (copy-on-write of shared pages)."""
    caches = [as_bytes(cache) for cache in (*k_caches, *v_caches)]  # bytes: the page's format does not matter
    if not caches or len(src) == 0:
        return
    src_index, dst_index = _index(src, caches[0].device), _index(dst, caches[0].device)
    for cache in caches:
        if cache.device != src_index.device:
            src_index, dst_index = src_index.to(cache.device), dst_index.to(cache.device)
        # gather first, then scatter: a page that is both a source and a destination reads its old contents
        cache.index_copy_(0, dst_index, cache.index_select(0, src_index))


def _pinned(device: torch.device) -> bool:
    """Whether host staging buffers for transfers with `device` should be pinned."""
    return device.type == "cuda"


def swap_blocks(src_caches: Sequence[torch.Tensor], dst_caches: Sequence[torch.Tensor],
                pairs: IndexLike) -> None:
    """Move pages pairs[i, 0] of each src cache into pages pairs[i, 1] of the matching dst cache.

    One gather, one transfer and one scatter per layer, never one copy per page. Uploads to the
    device go through pinned memory without blocking; downloads to the CPU are queued for every
    layer first and waited for once, because the CPU-side scatter must see finished data.
    """
    pair_array = torch.as_tensor(pairs).to(torch.long).reshape(-1, 2)
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"swap_blocks got {len(src_caches)} source and {len(dst_caches)} destination caches")
    if pair_array.shape[0] == 0:
        return
    indices: dict[tuple[int, torch.device], torch.Tensor] = {}  # one upload of the page ids per device

    def ids(column: int, device: torch.device) -> torch.Tensor:
        if (column, device) not in indices:
            indices[column, device] = _index(pair_array[:, column], device)
        return indices[column, device]

    downloads = []
    for src, dst in ((as_bytes(s), as_bytes(d)) for s, d in zip(src_caches, dst_caches, strict=True)):
        src_index, dst_index = ids(0, src.device), ids(1, dst.device)
        if src.device.type == "cpu" or dst.device.type != "cpu":
            dst.index_copy_(0, dst_index, _upload(src, src_index, dst.device))
        else:
            downloads.append((src.device, dst, dst_index, _start_download(src, src_index)))
    for device in {device for device, *_ in downloads if device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
    for _, dst, dst_index, staged in downloads:
        dst.index_copy_(0, dst_index, staged)


def _upload(src: torch.Tensor, src_index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pages of `src` gathered into one tensor on `device`; asynchronous from pinned host memory."""
    if src.device == device:
        return src.index_select(0, src_index)
    if src.device.type != "cpu":
        return src.index_select(0, src_index).to(device)
    staged = torch.empty((len(src_index), *src.shape[1:]), dtype=src.dtype, pin_memory=_pinned(device))
    torch.index_select(src, 0, src_index, out=staged)
    # the caching host allocator keeps `staged` alive until the copy has run
    return staged.to(device, non_blocking=True)


def _start_download(src: torch.Tensor, src_index: torch.Tensor) -> torch.Tensor:
    """Queue a copy of pages of device tensor `src` into host memory; valid after a stream sync."""
    gathered = src.index_select(0, src_index)
    staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=_pinned(src.device))
    return staged.copy_(gathered, non_blocking=True)
