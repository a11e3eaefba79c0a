"""Whether a request may start now: the server serves its kind (generation or embedding), the scheduler settings
allow it (priority, choices), it fits under --max-queue, and an engine core is stepping. Each refusal is an API
error (400, 429, 503); the engine's rules themselves live in pagegate.engine.limits."""

from __future__ import annotations

from collections.abc import Callable

from pagegate.config import EngineConfig
from pagegate.engine.limits import check_choices, check_priority, check_task
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.gateway.acquired import AcquiredModel
from pagegate.gateway.engine_requests import EngineRequests
from pagegate.gateway.errors import EngineStalled, Overloaded
from pagegate.gateway.prepare import PreparedRequest
from pagegate.gateway.settings import GatewayConfig


def serves_generations(engine_config: EngineConfig) -> bool:
    return engine_config.task != "embed"


def serves_embeddings(engine_config: EngineConfig) -> bool:
    """Whether /v1/embeddings is served: an encoder (--task embed), or a decoder's pooled states (--pooling)."""
    return engine_config.task == "embed" or engine_config.pooling is not None


class Admission:
    """Admits requests to the engine: callers start the generation (or embedding) at once after `admit`.

    `check_acquired`: a 503 that says why unless a request's acquired model still serves (EngineHost's);
    `engine_requests`: the ones already started, whose sequences the engine's queue does not count yet."""

    def __init__(self, engine_config: EngineConfig, config: GatewayConfig,
                 check_acquired: Callable[[AcquiredModel], None], engine_requests: EngineRequests) -> None:
        self.engine_config = engine_config
        self.config = config
        self._check_acquired = check_acquired
        self._engine_requests = engine_requests
        self.num_rejected = 0  # 429s under --max-queue

    def admit(self, acquired: AcquiredModel, prepared: PreparedRequest) -> None:
        """400 if n choices could never run at once; 429 unless the request's sequences (prompts x n) fit
        in the engine's free running slots plus --max-queue waiting ones; callers then start the generation
        at once. A 503 if the server began stopping while the request was being prepared."""
        self._check_acquired(acquired)
        self._check_runnable(prepared)
        self._check_queue(len(prepared.prompts) * prepared.params.n, acquired.engine)
        self._check_stepping(acquired.engine)

    def admit_embeddings(self, acquired: AcquiredModel, num_inputs: int, priority: int) -> None:
        """`admit` for an embedding request: 400 where the server does not embed, 429 past --max-queue."""
        self._check_acquired(acquired)
        self._check_task(embed=True)
        check_priority(priority, self.engine_config.scheduler.scheduling_policy)
        self._check_queue(num_inputs, acquired.engine)
        self._check_stepping(acquired.engine)

    def check_generates(self) -> None:
        """A 400 for a generation sent to an embedding server (--task embed)."""
        self._check_task(embed=False)

    def _check_task(self, embed: bool) -> None:
        check_task(serves_generations(self.engine_config), serves_embeddings(self.engine_config), embed=embed)

    def _check_runnable(self, prepared: PreparedRequest) -> None:
        """The engine's own checks of what the scheduler settings allow, made here before a stream starts
        (InvalidParamError: a 400)."""
        scheduler = self.engine_config.scheduler
        self.check_generates()
        check_priority(prepared.priority, scheduler.scheduling_policy)
        check_choices(prepared.params.n, scheduler.max_num_seqs)

    def _check_stepping(self, engine: EngineClient) -> None:
        """A 503 when no engine core could take the request: each has work it has not stepped on within
        --engine-step-timeout (hung). With several cores, the router passes over the stalled ones."""
        if not engine.accepting:
            raise EngineStalled(f"The engine is not stepping: {engine.stalled()}. Retry later.",
                                headers={"Retry-After": str(self.config.retry_after_s)})

    def _check_queue(self, num_seqs: int, engine: EngineClient) -> None:
        """NOTE: with several models the queue bound is each model's (its core's queue), the requests not yet in
        any core's inbox counted against all."""
        limit = self.config.max_queue
        if limit is None:
            return
        waiting, free = engine.queue_load()
        waiting += self._engine_requests.num_unsubmitted
        if waiting + num_seqs > limit + free:
            self.num_rejected += 1
            raise Overloaded(f"The server is overloaded: {waiting} sequences are waiting and this request adds "
                             f"{num_seqs} (limit {limit} waiting, {free} free running slots). Retry later.",
                             headers={"Retry-After": str(self.config.retry_after_s)})
