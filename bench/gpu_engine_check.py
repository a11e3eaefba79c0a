"""The engine on a device against the CPU: greedy agreement in float32, then tokens/s.

    python bench/gpu_engine_check.py                       # CUDA: the default model, and SmolLM2 if its GGUF is there
    python bench/gpu_engine_check.py --device cpu --quick  # a dry run of this script on a machine without a GPU

For each model, the CPU float32 run is the reference (greedy, top-2 logprobs). The device's float32 run must
give the same tokens, except after a near tie (the CPU's top two within --tie-nats), and the same logprobs
within --logprob-tol. In the model's own dtype (`auto`: bfloat16 for SmolLM2 on CUDA) agreement is reported,
not judged, and throughput is timed: one stream, then --batch requests at once. With --rows, appends markdown
table rows (check | result | figures) for bench/gpu_check.sh. Then the KV tiers on the device (host memory and disk
give back a prefix's pages with the cold run's tokens), and LoRA adapters in one mixed batch (on CUDA through the
grouped Triton kernels, kernels/triton_lora.py) against the CPU's torch path, and images on a tiny SmolVLM and a
tiny Gemma 3 (the vision encoder on the device; Gemma 3's image tokens seeing each other) against the CPU. Exits 1
when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing
from pagegate import LLM, SamplingParams  # noqa: E402
from pagegate.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pagegate.engine.lora import LoRARequest  # noqa: E402
from pagegate.engine.outputs import CompletionOutput, Logprob  # noqa: E402
from pagegate.kernels import BACKEND_ENV, resolve_backend  # noqa: E402

SMOLLM2 = ROOT / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers:",
    "A paged KV cache stores keys and values in",
    "Translate to German: good morning",
    "1, 1, 2, 3, 5, 8,",
    # long enough to span many 16-token pages, so prefill walks a real block table
    " ".join(["The quick brown fox jumps over the lazy dog."] * 40),
]


@dataclass
class Agreement:
    """How a candidate run's greedy outputs compare with the reference's, prompt by prompt."""

    identical: int = 0
    near_tie: int = 0  # diverged where the reference's top two were within tie_nats: not an error
    mismatch: int = 0
    matched_tokens: int = 0
    total_tokens: int = 0
    max_logprob_diff: float = 0.0  # over the tokens both runs chose alike

    def describe(self) -> str:
        prompts = self.identical + self.near_tie + self.mismatch
        return (f"{self.identical}/{prompts} prompts identical, {self.near_tie} near-tie divergences, "
                f"{self.mismatch} mismatches; {self.matched_tokens / max(self.total_tokens, 1):.0%} of tokens "
                f"agree, max logprob diff {self.max_logprob_diff:.1e}")


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def is_near_tie(step: Logprob, other_token: int, tie_nats: float) -> bool:
    """The candidate's token was the reference's runner-up by less than tie_nats."""
    return other_token in step.top and step.logprob - step.top[other_token] <= tie_nats


def compare(reference: list[CompletionOutput], candidate: list[CompletionOutput], tie_nats: float) -> Agreement:
    result = Agreement()
    for ref, got in zip(reference, candidate, strict=True):
        n = shared_prefix(ref.token_ids, got.token_ids)
        result.matched_tokens += n
        result.total_tokens += len(ref.token_ids)
        for a, b in zip(ref.logprobs[:n], got.logprobs[:n], strict=True):
            result.max_logprob_diff = max(result.max_logprob_diff, abs(a.logprob - b.logprob))
        if n == len(ref.token_ids) == len(got.token_ids):
            result.identical += 1
        elif n < min(len(ref.token_ids), len(got.token_ids)) and is_near_tie(ref.logprobs[n], got.token_ids[n],
                                                                              tie_nats):
            result.near_tie += 1
        else:
            result.mismatch += 1
    return result


def load(model: Path | None, device: str, dtype: str, num_kv_blocks: int) -> LLM:
    return LLM(str(model) if model else None, device=device, dtype=dtype, num_kv_blocks=num_kv_blocks, seed=0)


def release(llm: LLM) -> None:
    """Drop an engine and its KV cache before the next one is built."""
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy(llm: LLM, max_tokens: int) -> list[CompletionOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [out.outputs[0] for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def tokens_per_s(llm: LLM, num_requests: int, prompt_len: int, output_len: int) -> float:
    """Output tokens per second of LLM.generate over num_requests random-token prompts, after a warm-up."""
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(num_requests)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(num_requests)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(out.outputs[0].token_ids) for out in outputs) / elapsed


def check_model(name: str, model: Path | None, args: argparse.Namespace) -> tuple[bool, list[tuple[str, str, str]]]:
    """Reference, float32 agreement (judged), own-dtype agreement and speed (reported); (ok, table rows)."""
    rows = []
    os.environ[BACKEND_ENV] = "reference"  # the torch forward, the oracle: the native step's Q8 activations are not float32
    try:
        cpu = load(model, "cpu", "float32", args.cpu_kv_blocks)
    finally:
        del os.environ[BACKEND_ENV]
    reference = greedy(cpu, args.max_tokens)
    release(cpu)

    exact = load(model, args.device, "float32", args.kv_blocks)
    agreement = compare(reference, greedy(exact, args.max_tokens), args.tie_nats)
    release(exact)
    ok = agreement.mismatch == 0 and agreement.max_logprob_diff <= args.logprob_tol
    print(f"[{name}] {args.device} float32 vs cpu float32: {agreement.describe()} -> {'PASS' if ok else 'FAIL'}")
    rows.append((f"engine {name}: {args.device} float32 = cpu float32", "PASS" if ok else "FAIL",
                 agreement.describe()))

    own = load(model, args.device, "auto", args.kv_blocks)
    dtype = str(own.engine.runner.model.dtype).removeprefix("torch.")
    if dtype != "float32":
        loose = compare(reference, greedy(own, args.max_tokens), args.tie_nats)
        print(f"[{name}] {args.device} {dtype} vs cpu float32 (reported, not judged): {loose.describe()}")
        rows.append((f"engine {name}: {args.device} {dtype} vs cpu float32", "INFO", loose.describe()))
    single = tokens_per_s(own, 1, args.prompt_len, args.single_tokens)
    batched = tokens_per_s(own, args.batch, args.prompt_len, args.batch_tokens)
    release(own)
    speed = (f"1 stream {single:,.0f} tok/s; {args.batch} requests {batched:,.0f} tok/s "
             f"({args.prompt_len}-token prompts, {args.single_tokens}/{args.batch_tokens} tokens out)")
    print(f"[{name}] {args.device} {dtype}: {speed}")
    rows.append((f"engine {name}: speed ({args.device}, {dtype})", "INFO", speed))
    return ok, rows


def check_tiers(device: str) -> tuple[bool, tuple[str, str, str]]:
    """The KV tiers on the device: a prefix pushed out of a small pool comes back from host memory, and after a
    restart from disk, each with the tokens of its cold run (the default model, every page a 16-token copy)."""
    rng = random.Random(7)
    prefix, others = [rng.randrange(10, 2000) for _ in range(100)], [
        [rng.randrange(10, 2000) for _ in range(200)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    with tempfile.TemporaryDirectory(prefix="pagegate-gpu-tiers-") as directory:
        cache = CacheConfig(num_kv_blocks=24, kv_offload_memory="8MiB", kv_cache_dir=directory, kv_offload_min_reuse=1)
        config = EngineConfig(device=device, dtype="float32", cache=cache, scheduler=SchedulerConfig(max_model_len=256))
        llm = LLM.from_config(config)
        cold, _ = run(llm, prefix)
        for other in others:
            run(llm, other)
        host, host_cached = run(llm, prefix)
        llm.engine.close()
        release(llm)
        llm = LLM.from_config(config)
        disk, disk_cached = run(llm, prefix)
        llm.engine.close()
        release(llm)
    ok = host == cold == disk and host_cached == disk_cached == 96
    figures = f"cached tokens from host memory {host_cached}, from disk after a restart {disk_cached} (of 96)"
    print(f"[tiers] {device}: {figures}, outputs {'equal' if host == cold == disk else 'DIFFER'}")
    return ok, (f"KV tiers on {device}: pushed-out and restarted prefixes = cold", "PASS" if ok else "FAIL", figures)


def write_adapter(llm: LLM, folder: Path, seed: int, rank: int = 8) -> None:
    """A PEFT LoRA folder with random non-zero A and B for every projection the model adapts."""
    lora = llm.engine.runner.lora
    assert lora is not None
    gen, tensors = torch.Generator().manual_seed(seed), {}
    for key, target in lora.targets.items():
        layer, name = key.split(".", 1)
        shard = next(s for s in target.shards if s.name == name)
        prefix = f"base_model.model.model.layers.{layer}.{target.path.split('.')[0]}.{name}"
        tensors[f"{prefix}.lora_A.weight"] = 0.05 * torch.randn(rank, target.in_features, generator=gen)
        tensors[f"{prefix}.lora_B.weight"] = 0.05 * torch.randn(shard.columns.stop - shard.columns.start, rank,
                                                                generator=gen)
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def check_lora(args: argparse.Namespace) -> tuple[bool, tuple[str, str, str]]:
    """Two random adapters and the base model in one batch, float32: the device (on CUDA, the grouped Triton
    shrink and expand) gives the CPU torch path's tokens, except after a near tie, and its logprobs."""
    def run(on: str, loras: list[LoRARequest | None]) -> list[CompletionOutput]:
        llm = LLM(None, device=on, dtype="float32", num_kv_blocks=512, seed=0, enable_lora=True, max_lora_rank=8)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
        outputs = [out.outputs[0] for out in llm.generate(PROMPTS * 3, params, use_tqdm=False, lora_request=loras)]
        release(llm)
        return outputs

    with tempfile.TemporaryDirectory(prefix="pagegate-gpu-lora-") as directory:
        probe = LLM(None, device="cpu", dtype="float32", num_kv_blocks=256, enable_lora=True, max_lora_rank=8)
        adapters = []
        for i in (1, 2):
            write_adapter(probe, Path(directory) / f"a{i}", seed=i)
            adapters.append(LoRARequest(f"a{i}", i, str(Path(directory) / f"a{i}")))
        release(probe)
        loras = [None] * len(PROMPTS) + [adapters[0]] * len(PROMPTS) + [adapters[1]] * len(PROMPTS)
        reference = run("cpu", loras)
        agreement = compare(reference, run(args.device, loras), args.tie_nats)
    base, adapted = reference[:len(PROMPTS)], reference[len(PROMPTS):]
    changed = sum(a.token_ids != b.token_ids for a, b in zip(base * 2, adapted, strict=True))
    ok = agreement.mismatch == 0 and agreement.max_logprob_diff <= args.logprob_tol and changed > 0
    figures = f"{agreement.describe()}; the adapters change {changed}/{len(adapted)} answers"
    print(f"[lora] {args.device} float32 vs cpu float32: {figures} -> {'PASS' if ok else 'FAIL'}")
    return ok, (f"LoRA on {args.device}: 2 adapters + base in one batch = cpu torch path", "PASS" if ok else "FAIL",
                figures)


def check_vision(args: argparse.Namespace) -> tuple[bool, tuple[str, str, str]]:
    """A tiny random SmolVLM and Gemma 3, float32, three images each in one batch: the device (its encoder, and
    Gemma 3's bidirectional image steps on the reference attention) gives the CPU's tokens and logprobs."""
    import numpy as np
    from PIL import Image

    try:  # the tiny models are built with transformers, a test dependency the GPU setup may not install
        from tests.engine.vision_models import save_gemma3_vision, save_smolvlm
    except ImportError as error:
        print(f"[vision] skipped: {error}")
        return True, (f"images on {args.device}", "SKIP", f"the tiny models need transformers: {error}")

    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (90, 120, 3), dtype=np.uint8))
              for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    ok, figures = True, []
    with tempfile.TemporaryDirectory(prefix="pagegate-gpu-vision-") as directory:
        for name, save, placeholder in (("SmolVLM", save_smolvlm, "<image>"),
                                        ("Gemma 3", save_gemma3_vision, "<start_of_image>")):
            folder = save(Path(directory) / name).path
            prompts = [{"prompt": f"Look: {placeholder} What is this?", "multi_modal_data": {"image": image}}
                       for image in images]
            outputs = {}
            for on in ("cpu", args.device):
                llm = LLM(str(folder), device=on, dtype="float32", num_kv_blocks=256, kv_cache_dtype="float32")
                outputs[on] = [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]
                release(llm)
            agreement = compare(outputs["cpu"], outputs[args.device], args.tie_nats)
            ok &= agreement.mismatch == 0 and agreement.max_logprob_diff <= args.logprob_tol
            figures.append(f"{name}: {agreement.describe()}")
    print(f"[vision] {args.device} float32 vs cpu float32: {'; '.join(figures)} -> {'PASS' if ok else 'FAIL'}")
    return ok, (f"images on {args.device}: SmolVLM and Gemma 3 = cpu", "PASS" if ok else "FAIL", "; ".join(figures))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="device under test (cpu: a dry run against itself)")
    p.add_argument("--smollm2", type=Path, default=SMOLLM2, help="SmolLM2 GGUF; skipped when the file is missing")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per agreement prompt")
    p.add_argument("--tie-nats", type=float, default=0.01, help="top-two gap below which a divergence is a tie")
    p.add_argument("--logprob-tol", type=float, default=0.01, help="float32 logprobs must agree this closely")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--single-tokens", type=int, default=256, help="output tokens of the one-stream run")
    p.add_argument("--batch", type=int, default=64, help="requests at once in the batched run")
    p.add_argument("--batch-tokens", type=int, default=128, help="output tokens per request of the batched run")
    p.add_argument("--kv-blocks", type=int, default=4096, help="KV pages on the device")
    p.add_argument("--cpu-kv-blocks", type=int, default=1024, help="KV pages of the CPU reference")
    p.add_argument("--quick", action="store_true", help="small sizes (a dry run): 8 tokens, batch 8")
    p.add_argument("--rows", type=Path, default=None, help="append markdown table rows to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.max_tokens, args.prompt_len, args.single_tokens, args.batch, args.batch_tokens = 8, 32, 16, 8, 8
        args.kv_blocks = min(args.kv_blocks, 1024)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_engine_check: torch sees no CUDA device here (try --device cpu for a dry run)")
        return 2
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {where}, torch {torch.__version__}, attention backend {resolve_backend(device)}")
    models: list[tuple[str, Path | None]] = [("default model", None)]
    if args.smollm2.is_file():
        models.append(("SmolLM2-135M Q4_1", args.smollm2))
    ok, rows = True, []
    for name, model in models:
        model_ok, model_rows = check_model(name, model, args)
        ok &= model_ok
        rows += model_rows
    tiers_ok, tiers_row = check_tiers(args.device)
    ok &= tiers_ok
    rows.append(tiers_row)
    lora_ok, lora_row = check_lora(args)
    ok &= lora_ok
    rows.append(lora_row)
    vision_ok, vision_row = check_vision(args)
    ok &= vision_ok
    rows.append(vision_row)
    if not args.smollm2.is_file():
        print(f"SmolLM2 skipped: {args.smollm2} is missing")
        rows.append(("engine SmolLM2-135M Q4_1", "SKIP", f"{args.smollm2} not present"))
    if args.rows:
        with args.rows.open("a") as out:
            out.writelines(f"| {check} | {result} | {figures} |\n" for check, result, figures in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
