"""Page-state bytes for the dashboard: the C copy of a pool, and the run-length encoding (key and delta)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagegate.core import BlockPool
from pagegate.core.page_map import (
    CACHED,
    MAX_REFCOUNT,
    fill_page_states,
    max_encoded_size,
    rle_decode,
    rle_encode,
)


def states_of(pool: BlockPool) -> np.ndarray:
    out = np.empty(pool.num_blocks, dtype=np.uint8)
    fill_page_states(pool, out)
    return out


def test_states_say_free_cached_used_and_shared() -> None:
    pool = BlockPool(8, block_size=2)
    used = pool.allocate(4)  # pages 0-3
    pool.incref(used[:2])
    pool.incref(used[:1])  # page 0: 3 holders, page 1: 2
    pool.cache_block(int(used[2]), 0, [5, 6])  # page 2: a prefix page in use
    pool.cache_block(int(used[3]), 1, [7, 8])
    pool.free(used[3:])  # page 3: cached and evictable
    states = states_of(pool)
    assert states.tolist() == [3, 2, 1 | CACHED, CACHED, 0, 0, 0, 0]
    assert int((states & MAX_REFCOUNT > 1).sum()) == pool.num_shared_blocks
    assert int((states == CACHED).sum()) == pool.num_cached_free_blocks
    assert int((states & MAX_REFCOUNT > 0).sum()) == pool.num_used_blocks


def test_refcount_is_capped_and_the_output_must_fit() -> None:
    pool = BlockPool(2)
    page = pool.allocate(1)
    for _ in range(300):
        pool.incref(page)
    assert states_of(pool)[0] == MAX_REFCOUNT
    with pytest.raises(ValueError, match="pages"):
        fill_page_states(pool, np.empty(1, dtype=np.uint8))


def encode(states: np.ndarray, previous: np.ndarray | None = None) -> bytes:
    out = np.empty(max_encoded_size(len(states)), dtype=np.uint8)
    return out[:rle_encode(states, previous, out)].tobytes()


def test_runs_are_value_then_leb128_length() -> None:
    states = np.array([0] * 300 + [2, 2, 0x81], dtype=np.uint8)
    assert encode(states) == bytes([0, 0xAC, 0x02, 2, 2, 0x81, 1])
    assert encode(states, states.copy()) == bytes([0, 0xAF, 0x02])  # nothing changed: one run of zeros
    assert encode(np.zeros(0, dtype=np.uint8)) == b""


runs = st.lists(st.tuples(st.sampled_from([0, 1, 2, 5, 0x80, 0x81, 0xFF]), st.integers(1, 600)), max_size=40)


@given(runs, runs)
def test_key_and_delta_frames_decode_to_the_states(first: list, second: list) -> None:
    def expand(pairs: list) -> np.ndarray:
        return np.concatenate([np.full(n, v, dtype=np.uint8) for v, n in pairs] or [np.zeros(0, np.uint8)])

    a, b = expand(first), expand(second)
    size = min(len(a), len(b))
    a, b = a[:size], b[:size]
    key = encode(a)
    assert len(key) <= max_encoded_size(size)
    decoded = np.full(size, 7, dtype=np.uint8)
    rle_decode(key, decoded)
    assert (decoded == a).all()
    rle_decode(encode(b, a), decoded, delta=True)
    assert (decoded == b).all()


def test_random_bytes_stay_within_the_bound_and_bad_input_is_refused() -> None:
    states = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    data = encode(states)
    assert len(data) <= max_encoded_size(len(states))
    with pytest.raises(ValueError, match="may take"):
        rle_encode(states, None, np.empty(10, dtype=np.uint8))
    with pytest.raises(ValueError, match="previous"):
        rle_encode(states, states[:5], np.empty(max_encoded_size(len(states)), dtype=np.uint8))
    with pytest.raises(ValueError, match="truncated"):
        rle_decode(bytes([1, 0x80]), np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match="cover"):
        rle_decode(bytes([1, 3]), np.zeros(4, dtype=np.uint8))
