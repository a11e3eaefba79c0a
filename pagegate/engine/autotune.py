"""Auto-tuning of the running cap (the seed's section 3.3.5): fewer sequences after preemptions,
more again while the pool stays under-used with work waiting."""

from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger(__name__)

LOW_USAGE = 0.5  # below this KV usage, with work waiting, the cap grows back


class RunningCap:
    def __init__(self, max_num_seqs: int, window_s: float) -> None:
        self.max = max_num_seqs
        self.value = max_num_seqs
        self.window_s = window_s
        self.preemptions: deque[float] = deque()
        self.low_since: float | None = None

    def update(self, now: float, running: int, preempted: int, usage: float, waiting: int) -> None:
        while self.preemptions and now - self.preemptions[0] > self.window_s:
            self.preemptions.popleft()
        if preempted:
            self.preemptions.extend([now] * preempted)
            self._set(max(1, running), f"{preempted} preemption(s) with {running} left running")
            self.low_since = None
        elif usage < LOW_USAGE and waiting and not self.preemptions and self.value < self.max:
            self.low_since = now if self.low_since is None else self.low_since
            if now - self.low_since >= self.window_s:
                self._set(min(self.max, self.value * 2), f"KV usage {usage:.0%} with {waiting} waiting")
                self.low_since = None
        else:
            self.low_since = None

    def reset(self) -> None:
        """Back to max_num_seqs, its preemptions forgotten: the pool it was tuned on has grown."""
        self.preemptions.clear()
        self.low_since = None
        self._set(self.max, "the KV pool grew")

    def _set(self, value: int, reason: str) -> None:
        if value != self.value:
            log.info("max_num_seqs %d -> %d: %s", self.value, value, reason)
            self.value = value
