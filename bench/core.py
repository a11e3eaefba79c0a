"""Core benchmark report: pagegate vs the seed allocator, same process, medians and ratios.

    python -m bench.core [--repeats 7] [--png docs/bench-core.png]

The "api" rows run the seed's own BlockAllocator interface, once over the seed's pure-Python
class and once over pagegate.core.seed.allocator.BlockAllocator, on the same workload.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

from pagegate.core.seed.allocator import BlockAllocator

from . import core_workloads as w
from .plots import COLOURS, add_png_argument, figure, save_figure, wanted

GOALS_NS = {"W1": 250, "W2": 15, "W4": 20, "builder": 20_000}
GOALS_SPEEDUP = {"W3": 10, "W2 api": 5, "W3 api": 5}


def ns_per_op(fn, *args) -> float:
    start = time.perf_counter_ns()
    ops = fn(*args)
    return (time.perf_counter_ns() - start) / ops


def median_ns_per_op(fn, *args, repeats: int) -> float:
    return statistics.median(ns_per_op(fn, *args) for _ in range(repeats))


def compare(ours, seed, args: tuple, repeats: int) -> tuple[float, float]:
    """Medians of alternating runs, so that a noisy spell on the machine hits both sides."""
    a, b = [], []
    for _ in range(repeats):
        a.append(ns_per_op(ours, *args))
        b.append(ns_per_op(seed, *args))
    return statistics.median(a), statistics.median(b)


def plot(measured: dict[str, tuple[float, float]], path: Path) -> None:
    """ns per operation of both sides (log) and the speed-up against the seed, goals marked."""
    fig, (left, right) = figure(2, width=8, height=3)
    names = list(measured)
    x = range(len(names))
    for offset, side, index in ((-0.2, "pagegate", 0), (0.2, "seed", 1)):
        left.bar([i + offset for i in x], [measured[n][index] for n in names], 0.4, label=side, color=COLOURS[side])
    for i, name in enumerate(names):
        if name in GOALS_NS:
            left.hlines(GOALS_NS[name], i - 0.4, i, color="#e76f51", lw=1.5,
                        label="goal" if name == "W1" else None)
    left.set_yscale("log")
    left.set_xticks(list(x), names)
    left.set(title="ns per operation (log; lower is better)", ylabel="ns")
    left.legend()
    ratios = [measured[n][1] / measured[n][0] for n in names]
    bars = right.bar(names, ratios, color=COLOURS["pagegate"])
    right.bar_label(bars, fmt="{:.1f}x", fontsize=7)
    for i, name in enumerate(names):
        if name in GOALS_SPEEDUP:
            right.hlines(GOALS_SPEEDUP[name], i - 0.4, i + 0.4, color="#e76f51", lw=1.5,
                         label="goal" if name == "W3" else None)
    right.set_ylim(0, max(ratios + [10]) * 1.15)
    right.set(title="speed-up against the seed allocator", ylabel="seed ns / pagegate ns")
    right.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    add_png_argument(parser, "core")
    args = parser.parse_args()
    repeats = args.repeats
    trace = w.ServingTrace()
    api_trace = w.SeedApiTrace(trace)
    rows = [
        ("W1", "ns per allocate(1)+free pair", w.w1_pagegate, w.w1_seed, ()),
        ("W2", "ns per page, allocate(64)+free", w.w2_pagegate, w.w2_seed, ()),
        ("W3", "ns per allocated page, serving trace", w.w3_pagegate, w.w3_seed, (trace,)),
        ("W4", "ns per shared page", w.w4_pagegate, w.w4_seed, ()),
        ("W2 api", "ns per page, allocate(seq, 64)+free", partial(w.w2_seed, allocator=BlockAllocator),
         w.w2_seed, ()),
        ("W3 api", "ns per allocated page, serving trace",
         partial(w.w3_seed_api, allocator=BlockAllocator), w.w3_seed_api, (api_trace,)),
    ]
    measured = {}
    print(f"{'workload':<8} {'unit':<38} {'pagegate':>10} {'seed':>10} {'speed-up':>9} {'goal':>10}")
    for name, unit, ours, seed, inputs in rows:
        a, b = measured[name] = compare(ours, seed, inputs, repeats)
        goal = f"<= {GOALS_NS[name]}" if name in GOALS_NS else f">= {GOALS_SPEEDUP[name]}x"
        print(f"{name:<8} {unit:<38} {a:>10.1f} {b:>10.1f} {b / a:>8.1f}x {goal:>10}")
    setup = w.builder_setup()
    ns = median_ns_per_op(w.builder_steps, setup, repeats=repeats)
    print(f"{'builder':<8} {'ns per step, 256 seqs x 128 pages':<38} {ns:>10.0f} {'-':>10} {'-':>9} "
          f"{'<= 20000':>10}")
    if wanted(args.png):
        plot(measured, args.png)


if __name__ == "__main__":
    main()
