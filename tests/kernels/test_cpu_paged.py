"""The fused CPU kernel (pagegate.kernels.cpu_paged) against the float64 dense oracle, and its dispatch."""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.kernels import cpu_paged, dispatch, paged_attention, reference  # cpu_paged: built by setup.py

from .paged_cases import (
    MIXED_BATCH,
    SOFTCAPS,
    assert_close,
    dense_attention,
    heat,
    make_batch,
    poisoned_like,
    run_attention,
)

HEADS = [(4, 4), (4, 2), (8, 1)]  # (query heads, KV heads): GQA ratios 1, 2 and 8
# contexts longer than a key tile (128) and prefill chunks longer than a query tile, so the online
# softmax folds several tiles and a prefill is cut into several items
LONG_BATCH = [(300, 1), (129, 1), (128, 1), (257, 1), (400, 150), (260, 260), (1000, 1), (513, 7)]
# enough decodes that each takes all its KV heads in one item (the other mode: few decodes)
MANY_DECODES = [(length, 1) for length in (1, 15, 16, 17, 31, 32, 33, 64, 65, 127, 128, 129, 200, 255, 256, 300)]


def fused(batch, sliding_window=None, out=None, softcap=None):
    """The kernel called directly, into a NaN-poisoned buffer unless `out` is given."""
    out = poisoned_like(batch.query) if out is None else out
    result = cpu_paged.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                       batch.seq_lens, batch.query_start_loc, batch.scale, sliding_window,
                                       softcap=softcap, out=out)
    assert result is out
    return out


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("sliding_window", [None, 5, 100])
@pytest.mark.parametrize("shape", [MIXED_BATCH, LONG_BATCH, MANY_DECODES], ids=["mixed", "long", "decodes"])
def test_matches_dense(shape, heads, head_dim, sliding_window):
    batch = make_batch(shape, *heads, head_dim, seed=head_dim + heads[1])
    assert_close(fused(batch, sliding_window), dense_attention(batch, sliding_window), torch.float32)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size):
    shape = [(block_size, 1), (block_size + 1, 1), (3 * block_size, 2 * block_size), (2 * block_size + 1, 3),
             (200, 1), (150, 40)]
    batch = make_batch(shape, 4, 2, 64, block_size=block_size)
    assert_close(fused(batch), dense_attention(batch), torch.float32)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads):
    # the work split depends on the thread count (few decodes: one item per KV head)
    batch = make_batch(MIXED_BATCH + MANY_DECODES[:5], 8, 2, 64, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert_close(fused(batch, 20), dense_attention(batch, 20), torch.float32)
    finally:
        torch.set_num_threads(before)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_batches_match_dense(data):
    block_size = data.draw(st.sampled_from([4, 16]))
    heads = data.draw(st.sampled_from(HEADS))
    seqs = data.draw(st.lists(st.integers(1, 20 * block_size + 1), min_size=1, max_size=12))
    shape = [(length, data.draw(st.integers(1, length))) for length in seqs]
    window = data.draw(st.one_of(st.none(), st.integers(1, 12 * block_size)))
    batch = make_batch(shape, *heads, 64, block_size=block_size, seed=data.draw(st.integers(0, 1000)))
    assert_close(fused(batch, window), dense_attention(batch, window), torch.float32)


def test_strided_query_and_output_views():
    # q is a view of a fused qkv projection, and out may be a view too: rows are not contiguous
    batch = make_batch(MIXED_BATCH + LONG_BATCH[:2], 4, 2, 64)
    qkv = torch.randn(batch.query.shape[0], 3, 4, 64)
    qkv[:, 1] = batch.query
    batch.query = qkv[:, 1]
    out_buffer = torch.full((batch.query.shape[0], 2, 4, 64), float("nan"))
    out = fused(batch, out=out_buffer[:, 0])
    assert not batch.query.is_contiguous() and not out.is_contiguous()
    assert_close(out, dense_attention(batch), torch.float32)
    assert out_buffer[:, 1].isnan().all()


def test_output_of_another_dtype_is_filled():
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    out = fused(batch, out=torch.full(batch.query.shape, float("nan"), dtype=torch.float64))
    assert_close(out, dense_attention(batch), torch.float32)


def test_empty_sequences_and_batches():
    # q_len 0 (a sequence with nothing to compute this step) and a batch with no tokens at all
    batch = make_batch([(20, 1), (33, 2)], 4, 2, 64)
    expected = dense_attention(batch)[:1]
    batch.query, batch.query_start_loc = batch.query[:1], torch.tensor([0, 1, 1], dtype=torch.int32)
    assert_close(fused(batch), expected, torch.float32)
    none = make_batch([(5, 1)], 4, 2, 64)
    none.query, none.query_start_loc = none.query[:0], torch.tensor([0, 0], dtype=torch.int32)
    assert fused(none).shape == (0, 4, 64)


def test_bad_metadata_is_refused_not_read():
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    batch.block_tables[1, 0] = batch.k_cache.shape[0]  # a block past the end of the cache
    with pytest.raises(ValueError, match="outside the cache"):
        fused(batch)
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    batch.seq_lens[0] = 16 * batch.block_tables.shape[1] + 1  # more pages than the table holds
    with pytest.raises(ValueError, match="block table"):
        fused(batch)
    with pytest.raises(ValueError, match="does not fit"):
        fused(make_batch(MIXED_BATCH, 4, 3, 64))  # 4 query heads cannot share 3 KV heads
    with pytest.raises(ValueError, match="query's shape"):
        fused(make_batch(MIXED_BATCH, 4, 2, 64), out=torch.empty(1, 4, 64))


def test_runs_in_a_background_thread():
    # the engine loop calls attention from its own thread, with the GIL released inside
    batch = make_batch(LONG_BATCH + MANY_DECODES, 4, 2, 64, seed=3)
    results = []
    worker = threading.Thread(target=lambda: results.append(fused(batch)))
    worker.start()
    worker.join()
    assert torch.equal(results[0], fused(batch))
    assert_close(results[0], dense_attention(batch), torch.float32)


def test_auto_runs_the_fused_kernel_on_cpu_float32(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_paged, "paged_attention", lambda *args, **kwargs: calls.append(args) or kwargs["out"])
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    run_attention(batch, "auto")
    assert len(calls) == 1


@pytest.mark.parametrize("how", ["argument", "environment", "float16", "gradient", "not built"])
def test_torch_path_otherwise(monkeypatch, how):
    # naming the reference, a dtype the kernel does not take, a query that wants a gradient, or no
    # extension: the torch path
    groups = []
    plan = reference._groups
    monkeypatch.setattr(reference, "_groups", lambda *args: groups.append(plan(*args)) or groups[-1])
    dtype = torch.float16 if how == "float16" else torch.float32
    batch = make_batch(MIXED_BATCH, 4, 2, 64, dtype)
    backend = "reference" if how == "argument" else None
    if how == "environment":
        monkeypatch.setenv(dispatch.BACKEND_ENV, "reference")
    if how == "not built":
        monkeypatch.setattr(dispatch, "cpu_kernel", lambda: None)
    if how == "gradient":
        batch.query.requires_grad_(True)
    out = poisoned_like(batch.query)
    paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                    batch.query_start_loc, batch.scale, out=out, backend=backend)
    assert groups, "the torch reference's decode path did not run"
    assert_close(out.detach(), dense_attention(batch), dtype)


def test_fused_and_reference_agree_through_the_api():
    batch = make_batch(MIXED_BATCH + LONG_BATCH, 8, 2, 128, seed=11)
    for window in (None, 37):
        expected = run_attention(batch, "reference", window).double()
        assert_close(run_attention(batch, "auto", window), expected, torch.float32)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("sliding_window", [None, 5, 100])
@pytest.mark.parametrize("shape", [MIXED_BATCH, LONG_BATCH, MANY_DECODES], ids=["mixed", "long", "decodes"])
def test_softcapped_matches_reference_and_dense(shape, heads, head_dim, sliding_window, softcap):
    batch = heat(make_batch(shape, *heads, head_dim, seed=head_dim + heads[1]))
    out = fused(batch, sliding_window, softcap=softcap)
    assert_close(out, dense_attention(batch, sliding_window, softcap), torch.float32)
    assert_close(out, run_attention(batch, "reference", sliding_window, softcap).double(), torch.float32)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_softcapped_batches_match_dense(data):
    block_size = data.draw(st.sampled_from([4, 16]))
    heads = data.draw(st.sampled_from(HEADS))
    seqs = data.draw(st.lists(st.integers(1, 20 * block_size + 1), min_size=1, max_size=8))
    shape = [(length, data.draw(st.integers(1, length))) for length in seqs]
    window = data.draw(st.one_of(st.none(), st.integers(1, 12 * block_size)))
    softcap = data.draw(st.floats(0.5, 100.0))
    batch = heat(make_batch(shape, *heads, 64, block_size=block_size, seed=data.draw(st.integers(0, 1000))))
    assert_close(fused(batch, window, softcap=softcap), dense_attention(batch, window, softcap), torch.float32)


def test_softcap_zero_is_the_uncapped_kernel():
    batch = heat(make_batch(MIXED_BATCH + LONG_BATCH[:3], 4, 2, 64))
    assert torch.equal(fused(batch, softcap=0.0), fused(batch))
    assert not torch.allclose(fused(batch, softcap=5.0), fused(batch), atol=0.1)


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf")])
def test_bad_softcap_is_refused(softcap):
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    with pytest.raises(ValueError, match="softcap"):
        fused(batch, softcap=softcap)
    with pytest.raises(ValueError, match="softcap"):
        run_attention(batch, "auto", softcap=softcap)
