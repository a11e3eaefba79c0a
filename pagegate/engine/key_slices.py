"""Short steps for the API keys over their share of pages while a key under it is at work (issue 60).

NOTE: fair admission and the owed step (Scheduler._fill_owed) put a light key's prompt first and alone, but it still
waits for the step in flight, and beside a heavy key's 64 decodes that step is several times the prompt's own
(SmolLM2 Q4_1 on 2 cores: ~50 ms against ~10). So while a key holding under OWED_FRACTION of its weighted share of
the running pages is at work (it runs or waits, or its last request left less than LINGER_S ago: a user between two
requests), the keys over their share take at most `tokens` tokens a step together, their decodes least recently
served first, so that every step the light key's next prompt may arrive behind is short. The keys at or under their
share are not held back, and without such a light key nothing is.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from pagegate.engine.key_pages import KeyPages, key_name
from pagegate.engine.sequence import Sequence
from pagegate.engine.tenants import ONLINE, KeyShare

OWED_FRACTION = 0.5  # a key holding under this part of its weighted share of the running pages is owed
LINGER_S = 1.0  # a key is at work this long after its last online sequence left


class KeySlices:
    """The keys owed this step (under OWED_FRACTION of their weighted share), and while there are any, which
    sequences of the keys over their share a step may hold and how many tokens of theirs are left."""

    def __init__(self, tokens: int | None) -> None:
        self.tokens = tokens or 0  # 0 (or None: a config on_device did not see): never held back
        self.owed: frozenset[str] = frozenset()  # this step's keys at work under OWED_FRACTION of their share
        self.over: frozenset[str] = frozenset()  # this step's keys over their share (empty: no slice this step)
        self._served: set[Sequence] = set()  # this step's decodes of those keys that may run
        self._left = 0  # tokens those keys' other sequences may still take this step
        self._gone: dict[str, tuple[KeyShare, float]] = {}  # keys whose last online sequence left, and when
        self._step = 0

    def leave(self, seq: Sequence, now: float) -> None:
        """`seq` left the scheduler (finished or aborted) at `now`: its key lingers at work a while."""
        key = seq.request.key
        if key is not None and seq.request.lane == ONLINE:
            self._gone[key.name] = (key, now)

    def begin(self, running: list[Sequence], waiting: Iterable[Sequence], pages: KeyPages, now: float) -> None:
        """Decide this step's slice: `pages` as the step starts, `running` in scheduling order."""
        self._step += 1
        self._gone = {name: gone for name, gone in self._gone.items() if now - gone[1] < LINGER_S}
        self.owed, over = self._weigh(running, waiting, pages)
        self.over = over if self.tokens and self.owed else frozenset()
        self._served, self._left = set(), self.tokens
        if self.over:
            decodes = [seq for seq in running if key_name(seq) in self.over and seq.decodes]
            decodes.sort(key=lambda seq: seq.served_step)  # stable: most urgent first among equals
            self._served = set(decodes[:self.tokens])
            self._left -= len(self._served)

    def _weigh(self, running: list[Sequence], waiting: Iterable[Sequence],
               pages: KeyPages) -> tuple[frozenset[str], frozenset[str]]:
        """The keys at work under OWED_FRACTION of their weighted share of the pages, and those over it."""
        at_work = {name: key for name, (key, _) in self._gone.items()}
        for seq in itertools.chain(running, waiting):
            if seq.request.key is not None and seq.request.lane == ONLINE:
                at_work[seq.request.key.name] = seq.request.key
        shares = {name: pages.held.get(name, 0) / key.weight for name, key in at_work.items()}
        total = sum(pages.held.get(name, 0) for name in at_work)
        if len(at_work) < 2 or total == 0:
            return frozenset(), frozenset()
        fair = total / sum(key.weight for key in at_work.values())  # pages per unit of weight
        return (frozenset(name for name, share in shares.items() if share < OWED_FRACTION * fair),
                frozenset(name for name, share in shares.items() if share > fair))

    def allows(self, seq: Sequence) -> bool:
        """Whether `seq`'s decode may run this step."""
        return key_name(seq) not in self.over or seq in self._served

    def allowance(self, seq: Sequence, budget: int) -> int:
        """The tokens of `budget` that `seq` may take this step."""
        if self.allows(seq):
            return budget
        return min(budget, max(self._left, 0))  # a decode's guesses may have overdrawn it

    def took(self, seq: Sequence, n: int) -> None:
        """`seq` computes `n` tokens this step."""
        seq.served_step = self._step
        if key_name(seq) in self.over and seq not in self._served:
            self._left -= n

