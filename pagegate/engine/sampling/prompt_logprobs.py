"""Prompt logprobs (`prompt_logprobs`, `echo` with `logprobs`): the model's log_softmax at each prompt position,
scored against the prompt token that follows it, as evaluation harnesses read them.

They are computed in the prefill steps themselves, chunk by chunk, from the hidden states the step already has.
A request that scores its prompt takes no prefix-cache hits past what it has scored (a cached prefix has no
logits): those positions are computed again. Values are the raw model distribution (no penalties, no bias, no
temperature), as vLLM's and OpenAI's are.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from pagegate.engine.outputs import Logprob

if TYPE_CHECKING:
    from pagegate.engine.sequence import Sequence

ROWS_PER_SLICE = 256  # logits rows at once: a whole 8k-token chunk's logits would be gigabytes


def score_prompts(seqs: Seq[Sequence], num_tokens: Seq[int], starts: Seq[int], hidden: torch.Tensor,
                  compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Append to each scoring request's `prompt_logprobs` the tokens this step's rows predict: row i of a
    sequence (position p) scores prompt token p + 1, in order, each position once (a recomputed one is skipped)."""
    for i, (seq, n) in enumerate(zip(seqs, num_tokens, strict=True)):
        request = seq.request
        if not request.scoring_prompt or seq.index != 0:
            continue
        assert request.prompt_logprobs is not None
        first = seq.num_computed - n  # the position of the step's first row
        done = len(request.prompt_logprobs)  # the next token to score is at `done`, predicted at done - 1
        lo, hi = max(first, done - 1), min(seq.num_computed, len(request.prompt_token_ids) - 1)
        if lo >= hi or lo != done - 1:  # nothing new, or a gap before this step's rows (never scored out of order)
            continue
        rows = hidden[starts[i] + lo - first:starts[i] + hi - first]
        targets = request.prompt_token_ids[lo + 1:hi + 1]
        k = request.params.prompt_logprobs or 0
        for part in range(0, len(targets), ROWS_PER_SLICE):
            logits = compute_logits(rows[part:part + ROWS_PER_SLICE])
            request.prompt_logprobs += logprobs_of(logits, targets[part:part + ROWS_PER_SLICE], k)


def logprobs_of(logits: torch.Tensor, targets: list[int], k: int) -> list[Logprob | None]:
    """Each row's log_softmax at its target token, the target's rank (1: the argmax) and the top k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(targets, device=logprobs.device)[:, None]
    values = logprobs.gather(1, chosen)
    ranks = ((logprobs > values).sum(dim=1) + 1).tolist()
    top_values, top_ids = (t.tolist() for t in logprobs.topk(min(k, logprobs.shape[1]), dim=-1)) if k else ([], [])
    return [Logprob(token, value, dict(zip(top_ids[j], top_values[j], strict=True)) if k else {}, rank)
            for j, (token, value, rank) in enumerate(zip(targets, values.squeeze(1).tolist(), ranks, strict=True))]
