"""The frames between the gateway and an engine-core process: msgpack lists, `[kind, ...]`, each behind its
4-byte length on one Unix stream socket (a socketpair the core inherits).

Gateway -> core: `add`, `abort`, `call` (a question answered between two steps), `shutdown`.
Core -> gateway: `ready` (what the gateway needs to know of the model), `outputs` (one frame per step: what
each request that moved gained in it, then the core's counts), `reply`, `failed` (the core could not start).

NOTE: outputs cross as deltas (the new token ids, text and logprobs of each choice), not cumulative lists: a
frame's size and its encoding stay O(batch), however long the generations get. The gateway's assembler appends
them into the cumulative `RequestOutput`s that renderers read. Nothing here imports torch.

NOTE: a socketpair, not ZMQ: each side's own thread writes and reads the socket, so a frame wakes no I/O thread
(ZMQ runs one per process), and on a 2-core machine every wake-up steals time from the core's OpenMP team.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import msgpack

from pagegate.config import EngineConfig
from pagegate.engine.errors import InvalidParamError, RequestFailedError
from pagegate.engine.observe.stats import EngineHealth, EngineStats
from pagegate.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagegate.engine.pins import Pin
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from pagegate.engine.sequence import Request

ADD, ABORT, UNPIN, CALL, SHUTDOWN = "add", "abort", "unpin", "call", "shutdown"
READY, OUTPUTS, REPLY, FAILED = "ready", "outputs", "reply", "failed"

CPUS_ENV = "PAGEGATE_CORE_CPUS"  # the CPUs a core pins itself to, e.g. "0,1" (one share under data parallelism)

_STATS_FIELDS = tuple(f.name for f in fields(EngineStats))
_HEALTH_FIELDS = tuple(f.name for f in fields(EngineHealth))


def pack(frame: list[Any]) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)  # logit_bias and top logprobs: int keys


def framed(frame: list[Any]) -> bytes:
    """A frame as it goes on the socket: its length, then its msgpack bytes."""
    payload = pack(frame)
    return len(payload).to_bytes(4, "big") + payload


class FrameReader:
    """Bytes off the socket in, whole frames out (a frame may arrive in pieces, several in one read)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[list[Any]]:
        buffer = self._buffer
        buffer += data
        frames, start = [], 0
        while len(buffer) - start >= 4:
            end = start + 4 + int.from_bytes(buffer[start:start + 4], "big")
            if end > len(buffer):
                break
            frames.append(unpack(bytes(buffer[start + 4:end])))
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


def add_frame(request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams, priority: int,
              cache_salt: str | None, pin: Pin | None = None, embed: bool = False) -> list[Any]:
    """`embed`: an embedding request (its prompt pooled, not continued)."""
    wire_pin = [pin.key, pin.ttl_s] if pin is not None else None
    return [ADD, request_id, prompt, token_ids, params_to_wire(params), priority, cache_salt, wire_pin, embed]


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


# ---- outputs: deltas out of the core, cumulative again in the gateway -------------------------------------


def error_to_wire(error: BaseException | str) -> list[Any]:
    if isinstance(error, InvalidParamError):
        return ["invalid", str(error), error.param, error.code]
    return ["failed", str(error), None, None]


def error_from_wire(wire: list[Any]) -> Exception:
    kind, message, param, code = wire
    return InvalidParamError(message, param, code) if kind == "invalid" else RequestFailedError(message)


def _logprob_to_wire(logprob: Logprob) -> list[Any]:
    return [logprob.token_id, logprob.logprob, logprob.top, logprob.rank]


def _logprob_from_wire(wire: list[Any] | None) -> Logprob | None:
    return None if wire is None else Logprob(*wire)


PROMPT_SENT = -1  # DeltaWriter's key (beside the choice indices) once a request's prompt logprobs went out


class DeltaWriter:
    """Core side: per request and choice, how much was already sent (tokens, characters, logprobs)."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, list[int]]] = {}

    def delta(self, request: Request) -> list[Any]:
        """[request id, finished, error, cached tokens, timings when finished, [choice deltas], prompt logprobs
        (once, when all are in), embedding (little-endian float32 bytes, once an embedding request has it)]."""
        sent = self._sent.setdefault(request.request_id, {})
        choices = []
        for seq in request.seqs if request.forked or request.params.n == 1 else ():
            tokens, chars, logprobs = sent.setdefault(seq.index, [0, 0, 0])
            new_ids = seq.token_ids[seq.num_prompt_tokens + tokens:]
            new_logprobs = ([_logprob_to_wire(lp) for lp in seq.logprobs[logprobs:]]
                            if seq.logprobs is not None else None)
            choices.append([seq.index, new_ids, seq.text[chars:], new_logprobs, seq.finish_reason,
                            seq.stop_reason])
            sent[seq.index] = [tokens + len(new_ids), len(seq.text),
                               len(seq.logprobs) if seq.logprobs is not None else 0]
        finished = request.finished or request.error is not None
        if finished:
            self._sent.pop(request.request_id, None)
        error = error_to_wire(request.error) if request.error is not None else None
        scored = request.scored_prompt if PROMPT_SENT not in sent else None
        if scored is not None:
            sent[PROMPT_SENT] = []
        return [request.request_id, request.finished, error, request.num_cached_tokens,
                request.timings() if finished else None, choices,
                [None if lp is None else _logprob_to_wire(lp) for lp in scored] if scored is not None else None,
                request.embedding.numpy().astype("<f4").tobytes() if request.embedding is not None else None]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def is_new(self, request: Request) -> bool:
        """Nothing of it was sent yet: its first token should not wait."""
        return request.request_id not in self._sent


@dataclass
class OutputAssembler:
    """Gateway side: one request's cumulative output, grown by each delta in place."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    choices: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list[Logprob | None] | None = None

    def apply(self, delta: list[Any]) -> RequestOutput:
        _, finished, error, cached, timings, choices, prompt_logprobs, *_ = delta  # then an embedding: embedding_of
        if prompt_logprobs is not None:
            self.prompt_logprobs = [_logprob_from_wire(lp) for lp in prompt_logprobs]
        for index, token_ids, text, logprobs, finish_reason, stop_reason in choices:
            choice = self.choices.get(index)
            if choice is None:
                choice = self.choices[index] = CompletionOutput(index, "", [], logprobs=[] if logprobs is not None
                                                                else None)
            choice.token_ids.extend(token_ids)
            choice.text += text
            if logprobs and choice.logprobs is not None:
                choice.logprobs.extend(Logprob(*wire) for wire in logprobs)
            choice.finish_reason, choice.stop_reason = finish_reason, stop_reason
        outputs = [self.choices[i] for i in sorted(self.choices)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished, cached,
                             timings or {}, error[1] if error is not None else None, self.prompt_logprobs)


def embedding_of(delta: list[Any]) -> bytes | None:
    """The embedding a finished embedding request's delta carries (little-endian float32), else None."""
    return delta[7] if len(delta) > 7 else None
