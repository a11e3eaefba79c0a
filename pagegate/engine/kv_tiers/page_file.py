"""One KV page in one file: a fixed header, the page's token ids (int32) and its bytes.

Header (little-endian): magic b"PGKV", format version (u16), flags (u16, bit 0: the page starts its chain),
the 32-byte fingerprint of model, weights, tokenizer, block size and KV format, the page hash, its parent's
hash (u64 each), block_size (u32), crc32 of tokens + payload (u32), page_bytes (u64).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from pagegate.engine.kv_tiers.records import PageKey

MAGIC = b"PGKV"
VERSION = 1
HEADER = struct.Struct("<4sHH32sQQIIQ")
FIRST = 1
TMP_SUFFIX = ".tmp"
LOCK_NAME = "lock"  # the slot's lock file (disk_slot.py), the one file here that is no page


class BadPage(Exception):
    """A file that must never be served; its message is the reason, grouped into one warning."""


def file_name(hash: int) -> str:
    return f"{hash:016x}"


def hash_of_name(name: str) -> int | None:
    """The page hash a file name stands for, or None when the name is no page's."""
    if len(name) != 16:
        return None
    try:
        return int(name, 16)
    except ValueError:
        return None


@dataclass(frozen=True)
class PageFormat:
    """What every file of one tier shares; a file that differs in any of it is foreign."""

    fingerprint: bytes  # 32 bytes
    block_size: int
    page_bytes: int

    @property
    def head_bytes(self) -> int:
        return HEADER.size + 4 * self.block_size

    @property
    def file_bytes(self) -> int:
        return self.head_bytes + self.page_bytes

    def encode_head(self, key: PageKey, payload: bytes) -> bytes:
        crc = zlib.crc32(payload, zlib.crc32(key.tokens))
        header = HEADER.pack(MAGIC, VERSION, FIRST if key.first else 0, self.fingerprint, key.hash, key.parent,
                             self.block_size, crc, self.page_bytes)
        return header + key.tokens

    def parse_head(self, head: bytes, name_hash: int) -> tuple[PageKey, int]:
        """The page's key and stored crc; BadPage when this header is not one of ours."""
        if len(head) < self.head_bytes:
            raise BadPage("truncated")
        magic, version, flags, fingerprint, hash, parent, block_size, crc, page_bytes = HEADER.unpack_from(head)
        if magic != MAGIC:
            raise BadPage("not a page file")
        if version != VERSION:
            raise BadPage("another format version")
        if fingerprint != self.fingerprint:
            raise BadPage("foreign fingerprint")
        if block_size != self.block_size or page_bytes != self.page_bytes:
            raise BadPage("another block or page size")
        if hash != name_hash:
            raise BadPage("name and hash differ")
        key = PageKey(hash, parent, bytes(head[HEADER.size:self.head_bytes]), bool(flags & FIRST))
        return key, crc


def write_page(path: Path, head: bytes, payload: bytes) -> None:
    """Write to `<path>.tmp`, then rename: a kill mid-write leaves only a .tmp, never a short page file.

    NOTE: no fsync: a killed process loses nothing the kernel already holds, and a power cut is caught by
    the checksum at read time (the page is then recomputed)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(head)
            file.write(payload)
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def check_file(path: Path, page_format: PageFormat) -> PageKey:
    """The key of a page file whose header and size are sane (start-up indexing); BadPage otherwise."""
    name_hash = hash_of_name(path.name)
    if name_hash is None:
        raise BadPage("unfinished write" if path.name.endswith(TMP_SUFFIX) else "not a page file")
    with open(path, "rb") as file:
        key, _ = page_format.parse_head(file.read(page_format.head_bytes), name_hash)
        size = os.fstat(file.fileno()).st_size
    if size != page_format.file_bytes:
        raise BadPage("truncated" if size < page_format.file_bytes else "wrong size")
    return key


def scan_directory(directory: Path, page_format: PageFormat) -> tuple[list[PageKey], Counter[str]]:
    """The keys of the sane page files, least recently used (oldest mtime) first, and why each other
    file was deleted (unfinished writes, truncated, foreign, ...). Sub-directories are left alone."""
    found: list[tuple[int, PageKey]] = []
    dropped: Counter[str] = Counter()
    for entry in os.scandir(directory):
        if entry.name == LOCK_NAME or not entry.is_file(follow_symlinks=False):
            continue
        try:
            found.append((entry.stat().st_mtime_ns, check_file(Path(entry.path), page_format)))
        except (BadPage, OSError) as bad:
            dropped[str(bad) if isinstance(bad, BadPage) else "unreadable"] += 1
            with suppress(OSError):
                os.unlink(entry.path)
    found.sort(key=lambda item: item[0])
    return [key for _, key in found], dropped


def read_page(path: Path, page_format: PageFormat, key: PageKey, out: memoryview) -> None:
    """Read one page's bytes into `out` (page_bytes long) after checking header, size and checksum."""
    with open(path, "rb", buffering=0) as file:
        if os.fstat(file.fileno()).st_size != page_format.file_bytes:
            raise BadPage("wrong size")
        stored, crc = page_format.parse_head(file.read(page_format.head_bytes), key.hash)
        if stored != key:
            raise BadPage("header changed")
        if file.readinto(out) != page_format.page_bytes:
            raise BadPage("truncated")
    if zlib.crc32(out, zlib.crc32(key.tokens)) != crc:
        raise BadPage("bad checksum")
