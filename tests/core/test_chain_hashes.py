"""Prefix-chain identities: a page's hash is SHA-256 of a length-prefixed record, and a chain's root keeps the model,
adapter, salt and tenant apart as separate fields (no string join, nothing a client can aim)."""

from __future__ import annotations

import hashlib
import struct

from hypothesis import given
from hypothesis import strategies as st

from pagegate.core import BlockPool, compute_block_hash
from pagegate.core.chain_root import chain_root

tokens = st.lists(st.integers(0, 2**31 - 1), max_size=40)
parents = st.integers(0, 2**64 - 1)
fields = st.one_of(st.none(), st.text(max_size=12))


def sha256_record(parent: int, token_ids: list[int]) -> int:
    record = b"PGPAGE1\0" + struct.pack("<QI", parent, len(token_ids)) + struct.pack(f"<{len(token_ids)}I", *token_ids)
    return int.from_bytes(hashlib.sha256(record).digest()[:8], "little")


@given(parents, tokens)
def test_a_page_hash_is_sha256_of_its_length_prefixed_record(parent, token_ids):
    assert compute_block_hash(parent, token_ids) == sha256_record(parent, token_ids)


@given(parents, tokens)
def test_the_pool_chains_pages_with_that_hash(parent, token_ids):
    pool = BlockPool(4, 4)
    pages = pool.allocate(2)
    first = pool.cache_block(int(pages[0]), parent, [1, 2, 3, 4], first=True)
    assert first == sha256_record(parent, [1, 2, 3, 4])
    assert pool.cache_block(int(pages[1]), first, [5, 6, 7, 8]) == sha256_record(first, [5, 6, 7, 8])
    assert pool.prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], parent).tolist() == [first, sha256_record(first, [5, 6, 7, 8])]


def test_a_token_count_is_part_of_the_record():
    # no trailing zero token, nor a zero parent, makes another record's hash
    assert compute_block_hash(0, [1, 2]) != compute_block_hash(0, [1, 2, 0])
    assert compute_block_hash(0, []) != compute_block_hash(0, [0])


@given(st.tuples(st.text(max_size=8), fields, fields, fields), st.tuples(st.text(max_size=8), fields, fields, fields))
def test_different_fields_never_share_a_root(a, b):
    assert (chain_root(*a) == chain_root(*b)) == (a == b)


def test_joins_that_used_to_collide_are_apart():
    model = "m"
    # the old root was hash(salt + "\0lora:" + identity): a salt could spell an adapter, and "a" == "a\0"
    assert chain_root(model, "evil:abc", "s") != chain_root(model, None, "s\0lora:evil:abc")
    assert chain_root(model, None, "a") != chain_root(model, None, "a\0")
    assert chain_root(model, None, "") != chain_root(model)
    # the tenant was "key:<tenant>:<salt>" inside the salt
    assert chain_root(model, None, "x", "t") != chain_root(model, None, "key:t:x")
    assert chain_root(model, None, None, "t") != chain_root(model, None, "t")
    assert chain_root("m1") != chain_root("m2")


def test_a_root_is_the_first_eight_bytes_of_sha256():
    record = b"PGROOT1\0" + b"\1" + struct.pack("<I", 1) + b"m" + b"\0" + b"\1" + struct.pack("<I", 1) + b"s" + b"\0"
    assert chain_root("m", None, "s") == int.from_bytes(hashlib.sha256(record).digest()[:8], "little")
