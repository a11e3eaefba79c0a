"""Turns a scheduled batch into tensors, runs the model, returns logits of the rows that sample."""

from __future__ import annotations

import numpy as np
import torch

from pagegate.core import BatchBuilder, BlockTables
from pagegate.engine.kv_cache import PagedKVCache
from pagegate.engine.model import AttentionMetadata, CausalLM
from pagegate.engine.parallel import StepChannel, StepInputs
from pagegate.engine.scheduler import ScheduledBatch


class ModelRunner:
    """Rank 0's runner: builds each step's inputs, sends them to the tensor-parallel workers (if any) and
    runs the same forward; only rank 0 computes logits."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, tables: BlockTables,
                 max_num_batched_tokens: int, channel: StepChannel | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.channel = channel
        self.builder = BatchBuilder(tables, tables.max_seqs, max_num_batched_tokens)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [S, vocab] for each sequence whose last token was computed this step, in batch order."""
        seqs, counts = batch.seqs, batch.num_tokens
        block_tables, slots, positions, seq_lens, starts = self.builder.build([s.handle for s in seqs], counts)
        input_ids = np.fromiter((t for s, n in zip(seqs, counts, strict=True)
                                 for t in s.token_ids[s.num_computed - n:s.num_computed]),
                                dtype=np.int64, count=len(slots))
        step = StepInputs(input_ids, positions, slots, block_tables, seq_lens, starts,
                          batch.pairs("swap_out"), batch.copies, batch.pairs("swap_in"))
        if self.channel is not None:
            self.channel.send(step)
        hidden = forward(self.model, self.kv_cache, step)
        last = [starts[i + 1] - 1 for i, s in enumerate(seqs) if s.num_computed == len(s.token_ids)]
        return self.model.compute_logits(hidden[last])


@torch.inference_mode()
def forward(model: CausalLM, kv_cache: PagedKVCache, step: StepInputs) -> torch.Tensor:
    """The step's page moves, then the forward pass: hidden states [T, hidden] (every rank runs this)."""
    kv_cache.swap_out(step.swap_out)
    kv_cache.copy(step.copies)
    kv_cache.swap_in(step.swap_in)
    device = model.device

    def tensor(array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t if device.type == "cpu" else t.to(device, non_blocking=True)

    attn = AttentionMetadata(tensor(step.slot_mapping), tensor(step.block_tables), tensor(step.seq_lens),
                             tensor(step.query_start_loc))
    return model(tensor(step.input_ids), tensor(step.positions), kv_cache.layers, attn)
