"""Embeddings out of hidden states: what a runner's model serves, and the pooling of a generative model's prompt.

An embedding request is a prefill-only request: it is scheduled like any prompt (chunked, batched with
generations, preempted), and each step's final-norm hidden states of its tokens are pooled here instead of
sampled; when its last prompt token is computed the pooled vector, normalised, is its answer and it ends.

NOTE: mean pooling needs the hidden state of every prompt position, so an embedding request takes no prefix-cache
hits (the scheduler skips the lookup for it); a recomputed one starts its sum again at position 0, a swapped one
keeps it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagegate.engine.sequence import Sequence


def pool_step(seqs: list[Sequence], counts: list[int], starts: np.ndarray, hidden: torch.Tensor, mode: str) -> None:
    """Pool the rows of this step's hidden states [T, hidden] that belong to embedding sequences; `starts[i]`
    is the first row of seqs[i] (query_start_loc)."""
    for i, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
        if seq.pools:
            first = int(starts[i])
            pool_rows(seq, hidden[first:first + n], seq.num_computed - n, mode)


def pool_rows(seq: Sequence, rows: torch.Tensor, first_position: int, mode: str) -> None:
    """Take rows [n, hidden] of prompt positions first_position.. of an embedding sequence; on its last prompt
    token, set its request's embedding."""
    complete = seq.num_computed == len(seq.token_ids)
    if mode == "last":
        if complete:
            seq.request.embedding = normalized(rows[-1].float())
        return
    if first_position == 0 or seq.pool_sum is None:  # a (re)started prompt
        seq.pool_sum = torch.zeros(rows.shape[-1], dtype=torch.float32, device=rows.device)
    seq.pool_sum += rows.float().sum(dim=0)
    if complete:
        seq.request.embedding = normalized(seq.pool_sum / len(seq.token_ids))
        seq.pool_sum = None


def normalized(vectors: torch.Tensor) -> torch.Tensor:
    """Unit length along the last dimension, as float32 on the CPU (what crosses to the gateway)."""
    return F.normalize(vectors.float(), dim=-1).cpu()
