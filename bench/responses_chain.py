"""How long /health takes while a stored conversation grows (issue 41, item 3).

    python -m bench.responses_chain                       # launches the embedded model on CPU, SQLite store
    python -m bench.responses_chain --turns 24 --items 16000 --no-store-path
    python -m bench.responses_chain --base-url http://127.0.0.1:8000

One client runs a `previous_response_id` chain: every turn hands back `--items` reasoning items (as agents do:
they are not rendered, so no context check bounds them) and one short user message, and asks for 2 tokens.
Meanwhile /health is probed every 10 ms over a kept-alive connection. Per turn it prints the turn's seconds and
the probes' median and worst latency (probes are counted for the turn during which they started; after the last
turn, probing goes on for a second, for work the server does once a turn has answered). A store that repeats every
earlier turn's items in each record, and encodes and writes them on the event loop, stalls /health more with each
turn; one that stores each turn once, off the loop, does not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERVER_ARGS = ["--dtype", "float32", "--device", "cpu", "--grpc-port", "0", "--disable-uvicorn-access-log",
               "--responses-store-max-bytes", "1GiB"]  # the whole chain stays stored, before and after
PROBE_EVERY_S = 0.01
TAIL_S = 1.0


def turn_body(model: str, turn: int, items: int, previous: str | None) -> dict:
    reasoning = [{"type": "reasoning", "id": f"rs_{turn}_{i}",
                  "summary": [{"type": "summary_text", "text": f"step {i} of turn {turn}"}]} for i in range(items)]
    body = {"model": model, "input": [*reasoning, {"role": "user", "content": f"Turn {turn}: say hi."}],
            "max_output_tokens": 2, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    return body


def gateway_rss_mb(pid: int | None) -> float:
    """The launched gateway process's resident memory (MB); 0 when unknown."""
    if pid is None:
        return 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_chain(base_url: str, model: str, turns: int, items: int,
              pid: int | None = None) -> list[dict[str, float | int]]:
    """The chain's turns, each with its seconds, the gateway's memory after it, and the /health probes that
    started during it."""
    bounds: list[tuple[float, float, int, float]] = []  # (start, end, status, gateway MB) per turn
    done = threading.Event()

    def client() -> None:
        previous = None
        with httpx.Client(base_url=base_url, timeout=600) as http:
            for turn in range(turns):
                body = turn_body(model, turn, items, previous)
                started = time.perf_counter()
                reply = http.post("/v1/responses", json=body)
                bounds.append((started, time.perf_counter(), reply.status_code, gateway_rss_mb(pid)))
                if reply.status_code != 200:
                    print(f"turn {turn}: {reply.status_code} {reply.text[:200]}", flush=True)
                    break
                previous = reply.json()["id"]
        done.set()

    probes: list[tuple[float, float]] = []  # (start, seconds)
    with httpx.Client(base_url=base_url, timeout=600) as http:
        http.get("/health")
        sender = threading.Thread(target=client)
        sender.start()
        stop_at = None
        while stop_at is None or time.perf_counter() < stop_at:
            started = time.perf_counter()
            http.get("/health")
            probes.append((started, time.perf_counter() - started))
            if stop_at is None and done.is_set():
                stop_at = time.perf_counter() + TAIL_S
            time.sleep(PROBE_EVERY_S)
        sender.join()
    return [_row(turn, start, (bounds[turn + 1][0] if turn + 1 < len(bounds) else float("inf")), end - start,
                 status, rss, probes) for turn, (start, end, status, rss) in enumerate(bounds)]


def _row(turn: int, start: float, until: float, seconds: float, status: int, rss: float,
         probes: list[tuple[float, float]]) -> dict[str, float | int]:
    mine = [took for began, took in probes if start <= began < until] or [0.0]
    return {"turn": turn + 1, "status": status, "turn_s": seconds, "gateway_mb": rss, "probes": len(mine),
            "health_p50_ms": statistics.median(mine) * 1000, "health_max_ms": max(mine) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (default: launch one)")
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--items", type=int, default=10_000, help="reasoning items handed back per turn")
    parser.add_argument("--no-store-path", action="store_true",
                        help="keep the launched server's store in memory (default: --responses-store-path, SQLite)")
    parser.add_argument("--server-args", default="", help="extra flags for the launched server")
    args = parser.parse_args()
    server = None
    with tempfile.TemporaryDirectory() as folder:
        if args.base_url is None:
            from pagegate.testing.launcher import ServerProcess

            store = [] if args.no_store_path else ["--responses-store-path", str(Path(folder) / "responses.sqlite")]
            server = ServerProcess(SERVER_ARGS + store + args.server_args.split()).start()
        base_url = args.base_url or server.base_url
        try:
            model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
            pid = server.process.pid if server is not None and server.process is not None else None
            rows = run_chain(base_url, model, args.turns, args.items, pid)
            print(f"{args.items} reasoning items a turn; store: "
                  f"{'memory' if args.no_store_path or args.base_url else 'SQLite'}")
            print(f"{'turn':>4} {'status':>6} {'turn s':>8} {'gateway MB':>11} {'probes':>7} {'/health p50 ms':>15} "
                  f"{'/health max ms':>15}")
            for row in rows:
                print(f"{row['turn']:>4} {row['status']:>6} {row['turn_s']:>8.2f} {row['gateway_mb']:>11.0f} {row['probes']:>7} "
                      f"{row['health_p50_ms']:>15.1f} {row['health_max_ms']:>15.1f}")
            worst = max(float(row["health_max_ms"]) for row in rows)
            print(f"worst /health over the chain: {worst:.1f} ms")
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
