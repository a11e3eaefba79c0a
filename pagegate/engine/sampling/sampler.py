"""Next-token sampling: penalties, logit bias, min_tokens, temperature, top-k/top-p/min-p, seeds, logprobs.

Order per row: repetition penalty (HF, prompt + output tokens), presence/frequency penalties (OpenAI,
output tokens), logit_bias, min_tokens masking, the grammar's allowed tokens (structured outputs). Logprobs are log_softmax of these processed logits,
before temperature and min-p/top-k/top-p. Then temperature (below GREEDY_TEMPERATURE: the argmax, its
limit) and the min-p/top-k/top-p filters. On the CPU, rows that no processor touches (the common case) take all of
it in C (kernels/cpu_sample.h: one uniform draw a row, the inverse CDF of the kept tokens); the others an
exponential race in torch (argmax of p / q, q ~ Exp(1)). Either way a row with its own generator draws alone, so a
seeded request samples the same tokens whatever else is in the batch.

NOTE: torch is imported only for the rows that need its processors (processors.py), or logits that come as tensors:
the native core (native_runner.py, issue 57) samples plain rows without it; its random
streams (draws.py) are torch's CPU generator's, number for number.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from pagegate.engine.outputs import Logprob
from pagegate.engine.sampling.draws import Draws
from pagegate.engine.sampling.rows import LogitBias, SampleResult, SamplingRow
from pagegate.kernels.dispatch import default_threads, sample_kernel

if TYPE_CHECKING:
    import torch

    from pagegate.engine.sampling.grammar_masks import GrammarMasks

__all__ = ["LogitBias", "SampleResult", "Sampler", "SamplingRow", "choice_seed", "make_generator"]


def make_generator(seed: int, device: str | torch.device = "cpu") -> Draws:
    """A request's private generator for `SamplingParams.seed`."""
    return Draws(seed, device)


_MASK64 = 2**64 - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def choice_seed(seed: int, index: int) -> int:
    """The generator seed of choice `index` of a request seeded with `seed`.

    NOTE: choice 0 keeps the seed itself (so n = 1 samples as before); choice i > 0 takes a 64-bit mix of
    (seed, i). `seed + i` (vLLM's way) made (seed 1, choice 1) the same stream as (seed 2, choice 0), so
    nearby seeds shared most of their samples; mixed, two requests share a stream only by a 2^-64 accident.
    """
    return seed if index == 0 else _splitmix64(_splitmix64(seed & _MASK64) ^ index)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Sampler:
    """Samples one token per logits row; owns the generator shared by unseeded rows."""

    native = True  # CPU rows that no processor touches go to the C sampler (tests turn it off to check torch's)

    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.generator = make_generator(seed, device)
        self.grammar_masks: GrammarMasks | None = None  # built on the first constrained row

    def _grammar_allowed(self, rows: Sequence[SamplingRow], vocab: int) -> tuple[list[int], torch.Tensor] | None:
        constrained = [(i, row.matcher) for i, row in enumerate(rows) if row.matcher is not None]
        if not constrained:
            return None
        if self.grammar_masks is None:
            from pagegate.engine.sampling.grammar_masks import GrammarMasks
            self.grammar_masks = GrammarMasks(vocab)
        bitmask = self.grammar_masks.compute([matcher for _, matcher in constrained])
        return [i for i, _ in constrained], self.grammar_masks.allowed(bitmask, vocab)

    def __call__(self, logits: np.ndarray | torch.Tensor, rows: Sequence[SamplingRow],
                 allowed: tuple[Sequence[int], torch.Tensor] | None = None) -> list[SampleResult]:
        """Next token (and logprobs when asked) for each row of logits [B, V] (a tensor, or a float32 array of the
        CPU's); `allowed` is (rows, bool [R, V]) of the rows whose grammar restricts the next token, else taken
        from the rows' matchers."""
        on_cpu = isinstance(logits, np.ndarray) or logits.device.type == "cpu"
        kernel = sample_kernel() if self.native and on_cpu else None
        if kernel is not None and allowed is None and all(_plain(row) for row in rows):
            return self._native(kernel, logits, rows)
        from pagegate.engine.sampling import processors  # torch's, for the rows that need it
        allowed = allowed or self._grammar_allowed(rows, logits.shape[1])
        return processors.sample(logits, rows, allowed, self.eos_token_ids, self.generator.torch_generator())

    def _native(self, kernel: ModuleType, logits: Any, rows: Sequence[SamplingRow]) -> list[SampleResult]:
        """The rows on the C sampler (cpu_sample.h): one uniform draw a sampled row, from its own generator if it
        has one; logprobs of the logits as they are (no processor touched them)."""
        n, vocab = len(rows), logits.shape[1]
        params = [row.params for row in rows]
        sampled = [not p.greedy for p in params]
        uniform = [(row.generator or self.generator).uniform() if draw else 0.0
                   for row, draw in zip(rows, sampled, strict=True)]
        wanted = [-1 if p.logprobs is None else min(p.logprobs, vocab) for p in params]
        width = max([0, *wanted])
        temperature = [min(p.temperature, _FLOAT32_MAX) if draw else 0.0 for p, draw in zip(params, sampled, strict=True)]
        tokens, chosen = np.empty(n, np.int32), np.empty(n, np.float32)
        top_ids, top_values = np.empty((n, width), np.int32), np.empty((n, width), np.float32)
        kernel.sample(np.ascontiguousarray(logits, dtype=np.float32), np.array(temperature, np.float32),
                      np.array([p.top_k for p in params], np.int32), np.array([p.top_p for p in params], np.float32),
                      np.array([p.min_p for p in params], np.float32), np.array(uniform, np.float32),
                      np.array(wanted, np.int32), tokens, chosen, top_ids, top_values, _threads(logits))
        results = [SampleResult(token) for token in tokens.tolist()]
        for i, k in enumerate(wanted):
            if k >= 0:
                top = dict(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist(), strict=True))
                results[i].logprob = Logprob(results[i].token_id, float(chosen[i]), top)
        return results


def _threads(logits: Any) -> int:
    """The C sampler's threads: torch's where the logits are a tensor (the torch runner may have set them), else the
    CPUs this process may run on."""
    if isinstance(logits, np.ndarray):
        return default_threads()
    import torch
    return torch.get_num_threads()


def _plain(row: SamplingRow) -> bool:
    """No penalty, bias, min_tokens mask or grammar touches the row's logits: the C sampler takes it."""
    p = row.params
    return (row.matcher is None and row.logit_bias is None and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and len(row.output_token_ids) >= p.min_tokens)
