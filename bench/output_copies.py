"""Do cumulative outputs cost a step more than 2%? (issue 23, "delta outputs, if they pay").

Every step `Request.output()` copies each choice's whole token list and logprobs, and `seq.text +=` copies
the text (the last output still holds the old string). This times that work for N sequences that already
hold T output tokens, against a real decode step of N sequences on the same model, in alternating rounds.
The step runs at a short context (N x 2k tokens of KV do not fit here), so its share is an upper bound;
a second engine of N / 8 sequences at a 2k context measures what the longer attention adds, and scaled by 8
it estimates the N x 2k step.

    python -m bench.output_copies [--model PATH] [--seqs 256] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pagegate import LLM, SamplingParams
from pagegate.engine.outputs import Logprob
from pagegate.engine.sequence import Request, Sequence

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT_LEN, TOP_LOGPROBS = 128, 5


def requests_holding(num_seqs: int, num_tokens: int, logprobs: bool) -> list[Request]:
    """Requests whose one choice already holds `num_tokens` outputs (text ~4 characters a token)."""
    requests = []
    for i in range(num_seqs):
        params = SamplingParams(max_tokens=num_tokens + 1000, logprobs=TOP_LOGPROBS if logprobs else None)
        request = Request(str(i), None, list(range(PROMPT_LEN)), params)
        seq = Sequence(request, 0, list(range(PROMPT_LEN + num_tokens)), PROMPT_LEN,
                       logprobs=[_logprob() for _ in range(num_tokens)] if logprobs else None)
        seq.text = "abcd" * num_tokens
        request.seqs.append(seq)
        requests.append(request)
    return requests


def _logprob() -> Logprob:
    return Logprob(7, -0.5, {t: -1.0 - t for t in range(TOP_LOGPROBS)})


def copy_round(requests: list[Request]) -> float:
    """Seconds for one step's output work: a token (and logprob) and its text into each sequence, then
    every request's cumulative output, held as the engine's caller holds it until the next step."""
    started = time.perf_counter()
    outputs = []
    for request in requests:
        seq = request.seqs[0]
        seq.token_ids.append(7)
        if seq.logprobs is not None:
            seq.logprobs.append(_logprob())
        seq.text += "abcd"
        outputs.append(request.output())
    elapsed = time.perf_counter() - started
    del outputs
    return elapsed


def decoding_llm(model: str | None, num_seqs: int, prompt_len: int = PROMPT_LEN) -> LLM:
    """An engine with `num_seqs` sequences past their prefill, decoding together."""
    max_len = prompt_len + 256
    llm = LLM(model, max_num_seqs=num_seqs, num_kv_blocks=num_seqs * -(-max_len // 16), max_model_len=max_len)
    params = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True)
    requests = [llm.engine.add_request(str(i), [(i * 31 + j) % 1000 + 3 for j in range(prompt_len)], params)
                for i in range(num_seqs)]
    while not all(r.first_token_time is not None for r in requests):
        llm.engine.step()
    return llm


def step_time(llm: LLM) -> float:
    started = time.perf_counter()
    llm.engine.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM2) if SMOLLM2.exists() else None)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    llm = decoding_llm(args.model, args.seqs)
    cases = {(lp, t): requests_holding(args.seqs, t, lp) for lp in (False, True) for t in (0, args.tokens)}
    steps: list[float] = []
    copies: dict[tuple[bool, int], list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):  # alternating: a step, then each case's copies
        steps.append(step_time(llm))
        for case, requests in cases.items():
            copies[case].append(copy_round(requests))
    step_ms = statistics.median(steps) * 1e3
    del llm
    long_ms = 1e3 * (long_context_extra(args.model, args.seqs // 8, args.tokens, args.rounds)) * 8
    print(f"model {args.model or 'default'}: decode step of {args.seqs} sequences at ~{PROMPT_LEN + 20} "
          f"tokens of context, median of {args.rounds}: {step_ms:.1f} ms; at {args.tokens} (estimated): "
          f"{step_ms + long_ms:.1f} ms")
    print(f"{'logprobs':>8} {'prior tokens':>12} {'copies ms/step':>15} {'share, short':>13} {'share, 2k':>10}")
    for (logprobs, tokens), times in copies.items():
        ms = statistics.median(times) * 1e3
        print(f"{'on' if logprobs else 'off':>8} {tokens:>12} {ms:>15.2f} {ms / step_ms:>13.1%} "
              f"{ms / (step_ms + long_ms):>10.1%}")


def long_context_extra(model: str | None, num_seqs: int, context: int, rounds: int) -> float:
    """Seconds a decode step of num_seqs sequences gains from `context` tokens of context (alternating)."""
    short, long = decoding_llm(model, num_seqs), decoding_llm(model, num_seqs, context)
    pairs = [(step_time(short), step_time(long)) for _ in range(rounds)]
    return statistics.median(b - a for a, b in pairs)


if __name__ == "__main__":
    main()
