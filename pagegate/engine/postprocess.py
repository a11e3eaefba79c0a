"""Each sampled token into its sequence, and every stop rule in one place (vLLM's check_stop): a stop
token id, EOS, a finished grammar, max_tokens or the context length, then stop strings in the new text."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from pagegate.engine.outputs import Logprob
from pagegate.engine.sequence import Sequence

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger(__name__)


class PostProcessor:
    def __init__(self, eos_token_ids: Seq[int], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, token: int, logprob: Logprob | None) -> None:
        """Take `token`; on return `seq.finish_reason` says whether the sequence ended with it."""
        seq.token_ids.append(token)
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
        shown = self.check_stop(seq, token)
        self._detokenize(seq, token, shown)

    def check_stop(self, seq: Sequence, token: int) -> bool:
        """Set the finish (and stop) reason the token gives; False when the token stays out of the text (an
        EOS, or a stop token id unless include_stop_str_in_output, as vLLM does)."""
        params = seq.request.params
        eos = token in self.eos_token_ids and not params.ignore_eos
        if token in params.stop_token_set:
            seq.finish_reason, seq.stop_reason = "stop", token
            return params.include_stop_str_in_output and not eos
        if eos:
            seq.finish_reason = "stop"
            return False
        if seq.grammar_waits:  # reasoning is free text: the grammar constrains the answer after it
            seq.grammar_waits = token != params.grammar_after_token
        elif seq.matcher is not None and not _advance(seq.matcher, token):
            seq.finish_reason = "stop"  # the grammar is complete: only EOS could follow
            return True
        if (len(seq.token_ids) - seq.num_prompt_tokens >= (params.max_tokens or self.max_model_len)
                or len(seq.token_ids) >= self.max_model_len):
            seq.finish_reason = "length"
        return True

    def _detokenize(self, seq: Sequence, token: int, shown: bool) -> None:
        """The token's text, cut at a stop string (which ends the sequence); flushed when it ended."""
        if seq.detokenizer is None or seq.stop_checker is None:
            return
        delta = seq.detokenizer.step([token]) if shown else ""
        if seq.finish_reason is not None:
            delta += seq.detokenizer.flush()
        text, matched = seq.stop_checker.step(delta)
        seq.text += text
        if matched is not None and seq.stop_reason is None:
            seq.finish_reason, seq.stop_reason = "stop", matched
        elif seq.finish_reason is not None:
            seq.text += seq.stop_checker.flush()


def _advance(matcher: LLMatcher, token: int) -> bool:
    """Feed the sampled token to the sequence's grammar; False once nothing but EOS may follow."""
    if not matcher.consume_token(token):  # the mask allowed it, so this is llguidance's own failure
        log.warning("structured output stopped: %s", matcher.get_error())
        return False
    return not matcher.is_stopped()
