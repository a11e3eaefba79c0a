"""Time to first token of one image question, served: `pagegate serve model.gguf --mmproj mmproj.gguf` against
`llama-server -m model.gguf --mmproj mmproj.gguf` on the same files, both through the official OpenAI SDK.

    python -m bench.vision_served [--family smolvlm|gemma3-4b] [--rounds 3] [--threads 2] [--size 512]

The model is a random SmolVLM of SmolVLM-256M-Instruct's shapes (tests/engine/vision_models.py's SMOLVLM_256M:
30 text layers of 576, a 12-layer SigLIP of 768 on 512-pixel tiles; so a 512 x 512 image becomes 4 x 4 tiles and
the global image, 1,088 image tokens), or a random Gemma 3 of gemma-3-4b-it's widths (GEMMA3_4B: its whole
27-layer SigLIP of 1152 on 896-pixel images, 256 image tokens; 6 of its 34 text layers), converted to F16 GGUF
files by llama.cpp's own converter. Each round sends a
new random image (no side reuses an encoded image or a cached prefix) with a short question as a streamed chat
request for one token, the two servers in alternating order; TTFT is the first content chunk's arrival.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time
from pathlib import Path

import numpy as np
import openai
from PIL import Image

from bench.peers import llamacpp
from bench.peers.served import start_llama_server
from bench.vision_peers import fit_for_llama_cpp
from pagegate.testing.launcher import ServerProcess
from tests.engine.vision_models import GEMMA3_4B, SMOLVLM_256M, save_gemma3_vision, save_smolvlm

WORKS = {"smolvlm": llamacpp.CACHE / "smolvlm-256m", "gemma3-4b": llamacpp.CACHE / "gemma3-4b"}
CONTEXTS = {"smolvlm": 4096, "gemma3-4b": 2048}  # each model's positions at most
QUESTION = "What does this picture show?"
RESULTS = Path("bench/results")


def make_model(family: str) -> tuple[Path, Path]:
    """The family's text GGUF and mmproj GGUF, F16 (made once)."""
    work = WORKS[family]
    folder = work / "hf"
    if not (folder / "model.safetensors").is_file():
        if family == "smolvlm":
            save_smolvlm(folder, shape=SMOLVLM_256M)
            fit_for_llama_cpp(folder)
        else:
            save_gemma3_vision(folder, shape=GEMMA3_4B)
    text = llamacpp.convert(folder, work / "text-f16.gguf", "f16")
    mmproj = llamacpp.convert(folder, work / "mmproj-f16.gguf", "f16", extra_args=("--mmproj",))
    return text, mmproj


def image_url(seed: int, size: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ttft(client: openai.OpenAI, url: str) -> float:
    """Seconds from sending the request to its first content chunk."""
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    start = time.perf_counter()
    stream = client.chat.completions.create(model="vlm", messages=[{"role": "user", "content": content}],
                                            max_tokens=1, temperature=0.0, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=tuple(WORKS), default="smolvlm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=512, help="the image's side in pixels")
    args = parser.parse_args()
    llamacpp.build()
    text, mmproj = make_model(args.family)
    pagegate = ServerProcess(["--model", str(text), "--mmproj", str(mmproj), "--served-model-name", "vlm",
                              "--max-model-len", str(CONTEXTS[args.family]), "--grpc-port", "0", "--disable-uvicorn-access-log"],
                             env={"PAGEGATE_CORE_CPUS": ",".join(map(str, range(args.threads)))}).start()
    process, served = start_llama_server(text, args.threads, 1, llamacpp.repack_crashes(), context=CONTEXTS[args.family],
                                         extra=("--mmproj", str(mmproj), "--jinja"))
    clients = {"pagegate": openai.OpenAI(base_url=pagegate.base_url + "/v1", api_key="-", timeout=900),
               "llama-server": openai.OpenAI(base_url=served.base_url, api_key="-", timeout=900)}
    try:
        for client in clients.values():  # first calls build buffers on both sides: not timed
            ttft(client, image_url(1000, args.size))
        times: dict[str, list[float]] = {name: [] for name in clients}
        for round_ in range(args.rounds):
            url = image_url(round_, args.size)
            for name in (list(clients) if round_ % 2 == 0 else list(clients)[::-1]):
                times[name].append(ttft(clients[name], url))
                print(f"round {round_}: {name} TTFT {times[name][-1]:.2f} s", flush=True)
    finally:
        pagegate.stop()
        process.terminate()
        process.wait()
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["pagegate"] / medians["llama-server"]
    print("median TTFT: " + ", ".join(f"{name} {value:.2f} s" for name, value in medians.items()) +
          f"; pagegate / llama-server = {ratio:.2f}x")
    name = "vision-served.json" if args.family == "smolvlm" else f"vision-served-{args.family}.json"
    (RESULTS / name).write_text(json.dumps({"image": args.size, "threads": args.threads, "rounds": times,
                                   "median_s": medians, "ratio": ratio}, indent=2) + "\n")


if __name__ == "__main__":
    main()
