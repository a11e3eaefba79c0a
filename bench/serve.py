"""Serving benchmark (like `vllm bench serve`): load a pagegate server over HTTP and report latency and throughput.

    python bench/serve.py --launch --num-prompts 256 --concurrency 64 --offline
    python bench/serve.py --base-url http://127.0.0.1:8000 --request-rate 20 --dataset shared-prefix
    python bench/serve.py --launch --protocol grpc      # pagegate.v1.Generation streams instead of SSE

Requests are token-id prompts (exact lengths) with ignore_eos, so every request produces exactly
--output-len tokens and the offline run (`--offline`: LLM.generate on the same requests, on this process's
main thread, alternating with the served rounds) is directly comparable. Server CPU is split into the gateway
process's and its engine cores'. Streams are read by a small raw-asyncio HTTP/1.1
client so the load generator costs the shared CPUs as little as possible. Writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgpack
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_SERVER_ARGS = ("--num-kv-blocks 2048 --max-num-seqs 64 --dtype float32 --device cpu --max-queue -1 "
                       "--grpc-port 0")


# -- requests --------------------------------------------------------------------------------------
@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """Random token-id prompts, or a shared prefix plus a random suffix (exercises the prefix cache)."""
    rng = random.Random(args.seed)
    low, high = 10, max(vocab_size - 1, 11)  # skip the first ids: usually special tokens

    def random_ids(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    prefix = random_ids(args.prefix_len) if args.dataset == "shared-prefix" else []
    suffix_len = max(args.input_len - len(prefix), 1)
    return [BenchRequest(prefix + random_ids(suffix_len), args.output_len) for _ in range(args.num_prompts)]


def vocab_size_of(model: str | None) -> int:
    from pagegate.engine.loading.tokenizer import Tokenizer

    folder = Path(model) if model else ROOT / "pagegate" / "engine" / "default_model"
    tokenizer = Tokenizer.from_folder(folder)
    return tokenizer.vocab_size if tokenizer is not None else 1000


# -- a minimal streaming HTTP/1.1 client -----------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival time of each chunk carrying text


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    return status, headers


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


class StreamDecoder:
    """SSE (`data: {...}\\n\\n`, `data: [DONE]`) or msgpack maps (`{"done": true}` last) -> chunk dicts."""

    def __init__(self, msgpack_frames: bool) -> None:
        self.msgpack_frames = msgpack_frames
        self.buffer = b""
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)

    def feed(self, data: bytes) -> list[dict]:
        if self.msgpack_frames:
            self.unpacker.feed(data)
            return [item for item in self.unpacker if not item.get("done")]
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        return [json.loads(e[6:]) for e in events if e.startswith(b"data: ") and e != b"data: [DONE]"]


def chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices", []):
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def send_request(url: str, body: dict, msgpack_frames: bool, api_key: str | None) -> RequestResult:
    parts = urlsplit(url)
    payload = msgpack.packb(body) if msgpack_frames else json.dumps(body).encode()
    kind = "application/msgpack" if msgpack_frames else "application/json"
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: {kind}\r\nAccept: "
            f"{kind if msgpack_frames else 'text/event-stream'}\r\n{auth}Content-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n").encode()
    result = RequestResult(start=time.perf_counter())
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(head + payload)
        status, headers = await _read_head(reader)
        decoder = StreamDecoder(msgpack_frames)
        async for piece in _body_pieces(reader, headers):
            now = time.perf_counter()
            for chunk in decoder.feed(piece):
                _account(result, chunk, now, status)
        result.ok = status == 200 and not result.error and result.output_tokens > 0
    finally:
        writer.close()
    result.latency = time.perf_counter() - result.start
    return result


def _account(result: RequestResult, chunk: dict, now: float, status: int) -> None:
    if "error" in chunk:
        result.error = f"{status}: {chunk['error'].get('message')}"
    elif chunk_text(chunk):
        if not result.chunk_times:
            result.ttft = now - result.start
        result.chunk_times.append(now)
    if chunk.get("usage"):
        result.prompt_tokens = chunk["usage"]["prompt_tokens"]
        result.output_tokens = chunk["usage"]["completion_tokens"]


# -- load patterns ---------------------------------------------------------------------------------
def request_body(args: argparse.Namespace, request: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": request.output_len, "ignore_eos": True, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":  # chat renders a template, so lengths are approximate
        body["messages"] = [{"role": "user", "content": " ".join(map(str, request.prompt_token_ids))}]
    else:
        body["prompt"] = request.prompt_token_ids
    return body


async def run_load(args: argparse.Namespace, base_url: str, requests: list[BenchRequest]) -> tuple[list, float]:
    """Fixed concurrency (default) or Poisson arrivals at --request-rate, capped by --concurrency."""
    if args.protocol == "grpc":
        return await run_grpc_load(args, args.grpc_target, requests)
    url = base_url.rstrip("/") + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    msgpack_frames = args.protocol == "msgpack"
    gate = asyncio.Semaphore(args.concurrency)
    rng = random.Random(args.seed + 1)
    progress = tqdm(total=len(requests), desc=args.protocol, leave=False)

    async def one(request: BenchRequest) -> RequestResult:
        async with gate:
            try:
                return await send_request(url, request_body(args, request), msgpack_frames, args.api_key)
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                return RequestResult(error=f"{type(exc).__name__}: {exc}")
            finally:
                progress.update()

    started = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(one(request)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    progress.close()
    return results, duration


# -- the gRPC transport (pagegate.v1.Generation, --protocol grpc) ----------------------------------
def grpc_request(args: argparse.Namespace, request: BenchRequest) -> Any:
    """The same body as the HTTP runs, as a CompletionRequest / ChatRequest (the RPC itself streams)."""
    from pagegate.gateway.proto import pagegate_pb2 as pb
    from pagegate.gateway.proto.convert import body_to_request

    body = {k: v for k, v in request_body(args, request).items() if k != "stream"}
    return body_to_request(body, pb.ChatRequest if args.endpoint == "chat" else pb.CompletionRequest)


async def send_grpc_request(stub: Any, message: Any, chat: bool, metadata: tuple) -> RequestResult:
    """One streamed call, accounted like the HTTP streams (a chunk with text is an arrival)."""
    import grpc

    result = RequestResult(start=time.perf_counter())
    call = (stub.ChatStream if chat else stub.CompleteStream)(message, metadata=metadata)
    try:
        async for chunk in call:
            now = time.perf_counter()
            if any(c.delta.content if chat else c.text for c in chunk.choices):
                if not result.chunk_times:
                    result.ttft = now - result.start
                result.chunk_times.append(now)
            if chunk.HasField("usage"):
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.output_tokens = chunk.usage.completion_tokens
        result.ok = result.output_tokens > 0
    except grpc.RpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    result.latency = time.perf_counter() - result.start
    return result


async def run_grpc_load(args: argparse.Namespace, target: str, requests: list[BenchRequest]) -> tuple[list, float]:
    """run_load over gRPC: every stream on one grpc.aio channel (one HTTP/2 connection), as gRPC
    clients are used; the channel connects before the clock starts."""
    import grpc

    from pagegate.gateway.proto import pagegate_pb2_grpc as pb_grpc

    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    messages = [grpc_request(args, r) for r in requests]
    gate = asyncio.Semaphore(args.concurrency)
    rng = random.Random(args.seed + 1)
    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = pb_grpc.GenerationStub(channel)

        progress = tqdm(total=len(messages), desc="grpc", leave=False)

        async def one(message: Any) -> RequestResult:
            async with gate:
                result = await send_grpc_request(stub, message, args.endpoint == "chat", metadata)
                progress.update()
                return result

        started = time.perf_counter()
        tasks = []
        for message in messages:
            tasks.append(asyncio.create_task(one(message)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        progress.close()
        return results, duration


# -- CPU accounting: on a shared, noisy machine CPU seconds per token compare better than wall time --
def process_cpu_s(pid: int | None = None) -> float | None:
    """User + system CPU seconds of a process, all its threads (this process when pid is None)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cores_cpu_s(pid: int | None) -> float | None:
    """CPU seconds of every process below the server: its engine cores and their tensor-parallel workers."""
    if pid is None:
        return None
    from pagegate.testing.launcher import descendants

    return sum(process_cpu_s(child) or 0.0 for child in descendants(pid))


def cpu_delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


# -- statistics ------------------------------------------------------------------------------------
def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] * scale

    return {"mean": statistics.fmean(values) * scale, "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def tpot_s(result: RequestResult) -> float:
    """Seconds per output token after the first."""
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    good = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in good)
    prompt_tokens = sum(r.prompt_tokens for r in good)
    tpot = [tpot_s(r) for r in good if r.output_tokens > 1]
    itl = [b - a for r in good for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    chunks = sum(len(r.chunk_times) for r in good)
    return {
        "completed": len(good), "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "request_throughput": len(good) / duration, "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "tokens_per_chunk": output_tokens / chunks if chunks else 0.0,
        "ttft_ms": percentiles([r.ttft for r in good]), "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl), "e2el_ms": percentiles([r.latency for r in good]),
    }


# -- the offline comparison ------------------------------------------------------------------------
class OfflineRunner:
    """LLM.generate over the same token prompts and lengths, with the server's engine flags."""

    def __init__(self, args: argparse.Namespace) -> None:
        from pagegate import SamplingParams
        from pagegate.engine.llm import LLM
        from pagegate.gateway.cli import build_parser, configs_from_args

        engine_config, _ = configs_from_args(build_parser().parse_args(server_flags(args)))
        self.llm = LLM.from_config(engine_config)
        self.params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature)

    def run(self, requests: list[BenchRequest]) -> dict[str, Any]:
        # On this (the main) thread: the engine offline at its best, the baseline the served engine core (which
        # steps on its own process's main thread) is held to.
        prompts = [r.prompt_token_ids for r in requests]
        started, cpu_before = time.perf_counter(), process_cpu_s()
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        duration, cpu = time.perf_counter() - started, cpu_delta(cpu_before, process_cpu_s())
        if len(outputs) != len(requests):
            raise RuntimeError("the offline run failed (see the traceback above)")
        output_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        return {"duration_s": duration, "output_tokens": output_tokens, "cpu_s": cpu,
                "output_token_throughput": output_tokens / duration}


# -- report ----------------------------------------------------------------------------------------
def print_report(summary: dict[str, Any], offline: dict[str, Any] | None) -> None:
    print(f"completed {summary['completed']}  failed {summary['failed']}  in {summary['duration_s']:.2f}s")
    print(f"request throughput      {summary['request_throughput']:10.2f} req/s")
    print(f"output token throughput {summary['output_token_throughput']:10.1f} tok/s "
          f"({summary['tokens_per_chunk']:.2f} tokens per chunk)")
    print(f"total token throughput  {summary['total_token_throughput']:10.1f} tok/s")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        p = summary[name]
        print(f"{name:8s} mean {p['mean']:9.2f}  p50 {p['p50']:9.2f}  p90 {p['p90']:9.2f}  p99 {p['p99']:9.2f}")
    if summary.get("server_cpu_s") is not None:
        print(f"CPU seconds             gateway {summary['server_cpu_s']:.1f} "
              f"({summary.get('gateway_cpu_ms_per_token', 0):.2f} ms per output token), engine cores "
              f"{_fmt(summary.get('core_cpu_s'))}, load generator "
              f"{summary['client_cpu_s']:.1f}" + (f", offline run {offline['cpu_s']:.1f}" if offline else ""))
    if offline:
        print(f"offline LLM.generate    {offline['output_token_throughput']:10.1f} tok/s  "
              f"-> HTTP/offline = {summary['output_token_throughput'] / offline['output_token_throughput']:.1%}")
    for error in summary["errors"]:
        print("error:", error)


def plot(path: Path, results: list[RequestResult], summary: dict[str, Any], offline: dict[str, Any] | None,
         title: str) -> None:
    """TTFT, TPOT and ITL as CDFs, and the throughput (against the offline run's when there is one)."""
    from bench.plots import cdf, figure, labelled_bars, save_figure

    good = [r for r in results if r.ok]
    fig, axes = figure(2, 2, width=8, height=5)
    cdf(axes[0][0], [r.ttft * 1000 for r in good], "TTFT")
    axes[0][0].set(title="TTFT, CDF over requests", xlabel="ms", ylabel="fraction")
    cdf(axes[0][1], [tpot_s(r) * 1000 for r in good if r.output_tokens > 1], "TPOT")
    axes[0][1].set(title="TPOT, CDF over requests", xlabel="ms / token")
    itl = [(b - a) * 1000 for r in good for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    cdf(axes[1][0], itl, "ITL")
    axes[1][0].set(title=f"ITL, CDF over chunks ({summary['tokens_per_chunk']:.1f} tokens a chunk)", xlabel="ms",
                   ylabel="fraction")
    names, values = ["HTTP stream"], [summary["output_token_throughput"]]
    if offline:
        names.append("offline LLM.generate")
        values.append(offline["output_token_throughput"])
    labelled_bars(axes[1][1], names, values, color=["#2a9d8f", "#8d99ae"][: len(values)])
    axes[1][1].set(title="output tokens / s")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server (ignored with --launch)")
    p.add_argument("--launch", action="store_true", help="start `pagegate serve SERVER_ARGS` for the run")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="engine/server flags for --launch and --offline")
    p.add_argument("--api-key", default=None)
    p.add_argument("--protocol", choices=["openai", "msgpack", "grpc"], default="openai",
                   help="openai: JSON + SSE; msgpack: msgpack bodies and frames; grpc: pagegate.v1.Generation")
    p.add_argument("--grpc-target", default="127.0.0.1:50051", help="a running server's gRPC host:port "
                   "(--protocol grpc without --launch)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=48, help="shared-prefix: tokens every prompt starts with")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64, help="streams in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=None, help="requests run before measuring (default: --concurrency)")
    p.add_argument("--offline", action="store_true", help="also run LLM.generate on the same requests")
    p.add_argument("--rounds", type=int, default=1, help="HTTP/offline pairs, alternated; the median is reported")
    p.add_argument("--model", default=None, help="model folder (tokenizer for prompt ids; passed to the server "
                   "and LLM); default: the embedded model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/serve-<time>.json; PNG beside it)")
    p.add_argument("--png", type=Path, default=None, help="the PNG's path (default: beside the JSON; '' for none)")
    return p.parse_args(argv)


def server_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags both the launched server and the offline LLM get."""
    return args.server_args.split() + (["--model", args.model] if args.model else [])


@contextlib.contextmanager
def serving(args: argparse.Namespace) -> Iterator[tuple[str, int | None]]:
    """The base URL to load (and the server's pid when this run started it with --launch)."""
    if not args.launch:
        yield args.base_url, None
        return
    from pagegate.testing.launcher import ServerProcess, free_port

    extra = ["--api-key", args.api_key] if args.api_key else []
    if args.protocol == "grpc":  # `pagegate serve --grpc-port`: the gRPC door on a free port
        args.grpc_target = f"127.0.0.1:{free_port()}"
        extra += ["--grpc-port", args.grpc_target.rsplit(":", 1)[1]]
    server = ServerProcess(server_flags(args) + extra + ["--disable-uvicorn-access-log"]).start()
    try:
        yield server.base_url, server.process.pid
    finally:
        code = server.stop()
        if code != 0:
            print(f"warning: the server exited with {code}; log at {server.log_path}", file=sys.stderr)


def run_rounds(args: argparse.Namespace, requests: list[BenchRequest]) -> list[dict[str, Any]]:
    """Alternate HTTP and offline runs (--rounds times) so both see the same machine noise."""
    rounds = []
    offline = OfflineRunner(args) if args.offline else None
    with serving(args) as (base_url, server_pid):
        if args.warmup:
            asyncio.run(run_load(args, base_url, requests[: args.warmup]))
            if offline:
                offline.run(requests[: args.warmup])
        for index in range(args.rounds):
            server_cpu, client_cpu = process_cpu_s(server_pid) if server_pid else None, process_cpu_s()
            core_cpu = cores_cpu_s(server_pid)
            results, duration = asyncio.run(run_load(args, base_url, requests))
            summary = summarize(results, duration)
            summary["server_cpu_s"] = cpu_delta(server_cpu, process_cpu_s(server_pid) if server_pid else None)
            summary["core_cpu_s"] = cpu_delta(core_cpu, cores_cpu_s(server_pid))
            if summary["server_cpu_s"] is not None and summary["output_tokens"]:
                summary["gateway_cpu_ms_per_token"] = 1000 * summary["server_cpu_s"] / summary["output_tokens"]
            summary["client_cpu_s"] = cpu_delta(client_cpu, process_cpu_s())
            if offline:
                summary["offline"] = offline.run(requests)
                ratio = summary["output_token_throughput"] / summary["offline"]["output_token_throughput"]
                summary["http_over_offline"] = ratio
                print(f"round {index + 1}: HTTP {summary['output_token_throughput']:.1f} tok/s, offline "
                      f"{summary['offline']['output_token_throughput']:.1f} tok/s, ratio {ratio:.1%}; "
                      f"CPU s: server {_fmt(summary['server_cpu_s'])}, client {_fmt(summary['client_cpu_s'])}, "
                      f"offline {_fmt(summary['offline']['cpu_s'])}", flush=True)
            rounds.append({"summary": summary, "results": results})
    return rounds


def _fmt(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.warmup is None:
        args.warmup = min(args.concurrency, args.num_prompts)
    requests = make_requests(args, vocab_size_of(args.model))
    rounds = run_rounds(args, requests)
    key = "http_over_offline" if args.offline else "output_token_throughput"
    median = sorted(rounds, key=lambda r: r["summary"][key])[len(rounds) // 2]  # the median round is reported
    summary, results = median["summary"], median["results"]
    print_report(summary, summary.get("offline"))
    out = Path(args.out or ROOT / "bench" / "results" / f"serve-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config["request_rate"] = str(config["request_rate"])
    report = {"config": config, "summary": summary, "rounds": [r["summary"] for r in rounds],
              "requests": [asdict(r) | {"chunk_times": None} for r in results]}
    out.write_text(json.dumps(report, indent=1, default=str))
    title = (f"{args.protocol} {args.endpoint}, {args.num_prompts} requests, concurrency {args.concurrency}, "
             f"{args.input_len} in / {args.output_len} out")
    print(f"wrote {out}")
    png = out.with_suffix(".png") if args.png is None else args.png
    if str(png) not in ("", "."):
        plot(png, results, summary, summary.get("offline"), title)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
