"""llama-server's router mode (`--models-dir`, `--models-max`, `--sleep-idle-seconds`): the peer that bench/models.py
measures pagegate's model switching against. Each model runs in its own llama-server child process that the router
starts on the first request for it and proxies to."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.peers import llamacpp
from pagegate.testing.launcher import free_port


@contextlib.contextmanager
def llama_router(models: dict[str, Path], threads: int, models_max: int,
                 sleep_idle_s: int | None = None) -> Iterator[str]:
    """A llama-server router over `models` (name -> GGUF file, linked into a temporary --models-dir); yields its
    base URL once it answers /health, and stops it (and its children) on exit."""
    with tempfile.TemporaryDirectory(prefix="router-") as folder:
        for name, path in models.items():
            (Path(folder) / f"{name}.gguf").symlink_to(path.resolve())
        port = free_port()
        command = [str(llamacpp.binary("llama-server")), "--models-dir", folder, "--models-max", str(models_max),
                   "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
        if sleep_idle_s is not None:
            command += ["--sleep-idle-seconds", str(sleep_idle_s)]
        if llamacpp.repack_crashes():
            command.append("--no-repack")
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, process)
            yield base
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def wait_healthy(base: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the llama-server router exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError("the llama-server router never became healthy")


def model_status(base: str, name: str) -> str:
    """The router's state of one model ("loaded", "unloaded", "loading", ...) from its /v1/models."""
    cards = httpx.get(base + "/v1/models", timeout=10).json()["data"]
    status = next(card["status"] for card in cards if card["id"] == name)
    return str(status["value"])
