"""A victim request's latency beside each hostile load of issue 22, on the code before and after its bounds.

    git worktree add /tmp/before <commit before the fixes>   # with its Cython modules built or copied in
    python -m bench.hostile --before /tmp/before [--rounds 3] [--scenarios stop-token-ids logit-bias ...]

Each round starts one server per tree (alternating which goes first), and for each scenario measures the
victim (a short completion through the OpenAI SDK) alone, then while the hostile load runs; the figure is
the ratio of the two medians (1.0: the load costs the victim nothing). A hostile request the server refuses
(a 4xx) is replaced by the strongest one it accepts, so the "after" column measures what an attacker can
still do. The table gives the median ratio over the rounds for each tree.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagegate.testing.launcher import ServerProcess  # noqa: E402

SERVER_ARGS = ["--dtype", "float32", "--device", "cpu", "--grpc-port", "0", "--max-queue", "-1",
               "--disable-uvicorn-access-log", "--num-kv-blocks", "2048"]
VICTIM_TIMEOUT_S = 20.0  # a victim that waits longer counts as this long (the ratio is then a lower bound)
VICTIM_SAMPLES = 3
VOCAB = 2048  # the embedded model's
SERVER_FILE_LIMIT = 1024  # ulimit -n of the servers


@dataclass
class Hostile:
    """Bodies a hostile client posts in a loop from `clients` threads: the issue's, then what is accepted."""

    path: str
    attack: dict
    fallback: dict | None  # the strongest body a bounded server accepts (None: keep sending the attack)
    clients: int = 1


def tool(index: int) -> dict:
    """A function of four object parameters (distinct names, so every schema compiles anew)."""
    fields = {f"p{j}_{index}": {"type": "object", "required": ["x"], "properties": {
        "x": {"type": "integer", "minimum": 0}, "y": {"type": "string", "enum": ["a", "b", "c"]}}} for j in range(4)}
    return {"type": "function", "function": {"name": f"f{index}", "parameters": {
        "type": "object", "properties": fields, "required": list(fields)[:2]}}}


LONG_CHAT = [{"role": "user", "content": "x " * 3000}]
SCENARIOS: dict[str, Hostile] = {
    # not hostile: the load of 128 ordinary choices, what the two below add their cost to
    "n128-plain": Hostile("/v1/completions", {"prompt": "Hi", "n": 128, "max_tokens": 64, "ignore_eos": True}, None),
    "stop-token-ids": Hostile(
        "/v1/completions", {"prompt": "Hi", "n": 128, "max_tokens": 64, "ignore_eos": True,
                            "stop_token_ids": [0] * 4_000_000},
        {"prompt": "Hi", "n": 128, "max_tokens": 64, "ignore_eos": True, "stop_token_ids": list(range(256))}),
    "logit-bias": Hostile(
        "/v1/completions", {"prompt": "Hi", "n": 128, "max_tokens": 64, "ignore_eos": True,
                            "logit_bias": {str(t): 0.5 for t in range(VOCAB)}},
        {"prompt": "Hi", "n": 128, "max_tokens": 64, "ignore_eos": True,
         "logit_bias": {str(t): 0.5 for t in range(300)}}),
    "priority": Hostile(  # 512 sequences, 256 run: better-priority arrivals always wait in front of the victim
        "/v1/completions", {"prompt": ["Hi"] * 32, "max_tokens": 32, "ignore_eos": True, "priority": -(2**31)},
        {"prompt": ["Hi"] * 32, "max_tokens": 32, "ignore_eos": True}, clients=16),
    "tools-12000": Hostile(  # each a 400 in the end (the prompt is too long): after compiling them, or at once
        "/v1/chat/completions", {"messages": LONG_CHAT, "max_tokens": 1, "tools": [tool(i) for i in range(12_000)]},
        None, clients=4),
}


def victim_latency(base_url: str) -> float:
    """Median seconds of a few 8-token completions, one after another."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0, timeout=VICTIM_TIMEOUT_S)
    times = []
    for _ in range(VICTIM_SAMPLES):
        started = time.perf_counter()
        try:
            client.completions.create(model="pagegate-default", prompt="The victim asks", max_tokens=8)
            times.append(time.perf_counter() - started)
        except openai.APIError:
            times.append(VICTIM_TIMEOUT_S)
    return statistics.median(times)


class HostileLoad:
    """Threads posting the hostile body until stopped; a refused body is swapped for the fallback. Raw
    sockets, so that stopping closes them and the server aborts what is still running."""

    def __init__(self, base_url: str, hostile: Hostile) -> None:
        host, port = base_url.removeprefix("http://").split(":")
        self.address, self.hostile = (host, int(port)), hostile
        self.stop = threading.Event()
        self.body = hostile.attack
        self.encoded = {id(body): http_post(hostile.path, body) for body in (hostile.attack, hostile.fallback) if body}
        self.sockets: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(hostile.clients)]

    def __enter__(self) -> HostileLoad:
        for thread in self.threads:
            thread.start()
        time.sleep(1.0)  # let the load build up
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for sock in list(self.sockets):
            sock.close()
        for thread in self.threads:
            thread.join()

    def _loop(self) -> None:
        while not self.stop.is_set():
            body = self.body
            status = self._post(self.encoded[id(body)])
            if 400 <= status < 500 and body is self.hostile.attack and self.hostile.fallback is not None:
                self.body = self.hostile.fallback

    def _post(self, request: bytes) -> int:
        """The response's status (0 when the connection ended first)."""
        sock = socket.create_connection(self.address)
        self.sockets.append(sock)
        try:
            sock.sendall(request)
            answer = sock.recv(64)
        except OSError:
            answer = b""
        finally:
            sock.close()
            self.sockets.remove(sock)
        return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


def http_post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return head.encode() + data


class IdleSockets:
    """`count` connections that send `head` (or nothing) and never read: idle dashboard viewers, or sockets
    that hold a file descriptor without ever starting a request."""

    def __init__(self, base_url: str, count: int, head: bytes, settle_s: float) -> None:
        host, port = base_url.removeprefix("http://").split(":")
        self.address, self.count, self.head = (host, int(port)), count, head
        self.settle_s = settle_s  # how long the load stands before the victim asks
        self.sockets: list[socket.socket] = []

    def __enter__(self) -> IdleSockets:
        for _ in range(self.count):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that never reads
            sock.settimeout(10)
            try:
                sock.connect(self.address)
                if self.head:
                    sock.sendall(self.head)
            except OSError:
                pass  # a bounded server may close it at once
            self.sockets.append(sock)
        time.sleep(self.settle_s)
        return self

    def __exit__(self, *exc: object) -> None:
        for sock in self.sockets:
            sock.close()


FEED_REQUEST = b"GET /dashboard/api/feed HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n"
SOCKET_LOADS: dict[str, Callable[[str], IdleSockets]] = {
    "viewers-900": lambda url: IdleSockets(url, 900, FEED_REQUEST, settle_s=2.0),
    # past the idle timeout (5 s), under the usual 1,024-file limit (see start())
    "silent-1100": lambda url: IdleSockets(url, 1100, b"", settle_s=6.0),
}


def wait_idle(base_url: str, timeout_s: float = 120.0) -> None:
    """Until no request runs or waits (hostile ones left over from the last scenario)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(base_url + "/metrics", timeout=30).text
        busy = [line for line in text.splitlines()
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
                and float(line.rsplit(" ", 1)[1]) > 0]
        if not busy:
            return
        time.sleep(0.5)


def measure(base_url: str, name: str) -> tuple[float, float, str]:
    wait_idle(base_url)
    alone = victim_latency(base_url)
    load = SOCKET_LOADS[name](base_url) if name in SOCKET_LOADS else HostileLoad(base_url, SCENARIOS[name])
    with load:
        loaded = victim_latency(base_url)
    wait_idle(base_url)
    if isinstance(load, HostileLoad):
        return alone, loaded, "fell back" if load.body is not SCENARIOS[name].attack else "the attack"
    return alone, loaded, "connections"


def start(tree: Path) -> ServerProcess:
    """A server of `tree`'s code under the open-file limit most machines start with."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(SERVER_FILE_LIMIT, hard), hard))  # the child inherits it
    try:
        return ServerProcess(SERVER_ARGS, env={"PYTHONPATH": str(tree)}, cwd=tree).start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the code before the bounds")
    parser.add_argument("--rounds", type=int, default=3)
    names = [*SCENARIOS, *SOCKET_LOADS]
    parser.add_argument("--scenarios", nargs="+", default=names, choices=names)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": ROOT}
    ratios: dict[tuple[str, str], list[float]] = {}
    notes: dict[tuple[str, str], str] = {}
    for round_index in range(args.rounds):
        order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
        for label in order:
            server = start(trees[label])
            try:
                for name in args.scenarios:
                    alone, loaded, refused = measure(server.base_url, name)
                    ratios.setdefault((name, label), []).append(loaded / alone)
                    notes[(name, label)] = refused
                    print(f"round {round_index} {label:<6} {name:<15} alone {alone * 1000:7.0f} ms  "
                          f"loaded {loaded * 1000:7.0f} ms  ({refused})", flush=True)
            finally:
                server.stop()
    print(f"\n{'scenario':<15} {'before: loaded/alone':>21} {'after: loaded/alone':>20}  hostile body after")
    for name in args.scenarios:
        before, after = (statistics.median(ratios[(name, label)]) for label in trees)
        print(f"{name:<15} {before:>21.2f} {after:>20.2f}  {notes[(name, 'after')]}")


if __name__ == "__main__":
    main()
