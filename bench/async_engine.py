"""Single-stream decode speed of the public AsyncEngine (an engine-core process, driven from this process's event
loop) against the offline `LLM.generate` on this process's main thread: one model, one EngineConfig, the same
requests.

    python -m bench.async_engine                                  # SmolLM2-135M Q4_1, 5 rounds of 4 x 256 tokens
    python -m bench.async_engine --rounds 1 --requests 1 --output-len 16    # a check that it runs

Each request is a token-id prompt with ignore_eos, run alone (one stream), so it decodes exactly --output-len
tokens. Decode tok/s: the tokens after the first over the time from the first to the last, where the caller gets
them (AsyncEngine: when its outputs arrive here; offline: the engine's own times, on this thread). End-to-end
tok/s (from the call to the last token, prefill included) is reported beside it. Rounds alternate which side
goes first, so both see the same machine noise; the medians over every request of every round and their ratio
(goal: AsyncEngine >= 0.95x offline) are printed and written as JSON to bench/results/async_engine-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagegate.config import CacheConfig, EngineConfig
from pagegate.engine.llm import LLM
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.serving.async_engine import AsyncEngine

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Timed:
    """One request's run: its output tokens, the seconds from the call to its last token and from its first
    token to its last."""

    tokens: int
    total_s: float
    decode_s: float

    @property
    def decode_tok_s(self) -> float:
        return (self.tokens - 1) / self.decode_s

    @property
    def end_to_end_tok_s(self) -> float:
        return self.tokens / self.total_s


def make_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(count)]  # past the special ids


def run_offline(llm: LLM, prompt: list[int], params: SamplingParams) -> Timed:
    started = time.monotonic()
    [output] = llm.generate([prompt], params, use_tqdm=False)
    ended = time.monotonic()
    timings = output.metrics  # the engine's monotonic times of its first and last token, on this thread
    return Timed(len(output.outputs[0].token_ids), ended - started,
                 timings["last_token_time"] - timings["first_token_time"])


async def run_async(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str) -> Timed:
    started = time.monotonic()
    first = last = started
    tokens = 0
    async for output in engine.generate(prompt, params, request_id):
        last = time.monotonic()
        if tokens == 0:
            first = last
        tokens = len(output.outputs[0].token_ids)
    return Timed(tokens, last - started, last - first)


def median_of(runs: list[Timed], name: str) -> float:
    return statistics.median(getattr(run, name) for run in runs)


async def run_rounds(args: argparse.Namespace, config: EngineConfig) -> dict[str, list[list[Timed]]]:
    """Both engines loaded side by side; each round runs every request on one, then on the other."""
    llm = LLM.from_config(config)
    vocab_size = llm.engine.model_config.vocab_size
    prompts = make_prompts(args.requests, args.input_len, vocab_size, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rounds: dict[str, list[list[Timed]]] = {"offline": [], "async_engine": []}
    async with await AsyncEngine.start(config) as engine:
        run_offline(llm, prompts[0], warm)
        await run_async(engine, prompts[0], warm, "warm")
        for index in range(args.rounds):
            for side in ("offline", "async_engine") if index % 2 == 0 else ("async_engine", "offline"):
                if side == "offline":
                    runs = [run_offline(llm, prompt, params) for prompt in prompts]
                else:
                    runs = [await run_async(engine, prompt, params, f"r{index}-{i}") for i, prompt in enumerate(prompts)]
                rounds[side].append(runs)
            offline, served = rounds["offline"][-1], rounds["async_engine"][-1]
            print(f"round {index + 1}: decode tok/s offline {median_of(offline, 'decode_tok_s'):.1f}, AsyncEngine "
                  f"{median_of(served, 'decode_tok_s'):.1f}", flush=True)
    return rounds


def summarize(rounds: dict[str, list[list[Timed]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for side, side_rounds in rounds.items():
        runs = [run for one_round in side_rounds for run in one_round]
        summary[side] = {"decode_tok_s": median_of(runs, "decode_tok_s"),
                         "end_to_end_tok_s": median_of(runs, "end_to_end_tok_s")}
    for name in ("decode_tok_s", "end_to_end_tok_s"):
        summary[f"{name}_ratio"] = summary["async_engine"][name] / summary["offline"][name]
    return summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a GGUF file or HF folder (default: SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=4, help="requests a round, each run alone")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/async_engine-<time>.json)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          cache=CacheConfig(num_kv_blocks=args.num_kv_blocks))
    rounds = asyncio.run(run_rounds(args, config))
    summary = summarize(rounds)
    print(f"\nsingle stream, {args.requests} requests x {args.output_len} tokens, {args.rounds} alternating rounds; "
          "medians")
    print("| | decode tok/s | end-to-end tok/s |\n|---|---|---|")
    for side in ("offline", "async_engine"):
        print(f"| {side} | {summary[side]['decode_tok_s']:.1f} | {summary[side]['end_to_end_tok_s']:.1f} |")
    print(f"| AsyncEngine / offline | {summary['decode_tok_s_ratio']:.3f}x | {summary['end_to_end_tok_s_ratio']:.3f}x |")
    out = args.out or ROOT / "bench" / "results" / f"async_engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "summary": summary,
              "rounds": {side: [[asdict(run) for run in one_round] for one_round in side_rounds]
                         for side, side_rounds in rounds.items()}}
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
