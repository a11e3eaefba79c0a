"""Next-token sampling: penalties, logit bias, min_tokens, temperature, top-k/top-p/min-p, seeds, logprobs.

Order per row: repetition penalty (HF, prompt + output tokens), presence/frequency penalties (OpenAI,
output tokens), logit_bias, min_tokens masking, the grammar's allowed tokens (structured outputs). Logprobs are log_softmax of these processed logits,
before temperature and min-p/top-k/top-p. Then temperature (below GREEDY_TEMPERATURE: the argmax, its
limit) and the min-p/top-k/top-p filters. On the CPU, rows that no processor touches (the common case) take all of
it in C (kernels/cpu_sample.h: one uniform draw a row, the inverse CDF of the kept tokens); the others an
exponential race in torch (argmax of p / q, q ~ Exp(1)). Either way a row with its own generator draws alone, so a
seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from llguidance import LLMatcher

from pagegate.engine.outputs import Logprob
from pagegate.engine.sampling.grammar_masks import GrammarMasks, apply_allowed
from pagegate.engine.sampling.params import SamplingParams
from pagegate.kernels.dispatch import sample_kernel


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
        token_ids, values = zip(*entries, strict=True)
        return cls(torch.tensor(token_ids, dtype=torch.long, device=device),
                   torch.tensor(values, dtype=torch.float32, device=device))


@dataclass
class SamplingRow:
    """One row of the logits: its parameters, token history, logit bias and optional private generator."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    logit_bias: LogitBias | None = None
    matcher: LLMatcher | None = None  # structured outputs: the grammar that restricts the next token


@dataclass
class SampleResult:
    token_id: int
    logprob: Logprob | None = None  # set when the row's params ask for logprobs


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A request's private generator for `SamplingParams.seed`."""
    return torch.Generator(device=device).manual_seed(seed)


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

    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.generator = make_generator(seed, device)
        self.grammar_masks: GrammarMasks | None = None  # built on the first constrained row

    def _grammar_allowed(self, rows: Sequence[SamplingRow], vocab: int) -> tuple[list[int], torch.Tensor] | None:
        constrained = [(i, row.matcher) for i, row in enumerate(rows) if row.matcher is not None]
        if not constrained:
            return None
        if self.grammar_masks is None:
            self.grammar_masks = GrammarMasks(vocab)
        bitmask = self.grammar_masks.compute([matcher for _, matcher in constrained])
        return [i for i, _ in constrained], self.grammar_masks.allowed(bitmask, vocab)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 allowed: tuple[Sequence[int], torch.Tensor] | None = None) -> list[SampleResult]:
        """Next token (and logprobs when asked) for each row of logits [B, V]; `allowed` is (rows,
        bool [R, V]) of the rows whose grammar restricts the next token, else taken from the rows' matchers."""
        kernel = sample_kernel() if self.native and logits.device.type == "cpu" else None
        if kernel is not None and allowed is None and all(_plain(row) for row in rows):
            return self._native(kernel, logits, rows)
        allowed = allowed or self._grammar_allowed(rows, logits.shape[1])
        logits = logits.float().clone()
        apply_penalties(logits, rows)
        apply_logit_bias(logits, rows)
        apply_min_tokens(logits, rows, self.eos_token_ids)
        if allowed is not None:
            apply_allowed(logits, *allowed)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        logprobs = torch.log_softmax(logits[wanted], dim=-1) if wanted else None  # before temperature
        results = [SampleResult(token_id) for token_id in self._choose(logits, rows).tolist()]
        if logprobs is not None:
            _attach_logprobs(results, logprobs, wanted, rows)
        return results

    def _native(self, kernel: ModuleType, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleResult]:
        """The rows on the C sampler (cpu_sample.h): one uniform draw a sampled row, from its own generator if it
        has one; logprobs of the logits as they are (no processor touched them)."""
        n, vocab = len(rows), logits.shape[1]
        params = [row.params for row in rows]
        sampled = [not p.greedy for p in params]
        uniform = [float(torch.rand(1, generator=row.generator or self.generator)) if draw else 0.0
                   for row, draw in zip(rows, sampled, strict=True)]
        wanted = [-1 if p.logprobs is None else min(p.logprobs, vocab) for p in params]
        width = max([0, *wanted])
        temperature = [min(p.temperature, _FLOAT32_MAX) if draw else 0.0 for p, draw in zip(params, sampled, strict=True)]
        tokens, chosen = np.empty(n, np.int32), np.empty(n, np.float32)
        top_ids, top_values = np.empty((n, width), np.int32), np.empty((n, width), np.float32)
        kernel.sample(logits.float().contiguous().numpy(), np.array(temperature, np.float32),
                      np.array([p.top_k for p in params], np.int32), np.array([p.top_p for p in params], np.float32),
                      np.array([p.min_p for p in params], np.float32), np.array(uniform, np.float32),
                      np.array(wanted, np.int32), tokens, chosen, top_ids, top_values, torch.get_num_threads())
        results = [SampleResult(token) for token in tokens.tolist()]
        for i, k in enumerate(wanted):
            if k >= 0:
                top = dict(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist(), strict=True))
                results[i].logprob = Logprob(results[i].token_id, float(chosen[i]), top)
        return results

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        if all(r.params.greedy for r in rows):
            return logits.argmax(dim=-1)
        greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
        # Greedy rows divide by 1 (a vanishing temperature would turn their logits into inf/NaN), and a
        # temperature past float32's range stays finite so masked (-inf) logits do not become NaN.
        temperature = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows],
                                   device=logits.device).clamp_(max=torch.finfo(torch.float32).max)
        probs = torch.softmax(apply_top_k_top_p_min_p(logits / temperature[:, None], rows), dim=-1)
        sampled = (probs / self._exponential_noise(probs, rows)).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def _exponential_noise(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None and not row.params.greedy:
                noise[i].exponential_(generator=row.generator)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # q = 0 would make p / q infinite


def _plain(row: SamplingRow) -> bool:
    """No penalty, bias, min_tokens mask or grammar touches the row's logits: the C sampler takes it."""
    p = row.params
    return (row.matcher is None and row.logit_bias is None and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and len(row.output_token_ids) >= p.min_tokens)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition penalty over prompt + output (HF) and presence/frequency over output (OpenAI), in place."""
    vocab = logits.shape[1]
    repetition = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if repetition:
        seen = _token_counts([list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids)
                              for i in repetition], vocab, logits.device) > 0
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in repetition], device=logits.device)
        sub = logits[repetition]
        scaled = torch.where(sub > 0, sub / penalty[:, None], sub * penalty[:, None])
        logits[repetition] = torch.where(seen, scaled, sub)
    additive = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
    if additive:
        counts = _token_counts([rows[i].output_token_ids for i in additive], vocab, logits.device)
        presence = torch.tensor([rows[i].params.presence_penalty for i in additive], device=logits.device)
        frequency = torch.tensor([rows[i].params.frequency_penalty for i in additive], device=logits.device)
        logits[additive] -= frequency[:, None] * counts + presence[:, None] * (counts > 0)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's logit bias, in place, in one indexed add."""
    biased = [(i, r.logit_bias) for i, r in enumerate(rows) if r.logit_bias is not None]
    if not biased:
        return
    device = logits.device
    sizes = torch.tensor([len(bias.token_ids) for _, bias in biased], device=device)
    row_idx = torch.repeat_interleave(torch.tensor([i for i, _ in biased], device=device), sizes)
    token_idx = torch.cat([bias.token_ids for _, bias in biased])
    values = torch.cat([bias.values for _, bias in biased]).to(logits.dtype)
    logits.index_put_((row_idx, token_idx), values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]) -> None:
    """Forbid stop_token_ids and eos (unless ignore_eos) until a row has min_tokens outputs, in place."""
    vocab = logits.shape[1]
    blocked = [(i, token) for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens
               for token in _stop_ids(r.params, eos_token_ids) if 0 <= token < vocab]
    if blocked:
        row_idx, token_idx = zip(*blocked, strict=True)
        logits[list(row_idx), list(token_idx)] = float("-inf")


def _stop_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> frozenset[int]:
    return params.stop_token_set if params.ignore_eos else params.stop_token_set | set(eos_token_ids)


def apply_top_k_top_p_min_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) tokens below min_p * p_max, then outside the top-k, then outside the top-p nucleus.

    The order is vLLM's; top-p works on the distribution renormalised after the earlier filters.
    """
    vocab, device = logits.shape[1], logits.device
    if any(r.params.min_p > 0 for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], device=device)
        probs = torch.softmax(logits, dim=-1)
        too_small = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(too_small, float("-inf"))
    if not any(0 < r.params.top_k < vocab or r.params.top_p < 1 for r in rows):
        return logits
    top_k = torch.tensor([r.params.top_k or vocab for r in rows], device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)
    remove = rank[None, :] >= top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # The best token always stays; rows with top_p = 1 are left alone (cumsum rounding could reach 1).
    remove |= (mass_before >= top_p[:, None]) & (rank[None, :] > 0) & (top_p[:, None] < 1)
    return logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Occurrences [len(token_lists), vocab] of each token id in each list."""
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)  # column `vocab` absorbs bad ids
    lengths = torch.tensor([len(tokens) for tokens in token_lists])
    flat = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)
    flat = torch.where((flat >= 0) & (flat < vocab), flat, vocab)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    ones = torch.ones(len(flat), device=device)
    counts.index_put_((rows.to(device), flat.to(device)), ones, accumulate=True)
    return counts[:, :vocab]


def _attach_logprobs(results: list[SampleResult], logprobs: torch.Tensor, wanted: list[int],
                     rows: Sequence[SamplingRow]) -> None:
    """Fill in the sampled token's logprob and the top alternatives for the rows in `wanted`."""
    chosen = torch.tensor([results[i].token_id for i in wanted], device=logprobs.device)
    sampled = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    wanted_top = [rows[i].params.logprobs or 0 for i in wanted]
    top_values, top_ids = (t.tolist() for t in logprobs.topk(min(max(wanted_top), logprobs.shape[1]), dim=-1))
    for j, (i, k) in enumerate(zip(wanted, wanted_top, strict=True)):
        top = dict(zip(top_ids[j][:k], top_values[j][:k], strict=True))
        results[i].logprob = Logprob(results[i].token_id, sampled[j], top)
