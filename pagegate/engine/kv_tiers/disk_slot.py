"""The tier's directories, checked before use, and one slot per process: the first numbered sub-directory whose
lock file this process can take.

A directory the tier uses (the configured one, its fingerprint sub-directory, the slot) must not be a symbolic
link, must belong to this process's effective user and must not be writable by group or others, as ssh and
PostgreSQL demand of theirs: the tier deletes and replaces files in them, so a directory someone else planted
(say, `/tmp/pagegate-kv` created first by another user, or a slot linked to `/etc`) would aim that at their choice.
Directories it creates are 0700. Past the checks every file is reached through the slot's descriptor, so the
path is never looked up again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from contextlib import suppress
from pathlib import Path
from typing import NamedTuple

from pagegate.engine.kv_tiers.page_file import LOCK_NAME

MAX_SLOTS = 64
DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirectory(OSError):
    """A tier directory this server refuses: a link, another user's, or writable by group or others."""


class Slot(NamedTuple):
    path: Path  # for messages and tests; files are reached through `dir_fd` only
    dir_fd: int
    lock_fd: int  # holds the slot's flock: closing it unlocks


def make_private_dirs(path: Path) -> None:
    """Create `path` and its missing parents with mode 0700; directories that exist are left as they are."""
    missing: list[Path] = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with suppress(FileExistsError):
            directory.mkdir(mode=0o700)


def check_private(fd: int, path: Path) -> None:
    """UnsafeDirectory unless the open directory `fd` is this effective user's and writable by it alone."""
    info, euid = os.fstat(fd), os.geteuid()
    if info.st_uid != euid:
        raise UnsafeDirectory(errno.EPERM, f"owned by uid {info.st_uid}, not by this server's uid {euid}",
                              str(path))
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(errno.EPERM, f"writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}; "
                                           "chmod go-w it)", str(path))


def open_private_dir(name: str | Path, path: Path, dir_fd: int | None = None) -> int:
    """A descriptor of directory `name` (in `dir_fd`, created 0700 when missing) once check_private passes."""
    with suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    try:
        fd = os.open(name, DIRECTORY_FLAGS, dir_fd=dir_fd)
    except OSError as error:  # O_NOFOLLOW met a link: ELOOP, or ENOTDIR with O_DIRECTORY
        if error.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, dir_fd):
            raise UnsafeDirectory(errno.ELOOP, "a symbolic link (give the directory itself)", str(path)) from None
        raise
    try:
        check_private(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_link(name: str | Path, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _try_lock(slot_fd: int) -> int | None:
    """The slot's lock file, locked, or None when another process holds it."""
    fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                 dir_fd=slot_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def take_slot(base: Path, name: str) -> Slot:
    """The first `base/name/<n>` whose lock this process takes, each directory on the way checked.

    NOTE: flock is held per open file, so two servers (or two engine cores of one server) on one directory
    never share a slot, and a lock dies with its process: a restart, even after SIGKILL, takes slot 0 again
    and finds its pages. Only the directories the tier uses are checked, not the parents of `base` (the
    operator's choice, as an ordinary path)."""
    make_private_dirs(base.parent)
    base_fd = open_private_dir(base, base)
    try:
        root_fd = open_private_dir(name, base / name, base_fd)
    finally:
        os.close(base_fd)
    try:
        for number in range(MAX_SLOTS):
            path = base / name / str(number)
            slot_fd = open_private_dir(str(number), path, root_fd)
            try:
                lock_fd = _try_lock(slot_fd)
            except BaseException:
                os.close(slot_fd)
                raise
            if lock_fd is not None:
                return Slot(path, slot_fd, lock_fd)
            os.close(slot_fd)
    finally:
        os.close(root_fd)
    raise OSError(errno.EBUSY, f"all {MAX_SLOTS} slots are taken", str(base / name))
