"""A GGUF's strings read in C (gguf_strings.pyx) against the Python loops they replaced: the same strings, offsets
and errors, on arrays of any text, sizes past the bound or the file's end, cut-off sizes and bytes that are no
UTF-8, in both byte orders; and merges cut into the same pairs."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.engine.loading.gguf_strings import merge_pairs, read_strings

LIMIT = 64


def python_strings(view: memoryview, offset: int, count: int, order: str, limit: int,
                   key: str) -> tuple[list[str], int]:
    """gguf_reader's loop before it was C."""
    strings = []
    unpack = struct.Struct(order + "Q").unpack_from
    for _ in range(count):
        (size,) = unpack(view, offset)
        offset += 8
        if size > limit or offset + size > len(view):
            raise ValueError(f"GGUF metadata {key!r}: a string of {size:,} bytes is past the file's end or the bound "
                             f"({limit:,} bytes)")
        strings.append(str(view[offset:offset + size], "utf-8"))
        offset += size
    return strings, offset


def python_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """gguf_tokenizer's cut before it was C."""
    cuts = [(merge, merge.find(" ", 1)) for merge in merges]
    return [(merge[:cut], merge[cut + 1:]) for merge, cut in cuts if cut > 0]


def outcome(read, data: bytes, offset: int, count: int, order: str) -> tuple[str, object]:
    try:
        return "ok", read(memoryview(data), offset, count, order, LIMIT, "k.tokens")
    except (ValueError, struct.error) as error:  # UnicodeDecodeError is a ValueError
        return type(error).__name__, str(error)


# an array as a file holds it: sizes, some past the bound or the end, some bytes no UTF-8, the end anywhere
pieces = st.one_of(st.text(max_size=12).map(str.encode), st.binary(max_size=12),
                   st.integers(0, 2**64 - 1).map(lambda size: (size, b"")))


def encoded(items: list[bytes | tuple[int, bytes]], order: str) -> bytes:
    return b"".join(struct.pack(order + "Q", item[0]) if isinstance(item, tuple) else
                    struct.pack(order + "Q", len(item)) + item for item in items)


@settings(max_examples=400, deadline=None)
@given(items=st.lists(pieces, max_size=8), order=st.sampled_from("<>"), head=st.binary(max_size=9),
       cut=st.integers(0, 200), extra=st.integers(0, 2))
def test_strings_read_in_c_are_the_python_loops(items: list[bytes | tuple[int, bytes]], order: str, head: bytes,
                                               cut: int, extra: int) -> None:
    data = head + encoded(items, order)
    data = data[:len(head) + cut] if cut < len(data) - len(head) else data
    count = len(items) + extra  # past the array too: into the file's end
    assert outcome(read_strings, data, len(head), count, order) == \
        outcome(python_strings, data, len(head), count, order)


@pytest.mark.parametrize(("data", "error"), [
    (struct.pack("<Q", 3) + b"abc" + struct.pack("<Q", LIMIT + 1) + bytes(LIMIT + 1), "a string of 65 bytes"),
    (struct.pack("<Q", 10) + b"abc", "a string of 10 bytes"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "can't decode byte 0xff"),
    (struct.pack("<Q", 1) + b"a" + b"\x01\x00", "unpack_from requires a buffer of at least 17 bytes"),
], ids=["past-the-bound", "past-the-end", "not-utf-8", "size-cut-off"])
def test_each_error_is_the_python_loops(data: bytes, error: str) -> None:
    found = outcome(read_strings, data, 0, 2, "<")
    assert found == outcome(python_strings, data, 0, 2, "<") and error in str(found[1])


def test_a_big_endian_array_and_the_offset_past_it() -> None:
    data = b"xx" + encoded([b"a", "日本".encode(), b""], ">") + b"rest"
    assert read_strings(memoryview(data), 2, 3, ">", LIMIT, "k") == (["a", "日本", ""], len(data) - 4)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="ab Ġ▁日 ", max_size=6), max_size=20))
def test_merges_are_cut_as_the_python_cut(merges: list[str]) -> None:
    assert merge_pairs(merges) == python_pairs(merges)
