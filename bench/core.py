"""Core benchmark report: pagegate vs the seed allocator, same process, medians and ratios.

    python -m bench.core [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from . import core_workloads as w

GOALS_NS = {"W1": 250, "W2": 15, "W4": 20, "builder": 20_000}


def median_ns_per_op(fn, *args, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        ops = fn(*args)
        samples.append((time.perf_counter_ns() - start) / ops)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats
    trace = w.ServingTrace()
    rows = [
        ("W1", "ns per allocate(1)+free pair", w.w1_pagegate, w.w1_seed, ()),
        ("W2", "ns per page, allocate(64)+free", w.w2_pagegate, w.w2_seed, ()),
        ("W3", "ns per allocated page, serving trace", w.w3_pagegate, w.w3_seed, (trace,)),
        ("W4", "ns per shared page", w.w4_pagegate, w.w4_seed, ()),
    ]
    print(f"{'workload':<8} {'unit':<38} {'pagegate':>10} {'seed':>10} {'speed-up':>9} {'goal':>10}")
    for name, unit, ours, seed, args in rows:
        a = median_ns_per_op(ours, *args, repeats=repeats)
        b = median_ns_per_op(seed, *args, repeats=max(3, repeats // 2))
        goal = f"<= {GOALS_NS[name]}" if name in GOALS_NS else ">= 10x"
        print(f"{name:<8} {unit:<38} {a:>10.1f} {b:>10.1f} {b / a:>8.1f}x {goal:>10}")
    setup = w.builder_setup()
    ns = median_ns_per_op(w.builder_steps, setup, repeats=repeats)
    print(f"{'builder':<8} {'ns per step, 256 seqs x 128 pages':<38} {ns:>10.0f} {'-':>10} {'-':>9} "
          f"{'<= 20000':>10}")


if __name__ == "__main__":
    main()
