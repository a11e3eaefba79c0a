"""Draft-model speculation on a pair built here: the embedded default model (4 layers) as the target, drafted for by
itself (every guess right: what drafting costs at best) and by its own first layer (the target's embeddings, first
block and head: a self-speculative draft), against the target alone and n-gram guessing, in one process.

    python -m bench.spec_draft [--rounds 3] [--max-tokens 128]

Single-stream greedy decoding through `LLM.generate` (the engine the server steps); rounds alternate the setups.
Reports decode tokens/s (medians), the ratio to the target alone and the share of guesses kept; greedy outputs
must be identical in every setup.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

import pagegate.engine
from pagegate import LLM, SamplingParams

DEFAULT_MODEL = Path(pagegate.engine.__file__).parent / "default_model"
PROMPTS = ["In the beginning God created the heaven and the earth. And the earth was without form, and void;",
           "And God said, Let there be light: and there was light. And God saw the light, that it was good:"]


def first_layers(folder: Path, layers: int) -> Path:
    """A copy of the default model keeping its first `layers` blocks (embeddings, final norm and head too)."""
    out = folder / f"default-first-{layers}"
    shutil.copytree(DEFAULT_MODEL, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(out / "model.safetensors")
    keep = {name: tensor for name, tensor in weights.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    return out


def decode_rate(llm: LLM, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s over the prompts one at a time (prefill timed apart, by a one-token run), and the tokens."""
    rates, tokens = [], []
    for prompt in PROMPTS:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                             use_tqdm=False)
        rates.append((max_tokens - 1) / (time.perf_counter() - start - prefill))
        tokens.append(out.outputs[0].token_ids)
    return statistics.median(rates), tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        setups = {"target alone": None,
                  "n-gram": {"method": "ngram", "num_speculative_tokens": 4},
                  "draft: itself": {"model": str(DEFAULT_MODEL), "num_speculative_tokens": 4},
                  "draft: its first layer": {"model": str(first_layers(Path(folder), 1)), "num_speculative_tokens": 3}}
        engines = {name: LLM(device="cpu", max_model_len=512, num_kv_blocks=128, speculative_config=config)
                   for name, config in setups.items()}
        rates: dict[str, list[float]] = {name: [] for name in setups}
        reference = None
        for number in range(args.rounds):
            for name in (setups if number % 2 == 0 else reversed(list(setups))):
                rate, tokens = decode_rate(engines[name], args.max_tokens)
                reference = reference or tokens
                assert tokens == reference, f"{name}: greedy output differs"
                rates[name].append(rate)
        base = statistics.median(rates["target alone"])
        print("setup                      decode tok/s  ratio  guesses kept")
        for name, llm in engines.items():
            stats, rate = llm.stats(), statistics.median(rates[name])
            kept = f"{stats.spec_accepted_tokens / stats.spec_draft_tokens:.0%}" if stats.spec_draft_tokens else "-"
            print(f"{name:25s}  {rate:12.1f}  {rate / base:5.2f}x  {kept:>12s}")


if __name__ == "__main__":
    main()
