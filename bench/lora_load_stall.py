"""How long a running stream stalls while a LoRA adapter is loaded at run time (issue 64, item 6).

    python bench/lora_load_stall.py                                   # the embedded model on CPU, this checkout
    git worktree add /tmp/before <commit> && python bench/lora_load_stall.py --checkout /tmp/before   # "before"

It launches a server (`--enable-lora --allow-runtime-lora --max-lora-rank 256`), then per case streams a greedy
completion of `--tokens` tokens and, once `--after` chunks have come, POSTs /v1/load_lora_adapter with the case's
lora_path: none (the stream alone), a model's GGUF (`--model-gguf`, 253 MB for SmolLM2-135M Q4_1; a sparse 256 MB
fake when absent), a valid rank-256 adapter on every projection (~19 MB float32: read whole and accepted), and the
same with one NaN (read whole and refused). It prints, per case, the load's answer and time and the stream's longest
gap between two chunks after the load was sent. Bounded: one server, four streams, `--timeout` seconds each.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERVER_ARGS = ["--dtype", "float32", "--device", "cpu", "--grpc-port", "0", "--disable-uvicorn-access-log",
               "--enable-lora", "--allow-runtime-lora", "--max-lora-rank", "256"]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama-shaped model's config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def big_adapter(folder: Path, config: dict, rank: int, nan: bool) -> Path:
    import numpy as np

    from pagegate.testing.lora import lora_tensors, write_adapter

    tensors = lora_tensors(shapes(config), config["num_hidden_layers"], rank, 1, 0.01)
    if nan:
        last = sorted(tensors)[-1]
        tensors[last] = tensors[last].copy()
        tensors[last][-1, -1] = np.nan
    return write_adapter(folder, tensors, {"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                           "target_modules": list(MODULES)})


def fake_model_gguf(path: Path, size: int) -> Path:
    """A GGUF whose header says general.type "model", padded (sparse) to `size` bytes."""
    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value)) + value.encode()

    entry = text("general.type") + struct.pack("<I", 8) + text("model")
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry)
    os.truncate(path, size)
    return path


def stream_with_load(http: httpx.Client, model: str, path: str | None, args: argparse.Namespace) -> dict:
    """Stream a completion; after `args.after` chunks, load `path` from another thread. The chunks' arrival times,
    the load's send and answer times and status."""
    times: list[float] = []
    outcome: dict = {"sent": None}

    def load(name: str) -> None:
        outcome["sent"] = time.perf_counter()
        reply = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        outcome["status"], outcome["answered"] = reply.status_code, time.perf_counter()
        outcome["message"] = reply.text[:120]

    loader = None
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": args.tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            times.append(time.perf_counter())
            if path is not None and len(times) == args.after:
                loader = threading.Thread(target=load, args=(f"case{int(time.time() * 1000)}",))
                loader.start()
    if loader is not None:
        loader.join(args.timeout)
    return {"times": times, **outcome}


def longest_gap(times: list[float], since: float | None) -> float:
    start = since if since is not None else times[0]
    later = [t for t in times if t >= start]
    points = [start, *later]
    return max((b - a for a, b in zip(points, points[1:], strict=False)), default=0.0)


def run(base_url: str, args: argparse.Namespace, cases: dict[str, str | None]) -> None:
    with httpx.Client(base_url=base_url, timeout=args.timeout) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        stream_with_load(http, model, None, args)  # warm
        print(f"{'case':<34} {'load':>6} {'load s':>8} {'longest gap s':>14}  chunks")
        for case, path in cases.items():
            result = stream_with_load(http, model, path, args)
            load_s = result["answered"] - result["sent"] if result["sent"] else 0.0
            gap = longest_gap(result["times"], result["sent"] or result["times"][args.after - 1])
            print(f"{case:<34} {result.get('status', '-')!s:>6} {load_s:>8.3f} {gap:>14.3f}  {len(result['times'])}")
            if result.get("status", 200) != 200:
                print(f"{'':<34} {result['message']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose server runs")
    parser.add_argument("--server-args", default="", help="more flags for the server")
    parser.add_argument("--model-gguf", type=Path, default=ROOT / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--after", type=int, default=20, help="chunks of the stream before the load is sent")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    from pagegate.testing.launcher import ServerProcess

    config = json.loads((ROOT / "pagegate/engine/default_model/config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="lora-stall-") as tmp:
        gguf = args.model_gguf if args.model_gguf.is_file() else fake_model_gguf(Path(tmp) / "model.gguf", 256 << 20)
        cases: dict[str, str | None] = {
            "none (the stream alone)": None,
            f"model GGUF ({gguf.stat().st_size >> 20} MB)": str(gguf),
            "rank-256 adapter (valid)": str(big_adapter(Path(tmp) / "big", config, 256, nan=False)),
            "rank-256 adapter, one NaN": str(big_adapter(Path(tmp) / "nan", config, 256, nan=True)),
        }
        server_args = [*SERVER_ARGS, *shlex.split(args.server_args)]
        with ServerProcess(server_args, cwd=args.checkout, startup_timeout_s=args.timeout) as server:
            run(server.base_url, args, cases)


if __name__ == "__main__":
    main()
