import logging
import os
import resource
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pagegate.engine.kv_tiers import DISK, DiskTier, PageKey

from .pages import BLOCK_SIZE, FINGERPRINT, PAGE_BYTES, page_data, page_key, tokens_of

DISK_LOG = "pagegate.engine.kv_tiers.disk"


def open_tier(directory: Path, max_pages: int = 100, fingerprint: bytes = FINGERPRINT,
              page_bytes: int = PAGE_BYTES) -> DiskTier:
    probe_bytes = 72 + 4 * BLOCK_SIZE + page_bytes  # header + tokens + payload
    return DiskTier(directory, max_pages * probe_bytes, fingerprint, page_bytes, BLOCK_SIZE)


def store(tier: DiskTier, hashes: range | list[int], page_bytes: int = PAGE_BYTES) -> list[PageKey]:
    keys = [page_key(hash) for hash in hashes]
    for key in keys:
        tier.put(key, page_data(key.hash, page_bytes))
    tier.flush()
    return keys


def page_path(tier: DiskTier, hash: int) -> Path:
    assert tier.directory is not None
    return tier.directory / f"{hash:016x}"


def found(tier: DiskTier, key: PageKey) -> bool:
    return tier.find(key.hash, key.parent, tokens_of(key)) is not None


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == DISK_LOG and r.levelno == logging.WARNING]


def test_pages_read_back_bit_exact_sync_and_async(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "kv")
    keys = store(tier, range(1, 6))
    for key in keys:
        assert found(tier, key)
        read = tier.read(key.hash)
        assert read is not None and read[0] == key and read[1] == page_data(key.hash).numpy().tobytes()
    load = tier.load(keys)
    assert torch.equal(load.result(timeout=10), torch.stack([page_data(key.hash) for key in keys]))
    assert tier.current_stats().hits == 5 and tier.stats.bytes_read == 5 * PAGE_BYTES
    tier.close()


def test_files_are_private(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "kv")
    store(tier, [1])
    assert tier.directory is not None
    for directory in (tmp_path / "kv", tier.root, tier.directory):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in tier.directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    tier.close()


def test_lru_eviction_keeps_the_byte_budget(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, max_pages=3)
    keys = store(tier, [1, 2, 3])
    assert found(tier, keys[0])  # 1 is now the most recently used
    store(tier, [4, 5])
    assert sorted(key.hash for key in keys + [page_key(4), page_key(5)] if found(tier, key)) == [1, 4, 5]
    assert not page_path(tier, 2).exists() and not page_path(tier, 3).exists()
    assert tier.current_stats().bytes <= tier.stats.capacity_bytes
    events = tier.take_events()
    assert ("BlockRemoved", (2,), DISK) in [(e.name, e.hashes, e.medium) for e in events]
    tier.close()


def test_slots_per_process_and_warm_restart(tmp_path: Path) -> None:
    first, second = open_tier(tmp_path), open_tier(tmp_path)
    assert first.directory is not None and second.directory is not None
    assert (first.directory.name, second.directory.name) == ("0", "1")
    keys = store(first, range(1, 4))
    assert not found(second, keys[0])
    first.close()
    third = open_tier(tmp_path)
    assert third.directory == first.directory
    assert all(found(third, key) for key in keys)
    assert sorted(third.take_events()[0].hashes) == [1, 2, 3]  # BlockStored for the pages found at start
    read = third.read(2)
    assert read is not None and read[1] == page_data(2).numpy().tobytes()
    second.close()
    third.close()


def test_restart_orders_the_lru_by_last_use(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    store(tier, [1, 2, 3])
    for age, hash in enumerate([2, 3, 1]):  # 2 used longest ago, 1 most recently
        os.utime(page_path(tier, hash), ns=(10**18 + age * 10**9,) * 2)
    tier.close()
    smaller = open_tier(tmp_path, max_pages=2)
    assert sorted(hash for hash in (1, 2, 3) if hash in smaller) == [1, 3]
    smaller.close()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _leftover_tmp(path: Path) -> None:
    shutil.copy(path, path.with_name(path.name + ".tmp"))
    path.unlink()


def _foreign(fingerprint: bytes, page_bytes: int):
    def replace(path: Path) -> None:
        other = open_tier(path.parents[3] / "other", fingerprint=fingerprint, page_bytes=page_bytes)
        store(other, [int(path.name, 16)], page_bytes)
        shutil.copy(page_path(other, int(path.name, 16)), path)
        other.close()
    return replace


@pytest.mark.parametrize("damage", [_truncate, _leftover_tmp, _foreign(b"another model", PAGE_BYTES),
                                    _foreign(FINGERPRINT, PAGE_BYTES * 2)],
                         ids=["truncated", "leftover-tmp", "foreign-fingerprint", "wrong-page-size"])
def test_bad_files_are_dropped_at_start_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         damage) -> None:
    tier = open_tier(tmp_path / "kv")
    keys = store(tier, [1, 2, 3])
    tier.close()
    damage(page_path(tier, 2))
    (page_path(tier, 3).parent / "junk").write_bytes(b"not a page")
    with caplog.at_level(logging.WARNING, DISK_LOG):
        restarted = open_tier(tmp_path / "kv")
    assert len(warnings(caplog)) == 1 and "deleted 1 files" in warnings(caplog)[0]
    assert "left alone 1 entries" in warnings(caplog)[0]  # the junk: no page magic, not the tier's to delete
    assert [found(restarted, key) for key in keys] == [True, False, True]
    assert restarted.read(2) is None  # a miss: the prefix is recomputed
    assert restarted.directory is not None
    assert sorted(path.name for path in restarted.directory.iterdir()) == ["0000000000000001",
                                                                           "0000000000000003", "junk", "lock"]
    restarted.close()


def test_a_flipped_payload_byte_is_never_served(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = open_tier(tmp_path)
    keys = store(tier, [1, 2, 3])
    raw = bytearray(page_path(tier, 2).read_bytes())
    raw[-1] ^= 0x10
    page_path(tier, 2).write_bytes(raw)
    with caplog.at_level(logging.WARNING, DISK_LOG):
        served = tier.load(keys).result(timeout=10)
    assert torch.equal(served, torch.stack([page_data(1)]))  # the run ends at the bad page
    assert len(warnings(caplog)) == 1 and "checksum" in warnings(caplog)[0]
    assert not found(tier, keys[1]) and not page_path(tier, 2).exists()
    assert ("BlockRemoved", (2,)) in [(e.name, e.hashes) for e in tier.take_events()]
    tier.close()


def test_an_unwritable_directory_turns_the_tier_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # NOTE: tests run as root, where chmod stops no write; a directory under a regular file cannot be made
    (tmp_path / "a-file").write_bytes(b"")
    with caplog.at_level(logging.WARNING, DISK_LOG):
        tier = open_tier(tmp_path / "a-file" / "kv")
    assert not tier.enabled and len(warnings(caplog)) == 1
    key = page_key(1)
    tier.put(key, page_data(1))
    assert not found(tier, key) and tier.load([key]).result(timeout=10).shape == (0, PAGE_BYTES)
    assert not tier.current_stats().enabled
    tier.close()


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes fail with EFBIG (Python ignores SIGXFSZ): a full disk, as the writer sees it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_full_disk_turns_the_tier_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = open_tier(tmp_path)
    kept = store(tier, [1])
    with caplog.at_level(logging.WARNING, DISK_LOG), file_size_limit(16):
        store(tier, [2])
    assert not tier.enabled
    assert len(warnings(caplog)) == 1 and "File too large" in warnings(caplog)[0]
    assert tier.directory is not None and not [p for p in tier.directory.iterdir() if p.name.endswith(".tmp")]
    assert not found(tier, kept[0]) and tier.read(1) is None  # off: finds miss, serving goes on
    assert ("BlockRemoved", (1, 2)) in [(e.name, e.hashes) for e in tier.take_events()]
    tier.close()


# Directories and files the tier does not own (issue 64, finding 2): refused, never followed, never deleted.

def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == DISK_LOG and r.levelno == logging.ERROR]


def victim_files(directory: Path) -> dict[str, bytes]:
    """Files someone else owns: a note and one named like a page (no page magic)."""
    directory.mkdir()
    (directory / "notes.txt").write_bytes(b"keep me")
    (directory / "0000000000000009").write_bytes(b"not a page, not yours")
    return contents(directory)


def contents(directory: Path) -> dict[str, bytes]:
    return {path.name: b"<dir>" if path.is_dir() else path.read_bytes() for path in directory.iterdir()}


def tier_dirs(tmp_path: Path) -> dict[str, Path]:
    """The three directories a tier under `tmp_path / 'kv'` uses, made by a first tier holding page 1."""
    tier = open_tier(tmp_path / "kv")
    store(tier, [1])
    tier.close()
    assert tier.directory is not None
    return {"configured": tmp_path / "kv", "fingerprint": tier.root, "slot": tier.directory}


def open_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> DiskTier:
    with caplog.at_level(logging.WARNING, DISK_LOG):
        return open_tier(tmp_path / "kv")


def assert_refused(tier: DiskTier, caplog: pytest.LogCaptureFixture, why: str) -> None:
    assert not tier.enabled and not tier.current_stats().enabled and tier.directory is None
    assert len(errors(caplog)) == 1 and why in errors(caplog)[0] and "WITHOUT the disk tier" in errors(caplog)[0]
    key = page_key(2)
    tier.put(key, page_data(2))
    tier.flush()
    assert not found(tier, key)
    tier.close()


@pytest.mark.parametrize("level", ["configured", "fingerprint", "slot"])
def test_a_symlinked_tier_directory_is_refused_and_its_target_untouched(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, level: str) -> None:
    directory = tier_dirs(tmp_path)[level]
    before = victim_files(tmp_path / "victim")
    shutil.rmtree(directory)
    directory.symlink_to(tmp_path / "victim")
    tier = open_logged(tmp_path, caplog)
    assert contents(tmp_path / "victim") == before
    assert_refused(tier, caplog, "symbolic link")


@pytest.mark.parametrize("level", ["configured", "fingerprint", "slot"])
@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777], ids=["group", "others", "sticky-world"])
def test_a_group_or_world_writable_tier_directory_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, level: str, mode: int) -> None:
    directory = tier_dirs(tmp_path)[level]
    directory.chmod(mode)
    assert_refused(open_logged(tmp_path, caplog), caplog, "writable by group or others")
    directory.chmod(0o700)
    tier = open_tier(tmp_path / "kv")
    assert found(tier, page_key(1))  # nothing was deleted meanwhile
    tier.close()


@pytest.mark.parametrize("level", ["configured", "fingerprint", "slot"])
def test_a_tier_directory_of_another_user_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     level: str) -> None:
    directory = tier_dirs(tmp_path)[level]
    other = os.geteuid() + 4242
    os.chown(directory, other, -1)  # NOTE: tests run as root, who may give a directory away
    assert_refused(open_logged(tmp_path, caplog), caplog, f"owned by uid {other}")
    assert (tmp_path / "kv").exists() and any(tmp_path.joinpath("kv").rglob("0000000000000001"))


def test_a_planted_tmp_link_is_not_written_through(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    for name in ("0000000000000002.tmp", "0000000000000002"):
        (page_path(tier, 2).parent / name).unlink(missing_ok=True)
    page_path(tier, 2).with_name("0000000000000002.tmp").symlink_to(victim)
    page_path(tier, 3).symlink_to(victim)  # a link where a page will be written: replaced, not followed
    keys = store(tier, [2, 3])
    tier.close()
    assert victim.read_bytes() == b"precious"
    restarted = open_tier(tmp_path)
    assert all(found(restarted, key) for key in keys)
    assert restarted.read(3) == (keys[1], page_data(3).numpy().tobytes())
    assert victim.read_bytes() == b"precious"
    assert page_path(tier, 2).with_name("0000000000000002.tmp").is_symlink()  # not the tier's: left alone
    restarted.close()


def test_foreign_files_are_left_alone_and_links_never_followed(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    tier = open_tier(tmp_path)
    keys = store(tier, [1, 2])
    tier.close()
    assert tier.directory is not None
    before = victim_files(tmp_path / "victim")
    shutil.copy(page_path(tier, 1), tmp_path / "victim" / "0000000000000005")  # a page, but behind a link
    for name in before:
        shutil.copy(tmp_path / "victim" / name, tier.directory / name)  # no page magic: not the tier's
    (tier.directory / "0000000000000005").symlink_to(tmp_path / "victim" / "0000000000000005")
    (tier.directory / "0000000000000006.tmp").symlink_to(tmp_path / "victim" / "notes.txt")
    (tier.directory / "a-page-copy").write_bytes(page_path(tier, 2).read_bytes())  # the tier's magic: deleted
    with caplog.at_level(logging.WARNING, DISK_LOG):
        restarted = open_tier(tmp_path)
    assert [found(restarted, key) for key in keys] == [True, True] and 5 not in restarted
    assert "deleted 1 files" in warnings(caplog)[0] and "left alone 4 entries" in warnings(caplog)[0]
    assert sorted(path.name for path in tier.directory.iterdir()) == sorted(
        ["0000000000000001", "0000000000000002", "0000000000000005", "0000000000000006.tmp", "lock", *before])
    for name, data in before.items():
        assert (tier.directory / name).read_bytes() == data and (tmp_path / "victim" / name).read_bytes() == data
    restarted.close()
