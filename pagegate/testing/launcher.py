"""Run `python -m pagegate serve` in a subprocess on a free port (tests, benchmarks, scripts)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

CORE_PROCESS_NAME = "pagegate-core"  # what a taken spare renames itself (pagegate.engine.serving.core_spawn)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: a server's engine cores, their tensor-parallel workers, helpers."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        below = parents.get(todo.pop(), [])
        found += below
        todo += below
    return found


def alive(pid: int) -> bool:
    """Running: some thread of it is neither a zombie nor dead. A killed process's main thread shows a zombie
    while its other threads are still exiting; until they have, its parent's waitpid does not see it exit."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    return any(_task_state(task) not in ("Z", "X", "") for task in tasks)


def _task_state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:  # it ended while we looked
        return ""


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0, poll_s: float = 0.1) -> None:
    """Return once `condition()` holds; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    """Wait until none of `pids` runs (or the timeout); the ones still running."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


def core_pids(server_pid: int) -> list[int]:
    """A server's engine-core processes (`python -m pagegate.engine.serving.core_process`), a spare waiting for its
    spec left out (pagegate.engine.serving.spare_core: it renames itself once it is a core)."""
    found = []
    for pid in descendants(server_pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if b"pagegate.engine.serving.core_process" in command and (b"--spare" not in command
                                                                    or name == CORE_PROCESS_NAME):
            found.append(pid)
    return found


@contextlib.contextmanager
def cores_stopped(server_pid: int) -> Iterator[list[int]]:
    """A server's engine cores stopped (SIGSTOP) until the block ends (SIGCONT): nothing steps meanwhile, so what
    runs cannot finish however fast the machine is. The gateway still answers, from its last counts; a question
    it must ask a core (/metrics) waits until the core runs again (or --engine-step-timeout)."""
    cores = core_pids(server_pid)
    for pid in cores:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield cores
    finally:
        for pid in cores:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)


class ServerProcess:
    """A real server: started, waited for (/health 200), stopped with SIGTERM; its log kept in a file."""

    def __init__(self, args: list[str] | None = None, *, host: str = "127.0.0.1", port: int | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 180.0,
                 cwd: Path | None = None) -> None:
        self.args = list(args or [])
        self.host = host
        self.port = port or free_port(host)
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd  # `python -m` puts it first on sys.path: a checkout there is the code that runs
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="pagegate-serve-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        command = [sys.executable, "-m", "pagegate", "serve", "--host", self.host, "--port", str(self.port), *self.args]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                        cwd=self.cwd)
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode} while starting:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server was not healthy after {self.startup_timeout_s}s:\n{self.log()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then wait; returns the exit code (SIGKILL and None if it would not stop)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                return None
        return self.process.returncode

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
