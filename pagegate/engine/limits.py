"""The hard limits on a request, written here and nowhere else, and checked once on each side of the seam: the
gateway where it prepares a request (prepare.py, embeddings.py) and admits it (admission.py), before it starts any
of its prompts; the engine in intake (intake.py), for every request whoever sent it. The seam between them
(engine/serving) checks nothing."""

from __future__ import annotations

from collections.abc import Iterable

from pagegate.engine.errors import InvalidParamError
from pagegate.engine.sampling.params import PRIORITY_RANGE


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParamError(f"Token id {bad} is out of range: the vocabulary has {vocab_size} tokens.", param)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str = "prompt") -> None:
    """Reject a prompt that, with the tokens asked for (at least one), does not fit the context."""
    wanted = prompt_len + (max_tokens or 1)
    if wanted <= max_model_len:
        return
    if max_tokens is None or prompt_len >= max_model_len:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                   f"{prompt_len} tokens, leaving no room for a completion. Please shorten the prompt.")
    else:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{wanted} tokens ({prompt_len} in the {param}, {max_tokens} for the completion). "
                   "Please reduce the length of the prompt or max_tokens.")
    raise InvalidParamError(message, param, code="context_length_exceeded")


def check_choices(n: int, max_num_seqs: int) -> None:
    """The n choices of a prompt run together, so more than max_num_seqs could never start."""
    if n > max_num_seqs:
        raise InvalidParamError(f"n is {n}, but at most {max_num_seqs} sequences run at once (--max-num-seqs), "
                                "and the n choices of a prompt run together", "n")


def check_priority(priority: int, scheduling_policy: str) -> None:
    """A priority is honoured only under the priority policy, and only within PRIORITY_RANGE."""
    low, high = PRIORITY_RANGE
    if priority and scheduling_policy != "priority":
        raise InvalidParamError("priority is only honoured when the server runs with --scheduling-policy "
                                f"priority; this one schedules {scheduling_policy}: leave priority at 0", "priority")
    if not low <= priority <= high:
        raise InvalidParamError(f"priority must be in [{low}, {high}], got {priority}", "priority")


def check_task(generates: bool, pools: bool, embed: bool) -> None:
    """A generation needs a generative server; an embedding a server that pools (--pooling, or --task embed)."""
    if embed and not pools:
        raise InvalidParamError("This server does not serve embeddings: it was started with --pooling none. Start "
                                "`pagegate serve` without that flag (embeddings from the last token's hidden state) "
                                "or with --pooling mean, or serve an embedding model with --task embed --model "
                                "FOLDER (offline: LLM(..., pooling='last')).", "model", code="model_not_supported")
    if not embed and not generates:
        raise InvalidParamError("This server serves an embedding model (--task embed): it answers /v1/embeddings "
                                "only, not generations.", "model", code="model_not_supported")


def check_embedding_length(num_tokens: int, max_model_len: int, param: str = "input") -> None:
    """An input to embed must fit the model's context whole (nothing is generated after it)."""
    if num_tokens > max_model_len:
        raise InvalidParamError(f"This model's maximum context length is {max_model_len} tokens. However, an input "
                                f"has {num_tokens} tokens. Please shorten it.", param, code="context_length_exceeded")
