"""Single-stream decode speed against context depth, per KV page format, beside llama-bench at the same depths.

    python -m bench.kv_speed [--depths 128,512,1024,2048,3584,8064] [--formats float32,float16,int8,fp8_e4m3,int4]
                             [--rounds 3] [--tokens 64] [--threads 2] [--no-peers]

pagegate runs the engine on the main thread (as the engine core does) over SmolLM2-135M Q4_1, one engine per
format, each in its own process; decode tok/s is `tokens` tokens timed after a `depth`-token prompt's first token
(llama-bench's tg with -d). The prompt is the same in every round, so after the first round its prefill is a prefix
hit. llama-bench runs the same file at the same depths: F16 pages without flash attention (its best here), and q8_0
and q4_0 pages (which need flash attention). Formats and peers alternate within each round; medians of the
rounds are reported. Writes bench/results/kv_speed.json and docs/bench-kv-speed.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.peers import llamacpp
from bench.plots import add_png_argument, figure, save_figure, wanted
from pagegate import LLM, SamplingParams

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
RESULTS = Path("bench/results")
PEERS = {"llama-bench F16 -fa 0": ("f16", "0"), "llama-bench q8_0 -fa 1": ("q8_0", "1"),
         "llama-bench q4_0 -fa 1": ("q4_0", "1")}


def decode_tok_s(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Tokens per second of one stream after its first token, `prompt` as context."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    request = engine.intake.make_request(f"r{time.monotonic_ns()}", prompt, params)
    engine.add(request)
    while request.first_token_time is None:
        engine.step()  # the prefill (or its prefix hit) and the first token
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return tokens / (time.perf_counter() - start)


def llama_bench(depth: int, tokens: int, threads: int, cache_type: str, flash: str) -> float:
    command = [str(llamacpp.binary("llama-bench")), "-m", str(SMOLLM2), "-t", str(threads), "-p", "0",
               "-n", str(tokens), "-d", str(depth), "-r", "1", "-ctk", cache_type, "-ctv", cache_type, "-fa", flash,
               "-o", "json", *(["--repack", "0"] if llamacpp.repack_crashes() else [])]
    rows = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    return float(rows[0]["avg_ts"])


class FormatWorker:
    """One engine with one page format in its own process (as a served engine core has), measuring on request:
    engines sharing a process measured 0.8-4.5 tok/s here, a fraction of what each does alone."""

    def __init__(self, kv_cache_dtype: str, max_model_len: int) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "bench.kv_speed", "--worker", kv_cache_dtype,
                                         "--max-model-len", str(max_model_len)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def decode_tok_s(self, depth: int, tokens: int) -> float:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{depth} {tokens}\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def worker(kv_cache_dtype: str, max_model_len: int) -> None:
    """Answer each "depth tokens" line on stdin with the decode tok/s after a `depth`-token prompt."""
    llm = LLM(str(SMOLLM2), kv_cache_dtype=kv_cache_dtype, kv_cache_memory="2GiB", max_model_len=max_model_len)
    vocab = llm.engine.model_config.vocab_size
    for line in sys.stdin:
        depth, tokens = map(int, line.split())
        prompt = np.random.default_rng(depth).integers(10, vocab, depth).tolist()
        print(decode_tok_s(llm, prompt, tokens), flush=True)


def measure(args: argparse.Namespace) -> dict[str, dict[int, list[float]]]:
    max_model_len = max(args.depths) + args.tokens + 16
    workers = {name: FormatWorker(name, max_model_len) for name in args.formats}
    runs: dict[str, dict[int, list[float]]] = {name: {d: [] for d in args.depths}
                                               for name in [*args.formats, *([] if args.no_peers else PEERS)]}
    try:
        for round_ in range(args.rounds):
            for depth in args.depths:
                for name, engine in workers.items():
                    runs[name][depth].append(engine.decode_tok_s(depth, args.tokens))
                for name, (cache_type, flash) in ({} if args.no_peers else PEERS).items():
                    runs[name][depth].append(llama_bench(depth, args.tokens, args.threads, cache_type, flash))
                print(f"round {round_ + 1} depth {depth}: " + ", ".join(
                    f"{name} {values[depth][-1]:.1f}" for name, values in runs.items()), flush=True)
    finally:
        for engine in workers.values():
            engine.close()
    return runs


def table(medians: dict[str, dict[int, float]], depths: list[int]) -> str:
    lines = ["| decode tok/s at depth | " + " | ".join(str(d) for d in depths) + " |",
             "|---" * (len(depths) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{row[d]:.1f}" for d in depths) + " |" for name, row in medians.items()]
    best_peer = {d: max((row[d] for name, row in medians.items() if name in PEERS), default=0.0) for d in depths}
    for name in (n for n in medians if n not in PEERS):
        if "float32" in medians and name != "float32":
            lines.append(f"| {name} / float32 | " + " | ".join(f"{medians[name][d] / medians['float32'][d]:.2f}x"
                                                             for d in depths) + " |")
        if all(best_peer.values()):
            lines.append(f"| {name} / best llama-bench | " + " | ".join(
                f"{medians[name][d] / best_peer[d]:.2f}x" for d in depths) + " |")
    return "\n".join(lines)


def plot(medians: dict[str, dict[int, float]], path: Path) -> None:
    fig, axes = figure()
    for name, row in medians.items():
        depths = sorted(row)
        axes.plot(depths, [row[d] for d in depths], marker="o", linestyle="--" if name in PEERS else "-", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("context depth (tokens)")
    axes.set_ylabel("single-stream decode tok/s")
    axes.set_title("SmolLM2-135M Q4_1, 2 threads: decode speed by KV page format")
    axes.grid(alpha=0.3)
    axes.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 1024, 2048,
                                                                                           3584, 8064])
    parser.add_argument("--formats", type=lambda s: s.split(","), default=["float32", "float16", "int8", "fp8_e4m3", "int4"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peers", action="store_true", help="pagegate's formats only (no llama.cpp build)")
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_speed.json")
    add_png_argument(parser, "kv-speed")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.max_model_len)
    if not args.no_peers:
        llamacpp.build()
    runs = measure(args)
    medians = {name: {d: statistics.median(v) for d, v in row.items()} for name, row in runs.items()}
    print(table(medians, args.depths))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
                                    "runs": runs, "medians": medians}, indent=1))
    if wanted(args.png):
        plot(medians, args.png)


if __name__ == "__main__":
    main()
