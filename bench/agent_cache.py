"""Prompt-cache breakpoints against an agent's workload: the next turn's TTFT with and without them (issue 61).

    python -m bench.agent_cache [--system-tokens 2000] [--sessions 3] [--turns 3] [--streams 8] [--rounds 1]
    python -m bench.agent_cache --system-tokens 6000 --sessions 8 --turns 10 --streams 16 \
        --kv-cache-memory 768MiB --max-pinned-fraction 0.8      # the issue's full size (~1 h here)

One server (SmolLM2 Q4_1) with a pool small enough that other traffic evicts what nobody pins (`--kv-cache-memory`,
`--max-pinned-fraction`). Per mode (`cache_control` on the system block, or none), in alternating rounds, each on a
fresh server: `--sessions` agent sessions, each a long system prompt of its own (`--system-tokens`) after the same four
tool definitions, and `--turns` turns of a growing conversation through the official `anthropic` SDK (streamed
`/v1/messages`), the sessions taking turns one after another with a pause of `--gap` seconds; beside them `--streams`
unrelated streamed chats (a fresh prompt of `--other-tokens` each, `--max-tokens` tokens) one after another through the
`openai` SDK, filling the pool, and going on for `--after` seconds once the sessions end (their pins still held). Each
mode and round has system prompts of its own.

Goals: turn N+1's TTFT (turns after the first, median) with breakpoints at most 0.15x without; the unrelated streams'
output tok/s within 10% either way. Printed beside it: the unrelated streams' tok/s in the `--after` window, with the
pins held against without them (what the pinned pages cost them, apart from the prefills the pins save).
bench/results/agent_cache.json keeps every turn; the PNG (docs/bench-agent-cache.png) draws TTFT per turn in both modes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anthropic
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.plots import add_png_argument, figure, save_figure, wanted  # noqa: E402
from bench.served_bench import RESULTS, serve_args, served_parser  # noqa: E402
from pagegate.testing.launcher import ServerProcess  # noqa: E402

TEXT = ROOT / "bench/data/kjv_genesis_joseph.txt"
TOOLS = [{"name": name, "description": f"{what} The agent calls it when the user's question needs it.",
          "input_schema": {"type": "object", "properties": {arg: {"type": "string", "description": f"the {arg}"}},
                           "required": [arg]}}
         for name, what, arg in (("read_file", "Reads a file of the workspace and returns its text.", "path"),
                                 ("search", "Searches the reference material for a phrase.", "phrase"),
                                 ("run_command", "Runs a shell command in the workspace.", "command"),
                                 ("write_file", "Writes text to a file of the workspace.", "path"))]


@dataclass
class Mode:
    """One mode's figures in one round."""

    breakpoints: bool
    ttft: list[list[float]] = field(default_factory=list)  # per session, per turn (seconds)
    cached: list[list[int]] = field(default_factory=list)  # per session, per turn: cache_read_input_tokens
    other_tokens: int = 0
    seconds: float = 0.0
    after_tokens: int = 0  # the unrelated streams' once the sessions ended, their pins (if any) still held
    after_seconds: float = 0.0
    after: bool = False

    def next_turns(self) -> list[float]:
        return [t for turns in self.ttft for t in turns[1:]]

    @property
    def other_tok_s(self) -> float:
        return self.other_tokens / self.seconds if self.seconds else 0.0

    @property
    def after_tok_s(self) -> float:
        return self.after_tokens / self.after_seconds if self.after_seconds else 0.0


def words(n: int, seed: int) -> str:
    """About n tokens of the shipped text, from a place that depends on seed (each session its own prompt)."""
    text = TEXT.read_text(encoding="utf-8").split()
    start = random.Random(seed).randrange(len(text) // 2)
    return " ".join((text * 2)[start:start + int(n * 0.75)])


async def session(client: anthropic.AsyncAnthropic, model: str, index: int, mode: Mode, args: argparse.Namespace,
                  turn_gate: list[asyncio.Event], seed: int) -> None:
    # each mode and round its own prompts: pins taken in one mode must not serve the other
    system = f"You are agent {seed}-{index}. Your reference material follows.\n" + words(args.system_tokens, seed)
    block: dict = {"type": "text", "text": system}
    if mode.breakpoints:
        block["cache_control"] = {"type": "ephemeral"}
    messages: list[dict] = []
    ttfts, cached = [], []
    for turn in range(args.turns):
        await turn_gate[turn * args.sessions + index].wait()
        messages.append({"role": "user", "content": f"Turn {turn}: what does verse {turn + index} say?"})
        sent, first, text = time.perf_counter(), None, []
        async with client.messages.stream(model=model, max_tokens=16, system=[block], messages=messages,
                                          tools=TOOLS) as stream:
            async for piece in stream.text_stream:
                first = first or time.perf_counter()
                text.append(piece)
            final = await stream.get_final_message()
        ttfts.append((first or time.perf_counter()) - sent)
        cached.append(final.usage.cache_read_input_tokens or 0)
        messages.append({"role": "assistant", "content": "".join(text) or "..."})
        if turn * args.sessions + index + 1 < len(turn_gate):
            await asyncio.sleep(args.gap)
            turn_gate[turn * args.sessions + index + 1].set()
    mode.ttft.append(ttfts)
    mode.cached.append(cached)


async def other_stream(client: openai.AsyncOpenAI, model: str, index: int, mode: Mode, args: argparse.Namespace,
                       done: asyncio.Event) -> None:
    """Unrelated chats one after another (a fresh prompt each: they only fill the pool) until the sessions end."""
    n = 0
    while not done.is_set():
        prompt = words(args.other_tokens, 10_000 + 100 * index + n)
        stream = await client.chat.completions.create(
            model=model, stream=True, max_tokens=args.max_tokens, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": f"{index}-{n}: summarise: {prompt}"}],
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None and not done.is_set():
                if mode.after:
                    mode.after_tokens += chunk.usage.completion_tokens
                else:
                    mode.other_tokens += chunk.usage.completion_tokens
        n += 1


async def run_mode(base_url: str, model: str, breakpoints: bool, args: argparse.Namespace, round_no: int) -> Mode:
    mode = Mode(breakpoints)
    agents = anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    others = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    gates = [asyncio.Event() for _ in range(args.sessions * args.turns)]
    done = asyncio.Event()
    started = time.perf_counter()
    streams = [asyncio.ensure_future(other_stream(others, model, i, mode, args, done)) for i in range(args.streams)]
    await asyncio.sleep(args.gap)  # the pool fills first
    gates[0].set()
    seed = 1000 * round_no + 100 * breakpoints
    await asyncio.gather(*(session(agents, model, i, mode, args, gates, seed + i) for i in range(args.sessions)))
    mode.seconds = time.perf_counter() - started
    mode.after = True
    await asyncio.sleep(args.after)
    mode.after_seconds = time.perf_counter() - started - mode.seconds
    done.set()
    await asyncio.gather(*streams)
    await agents.close()
    await others.close()
    return mode


async def measure(base_url: str, breakpoints: bool, args: argparse.Namespace, round_no: int) -> Mode:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused") as client:
        model = (await client.models.list()).data[0].id
    mode = await run_mode(base_url, model, breakpoints, args, round_no)
    print(f"{'breakpoints' if breakpoints else 'none':>11}: next-turn TTFT median "
          f"{statistics.median(mode.next_turns()) * 1000:.0f} ms, cache reads {mode.cached}, "
          f"unrelated {mode.other_tok_s:.1f} tok/s, after the sessions {mode.after_tok_s:.1f}", flush=True)
    return mode


def bench(args: argparse.Namespace) -> list[dict[str, Mode]]:
    """Alternating rounds; each mode on a server of its own, so that one mode's pins never shrink the other's pool."""
    pool = ["--kv-cache-memory", args.kv_cache_memory, "--max-pinned-fraction", str(args.max_pinned_fraction),
            "--max-model-len", "8192"]
    rounds = []
    for r in range(args.rounds):
        measured = {}
        for breakpoints in (False, True) if r % 2 == 0 else (True, False):
            with ServerProcess(serve_args(args, *pool)) as server:
                mode = asyncio.run(measure(server.base_url, breakpoints, args, r))
            measured["breakpoints" if breakpoints else "none"] = mode
        rounds.append(measured)
    return rounds


def report(rounds: list[dict[str, Mode]]) -> dict[str, float]:
    def median(name: str, of) -> float:
        return statistics.median(of(r[name]) for r in rounds)
    figures = {"ttft_next_turn_breakpoints": median("breakpoints", lambda m: statistics.median(m.next_turns())),
               "ttft_next_turn_none": median("none", lambda m: statistics.median(m.next_turns())),
               "other_tok_s_breakpoints": median("breakpoints", lambda m: m.other_tok_s),
               "other_tok_s_none": median("none", lambda m: m.other_tok_s),
               "after_tok_s_breakpoints": median("breakpoints", lambda m: m.after_tok_s),
               "after_tok_s_none": median("none", lambda m: m.after_tok_s)}
    ttft = figures["ttft_next_turn_breakpoints"] / figures["ttft_next_turn_none"]
    other = figures["other_tok_s_breakpoints"] / figures["other_tok_s_none"]
    print(f"\nmedians of {len(rounds)} round(s):")
    print(f"next turn's TTFT {figures['ttft_next_turn_none'] * 1000:.0f} ms without breakpoints, "
          f"{figures['ttft_next_turn_breakpoints'] * 1000:.0f} ms with: {ttft:.2f}x "
          f"{'✓' if ttft <= 0.15 else '✗'} (goal ≤ 0.15x)")
    print(f"unrelated streams {figures['other_tok_s_none']:.1f} tok/s without, {figures['other_tok_s_breakpoints']:.1f} "
          f"with: {other:.2f}x {'✓' if 0.9 <= other <= 1.1 else '✗'} (goal within 10%)")
    after = figures["after_tok_s_breakpoints"] / figures["after_tok_s_none"]
    print(f"after the sessions, their pins held: unrelated streams {figures['after_tok_s_none']:.1f} tok/s without, "
          f"{figures['after_tok_s_breakpoints']:.1f} with: {after:.2f}x (what the pins' pages cost them)")
    return figures


def draw(rounds: list[dict[str, Mode]], path: Path) -> None:
    fig, ax = figure()
    for name, style in (("none", "--o"), ("breakpoints", "-o")):
        turns = [statistics.median(t[k] for r in rounds for t in r[name].ttft) * 1000
                 for k in range(len(rounds[0][name].ttft[0]))]
        ax.plot(range(1, len(turns) + 1), turns, style, label="cache_control breakpoints" if name != "none"
                else "no breakpoints")
    ax.set(xlabel="turn", ylabel="TTFT, median over sessions (ms)", title="agent sessions beside unrelated streams")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = served_parser(__doc__)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens an unrelated stream's answer takes")
    parser.add_argument("--other-tokens", type=int, default=300, help="tokens of an unrelated stream's prompt")
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between one turn's end and the next turn")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--after", type=float, default=20.0,
                        help="seconds the unrelated streams go on once the sessions end (their pins still held)")
    parser.add_argument("--kv-cache-memory", default="192MiB", help="the pool: small enough that the streams evict")
    parser.add_argument("--max-pinned-fraction", type=float, default=0.4)
    add_png_argument(parser, "agent-cache")
    args = parser.parse_args()
    rounds = bench(args)
    figures = report(rounds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "agent_cache.json").write_text(json.dumps(
        {"args": vars(args) | {"png": str(args.png)}, "figures": figures,
         "rounds": [{name: asdict(m) for name, m in r.items()} for r in rounds]}, indent=1))
    if wanted(args.png):
        draw(rounds, args.png)


if __name__ == "__main__":
    main()
