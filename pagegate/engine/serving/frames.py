"""The frames between the gateway and an engine-core process: one named `msgspec.Struct` per frame, array-like
(positional msgpack arrays on the wire, named in code) and tagged by their first element, each behind its 4-byte
length on one Unix stream socket (a socketpair the core inherits).

Gateway -> core: `Add`, `Abort`, `Unpin`, `Call` (a question answered between two steps), `Shutdown`.
Core -> gateway: `Ready` (what the gateway needs to know of the model), `Outputs` (one frame per step: what each
request that moved gained in it, then the core's counts), `Reply`, `Failed` (the core could not start).

NOTE: outputs cross as deltas (the new token ids, text and logprobs of each choice), not cumulative lists: a
frame's size and its encoding stay O(batch), however long the generations get, and the gateway's renderers
append them as they come. Nothing here imports torch.

NOTE: a socketpair, not ZMQ: each side's own thread writes and reads the socket, so a frame wakes no I/O thread
(ZMQ runs one per process), and on a 2-core machine every wake-up steals time from the core's OpenMP team.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import msgspec

from pagegate.config import EngineConfig
from pagegate.engine.errors import InvalidParamError, RequestFailedError
from pagegate.engine.observe.stats import EngineHealth, EngineStats
from pagegate.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagegate.engine.pins import Pin
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.structured import StructuredOutputsParams
from pagegate.engine.serving.page_ledger import ElasticSpec

if TYPE_CHECKING:
    from pagegate.engine.sequence import Request

CPUS_ENV = "PAGEGATE_CORE_CPUS"  # the CPUs a core pins itself to, e.g. "0,1" (one share under data parallelism)

_STATS_FIELDS = tuple(f.name for f in fields(EngineStats))
_HEALTH_FIELDS = tuple(f.name for f in fields(EngineHealth))


class Frame(msgspec.Struct, array_like=True, tag=True):
    """A frame; its tag (the class's `tag=`) is the first element of its array on the wire."""


# ---- gateway -> core -----------------------------------------------------------------------------------


class Add(Frame, tag="add"):
    """A request: its prompt (the text, when it came as text, for the outputs), sampling parameters as
    `params_to_wire` writes them, and `embed` for an embedding request (its prompt pooled, not continued);
    `lora_name`: the registered LoRA adapter it runs with (None: the base model); `tenant`: the identity of the API
    key that sent it where each key keeps its own prefix cache (a field of the chain root, never joined to the salt)."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: dict[str, Any]
    priority: int = 0
    cache_salt: str | None = None
    pin: Pin | None = None
    embed: bool = False
    lora_name: str | None = None
    tenant: str | None = None

    @property
    def sampling(self) -> SamplingParams:
        return params_from_wire(dict(self.params))


class Abort(Frame, tag="abort"):
    """`num_seqs`: the sequences the gateway counted for it, counted back by the core even when it had ended."""

    request_id: str
    num_seqs: int


class Unpin(Frame, tag="unpin"):
    key: str


CallName = Literal["snapshot", "metrics", "sleep", "wake", "resize", "load_lora", "unload_lora"]


class Call(Frame, tag="call"):
    """A question answered between two steps; `sleep` frees an idle core's KV pages, `wake` allocates them again
    and `resize` does both at once (`arg`: the pages' new budget in bytes; None: as before); `load_lora` registers
    an adapter (`arg`: [name, path]) and `unload_lora` forgets one (`arg`: its name)."""

    call_id: int
    name: CallName
    arg: Any = None


class Shutdown(Frame, tag="shutdown"):
    pass


ToCore = Add | Abort | Unpin | Call | Shutdown


# ---- core -> gateway -----------------------------------------------------------------------------------


class WireError(msgspec.Struct, array_like=True):
    """Why a request failed: a bad parameter (a 400, naming it) or a failure."""

    invalid: bool
    message: str
    param: str | None = None
    code: str = "invalid_value"

    @classmethod
    def of(cls, error: BaseException | str) -> WireError:
        if isinstance(error, InvalidParamError):
            return cls(True, str(error), error.param, error.code)
        return cls(False, str(error))

    def exception(self) -> Exception:
        return InvalidParamError(self.message, self.param, self.code) if self.invalid else RequestFailedError(self.message)


class RequestDelta(msgspec.Struct, array_like=True):
    """What one request gained since its last delta: each choice's new part, the prompt's logprobs (once, when all
    are in), its timings (once, when it finishes), an embedding request's vector (little-endian float32 bytes)."""

    request_id: str
    finished: bool
    error: WireError | None = None
    num_cached_tokens: int = 0
    timings: dict[str, Any] | None = None
    choices: list[CompletionOutput] = msgspec.field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    embedding: bytes | None = None

    def output(self, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
        """This delta as the engine's output type (its choices hold only what is new)."""
        return RequestOutput(self.request_id, prompt, prompt_token_ids, self.choices, self.finished,
                             self.num_cached_tokens, self.timings or {},
                             self.error.message if self.error is not None else None, self.prompt_logprobs)


class Ready(Frame, tag="ready"):
    """What the gateway needs to validate, tokenize and render without a model of its own."""

    model_name: str
    max_model_len: int
    kv_pages: str  # the KV pages' format and bytes a token, for the start-up line
    vocab_size: int
    eos_token_ids: list[int]
    default_sampling: dict[str, float]  # generation_config.json, as SamplingParams keywords
    tokenizer: dict[str, Any] | None  # Tokenizer.to_wire
    load: list[Any]  # CoreLoad.to_wire


class Outputs(Frame, tag="outputs"):
    deltas: list[RequestDelta]
    load: list[Any]  # CoreLoad.to_wire: decoded only when the gateway reads it


class Reply(Frame, tag="reply"):
    call_id: int
    ok: bool
    result: Any  # the answer, or the error's text when not ok


class Failed(Frame, tag="failed"):
    error_type: str
    message: str


ToGateway = Ready | Outputs | Reply | Failed

F = TypeVar("F", bound=Frame)
_ENCODER = msgspec.msgpack.Encoder()


def framed(frame: Frame) -> bytes:
    """A frame as it goes on the socket: its length, then its msgpack bytes."""
    payload = _ENCODER.encode(frame)
    return len(payload).to_bytes(4, "big") + payload


class FrameReader(Generic[F]):
    """Bytes off the socket in, whole frames of one direction out (a frame may arrive in pieces, several in one
    read); a frame that is not of that direction's types raises msgspec.ValidationError."""

    def __init__(self, kinds: Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[F] = msgspec.msgpack.Decoder(kinds)
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[F]:
        buffer = self._buffer
        buffer += data
        frames, start = [], 0
        while len(buffer) - start >= 4:
            end = start + 4 + int.from_bytes(buffer[start:start + 4], "big")
            if end > len(buffer):
                break
            frames.append(self._decoder.decode(bytes(buffer[start + 4:end])))
            start = end
        del buffer[:start]
        return frames


@dataclass(frozen=True)
class CoreSpec:
    """What the gateway hands a core on its stdin."""

    config: EngineConfig
    socket_fd: int  # the core's end of the socketpair
    parent_pid: int
    log_level: str = "INFO"
    elastic: ElasticSpec | None = None  # None: a fixed pool of config's size


# ---- requests ------------------------------------------------------------------------------------------


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    wire = {f.name: getattr(params, f.name) for f in fields(params) if f.init}
    if params.structured_outputs is not None:
        wire["structured_outputs"] = {f.name: getattr(params.structured_outputs, f.name)
                                      for f in fields(params.structured_outputs)}
    return wire


def params_from_wire(wire: dict[str, Any]) -> SamplingParams:
    structured = wire.pop("structured_outputs", None)
    if structured is not None:
        wire["structured_outputs"] = StructuredOutputsParams(**structured)
    return SamplingParams(**wire)


def add_frame(request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams, priority: int = 0,
              cache_salt: str | None = None, pin: Pin | None = None, embed: bool = False,
              lora_name: str | None = None, tenant: str | None = None) -> Add:
    return Add(request_id, prompt, token_ids, params_to_wire(params), priority, cache_salt, pin, embed, lora_name,
               tenant)


# ---- the core's counts ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CoreLoad:
    """Sent with every outputs frame: the core's counts after the step, what admission control weighs (waiting
    sequences counting n choices each, running slots free), and how many sequences the core has taken from the
    gateway so far and how many aborts' sequences it has dropped (the rest are still in flight)."""

    stats: EngineStats
    health: EngineHealth
    waiting_seqs: int = 0
    free_slots: int = 0
    seqs_taken: int = 0
    seqs_aborted: int = 0

    def to_wire(self) -> list[Any]:
        return [[getattr(self.stats, n) for n in _STATS_FIELDS], [getattr(self.health, n) for n in _HEALTH_FIELDS],
                self.waiting_seqs, self.free_slots, self.seqs_taken, self.seqs_aborted]

    @classmethod
    def from_wire(cls, wire: list[Any]) -> CoreLoad:
        stats, health, *counts = wire
        return cls(EngineStats.from_values(stats), EngineHealth(*health), *counts)


# ---- outputs: deltas out of the core -------------------------------------------------------------------


@dataclass
class _Sent:
    tokens: int = 0
    chars: int = 0
    logprobs: int = 0


class DeltaWriter:
    """Core side: per request and choice, how much was already sent (tokens, characters, logprobs)."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, _Sent]] = {}
        self._scored: set[str] = set()  # requests whose prompt logprobs went out

    def delta(self, request: Request) -> RequestDelta:
        sent = self._sent.setdefault(request.request_id, {})
        choices = []
        for seq in request.seqs if request.forked or request.params.n == 1 else ():
            mark = sent.setdefault(seq.index, _Sent())
            new_ids = seq.token_ids[seq.num_prompt_tokens + mark.tokens:]
            new_logprobs = seq.logprobs[mark.logprobs:] if seq.logprobs is not None else None
            choices.append(CompletionOutput(seq.index, seq.text[mark.chars:], new_ids, seq.finish_reason,
                                            new_logprobs, seq.stop_reason))
            mark.tokens, mark.chars = mark.tokens + len(new_ids), len(seq.text)
            mark.logprobs = len(seq.logprobs) if seq.logprobs is not None else 0
        finished = request.finished or request.error is not None
        scored = request.scored_prompt if request.request_id not in self._scored else None
        if scored is not None:
            self._scored.add(request.request_id)
        if finished:
            self.forget(request.request_id)
        return RequestDelta(request.request_id, request.finished,
                            WireError.of(request.error) if request.error is not None else None,
                            request.num_cached_tokens, request.timings() if finished else None, choices, scored,
                            request.embedding.numpy().astype("<f4").tobytes() if request.embedding is not None else None)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._scored.discard(request_id)

    def is_new(self, request: Request) -> bool:
        """Nothing of it was sent yet: its first token should not wait."""
        return request.request_id not in self._sent
