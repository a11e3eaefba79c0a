"""A draft model for speculation: a smaller model of the same vocabulary that guesses the target's next tokens,
greedily, over its own KV pages and block tables.

Greedy guesses are a deterministic function of the sequence, so the engine's rule (keep a guess while the target's
sample equals it) stays exact for every sampling parameter, as with n-gram guesses. The draft's slots are never
committed: after a step its table is cut back to the tokens the target kept, which its KV already holds.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np
import torch

from pagegate.config import EngineConfig
from pagegate.core import BatchBuilder, BlockPool, BlockTables
from pagegate.engine.forward import forward
from pagegate.engine.kv_cache import PagedKVCache
from pagegate.engine.loading.loader import load_checkpoint
from pagegate.engine.models.native import NativeDecoder
from pagegate.engine.parallel import StepInputs
from pagegate.engine.sequence import Sequence
from pagegate.kernels.kv_format import resolve_format

log = logging.getLogger(__name__)
_NO_PAIRS = np.zeros((0, 2), dtype=np.int32)


class DraftModel:
    """Guesses for a batch of sequences: one draft forward per guessed position, all sequences at once."""

    def __init__(self, path: str, config: EngineConfig, device: torch.device, num_blocks: int, max_model_len: int,
                 vocab_size: int) -> None:
        (self.model, model_config, _), _ = load_checkpoint(path, config.dtype, device, config.quantization)
        if model_config.vocab_size != vocab_size:
            raise ValueError(f"the draft model {path} has a vocabulary of {model_config.vocab_size} tokens, the "
                             f"target {vocab_size}: a draft must share the target's tokenizer")
        self.model.fit_context(max_model_len)
        m, block_size = self.model, config.cache.block_size
        kv_format = resolve_format(config.cache.kv_cache_dtype, m.dtype, device)
        self.kv_cache = PagedKVCache(m.num_layers, num_blocks, block_size, m.num_kv_heads, m.head_dim, kv_format,
                                     device, 0)
        self.native = NativeDecoder.build(m, self.kv_cache)
        max_seqs, max_blocks = config.scheduler.table_shape(max_model_len, block_size)
        self.tables = BlockTables(BlockPool(num_blocks, block_size, False), max_seqs, max_blocks)
        self.builder = BatchBuilder(self.tables, max_seqs, config.scheduler.step_tokens + max_seqs)
        self._handles: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self._guessed_from: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        log.info("draft model %s: %d KV pages of its own", path, num_blocks)

    @torch.inference_mode()
    def guess(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy guesses after each sequence's tokens (none where its pages run out)."""
        for seq in seqs:
            self.settle(seq, 0)  # guesses never verified (the sequence was preempted) are not its tokens
        pending = {i: seq.token_ids[self.tables.num_tokens(h):] for i, seq in enumerate(seqs)
                   if ks[i] > 0 and (h := self._handle(seq)) is not None}
        self._catch_up(seqs, pending)
        guesses: list[list[int]] = [[] for _ in seqs]
        for position in range(max(ks, default=0)):
            rows = [i for i in pending if ks[i] > position and self._grow(seqs[i], pending[i])]
            if not rows:
                break
            hidden, starts = self._forward([(self._handles[seqs[i]], pending[i]) for i in rows])
            logits = (self.native or self.model).compute_logits(hidden[starts[1:] - 1])
            for i, token in zip(rows, logits.argmax(dim=-1).tolist(), strict=True):
                guesses[i].append(token)
            pending = {i: [guesses[i][-1]] for i in rows}
        for seq in seqs:
            self._guessed_from[seq] = len(seq.token_ids)
        return guesses

    def _catch_up(self, seqs: list[Sequence], pending: dict[int, list[int]]) -> None:
        """While more tokens are pending than one forward takes (a new sequence's prompt), compute all but each
        row's last in chunks; `pending` keeps what is left (and loses the rows the pool cannot hold)."""
        limit = self.builder.max_num_tokens
        while sum(map(len, pending.values())) > limit:
            rows, room = [], limit - len(pending)
            for i, tokens in list(pending.items()):
                n = min(len(tokens) - 1, room)
                if n > 0 and self._grow(seqs[i], tokens[:n]):
                    rows.append((i, n))
                    room -= n
                elif n > 0:
                    del pending[i]
            if not rows:
                return
            self._forward([(self._handles[seqs[i]], pending[i][:n]) for i, n in rows])
            for i, n in rows:
                pending[i] = pending[i][n:]

    def settle(self, seq: Sequence, kept: int) -> None:
        """Keep the draft's KV of the guesses the target kept (all but the last guess have KV)."""
        handle, start = self._handles.get(seq), self._guessed_from.pop(seq, None)
        if handle is not None and start is not None:
            self.tables.truncate(handle, min(self.tables.num_tokens(handle), start + kept))

    def release(self, seq: Sequence) -> None:
        handle = self._handles.pop(seq, None)
        if handle is not None:
            self.tables.free_sequence(handle)

    def _handle(self, seq: Sequence) -> int | None:
        if seq not in self._handles:
            try:
                self._handles[seq] = self.tables.add_sequence()
            except ValueError:  # every slot in use: this sequence goes without guesses
                return None
        return self._handles[seq]

    def _grow(self, seq: Sequence, tokens: list[int]) -> bool:
        """Uncommitted slots for tokens the draft computes next; a sequence the pool cannot hold is dropped."""
        handle = self._handles[seq]
        if self.tables.pages_needed(handle, len(tokens)) > self.tables.pool.num_free_blocks:
            self.release(seq)
            return False
        self.tables.grow(handle, len(tokens))
        return True

    def _forward(self, rows: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, np.ndarray]:
        """Hidden states of each (handle, tokens just grown into its table) row, and where each row starts."""
        handles, counts = [h for h, _ in rows], [len(tokens) for _, tokens in rows]
        block_tables, slots, positions, seq_lens, starts = self.builder.build(handles, counts)
        input_ids = np.fromiter((t for _, tokens in rows for t in tokens), dtype=np.int64, count=len(slots))
        step = StepInputs(input_ids, positions, slots, block_tables, seq_lens, starts, _NO_PAIRS, _NO_PAIRS,
                          _NO_PAIRS)
        return forward(self.model, self.kv_cache, step, self.native), starts
