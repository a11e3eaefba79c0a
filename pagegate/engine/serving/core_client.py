"""One engine-core process, seen from the gateway: it starts the process, sends it requests and aborts over a
socketpair, and hands each stream the deltas of its outputs as the core's frames bring them. Implements
EngineClient; nothing here imports torch (the gateway process never starts an OpenMP thread team).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from pagegate.config import EngineConfig
from pagegate.engine.errors import (
    EngineDeadError,
    EngineStalledError,
    InvalidParamError,
    ModelLoadError,
    RequestFailedError,
)
from pagegate.engine.loading.gguf_tokenizer import tokenizer_from_gguf
from pagegate.engine.media.processing import ImageProcessing
from pagegate.engine.memory.page_ledger import ElasticSpec
from pagegate.engine.observe.stats import EngineHealth, EngineStats
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.pin import Pin
from pagegate.engine.pool_snapshot import PoolSnapshot
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.structured import GrammarCompiler, StructuredOutputsParams
from pagegate.engine.serving.core_spawn import CoreProcess, spawn_core
from pagegate.engine.serving.frames import (
    Abort,
    Add,
    Call,
    CallArg,
    CallName,
    CallResult,
    CoreLoad,
    CoreSpec,
    EarlyTokenizer,
    Failed,
    Frame,
    FrameReader,
    Outputs,
    Ready,
    Reply,
    RequestDelta,
    Shutdown,
    ToGateway,
    Unpin,
    WireSnapshot,
    add_frame,
    framed,
)
from pagegate.engine.serving.spare_core import SPARE_CORES
from pagegate.engine.tenants import ONLINE, KeyShare, Lane

if TYPE_CHECKING:
    import numpy as np

    from pagegate.engine.loading.tokenizer import Tokenizer

log = logging.getLogger("pagegate.gateway")

R = TypeVar("R", int, bytes, WireSnapshot, None)

STOP_TIMEOUT_S = 15.0  # a core that does not exit after `shutdown` in this long is killed
MAX_STALL_CHECK_S = 1.0  # how often, at most this far apart, a core's silence is checked (--engine-step-timeout)


class _CoreProtocol(asyncio.Protocol):
    """The gateway's end of the socketpair: each whole frame to `take`, on the event loop."""

    def __init__(self, take: Callable[[ToGateway], None]) -> None:
        self.take = take
        self.reader: FrameReader[ToGateway] = FrameReader(ToGateway)

    def data_received(self, data: bytes) -> None:
        for frame in self.reader.feed(data):
            self.take(frame)


class CoreClient:
    def __init__(self, config: EngineConfig, index: int = 0, env: dict[str, str] | None = None, *,
                 step_timeout_s: float = 0.0, elastic: ElasticSpec | None = None) -> None:
        self.config, self.index, self._env = config, index, env
        self.elastic = elastic  # its pool's share of a shared page budget (None: a fixed pool)
        self.step_timeout_s = step_timeout_s  # --engine-step-timeout (0: never taken for hung)
        self.stalled_error: EngineStalledError | None = None  # set while the core is taken for hung
        self._last_heard = time.monotonic()  # the core's last frame, or when an idle core was last given work
        self._stall_watch: asyncio.Task[None] | None = None
        self.on_dead: Callable[[], None] | None = None
        self.dead_error: BaseException | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._streams: dict[str, asyncio.Queue[RequestDelta | BaseException]] = {}
        self._calls: dict[int, asyncio.Future[Reply]] = {}
        self._call_ids = itertools.count()
        self._seqs_sent = self._abort_seqs_sent = 0
        self._open_seqs: dict[str, int] = {}  # request id -> its sequences, while its stream is open
        self._stopping = False
        self._ready: asyncio.Future[Ready] | None = None
        self._load: CoreLoad | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.grammars: GrammarCompiler | None = None
        self.processing: ImageProcessing | None = None  # a vision-language model's (from its Ready frame)
        self._early_tokenizer: Tokenizer | None = None  # an EarlyTokenizer's, built while the core loads

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the core and wait until its model is loaded; ModelLoadError (or another) if it cannot start."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        core = self._launch()
        self.process = core.process
        self._transport, _ = await loop.create_connection(lambda: _CoreProtocol(self._take), sock=core.sock)
        self._watcher = loop.create_task(self._watch())
        self._take_ready(await self._ready)
        if self.step_timeout_s > 0:
            self._stall_watch = loop.create_task(self._watch_steps())

    def _launch(self) -> CoreProcess:
        """A core process handed its spec: the server's spare where it keeps one (several models, and this core
        runs in the gateway's environment: spare_core's NOTE), else the core `pagegate serve` started first (in
        the gateway's environment too), else a new process."""
        keeps_spare = self._env is None and self.elastic is not None
        spare = SPARE_CORES.take(self) if keeps_spare else None
        if spare is not None:
            try:
                spare.hand(self._spec(spare.core_fd))
                return spare
            except OSError:  # it exited between the look and the write
                spare.discard()
        core = (SPARE_CORES.take_early() if self._env is None else None) or spawn_core(self._env)
        if keeps_spare:
            SPARE_CORES.keep_one()
        core.hand(self._spec(core.core_fd))
        return core

    def _spec(self, socket_fd: int) -> CoreSpec:
        return CoreSpec(self.config, socket_fd, os.getpid(), logging.getLevelName(logging.getLogger().level),
                        self.elastic)

    @property
    def busy(self) -> bool:
        """Loading, or with requests or calls in flight (a spare waits for every core to be idle)."""
        return self.is_running and (self._ready is None or not self._ready.done() or self._has_work())

    def _take_ready(self, ready: Ready) -> None:
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.kv_pages = ready.kv_pages
        self.one_path = ready.one_path
        self.vocab_size = ready.vocab_size
        self.default_sampling = ready.default_sampling
        self.eos_token_ids = ready.eos_token_ids
        self.tokenizer = ready.tokenizer.tokenizer() if ready.tokenizer is not None else self._early_tokenizer
        self.processing = ready.processing.processing() if ready.processing is not None else None
        self._load = ready.load
        if self.tokenizer is not None:
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)

    async def _watch(self) -> None:
        """The core's exit, seen at once through a pidfd (a thread's waitpid where there is none)."""
        process = self.process
        assert process is not None
        try:
            fd = os.pidfd_open(process.pid)
        except (AttributeError, OSError):
            await asyncio.to_thread(process.wait)
        else:
            exited = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.add_reader(fd, exited.set)
            try:
                await exited.wait()
            finally:
                loop.remove_reader(fd)
                os.close(fd)
        code = process.wait()
        if self._ready is not None and not self._ready.done():  # its last frame (`failed`) may be in flight
            await asyncio.wait([self._ready], timeout=1.0)
        if not self._stopping:
            self._die(EngineDeadError(f"the engine core exited with code {code}"))

    def _die(self, error: BaseException) -> None:
        first = self.dead_error is None
        if first:
            log.error("engine core %d: %s", self.index, error)
        self.dead_error = self.dead_error or error
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        for stream in self._streams.values():
            stream.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        if first and self._ready is not None and self._ready.done() and self.on_dead is not None:
            self.on_dead()

    # ---- a hung core (--engine-step-timeout) -----------------------------------------------------------

    async def _watch_steps(self) -> None:
        while True:
            await asyncio.sleep(min(MAX_STALL_CHECK_S, self.step_timeout_s / 4))
            self._check_stall()

    def _has_work(self) -> bool:
        return bool(self._streams or self._calls)

    def _check_stall(self) -> None:
        """Take the core for hung when it has work and has sent nothing for --engine-step-timeout.

        NOTE: a busy core sends a frame at least every step it finishes, and an idle one has nothing to send, so
        silence only counts while something waits on it (a request's outputs, a call's reply), from the later of
        its last frame and the moment it was given work while idle. A step longer than the bound (a huge prefill on
        a slow machine) is taken for a hang too: the default (60 s) is vLLM's engine iteration timeout."""
        if self.stalled_error is not None or self.step_timeout_s <= 0 or not self.is_running or not self._has_work():
            return
        silent = time.monotonic() - self._last_heard
        if silent >= self.step_timeout_s:
            self._stall(EngineStalledError(f"engine core {self.index} has had work and finished no step for "
                                           f"{silent:.0f} s (--engine-step-timeout {self.step_timeout_s:g})"))

    def _stall(self, error: EngineStalledError) -> None:
        """Fail what waits on a hung core and abort its requests (their pages are freed if it ever steps again);
        until it sends a frame, it takes no new work."""
        log.error("%s: its requests fail and it takes no new ones until it steps again", error)
        self.stalled_error = error
        for request_id in list(self._open_seqs):
            self.abort(request_id)
        for stream in self._streams.values():
            stream.put_nowait(EngineStalledError(str(error)))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineStalledError(str(error)))

    def stalled(self) -> str | None:
        """Why this core is taken for hung (None when it steps)."""
        self._check_stall()
        return str(self.stalled_error) if self.stalled_error is not None else None

    @property
    def accepting(self) -> bool:
        """Whether it takes new work (not while it is taken for hung)."""
        return self.stalled() is None

    def _heard(self) -> None:
        self._last_heard = time.monotonic()
        if self.stalled_error is not None:
            log.warning("engine core %d steps again: it takes new work", self.index)
            self.stalled_error = None

    def _giving_work(self) -> None:
        """Before a request or a call is sent: an idle core's silence so far was no hang."""
        self._check_alive()
        if not self._has_work():
            self._last_heard = time.monotonic()

    async def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the core to stop (it aborts every request, freeing every page) and wait for it to exit."""
        self._stopping = True
        if self._stall_watch is not None:
            self._stall_watch.cancel()
        process = self.process
        if process is not None and process.poll() is None:
            self._send(Shutdown())
            try:
                await asyncio.wait_for(asyncio.to_thread(process.wait), timeout)
            except TimeoutError:
                log.error("engine core %d did not stop in %.0f s: killed", self.index, timeout)
                process.kill()
                await asyncio.to_thread(process.wait)
        if self._watcher is not None:
            self._watcher.cancel()
        self._transport.close()

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._stopping and self.process is not None

    # ---- frames from the core --------------------------------------------------------------------

    def _take(self, frame: ToGateway) -> None:
        self._heard()
        match frame:
            case Outputs(deltas, load):
                for delta in deltas:
                    stream = self._streams.get(delta.request_id)
                    if stream is not None:
                        stream.put_nowait(delta)
                self._load = load
            case Reply(call_id):
                future = self._calls.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_result(frame)
            case EarlyTokenizer(vocabulary) if self._ready is not None and not self._ready.done():
                self._early_tokenizer = _early_tokenizer(vocabulary)
            case Ready() if self._ready is not None:
                self._ready.set_result(frame)
            case Failed(name, message) if self._ready is not None and not self._ready.done():
                error = ModelLoadError(message) if name == "ModelLoadError" else RuntimeError(f"{name}: {message}")
                self._ready.set_exception(error)

    def _send(self, frame: Frame) -> None:
        self._transport.write(framed(frame))  # buffered by the transport: the event loop never blocks on it

    async def _ask(self, name: CallName, arg: CallArg = None) -> Reply:
        """A question the core answers between two steps."""
        self._giving_work()
        call_id = next(self._call_ids)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(Call(call_id, name, arg))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def _call(self, name: CallName, answer: type[R], arg: CallArg = None) -> R:
        """The call's result, of the type it answers with; a failed call raises RuntimeError("Type: message")."""
        reply = await self._ask(name, arg)
        if reply.error is not None:
            raise reply.error.exception()
        result: CallResult = reply.result
        if not isinstance(result, answer):
            raise RuntimeError(f"the engine core answered {name} with {type(result).__name__}")
        return result

    # ---- requests --------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       pins: tuple[Pin, ...] = (), token_ids: list[int] | None = None,
                       lora_name: str | None = None, tenant: str | None = None, lane: Lane = ONLINE,
                       key: KeyShare | None = None,
                       images: Sequence[tuple[bytes, np.ndarray]] = ()) -> AsyncGenerator[RequestOutput, None]:
        """Each output's delta as it comes (RequestOutput.add joins them); leaving the loop early aborts the
        request. The core checks the request (InvalidParamError from its first delta when it breaks a rule).
        `token_ids`: the prompt's, when the caller has tokenized it already (Replicas, to route it)."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = token_ids if token_ids is not None else self.token_ids(prompt)
        async for delta in self._stream(add_frame(request_id, text, token_ids, params, priority, cache_salt, pins,
                                                  lora_name=lora_name, tenant=tenant, lane=lane, key=key,
                                                  images=images), params.n):
            yield delta.output(text, token_ids)

    async def embed(self, token_ids: list[int], request_id: str, *, priority: int = 0,
                    lora_name: str | None = None, lane: Lane = ONLINE, key: KeyShare | None = None) -> bytes:
        """The prompt's embedding (little-endian float32), pooled in the core; leaving early aborts it."""
        async for delta in self._stream(add_frame(request_id, None, token_ids, SamplingParams(), priority,
                                                  embed=True, lora_name=lora_name, lane=lane, key=key), 1):
            if delta.finished:
                if delta.embedding is None:
                    raise RequestFailedError("the engine finished an embedding request without its embedding")
                return delta.embedding
        raise RequestFailedError("the engine ended an embedding request without finishing it")

    async def _stream(self, add: Add, num_seqs: int) -> AsyncGenerator[RequestDelta, None]:
        """Send a request; its deltas until the finished one (a failed one raises its error)."""
        self._giving_work()
        if add.request_id in self._streams:
            raise ValueError(f"request id {add.request_id!r} is already in use")
        stream: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._streams[add.request_id] = stream
        self._open_seqs[add.request_id] = num_seqs
        self._seqs_sent += num_seqs
        self._send(add)
        finished = False
        try:
            while not finished:
                delta = await stream.get()
                finished = isinstance(delta, BaseException) or delta.finished or delta.error is not None
                if isinstance(delta, BaseException):
                    raise delta
                if delta.error is not None:
                    raise delta.error.exception()
                yield delta
        finally:
            self._streams.pop(add.request_id, None)
            if not finished:
                self.abort(add.request_id)
            self._open_seqs.pop(add.request_id, None)

    def token_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (a text prompt is tokenized here, where the gateway's tokenizer is)."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise InvalidParamError("this model has no tokenizer: send the prompt as token ids", "prompt")
        return self.tokenizer.encode(prompt)

    def abort(self, request_id: str) -> None:
        """The core frees the request's pages before its next step; admission counts them free already."""
        if self.is_running:
            num_seqs = self._open_seqs.pop(request_id, 0)
            self._abort_seqs_sent += num_seqs
            self._send(Abort(request_id, num_seqs))

    def unpin(self, key: str) -> None:
        if self.is_running:
            self._send(Unpin(key))

    def compile_grammar(self, structured: StructuredOutputsParams) -> None:
        """Check a constraint here, before the request is admitted (InvalidParamError when it is bad); the core
        compiles its own matcher from the same source."""
        if self.grammars is None:
            raise InvalidParamError("this model has no tokenizer, so it cannot constrain its output",
                                    "structured_outputs")
        self.grammars.matcher(structured)

    def _check_alive(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")
        if self.stalled_error is not None:
            raise EngineStalledError(str(self.stalled_error))

    # ---- counts ----------------------------------------------------------------------------------

    @property
    def load(self) -> CoreLoad:
        """The core's latest counts."""
        if self._load is None:
            raise RuntimeError("the engine core has sent no counts yet: it is not ready")
        return self._load

    def queue_load(self) -> tuple[int, int]:
        """(sequences waiting, counting those still on their way to the core; running slots free, counting those
        of aborts on their way: an aborted sequence frees a waiting place or a running slot)."""
        load = self.load
        waiting = (self._seqs_sent - load.seqs_taken) + load.waiting_seqs - (self._abort_seqs_sent - load.seqs_aborted)
        return max(waiting, 0), load.free_slots + max(-waiting, 0)

    def stats(self) -> EngineStats:
        return self.load.stats

    def health(self) -> EngineHealth:
        return msgspec.structs.replace(self.load.health, engine_running=self.is_running)

    async def pool_snapshot(self) -> PoolSnapshot:
        return (await self._call("snapshot", WireSnapshot)).snapshot()

    async def metrics_text(self) -> bytes:
        """The core's Prometheus registry, rendered in the core."""
        return await self._call("metrics", bytes)

    async def sleep(self) -> None:
        """Free the core's KV pages, keep its weights (an idle core; pagegate.engine.sleep)."""
        await self._call("sleep", type(None))

    async def wake_up(self, kv_bytes: int | None = None) -> int:
        """KV pages again after `sleep` (`kv_bytes` of them; None: as before); how many."""
        return await self._call("wake", int, kv_bytes)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Register a LoRA adapter in the core; InvalidParamError (param lora_path) naming why it does not fit."""
        await self._lora_call("load_lora", (name, path))

    async def unload_lora_adapter(self, name: str) -> None:
        """Forget a LoRA adapter; InvalidParamError: code model_not_found (unknown) or adapter_busy (in use)."""
        await self._lora_call("unload_lora", name)

    async def _lora_call(self, name: CallName, arg: CallArg) -> None:
        error = (await self._ask(name, arg)).error
        if error is None:
            return
        if error.type == "InvalidParamError":
            raise InvalidParamError(error.message, "lora_name", "model_not_found")
        if error.type == "ValueError":
            busy = name == "unload_lora"
            raise InvalidParamError(error.message, "lora_name" if busy else "lora_path",
                                    "adapter_busy" if busy else "invalid_value")
        raise error.exception()

    async def resize(self, kv_bytes: int) -> int:
        """An idle core's pool to `kv_bytes` of pages (an elastic pool's limit moves in place, its prefix cache below
        it kept; a fixed pool is allocated again, its prefix cache lost); how many pages it has now."""
        return await self._call("resize", int, kv_bytes)


def _early_tokenizer(vocabulary: dict[str, Any]) -> Tokenizer | None:
    """The tokenizer of an EarlyTokenizer's vocabulary; None where it builds none (the core, building its own from the
    same vocabulary, fails the load and says why)."""
    try:
        return tokenizer_from_gguf(vocabulary)
    except (KeyError, ValueError):
        log.debug("the early vocabulary built no tokenizer", exc_info=True)
        return None
