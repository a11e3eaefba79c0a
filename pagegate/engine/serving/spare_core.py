"""The spare engine core a server of several models keeps, and the server's first core until a core takes it.

A core process imports pagegate (and, started as a spare or with PRELOAD_FLAG, the torch runner) before it reads its
spec from stdin, so a process started with no spec yet is a spare: it pays those imports (and torch's lazily imported
compiler, which building any model pulls in) ahead of need, then blocks until a CoreClient hands it a spec. Taking it saves that much of a model's load. Nothing
here imports torch.

NOTE: a spare is kept only where models load while the server runs (several models: the cores get an elastic
share of one page budget), and only for a core of the gateway's own environment (a data-parallel core's pinned CPUs
and thread count are set in its environment before torch starts). The spare that replaces a taken one starts once
every core has been idle for SPARE_IDLE_S: its imports take a CPU for seconds, and on a small machine they would
slow the steps of the model just loaded, its warm-up and first tokens included.

`pagegate serve` starts its first core before anything else (core_spawn.start_early_core, from pagegate/__main__.py):
the core's imports then run beside the gateway's own on the other CPU, not after them; SpareCores holds it from its
import on, and the first core of the gateway's environment takes it (`take_early`). One not taken (a data-parallel
core has an environment of its own; bad flags; --help) is ended at exit.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import TYPE_CHECKING, Protocol

from pagegate.engine.serving.core_spawn import CoreProcess, early_core, spawn_core

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger("pagegate.gateway")

SPARE_IDLE_S = 1.0  # every core idle this long before a spare replacing a taken one starts
IDLE_CHECK_S = 0.25


class Busy(Protocol):
    @property
    def busy(self) -> bool:
        """Loading, or serving requests or calls."""
        ...


class SpareCores:
    """The one spare core of this gateway process: taken by a starting core, replaced once the cores are idle."""

    def __init__(self) -> None:
        self.spare: CoreProcess | None = None
        self.early: CoreProcess | None = early_core()  # the first core, started before the gateway imported its app
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


async def stop_spare_core() -> None:
    """End this gateway's spare core, if it keeps one: call when the server stops, once no core can start any
    more (the loads in progress done)."""
    await SPARE_CORES.close()
