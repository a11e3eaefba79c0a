"""The public asyncio face for library use: the engine runs where the server runs it, in an engine-core process
(or several, `data_parallel_size`), and this is a client of it, as vLLM's AsyncLLM is a client of its EngineCore.

    async with await AsyncEngine.start(EngineConfig(model)) as engine:
        async for output in engine.generate("Hello", SamplingParams(max_tokens=20), "r1"):
            print(output.outputs[0].text)

NOTE: not a thread of the caller's process: there the engine's OpenMP team shares the interpreter with the
caller's event loop, and SmolLM2 decoded at half the speed of the same engine on a main thread. In its own
process the engine steps on that process's main thread, as in `pagegate serve`. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from types import TracebackType

from msgspec import structs

from pagegate.config import EngineConfig
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.observe.stats import EngineHealth, EngineStats
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.pin import Pin
from pagegate.engine.pool_snapshot import PoolSnapshot
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.engine.serving.replicas import start_cores


class AsyncEngine:
    """An engine in its own process(es), driven from one asyncio event loop: the one that started it."""

    def __init__(self, client: EngineClient) -> None:
        """Over a started client; `AsyncEngine.start` starts one."""
        self.client = client  # CoreClient, or Replicas under data parallelism: the processes are there
        self.model_name: str = client.model_name
        self.tokenizer: Tokenizer | None = client.tokenizer
        self.max_model_len: int = client.max_model_len

    @classmethod
    async def start(cls, config: EngineConfig, *, data_parallel_size: int = 1,
                    step_timeout_s: float = 0.0) -> AsyncEngine:
        """Start the engine core(s) and wait until the model is loaded and the KV cache sized.
        `step_timeout_s` > 0: a core that has work and finishes no step in that long fails its requests
        (EngineStalledError) until it steps again."""
        return cls(await start_cores(config, data_parallel_size, step_timeout_s))

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        """Every request aborted, every page freed, every engine process gone."""
        await self.client.shutdown()

    # ---- requests --------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       pins: tuple[Pin, ...] = ()) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs as they come, each one the whole answer so far; leaving the loop early aborts the
        request (its pages are free within one step). InvalidParamError before the first output for a bad
        request, RequestFailedError when it fails, EngineDeadError when the engine dies under it. With `pins`,
        its pages stay cached under each one's key (see `unpin`)."""
        outputs = self.client.generate(prompt, params, request_id, priority=priority, cache_salt=cache_salt,
                                       pins=pins)
        joined: RequestOutput | None = None
        async with aclosing(outputs):  # closed at once when the caller leaves: the abort goes out now, not at GC
            async for delta in outputs:
                if joined is None:
                    joined = delta
                else:
                    joined.add(delta)
                yield whole_answer(joined)

    async def embed(self, token_ids: list[int], request_id: str, *, priority: int = 0) -> bytes:
        """The prompt's embedding (little-endian float32), pooled in the engine; cancelling aborts it."""
        return await self.client.embed(token_ids, request_id, priority=priority)

    def abort(self, request_id: str) -> None:
        """The engine frees the request's pages before its next step."""
        self.client.abort(request_id)

    def unpin(self, key: str) -> None:
        """Release the pages a request's pin holds (nothing when it holds nothing)."""
        self.client.unpin(key)

    # ---- the engine's state ----------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.client.is_running

    def stats(self) -> EngineStats:
        """The engine's counts after its latest step (sent with every output frame)."""
        return self.client.stats()

    def health(self) -> EngineHealth:
        return self.client.health()

    async def pool_snapshot(self) -> PoolSnapshot:
        """The pool's page states, queues and counts at one instant between two steps (the first core's pool
        under data parallelism)."""
        return await self.client.pool_snapshot()

    async def metrics_text(self) -> bytes:
        """The engine's Prometheus metrics, counted where it runs (each core's labelled under data parallelism)."""
        return await self.client.metrics_text()


def whole_answer(joined: RequestOutput) -> RequestOutput:
    """What `generate` yields: the whole answer so far, in objects of its own (a caller may keep every output it
    was given, while `joined` keeps growing by the client's deltas)."""
    return replace(joined, outputs=[structs.replace(choice, token_ids=list(choice.token_ids),
                                                    logprobs=list(choice.logprobs) if choice.logprobs is not None
                                                    else None)
                                    for choice in joined.outputs])
