"""Engine-core processes as the gateway starts them, and the spare one a server of several models keeps.

A core process imports pagegate (and, started as a spare or with PRELOAD_FLAG, the torch runner) before it reads its
spec from stdin, so a process started with no spec yet is a spare: it pays those imports (and torch's lazily imported
compiler, which building any model pulls in) ahead of need, then blocks until a CoreClient hands it a spec. Taking it saves that much of a model's load. Nothing
here imports torch.

NOTE: a spare is kept only where models load while the server runs (several models: the cores get an elastic
share of one page budget), and only for a core of the gateway's own environment (a data-parallel core's pinned CPUs
and thread count are set in its environment before torch starts). The spare that replaces a taken one starts once
every core has been idle for SPARE_IDLE_S: its imports take a CPU for seconds, and on a small machine they would
slow the steps of the model just loaded, its warm-up and first tokens included.

`pagegate serve` starts its first core before anything else (`start_early_core`, from pagegate/__main__.py): the
core's imports (torch's ~1.2 s) then run beside the gateway's own (~0.5 s) on the other CPU, not after them, and
the first core of the gateway's environment takes it (`take_early`). One not taken (a data-parallel core has an
environment of its own; bad flags; --help) is ended at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagegate.engine.memory.page_ledger import send_ledger

if TYPE_CHECKING:
    import asyncio

    from pagegate.engine.serving.frames import CoreSpec

log = logging.getLogger("pagegate.gateway")

CORE_MODULE = "pagegate.engine.serving.core_process"
SPARE_FLAG = "--spare"  # argv of a spare: `--spare <gateway pid>`
PRELOAD_FLAG = "--preload"  # argv of a core that imports the torch runner while it waits for its spec
READ_AHEAD_FLAG = "--read-ahead"  # argv of a core that reads a GGUF model for the native core while it waits
SPARE_PROCESS_NAME = "pagegate-spare"  # a waiting spare's name (/proc/<pid>/comm)
CORE_PROCESS_NAME = "pagegate-core"  # a core's once it has its spec, a taken spare's too
SPARE_IDLE_S = 1.0  # every core idle this long before a spare replacing a taken one starts
IDLE_CHECK_S = 0.25
SPARE_STOP_TIMEOUT_S = 5.0
# A core's environment unless its own says otherwise. numpy's OpenBLAS starts a thread a CPU when it is imported,
# and each spins for ~0.1 s: on two CPUs, the one the gateway imports on. A core's numpy multiplies no matrices
# (its steps are C; torch has MKL of its own): one thread.
CORE_ENV = {"OPENBLAS_NUM_THREADS": "1"}


@dataclass
class CoreProcess:
    """A started engine-core process and the gateway's end of its socketpair (`core_fd`: the core's end, the same
    number in the core as it had here)."""

    process: subprocess.Popen[bytes]
    sock: socket.socket
    core_fd: int

    def hand(self, spec: CoreSpec) -> None:
        """Send its spec (it then loads its model), and first over its socket the page ledger its elastic pool
        uses (page_ledger's NOTE: a descriptor, never a path); OSError (a broken pipe) if the process has exited."""
        if spec.elastic is not None:
            send_ledger(self.sock, spec.elastic.ledger_fd)
        assert self.process.stdin is not None
        self.process.stdin.write(pickle.dumps(spec))
        self.process.stdin.close()

    def discard(self, timeout_s: float = SPARE_STOP_TIMEOUT_S) -> None:
        """End a process that was never handed a spec (it holds nothing: terminated at once) and wait for it."""
        self.sock.close()
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()
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


class Busy(Protocol):
    @property
    def busy(self) -> bool:
        """Loading, or serving requests or calls."""
        ...


class SpareCores:
    """The one spare core of this gateway process: taken by a starting core, replaced once the cores are idle."""

    def __init__(self) -> None:
        self.spare: CoreProcess | None = None
        self.early: CoreProcess | None = None  # the first core, started before the gateway imported its app
        self.cores: weakref.WeakSet[Busy] = weakref.WeakSet()  # the cores that took (or asked for) a spare
        self._replacing: asyncio.Task[None] | None = None
        atexit.register(self.close_now)

    def take(self, core: Busy) -> CoreProcess | None:
        """The spare, if one waits, for `core` to hand its spec; its replacement starts once every core is idle."""
        self.cores.add(core)
        spare, self.spare = self.spare, None
        if spare is not None and spare.process.poll() is not None:  # it died while it waited
            spare.discard()
            spare = None
        if spare is not None:
            self._replace_when_idle()
        return spare

    def take_early(self) -> CoreProcess | None:
        """The core `pagegate serve` started first (start_early_core), once, if it still runs."""
        early, self.early = self.early, None
        if early is not None and early.process.poll() is not None:
            early.discard()
            early = None
        return early

    def drop_early(self) -> None:
        """End the early core if no core took it (the first model's cores have started)."""
        early, self.early = self.early, None
        if early is not None:
            early.discard()

    def keep_one(self) -> None:
        """Start a spare now unless one waits or is due: after the server's first core started (its load runs
        beside the spare's imports, each on a CPU of its own on two)."""
        if self.spare is None and not self._replacement_pending():
            self._start_spare()

    # NOTE: asyncio is imported in the methods that run on the gateway's loop: an engine core imports this module
    # for its flags, and `pagegate serve` to start its first core, each ~5 ms sooner without it.
    def _replacement_pending(self) -> bool:
        import asyncio

        task = self._replacing
        return task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop()

    def _replace_when_idle(self) -> None:
        import asyncio

        if not self._replacement_pending():
            self._replacing = asyncio.get_running_loop().create_task(self._replace())

    async def _replace(self) -> None:
        import asyncio

        idle_s = 0.0
        while idle_s < SPARE_IDLE_S:
            await asyncio.sleep(IDLE_CHECK_S)
            idle_s = 0.0 if any(core.busy for core in self.cores) else idle_s + IDLE_CHECK_S
        if self.spare is None:
            self._start_spare()

    def _start_spare(self) -> None:
        try:
            self.spare = spawn_core(spare=True)
        except OSError as error:  # out of processes or memory: the next load starts its core afresh
            log.warning("could not start a spare engine core: %s", error)

    async def close(self) -> None:
        """End the spare (the server stops); a later core that asks for one starts them again."""
        if self._replacing is not None:
            self._replacing.cancel()
            self._replacing = None
        spare, self.spare = self.spare, None
        if spare is not None:
            import asyncio

            await asyncio.to_thread(spare.discard)

    def close_now(self) -> None:
        """The same at interpreter exit, for a gateway that never called close (and an early core never taken)."""
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.discard()
        self.drop_early()


SPARE_CORES = SpareCores()


def start_early_core(gguf: str | None) -> None:
    """Start the server's first core now, to import what it needs while the gateway imports its own (see above):
    with `gguf` (the one model to serve is that GGUF file), it reads it for the native core meanwhile; else it imports
    the torch runner."""
    try:
        SPARE_CORES.early = spawn_core(preload=gguf is None, read_ahead=gguf)
    except OSError as error:  # the gateway starts its core when it needs it, as it would have
        log.warning("could not start the engine core early: %s", error)


async def stop_spare_core() -> None:
    """End this gateway's spare core, if it keeps one: call when the server stops, once no core can start any
    more (the loads in progress done)."""
    await SPARE_CORES.close()
