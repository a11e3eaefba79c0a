"""Page bookkeeping in Cython: the block pool, block tables, the batch builder (no torch here)."""

from pagegate.core.block_pool import BlockPool, NoFreeBlocksError, compute_block_hash
from pagegate.core.block_tables import BatchBuilder, BlockTables

__all__ = ["BlockPool", "BlockTables", "BatchBuilder", "NoFreeBlocksError", "compute_block_hash"]
