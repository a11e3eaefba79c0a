"""Randomly initialised Llamas for the llama.cpp comparison: only speed is judged, so no weights are downloaded.

    python -m bench.peers.random_models llama1b    # build the Llama 3.2 1B-shaped Q4_K_M GGUF once, print its path

Both use the default model's byte-level BPE tokenizer; the converter pads its vocabulary with unused tokens up
to the config's `vocab_size`, so the embedding table and the logits have the shape the config names.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from bench.peers import llamacpp
from pagegate.engine.loading.loader import DEFAULT_MODEL

MODELS = llamacpp.CACHE / "models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# the default model's tokenizer: <bos> 0, <eos> 1 (Llama 3.2's own ids would name padding tokens here)
SPECIAL_IDS: dict[str, Any] = {"bos_token_id": 0, "eos_token_id": 1}
LLAMA_100M: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
# Llama 3.2 1B's config.json, as far as LlamaConfig takes it (transformers 5 keeps RoPE in rope_parameters)
LLAMA_3_2_1B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
LLAMA_1B = "llama-1b-random"  # no dots: the intermediate files' names are made from it
LLAMA_1B_GGUF = MODELS / f"{LLAMA_1B}.Q4_K_M.gguf"


def random_llama(folder: Path, shape: dict[str, Any], dtype: torch.dtype = torch.float32) -> Path:
    """A Llama of `shape` with random weights (seed 0) in `dtype`, saved by transformers with the default model's
    tokenizer; once: a finished folder is reused. Written to a sibling first, so a half-written one never is."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, **SPECIAL_IDS)
    model = LlamaForCausalLM._from_config(config, dtype=dtype)
    partial = folder.with_name(folder.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    del model
    for name in TOKENIZER_FILES:
        (partial / name).write_bytes((DEFAULT_MODEL / name).read_bytes())
    partial.rename(folder)
    return folder


def llama_100m() -> Path:
    """The random 100M Llama (float32), as a Hugging Face folder."""
    return random_llama(MODELS / "llama-100m", LLAMA_100M)


def llama_1b_q4km() -> Path:
    """The random Llama 3.2 1B-shaped model as a Q4_K_M GGUF, built once: float16 weights (2.5 GB, where float32
    would take 5) -> llama.cpp's converter to an F16 GGUF -> llama-quantize. The folder and the F16 file are
    deleted once the Q4_K_M file exists (a failed build leaves them for the next try)."""
    if LLAMA_1B_GGUF.is_file():
        return LLAMA_1B_GGUF
    folder = random_llama(MODELS / f"{LLAMA_1B}-hf", LLAMA_3_2_1B, torch.float16)
    f16 = llamacpp.convert(folder, MODELS / f"{LLAMA_1B}.F16.gguf", outtype="f16")
    llamacpp.quantize(f16, LLAMA_1B_GGUF)
    shutil.rmtree(folder)
    f16.unlink()
    return LLAMA_1B_GGUF


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=("llama100m", "llama1b"))
    args = parser.parse_args()
    start = time.perf_counter()
    path = llama_100m() if args.model == "llama100m" else llama_1b_q4km()
    print(f"{path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
