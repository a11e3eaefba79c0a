"""Speculation: guess a decoding sequence's next tokens (from its own earlier ones, n-gram prompt lookup, or with a
draft model: pagegate/engine/draft.py), compute them in the step's one forward with the token it has, and keep the
run of guesses the model agrees with.

Exact by construction. Each position is sampled from the target model's distribution with the sequence's own
sampler state (penalties, logit bias, its grammar, its seed), and a guess is kept only while the sample equals
it; the first sample that differs is the step's last token. For a deterministic guess this is the rejection rule
itself (accept x with probability p(x), else draw from p without x), so sampled output follows the model's
distribution, greedy output is the model's argmax, and a seeded request draws the very numbers it would without
speculation: one draw per token, in order.

Guesses take slots, never committed tokens: the scheduler grows the block table for them and commits each one
only once it is kept; `BlockTables.truncate` gives the rest back, so no rejected token reaches the prefix cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import Protocol

from pagegate.config import SpeculativeConfig
from pagegate.engine.sequence import Sequence

# A step of m tokens costs about 1 + 0.3 (m - 1) steps of one on the CPU decoder (8 ms for one token, 16 for four,
# 24 for eight on SmolLM2 Q4_1): a lone guess pays when more than ~2 in 5 are kept. A sequence keeping fewer (a running
# average) pauses, twice as long each time.
MIN_KEPT_RATE = 0.4
RATE_MEMORY = 0.6  # the running average's weight of the past
MAX_PAUSE_STEPS = 64


class NgramIndex:
    """Where each n-gram of a sequence's tokens (lo <= n <= hi) last ended, kept current as tokens come."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def guess(self, tokens: Tokens[int], k: int) -> list[int]:
        """The k tokens that followed the latest earlier occurrence of the longest suffix found."""
        for end in range(max(self.indexed, self.lo), len(tokens)):  # not the suffix itself: it ends at len
            for n in range(self.lo, min(self.hi, end) + 1):
                self.ends[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            found = self.ends.get(tuple(tokens[len(tokens) - n:]))
            if found is not None:
                return list(tokens[found:found + k])
        return []


class Proposer(Protocol):
    """What guesses tokens: n-gram lookup here, a draft model (pagegate/engine/draft.py), heads later."""

    def guess(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]: ...
    def settle(self, seq: Sequence, kept: int) -> None: ...
    def release(self, seq: Sequence) -> None: ...


class NgramProposer:
    """Prompt lookup over each sequence's own tokens."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self._indexes: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()

    def guess(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self._indexes.setdefault(seq, NgramIndex(self.lo, self.hi)).guess(seq.token_ids, k) if k else []
                for seq, k in zip(seqs, ks, strict=True)]

    def settle(self, seq: Sequence, kept: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


@dataclass
class Guessing:
    """A sequence's speculation state: how many tokens to guess next, and how it went lately."""

    k: int
    kept_rate: float = 1.0  # running average of the share of guesses kept
    pause: int = 1  # steps the next pause lasts
    paused: int = 0  # steps left before guessing again


@dataclass
class SpeculationStats:
    """vLLM's counters: drafts (steps a sequence guessed in), tokens guessed, tokens kept (also per position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    """Guesses tokens for the running decodes of a step, and learns from what the model kept."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None) -> None:
        self.config, self.max_model_len = config, max_model_len
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._state: weakref.WeakKeyDictionary[Sequence, Guessing] = weakref.WeakKeyDictionary()

    def propose(self, running: list[Sequence]) -> None:
        """Set `draft` of each decode in `running`, within `max_step_tokens` for the whole step; none when the batch
        is large enough that the step is bound by compute rather than by reading the weights (then guesses cost more
        than they save)."""
        decodes = [seq for seq in running if seq.num_uncomputed == 1 and not seq.pools]  # not an embedding prompt's last
        for seq in running:
            seq.draft = []
        if len(decodes) > self.config.max_batch_size:
            return
        room = self.config.max_step_tokens - len(decodes)
        ks = [max(0, min(self._wanted(seq), room)) for seq in decodes]
        for seq, draft in zip(decodes, self.proposer.guess(decodes, ks), strict=True):
            seq.draft = draft[:room]  # the most urgent sequences' guesses first
            room -= len(seq.draft)

    def _wanted(self, seq: Sequence) -> int:
        """How many tokens to guess for `seq` this step (0 while it pauses, or when one more token ends it)."""
        state = self._state.setdefault(seq, Guessing(self.config.num_speculative_tokens))
        if state.paused:
            state.paused -= 1
            return 0
        left = min((seq.request.params.max_tokens or self.max_model_len) - len(seq.output_token_ids),
                   self.max_model_len - len(seq.token_ids))
        return min(state.k, left - 1)

    def release(self, seq: Sequence) -> None:
        """The sequence left (finished, aborted)."""
        self.proposer.release(seq)

    def settle(self, seq: Sequence, kept: int) -> None:
        """After a step: `kept` of the sequence's guesses were accepted. The next guess is one longer than what
        was kept; a sequence whose guesses do not pay (MIN_KEPT_RATE) pauses."""
        guessed = len(seq.draft)
        seq.draft = []
        self.proposer.settle(seq, kept)
        state = self._state.get(seq)
        if state is None or not guessed:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += guessed
        stats.num_accepted_tokens += kept
        for position in range(kept):
            stats.accepted_per_position[position] += 1
        state.k = min(kept + 1, self.config.num_speculative_tokens)
        state.kept_rate = RATE_MEMORY * state.kept_rate + (1 - RATE_MEMORY) * kept / guessed
        if state.kept_rate >= MIN_KEPT_RATE:
            state.pause = 1
        else:
            state.paused, state.pause = state.pause, min(2 * state.pause, MAX_PAUSE_STEPS)
