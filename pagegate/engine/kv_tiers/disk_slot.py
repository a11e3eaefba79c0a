"""One sub-directory per process: the first numbered slot whose lock file this process can take."""

from __future__ import annotations

import errno
import fcntl
import os
from contextlib import suppress
from pathlib import Path

from pagegate.engine.kv_tiers.page_file import LOCK_NAME

MAX_SLOTS = 64


def make_private_dirs(path: Path) -> None:
    """Create `path` and its missing parents with mode 0700; directories that exist are left as they are."""
    missing: list[Path] = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with suppress(FileExistsError):
            directory.mkdir(mode=0o700)


def take_slot(root: Path) -> tuple[Path, int]:
    """The first `root/<n>` whose lock this process takes, and the locked descriptor (closing it unlocks).

    NOTE: flock is held per open file, so two servers (or two engine cores of one server) on one directory
    never share a slot, and a lock dies with its process: a restart, even after SIGKILL, takes slot 0 again
    and finds its pages."""
    for number in range(MAX_SLOTS):
        directory = root / str(number)
        make_private_dirs(directory)
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        except OSError:
            os.close(fd)
            raise
        return directory, fd
    raise OSError(errno.EBUSY, f"all {MAX_SLOTS} slots are taken", str(root))
