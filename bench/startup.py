"""Start-up: `pagegate serve --model X.gguf` against `llama-server -m X.gguf`, launch to a healthy /health (issue 57).

    python -m bench.startup [--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--rounds 5]

Each round starts each server once, in turn (alternating), on a warm file cache (one start of each before the
rounds), each with its defaults (llama-server: one slot of its default context), and polls /health every 10 ms from
the moment it is launched; the medians of the rounds and their ratio are printed. pagegate's healthy means its model
is loaded and warmed up (/health answers 200 only then), as llama-server's.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.peers import llamacpp
from pagegate.testing.launcher import free_port

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
POLL_S = 0.01


def healthy(port: int) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def time_to_health(command: list[str], port: int, limit_s: float = 120) -> float:
    """Seconds from launching `command` to its /health answering 200 (the process is then stopped)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not healthy(port):
            if process.poll() is not None or time.perf_counter() - start > limit_s:
                raise RuntimeError(f"{command[0]} exited or never became healthy: {' '.join(command)}")
            time.sleep(POLL_S)
        return time.perf_counter() - start
    finally:
        process.terminate()
        process.wait()


def pagegate(model: Path, threads: int) -> float:
    port = free_port()
    return time_to_health([sys.executable, "-m", "pagegate", "serve", "--model", str(model), "--host", "127.0.0.1",
                           "--port", str(port), "--grpc-port", "0", "--disable-uvicorn-access-log"], port)


def llama_server(model: Path, threads: int) -> float:
    port = free_port()
    no_repack = ["--no-repack"] if llamacpp.repack_crashes() else []
    return time_to_health([str(llamacpp.binary("llama-server")), "-m", str(model), "-t", str(threads), "--host",
                           "127.0.0.1", "--port", str(port), "--no-webui", *no_repack], port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llamacpp.build()
    servers = {"pagegate": pagegate, "llama-server": llama_server}
    for start in servers.values():  # the file cache warm, for both
        start(args.model, args.threads)
    times: dict[str, list[float]] = {name: [] for name in servers}
    for _ in range(args.rounds):
        for name, start in servers.items():
            times[name].append(start(args.model, args.threads))
    medians = {name: statistics.median(found) for name, found in times.items()}
    for name, found in times.items():
        print(f"{name}: rounds {', '.join(f'{t:.2f}' for t in found)} s, median {medians[name]:.3f} s")
    print(f"pagegate / llama-server: {medians['pagegate'] / medians['llama-server']:.2f}x (goal 1.5x)")


if __name__ == "__main__":
    main()
