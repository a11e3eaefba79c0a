"""Single-stream decode tokens/s of the native decoder against the torch path (PAGEGATE_KERNEL_BACKEND=reference)
on a random float32 model of a given family's block (default: a Gemma 3 270M-like block at 6 layers).

    python -m bench.native_decode [--family gemma3|gemma2|qwen3|llama] [--rounds 3] [--tokens 128]

Decode time is a generate of 1 + N tokens less a generate of 1 (the prefill), per round; the two engines
alternate, and the medians are reported."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagegate import LLM, SamplingParams

SHAPE = dict(vocab_size=32000, hidden_size=640, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=1, max_position_embeddings=1024)


def save_model(folder: Path, family: str) -> None:
    import transformers

    if family == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
        config = transformers.Gemma3TextConfig(**SHAPE, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                                               rope_parameters=rope)
    elif family == "gemma2":
        config = transformers.Gemma2Config(**SHAPE, head_dim=256, query_pre_attn_scalar=256, sliding_window=512)
    elif family == "qwen3":
        config = transformers.Qwen3Config(**SHAPE, head_dim=256)
    else:
        config = transformers.LlamaConfig(**SHAPE, head_dim=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def decode_seconds(llm: LLM, prompt: list[int], tokens: int) -> float:
    def timed(n: int) -> float:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    return timed(1 + tokens) - timed(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="gemma3", choices=["gemma3", "gemma2", "qwen3", "llama"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        save_model(Path(folder), args.family)
        engines = {}
        for name, backend in (("native", None), ("torch", "reference")):
            os.environ.pop("PAGEGATE_KERNEL_BACKEND", None)
            if backend:
                os.environ["PAGEGATE_KERNEL_BACKEND"] = backend
            engines[name] = LLM(folder, device="cpu", num_kv_blocks=64, enable_prefix_caching=False)
            assert (engines[name].engine.runner.native is not None) == (name == "native")
        os.environ.pop("PAGEGATE_KERNEL_BACKEND", None)
        prompt = list(range(10, 10 + args.prompt))
        for llm in engines.values():
            decode_seconds(llm, prompt, 8)  # warm up
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                rates[name].append(args.tokens / decode_seconds(llm, prompt, args.tokens))
    print(f"{args.family}: {SHAPE}, float32, {torch.get_num_threads()} threads, single stream, "
          f"{args.tokens} tokens after {args.prompt}")
    for name, values in rates.items():
        print(f"  {name:6s} median {statistics.median(values):7.1f} tok/s  ({', '.join(f'{v:.1f}' for v in values)})")
    print(f"  native / torch: {statistics.median(rates['native']) / statistics.median(rates['torch']):.2f}x")


if __name__ == "__main__":
    main()
