"""copy_blocks (copy-on-write) and swap_blocks (device <-> CPU pool) move whole pages exactly."""

import numpy as np
import pytest
import torch

from pagegate.kernels import copy_blocks, swap_blocks

LAYERS, PAGES, SHAPE = 3, 10, (4, 2, 8)  # SHAPE: block_size, KV heads, head_dim


def _caches(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGES, *SHAPE, generator=gen).to(dtype) for _ in range(LAYERS)]


@pytest.mark.parametrize("indices", [torch.tensor, np.array, list], ids=["tensor", "numpy", "list"])
def test_copy_blocks_copies_pages_in_every_layer(indices):
    k_caches, v_caches = _caches(seed=1), _caches(seed=2)
    before = [cache.clone() for cache in k_caches + v_caches]
    src, dst = [1, 4, 4], [7, 2, 9]
    copy_blocks(k_caches, v_caches, indices(src), indices(dst))
    for cache, old in zip(k_caches + v_caches, before, strict=True):
        assert torch.equal(cache[dst], old[src])
        untouched = [p for p in range(PAGES) if p not in dst]
        assert torch.equal(cache[untouched], old[untouched])


def test_copy_blocks_reads_sources_before_writing():
    # page 3 is both copied from and overwritten: its copy must carry the old contents
    k_caches, v_caches = _caches(seed=3), _caches(seed=4)
    old = k_caches[0].clone()
    copy_blocks(k_caches, v_caches, torch.tensor([3, 5]), torch.tensor([6, 3]))
    assert torch.equal(k_caches[0][6], old[3]) and torch.equal(k_caches[0][3], old[5])


def test_copy_blocks_with_nothing_to_copy():
    k_caches, v_caches = _caches(), _caches()
    before = [cache.clone() for cache in k_caches]
    copy_blocks(k_caches, v_caches, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    assert all(torch.equal(a, b) for a, b in zip(k_caches, before, strict=True))


def _bits(tensor):
    """The raw bit patterns, so NaN pages compare equal and -0.0 differs from 0.0."""
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_swap_out_and_back_restores_pages_bit_exactly(dtype):
    device_pool = _caches(dtype, seed=5)
    # NaN pages too: a round trip must not touch a single bit
    device_pool[0][2].fill_(float("nan"))
    original = [cache.clone() for cache in device_pool]
    cpu_pool = [torch.full((6, *SHAPE), float("inf"), dtype=dtype) for _ in range(LAYERS)]
    out_pairs = torch.tensor([[2, 5], [7, 0], [3, 1]])
    swap_blocks(device_pool, cpu_pool, out_pairs)
    for cache in device_pool:
        cache[[2, 7, 3]] = 0.5  # the freed pages get reused meanwhile
    back_pairs = torch.tensor([[5, 8], [0, 4], [1, 6]])  # back into different pages
    swap_blocks(cpu_pool, device_pool, back_pairs)
    for cache, old in zip(device_pool, original, strict=True):
        assert torch.equal(_bits(cache[[8, 4, 6]]), _bits(old[[2, 7, 3]]))


def test_swap_moves_only_the_named_pages():
    src, dst = _caches(seed=6), [torch.zeros(4, *SHAPE) for _ in range(LAYERS)]
    swap_blocks(src, dst, np.array([[9, 3]]))
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[3], s[9]) and not d[:3].any()


def test_swap_rejects_mismatched_layers():
    with pytest.raises(ValueError, match="2 source and 3 destination"):
        swap_blocks(_caches()[:2], _caches(), torch.tensor([[0, 1]]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_swap_through_cuda_round_trip():
    cpu_pool = [cache.pin_memory() for cache in _caches(torch.bfloat16, seed=7)]
    gpu_pool = [torch.zeros(PAGES, *SHAPE, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    swap_blocks(cpu_pool, gpu_pool, torch.tensor([[1, 2], [3, 4]]))
    back = [torch.zeros_like(cache) for cache in cpu_pool]
    swap_blocks(gpu_pool, back, torch.tensor([[2, 1], [4, 3]]))
    for cache, restored in zip(cpu_pool, back, strict=True):
        assert torch.equal(restored[[1, 3]], cache[[1, 3]])
