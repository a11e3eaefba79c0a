"""The synchronous engine: requests in, one `step()` at a time, outputs back."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import fields

import torch
from llguidance import LLMatcher

from pagegate.config import EngineConfig
from pagegate.core import compute_block_hash
from pagegate.engine.grammar_masks import GrammarMasks
from pagegate.engine.kv_cache import PagedKVCache, bytes_per_block, check_fits, device_memory_budget
from pagegate.engine.kv_events import EventPublisher, KVEventsConfig
from pagegate.engine.limits import check_choices, check_context, check_priority, check_token_ids
from pagegate.engine.loader import load_checkpoint, model_path, resolve_device
from pagegate.engine.metrics import EngineMetrics
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.parallel import SINGLE
from pagegate.engine.params import InvalidParamError, SamplingParams
from pagegate.engine.runner import ModelRunner
from pagegate.engine.sampler import LogitBias, Sampler, SampleResult, SamplingRow, choice_seed, make_generator
from pagegate.engine.scheduler import Scheduler
from pagegate.engine.sequence import Request, SeqStatus, Sequence
from pagegate.engine.stats import EngineHealth, EngineStats
from pagegate.engine.structured import GrammarCompiler, StructuredOutputsParams
from pagegate.engine.tokenizer import IncrementalDetokenizer, StopChecker
from pagegate.engine.tp_workers import WorkerGroup, rank_device

log = logging.getLogger(__name__)

GIB = 1024**3


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.workers: WorkerGroup | None = None
        if config.tensor_parallel_size > 1:  # the workers load their slices while this rank loads its own
            self.workers = WorkerGroup(config, self.device)
            self.device = rank_device(self.device, 0, config.tensor_parallel_size)
        try:
            self._load(config)
        except BaseException:
            if self.workers is not None:  # they may wait for sizes that never come
                self.workers.close(graceful=False)
            raise

    def _load(self, config: EngineConfig) -> None:
        tp = self.workers.tp if self.workers is not None else SINGLE
        path = model_path(config)
        log.info("loading weights from %s", path)
        (self.model, self.model_config, self.generation), self.tokenizer = load_checkpoint(
            path, config.dtype, self.device, config.quantization, tp)
        self.model_name = config.served_model_name or (path.name if config.model else "pagegate-default")
        self.max_model_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        self.eos_token_ids = sorted(set(self.generation.eos_token_ids) |
                                    set(self.tokenizer.eos_token_ids if self.tokenizer else ()))
        self._build_cache()
        self.runner = ModelRunner(self.model, self.kv_cache, self.scheduler.tables,
                                  config.scheduler.max_num_batched_tokens,
                                  self.workers.channel if self.workers is not None else None)
        self.sampler = Sampler(self.eos_token_ids, config.seed, self.device)
        vocab = self.model_config.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer, vocab, self.eos_token_ids) if self.tokenizer else None
        self.grammar_masks = GrammarMasks(vocab)
        self.metrics = EngineMetrics(self.model_name, config.health)
        self.metrics.cache_config(config.cache.block_size, self.scheduler.pool.num_blocks)
        self.kv_events = self._start_kv_events(config.kv_events)
        self.requests: dict[str, Request] = {}
        self._order = itertools.count()
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.health_grade, self.health_reason = "OK", "starting"

    def _build_cache(self) -> None:
        """Size the pages: a byte budget (KV memory, swap space) is shared by the ranks, each of which holds
        its KV heads of every page; a GPU's own memory budget is per GPU."""
        cache, m, ranks = self.config.cache, self.model, self.model.tp.size
        block_bytes = bytes_per_block(m.num_layers, cache.block_size, m.num_kv_heads, m.head_dim, m.dtype)
        shared = ranks if self.device.type == "cpu" or cache.kv_cache_memory is not None else 1
        num_blocks = cache.num_kv_blocks or self._profiled_budget() // shared // block_bytes
        check_fits(num_blocks, cache.block_size, self.max_model_len, block_bytes)
        num_cpu_blocks = int(cache.swap_space * GIB) // ranks // block_bytes
        if self.workers is not None:
            self.workers.share_sizes(num_blocks, num_cpu_blocks)
        self.kv_cache = PagedKVCache(m.num_layers, num_blocks, cache.block_size, m.num_kv_heads, m.head_dim,
                                     m.dtype, self.device, num_cpu_blocks)
        self.scheduler = Scheduler(self.config.scheduler, cache, num_blocks, num_cpu_blocks, self.max_model_len)
        log.info("KV cache: %d pages of %d tokens (%d tokens), %d bytes per page per rank (%.3f GiB), "
                 "%d CPU swap pages; %d rank(s) of %d KV heads each (%d in the model)",
                 num_blocks, cache.block_size, num_blocks * cache.block_size, block_bytes,
                 num_blocks * block_bytes / GIB, num_cpu_blocks, ranks, m.num_kv_heads,
                 self.model_config.num_key_value_heads)

    def _profiled_budget(self) -> int:
        """Device bytes for pages; on CUDA after a forward at the largest batch (its peak is not KV)."""
        peak = 0
        if self.device.type == "cuda" and self.config.cache.kv_cache_memory is None:
            torch.cuda.reset_peak_memory_stats(self.device)
            tokens = self.config.scheduler.max_num_batched_tokens
            with torch.inference_mode():
                hidden = self.model.model.embed_tokens(torch.zeros(tokens, dtype=torch.long, device=self.device))
                for layer in self.model.model.layers if self.model.tp.size == 1 else ():  # no lone all-reduce
                    hidden = hidden + layer.get_submodule("mlp")(hidden)
                self.model.compute_logits(hidden[-self.config.scheduler.max_num_seqs:])
            peak = torch.cuda.max_memory_allocated(self.device)
        return device_memory_budget(self.config.cache, self.device, peak)

    # ---- requests ----------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     priority: int = 0, cache_salt: str | None = None) -> Request:
        """Validate and tokenize; safe to call from any thread (touches no engine state)."""
        text, token_ids = self._tokenize(prompt)
        check_context(len(token_ids), params.max_tokens, self.max_model_len)
        check_priority(priority, self.config.scheduler.scheduling_policy)
        check_choices(params.n, self.config.scheduler.max_num_seqs)
        root = hash_salt(cache_salt) if cache_salt else 0
        matcher = self.grammar_matcher(params.structured_outputs) if params.structured_outputs else None
        bias = LogitBias.of(params.logit_bias, self.model_config.vocab_size, self.device)
        return Request(request_id, text, token_ids, params, priority, cache_salt, root_hash=root, matcher=matcher,
                       logit_bias=bias)

    def grammar_matcher(self, structured: StructuredOutputsParams) -> LLMatcher:
        """A fresh matcher of the constraint (compiled once, then cached); safe from any thread."""
        if self.grammars is None:
            raise InvalidParamError("this model has no tokenizer, so it cannot constrain its output",
                                    "structured_outputs")
        return self.grammars.matcher(structured)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParamError("this model has no tokenizer: send the prompt as token ids", "prompt")
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            token_ids, text = [int(t) for t in prompt], None
            check_token_ids(token_ids, self.model_config.vocab_size, "prompt")
        if not token_ids:
            raise InvalidParamError("the prompt is empty", "prompt")
        return text, token_ids

    def add(self, request: Request) -> None:
        """Queue a validated request (engine thread)."""
        if request.request_id in self.requests:
            raise InvalidParamError(f"request id {request.request_id!r} is already in use", "request_id")
        request.order = next(self._order)
        self.requests[request.request_id] = request
        self.scheduler.add(self._new_sequence(request, 0, list(request.prompt_token_ids)))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None) -> Request:
        request = self.make_request(request_id, prompt, params, priority, cache_salt)
        self.add(request)
        return request

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        params = request.params
        seed = params.seed
        generator = make_generator(choice_seed(seed, index), self.device) if seed is not None else None
        seq = Sequence(request, index, token_ids, len(request.prompt_token_ids), generator,
                       logprobs=[] if params.logprobs is not None else None,
                       matcher=request.matcher.deep_copy() if request.matcher is not None else None)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     params.skip_special_tokens)
            seq.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        request.seqs.append(seq)
        return seq

    def _start_kv_events(self, config: KVEventsConfig | None) -> EventPublisher | None:
        if config is None or not config.enable_kv_cache_events:
            return None
        pool = self.scheduler.pool
        pool.record_events()
        publisher = EventPublisher(config, pool.block_size)
        publisher.publish([("AllBlocksCleared",)])  # a router may hold pages from this server's last life
        log.info("KV-cache events: %s publisher on %s (topic %r, replay %s)", config.publisher, config.endpoint,
                 config.topic, config.replay_endpoint)
        return publisher

    def close(self) -> None:
        """End the tensor-parallel workers and the KV-event publisher."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its pages now; False when it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            self.scheduler.free(seq)
            seq.status = SeqStatus.FINISHED
        self.refresh_stats()  # pages came back outside step(): keep the gauges true
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return the outputs of requests that moved."""
        now = time.monotonic()
        batch = self.scheduler.schedule(now)
        failed = [self._fail(seq.request) for seq in batch.failed]
        if not batch.seqs:
            self.refresh_stats(now)
            return failed
        logits = self.runner.execute(batch)
        prompt_tokens = sum(n for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
                            if s.num_computed <= s.num_prompt_tokens)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.num_prompt_tokens += prompt_tokens
        sampling = [s for s in batch.seqs if s.num_computed == len(s.token_ids)]
        moved = self._sample(sampling, logits, time.monotonic())
        self.refresh_stats(now)
        return failed + [request.output() for request in moved]

    def _sample(self, sampling: list[Sequence], logits: torch.Tensor, now: float) -> list[Request]:
        rows, seqs, row_of = [], [], []
        for i, seq in enumerate(sampling):
            group = self._fork(seq) if seq.request.params.n > 1 and not seq.request.forked else [seq]
            for member in group if seq.request.error is None else ():
                rows.append(SamplingRow(member.request.params, member.request.prompt_token_ids,
                                        member.output_token_ids, member.generator, member.request.logit_bias))
                seqs.append(member)
                row_of.append(i)
        matchers = [(j, seq.matcher) for j, seq in enumerate(seqs) if seq.matcher is not None]
        allowed = None
        if matchers:
            bitmask = self.grammar_masks.compute([matcher for _, matcher in matchers])
            allowed = ([j for j, _ in matchers], self.grammar_masks.allowed(bitmask, logits.shape[1]))
        results = self.sampler(logits[row_of], rows, allowed) if rows else []
        moved = {id(seq.request): seq.request for seq in sampling}
        for seq, result in zip(seqs, results, strict=True):
            if seq.request.error is None:
                self._append_token_or_fail(seq, result, now)
        self.metrics.generation_tokens.inc(len(results))
        self.num_generation_tokens += len(results)
        for request in moved.values():
            if request.error is not None:
                self._fail(request)
            elif request.finished:
                self._finish(request, now)
        return list(moved.values())

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the prompt was computed once; n choices now share its pages. The scheduler admitted the
        prompt with seats for all n, so this cannot run out of slots; if it does, the request fails alone."""
        request = parent.request
        request.forked = True
        children = [self._new_sequence(request, i, list(parent.token_ids)) for i in range(1, request.params.n)]
        try:
            for child in children:
                self.scheduler.fork(parent, child)
        except ValueError as error:
            log.exception("request %s: forking its %d choices failed", request.request_id, request.params.n)
            request.error = f"its {request.params.n} choices could not be started: {error}"
        return [parent, *children]

    def _append_token_or_fail(self, seq: Sequence, result: SampleResult, now: float) -> None:
        """A failure in one request's bookkeeping (its grammar, its detokenizer) fails that request alone."""
        try:
            self._append_token(seq, result.token_id, result.logprob, now)
        except Exception as error:
            log.exception("request %s failed while taking token %d", seq.request.request_id, result.token_id)
            seq.request.error = f"internal error after token {result.token_id}: {type(error).__name__}: {error}"

    def _append_token(self, seq: Sequence, token: int, logprob, now: float) -> None:
        request, params = seq.request, seq.request.params
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.time_to_first_token.observe(now - request.arrival_time)
        elif request.last_token_time is not None:
            self.metrics.inter_token_latency.observe(now - request.last_token_time)
        request.last_token_time = now
        seq.token_ids.append(token)
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
        num_out = len(seq.token_ids) - seq.num_prompt_tokens
        eos = token in self.eos_token_ids and not params.ignore_eos
        stop_token = token in params.stop_token_set
        if stop_token:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif eos:
            seq.finish_reason = "stop"
        elif seq.matcher is not None and not _advance(seq.matcher, token):
            seq.finish_reason = "stop"  # the grammar is complete: only EOS could follow
        elif num_out >= (params.max_tokens or self.max_model_len) or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
        self._detokenize(seq, token, in_text=not (eos or stop_token and not params.include_stop_str_in_output))
        if seq.finish_reason is not None:
            seq.status = SeqStatus.FINISHED
            self.scheduler.free(seq)

    def _detokenize(self, seq: Sequence, token: int, in_text: bool) -> None:
        """`in_text` False: an EOS, or a stop token (vLLM's way), which do not show in the text."""
        if seq.detokenizer is None or seq.stop_checker is None:
            return
        delta = seq.detokenizer.step([token]) if in_text else ""
        if seq.finish_reason is not None:
            delta += seq.detokenizer.flush()
        text, matched = seq.stop_checker.step(delta)
        seq.text += text
        if matched is not None and seq.stop_reason is None:
            seq.finish_reason, seq.stop_reason = "stop", matched
        elif seq.finish_reason is not None:
            seq.text += seq.stop_checker.flush()

    def _finish(self, request: Request, now: float) -> None:
        self.requests.pop(request.request_id, None)
        self.metrics.e2e_request_latency.observe(now - request.arrival_time)
        if request.first_scheduled_time is not None:
            self.metrics.request_queue_time.observe(request.first_scheduled_time - request.arrival_time)

    def _fail(self, request: Request) -> RequestOutput:
        log.warning("request %s failed: %s", request.request_id, request.error)
        self.abort(request.request_id)
        return request.output()

    # ---- introspection ----------------------------------------------------------------------------------

    def refresh_stats(self, now: float | None = None) -> None:
        """Recompute the gauges and the health grade from the scheduler's counts."""
        self.health_grade, self.health_reason = self.metrics.update(self.scheduler.stats(), now)
        if self.kv_events is not None and (events := self.scheduler.pool.take_events()):
            if not self.kv_events.publish(events):
                self.metrics.kv_events_dropped.inc()

    def stats(self) -> EngineStats:
        scheduler = self.scheduler.stats()
        return EngineStats(**{f.name: getattr(scheduler, f.name) for f in fields(scheduler)},
                           requests=len(self.requests), prompt_tokens=self.num_prompt_tokens,
                           generation_tokens=self.num_generation_tokens)

    def health(self) -> EngineHealth:
        stats = self.scheduler.stats()
        return EngineHealth(grade=self.health_grade, reason=self.health_reason,
                            kv_cache_usage=stats.kv_cache_usage, waiting=stats.waiting, running=stats.running,
                            swapped=stats.swapped, swaps_in_window=len(self.metrics.swap_times))


def _advance(matcher: LLMatcher, token: int) -> bool:
    """Feed the sampled token to the sequence's grammar; False once nothing but EOS may follow."""
    if not matcher.consume_token(token):  # the mask allowed it, so this is llguidance's own failure
        log.warning("structured output stopped: %s", matcher.get_error())
        return False
    return not matcher.is_stopped()


def hash_salt(salt: str) -> int:
    """A 64-bit chain root from a cache salt."""
    data = salt.encode()
    words = [int.from_bytes(data[i:i + 4], "little") & 0x7FFFFFFF for i in range(0, len(data), 4)]
    return compute_block_hash(0x5A17, words or [0])
