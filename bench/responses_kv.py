"""A 20-turn agent-style conversation through /v1/responses: stored (previous_response_id) against the same
conversation resent whole each turn (store=False), both under page pressure from other traffic.

    python -m bench.responses_kv [--model PATH] [--turns 20] [--context 2000] [--turn-tokens 200]

Each turn appends ~turn-tokens of new text to a context that starts at ~context tokens. Before every turn,
other traffic (distinct prompts, 3/4 of what the page pool holds) runs through the server, so an unpinned
conversation's cached pages are evicted between its turns. The two conversations (different text, the same
shape) alternate turn by turn against one server; per turn the script reports prompt tokens, cached tokens and TTFT (time to the first
output_text delta, streamed), and draws them (docs/bench-responses-kv.png).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import time
from pathlib import Path

import openai

from bench.plots import add_png_argument, figure, save_figure, wanted
from pagegate.testing.launcher import ServerProcess

WORDS = ("page pool block table prefix cache swap token model kernel batch step queue stream turn agent tool "
         "result file edit patch diff test build error trace line value field schema").split()
SMOLLM2 = Path(__file__).resolve().parents[1] / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def text_of(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ttft_turn(client: openai.OpenAI, model: str, **request: object) -> tuple[float, object]:
    """(seconds to the first text delta, the final response) of one streamed turn."""
    start, first = time.perf_counter(), None
    with client.responses.stream(model=model, max_output_tokens=8, temperature=0, **request) as stream:
        for event in stream:
            if first is None and event.type == "response.output_text.delta":
                first = time.perf_counter() - start
        final = stream.get_final_response()
    return (first if first is not None else time.perf_counter() - start), final


def pressure(client: openai.OpenAI, model: str, rng: random.Random, tokens: int, streams: int = 4) -> None:
    """Distinct prompts, `tokens` of them in all, through /v1/completions (each evicts unpinned cached pages)."""
    prompts = [text_of(rng, tokens // streams) for _ in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda p: client.completions.create(model=model, prompt=p, max_tokens=1), prompts))


def run(args: argparse.Namespace) -> dict[str, list[tuple[int, int, float]]]:
    flags = [str(args.model), "--device", "cpu", "--grpc-port", "0", "--disable-uvicorn-access-log",
             "--max-model-len", str(args.context + args.turns * (args.turn_tokens + 40) + 256),
             "--num-kv-blocks", str(args.pool_tokens // 16), "--max-pinned-fraction", str(args.pinned_fraction)]
    rows: dict[str, list[tuple[int, int, float]]] = {"stored": [], "stateless": []}
    with ServerProcess(flags) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        rng = random.Random(0)
        conversations = {name: (text_of(rng, args.context), [text_of(rng, args.turn_tokens) for _ in range(args.turns)])
                         for name in rows}  # two conversations of one shape: neither reuses the other's pages
        previous, history = None, []
        for number in range(args.turns):
            system, turns = conversations["stored"]
            pressure(client, model, rng, args.pressure_tokens or args.pool_tokens * 3 // 4)
            first = [{"role": "user", "content": system + "\n" + turns[0]}] if previous is None else turns[number]
            seconds, stored = ttft_turn(client, model, input=first, previous_response_id=previous)
            previous = stored.id
            rows["stored"].append((stored.usage.input_tokens, stored.usage.input_tokens_details.cached_tokens,
                                   seconds))
            system, turns = conversations["stateless"]
            history.append({"role": "user", "content": system + "\n" + turns[0] if number == 0 else turns[number]})
            pressure(client, model, rng, args.pressure_tokens or args.pool_tokens * 3 // 4)
            seconds, whole = ttft_turn(client, model, input=history, store=False)
            history.append({"role": "assistant", "content": whole.output_text})
            rows["stateless"].append((whole.usage.input_tokens, whole.usage.input_tokens_details.cached_tokens,
                                      seconds))
            print(f"turn {number + 1:2d}: stored {rows['stored'][-1]}  stateless {rows['stateless'][-1]}", flush=True)
    return rows


def report(rows: dict[str, list[tuple[int, int, float]]], png: Path | None) -> None:
    print("\nturn  prompt  stored: cached  computed  TTFT ms | stateless: cached  computed  TTFT ms")
    for number, (a, b) in enumerate(zip(rows["stored"], rows["stateless"], strict=True), 1):
        print(f"{number:4d}  {a[0]:6d}  {a[1]:14d}  {a[0] - a[1]:8d}  {a[2] * 1000:7.0f} | "
              f"{b[1]:17d}  {b[0] - b[1]:8d}  {b[2] * 1000:7.0f}")
    late = slice(len(rows["stored"]) // 2, None)
    stored_ttft = statistics.median(r[2] for r in rows["stored"][late])
    stateless_ttft = statistics.median(r[2] for r in rows["stateless"][late])
    print(f"median TTFT over the second half: stored {stored_ttft * 1000:.0f} ms, stateless "
          f"{stateless_ttft * 1000:.0f} ms ({stateless_ttft / stored_ttft:.1f}x)")
    if not wanted(png):
        return
    assert png is not None
    fig, (left, right) = figure(ncols=2, width=8.0)
    for name, colour in (("stored", "#2a9d8f"), ("stateless", "#8d99ae")):
        turns = range(1, len(rows[name]) + 1)
        left.plot(turns, [r[0] - r[1] for r in rows[name]], marker="o", ms=3, color=colour, label=name)
        right.plot(turns, [r[2] * 1000 for r in rows[name]], marker="o", ms=3, color=colour, label=name)
    left.set(title="prompt tokens computed per turn", xlabel="turn", ylabel="tokens")
    right.set(title="time to first token", xlabel="turn", ylabel="ms")
    left.legend()
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--context", type=int, default=2000, help="words of the first turn's context")
    parser.add_argument("--turn-tokens", type=int, default=200, help="words each turn adds")
    parser.add_argument("--pool-tokens", type=int, default=16384, help="the KV pool, in tokens")
    parser.add_argument("--pinned-fraction", type=float, default=0.5)
    parser.add_argument("--pressure-tokens", type=int, default=0, help="other traffic per turn (0: 3/4 of the pool)")
    add_png_argument(parser, "responses-kv")
    args = parser.parse_args(argv)
    report(run(args), args.png)


if __name__ == "__main__":
    main()
