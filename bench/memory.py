"""Memory-policy benchmarks on the embedded model.

    python -m bench.memory capacity   # peak sequences held by a page budget: paged vs max-length preallocation
    python -m bench.memory shared     # 32 requests sharing a 1,024-token system prompt, caching on vs off
    python -m bench.memory pressure   # a pool too small for the load: preemption, swap and recompute over time

Each writes docs/bench-memory-<command>.png (`--png PATH` to change, `--png ''` for none).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pagegate import LLM, SamplingParams
from pagegate.core.seed.simulator import GIB, compare, seed_trace

from .plots import COLOURS, add_png_argument, figure, labelled_bars, save_figure, wanted

BLOCK = 16


def run_and_watch(llm: LLM, prompts: list, params: list, label: str = "requests") -> dict:
    """Step the engine to completion, sampling page use after every step (the timeline too)."""
    engine = llm.engine
    scheduler = engine.scheduler
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    peak_running = peak_used = 0
    waste = []
    timeline: dict[str, list] = {k: [] for k in ("t", "used", "swapped_pages", "running", "swapped", "waiting",
                                                 "preemptions", "swap_outs")}
    progress = tqdm(total=len(prompts), desc=label, leave=False)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        running = scheduler.running
        used = scheduler.pool.num_used_blocks
        peak_used = max(peak_used, used)
        peak_running = max(peak_running, len(running))
        if running:
            held = sum(s.num_computed for s in running)
            waste.append((used * BLOCK - held) / len(running))
        cpu = scheduler.cpu_pool
        for key, value in (("t", time.perf_counter() - start), ("used", used),
                           ("swapped_pages", cpu.num_used_blocks if cpu is not None else 0),
                           ("running", len(running)), ("swapped", len(scheduler.swapped)),
                           ("waiting", len(scheduler.waiting)), ("preemptions", scheduler.num_preemptions),
                           ("swap_outs", scheduler.num_swap_outs)):
            timeline[key].append(value)
        progress.update(len(prompts) - scheduler.num_unfinished - progress.n)
    progress.close()
    return {"seconds": time.perf_counter() - start, "peak_running": peak_running, "peak_used_blocks": peak_used,
            "waste_tokens_per_seq": float(np.median(waste)) if waste else 0.0, "timeline": timeline,
            "preemptions": scheduler.num_preemptions, "swap_outs": scheduler.num_swap_outs}


def capacity(args) -> None:
    sim = compare(seed_trace(20_000, seed=0))
    print(f"simulator (seed scenario, 20 GiB, 16 KiB/token): contiguous holds {sim['contiguous']['peak_concurrent']}"
          f" sequences, paged {sim['paged']['peak_concurrent']}: {sim['capacity_ratio']:.2f}x; waste per paged "
          f"sequence {sim['paged']['waste_per_seq_tokens']:.1f} tokens")
    rng = np.random.default_rng(0)
    pages, max_len = args.pages, 2048
    total = np.clip(rng.exponential(512, args.requests), 32, max_len).astype(int)
    prompt = np.maximum(8, (total * 0.5).astype(int))
    prompts = [rng.integers(10, 2048, n).tolist() for n in prompt]
    params = [SamplingParams(temperature=0, max_tokens=int(t - p), ignore_eos=True) for t, p in zip(total, prompt, strict=True)]
    llm = LLM(None, num_kv_blocks=pages, max_model_len=max_len, max_num_seqs=512, max_num_batched_tokens=4096,
              enable_prefix_caching=False)
    watched = run_and_watch(llm, prompts, params)
    contiguous = pages * BLOCK // max_len
    print(f"engine ({pages} pages = {pages * BLOCK} tokens, max {max_len}, mean actual {total.mean():.0f}): "
          f"contiguous preallocation holds {contiguous} sequences, pagegate held {watched['peak_running']}: "
          f"{watched['peak_running'] / contiguous:.2f}x; median waste {watched['waste_tokens_per_seq']:.1f} tokens "
          f"per sequence (one page = {BLOCK})")
    if wanted(args.png):
        plot_capacity(sim, contiguous, watched["peak_running"], pages, args.png)


def plot_capacity(sim: dict, engine_contiguous: int, engine_paged: int, pages: int, path: Path) -> None:
    """Sequences held at once, and where the simulator's 20 GiB went, contiguous against paged."""
    fig, (left, right) = figure(2, width=8, height=3)
    groups = ["simulator, 20 GiB", f"engine, {pages:,} pages"]
    held = {"contiguous": [sim["contiguous"]["peak_concurrent"], engine_contiguous],
            "paged": [sim["paged"]["peak_concurrent"], engine_paged]}
    for offset, name in ((-0.2, "contiguous"), (0.2, "paged")):
        bars = left.bar([i + offset for i in range(2)], held[name], 0.4, label=name, color=COLOURS[name])
        left.bar_label(bars, fontsize=7)
    left.set_yscale("log")
    left.set_ylim(top=max(held["paged"]) * 3)
    left.set_xticks(range(2), groups)
    left.set(title="peak sequences held at once (log)", ylabel="sequences")
    left.legend()
    names = ["contiguous", "paged"]
    parts = [("tokens", "utilization", "#2a9d8f"), ("internal waste", "internal_waste_bytes", "#e9c46a"),
             ("external waste", "external_waste_bytes", "#e76f51")]
    bottom = [0.0, 0.0]
    for label, key, colour in parts:
        share = [sim[n][key] if key == "utilization" else sim[n][key] / (20 * GIB) for n in names]
        bars = right.bar(names, share, bottom=bottom, label=label, color=colour)
        right.bar_label(bars, labels=[f"{v:.1%}" if v >= 0.03 else "" for v in share], label_type="center",
                        fontsize=7)
        bottom = [b + v for b, v in zip(bottom, share, strict=True)]
    right.set_xticks(range(2), [f"{n}\n{sim[n]['waste_per_seq_tokens']:,.1f} tokens waste/seq" for n in names])
    right.set_ylim(0, 1)
    right.yaxis.set_major_formatter("{x:.0%}")
    right.set(title="simulator: the pool, averaged over steps", ylabel="share of 20 GiB")
    right.legend(loc="upper right")
    save_figure(fig, path)


def shared(args) -> None:
    rng = np.random.default_rng(1)
    system = rng.integers(10, 2048, 1024).tolist()
    prompts = [system + rng.integers(10, 2048, 16).tolist() for _ in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 32
    results = {}
    for caching in (False, True):
        llm = LLM(None, num_kv_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048,
                  enable_prefix_caching=caching)
        results[caching] = run_and_watch(llm, prompts, params, f"prefix caching {'on' if caching else 'off'}")
    off, on = results[False], results[True]
    system_pages = 1024 // BLOCK
    print(f"system prompt pages: unshared {32 * system_pages}, shared {system_pages} "
          f"(1/32); peak pages in use {off['peak_used_blocks']} -> "
          f"{on['peak_used_blocks']}")
    print(f"end to end: {off['seconds']:.2f} s without prefix caching, {on['seconds']:.2f} s with: "
          f"{off['seconds'] / on['seconds']:.2f}x")
    if wanted(args.png):
        fig, (left, right) = figure(2, width=6, height=2.6)
        for ax, key, title in ((left, "peak_used_blocks", "peak KV pages in use"), (right, "seconds", "seconds")):
            labelled_bars(ax, ["caching off", "caching on"], [off[key], on[key]],
                          "{:.1f}" if key == "seconds" else "{:.0f}", color=[COLOURS["contiguous"], COLOURS["paged"]])
            ax.set_title(title)
        fig.suptitle("32 requests sharing a 1,024-token system prompt", fontsize=9)
        save_figure(fig, args.png)


def pressure(args) -> None:
    """More load than pages: the scheduler preempts (swapping to the CPU pool while it has room, else
    recomputing) and brings sequences back as others finish."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(10, 2048, int(n)).tolist() for n in rng.integers(64, 257, args.requests)]
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True)
              for n in rng.integers(128, 257, args.requests)]
    llm = LLM(None, num_kv_blocks=args.pages, swap_space=args.swap_space, max_num_seqs=args.requests,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    cpu_pages = llm.engine.scheduler.cpu_pool.num_blocks if llm.engine.scheduler.cpu_pool is not None else 0
    watched = run_and_watch(llm, prompts, params)
    lengths = [len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True)]
    print(f"{args.requests} requests ({sum(lengths):,} tokens in all, {sum(-(-n // BLOCK) for n in lengths):,} pages "
          f"if held at once) on "
          f"{args.pages} device pages and {cpu_pages} CPU swap pages: {watched['preemptions']} preemptions "
          f"({watched['swap_outs']} swapped out, the rest recomputed), peak {watched['peak_running']} running, "
          f"{watched['seconds']:.1f} s")
    if wanted(args.png):
        plot_pressure(watched["timeline"], args.pages, cpu_pages, args.png)


def plot_pressure(timeline: dict, pages: int, cpu_pages: int, path: Path) -> None:
    fig, (top, bottom) = figure(1, 2, width=7, height=4.2, sharex=True)
    t = timeline["t"]
    top.plot(t, timeline["used"], color="#2a9d8f", label="device pages used")
    top.plot(t, timeline["swapped_pages"], color="#e76f51", label="pages swapped to CPU")
    top.axhline(pages, color="#2a9d8f", ls=":", lw=1, label=f"device pool ({pages})")
    if cpu_pages:
        top.axhline(cpu_pages, color="#e76f51", ls=":", lw=1, label=f"CPU pool ({cpu_pages})")
    top.set(title="a pool too small for the load: pages over time", ylabel="pages")
    top.legend(loc="center right", ncols=2)
    for key, colour in (("running", "#264653"), ("swapped", "#e76f51"), ("waiting", "#8d99ae")):
        bottom.plot(t, timeline[key], color=colour, label=key)
    swaps = np.diff(np.asarray(timeline["swap_outs"]), prepend=0)
    recomputes = np.diff(np.asarray(timeline["preemptions"]), prepend=0) - swaps
    for events, colour, label in ((swaps, "#e76f51", "swapped out"), (recomputes, "black", "preempted to recompute")):
        at = [x for x, n in zip(t, events, strict=True) if n]
        bottom.plot(at, [-0.5] * len(at), "|", color=colour, ms=8, label=label)
    bottom.set(xlabel="seconds", ylabel="sequences")
    bottom.legend(loc="upper right", ncols=3)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("capacity")
    c.add_argument("--pages", type=int, default=2048)
    c.add_argument("--requests", type=int, default=200)
    add_png_argument(c, "memory-capacity")
    add_png_argument(sub.add_parser("shared"), "memory-shared")
    p = sub.add_parser("pressure")
    p.add_argument("--pages", type=int, default=256, help="device KV pages (16 tokens each)")
    p.add_argument("--swap-space", type=float, default=0.01, help="GiB of CPU swap (0: recompute only)")
    p.add_argument("--requests", type=int, default=48)
    add_png_argument(p, "memory-pressure")
    args = parser.parse_args()
    {"capacity": capacity, "shared": shared, "pressure": pressure}[args.command](args)


if __name__ == "__main__":
    main()
