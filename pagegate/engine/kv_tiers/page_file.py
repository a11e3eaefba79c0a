"""One KV page in one file: a fixed header, the page's token ids (int32) and its bytes.

Header (little-endian): magic b"PGKV", format version (u16), flags (u16, bit 0: the page starts its chain),
the 32-byte fingerprint of model, weights, tokenizer, block size and KV format, the page hash, its parent's
hash (u64 each), block_size (u32), crc32 of tokens + payload (u32), page_bytes (u64).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import struct
import zlib
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass
from io import FileIO

from pagegate.engine.kv_tiers.records import PageKey

MAGIC = b"PGKV"
VERSION = 2  # 2: pages hashed with SHA-256 (core/page_hash.h); a file of the old invertible hash is never read
HEADER = struct.Struct("<4sHH32sQQIIQ")
FIRST = 1
TMP_SUFFIX = ".tmp"
LOCK_NAME = "lock"  # the slot's lock file (disk_slot.py), the one file here that is no page


class BadPage(Exception):
    """A file that must never be served; its message is the reason, grouped into one warning."""


class NotOurs(BadPage):
    """A file without the page magic: the tier did not write it, so it is neither served nor deleted."""


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


# NOTE: files are only ever opened through the slot directory's descriptor and never through a link: a name
# planted in the directory (a link to another file, a FIFO) is sidestepped or refused, never written through.
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _create_tmp(dir_fd: int, name: str) -> tuple[str, int]:
    """A new, empty `<name>.<random>.tmp` (O_EXCL: never one that was there before) and its descriptor."""
    for _ in range(16):
        tmp = f"{name}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            return tmp, os.open(tmp, CREATE_FLAGS, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", name)


def write_page(dir_fd: int, name: str, head: bytes, payload: bytes) -> None:
    """Write a new temporary file, then rename it to `name`: a kill mid-write leaves only a .tmp, never a short
    page file; the rename replaces whatever entry `name` was (a link is replaced, not followed).

    NOTE: no fsync: a killed process loses nothing the kernel already holds, and a power cut is caught by
    the checksum at read time (the page is then recomputed)."""
    tmp, fd = _create_tmp(dir_fd, name)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(head)
            file.write(payload)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _open_regular(dir_fd: int, name: str) -> FileIO:
    """`name` opened for reading, unbuffered; OSError for a link (ELOOP) or anything but a regular file."""
    fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", name)
    return FileIO(fd, "rb")


def check_file(dir_fd: int, name: str, page_format: PageFormat) -> PageKey:
    """The key of a page file whose header and size are sane (start-up indexing); BadPage otherwise, NotOurs
    when the file does not start with the page magic."""
    with _open_regular(dir_fd, name) as file:
        head = file.read(page_format.head_bytes)
        size = os.fstat(file.fileno()).st_size
    if head[:len(MAGIC)] != MAGIC:
        raise NotOurs("not a page file")
    name_hash = hash_of_name(name)
    if name_hash is None:
        raise BadPage("misnamed")
    key, _ = page_format.parse_head(head, name_hash)
    if size != page_format.file_bytes:
        raise BadPage("truncated" if size < page_format.file_bytes else "wrong size")
    return key


def is_ours(dir_fd: int, name: str) -> bool:
    """Whether `name` is a regular file (not followed if a link) that this tier wrote: a `.tmp` or a page."""
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
        if name.endswith(TMP_SUFFIX):
            return True
        with _open_regular(dir_fd, name) as file:
            return file.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def remove_page(dir_fd: int, name: str) -> bool:
    """Delete `name` if this tier wrote it (is_ours); anything else is left alone. True when deleted."""
    if not is_ours(dir_fd, name):
        return False
    with suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)
    return True


def scan_directory(dir_fd: int, page_format: PageFormat) -> tuple[list[PageKey], Counter[str], int]:
    """The keys of the sane page files, least recently used (oldest mtime) first; why each other file the tier
    wrote was deleted (unfinished writes, truncated, foreign, ...); and how many entries were left alone since
    the tier did not write them (no page magic, links, sub-directories, unreadable files)."""
    found: list[tuple[int, PageKey]] = []
    dropped: Counter[str] = Counter()
    left = 0
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if entry.name == LOCK_NAME:
                continue
            if not entry.is_file(follow_symlinks=False):
                left += 1
                continue
            try:
                if entry.name.endswith(TMP_SUFFIX):
                    raise BadPage("unfinished write")
                found.append((entry.stat(follow_symlinks=False).st_mtime_ns,
                              check_file(dir_fd, entry.name, page_format)))
            except NotOurs:
                left += 1
            except BadPage as bad:
                dropped[str(bad)] += remove_page(dir_fd, entry.name)
            except OSError:
                left += 1
    found.sort(key=lambda item: item[0])
    return [key for _, key in found], +dropped, left


def read_page(dir_fd: int, name: str, page_format: PageFormat, key: PageKey, out: memoryview) -> None:
    """Read one page's bytes into `out` (page_bytes long) after checking header, size and checksum; the file's
    mtime becomes now (the last use, so a restart rebuilds the LRU order)."""
    with _open_regular(dir_fd, name) as file:
        if os.fstat(file.fileno()).st_size != page_format.file_bytes:
            raise BadPage("wrong size")
        stored, crc = page_format.parse_head(file.read(page_format.head_bytes), key.hash)
        if stored != key:
            raise BadPage("header changed")
        if file.readinto(out) != page_format.page_bytes:
            raise BadPage("truncated")
        if zlib.crc32(out, zlib.crc32(key.tokens)) != crc:
            raise BadPage("bad checksum")
        os.utime(file.fileno())
