"""How long /health takes while the server handles one oversized request (issue 12).

    python bench/health_latency.py                                   # launches the embedded model on CPU
    python bench/health_latency.py --base-url http://127.0.0.1:8000 --scenarios prompt-10MB header-16MiB

Each scenario sends one request from a thread while /health is probed every 10 ms over a kept-alive
connection; it prints the request's status and seconds and the probes' median and worst latency. The
claim to check: the worst probe stays under 100 ms whatever single request is being parsed (or answered:
`scoring-420k` builds a large scored answer).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERVER_ARGS = ["--dtype", "float32", "--device", "cpu", "--grpc-port", "0", "--max-queue", "-1",
               "--disable-uvicorn-access-log"]
TEXT_10MB = "All work and no play makes Jack a dull boy. " * 230_000
PROBE_EVERY_S = 0.01


def _post(base_url: str, path: str, body: dict) -> int:
    return httpx.post(base_url + path, json=body, timeout=600).status_code


def _big_header(base_url: str, size: int) -> int:
    parts = urlsplit(base_url)
    head = (b"GET /health HTTP/1.1\r\nHost: bench\r\nConnection: close\r\nX-Padding: " + b"p" * size + b"\r\n\r\n")
    with socket.create_connection((parts.hostname, parts.port), timeout=600) as sock:
        try:
            sock.sendall(head)
        except OSError:
            pass  # the server may answer and close before reading it all
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


SCENARIOS: dict[str, Callable[[str, str], int]] = {
    "prompt-10MB": lambda url, model: _post(url, "/v1/completions",
                                            {"model": model, "prompt": TEXT_10MB, "max_tokens": 1}),
    "chat-10MB": lambda url, model: _post(url, "/v1/chat/completions",
                                          {"model": model, "messages": [{"role": "user", "content": TEXT_10MB}]}),
    "tokenize-10MB": lambda url, model: _post(url, "/tokenize", {"model": model, "prompt": TEXT_10MB}),
    "prompts-2000": lambda url, model: _post(url, "/v1/completions", {
        "model": model, "max_tokens": 1, "prompt": [f"Request {i}: tell me about page tables." for i in range(2000)]}),
    "ids-3M": lambda url, model: _post(url, "/v1/completions",
                                       {"model": model, "prompt": [7] * 3_000_000, "max_tokens": 1}),
    "header-16MiB": lambda url, model: _big_header(url, 16 * 1024 * 1024),
    # 20 prompts x 1,000 tokens scored with 20 alternatives: 420,000 entries, a ~30 MB answer (issue 41, item 2)
    "scoring-420k": lambda url, model: _post(url, "/v1/completions", {
        "model": model, "max_tokens": 1, "prompt_logprobs": 20,
        "prompt": [[(7 * i + p) % 400 + 10 for p in range(1000)] for i in range(20)]}),
}


def run_scenario(base_url: str, model: str, name: str) -> dict[str, float | int | str]:
    outcome: dict[str, float | int] = {}

    def send() -> None:
        started = time.perf_counter()
        outcome["status"] = SCENARIOS[name](base_url, model)
        outcome["seconds"] = time.perf_counter() - started

    probes: list[float] = []
    with httpx.Client(base_url=base_url, timeout=600) as http:
        http.get("/health")  # the connection is open before the request starts
        sender = threading.Thread(target=send)
        sender.start()
        while True:
            started = time.perf_counter()
            http.get("/health")
            probes.append(time.perf_counter() - started)
            if not sender.is_alive():
                break
            time.sleep(PROBE_EVERY_S)
        sender.join()
    return {"scenario": name, "status": outcome["status"], "request_s": outcome["seconds"],
            "probes": len(probes), "health_p50_ms": statistics.median(probes) * 1000,
            "health_max_ms": max(probes) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (default: launch one)")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--server-args", default="", help="extra flags for the launched server")
    args = parser.parse_args()
    server = None
    if args.base_url is None:
        from pagegate.testing.launcher import ServerProcess

        server = ServerProcess(SERVER_ARGS + args.server_args.split()).start()
    base_url = args.base_url or server.base_url
    try:
        model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        print(f"{'scenario':<14} {'status':>6} {'request s':>10} {'probes':>7} {'/health p50 ms':>15} "
              f"{'/health max ms':>15}")
        for name in args.scenarios:
            row = run_scenario(base_url, model, name)
            print(f"{row['scenario']:<14} {row['status']:>6} {row['request_s']:>10.2f} {row['probes']:>7} "
                  f"{row['health_p50_ms']:>15.1f} {row['health_max_ms']:>15.1f}", flush=True)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
