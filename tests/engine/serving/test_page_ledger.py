"""The shared page budget's ledger: what is taken never sums past the total, across processes."""

import time
from concurrent.futures import ProcessPoolExecutor

from pagegate.engine.serving.page_ledger import PageLedger


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
        ledger.unlink()


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
        ledger.unlink()


def _hammer(path: str, entry: int) -> int:
    ledger = PageLedger(path)
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
        with ProcessPoolExecutor(4) as pool:
            taken = list(pool.map(_hammer, [ledger.path] * 4, range(4)))
        assert [ledger.held(entry) for entry in range(4)] == taken
        assert sum(taken) + ledger.free() == 1000 and ledger.free() >= 0
    finally:
        ledger.unlink()
