"""What the gateway uses of an engine, as a Protocol: `CoreClient` (one engine-core process) and `Replicas`
(data-parallel cores) implement it, and mypy checks that they keep fitting. Nothing here imports torch."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from pagegate.engine.observe.stats import EngineHealth, EngineStats
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.tenants import ONLINE, KeyShare, Lane

if TYPE_CHECKING:
    import numpy as np

    from pagegate.engine.loading.tokenizer import Tokenizer
    from pagegate.engine.media.processing import ImageProcessing
    from pagegate.engine.pin import Pin
    from pagegate.engine.pool_snapshot import PoolSnapshot
    from pagegate.engine.sampling.structured import StructuredOutputsParams


class EngineClient(Protocol):
    model_name: str
    tokenizer: Tokenizer | None
    processing: ImageProcessing | None  # a vision-language model's image preprocessing (None: text only)
    max_model_len: int
    kv_pages: str  # the KV pages' format and bytes a token, for the start-up line
    one_path: bool  # every step runs one path (frames.Ready's)
    vocab_size: int
    default_sampling: dict[str, float]  # the folder's generation_config.json, as SamplingParams keywords
    on_dead: Callable[[], None] | None  # called once, on the event loop, if the engine dies

    @property
    def is_running(self) -> bool: ...

    @property
    def accepting(self) -> bool:
        """Whether a new request has a core to go to (one not taken for hung: --engine-step-timeout)."""
        ...

    def stalled(self) -> str | None:
        """Why a core with work has finished no step within --engine-step-timeout (None when every core steps)."""
        ...

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                 priority: int = 0, cache_salt: str | None = None,
                 pins: tuple[Pin, ...] = (), lora_name: str | None = None,
                 tenant: str | None = None, lane: Lane = ONLINE, key: KeyShare | None = None,
                 images: Sequence[tuple[bytes, np.ndarray]] = ()) -> AsyncGenerator[RequestOutput, None]:
        """Each output's delta as it comes: every choice's new token ids, text and logprobs (RequestOutput.add
        joins them where a whole answer is needed); leaving the loop early aborts the request. With `pins`, its
        pages stay in the prefix cache under each one's key (within the pin budget, for its TTL).
        `lora_name`: a registered LoRA adapter it runs with (None: the base model); `tenant`: the sending key's
        identity where each key keeps its own prefix cache; `lane`: online, or batch work below it; `key`: the
        sending key's name, weight and quota of pages (pagegate.engine.tenants); `images`: (digest, tiles) of the
        images the prompt's image tokens hold, in order."""
        ...

    async def embed(self, token_ids: list[int], request_id: str, *, priority: int = 0,
                    lora_name: str | None = None, lane: Lane = ONLINE, key: KeyShare | None = None) -> bytes:
        """The prompt's embedding (little-endian float32 bytes), pooled by the engine; cancelling aborts it."""
        ...

    def abort(self, request_id: str) -> None: ...

    def unpin(self, key: str) -> None:
        """Release what a request's pin holds (nothing when it holds nothing)."""
        ...

    def compile_grammar(self, structured: StructuredOutputsParams) -> None:
        """Compile and cache a structured-output constraint; InvalidParamError when it is invalid."""
        ...

    def queue_load(self) -> tuple[int, int]:
        """(sequences waiting to run, running slots free now)."""
        ...

    def stats(self) -> EngineStats: ...

    async def pool_snapshot(self) -> PoolSnapshot:
        """Page states, queues and counts at one instant between two engine steps (the dashboard)."""
        ...

    def health(self) -> EngineHealth: ...

    async def metrics_text(self) -> bytes:
        """The engine's Prometheus metrics, counted where the engine runs."""
        ...

    async def sleep(self) -> None:
        """Free the KV pages (their prefix cache too), keep the weights; only while no request runs."""
        ...

    async def wake_up(self, kv_bytes: int | None = None) -> int:
        """Allocate the KV pages again after `sleep` (`kv_bytes` of them; None: as many as before); how many."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Register a LoRA adapter (a PEFT folder or a GGUF file) by name; InvalidParamError naming why not."""
        ...

    async def unload_lora_adapter(self, name: str) -> None:
        """Forget a LoRA adapter; InvalidParamError: code model_not_found (unknown), adapter_busy (requests use it)."""
        ...

    async def resize(self, kv_bytes: int) -> int:
        """An idle engine's pool to `kv_bytes` of pages: an elastic pool's limit moves in place (its prefix cache
        below it kept, never a page in use taken); a fixed pool sleeps and wakes in one (its prefix cache lost, a
        RuntimeError while it has requests). How many pages it has now."""
        ...

    async def shutdown(self) -> None:
        """Every request aborted, every page freed, every engine process gone."""
        ...
