"""The seed's `BlockAllocator`, same method names, backed by the Cython `BlockPool`.

Differences from the seed, on purpose: `stats()['used']` counts physical pages once (the seed
counts a shared page once per sequence that holds it) and `stats()` also reports `logical`
(pages summed over sequences) and `shared` (pages with refcount > 1). Out-of-pages raises
`NoFreeBlocksError`, a `RuntimeError` like the seed's, and changes nothing.
"""

from __future__ import annotations

from pagegate.core.block_pool import BlockPool, NoFreeBlocksError

__all__ = ["BlockAllocator", "NoFreeBlocksError"]


class BlockAllocator:
    """Per-sequence page lists over one refcounted pool (the seed's section 3.3.2 interface)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self.allocated_blocks: dict[int, list[int]] = {}

    def allocate(self, seq_id: int, num_blocks: int) -> list[int]:
        """Append `num_blocks` fresh pages to the sequence's table; all or nothing."""
        blocks = self.pool.allocate(num_blocks).tolist()
        self.allocated_blocks.setdefault(seq_id, []).extend(blocks)
        return blocks

    def try_allocate(self, num_blocks: int) -> bool:
        return self.pool.num_free_blocks >= num_blocks

    def free(self, seq_id: int) -> None:
        """Release every page of the sequence (shared pages stay until their last holder frees)."""
        blocks = self.allocated_blocks.pop(seq_id, None)
        if blocks:
            self.pool.free(blocks)

    def share_blocks(self, src_seq: int, dst_seq: int, num_shared: int) -> None:
        """`dst_seq` starts with the first `num_shared` pages of `src_seq`, shared by reference."""
        if src_seq not in self.allocated_blocks:
            raise KeyError(f"sequence {src_seq} holds no pages")
        if dst_seq in self.allocated_blocks:
            raise ValueError(f"sequence {dst_seq} already holds pages")
        shared = self.allocated_blocks[src_seq][:num_shared]
        self.pool.incref(shared)
        self.allocated_blocks[dst_seq] = list(shared)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.allocated_blocks.get(seq_id, []))

    @property
    def free_blocks(self) -> list[int]:
        return self.pool.free_block_ids().tolist()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def stats(self) -> dict:
        used = self.pool.num_used_blocks
        return {
            "total": self.num_blocks,
            "free": self.pool.num_free_blocks,
            "used": used,
            "logical": sum(len(blocks) for blocks in self.allocated_blocks.values()),
            "shared": self.pool.num_shared_blocks,
            "utilization": f"{used / self.num_blocks * 100:.1f}%",
        }
