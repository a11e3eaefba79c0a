"""Several models behind one `pagegate serve`: what switching costs, measured as a client sees it (time to the
first streamed token of a short greedy completion) for a model that is loaded, asleep (--sleep / its KV pages
freed, weights kept), and unloaded (--models-max 1: the other model is unloaded and this one's core starts).

    python -m bench.models [--model A.gguf --model B.gguf] [--rounds 3] [--max-tokens 8]

Default: SmolLM2-135M-Instruct Q4_1 (.cache/models) served twice under two names, so both sides load the same
file. Figures are medians over rounds; each round is a fresh server. The shared-budget comparison of issue 46
(two models with shifting traffic against two servers with half the memory each) is not here: the page budget is
split in fixed shares at load (pagegate/gateway/model_slots.py), so that comparison would show no difference
until shares move with demand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from pagegate.testing.launcher import ServerProcess

SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
NAMES = ("first", "second")
PROMPT = "Write one sentence about paged attention."


def first_token_s(http: httpx.Client, model: str, max_tokens: int) -> float:
    """Seconds to the first streamed token of one greedy completion (its whole answer is read)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started, first = time.perf_counter(), None
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
    assert first is not None, "no token came back"
    return first


def one_round(models: list[str], max_tokens: int, extra: list[str]) -> dict[str, float]:
    args = [arg for path in models for arg in ("--model", path)]
    args += ["--served-model-name", *NAMES, "--models-max", "1", "--disable-uvicorn-access-log", "--grpc-port", "0",
             *extra]
    with ServerProcess(args) as server, httpx.Client(base_url=server.base_url, timeout=600) as http:
        first_token_s(http, NAMES[0], max_tokens)  # the default model, loaded at start and warm
        loaded = first_token_s(http, NAMES[0], max_tokens)
        http.post("/sleep", params={"model": NAMES[0]}).raise_for_status()
        asleep = first_token_s(http, NAMES[0], max_tokens)
        unloaded = first_token_s(http, NAMES[1], max_tokens)  # --models-max 1: `first` goes, `second` loads
    return {"loaded": loaded, "asleep": asleep, "unloaded": unloaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, help="two model files (default: SmolLM2 twice)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `pagegate serve` flags")
    args = parser.parse_args()
    models = args.model or [str(SMOLLM2), str(SMOLLM2)]
    if len(models) != 2:
        raise SystemExit("give two --model (or none)")
    rounds = [one_round(models, args.max_tokens, args.extra) for _ in range(args.rounds)]
    medians = {case: statistics.median(r[case] for r in rounds) for case in rounds[0]}
    print(f"models: {models[0]} as `{NAMES[0]}`, {models[1]} as `{NAMES[1]}`; {args.rounds} round(s), "
          f"{args.max_tokens} tokens each")
    print("| the requested model was | first token (ms, median) |")
    print("|---|---|")
    for case, seconds in medians.items():
        print(f"| {case} | {seconds * 1000:.0f} |")
    print(json.dumps({"rounds": rounds}))


if __name__ == "__main__":
    main()
