"""pagegate against llama.cpp on the same CPU and the same GGUF files: prefill, parallel sequences and decode, as
ratios beside issue 56's goals.

    python -m bench.peers.compare [--rounds 3] [--models smollm2,smollm2-q4km,llama100m,llama1b-q4km] [--threads 2]

Figures, each against llama.cpp's own tool:
  prefill128, prefill512  a prompt of 128 / 512 tokens to its first token     llama-bench pp128 / pp512
  parallel                64 sequences of a 128-token prompt, 128 tokens      llama-batched-bench -npp 128 -ntg 128
                          each, all in flight at once (llama1b-q4km: 16 ×     -npl 64: its S t/s
                          (128 + 64)); prompt and output tokens per second
  decode                  one stream's tokens after its first                 llama-bench tg128
Both sides get the same thread count. A round measures pagegate, then llama.cpp, for every figure; rounds
alternate so that drift on a shared machine lands on both; each figure is the median over rounds. pagegate's
engine is built and stepped on this process's main thread, as the core process runs it (`step_requests`, no
output objects). Writes docs/peers.md (the table) and docs/peers.png (the ratios and their goals).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench import plots
from bench.peers import llamacpp
from bench.peers.random_models import llama_1b_q4km, llama_100m
from bench.peers.roofline import read_bandwidth_gbs, roofline_tok_s
from pagegate import LLM, SamplingParams
from pagegate.engine.loading.loader import DEFAULT_MODEL

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
DOCS = Path("docs")
PREFILLS = (128, 512)  # prompt lengths of the prefill figures
GEN = 128  # tokens decoded by the single stream
FIGURES = {**{f"prefill{n}": f"prefill {n}" for n in PREFILLS}, "parallel": "parallel", "decode": "decode"}
GOALS = {**{f"prefill{n}": 1.2 for n in PREFILLS}, "parallel": 1.5}  # decode's goal is the model's (Case)

Sides = dict[str, dict[str, float]]  # "pagegate" | "llama.cpp" -> figure -> tok/s; "roofline" -> {"decode": ...}


@dataclass(frozen=True)
class Shape:
    """`sequences` requests of a `prompt`-token prompt, each generating `gen` tokens, all in flight at once."""

    sequences: int
    prompt: int
    gen: int

    @property
    def tokens(self) -> int:
        """Prompt and generated tokens of the whole batch: what llama-batched-bench's S t/s counts."""
        return self.sequences * (self.prompt + self.gen)

    def __str__(self) -> str:
        return f"{self.sequences} × ({self.prompt} + {self.gen})"


PARALLEL = Shape(64, 128, 128)


@dataclass(frozen=True)
class Case:
    """One model of the comparison: its files, its decode goal (by weight format), its parallel shape."""

    describe: str
    prepare: Callable[[], tuple[str | None, Path]]  # -> (what `LLM` loads, the GGUF llama.cpp runs)
    decode_goal: float
    parallel: Shape = PARALLEL
    max_model_len: int | None = None  # bounds pagegate's KV check where the model's own length would not fit

    def goal(self, figure: str) -> float:
        return self.decode_goal if figure == "decode" else GOALS[figure]


def _default() -> tuple[str | None, Path]:
    return None, llamacpp.convert(DEFAULT_MODEL, llamacpp.CACHE / "gguf" / "default_model.gguf")


def _smollm2() -> tuple[str | None, Path]:
    return str(SMOLLM2), SMOLLM2


def _smollm2_q4km() -> tuple[str | None, Path]:
    """The K-quant most downloads use, made from the Q4_1 file (only speed is judged)."""
    gguf = llamacpp.quantize(SMOLLM2, llamacpp.CACHE / "gguf" / "SmolLM2-135M-Instruct.Q4_K_M.gguf")
    return str(gguf), gguf


def _llama100m() -> tuple[str | None, Path]:
    folder = llama_100m()
    return str(folder), llamacpp.convert(folder, llamacpp.CACHE / "gguf" / "llama-100m.gguf")


def _llama1b_q4km() -> tuple[str | None, Path]:
    gguf = llama_1b_q4km()
    return str(gguf), gguf


CASES = {
    "default": Case("the default model, F32", _default, 0.95),
    "smollm2": Case("SmolLM2-135M-Instruct, Q4_1", _smollm2, 1.15),
    "smollm2-q4km": Case("SmolLM2-135M-Instruct, Q4_K_M (requantized)", _smollm2_q4km, 1.1),
    "llama100m": Case("random 100M Llama, F32", _llama100m, 0.95),
    "llama1b-q4km": Case("random Llama 3.2 1B shape, Q4_K_M", _llama1b_q4km, 1.05, Shape(16, 128, 64),
                         max_model_len=4096),
}
ISSUE_MODELS = "smollm2,smollm2-q4km,llama100m,llama1b-q4km"


class PagegateRunner:
    """One loaded engine, stepped on the main thread as the engine core does; each figure adds its requests and
    steps until they are done."""

    def __init__(self, model: str | None, max_model_len: int | None = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("pagegate's engine is measured on the main thread, as its core process runs it")
        # no prefix caching: llama.cpp's tools reuse nothing between runs
        self.engine = LLM(model, enable_prefix_caching=False, max_model_len=max_model_len).engine
        self.vocab = self.engine.model_config.vocab_size
        self.rng = np.random.default_rng(0)
        self.ids = 0
        self.prefill(PREFILLS[-1])  # warm-up: the longest prompt and a small batch
        self.parallel(Shape(4, 16, 4))

    def _add(self, prompt_len: int, max_tokens: int) -> None:
        prompt = self.rng.integers(10, self.vocab, prompt_len).tolist()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.ids += 1
        self.engine.add(self.engine.intake.make_request(str(self.ids), prompt, params))

    def _run(self) -> float:
        """Step until every request is done, as the core's loop does; the seconds it took."""
        start = time.perf_counter()
        while self.engine.has_unfinished():
            self.engine.step_requests()
        return time.perf_counter() - start

    def decode(self) -> float:
        """Tokens per second of one stream after its first token, from a one-token prompt (as llama-bench tg)."""
        self._add(1, GEN + 1)
        self.engine.step_requests()  # prefill and the first token
        return GEN / self._run()

    def prefill(self, prompt: int) -> float:
        """Prompt tokens per second: a `prompt`-token prompt to its first token (as llama-bench pp)."""
        self._add(prompt, 1)
        return prompt / self._run()

    def parallel(self, shape: Shape) -> float:
        """Prompt and output tokens per second of `shape`'s sequences in flight at once (as llama-batched-bench)."""
        for _ in range(shape.sequences):
            self._add(shape.prompt, shape.gen)
        return shape.tokens / self._run()

    def round(self, shape: Shape) -> dict[str, float]:
        figures = {f"prefill{n}": self.prefill(n) for n in PREFILLS}
        figures["parallel"] = self.parallel(shape)
        figures["decode"] = self.decode()
        return figures


def llamacpp_round(gguf: Path, shape: Shape, threads: int) -> dict[str, float]:
    figures = llamacpp.bench(gguf, threads, PREFILLS, GEN, reps=1)
    figures["parallel"] = llamacpp.batched(gguf, shape.sequences, shape.prompt, shape.gen, threads)
    return figures


def measure(name: str, rounds: int, threads: int, bandwidth_gbs: float) -> Sides:
    """{"pagegate" | "llama.cpp": {figure: median tok/s}, "roofline": {"decode": tok/s}} for one model."""
    case = CASES[name]
    pagegate_model, gguf = case.prepare()
    runner = PagegateRunner(pagegate_model, case.max_model_len)
    sides: dict[str, Callable[[], dict[str, float]]] = {
        "pagegate": lambda: runner.round(case.parallel),
        "llama.cpp": lambda: llamacpp_round(gguf, case.parallel, threads),
    }
    samples: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for i in range(rounds):
        for side, run in sides.items():
            samples[side].append(run())
            print(f"{name} round {i + 1} {side}: " + ", ".join(f"{f} {v:.1f}" for f, v in samples[side][-1].items()),
                  flush=True)
    medians = {side: {f: statistics.median(s[f] for s in rows) for f in FIGURES} for side, rows in samples.items()}
    return {**medians, "roofline": {"decode": roofline_tok_s(gguf, bandwidth_gbs)}}


def ratio(sides: Sides, figure: str) -> float:
    return sides["pagegate"][figure] / sides["llama.cpp"][figure]


def cell(name: str, sides: Sides, figure: str) -> str:
    """`1.31× (≥ 1.20× ✓) 812 / 620`: the ratio, its goal (met or not), pagegate's and llama.cpp's tok/s."""
    value, goal = ratio(sides, figure), CASES[name].goal(figure)
    return (f"{value:.2f}× (≥ {goal:.2f}× {'✓' if value >= goal else '✗'}) "
            f"{tok_s(sides['pagegate'][figure])} / {tok_s(sides['llama.cpp'][figure])}")


def tok_s(value: float) -> str:
    """Whole tokens per second, or one decimal below 100 (a 1B's decode)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def table(results: dict[str, Sides], threads: int, rounds: int, bandwidth_gbs: float) -> str:
    """Markdown: per model and figure, pagegate / llama.cpp beside its goal, with both tok/s figures; decode also
    as a share of the roofline (read bandwidth / weight bytes per token)."""
    lines = [f"pagegate / llama.cpp on the same GGUF, {threads} threads each, median of {rounds} alternating rounds. "
             "Each cell: the ratio (the goal, ✓ met or ✗ not), then pagegate and llama.cpp tok/s. Prefill: "
             f"llama-bench ppN; parallel: all sequences at once, prompt and output tok/s (llama-batched-bench's "
             f"S t/s); decode: llama-bench tg{GEN}. Decode roofline: {bandwidth_gbs:.1f} GB/s read bandwidth "
             f"({threads} threads) / the weight bytes a token reads; the share of it each side reaches.", "",
             "| model | " + " | ".join(FIGURES.values()) + " | parallel shape | decode roofline tok/s "
             "(pagegate / llama.cpp share) |", "|---" * (len(FIGURES) + 3) + "|"]
    for name, sides in results.items():
        case, roof = CASES[name], sides["roofline"]["decode"]
        cells = [f"{name} ({case.describe})", *(cell(name, sides, f) for f in FIGURES), str(case.parallel),
                 f"{roof:.0f} ({sides['pagegate']['decode'] / roof:.0%} / {sides['llama.cpp']['decode'] / roof:.0%})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Sides], path: Path) -> None:
    """Grouped bars of pagegate / llama.cpp per model and figure, each with its goal as a black tick."""
    fig, ax = plots.figure(width=8.0, height=3.6)
    width = 0.8 / len(FIGURES)
    models = np.arange(len(results))
    for i, (key, label) in enumerate(FIGURES.items()):
        x = models + (i - (len(FIGURES) - 1) / 2) * width
        bars = ax.bar(x, [ratio(sides, key) for sides in results.values()], width, label=label)
        ax.bar_label(bars, fmt="{:.2f}", fontsize=6)
        ax.hlines([CASES[name].goal(key) for name in results], x - width / 2, x + width / 2, color="black",
                  linewidth=1.5, label="goal" if i == 0 else None)
    ax.axhline(1.0, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xticks(models, list(results))
    ax.set_ylabel("pagegate / llama.cpp (tok/s)")
    ax.set_title("pagegate vs llama.cpp on the same CPU and GGUF (higher: pagegate faster; black: the goal)")
    ax.legend(ncols=len(FIGURES) + 1, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    plots.save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=ISSUE_MODELS, help=f"a comma-separated list of: {', '.join(CASES)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DOCS, help="where peers.md and peers.png go (default docs)")
    args = parser.parse_args()
    names = args.models.split(",")
    if unknown := [name for name in names if name not in CASES]:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}: pick from {', '.join(CASES)}")
    torch.set_num_threads(args.threads)
    built = llamacpp.build()
    if built:
        print(f"built llama.cpp in {built:.0f} s")
    bandwidth = read_bandwidth_gbs(args.threads)
    print(f"read bandwidth, {args.threads} threads: {bandwidth:.1f} GB/s", flush=True)
    results = {name: measure(name, args.rounds, args.threads, bandwidth) for name in names}
    text = table(results, args.threads, args.rounds, bandwidth)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.md").write_text(f"Made by `python -m bench.peers.compare --rounds {args.rounds} "
                                       f"--models {args.models}`.\n\n" + text)
    plot(results, args.out / "peers.png")


if __name__ == "__main__":
    main()
