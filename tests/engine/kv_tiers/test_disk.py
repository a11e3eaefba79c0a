import logging
import os
import shutil
import stat
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
    assert len(warnings(caplog)) == 1 and "2 files" in warnings(caplog)[0]
    assert [found(restarted, key) for key in keys] == [True, False, True]
    assert restarted.read(2) is None  # a miss: the prefix is recomputed
    assert restarted.directory is not None
    assert sorted(path.name for path in restarted.directory.iterdir()) == ["0000000000000001",
                                                                           "0000000000000003", "lock"]
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


def test_a_full_disk_turns_the_tier_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = open_tier(tmp_path)
    kept = store(tier, [1])
    page_path(tier, 2).with_suffix(".tmp").symlink_to("/dev/full")  # every write there fails with ENOSPC
    with caplog.at_level(logging.WARNING, DISK_LOG):
        store(tier, [2])
    assert not tier.enabled
    assert len(warnings(caplog)) == 1 and "No space left" in warnings(caplog)[0]
    assert not found(tier, kept[0]) and tier.read(1) is None  # off: finds miss, serving goes on
    assert ("BlockRemoved", (1, 2)) in [(e.name, e.hashes) for e in tier.take_events()]
    tier.close()
