# Type stub of page_map.pyx (page-state bytes for viewers), so mypy checks its callers.
import numpy as np
import numpy.typing as npt

from pagegate.core.block_pool import BlockPool

Bytes = npt.NDArray[np.uint8]

CACHED: int
MAX_REFCOUNT: int

def fill_page_states(pool: BlockPool, out: Bytes) -> None: ...
def max_encoded_size(n: int) -> int: ...
def rle_encode(states: Bytes, previous: Bytes | None, out: Bytes) -> int: ...
def rle_decode(data: Bytes | bytes, states: Bytes, delta: bool = False) -> None: ...
