"""The shared page budget's ledger: what is taken never sums past the total, across processes; it has no name
and crosses to a core over a socket."""

import multiprocessing
import os
import socket
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from pagegate.engine.memory.page_ledger import PageLedger, receive_ledger, send_ledger


def test_takes_are_bounded_by_what_is_free():
    ledger = PageLedger.create(100, 2)
    try:
        assert ledger.take(0, 60) == 60
        assert ledger.take(1, 60) == 40  # only 40 left
        assert ledger.take(1, 10) == 0 and ledger.free() == 0
        assert ledger.take(0, 30, at_least=30) == 0
        ledger.give(0, 25)
        assert (ledger.held(0), ledger.free()) == (35, 25)
        assert ledger.clear(1) == 40 and ledger.free() == 65
    finally:
        ledger.close()


def test_an_entry_refused_bytes_contests_the_budget_while_its_want_is_recent():
    ledger = PageLedger.create(120, 3)
    try:
        assert ledger.fair_share(0, 1.0) is None  # nobody wants: an entry may take all that is free
        assert ledger.take(0, 100) == 100
        assert ledger.take(1, 50) == 20  # refused the rest: wanting
        assert ledger.fair_share(0, 1.0) == 60 and ledger.fair_share(2, 1.0) == 60
        assert ledger.fair_share(1, 1.0) is None  # its own want is no contest
        ledger.want(2)
        assert ledger.fair_share(0, 1.0) == 40
        time.sleep(0.02)
        assert ledger.fair_share(0, 0.01) is None  # wants older than the window no longer count
        ledger.clear(1)
        ledger.clear(2)
        assert ledger.fair_share(0, 1.0) is None  # a cleared entry (its cores gone) wants nothing
    finally:
        ledger.close()


def _hammer(fd: int, entry: int) -> int:
    ledger = PageLedger.attach(fd)  # a forked worker inherits the descriptor: the ledger has no name to open
    taken = 0
    for _ in range(300):
        got = ledger.take(entry, 7)
        taken += got
        if got and taken % 3 == 0:
            ledger.give(entry, got)
            taken -= got
    ledger.close()
    return taken


def test_processes_changing_it_at_once_never_overcommit():
    ledger = PageLedger.create(1000, 4)
    try:
        with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("fork")) as pool:
            taken = list(pool.map(_hammer, [ledger.fileno()] * 4, range(4)))
        assert [ledger.held(entry) for entry in range(4)] == taken
        assert sum(taken) + ledger.free() == 1000 and ledger.free() >= 0
    finally:
        ledger.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd_create and /proc/self/fd are Linux's")
def test_the_ledger_has_no_name_and_crosses_a_socket_as_a_descriptor():
    """Nothing that cleans /dev/shm or /tmp can take the budget away: there is no path, and a core gets its own
    descriptor over its socket, the same memory behind it."""
    ledger = PageLedger.create(100, 2)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert os.readlink(f"/proc/self/fd/{ledger.fileno()}").startswith("/memfd:pagegate-ledger")
        send_ledger(ours, ledger.fileno())
        ours.sendall(b"a frame")  # what follows on the socket stays the core's to read
        received = receive_ledger(theirs)
        assert received != ledger.fileno() and theirs.recv(16) == b"a frame"
        core = PageLedger.attach(received)
        os.close(received)
        assert core.take(1, 30) == 30 and ledger.held(1) == 30 and ledger.free() == 70
        core.close()
        assert ledger.take(0, 80) == 70  # the gateway's copy is untouched by the core's close
    finally:
        ours.close()
        theirs.close()
        ledger.close()
