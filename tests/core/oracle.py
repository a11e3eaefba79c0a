"""A small pure-Python model of the page pool and block tables: the oracle the Cython core must match."""

from __future__ import annotations

from collections import Counter, deque

from pagegate.core import NoFreeBlocksError, compute_block_hash


class PoolModel:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = True, hash_bits: int = 64) -> None:
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.mask = (1 << hash_bits) - 1
        self.refs = [0] * num_blocks
        self.uncached = deque(range(num_blocks))
        self.cached_free: list[int] = []  # least recently freed first
        self.content: dict[int, tuple] = {}  # block -> (hash, parent, tokens)
        self.index: dict[int, int] = {}  # hash -> block
        self.hits = self.queries = 0

    @property
    def num_free(self) -> int:
        return len(self.uncached) + len(self.cached_free)

    def free_order(self) -> list[int]:
        return list(self.uncached) + self.cached_free

    def take(self) -> int:
        if self.uncached:
            block = self.uncached.popleft()
        else:
            block = self.cached_free.pop(0)
            self.evict(block)
        self.refs[block] = 1
        return block

    def evict(self, block: int) -> None:
        del self.index[self.content.pop(block)[0]]

    def release(self, block: int) -> None:
        (self.cached_free if block in self.content else self.uncached).append(block)

    def ref(self, block: int) -> None:
        if self.refs[block] == 0:
            (self.cached_free if block in self.content else self.uncached).remove(block)
        self.refs[block] += 1

    def unref(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.release(block)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocksError(n, self.num_free)
        return [self.take() for _ in range(n)]

    def check_allocated(self, ids) -> None:
        for block in ids:
            if not 0 <= block < self.num_blocks or self.refs[block] == 0:
                raise ValueError(block)

    def free(self, ids) -> None:
        self.check_allocated(ids)
        if any(count > self.refs[b] for b, count in Counter(ids).items()):
            raise ValueError(ids)
        for block in reversed(list(ids)):  # last page first: a chain is evicted from its tail
            self.unref(block)

    def incref(self, ids) -> None:
        self.check_allocated(ids)
        for block in ids:
            self.ref(block)

    def hash(self, parent: int, tokens) -> int:
        return compute_block_hash(parent, tokens) & self.mask

    def cache_block(self, block: int, parent: int, tokens) -> int:
        self.check_allocated([block])
        entry = (self.hash(parent, tokens), parent, tuple(tokens))
        if not self.caching:
            return entry[0]
        if block in self.content:
            if self.content[block] == entry:
                return entry[0]
            self.evict(block)
        if entry[0] not in self.index:
            self.content[block] = entry
            self.index[entry[0]] = block
        return entry[0]

    def match_prefix(self, tokens, root: int = 0) -> tuple[list[int], int]:
        bs, parent, out = self.block_size, root, []
        for i in range(len(tokens) // bs if self.caching else 0):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = self.hash(parent, chunk)
            block = self.index.get(h)
            if block is None or self.content[block] != (h, parent, chunk):
                break
            self.ref(block)
            out.append(block)
            parent = h
        self.queries += len(tokens)
        self.hits += len(out) * bs
        return out, len(out) * bs


class TablesModel:
    """Block tables over a PoolModel (plus an optional CPU PoolModel)."""

    def __init__(self, pool: PoolModel, cpu: PoolModel | None = None) -> None:
        self.pool, self.cpu = pool, cpu
        self.seqs: dict[int, dict] = {}  # handle -> {"blocks", "tokens", "swapped", "committed", ...}
        self.cow: list[tuple[int, int]] = []

    def add(self, handle: int, blocks=(), tokens: int = 0, root: int = 0) -> None:
        parent = self.pool.content[blocks[-1]][0] if len(blocks) else root
        self.seqs[handle] = {"blocks": list(blocks), "tokens": tokens, "swapped": False,
                             "committed": tokens, "parent": parent, "partial": []}

    def commit(self, handle: int, tokens) -> None:
        seq, bs = self.seqs[handle], self.pool.block_size
        for token in tokens:
            seq["partial"].append(token)
            seq["committed"] += 1
            if seq["committed"] % bs == 0:
                page = seq["blocks"][seq["committed"] // bs - 1]
                seq["parent"] = self.pool.cache_block(page, seq["parent"], seq["partial"])
                seq["partial"] = []

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def needs_copy(self, seq: dict, k: int) -> bool:
        return (k > 0 and seq["tokens"] % self.pool.block_size != 0
                and self.pool.refs[seq["blocks"][-1]] > 1)

    def pages_needed(self, handle: int, k: int) -> int:
        seq = self.seqs[handle]
        return self.pages_for(seq["tokens"] + k) - len(seq["blocks"]) + self.needs_copy(seq, k)

    def grow(self, handle: int, k: int) -> None:
        seq = self.seqs[handle]
        new = self.pages_for(seq["tokens"] + k) - len(seq["blocks"])
        if self.pages_needed(handle, k) > self.pool.num_free:
            raise NoFreeBlocksError(self.pages_needed(handle, k), self.pool.num_free)
        if self.needs_copy(seq, k):
            old, copy = seq["blocks"][-1], self.pool.take()
            self.pool.unref(old)
            seq["blocks"][-1] = copy
            self.cow.append((old, copy))
        seq["blocks"] += [self.pool.take() for _ in range(new)]
        seq["tokens"] += k

    def truncate(self, handle: int, tokens: int) -> int:
        seq = self.seqs[handle]
        if not seq["committed"] <= tokens <= seq["tokens"]:
            raise ValueError(tokens)
        keep = self.pages_for(tokens)
        dropped = seq["blocks"][keep:]
        self.pool.free(dropped)
        seq["blocks"], seq["tokens"] = seq["blocks"][:keep], tokens
        return len(dropped)

    def fork(self, handle: int, child: int) -> None:
        seq = self.seqs[handle]
        for block in seq["blocks"]:
            self.pool.ref(block)
        self.seqs[child] = {**seq, "blocks": list(seq["blocks"]), "partial": list(seq["partial"])}

    def free_sequence(self, handle: int) -> None:
        seq = self.seqs.pop(handle)
        (self.cpu if seq["swapped"] else self.pool).free(seq["blocks"])

    def move(self, handle: int, to_cpu: bool) -> list[tuple[int, int]]:
        seq = self.seqs[handle]
        src, dst = (self.pool, self.cpu) if to_cpu else (self.cpu, self.pool)
        new = dst.allocate(len(seq["blocks"]))
        pairs = list(zip(seq["blocks"], new, strict=True))
        src.free(seq["blocks"])
        seq["blocks"], seq["swapped"] = new, to_cpu
        return pairs
