"""KV page formats: storing rows, reading them in every kernel, and moving pages as bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.config import KV_CACHE_DTYPES
from pagegate.kernels import copy_blocks, reference, swap_blocks
from pagegate.kernels.dispatch import cpu_kernel
from pagegate.kernels.kv_format import (
    AUTO_4,
    FORMATS,
    as_bytes,
    dequantize_rows,
    format_of,
    head_dim_of,
    quantize_rows,
    resolve_format,
)
from pagegate.kernels.rotation import rotate, unrotate
from tests.kernels.paged_cases import (
    MIXED_BATCH,
    PagedBatch,
    dense_attention,
    heat,
    make_batch,
    run_attention,
)

cpu_paged = cpu_kernel()
needs_kernel = pytest.mark.skipif(cpu_paged is None, reason="the CPU kernels are not built")
NAMES = list(FORMATS)
SCALED = [name for name in NAMES if FORMATS[name].scaled]


def in_format(batch: PagedBatch, name: str) -> PagedBatch:
    """The batch with its context stored in `name` pages, and the oracle's keys/values what those pages hold."""
    fmt = FORMATS[name]
    num_blocks, block_size, num_kv_heads, head_dim = batch.k_cache.shape
    k_cache = fmt.empty(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = fmt.empty(num_blocks, block_size, num_kv_heads, head_dim)
    keys, values = [], []
    for b, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        positions = torch.arange(len(k))
        slots = batch.block_tables[b][positions // block_size].long() * block_size + positions % block_size
        if fmt.rotated:  # int4 pages hold R k and R v: what they hold, rotated back, is the oracle's
            k, v = rotate(k), rotate(v)
        reference.write_kv(k, v, k_cache, v_cache, slots)
        back = unrotate if fmt.rotated else (lambda rows: rows)
        keys.append(back(dequantize_rows(quantize_rows(k, fmt), head_dim)))
        values.append(back(dequantize_rows(quantize_rows(v, fmt), head_dim)))
    return PagedBatch(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                      keys, values, batch.scale)


def test_the_flag_lists_every_format():
    assert KV_CACHE_DTYPES == ("auto", *FORMATS, AUTO_4)


def test_an_unknown_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="int8"):
        resolve_format("q4_0", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="no page format"):
        format_of(torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("name", NAMES)
def test_capacity_per_token(name):
    # SmolLM2: 30 layers, 3 KV heads of 64; float32 pages cost 46,080 bytes a token
    fmt = FORMATS[name]
    ratio = FORMATS["float32"].bytes_per_token(30, 3, 64) / fmt.bytes_per_token(30, 3, 64)
    assert ratio == {"float32": 1, "float16": 2, "bfloat16": 2, "int4": 256 / 34}.get(name, 256 / 66)
    assert head_dim_of(fmt.empty(1, 16, 3, 64)) == 64


@pytest.mark.parametrize("name", SCALED)
def test_scaled_rows_round_within_half_a_step(name):
    fmt = FORMATS[name]
    x = torch.randn(200, 4, 64, dtype=torch.float64).float() * torch.logspace(-3, 3, 200)[:, None, None]
    back = dequantize_rows(quantize_rows(x, fmt), 64)
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half of scale = amax / 127 (the float16 scale adds ~0.1%); fp8: its relative spacing at the top; int4:
    # a whole step of amax / 8, where a value of the other sign near amax is clamped to 7 steps
    relative = {"int8": 0.5 / 127 * 1.01, "int4": 1 / 8 * 1.01, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}[name]
    assert ((back - x).abs() <= relative * amax + 1e-30).all()
    assert not torch.isnan(back).any()


def test_zero_rows_stay_zero():
    for fmt in FORMATS.values():
        assert dequantize_rows(quantize_rows(torch.zeros(3, 2, 64), fmt), 64).abs().sum() == 0


@needs_kernel
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_c_writes_equal_the_reference_byte_for_byte(name, data):
    # magnitudes from float16 subnormals to past float16's range, and rows of zeros
    exponent = data.draw(st.integers(-30, 17))
    seed = data.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(40, 2, 64, generator=gen) * 2.0 ** exponent
    rows[0] = 0
    slots = torch.randperm(64, generator=gen)[:40]
    slots[3] = -1
    fmt = FORMATS[name]
    ours, theirs = (fmt.empty(4, 16, 2, 64) for _ in range(2))
    cpu_paged.write_kv(rows, rows, ours, ours.clone(), slots)
    reference.write_kv(rows, rows, theirs, theirs.clone(), slots)
    assert torch.equal(as_bytes(ours).view(torch.uint8), as_bytes(theirs).view(torch.uint8))


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("head_dim", [64, 12])  # 12: not whole vectors of 8, the plain C tiles
def test_attention_reads_what_the_pages_hold(backend, name, sliding_window, head_dim):
    # against float64 attention over the stored values: only the kernel's own float32 arithmetic differs
    if backend == "auto" and cpu_paged is None:
        pytest.skip("the CPU kernels are not built")
    if FORMATS[name].rotated and head_dim == 12:
        head_dim = 4  # int4 rotates power-of-two heads only: 4, not whole vectors of 8, runs the plain C tiles too
    batch = in_format(make_batch(MIXED_BATCH, 6, 2, head_dim, seed=3), name)
    out = run_attention(batch, backend, sliding_window)
    expected = dense_attention(batch, sliding_window)
    assert (out.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


@needs_kernel
@pytest.mark.parametrize("name", NAMES)
def test_softcapped_attention_reads_every_format(name):
    batch = in_format(heat(make_batch(MIXED_BATCH, 4, 2, 64, seed=5)), name)
    out = run_attention(batch, "auto", softcap=5.0)
    expected = dense_attention(batch, softcap=5.0)
    assert (out.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("name", NAMES)
def test_attention_stays_near_float64_on_the_original_values(name):
    original = make_batch(MIXED_BATCH, 6, 2, 64, seed=7)
    expected = dense_attention(original)
    out = run_attention(in_format(original, name), "auto" if cpu_paged else "reference")
    tolerance = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2, "int8": 2e-2, "int4": 0.25}.get(name, 6e-2)
    assert (out.double() - expected).abs().max() <= tolerance * expected.abs().max()


def _random_pages(fmt, num_blocks, gen):
    """A cache of `fmt` filled with random bytes (any bit pattern: moves must not interpret them)."""
    cache = fmt.empty(num_blocks, 4, 2, 8)
    as_bytes(cache).view(torch.uint8).copy_(torch.randint(0, 256, as_bytes(cache).view(torch.uint8).shape,
                                                          generator=gen, dtype=torch.uint8))
    return cache


def _page_bytes(cache, page):
    return as_bytes(cache).view(torch.uint8)[page].clone()


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_copy_on_write_and_swap_move_pages_bit_exactly(name, data):
    fmt, gen = FORMATS[name], torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    k, v = _random_pages(fmt, 8, gen), _random_pages(fmt, 8, gen)
    cpu_k, cpu_v = _random_pages(fmt, 6, gen), _random_pages(fmt, 6, gen)
    src = data.draw(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True))
    dst = data.draw(st.lists(st.integers(0, 7).filter(lambda p: p not in src), min_size=len(src),
                             max_size=len(src), unique=True))
    expected = [(_page_bytes(k, s), _page_bytes(v, s)) for s in src]
    copy_blocks([k], [v], src, dst)
    for (k_bytes, v_bytes), d in zip(expected, dst, strict=True):
        assert torch.equal(_page_bytes(k, d), k_bytes) and torch.equal(_page_bytes(v, d), v_bytes)
    out = np.array(list(enumerate(dst)), dtype=np.int32)[:, ::-1].copy()  # device page -> cpu page i
    swap_blocks([k, v], [cpu_k, cpu_v], out)
    k.zero_(), v.zero_()
    swap_blocks([cpu_k, cpu_v], [k, v], out[:, ::-1].copy())
    for (k_bytes, v_bytes), d in zip(expected, dst, strict=True):
        assert torch.equal(_page_bytes(k, d), k_bytes) and torch.equal(_page_bytes(v, d), v_bytes)
    assert k.dtype == fmt.dtype and cpu_k.dtype == fmt.dtype
