"""pagegate's greedy tokens against llama.cpp's (`llama-server --mmproj`) and transformers' on one image, a tiny random
SmolVLM or Gemma 3. Tokens only: time to first token is bench/vision_served.py's (both servers through the SDK).

    python -m bench.vision_peers [--family smolvlm|gemma3|gemma3-4b] [--rounds 3] [--tokens 8] [--threads 2]

The model is tests/engine/vision_models.py's tiny SmolVLM or Gemma 3 (gemma3-4b: Gemma 3 at gemma-3-4b-it's widths,
6 text layers, 896-pixel images of 256 tokens), saved once under .cache/peers/ and converted
by llama.cpp's own `convert_hf_to_gguf.py` (a text GGUF and, with --mmproj, the vision GGUF); llama.cpp is built
once by `python -m bench.peers.llamacpp build`. Each round makes a new random image and sends it with the family's
chat prompt to both engines for `--tokens` greedy tokens, printed beside transformers' own. pagegate runs offline
(`LLM`) on the GGUF files with `mmproj` (the folder's own tokens are transformers'), float32 pages.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

from bench.peers import llamacpp
from bench.peers.served import start_llama_server
from pagegate import LLM, SamplingParams
from tests.engine.vision_models import GEMMA3_4B, save_gemma3_vision, save_smolvlm

QUESTION = "What is in this image?"
CONTEXT = 2048
# height, width of each family's images. SmolVLM's 300 x 200 is resized to 256 x 170 and cut into 2 x 2 tiles and the
# global image; Gemma 3's is its tower's square (56), since llama.cpp's bilinear resize (no antialiasing) is not
# Pillow's, which transformers runs: downscaled, the two give the encoder other pixels
IMAGE_SIZES = {"smolvlm": (300, 200), "gemma3": (56, 56), "gemma3-4b": (896, 896)}


def make_model(family: str) -> tuple[Path, Path, Path]:
    """The family's HF folder, its text GGUF and its mmproj GGUF (made once)."""
    work = llamacpp.CACHE / (family if family == "gemma3-4b" else f"{family}-tiny")
    folder = work / "hf"
    if not (folder / "model.safetensors").is_file():
        if family == "smolvlm":
            save_smolvlm(folder)
            fit_for_llama_cpp(folder)
        elif family == "gemma3-4b":
            save_gemma3_vision(folder, shape=GEMMA3_4B)
        else:
            save_gemma3_vision(folder)
    text = llamacpp.convert(folder, work / "text-f32.gguf", "f32")
    mmproj = llamacpp.convert(folder, work / "mmproj-f32.gguf", "f32", extra_args=("--mmproj",))
    return folder, text, mmproj


def fit_for_llama_cpp(folder: Path) -> None:
    """Two things SmolVLM's published folders have and the tiny one lacks.

    The converter picks the text model's class from `text_config.architectures` (SmolVLM's: VLlama3ForCausalLM);
    without it, it refuses Idefics3ForConditionalGeneration. And llama.cpp's idefics3 prompt (tools/mtmd/mtmd.cpp)
    looks "\\n\\n" up as one vocabulary token before the global image, while the tiny vocabulary spells it as two:
    its last merge (whose token no later merge uses) becomes "\\n" + "\\n", in both tokenizers alike."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    config_path.write_text(json.dumps(config, indent=2))
    tokenizer_path = folder / "tokenizer.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    model = tokenizer["model"]
    last = "".join(model["merges"][-1])
    model["vocab"]["ĊĊ"] = model["vocab"].pop(last)  # GPT-2's byte spelling of "\n\n"
    model["merges"][-1] = ["Ċ", "Ċ"]
    tokenizer_path.write_text(json.dumps(tokenizer, ensure_ascii=False))


def chat_prompt(folder: Path) -> str:
    """The family's chat template on one user turn (the image, then the question), its placeholder where the image
    goes (SmolVLM's `<image>`, Gemma 3's `<start_of_image>`)."""
    from transformers import AutoProcessor

    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return str(AutoProcessor.from_pretrained(folder).apply_chat_template(turn, add_generation_prompt=True))


def transformers_tokens(folder: Path, prompt: str, png: bytes, tokens: int) -> list[int]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()  # tiny: fast
    inputs = processor(text=prompt, images=[Image.open(io.BytesIO(png))], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return list(out[0, inputs["input_ids"].shape[1]:].tolist())


Run = tuple[list[int], int]  # greedy tokens, prompt tokens


def pagegate_run(llm: LLM, prompt: str, png: bytes, tokens: int) -> Run:
    """pagegate offline, on the GGUF files."""
    request = {"prompt": prompt, "multi_modal_data": {"image": Image.open(io.BytesIO(png))}}
    out = llm.generate(request, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), len(out.prompt_token_ids)


# each family's placeholder, and what llama.cpp's prompt holds for it (tools/mtmd/mtmd.cpp puts Gemma 3's image between
# <start_of_image> and <end_of_image>, and transformers' processor writes blank lines around those)
MARKERS = {"smolvlm": ("<image>", "{}"), "gemma3": ("<start_of_image>", "\n\n{}\n\n")}
MARKERS["gemma3-4b"] = MARKERS["gemma3"]


def llama_run(base: str, family: str, prompt: str, png: bytes, tokens: int) -> Run:
    """llama-server's /completion: the raw prompt with the image where the server's media marker is (random per
    server, read from /props), so no chat template of its own applies."""
    marker = httpx.get(f"{base}/props").json()["media_marker"]
    placeholder, spelling = MARKERS[family]
    body = {"prompt": {"prompt_string": prompt.replace(placeholder, spelling.format(marker)),
                       "multimodal_data": [base64.b64encode(png).decode()]},
            "n_predict": tokens, "temperature": 0, "top_k": 1, "ignore_eos": True, "cache_prompt": False,
            "return_tokens": True}
    response = httpx.post(f"{base}/completion", json=body, timeout=600)
    response.raise_for_status()
    out = response.json()
    return list(out["tokens"]), int(out["tokens_evaluated"])


def random_png(seed: int, size: tuple[int, int]) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=tuple(MARKERS), default="smolvlm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llamacpp.build()
    folder, text, mmproj = make_model(args.family)
    prompt = chat_prompt(folder)
    torch.set_num_threads(args.threads)
    llm = LLM(str(text), mmproj=str(mmproj), num_kv_blocks=CONTEXT // 16, max_model_len=CONTEXT,
              enable_prefix_caching=False, kv_cache_dtype="float32")
    process, served = start_llama_server(text, args.threads, 1, llamacpp.repack_crashes(), context=CONTEXT,
                                         extra=("--mmproj", str(mmproj)))
    base = served.base_url.removesuffix("/v1")
    try:
        for round_ in range(args.rounds):
            png = random_png(round_, IMAGE_SIZES[args.family])
            reference = transformers_tokens(folder, prompt, png, args.tokens)
            print(f"round {round_}: transformers {reference}")
            for name, (tokens, prompt_len) in (("pagegate", pagegate_run(llm, prompt, png, args.tokens)),
                                               ("llama-server", llama_run(base, args.family, prompt, png,
                                                                          args.tokens))):
                verdict = "same" if tokens == reference else "DIFFERENT"
                print(f"  {name:12s} {tokens} ({verdict}), {prompt_len} prompt tokens")
    finally:
        process.terminate()
        process.wait()


if __name__ == "__main__":
    main()
