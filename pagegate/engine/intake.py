"""Request intake: prompts and parameters become validated `Request`s, and each choice its `Sequence`. The
engine's side of every rule in `limits.py` is checked here, once, for every request whoever sent it (the offline
`LLM`, or the gateway through the core process's frames)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np

from pagegate.config import SchedulerConfig
from pagegate.core.chain_root import chain_root
from pagegate.engine.errors import InvalidParamError
from pagegate.engine.limits import (
    check_choices,
    check_context,
    check_embedding_length,
    check_priority,
    check_task,
    check_token_ids,
)
from pagegate.engine.loading.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer
from pagegate.engine.media.prompt_images import ImageInput, VisionSpec
from pagegate.engine.models.config import ModelConfig
from pagegate.engine.pin import Pin
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.sampler import LogitBias, choice_seed, make_generator
from pagegate.engine.sampling.structured import GrammarCompiler, StructuredOutputsParams
from pagegate.engine.sequence import Request, Sequence
from pagegate.engine.serves import Serves
from pagegate.engine.tenants import ONLINE, KeyShare, Lane

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher

    from pagegate.engine.lora.model import Registered


class RequestIntake:
    def __init__(self, tokenizer: Tokenizer | None, model_config: ModelConfig, eos_token_ids: list[int],
                 max_model_len: int, scheduler: SchedulerConfig, device: str | torch.device,
                 serves: Serves | None = None, vision: VisionSpec | None = None, block_size: int = 16) -> None:
        self.tokenizer = tokenizer
        self.vision = vision  # a vision-language model's image checks (None: it takes no images)
        self.block_size = block_size
        self.model_identity = repr(model_config)  # the model's part of every chain root (chain_root.py)
        self.serves = serves or Serves()
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.device = device
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, eos_token_ids) if tokenizer else None

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     priority: int = 0, cache_salt: str | None = None, pins: tuple[Pin, ...] = (),
                     embed: bool = False, lora: Registered | None = None, tenant: str | None = None, *,
                     lane: Lane = ONLINE, key: KeyShare | None = None,
                     images: Seq[tuple[bytes, np.ndarray]] = ()) -> Request:
        """Validate and tokenize; raises InvalidParamError for what the caller must fix. An `embed` request's
        prompt is pooled, not continued (pagegate/engine/pooling.py): one choice, nothing sampled. `lora`: the
        adapter it runs with (lora.model.resolve_adapter); `tenant`: the identity of the API key that sent it, when
        each key keeps its own prefix cache (--prefix-cache-scope key); `lane` and `key`: who it runs for, as the
        scheduler weighs it (tenants.py); `images`: (digest, tiles) of each image its image tokens hold, in order."""
        check_task(self.serves.generate, self.serves.pooling is not None, embed)
        if embed and params.n != 1:
            raise InvalidParamError("an embedding request has one choice", "n")
        text, token_ids = self._tokenize(prompt)
        if embed:
            check_embedding_length(len(token_ids), self.max_model_len)
        else:
            check_context(len(token_ids), params.max_tokens, self.max_model_len)
        placed, keys = self._images(token_ids, images, embed)
        check_priority(priority, self.scheduler.scheduling_policy)
        check_choices(params.n, self.scheduler.max_num_seqs)
        # NOTE: the adapter's identity (name and weights digest), the salt and the tenant root the chain as separate
        # fields: a page computed under one adapter (or the base model), salt or key is never a hit for another.
        root = chain_root(self.model_identity, lora.identity if lora else None, cache_salt or None, tenant)
        matcher = self.grammar_matcher(params.structured_outputs) if params.structured_outputs else None
        bias = LogitBias.of(params.logit_bias, self.vocab_size, self.device)
        return Request(request_id, text, token_ids, params, priority, cache_salt, root_hash=root, matcher=matcher,
                       logit_bias=bias, pins=pins, embed=embed, lora_name=lora.request.lora_name if lora else None,
                       lane=lane, key=key, images=placed, prefix_keys=keys)

    def _images(self, token_ids: list[int], images: Seq[tuple[bytes, np.ndarray]],
                embed: bool) -> tuple[tuple[ImageInput, ...], list[int] | None]:
        if self.vision is None or embed:
            if images:
                raise InvalidParamError("this model does not take images" if self.vision is None else
                                        "an embedding request takes no images", "images")
            return (), None
        return self.vision.inputs(token_ids, images, self.block_size)

    def grammar_matcher(self, structured: StructuredOutputsParams) -> LLMatcher:
        """A fresh matcher of the constraint (compiled once, then cached)."""
        if self.grammars is None:
            raise InvalidParamError("this model has no tokenizer, so it cannot constrain its output",
                                    "structured_outputs")
        return self.grammars.matcher(structured)

    def new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        """Choice `index` of a request, with its own generator, grammar state, detokenizer and stop strings."""
        params = request.params
        seed = params.seed
        generator = make_generator(choice_seed(seed, index), self.device) if seed is not None else None
        seq = Sequence(request, index, token_ids, len(request.prompt_token_ids), generator,
                       logprobs=[] if params.logprobs is not None else None,
                       matcher=request.matcher.deep_copy() if request.matcher is not None else None,
                       grammar_waits=request.matcher is not None and params.grammar_after_token is not None)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     params.skip_special_tokens)
            seq.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        request.seqs.append(seq)
        return seq

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParamError("this model has no tokenizer: send the prompt as token ids", "prompt")
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            token_ids, text = [int(t) for t in prompt], None
            check_token_ids(token_ids, self.vocab_size, "prompt")
        if not token_ids:
            raise InvalidParamError("the prompt is empty", "prompt")
        return text, token_ids

