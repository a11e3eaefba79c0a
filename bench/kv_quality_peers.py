"""KV page formats against llama.cpp's KV cache types in llama-perplexity's own protocol, on the same GGUF and text.

    python -m bench.kv_quality_peers [--formats float32,int8,int4] [--peers f16,q8_0,q4_0] [--ctx 2048]

llama-perplexity cuts the text into windows of --ctx tokens and scores the second half of each (its first half is
context); pagegate's formats are scored the same way here (prompt logprobs of the same windows, positions >= ctx / 2),
so each side's rise over its own float pages is comparable (issue 59: pagegate's int4 rise at most half of
llama.cpp's q4_0, at no more bytes a token). llama.cpp runs with flash attention on (its quantized V cache needs it).
Prints both tables; needs `make bench-peers` (it builds llama-perplexity).
"""

from __future__ import annotations

import argparse
import re
import subprocess

from bench.kv_quality import SMOLLM2, TEXT, perplexity, position_nlls, score, windows
from bench.peers import llamacpp
from pagegate import LLM


def pagegate_ppl(fmt: str, ctx: int) -> float:
    llm = LLM(str(SMOLLM2), kv_cache_dtype=fmt, max_model_len=ctx + 1)
    ids = llm.get_tokenizer().encode(TEXT.read_text())
    full = [w for w in windows(ids, ctx) if len(w) == ctx]
    return perplexity([nll for pos, nll in position_nlls(score(llm, full)) if pos >= ctx // 2])


def llama_ppl(cache_type: str, ctx: int, threads: int) -> float:
    result = subprocess.run([str(llamacpp.binary("llama-perplexity")), "-m", str(SMOLLM2), "-f", str(TEXT),
                             "-c", str(ctx), "-t", str(threads), "-fa", "on", "-ctk", cache_type, "-ctv", cache_type],
                            check=True, capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no estimate: {result.stderr[-2000:]}")
    return float(found.group(1))


def table(name: str, figures: dict[str, float]) -> str:
    base = next(iter(figures.values()))
    rows = [f"| {kind} | {ppl:.4f} | {ppl / base - 1:+.2%} |" for kind, ppl in figures.items()]
    return "\n".join([f"| {name} | perplexity | rise |", "|---|---|---|", *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="float32,int8,int4", help="pagegate's, the float one first")
    parser.add_argument("--peers", default="f16,q8_0,q4_0", help="llama.cpp's -ctk/-ctv types, the float one first")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ours = {fmt: pagegate_ppl(fmt, args.ctx) for fmt in args.formats.split(",")}
    theirs = {kind: llama_ppl(kind, args.ctx, args.threads) for kind in args.peers.split(",")}
    print(table("pagegate pages", ours))
    print()
    print(table("llama.cpp cache", theirs))


if __name__ == "__main__":
    main()
