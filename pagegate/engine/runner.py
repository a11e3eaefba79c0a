"""Turns a scheduled batch into tensors, runs the model, returns logits of the rows that sample."""

from __future__ import annotations

import numpy as np
import torch

from pagegate.core import BatchBuilder, BlockTables
from pagegate.engine.kv_cache import PagedKVCache
from pagegate.engine.model import AttentionMetadata, CausalLM
from pagegate.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, tables: BlockTables,
                 max_num_batched_tokens: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.builder = BatchBuilder(tables, tables.max_seqs, max_num_batched_tokens)

    def _tensor(self, array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t.to(self.device, dtype=dtype, non_blocking=True) if dtype or self.device.type != "cpu" else t

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [S, vocab] for each sequence whose last token was computed this step, in batch order."""
        self.kv_cache.swap_out(batch.pairs("swap_out"))
        self.kv_cache.copy(batch.copies)
        self.kv_cache.swap_in(batch.pairs("swap_in"))
        seqs, counts = batch.seqs, batch.num_tokens
        block_tables, slots, positions, seq_lens, starts = self.builder.build([s.handle for s in seqs], counts)
        input_ids = np.fromiter((t for s, n in zip(seqs, counts, strict=True)
                                 for t in s.token_ids[s.num_computed - n:s.num_computed]),
                                dtype=np.int64, count=len(slots))
        attn = AttentionMetadata(self._tensor(slots), self._tensor(block_tables),
                                 self._tensor(seq_lens), self._tensor(starts))
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), self.kv_cache.layers, attn)
        last = [starts[i + 1] - 1 for i, s in enumerate(seqs) if s.num_computed == len(s.token_ids)]
        return self.model.compute_logits(hidden[last])
