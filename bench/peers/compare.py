"""pagegate against llama.cpp on the same CPU: decode, prefill and 64 parallel requests, as ratios.

    python -m bench.peers.compare [--rounds 3] [--models default,smollm2,smollm2-q4km,llama100m] [--threads 2]

Both sides get the same thread count. A round measures pagegate, then llama.cpp, for every figure; rounds
alternate so that drift on a shared machine lands on both; each figure is the median over rounds. pagegate is
driven in this process through its engine; llama.cpp with its own tools (`llama-bench`, `llama-batched-bench`).
Writes docs/peers.md (the table) and docs/peers.png (the ratios).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.peers import llamacpp
from bench.peers.roofline import read_bandwidth_gbs, roofline_tok_s
from pagegate import LLM, SamplingParams
from pagegate.engine.loading.loader import DEFAULT_MODEL

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
DOCS = Path("docs")
PROMPT, GEN = 128, 128  # prefill length; tokens decoded by one stream and by each parallel request
PARALLEL, PARALLEL_PROMPTS = 64, (64, 256)
FIGURES = {"decode": "single-stream decode tok/s", "prefill": f"prefill of {PROMPT} tokens tok/s",
           "parallel": f"{PARALLEL} requests × {GEN} output tokens (prompts {PARALLEL_PROMPTS[0]}–"
                       f"{PARALLEL_PROMPTS[1]}) total output tok/s"}


def random_llama(folder: Path) -> Path:
    """A randomly initialised 100M Llama saved by transformers, with the default model's tokenizer."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((DEFAULT_MODEL / name).read_bytes())
    return folder


def prepare(name: str) -> tuple[str | None, Path]:
    """(what `LLM` loads, the GGUF llama.cpp runs) for a model name."""
    if name == "default":
        return None, llamacpp.convert(DEFAULT_MODEL, llamacpp.CACHE / "gguf" / "default_model.gguf")
    if name == "smollm2":
        return str(SMOLLM2), SMOLLM2
    if name == "smollm2-q4km":  # the K-quant most downloads use, made from the Q4_1 file (only speed is judged)
        gguf = llamacpp.quantize(SMOLLM2, llamacpp.CACHE / "gguf" / "SmolLM2-135M-Instruct.Q4_K_M.gguf")
        return str(gguf), gguf
    if name == "llama100m":
        folder = random_llama(llamacpp.CACHE / "models" / "llama-100m")
        return str(folder), llamacpp.convert(folder, llamacpp.CACHE / "gguf" / "llama-100m.gguf")
    raise SystemExit(f"unknown model {name!r}: default, smollm2, smollm2-q4km or llama100m")


def parallel_prompt_lens(seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(PARALLEL_PROMPTS[0], PARALLEL_PROMPTS[1] + 1, PARALLEL).tolist()


class PagegateRunner:
    """One loaded engine; each call adds requests and steps the engine until they are done."""

    def __init__(self, model: str | None) -> None:
        self.llm = LLM(model, enable_prefix_caching=False)  # llama.cpp's tools reuse nothing between runs
        self.engine = self.llm.engine
        self.vocab = self.engine.model_config.vocab_size
        self.rng = np.random.default_rng(0)
        self.ids = 0
        self.parallel(lens=[16] * 4, gen=4)  # warm-up

    def _add(self, prompt_len: int, max_tokens: int) -> None:
        prompt = self.rng.integers(10, self.vocab, prompt_len).tolist()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.ids += 1
        self.engine.add(self.engine.intake.make_request(str(self.ids), prompt, params))

    def _run(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def decode(self) -> float:
        """Tokens per second of one stream after its first token, from a one-token prompt (as llama-bench tg)."""
        self._add(1, GEN + 1)
        self.engine.step()  # prefill and the first token
        start = time.perf_counter()
        self._run()
        return GEN / (time.perf_counter() - start)

    def prefill(self) -> float:
        """Prompt tokens per second: a PROMPT-token prompt to its first token."""
        self._add(PROMPT, 1)
        start = time.perf_counter()
        self._run()
        return PROMPT / (time.perf_counter() - start)

    def parallel(self, lens: list[int] | None = None, gen: int = GEN) -> float:
        """Output tokens per second of every request in flight at once, prefill included."""
        lens = lens or parallel_prompt_lens()
        for n in lens:
            self._add(n, gen)
        start = time.perf_counter()
        self._run()
        return len(lens) * gen / (time.perf_counter() - start)


def llamacpp_round(gguf: Path, threads: int) -> dict[str, float]:
    figures = llamacpp.bench(gguf, threads, PROMPT, GEN, reps=1)
    figures["parallel"] = llamacpp.batched(gguf, parallel_prompt_lens(), GEN, threads)
    return figures


def measure(name: str, rounds: int, threads: int, bandwidth_gbs: float) -> dict[str, dict[str, float]]:
    """{"pagegate" | "llama.cpp": {figure: median tok/s}, "roofline": {"decode": tok/s}} for one model."""
    pagegate_model, gguf = prepare(name)
    runner = PagegateRunner(pagegate_model)
    sides: dict[str, Callable[[], dict[str, float]]] = {
        "pagegate": lambda: {f: getattr(runner, f)() for f in FIGURES},
        "llama.cpp": lambda: llamacpp_round(gguf, threads),
    }
    samples: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for i in range(rounds):
        for side, run in sides.items():
            samples[side].append(run())
            print(f"{name} round {i + 1} {side}: " + ", ".join(f"{f} {v:.1f}" for f, v in samples[side][-1].items()),
                  flush=True)
    medians = {side: {f: statistics.median(s[f] for s in rows) for f in FIGURES} for side, rows in samples.items()}
    return {**medians, "roofline": {"decode": roofline_tok_s(gguf, bandwidth_gbs)}}


def table(results: dict[str, dict[str, dict[str, float]]], threads: int, rounds: int, bandwidth_gbs: float) -> str:
    """Markdown: per model and figure, pagegate / llama.cpp with both tok/s figures; decode also as a share of
    the roofline (read bandwidth / weight bytes per token)."""
    lines = [f"pagegate / llama.cpp, {threads} threads each, median of {rounds} alternating rounds "
             f"(ratio, then pagegate and llama.cpp tok/s). Decode roofline: {bandwidth_gbs:.1f} GB/s read bandwidth "
             f"({threads} threads) / the weight bytes a token reads; the share of it each side reaches.", "",
             "| model | " + " | ".join(FIGURES.values()) + " | decode roofline tok/s (pagegate / llama.cpp share) |",
             "|---" * (len(FIGURES) + 2) + "|"]
    for name, sides in results.items():
        cells = [f"{sides['pagegate'][f] / sides['llama.cpp'][f]:.2f}× ({sides['pagegate'][f]:.0f} / "
                 f"{sides['llama.cpp'][f]:.0f})" for f in FIGURES]
        roof = sides["roofline"]["decode"]
        cells.append(f"{roof:.0f} ({sides['pagegate']['decode'] / roof:.0%} / {sides['llama.cpp']['decode'] / roof:.0%})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(FIGURES)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, figure in enumerate(FIGURES):
        ratios = [sides["pagegate"][figure] / sides["llama.cpp"][figure] for sides in results.values()]
        ax.bar(np.arange(len(results)) + (i - (len(FIGURES) - 1) / 2) * width, ratios, width, label=figure)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(results)), list(results))
    ax.set_ylabel("pagegate / llama.cpp (tok/s)")
    ax.set_title("pagegate vs llama.cpp on the same CPU (higher: pagegate faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="default,smollm2")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    built = llamacpp.build()
    if built:
        print(f"built llama.cpp in {built:.0f} s")
    bandwidth = read_bandwidth_gbs(args.threads)
    print(f"read bandwidth, {args.threads} threads: {bandwidth:.1f} GB/s", flush=True)
    results = {name: measure(name, args.rounds, args.threads, bandwidth) for name in args.models.split(",")}
    text = table(results, args.threads, args.rounds, bandwidth)
    print(text)
    DOCS.mkdir(exist_ok=True)
    (DOCS / "peers.md").write_text(f"Made by `python -m bench.peers.compare --rounds {args.rounds} "
                                   f"--models {args.models}`.\n\n" + text)
    plot(results, DOCS / "peers.png")


if __name__ == "__main__":
    main()
