"""The physical KV pages: per-layer K/V tensors on the device, an optional CPU pool for swap."""

from __future__ import annotations

import ctypes
import logging
import mmap

import numpy as np
import torch

from pagegate import kernels
from pagegate.config import CacheConfig, parse_bytes
from pagegate.kernels.kv_format import KVFormat, LayerFormats

log = logging.getLogger(__name__)

_MADV_DONTNEED = 4  # Linux: the range's pages are dropped; an access reads zeros (private anonymous memory)
_libc = ctypes.CDLL(None, use_errno=True)


def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, formats: LayerFormats) -> int:
    """K and V of one page in every layer, in each layer's format (scales included)."""
    return block_size * formats.bytes_per_token(num_kv_heads, head_dim)


def device_memory_budget(config: CacheConfig, device: torch.device, profile_peak: int = 0) -> int:
    """Bytes for device KV pages: explicit budget, else on CUDA `gpu_memory_utilization` of the
    device minus what the profiling forward peaked at, else the CPU default."""
    if config.kv_cache_memory is not None:
        return parse_bytes(config.kv_cache_memory)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * config.gpu_memory_utilization) - profile_peak
    return parse_bytes(config.default_cpu_kv_cache_memory)


class PagedKVCache:
    """`layers[i] = (k_cache, v_cache)`, each [num_blocks, block_size, num_kv_heads, row] in layer i's format
    (row: head_dim values, and a one-byte format's scale; see pagegate.kernels.kv_format): `kv_format` in every
    layer, or one format a layer."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, kv_format: KVFormat | LayerFormats, device: torch.device,
                 num_cpu_blocks: int = 0) -> None:
        formats = kv_format if isinstance(kv_format, LayerFormats) else LayerFormats.uniform(kv_format, num_layers)
        if len(formats.formats) != num_layers:
            raise ValueError(f"{len(formats.formats)} page formats for {num_layers} layers")
        self.formats = formats

        def pair(fmt: KVFormat, blocks: int, on: torch.device, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            if on.type == "cpu" and not pin:
                return (untouched_zeros(fmt, blocks, block_size, num_kv_heads, head_dim),
                        untouched_zeros(fmt, blocks, block_size, num_kv_heads, head_dim))
            return (fmt.empty(blocks, block_size, num_kv_heads, head_dim, on, pin),
                    fmt.empty(blocks, block_size, num_kv_heads, head_dim, on, pin))

        self.layers = [pair(fmt, num_blocks, device) for fmt in formats.formats]
        cpu = torch.device("cpu")
        self.cpu_layers = [pair(fmt, num_cpu_blocks, cpu, device.type == "cuda")
                           for fmt in formats.formats] if num_cpu_blocks else []

    def release_pages(self, start: int, stop: int) -> None:
        """Give the memory of pages [start, stop) back to the OS (every layer's K and V, the scales inside their
        rows included); they read as zeros when used again. A pool shrinking its limit calls this (CPU only: a
        device tensor keeps its memory)."""
        for tensor in self._flat(self.layers):
            if tensor.device.type == "cpu" and stop > start:
                stride = tensor[0].numel() * tensor.element_size()
                drop_memory(tensor.data_ptr() + start * stride, (stop - start) * stride)

    def _flat(self, layers: list) -> list[torch.Tensor]:
        return [t for pair in layers for t in pair]

    def copy(self, pairs: np.ndarray) -> None:
        """Copy-on-write: page pairs[i, 0] -> pairs[i, 1] in every layer."""
        if len(pairs):
            kernels.copy_blocks([k for k, _ in self.layers], [v for _, v in self.layers],
                                pairs[:, 0], pairs[:, 1])

    @property
    def page_bytes(self) -> int:
        """One page's bytes in every layer (K and V), as the tiers store it."""
        return sum(t[0].numel() * t.element_size() for t in self._flat(self.layers))

    def read_pages(self, block_ids: np.ndarray) -> torch.Tensor:
        """Pages as bytes [n, page_bytes]: layer by layer, K then V (the tiers' page layout)."""
        index = self._index(block_ids)
        rows = [t.view(torch.uint8).index_select(0, index).reshape(len(index), -1) for t in self._flat(self.layers)]
        return torch.cat(rows, dim=1).cpu()

    def write_pages(self, block_ids: np.ndarray, data: torch.Tensor) -> None:
        """The inverse of read_pages: `data` [n, page_bytes] into pages `block_ids`."""
        index = self._index(block_ids)
        data, start = data.to(index.device), 0
        for t in self._flat(self.layers):
            raw = t.view(torch.uint8)  # every format as its bytes (index_copy_ has no float8 kernel)
            size = raw[0].numel()
            raw.index_copy_(0, index, data[:, start:start + size].reshape(len(index), *raw.shape[1:]))
            start += size

    def _index(self, block_ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(block_ids, dtype=np.int64)).to(self.layers[0][0].device)

    def swap_out(self, pairs: np.ndarray) -> None:
        """(device page, cpu page) pairs, device -> CPU."""
        if len(pairs):
            kernels.swap_blocks(self._flat(self.layers), self._flat(self.cpu_layers), pairs)

    def swap_in(self, pairs: np.ndarray) -> None:
        """(cpu page, device page) pairs, CPU -> device."""
        if len(pairs):
            kernels.swap_blocks(self._flat(self.cpu_layers), self._flat(self.layers), pairs)


def untouched_zeros(kv_format: KVFormat, num_blocks: int, block_size: int, num_kv_heads: int,
                    head_dim: int) -> torch.Tensor:
    """kv_format.empty's zeroed CPU tensor, its memory not yet committed: the OS backs a page when it is written.

    NOTE: torch.zeros writes every byte, so a pool would cost its whole size at once; here only the unaligned ends are
    written and the pages between are dropped (madvise), which reads as zeros. A pool's pages then cost memory as
    they are first used, and an elastic pool allocated at the capacity of a server's whole budget costs its limit."""
    shape = (num_blocks, block_size, num_kv_heads, kv_format.row_bytes(head_dim))
    raw = torch.empty(shape, dtype=torch.uint8)
    flat = raw.view(-1)
    start, end = _aligned_inside(raw.data_ptr(), flat.numel())
    if end > start:
        flat[:start].zero_()
        flat[end:].zero_()
        drop_memory(raw.data_ptr() + start, end - start)
    else:
        flat.zero_()
    return raw.view(kv_format.dtype)


def _aligned_inside(address: int, length: int) -> tuple[int, int]:
    """The offsets [start, end) of the whole OS pages inside `length` bytes at `address`."""
    page = mmap.PAGESIZE
    start = -address % page
    end = (address + length) // page * page - address
    return start, max(end, start)


def drop_memory(address: int, length: int) -> None:
    """madvise(MADV_DONTNEED) the whole OS pages inside [address, address + length)."""
    start, end = _aligned_inside(address, length)
    if end > start and _libc.madvise(ctypes.c_void_p(address + start), ctypes.c_size_t(end - start),
                                     _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
