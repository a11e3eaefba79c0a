"""What a server costs in memory: `pagegate serve` against `llama-server` on the same GGUF file (issue 57).

    python -m bench.footprint [--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--streams 1,16,64]

For each stream count, each server in turn (each with its defaults; llama-server with -np = streams and the same
context per slot as pagegate's requests need) serves `streams` OpenAI SDK streams of 128 prompt + 128 output
tokens, twice. RSS (VmRSS of every process of the server, summed from /proc) is sampled every 50 ms from the
moment it is healthy; the peak is the larger of the samples' and the processes' own peaks (VmHWM, start-up
included), and idle is the RSS a second after the first batch of streams. Then each process
of the pagegate server is broken down by its /proc smaps: shared libraries (torch's apart), the model file's
mapping, and anonymous memory (the Python heap, weights copied or repacked, KV pages). Writes docs/footprint.md
and docs/bench-footprint.png (RSS over time, both servers, one panel per stream count).

    python -m bench.footprint --soak 2000

instead serves 2,000 mixed requests (completions, chats, streams cut short, structured output, embeddings on a
--pooling server), 8 at a time, and prints the server's RSS after the first 200 and after all of them (issue 57's
"nothing grows").

    python -m bench.footprint --cycles 30

serves the model and the embedded one from one server (--models-max 2) and prints its RSS after the first and
after the last of 30 sleep/wake cycles of one and 30 unload/load cycles of the other, a request after each.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench import plots
from bench.peers import llamacpp
from bench.peers.served import PROMPT, SMOLLM2, gguf_vocab_size, load, rss_bytes, start_llama_server
from pagegate.testing.launcher import ServerProcess, descendants, free_port

MIB = 2**20
SAMPLE_S = 0.05
# A two-model server's checkpoints are taken this long after a cycle's request: a load takes the spare core, whose
# replacement starts after the cores idle a second (spare_core.SPARE_IDLE_S) and imports for ~2 s; sampled at once,
# a checkpoint would count the spare or not by chance (~150 MiB)
SETTLE_S = 5.0


class Sampler(threading.Thread):
    """RSS of a server's processes (its root and everything below it) every SAMPLE_S seconds, as (t, bytes)."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.samples, self.started = root, list[tuple[float, int]](), time.monotonic()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SAMPLE_S):
            self.samples.append((time.monotonic() - self.started, rss_bytes([self.root, *descendants(self.root)])))

    def now(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def stop(self) -> list[tuple[float, int]]:
        self.done.set()
        self.join()
        return self.samples


def smaps_breakdown(pid: int, model: Path) -> Counter[str]:
    """Resident bytes of one process by what they are."""
    kinds: Counter[str] = Counter()
    kind = "anonymous"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            fields = line.split(None, 5)
            name = fields[5] if len(fields) > 5 else ""
            kind = ("model file" if name.endswith(model.name) else "torch libraries" if "/torch/" in name
                    else "other libraries" if name.startswith("/") else "anonymous")
        elif line.startswith("Rss:"):
            kinds[kind] += int(line.split()[1]) * 1024
    return kinds


def process_name(pid: int) -> str:
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return "engine core" if b"pagegate.engine.serving.core_process" in command else "gateway"


def serve_and_sample(start, streams: int, prompts: list[list[int]]) -> dict:
    """Start a server (start() -> (stop, base_url, root pid)), run two batches of streams, sample its RSS."""
    stop, base_url, root = start()
    sampler = Sampler(root)
    sampler.start()
    try:
        asyncio.run(load(base_url, prompts[:streams]))
        time.sleep(1.0)
        idle = sampler.now()
        asyncio.run(load(base_url, prompts[streams:]))
        pids = [root, *descendants(root)]
        breakdown = {pid: (process_name(pid), smaps_breakdown(pid, start.model)) for pid in pids}
        peak = rss_bytes(pids, "VmHWM")  # start-up included, which the samples begin after
    finally:
        samples = sampler.stop()
        stop()
    return {"peak": max(peak, *(b for _, b in samples)), "idle": idle, "samples": samples, "breakdown": breakdown}


class PagegateServer:
    def __init__(self, model: Path, extra: list[str]) -> None:
        self.model, self.extra = model, extra

    def __call__(self):
        # its defaults (the gRPC server on, on a free port rather than its default 50051)
        server = ServerProcess(["--model", str(self.model), "--grpc-port", str(free_port()), *self.extra]).start()
        return server.stop, server.base_url + "/v1", server.process.pid


class LlamaServer:
    def __init__(self, model: Path, streams: int, threads: int, no_repack: bool) -> None:
        self.model, self.streams, self.threads, self.no_repack = model, streams, threads, no_repack

    def __call__(self):
        process, served = start_llama_server(self.model, self.threads, self.streams, self.no_repack)

        def stop() -> None:
            process.terminate()
            process.wait(30)

        return stop, served.base_url, process.pid


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


KINDS = ("completion", "chat", "cut", "json", "embed")


def mixed_request(client, model: str, index: int, kind: str) -> None:
    """One request of the soak's mix."""
    prompt = f"Request {index}: tell me about the number {index * 7919 % 1000}."
    if kind == "completion":
        client.completions.create(model=model, prompt=prompt, max_tokens=16)
    elif kind == "chat":
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=16)
    elif kind == "cut":  # a stream the client stops reading after a few chunks
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=64, stream=True)
        for seen, _ in enumerate(stream):
            if seen == 3:
                stream.close()
                break
    elif kind == "json":
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A person as JSON."}],
                                       max_tokens=32, response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": SCHEMA, "strict": True}})
    else:
        client.embeddings.create(model=model, input=[prompt, prompt[::-1]])


def soak(model: Path, requests: int, extra: list[str], kinds: tuple[str, ...] = KINDS) -> tuple[int, int]:
    """RSS of the server after the first tenth of `requests` mixed requests and after all of them."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    server = ServerProcess(["--model", str(model), "--pooling", "last", "--disable-uvicorn-access-log",
                            "--disable-dashboard", "--grpc-port", str(free_port()), *extra]).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        pids = [server.process.pid, *descendants(server.process.pid)]
        figures = []
        with ThreadPoolExecutor(8) as pool:
            for first, last in ((0, requests // 10), (requests // 10, requests)):
                list(pool.map(lambda i: mixed_request(client, name, i, kinds[i % len(kinds)]), range(first, last)))
                figures.append(rss_bytes(pids))
                print(f"after {last} requests: RSS {figures[-1] / MIB:.0f} MiB", flush=True)
        return figures[0], figures[1]
    finally:
        server.stop()


def cycles(model: Path, count: int, extra: list[str]) -> None:
    """RSS of a two-model server across `count` sleep/wake cycles of `model` and unload/load cycles of the other."""
    import httpx
    import openai

    from pagegate.engine.loading.loader import DEFAULT_MODEL

    server = ServerProcess(["--model", str(model), "--model", str(DEFAULT_MODEL), "--served-model-name", "main",
                            "other", "--models-max", "2", "--disable-uvicorn-access-log", "--disable-dashboard",
                            "--grpc-port", str(free_port()), *extra]).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        http = httpx.Client(base_url=server.base_url, timeout=600)
        root = server.process.pid
        for name, step in (("sleep/wake", lambda: http.post("/sleep", params={"model": "main"})),
                           ("unload/load", lambda: http.post("/models/unload", json={"model": "other"}))):
            model_name = "main" if name == "sleep/wake" else "other"
            figures = []
            for cycle in range(count):
                client.completions.create(model=model_name, prompt=[5, 17, 42, 9, 33], max_tokens=8)
                if cycle in (0, count - 1):
                    time.sleep(SETTLE_S)
                    figures.append(rss_bytes([root, *descendants(root)]))
                step().raise_for_status()
            print(f"{count} {name} cycles: RSS {figures[0] / MIB:.0f} -> {figures[1] / MIB:.0f} MiB "
                  f"({figures[1] / figures[0] - 1:+.1%})", flush=True)
    finally:
        server.stop()


def table(results: dict[int, dict[str, dict]], model: Path) -> str:
    lines = [f"`pagegate serve` / `llama-server` on {model.name}, each with its defaults (llama-server: -np streams, "
             f"{PROMPT} + 192 tokens a slot), OpenAI SDK streams of 128 + 128 tokens, RSS of all processes summed.",
             "", "| streams | peak RSS MiB | ratio | idle after the first streams MiB | ratio |", "|---|---|---|---|---|"]
    for streams, sides in results.items():
        ours, theirs = sides["pagegate"], sides["llama-server"]
        lines.append(f"| {streams} | {ours['peak'] / MIB:.0f} / {theirs['peak'] / MIB:.0f} | "
                     f"{ours['peak'] / theirs['peak']:.2f}× | {ours['idle'] / MIB:.0f} / {theirs['idle'] / MIB:.0f} | "
                     f"{ours['idle'] / theirs['idle']:.2f}× |")
    last = results[max(results)]["pagegate"]["breakdown"]
    kinds = sorted({kind for _, parts in last.values() for kind in parts})
    lines += ["", f"pagegate's processes at the end of the {max(results)}-stream run, resident MiB by kind (smaps):",
              "", "| process | " + " | ".join(kinds) + " | total |", "|---" * (len(kinds) + 2) + "|"]
    for name, parts in last.values():
        lines.append(f"| {name} | " + " | ".join(f"{parts[kind] / MIB:.0f}" for kind in kinds)
                     + f" | {sum(parts.values()) / MIB:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[int, dict[str, dict]], path: Path) -> None:
    fig, axes = plots.figure(ncols=len(results), width=3.0 * len(results), height=2.6, squeeze=False)
    for ax, (streams, sides) in zip(axes[0], results.items(), strict=True):
        for side, result in sides.items():
            t, b = zip(*result["samples"], strict=True)
            ax.plot(t, np.array(b) / MIB, label=side, color=plots.COLOURS.get(side, "#e76f51"))
        ax.set_title(f"{streams} stream(s)")
        ax.set_xlabel("seconds from start")
    axes[0][0].set_ylabel("RSS MiB (all processes)")
    axes[0][0].legend()
    plots.save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="pagegate's (a model whose whole context does not fit the default KV budget needs one)")
    parser.add_argument("--kv-cache-memory", default=None, help="pagegate's KV budget (default: its own)")
    parser.add_argument("--soak", type=int, default=0, help="serve this many mixed requests instead (see above)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="the soak's mix, in turn")
    parser.add_argument("--cycles", type=int, default=0, help="sleep/wake and unload/load cycles instead (see above)")
    parser.add_argument("--out", type=Path, default=Path("docs/footprint.md"))
    plots.add_png_argument(parser, "footprint")
    args = parser.parse_args()
    extra = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    extra += ["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else []
    if args.cycles:
        cycles(args.model, args.cycles, extra)
        return
    if args.soak:
        after_tenth, after_all = soak(args.model, args.soak, extra, tuple(args.kinds.split(",")))
        print(f"{args.soak} mixed requests: RSS {after_tenth / MIB:.0f} -> {after_all / MIB:.0f} MiB "
              f"({after_all / after_tenth - 1:+.1%})")
        return
    llamacpp.build()
    no_repack = llamacpp.repack_crashes()
    rng = np.random.default_rng(0)
    vocab = gguf_vocab_size(args.model)
    results: dict[int, dict[str, dict]] = {}
    for streams in (int(s) for s in args.streams.split(",")):
        prompts = [rng.integers(10, vocab, PROMPT).tolist() for _ in range(2 * streams)]
        results[streams] = {
            "pagegate": serve_and_sample(PagegateServer(args.model, extra), streams, prompts),
            "llama-server": serve_and_sample(LlamaServer(args.model, streams, args.threads, no_repack), streams,
                                             prompts)}
        ours, theirs = results[streams]["pagegate"], results[streams]["llama-server"]
        print(f"{streams} streams: peak {ours['peak'] / MIB:.0f} / {theirs['peak'] / MIB:.0f} MiB, idle "
              f"{ours['idle'] / MIB:.0f} / {theirs['idle'] / MIB:.0f} MiB", flush=True)
    text = table(results, args.model)
    print(text)
    flags = f" --max-model-len {args.max_model_len}" if args.max_model_len else ""
    args.out.write_text(f"Made by `python -m bench.footprint --model {args.model} --streams {args.streams}{flags}`.\n\n"
                        + text)
    if plots.wanted(args.png):
        plot(results, args.png)


if __name__ == "__main__":
    main()
