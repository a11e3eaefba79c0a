"""Triton kernels against the reference and the float64 oracle.

Without a GPU they run on CPU tensors in Triton's interpreter (conftest sets TRITON_INTERPRET=1);
each program instance costs milliseconds there, so shapes stay small.
"""

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pagegate.kernels import triton_decode, triton_prefill, triton_write, write_kv  # noqa: E402

from .paged_cases import MIXED_BATCH, SOFTCAPS, assert_close, dense_attention, heat, make_batch, run_attention

# what counts is how the kernels were decorated, i.e. TRITON_INTERPRET when they were first imported
INTERPRETED = isinstance(triton_write._write_kv_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():  # a misconfigured run must fail, not pass silently
    pytest.fail("no CUDA device, and the kernels were imported without TRITON_INTERPRET=1 "
                "(tests/kernels/conftest.py sets it)", pytrace=False)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DECODE_BATCH = [(length, 1) for length in (1, 15, 16, 17, 32, 33, 50)]


def _check(shape, heads, head_dim=64, dtype=torch.float32, sliding_window=None, seed=0, block_size=16,
           softcap=None):
    batch = make_batch(shape, *heads, head_dim, dtype, block_size=block_size, seed=seed, device=DEVICE)
    if softcap is not None:
        heat(batch)  # scores in the tens, so the cap bends them
    # as in the model, q is a view of a fused qkv projection: rows are strided
    fused = torch.empty(len(batch.query), 2, *batch.query.shape[1:], dtype=dtype, device=DEVICE)
    fused[:, 0] = batch.query
    batch.query = fused[:, 0]
    out = run_attention(batch, "triton", sliding_window, softcap)
    assert_close(out, dense_attention(batch, sliding_window, softcap), dtype)
    # and the reference agrees to the same tolerance
    assert_close(out, run_attention(batch, "reference", sliding_window, softcap).double(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_batch(dtype):
    # bfloat16: the interpreter's bfloat16 tl.dot is broken upstream, so the kernels upcast there
    _check(MIXED_BATCH, (4, 2), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_batch(dtype):
    _check(DECODE_BATCH, (4, 2), dtype=dtype, seed=1)


@pytest.mark.parametrize("heads", [(2, 2), (8, 1)], ids=["mha", "gqa8"])
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_gqa_ratios_and_head_dim_128(heads, kind):
    _check(MIXED_BATCH[:5] if kind == "mixed" else DECODE_BATCH[:4], heads, head_dim=128, seed=2)


@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_sliding_window(kind):
    _check(MIXED_BATCH if kind == "mixed" else DECODE_BATCH, (4, 2), sliding_window=7, seed=3)


def test_block_size_8():
    _check([(8, 1), (9, 1), (24, 24), (30, 6)], (2, 1), block_size=8, seed=4)


@pytest.mark.parametrize("sliding_window", [None, 300])
def test_decode_splits_long_contexts(sliding_window):
    # two sequences, one head: the decode kernel splits the 700-token context and reduces
    seqs, heads, bound = [(700, 1), (260, 1)], (2, 1), 700
    assert triton_decode.split_length(2, 1, bound, torch.device(DEVICE)) < bound or DEVICE == "cuda"
    _check(seqs, heads, sliding_window=sliding_window, seed=5)


def test_prefill_with_gpu_tile_sizes(monkeypatch):
    # the CUDA tile shape (64 x 64) on the interpreter: tiles span several sequences' worth of rows
    monkeypatch.setattr(triton_prefill, "tile_sizes", lambda device: (64, 64))
    _check([(70, 70), (40, 1), (100, 37)], (2, 1), seed=6)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_softcap(kind, dtype, softcap):
    _check(MIXED_BATCH if kind == "mixed" else DECODE_BATCH, (4, 2), dtype=dtype, seed=8, softcap=softcap)


@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_softcap_with_sliding_window_and_head_dim_256(kind):
    shape = [(40, 40), (45, 13), (33, 1)] if kind == "mixed" else DECODE_BATCH[2:6]
    _check(shape, (2, 1), head_dim=256, sliding_window=7, seed=9, softcap=5.0)


def test_softcap_across_decode_splits():
    # the split partials are in capped units; the reduction must merge them as they are
    _check([(700, 1), (260, 1)], (2, 1), sliding_window=500, seed=10, softcap=5.0)


@pytest.mark.parametrize("softcap", [-1.0, float("nan")])
def test_bad_softcap_is_refused(softcap):
    batch = make_batch(DECODE_BATCH[:2], 2, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="softcap"):
        run_attention(batch, "triton", softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(7)
    caches = [torch.full((5, 16, 2, 64), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    slots = torch.randperm(80, generator=gen)[:11].to(DEVICE)
    slots[[0, 6]] = -1
    # strided views, as from a fused qkv projection, already in the cache dtype (a pure copy)
    fused = torch.randn(11, 3, 2, 64, generator=gen).to(DEVICE, dtype)
    key, value = fused[:, 1], fused[:, 2]
    write_kv(key, value, caches[0], caches[1], slots, backend="triton")
    write_kv(key, value, caches[2], caches[3], slots, backend="reference")
    assert torch.equal(caches[0].isnan(), caches[2].isnan())
    assert torch.equal(caches[0].nan_to_num(), caches[2].nan_to_num())
    assert torch.equal(caches[1].nan_to_num(), caches[3].nan_to_num())
