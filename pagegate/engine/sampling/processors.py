"""The torch half of the sampler: the rows some processor touches (penalties, logit bias, min_tokens, a grammar),
and any logits on an accelerator. Imported by Sampler when such a row comes, so an engine core that never sees one
never imports torch.

The row's token is an exponential race (argmax of p / q, q ~ Exp(1)): each row with its own generator draws its
noise alone, so a seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagegate.engine.outputs import Logprob
from pagegate.engine.sampling.grammar_masks import apply_allowed
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.rows import SampleResult, SamplingRow


@torch.inference_mode()
def sample(logits: np.ndarray | torch.Tensor, rows: Sequence[SamplingRow],
           allowed: tuple[Sequence[int], torch.Tensor] | None, eos_token_ids: Sequence[int],
           generator: torch.Generator) -> list[SampleResult]:
    """Sampler.__call__ for rows that need torch: `generator` draws for the rows without their own."""
    logits = (torch.from_numpy(logits) if isinstance(logits, np.ndarray) else logits).float().clone()
    apply_penalties(logits, rows)
    apply_logit_bias(logits, rows)
    apply_min_tokens(logits, rows, eos_token_ids)
    if allowed is not None:
        apply_allowed(logits, *allowed)
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    logprobs = torch.log_softmax(logits[wanted], dim=-1) if wanted else None  # before temperature
    results = [SampleResult(token_id) for token_id in _choose(logits, rows, generator).tolist()]
    if logprobs is not None:
        _attach_logprobs(results, logprobs, wanted, rows)
    return results


def _choose(logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator) -> torch.Tensor:
    if all(r.params.greedy for r in rows):
        return logits.argmax(dim=-1)
    greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
    # Greedy rows divide by 1 (a vanishing temperature would turn their logits into inf/NaN), and a
    # temperature past float32's range stays finite so masked (-inf) logits do not become NaN.
    temperature = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows],
                               device=logits.device).clamp_(max=torch.finfo(torch.float32).max)
    probs = torch.softmax(apply_top_k_top_p_min_p(logits / temperature[:, None], rows), dim=-1)
    sampled = (probs / _exponential_noise(probs, rows, generator)).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _exponential_noise(probs: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for i, row in enumerate(rows):
        if row.generator is not None and not row.params.greedy:
            noise[i].exponential_(generator=row.generator.torch_generator())
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # q = 0 would make p / q infinite


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
