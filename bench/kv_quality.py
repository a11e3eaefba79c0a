"""What each KV page format costs in quality, measured through prompt logprobs on a public-domain text.

    python -m bench.kv_quality [--model GGUF|FOLDER] [--tokens N] [--formats float32,int8,...] [--decode 64]

The text is bench/data/kjv_genesis_joseph.txt (KJV Genesis 37, 39-42: about 5,800 SmolLM2 tokens). For each format
`LLM(kv_cache_dtype=FORMAT)` (the public offline API, so whatever kernels serve that format are the ones measured):

1. **Perplexity** over the text, in windows of `--window` tokens (default: the model's length, so SmolLM2 reads the
   whole text as one window), scored by `prompt_logprobs`; its ratio to float32 pages' is the goal (issue 42: float16
   within +0.5%, int8 and fp8 within +2%).
2. **Perplexity against context length**: the same scores per `--bucket` positions of a window, drawn in
   docs/bench-kv-quality.png (left: perplexity, right: its ratio to float32 pages).
3. **Greedy decoding judged by float32**: prompts cut from the text (`--contexts` tokens of context, `--prompts`
   places each), `--decode` tokens decoded greedily on the format's pages; then float32 pages score prompt +
   continuation (teacher forcing on the format's own choices) and each continuation token's gap to float32's best
   token (top-1 logprob minus the chosen token's) is taken; the goal is every gap within 0.3 nats.

Prints a table (format, ppl, ratio, max gap, pass) and writes bench/results/kv_quality.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.plots import add_png_argument, figure, save_figure, wanted
from pagegate import LLM, SamplingParams
from pagegate.engine.outputs import Logprob

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ROOT / "bench/data/kjv_genesis_joseph.txt"
RESULTS = ROOT / "bench/results"
FORMATS = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "auto-4")
# NOTE: the issue sets +0.5% for float16 and +2% for int8/fp8; bfloat16 (8 significant bits, coarser than a scaled
# int8 row near its amax) is held to the one-byte formats' +2%; issue 59 holds int4 to +1%.
PPL_GOALS = {"float32": 0.0, "float16": 0.005, "bfloat16": 0.02, "int8": 0.02, "fp8_e4m3": 0.02, "fp8_e5m2": 0.02,
             "int4": 0.01}
AUTO_4_BYTES = 7500  # auto-4's bytes a token at most (issue 59)
GAP_GOAL = 0.3  # nats: every greedily chosen token within this of float32's best at that position
TOLERANCE = 1e-9


@dataclass
class FormatResult:
    """One format's figures (the JSON's entries)."""

    ppl: float
    ratio: float = 1.0  # ppl / float32 pages' ppl
    bytes_per_token: int = 0  # K and V of a token in every layer, scales included
    buckets: list[float] = field(default_factory=list)  # ppl per bucket of window positions
    bucket_positions: list[float] = field(default_factory=list)  # each bucket's mean window position
    max_gap: float = 0.0  # nats, over every judged continuation token
    gaps: list[list[float]] = field(default_factory=list)  # per prompt, per continuation token
    diverged_at: list[int | None] = field(default_factory=list)  # first token differing from float32's greedy
    seconds: float = 0.0  # scoring + decoding on this format's pages (not judging)
    passed: bool = False


def text_tokens(llm: LLM, path: Path, limit: int | None) -> list[int]:
    """The text's token ids (as the model's tokenizer makes them), the first `limit` of them when given."""
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise SystemExit("the model has no tokenizer")
    ids = tokenizer.encode(path.read_text(encoding="utf-8"))
    return ids[:limit] if limit else ids


def windows(ids: list[int], size: int) -> list[list[int]]:
    """Non-overlapping windows of at most `size` tokens (a last window of one token scores nothing: dropped)."""
    return [ids[i:i + size] for i in range(0, len(ids), size) if len(ids[i:i + size]) > 1]


def score(llm: LLM, prompts: list[list[int]], top: int = 0) -> list[list[Logprob | None]]:
    """Each prompt's prompt logprobs (one per token, the first None), with the `top` best alternatives."""
    if not prompts:
        return []
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scored = [o.prompt_logprobs for o in outputs]
    assert all(s is not None and len(s) == len(p) for s, p in zip(scored, prompts, strict=True))
    return [s for s in scored if s is not None]


def position_nlls(scored: list[list[Logprob | None]]) -> list[tuple[int, float]]:
    """(position within its window, negative log-likelihood) of every scored token."""
    return [(pos, -lp.logprob) for window in scored for pos, lp in enumerate(window) if lp is not None]


def perplexity(nlls: list[float]) -> float:
    return math.exp(sum(nlls) / len(nlls)) if nlls else float("nan")


def bucket_perplexities(nlls: list[tuple[int, float]], width: int) -> list[tuple[float, float]]:
    """(mean position, perplexity) of the tokens at window positions [i * width, (i + 1) * width), per bucket i."""
    groups: dict[int, list[tuple[int, float]]] = {}
    for pos, nll in nlls:
        groups.setdefault(pos // width, []).append((pos, nll))
    return [(sum(p for p, _ in group) / len(group), perplexity([n for _, n in group]))
            for _, group in sorted(groups.items())]


def cut_prompts(ids: list[int], contexts: list[int], places: int, decode: int) -> list[list[int]]:
    """`places` prompts of each context length, evenly spaced over the text (each leaves room to decode after it,
    so a continuation could be compared with the text). Lengths the text cannot hold are skipped."""
    prompts = []
    for length in contexts:
        room = len(ids) - length - decode
        if room < 0:
            continue
        starts = sorted({round(room * i / max(places - 1, 1)) for i in range(places)})
        prompts += [ids[s:s + length] for s in starts]
    return prompts


def greedy(llm: LLM, prompts: list[list[int]], decode: int) -> list[list[int]]:
    """Each prompt's greedy continuation of exactly `decode` tokens."""
    if not prompts:
        return []
    params = SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def judge(reference: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
    """Per prompt, the reference's gap (nats) between its best token and the chosen one at each continuation
    position, scoring prompt + continuation as one prompt (teacher forcing on the continuation's choices)."""
    scored = score(reference, [p + c for p, c in zip(prompts, continuations, strict=True)], top=1)
    gaps = []
    for prompt, logprobs in zip(prompts, scored, strict=True):
        tail = [lp for lp in logprobs[len(prompt):] if lp is not None]
        gaps.append([max(0.0, max(lp.top.values()) - lp.logprob) for lp in tail])
    return gaps


def judged(reference: LLM, prompts: list[list[int]], continuations: list[list[int]],
           diverged_at: list[int | None], base_gaps: list[list[float]]) -> list[list[float]]:
    """judge()'s gaps, rounded; a continuation equal to float32's own (diverged_at None) takes float32's gaps.
    NOTE: scoring the same tokens again gives the same values, and skipping it saves a multi-thousand-token
    prefill per prompt and format (most continuations match float32's)."""
    todo = [i for i, d in enumerate(diverged_at) if d is not None]
    fresh = dict(zip(todo, judge(reference, [prompts[i] for i in todo], [continuations[i] for i in todo]),
                     strict=True))
    return [[round(g, 5) for g in fresh[i]] if i in fresh else base_gaps[i] for i in range(len(prompts))]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def make_llm(model: str | None, fmt: str, max_model_len: int | None) -> LLM:
    return LLM(model, kv_cache_dtype=fmt, max_model_len=max_model_len)


def measure(llm: LLM, ids: list[int], window: int, bucket: int,
            prompts: list[list[int]], decode: int) -> tuple[FormatResult, list[list[int]]]:
    """One format's perplexity (whole and per bucket) and its greedy continuations of the prompts."""
    start = time.perf_counter()
    nlls = position_nlls(score(llm, windows(ids, window)))
    continuations = greedy(llm, prompts, decode)
    buckets = bucket_perplexities(nlls, bucket)
    result = FormatResult(perplexity([n for _, n in nlls]), buckets=[p for _, p in buckets],
                          bucket_positions=[round(x, 1) for x, _ in buckets])
    result.seconds = time.perf_counter() - start
    result.bytes_per_token = llm.engine.runner.kv_bytes_per_token
    return result, continuations


def run(model: str | None, reference: LLM, formats: list[str], ids: list[int], window: int, bucket: int,
        contexts: list[int], places: int, decode: int, max_model_len: int | None = None,
        on_result: Callable[[dict[str, FormatResult]], None] | None = None) -> dict[str, FormatResult]:
    """Every format measured, judged by `reference` (the model on float32 pages, kept loaded throughout)."""
    window = min(window or reference.engine.max_model_len, reference.engine.max_model_len)
    prompts = cut_prompts(ids, contexts, places, decode)
    base, base_continuations = measure(reference, ids, window, bucket, prompts, decode)
    base.gaps = judged(reference, prompts, base_continuations, [0] * len(prompts), [])  # float32 judges itself
    results = {}
    for fmt in formats:
        if fmt == "float32":
            result, continuations = base, base_continuations
        else:
            llm = make_llm(model, fmt, max_model_len)
            result, continuations = measure(llm, ids, window, bucket, prompts, decode)
            del llm
            gc.collect()
        result.ratio = result.ppl / base.ppl
        result.diverged_at = [first_difference(c, b) for c, b in zip(continuations, base_continuations, strict=True)]
        result.gaps = judged(reference, prompts, continuations, result.diverged_at, base.gaps)
        result.max_gap = max((g for gaps in result.gaps for g in gaps), default=0.0)
        # NOTE: auto-4's goal (issue 59, goal 4) is its perplexity and bytes against uniform int4's, no gap
        result.passed = ratio_goal_met(fmt, result, results) and (fmt == "auto-4" or result.max_gap <= GAP_GOAL)
        results[fmt] = result
        print(f"{fmt}: ppl {result.ppl:.4f} (x{result.ratio:.4f}), max gap {result.max_gap:.3f} nats, "
              f"{result.seconds:.0f} s", flush=True)
        if on_result is not None:
            on_result(results)
    return results


def ratio_goal_met(fmt: str, result: FormatResult, results: dict[str, FormatResult]) -> bool:
    """Within the format's rise over float32 pages; auto-4 (issue 59): below uniform int4's, at <= 7.5 KB a token."""
    if fmt == "auto-4":
        return "int4" in results and result.ratio < results["int4"].ratio and result.bytes_per_token <= AUTO_4_BYTES
    return result.ratio <= 1 + PPL_GOALS.get(fmt, 0.02) + TOLERANCE


def table(results: dict[str, FormatResult]) -> str:
    lines = [f"{'format':<10} {'bytes':>7} {'ppl':>9} {'ratio':>8} {'goal':>7} {'max gap':>8} {'diverged':>10} "
             f"{'pass':>5}", "-" * 72]
    for fmt, r in results.items():
        diverged = sum(d is not None for d in r.diverged_at)
        goal = "< int4" if fmt == "auto-4" else "+" + format(PPL_GOALS.get(fmt, 0.02), ".1%")
        lines.append(f"{fmt:<10} {r.bytes_per_token:>7,} {r.ppl:>9.4f} {r.ratio:>8.4f} {goal:>7} {r.max_gap:>8.3f} "
                     f"{f'{diverged}/{len(r.diverged_at)}':>10} {'yes' if r.passed else 'NO':>5}")
    return "\n".join(lines)


def draw(results: dict[str, FormatResult], bucket: int, path: Path) -> None:
    fig, (left, right) = figure(ncols=2, width=9.0, height=3.4)
    base = results.get("float32")
    for fmt, r in results.items():
        xs = r.bucket_positions
        left.plot(xs, r.buckets, marker=".", label=fmt)
        if base is not None:
            right.plot(xs, [v / b for v, b in zip(r.buckets, base.buckets, strict=False)], marker=".", label=fmt)
    xlabel = f"tokens of context (buckets of {bucket} positions)"
    left.set(xlabel=xlabel, ylabel="perplexity", title="Perplexity against context length")
    right.set(xlabel=xlabel, ylabel="ratio to float32 pages", title="Relative to float32 pages (goals dotted)")
    right.axhline(1.005, color="grey", linestyle=":", linewidth=0.8)
    right.axhline(1.02, color="grey", linestyle="--", linewidth=0.8)
    left.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2), help="GGUF or folder ('' for the embedded default model)")
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--tokens", type=int, default=None, help="use only the text's first N tokens")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--window", type=int, default=0, help="tokens a window (default: the model's length)")
    parser.add_argument("--bucket", type=int, default=512, help="positions a bucket of the context-length plot")
    parser.add_argument("--contexts", default="1024,3072", help="context lengths of the greedy prompts")
    parser.add_argument("--prompts", type=int, default=2, help="prompts of each context length")
    parser.add_argument("--decode", type=int, default=64, help="tokens decoded greedily after each prompt")
    parser.add_argument("--json", type=Path, default=RESULTS / "kv_quality.json")
    add_png_argument(parser, "kv-quality")
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    started = time.perf_counter()
    model = args.model or None
    reference = make_llm(model, "float32", None)
    ids = text_tokens(reference, args.text, args.tokens)
    record = {"model": Path(args.model).name if args.model else "embedded default", "text": args.text.name,
              "tokens": len(ids), "window": args.window or reference.engine.max_model_len, "bucket": args.bucket,
              "contexts": contexts, "prompts_per_context": args.prompts, "decode": args.decode,
              "gap_goal": GAP_GOAL, "ppl_goals": PPL_GOALS}

    def save(results: dict[str, FormatResult]) -> None:
        """The JSON after every format, so a run cut short keeps what it measured."""
        record.update(seconds=round(time.perf_counter() - started, 1),
                      formats={fmt: asdict(r) for fmt, r in results.items()})
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")

    results = run(model, reference, formats, ids, args.window, args.bucket, contexts, args.prompts, args.decode,
                  on_result=save)
    print(table(results))
    print(f"wrote {args.json}")
    if wanted(args.png):
        draw(results, args.bucket, args.png)

if __name__ == "__main__":
    main()
