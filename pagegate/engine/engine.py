"""The synchronous engine: requests in, one `step()` at a time, outputs back.

A step is: the scheduler picks the batch, the runner computes its logits, the sampler picks tokens and the
post-processor takes them in; requests that ended leave and their pages go back to the pool."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagegate.config import EngineConfig
from pagegate.engine.intake import RequestIntake
from pagegate.engine.memory.pool import KVPool
from pagegate.engine.observe.stats import EngineHealth, EngineStats
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.postprocess import PostProcessor
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.sampler import Sampler, SampleResult, SamplingRow
from pagegate.engine.sequence import Request, SeqStatus, Sequence

if TYPE_CHECKING:
    from pagegate.engine.memory.page_ledger import ElasticSpec
    from pagegate.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, elastic: ElasticSpec | None = None,
                 on_worker_death: Callable[[str], None] | None = None) -> None:
        """`elastic`: the pool's share of a page budget several models' cores hold (memory/elastic_pages.py);
        `on_worker_death(message)`: called when a tensor-parallel worker dies."""
        self.memory = memory = KVPool.build(config, elastic, on_worker_death)  # the runner, its pages, the scheduler
        self.config, self.runner, self.monitor = memory.config, memory.runner, memory.monitor
        config, runner = self.config, self.runner  # an elastic pool's config: its cache sized for the whole budget
        self.model_name, self.tokenizer, self.max_model_len = runner.model_name, runner.tokenizer, runner.max_model_len
        self.model_config, self.eos_token_ids, self.kv_pages = runner.model_config, runner.eos_token_ids, runner.kv_pages
        self.generation, self.processing = runner.generation, runner.processing  # the folder's sampling, images
        self.one_path = runner.chunk_invariant  # every step one path: a prompt's step runs what a decode's would
        self.intake = RequestIntake(runner.tokenizer, runner.model_config, runner.eos_token_ids, runner.max_model_len,
                                    config.scheduler, runner.device, runner.serves, runner.vision, config.cache.block_size)
        self.sampler = Sampler(runner.eos_token_ids, config.seed, runner.device)
        self.postprocessor = PostProcessor(runner.eos_token_ids, runner.max_model_len)
        self.metrics = self.monitor.metrics
        self.requests: dict[str, Request] = {}
        self._order = itertools.count()
        self.clock: Callable[[], float] = time.monotonic  # what steps read the time from (tests move it)

    @property
    def scheduler(self) -> Scheduler:
        return self.memory.scheduler  # a wake builds a fresh one

    def close(self) -> None:
        """End the tensor-parallel workers and the KV-event publisher."""
        self.memory.close()

    # ---- requests ----------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request built by `intake.make_request` (engine thread). Callers give unique ids (CoreClient
        checks them against its live streams), so a repeated one is a ValueError."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.memory.asleep:
            raise RuntimeError("the model is asleep: wake it up first")
        request.order = next(self._order)
        self.requests[request.request_id] = request
        self.scheduler.add(self.intake.new_sequence(request, 0, list(request.prompt_token_ids)))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    cache_salt: str | None = None) -> Request:
        self.add(request := self.intake.make_request(request_id, prompt, params, priority, cache_salt))
        return request

    def unpin(self, key: str) -> bool:
        """Release the pages a finished request's `Pin(key)` holds; False when none are held."""
        released = self.scheduler.unpin(key)
        self.refresh_stats()
        return released

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
        return [request.output() for request in self.step_requests()]

    def step_requests(self) -> list[Request]:
        """One step; the requests that moved in it (failed ones included), for callers that build their own
        outputs (the core process sends deltas)."""
        now = self.clock()
        batch = self.scheduler.schedule(now)
        failed = [self._fail(seq.request) for seq in batch.failed]
        if not batch.seqs:
            self.refresh_stats(now)
            return failed
        logits = self.runner.execute(batch)
        prompt_tokens = sum(n for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
                            if s.num_computed <= s.num_prompt_tokens)
        sampling = [s for s in batch.seqs if s.num_computed == len(s.token_ids)]
        moved, sampled = self._sample(sampling, logits, self.clock())
        self.monitor.computed(prompt_tokens, sampled)
        self.refresh_stats(now, batch.seqs)
        return failed + moved

    def _sample(self, sampling: list[Sequence], logits: Any, now: float) -> tuple[list[Request], int]:
        """Sample every running choice (forking n > 1 prompts first), position by position through the tokens
        guessed for it: the next position counts while the sample equals the guess (speculation.py)."""
        members, row = [], 0
        for seq in sampling:
            if seq.pools:  # an embedding request's prompt, pooled by the runner: it ends without a token
                seq.status = SeqStatus.FINISHED
                self.scheduler.free(seq)
                continue
            group = self._fork(seq) if seq.request.params.n > 1 and not seq.request.forked else [seq]
            members += [(member, row) for member in group if seq.request.error is None]
            row += 1 + len(seq.draft)
        sampled = 0
        for position in itertools.count():
            rows = [SamplingRow(m.request.params, m.request.prompt_token_ids, m.output_token_ids, m.generator,
                                m.request.logit_bias, None if m.grammar_waits else m.matcher) for m, _ in members]
            results = self.sampler(logits[[first + position for _, first in members]], rows) if rows else []
            sampled += len(results)
            members = [(seq, first) for (seq, first), result in zip(members, results, strict=True)
                       if self._take_token(seq, result, now) and self.scheduler.keep_guess(seq, position,
                                                                                            result.token_id)]
            if not members:
                break
        self.scheduler.settle_drafts(sampling)
        moved = list({id(seq.request): seq.request for seq in sampling}.values())
        for request in moved:
            if request.error is not None:
                self._fail(request)
            elif request.finished:
                self.requests.pop(request.request_id, None)
                self.monitor.finished(request, now)
        return moved, sampled

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the prompt was computed once; n choices now share its pages. The scheduler admitted the
        prompt with seats for all n, so this cannot run out of slots; if it does, the request fails alone."""
        request = parent.request
        request.forked = True
        children = [self.intake.new_sequence(request, i, list(parent.token_ids)) for i in range(1, request.params.n)]
        try:
            for child in children:
                self.scheduler.fork(parent, child)
        except ValueError as error:
            log.exception("request %s: forking its %d choices failed", request.request_id, request.params.n)
            request.error = f"its {request.params.n} choices could not be started: {error}"
        return [parent, *children]

    def _take_token(self, seq: Sequence, result: SampleResult, now: float) -> bool:
        """Whether the sequence goes on. A failure in one request's bookkeeping (its grammar, its detokenizer)
        fails that request alone."""
        if seq.request.error is not None:
            return False
        try:
            self.monitor.token(seq.request, now)
            self.postprocessor.append(seq, result.token_id, result.logprob)
        except Exception as error:
            log.exception("request %s failed while taking token %d", seq.request.request_id, result.token_id)
            seq.request.error = f"internal error after token {result.token_id}: {type(error).__name__}: {error}"
            return False
        self.scheduler.take_pins(seq, now)  # its prompt's prefixes once computed, all it wrote once it finished
        if seq.finish_reason is None:
            return True
        seq.status = SeqStatus.FINISHED
        self.scheduler.free(seq)
        return False

    def _fail(self, request: Request) -> Request:
        log.warning("request %s failed: %s", request.request_id, request.error)
        self.abort(request.request_id)
        return request

    # ---- memory: one call each into memory/pool.py ------------------------------------------------------

    def sleep(self) -> None:
        """Free the KV pages, keep the weights; refused while requests run."""
        self.memory.sleep(self.has_unfinished())

    def wake_up(self, kv_bytes: int | None = None) -> int:
        """KV pages again after `sleep` (`kv_bytes` of them; None: as before); how many are usable."""
        return self.memory.wake_up(kv_bytes)

    def resize(self, kv_bytes: int) -> int:
        """An idle engine's pool to `kv_bytes` of pages; how many are usable."""
        return self.memory.resize(kv_bytes, self.has_unfinished())

    def load_adapter(self, name: str, path: str) -> int:
        """Register the LoRA adapter in folder (or GGUF file) `path` under `name`; its id."""
        return self.memory.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter and give back its pages; refused while requests use it."""
        self.memory.unload_adapter(name)

    # ---- introspection ----------------------------------------------------------------------------------

    def refresh_stats(self, now: float | None = None, computed: list[Sequence] | None = None) -> None:
        """Recompute the gauges and the health grade from the scheduler's counts (`computed`: the step's batch)."""
        self.memory.refresh_stats(now, computed)

    def stats(self) -> EngineStats:
        return self.monitor.stats(self.scheduler.stats(), len(self.requests))

    def health(self) -> EngineHealth:
        return self.monitor.health(self.scheduler.stats())

    def seats(self) -> tuple[int, int]:
        """(sequences waiting, a request's n choices each; running slots open): what the gateway's admission weighs."""
        return self.scheduler.num_waiting_seqs, self.scheduler.free_slots
