"""Every step native against the rule it replaced, in one process and alternating rounds: before issue 56 a step that
held a prompt token, or more than 16 tokens, ran the torch forward (float32 activations over dequantized weight
tiles, MKL GEMMs) and only decode steps ran the native decoder.

    python -m bench.native_steps [--model PATH] [--rounds 3] [--threads 2]

Figures (tokens/s, the engine stepped on this process's main thread as the core process runs it, no prefix cache):
prefill of 128 and 512 tokens, 64 sequences of 128 + 128 tokens, one stream decoding 128 tokens. Medians of the
rounds; the ratio is native / before.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from pagegate import LLM, SamplingParams
from pagegate.engine import runners
from pagegate.engine.models.native import NativeDecoder
from pagegate.engine.runner import ModelRunner
from pagegate.engine.scheduler import ScheduledBatch

SMOLLM2 = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def before_rule(runner: ModelRunner) -> None:
    """Make `runner` run prompt steps and steps past 16 tokens on the torch forward, as before issue 56."""
    native, execute = runner.native, runner.execute

    def execute_as_before(batch: ScheduledBatch) -> torch.Tensor:
        prompt = any(s.num_computed - n < s.num_prompt_tokens for s, n in zip(batch.seqs, batch.num_tokens, strict=True))
        runner.native = None if prompt or sum(batch.num_tokens) > 16 else native
        try:
            return execute(batch)
        finally:
            runner.native = native

    runner.execute = execute_as_before  # type: ignore[method-assign]


class Workload:
    def __init__(self, llm: LLM) -> None:
        self.llm, self.rng = llm, np.random.default_rng(0)
        self.vocab = llm.engine.model_config.vocab_size

    def run(self, sequences: int, prompt: int, gen: int) -> float:
        """Seconds for `sequences` random prompts of `prompt` tokens to generate `gen` tokens each."""
        prompts = [{"prompt_token_ids": self.rng.integers(10, self.vocab, prompt).tolist()} for _ in range(sequences)]
        params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
        start = time.perf_counter()
        self.llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    def figures(self) -> dict[str, float]:
        first = self.run(1, 16, 1)
        return {"prefill 128": 128 / self.run(1, 128, 1), "prefill 512": 512 / self.run(1, 512, 1),
                "64 x (128 + 128)": 64 * 256 / self.run(64, 128, 128),
                "decode 128": 127 / max(self.run(1, 16, 128) - first, 1e-9)}


def measure(model: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    llm = LLM(model, max_model_len=2048, enable_prefix_caching=False, max_num_seqs=64)
    assert llm.engine.runner.chunk_invariant, "the native decoder does not take this model"
    native = Workload(llm)
    runs_native = runners.runs_native
    runners.runs_native = lambda config, elastic=False: False  # the torch runner, whose steps before_rule splits
    try:
        before_llm = LLM(model, max_model_len=2048, enable_prefix_caching=False, max_num_seqs=64)
    finally:
        runners.runs_native = runs_native
    assert isinstance(before_llm.engine.runner.native, NativeDecoder)
    before_rule(before_llm.engine.runner)
    before = Workload(before_llm)
    for workload in (native, before):
        workload.run(4, 64, 4)  # warm-up
    results: dict[str, dict[str, list[float]]] = {"native": {}, "before": {}}
    for _ in range(rounds):
        for name, workload in (("native", native), ("before", before)):
            for figure, value in workload.figures().items():
                results[name].setdefault(figure, []).append(value)
    return results


def table(results: dict[str, dict[str, list[float]]], describe: Callable[[str], str] = str) -> str:
    lines = ["| figure | every step native | before (prompts on torch) | ratio |", "|---|---|---|---|"]
    for figure, values in results["native"].items():
        native, before = statistics.median(values), statistics.median(results["before"][figure])
        lines.append(f"| {describe(figure)} | {native:.1f} | {before:.1f} | {native / before:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(table(measure(args.model, args.rounds)))


if __name__ == "__main__":
    main()
