"""How long a short completion waits behind one big embeddings request (issue 41, item 5; issue 64, item 11).

    python bench/embed_starvation.py                          # the embedded model on CPU, this checkout
    python bench/embed_starvation.py --inputs 48 --tokens 2000 --server-args "--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    python bench/embed_starvation.py --inputs 48 --tokens 2000 --rounds 3 --cancel    # issue 64, item 11: medians
    git worktree add /tmp/before <commit> && python bench/embed_starvation.py --checkout /tmp/before .   # before, after

It launches a server (`--pooling last`, so a checkout from before embeddings were served by default runs it too),
and per round times the victim (a 16-token greedy completion) alone (the median of `--alone` runs), then sends one
embeddings request of `--inputs` x `--tokens` token ids, and `--delay` seconds later the victim again; it prints the
victim's latency alone and beside the embeddings, their ratio, whether it ended before or after them, and the
embeddings request's own time; then the median over `--rounds`. Under plain first-come-first-served scheduling
the victim waited for every input; with embeddings in slices of time between generation steps (scheduler.py,
POOLING_SHARE) it waits for the slice in flight and then its own steps. Bounded: one server, `--timeout` seconds at
most a request; with `--cancel` a round ends with the victim (the embeddings request is closed, and aborted).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from http.client import HTTPConnection
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERVER_ARGS = ["--dtype", "float32", "--device", "cpu", "--grpc-port", "0", "--max-queue", "-1",
               "--disable-uvicorn-access-log", "--pooling", "last"]


def victim(http: httpx.Client, model: str, max_tokens: int) -> float:
    """Seconds for one short greedy completion (ignore_eos: always `max_tokens` tokens)."""
    started = time.perf_counter()
    reply = http.post("/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True})
    reply.raise_for_status()
    return time.perf_counter() - started


class BigEmbedding(threading.Thread):
    """One embeddings request of `inputs` x `tokens` token ids on its own connection, which `cancel` shuts (a
    blocked read ends at once; the server sees the client go and aborts the request)."""

    def __init__(self, base_url: str, model: str, inputs: int, tokens: int, timeout: float) -> None:
        super().__init__(daemon=True)
        url = httpx.URL(base_url)
        self.connection = HTTPConnection(url.host, url.port, timeout=timeout)
        ids = [[(7 * i + p) % 400 + 10 for p in range(tokens)] for i in range(inputs)]
        self.body = json.dumps({"model": model, "input": ids})
        self.status: int | str = "-"
        self.seconds = self.ended = 0.0

    def run(self) -> None:
        started = time.perf_counter()
        try:
            self.connection.request("POST", "/v1/embeddings", self.body, {"Content-Type": "application/json"})
            reply = self.connection.getresponse()
            reply.read()
            self.status = reply.status
        except OSError as error:  # cancelled
            self.status = f"cancelled ({type(error).__name__})"
        self.seconds, self.ended = time.perf_counter() - started, time.perf_counter()

    def cancel(self) -> None:
        if self.connection.sock is not None:
            self.connection.sock.shutdown(socket.SHUT_RDWR)


def idle(http: httpx.Client, model: str, timeout: float) -> None:
    """Wait until the engine holds no request (a cancelled embeddings request is aborted, not left running), then
    for a one-token completion: it cannot end before the step in flight at the abort (the next round's timings must
    not share the CPU with it)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        text = http.get("/metrics").text
        if not any(line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
                   and float(line.split()[-1]) > 0 for line in text.splitlines()):
            victim(http, model, 1)
            return
        time.sleep(0.2)
    raise TimeoutError(f"the engine still holds requests after {timeout:.0f} s")


def one_round(http: httpx.Client, base_url: str, model: str, args: argparse.Namespace) -> tuple[float, float]:
    """(alone, beside): the victim's median of --alone runs alone, then once beside the embeddings."""
    alone = statistics.median(victim(http, model, args.victim_tokens) for _ in range(args.alone))
    embedding = BigEmbedding(base_url, model, args.inputs, args.tokens, args.timeout)
    embedding.start()
    time.sleep(args.delay)
    beside = victim(http, model, args.victim_tokens)
    victim_ended = time.perf_counter()
    if args.cancel:
        embedding.cancel()
    embedding.join()
    embedding.connection.close()
    idle(http, model, args.timeout)
    lead = embedding.ended - victim_ended
    print(f"  embeddings: {args.inputs} inputs x {args.tokens} tokens -> {embedding.status} in "
          f"{embedding.seconds:.2f} s; victim ({args.victim_tokens} tokens, sent {args.delay:.1f} s later): alone "
          f"{alone:.2f} s, beside the embeddings {beside:.2f} s ({beside / alone:.1f}x), ending {abs(lead):.2f} s "
          f"{'before' if lead > 0 else 'after'} them", flush=True)
    return alone, beside


def run(servers: dict[str, str], args: argparse.Namespace) -> None:
    """--rounds rounds on each server (label: base URL) in turn, so that a shared machine's load falls on all."""
    clients = {label: httpx.Client(base_url=url, timeout=args.timeout) for label, url in servers.items()}
    rounds: dict[str, list[tuple[float, float]]] = {label: [] for label in servers}
    try:
        models = {label: http.get("/v1/models").json()["data"][0]["id"] for label, http in clients.items()}
        for label, http in clients.items():
            victim(http, models[label], args.victim_tokens)  # warm
        for i in range(args.rounds):
            for label, http in clients.items():
                print(f"round {i + 1}, {label}:", flush=True)
                rounds[label].append(one_round(http, servers[label], models[label], args))
    finally:
        for http in clients.values():
            http.close()
    for label, results in rounds.items():
        ratios = [beside / alone for alone, beside in results]
        print(f"{label}: median of {len(results)}: alone {statistics.median(a for a, _ in results):.2f} s, beside "
              f"{statistics.median(b for _, b in results):.2f} s, ratio {statistics.median(ratios):.1f}x "
              f"(each: {', '.join(f'{r:.1f}x' for r in ratios)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkout", type=Path, nargs="+", default=[ROOT],
                        help="the pagegate checkouts the servers run from (several: one server each, rounds in turn)")
    parser.add_argument("--base-url", default=None, help="a running server (with embeddings) instead")
    parser.add_argument("--inputs", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1500, help="tokens of each input (within the context)")
    parser.add_argument("--victim-tokens", type=int, default=16)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds between the embeddings and the victim")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--rounds", type=int, default=1, help="rounds; the ratios' median is printed")
    parser.add_argument("--alone", type=int, default=3, help="victim runs alone per round (their median counts)")
    parser.add_argument("--cancel", action="store_true",
                        help="close the embeddings request once the victim has ended (a round then lasts about "
                             "as long as the victim; the embeddings' own time is not measured)")
    parser.add_argument("--server-args", default="", help="extra flags for the launched server")
    args = parser.parse_args()
    if args.base_url is not None:
        run({args.base_url: args.base_url}, args)
        return
    from pagegate.testing.launcher import ServerProcess

    servers: dict[str, ServerProcess] = {}
    try:
        for checkout in (path.resolve() for path in args.checkout):
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
            servers[str(checkout)] = ServerProcess(SERVER_ARGS + args.server_args.split(), env=env,
                                                   cwd=checkout).start()
            print(f"server from {checkout}", flush=True)
        run({label: server.base_url for label, server in servers.items()}, args)
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
