"""Adapters loaded at run time are read and checked on a worker thread of the engine core, off its step loop: a
stream that runs while an adapter (or a big file named as one) is read keeps its pace.

NOTE: the worker only reads files and checks them with numpy (LoRAModel.read: no torch op, so no second OpenMP
team); the step loop's thread installs the result (LoRAModel.install) and answers the call. The worker wakes the
loop through a pipe that the loop polls beside its socket. Loads run one at a time, in the order they came."""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagegate.engine.lora.adapter import AdapterWeights


@dataclass(frozen=True)
class LoadJob:
    """One load asked for: the call to answer, the adapter's name and its path."""

    call_id: int
    name: str
    path: str


@dataclass(frozen=True)
class LoadDone:
    """A job read: its weights, or the error that refused it."""

    job: LoadJob
    result: AdapterWeights | Exception


class AdapterLoader:
    """A daemon thread that runs `read(name, path)` for each job; `finished()` gives the results on the loop's
    thread, and `wake_fd` turns readable when there are some."""

    def __init__(self, read: Callable[[str, str], AdapterWeights]) -> None:
        self._read = read
        self._jobs: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._done: deque[LoadDone] = deque()
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self._thread: threading.Thread | None = None
        self.pending = 0  # jobs submitted and not yet taken back by finished()

    def submit(self, job: LoadJob) -> None:
        if self._thread is None:  # started on the first load: a server that loads none has no thread
            self._thread = threading.Thread(target=self._work, name="pagegate-lora-loader", daemon=True)
            self._thread.start()
        self.pending += 1
        self._jobs.put(job)

    def finished(self) -> list[LoadDone]:
        """The jobs read since the last call (the wake-up pipe drained)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        done = []
        while self._done:
            done.append(self._done.popleft())
        self.pending -= len(done)
        return done

    def close(self) -> None:
        """Stop the worker after its current job (it is a daemon: a read under way never holds up an exit).

        NOTE: the pipe stays open until the process ends: closed now, a worker still reading could write its
        wake-up into whatever file took the descriptor's number next."""
        if self._thread is not None:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                result: AdapterWeights | Exception = self._read(job.name, job.path)
            except Exception as error:  # answered to the caller by the loop, never raised here
                result = error
            self._done.append(LoadDone(job, result))
            os.write(self._wake_write, b"!")
