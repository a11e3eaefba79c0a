"""The engine core in its own process: `python -m pagegate.engine.serving.core_process`, started by the gateway.

It reads its EngineConfig and the number of its socket from stdin, then runs the core's loop (core_loop.py). It
never outlives the gateway. Started as a spare (`--spare <gateway pid>`, spare_core), it does its imports and waits
on stdin for a spec until a core that loads a model takes it; started with `--read-ahead FILE FD` (`pagegate serve`'s
first core: core_spawn.start_early_core), it reads the GGUF model FILE for the native core meanwhile
(loading/read_ahead.py) and sends its vocabulary on the socket FD at once (EarlyTokenizer).

NOTE: this module imports only what reading ahead needs; the loop's modules (the engine, its scheduler, prometheus:
~0.1 s) are imported after the read, so the vocabulary reaches the gateway that much sooner, and the gateway builds
its tokenizer while this core builds its own and repacks the weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import logging
import os
import pickle
import signal
import socket
import sys
import threading
from typing import Any

from pagegate.engine.loading.read_ahead import read_ahead
from pagegate.engine.serving.core_spawn import (
    CORE_PROCESS_NAME,
    PRELOAD_FLAG,
    READ_AHEAD_FLAG,
    SPARE_FLAG,
    SPARE_PROCESS_NAME,
)
from pagegate.engine.serving.frames import CPUS_ENV, CoreSpec, EarlyTokenizer, framed

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _never_outlive(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the gateway died before prctl took effect
        os._exit(1)


class EarlySend:
    """The read-ahead's vocabulary on its way to the gateway as an EarlyTokenizer, written by a thread: the gateway
    reads it once its own imports are done (until then the socket's buffer is full) and builds its tokenizer while
    this core builds its own, repacks the weights and waits for its spec."""

    _thread: threading.Thread | None = None
    _sent = False

    def __init__(self, socket_fd: int) -> None:
        self.socket_fd = socket_fd  # the core's socket, before the spec names it

    def start(self, vocabulary: dict[str, Any]) -> None:
        frame = framed(EarlyTokenizer(vocabulary))
        EarlySend._thread = threading.Thread(target=self._send, args=(frame,), daemon=True)
        EarlySend._thread.start()

    def _send(self, frame: bytes) -> None:
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self.socket_fd)) as sock:  # OSError: gone
            sock.sendall(frame)
            EarlySend._sent = True

    @classmethod
    def done(cls) -> bool:
        """Whether the vocabulary was sent, once the thread (if any) is done: before anything else writes the
        socket."""
        if cls._thread is not None:
            cls._thread.join()
        return cls._sent


def _spec_as_spare(parent_pid: int) -> CoreSpec:
    """A spare (spare_core.SpareCores) waits for its spec, named SPARE_PROCESS_NAME; meanwhile it dies with the
    gateway, ignores Ctrl-C as every core does, and imports what building any model would import lazily.

    NOTE: torch imports its compiler (torch._dynamo, over a second on a small machine) the first time a module is
    initialised on the meta device (models.registry.build_empty_model); imported here, it is off the load's path."""
    _set_process_name(SPARE_PROCESS_NAME)
    _never_outlive(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    importlib.import_module("pagegate.engine.runner")
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
    # what the imports made lives as long as the process: no collection walks it again (those during SmolLM2's
    # read-ahead took ~25 ms, ~5 ms so; a full one later walks ~1,000 objects, not ~34,000)
    gc.freeze()
    if sys.argv[1:2] == [PRELOAD_FLAG]:  # the torch runner's imports, while the gateway readies the spec
        importlib.import_module("pagegate.engine.runner")
    elif sys.argv[1:2] == [READ_AHEAD_FLAG]:  # the model the spec will likely name, for the native core
        read_ahead(sys.argv[2], on_vocab=EarlySend(int(sys.argv[3])).start)
    from pagegate.engine.serving.core_loop import serve  # the loop's imports: after the read (the NOTE)

    gc.freeze()
    spec = _spec_as_spare(int(sys.argv[2])) if sys.argv[1:2] == [SPARE_FLAG] else _read_spec()
    _set_process_name(CORE_PROCESS_NAME)  # a spare taken is a core like any other
    _never_outlive(spec.parent_pid)
    if cpus := os.environ.get(CPUS_ENV):  # before the first parallel region: OpenMP's threads inherit it
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the gateway leads the stop
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    code = serve(spec, vocabulary_sent=EarlySend.done())
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: _exit skips interpreter teardown, where gloo's and OpenMP's C++ threads could still be destroyed
    # joinable ("terminate called without an active exception", exit -6) after a clean stop.
    os._exit(code)


if __name__ == "__main__":
    main()
