"""Page bookkeeping in Cython: the block pool, block tables, the batch builder (no torch here)."""

from pagegate.core.block_pool import BlockPool, NoFreeBlocksError, compute_block_hash
from pagegate.core.block_tables import BatchBuilder, BlockTables

NO_PAGES = -1  # the handle of a sequence that holds no pages (BlockTables handles are >= 0)

__all__ = ["NO_PAGES", "BlockPool", "BlockTables", "BatchBuilder", "NoFreeBlocksError", "compute_block_hash"]
