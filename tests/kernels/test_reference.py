"""The torch reference backend against a float64 dense oracle."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.kernels import reference, workspace, write_kv

from .paged_cases import (
    MIXED_BATCH,
    SOFTCAPS,
    assert_close,
    dense_attention,
    heat,
    make_batch,
    run_attention,
    slots_of,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 4), (4, 2), (8, 1)]  # (query heads, KV heads): GQA ratios 1, 2 and 8


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_mixed_batch_matches_dense(dtype, heads, head_dim, sliding_window):
    batch = make_batch(MIXED_BATCH, *heads, head_dim, dtype, seed=head_dim + heads[1])
    out = run_attention(batch, "reference", sliding_window)
    assert_close(out, dense_attention(batch, sliding_window), dtype)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size):
    shape = [(block_size, 1), (block_size + 1, 1), (3 * block_size, 2 * block_size), (2 * block_size + 1, 3)]
    batch = make_batch(shape, 4, 2, 64, block_size=block_size)
    assert_close(run_attention(batch, "reference"), dense_attention(batch), torch.float32)


def test_decode_groups_split_a_large_batch(monkeypatch):
    # a tiny group budget forces one group per few sequences: groups must not mix up rows
    monkeypatch.setattr(reference, "DECODE_GROUP_BYTES", 64 << 10)
    planned, plan = [], reference._groups
    monkeypatch.setattr(reference, "_groups", lambda *args: planned.append(plan(*args)) or planned[-1])
    shape = [(length, 1) for length in (1, 200, 16, 17, 95, 64, 65, 3, 130, 33)]
    batch = make_batch(shape, 4, 2, 64)
    assert_close(run_attention(batch, "reference"), dense_attention(batch), torch.float32)
    assert len(planned[0]) > 2


def test_window_wider_than_context_changes_nothing():
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    assert torch.equal(run_attention(batch, "reference", 1000), run_attention(batch, "reference"))


def test_strided_query_view():
    # the model hands in q as a view of a fused qkv projection: rows are not contiguous
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    fused = torch.randn(batch.query.shape[0], 3, 4, 64)
    fused[:, 1] = batch.query
    batch.query = fused[:, 1]
    assert not batch.query.is_contiguous()
    assert_close(run_attention(batch, "reference"), dense_attention(batch), torch.float32)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_batches_match_dense(data):
    block_size = data.draw(st.sampled_from([4, 16]))
    heads = data.draw(st.sampled_from(HEADS))
    seqs = data.draw(st.lists(st.integers(1, 4 * block_size + 1), min_size=1, max_size=6))
    shape = [(length, data.draw(st.integers(1, length))) for length in seqs]
    window = data.draw(st.one_of(st.none(), st.integers(1, 2 * block_size)))
    batch = make_batch(shape, *heads, 64, block_size=block_size, seed=data.draw(st.integers(0, 1000)))
    assert_close(run_attention(batch, "reference", window), dense_attention(batch, window), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_scatters_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.full((6, 16, 2, 64), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(96, generator=gen)[:12]
    slots[[2, 7]] = -1
    key, value = torch.randn(12, 2, 64, generator=gen), torch.randn(12, 2, 64, generator=gen)
    write_kv(key, value, k_cache, v_cache, slots, backend="reference")
    written = slots[slots >= 0]
    assert torch.equal(k_cache.view(96, 2, 64)[written], key[slots >= 0].to(dtype))
    assert torch.equal(v_cache.view(96, 2, 64)[written], value[slots >= 0].to(dtype))
    untouched = torch.ones(96, dtype=torch.bool)
    untouched[written] = False
    assert k_cache.view(96, 2, 64)[untouched].isnan().all() and v_cache.view(96, 2, 64)[untouched].isnan().all()


def test_write_kv_then_attend():
    # the real flow: the context goes in through write_kv with the block-table slot formula
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    batch.k_cache.fill_(float("nan"))
    batch.v_cache.fill_(float("nan"))
    for b, (keys, values) in enumerate(zip(batch.keys, batch.values, strict=True)):
        slots = slots_of(batch.block_tables[b], torch.arange(len(keys)), batch.k_cache.shape[1])
        write_kv(keys, values, batch.k_cache, batch.v_cache, slots, backend="reference")
    assert_close(run_attention(batch, "reference"), dense_attention(batch), torch.float32)


def test_decode_inside_and_outside_inference_mode():
    # the decode path reuses scratch buffers: one made under inference mode must not leak out of it
    workspace._local.__dict__.pop("buffers", None)  # start with none, so the first is made inside
    batch = make_batch([(40, 1), (33, 1)], 4, 2, 64)
    with torch.inference_mode():
        inside = run_attention(batch, "reference")
    assert torch.equal(run_attention(batch, "reference"), inside)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_softcapped_batch_matches_dense(softcap, dtype, heads, head_dim, sliding_window):
    batch = heat(make_batch(MIXED_BATCH, *heads, head_dim, dtype, seed=head_dim + heads[1]))
    out = run_attention(batch, "reference", sliding_window, softcap)
    assert_close(out, dense_attention(batch, sliding_window, softcap), dtype)


def test_softcap_bites_and_zero_means_none():
    batch = heat(make_batch(MIXED_BATCH, 4, 2, 64))
    plain = run_attention(batch, "reference")
    assert torch.equal(run_attention(batch, "reference", softcap=0), plain)
    assert torch.equal(run_attention(batch, "reference", softcap=None), plain)
    capped = dense_attention(batch, softcap=5.0)
    assert (capped - dense_attention(batch)).abs().max() > 0.5  # the cap changes the answer a lot here
    assert_close(run_attention(batch, "reference", softcap=5.0), capped, torch.float32)


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf")])
def test_bad_softcap_is_refused(softcap):
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    with pytest.raises(ValueError, match="softcap"):
        run_attention(batch, "reference", softcap=softcap)
    with pytest.raises(ValueError, match="softcap"):
        reference.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                  batch.query_start_loc, batch.scale, softcap=softcap)


def test_softcapped_prefill_in_query_chunks(monkeypatch):
    # a tiny score budget cuts each prefill's queries into many chunks (of one row for the longest)
    monkeypatch.setattr(reference, "CAPPED_SCORE_BYTES", 4 << 10)
    batch = heat(make_batch([(40, 40), (45, 13), (100, 30), (300, 7)], 8, 2, 64, seed=5))
    for window in (None, 20):
        assert_close(run_attention(batch, "reference", window, 5.0), dense_attention(batch, window, 5.0),
                     torch.float32)


def test_softcapped_decode_groups(monkeypatch):
    # decode groups, some with every slot visible (no mask) and some padded (masked)
    monkeypatch.setattr(reference, "DECODE_GROUP_BYTES", 64 << 10)
    shape = [(length, 1) for length in (1, 200, 16, 32, 95, 64, 65, 3, 130, 33)]
    batch = heat(make_batch(shape, 4, 2, 64))
    for window in (None, 40):
        assert_close(run_attention(batch, "reference", window, 5.0), dense_attention(batch, window, 5.0),
                     torch.float32)
