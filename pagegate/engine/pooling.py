"""Embeddings out of hidden states: what a runner's model serves, and the pooling of a generative model's prompt.

An embedding request is a prefill-only request: it is scheduled like any prompt (chunked, batched with
generations, preempted), and each step's final-norm hidden states of its tokens are pooled here instead of
sampled; when its last prompt token is computed the pooled vector, normalised, is its answer and it ends.

NOTE: mean pooling needs the hidden state of every prompt position, so an embedding request takes no prefix-cache
hits (the scheduler skips the lookup for it); a recomputed one starts its sum again at position 0, a swapped one
keeps it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from pagegate.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

Rows = Any  # float rows [n, hidden]: a numpy array (the native core's), or a tensor on any device (the torch runner's)


def pool_step(seqs: list[Sequence], counts: list[int], starts: np.ndarray, hidden: Rows, mode: str) -> None:
    """Pool the rows of this step's hidden states [T, hidden] that belong to embedding sequences; `starts[i]`
    is the first row of seqs[i] (query_start_loc)."""
    for i, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
        if seq.pools:
            first = int(starts[i])
            pool_rows(seq, hidden[first:first + n], seq.num_computed - n, mode)


def pool_rows(seq: Sequence, rows: Rows, first_position: int, mode: str) -> None:
    """Take rows [n, hidden] of prompt positions first_position.. of an embedding sequence; on its last prompt
    token, set its request's embedding."""
    rows = _on_host(rows)
    complete = seq.num_computed == len(seq.token_ids)
    if mode == "last":
        if complete:
            seq.request.embedding = normalized(rows[-1])
        return
    if first_position == 0 or seq.pool_sum is None:  # a (re)started prompt
        seq.pool_sum = np.zeros(rows.shape[-1], dtype=np.float32)
    seq.pool_sum += rows.sum(axis=0, dtype=np.float32)
    if complete:
        seq.request.embedding = normalized(seq.pool_sum / np.float32(len(seq.token_ids)))
        seq.pool_sum = None


def normalized(vector: np.ndarray) -> np.ndarray:
    """Unit length (F.normalize's: divided by the norm, or by 1e-12 if that is smaller), float32."""
    return (vector / np.float32(max(float(np.linalg.norm(vector)), 1e-12))).astype(np.float32)


def _on_host(rows: np.ndarray | torch.Tensor) -> np.ndarray:
    """Rows as a float32 numpy array (a tensor moved to the CPU: only an embedding's rows, never the step's)."""
    if isinstance(rows, np.ndarray):
        return rows.astype(np.float32, copy=False)
    return rows.detach().float().cpu().numpy()
