"""Tensor parallelism's cost per step: bytes and time of the step broadcast and the all-reduces, against
the whole step, for TP=2 on this machine (gloo over loopback), next to TP=1.

    python -m bench.tp                       # the default model (4 heads, 2 KV heads)
    python -m bench.tp --models default --batch 16 64

SmolLM2-135M has 9 attention heads and 3 KV heads: it splits over 3 ranks, not 2 (`--models smollm2` fails at
start saying so).

On a 2-core machine two ranks share the cores, so TP is no speed-up here: the figures show the overhead.
Rank 0's collective time includes waiting for the other rank to arrive. Writes docs/bench-tp.png (`--png PATH`,
`--png ''` for none).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from pagegate import LLM, SamplingParams

from .plots import COLOURS, add_png_argument, figure, save_figure, wanted

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")


class CommMeter:
    """Wraps torch.distributed's broadcast and all_reduce in this process (rank 0) to count bytes and time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._originals = {name: getattr(dist, name) for name in ("broadcast", "all_reduce")}

    def __enter__(self) -> CommMeter:
        for name, original in self._originals.items():
            setattr(dist, name, self._timed(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _timed(self, name: str, original):
        def call(tensor, *args, **kwargs):
            start = time.perf_counter()
            result = original(tensor, *args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            self.bytes[name] += tensor.numel() * tensor.element_size()
            self.calls[name] += 1
            return result
        return call


def decode_steps(llm: LLM, batch: int, steps: int, meter: CommMeter | None = None) -> list[float]:
    """Seconds of each of `steps` engine steps once `batch` sequences decode together (metered, if given)."""
    engine = llm.engine
    prompt = list(range(10, 42))
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{time.time_ns()}", prompt,
                           SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0))
    engine.step()  # the prefill
    times = []
    with meter or contextlib.nullcontext():
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return times


def measure(model: str | None, tp: int, batch: int, steps: int) -> dict[str, float]:
    quantization = "none" if model and model.endswith(".gguf") else None
    llm = LLM(model, device="cpu", tensor_parallel_size=tp, num_kv_blocks=1024, quantization=quantization)
    try:
        decode_steps(llm, 4, 4)  # warm-up
        meter = CommMeter()
        times = decode_steps(llm, batch, steps, meter)
        n = len(times)
        row = {"step_ms": statistics.median(times) * 1e3}
        if tp > 1:
            row.update(bcast_ms=meter.seconds["broadcast"] / n * 1e3, bcast_kb=meter.bytes["broadcast"] / n / 1024,
                       allreduce_ms=meter.seconds["all_reduce"] / n * 1e3,
                       allreduce_kb=meter.bytes["all_reduce"] / n / 1024, allreduces=meter.calls["all_reduce"] / n)
        return row
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="default")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=20)
    add_png_argument(parser, "tp")
    args = parser.parse_args()
    paths = {"default": None, "smollm2": str(SMOLLM2)}
    cases = [(name, batch) for name in args.models.split(",") for batch in args.batch]
    rows = {}
    print(f"{'model':>8} {'batch':>5} {'TP1 step':>9} {'TP2 step':>9} {'bcast':>14} {'all-reduce':>22} {'comm share':>10}")
    for name, batch in tqdm(cases, desc="model x batch", leave=False):
        one = measure(paths[name], 1, batch, args.steps)
        two = measure(paths[name], 2, batch, args.steps)
        rows[name, batch] = one, two
        comm = two["bcast_ms"] + two["allreduce_ms"]
        tqdm.write(f"{name:>8} {batch:>5} {one['step_ms']:7.2f}ms {two['step_ms']:7.2f}ms "
                   f"{two['bcast_ms']:5.2f}ms {two['bcast_kb']:5.1f}KiB "
                   f"{two['allreduce_ms']:6.2f}ms {two['allreduce_kb']:6.1f}KiB x{two['allreduces']:.0f} "
                   f"{comm / two['step_ms']:9.0%}")
    if wanted(args.png):
        plot(rows, args.png)


def plot(rows: dict[tuple[str, int], tuple[dict, dict]], path: Path) -> None:
    """Per model and batch: the TP=1 step beside the TP=2 step split into broadcast, all-reduce and the rest."""
    fig, ax = figure(width=7, height=3)
    labels = [f"{name}\nbatch {batch}" for name, batch in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [one["step_ms"] for one, _ in rows.values()], 0.4, label="TP=1 step",
           color=COLOURS["seed"])
    bottom = [0.0] * len(rows)
    for key, label, colour in (("bcast_ms", "TP=2: step broadcast", "#e76f51"),
                               ("allreduce_ms", "TP=2: all-reduces", "#e9c46a"),
                               (None, "TP=2: the rest of the step", COLOURS["pagegate"])):
        part = [two[key] if key else max(0.0, two["step_ms"] - two["bcast_ms"] - two["allreduce_ms"])
                for _, two in rows.values()]
        ax.bar([i + 0.2 for i in x], part, 0.4, bottom=bottom, label=label, color=colour)
        bottom = [b + p for b, p in zip(bottom, part, strict=True)]
    for i, (_, two) in enumerate(rows.values()):
        share = (two["bcast_ms"] + two["allreduce_ms"]) / two["step_ms"]
        ax.annotate(f"{share:.0%}", (i + 0.2, two["step_ms"]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), labels)
    ax.set(title="decode step, median ms (the % is TP=2's share in collectives)", ylabel="ms per step")
    ax.set_ylim(0, max(bottom) * 1.2)
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
