"""The engine core's loop, in the core's process (core_process.py): it builds the Engine on its main thread (the only
thread here that calls torch, so OpenMP keeps one thread team), says `ready`, then loops: take the frames the gateway
sent, step, send what moved (a frame a step, or one per OUTPUT_INTERVAL_S when steps are faster).

NOTE: detokenizing and stop strings stay in the core (Engine.postprocessor), unlike vLLM V1's frontend: a stop
string then ends its sequence in the step that produced it, so its pages are freed at once and no token past it
is computed; the offline `LLM` and the server share that code path. They cost microseconds per token next to a
step's milliseconds; the gateway keeps HTTP, validation, tokenizing, chat templates and rendering.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pagegate.engine.engine import Engine
from pagegate.engine.lora.loader import AdapterLoader, LoadJob
from pagegate.engine.media.processing import WireProcessing
from pagegate.engine.memory.page_ledger import receive_ledger
from pagegate.engine.native_runner import preloaded_tokenizer
from pagegate.engine.pool_snapshot import take_snapshot
from pagegate.engine.serving.frames import (
    Abort,
    Add,
    Call,
    CallArg,
    CallError,
    CallName,
    CallResult,
    CoreLoad,
    CoreSpec,
    DeltaWriter,
    Failed,
    Frame,
    FrameReader,
    Outputs,
    Ready,
    Reply,
    RequestDelta,
    Shutdown,
    ToCore,
    Unpin,
    WireError,
    WireSnapshot,
    WireTokenizer,
    framed,
)

if TYPE_CHECKING:
    from pagegate.engine.sequence import Request

log = logging.getLogger("pagegate.engine_core")  # the engine-core process (not the page core, pagegate.core)

OUTPUT_INTERVAL_S = 0.01  # outputs frames at most this often, except the urgent ones (CoreLoop._flush)
IDLE_POLL_MS = 500  # an idle core wakes this often (SIGTERM sets `stopping` between two polls)


class CoreLoop:
    """Frames in, steps, frames out; the Engine and the socket are used from this thread only."""

    def __init__(self, engine: Engine, sock: socket.socket) -> None:
        self.engine, self.sock = engine, sock
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)
        self.loader = self._adapter_loader()  # adapters loaded at run time are read off this loop
        self.reader: FrameReader[ToCore] = FrameReader(ToCore)
        self.deltas = DeltaWriter()
        self.seqs_taken = self.seqs_aborted = 0
        self.stopping = False
        self.unsent: dict[str, Request] = {}  # requests that moved since the last outputs frame
        self.last_sent = 0.0

    def run(self) -> None:
        while not self.stopping:
            busy = self.engine.has_unfinished()
            took = self._take_frames(0 if busy else IDLE_POLL_MS)
            if self.stopping:
                break
            if self.engine.has_unfinished():
                urgent = False
                for request in self.engine.step_requests():
                    self.unsent[request.request_id] = request
                    urgent = urgent or request.finished or request.error is not None or self.deltas.is_new(request)
                self._flush(urgent)
            elif took or self.unsent:  # aborts freed pages, or an add failed: the gateway's counts must see it
                self._flush(True)
            self._rebalance(busy)
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        if self.loader is not None:
            self.loader.close()
        self._last_counts()

    def _last_counts(self) -> None:
        """The counts once every request is aborted, so the gateway's last word on the pages is true even when
        the aborts and the stop came in one read (a core stopped, then resumed). The gateway may be gone."""
        try:
            self._send(Outputs([], self.load()))
        except OSError:
            pass

    def _rebalance(self, busy: bool) -> None:
        """An elastic pool grows after a step that lacked pages, shrinks when idle; the gateway hears of a move at
        once (its share of the budget, its pages)."""
        if self.engine.memory.rebalance(busy or self.engine.has_unfinished()):
            self._flush(True)

    def _flush(self, urgent: bool) -> None:
        """One outputs frame for what moved since the last, unless the last went out under OUTPUT_INTERVAL_S ago
        and nothing is urgent (a first token, a finish, a failure, an idle engine).

        NOTE: a small model steps every ~2 ms; a frame a step would cost the gateway (HTTP, JSON, SSE per chunk)
        CPU that the core's OpenMP threads are waiting for on a small machine. Coalesced, a stream gets its tokens
        a few at a time every 10 ms: no later than a reader notices, and time to first token is unchanged."""
        now = time.monotonic()
        if not urgent and self.engine.has_unfinished() and now - self.last_sent < OUTPUT_INTERVAL_S:
            return
        self._send(Outputs([self.deltas.delta(r) for r in self.unsent.values()], self.load()))
        self.unsent.clear()
        self.last_sent = now

    def _take_frames(self, timeout_ms: int) -> bool:
        took = False
        while events := self.poller.poll(timeout_ms):
            if self.loader is not None and any(fd == self.loader.wake_fd for fd, _ in events):
                self._finish_loads()
                if all(fd == self.loader.wake_fd for fd, _ in events):
                    timeout_ms = 0
                    continue
            data = self.sock.recv(1 << 20)
            if not data:
                log.error("the gateway is gone: the engine core stops")
                self.stopping = True
                return took
            for frame in self.reader.feed(data):
                self._handle(frame)
            took, timeout_ms = True, 0
        return took

    def _handle(self, frame: ToCore) -> None:
        match frame:
            case Add():
                self._add(frame)
            case Abort(request_id, num_seqs):  # counted even when the request had already ended
                self.engine.abort(request_id)
                self.deltas.forget(request_id)
                self.unsent.pop(request_id, None)
                self.seqs_aborted += num_seqs
            case Unpin(key):
                self.engine.unpin(key)
            case Call(call_id, name, arg):
                self._answer(call_id, name, arg)
            case Shutdown():
                self.stopping = True

    def _add(self, frame: Add) -> None:
        try:
            sampling = frame.sampling
            self.seqs_taken += sampling.n
            adapter = self.engine.memory.adapter(frame.lora_name)
            request = self.engine.intake.make_request(frame.request_id, frame.token_ids, sampling, frame.priority,
                                                      frame.cache_salt, tuple(frame.pins), frame.embed, adapter,
                                                      frame.tenant, lane=frame.lane, key=frame.key,
                                                      images=[image.image() for image in frame.images])
            request.prompt = frame.prompt
            self.engine.add(request)
        except Exception as error:  # that request fails, not the core
            self._send(Outputs([RequestDelta(frame.request_id, True, WireError.of(error))], self.load()))

    def _answer(self, call_id: int, name: CallName, arg: CallArg = None) -> None:
        try:
            with_arg: dict[str, Callable[[Any], CallResult]] = {"wake": self.engine.wake_up,
                                                                "resize": self.engine.resize,
                                                                "unload_lora": self.engine.unload_adapter}
            if name == "load_lora":
                self._load_lora(call_id, arg)
                return  # answered once the loader has read it (_finish_loads)
            if name in with_arg:
                result = with_arg[name](arg)
            else:
                without_arg: dict[str, Callable[[], CallResult]] = {"snapshot": self._snapshot,
                                                                    "metrics": self._metrics,
                                                                    "sleep": self.engine.sleep}
                result = without_arg[name]()
            self._send(Reply(call_id, result))
        except Exception as error:
            log.exception("call %s failed", name)
            self._send(Reply(call_id, error=CallError.of(error)))

    def _snapshot(self) -> WireSnapshot:
        return WireSnapshot.of(take_snapshot(self.engine))

    def _adapter_loader(self) -> AdapterLoader | None:
        """Adapters loaded at run time are Engine.load_adapter in two halves: read on the loader's thread, installed
        on this one between two steps."""
        if not self.engine.memory.serves_adapters:
            return None
        loader = AdapterLoader(self.engine.memory.read_adapter)
        self.poller.register(loader.wake_fd, select.POLLIN)
        return loader

    def _load_lora(self, call_id: int, name_and_path: CallArg) -> None:
        """Register an adapter at run time: its files are read and checked on the loader's thread (this loop keeps
        stepping), then _finish_loads installs it and answers with its id. ValueError naming what does not fit."""
        if self.loader is None:
            raise ValueError("this server serves no LoRA adapters (start it with --enable-lora)")
        if not isinstance(name_and_path, tuple):  # an assert would vanish under python -O
            raise ValueError(f"load_lora takes (name, path), not {type(name_and_path).__name__}")
        name, path = name_and_path
        self.loader.submit(LoadJob(call_id, name, path))

    def _finish_loads(self) -> None:
        """Install the adapters the loader has read (weights in host memory, paged in on first use) and answer
        their calls; a refused one answers its ValueError."""
        assert self.loader is not None
        for done in self.loader.finished():
            try:
                if isinstance(done.result, Exception):
                    raise done.result
                lora_id = self.engine.memory.load_adapter(done.job.name, done.job.path, done.result)
                self._send(Reply(done.job.call_id, lora_id))
            except Exception as error:
                log.warning("loading LoRA adapter %r failed: %s", done.job.name, error)
                self._send(Reply(done.job.call_id, error=CallError.of(error)))

    def _metrics(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.engine.metrics.registry)

    def load(self) -> CoreLoad:
        engine = self.engine
        return CoreLoad(engine.stats(), engine.health(), *engine.seats(), self.seqs_taken, self.seqs_aborted)

    def _send(self, frame: Frame) -> None:
        self.sock.sendall(framed(frame))


def ready_frame(loop: CoreLoop, tokenizer_sent: bool = False) -> Ready:
    """`tokenizer_sent`: the gateway built it from an EarlyTokenizer's vocabulary."""
    engine = loop.engine
    tokenizer = engine.tokenizer if not tokenizer_sent else None
    return Ready(engine.model_name, engine.max_model_len, engine.kv_pages, engine.model_config.vocab_size,
                 list(engine.eos_token_ids), engine.generation.sampling_overrides(),
                 WireTokenizer.of(tokenizer) if tokenizer is not None else None, loop.load(),
                 WireProcessing.of(engine.processing) if engine.processing is not None else None, engine.one_path)


def serve(spec: CoreSpec, vocabulary_sent: bool = False) -> int:
    """Build the engine `spec` asks for and run its loop until the gateway stops it; the exit code. `vocabulary_sent`:
    an EarlyTokenizer went out (core_process.EarlySend, done), so where the spec names the file read ahead the Ready
    frame carries no tokenizer."""
    sock = socket.socket(fileno=spec.socket_fd)
    try:
        if spec.elastic is not None:  # the gateway's descriptor number means nothing here: ours came on the socket
            spec = replace(spec, elastic=replace(spec.elastic, ledger_fd=receive_ledger(sock)))
        early = vocabulary_sent and preloaded_tokenizer(spec.config, spec.elastic is not None) is not None
        engine = Engine(spec.config, spec.elastic, on_worker_death=_worker_died)
    except Exception as error:
        log.debug("the engine failed to start", exc_info=True)
        sock.sendall(framed(Failed(type(error).__name__, str(error))))
        return 1
    loop = CoreLoop(engine, sock)
    signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "stopping", True))
    sock.sendall(framed(ready_frame(loop, tokenizer_sent=early)))
    loop.run()
    engine.close()
    sock.close()
    return 0


def _worker_died(message: str) -> None:
    """A dead rank: end here; the gateway sees the exit and fails the streams."""
    log.error("a tensor-parallel worker died (%s): the engine core stops", message)
    logging.shutdown()
    os._exit(1)
