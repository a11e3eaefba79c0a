"""The pages each API key's running sequences hold: what the scheduler weighs a key's fair share and its quota by
(tenants.KeyShare), and what pagegate:key_kv_blocks_used shows.

NOTE: a key holds what its running sequences' block tables hold, a shared page once for each sequence holding it (a
prefix hit counts to the key that hit it): what the key would hold if nothing were shared, so neither its share nor
its quota depends on what other keys happen to have cached. Counted from the block tables at the start of a step
and kept current through it by the scheduler (admissions, growth, preemptions); one number per key, none per page.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagegate.core import BlockTables
from pagegate.engine.sequence import Sequence


def key_name(seq: Sequence) -> str | None:
    """The name of the key `seq` runs for (None: a request without a key: a server without keys, offline)."""
    key = seq.request.key
    return key.name if key is not None else None


def quota_of(seq: Sequence) -> int | None:
    key = seq.request.key
    return key.max_kv_blocks if key is not None else None


class KeyPages:
    """Pages held per key name; sequences without a key are not counted (they all share one place)."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    def recount(self, running: Iterable[Sequence], tables: BlockTables) -> None:
        self.held = {}
        for seq in running:
            if seq.request.key is not None:
                self.add(seq, tables.num_blocks(seq.handle))

    def add(self, seq: Sequence, pages: int) -> None:
        """`seq`'s key holds `pages` more (fewer, when negative)."""
        key = seq.request.key
        if key is not None:
            self.held[key.name] = self.held.get(key.name, 0) + pages

    def of(self, seq: Sequence) -> int:
        """Pages held by `seq`'s key (0 without one)."""
        key = seq.request.key
        return 0 if key is None else self.held.get(key.name, 0)

    def share(self, seq: Sequence) -> float:
        """Pages held by `seq`'s key over its weight: the lower, the further below its fair share it is."""
        key = seq.request.key
        return 0.0 if key is None else self.of(seq) / key.weight

    def over_quota(self, seq: Sequence, more: int) -> bool:
        """Whether `more` pages for `seq` would take its key past its quota."""
        quota = quota_of(seq)
        return quota is not None and self.of(seq) + more > quota

    def room(self, seq: Sequence) -> int | None:
        """Pages `seq`'s key may still take (None: no quota)."""
        quota = quota_of(seq)
        return None if quota is None else max(0, quota - self.of(seq))
