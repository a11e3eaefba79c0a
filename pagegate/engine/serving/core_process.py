"""The engine core in its own process: `python -m pagegate.engine.serving.core_process`, started by the gateway.

It reads its EngineConfig and the number of its socket from stdin, builds the Engine on its main thread (the
only thread here that calls torch, so OpenMP keeps one thread team), says `ready`, then loops: take the frames
the gateway sent, step, send what moved (a frame a step, or one per OUTPUT_INTERVAL_S when steps are faster).
It never outlives the gateway. Started as a spare (`--spare <gateway pid>`, spare_core), it does its imports and
waits on stdin for a spec until a core that loads a model takes it.

NOTE: detokenizing and stop strings stay in the core (Engine.postprocessor), unlike vLLM V1's frontend: a stop
string then ends its sequence in the step that produced it, so its pages are freed at once and no token past it
is computed; the offline `LLM` and the server share that code path. They cost microseconds per token next to a
step's milliseconds; the gateway keeps HTTP, validation, tokenizing, chat templates and rendering.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import logging
import os
import pickle
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pagegate.engine.engine import Engine
from pagegate.engine.kv_cache import bytes_per_block, check_fits
from pagegate.engine.lora import LoRARequest
from pagegate.engine.lora.loader import AdapterLoader, LoadJob
from pagegate.engine.lora.model import resolve_adapter
from pagegate.engine.pool_snapshot import take_snapshot
from pagegate.engine.runner import ModelRunner
from pagegate.engine.scheduler import Scheduler
from pagegate.engine.serving.elastic_pages import ElasticPages, elastic_config, elastic_pages
from pagegate.engine.serving.frames import (
    CPUS_ENV,
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
from pagegate.engine.serving.page_ledger import receive_ledger
from pagegate.engine.serving.spare_core import CORE_PROCESS_NAME, SPARE_FLAG, SPARE_PROCESS_NAME

if TYPE_CHECKING:
    from pagegate.engine.sequence import Request

log = logging.getLogger("pagegate.engine_core")  # the engine-core process (not the page core, pagegate.core)

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
OUTPUT_INTERVAL_S = 0.01  # outputs frames at most this often, except the urgent ones (CoreLoop._flush)
IDLE_POLL_MS = 500  # an idle core wakes this often (SIGTERM sets `stopping` between two polls)


class CoreLoop:
    """Frames in, steps, frames out; the Engine and the socket are used from this thread only."""

    def __init__(self, engine: Engine, sock: socket.socket, elastic: ElasticPages | None = None) -> None:
        self.engine, self.sock = engine, sock
        self.elastic = elastic  # its pool's limit in a shared page budget (None: a fixed pool)
        if elastic is not None:
            self._new_scheduler(elastic.floor)
            elastic.adopt(elastic.spec.start_bytes)
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)
        self.loader = self._adapter_loader()  # adapters loaded at run time are read off this loop
        self.reader: FrameReader[ToCore] = FrameReader(ToCore)
        self.deltas = DeltaWriter()
        self.seqs_taken = self.seqs_aborted = 0
        self.stopping = False
        self.unsent: dict[str, Request] = {}  # requests that moved since the last outputs frame
        self.last_sent = 0.0
        self.asleep = False  # its KV pages are freed: it takes no request until it wakes

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
            if self.elastic is not None and not self.asleep:
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
        """The elastic pool grows after a step that lacked pages, shrinks when idle; the gateway hears of a move at
        once (its share of the budget, its pages)."""
        assert self.elastic is not None
        before = self.elastic.limit
        self.elastic.after_step(busy or self.engine.has_unfinished())
        if self.elastic.limit != before:
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
            if self.asleep:
                raise RuntimeError("the model is asleep: wake it up first")
            sampling = frame.sampling
            self.seqs_taken += sampling.n
            adapter = resolve_adapter(self.engine.runner.lora, frame.lora_name)
            request = self.engine.intake.make_request(frame.request_id, frame.token_ids, sampling, frame.priority,
                                                      frame.cache_salt, frame.pin, frame.embed, adapter,
                                                      frame.tenant)
            request.prompt = frame.prompt
            self.engine.add(request)
        except Exception as error:  # that request fails, not the core
            self._send(Outputs([RequestDelta(frame.request_id, True, WireError.of(error))], self.load()))

    def _answer(self, call_id: int, name: CallName, arg: CallArg = None) -> None:
        try:
            with_arg: dict[str, Callable[[Any], CallResult]] = {"wake": self._wake, "resize": self._resize,
                                                                "unload_lora": self._unload_lora}
            if name == "load_lora":
                self._load_lora(call_id, arg)
                return  # answered once the loader has read it (_finish_loads)
            if name in with_arg:
                result = with_arg[name](arg)
            else:
                without_arg: dict[str, Callable[[], CallResult]] = {"snapshot": self._snapshot,
                                                                    "metrics": self._metrics, "sleep": self._sleep}
                result = without_arg[name]()
            self._send(Reply(call_id, result))
        except Exception as error:
            log.exception("call %s failed", name)
            self._send(Reply(call_id, error=CallError.of(error)))

    def _snapshot(self) -> WireSnapshot:
        return WireSnapshot.of(take_snapshot(self.engine))

    def _sleep(self) -> None:
        """Free the KV pages, keep the weights (vLLM's sleep level 1: on CPU the weights already live in host
        memory, so nothing is offloaded); a RuntimeError while requests run.

        NOTE: the pages' contents go with them, unless the KV tiers are on: then every cached page goes down them
        first and a woken core finds its prefixes (and pinned conversations) there; without tiers it starts cold."""
        if self.asleep:
            return
        engine, events = self.engine, self.engine.config.kv_events
        if engine.has_unfinished():
            raise RuntimeError("the engine has requests running: it cannot sleep")
        if not isinstance(engine.runner, ModelRunner) or (events is not None and events.enable_kv_cache_events):
            raise ValueError("this engine cannot sleep (an encoder, or KV-cache events are published)")
        engine.runner.free_kv_cache(engine.scheduler.pool)
        if self.elastic is not None:
            self.elastic.slept()
        gc.collect()
        self.asleep = True

    def _wake(self, kv_bytes: int | None = None) -> int:
        """Fresh KV pages (as many as before, or `kv_bytes` of them) and a fresh scheduler over them; the number of
        pages."""
        engine, config = self.engine, self.engine.config
        runner = engine.runner
        assert isinstance(runner, ModelRunner)
        if not self.asleep:
            if self.elastic is not None:  # the bytes reserved for a wake it did not need go back
                self.elastic.ledger.give(self.elastic.spec.entry, kv_bytes or 0)
                return self.elastic.limit
            return runner.num_blocks
        if kv_bytes is not None and self.elastic is None:  # an elastic pool keeps its capacity and adopts kv_bytes
            runner.num_blocks = self._pages_for(kv_bytes)
            engine.metrics.cache_config(config.cache.block_size, runner.num_blocks)
        runner.allocate_kv_cache()
        self._new_scheduler(self.elastic.floor if self.elastic is not None else None)
        self.asleep = False
        if self.elastic is not None:
            return self.elastic.adopt(kv_bytes if kv_bytes is not None else self.elastic.spec.floor_bytes)
        return runner.num_blocks

    def _new_scheduler(self, limit: int | None) -> None:
        """A fresh scheduler over the runner's pages (`limit`: of them usable, an elastic pool's floor)."""
        engine, config = self.engine, self.engine.config
        runner = engine.runner
        assert isinstance(runner, ModelRunner)
        engine.scheduler = Scheduler(config.scheduler, config.cache, runner.num_blocks, runner.num_cpu_blocks,
                                     runner.max_model_len, config.speculative, runner.draft, runner.tiers,
                                     runner.lora, limit)  # adapters are read into the fresh pool's pages on demand
        runner.bind(engine.scheduler.tables)
        engine.monitor.rebind(engine.scheduler.pool)
        engine.metrics.rebase(engine.scheduler.stats())
        engine.refresh_stats()

    def _resize(self, kv_bytes: int) -> int:
        """An idle core's pool to `kv_bytes` of pages, in one call (no request can come between its sleep and its
        wake); the number of pages. Its prefix cache is lost, as in a sleep; an elastic pool moves its limit in
        place instead (its cached pages below the limit kept)."""
        if self.elastic is not None:
            return self.elastic.resize(kv_bytes)
        self._pages_for(kv_bytes)  # a size that cannot hold one sequence is refused before anything is freed
        self._sleep()
        return self._wake(kv_bytes)

    def _adapter_loader(self) -> AdapterLoader | None:
        lora = self.engine.runner.lora
        if lora is None:
            return None
        loader = AdapterLoader(lambda name, path: lora.read(name, path, lora.config.lora_dir))
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
        lora = self.engine.runner.lora
        for done in self.loader.finished():
            try:
                if isinstance(done.result, Exception):
                    raise done.result
                assert lora is not None
                registered = lora.install(LoRARequest(done.job.name, lora.next_id, done.job.path), done.result)
                self._send(Reply(done.job.call_id, registered.request.lora_int_id))
            except Exception as error:
                log.warning("loading LoRA adapter %r failed: %s", done.job.name, error)
                self._send(Reply(done.job.call_id, error=CallError.of(error)))

    def _unload_lora(self, name: str) -> None:
        """Forget an adapter: InvalidParamError (model_not_found) for an unknown one, ValueError while requests use
        it (they are never broken: the client retries once they are done)."""
        lora = self.engine.runner.lora
        resolve_adapter(lora, name)
        self.engine.scheduler.unload_adapter(name)
        assert lora is not None
        lora.unregister(name)
        self.engine.refresh_stats()

    def _pages_for(self, kv_bytes: int) -> int:
        runner, cache = self.engine.runner, self.engine.config.cache
        assert isinstance(runner, ModelRunner)
        model = runner.model
        page = bytes_per_block(model.num_layers, cache.block_size, model.num_kv_heads, model.head_dim,
                               runner.kv_format)
        check_fits(kv_bytes // page, cache.block_size, runner.max_model_len, page)
        return kv_bytes // page

    def _metrics(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.engine.metrics.registry)

    def load(self) -> CoreLoad:
        engine, scheduler = self.engine, self.engine.scheduler
        return CoreLoad(engine.stats(), engine.health(), scheduler.num_waiting_seqs, scheduler.free_slots,
                        self.seqs_taken, self.seqs_aborted)

    def _send(self, frame: Frame) -> None:
        self.sock.sendall(framed(frame))


def ready_frame(loop: CoreLoop) -> Ready:
    engine = loop.engine
    return Ready(engine.model_name, engine.max_model_len, engine.kv_pages, engine.model_config.vocab_size,
                 list(engine.eos_token_ids), engine.runner.generation.sampling_overrides(),
                 WireTokenizer.of(engine.tokenizer) if engine.tokenizer is not None else None, loop.load())


def _never_outlive(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the gateway died before prctl took effect
        os._exit(1)


def serve(spec: CoreSpec) -> int:
    sock = socket.socket(fileno=spec.socket_fd)
    try:
        if spec.elastic is not None:  # the gateway's descriptor number means nothing here: ours came on the socket
            spec = replace(spec, elastic=replace(spec.elastic, ledger_fd=receive_ledger(sock)))
        config = elastic_config(spec.config, spec.elastic) if spec.elastic is not None else spec.config
        engine = Engine(config)
        elastic = elastic_pages(engine, spec.elastic)
    except Exception as error:
        log.debug("the engine failed to start", exc_info=True)
        sock.sendall(framed(Failed(type(error).__name__, str(error))))
        return 1
    if engine.runner.workers is not None:  # a dead rank: end here, the gateway sees the exit and fails streams
        engine.runner.workers.on_death = _worker_died
    loop = CoreLoop(engine, sock, elastic)
    signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "stopping", True))
    sock.sendall(framed(ready_frame(loop)))
    loop.run()
    engine.close()
    sock.close()
    return 0


def _worker_died(message: str) -> None:
    log.error("a tensor-parallel worker died (%s): the engine core stops", message)
    logging.shutdown()
    os._exit(1)


def _spec_as_spare(parent_pid: int) -> CoreSpec:
    """A spare (spare_core.SpareCores) waits for its spec, named SPARE_PROCESS_NAME; meanwhile it dies with the
    gateway, ignores Ctrl-C as every core does, and imports what building any model would import lazily.

    NOTE: torch imports its compiler (torch._dynamo, over a second on a small machine) the first time a module is
    initialised on the meta device (models.registry.build_empty_model); imported here, it is off the load's path."""
    _set_process_name(SPARE_PROCESS_NAME)
    _never_outlive(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    importlib.import_module("torch._dynamo")
    return _read_spec()


def _read_spec() -> CoreSpec:
    try:
        spec: CoreSpec = pickle.load(sys.stdin.buffer)
    except EOFError:  # a spare let go, or a gateway gone before it sent the spec: nothing to serve
        os._exit(0)
    return spec


def _set_process_name(name: str) -> None:
    """The name `ps -e` and /proc/<pid>/comm show (15 bytes at most; the threads started later inherit it)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15])


def main() -> None:
    spec = _spec_as_spare(int(sys.argv[2])) if sys.argv[1:2] == [SPARE_FLAG] else _read_spec()
    _set_process_name(CORE_PROCESS_NAME)  # a spare taken is a core like any other
    _never_outlive(spec.parent_pid)
    if cpus := os.environ.get(CPUS_ENV):  # before the first parallel region: OpenMP's threads inherit it
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the gateway leads the stop
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    code = serve(spec)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: _exit skips interpreter teardown, where gloo's and OpenMP's C++ threads could still be destroyed
    # joinable ("terminate called without an active exception", exit -6) after a clean stop.
    os._exit(code)


if __name__ == "__main__":
    main()
