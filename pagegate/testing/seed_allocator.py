"""The seed's pure-Python BlockAllocator (the document pagegate grew from, section 3.3.2), copied as the baseline (two annotations added for mypy)."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks))
        self.allocated_blocks: dict[int, list[int]] = {}
        self.block_refcount: dict[int, int] = {}

    def allocate(self, seq_id: int, num_blocks: int) -> list:
        if len(self.free_blocks) < num_blocks:
            raise RuntimeError(f"OOM: needed {num_blocks}, free {len(self.free_blocks)}")
        blocks = []
        for _ in range(num_blocks):
            block_id = self.free_blocks.pop()
            blocks.append(block_id)
            self.block_refcount[block_id] = 1
        self.allocated_blocks.setdefault(seq_id, []).extend(blocks)
        return blocks

    def try_allocate(self, num_blocks: int) -> bool:
        return len(self.free_blocks) >= num_blocks

    def free(self, seq_id: int):
        if seq_id not in self.allocated_blocks:
            return
        for block_id in self.allocated_blocks[seq_id]:
            self.block_refcount[block_id] -= 1
            if self.block_refcount[block_id] <= 0:
                self.free_blocks.append(block_id)
                del self.block_refcount[block_id]
        del self.allocated_blocks[seq_id]

    def share_blocks(self, src_seq: int, dst_seq: int, num_shared: int):
        src_blocks = self.allocated_blocks[src_seq][:num_shared]
        for block_id in src_blocks:
            self.block_refcount[block_id] += 1
        self.allocated_blocks[dst_seq] = src_blocks.copy()
