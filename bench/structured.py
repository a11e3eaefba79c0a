"""Structured outputs: what a JSON schema costs against unconstrained decoding, in one process.

    python -m bench.structured                      # SmolLM2 (fetched by `make test`), 64 requests
    python -m bench.structured --model default --requests 64 --rounds 3

Reports output tokens/s with and without the schema (and their ratio; goal >= 0.9), the first and the
cached compile time of the schema, and the per-step cost of the masks (compute + apply) for 64 rows.
Writes docs/bench-structured.png (`--png PATH`, `--png ''` for none).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pagegate import LLM, SamplingParams
from pagegate.engine.sampling.grammar_masks import GrammarMasks, apply_allowed
from pagegate.engine.sampling.structured import StructuredOutputsParams

from .plots import COLOURS, add_png_argument, figure, labelled_bars, save_figure, wanted

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
# Long enough that no request ends before max_tokens: a list of short records.
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}}}, "required": ["people"]}


def throughput(llm: LLM, requests: int, max_tokens: int, structured: StructuredOutputsParams | None) -> float:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=structured is None,
                             structured_outputs=structured) for i in range(requests)]
    prompt = "List the people in the story as JSON."
    start = time.perf_counter()
    outputs = llm.generate([prompt] * requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def compile_times(llm: LLM) -> tuple[float, float]:
    """(first, cached) seconds to get a matcher for a schema never seen before."""
    compiler = llm.engine.intake.grammars
    assert compiler is not None
    schema = {**SCHEMA, "title": f"fresh-{time.time_ns()}"}
    start = time.perf_counter()
    compiler.matcher(StructuredOutputsParams(json=schema))
    first = time.perf_counter() - start
    cached = []
    for _ in range(20):
        start = time.perf_counter()
        compiler.matcher(StructuredOutputsParams(json=schema))
        cached.append(time.perf_counter() - start)
    return first, statistics.median(cached)


def mask_step(llm: LLM, rows: int) -> float:
    """Median seconds to compute and apply the masks of `rows` sequences mid-way through a JSON value."""
    compiler, vocab = llm.engine.intake.grammars, llm.engine.model_config.vocab_size
    assert compiler is not None
    masks = GrammarMasks(vocab)
    prefix = llm.engine.tokenizer.encode('{"people": [{"name": "Ann", "age": 3', add_special_tokens=False)
    matchers = [compiler.matcher(StructuredOutputsParams(json=SCHEMA)) for _ in range(rows)]
    for matcher in matchers:
        matcher.consume_tokens(prefix)
    logits = torch.randn(rows, vocab)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        apply_allowed(logits, range(rows), masks.allowed(masks.compute(matchers), vocab))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2), help='a model path, or "default" for the embedded one')
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    add_png_argument(parser, "structured")
    args = parser.parse_args()
    llm = LLM(None if args.model == "default" else args.model, max_num_seqs=max(args.requests, 64))
    first, cached = compile_times(llm)
    throughput(llm, 4, 8, StructuredOutputsParams(json=SCHEMA))  # warm-up
    free, constrained = [], []
    for _ in tqdm(range(args.rounds), desc="rounds", leave=False):  # interleaved: a slow minute hits both
        free.append(throughput(llm, args.requests, args.max_tokens, None))
        constrained.append(throughput(llm, args.requests, args.max_tokens, StructuredOutputsParams(json=SCHEMA)))
    free_tps, constrained_tps = statistics.median(free), statistics.median(constrained)
    print(f"model: {args.model}, {args.requests} concurrent requests, {args.max_tokens} tokens each, "
          f"median of {args.rounds} rounds")
    print(f"unconstrained: {free_tps:8.1f} output tok/s")
    print(f"JSON schema:   {constrained_tps:8.1f} output tok/s   ratio {constrained_tps / free_tps:.2f} (goal >= 0.9)")
    print(f"schema compile: first {first * 1e3:.2f} ms, cached {cached * 1e3:.3f} ms (goal < 1 ms)")
    masks = mask_step(llm, args.requests)
    print(f"masks for {args.requests} rows per step: {masks * 1e3:.2f} ms")
    if wanted(args.png):
        fig, (left, right) = figure(2, width=7, height=2.8)
        labelled_bars(left, ["unconstrained", "JSON schema"], [free_tps, constrained_tps], "{:.1f}",
                      color=[COLOURS["seed"], COLOURS["pagegate"]])
        left.set(title=f"output tokens / s (ratio {constrained_tps / free_tps:.2f}, goal >= 0.9)")
        bars = right.barh(["compile, first", "compile, cached", f"masks, {args.requests} rows a step"],
                          [first * 1e3, cached * 1e3, masks * 1e3], color=COLOURS["pagegate"])
        right.bar_label(bars, fmt="{:.3g} ms", fontsize=7)
        right.set_xscale("log")
        right.set_xlim(right=max(first, cached, masks) * 1e3 * 20)
        right.set(title="milliseconds (log)")
        fig.suptitle(f"structured outputs, {Path(args.model).name}: {args.requests} requests x {args.max_tokens} "
                     "tokens", fontsize=9)
        save_figure(fig, args.png)


if __name__ == "__main__":
    main()
