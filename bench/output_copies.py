"""What does a step's output work cost the served path per sequence, and does it grow with the answer? (issue 23,
item 4; issue 43, goal 3: deltas end to end)

Each step the engine appends a token (and logprob) to every running sequence and grows `seq.text` by a piece;
the core's `DeltaWriter` cuts what each request gained into a `RequestDelta`, the `Outputs` frame crosses the
socket (msgspec encode, decode), and the gateway's renderer appends the delta into a chunk (`ChatRenderer.update`).
Before issue 43 the gateway joined the deltas into a cumulative output again and the renderer sliced the new part
back out; the issue-23 version of this bench (git history) measured that cumulative path.

The work runs on real `Request`/`Sequence` objects holding `--tokens` outputs (and as many `Logprob`s with `--top`
alternatives, the sampler's shape), and at 0 prior tokens so any part that grows is visible; the renderer is the
real `ChatRenderer` with the model's tokenizer. The garbage collector stays on, as when serving: its young-
generation passes walk every young list, so they are part of the cost (the `gc` column: collector ms inside the
phases). The step it is compared with is a real steady-state decode step of `--seqs` sequences on the GGUF model
at a short context (256 x 2k tokens of KV do not fit here); what a 2k context adds is measured on an eighth of the
sequences and scaled up. Steps and output rounds alternate; medians (and the means) are reported.

    .venv/bin/python -m bench.output_copies [--seqs 256] [--tokens 2048] [--model PATH]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagegate.engine.llm import LLM
from pagegate.engine.outputs import Logprob
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sequence import Request, Sequence
from pagegate.engine.serving.frames import DeltaWriter, FrameReader, Outputs, ToGateway, framed
from pagegate.gateway.prepare import EnginePrompt, PreparedRequest, TokenizerLike
from pagegate.gateway.protocol import ChatCompletionRequest
from pagegate.gateway.render import ChatRenderer

MODEL = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_LEN, SHARED_PREFIX, PIECE = 128, 112, "abcd"  # ~4 characters a SmolLM2 token
PHASES = ("append", "text", "delta", "wire", "render", "gc")
Case = tuple[int | None, int]  # (top logprobs or None, prior output tokens)


# ---- the step: a real engine decoding --seqs sequences together --------------------------------------

def decoding_llm(model: str, num_seqs: int, prompt_len: int = PROMPT_LEN) -> LLM:
    """An engine whose `num_seqs` sequences are past their prefill. The prompts share a 112-token prefix,
    computed once and then served from the prefix cache, so the prefill is cheap; each sequence still
    attends over its own 128+ tokens."""
    max_len = prompt_len + 512
    llm = LLM(model, max_num_seqs=num_seqs, num_kv_blocks=num_seqs * max_len // 16 + 64, max_model_len=max_len)
    engine, rng = llm.engine, np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    prefix = rng.integers(10, vocab, SHARED_PREFIX).tolist()
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    requests = []
    for i in range(num_seqs):
        unique = rng.integers(10, vocab, prompt_len - SHARED_PREFIX).tolist()
        requests.append(engine.add_request(str(i), prefix + unique, params))
        while i == 0 and requests[0].first_token_time is None:  # cache the prefix before the others come
            engine.step()
    while not all(r.first_token_time is not None for r in requests):
        engine.step()
    return llm


def step_ms(llm: LLM) -> float:
    start = time.perf_counter()
    outputs = llm.engine.step()
    elapsed = (time.perf_counter() - start) * 1e3
    assert outputs and not any(o.finished for o in outputs), "ran past the decode budget: raise max_tokens"
    return elapsed


def long_context_ms(model: str, num_seqs: int, context: int, rounds: int) -> float:
    """What `context` tokens of context add to a decode step of `num_seqs` sequences (alternating steps of
    a short- and a long-context engine): scaled up, it estimates the step at the measured output length."""
    short, long = decoding_llm(model, num_seqs), decoding_llm(model, num_seqs, context)
    return statistics.median(step_ms(long) - step_ms(short) for _ in range(rounds))


# ---- the copies: one step's outputs, engine side and gateway side --------------------------------------

@dataclass
class Stream:
    """One running request as the engine holds it, what the core sent of it, the renderer its stream feeds."""

    request: Request
    writer: DeltaWriter
    renderer: ChatRenderer
    rng: np.random.Generator


def logprob(rng: np.random.Generator, top: int) -> Logprob:
    """The sampler's shape: the sampled token's logprob and a dict of the top alternatives, best first."""
    ids, values = rng.integers(10, 49152, top).tolist(), sorted(rng.normal(-3, 1, top).tolist(), reverse=True)
    return Logprob(ids[0], values[0], dict(zip(ids, values, strict=True)))


def make_stream(i: int, tokens: int, top: int | None, tokenizer: TokenizerLike | None) -> Stream:
    """A request whose one choice holds `tokens` outputs, its renderer caught up with them."""
    rng = np.random.default_rng(i)
    params = SamplingParams(max_tokens=tokens + 10_000, logprobs=top)
    prompt = rng.integers(10, 49152, PROMPT_LEN).tolist()
    request = Request(str(i), None, prompt, params)
    seq = Sequence(request, 0, prompt + rng.integers(10, 49152, tokens).tolist(), PROMPT_LEN,
                   logprobs=[logprob(rng, top) for _ in range(tokens)] if top else None)
    seq.text = PIECE * tokens
    request.seqs.append(seq)
    api = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "stream": True, "logprobs": top is not None, "top_logprobs": top})
    renderer = ChatRenderer(PreparedRequest(api, "m", [EnginePrompt(prompt, None)], params, 0, None),
                            tokenizer, f"chatcmpl-{i}")
    writer = DeltaWriter()
    renderer.update(0, writer.delta(request).output(None, prompt))  # the first chunk carries all so far: not timed
    return Stream(request, writer, renderer, rng)


class GcClock:
    """Nanoseconds the collector has run, from gc.callbacks."""

    def __init__(self) -> None:
        self.total, self._start = 0, 0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        else:
            self.total += time.perf_counter_ns() - self._start


def copy_round(streams: list[Stream], gc_clock: GcClock, reader: FrameReader[ToGateway]) -> dict[str, float]:
    """ms per phase of one step's output work over every stream: take a token (and its logprob), grow the
    text, cut the deltas, send them through the wire (one frame), render each into a chunk; `gc` is collector time
    inside them."""
    clock, gc_before = dict.fromkeys(PHASES, 0), gc_clock.total
    for s in streams:
        seq, top = s.request.seqs[0], s.request.params.logprobs
        lp = logprob(s.rng, top) if top else None  # the sampler's work: not timed
        t0 = time.perf_counter_ns()
        seq.token_ids.append(lp.token_id if lp else 1000)
        if lp is not None and seq.logprobs is not None:
            seq.logprobs.append(lp)
        t1 = time.perf_counter_ns()
        seq.text += PIECE
        clock["append"] += t1 - t0
        clock["text"] += time.perf_counter_ns() - t1
    t0 = time.perf_counter_ns()
    deltas = [s.writer.delta(s.request) for s in streams]
    t1 = time.perf_counter_ns()
    received = reader.feed(framed(Outputs(deltas, [])))[0]
    assert isinstance(received, Outputs)
    t2 = time.perf_counter_ns()
    for s, delta in zip(streams, received.deltas, strict=True):
        s.renderer.update(0, delta.output(None, []))
    t3 = time.perf_counter_ns()
    for phase, ns in zip(("delta", "wire", "render"), (t1 - t0, t2 - t1, t3 - t2), strict=True):
        clock[phase] += ns
    clock["gc"] = gc_clock.total - gc_before
    return {phase: ns / 1e6 for phase, ns in clock.items()}


# ---- the run and the report ----------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048, help="output tokens each sequence already holds")
    parser.add_argument("--top", type=int, default=5, help="top logprobs per token in the logprobs case")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds: a step, then copies")
    parser.add_argument("--repeats", type=int, default=8, help="copy rounds of each case per round")
    parser.add_argument("--threshold", type=float, default=0.02, help="share of a step the output work may take")
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = decoding_llm(args.model, args.seqs)
    tokenizer, gc_clock, reader = llm.get_tokenizer(), GcClock(), FrameReader(ToGateway)
    cases = {(top, n): [make_stream(i, n, top, tokenizer) for i in range(args.seqs)]
             for top in (None, args.top) for n in (0, args.tokens)}
    steps: list[float] = []
    copies: dict[Case, list[dict[str, float]]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        steps.append(step_ms(llm))
        for case, streams in cases.items():
            copies[case] += [copy_round(streams, gc_clock, reader) for _ in range(args.repeats)]
    del llm, cases
    extra = long_context_ms(args.model, args.seqs // 8, args.tokens, args.rounds) * 8
    report(args, steps, copies, statistics.median(steps) + extra)


def report(args: argparse.Namespace, steps: list[float], copies: dict[Case, list[dict[str, float]]],
           long_step: float) -> None:
    step = statistics.median(steps)
    print(f"{args.seqs} sequences; {args.rounds} rounds of a step then {args.repeats} copy rounds of each case")
    print(f"decode step, context {PROMPT_LEN}-{PROMPT_LEN + args.rounds} tokens, logprobs off: median {step:.1f} ms "
          f"(min {min(steps):.1f}); at {args.tokens} tokens of context, estimated from {args.seqs // 8} sequences: "
          f"{long_step:.0f} ms")
    print(f"{'logprobs':>8} {'prior':>6} " + " ".join(f"{p:>7}" for p in PHASES)
          + f" {'copies':>7} {'mean':>7} {'share':>7} {'at ' + str(args.tokens):>8}")
    totals = {}
    for (top, tokens), rounds in copies.items():
        sums = [sum(v for p, v in r.items() if p != "gc") for r in rounds]
        medians = " ".join(f"{statistics.median(r[p] for r in rounds):7.2f}" for p in PHASES)
        totals[top, tokens] = total = statistics.median(sums)
        print(f"{f'top {top}' if top else 'off':>8} {tokens:>6} {medians} {total:7.2f} "
              f"{statistics.mean(sums):7.2f} {total / step:7.2%} {total / long_step:8.2%}")
    print(f"ms per step for all {args.seqs} sequences, medians; copies = append + text + delta + wire + render "
          f"(gc is inside those); mean = the copies' mean")
    for top in (None, args.top):
        grown = totals[top, args.tokens] - totals[top, 0]
        print(f"logprobs {f'top {top}' if top else 'off'}: the part that grows with {args.tokens} prior tokens "
              f"{grown:.2f} ms = {grown / step:.2%} of the short step, "
              f"{grown / long_step:.2%} of the {args.tokens}-context one; it passes {args.threshold:.0%} of any step "
              f"under {grown / args.threshold:.0f} ms")
    worst = max(totals[top, args.tokens] for top in (None, args.top)) / long_step
    print(f"output work at {args.tokens} prior tokens: at most {worst:.2%} of the {args.tokens}-context step "
          f"(threshold {args.threshold:.0%})")


if __name__ == "__main__":
    main()
