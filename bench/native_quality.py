"""Issue 56's quality goal: the native step (activations rounded to 8 bits per 32 values, integer dot products: what
the server runs) against the float32 torch path (`PAGEGATE_KERNEL_BACKEND=reference`: the file's exact weights,
float32 activations) on the same GGUF file and bench/kv_quality.py's text:

1. perplexity over the text, native / torch: goal within +0.5%;
2. greedy decoding judged by the torch path: the native step's greedy continuations of prompts cut from the text,
   scored by the torch path (teacher forcing on the native choices); each token's gap is the torch path's best
   logprob less the chosen token's. Goal: within 0.3 nats a token (the mean; the worst is reported beside it).

    python -m bench.native_quality [--model GGUF] [--tokens N] [--decode 64]

Prints both figures and writes bench/results/native_quality.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from bench.kv_quality import (
    RESULTS,
    SMOLLM2,
    TEXT,
    cut_prompts,
    greedy,
    judge,
    perplexity,
    position_nlls,
    score,
    text_tokens,
    windows,
)
from pagegate import LLM

PPL_GOAL, GAP_GOAL = 0.005, 0.3


def make(model: str, backend: str | None) -> LLM:
    """The model on the native step (backend None) or on the torch path ("reference")."""
    previous = os.environ.pop("PAGEGATE_KERNEL_BACKEND", None)
    if backend is not None:
        os.environ["PAGEGATE_KERNEL_BACKEND"] = backend
    try:
        llm = LLM(model)
    finally:
        os.environ.pop("PAGEGATE_KERNEL_BACKEND", None)
        if previous is not None:
            os.environ["PAGEGATE_KERNEL_BACKEND"] = previous
    assert llm.engine.runner.chunk_invariant == (backend != "reference")  # every step native, or every step torch
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--tokens", type=int, default=None, help="use only the text's first N tokens")
    parser.add_argument("--contexts", default="256,1024,3072", help="context lengths of the greedy prompts")
    parser.add_argument("--prompts", type=int, default=2, help="prompts of each context length")
    parser.add_argument("--decode", type=int, default=64, help="tokens decoded greedily after each prompt")
    parser.add_argument("--json", type=Path, default=RESULTS / "native_quality.json")
    args = parser.parse_args()

    native, reference = make(args.model, None), make(args.model, "reference")
    ids = text_tokens(native, TEXT, args.tokens)
    window = native.engine.max_model_len
    ppl = {name: perplexity([nll for _, nll in position_nlls(score(llm, windows(ids, window)))])
           for name, llm in (("native", native), ("torch", reference))}
    prompts = cut_prompts(ids, [int(c) for c in args.contexts.split(",")], args.prompts, args.decode)
    gaps = [gap for row in judge(reference, prompts, greedy(native, prompts, args.decode)) for gap in row]
    result = {"model": Path(args.model).name, "tokens": len(ids), "ppl_native": ppl["native"],
              "ppl_torch": ppl["torch"], "ppl_ratio": ppl["native"] / ppl["torch"],
              "gap_mean": statistics.fmean(gaps), "gap_max": max(gaps), "judged_tokens": len(gaps)}
    result["passed"] = result["ppl_ratio"] <= 1 + PPL_GOAL and result["gap_mean"] <= GAP_GOAL
    print(f"perplexity native {ppl['native']:.4f} / torch {ppl['torch']:.4f} = {result['ppl_ratio']:.4f} "
          f"(goal <= {1 + PPL_GOAL}); greedy gaps over {len(gaps)} tokens: mean {result['gap_mean']:.3f}, "
          f"max {result['gap_max']:.3f} nats (goal: mean <= {GAP_GOAL})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
