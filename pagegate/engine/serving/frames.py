"""The frames between the gateway and an engine-core process: one named `msgspec.Struct` per frame, array-like
(positional msgpack arrays on the wire, named in code) and tagged by their first element, each behind its 4-byte
length on one Unix stream socket (a socketpair the core inherits).

Gateway -> core: `Add`, `Abort`, `Unpin`, `Call` (a question answered between two steps), `Shutdown`.
Core -> gateway: `Ready` (what the gateway needs to know of the model; before it `EarlyTokenizer`, the vocabulary of
the GGUF a core reads ahead), `Outputs` (one frame per step: what each request that moved gained in it, then the
core's counts), `Reply`, `Failed` (the core could not start).

Every payload is typed: what a frame carries of the engine's own types crosses as a positional Struct of its own
(`WireSampling`, `WireTimings`, `WireTokenizer`, `WireSnapshot`, `CoreLoad`), so a frame of the wrong shape is
refused whole when it is read, and a call's error crosses as its type's name and its message (`CallError`).

NOTE: outputs cross as deltas (the new token ids, text and logprobs of each choice), not cumulative lists: a
frame's size and its encoding stay O(batch), however long the generations get, and the gateway's renderers
append them as they come. Nothing here imports torch.

NOTE: a socketpair, not ZMQ: each side's own thread writes and reads the socket, so a frame wakes no I/O thread
(ZMQ runs one per process), and on a 2-core machine every wake-up steals time from the core's OpenMP team.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import msgspec

from pagegate.config import EngineConfig
from pagegate.engine.errors import InvalidParamError, RequestFailedError
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.media.processing import WireProcessing
from pagegate.engine.memory.page_ledger import ElasticSpec
from pagegate.engine.observe.stats import EngineHealth, EngineStats
from pagegate.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagegate.engine.pin import Pin
from pagegate.engine.pool_snapshot import PoolSnapshot
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.structured import StructuredOutputsParams
from pagegate.engine.tenants import ONLINE, KeyShare, Lane

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pagegate.engine.sequence import Request

CPUS_ENV = "PAGEGATE_CORE_CPUS"  # the CPUs a core pins itself to, e.g. "0,1" (one share under data parallelism)


class Frame(msgspec.Struct, array_like=True, tag=True):
    """A frame; its tag (the class's `tag=`) is the first element of its array on the wire."""


# ---- gateway -> core -----------------------------------------------------------------------------------


class WireStructured(msgspec.Struct, array_like=True):
    """StructuredOutputsParams, field for field (a choice's tuple arrives as a list)."""

    json: str | dict[str, object] | None  # a JSON schema: any JSON value under its keys
    regex: str | None
    choice: list[str] | None
    grammar: str | None
    json_object: bool

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(**msgspec.structs.asdict(self))


class WireSampling(msgspec.Struct, array_like=True):
    """SamplingParams' init fields, in their order (test_frames holds the two to it): the core builds the
    SamplingParams, and so validates it, when it takes the request, so a bad one fails that request alone."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float] | None
    max_tokens: int | None
    min_tokens: int
    stop: list[str]
    stop_token_ids: list[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    skip_special_tokens: bool
    structured_outputs: WireStructured | None
    grammar_after_token: int | None

    @classmethod
    def of(cls, params: SamplingParams) -> WireSampling:
        """Checked against the wire's types here, where a bad one fails its request and not the core; a whole
        number given as a float (top_k=20.0) becomes the int the field is."""
        wire = {f.name: getattr(params, f.name) for f in fields(params) if f.init}
        if (structured := params.structured_outputs) is not None:
            wire["structured_outputs"] = [getattr(structured, f.name) for f in fields(structured)]
        return msgspec.convert(list(wire.values()), cls, strict=False)

    def params(self) -> SamplingParams:
        wire = msgspec.structs.asdict(self)
        if self.structured_outputs is not None:
            wire["structured_outputs"] = self.structured_outputs.params()
        return SamplingParams(**wire)


class WireImage(msgspec.Struct, array_like=True):
    """One image of a prompt, as the gateway decoded and preprocessed it: its digest and uint8 tiles."""

    digest: bytes
    shape: list[int]
    tiles: bytes

    @classmethod
    def of(cls, image: tuple[bytes, np.ndarray]) -> WireImage:
        import numpy as np  # NOTE: numpy where used: a gateway that sees no image nor snapshot never imports it

        digest, tiles = image
        return cls(digest, list(tiles.shape), np.ascontiguousarray(tiles, dtype=np.uint8).tobytes())

    def image(self) -> tuple[bytes, np.ndarray]:
        """(digest, tiles); InvalidParamError when the bytes are not the shape's."""
        import numpy as np

        count = int(np.prod(self.shape)) if self.shape else 0
        if count != len(self.tiles) or any(n < 0 for n in self.shape):
            raise InvalidParamError(f"an image's tiles ({len(self.tiles)} bytes) are not uint8 {self.shape}",
                                    "images")
        return self.digest, np.frombuffer(self.tiles, dtype=np.uint8).reshape(self.shape)


class Add(Frame, tag="add"):
    """A request: its prompt (the text, when it came as text, for the outputs), its sampling parameters, and
    `embed` for an embedding request (its prompt pooled, not continued);
    `lora_name`: the registered LoRA adapter it runs with (None: the base model); `tenant`: the identity of the API
    key that sent it where each key keeps its own prefix cache (a field of the chain root, never joined to the salt);
    `lane`: online, or batch work below it; `key`: the sending key's name, weight and quota of pages; `images`: the
    images its image tokens hold, in order."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: WireSampling
    priority: int = 0
    cache_salt: str | None = None
    pins: list[Pin] = msgspec.field(default_factory=list)
    embed: bool = False
    lora_name: str | None = None
    tenant: str | None = None
    lane: Lane = ONLINE
    key: KeyShare | None = None
    images: list[WireImage] = msgspec.field(default_factory=list)

    @property
    def sampling(self) -> SamplingParams:
        """Built (and validated) on each read."""
        return self.params.params()


class Abort(Frame, tag="abort"):
    """`num_seqs`: the sequences the gateway counted for it, counted back by the core even when it had ended."""

    request_id: str
    num_seqs: int


class Unpin(Frame, tag="unpin"):
    key: str


CallName = Literal["snapshot", "metrics", "sleep", "wake", "resize", "load_lora", "unload_lora"]
CallArg = int | str | tuple[str, str] | None


class Call(Frame, tag="call"):
    """A question answered between two steps; `sleep` frees an idle core's KV pages, `wake` allocates them again
    and `resize` does both at once (`arg`: the pages' new budget in bytes; None: as before); `load_lora` registers
    an adapter (`arg`: (name, path)) and `unload_lora` forgets one (`arg`: its name)."""

    call_id: int
    name: CallName
    arg: CallArg = None


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


class WireTimings(msgspec.Struct, array_like=True):
    """Request.timings(): core monotonic times of its milestones (None: not reached), then its timeline's."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    prefix_hit_pages: int = 0
    pages_held: int = 0
    preemptions: list[tuple[str, float, int, int, float | None]] | None = None  # Preemption.to_wire, each

    def metrics(self) -> dict[str, object]:
        """As Request.timings() wrote them: a milestone not reached and an empty timeline left out."""
        metrics = {name: value for name, value in msgspec.structs.asdict(self).items() if value is not None}
        if self.preemptions is not None:
            metrics["preemptions"] = [list(preemption) for preemption in self.preemptions]
        return metrics


class RequestDelta(msgspec.Struct, array_like=True):
    """What one request gained since its last delta: each choice's new part, the prompt's logprobs (once, when all
    are in), its timings (once, when it finishes), an embedding request's vector (little-endian float32 bytes), and
    the tokens each of its pins holds."""

    request_id: str
    finished: bool
    error: WireError | None = None
    num_cached_tokens: int = 0
    timings: WireTimings | None = None
    choices: list[CompletionOutput] = msgspec.field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    embedding: bytes | None = None
    pinned_tokens: list[int] | None = None  # a request with pins: the tokens each one holds so far

    def output(self, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
        """This delta as the engine's output type (its choices hold only what is new)."""
        return RequestOutput(self.request_id, prompt, prompt_token_ids, self.choices, self.finished,
                             self.num_cached_tokens, self.timings.metrics() if self.timings is not None else {},
                             self.error.message if self.error is not None else None, self.prompt_logprobs,
                             self.pinned_tokens or [])


class WireTokenizer(msgspec.Struct, array_like=True):
    """Tokenizer.to_wire, field for field: what rebuilds the model's tokenizer in the gateway."""

    backend: str  # tokenizer.json
    special_tokens: dict[str, str | None]
    chat_template: str | None
    eos_token_ids: list[int]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> WireTokenizer:
        return cls(**tokenizer.to_wire())

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_wire(msgspec.structs.asdict(self))


class CoreLoad(msgspec.Struct, array_like=True, frozen=True):
    """Sent with every outputs frame: the core's counts after the step, what admission control weighs (waiting
    sequences counting n choices each, running slots free), and how many sequences the core has taken from the
    gateway so far and how many aborts' sequences it has dropped (the rest are still in flight)."""

    stats: EngineStats
    health: EngineHealth
    waiting_seqs: int = 0
    free_slots: int = 0
    seqs_taken: int = 0
    seqs_aborted: int = 0


class Ready(Frame, tag="ready"):
    """What the gateway needs to validate, tokenize and render without a model of its own."""

    model_name: str
    max_model_len: int
    kv_pages: str  # the KV pages' format and bytes a token, for the start-up line
    vocab_size: int
    eos_token_ids: list[int]
    default_sampling: dict[str, int | float]  # generation_config.json, as SamplingParams keywords (top_k an int)
    tokenizer: WireTokenizer | None
    load: CoreLoad
    processing: WireProcessing | None = None  # a vision-language model's image preprocessing
    one_path: bool = False  # every step runs one path (the native decoder): a warm-up needs no decode step


class EarlyTokenizer(Frame, tag="tokenizer"):
    """The vocabulary of the GGUF a core reads ahead (gguf_tokenizer.vocabulary, loading/read_ahead.py), sent before
    the core builds anything from it: the gateway builds its copy of the tokenizer from it (tokenizer_from_gguf, as
    the core does; ~0.1 s for a 50k-token BPE) while the core loads. Where the spec names that file, Ready then
    carries no tokenizer."""

    vocabulary: dict[str, Any]


class Outputs(Frame, tag="outputs"):
    deltas: list[RequestDelta]
    load: CoreLoad


class WireSnapshot(msgspec.Struct, array_like=True):
    """A PoolSnapshot, its arrays as raw bytes (page states uint8, block tables int32)."""

    taken_at: float
    device_states: bytes
    cpu_states: bytes
    stats: EngineStats
    health: str
    health_reason: str
    seq_pages: dict[str, list[tuple[str, bytes]]]

    @classmethod
    def of(cls, snapshot: PoolSnapshot) -> WireSnapshot:
        import numpy as np

        seq_pages = {queue: [(rid, pages.astype(np.int32).tobytes()) for rid, pages in entries]
                     for queue, entries in snapshot.seq_pages.items()}
        return cls(snapshot.taken_at, snapshot.device_states.tobytes(), snapshot.cpu_states.tobytes(),
                   snapshot.stats, snapshot.health, snapshot.health_reason, seq_pages)

    def snapshot(self) -> PoolSnapshot:
        import numpy as np

        seq_pages = {queue: [(rid, np.frombuffer(raw, dtype=np.int32)) for rid, raw in entries]
                     for queue, entries in self.seq_pages.items()}
        return PoolSnapshot(self.taken_at, np.frombuffer(self.device_states, dtype=np.uint8),
                            np.frombuffer(self.cpu_states, dtype=np.uint8), self.stats, self.health,
                            self.health_reason, seq_pages)


CallResult = int | bytes | WireSnapshot | None  # a page count or an adapter's id, the metrics' text, a snapshot


class CallError(msgspec.Struct, array_like=True):
    """Why a call failed: the exception's type name and its message."""

    type: str
    message: str

    @classmethod
    def of(cls, error: BaseException) -> CallError:
        return cls(type(error).__name__, str(error))

    def exception(self) -> RuntimeError:
        return RuntimeError(f"{self.type}: {self.message}")


class Reply(Frame, tag="reply"):
    """A call's answer: its result, or the error it failed with."""

    call_id: int
    result: CallResult = None
    error: CallError | None = None


class Failed(Frame, tag="failed"):
    error_type: str
    message: str


ToGateway = EarlyTokenizer | Ready | Outputs | Reply | Failed

F = TypeVar("F", bound=Frame)
_ENCODER = msgspec.msgpack.Encoder()


def framed(frame: Frame) -> bytes:
    """A frame as it goes on the socket: its length, then its msgpack bytes."""
    payload = _ENCODER.encode(frame)
    return len(payload).to_bytes(4, "big") + payload


class FrameReader(Generic[F]):
    """Bytes off the socket in, whole frames of one direction out (a frame may arrive in pieces, several in one
    read); a frame that is not of that direction's types raises msgspec.ValidationError."""

    def __init__(self, kinds: object) -> None:
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


def add_frame(request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams, priority: int = 0,
              cache_salt: str | None = None, pins: tuple[Pin, ...] = (), embed: bool = False,
              lora_name: str | None = None, tenant: str | None = None, lane: Lane = ONLINE,
              key: KeyShare | None = None, images: Sequence[tuple[bytes, np.ndarray]] = ()) -> Add:
    return Add(request_id, prompt, token_ids, WireSampling.of(params), priority, cache_salt, list(pins), embed, lora_name,
               tenant, lane, key, [WireImage.of(image) for image in images])


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
                            request.num_cached_tokens, WireTimings(**request.timings()) if finished else None,
                            choices, scored,
                            _float32_bytes(request.embedding) if request.embedding is not None else None,
                            list(request.pinned_tokens) if request.pins else None)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._scored.discard(request_id)

    def is_new(self, request: Request) -> bool:
        """Nothing of it was sent yet: its first token should not wait."""
        return request.request_id not in self._sent


def _float32_bytes(values: np.ndarray | torch.Tensor) -> bytes:
    """An embedding (numpy, or a CPU torch tensor on the torch runner) as little-endian float32 bytes."""
    import numpy as np

    return np.asarray(values, dtype="<f4").tobytes()
