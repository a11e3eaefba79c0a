"""A process killed (SIGKILL) while writing pages leaves nothing a restart would serve wrongly."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from pagegate.engine.kv_tiers import DiskTier
from pagegate.testing.launcher import wait_for

from .pages import BLOCK_SIZE, FINGERPRINT, page_data, page_key

PAGE_BYTES = 1 << 16
MAX_BYTES = 40 * PAGE_BYTES  # small: the writer also evicts (deletes) while it writes
WRITER = """
import sys
from pagegate.engine.kv_tiers import DiskTier
from tests.engine.kv_tiers.pages import page_data, page_key
tier = DiskTier(sys.argv[1], {max_bytes}, {fingerprint!r}, {page_bytes}, {block_size})
hash = int(sys.argv[2])
while True:
    tier.put(page_key(hash), page_data(hash, {page_bytes}))
    hash += 1
"""


def page_hashes(directory: Path) -> set[int]:
    return {int(name, 16) for _, _, files in os.walk(directory) for name in files if len(name) == 16}


def run_writer_and_kill(directory: Path, first_hash: int, min_pages: int) -> None:
    """Start a writer of pages `first_hash`, `first_hash + 1`, ...; SIGKILL it once `min_pages` are on disk."""
    code = WRITER.format(max_bytes=MAX_BYTES, fingerprint=FINGERPRINT, page_bytes=PAGE_BYTES,
                         block_size=BLOCK_SIZE)
    root = Path(__file__).resolve().parents[3]
    writer = subprocess.Popen([sys.executable, "-c", code, str(directory), str(first_hash)], cwd=root)
    try:
        wait_for(lambda: writer.poll() is not None
                 or len({hash for hash in page_hashes(directory) if hash >= first_hash}) >= min_pages,
                 f"{min_pages} pages on disk", timeout_s=60, poll_s=0.01)
        assert writer.poll() is None, "the writer died by itself"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()


def test_sigkill_mid_write_serves_only_whole_pages(tmp_path: Path) -> None:
    for first_hash, min_pages in ((1, 5), (10_001, 25)):
        run_writer_and_kill(tmp_path, first_hash, min_pages)
    tier = DiskTier(tmp_path, MAX_BYTES, FINGERPRINT, PAGE_BYTES, BLOCK_SIZE)
    assert tier.directory is not None and tier.directory.name == "0"  # the killed writer's lock died with it
    assert not [path for path in tier.directory.iterdir() if path.name.endswith(".tmp")]
    served = [hash for hash in page_hashes(tmp_path) if hash in tier]
    assert served
    for hash in served:
        read = tier.read(hash)
        assert read is not None and read[0] == page_key(hash)
        assert torch.equal(torch.frombuffer(bytearray(read[1]), dtype=torch.uint8), page_data(hash, PAGE_BYTES))
    tier.close()
