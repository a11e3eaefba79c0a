"""Engine-core processes started: the command line, environment and socket each starts with, and the server's first.

Light on purpose: `pagegate serve` imports it before anything else and starts its first core with it
(`start_early_core`), so the core's own imports begin ~20 ms after the gateway's process does rather than after the
spare-core bookkeeping's (logging, dataclasses: spare_core.py, which takes that first core over). Nothing here
imports more than the standard library's process and socket modules at start.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

TYPE_CHECKING = False  # typing's own costs an import
if TYPE_CHECKING:
    from pagegate.engine.serving.frames import CoreSpec

CORE_MODULE = "pagegate.engine.serving.core_process"
SPARE_FLAG = "--spare"  # argv of a spare: `--spare <gateway pid>`
PRELOAD_FLAG = "--preload"  # argv of a core that imports the torch runner while it waits for its spec
READ_AHEAD_FLAG = "--read-ahead"  # argv of a core that reads a GGUF model for the native core while it waits
SPARE_PROCESS_NAME = "pagegate-spare"  # a waiting spare's name (/proc/<pid>/comm)
CORE_PROCESS_NAME = "pagegate-core"  # a core's once it has its spec, a taken spare's too
SPARE_STOP_TIMEOUT_S = 5.0
# A core's environment unless its own says otherwise. numpy's OpenBLAS starts a thread a CPU when it is imported,
# and each spins for ~0.1 s: on two CPUs, the one the gateway imports on. A core's numpy multiplies no matrices
# (its steps are C; torch has MKL of its own): one thread.
CORE_ENV = {"OPENBLAS_NUM_THREADS": "1"}


class CoreProcess:
    """A started engine-core process and the gateway's end of its socketpair (`core_fd`: the core's end, the same
    number in the core as it had here)."""

    __slots__ = ("process", "sock", "core_fd")

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket, core_fd: int) -> None:
        self.process, self.sock, self.core_fd = process, sock, core_fd

    def hand(self, spec: CoreSpec) -> None:
        """Send its spec (it then loads its model), and first over its socket the page ledger its elastic pool
        uses (page_ledger's NOTE: a descriptor, never a path); OSError (a broken pipe) if the process has exited."""
        import pickle

        if spec.elastic is not None:
            from pagegate.engine.memory.page_ledger import send_ledger

            send_ledger(self.sock, spec.elastic.ledger_fd)
        assert self.process.stdin is not None
        self.process.stdin.write(pickle.dumps(spec))
        self.process.stdin.close()

    def discard(self, timeout_s: float = SPARE_STOP_TIMEOUT_S) -> None:
        """End a process that was never handed a spec (it holds nothing: terminated at once) and wait for it."""
        self.sock.close()
        try:
            assert self.process.stdin is not None
            self.process.stdin.close()
        except OSError:
            pass
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def spawn_core(env: dict[str, str] | None = None, *, spare: bool = False, preload: bool = False,
               read_ahead: str | None = None) -> CoreProcess:
    """Start `python -m pagegate.engine.serving.core_process`, waiting for its spec on stdin (a spare: as long as
    it takes a core to load a model; ended by SpareCores.close, at exit, or by its parent-death signal). `preload`:
    it imports the torch runner while it waits (a spare does); `read_ahead`: it reads this GGUF file for the native
    core while it waits (loading/read_ahead.py). Its environment: `env` (else this process's) over CORE_ENV."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    args = ([SPARE_FLAG, str(os.getpid())] if spare else [PRELOAD_FLAG] if preload
            else [READ_AHEAD_FLAG, read_ahead, str(theirs.fileno())] if read_ahead else [])
    with theirs:  # the core holds its own copy
        try:
            process = subprocess.Popen([sys.executable, "-m", CORE_MODULE, *args], stdin=subprocess.PIPE,
                                       env={**CORE_ENV, **(os.environ if env is None else env)},
                                       pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        return CoreProcess(process, ours, theirs.fileno())


_early: list[CoreProcess] = []  # the server's first core, until spare_core's SpareCores takes it over


def start_early_core(gguf: str | None) -> None:
    """Start the server's first core now, to import what it needs while the gateway imports its own (spare_core's
    docstring): with `gguf` (the one model to serve is that GGUF file), it reads it for the native core meanwhile;
    else it imports the torch runner."""
    try:
        _early.append(spawn_core(preload=gguf is None, read_ahead=gguf))
    except OSError as error:  # the gateway starts its core when it needs it, as it would have
        print(f"pagegate: could not start the engine core early: {error}", file=sys.stderr)


def early_core() -> CoreProcess | None:
    """The core start_early_core started, once (SpareCores holds it from then on)."""
    return _early.pop() if _early else None
