"""The KV tiers a runner gets from its flags, and the fingerprint that keeps a disk tier to one model."""

from __future__ import annotations

import hashlib
import json
import logging

import torch
from torch import nn

from pagegate.config import CacheConfig, parse_bytes
from pagegate.engine.kv_tiers import DiskTier, HostTier, ReuseGate, TierStack
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.models.config import ModelConfig
from pagegate.kernels.kv_format import LayerFormats

log = logging.getLogger(__name__)

REUSE_MEMORY = 1 << 20  # page hashes the reuse gate remembers (about 100 MB of dictionary at most)
SAMPLED_BYTES = 1 << 16  # bytes of each weight tensor the fingerprint reads, evenly spread


def build_tiers(cache: CacheConfig, page_bytes: int, fingerprint: bytes) -> TierStack | None:
    """The host-memory and disk tiers the flags ask for (None when neither is on)."""
    if cache.kv_offload_memory is None and cache.kv_cache_dir is None:
        return None
    if not cache.enable_prefix_caching:
        raise ValueError("the KV tiers (--kv-offload-memory, --kv-cache-dir) keep prefix-cache pages: they need "
                         "prefix caching on")
    host_pages = parse_bytes(cache.kv_offload_memory) // page_bytes if cache.kv_offload_memory else 0
    host = HostTier(host_pages, page_bytes) if host_pages else None
    disk = (DiskTier(cache.kv_cache_dir, parse_bytes(cache.kv_cache_disk), fingerprint, page_bytes, cache.block_size)
            if cache.kv_cache_dir else None)
    log.info("KV tiers: host memory %d pages, disk %s; a page goes down once seen %d times", host_pages,
             cache.kv_cache_dir or "off", cache.kv_offload_min_reuse)
    return TierStack(host, disk, ReuseGate(cache.kv_offload_min_reuse, REUSE_MEMORY))


def fingerprint(model: nn.Module, config: ModelConfig, tokenizer: Tokenizer | None, block_size: int,
                kv_format: LayerFormats) -> bytes:
    """What a page's bytes depend on: the model's shape, its weights (a spread sample of every tensor, with
    names, shapes and types), the tokenizer, the block size and the page format.
    NOTE: a sample, not a hash of every byte: reading a 7B model's weights at start would cost seconds; any
    retrained or requantized weight changes most sampled bytes."""
    digest = hashlib.sha256()
    digest.update(json.dumps([repr(config), block_size, kv_format.key], sort_keys=True).encode())
    digest.update((tokenizer.backend_json() if tokenizer is not None else "").encode())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(_sample(tensor))
    return digest.digest()


def _sample(tensor: torch.Tensor) -> bytes:
    raw = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    step = max(1, raw.numel() // SAMPLED_BYTES)
    return raw[::step].numpy().tobytes()
