"""What a router knows from a server's KV-cache events alone: which pages it holds, so which prefix of a
prompt it would serve from cache. The oracle the KV-event tests check the engine's own hits against."""

from __future__ import annotations

import msgpack


class PageIndex:
    """One server's cached pages, keyed by (parent page hash or None, token ids), from its events alone."""

    def __init__(self) -> None:
        self.pages: dict[tuple[int | None, tuple[int, ...]], int] = {}
        self.block_size = 16
        self.removed = 0  # pages evicted so far

    def apply(self, payload: bytes) -> None:
        _, events, _ = msgpack.unpackb(payload)
        for event in events:
            if event[0] == "BlockStored":
                _, hashes, parent, tokens, self.block_size, *_ = event
                for i, block_hash in enumerate(hashes):
                    self.pages[(parent, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))] = block_hash
                    parent = block_hash
            elif event[0] == "BlockRemoved":
                gone = set(event[1])
                self.removed += len(gone)
                self.pages = {key: h for key, h in self.pages.items() if h not in gone}
            else:
                self.pages.clear()

    def cached_tokens(self, prompt: list[int]) -> int:
        parent, hit, size = None, 0, self.block_size
        usable = prompt[:-1]
        for start in range(0, len(usable) - size + 1, size):
            parent = self.pages.get((parent, tuple(usable[start:start + size])))
            if parent is None:
                break
            hit += size
        return hit
