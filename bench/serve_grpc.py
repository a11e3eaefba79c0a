"""Streaming transports side by side: REST-SSE, msgpack and gRPC against one server, same requests.

    python bench/serve_grpc.py --launch --num-prompts 256 --concurrency 64 --rounds 5
    python bench/serve_grpc.py --base-url http://127.0.0.1:8000 --grpc-target 127.0.0.1:50051

The transports, requests, statistics, CPU accounting and flags are bench/serve.py's (`--protocol grpc`
there runs one transport); this runs `--protocols` (default all three) against one launched server,
alternating them within each round so they share the machine's noise, and prints the table of docs/performance.md;
writes docs/bench-transports.png (throughput, TTFT and TPOT CDFs per transport; `--png PATH`, `--png ''` for none).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from bench import serve  # noqa: E402
from bench.plots import add_png_argument, cdf, figure, labelled_bars, save_figure, wanted  # noqa: E402

PROTOCOLS = ("openai", "msgpack", "grpc")
LABELS = {"openai": "REST-SSE", "msgpack": "msgpack", "grpc": "gRPC"}


# -- the server ------------------------------------------------------------------------------------
@contextlib.contextmanager
def serving(args: argparse.Namespace) -> Iterator[tuple[str, str, int | None]]:
    """(base URL, gRPC target, server pid when --launch started it)."""
    if not args.launch:
        yield args.base_url, args.grpc_target, None
        return

    from pagegate.testing.launcher import ServerProcess, free_port

    grpc_port = free_port()
    extra = (["--api-key", args.api_key] if args.api_key else []) + ["--disable-uvicorn-access-log"]
    server = ServerProcess(serve.server_flags(args) + extra + ["--grpc-port", str(grpc_port)])
    server.start()
    try:
        yield server.base_url, f"{server.host}:{grpc_port}", server.process.pid
    finally:
        code = server.stop()
        if code != 0:
            print(f"warning: the server exited with {code}; log at {server.log_path}", file=sys.stderr)


def run_protocol(args: argparse.Namespace, protocol: str, base_url: str, target: str,
                 requests: list[serve.BenchRequest]) -> tuple[list, float]:
    run_args = argparse.Namespace(**{**vars(args), "protocol": protocol, "grpc_target": target})
    return asyncio.run(serve.run_load(run_args, base_url, requests))


def run_rounds(args: argparse.Namespace, requests: list[serve.BenchRequest]
               ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[list[serve.RequestResult]]]]:
    """Per transport, each round's summary and its requests' results."""
    rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in args.protocols}
    results_of: dict[str, list[list[serve.RequestResult]]] = {p: [] for p in args.protocols}
    with serving(args) as (base_url, target, pid):
        for protocol in args.protocols:
            if args.warmup:
                run_protocol(args, protocol, base_url, target, requests[: args.warmup])
        for index in range(args.rounds):
            order = args.protocols[index % len(args.protocols):] + args.protocols[: index % len(args.protocols)]
            for protocol in order:
                server_cpu, client_cpu = serve.process_cpu_s(pid) if pid else None, serve.process_cpu_s()
                results, duration = run_protocol(args, protocol, base_url, target, requests)
                summary = serve.summarize(results, duration)
                summary["server_cpu_s"] = serve.cpu_delta(server_cpu, serve.process_cpu_s(pid) if pid else None)
                summary["client_cpu_s"] = serve.cpu_delta(client_cpu, serve.process_cpu_s())
                rounds[protocol].append(summary)
                results_of[protocol].append(results)
                print(f"round {index + 1} {LABELS[protocol]:9s} {summary['output_token_throughput']:8.1f} tok/s  "
                      f"TTFT p50 {summary['ttft_ms']['p50']:7.1f} ms  failed {summary['failed']}", flush=True)
    return rounds, results_of


# -- report ----------------------------------------------------------------------------------------
def median_round(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(summaries, key=lambda s: s["output_token_throughput"])[len(summaries) // 2]


def table(medians: dict[str, dict[str, Any]]) -> str:
    """A Markdown table, docs/performance.md's format."""
    head = ("| transport | output tok/s | TTFT mean / p50 / p99 (ms) | TPOT mean (ms) | ITL p50 (ms) "
            "| tokens/chunk | server CPU s | client CPU s | failed |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for protocol, s in medians.items():
        t = s["ttft_ms"]
        lines.append(f"| {LABELS[protocol]} | {s['output_token_throughput']:.0f} | {t['mean']:.0f} / {t['p50']:.0f} / "
                     f"{t['p99']:.0f} | {s['tpot_ms']['mean']:.1f} | {s['itl_ms']['p50']:.1f} | "
                     f"{s['tokens_per_chunk']:.2f} | {_fmt(s['server_cpu_s'])} | {_fmt(s['client_cpu_s'])} | "
                     f"{s['failed']} |")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def plot(medians: dict[str, dict[str, Any]], results: dict[str, list[serve.RequestResult]], title: str,
         path: Path) -> None:
    """Each transport's median round: output tokens/s, and TTFT and TPOT as CDFs over its requests."""
    fig, (rate, ttft, tpot) = figure(3, width=9, height=2.8)
    colours = {"openai": "#2a9d8f", "msgpack": "#e9c46a", "grpc": "#264653"}
    labelled_bars(rate, [LABELS[p] for p in medians], [s["output_token_throughput"] for s in medians.values()],
                  color=[colours[p] for p in medians])
    rate.set(title="output tokens / s")
    for protocol, good in ((p, [r for r in rs if r.ok]) for p, rs in results.items()):
        cdf(ttft, [r.ttft * 1000 for r in good], LABELS[protocol], color=colours[protocol])
        cdf(tpot, [serve.tpot_s(r) * 1000 for r in good if r.output_tokens > 1], LABELS[protocol],
            color=colours[protocol])
    ttft.set(title="TTFT, CDF over requests", xlabel="ms", ylabel="fraction")
    tpot.set(title="TPOT, CDF over requests", xlabel="ms / token")
    ttft.legend(loc="lower right")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    own.add_argument("--grpc-target", default="127.0.0.1:50051", help="a running server's gRPC port (no --launch)")
    add_png_argument(own, "transports")
    mine, rest = own.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        own.print_help()
        print("\nand bench/serve.py's flags (--protocol is replaced by --protocols):")
    args = serve.parse_args(rest)
    args.protocols, args.grpc_target, args.png = mine.protocols, mine.grpc_target, mine.png
    if args.offline:
        raise SystemExit("--offline is bench/serve.py's; this benchmark compares transports")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.warmup is None:
        args.warmup = min(args.concurrency, args.num_prompts)
    requests = serve.make_requests(args, serve.vocab_size_of(args.model))
    rounds, results = run_rounds(args, requests)
    medians = {protocol: median_round(summaries) for protocol, summaries in rounds.items()}
    title = (f"{args.num_prompts} streams of {args.input_len} in / {args.output_len} out, concurrency "
             f"{args.concurrency}, {args.endpoint}, median of {args.rounds} round(s)")
    print(f"\n{title}:\n")
    print(table(medians))
    spread = {LABELS[p]: [round(s["output_token_throughput"]) for s in rounds[p]] for p in rounds}
    print(f"\nper-round tok/s: {spread}")
    out = Path(args.out or ROOT / "bench" / "results" / f"transports-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config["request_rate"] = str(config["request_rate"])
    out.write_text(json.dumps({"config": config, "median": medians, "rounds": rounds,
                               "mean_tok_s": {p: statistics.fmean(s["output_token_throughput"] for s in rounds[p])
                                              for p in rounds}}, indent=1, default=str))
    print(f"wrote {out}")
    if wanted(args.png):
        plot(medians, {p: results[p][rounds[p].index(medians[p])] for p in medians}, title, args.png)
    return 0 if all(m["failed"] == 0 for m in medians.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
