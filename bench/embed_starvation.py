"""How long a short completion waits behind one big embeddings request (issue 41, item 5).

    python bench/embed_starvation.py                          # the embedded model on CPU, this checkout
    python bench/embed_starvation.py --inputs 48 --tokens 2000 --server-args "--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    git worktree add /tmp/before <commit> && python bench/embed_starvation.py --checkout /tmp/before   # "before"

It launches a server (`--pooling last`, so a checkout from before embeddings were served by default runs it too),
times the victim (a 16-token greedy completion) alone, then sends one embeddings request of `--inputs` x
`--tokens` token ids, and `--delay` seconds later the victim again; it prints the victim's latency alone and behind
the embeddings, whether it ended before or after them, and the embeddings request's own time. Under plain first-come-first-served scheduling the victim
waited for every input; with embeddings held to a share of each step it waits about its own decode steps, each
carrying one embedding chunk. Bounded: one server, three requests, `--timeout` seconds at most each.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
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


def big_embedding(http: httpx.Client, model: str, inputs: int, tokens: int, outcome: dict) -> None:
    ids = [[(7 * i + p) % 400 + 10 for p in range(tokens)] for i in range(inputs)]
    started = time.perf_counter()
    reply = http.post("/v1/embeddings", json={"model": model, "input": ids})
    outcome["status"], outcome["seconds"], outcome["ended"] = reply.status_code, time.perf_counter() - started, \
        time.perf_counter()


def run(base_url: str, args: argparse.Namespace) -> None:
    with httpx.Client(base_url=base_url, timeout=args.timeout) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        victim(http, model, args.victim_tokens)  # warm
        alone = victim(http, model, args.victim_tokens)
        outcome: dict = {}
        sender = threading.Thread(target=big_embedding, args=(http, model, args.inputs, args.tokens, outcome))
        sender.start()
        time.sleep(args.delay)
        beside = victim(http, model, args.victim_tokens)
        victim_ended = time.perf_counter()
        sender.join()
    lead = outcome["ended"] - victim_ended
    print(f"embeddings: {args.inputs} inputs x {args.tokens} tokens -> {outcome['status']} in {outcome['seconds']:.2f} s")
    print(f"victim ({args.victim_tokens} tokens, sent {args.delay:.1f} s later): alone {alone:.2f} s, "
          f"behind the embeddings {beside:.2f} s, ending {abs(lead):.2f} s {'before' if lead > 0 else 'after'} them")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the pagegate checkout the server runs from")
    parser.add_argument("--base-url", default=None, help="a running server (with embeddings) instead")
    parser.add_argument("--inputs", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1500, help="tokens of each input (within the context)")
    parser.add_argument("--victim-tokens", type=int, default=16)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds between the embeddings and the victim")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--server-args", default="", help="extra flags for the launched server")
    args = parser.parse_args()
    if args.base_url is not None:
        run(args.base_url, args)
        return
    from pagegate.testing.launcher import ServerProcess

    checkout = args.checkout.resolve()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    server = ServerProcess(SERVER_ARGS + args.server_args.split(), env=env, cwd=checkout).start()
    print(f"server from {checkout}")
    try:
        run(server.base_url, args)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
