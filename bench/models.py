"""Several models behind one `pagegate serve`.

    python -m bench.models [--model A.gguf --model B.gguf] [--rounds 3] [--max-tokens 8]
    python -m bench.models --shared-budget [--budget 24MiB] [--phases 4] [--concurrency 4] [--prompt 64] [--gen 128]

Switching (the default): what a switch costs as a client sees it, the time to the first streamed token of a short
greedy completion, for a model that is loaded, asleep (idle past --sleep-idle-seconds 2: pagegate frees its KV
pages and keeps its weights, llama-server's child frees the model), and unloaded (--models-max 1: the other model
is unloaded and this one starts), on pagegate and on llama-server's router (`--models-dir` with the same files,
bench/peers/router.py). Each round starts both servers fresh.

--shared-budget: two models whose traffic shifts (phases of `concurrency` requests at once to one model, then to
the other, with an idle gap between), served by one server whose --kv-cache-memory is `budget` for both, against
two servers given half of it each. Reported: output tokens per second within the phases (median over phases, the
first phase of each model left out as warm-up), and the most pages the busy model's pool held in a phase (sampled
from /metrics). On the shared server the pool of the model in its phase grows in place while its requests lack
pages, up to all the budget but the idle model's floor (pagegate/gateway/model_slots.py), and gives it back after
2 s idle; on the split ones each pool is half the budget. The shared server wins where a phase needs more pages than
half the budget and the CPUs could run more sequences than half of it holds. Defaults: SmolLM2's float16 pages take
23,040 bytes a token, so 24 MiB holds 1,092 tokens (68 pages of 16); the idle model keeps a floor of 13 (one
--max-model-len sequence), so the busy one may grow to 55 pages, where its 4 requests of 192 tokens need 48; half
the budget (34 pages) holds two of them. Time it on a quiet machine: the cores' OpenMP threads slow down many
times over when another job takes a CPU.

Default models: SmolLM2-135M-Instruct Q4_1 (.cache/models) served twice under two names.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.peers.router import llama_router
from pagegate.config import parse_bytes
from pagegate.testing.launcher import ServerProcess

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
NAMES = ("first", "second")
PROMPT = "Write one sentence about paged attention."
SLEEP_IDLE_S = 2  # switching: both servers put a model idle this long to sleep
IDLE_GAP_S = 2.5  # between two phases: past the 2 s after which a model asked again may take idle pages
SAMPLE_S = 0.25  # how often a phase's pool size is read from /metrics


DROPPED: list[str] = []  # "server: model" of each request whose connection was dropped (then retried)


def first_token_s(http: httpx.Client, model: str, max_tokens: int) -> float:
    """Seconds to the first streamed token of one greedy completion (its whole answer is read). A dropped
    connection is retried, as the openai SDK does, the time counted from the first try (llama-server's router drops
    some requests to a sleeping model)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started, first = time.perf_counter(), None
    for attempt in range(3):
        try:
            with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - started
            break
        except httpx.RemoteProtocolError:
            DROPPED.append(f"{http.base_url}: {model}")
            if attempt == 2:
                raise
    assert first is not None, "no token came back"
    return first


def switch_costs(base_url: str, max_tokens: int) -> dict[str, float]:
    """First tokens of `first` warm, then asleep (idle past SLEEP_IDLE_S), then of `second`, loaded in its place
    (--models-max 1)."""
    with httpx.Client(base_url=base_url, timeout=600) as http:
        first_token_s(http, NAMES[0], max_tokens)  # loads it (llama-server's router) and warms it
        loaded = first_token_s(http, NAMES[0], max_tokens)
        time.sleep(SLEEP_IDLE_S + 2)
        asleep = first_token_s(http, NAMES[0], max_tokens)
        unloaded = first_token_s(http, NAMES[1], max_tokens)
    return {"loaded": loaded, "asleep": asleep, "unloaded": unloaded}


def one_round(models: list[str], max_tokens: int, threads: int, extra: list[str]) -> dict[str, dict[str, float]]:
    """pagegate and llama-server's router, each fresh, with the same two files, --models-max 1 and idle sleep."""
    args = [arg for path in models for arg in ("--model", path)]
    args += ["--served-model-name", *NAMES, "--models-max", "1", "--sleep-idle-seconds", str(SLEEP_IDLE_S),
             "--disable-uvicorn-access-log", "--grpc-port", "0", *extra]
    with ServerProcess(args) as server:
        pagegate = switch_costs(server.base_url, max_tokens)
    files = {name: Path(path) for name, path in zip(NAMES, models, strict=True)}
    with llama_router(files, threads, models_max=1, sleep_idle_s=SLEEP_IDLE_S) as base_url:
        llama = switch_costs(base_url, max_tokens)
    return {"pagegate": pagegate, "llama-server router": llama}


def phase(base_url: str, model: str, requests: list[list[int]], gen: int) -> tuple[int, float]:
    """`requests` at once to `model` (greedy, exactly `gen` tokens each): output tokens and seconds."""
    def one(prompt: list[int]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": gen, "temperature": 0, "ignore_eos": True}
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        tokens = sum(pool.map(one, requests))
    return tokens, time.perf_counter() - started


def pool_pages(base_url: str) -> dict[str, int]:
    """Each model's KV pages now: a shared server's per-model pools, or a one-model server's pool."""
    text = httpx.get(base_url + "/metrics", timeout=60).text
    shared = re.findall(r'^pagegate:model_kv_blocks_total\{model_name="([^"]+)"\} (\S+)', text, re.M)
    if shared:
        return {name: int(float(pages)) for name, pages in shared}
    return {name: int(pages) for name, pages in re.findall(r'^vllm:cache_config_info\{.*?model_name="([^"]+)".*?'
                                                             r'num_gpu_blocks="(\d+)"', text, re.M)}


class PeakPages:
    """The most pages `model`'s pool held while a phase ran, sampled every SAMPLE_S."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url, self.model, self.peak = base_url, model, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakPages:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._done.wait(SAMPLE_S):
            self.peak = max(self.peak, pool_pages(self.base_url).get(self.model, 0))


def shifting_traffic(urls: dict[str, str], args: argparse.Namespace) -> tuple[list[float], list[int]]:
    """Phases alternating between the two models (each preceded by an idle gap); tokens/s of each phase and the
    most pages the model in its phase held."""
    rng = random.Random(0)
    rates, peaks = [], []
    for index in range(args.phases + 2):
        time.sleep(IDLE_GAP_S)
        model = NAMES[index % 2]
        prompts = [[rng.randrange(10, 250) for _ in range(args.prompt)] for _ in range(args.concurrency)]
        with PeakPages(urls[model], model) as pages:
            tokens, seconds = phase(urls[model], model, prompts, args.gen)
        if index >= 2:  # each model's first phase warms it
            rates.append(tokens / seconds)
            peaks.append(pages.peak)
    return rates, peaks


def shared_budget(models: list[str], args: argparse.Namespace) -> dict[str, tuple[list[float], list[int]]]:
    common = ["--disable-uvicorn-access-log", "--grpc-port", "0", "--kv-cache-dtype", "float16",
              "--max-model-len", str(args.prompt + args.gen + 16), *args.extra]
    half = str(parse_bytes(args.budget) // 2)
    shared_args = [a for path in models for a in ("--model", path)]
    shared_args += ["--served-model-name", *NAMES, "--models-max", "2", "--kv-cache-memory", args.budget, *common]
    with ServerProcess(shared_args) as server:
        for name in NAMES:
            httpx.post(server.base_url + "/models/load", json={"model": name}, timeout=600).raise_for_status()
        shared = shifting_traffic(dict.fromkeys(NAMES, server.base_url), args)
    split_args = [[path, "--served-model-name", name, "--kv-cache-memory", half, *common]
                  for path, name in zip(models, NAMES, strict=True)]
    with ServerProcess(split_args[0]) as first, ServerProcess(split_args[1]) as second:
        split = shifting_traffic({NAMES[0]: first.base_url, NAMES[1]: second.base_url}, args)
    return {"one server, shared budget": shared, "two servers, half each": split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, help="two model files (default: SmolLM2 twice)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    parser.add_argument("--shared-budget", action="store_true", help="the shifting-traffic comparison instead")
    parser.add_argument("--budget", default="24MiB", help="--kv-cache-memory of the shared server")
    parser.add_argument("--phases", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens of each request")
    parser.add_argument("--gen", type=int, default=128, help="output tokens of each request")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `pagegate serve` flags")
    args = parser.parse_args()
    models = args.model or [str(SMOLLM2), str(SMOLLM2)]
    if len(models) != 2:
        raise SystemExit("give two --model (or none)")
    if args.shared_budget:
        results = shared_budget(models, args)
        print(f"budget {args.budget}; {args.phases} phases of {args.concurrency} requests x {args.prompt} prompt + "
              f"{args.gen} output tokens")
        print("| setup | output tok/s in a phase (median) | pages of the busy model's pool (median of peaks) |")
        print("|---|---|---|")
        for setup, (rates, peaks) in results.items():
            print(f"| {setup} | {statistics.median(rates):.1f} | {statistics.median(peaks):.0f} |")
        print(json.dumps(results))
        return
    rounds = [one_round(models, args.max_tokens, args.threads, args.extra) for _ in range(args.rounds)]
    servers = list(rounds[0])
    print(f"models: {models[0]} as `{NAMES[0]}`, {models[1]} as `{NAMES[1]}`; {args.rounds} round(s), "
          f"{args.max_tokens} tokens each; first token in ms (median)")
    print("| the requested model was | " + " | ".join(servers) + " |")
    print("|---|" + "---|" * len(servers))
    for case in rounds[0][servers[0]]:
        cells = [f"{statistics.median(r[server][case] for r in rounds) * 1000:.0f}" for server in servers]
        print(f"| {case} | " + " | ".join(cells) + " |")
    print(json.dumps({"rounds": rounds, "dropped and retried": DROPPED}))

if __name__ == "__main__":
    main()
