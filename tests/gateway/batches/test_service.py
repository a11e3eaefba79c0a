"""The service's janitor: an expired file is answered 404 at once and its bytes leave the disk on the next pass;
the start-up sweep removes what a crash left; the flags."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest

from pagegate.gateway.batches.service import Batches
from pagegate.gateway.cli import build_parser, configs_from_args
from pagegate.gateway.errors import NotFound
from pagegate.gateway.settings import GatewayConfig


def test_expired_files_leave_the_disk(tmp_path: Path) -> None:
    batches = Batches(GatewayConfig(batch_dir=str(tmp_path)), concurrency=1)

    async def scenario() -> None:
        kept = await batches.upload("alice", "kept.jsonl", "batch", io.BytesIO(b"{}\n"), ttl_s=None)
        expiring = await batches.upload("alice", "old.jsonl", "batch", io.BytesIO(b"{}\n"), ttl_s=3600)
        path = batches.disk.file_path(expiring.id)
        assert path.read_bytes() == b"{}\n" and kept.expires_at == kept.created_at + 30 * 24 * 3600
        await batches.db(batches.store.db.execute, "UPDATE files SET expires_at = 1 WHERE id = ?", (expiring.id,))
        with pytest.raises(NotFound):
            await batches.file("alice", expiring.id)
        await batches.expire_files()
        assert not path.exists() and batches.disk.file_path(kept.id).exists()
        await batches.stop()

    asyncio.run(scenario())


def test_the_start_sweeps_what_a_crash_left(tmp_path: Path) -> None:
    (tmp_path / "files").mkdir()
    stray = tmp_path / "files" / ("file-" + "e" * 24)
    stray.write_bytes(b"written, never recorded")
    (tmp_path / "files" / f".{stray.name}.tmp").write_bytes(b"half")
    batches = Batches(GatewayConfig(batch_dir=str(tmp_path)), concurrency=1)

    async def scenario() -> None:
        await batches.start(router=None, state={})  # type: ignore[arg-type]  # no batch to run: never called
        await batches.stop()

    asyncio.run(scenario())
    assert list((tmp_path / "files").iterdir()) == []


def test_the_flags() -> None:
    defaults = configs_from_args(build_parser().parse_args([]))[1]
    assert (defaults.batch_dir, defaults.batch_max_bytes, defaults.batch_concurrency) == (None, 10 * 1024**3, 0)
    config = configs_from_args(build_parser().parse_args(
        ["--batch-dir", "/x", "--batch-max-bytes", "64MiB", "--batch-concurrency", "4"]))[1]
    assert (config.batch_dir, config.batch_max_bytes, config.batch_concurrency) == ("/x", 64 * 1024**2, 4)
    for bad in (["--batch-max-bytes", "lots"], ["--batch-concurrency", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
