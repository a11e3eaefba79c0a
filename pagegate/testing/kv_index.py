"""What a router knows from a server's KV-cache events alone: which pages it holds, so which prefix of a
prompt it would serve from cache. The oracle the KV-event tests check the engine's own hits against."""

from __future__ import annotations

from collections import defaultdict

import msgpack

DEVICE = "GPU"


class PageIndex:
    """One server's cached pages per medium ("GPU": the pool; "CPU", "DISK": the tiers under it), keyed by
    (parent page hash or None, token ids), from its events alone."""

    def __init__(self) -> None:
        self.media: dict[str, dict[tuple[int | None, tuple[int, ...]], int]] = defaultdict(dict)
        self.block_size = 16
        self.removed = 0  # pages evicted so far, from any medium

    @property
    def pages(self) -> dict[tuple[int | None, tuple[int, ...]], int]:
        return self.media[DEVICE]

    def apply(self, payload: bytes) -> None:
        _, events, _ = msgpack.unpackb(payload)
        for event in events:
            if event[0] == "BlockStored":
                _, hashes, parent, tokens, self.block_size, _, medium, _ = event
                for i, block_hash in enumerate(hashes):
                    self.media[medium][(parent, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))] = \
                        block_hash
                    parent = block_hash
            elif event[0] == "BlockRemoved":
                gone, medium = set(event[1]), event[2]
                self.removed += len(gone)
                self.media[medium] = {key: h for key, h in self.media[medium].items() if h not in gone}
            else:
                self.media.clear()

    @staticmethod
    def cached_tokens_of(pages: dict[tuple[int | None, tuple[int, ...]], int], prompt: list[int],
                         size: int = 16) -> int:
        """The run of `pages` from the prompt's start, in tokens (one medium alone)."""
        parent: int | None = None
        hit, usable = 0, prompt[:-1]
        for start in range(0, len(usable) - size + 1, size):
            parent = pages.get((parent, tuple(usable[start:start + size])))
            if parent is None:
                break
            hit += size
        return hit

    def cached_tokens(self, prompt: list[int]) -> int:
        """The pool's run of pages from the prompt's start, then the tiers' run after it (as the scheduler looks)."""
        below = {key: h for medium, pages in self.media.items() if medium != DEVICE for key, h in pages.items()}
        parent: int | None = None
        hit, size, usable, where = 0, self.block_size, prompt[:-1], self.pages
        for start in range(0, len(usable) - size + 1, size):
            key = (parent, tuple(usable[start:start + size]))
            if key not in where and where is self.pages:
                where = below
            if key not in where:
                break
            parent = where[key]
            hit += size
        return hit
