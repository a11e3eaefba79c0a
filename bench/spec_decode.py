"""N-gram speculation through the served path: `pagegate serve --speculative-config` against the same server without
it, one run, rounds alternating between the two, each through the OpenAI SDK.

    python -m bench.spec_decode [--model PATH] [--rounds 3] [--max-tokens 160] [--parallel 64] [--peer]

Workloads: copy-heavy single streams (repeat, edit or reformat a given text), open-ended single streams (where
guesses mostly fail and speculation should step aside), and `--parallel` concurrent chats (throughput). Single
streams report decode tokens/s (after the first token, streamed); greedy outputs must be identical on both
servers. Medians of the rounds, as ratios speculative / plain, drawn in docs/bench-spec-decode.png. With --peer,
llama-server on the same GGUF (plain, and `--spec-type ngram-simple --spec-draft-n-max 4`) takes the single-stream
workloads in the same alternating rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import statistics
import time
from pathlib import Path

import httpx
import openai

from bench.plots import add_png_argument, figure, save_figure, wanted
from pagegate.testing.launcher import ServerProcess

SMOLLM2 = Path(__file__).resolve().parents[1] / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PARAGRAPHS = ("The page pool holds every sequence's keys and values in fixed-size pages. A block table maps each "
              "sequence's positions to pages, so sequences grow one page at a time and share the pages of a common "
              "prefix. When the pool runs out, the scheduler swaps a sequence to CPU memory or frees it to be "
              "recomputed later. Each step, the scheduler picks the running sequences first, then the swapped ones, "
              "then new prompts, and spends a budget of tokens on them.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += "
        "item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n\n\n"
        "def format_receipt(items, tax_rate):\n    lines = []\n    for item in items:\n        lines.append(item.name)"
        "\n    lines.append(str(total_price(items, tax_rate)))\n    return lines\n")
NOTES = ("Meeting notes, 3 December. Present: Ana, Ben, Chen, Dara. Ana will update the deployment guide by Friday. "
         "Ben reported that the cache hit rate rose from 40 to 65 percent after the prefix change. Chen asked for a "
         "second review of the scheduler patch. Dara will book the room for the next planning session.")
# Copy-heavy work a 135M model does do: quoting a given text back (the shape of RAG answers and code edits)
COPY = [f"Repeat the following text exactly, word for word:\n\n{PARAGRAPHS}",
        f"Repeat the following code exactly:\n\n{CODE}",
        f"Repeat the following notes exactly, word for word:\n\n{NOTES}"]
OPEN = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain to a ten-year-old why the sky is blue.",
        "Give me five ideas for a weekend trip in the mountains, with a sentence on each."]
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def stream(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    """(decode tokens/s after the first token, the text) of one greedy streamed chat."""
    start, first, pieces, tokens = time.perf_counter(), None, [], 0
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                pieces.append(choice.delta.content)
    seconds = time.perf_counter() - (first or start)
    return (tokens - 1) / seconds, "".join(pieces)


def parallel(client: openai.OpenAI, model: str, prompts: list[str], max_tokens: int) -> float:
    """Completion tokens/s of all `prompts` at once."""
    def one(prompt: str) -> int:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=0.8, seed=len(prompt))
        return reply.usage.completion_tokens
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - start)


LLAMA_NGRAM = ("--spec-type", "ngram-simple", "--spec-draft-n-max", "4")  # llama-server's prompt lookup


def start_sides(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, str]:
    """Each server to compare, started: name -> base URL. pagegate with and without speculation; with --peer
    also llama-server on the same file, with and without its n-gram speculation."""
    base = [str(args.model), "--device", "cpu", "--grpc-port", "0", "--disable-uvicorn-access-log",
            "--max-model-len", "2048", "--max-num-seqs", str(max(args.parallel, 8))]
    sides = {"plain": stack.enter_context(ServerProcess(base)).base_url,
             "speculative": stack.enter_context(ServerProcess(
                 [*base, "--speculative-config", json.dumps(SPECULATIVE)])).base_url}
    if args.peer:
        from bench.peers import llamacpp
        from bench.peers.served import start_llama_server

        llamacpp.build()
        for name, extra in (("llama.cpp", ()), ("llama.cpp ngram", LLAMA_NGRAM)):
            process, served = start_llama_server(args.model, threads=2, streams=1, no_repack=llamacpp.repack_crashes(),
                                                 context=2048, extra=extra)
            stack.callback(process.wait, 30)
            stack.callback(process.terminate)
            sides[name] = served.base_url.removesuffix("/v1")
    return sides


def run(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {"copy": {}, "open": {}, "parallel": {}}
    with contextlib.ExitStack() as stack:
        sides = start_sides(args, stack)
        clients = {name: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
                   for name, url in sides.items()}
        model = clients["plain"].models.list().data[0].id
        crowd = [f"{OPEN[i % len(OPEN)]} (request {i})" for i in range(args.parallel)]
        for number in range(args.rounds):
            order = list(clients) if number % 2 == 0 else list(reversed(clients))
            texts: dict[str, list[str]] = {}
            for name in order:
                for kind, prompts in (("copy", COPY), ("open", OPEN)):
                    rates, outputs = zip(*(stream(clients[name], model, p, args.max_tokens) for p in prompts),
                                         strict=True)
                    results[kind].setdefault(name, []).append(statistics.median(rates))
                    texts.setdefault(name, []).extend(outputs)
                if args.parallel and not name.startswith("llama"):
                    results["parallel"].setdefault(name, []).append(
                        parallel(clients[name], model, crowd, args.parallel_tokens))
            assert texts["plain"] == texts["speculative"], "greedy outputs differ with speculation"
            if args.peer:
                same = texts["llama.cpp"] == texts["llama.cpp ngram"]
                print(f"llama.cpp's greedy outputs with and without its speculation {'agree' if same else 'differ'}")
            print(f"round {number + 1}: " + "  ".join(f"{kind} {name} {values[name][-1]:.1f}"
                                                      for kind, values in results.items() for name in values),
                  flush=True)
        text = httpx.get(sides["speculative"] + "/metrics").text
        drafted, kept = (metric(text, f"vllm:spec_decode_num_{name}_tokens_total") for name in ("draft", "accepted"))
        print(f"guessed {drafted:.0f} tokens, kept {kept:.0f} ({kept / max(drafted, 1):.0%})")
    return results


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def report(results: dict[str, dict[str, list[float]]], png: Path | None) -> None:
    print("\nworkload   plain tok/s  speculative tok/s  ratio (medians of alternating rounds)")
    ratios = {}
    for kind, values in results.items():
        if not values:
            continue
        plain, spec = statistics.median(values["plain"]), statistics.median(values["speculative"])
        ratios[kind] = spec / plain
        print(f"{kind:9s}  {plain:11.1f}  {spec:17.1f}  {spec / plain:5.2f}x")
        if "llama.cpp" in values:
            theirs, theirs_spec = statistics.median(values["llama.cpp"]), statistics.median(values["llama.cpp ngram"])
            print(f"{'':9s}  llama-server {theirs:.1f}, with ngram-simple {theirs_spec:.1f} "
                  f"({theirs_spec / theirs:.2f}x); pagegate speculative / llama-server ngram {spec / theirs_spec:.2f}x")
    if not wanted(png):
        return
    assert png is not None
    fig, axes = figure(width=5.0, height=2.8)
    kinds = list(ratios)
    axes.bar(kinds, [ratios[k] for k in kinds], color="#2a9d8f")
    axes.axhline(1.0, color="#8d99ae", lw=1)
    axes.set(title="n-gram speculation / plain (served, SmolLM2-135M Q4_1)", ylabel="tokens/s ratio")
    for i, kind in enumerate(kinds):
        axes.text(i, ratios[kind], f"{ratios[kind]:.2f}x", ha="center", va="bottom")
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--parallel", type=int, default=64)
    parser.add_argument("--parallel-tokens", type=int, default=32)
    parser.add_argument("--peer", action="store_true",
                        help="also llama-server on the same file, with and without --spec-type ngram-simple")
    add_png_argument(parser, "spec-decode")
    args = parser.parse_args(argv)
    report(run(args), args.png)


if __name__ == "__main__":
    main()
