"""The bytes under --batch-dir: paths only from this server's ids, files written whole or not at all, one server
per folder, and what a crash leaves swept at start-up."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from pagegate.gateway.batches.disk import BatchDirInUse, BatchDisk, FileTooLarge

FILE = "file-" + "a" * 24
BATCH = "batch_" + "b" * 24


def test_a_path_is_only_made_from_an_id_of_this_server(tmp_path: Path) -> None:
    disk = BatchDisk(tmp_path)
    for bad in ("../batches.sqlite3", "file-../../etc/passwd", "file-" + "a" * 23 + "/", "x", FILE + "\n"):
        with pytest.raises(ValueError):
            disk.file_path(bad)
    with pytest.raises(ValueError):
        disk.input_path("batch_../x")
    assert disk.file_path(FILE) == tmp_path / "files" / FILE


def test_an_upload_too_long_leaves_nothing_behind(tmp_path: Path) -> None:
    disk = BatchDisk(tmp_path)
    with pytest.raises(FileTooLarge):
        disk.write_upload(FILE, io.BytesIO(b"x" * 100), limit=99)
    assert list((tmp_path / "files").iterdir()) == []
    assert disk.write_upload(FILE, io.BytesIO(b"x" * 99), limit=99) == 99
    assert disk.file_path(FILE).read_bytes() == b"x" * 99


def test_one_server_per_folder(tmp_path: Path) -> None:
    disk = BatchDisk(tmp_path)
    with pytest.raises(BatchDirInUse):
        BatchDisk(tmp_path)
    disk.close()
    BatchDisk(tmp_path).close()


def test_a_batch_keeps_its_input_when_the_file_is_deleted(tmp_path: Path) -> None:
    disk = BatchDisk(tmp_path)
    disk.write_upload(FILE, io.BytesIO(b'{"a": 1}\n'), limit=100)
    disk.link_input(BATCH, FILE)
    disk.delete_file(FILE)
    assert not disk.file_path(FILE).exists() and disk.input_path(BATCH).read_bytes() == b'{"a": 1}\n'


def test_the_sweep_removes_what_no_record_names(tmp_path: Path) -> None:
    disk = BatchDisk(tmp_path)
    kept, stray = FILE, "file-" + "c" * 24
    for file_id in (kept, stray):
        disk.write_upload(file_id, io.BytesIO(b"x"), limit=10)
    (tmp_path / "files" / f".{kept}.tmp").write_bytes(b"half")
    disk.link_input(BATCH, kept)
    ended = "batch_" + "d" * 24
    disk.link_input(ended, kept)
    (tmp_path / "files" / "notes.txt").write_bytes(b"not the server's")  # a folder the user already had
    assert disk.sweep({kept}, {BATCH}) == 3
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [kept, "notes.txt"]
    assert [p.name for p in (tmp_path / "inputs").iterdir()] == [BATCH]
