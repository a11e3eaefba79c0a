"""The rows a step samples: each one's parameters, history, logit bias and random stream, and its result
(torch-free: a tensor is built only for a request with a logit bias)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagegate.engine.outputs import Logprob
from pagegate.engine.sampling.draws import Draws
from pagegate.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher


@dataclass(frozen=True)
class LogitBias:
    """A request's logit_bias as tensors, built once when it arrives: a step adds every row's bias in one
    op instead of walking dicts (a whole-vocabulary bias times n choices was n x V Python tuples a step)."""

    token_ids: torch.Tensor  # int64 [K], inside the vocabulary
    values: torch.Tensor  # float32 [K]

    @classmethod
    def of(cls, bias: dict[int, float] | None, vocab_size: int, device: str | torch.device = "cpu") -> LogitBias | None:
        """None when no entry falls inside the vocabulary (ids outside it are ignored)."""
        entries = [(token, value) for token, value in (bias or {}).items() if 0 <= token < vocab_size]
        if not entries:
            return None
        import torch
        token_ids, values = zip(*entries, strict=True)
        return cls(torch.tensor(token_ids, dtype=torch.long, device=device),
                   torch.tensor(values, dtype=torch.float32, device=device))


@dataclass
class SamplingRow:
    """One row of the logits: its parameters, token history, logit bias and optional private generator."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: Draws | None = None
    logit_bias: LogitBias | None = None
    matcher: LLMatcher | None = None  # structured outputs: the grammar that restricts the next token


@dataclass
class SampleResult:
    token_id: int
    logprob: Logprob | None = None  # set when the row's params ask for logprobs
