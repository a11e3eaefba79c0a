"""Start-up and model switch: pagegate against llama-server on the same GGUF file (issue 57, goal 4).

    python -m bench.startup [--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--rounds 5]

Start-up: `pagegate serve --model X.gguf` against `llama-server -m X.gguf`, each with its defaults (llama-server: one
slot of its default context), launched in turn (alternating rounds) on a warm file cache (one start of each before
the rounds). Each launch is timed to a healthy /health (polled every 10 ms; pagegate's 200 means its model is loaded
and warmed up, as llama-server's) and to its first answer (a one-token chat completion sent once healthy), so a cost
moved from start-up into the first request shows.

Switch: a several-model server (`pagegate serve --models-dir D`, llama-server's router `--models-dir D`) over two
names of the same file, `a` serving; each round unloads `b`, lets the server idle SETTLE_S (what it keeps ready
between requests, it may ready meanwhile: pagegate's spare core), then times a one-token chat completion naming `b`
(loaded on demand). The servers run side by side, their rounds alternating. Medians and their ratios are printed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.peers import llamacpp
from pagegate.testing.launcher import free_port

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
# Python's bytecode cached, as an installed pagegate has it (pip compiles it; a source checkout writes __pycache__ at
# its first run); a sandbox's PYTHONDONTWRITEBYTECODE would make every launch compile pagegate from source
ENV = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
POLL_S = 0.01
SETTLE_S = 4.0
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}


def post(port: int, path: str, body: dict, timeout: float = 120) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def healthy(port: int) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def answer(port: int, model: str) -> None:
    status = post(port, "/v1/chat/completions", {"model": model, **CHAT})
    if status != 200:
        raise RuntimeError(f"a chat completion for {model!r} answered {status}")


def launch(command: list[str], port: int, limit_s: float = 120) -> tuple[subprocess.Popen[bytes], float]:
    """The server started, and the seconds from its launch to a 200 from /health."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    while not healthy(port):
        if process.poll() is not None or time.perf_counter() - start > limit_s:
            process.kill()
            raise RuntimeError(f"{command[0]} exited or never became healthy: {' '.join(command)}")
        time.sleep(POLL_S)
    return process, time.perf_counter() - start


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait()


def pagegate_command(port: int, threads: int, *model: str) -> list[str]:
    """Its defaults, the gRPC server included (on a free port rather than 50051)."""
    return [sys.executable, "-m", "pagegate", "serve", *model, "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", str(free_port())]


def llama_server_command(port: int, threads: int, *model: str) -> list[str]:
    no_repack = ["--no-repack"] if llamacpp.repack_crashes() else []
    return [str(llamacpp.binary("llama-server")), *model, "-t", str(threads), "--host", "127.0.0.1", "--port",
            str(port), "--no-webui", *no_repack]


Command = Callable[..., list[str]]
SERVERS: dict[str, tuple[Command, list[str]]] = {"pagegate": (pagegate_command, ["--model"]),
                                                 "llama-server": (llama_server_command, ["-m"])}


def start_once(command: Command, flag: list[str], model: Path, threads: int) -> tuple[float, float]:
    """(launch to healthy, launch to the first answer) in seconds."""
    port = free_port()
    start = time.perf_counter()
    process, to_health = launch(command(port, threads, *flag, str(model)), port)
    try:
        answer(port, model.name)  # pagegate's name for it; llama-server with one model takes any
        return to_health, time.perf_counter() - start
    finally:
        stop(process)


def startup(model: Path, rounds: int, threads: int) -> dict[str, list[tuple[float, float]]]:
    for command, flag in SERVERS.values():  # the file cache warm, for both
        start_once(command, flag, model, threads)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in SERVERS}
    for _ in range(rounds):
        for name, (command, flag) in SERVERS.items():
            times[name].append(start_once(command, flag, model, threads))
    return times


def switch(model: Path, rounds: int, threads: int) -> dict[str, list[float]]:
    """Seconds of a one-token answer naming an unloaded model, per server and round."""
    with tempfile.TemporaryDirectory() as folder:
        for name in ("a", "b"):
            (Path(folder) / f"{name}.gguf").symlink_to(model.resolve())
        servers = {}
        try:
            for name, (command, _) in SERVERS.items():
                port = free_port()
                servers[name] = port, launch(command(port, threads, "--models-dir", folder), port)[0]
                answer(port, "a")
            times: dict[str, list[float]] = {name: [] for name in servers}
            for _ in range(rounds):
                for name, (port, _) in servers.items():
                    post(port, "/models/unload", {"model": "b"})  # a 400 where it is not loaded: fine
                    time.sleep(SETTLE_S)
                    start = time.perf_counter()
                    answer(port, "b")
                    times[name].append(time.perf_counter() - start)
            return times
        finally:
            for _, process in servers.values():
                stop(process)


def report(title: str, times: dict[str, list[float]]) -> None:
    medians = {name: statistics.median(found) for name, found in times.items()}
    for name, found in times.items():
        print(f"{title} {name}: rounds {', '.join(f'{t:.2f}' for t in found)} s, median {medians[name]:.3f} s")
    print(f"{title} pagegate / llama-server: {medians['pagegate'] / medians['llama-server']:.2f}x (goal 1.5x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", choices=["startup", "switch"], help="leave one of the two out")
    args = parser.parse_args()
    llamacpp.build()
    if args.skip != "startup":
        times = startup(args.model, args.rounds, args.threads)
        report("start-up (healthy)", {name: [t for t, _ in found] for name, found in times.items()})
        report("start-up (first answer)", {name: [t for _, t in found] for name, found in times.items()})
    if args.skip != "switch":
        report("switch", switch(args.model, args.rounds, args.threads))


if __name__ == "__main__":
    main()
