"""Many LoRA adapters on one base: `pagegate serve` and llama-server with the same adapters (GGUF form there), both
through the OpenAI SDK.

    python -m bench.lora [--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--rounds 3]
    python -m bench.lora --streams 4 --prompt 16 --gen 8 --rounds 1     # a tiny run: it works, nothing more

The adapters: 8 random PEFT LoRAs of rank 8 on q, k, v, o, gate, up and down, built once with transformers'
LlamaConfig made from the GGUF's shapes and `peft`, saved under .cache/lora/ (and converted to GGUF there by
llama.cpp's convert_lora_to_gguf.py for llama-server). Each side serves: `streams` prompts of random token ids
spread over the 8 adapters ("mixed") against the same prompts on the base model alone, and 1 prompt with an
adapter against without; output tok/s (ignore_eos), median over rounds, and the ratios. pagegate serves them
with --enable-lora --lora-modules (a request's `model` names its adapter); llama-server takes its adapters with --lora ... --lora-init-without-apply and a per-request `lora` list (its
docs/models-and-lora.md: requests with different adapters are not batched together). Writes docs/lora.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

from bench.peers import llamacpp
from bench.peers.served import SMOLLM2, start_llama_server
from pagegate.testing.launcher import ServerProcess
from pagegate.testing.lora import save_random_adapter

LORA_DIR = Path(".cache/lora")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS, RANK = 8, 8
Figures = dict[str, float]


# ---- the adapters, made once ----------------------------------------------------------------------------------

def base_config_dir(model: Path) -> Path:
    """A HF folder holding only the config.json of `model`'s shapes (what peft and llama.cpp's converter need)."""
    from transformers import LlamaConfig

    from pagegate.engine.loading.gguf_file import GGUFFile

    folder = LORA_DIR / f"{model.stem}-base"
    if not (folder / "config.json").is_file():
        c = GGUFFile(model).config
        config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, head_dim=c.head_dim,
                             intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                             num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                             rms_norm_eps=c.rms_norm_eps,
                             rope_parameters={"rope_type": "default", "rope_theta": c.rope.theta},
                             max_position_embeddings=c.max_position_embeddings,
                             tie_word_embeddings=c.tie_word_embeddings, architectures=["LlamaForCausalLM"])
        config.save_pretrained(folder)
    return folder


def make_adapters(model: Path, count: int = ADAPTERS, rank: int = RANK) -> list[Path]:
    """`count` PEFT folders of rank `rank` with small random A and B (all non-zero), made the first time."""
    folders = [LORA_DIR / f"{model.stem}-r{rank}-{i}" for i in range(count)]
    if all((f / "adapter_config.json").is_file() for f in folders):
        return folders
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_config_dir(model))
    base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # the values do not matter, the shapes do
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
    for seed, folder in enumerate(folders):
        save_random_adapter(base, folder, lora, seed, scale=0.02)
    return folders


def gguf_adapters(model: Path, folders: list[Path]) -> list[Path]:
    """Each PEFT folder as llama.cpp's GGUF LoRA (F16, as its users convert them), converted the first time."""
    converter = llamacpp.source_dir() / "convert_lora_to_gguf.py"
    files = [folder.parent / f"{folder.name}.gguf" for folder in folders]
    for folder, file in zip(folders, files, strict=True):
        if not file.is_file():
            subprocess.run([sys.executable, str(converter), "--base", str(base_config_dir(model)), "--outfile",
                            str(file), "--outtype", "f16", str(folder)], check=True, capture_output=True)
    return files


# ---- measuring ------------------------------------------------------------------------------------------------

Choice = tuple[str, dict[str, Any]]  # a request's `model` and the rest of its body (llama-server's `lora` list)


async def served_round(base_url: str, prompts: list[list[int]], choices: list[Choice], gen: int) -> float:
    """Output tok/s of `prompts` streamed at once, prompt i as choices[i] says."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        async def one(prompt: list[int], choice: Choice) -> None:
            model, extra = choice
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=gen, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True, **extra})
            async for _ in stream:
                pass

        started = time.perf_counter()
        await asyncio.gather(*(one(p, c) for p, c in zip(prompts, choices, strict=True)))
        return len(prompts) * gen / (time.perf_counter() - started)


def cases(rng: np.random.Generator, vocab: int, streams: int, prompt: int, count: int) -> dict[str, tuple]:
    """The four workloads of one round: fresh prompts, adapter indices (None: the base)."""
    many = [rng.integers(10, vocab, prompt).tolist() for _ in range(streams)]
    one = [rng.integers(10, vocab, prompt).tolist()]
    return {"mixed": (many, [i % count for i in range(streams)]), "base": (many, [None] * streams),
            "one_adapter": (one, [0]), "one_base": (one, [None])}


def run_side(measure: Callable[[list[list[int]], list[int | None]], float], vocab: int, streams: int, prompt: int,
             rounds: int, count: int, side: str) -> Figures:
    rng = np.random.default_rng(0)  # both sides see the same prompts
    warm = cases(rng, vocab, streams, prompt, count)
    for prompts, adapters in warm.values():  # not counted: loads every adapter once
        measure(prompts, adapters)
    samples: dict[str, list[float]] = {}
    for index in range(rounds):
        for case, (prompts, adapters) in cases(rng, vocab, streams, prompt, count).items():
            samples.setdefault(case, []).append(measure(prompts, adapters))
            print(f"{side}, round {index + 1}, {case}: {samples[case][-1]:.1f} tok/s", flush=True)
    return {case: statistics.median(values) for case, values in samples.items()}


def pagegate_figures(model: Path, folders: list[Path], args: argparse.Namespace, vocab: int) -> Figures:
    server = ServerProcess(["--model", str(model), "--max-num-seqs", str(args.streams), "--max-queue", "-1",
                            "--grpc-port", "0", "--disable-uvicorn-access-log", "--disable-dashboard", "--enable-lora",
                            "--max-loras", str(len(folders)), "--max-lora-rank", str(RANK), "--lora-modules",
                            *(f"{folder.name}={folder}" for folder in folders)]).start()
    try:
        base = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]  # the model first, then adapters

        def choose(index: int | None) -> Choice:
            return (folders[index].name if index is not None else base), {}

        return run_side(lambda p, a: asyncio.run(served_round(server.base_url + "/v1", p, [choose(i) for i in a],
                                                              args.gen)),
                        vocab, args.streams, args.prompt, args.rounds, len(folders), "pagegate")
    finally:
        server.stop()


def llama_server_figures(model: Path, files: list[Path], args: argparse.Namespace, vocab: int) -> Figures:
    lora_flags = tuple(flag for file in files for flag in ("--lora", str(file)))
    process, served = start_llama_server(model, args.threads, args.streams, llamacpp.repack_crashes(),
                                         args.prompt + args.gen + 64, (*lora_flags, "--lora-init-without-apply"))
    def choose(index: int | None) -> Choice:
        return "base", {"lora": [{"id": index, "scale": 1.0}] if index is not None else []}

    try:
        return run_side(lambda p, a: asyncio.run(served_round(served.base_url, p, [choose(i) for i in a], args.gen)),
                        vocab, args.streams, args.prompt, args.rounds, len(files), "llama-server")
    finally:
        process.terminate()
        process.wait(30)


def table(results: dict[str, Figures], args: argparse.Namespace, model: Path) -> str:
    lines = [f"{model.name}, {ADAPTERS} random PEFT adapters of rank {RANK} on {', '.join(TARGETS)}; prompts of "
             f"{args.prompt} random tokens, {args.gen} output tokens (ignore_eos), median of {args.rounds} rounds; "
             f"output tok/s.", "",
             f"| server | {args.streams} streams, {ADAPTERS} adapters mixed | {args.streams} streams, base "
             f"| ratio (goal ≥ 0.8×) | 1 stream, adapter | 1 stream, base | ratio (goal ≥ 0.9×) |",
             "|---|---|---|---|---|---|---|"]
    for side, f in results.items():
        lines.append(f"| {side} | {f['mixed']:.1f} | {f['base']:.1f} | {f['mixed'] / f['base']:.2f}× "
                     f"| {f['one_adapter']:.1f} | {f['one_base']:.1f} | {f['one_adapter'] / f['one_base']:.2f}× |")
    lines += ["", "pagegate: `pagegate serve --enable-lora --max-loras 8 --max-lora-rank 8 --lora-modules ...`, a "
              "request's `model` naming its adapter. "
              "llama-server: the same adapters converted by llama.cpp's convert_lora_to_gguf.py (F16), "
              "`--lora` each, `--lora-init-without-apply`, a per-request `lora` list."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama-server", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("docs/lora.md"))
    args = parser.parse_args()
    from bench.peers.served import gguf_vocab_size

    folders = make_adapters(args.model)
    vocab = gguf_vocab_size(args.model)
    results = {"pagegate": pagegate_figures(args.model, folders, args, vocab)}
    if not args.no_llama_server:
        llamacpp.build()
        results["llama-server"] = llama_server_figures(args.model, gguf_adapters(args.model, folders), args, vocab)
    text = table(results, args, args.model)
    print(text)
    command = " ".join(["python -m bench.lora", *sys.argv[1:]])
    args.out.write_text(f"Made by `{command}`.\n\n{text}")
    out = Path("bench/results/lora.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
