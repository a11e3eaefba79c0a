"""The logit masks of structured outputs: each step, the allowed tokens of every constrained row."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch


class GrammarMasks:
    """Each step: the allowed-token bitmask of every constrained row, computed in parallel by llguidance
    and applied to those rows' logits in one batched torch call."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor()
        self._bits = torch.arange(32, dtype=torch.int32)

    def compute(self, matchers: Sequence[llguidance.LLMatcher]) -> torch.Tensor:
        """The packed bitmask [R, ceil(V / 32)] int32 of `matchers` (bit t: token t allowed)."""
        bitmask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        array = bitmask.numpy()
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], array.ctypes.data,
                                               self.words * 4, len(matchers))
        return bitmask

    def allowed(self, bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
        """The bitmask unpacked to bool [R, vocab]."""
        bits = (bitmask.unsqueeze(-1) >> self._bits) & 1
        return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_allowed(logits: torch.Tensor, rows: Sequence[int], allowed: torch.Tensor) -> None:
    """Mask the logits of `rows` to their allowed tokens, in place. A row whose other constraints
    (min_tokens) left nothing allowed samples among the grammar's tokens: the grammar wins."""
    index = torch.tensor(list(rows), device=logits.device)
    allowed = allowed.to(logits.device)
    sub = logits[index]
    masked = sub.masked_fill(~allowed, float("-inf"))
    dead = masked.isneginf().all(dim=-1, keepdim=True)
    logits[index] = torch.where(dead & allowed, torch.zeros_like(sub), masked)
