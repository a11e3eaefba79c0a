"""How many KV pages fit (torch-free: the native core sizes its pages here too)."""

from __future__ import annotations

GIB = 1024**3


def check_fits(num_blocks: int, block_size: int, max_model_len: int, block_bytes: int) -> None:
    """Fail at start when one sequence of max_model_len cannot fit in the pool."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks} pages ({num_blocks * block_size} tokens, "
            f"{num_blocks * block_bytes / GIB:.3f} GiB) but one sequence of max_model_len={max_model_len} "
            f"needs {needed} pages ({needed * block_bytes / GIB:.3f} GiB): give more KV memory or a "
            f"smaller --max-model-len (at most {num_blocks * block_size} fits)")
